//! Receivers' reading claims, `readers/<lease>-0` (the reader fence, docs/deployment.md): each
//! is JSON naming the step and the publishers (rank and incarnation) a receiver reads, put under
//! a lease of its own that lives exactly as long as the refit holding it.
//!
//! Why a lease per claim, not one per connection: a claim whose delete never runs (a refit
//! future dropped outside any runtime, as Python's cancel and Ctrl-C do; a delete that failed in
//! an etcd election) would otherwise live as long as the connection's lease, which a live
//! receiver renews for ever, and close its publishers' fence for good. Here the claim's lease is
//! renewed by a task that stops the moment the handle ([`Claimed`]) ends, however it ends:
//! released (its lease revoked, which deletes the claim), or dropped anywhere (the task revokes
//! it, retrying until etcd agrees or the lease has expired on its own). So a claim outlives its
//! refit by at most one TTL, and by one round trip in the common case. A receiver that dies stops
//! renewing too, and etcd deletes its claims when the TTL runs out. A claim lost with its lease
//! (an outage longer than the TTL) opens the fence early; the receiver's digest check still
//! refuses any bytes a publisher rewrote under it, so the cost is a failed refit, never wrong
//! weights.

use std::time::{Duration, Instant};

use async_trait::async_trait;
use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper, PutOptions};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use reshard_core::rendezvous::{clip_note, ReadClaim, Reading, MAX_CLAIM_RANKS};
use reshard_core::{Error, ErrorKind, OwnerId, Result};

use super::keys::{reader_key, readers_prefix};
use super::lease::lease_not_found;
use super::{Etcd, FIRST_PAGE_CLAIMS};

/// How long [`Reading::release`] waits for etcd to revoke a claim's lease before it hands the
/// revoke to the claim's keeper (an election can hold a request for etcd's whole request
/// timeout; the refit it ends must not wait that long).
const RELEASE_WAIT: Duration = Duration::from_secs(2);

/// The first pause between two tries of a background revoke; doubled up to
/// [`REVOKE_PAUSE_MAX`].
const REVOKE_PAUSE_FIRST: Duration = Duration::from_millis(50);

/// The longest pause between two tries of a background revoke.
const REVOKE_PAUSE_MAX: Duration = Duration::from_secs(1);

/// A reading claim as stored: what [`ReadClaim`] holds but the model, which is in the key.
#[derive(Serialize, Deserialize)]
struct Stored {
    step: u64,
    reader: String,
    ranks: Vec<(OwnerId, u64)>,
}

/// The claim stored under `key`, checked: at most [`MAX_CLAIM_RANKS`] ranks, a reader name
/// cut to a note's length.
pub(super) fn parse_claim(model: &str, key: &[u8], value: &[u8]) -> Result<ReadClaim> {
    let key = String::from_utf8_lossy(key);
    let stored: Stored = serde_json::from_slice(value).map_err(|e| {
        Error::new(
            ErrorKind::Decode,
            format!("reading claim {key}: not a claim ({e})"),
        )
    })?;
    if stored.ranks.len() > MAX_CLAIM_RANKS {
        return Err(Error::new(
            ErrorKind::Decode,
            format!(
                "reading claim {key}: field `ranks` names {} publishers, above the limit of {}",
                stored.ranks.len(),
                MAX_CLAIM_RANKS
            ),
        ));
    }
    Ok(ReadClaim {
        model: model.to_string(),
        step: stored.step,
        reader: clip_note(&stored.reader),
        ranks: stored.ranks,
    })
}

/// Whether an etcd client error says the lease is gone (expired or revoked).
fn gone(e: &etcd_client::Error) -> bool {
    e.to_string().contains("lease not found")
}

/// Keeps a claim's `lease` alive, renewing it every third of `ttl`, until `over` says the claim
/// ended: sent (the holder revoked the lease itself) ends the task at once; dropped (a failed
/// revoke, a cancelled refit, a handle dropped outside any runtime) makes it revoke the lease.
/// A renewal etcd answers "gone" for ends it too: the claim went with its lease.
async fn keep_claim(
    mut client: Client,
    lease: i64,
    ttl: Duration,
    mut over: oneshot::Receiver<()>,
    endpoint: String,
) {
    let period = (ttl / 3).max(Duration::from_millis(100));
    let mut renewed = Instant::now();
    let mut stream: Option<(LeaseKeeper, LeaseKeepAliveStream)> = None;
    loop {
        let renewal = async {
            tokio::time::sleep(period).await;
            renew(&mut client, &mut stream, lease, period).await
        };
        tokio::select! {
            ended = &mut over => {
                if ended.is_ok() {
                    return;
                }
                break;
            }
            renewal = renewal => match renewal {
                Renewal::Renewed => renewed = Instant::now(),
                Renewal::Gone => return,
                // etcd did not answer in time (an election, an outage): the next period tries
                // again on a new stream; the lease may outlive the outage.
                Renewal::Failed => stream = None,
            },
        }
    }
    // The claim ended without its lease revoked: revoke it, retrying while the lease may still
    // be alive (its TTL after the last renewal, plus a period for etcd's own lag).
    let until = renewed + ttl + period;
    let mut pause = REVOKE_PAUSE_FIRST;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            tracing::warn!(
                "could not revoke a reading claim's lease {lease:x} at {endpoint}; it has \
                 expired with its TTL instead"
            );
            return;
        }
        match tokio::time::timeout(left, client.lease_revoke(lease)).await {
            Ok(Ok(_)) => return,
            Ok(Err(e)) if gone(&e) => return,
            _ => {}
        }
        tokio::time::sleep(pause.min(until.saturating_duration_since(Instant::now()))).await;
        pause = (pause * 2).min(REVOKE_PAUSE_MAX);
    }
}

/// What one renewal of a claim's lease found.
enum Renewal {
    /// etcd renewed the lease.
    Renewed,
    /// etcd says the lease is gone.
    Gone,
    /// No answer within the period, or the stream broke.
    Failed,
}

/// Renews `lease` once over `stream` (opened first when there is none), waiting at most
/// `bound` for each step.
async fn renew(
    client: &mut Client,
    stream: &mut Option<(LeaseKeeper, LeaseKeepAliveStream)>,
    lease: i64,
    bound: Duration,
) -> Renewal {
    if stream.is_none() {
        match tokio::time::timeout(bound, client.lease_keep_alive(lease)).await {
            Ok(Ok(opened)) => *stream = Some(opened),
            Ok(Err(e)) if gone(&e) => return Renewal::Gone,
            _ => return Renewal::Failed,
        }
    }
    let Some((keeper, messages)) = stream.as_mut() else {
        return Renewal::Failed;
    };
    if keeper.keep_alive().await.is_err() {
        return Renewal::Failed;
    }
    match tokio::time::timeout(bound, messages.message()).await {
        Ok(Ok(Some(r))) if r.ttl() > 0 => Renewal::Renewed,
        Ok(Ok(Some(_))) => Renewal::Gone,
        _ => Renewal::Failed,
    }
}

/// A receiver's hold on one etcd reading claim, which lives under a lease of its own that a
/// task renews while this handle lives ([`keep_claim`]).
struct Claimed {
    client: Client,
    lease: i64,
    endpoint: String,
    /// Ends the renewals: sent once [`Reading::release`] revoked the lease, dropped (with the
    /// handle, or after a failed revoke) to have the keeper revoke it.
    over: Option<oneshot::Sender<()>>,
}

#[async_trait]
impl Reading for Claimed {
    async fn release(mut self: Box<Self>) -> Result<()> {
        let over = self.over.take();
        let revoked =
            tokio::time::timeout(RELEASE_WAIT, self.client.lease_revoke(self.lease)).await;
        let why = match revoked {
            Ok(Ok(_)) => None,
            Ok(Err(e)) if gone(&e) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some(format!("no answer within {} ms", RELEASE_WAIT.as_millis())),
        };
        match why {
            None => {
                if let Some(over) = over {
                    let _ = over.send(());
                }
                Ok(())
            }
            // `over` is dropped here: the keeper stops renewing and revokes in the background.
            Some(why) => Err(Error::new(
                ErrorKind::Transport,
                format!(
                    "could not remove a reading claim from etcd at {} ({why}); it is retried in \
                     the background, and the claim expires with its own lease at the latest",
                    self.endpoint
                ),
            )),
        }
    }
}

impl Etcd {
    /// See [`reshard_core::rendezvous::Rendezvous::claim_reading`].
    pub(super) async fn put_claim(&self, claim: ReadClaim) -> Result<Box<dyn Reading>> {
        if claim.ranks.len() > MAX_CLAIM_RANKS {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "a reading claim of model {:?} names {} publishers, above the limit of {}",
                    claim.model,
                    claim.ranks.len(),
                    MAX_CLAIM_RANKS
                ),
            ));
        }
        let value = serde_json::to_vec(&Stored {
            step: claim.step,
            reader: clip_note(&claim.reader),
            ranks: claim.ranks,
        })
        .map_err(|e| Error::new(ErrorKind::Internal, format!("reading claim to JSON: {e}")))?;
        let ttl = self.options.lease_ttl;
        // A lease etcd let expire before the put (a stall longer than the TTL) is replaced once.
        for _ in 0..2 {
            let granted = self
                .client
                .clone()
                .lease_grant(ttl.as_secs().max(1) as i64, None)
                .await
                .map_err(|e| self.err("grant a reading claim's lease at", e))?;
            let lease = granted.id();
            // The keeper runs from the grant on, so a put that fails or is cancelled still
            // has its lease revoked (dropping `over` tells it to).
            let (over, ended) = oneshot::channel();
            tokio::spawn(keep_claim(
                self.client.clone(),
                lease,
                ttl,
                ended,
                self.endpoint.clone(),
            ));
            let key = reader_key(&claim.model, lease, 0);
            let put = self
                .client
                .clone()
                .put(
                    key,
                    value.clone(),
                    Some(PutOptions::new().with_lease(lease)),
                )
                .await;
            match put.map_err(|e| self.err("put a reading claim to", e)) {
                Ok(_) => {
                    return Ok(Box::new(Claimed {
                        client: self.client.clone(),
                        lease,
                        endpoint: self.endpoint.clone(),
                        over: Some(over),
                    }))
                }
                Err(e) if lease_not_found(&e) => drop(over),
                Err(e) => return Err(e),
            }
        }
        Err(Error::new(
            ErrorKind::Transport,
            format!(
                "etcd at {} dropped a reading claim's lease twice in a row before the claim \
                 was written",
                self.endpoint
            ),
        ))
    }

    /// See [`reshard_core::rendezvous::Rendezvous::readers`].
    pub(super) async fn list_claims(&self, model: &str) -> Result<(Vec<ReadClaim>, u64)> {
        let (kvs, revision) = self
            .list(
                &readers_prefix(model),
                false,
                FIRST_PAGE_CLAIMS,
                "list reading claims at",
            )
            .await?;
        let revision = revision as u64;
        let mut claims = Vec::with_capacity(kvs.len());
        for kv in &kvs {
            match parse_claim(model, kv.key(), kv.value()) {
                Ok(c) => claims.push(c),
                // Garbage under readers/ must not stop a publisher: left out and logged.
                Err(e) => tracing::warn!(endpoint = %self.endpoint, "skipping a claim: {e}"),
            }
        }
        Ok((claims, revision))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_decodes_and_garbage_or_oversize_is_a_decode_error() {
        let good = br#"{"step":3,"reader":"receiver rank 0","ranks":[[0,7],[1,9]]}"#;
        let c = parse_claim("m", b"k", good).unwrap();
        assert_eq!((c.step, c.ranks.clone()), (3, vec![(0, 7), (1, 9)]));
        assert!(c.names(1, 9) && !c.names(1, 7));
        for bad in [&b"{"[..], br#"{"step":-1,"reader":"","ranks":[]}"#] {
            let e = parse_claim("m", b"k", bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Decode, "{e}");
        }
        let many: Vec<(u32, u64)> = (0..=MAX_CLAIM_RANKS as u32).map(|r| (r, 1)).collect();
        let big = serde_json::to_vec(&Stored {
            step: 1,
            reader: String::new(),
            ranks: many,
        })
        .unwrap();
        let e = parse_claim("m", b"k", &big).unwrap_err();
        assert!(e.to_string().contains("`ranks`"), "{e}");
    }
}
