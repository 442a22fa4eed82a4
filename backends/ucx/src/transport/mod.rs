//! [`UcxTransport`]: the async face of one UCX endpoint. It owns the endpoint's progress
//! thread (see `engine`), forwards every operation to it and awaits the answer.
//!
//! This file owns the endpoint itself (constructor, the mailbox round trip, drop); the rest is
//! split by concern:
//! - `trait_impl`: the [`Transport`] impl;
//! - `post`: posting a prepared batch and the in-flight handle that waits for or aborts it;
//! - `tests`: unit tests that need the progress thread's test hooks.

mod post;
#[cfg(test)]
mod tests;
mod trait_impl;

use parking_lot::Mutex;
use reshard_core::{Error, ErrorKind, OwnerId, Result, Transport};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::oneshot;

use crate::alloc::{Allocation, UcxHostMemory};
use crate::engine::{self, BatchHold, BatchSignal, Cmd, EngineOptions, LogSlot, Mailbox};
use crate::meta::EndpointMeta;
use crate::options::UcxOptions;
use crate::raw::{self, Context, ContextOptions};
use crate::SCHEME;

/// Distinguishes endpoints of this process, so a batch prepared by one is refused by another.
static NEXT_UID: AtomicU64 = AtomicU64::new(1);

/// One UCX endpoint (a UCP context and worker driven by a dedicated progress thread),
/// implementing the core transport contract with one-sided `ucp_get_nbx` reads.
pub struct UcxTransport {
    agent: String,
    uid: u64,
    /// This endpoint's incarnation (in its metadata).
    incarnation: u64,
    /// The incarnation of the metadata last loaded per owner.
    peer_incarnations: Mutex<std::collections::HashMap<OwnerId, u64>>,
    options: UcxOptions,
    mailbox: Mailbox,
    epoch: Arc<AtomicU64>,
    vram: bool,
    next_id: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The process-wide context of this configuration (shared with the progress thread).
    ctx: Arc<Context>,
    /// The execution log, read by the progress thread at every post.
    log: LogSlot,
    /// Test-only: the read every post skips (shared with the progress thread).
    #[cfg(feature = "fault-injection")]
    skip_read: reshard_core::fault::SkipRead,
}

/// The UCX state of a [`PreparedBatch`]: which endpoint resolved it and under which id its
/// descriptors live on the progress thread (forgotten there when this drops).
struct PreparedToken {
    uid: u64,
    id: u64,
    mailbox: Mailbox,
}

impl Drop for PreparedToken {
    fn drop(&mut self) {
        self.mailbox.send(Cmd::Forget { id: self.id });
    }
}

fn stopped(agent: &str) -> Error {
    Error::new(
        ErrorKind::Transport,
        format!("the ucx progress thread of agent {agent:?} has stopped"),
    )
    .with_backend(SCHEME)
}

impl UcxTransport {
    /// Creates endpoint `agent` with `options`: loads UCX (`Unavailable` when it is not
    /// installed), creates the context and worker and starts the progress thread.
    pub fn new(agent: &str, options: UcxOptions) -> Result<Self> {
        options.validate()?;
        if agent.is_empty() || agent.len() > u16::MAX as usize {
            return Err(Error::new(
                ErrorKind::Config,
                format!("ucx agent names must be 1..={} bytes", u16::MAX),
            )
            .with_backend(SCHEME));
        }
        let epoch = Arc::new(AtomicU64::new(1));
        let log = LogSlot::default();
        #[cfg(feature = "fault-injection")]
        let skip_read = reshard_core::fault::SkipRead::default();
        let ctx = Context::shared(
            raw::lib()?,
            &ContextOptions {
                tls: options.tls.clone(),
                net_devices: options.net_devices.clone(),
                name: "reshard".to_owned(),
            },
        )?;
        let incarnation = reshard_core::new_incarnation();
        let spawned = engine::start(
            agent,
            EngineOptions {
                context: Arc::clone(&ctx),
                incarnation,
                reads_in_flight: options.reads_in_flight,
                timeout: Duration::from_millis(options.timeout_ms),
                piece_bytes: options.piece_bytes,
                copy_threads: options.effective_copy_threads(),
                shm_fast_path: options.shm_fast_path,
                log: Arc::clone(&log),
                #[cfg(feature = "fault-injection")]
                skip_read: skip_read.clone(),
            },
            Arc::clone(&epoch),
        )?;
        Ok(UcxTransport {
            agent: agent.to_owned(),
            uid: NEXT_UID.fetch_add(1, Ordering::Relaxed),
            incarnation,
            peer_incarnations: Mutex::new(std::collections::HashMap::new()),
            options,
            mailbox: spawned.mailbox,
            epoch,
            vram: spawned.vram,
            next_id: AtomicU64::new(1),
            thread: Mutex::new(Some(spawned.thread)),
            ctx,
            log,
            #[cfg(feature = "fault-injection")]
            skip_read,
        })
    }

    /// Test-only fault injection (feature `fault-injection`, off by default): while set to
    /// `Some(i)`, every `post` silently skips read `i` of its batch (none of its pieces is
    /// issued, copied, counted in the [`WireReport`] or recorded in the execution log), as a
    /// backend that loses a read would. Reads are numbered in batch order.
    #[cfg(feature = "fault-injection")]
    pub fn inject_skip_read(&self, read: Option<usize>) {
        self.skip_read.set(read);
    }

    /// The options this endpoint runs with.
    pub fn options(&self) -> &UcxOptions {
        &self.options
    }

    /// Sends a command built around a reply channel and awaits the answer.
    async fn ask<T>(&self, cmd: impl FnOnce(oneshot::Sender<Result<T>>) -> Cmd) -> Result<T> {
        let (tx, rx) = oneshot::channel();
        if !self.mailbox.send(cmd(tx)) {
            return Err(stopped(&self.agent));
        }
        rx.await.map_err(|_| stopped(&self.agent))?
    }
}

/// Runs `f`, which blocks, letting a multi-thread tokio runtime move its other tasks off this
/// worker thread meanwhile (`block_in_place`); elsewhere (no runtime, a current-thread
/// runtime) `f` simply runs.
pub(crate) fn blocking<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

impl Drop for UcxTransport {
    /// Stops the progress thread: it ends every running batch as abort does (answering its
    /// waiters with an error), waits for their gets within the no-progress bound (quarantining
    /// and leaking what does not finish) and releases UCX.
    ///
    /// Blocks (through [`blocking`] on a multi-thread runtime) until the thread has exited,
    /// for at most twice the timeout plus a grace second; past that the thread finishes
    /// releasing in the background (it keeps every buffer a read may still touch alive).
    fn drop(&mut self) {
        self.mailbox.shutdown();
        let Some(t) = self.thread.lock().take() else {
            return;
        };
        let bound = Duration::from_millis(self.options.timeout_ms.saturating_mul(2))
            + Duration::from_secs(1);
        let alive = self.mailbox.alive();
        let exited = blocking(|| {
            let start = std::time::Instant::now();
            while alive.load(Ordering::Acquire) {
                if start.elapsed() > bound {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            true
        });
        if !exited {
            tracing::warn!(
                agent = %self.agent,
                "ucx progress thread still ending batches; finishing in the background"
            );
            return;
        }
        if t.join().is_err() {
            tracing::warn!(agent = %self.agent, "ucx progress thread panicked");
        }
    }
}

impl fmt::Debug for UcxTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UcxTransport")
            .field("agent", &self.agent)
            .field("epoch", &self.epoch())
            .field("options", &self.options)
            .finish()
    }
}
