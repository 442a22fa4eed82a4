//! Posted batches: posting every owner's request, polling completion with backoff under a
//! no-progress bound, the failure, abort and drop paths, and the [`InFlight`] handle.
//!
//! Requests are re-posted every step (NIXL allows re-posting a request once its previous
//! transfer completed). NIXL cannot stop a READ: `releaseXferReq` on a request in progress
//! frees it while the get carries on (docs/in-flight-safety.md). So a request is never
//! released while it may be in progress. A batch either ends with every posted request seen
//! to end (completed or failed), or it is handed to the [`crate::quarantine`] with everything
//! its reads touch, and the error says so (`is_quarantined`, never retryable).

use async_trait::async_trait;
use parking_lot::{Condvar, Mutex};
use reshard_core::progress::{self, NoProgress};
use reshard_core::{CompletionSink, Countdown, Error, ErrorKind, InFlight, Result, WireReport};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::agent::{plugin_failed, status_name, Request};
use crate::quarantine;
use crate::transport::{Prepared, IDLE, QUARANTINED};
use crate::SCHEME;

/// Polls answered by yielding before the poller starts sleeping.
const SPIN_POLLS: u32 = 64;
/// First and largest sleep between polls.
const FIRST_SLEEP: Duration = Duration::from_micros(50);
const MAX_SLEEP: Duration = Duration::from_millis(1);
/// Largest sleep while requests wait for a slot: a slot left empty idles the wire.
const QUEUED_MAX_SLEEP: Duration = Duration::from_micros(100);

/// Yield a few times (a small read completes in microseconds), then sleep, doubling up to
/// 1 ms, so a long transfer costs no runtime worker.
struct Backoff {
    polls: u32,
    sleep: Duration,
}

impl Backoff {
    fn new() -> Self {
        Backoff {
            polls: 0,
            sleep: FIRST_SLEEP,
        }
    }

    fn reset(&mut self) {
        *self = Backoff::new();
    }

    async fn pause(&mut self) {
        self.pause_upto(MAX_SLEEP).await;
    }

    /// As [`Backoff::pause`], sleeping at most `max`.
    async fn pause_upto(&mut self, max: Duration) {
        if self.polls < SPIN_POLLS {
            self.polls += 1;
            tokio::task::yield_now().await;
        } else {
            let sleep = self.sleep.min(max);
            tokio::time::sleep(sleep).await;
            self.sleep = (sleep * 2).min(max);
        }
    }
}

/// A posted NIXL batch: its requests are in flight, at most `requests_in_flight` per owner;
/// the rest wait in per-owner queues and are
/// posted as requests complete, so `abort` and a drop (which cannot stop a posted read) only
/// wait for what is in flight, not for the whole batch.
pub(crate) struct NixlInFlight {
    p: Arc<Prepared>,
    /// Groups posted and not yet seen to end.
    pending: Vec<usize>,
    /// Groups not posted yet, per owner, in batch order.
    queues: Vec<(reshard_core::OwnerId, VecDeque<usize>)>,
    /// Per owner, when its reads last advanced: one of its requests ended, or one was posted
    /// while none of its was pending. What a timeout names (see
    /// [`NixlInFlight::stalled_owners`]).
    progress: Vec<(reshard_core::OwnerId, Instant)>,
    /// When any request of the batch last ended (or the batch was posted): the no-progress
    /// timer of `wait` and of the drains (abort, drop, after a failure), which go on while
    /// anything of the batch still moves (docs/in-flight-safety.md, rule 4).
    last_progress: NoProgress,
    /// The batch was handed back (idle) or to the quarantine.
    finished: bool,
    /// A post failed inside the UCX plugin: reads of that request it had already started may
    /// still run, and NIXL released their handles, so their end can never be observed.
    unobservable: bool,
    /// Reads and bytes of the requests seen to complete successfully, summed as they complete
    /// (each request's descriptors and bytes): what `wait` reports.
    counted: WireReport,
    /// Where reads are reported as the request landing their last byte ends
    /// (`Transport::post_reporting`); polled, like every completion, by the waiter.
    completions: Option<(CompletionSink, Countdown)>,
}

impl NixlInFlight {
    /// Posts the first request of every owner and returns the handle; on a
    /// post failure waits for what was posted and returns the error.
    pub(crate) async fn start(
        p: Arc<Prepared>,
        completions: Option<(CompletionSink, Countdown)>,
    ) -> Result<NixlInFlight> {
        let mut f = NixlInFlight {
            p,
            pending: Vec::new(),
            queues: Vec::new(),
            progress: Vec::new(),
            last_progress: NoProgress::new(),
            finished: false,
            unobservable: false,
            counted: WireReport::default(),
            completions,
        };
        let made = {
            let mut nixl = f.p.nixl.lock();
            match nixl.as_mut() {
                Some(n) if n.requests.is_none() => match f.p.make_requests(n) {
                    Ok(r) => {
                        n.requests = Some(r);
                        Ok(())
                    }
                    Err(e) => Err(e),
                },
                Some(_) => Ok(()),
                None => Err(Error::new(
                    ErrorKind::Transport,
                    "this prepared batch was released (a peer was reloaded); prepare again",
                )
                .with_backend(SCHEME)),
            }
        };
        if let Err(e) = made {
            // Nothing was posted.
            f.idle();
            return Err(e);
        }
        f.p.posts.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = f.post_all() {
            return Err(f.after_failure(e).await);
        }
        Ok(f)
    }

    /// Queues every request per owner and posts the first of every owner (the contract: every
    /// owner's reads start in `post`).
    fn post_all(&mut self) -> Result<()> {
        for (g, group) in self.p.groups.iter().enumerate() {
            match self.queues.iter_mut().find(|(o, _)| *o == group.owner) {
                Some((_, q)) => q.push_back(g),
                None => self.queues.push((group.owner, VecDeque::from([g]))),
            }
        }
        self.last_progress.progressed(Instant::now());
        self.refill()
    }

    /// Posts queued requests of every owner while it has fewer than `requests_in_flight` in
    /// flight (a request that completes inside the post takes no slot); stops at the first
    /// failure (the requests posted before it stay pending).
    ///
    /// Lanes: every lane holding a queued request posts its own requests from its own thread
    /// (the first lane's on this one; the others on scoped threads joined before
    /// this returns), because NIXL's UCX copies over cross-memory attach on the posting
    /// thread. The per-owner window is shared by the lanes: a request being posted holds a
    /// slot of its owner until its post returns, so no more than `requests_in_flight`
    /// requests of an owner are ever in flight, over all lanes (the bound of abort).
    fn refill(&mut self) -> Result<()> {
        if self.queues.iter().all(|(_, q)| q.is_empty()) {
            return Ok(());
        }
        let nixl = self.p.nixl.lock();
        let Some(reqs) = nixl.as_ref().and_then(|n| n.requests.as_ref()) else {
            return Err(
                Error::new(ErrorKind::Internal, "nixl requests missing at post")
                    .with_backend(SCHEME),
            );
        };
        let log = self.p.shared.log.lock().clone();
        let groups = &self.p.groups;
        let busy = self
            .queues
            .iter()
            .map(|(owner, _)| {
                self.pending
                    .iter()
                    .filter(|&&g| groups[g].owner == *owner)
                    .count()
            })
            .collect();
        let mut lanes: Vec<usize> = self
            .queues
            .iter()
            .flat_map(|(_, q)| q.iter().map(|&g| groups[g].lane))
            .collect();
        lanes.sort_unstable();
        lanes.dedup();
        let dispatch = Dispatch {
            state: Mutex::new(DispatchState {
                queues: std::mem::take(&mut self.queues),
                busy,
                in_post: 0,
                stop: false,
                outcomes: Vec::new(),
                started: Vec::new(),
            }),
            turn: Condvar::new(),
            p: &self.p,
            reqs,
            completions: &self.completions,
        };
        match lanes.split_first() {
            Some((&first, [])) => dispatch.run(first),
            Some((&first, others)) => std::thread::scope(|scope| {
                for &lane in others {
                    let dispatch = &dispatch;
                    let spawned = std::thread::Builder::new()
                        .name(format!("reshard-nixl-lane{lane}"))
                        .spawn_scoped(scope, move || dispatch.run(lane));
                    if let Err(e) = spawned {
                        // That lane's requests stay queued; this thread posts its own, and
                        // the next refill (after a completion) tries that lane again.
                        tracing::warn!(%e, lane, "nixl: cannot start a lane thread");
                    }
                }
                dispatch.run(first);
            }),
            None => {}
        }
        let state = dispatch.state.into_inner();
        self.queues = state.queues;
        drop(nixl);
        let mut posted = Vec::new();
        let mut result = Ok(());
        for (g, outcome) in state.outcomes {
            let group = &self.p.groups[g];
            match outcome {
                Ok(true) => {
                    self.pending.push(g);
                    posted.push(g);
                }
                Ok(false) => {
                    // Complete at once: counted now (reported by the posting lane).
                    self.counted.reads += group.reads();
                    self.counted.bytes += group.bytes;
                    posted.push(g);
                }
                Err(e) => {
                    // NIXL records the failed post as the request's status (it reports that
                    // error from now on). Errors of NIXL's own checks (invalid parameter,
                    // unknown agent) come before anything is handed to the plugin. A plugin
                    // error (NIXL_ERR_BACKEND) may come part-way: the UCX plugin then releases
                    // the gets of this request it already started, which do not stop.
                    self.unobservable |= plugin_failed(&e);
                    if result.is_ok() {
                        result = Err(Error::new(
                            ErrorKind::Transport,
                            format!("NIXL postXferReq (READ) failed: {}", status_name(&e)),
                        )
                        .with_owner(group.owner)
                        .with_range(group.range.clone())
                        .with_backend(SCHEME)
                        .with_source(e)
                        .set_retryable(true));
                    }
                }
            }
        }
        self.advanced(state.started);
        if let Some(log) = log {
            self.p.record(&log, &posted);
        }
        result
    }

    /// Restarts the no-progress timer of each of `owners`.
    fn advanced(&mut self, owners: impl IntoIterator<Item = reshard_core::OwnerId>) {
        let now = Instant::now();
        for owner in owners {
            match self.progress.iter_mut().find(|(o, _)| *o == owner) {
                Some((_, t)) => *t = now,
                None => self.progress.push((owner, now)),
            }
        }
    }

    /// Requests not posted yet.
    fn queued(&self) -> bool {
        self.queues.iter().any(|(_, q)| !q.is_empty())
    }

    /// Polls the pending requests once; returns the first failure.
    /// A request seen to end (completed or failed) restarts its owner's no-progress timer.
    fn poll_once(&mut self) -> Option<Error> {
        let nixl = self.p.nixl.lock();
        let Some(reqs) = nixl.as_ref().and_then(|n| n.requests.as_ref()) else {
            // Cannot happen while the batch is busy (nothing else releases its requests).
            return Some(
                Error::new(ErrorKind::Internal, "nixl requests missing while in flight")
                    .with_backend(SCHEME),
            );
        };
        let mut first = None;
        let p = &self.p;
        let counted = &mut self.counted;
        let completions = &self.completions;
        let mut ended = Vec::new();
        self.pending.retain(|&g| {
            let lane = &p.shared.lanes[p.groups[g].lane];
            let r = lane.agent.done(&reqs[g]);
            if !matches!(r, Ok(false)) {
                ended.push(p.groups[g].owner);
            }
            match r {
                Ok(done) => {
                    if done {
                        // A request completes whole: its descriptors and bytes are counted.
                        let group = &p.groups[g];
                        lane.completed(group.bytes);
                        counted.reads += group.reads();
                        counted.bytes += group.bytes;
                        report(completions, group);
                    }
                    !done
                }
                Err(e) => {
                    let group = &p.groups[g];
                    if first.is_none() {
                        first = Some(
                            Error::new(
                                ErrorKind::Transport,
                                format!("NIXL READ failed: {}", status_name(&e)),
                            )
                            .with_owner(group.owner)
                            .with_range(group.range.clone())
                            .with_backend(SCHEME)
                            .with_source(e)
                            .set_retryable(true),
                        );
                    }
                    false
                }
            }
        });
        drop(nixl);
        if !ended.is_empty() {
            self.last_progress.progressed(Instant::now());
        }
        self.advanced(ended);
        first
    }

    /// The owners with requests in flight, the one whose reads made no progress for longest
    /// first, with how long. Once the batch as a whole made none for the bound, the first is
    /// the owner whose reads stopped first (the one a dead link cut off, not a healthy one
    /// that merely has a request pending).
    ///
    /// NIXL reports a request only when all of it has ended, so a request of `request_bytes`
    /// must be able to complete within the bound on a healthy link, behind the owner's other
    /// requests in flight: `timeout_ms` must exceed `requests_in_flight` x `request_bytes`
    /// over the owner's share of the slowest link (README, "In-flight safety" rule 4).
    fn stalled_owners(&self) -> Vec<(reshard_core::OwnerId, Duration)> {
        let now = Instant::now();
        let mut stalled: Vec<(reshard_core::OwnerId, Duration)> = self
            .progress
            .iter()
            .filter(|(o, _)| self.pending.iter().any(|&g| self.p.groups[g].owner == *o))
            .map(|&(o, t)| (o, now.saturating_duration_since(t)))
            .collect();
        progress::longest_first(&mut stalled);
        stalled
    }

    /// Whether no request of the batch ended for the no-progress bound (the drains' bound).
    fn stalled(&self) -> bool {
        self.last_progress
            .stalled(Instant::now(), self.p.shared.timeout)
    }

    fn closed(&self) -> bool {
        self.p.shared.closed.load(Ordering::Acquire)
    }

    /// Polls until nothing of the batch is in flight (errors only end a request's
    /// wait); false when no pending request ended for the no-progress bound.
    async fn drain(&mut self) -> bool {
        let mut backoff = Backoff::new();
        while !self.pending.is_empty() {
            let before = self.pending.len();
            let _ = self.poll_once();
            if self.pending.is_empty() {
                break;
            }
            if self.pending.len() < before {
                backoff.reset();
            }
            if self.stalled() {
                return false;
            }
            backoff.pause().await;
        }
        true
    }

    /// Blocking drain for `Drop` (nothing can be awaited there), bounded by the no-progress
    /// bound: a drop must not return while bytes may still land (docs/in-flight-safety.md,
    /// rule 1), and NIXL cannot stop them, so the dropping thread waits them out while they
    /// progress. Only a batch that stops progressing is handed to the quarantine.
    fn drain_blocking(&mut self) -> bool {
        let mut sleep = FIRST_SLEEP;
        let mut spins = 0u32;
        while !self.pending.is_empty() {
            let before = self.pending.len();
            let _ = self.poll_once();
            if self.pending.is_empty() {
                break;
            }
            if self.pending.len() < before {
                sleep = FIRST_SLEEP;
            }
            if self.stalled() {
                return false;
            }
            if spins < SPIN_POLLS {
                spins += 1;
                std::thread::yield_now();
            } else {
                std::thread::sleep(sleep);
                sleep = (sleep * 2).min(MAX_SLEEP);
            }
        }
        true
    }

    /// Every posted request has been seen to end: the batch is postable again.
    fn idle(&mut self) {
        if !self.finished {
            self.finished = true;
            self.pending.clear();
            self.p.phase.store(IDLE, Ordering::Release);
        }
    }

    /// Pending requests may still move bytes and nobody will wait for them: the quarantine
    /// keeps the batch (requests, lists, registrations, memory) until they end. Returns a
    /// description of what was quarantined, for errors and logs.
    fn quarantine(&mut self) -> String {
        let what = self.pending_description();
        if !self.finished {
            self.finished = true;
            self.p.phase.store(QUARANTINED, Ordering::Release);
            let pending = self.pending.drain(..).collect();
            quarantine::admit(Arc::clone(&self.p), pending);
        }
        what
    }

    /// After a post that failed part-way inside the plugin: nothing can tell when the reads it
    /// started end, so the batch (requests, lists, registrations, memory) is kept for the life
    /// of the process.
    fn keep_forever(&mut self) -> String {
        if !self.finished {
            self.finished = true;
            self.pending.clear();
            self.p.phase.store(QUARANTINED, Ordering::Release);
            quarantine::keep_forever(Arc::clone(&self.p));
        }
        format!(
            "reads this post had already started cannot be observed any more (NIXL released \
             them); local regions {:?} (their NIXL registrations and memory) are quarantined for \
             the life of the process, and the batch is never posted again",
            self.p.local_regions()
        )
    }

    fn pending_description(&self) -> String {
        let mut owners: Vec<String> = self
            .pending
            .iter()
            .map(|&g| {
                let gr = &self.p.groups[g];
                format!(
                    "owner {} (remote bytes {}..{} and on)",
                    gr.owner, gr.range.start, gr.range.end
                )
            })
            .collect();
        owners.dedup();
        format!(
            "reads of {} still in flight; local regions {:?} (their NIXL registrations and \
             memory) and the batch's requests are quarantined until NIXL reports them \
             finished, and the batch is never posted again",
            owners.join(", "),
            self.p.local_regions()
        )
    }

    /// `e` after a failure: waits (no-progress bound) for the other pending requests; if they
    /// all end, nothing can land any more: their requests are released (the next post re-makes
    /// them) and `e` is returned as it is. Otherwise the batch is quarantined and so is `e`.
    async fn after_failure(&mut self, e: Error) -> Error {
        if self.unobservable {
            let what = self.keep_forever();
            return requalify(e, &what);
        }
        if self.drain().await {
            self.p.release_requests();
            self.idle();
            e
        } else {
            let what = self.quarantine();
            requalify(e, &what)
        }
    }

    async fn run(&mut self) -> Result<WireReport> {
        let mut backoff = Backoff::new();
        loop {
            let before = self.pending.len();
            if let Some(e) = self.poll_once() {
                return Err(self.after_failure(e).await);
            }
            // Also when nothing is pending but requests are queued (a lane thread that could
            // not be started left its requests queued).
            if self.pending.len() < before || (self.pending.is_empty() && self.queued()) {
                backoff.reset();
                if let Err(e) = self.refill() {
                    return Err(self.after_failure(e).await);
                }
            }
            if self.pending.is_empty() && !self.queued() {
                self.idle();
                return Ok(self.counted);
            }
            if self.closed() {
                return Err(self.dropped_transport().await);
            }
            if self.stalled() {
                let e = self.timeout_error();
                let what = self.quarantine();
                return Err(requalify(e, &what));
            }
            if self.queued() {
                backoff.pause_upto(QUEUED_MAX_SLEEP).await;
            } else {
                backoff.pause().await;
            }
        }
    }

    /// The transport was dropped while this batch ran: no further request is posted, what is
    /// in flight is drained (no-progress bound), and the waiter gets an error.
    async fn dropped_transport(&mut self) -> Error {
        let e = Error::new(
            ErrorKind::Aborted,
            "the nixl transport was dropped while this batch was in flight",
        )
        .with_backend(SCHEME);
        if self.drain().await {
            self.idle();
            e
        } else {
            let what = self.quarantine();
            requalify(e, &what)
        }
    }

    /// The `Timeout` of a batch whose reads of some owners stalled: it names the owner stalled
    /// longest (and lists the others) and that owner's first request still in flight.
    fn timeout_error(&self) -> Error {
        let stalled = self.stalled_owners();
        let first = stalled.first().map(|&(o, _)| o);
        let g = self
            .pending
            .iter()
            .map(|&g| &self.p.groups[g])
            .find(|g| Some(g.owner) == first);
        let owners: Vec<String> = stalled
            .iter()
            .map(|(o, idle)| format!("owner {o} for {} ms", idle.as_millis()))
            .collect();
        let mut e = Error::new(
            ErrorKind::Timeout,
            format!(
                "NIXL READs made no progress for over {} ms (no request ended, status \
                 NIXL_IN_PROG): {}",
                self.p.shared.timeout.as_millis(),
                owners.join(", ")
            ),
        )
        .with_backend(SCHEME);
        if let Some(g) = g {
            e = e.with_owner(g.owner).with_range(g.range.clone());
        }
        e
    }
}

/// The requests one [`NixlInFlight::refill`] posts, shared by its lane threads.
struct Dispatch<'a> {
    state: Mutex<DispatchState>,
    /// Signalled whenever a post returns (a slot may have come free, or the refill stops).
    turn: Condvar,
    p: &'a Prepared,
    reqs: &'a [Request],
    completions: &'a Option<(CompletionSink, Countdown)>,
}

struct DispatchState {
    /// Requests not posted yet, per owner, in batch order (taken from the handle).
    queues: Vec<(reshard_core::OwnerId, VecDeque<usize>)>,
    /// Per queue: the owner's requests in flight, or being posted.
    busy: Vec<usize>,
    /// Posts under way on any lane.
    in_post: usize,
    /// A post failed: no lane starts another.
    stop: bool,
    /// Every post's result, in the order they returned.
    outcomes: Vec<(usize, std::result::Result<bool, nixl_sys::NixlError>)>,
    /// Owners whose first request in flight this refill posted (their timer starts).
    started: Vec<reshard_core::OwnerId>,
}

impl Dispatch<'_> {
    /// Posts the requests of lane `lane` while their owners have room in the window: takes
    /// the first queued request of this lane of the first owner with room, posts it on the
    /// lane's agent, and records the outcome. Waits while this lane's requests are held back
    /// only by posts under way on other lanes (which may free a slot); returns once none is
    /// left, no slot can free up during this refill, or a post failed.
    fn run(&self, lane: usize) {
        let window = self.p.shared.requests_in_flight;
        let groups = &self.p.groups;
        let agent = &self.p.shared.lanes[lane];
        loop {
            let (qi, g) = {
                let mut st = self.state.lock();
                loop {
                    if st.stop {
                        return;
                    }
                    let mut mine = false;
                    let mut pick = None;
                    for (qi, (_, q)) in st.queues.iter().enumerate() {
                        let Some(pos) = q.iter().position(|&g| groups[g].lane == lane) else {
                            continue;
                        };
                        mine = true;
                        if st.busy[qi] < window {
                            pick = Some((qi, pos));
                            break;
                        }
                    }
                    if let Some((qi, pos)) = pick {
                        let Some(g) = st.queues[qi].1.remove(pos) else {
                            return;
                        };
                        if st.busy[qi] == 0 {
                            // The owner's timer starts with its first request in flight.
                            let owner = st.queues[qi].0;
                            st.started.push(owner);
                        }
                        st.busy[qi] += 1;
                        st.in_post += 1;
                        break (qi, g);
                    }
                    if !mine || st.in_post == 0 {
                        // Nothing of this lane left, or every slot it waits for is held by a
                        // request in flight, which only the waiter's polling frees.
                        return;
                    }
                    self.turn.wait(&mut st);
                }
            };
            // A panic on a lane thread must not lose what was posted: it counts as a plugin
            // failure part-way (the batch is then kept for the life of the process).
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                agent.agent.post(&self.reqs[g])
            }))
            .unwrap_or(Err(nixl_sys::NixlError::BackendError));
            if matches!(r, Ok(false)) {
                // Complete inside the post: this lane's agent moved it; its reads are reported
                // now, while the other lanes still copy.
                let group = &groups[g];
                agent.completed(group.bytes);
                report(self.completions, group);
            }
            let mut st = self.state.lock();
            st.in_post -= 1;
            if !matches!(r, Ok(true)) {
                st.busy[qi] -= 1;
            }
            if r.is_err() {
                st.stop = true;
            }
            st.outcomes.push((g, r));
            drop(st);
            self.turn.notify_all();
        }
    }
}

/// Reports the reads whose last byte the ended request `group` landed.
fn report(completions: &Option<(CompletionSink, Countdown)>, group: &crate::transport::Group) {
    if let Some((sink, left)) = completions {
        for &(read, n) in &group.pieces {
            if left.landed(read as usize, n) {
                sink.complete(read as usize);
            }
        }
    }
}

impl Prepared {
    /// Releases the requests (not the lists): only when none is in progress. The next post
    /// makes them again from the prepared lists.
    fn release_requests(&self) {
        let old = self.nixl.lock().as_mut().and_then(|n| n.requests.take());
        drop(old);
    }
}

/// `e` with the quarantine note `what` appended, marked quarantined (never retryable).
fn requalify(e: Error, what: &str) -> Error {
    let mut q = Error::new(e.kind(), format!("{}; {what}", e.message())).with_backend(SCHEME);
    if let Some(o) = e.context().owner {
        q = q.with_owner(o);
    }
    if let Some(r) = e.context().range.clone() {
        q = q.with_range(r);
    }
    q.with_source(e).set_quarantined()
}

#[async_trait]
impl InFlight for NixlInFlight {
    async fn wait(mut self: Box<Self>) -> Result<WireReport> {
        self.run().await
    }

    async fn abort(mut self: Box<Self>) {
        // NIXL cannot take back a one-sided read already handed to the fabric: no further
        // request is posted from the queues, and what is in
        // flight (at most `requests_in_flight` requests per owner) is drained while it makes
        // progress.
        if self.drain().await {
            self.idle();
        } else {
            let what = self.quarantine();
            tracing::warn!(agent = %self.p.shared.name, "nixl abort: {what}");
        }
    }
}

impl Drop for NixlInFlight {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        // Dropped part-way (the handle, or a `wait`/`abort` future): no further request is
        // posted, and the reads already posted, which NIXL cannot stop, are waited out here
        // while they progress (rule 1), blocking this thread as long as the transfer of what
        // was posted takes. A batch that stops progressing for the no-progress bound goes to
        // the quarantine; a drop has no error to return, so that is logged as an error.
        if self.drain_blocking() {
            self.idle();
        } else {
            let what = self.quarantine();
            tracing::error!(agent = %self.p.shared.name, "nixl batch dropped in flight: {what}");
        }
    }
}
