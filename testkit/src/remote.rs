//! Publishers in another process: a child process holds the synthetic publishers' memory and
//! transport endpoints, and the parent (the receiver) drives it over a Unix socket.
//!
//! This is what makes a cross-process refit real: the receiver only ever sees the child's shard
//! tables and transport metadata, exactly as it would see a trainer's, and the bytes cross the
//! process boundary through the backend under test. The control protocol is one JSON object per
//! line; every request gets exactly one reply, and a failure in the child comes back as a typed
//! error of the same kind.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, ErrorKind as IoKind, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reshard_core::encoding::{decode_table, encode_table};
use reshard_core::{
    Error, ErrorKind, OwnerId, Result, ShardTable, TensorSpec, Transport, WantedLayout,
};
use reshard_planner::presets::ModelConfig;
use reshard_planner::topology::PublisherTopology;

use crate::synthetic::{reference_params, Placement, SyntheticCluster};

/// Environment variable through which a publisher process learns the parent's socket path.
pub const SOCKET_ENV: &str = "RESHARD_PUBLISHER_SOCKET";

/// Default bound on any one wait for the child (start-up, a reply).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Request {
    Start {
        model: ModelConfig,
        topology: String,
        seed: u64,
        #[serde(default)]
        placement: Placement,
    },
    Publish {
        step: u64,
    },
    SetDigests {
        on: bool,
    },
    Corrupt {
        tensor: String,
        byte: u64,
    },
    Shutdown,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
enum Reply {
    Cluster {
        /// The transport the child's publishers serve reads over.
        transport: String,
        arena_bytes: u64,
        metadata: Vec<(OwnerId, Vec<u8>)>,
        tables: Vec<Vec<u8>>,
    },
    Tables {
        tables: Vec<Vec<u8>>,
    },
    Corrupted {
        at: u64,
    },
    Bye,
    Failed {
        kind: String,
        message: String,
    },
}

fn channel_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::Transport,
        format!("publisher process control channel: {what}: {e}"),
    )
}

fn encode_tables(c: &SyntheticCluster) -> Vec<Vec<u8>> {
    c.tables().iter().map(encode_table).collect()
}

/// True in a process started by [`RemoteCluster::spawn`] (its socket variable is set).
pub fn is_publisher_process() -> bool {
    std::env::var_os(SOCKET_ENV).is_some()
}

/// Runs the publisher side: connects to the parent's socket, builds publishers on endpoints
/// from `make(agent)` when asked, and answers requests until the parent says shutdown or goes
/// away. Returns once the publishers' registrations are released.
pub fn serve(make: impl Fn(&str) -> Result<Arc<dyn Transport>>) -> Result<()> {
    let path = std::env::var_os(SOCKET_ENV).ok_or_else(|| {
        Error::new(
            ErrorKind::Config,
            format!("{SOCKET_ENV} is not set: not started as a publisher process"),
        )
    })?;
    let stream = UnixStream::connect(&path).map_err(|e| channel_error("connect", e))?;
    let mut reader = BufReader::new(
        stream
            .try_clone()
            .map_err(|e| channel_error("clone socket", e))?,
    );
    let mut writer = stream;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::new(ErrorKind::Internal, format!("tokio runtime: {e}")))?;
    let mut cluster: Option<SyntheticCluster> = None;
    let mut line = String::new();
    loop {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => return Err(channel_error("read request", e)),
        }
        let (reply, stop) = match serde_json::from_str::<Request>(&line) {
            Err(e) => (
                Err(Error::new(
                    ErrorKind::Decode,
                    format!("bad control request: {e}"),
                )),
                false,
            ),
            Ok(Request::Shutdown) => (Ok(Reply::Bye), true),
            Ok(req) => (rt.block_on(handle(&mut cluster, req, &make)), false),
        };
        let reply = reply.unwrap_or_else(|e| Reply::Failed {
            kind: e.kind().as_str().to_string(),
            message: e.to_string(),
        });
        let mut out = serde_json::to_string(&reply)
            .map_err(|e| Error::new(ErrorKind::Internal, format!("encode reply: {e}")))?;
        out.push('\n');
        writer
            .write_all(out.as_bytes())
            .map_err(|e| channel_error("write reply", e))?;
        if stop {
            break;
        }
    }
    // Registrations are released inside the runtime, where backends may need it.
    rt.block_on(async move { drop(cluster) });
    Ok(())
}

async fn handle(
    cluster: &mut Option<SyntheticCluster>,
    req: Request,
    make: &impl Fn(&str) -> Result<Arc<dyn Transport>>,
) -> Result<Reply> {
    fn started(c: &mut Option<SyntheticCluster>) -> Result<&mut SyntheticCluster> {
        c.as_mut().ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidInput,
                "publisher process: no cluster started yet",
            )
        })
    }
    match req {
        Request::Start {
            model,
            topology,
            seed,
            placement,
        } => {
            // Drop the previous cluster first so its registrations go before new ones exist.
            *cluster = None;
            let topo: PublisherTopology = topology.parse()?;
            let c = SyntheticCluster::with_placement(model, topo, seed, placement, |rank| {
                make(&format!("publisher-{rank}"))
            })
            .await?;
            let metadata = c
                .metadata()
                .await?
                .into_iter()
                .map(|(r, b)| (r, b.to_vec()))
                .collect();
            let reply = Reply::Cluster {
                transport: c.transport_name().to_string(),
                arena_bytes: c.arena_bytes(),
                metadata,
                tables: encode_tables(&c),
            };
            *cluster = Some(c);
            Ok(reply)
        }
        Request::Publish { step } => {
            let c = started(cluster)?;
            c.publish_step(step);
            Ok(Reply::Tables {
                tables: encode_tables(c),
            })
        }
        Request::SetDigests { on } => {
            let c = started(cluster)?;
            c.set_digests(on);
            Ok(Reply::Tables {
                tables: encode_tables(c),
            })
        }
        Request::Corrupt { tensor, byte } => {
            let c = started(cluster)?;
            Ok(Reply::Corrupted {
                at: c.corrupt(&tensor, byte)?,
            })
        }
        Request::Shutdown => Ok(Reply::Bye),
    }
}

struct Channel {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Channel {
    fn call(&mut self, req: &Request) -> Result<Reply> {
        let mut out = serde_json::to_string(req)
            .map_err(|e| Error::new(ErrorKind::Internal, format!("encode request: {e}")))?;
        out.push('\n');
        self.writer
            .write_all(out.as_bytes())
            .map_err(|e| channel_error("write request", e))?;
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) => Err(channel_error(
                "read reply",
                "the publisher process closed the connection (did it crash? see its stderr)",
            )),
            Ok(_) => {
                let reply: Reply = serde_json::from_str(&line).map_err(|e| {
                    Error::new(ErrorKind::Decode, format!("bad control reply: {e}"))
                })?;
                match reply {
                    Reply::Failed { kind, message } => Err(Error::new(
                        ErrorKind::from_name(&kind).unwrap_or(ErrorKind::Internal),
                        format!("publisher process: {message}"),
                    )),
                    r => Ok(r),
                }
            }
            Err(e) if matches!(e.kind(), IoKind::WouldBlock | IoKind::TimedOut) => Err(Error::new(
                ErrorKind::Timeout,
                "publisher process did not reply in time",
            )),
            Err(e) => Err(channel_error("read reply", e)),
        }
    }
}

/// Every publisher of a topology, living in a child process; mirrors [`SyntheticCluster`].
pub struct RemoteCluster {
    child: Option<Child>,
    channel: Mutex<Channel>,
    socket: PathBuf,
    model: ModelConfig,
    topology: PublisherTopology,
    specs: Vec<TensorSpec>,
    seed: u64,
    step: u64,
    transport: String,
    arena_bytes: u64,
    metadata: Vec<(OwnerId, Bytes)>,
    tables: Vec<ShardTable>,
}

impl std::fmt::Debug for RemoteCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RemoteCluster({} {}, pid {:?}, step {})",
            self.model.name,
            self.topology,
            self.child.as_ref().map(|c| c.id()),
            self.step
        )
    }
}

static SOCKETS: AtomicU64 = AtomicU64::new(0);

impl RemoteCluster {
    /// Starts `command` as the publisher process (its socket path goes in [`SOCKET_ENV`]; its
    /// stdout is discarded, stderr inherited), then builds the cluster there and loads its
    /// tables and metadata. Each wait is bounded by `timeout`. Publishers own per-rank memory
    /// ([`Placement::PerRank`]); see [`Self::spawn_with_placement`].
    pub fn spawn(
        command: Command,
        model: ModelConfig,
        topology: PublisherTopology,
        seed: u64,
        timeout: Duration,
    ) -> Result<Self> {
        Self::spawn_with_placement(command, model, topology, seed, Placement::PerRank, timeout)
    }

    /// [`Self::spawn`] with the publishers' memory placed as `placement` says.
    pub fn spawn_with_placement(
        mut command: Command,
        model: ModelConfig,
        topology: PublisherTopology,
        seed: u64,
        placement: Placement,
        timeout: Duration,
    ) -> Result<Self> {
        let socket = std::env::temp_dir().join(format!(
            "reshard-pub-{}-{}.sock",
            std::process::id(),
            SOCKETS.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket).map_err(|e| channel_error("bind", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| channel_error("listen", e))?;
        let mut child = command
            .env(SOCKET_ENV, &socket)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| {
                Error::new(
                    ErrorKind::InvalidInput,
                    format!("cannot start the publisher process: {e}"),
                )
            })?;
        let started = Instant::now();
        let stream = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == IoKind::WouldBlock => {}
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let _ = std::fs::remove_file(&socket);
                    return Err(channel_error("accept", e));
                }
            }
            if let Ok(Some(status)) = child.try_wait() {
                let _ = std::fs::remove_file(&socket);
                return Err(Error::new(
                    ErrorKind::Transport,
                    format!("the publisher process exited before connecting ({status})"),
                ));
            }
            if started.elapsed() > timeout {
                let _ = child.kill();
                let _ = child.wait();
                let _ = std::fs::remove_file(&socket);
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("the publisher process did not connect within {timeout:?}"),
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let setup = |s: &UnixStream| -> std::io::Result<UnixStream> {
            s.set_nonblocking(false)?;
            s.set_read_timeout(Some(timeout))?;
            s.try_clone()
        };
        let reader = setup(&stream).map_err(|e| channel_error("configure socket", e))?;
        let mut cluster = RemoteCluster {
            child: Some(child),
            channel: Mutex::new(Channel {
                reader: BufReader::new(reader),
                writer: stream,
            }),
            socket,
            specs: model.tensors(),
            model: model.clone(),
            topology,
            seed,
            step: 0,
            transport: String::new(),
            arena_bytes: 0,
            metadata: Vec::new(),
            tables: Vec::new(),
        };
        let reply = cluster.call(&Request::Start {
            model,
            topology: topology.to_string(),
            seed,
            placement,
        })?;
        match reply {
            Reply::Cluster {
                transport,
                arena_bytes,
                metadata,
                tables,
            } => {
                cluster.transport = transport;
                cluster.arena_bytes = arena_bytes;
                cluster.metadata = metadata
                    .into_iter()
                    .map(|(r, b)| (r, Bytes::from(b)))
                    .collect();
                cluster.set_tables(tables)?;
                Ok(cluster)
            }
            other => Err(unexpected(&other)),
        }
    }

    fn call(&self, req: &Request) -> Result<Reply> {
        let mut ch = self
            .channel
            .lock()
            .map_err(|_| Error::new(ErrorKind::Internal, "control channel lock poisoned"))?;
        ch.call(req)
    }

    fn set_tables(&mut self, tables: Vec<Vec<u8>>) -> Result<()> {
        self.tables = tables
            .iter()
            .map(|t| decode_table(t))
            .collect::<Result<_>>()?;
        Ok(())
    }

    /// Rewrites the child's buffers with the weights of `step` and reloads the tables.
    pub fn publish_step(&mut self, step: u64) -> Result<()> {
        match self.call(&Request::Publish { step })? {
            Reply::Tables { tables } => {
                self.set_tables(tables)?;
                self.step = step;
                Ok(())
            }
            other => Err(unexpected(&other)),
        }
    }

    /// Turns digest publication on or off in the child and reloads the tables.
    pub fn set_digests(&mut self, on: bool) -> Result<()> {
        match self.call(&Request::SetDigests { on })? {
            Reply::Tables { tables } => self.set_tables(tables),
            other => Err(unexpected(&other)),
        }
    }

    /// Flips one byte of `tensor`'s first buffer in the child (see
    /// [`SyntheticCluster::corrupt`]).
    pub fn corrupt(&self, tensor: &str, byte: u64) -> Result<u64> {
        match self.call(&Request::Corrupt {
            tensor: tensor.to_string(),
            byte,
        })? {
            Reply::Corrupted { at } => Ok(at),
            other => Err(unexpected(&other)),
        }
    }

    /// One shard table per rank, for the current step.
    pub fn tables(&self) -> Vec<ShardTable> {
        self.tables.clone()
    }

    /// The name of the transport the child's publishers serve reads over.
    pub fn transport_name(&self) -> &str {
        &self.transport
    }

    /// Every rank's transport metadata.
    pub fn metadata(&self) -> &[(OwnerId, Bytes)] {
        &self.metadata
    }

    /// Loads every rank's metadata into a receiver's transport.
    pub async fn connect(&self, receiver: &dyn Transport) -> Result<()> {
        for (rank, md) in &self.metadata {
            receiver.load_peer(*rank, md.clone()).await?;
        }
        Ok(())
    }

    /// The current training step.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The model published.
    pub fn model(&self) -> &ModelConfig {
        &self.model
    }

    /// The publisher topology.
    pub fn topology(&self) -> &PublisherTopology {
        &self.topology
    }

    /// Bytes of physical publisher memory in the child.
    pub fn arena_bytes(&self) -> u64 {
        self.arena_bytes
    }

    /// The child's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// The bytes every parameter of `layout` must hold after a refit of the current step.
    pub fn expected_params(&self, layout: &WantedLayout) -> Result<Vec<Vec<u8>>> {
        reference_params(&self.specs, self.seed, self.step, layout)
    }

    /// Kills the child at once (SIGKILL: a publisher dying mid-transfer, as a crashed trainer
    /// would) and reaps it. Its memory, and every read still served from it, is gone.
    pub fn kill(&mut self) -> Result<ExitStatus> {
        let Some(mut child) = self.child.take() else {
            return Err(Error::new(ErrorKind::Internal, "already shut down"));
        };
        let _ = child.kill();
        let status = child
            .wait()
            .map_err(|e| channel_error("wait for the killed publisher process", e));
        let _ = std::fs::remove_file(&self.socket);
        status
    }

    /// Asks the child to release its publishers and exit, and waits for it.
    pub fn shutdown(mut self) -> Result<ExitStatus> {
        self.stop()
    }

    fn stop(&mut self) -> Result<ExitStatus> {
        let Some(mut child) = self.child.take() else {
            return Err(Error::new(ErrorKind::Internal, "already shut down"));
        };
        let said_bye = self.call(&Request::Shutdown);
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break Ok(s),
                Ok(None) if said_bye.is_ok() && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Ok(None) => {
                    let _ = child.kill();
                    break child
                        .wait()
                        .map_err(|e| channel_error("wait for the publisher process", e));
                }
                Err(e) => break Err(channel_error("wait for the publisher process", e)),
            }
        };
        let _ = std::fs::remove_file(&self.socket);
        said_bye?;
        status
    }
}

impl Drop for RemoteCluster {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.stop();
        }
    }
}

fn unexpected(r: &Reply) -> Error {
    Error::new(
        ErrorKind::Internal,
        format!("publisher process sent an unexpected reply: {r:?}"),
    )
}
