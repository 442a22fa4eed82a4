//! Receivers' reading claims, `readers/<lease>-<n>` (the reader fence, docs/deployment.md):
//! each is JSON naming the step and the publishers (rank and incarnation) a receiver reads,
//! put under the receiver connection's own lease and deleted when the reads are over. A
//! receiver that dies stops renewing, and etcd deletes its claims when the TTL runs out, so a
//! publisher waiting on them is never stuck behind a dead reader for longer than that.
//!
//! One lease per connection serves all its claims: granted at the first claim, renewed every
//! third of the TTL by a task that ends with the connection; when etcd says it is gone (it
//! expired through an outage longer than the TTL) the next claim grants a new one. A claim lost
//! with its lease opens the fence early; the receiver's digest check still refuses any bytes a
//! publisher rewrote under it, so the cost is a failed refit, never wrong weights.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Client, GetOptions, PutOptions};
use serde::{Deserialize, Serialize};

use reshard_core::rendezvous::{clip_note, ReadClaim, Reading, MAX_CLAIM_RANKS};
use reshard_core::{Error, ErrorKind, OwnerId, Result};

use super::keys::{reader_key, readers_prefix};
use super::lease::lease_not_found;
use super::Etcd;

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

/// The lease this connection's claims live under.
#[derive(Default)]
pub(super) struct ReaderLease {
    /// The lease (0: none granted, or etcd said it is gone).
    lease: tokio::sync::Mutex<i64>,
    /// Numbers the claims under one lease.
    next: AtomicU64,
}

impl ReaderLease {
    /// The live lease, granted (and its keep-alive started) when there is none.
    async fn get(self: &Arc<Self>, etcd: &Etcd) -> Result<i64> {
        let mut lease = self.lease.lock().await;
        if *lease == 0 {
            let ttl = etcd.options.lease_ttl.as_secs().max(1) as i64;
            let r = etcd
                .client
                .clone()
                .lease_grant(ttl, None)
                .await
                .map_err(|e| etcd.err("grant a reader's lease at", e))?;
            *lease = r.id();
            tokio::spawn(keep_alive(
                Arc::downgrade(self),
                etcd.client.clone(),
                r.id(),
                etcd.options.lease_ttl,
            ));
        }
        Ok(*lease)
    }

    /// Forgets `lease` (etcd says it is gone): the next claim grants another.
    async fn forget(&self, lease: i64) {
        let mut held = self.lease.lock().await;
        if *held == lease {
            *held = 0;
        }
    }
}

/// Renews `lease` every third of `ttl` while the connection lives; a broken stream is opened
/// again (etcd unreachable: the lease may outlive the outage); ends when etcd says the lease is
/// gone (the next claim grants a new one) or the connection is dropped (the lease then expires
/// within its TTL; claims are released before that on every path but a crash).
async fn keep_alive(owner: Weak<ReaderLease>, mut client: Client, lease: i64, ttl: Duration) {
    let period = (ttl / 3).max(Duration::from_millis(100));
    loop {
        if owner.strong_count() == 0 {
            // The connection is gone: renewing stops and the lease expires with any claim
            // still under it, as a dead reader's would.
            return;
        }
        let gone = match tokio::time::timeout(period, client.lease_keep_alive(lease)).await {
            Ok(Ok((mut keeper, mut stream))) => loop {
                tokio::time::sleep(period).await;
                if owner.strong_count() == 0 || keeper.keep_alive().await.is_err() {
                    break false;
                }
                match tokio::time::timeout(period, stream.message()).await {
                    Ok(Ok(Some(r))) if r.ttl() > 0 => {}
                    Ok(Ok(Some(_))) => break true,
                    _ => break false,
                }
            },
            Ok(Err(e)) => e.to_string().contains("lease not found"),
            Err(_) => false,
        };
        if gone {
            if let Some(owner) = owner.upgrade() {
                owner.forget(lease).await;
            }
            return;
        }
        tokio::time::sleep(period / 2).await;
    }
}

/// A receiver's hold on one etcd reading claim.
struct Claimed {
    client: Client,
    key: Option<String>,
    endpoint: String,
}

#[async_trait]
impl Reading for Claimed {
    async fn release(mut self: Box<Self>) -> Result<()> {
        let key = self.key.take().expect("a claim is released once");
        self.client.delete(key, None).await.map_err(|e| {
            Error::new(
                ErrorKind::Transport,
                format!(
                    "could not remove a reading claim from etcd at {} (it expires with the \
                     reader's lease): {e}",
                    self.endpoint
                ),
            )
        })?;
        Ok(())
    }
}

impl Drop for Claimed {
    fn drop(&mut self) {
        // Not released (the refit was cancelled): remove it in the background where a runtime
        // runs; otherwise it expires with the lease.
        if let (Some(key), Ok(rt)) = (self.key.take(), tokio::runtime::Handle::try_current()) {
            let mut client = self.client.clone();
            rt.spawn(async move {
                let _ = client.delete(key, None).await;
            });
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
        // A lease etcd let expire (an outage) is replaced once.
        for _ in 0..2 {
            let lease = self.readers.get(self).await?;
            let n = self.readers.next.fetch_add(1, Ordering::Relaxed);
            let key = reader_key(&claim.model, lease, n);
            let put = self
                .client
                .clone()
                .put(
                    key.clone(),
                    value.clone(),
                    Some(PutOptions::new().with_lease(lease)),
                )
                .await;
            match put.map_err(|e| self.err("put a reading claim to", e)) {
                Ok(_) => {
                    return Ok(Box::new(Claimed {
                        client: self.client.clone(),
                        key: Some(key),
                        endpoint: self.endpoint.clone(),
                    }))
                }
                Err(e) if lease_not_found(&e) => self.readers.forget(lease).await,
                Err(e) => return Err(e),
            }
        }
        Err(Error::new(
            ErrorKind::Transport,
            format!(
                "etcd at {} dropped the reader's lease twice in a row",
                self.endpoint
            ),
        ))
    }

    /// See [`reshard_core::rendezvous::Rendezvous::readers`].
    pub(super) async fn list_claims(&self, model: &str) -> Result<(Vec<ReadClaim>, u64)> {
        let r = self
            .client
            .clone()
            .get(readers_prefix(model), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.err("list reading claims at", e))?;
        let revision = r.header().map_or(0, |h| h.revision()) as u64;
        let mut claims = Vec::with_capacity(r.kvs().len());
        for kv in r.kvs() {
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
