//! Blobs (transport metadata, model config, shard tables) as chunks of at most [`CHUNK_BYTES`],
//! written under one prefix and read back at one revision, checked against their size and hash.

use std::collections::BTreeMap;

use bytes::Bytes;
use etcd_client::{GetOptions, PutOptions};
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};

use reshard_core::{Error, ErrorKind, OwnerId, Result};

use super::{Etcd, FETCH_CONCURRENCY};

/// Largest value one blob chunk holds: well under etcd's default 1.5 MiB request limit, with
/// room for the key and the gRPC framing.
pub const CHUNK_BYTES: usize = 512 * 1024;

/// Where a blob's chunks are and what they must add up to.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(super) struct BlobRef {
    pub(super) prefix: String,
    pub(super) chunks: u32,
    pub(super) bytes: u64,
    pub(super) xxh3: u64,
}

impl Etcd {
    /// Writes `bytes` as chunks under `prefix`, attached to `lease`.
    pub(super) async fn put_blob(
        &self,
        prefix: String,
        bytes: &Bytes,
        lease: i64,
    ) -> Result<BlobRef> {
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
            xxh3: xxhash_rust::xxh3::xxh3_64(bytes),
        })
    }

    /// Reads a blob's chunks at `revision` and checks their size and hash.
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
        let mut ordered: BTreeMap<u32, Vec<u8>> = parts.into_iter().collect();
        let mut out = Vec::with_capacity(blob.bytes as usize);
        for i in 0..blob.chunks {
            out.extend_from_slice(&ordered.remove(&i).unwrap_or_default());
        }
        if out.len() as u64 != blob.bytes || xxhash_rust::xxh3::xxh3_64(&out) != blob.xxh3 {
            return Err(Error::new(
                ErrorKind::Decode,
                format!(
                    "publisher rank {rank}'s blob {} read back {} bytes that do not match its \
                     record ({} bytes, xxh3 {:016x})",
                    blob.prefix,
                    out.len(),
                    blob.bytes,
                    blob.xxh3
                ),
            )
            .with_owner(rank));
        }
        Ok(Bytes::from(out))
    }
}
