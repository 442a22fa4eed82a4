//! Shutting the progress thread down: ending every batch, draining the worker, and releasing
//! UCX only once nothing can still touch the memory.

use std::time::{Duration, Instant};

use reshard_core::{Error, ErrorKind};

use super::{Engine, CONNECT_MIN, DRAIN_MAX, DRAIN_SILENCE, PROGRESS_ROUNDS};
use crate::raw;
use crate::SCHEME;

impl Engine {
    /// Ends every running batch as abort does, waits (bounded by the no-progress timer) for
    /// their gets, answers every waiter with an error, then releases UCX, unless gets remain
    /// outstanding: then everything is leaked (quarantined for the life of the process).
    pub(super) fn shutdown(mut self) {
        let stopped = |agent: &str| {
            Error::new(
                ErrorKind::Aborted,
                format!("the ucx transport of agent {agent:?} was dropped"),
            )
            .with_backend(SCHEME)
        };
        for d in std::mem::take(&mut self.deferred) {
            let _ = d.ack.send(Err(stopped(&self.agent)));
        }
        for d in std::mem::take(&mut self.deferred_prepares) {
            d.answer(Err(stopped(&self.agent)));
        }
        self.shutting_down = true;
        for c in std::mem::take(&mut self.connecting) {
            if let Some(r) = c.reply {
                let _ = r.send(Err(stopped(&self.agent)));
            }
        }
        let ids: Vec<u64> = self.running.iter().map(|r| r.id).collect();
        for id in ids {
            if let Some(run) = self.running.iter_mut().find(|r| r.id == id) {
                run.cancelled = true;
                run.signal.stop();
                if run.error.is_none() {
                    run.error = Some(stopped(&self.agent));
                }
            }
            self.close_endpoints_of(id);
        }
        while !self.running.is_empty() {
            let mut progressed = false;
            let mut rounds = 0;
            while rounds < PROGRESS_ROUNDS && self.worker.progress() {
                rounds += 1;
                progressed = true;
            }
            progressed |= self.apply_completions();
            // Finishes batches whose gets completed and quarantines those past the bound.
            self.pump();
            if !progressed {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        if self.forced_any {
            // A force-closed endpoint's peer does not learn that its reads were ended: an
            // emulated get's publisher keeps sending the replies it has queued. Destroying the
            // worker now would fail the peer's connection with replies still queued, which
            // crashes UCX 1.13's peer-failure handling there (`ucp_request_send_state_ff` of
            // a get reply, in `uct_tcp_ep_pending_purge`). So receive (and drop) them until
            // the worker is silent, bounded.
            let start = Instant::now();
            let mut last = Instant::now();
            while last.elapsed() < DRAIN_SILENCE && start.elapsed() < DRAIN_MAX {
                if self.worker.progress() {
                    last = Instant::now();
                } else {
                    std::thread::sleep(Duration::from_micros(200));
                }
                self.apply_completions();
            }
            tracing::debug!(agent = %self.agent, took = ?start.elapsed(), "ucx drained before shutdown");
        }
        // Peers' emulated reads are answered out of our regions until their replies are sent:
        // flush before anything is released (bounded; past it nothing is released).
        let mut flushed = true;
        let bound = self.opts.timeout.max(CONNECT_MIN);
        match self.worker.flush() {
            Ok(None) => {}
            Ok(Some(req)) => {
                let start = Instant::now();
                while req.status() == raw::sys::UCS_INPROGRESS {
                    if start.elapsed() > bound {
                        flushed = false;
                        break;
                    }
                    if !self.worker.progress() {
                        std::thread::sleep(Duration::from_micros(100));
                    }
                    self.apply_completions();
                }
            }
            Err(e) => {
                tracing::warn!(agent = %self.agent, error = %e, "ucx worker flush failed at shutdown");
                flushed = false;
            }
        }
        self.poll_releasing();
        if !flushed || !self.releasing.is_empty() {
            tracing::warn!(
                agent = %self.agent,
                "ucx replies to peers' reads not sent at shutdown; leaking the endpoint's resources"
            );
            drop(self.copy_pool.take());
            std::mem::forget(self);
            return;
        }
        if !self.pending.is_empty() || !self.quarantine.is_empty() {
            // UCX may still write into some buffers: never free them under it. Every waiter
            // has been answered (running batches finished or quarantined above).
            tracing::warn!(
                agent = %self.agent,
                outstanding = self.pending.len(),
                "ucx reads still outstanding at shutdown; leaking the endpoint's resources"
            );
            for q in &self.quarantine {
                q.signal.set_quiet();
            }
            drop(self.copy_pool.take());
            std::mem::forget(self);
        }
    }
}
