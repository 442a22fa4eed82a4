//! Blobs (transport metadata, model config, shard tables) as chunks of at most [`CHUNK_BYTES`],
//! written under one prefix and read back at one revision, checked against their size and hash
//! (the [`BlobRef`] a member record carries, checked and assembled in `record`).

use bytes::Bytes;
use etcd_client::{GetOptions, PutOptions};
use futures::{StreamExt, TryStreamExt};

use reshard_core::{Error, ErrorKind, OwnerId, Result};

use super::record::{BlobRef, CHUNK_BYTES, MAX_BLOB_BYTES};
use super::{Etcd, FETCH_CONCURRENCY};

impl Etcd {
    /// Writes `bytes` as chunks under `prefix`, attached to `lease`.
    pub(super) async fn put_blob(
        &self,
        prefix: String,
        bytes: &Bytes,
        lease: i64,
    ) -> Result<BlobRef> {
        // Receivers refuse a record declaring more (docs/bad-input.md): fail here, where the
        // publisher can say which blob is too large.
        if bytes.len() as u64 > MAX_BLOB_BYTES {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "blob {prefix} is {} bytes, above the limit of {MAX_BLOB_BYTES} one etcd blob \
                     may hold",
                    bytes.len()
                ),
            ));
        }
        let chunks: Vec<(usize, Bytes)> = bytes
            .chunks(CHUNK_BYTES)
            .enumerate()
            .map(|(i, c)| (i, bytes.slice_ref(c)))
            .collect();
        let count = chunks.len() as u32;
        futures::stream::iter(chunks)
            .map(|(i, chunk)| {
                let mut client = self.client.clone();
                let key = format!("{prefix}{i:06}");
                async move {
                    client
                        .put(
                            key,
                            chunk.to_vec(),
                            Some(PutOptions::new().with_lease(lease)),
                        )
                        .await
                        .map_err(|e| self.err("write a blob chunk to", e))
                }
            })
            .buffer_unordered(FETCH_CONCURRENCY)
            .try_collect::<Vec<_>>()
            .await?;
        Ok(BlobRef {
            prefix,
            chunks: count,
            bytes: bytes.len() as u64,
            xxh3: twox_hash::XxHash3_64::oneshot(bytes),
        })
    }

    /// Reads a blob's chunks at `revision` and checks their size and hash. `blob` comes from a
    /// record `parse_record` checked, so its chunk count is bounded by its size and the limit.
    pub(super) async fn get_blob(
        &self,
        blob: &BlobRef,
        revision: i64,
        rank: OwnerId,
    ) -> Result<Bytes> {
        let parts: Vec<(u32, Vec<u8>)> = futures::stream::iter(0..blob.chunks)
            .map(|i| {
                let mut client = self.client.clone();
                let key = format!("{}{i:06}", blob.prefix);
                async move {
                    let r = client
                        .get(key.clone(), Some(GetOptions::new().with_revision(revision)))
                        .await
                        .map_err(|e| self.err("read a blob chunk from", e))?;
                    let value = r
                        .kvs()
                        .first()
                        .map(|kv| kv.value().to_vec())
                        .ok_or_else(|| {
                            Error::new(
                                ErrorKind::PeerUnknown,
                                format!(
                                "publisher rank {rank}'s key {key} is gone at revision {revision} \
                                 of {} (its lease expired or the history was compacted)",
                                self.endpoint
                            ),
                            )
                            .with_owner(rank)
                        })?;
                    Ok::<_, Error>((i, value))
                }
            })
            .buffer_unordered(FETCH_CONCURRENCY)
            .try_collect()
            .await?;
        blob.assemble(parts, rank)
    }
}
