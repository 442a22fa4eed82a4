//! Ending batches early: abort, force-closing the endpoints their gets are outstanding on,
//! the no-progress timeout and quarantine.

use std::collections::BTreeSet;
use std::rc::Rc;
#[cfg(test)]
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use reshard_core::contract::span;
use reshard_core::{Error, ErrorKind, OwnerId};

use super::execute::{PendingRead, Running};
use super::peers::Peer;
use super::Engine;
#[cfg(test)]
use super::TEST_IGNORE_FORCE_CLOSE;
use crate::SCHEME;

impl Engine {
    /// Ends `batch` as abort does (see [`Cmd::Cancel`](super::Cmd::Cancel)).
    pub(super) fn cancel(&mut self, batch: u64) {
        if let Some(i) = self.deferred.iter().position(|d| d.batch == batch) {
            // Still waiting for an endpoint: it never starts. Dropping it answers the post
            // (if anyone still waits) and signals the batch quiet.
            let d = self.deferred.remove(i);
            let _ = d.ack.send(Err(Error::new(
                ErrorKind::Aborted,
                "the ucx batch was ended before it started",
            )
            .with_backend(SCHEME)));
            return;
        }
        let Some(run) = self.running.iter_mut().find(|r| r.id == batch) else {
            // Finished (and answered) already, or quarantined.
            return;
        };
        run.cancelled = true;
        run.signal.stop();
        self.close_endpoints_of(batch);
    }

    /// Force-closes every endpoint a get of `batch` is outstanding on: UCX then completes
    /// those gets (with an error) as the worker is progressed. Other batches using a closed
    /// endpoint stop issuing on it and fail; the owner's endpoint is re-created from its
    /// metadata before the next post to it.
    pub(super) fn close_endpoints_of(&mut self, batch: u64) {
        let Some(run) = self.running.iter().find(|r| r.id == batch) else {
            return;
        };
        let owners: BTreeSet<OwnerId> = self
            .pending
            .values()
            .filter(|p| p.batch == batch)
            .map(|p| p.owner)
            .collect();
        let peers: Vec<(OwnerId, Rc<Peer>)> = owners
            .into_iter()
            .filter_map(|o| run.res.peers.get(&o).map(|p| (o, Rc::clone(p))))
            .filter(|(_, p)| !p.ep.is_closed())
            .collect();
        for (owner, peer) in peers {
            self.force_close(owner, &peer);
        }
        let now = Instant::now();
        if let Some(run) = self.running.iter_mut().find(|r| r.id == batch) {
            run.closed = true;
            run.last_event.progressed(now);
        }
    }

    fn force_close(&mut self, owner: OwnerId, peer: &Rc<Peer>) {
        tracing::debug!(agent = %self.agent, owner, peer = %peer.agent, "ucx force-closing endpoint");
        self.forced_any = true;
        #[cfg(test)]
        let ignore = TEST_IGNORE_FORCE_CLOSE.load(Ordering::Relaxed);
        #[cfg(not(test))]
        let ignore = false;
        if ignore {
            tracing::debug!(agent = %self.agent, owner, "test: forced close ignored");
        } else if let Err(e) = peer.ep.force_close() {
            // Its gets are then waited out, or quarantined, by the no-progress bound.
            tracing::warn!(agent = %self.agent, owner, error = %e, "ucx forced close failed");
        }
        let now = Instant::now();
        for r in &mut self.running {
            if !r.res.peers.get(&owner).is_some_and(|p| Rc::ptr_eq(p, peer)) {
                continue;
            }
            r.closed = true;
            r.last_event.progressed(now);
            if r.error.is_none() && !r.cancelled {
                // Its gets on this endpoint complete with an error; nothing lands once they
                // have, so trying again (on the re-created endpoint) may help.
                r.error = Some(
                    Error::new(
                        ErrorKind::Transport,
                        format!(
                            "the ucx endpoint to owner {owner} was force-closed to end another \
                             batch's reads"
                        ),
                    )
                    .with_owner(owner)
                    .with_backend(SCHEME)
                    .set_retryable(true),
                );
            }
        }
        if ignore {
            // The endpoint stays usable as it was.
            return;
        }
        if self.peers.get(&owner).is_some_and(|p| Rc::ptr_eq(p, peer)) {
            // Nothing may use the closed endpoint again: the owner is re-created from the
            // metadata it was loaded from, and posts to it wait for that.
            self.peers.remove(&owner);
            self.bump_epoch();
            if !self.shutting_down {
                self.start_connect(owner, peer.meta.clone(), None);
            }
        }
    }

    /// Moves `batch`, whose gets did not complete within the no-progress bound after its
    /// endpoints were force-closed, to quarantine, and answers its waiters.
    pub(super) fn quarantine_batch(&mut self, batch: u64) {
        let Some(i) = self.running.iter().position(|r| r.id == batch) else {
            return;
        };
        let mut run = self.running.swap_remove(i);
        let stuck: Vec<&PendingRead> = self.pending.values().filter(|p| p.batch == batch).collect();
        let owners: BTreeSet<OwnerId> = stuck.iter().map(|p| p.owner).collect();
        let first = stuck
            .iter()
            .filter_map(|p| run.res.op_read.get(p.piece as usize))
            .filter_map(|&r| run.batch.reads.get(r as usize))
            .next();
        tracing::warn!(
            agent = %self.agent,
            batch,
            outstanding = run.outstanding,
            ?owners,
            "ucx reads did not complete after their endpoints were force-closed; quarantining \
             their memory"
        );
        let mut e = Error::new(
            ErrorKind::Timeout,
            format!(
                "{} ucx read(s) from owner(s) {owners:?} did not complete within {} ms of \
                 their endpoints being force-closed; the destination memory, keys and \
                 registrations are quarantined (kept alive, never reused) until they do{}",
                run.outstanding,
                self.opts.timeout.as_millis(),
                match &run.error {
                    Some(cause) => format!(" (the batch had failed: {cause})"),
                    None => String::new(),
                }
            ),
        )
        .with_backend(SCHEME);
        if let Some(r) = first {
            e = e
                .with_owner(r.owner)
                .with_range(span(r.remote_offset, r.remote_span().unwrap_or(r.len)));
        }
        let e = e.set_quarantined();
        run.signal.set_quiet();
        if let Some(done) = run.done.take() {
            let _ = done.send(Err(e));
        }
        self.quarantine.push(run);
    }

    /// The owners of `run` whose reads made no progress for the no-progress bound, longest
    /// stalled first, with how long.
    ///
    /// UCX reports a get only when it completes. The worker's own activity cannot be
    /// attributed to an owner, and it stays busy while a link is down (connection attempts),
    /// so it is not progress. An owner's reads advance when a get of the batch on it
    /// completes, when any get through the same endpoint completes successfully (another
    /// batch's gets ahead of these on the link), or when the first of the batch's gets on it
    /// is issued while none is outstanding. Reads are cut into pieces of at most
    /// `piece_bytes` and one endpoint's gets are served in the order they were issued, so a
    /// healthy link completes one within `piece_bytes` over the owner's share of its
    /// bandwidth; `timeout_ms` must exceed that (README, "In-flight safety").
    pub(super) fn stalled_owners(&self, run: &Running, now: Instant) -> Vec<(OwnerId, Duration)> {
        let mut stalled: Vec<(OwnerId, Duration)> = run
            .owners
            .iter()
            .filter(|o| o.outstanding > 0)
            .filter_map(|o| {
                let through = run
                    .res
                    .peers
                    .get(&o.owner)
                    .and_then(|p| p.last_completion.get());
                let last = through.map_or(o.since, |t| t.max(o.since));
                let idle = now.saturating_duration_since(last);
                (idle > self.opts.timeout).then_some((o.owner, idle))
            })
            .collect();
        reshard_core::progress::longest_first(&mut stalled);
        stalled
    }

    /// The `Timeout` of `run`, whose reads of the `stalled` owners (see
    /// [`Engine::stalled_owners`]) made no progress: it names the owner stalled longest and
    /// the first of its reads still outstanding.
    pub(super) fn timeout_error(&self, run: &Running, stalled: &[(OwnerId, Duration)]) -> Error {
        let first = stalled.first().map(|&(o, _)| o);
        let r = self
            .pending
            .values()
            .filter(|p| p.batch == run.id && Some(p.owner) == first)
            .filter_map(|p| run.res.op_read.get(p.piece as usize))
            .min()
            .and_then(|&read| run.batch.reads.get(read as usize));
        let from: usize = run
            .owners
            .iter()
            .filter(|o| stalled.iter().any(|s| s.0 == o.owner))
            .map(|o| o.outstanding)
            .sum();
        let owners: Vec<String> = stalled
            .iter()
            .map(|(o, idle)| format!("owner {o} for {} ms", idle.as_millis()))
            .collect();
        let mut e = Error::new(
            ErrorKind::Timeout,
            format!(
                "ucx reads made no progress for over {} ms: {} ({from} of the batch's {} \
                 outstanding reads are theirs); the batch's endpoints are force-closed, and it \
                 answers once none of its reads is outstanding (else they are quarantined)",
                self.opts.timeout.as_millis(),
                owners.join(", "),
                run.outstanding
            ),
        )
        .with_backend(SCHEME)
        .set_retryable(true);
        if let Some(o) = first {
            e = e.with_owner(o);
        }
        if let Some(r) = r {
            e = e.with_range(span(r.remote_offset, r.remote_span().unwrap_or(r.len)));
        }
        e
    }
}
