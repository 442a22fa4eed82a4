//! The reader fence (docs/deployment.md, "The reader fence"): a receiver says, through the
//! rendezvous, which publishers' memory it is reading while it reads it, under a lease of its
//! own, so a dead receiver's claim expires with it; a publisher that is about to rewrite its
//! memory marks its announcement not ready, then waits here until no claim names its memory.
//!
//! Why it is sound: the receiver puts its claim, then reads the members again and reads only
//! if every publisher is still ready at the step it found; the publisher marks itself not
//! ready, then lists the claims. On a linearizable store one of the two sees the other's write:
//! either the receiver sees "not ready" (it withdraws its claim and reads nothing) or the
//! publisher sees the claim (it waits for the release).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use super::{backoff, bounded, is_transient, Rendezvous, Waited, RETRY_FIRST};
use crate::{Error, ErrorKind, OwnerId, Result};

/// A receiver's claim that it is reading some publishers' memory now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadClaim {
    /// Model name (the rendezvous namespace).
    pub model: String,
    /// The step being read.
    pub step: u64,
    /// Who reads, for messages and `reshard status` (`receiver rank 1 on host h pid 42`).
    pub reader: String,
    /// Each publisher read, as `(rank, incarnation)`: the memory of that incarnation is under
    /// the reader's reads until the claim is released.
    pub ranks: Vec<(OwnerId, u64)>,
}

impl ReadClaim {
    /// Whether this claim covers the memory of publisher `rank` in `incarnation`.
    pub fn names(&self, rank: OwnerId, incarnation: u64) -> bool {
        self.ranks
            .iter()
            .any(|&(r, i)| r == rank && i == incarnation)
    }
}

/// Most publisher ranks one claim may name (the same bound as a model's world).
pub const MAX_CLAIM_RANKS: usize = super::MAX_WORLD as usize;

/// A receiver's hold on one [`ReadClaim`]. Dropping it without [`Reading::release`] removes
/// the claim in the background (best effort) or leaves it to expire with the reader's lease.
#[async_trait]
pub trait Reading: Send + Sync {
    /// Removes the claim now: the reads it covered are over (waited for or aborted).
    async fn release(self: Box<Self>) -> Result<()>;
}

/// What [`wait_released`] waited for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Time spent waiting.
    pub waited: Duration,
    /// The readers that held the memory when the wait began and were waited out, one line each
    /// (`receiver rank 0 on host h pid 4 reading step 7`); empty when none was reading.
    pub readers: Vec<String>,
    /// Rendezvous failures waited through, as in [`super::Discovered::waited_through`].
    pub waited_through: Vec<String>,
}

/// `claim` as one line for messages.
fn describe(claim: &ReadClaim) -> String {
    format!("{} reading step {}", claim.reader, claim.step)
}

/// Waits until no receiver claims to read the memory of publisher `rank` of `model` in
/// `incarnation` (call it after [`super::Announced::unready`]: a receiver that claims after
/// that sees the announcement not ready and reads nothing). `timeout` bounds the whole call;
/// rendezvous failures that time mends are waited through. On timeout the error is `Timeout`,
/// naming each reader still holding the memory.
pub async fn wait_released(
    rendezvous: &dyn Rendezvous,
    model: &str,
    rank: OwnerId,
    incarnation: u64,
    timeout: Duration,
) -> Result<Released> {
    let start = Instant::now();
    let deadline = start + timeout;
    let mut waited = Waited::default();
    let mut pause = RETRY_FIRST;
    let mut first: Option<BTreeSet<String>> = None;
    let mut holding: Vec<String> = Vec::new();
    loop {
        match bounded(deadline, rendezvous.readers(model)).await {
            Some(Ok((claims, revision))) => {
                pause = RETRY_FIRST;
                holding = claims
                    .iter()
                    .filter(|c| c.names(rank, incarnation))
                    .map(describe)
                    .collect();
                let seen = first.get_or_insert_with(|| holding.iter().cloned().collect());
                if holding.is_empty() {
                    return Ok(Released {
                        waited: start.elapsed(),
                        readers: seen.iter().cloned().collect(),
                        waited_through: waited.lines(),
                    });
                }
                let now = Instant::now();
                if now < deadline {
                    let change = bounded(
                        deadline,
                        rendezvous.readers_changed(model, revision, deadline - now),
                    )
                    .await;
                    if let Some(Err(e)) = change {
                        if !is_transient(&e) {
                            return Err(e);
                        }
                        waited.note(&e);
                        backoff(&mut pause, deadline).await;
                    }
                }
            }
            Some(Err(e)) if is_transient(&e) => {
                waited.note(&e);
                backoff(&mut pause, deadline).await;
            }
            Some(Err(e)) => return Err(e),
            None => {}
        }
        if Instant::now() >= deadline {
            let mut msg = format!(
                "publisher rank {rank} of model {model:?}: receivers still read its memory after \
                 {:.1} s (at {}): ",
                timeout.as_secs_f64(),
                rendezvous.endpoint()
            );
            if holding.is_empty() {
                msg.push_str("the rendezvous did not say (it did not answer)");
            } else {
                msg.push_str(&holding.join("; "));
            }
            let lines = waited.lines();
            if !lines.is_empty() {
                let _ = write!(msg, "; waited through: {}", lines.join("; "));
            }
            return Err(Error::new(ErrorKind::Timeout, msg).with_owner(rank));
        }
    }
}
