//! The etcd rendezvous: publishers and receivers on different hosts meet through an etcd
//! cluster (docs/deployment.md has the keys, the protocol and the traffic at scale).
//!
//! Keys, under `/reshard/v1/<model>/` (the model name escaped so it is one key segment):
//! - `members/<rank>`: the member record (JSON: step, readiness, world, transport,
//!   incarnation, and the size and XXH3-64 of its table and metadata), written last, so a
//!   record that says ready implies its blobs are there;
//! - `blobs/<rank>/<lease>/metadata/<chunk>`, `blobs/<rank>/<lease>/config/<chunk>` and
//!   `blobs/<rank>/<lease>/table-<step>/<chunk>`: the transport metadata, the model's
//!   architecture and the encoded shard table in chunks of [`CHUNK_BYTES`], under etcd's request limit (1.5 MiB by default),
//!   since tables of large models are megabytes.
//!
//! Every key of a publisher is attached to its lease: a publisher that dies stops the keep-alive
//! and etcd deletes all of them when the lease's TTL runs out; a clean exit revokes the lease at
//! once. A receiver reads a member's blobs at the revision it read the record at, so it never
//! pairs one step's record with another step's table, even while the publisher advances.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use etcd_client::{Client, ConnectOptions, DeleteOptions, GetOptions, PutOptions, WatchOptions};
use futures::{StreamExt, TryStreamExt};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use reshard_core::rendezvous::{Announced, Announcement, Member, Rendezvous};
use reshard_core::{Error, ErrorKind, OwnerId, Result};

/// Largest value one blob chunk holds: well under etcd's default 1.5 MiB request limit, with
/// room for the key and the gRPC framing.
pub const CHUNK_BYTES: usize = 512 * 1024;

/// Requests in flight at once when a receiver fetches many publishers' blobs.
const FETCH_CONCURRENCY: usize = 32;

/// Settings of the etcd rendezvous.
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    /// Lease TTL: how long after a publisher's death its announcement disappears.
    pub lease_ttl: Duration,
    /// Time allowed to connect to the cluster.
    pub connect_timeout: Duration,
    /// Time allowed for one request.
    pub request_timeout: Duration,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        Self {
            lease_ttl: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// A connection to an etcd cluster, used as a rendezvous.
#[derive(Clone)]
pub struct Etcd {
    client: Client,
    endpoint: String,
    options: EtcdOptions,
}

/// A member record: what `members/<rank>` holds.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Record {
    rank: OwnerId,
    world: u32,
    step: u64,
    ready: bool,
    transport: String,
    incarnation: u64,
    granted_unix_ms: u64,
    table: BlobRef,
    metadata: BlobRef,
    config: BlobRef,
}

/// Where a blob's chunks are and what they must add up to.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct BlobRef {
    prefix: String,
    chunks: u32,
    bytes: u64,
    xxh3: u64,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A model name as one key segment: `/` and `%` are percent-escaped (HF names have slashes).
fn escape(model: &str) -> String {
    model.replace('%', "%25").replace('/', "%2F")
}

fn unescape(segment: &str) -> String {
    segment.replace("%2F", "/").replace("%25", "%")
}

const ROOT: &str = "/reshard/v1/";

fn model_prefix(model: &str) -> String {
    format!("{ROOT}{}/", escape(model))
}

fn members_prefix(model: &str) -> String {
    format!("{}members/", model_prefix(model))
}

fn member_key(model: &str, rank: OwnerId) -> String {
    format!("{}{rank:08}", members_prefix(model))
}

/// Blobs are keyed by lease, not incarnation: when an old lease of a restarted rank expires, it
/// deletes only its own keys.
fn blob_prefix(model: &str, rank: OwnerId, lease: i64, name: &str) -> String {
    format!("{}blobs/{rank:08}/{lease:x}/{name}/", model_prefix(model))
}

impl Etcd {
    /// Connects to `etcd://HOST:PORT[,HOST:PORT...]`.
    pub async fn connect(url: &str, options: EtcdOptions) -> Result<Self> {
        let Some(hosts) = url.strip_prefix("etcd://") else {
            return Err(Error::new(
                ErrorKind::Config,
                format!("rendezvous {url:?} is not an etcd address: expected etcd://HOST:PORT"),
            ));
        };
        let endpoints: Vec<String> = hosts
            .trim_end_matches('/')
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| format!("http://{h}"))
            .collect();
        if endpoints.is_empty() {
            return Err(Error::new(
                ErrorKind::Config,
                format!("rendezvous {url:?} names no etcd host"),
            ));
        }
        if options.lease_ttl < Duration::from_secs(1) {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "etcd lease TTL {:?} is below etcd's granularity of one second",
                    options.lease_ttl
                ),
            ));
        }
        let connect = ConnectOptions::new()
            .with_connect_timeout(options.connect_timeout)
            .with_timeout(options.request_timeout);
        let endpoint = url.to_string();
        let client = Client::connect(&endpoints, Some(connect))
            .await
            .map_err(|e| service_error(&endpoint, "connect", e))?;
        let mut me = Self {
            client,
            endpoint,
            options,
        };
        // Connecting is lazy: one request proves the cluster answers.
        me.client
            .get(ROOT, Some(GetOptions::new().with_count_only()))
            .await
            .map_err(|e| service_error(&me.endpoint, "reach", e))?;
        Ok(me)
    }

    fn err(&self, what: &str, e: etcd_client::Error) -> Error {
        service_error(&self.endpoint, what, e)
    }

    /// Writes `bytes` as chunks under `prefix`, attached to `lease`.
    async fn put_blob(&self, prefix: String, bytes: &Bytes, lease: i64) -> Result<BlobRef> {
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
    async fn get_blob(&self, blob: &BlobRef, revision: i64, rank: OwnerId) -> Result<Bytes> {
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

    async fn put_record(&self, model: &str, record: &Record, lease: i64) -> Result<()> {
        let value = serde_json::to_vec(record)
            .map_err(|e| Error::new(ErrorKind::Internal, format!("member record to JSON: {e}")))?;
        self.client
            .clone()
            .put(
                member_key(model, record.rank),
                value,
                Some(PutOptions::new().with_lease(lease)),
            )
            .await
            .map_err(|e| self.err("write a member record to", e))?;
        Ok(())
    }
}

fn service_error(endpoint: &str, what: &str, e: etcd_client::Error) -> Error {
    let text = e.to_string();
    let kind =
        if text.contains("deadline") || text.contains("timed out") || text.contains("Timeout") {
            ErrorKind::Timeout
        } else {
            ErrorKind::Transport
        };
    Error::new(kind, format!("could not {what} etcd at {endpoint}: {text}"))
}

fn parse_record(model: &str, key: &[u8], value: &[u8]) -> Result<Record> {
    serde_json::from_slice(value).map_err(|e| {
        Error::new(
            ErrorKind::Decode,
            format!(
                "member record {} of model {model:?} is not a reshard record: {e}",
                String::from_utf8_lossy(key)
            ),
        )
    })
}

/// A publisher's lease and the keep-alive task that holds it.
struct Held {
    etcd: Etcd,
    model: String,
    lease: i64,
    record: Mutex<Record>,
    /// Why the lease was lost, once it was.
    lost: Arc<Mutex<Option<String>>>,
    keeper: tokio::task::JoinHandle<()>,
}

impl Drop for Held {
    fn drop(&mut self) {
        // Without a keep-alive the lease runs out and etcd removes every key of this publisher,
        // as for a killed one; `withdraw` revokes it at once instead.
        self.keeper.abort();
    }
}

impl Held {
    fn current(&self) -> Record {
        self.record.lock().clone()
    }
}

#[async_trait]
impl Announced for Held {
    async fn unready(&self) -> Result<()> {
        self.check_alive()?;
        let mut record = self.current();
        record.ready = false;
        self.etcd
            .put_record(&self.model, &record, self.lease)
            .await?;
        *self.record.lock() = record;
        Ok(())
    }

    async fn advance(&self, step: u64, table: Bytes) -> Result<()> {
        self.check_alive()?;
        let mut record = self.current();
        let old = record.table.prefix.clone();
        let name = format!("table-{step:020}");
        let prefix = blob_prefix(&self.model, record.rank, self.lease, &name);
        record.table = self
            .etcd
            .put_blob(prefix.clone(), &table, self.lease)
            .await?;
        record.step = step;
        record.ready = true;
        self.etcd
            .put_record(&self.model, &record, self.lease)
            .await?;
        *self.record.lock() = record;
        // An empty prefix is the first table's absent predecessor (and would delete every key).
        if !old.is_empty() && old != prefix {
            // Readers of the previous record read at its revision, where these keys still are.
            self.etcd
                .client
                .clone()
                .delete(old, Some(DeleteOptions::new().with_prefix()))
                .await
                .map_err(|e| self.etcd.err("delete an old table from", e))?;
        }
        Ok(())
    }

    fn check_alive(&self) -> Result<()> {
        match &*self.lost.lock() {
            None => Ok(()),
            Some(why) => {
                let rank = self.record.lock().rank;
                Err(Error::new(
                    ErrorKind::Transport,
                    format!(
                        "publisher rank {rank} of model {:?} lost its lease at {}: {why}",
                        self.model, self.etcd.endpoint
                    ),
                )
                .with_owner(rank))
            }
        }
    }

    async fn withdraw(self: Box<Self>) -> Result<()> {
        self.keeper.abort();
        self.etcd
            .client
            .clone()
            .lease_revoke(self.lease)
            .await
            .map_err(|e| self.etcd.err("revoke a lease at", e))?;
        Ok(())
    }
}

/// Keeps `lease` alive every third of its TTL; records why in `lost` when it cannot.
async fn keep_alive(
    mut client: Client,
    lease: i64,
    ttl: Duration,
    lost: Arc<Mutex<Option<String>>>,
) {
    let why = match client.lease_keep_alive(lease).await {
        Err(e) => format!("keep-alive could not start: {e}"),
        Ok((mut keeper, mut stream)) => {
            let mut tick = tokio::time::interval(ttl / 3);
            loop {
                tick.tick().await;
                if let Err(e) = keeper.keep_alive().await {
                    break format!("keep-alive failed: {e}");
                }
                match stream.message().await {
                    Ok(Some(r)) if r.ttl() > 0 => {}
                    Ok(Some(_)) => break "etcd says the lease expired".to_string(),
                    Ok(None) => break "the keep-alive stream ended".to_string(),
                    Err(e) => break format!("keep-alive failed: {e}"),
                }
            }
        }
    };
    *lost.lock() = Some(why);
}

#[async_trait]
impl Rendezvous for Etcd {
    fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    async fn announce(&self, a: Announcement) -> Result<Box<dyn Announced>> {
        a.check()?;
        let ttl = self.options.lease_ttl;
        let lease = self
            .client
            .clone()
            .lease_grant(ttl.as_secs().max(1) as i64, None)
            .await
            .map_err(|e| self.err("grant a lease at", e))?
            .id();
        let lost = Arc::new(Mutex::new(None));
        let keeper = tokio::spawn(keep_alive(self.client.clone(), lease, ttl, lost.clone()));
        let held = Held {
            etcd: self.clone(),
            model: a.model.clone(),
            lease,
            record: Mutex::new(Record {
                rank: a.rank,
                world: a.world,
                step: a.step,
                ready: true,
                transport: a.transport.clone(),
                incarnation: a.incarnation,
                granted_unix_ms: unix_ms(),
                table: BlobRef::default(),
                metadata: BlobRef::default(),
                config: BlobRef::default(),
            }),
            lost,
            keeper,
        };
        let meta = blob_prefix(&a.model, a.rank, lease, "metadata");
        let metadata = self.put_blob(meta, &a.metadata, lease).await?;
        let config = blob_prefix(&a.model, a.rank, lease, "config");
        let config = self.put_blob(config, &a.config, lease).await?;
        {
            let mut record = held.record.lock();
            record.metadata = metadata;
            record.config = config;
        }
        // `advance` writes the table, then the record that makes it visible.
        held.advance(a.step, a.table).await?;
        Ok(Box::new(held))
    }

    async fn members(&self, model: &str) -> Result<(Vec<Member>, u64)> {
        let r = self
            .client
            .clone()
            .get(members_prefix(model), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.err("list members at", e))?;
        let revision = r.header().map_or(0, |h| h.revision()) as u64;
        let now = unix_ms();
        let mut members = Vec::with_capacity(r.kvs().len());
        for kv in r.kvs() {
            let rec = parse_record(model, kv.key(), kv.value())?;
            members.push(Member {
                rank: rec.rank,
                world: rec.world,
                step: rec.step,
                ready: rec.ready,
                transport: rec.transport,
                incarnation: rec.incarnation,
                age: Duration::from_millis(now.saturating_sub(rec.granted_unix_ms)),
                table_bytes: rec.table.bytes,
            });
        }
        members.sort_by_key(|m| m.rank);
        Ok((members, revision))
    }

    async fn fetch(&self, model: &str, ranks: &[OwnerId]) -> Result<Vec<Announcement>> {
        let mut out: Vec<Announcement> = futures::stream::iter(ranks.iter().copied())
            .map(|rank| async move {
                let r = self
                    .client
                    .clone()
                    .get(member_key(model, rank), None)
                    .await
                    .map_err(|e| self.err("read a member record from", e))?;
                let revision = r.header().map_or(0, |h| h.revision());
                let kv = r.kvs().first().ok_or_else(|| {
                    Error::new(
                        ErrorKind::PeerUnknown,
                        format!(
                            "publisher rank {rank} of model {model:?} is not announced at {}",
                            self.endpoint
                        ),
                    )
                    .with_owner(rank)
                })?;
                let rec = parse_record(model, kv.key(), kv.value())?;
                let (table, metadata, config) = futures::try_join!(
                    self.get_blob(&rec.table, revision, rank),
                    self.get_blob(&rec.metadata, revision, rank),
                    self.get_blob(&rec.config, revision, rank)
                )?;
                Ok::<_, Error>(Announcement {
                    model: model.to_string(),
                    rank,
                    world: rec.world,
                    step: rec.step,
                    transport: rec.transport,
                    incarnation: rec.incarnation,
                    table,
                    metadata,
                    config,
                })
            })
            .buffer_unordered(FETCH_CONCURRENCY)
            .try_collect()
            .await?;
        out.sort_by_key(|a| a.rank);
        Ok(out)
    }

    async fn changed(&self, model: &str, revision: u64, timeout: Duration) -> Result<u64> {
        let watch = async {
            let mut stream = self
                .client
                .clone()
                .watch(
                    members_prefix(model),
                    Some(
                        WatchOptions::new()
                            .with_prefix()
                            .with_start_revision(revision as i64 + 1),
                    ),
                )
                .await
                .map_err(|e| self.err("watch", e))?;
            loop {
                match stream.message().await.map_err(|e| self.err("watch", e))? {
                    None => {
                        return Err(Error::new(
                            ErrorKind::Transport,
                            format!("the watch on {} ended", self.endpoint),
                        ))
                    }
                    // History compacted past `revision`: report a change so the caller
                    // re-reads the members.
                    Some(r) if r.compact_revision() > 0 => return Ok(r.compact_revision() as u64),
                    Some(r) if !r.events().is_empty() => {
                        return Ok(r.header().map_or(revision + 1, |h| h.revision() as u64))
                    }
                    Some(_) => {}
                }
            }
        };
        match tokio::time::timeout(timeout, watch).await {
            Ok(r) => r,
            Err(_) => Ok(revision),
        }
    }

    async fn models(&self) -> Result<Vec<String>> {
        let r = self
            .client
            .clone()
            .get(ROOT, Some(GetOptions::new().with_prefix().with_keys_only()))
            .await
            .map_err(|e| self.err("list models at", e))?;
        let mut models: Vec<String> = r
            .kvs()
            .iter()
            .filter_map(|kv| {
                let key = std::str::from_utf8(kv.key()).ok()?;
                let rest = key.strip_prefix(ROOT)?;
                let (model, tail) = rest.split_once('/')?;
                tail.starts_with("members/").then(|| unescape(model))
            })
            .collect();
        models.dedup();
        Ok(models)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_with_slashes_are_one_key_segment() {
        for name in ["Qwen/Qwen3-30B-A3B", "a%2Fb", "plain"] {
            let e = escape(name);
            assert!(!e.contains('/'), "{e}");
            assert_eq!(unescape(&e), name);
        }
        assert_eq!(
            member_key("Qwen/Q", 7),
            "/reshard/v1/Qwen%2FQ/members/00000007"
        );
    }
}
