//! Posting a prepared batch to the progress thread and [`UcxInFlight`], the handle that waits
//! for or aborts it.

use async_trait::async_trait;
use reshard_core::{
    prepared, CompletionSink, Error, ErrorKind, InFlight, PreparedBatch, Result, WireReport,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::oneshot;

use super::*;

impl UcxTransport {
    /// Posts `prepared`, reporting each read to `sink` once its last piece completed.
    pub(super) async fn post_with(
        &self,
        prepared: &PreparedBatch,
        sink: Option<CompletionSink>,
    ) -> Result<Box<dyn InFlight>> {
        let token = prepared::own_state::<PreparedToken>(
            SCHEME,
            prepared,
            |t| t.uid == self.uid,
            "ucx endpoint",
            "ucx agent",
            &self.agent,
        )?;
        let batch = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (done_tx, done_rx) = oneshot::channel();
        let signal = BatchSignal::new();
        // The handle exists before the batch reaches the progress thread: if this future is
        // dropped while it awaits the thread's answer, the handle's drop ends the batch as
        // abort does and waits until it is quiet, so nothing keeps running that no one waits
        // for (docs/in-flight-safety.md, rule 1). A batch the thread never starts is quiet
        // as soon as the thread lets go of its post (see `BatchHold`).
        let mut handle = UcxInFlight {
            agent: self.agent.clone(),
            mailbox: self.mailbox.clone(),
            batch,
            signal: Arc::clone(&signal),
            done: Some(done_rx),
        };
        let started = self
            .ask(|ack| Cmd::Post {
                prepared: token.id,
                batch,
                signal: BatchHold::new(signal),
                ack,
                done: done_tx,
                sink,
            })
            .await;
        match started {
            Ok(()) => Ok(Box::new(handle)),
            Err(e) => {
                // The thread refused the post before issuing anything, or has stopped (after
                // ending every batch): nothing of it runs, so there is nothing to end.
                handle.done = None;
                Err(e)
            }
        }
    }
}

/// A posted batch: its reads run on the progress thread; this waits for or aborts them.
///
/// `post` makes it before it sends the batch to the progress thread, so a `post` future
/// dropped before the thread answered ends the batch through this handle's `Drop` too.
///
/// The progress thread answers `done` only once the batch is quiet (no get outstanding, no
/// copy running) or quarantined, so a returned `wait` or `abort` ends the batch. Both futures
/// keep `done` in `self` while they await it: dropping either part-way drops `self`, whose
/// `Drop` ends the batch as abort does and blocks until the thread reports it quiet.
struct UcxInFlight {
    agent: String,
    mailbox: Mailbox,
    batch: u64,
    signal: Arc<BatchSignal>,
    /// `None` once the batch has ended (answered).
    done: Option<oneshot::Receiver<Result<WireReport>>>,
}

#[async_trait]
impl InFlight for UcxInFlight {
    async fn wait(mut self: Box<Self>) -> Result<WireReport> {
        let Some(rx) = self.done.as_mut() else {
            return Err(
                Error::new(ErrorKind::Internal, "batch already waited for").with_backend(SCHEME)
            );
        };
        // Cancel-safe: `rx` stays in `self` until it answered.
        let r = rx.await;
        self.done = None;
        r.map_err(|_| stopped(&self.agent))?
    }

    async fn abort(mut self: Box<Self>) {
        self.signal.stop();
        if let Some(rx) = self.done.as_mut() {
            self.mailbox.send(Cmd::Cancel { batch: self.batch });
            // Answered only once no read of the batch can land any more (or they were
            // quarantined). Dropped part-way, `Drop` waits instead.
            let _ = rx.await;
            self.done = None;
        }
    }
}

impl Drop for UcxInFlight {
    /// Dropped before the batch ended (without `wait`/`abort`, with their futures dropped
    /// part-way, or with the `post` future before it answered): ends it as abort does and
    /// blocks until the progress thread reports it quiet (at once for a batch it never
    /// started). That takes as long as ending its gets (microseconds to milliseconds after the
    /// forced close) and is bounded by the no-progress timer, past which the batch is
    /// quarantined and the wait ends; on a multi-thread runtime the wait runs in
    /// `block_in_place`.
    fn drop(&mut self) {
        if self.done.take().is_none() {
            return;
        }
        self.signal.stop();
        if !self.mailbox.send(Cmd::Cancel { batch: self.batch }) {
            // The thread has stopped: it answered and ended every batch before it did.
            return;
        }
        let (signal, alive) = (&self.signal, self.mailbox.alive());
        if !blocking(|| signal.wait_quiet(alive)) {
            tracing::error!(
                agent = %self.agent,
                batch = self.batch,
                "ucx progress thread died before the dropped batch was quiet"
            );
        }
    }
}
