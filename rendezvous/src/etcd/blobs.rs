//! Blobs (transport metadata, model config, shard tables) as chunks of at most [`CHUNK_BYTES`],
//! written under one prefix and read back at one revision, checked against their size and hash
//! (the [`BlobRef`] a member record carries, checked and assembled in `record`).

use bytes::Bytes;
use etcd_client::{GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse};
use futures::{StreamExt, TryStreamExt};

use reshard_core::{Error, ErrorKind, OwnerId, Result};

use super::record::{BlobRef, CHUNK_BYTES, MAX_BLOB_BYTES};
use super::{too_big, Etcd, FETCH_CONCURRENCY};

/// Most chunk reads one read-only transaction carries: etcd's default `--max-txn-ops`.
const READS_PER_TXN: usize = 128;

/// Most value bytes (as records declare them) one transaction asks for: its answer stays well
/// under the client's 4 MiB limit on a message it decodes.
const BYTES_PER_TXN: u64 = 2 * 1024 * 1024;

/// Transactions of one receiver in flight at once: each answer is up to [`BYTES_PER_TXN`].
const TXNS_IN_FLIGHT: usize = 8;

/// One chunk to read: which blob of the list, which chunk of it, and the bytes it should hold.
struct ChunkRead {
    blob: usize,
    chunk: u32,
    key: String,
    bytes: u64,
}

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

    /// Reads many blobs at `revision` (each `(rank, blob)` of a record `parse_record` checked)
    /// and checks each against its size and hash; the blobs in the order given. Their chunks
    /// are read many to a request: read-only transactions of exact-key gets, at most
    /// [`READS_PER_TXN`] and about [`BYTES_PER_TXN`] each, [`TXNS_IN_FLIGHT`] at once. A
    /// transaction etcd or the client refuses as too large (values larger than their records
    /// declared, a cluster allowing fewer operations per transaction) is read again a chunk per
    /// request, which says which key is wrong; any other failure is returned as it is.
    pub(super) async fn get_blobs(
        &self,
        blobs: &[(OwnerId, &BlobRef)],
        revision: i64,
    ) -> Result<Vec<Bytes>> {
        let mut reads = Vec::new();
        for (i, (_, blob)) in blobs.iter().enumerate() {
            for chunk in 0..blob.chunks {
                let before = u64::from(chunk) * CHUNK_BYTES as u64;
                reads.push(ChunkRead {
                    blob: i,
                    chunk,
                    key: format!("{}{chunk:06}", blob.prefix),
                    bytes: blob.bytes.saturating_sub(before).min(CHUNK_BYTES as u64),
                });
            }
        }
        let mut batches: Vec<Vec<ChunkRead>> = Vec::new();
        let mut bytes = 0u64;
        for read in reads {
            match batches.last_mut() {
                Some(b) if b.len() < READS_PER_TXN && bytes + read.bytes <= BYTES_PER_TXN => {
                    bytes += read.bytes;
                    b.push(read);
                }
                _ => {
                    bytes = read.bytes;
                    batches.push(vec![read]);
                }
            }
        }
        let read: Vec<Vec<(usize, u32, Vec<u8>)>> = futures::stream::iter(batches)
            .map(|batch| self.read_batch(batch, blobs, revision))
            .buffer_unordered(TXNS_IN_FLIGHT)
            .try_collect()
            .await?;
        let mut parts: Vec<Vec<(u32, Vec<u8>)>> = blobs.iter().map(|_| Vec::new()).collect();
        for (blob, chunk, value) in read.into_iter().flatten() {
            parts[blob].push((chunk, value));
        }
        parts
            .into_iter()
            .zip(blobs)
            .map(|(p, (rank, blob))| blob.assemble(p, *rank))
            .collect()
    }

    /// One transaction of [`Etcd::get_blobs`]: each read's value, or a chunk per request when
    /// the transaction is refused as too large.
    async fn read_batch(
        &self,
        batch: Vec<ChunkRead>,
        blobs: &[(OwnerId, &BlobRef)],
        revision: i64,
    ) -> Result<Vec<(usize, u32, Vec<u8>)>> {
        let at = || Some(GetOptions::new().with_revision(revision));
        let ops: Vec<TxnOp> = batch
            .iter()
            .map(|r| TxnOp::get(r.key.as_str(), at()))
            .collect();
        let answer = self.client.clone().txn(Txn::new().and_then(ops)).await;
        let answers = match answer {
            Ok(r) => r.op_responses(),
            Err(e) if !too_big(&e) => return Err(self.err("read blob chunks from", e)),
            Err(e) => {
                tracing::debug!(
                    endpoint = %self.endpoint,
                    "{} blob chunks are too many or too large for one transaction ({e}); reading \
                     them one by one",
                    batch.len()
                );
                return futures::stream::iter(batch)
                    .map(|r| async move {
                        let got = self
                            .client
                            .clone()
                            .get(r.key.as_str(), at())
                            .await
                            .map_err(|e| self.err("read a blob chunk from", e))?;
                        let value = got.kvs().first().map(|kv| kv.value().to_vec());
                        self.chunk_read(r, blobs, revision, value)
                    })
                    .buffer_unordered(FETCH_CONCURRENCY)
                    .try_collect()
                    .await;
            }
        };
        let mut answers = answers.into_iter();
        batch
            .into_iter()
            .map(|r| {
                let value = match answers.next() {
                    Some(TxnOpResponse::Get(g)) => g.kvs().first().map(|kv| kv.value().to_vec()),
                    _ => None,
                };
                self.chunk_read(r, blobs, revision, value)
            })
            .collect()
    }

    /// A chunk read's value, or the error of a key gone at `revision`.
    fn chunk_read(
        &self,
        r: ChunkRead,
        blobs: &[(OwnerId, &BlobRef)],
        revision: i64,
        value: Option<Vec<u8>>,
    ) -> Result<(usize, u32, Vec<u8>)> {
        let rank = blobs[r.blob].0;
        let value = value.ok_or_else(|| {
            Error::new(
                ErrorKind::PeerUnknown,
                format!(
                    "publisher rank {rank}'s key {} is gone at revision {revision} of {} (its \
                     lease expired or the history was compacted)",
                    r.key, self.endpoint
                ),
            )
            .with_owner(rank)
        })?;
        Ok((r.blob, r.chunk, value))
    }
}
