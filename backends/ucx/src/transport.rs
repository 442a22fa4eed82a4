//! [`UcxTransport`]: the async face of one UCX endpoint. It owns the endpoint's progress
//! thread (see `engine`), forwards every operation to it and awaits the answer.

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;
use reshard_core::{
    prepared, Capability, CompletionSink, Error, ErrorKind, ExecutionLog, HostMemory, InFlight,
    MemoryBlock, OwnerId, PreparedBatch, ReadBatch, Registration, Result, Transport, WireReport,
};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::oneshot;

use crate::alloc::{Allocation, UcxHostMemory};
use crate::config::UcxOptions;
use crate::engine::{self, BatchHold, BatchSignal, Cmd, EngineOptions, LogSlot, Mailbox};
use crate::meta::EndpointMeta;
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

#[async_trait]
impl Transport for UcxTransport {
    fn name(&self) -> &'static str {
        SCHEME
    }

    fn agent(&self) -> &str {
        &self.agent
    }

    fn capabilities(&self) -> Capability {
        Capability {
            one_sided_read: true,
            one_sided_write: false,
            vram: self.vram,
            cross_process: true,
            max_reads_per_post: None,
        }
    }

    fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    fn incarnation(&self) -> u64 {
        self.incarnation
    }

    fn peer_incarnation(&self, owner: OwnerId) -> Option<u64> {
        self.peer_incarnations.lock().get(&owner).copied()
    }

    /// Shared memory allocated by UCX (`ucp_mem_map` with `UCP_MEM_MAP_ALLOCATE`): peers on
    /// this host read it with plain copies through UCX's sysv/posix transports, while memory
    /// the caller allocated is served by emulated reads (see README). Any endpoint of this
    /// process with the same `tls` and `net_devices` can register it.
    async fn allocate_host(&self, len: usize) -> Result<Option<Arc<dyn HostMemory>>> {
        let alloc = Allocation::new(&self.ctx, len).map_err(Error::from)?;
        tracing::debug!(agent = %self.agent, len, addr = alloc.addr, "ucx allocate_host");
        Ok(Some(Arc::new(UcxHostMemory::new(alloc))))
    }

    async fn register(&self, block: Arc<dyn MemoryBlock>) -> Result<Registration> {
        let (len, kind) = (block.len() as u64, block.kind());
        let id = self.ask(|reply| Cmd::Register { block, reply }).await?;
        let mailbox = self.mailbox.clone();
        Ok(Registration::new(id, len, kind, move || {
            // The thread unmaps once no running read uses the region; a stopped thread has
            // already released everything.
            mailbox.send(Cmd::Deregister { id });
        }))
    }

    async fn export_metadata(&self) -> Result<Bytes> {
        self.ask(|reply| Cmd::Export { reply }).await
    }

    async fn load_peer(&self, owner: OwnerId, metadata: Bytes) -> Result<()> {
        let meta = EndpointMeta::decode(&metadata).map_err(|e| e.with_owner(owner))?;
        let incarnation = meta.incarnation;
        // Forget the old incarnation first: while the new one loads, tables of neither are read.
        self.peer_incarnations.lock().remove(&owner);
        self.ask(|reply| Cmd::LoadPeer { owner, meta, reply })
            .await
            .map_err(|e| e.with_owner(owner))?;
        self.peer_incarnations.lock().insert(owner, incarnation);
        Ok(())
    }

    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let batch = Arc::new(batch);
        let b = Arc::clone(&batch);
        let pieces = self
            .ask(|reply| Cmd::Prepare {
                id,
                batch: b,
                reply,
            })
            .await?;
        tracing::debug!(
            agent = %self.agent,
            reads = batch.reads.len(),
            bytes = batch.bytes(),
            pieces,
            "ucx prepare"
        );
        let token = PreparedToken {
            uid: self.uid,
            id,
            mailbox: self.mailbox.clone(),
        };
        Ok(PreparedBatch::new(batch, SCHEME, token))
    }

    async fn post(&self, prepared: &PreparedBatch) -> Result<Box<dyn InFlight>> {
        self.post_with(prepared, None).await
    }

    async fn post_reporting(
        &self,
        prepared: &PreparedBatch,
        sink: CompletionSink,
    ) -> Result<Box<dyn InFlight>> {
        self.post_with(prepared, Some(sink)).await
    }

    fn set_execution_log(&self, log: Option<Arc<ExecutionLog>>) -> bool {
        *self.log.lock() = log;
        true
    }
}

impl UcxTransport {
    /// Posts `prepared`, reporting each read to `sink` once its last piece completed.
    async fn post_with(
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

#[cfg(test)]
mod tests {
    use super::*;
    use reshard_core::{HostBuffer, ReadDesc};
    use std::time::Instant;

    /// Gets that do not complete within the no-progress bound after their endpoint was
    /// "force-closed" (the close is skipped here, so they run on) are quarantined: the error
    /// says so and is not retryable, posts into their memory are refused until they complete,
    /// then the memory is released and a clean post works.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unstoppable_gets_are_quarantined_then_released() {
        if !reshard_conformance::backend_available("ucx", crate::probe()) {
            return;
        }
        engine::TEST_IGNORE_FORCE_CLOSE.store(true, Ordering::Relaxed);
        let options = UcxOptions {
            tls: Some("tcp".into()),
            reads_in_flight: 512,
            // Far below the ~25 ms one 16 MiB read over TCP takes here.
            timeout_ms: 1,
            ..UcxOptions::default()
        };
        let len: usize = 512 << 20;
        let publisher = UcxTransport::new("publisher", options.clone()).unwrap();
        let receiver = UcxTransport::new("receiver", options).unwrap();
        let src = Arc::new(HostBuffer::from_bytes(
            &(0..len).map(|i| (i % 251) as u8).collect::<Vec<_>>(),
        ));
        let dst = Arc::new(HostBuffer::zeroed(len));
        let rs = publisher
            .register(src.clone() as Arc<dyn MemoryBlock>)
            .await
            .unwrap();
        let rd = receiver
            .register(dst.clone() as Arc<dyn MemoryBlock>)
            .await
            .unwrap();
        receiver
            .load_peer(7, publisher.export_metadata().await.unwrap())
            .await
            .unwrap();
        let batch = |n: u64, chunk: u64| ReadBatch {
            reads: (0..n / chunk)
                .map(|i| ReadDesc {
                    owner: 7,
                    remote_region: rs.id(),
                    remote_offset: i * chunk,
                    local_region: rd.id(),
                    local_offset: i * chunk,
                    len: chunk,
                })
                .collect(),
        };
        let prepared = receiver.prepare(batch(len as u64, 16 << 20)).await.unwrap();
        let mut quarantined = None;
        for _ in 0..10 {
            match receiver.post(&prepared).await {
                Ok(f) => match f.wait().await {
                    Err(e) if e.is_quarantined() => {
                        quarantined = Some(e);
                        break;
                    }
                    // Completed, or ended (quiet) before the bound: try again.
                    _ => continue,
                },
                // Refused while an earlier attempt's gets are quarantined.
                Err(e) => assert!(e.is_quarantined(), "{e}"),
            }
        }
        engine::TEST_IGNORE_FORCE_CLOSE.store(false, Ordering::Relaxed);
        let e = quarantined.expect("a batch was quarantined");
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert!(!e.is_retryable(), "{e}");
        assert_eq!(e.context().owner, Some(7), "{e}");
        assert!(e.to_string().contains("owner(s) {7}"), "{e}");
        // While its gets run, their memory is not reused.
        let e = match receiver.post(&prepared).await {
            Ok(f) => f
                .wait()
                .await
                .expect_err("quarantined memory is not posted into"),
            Err(e) => e,
        };
        assert!(e.is_quarantined() && !e.is_retryable(), "{e}");
        // Once they completed, the quarantine is released and a clean (short) post works.
        let head = receiver.prepare(batch(32 << 20, 1 << 20)).await.unwrap();
        let start = Instant::now();
        loop {
            let r = match receiver.post(&head).await {
                Ok(f) => f.wait().await,
                Err(e) => Err(e),
            };
            match r {
                Ok(_) => break,
                Err(e) if e.is_quarantined() || e.is_retryable() => {
                    assert!(start.elapsed() < Duration::from_secs(20), "{e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert!(dst.read()[..32 << 20] == src.read()[..32 << 20]);
    }
}
