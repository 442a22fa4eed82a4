//! [`UcxTransport`]: the async face of one UCX endpoint. It owns the endpoint's progress
//! thread (see `engine`), forwards every operation to it and awaits the answer.

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;
use reshard_core::{
    Capability, Error, ErrorKind, HostMemory, InFlight, MemoryBlock, OwnerId, PreparedBatch,
    ReadBatch, Registration, Result, Transport, WireReport,
};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::oneshot;

use crate::alloc::{Allocation, UcxHostMemory};
use crate::config::UcxOptions;
use crate::engine::{self, Cmd, EngineOptions, Mailbox};
use crate::meta::EndpointMeta;
use crate::raw::{self, Context, ContextOptions};
use crate::BACKEND;

/// Distinguishes endpoints of this process, so a batch prepared by one is refused by another.
static NEXT_UID: AtomicU64 = AtomicU64::new(1);

/// One UCX endpoint (a UCP context and worker driven by a dedicated progress thread),
/// implementing the core transport contract with one-sided `ucp_get_nbx` reads.
pub struct UcxTransport {
    agent: String,
    uid: u64,
    options: UcxOptions,
    mailbox: Mailbox,
    epoch: Arc<AtomicU64>,
    vram: bool,
    next_id: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The process-wide context of this configuration (shared with the progress thread).
    ctx: Arc<Context>,
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
    .with_backend(BACKEND)
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
            .with_backend(BACKEND));
        }
        let epoch = Arc::new(AtomicU64::new(1));
        let ctx = Context::shared(
            raw::lib()?,
            &ContextOptions {
                tls: options.tls.clone(),
                net_devices: options.net_devices.clone(),
                name: "reshard".to_owned(),
            },
        )?;
        let spawned = engine::start(
            agent,
            EngineOptions {
                context: Arc::clone(&ctx),
                reads_in_flight: options.reads_in_flight,
                timeout: Duration::from_millis(options.timeout_ms),
                copy_threads: options.effective_copy_threads(),
            },
            Arc::clone(&epoch),
        )?;
        Ok(UcxTransport {
            agent: agent.to_owned(),
            uid: NEXT_UID.fetch_add(1, Ordering::Relaxed),
            options,
            mailbox: spawned.mailbox,
            epoch,
            vram: spawned.vram,
            next_id: AtomicU64::new(1),
            thread: Mutex::new(Some(spawned.thread)),
            ctx,
        })
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

impl Drop for UcxTransport {
    fn drop(&mut self) {
        self.mailbox.shutdown();
        if let Some(t) = self.thread.lock().take() {
            // The thread cancels outstanding reads and releases UCX in bounded time.
            if t.join().is_err() {
                tracing::warn!(agent = %self.agent, "ucx progress thread panicked");
            }
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
        BACKEND
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
        self.ask(|reply| Cmd::LoadPeer { owner, meta, reply })
            .await
            .map_err(|e| e.with_owner(owner))
    }

    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let batch = Arc::new(batch);
        let b = Arc::clone(&batch);
        let generations = self
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
            generations,
            "ucx prepare"
        );
        let token = PreparedToken {
            uid: self.uid,
            id,
            mailbox: self.mailbox.clone(),
        };
        Ok(PreparedBatch::new(batch, BACKEND, token))
    }

    async fn post(&self, prepared: &PreparedBatch) -> Result<Box<dyn InFlight>> {
        let token = prepared
            .state::<PreparedToken>()
            .filter(|t| t.uid == self.uid)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Unsupported,
                    format!(
                        "batch was prepared by {} (another backend or ucx endpoint), not by \
                         ucx agent {:?}",
                        prepared.backend(),
                        self.agent
                    ),
                )
                .with_backend(BACKEND)
            })?;
        let batch = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (done_tx, done_rx) = oneshot::channel();
        let prepared_id = token.id;
        self.ask(|ack| Cmd::Post {
            prepared: prepared_id,
            batch,
            ack,
            done: done_tx,
        })
        .await?;
        Ok(Box::new(UcxInFlight {
            agent: self.agent.clone(),
            mailbox: self.mailbox.clone(),
            batch,
            done: Some(done_rx),
        }))
    }
}

/// A posted batch: its reads run on the progress thread; this waits for or aborts them.
struct UcxInFlight {
    agent: String,
    mailbox: Mailbox,
    batch: u64,
    done: Option<oneshot::Receiver<Result<WireReport>>>,
}

#[async_trait]
impl InFlight for UcxInFlight {
    async fn wait(mut self: Box<Self>) -> Result<WireReport> {
        match self.done.take() {
            Some(rx) => rx.await.map_err(|_| stopped(&self.agent))?,
            None => {
                Err(Error::new(ErrorKind::Internal, "batch already waited for")
                    .with_backend(BACKEND))
            }
        }
    }

    async fn abort(mut self: Box<Self>) {
        if let Some(rx) = self.done.take() {
            self.mailbox.send(Cmd::Cancel { batch: self.batch });
            // Answered only once no read of the batch is outstanding.
            let _ = rx.await;
        }
    }
}

impl Drop for UcxInFlight {
    fn drop(&mut self) {
        // Dropped without wait or abort: stop the batch; the progress thread keeps its
        // buffers alive until its outstanding reads complete.
        if self.done.is_some() {
            self.mailbox.send(Cmd::Cancel { batch: self.batch });
        }
    }
}
