//! Posted batches: copy jobs on the transport's worker pool and the [`InFlight`] handle that
//! waits for or aborts them. This is the only module with `unsafe`.

use async_trait::async_trait;
use rayon::ThreadPool;
use reshard_core::gate::BatchGate;
use reshard_core::{
    CompletionSink, Countdown, Error, ErrorKind, InFlight, MemoryBlock, OwnerId, Result, WireReport,
};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::oneshot;

use crate::transport::Prepared;
use crate::work::Piece;
use crate::SCHEME;

/// Bytes copied between two looks at the abort flag.
pub(crate) const COPY_CHUNK: u64 = 1 << 20;

/// Bytes copied between two hashing steps when the batch carries a hash plan: small enough
/// that a block is still in this core's cache when its segments are hashed right after
/// (docs/in-flight-safety.md, "Hashing while copying").
pub(crate) const HASH_BLOCK: u64 = 256 << 10;

/// A region resolved at post time: the live block and the owner it belongs to.
pub(crate) struct Live {
    pub(crate) owner: Option<OwnerId>,
    pub(crate) addr: usize,
    /// Kept so the memory outlives every job that copies from or into it.
    pub(crate) _block: Arc<dyn MemoryBlock>,
}

/// Everything the jobs of one post share.
pub(crate) struct PostCtx {
    pub(crate) prepared: Arc<Prepared>,
    /// Indexed by `Piece::src`; every piece's source range lies inside its block (checked at post).
    pub(crate) srcs: Vec<Live>,
    /// Indexed by `Piece::dst`; likewise for destinations.
    pub(crate) dsts: Vec<Live>,
    pub(crate) abort: Arc<AtomicBool>,
    /// Makes "the batch is over" exact (docs/in-flight-safety.md, rule 1): a job enters (under
    /// its work list's index) before its first memory access and leaves after its last, and
    /// ending the batch closes the gate and waits for the jobs inside. The abort flag, checked
    /// between chunks, keeps that wait to at most one chunk ([`COPY_CHUNK`]) per running job.
    pub(crate) gate: Arc<BatchGate>,
    /// Where reads are reported as their last byte lands (`Transport::post_reporting`), with
    /// the bytes each read still waits for: a read split between workers completes when the
    /// piece that lands its last byte finishes, whichever worker runs it.
    pub(crate) completions: Option<(CompletionSink, Countdown)>,
    /// Test-only: the read whose pieces are silently skipped.
    #[cfg(feature = "fault-injection")]
    pub(crate) skip_read: Option<u32>,
    #[cfg(test)]
    pub(crate) faults: crate::transport::Faults,
}

/// What a job copied: the reads it finished (their last piece) and the bytes of its pieces.
type JobResult = Result<WireReport>;

/// Starts one job per work list on `pool` and returns the handle that waits for them.
pub(crate) fn start(pool: &Arc<ThreadPool>, ctx: PostCtx) -> LoopbackInFlight {
    let ctx = Arc::new(ctx);
    let mut jobs = Vec::with_capacity(ctx.prepared.work.len());
    for w in 0..ctx.prepared.work.len() {
        let (tx, rx) = oneshot::channel::<JobResult>();
        let ctx = Arc::clone(&ctx);
        pool.spawn(move || {
            let _ = tx.send(run_job(&ctx, w));
        });
        jobs.push(rx);
    }
    LoopbackInFlight {
        abort: Arc::clone(&ctx.abort),
        gate: Arc::clone(&ctx.gate),
        jobs,
        counted: WireReport::default(),
        finished: false,
        _pool: Arc::clone(pool),
    }
}

fn piece_error(ctx: &PostCtx, p: &Piece, kind: ErrorKind, msg: String) -> Error {
    let mut e = Error::new(kind, msg)
        .with_backend(SCHEME)
        .with_range(p.src_off..p.src_off + p.len);
    if let Some(o) = ctx.srcs[p.src as usize].owner {
        e = e.with_owner(o);
    }
    e
}

/// Runs work list `w`; a panic becomes a `Transport` error naming the piece it hit.
fn run_job(ctx: &PostCtx, w: usize) -> JobResult {
    let pieces = &ctx.prepared.work[w];
    if !ctx.gate.lock().enter(w) {
        let p = &pieces[0];
        return Err(piece_error(
            ctx,
            p,
            ErrorKind::Aborted,
            "read aborted".into(),
        ));
    }
    let at = Cell::new(0usize);
    let r = catch_unwind(AssertUnwindSafe(|| copy_pieces(ctx, pieces, &at)));
    ctx.gate.lock().leave(w);
    if !matches!(r, Ok(Ok(_))) {
        // The batch has failed: the other lists stop at their next chunk, and the ones still
        // queued at their first, instead of copying to the end before `wait` hears of it.
        ctx.abort.store(true, Ordering::Release);
    }
    match r {
        Ok(r) => r,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            let p = pieces[at.get().min(pieces.len().saturating_sub(1))];
            Err(piece_error(
                ctx,
                &p,
                ErrorKind::Transport,
                format!("loopback copy worker panicked: {what}"),
            )
            .set_retryable(false))
        }
    }
}

fn copy_pieces(ctx: &PostCtx, pieces: &[Piece], at: &Cell<usize>) -> JobResult {
    let mut counted = WireReport::default();
    for (k, p) in pieces.iter().enumerate() {
        at.set(k);
        #[cfg(feature = "fault-injection")]
        if ctx.skip_read == Some(p.read) {
            continue;
        }
        #[cfg(test)]
        ctx.faults.before_piece(k, p.read, p.off);
        let src_base = ctx.srcs[p.src as usize].addr;
        let dst = ctx.dsts[p.dst as usize].addr + p.dst_off as usize;
        let mut hasher = ctx
            .completions
            .as_ref()
            .and_then(|(sink, _)| sink.piece_hasher(p.read as usize, p.off));
        let block = if hasher.is_some() {
            HASH_BLOCK
        } else {
            COPY_CHUNK
        };
        let mut done = 0u64;
        while done < p.len {
            if ctx.abort.load(Ordering::Acquire) {
                // Retryable: the gate guarantees nothing of this batch runs once it is over.
                let e = piece_error(ctx, p, ErrorKind::Aborted, "read aborted".into());
                return Err(e.set_retryable(true));
            }
            let n = (p.len - done).min(block);
            // One run for a plain piece; one per row (or row fragment) for a gather.
            for (src_off, at, len) in p.src_runs(done, done + n) {
                let n = len as usize;
                let s = (src_base + src_off as usize) as *const u8;
                let d = (dst + at as usize) as *mut u8;
                if (s as usize) < (d as usize) + n && (d as usize) < (s as usize) + n {
                    // SAFETY: `post` checked that this piece's source range (a gather's whole
                    // span) and destination range lie inside live registered blocks, which
                    // `ctx` keeps alive (the `Arc`s in `Live`) and whose addresses are stable
                    // for their whole life (MemoryBlock contract). The ranges overlap here (a
                    // read within one block, or aliased blocks), so the overlap-tolerant `copy`
                    // is used. No one else writes the destination while the batch is in flight
                    // (MemoryBlock and ReadBatch contracts).
                    unsafe { std::ptr::copy(s, d, n) };
                } else {
                    // SAFETY: as above (both ranges inside live, registered, stable blocks kept
                    // alive by `ctx`; the destination is not accessed by anyone else while in
                    // flight), and the two ranges were just checked not to overlap.
                    unsafe { std::ptr::copy_nonoverlapping(s, d, n) };
                }
            }
            done += n;
            if let Some(h) = &mut hasher {
                // SAFETY: the piece's first `done` destination bytes lie inside a live
                // registered block kept alive by `ctx` (checked at post); this thread has just
                // written them and no one else writes them while the batch is in flight
                // (destinations of one batch are disjoint), so a shared view is sound. The
                // hashes are of the bytes as they landed, read back after the copy.
                let landed = unsafe { std::slice::from_raw_parts(dst as *const u8, done as usize) };
                h.landed(landed);
            }
        }
        // The piece is complete: count its bytes, and its read once its last piece is done.
        counted.bytes += done;
        counted.reads += u64::from(p.last);
        // Still inside the gate: a report never follows the end of the batch.
        if let Some((sink, left)) = &ctx.completions {
            if left.landed(p.read as usize, done) {
                sink.complete(p.read as usize);
            }
        }
    }
    Ok(counted)
}

/// A posted loopback batch: every job is already queued on the worker pool.
pub(crate) struct LoopbackInFlight {
    abort: Arc<AtomicBool>,
    gate: Arc<BatchGate>,
    jobs: Vec<oneshot::Receiver<JobResult>>,
    /// Reads and bytes the jobs that finished so far reported, summed as they arrive.
    counted: WireReport,
    /// Every job reported: nothing of the batch can run any more.
    finished: bool,
    /// The pool outlives its queued jobs even if the transport is dropped meanwhile.
    _pool: Arc<ThreadPool>,
}

impl LoopbackInFlight {
    /// Awaits every job; returns the first real failure (an abort caused by another failure
    /// is not reported in its place).
    ///
    /// Cancel-safe: the receivers stay in `self.jobs` until they answer, so a future dropped
    /// part-way leaves `finished` false and `Drop` ends the batch.
    async fn join(&mut self) -> Result<()> {
        let mut first: Option<Error> = None;
        while let Some(rx) = self.jobs.last_mut() {
            let r = rx.await;
            self.jobs.pop();
            let r = match r {
                Ok(Ok(c)) => {
                    self.counted.reads += c.reads;
                    self.counted.bytes += c.bytes;
                    Ok(())
                }
                Ok(Err(e)) => Err(e),
                Err(_) => Err(Error::new(
                    ErrorKind::Transport,
                    "loopback copy job ended without reporting",
                )
                .with_backend(SCHEME)),
            };
            if let Err(e) = r {
                // Stop the other jobs early: the batch has failed.
                self.abort.store(true, Ordering::Release);
                let replace = match &first {
                    None => true,
                    Some(f) => f.kind() == ErrorKind::Aborted && e.kind() != ErrorKind::Aborted,
                };
                if replace {
                    first = Some(e);
                }
            }
        }
        self.finished = true;
        first.map_or(Ok(()), Err)
    }
}

#[async_trait]
impl InFlight for LoopbackInFlight {
    async fn wait(mut self: Box<Self>) -> Result<WireReport> {
        self.join().await?;
        Ok(self.counted)
    }

    async fn abort(mut self: Box<Self>) {
        self.abort.store(true, Ordering::Release);
        // Every job reports after its last memory access, so once all have reported (or
        // vanished) nothing touches the buffers any more.
        let _ = self.join().await;
    }
}

impl Drop for LoopbackInFlight {
    fn drop(&mut self) {
        // Dropped without wait/abort, or with their future dropped part-way: stop at the next
        // chunk and block until the running jobs have left the gate (at most one chunk each,
        // a fraction of a millisecond), so no byte lands after the drop (rule 1).
        if !self.finished {
            self.abort.store(true, Ordering::Release);
            self.gate.close_and_wait();
        }
    }
}
