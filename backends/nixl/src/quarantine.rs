//! The quarantine: prepared batches whose NIXL requests may still be moving bytes, kept alive
//! until NIXL reports every one of them finished.
//!
//! NIXL cannot stop a READ (`releaseXferReq` on a request in progress frees it while the get
//! carries on), so a batch that is not seen to finish within the no-progress bound, or whose
//! handle is dropped while its reads run, is handed here instead of being released. An entry
//! holds the `Arc<Prepared>`, and with it the requests, the descriptor lists, the NIXL
//! registrations and the memory blocks (and the agent). One process-wide thread polls every
//! entry (`getXferStatus`, which also drives NIXL's progress) and releases an entry only once
//! each of its pending requests has reported completion or an error; the thread exits when the
//! list is empty and is started again by the next admission.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::transport::Prepared;

/// A quarantined batch: its requests (group indices) that may still be in progress.
struct Entry {
    p: Arc<Prepared>,
    pending: Mutex<Vec<usize>>,
    since: Instant,
}

/// Every entry stays in the list until it has ended, so `count` and `conflicts` always see it;
/// the polling thread works on a snapshot of `Arc`s.
static LIST: Mutex<Vec<Arc<Entry>>> = Mutex::new(Vec::new());
/// Batches whose reads can never be observed to end: kept for the life of the process.
static KEPT: Mutex<Vec<Arc<Prepared>>> = Mutex::new(Vec::new());
/// The polling thread is running (or being started).
static RUNNING: AtomicBool = AtomicBool::new(false);

/// First and largest pause of the polling thread between rounds.
const FIRST_PAUSE: Duration = Duration::from_micros(200);
const MAX_PAUSE: Duration = Duration::from_millis(10);

/// Keeps `p` alive and polls its `pending` requests until every one has ended. The caller has
/// already marked `p` quarantined, so it is never posted again.
pub(crate) fn admit(p: Arc<Prepared>, pending: Vec<usize>) {
    LIST.lock().push(Arc::new(Entry {
        p,
        pending: Mutex::new(pending),
        since: Instant::now(),
    }));
    if !RUNNING.swap(true, Ordering::AcqRel) {
        let spawned = std::thread::Builder::new()
            .name("reshard-nixl-quarantine".into())
            .spawn(run);
        if let Err(e) = spawned {
            // The entries stay in the list (alive, never released) and the next admission
            // tries again: keeping memory is safe, releasing it is not.
            RUNNING.store(false, Ordering::Release);
            tracing::error!(%e, "nixl: cannot start the quarantine thread");
        }
    }
}

/// Keeps `p` (already marked quarantined) for the rest of the process: some of its reads were
/// handed to UCX by a post that then failed part-way, and NIXL released their handles, so
/// nothing can tell when they end. Never polled, never released.
pub(crate) fn keep_forever(p: Arc<Prepared>) {
    KEPT.lock().push(p);
}

/// Quarantined batches of the endpoint `uid` (waiting for their reads to end, or kept).
pub(crate) fn count(uid: u64) -> usize {
    LIST.lock().iter().filter(|e| e.p.shared.uid == uid).count()
        + KEPT.lock().iter().filter(|p| p.shared.uid == uid).count()
}

/// Quarantined local address ranges of endpoint `uid` that overlap `ranges`
/// (`(space, start, end)`), as `(start, end)`.
pub(crate) fn conflicts(uid: u64, ranges: &[(u64, u64, u64)]) -> Vec<(u64, u64)> {
    let list = LIST.lock();
    let kept = KEPT.lock();
    let batches = list.iter().map(|e| &e.p).chain(kept.iter());
    let mut out = Vec::new();
    for p in batches.filter(|p| p.shared.uid == uid) {
        for &(space, s, end) in p.local_ranges() {
            if ranges
                .iter()
                .any(|&(sp, a, b)| sp == space && a < end && s < b)
            {
                out.push((s, end));
            }
        }
    }
    out
}

impl Entry {
    /// Polls the pending requests once; true when none is left in progress.
    fn poll(&self) -> bool {
        let p = &self.p;
        let nixl = p.nixl.lock();
        let Some(reqs) = nixl.as_ref().and_then(|n| n.requests.as_ref()) else {
            // Nothing left to poll (cannot happen: nothing releases a quarantined batch's
            // requests but this thread).
            return true;
        };
        // `Ok(false)`: still in progress. Completion and any error (including a request
        // never posted) end it.
        let mut pending = self.pending.lock();
        pending.retain(|&g| {
            // Each request is polled on the lane whose agent it was posted on.
            let lane = p.groups.get(g).and_then(|gr| p.shared.lanes.get(gr.lane));
            match lane {
                Some(l) => matches!(l.agent.done(&reqs[g]), Ok(false)),
                // Cannot happen (prepare assigns existing lanes); kept, never released.
                None => true,
            }
        });
        pending.is_empty()
    }
}

fn run() {
    let mut pause = FIRST_PAUSE;
    loop {
        // Poll a snapshot outside the list lock: admissions, `count` and `conflicts` never
        // wait for NIXL, and an entry leaves the list only once it has ended.
        let entries: Vec<Arc<Entry>> = LIST.lock().clone();
        let ended: Vec<Arc<Entry>> = entries.into_iter().filter(|e| e.poll()).collect();
        let progressed = !ended.is_empty();
        let exit = {
            let mut list = LIST.lock();
            list.retain(|e| !ended.iter().any(|d| Arc::ptr_eq(d, e)));
            let empty = list.is_empty();
            if empty {
                // Under the lock: an admission after this sees RUNNING false and starts a
                // new thread.
                RUNNING.store(false, Ordering::Release);
            }
            empty
        };
        let ended: Vec<_> = ended
            .into_iter()
            .map(|e| (Arc::clone(&e.p), e.since.elapsed()))
            .collect();
        for (p, after) in ended {
            tracing::info!(
                agent = %p.shared.name,
                after_ms = after.as_millis() as u64,
                "nixl: quarantined reads ended; releasing their requests and memory"
            );
            p.release_nixl();
            drop(p);
        }
        if exit {
            return;
        }
        pause = if progressed {
            FIRST_PAUSE
        } else {
            (pause * 2).min(MAX_PAUSE)
        };
        std::thread::sleep(pause);
    }
}
