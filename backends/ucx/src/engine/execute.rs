//! Executing posted batches: issuing gets and direct copies, applying completions, and
//! answering batches once they are quiet.

use std::ops::Range;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use reshard_core::contract::span;
use reshard_core::progress::NoProgress;
use reshard_core::{
    CompletionSink, Error, ErrorKind, ExecutionLog, OwnerId, ReadBatch, Result, WireReport,
};

use super::mailbox::BatchHold;
use super::resolve::Resolved;
use super::{Engine, Reply, DIRECT_BYTES};
use crate::raw::{self, Request, Started, UcxStatusError};
use crate::SCHEME;

/// A posted batch being executed.
pub(super) struct Running {
    pub(super) id: u64,
    pub(super) res: Rc<Resolved>,
    pub(super) batch: Arc<ReadBatch>,
    /// Next position in `res.order`.
    pos: usize,
    pub(super) outstanding: usize,
    pub(super) error: Option<Error>,
    /// Ended by abort, a dropped handle or shutdown: issues and copies nothing more.
    pub(super) cancelled: bool,
    /// Last event of the batch: a read issued, copied or completed, or its endpoints
    /// force-closed. Once they were, no completion for the timeout quarantines it.
    pub(super) last_event: NoProgress,
    /// Its gets outstanding per owner, and since when each owner's reads last advanced: the
    /// no-progress timer while its endpoints are open (see `Engine::stalled_owners`).
    pub(super) owners: Vec<OwnerGets>,
    /// The endpoints its gets were outstanding on were force-closed: from now on only a
    /// completion counts as progress, and no progress for the timeout quarantines it.
    pub(super) closed: bool,
    pub(super) done: Option<Reply<WireReport>>,
    /// Signals the batch quiet when the running batch is dropped, which happens only once
    /// none of its gets is outstanding (quarantined batches are kept): waiters blocked on it
    /// wake however it ends.
    pub(super) signal: BatchHold,
    /// Reads and bytes of completions seen with `UCS_OK` (or copies finished), summed as
    /// they arrive: what `wait` reports.
    counted: WireReport,
    /// Pieces still to complete per read (a copy of `res.read_pieces`; empty when no read
    /// was cut).
    left: Vec<u32>,
    /// The execution log at post time, if any.
    pub(super) log: Option<Arc<ExecutionLog>>,
    /// Test-only: the read this post skips (never issued, copied, counted or recorded).
    skip: Option<u32>,
    /// Where reads are reported once their last piece completed (`Transport::post_reporting`).
    sink: Option<CompletionSink>,
}

impl Running {
    fn owner_of(&self, piece: u32) -> Option<OwnerId> {
        let read = *self.res.op_read.get(piece as usize)?;
        Some(self.batch.reads.get(read as usize)?.owner)
    }

    /// Counts piece `piece`, which completed successfully: its bytes, and its read once the
    /// read's last outstanding piece completed.
    fn complete(&mut self, piece: u32) {
        let Some(op) = self.res.ops.get(piece as usize) else {
            return;
        };
        self.counted.bytes += op.len as u64;
        let read = self.res.op_read.get(piece as usize).copied();
        let whole = if self.left.is_empty() {
            true
        } else if let Some(l) = read.and_then(|r| self.left.get_mut(r as usize)) {
            *l -= 1;
            *l == 0
        } else {
            false
        };
        if whole {
            self.counted.reads += 1;
            // Only while the batch is unanswered: once `done` is taken (answered, or handed
            // to quarantine) the batch has ended and reports nothing more.
            if let (Some(sink), Some(r), true) = (&self.sink, read, self.done.is_some()) {
                sink.complete(r as usize);
            }
        }
    }

    /// Whether `piece` belongs to the read fault injection skips.
    fn skipped(&self, piece: u32) -> bool {
        self.skip.is_some() && self.res.op_read.get(piece as usize).copied() == self.skip
    }
}

/// The gets one running batch has outstanding on one owner.
pub(super) struct OwnerGets {
    pub(super) owner: OwnerId,
    pub(super) outstanding: usize,
    /// When the batch's reads of this owner last advanced: one of its gets on the owner
    /// completed, or the first of them was issued while none was outstanding.
    pub(super) since: Instant,
}

impl Running {
    /// Counts a get on `owner` issued at `now`.
    fn owner_issued(&mut self, owner: OwnerId, now: Instant) {
        match self.owners.iter_mut().find(|o| o.owner == owner) {
            Some(o) => {
                if o.outstanding == 0 {
                    o.since = now;
                }
                o.outstanding += 1;
            }
            None => self.owners.push(OwnerGets {
                owner,
                outstanding: 1,
                since: now,
            }),
        }
    }

    /// Counts a get on `owner` that completed at `now` (with any status).
    fn owner_completed(&mut self, owner: OwnerId, now: Instant) {
        if let Some(o) = self.owners.iter_mut().find(|o| o.owner == owner) {
            o.outstanding = o.outstanding.saturating_sub(1);
            o.since = now;
        }
    }
}

/// An outstanding read piece: its batch, its piece index and the request to free once complete.
pub(super) struct PendingRead {
    pub(super) batch: u64,
    pub(super) owner: OwnerId,
    /// Index into the batch's `Resolved::ops`.
    pub(super) piece: u32,
    req: Request,
}

impl Engine {
    /// Local byte ranges quarantined batches' outstanding gets may still write.
    fn quarantined_ranges(&self) -> Vec<Range<usize>> {
        let mut v = Vec::new();
        for q in &self.quarantine {
            for p in self.pending.values().filter(|p| p.batch == q.id) {
                if let Some(op) = q.res.ops.get(p.piece as usize) {
                    let s = op.local as usize;
                    v.push(s..s + op.len);
                }
            }
        }
        v
    }

    pub(super) fn post(
        &mut self,
        prepared: u64,
        batch: u64,
        signal: BatchHold,
        done: Reply<WireReport>,
        sink: Option<CompletionSink>,
    ) -> Result<()> {
        let (batch_arc, cached) = {
            let entry = self.prepared.get(&prepared).ok_or_else(|| {
                Error::new(
                    ErrorKind::Internal,
                    "prepared batch is unknown to this ucx endpoint",
                )
                .with_backend(SCHEME)
            })?;
            (Arc::clone(&entry.batch), entry.resolved.clone())
        };
        let res = match cached {
            Some(r) => r,
            None => {
                // Registrations or peers changed since prepare: resolve (and validate) again.
                let r = Rc::new(self.translate(&batch_arc)?);
                if let Some(e) = self.prepared.get_mut(&prepared) {
                    e.resolved = Some(Rc::clone(&r));
                }
                r
            }
        };
        let quarantined = self.quarantined_ranges();
        if !quarantined.is_empty() {
            for (piece, op) in res.ops.iter().enumerate() {
                let s = op.local as usize;
                if quarantined
                    .iter()
                    .any(|q| q.start < s + op.len && s < q.end)
                {
                    let read = res.op_read[piece] as usize;
                    let r = &batch_arc.reads[read];
                    return Err(Error::new(
                        ErrorKind::Transport,
                        format!(
                            "read {read} writes local bytes {}..{} of region {}, which reads of \
                             an earlier batch that could not be stopped may still write \
                             (quarantined)",
                            r.local_offset,
                            r.local_offset + r.len,
                            r.local_region
                        ),
                    )
                    .with_owner(r.owner)
                    .with_range(span(r.remote_offset, r.remote_span().unwrap_or(r.len)))
                    .with_backend(SCHEME)
                    .set_quarantined());
                }
            }
        }
        #[cfg(feature = "fault-injection")]
        let skip = self.opts.skip_read.get();
        #[cfg(not(feature = "fault-injection"))]
        let skip = None;
        let left = res.read_pieces.clone();
        let mut run = Running {
            counted: WireReport::default(),
            left,
            log: self.opts.log.lock().clone(),
            skip,
            sink,
            id: batch,
            res,
            batch: batch_arc,
            pos: 0,
            outstanding: 0,
            error: None,
            cancelled: false,
            last_event: NoProgress::new(),
            owners: Vec::new(),
            closed: false,
            done: Some(done),
            signal,
        };
        // Issue the first window now, so every owner's reads are started before post returns.
        self.issue(&mut run);
        self.running.push(run);
        Ok(())
    }

    /// Issues reads of `run` until its in-flight cap, its end, or a budget of
    /// one cap's worth of reads or [`DIRECT_BYTES`] of direct copies (so reads completing in
    /// place cannot starve the mailbox).
    fn issue(&mut self, run: &mut Running) -> bool {
        if run.signal.stopping() {
            run.cancelled = true;
        }
        let cap = self.opts.reads_in_flight;
        let mut issued = 0;
        let mut copied = 0;
        while run.error.is_none() && !run.cancelled {
            if run.pos == run.res.order.len() {
                break;
            }
            if run.outstanding >= cap || issued >= cap || copied >= DIRECT_BYTES {
                break;
            }
            let piece = run.res.order[run.pos];
            if run.skipped(piece) {
                run.pos += 1;
                continue;
            }
            if !run.res.ops[piece as usize].direct.is_null() {
                let (n, bytes) = self.copy_direct(run, cap - issued);
                issued += n;
                copied += bytes;
                continue;
            }
            run.pos += 1;
            issued += 1;
            let token = self.next_token;
            self.next_token += 1;
            if run.log.is_some() {
                self.record(run, piece);
            }
            let op = &run.res.ops[piece as usize];
            // SAFETY: `op` was resolved from objects `run.res` keeps alive (endpoint, remote
            // key, local registration and its block) until the read completes: the running
            // batch is only dropped once none of its reads is outstanding (else it is kept in
            // quarantine). Its endpoint is not closed: a forced close bumps the epoch (so no
            // later post uses a resolved form holding it) and stops every running batch using
            // it (`error` set, checked above). The local range was checked inside a registered
            // block, and destinations of one batch are disjoint (validated at prepare), so no
            // two outstanding reads write the same memory.
            match unsafe { raw::get(self.ucx, op, token) } {
                Started::Done => run.complete(piece),
                Started::Pending(req) => {
                    let owner = run.owner_of(piece).unwrap_or_default();
                    run.owner_issued(owner, Instant::now());
                    self.pending.insert(
                        token,
                        PendingRead {
                            batch: run.id,
                            owner,
                            piece,
                            req,
                        },
                    );
                    run.outstanding += 1;
                }
                Started::Failed(e) => {
                    run.error = Some(read_error(run, piece, e));
                }
            }
        }
        if issued > 0 {
            run.last_event.progressed(Instant::now());
        }
        issued > 0
    }

    /// Copies the direct reads of `run` from its position on (at most `max` of them, within
    /// its generation, up to [`DIRECT_BYTES`]) over the copy pool; returns how many, and their
    /// bytes.
    ///
    /// They complete before this returns, so they are never outstanding. The byte cap keeps
    /// the thread answering its mailbox (aborts, other batches) between chunks, and the
    /// batch's stop flag (set by abort or a dropped handle, from any thread) is checked before
    /// every piece of the copy.
    fn copy_direct(&mut self, run: &mut Running, max: usize) -> (usize, usize) {
        let mut tasks = Vec::new();
        let mut copied = Vec::new();
        let mut bytes = 0;
        while run.pos < run.res.order.len() && tasks.len() < max.max(1) && bytes < DIRECT_BYTES {
            let piece = run.res.order[run.pos];
            if run.skipped(piece) {
                run.pos += 1;
                continue;
            }
            let op = &run.res.ops[piece as usize];
            if op.direct.is_null() {
                break;
            }
            if run.log.is_some() {
                self.record(run, piece);
            }
            let op = &run.res.ops[piece as usize];
            copied.push(piece);
            tasks.push(raw::CopyTask {
                dst: op.local,
                src: op.direct,
                len: op.len,
                rows: op.rows,
                read: run.res.op_read[piece as usize],
                off: run.res.op_off[piece as usize],
            });
            bytes += op.len;
            run.pos += 1;
        }
        let threads = self.opts.copy_threads;
        if threads > 1 && self.copy_pool.is_none() && !tasks.is_empty() {
            match rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("ucx-copy-{i}"))
                .build()
            {
                Ok(p) => self.copy_pool = Some(p),
                // Without threads the copy still happens, on this thread.
                Err(e) => tracing::warn!(agent = %self.agent, error = %e, "no ucx copy pool"),
            }
        }
        // SAFETY: every task is a resolved direct read of `run`: its source lies inside a
        // shared-memory segment mapped for a remote key `run.res` keeps alive (checked against
        // this process's mappings in `translate`), its destination inside a live local
        // registration. Reads of one batch have pairwise disjoint destinations (validated at
        // prepare), and no other read of this batch is outstanding on those bytes, so the
        // copies are independent.
        // With a hash plan in the sink the copy hashes each block's digest segments as it
        // lands; every hash of a piece is stored before `copy_all` returns, so before its read
        // is reported below.
        let all = unsafe {
            raw::copy_all(
                self.copy_pool.as_ref(),
                &tasks,
                &run.signal.stop,
                run.sink.as_ref(),
            )
        };
        if all {
            for piece in copied {
                run.complete(piece);
            }
        } else {
            // Stopped part-way: the batch was ended by its handle.
            run.cancelled = true;
        }
        (tasks.len(), bytes)
    }

    /// Applies the statuses callbacks queued; true when there were any.
    pub(super) fn apply_completions(&mut self) -> bool {
        raw::take_completions(&mut self.completions);
        if self.completions.is_empty() {
            return false;
        }
        let now = Instant::now();
        for (token, status) in std::mem::take(&mut self.completions) {
            let Some(p) = self.pending.remove(&token) else {
                continue;
            };
            let PendingRead {
                batch,
                owner,
                piece,
                req,
            } = p;
            // The read is complete: it writes nothing more, and the request goes back to UCX.
            drop(req);
            if let Some(run) = self.running.iter_mut().find(|r| r.id == batch) {
                run.outstanding -= 1;
                run.last_event.progressed(now);
                run.owner_completed(owner, now);
                if status == raw::sys::UCS_OK {
                    // The link to this owner moves bytes: progress for every batch reading
                    // through this endpoint (their gets queue behind this one's).
                    if let Some(peer) = run.res.peers.get(&owner) {
                        peer.last_completion.set(Some(now));
                    }
                }
                if status == raw::sys::UCS_OK {
                    run.complete(piece);
                }
                // After abort or a forced close, failures are the expected way gets end.
                if status != raw::sys::UCS_OK && !run.cancelled && run.error.is_none() {
                    let e = UcxStatusError::new("ucp_get_nbx", status);
                    run.error = Some(read_error(run, piece, e));
                }
            } else if let Some(i) = self.quarantine.iter().position(|r| r.id == batch) {
                let q = &mut self.quarantine[i];
                q.outstanding -= 1;
                if q.outstanding == 0 {
                    tracing::info!(
                        agent = %self.agent,
                        batch,
                        "quarantined ucx reads completed; releasing their memory"
                    );
                    self.quarantine.swap_remove(i);
                }
            }
        }
        true
    }

    /// Issues more reads, finishes completed batches and enforces the no-progress bound;
    /// true on work.
    ///
    /// A batch with gets outstanding on an owner whose reads made no progress for the
    /// timeout first fails with `Timeout` naming that owner and has its endpoints
    /// force-closed; if its gets still do not complete within another no-progress timeout,
    /// it is quarantined.
    pub(super) fn pump(&mut self) -> bool {
        let mut worked = false;
        let mut runs = std::mem::take(&mut self.running);
        let now = Instant::now();
        let mut to_close = Vec::new();
        let mut to_quarantine = Vec::new();
        for run in &mut runs {
            // Nobody can wait for or abort a batch whose post was given up: end it.
            if !run.cancelled && run.done.as_ref().is_some_and(|d| d.is_closed()) {
                run.cancelled = true;
                run.signal.stop();
                to_close.push(run.id);
            }
            worked |= self.issue(run);
            if run.outstanding == 0 {
                continue;
            }
            if !run.closed {
                let stalled = self.stalled_owners(run, now);
                if !stalled.is_empty() {
                    if run.error.is_none() && !run.cancelled {
                        run.error = Some(self.timeout_error(run, &stalled));
                    }
                    to_close.push(run.id);
                }
            } else if run.last_event.idle(now) > self.opts.timeout {
                to_quarantine.push(run.id);
            }
        }
        runs.append(&mut self.running);
        self.running = runs;
        for id in to_close {
            self.close_endpoints_of(id);
            worked = true;
        }
        for id in to_quarantine {
            self.quarantine_batch(id);
            worked = true;
        }
        let mut keep = Vec::with_capacity(self.running.len());
        for mut run in std::mem::take(&mut self.running) {
            let total = run.res.order.len();
            let finished =
                run.outstanding == 0 && (run.error.is_some() || run.cancelled || run.pos == total);
            if !finished {
                keep.push(run);
                continue;
            }
            worked = true;
            let result = match (run.error.take(), run.cancelled) {
                (Some(e), _) => Err(e),
                (None, true) => {
                    Err(Error::new(ErrorKind::Aborted, "ucx batch aborted").with_backend(SCHEME))
                }
                (None, false) => Ok(run.counted),
            };
            // Quiet first (no get is outstanding), so a waiter's drop returns at once.
            run.signal.set_quiet();
            if let Some(done) = run.done.take() {
                let _ = done.send(result);
            }
        }
        self.running = keep;
        worked
    }
}

/// The public error of a failed read: UCX's status plus the read's owner and remote range.
pub(super) fn read_error(run: &Running, piece: u32, e: UcxStatusError) -> Error {
    let mut err = Error::from(e);
    let read = run.res.op_read.get(piece as usize);
    if let Some(r) = read.and_then(|&i| run.batch.reads.get(i as usize)) {
        err = err
            .with_owner(r.owner)
            .with_range(span(r.remote_offset, r.remote_span().unwrap_or(r.len)));
    }
    err
}
