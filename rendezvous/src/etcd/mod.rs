//! The etcd rendezvous: publishers and receivers on different hosts meet through an etcd
//! cluster (docs/deployment.md has the keys, the protocol and the traffic at scale).
//!
//! Keys, under `/reshard/v1/<model>/` (the model name escaped so it is one key segment):
//! - `members/<rank:08>`: the member record (the rank in eight digits, the one spelling that
//!   counts: another is skipped, so no rank has two records; JSON: step, readiness, world, transport,
//!   incarnation, the holder's host and pid, and the size and XXH3-64 of its table and
//!   metadata), written last, so a record that says ready implies its blobs are there. It is
//!   created by a claim transaction (only if absent, attached to the lease) and rewritten only
//!   while it is still attached to the writer's lease: one holder per rank;
//! - `blobs/<rank>/<lease>/metadata/<chunk>`, `blobs/<rank>/<lease>/config/<chunk>` and
//!   `blobs/<rank>/<lease>/table-<step>/<chunk>`: the transport metadata, the model's
//!   architecture and the encoded shard table in chunks of [`CHUNK_BYTES`], under etcd's
//!   request limit (1.5 MiB by default), since tables of large models are megabytes;
//! - `probes/<rank>`: a claimant's probe of the rank's holder and the holder's answer, which
//!   is how a claimant tells a live holder from a dead one (`lease`);
//! - `readers/<lease>-<n>`: a receiver's reading claim (the reader fence: the step and the
//!   publishers it reads), under a lease of its own that lives as long as the refit holding it
//!   (`readers`).
//!
//! Every key of a publisher is attached to its lease: a publisher that dies stops the keep-alive
//! and etcd deletes all of them when the lease's TTL runs out; a clean exit revokes the lease at
//! once. A live publisher's keep-alive outlasts etcd outages (it reconnects, and announces the
//! same incarnation again under a new lease if the old one expired meanwhile). A receiver reads a member's blobs at the revision it read the record at, so it never
//! pairs one step's record with another step's table, even while the publisher advances.
//!
//! One concern per file: `keys` (the key layout and model-name escaping), `blobs` (writing and
//! reading chunked blobs), `readers` (receivers' reading claims), `record` (the member record and its blob references, decoded and
//! bounded: no etcd client, so the fuzz target compiles it), `lease` (a publisher's lease, its
//! keep-alive, the claim of its rank and the [`Announced`] handle), `rendezvous` (the
//! [`Rendezvous`] impl) and `endpoints` (failover between the members of a cluster); this file
//! has the connection itself.
//!
//! [`Announced`]: reshard_core::rendezvous::Announced
//! [`Rendezvous`]: reshard_core::rendezvous::Rendezvous

mod blobs;
mod endpoints;
mod keys;
mod lease;
mod readers;
mod record;
mod rendezvous;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use etcd_client::{Client, ConnectOptions, GetOptions, KeyValue};
use reshard_core::{Error, ErrorKind, Result};

use keys::ROOT;
pub use record::{CHUNK_BYTES, MAX_BLOB_BYTES, MAX_HOST_LEN, MAX_TRANSPORT_LEN};

/// Requests in flight at once when a publisher writes a blob's chunks, or a receiver reads
/// chunks one by one (`blobs`: a transaction refused as too large).
const FETCH_CONCURRENCY: usize = 32;

/// Keys a listing's first page asks for when its values are small (member records of about
/// 0.7 KB, or keys alone); see [`Etcd::list`].
const FIRST_PAGE_KEYS: i64 = 1024;

/// Keys the first page of reading claims asks for: a claim names every rank its receiver reads,
/// 27 KB for 1,024 ranks.
const FIRST_PAGE_CLAIMS: i64 = 32;

/// Bytes a page after the first aims at (its key count from the first pages' bytes per key),
/// well under the client's 4 MiB limit on a decoded message.
const PAGE_BYTES: usize = 2 * 1024 * 1024;

/// Most keys one page asks for.
const MAX_PAGE_KEYS: i64 = 4096;

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
    /// Takes a member that stops answering out of `client`'s endpoints while it is down.
    failover: Option<Arc<endpoints::Failover>>,
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
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
        let failover = endpoints::start(client.clone(), endpoints, endpoint.clone()).map(Arc::new);
        let mut me = Self {
            client,
            endpoint,
            options,
            failover,
        };
        // Connecting is lazy: one request proves the cluster answers.
        me.client
            .get(ROOT, Some(GetOptions::new().with_count_only()))
            .await
            .map_err(|e| service_error(&me.endpoint, "reach", e))?;
        Ok(me)
    }

    /// The error of a failed request: `what` it could not do, at this cluster. A failed
    /// request is also why failover looks at the members again (`endpoints`).
    pub(super) fn err(&self, what: &str, e: etcd_client::Error) -> Error {
        if let Some(f) = &self.failover {
            f.suspect();
        }
        service_error(&self.endpoint, what, e)
    }
}

impl Etcd {
    /// `request` (which does `what`, as in [`Etcd::err`]), abandoned once `bound` passes without
    /// an answer: a `Timeout` error, and the failover looks at the members again as after any
    /// failed request. Only for requests whose retry is harmless if etcd still applies the
    /// abandoned one.
    pub(super) async fn bounded<T>(
        &self,
        what: &str,
        bound: Duration,
        request: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        match tokio::time::timeout(bound, request).await {
            Ok(r) => r,
            Err(_) => {
                if let Some(f) = &self.failover {
                    f.suspect();
                }
                Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "could not {what} etcd at {}: no answer within {} ms",
                        self.endpoint,
                        bound.as_millis()
                    ),
                ))
            }
        }
    }
}

impl Etcd {
    /// Every key below `prefix` (with values unless `keys_only`) and the revision they were
    /// read at, in pages: the first of `first_page` keys at the current revision, the rest at
    /// that one, so the listing is one snapshot, each sized to about [`PAGE_BYTES`] from the
    /// bytes per key seen so far. One answer of a listing of thousands of records or claims
    /// would pass the client's 4 MiB limit on a decoded message (issue 42 item 7: a publisher's
    /// fence could not list the claims of 128 receivers of 2,048 ranks, 7 MB); a page refused
    /// as too large is asked again at half the keys (etcd sent it whole first: the first page
    /// is kept small where values can be large). `what` names the listing in errors, as in
    /// [`Etcd::err`].
    pub(super) async fn list(
        &self,
        prefix: &str,
        keys_only: bool,
        first_page: i64,
        what: &str,
    ) -> Result<(Vec<KeyValue>, i64)> {
        let end = prefix_end(prefix.as_bytes());
        let mut from = prefix.as_bytes().to_vec();
        let mut kvs = Vec::new();
        let mut revision = 0;
        let mut limit = first_page.clamp(1, MAX_PAGE_KEYS);
        let mut bytes = 0usize;
        loop {
            let mut options = GetOptions::new()
                .with_range(end.clone())
                .with_limit(limit)
                .with_revision(revision);
            if keys_only {
                options = options.with_keys_only();
            }
            let mut r = match self.client.clone().get(from.clone(), Some(options)).await {
                Ok(r) => r,
                Err(e) if too_big(&e) && limit > 1 => {
                    limit /= 2;
                    continue;
                }
                Err(e) => return Err(self.err(what, e)),
            };
            if revision == 0 {
                revision = r.header().map_or(0, |h| h.revision());
            }
            let more = r.more();
            let page = r.take_kvs();
            let last = page.last().map(|kv| kv.key().to_vec());
            bytes += page
                .iter()
                .map(|kv| kv.key().len() + kv.value().len())
                .sum::<usize>();
            kvs.extend(page);
            if let Some(per_key) = bytes.checked_div(kvs.len()) {
                limit = (PAGE_BYTES / per_key.max(1)).clamp(1, MAX_PAGE_KEYS as usize) as i64;
            }
            match last {
                // The next page starts right after the last key of this one.
                Some(mut key) if more => {
                    key.push(0);
                    from = key;
                }
                _ => return Ok((kvs, revision)),
            }
        }
    }
}

/// The first key after every key that starts with `prefix` (etcd's range end of a prefix).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Only 0xff bytes: to the end of the keyspace.
    vec![0]
}

/// Whether a failed request was refused for its size: an answer above the client's limit on a
/// decoded message, too many operations for the cluster's `--max-txn-ops`, or an answer above
/// the server's limit on a message it sends (tonic and etcd say so only in the text).
pub(super) fn too_big(e: &etcd_client::Error) -> bool {
    let text = e.to_string();
    ["too large", "too many operations", "larger than max"]
        .iter()
        .any(|t| text.contains(t))
}

/// A request's failure as an error: `Timeout` when etcd or the client says it timed out,
/// else `Transport`.
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

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn a_prefix_ends_at_its_last_byte_plus_one_past_trailing_0xff() {
        assert_eq!(
            prefix_end(b"/reshard/v1/m/readers/"),
            b"/reshard/v1/m/readers0"
        );
        assert_eq!(prefix_end(b"a\xff\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), b"\0");
    }
}
