//! The native publisher: one trainer rank's tensors, registered in place from the caller's
//! arrays ([`TensorPublisher`]), announced through a rendezvous the way `reshard publish` does
//! (cli/src/publish_cmd.rs): announce, then for every later step unready, digest, advance; and
//! withdraw on close. Every publish first checks that each caller's array is still the memory
//! registered for it (memory.rs), and publishes nothing when one is not.

use std::sync::Arc;

use bytes::Bytes;
use parking_lot::{Mutex, MutexGuard};
use pyo3::prelude::*;
use pyo3::types::PyList;

use reshard_core::encoding::encode_table;
use reshard_core::rendezvous::{wait_released, Announced, Announcement, Rendezvous};
use reshard_core::{Error, ErrorKind, HostMemory, Transport};
use reshard_planner::topology::PublisherTopology;
use reshard_runtime::{HeldTensor, TensorPublisher};

use crate::errors::{self, boundary, invalid, IntoPy};
use crate::memory::{fill_view, ArrayMemory};
use crate::{
    lease_ttl_arg, load_config, model_from, registry, rendezvous_spec, runtime, wait,
    RendezvousSpec,
};

/// Longest a first publish waits to reach a rendezvous `connect` did not reach.
const FIRST_CONNECT: std::time::Duration = std::time::Duration::from_secs(30);

/// `[(name, dtype, offset, shape)]` of a rank's tensors.
pub fn tensor_rows<'py>(py: Python<'py>, tensors: &[HeldTensor]) -> PyResult<Bound<'py, PyList>> {
    let rows: Vec<(String, String, Vec<u64>, Vec<u64>)> = tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.dtype.to_string(),
                t.bounds.offset.clone(),
                t.bounds.extent.clone(),
            )
        })
        .collect();
    PyList::new(py, rows)
}

/// Memory a transport allocated for a tensor (`Publisher.empty`), exported to Python as a
/// writable byte buffer that numpy wraps without copying. The exporter keeps the memory alive
/// while any array over it lives; the publisher's registration keeps it alive after that.
#[pyclass(module = "reshard._reshard", frozen)]
pub struct TransportBuffer {
    memory: Arc<dyn HostMemory>,
    /// Whether the transport allocated it (false: plain host memory, the transport has none).
    #[pyo3(get)]
    transport_memory: bool,
}

#[pymethods]
impl TransportBuffer {
    /// Fills `view` with the whole memory, writable, one dimension of bytes.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        boundary("TransportBuffer.__getbuffer__", || {
            let (addr, len) = {
                let me = slf.get();
                (me.memory.addr(), me.memory.len())
            };
            // SAFETY: `view` comes from the interpreter; the memory stays valid while `slf`
            // (which FillInfo references from the view) lives; writes through it follow the
            // MemoryBlock contract (not while a publish digests it or a read may touch it).
            unsafe { fill_view(slf.as_any(), view, addr, len, false, flags) }
        })
    }

    /// Nothing to free: FillInfo's format is static and the object reference is the view's
    /// (an empty body: nothing here can panic).
    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}

    fn __len__(&self) -> PyResult<usize> {
        boundary("TransportBuffer.__len__", || Ok(self.memory.len()))
    }
}

/// What a live publisher holds. Field order is drop order: the announcement is withdrawn (or
/// left to expire) before the registrations and the arrays go.
struct State {
    announced: Option<Box<dyn Announced>>,
    publisher: TensorPublisher,
    /// The rendezvous, reached at `connect` or the first publish (never in the constructor).
    rendezvous: RendezvousSpec,
    name: String,
    world: u32,
    config: Bytes,
    step: Option<u64>,
    /// The table `step` was announced with, to mark it ready again unchanged ([`NativePublisher::ready`]).
    table: Option<Bytes>,
    /// The caller's arrays registered so far (not those of `empty`, which reshard owns), by
    /// tensor name: checked before every publish.
    arrays: Vec<(String, Arc<ArrayMemory>)>,
}

/// One publisher rank (use `reshard.Publisher`).
#[pyclass(module = "reshard._reshard", frozen)]
pub struct NativePublisher {
    state: Mutex<Option<State>>,
    rank: u32,
}

impl State {
    /// The rendezvous once reached.
    fn connected(&self) -> Option<Arc<dyn Rendezvous>> {
        match &self.rendezvous {
            RendezvousSpec::Ready(r) => Some(r.clone()),
            RendezvousSpec::Etcd { .. } => None,
        }
    }
}

impl NativePublisher {
    /// The rendezvous, reached now when it is not yet (within `timeout`; etcd's own connect
    /// timeout bounds each try). The state's lock is not held while connecting.
    fn reach(&self, py: Python<'_>, timeout: std::time::Duration) -> PyResult<Arc<dyn Rendezvous>> {
        let spec = self.with(|s| {
            Ok(match &s.rendezvous {
                RendezvousSpec::Ready(r) => Err(r.clone()),
                RendezvousSpec::Etcd { url, lease_ttl } => Ok(RendezvousSpec::Etcd {
                    url: url.clone(),
                    lease_ttl: *lease_ttl,
                }),
            })
        })?;
        let spec = match spec {
            Err(ready) => return Ok(ready),
            Ok(spec) => spec,
        };
        let url = match &spec {
            RendezvousSpec::Etcd { url, .. } => url.clone(),
            RendezvousSpec::Ready(_) => String::new(),
        };
        let r = wait(py, None, async move {
            tokio::time::timeout(timeout, spec.connect())
                .await
                .unwrap_or_else(|_| {
                    Err(Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "could not reach etcd at {url} within {:.1} s",
                            timeout.as_secs_f64()
                        ),
                    ))
                })
        })?;
        self.with(|s| {
            s.rendezvous = RendezvousSpec::Ready(r.clone());
            Ok(())
        })?;
        Ok(r)
    }

    /// The state's lock, or an error when another thread holds it: waiting for it with the GIL
    /// held could deadlock a publish that needs the GIL to check for Ctrl-C.
    fn lock(&self) -> PyResult<MutexGuard<'_, Option<State>>> {
        self.state.try_lock().ok_or_else(|| {
            errors::busy(format!(
                "publisher rank {} is busy in another thread (one thread per publisher)",
                self.rank
            ))
        })
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> PyResult<T>) -> PyResult<T> {
        let mut guard = self.lock()?;
        match guard.as_mut() {
            Some(s) => f(s),
            None => Err(errors::closed(format!(
                "publisher rank {} is closed",
                self.rank
            ))),
        }
    }
}

#[pymethods]
impl NativePublisher {
    /// See `reshard.Publisher`.
    #[new]
    #[pyo3(signature = (model, topology, rank, rendezvous_arg, transport=None, config=None, lease_ttl_s=10.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        model: &str,
        topology: &str,
        rank: u32,
        rendezvous_arg: &Bound<'_, PyAny>,
        transport: Option<&str>,
        config: Option<&str>,
        lease_ttl_s: f64,
    ) -> PyResult<Self> {
        boundary("Publisher()", || {
            Self::open(
                model,
                topology,
                rank,
                rendezvous_arg,
                transport,
                config,
                lease_ttl_s,
            )
        })
    }

    /// `[(name, dtype, offset, shape)]` of the tensors this rank holds.
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        boundary("Publisher.tensors", || {
            let tensors = self.with(|s| Ok(s.publisher.tensors()))?;
            tensor_rows(py, &tensors)
        })
    }

    /// Tensors not registered yet.
    fn missing(&self) -> PyResult<Vec<String>> {
        boundary("Publisher.missing", || {
            self.with(|s| Ok(s.publisher.missing()))
        })
    }

    /// Registers `array` (buffer protocol, C-contiguous) as tensor `name`, in place. `probe`,
    /// when `array` views another object's memory (a torch tensor's, through DLPack), returns
    /// that object's `(address, bytes)` now; it is held, and asked before every publish.
    #[pyo3(signature = (name, array, probe=None))]
    fn register(
        &self,
        py: Python<'_>,
        name: &str,
        array: &Bound<'_, PyAny>,
        probe: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        boundary("Publisher.register", || {
            self.register_array(py, name, array, probe)
        })
    }

    /// Allocates tensor `name`'s array from the transport (plain host memory when the
    /// transport has no allocator of its own), registers it, and returns it as a buffer.
    fn empty(&self, py: Python<'_>, name: &str) -> PyResult<TransportBuffer> {
        boundary("Publisher.empty", || self.allocate(py, name))
    }

    /// Marks the announcement not ready: call before rewriting the arrays while receivers may
    /// be reading them (optional: a receiver that reads during a rewrite fails verification
    /// and keeps its previous weights).
    fn unready(&self, py: Python<'_>) -> PyResult<()> {
        boundary("Publisher.unready", || {
            let mut guard = self.lock()?;
            let Some(s) = guard.as_mut() else {
                return Ok(());
            };
            match s.announced.as_ref() {
                Some(a) => wait(py, None, a.unready()),
                None => Ok(()),
            }
        })
    }

    /// Marks the announced step ready again with the table it was published with, after
    /// checking that every array is where it was: for a rewrite that did not happen after all
    /// (`updating` whose wait for readers timed out before its body ran). A no-op when nothing
    /// is announced.
    fn ready(&self, py: Python<'_>) -> PyResult<()> {
        boundary("Publisher.ready", || {
            let mut guard = self.lock()?;
            let Some(s) = guard.as_mut() else {
                return Err(errors::closed(format!(
                    "publisher rank {} is closed",
                    self.rank
                )));
            };
            let (Some(a), Some(step), Some(table)) =
                (s.announced.as_ref(), s.step, s.table.clone())
            else {
                return Ok(());
            };
            let done = format!("marked ready again: step {step} stays not ready");
            for (name, memory) in &s.arrays {
                memory.check(py, name, &done)?;
            }
            wait(py, None, async move {
                a.check_alive()?;
                a.advance(step, table).await
            })
        })
    }

    /// Reaches the rendezvous now (etcd: connects, within `timeout_s`), so a bad address fails
    /// here rather than at the first publish; a no-op once connected.
    fn connect(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        boundary("Publisher.connect", || {
            let timeout = crate::timeout_arg("timeout", timeout_s)?;
            self.reach(py, timeout).map(|_| ())
        })
    }

    /// Waits up to `timeout_s` until no receiver reads this rank's memory (the reader fence:
    /// call after `unready`); returns `(waited_s, readers)`, the readers it waited for. Raises
    /// `Timeout` naming the readers still reading.
    fn wait_released(&self, py: Python<'_>, timeout_s: f64) -> PyResult<(f64, Vec<String>)> {
        boundary("Publisher.wait_released", || {
            let timeout = crate::timeout_arg("timeout", timeout_s)?;
            let (rendezvous, model, incarnation, announced) = self.with(|s| {
                Ok((
                    s.connected(),
                    s.name.clone(),
                    s.publisher.transport().incarnation(),
                    s.announced.is_some(),
                ))
            })?;
            if !announced {
                // Nothing announced: nobody can be reading.
                return Ok((0.0, Vec::new()));
            }
            let rank = self.rank;
            let Some(rendezvous) = rendezvous else {
                return Ok((0.0, Vec::new()));
            };
            let released = wait(py, None, async move {
                wait_released(rendezvous.as_ref(), &model, rank, incarnation, timeout).await
            })?;
            Ok((released.waited.as_secs_f64(), released.readers))
        })
    }

    /// Checks that every registered array is still where it was registered, digests every
    /// array and announces step `step` (the first call announces the rank).
    fn publish(&self, py: Python<'_>, step: u64) -> PyResult<()> {
        boundary("Publisher.publish", || self.publish_step(py, step))
    }

    /// The last step published, or None.
    #[getter]
    fn step(&self) -> PyResult<Option<u64>> {
        boundary("Publisher.step", || self.with(|s| Ok(s.step)))
    }

    /// Withdraws the announcement, then releases the registrations and the arrays.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        boundary("Publisher.close", || {
            let Some(mut s) = self.lock()?.take() else {
                return Ok(());
            };
            let announced = s.announced.take();
            let withdrawn = match announced {
                Some(a) => wait(py, None, a.withdraw()),
                None => Ok(()),
            };
            // Registrations and the arrays' buffer views are released with the GIL free: a
            // backend may hand the last reference to one of its own threads.
            py.allow_threads(move || drop(s));
            withdrawn
        })
    }
}

impl NativePublisher {
    /// [`NativePublisher::new`]'s body.
    #[allow(clippy::too_many_arguments)]
    fn open(
        model: &str,
        topology: &str,
        rank: u32,
        rendezvous_arg: &Bound<'_, PyAny>,
        transport: Option<&str>,
        config: Option<&str>,
        lease_ttl_s: f64,
    ) -> PyResult<Self> {
        let lease_ttl = lease_ttl_arg(lease_ttl_s)?;
        let model = model_from(model).py_err()?;
        let topo: PublisherTopology = topology.parse().py_err()?;
        let cfg = load_config(transport, config).py_err()?;
        // Checked now, reached at `connect` or the first publish: the constructor never waits.
        let rendezvous = rendezvous_spec(rendezvous_arg, lease_ttl)?;
        let agent = crate::agent_name(&format!("{}-publisher-{rank}", model.name));
        let rt = runtime().py_err()?;
        let t: Arc<dyn Transport> = {
            let _guard = rt.enter();
            registry().create(&agent, &cfg.transport).py_err()?
        };
        let publisher = TensorPublisher::new(t, &model, &topo, rank).py_err()?;
        let config = Bytes::from(serde_json::to_vec(&model).map_err(|e| {
            invalid(
                ErrorKind::Internal,
                format!("model configuration to JSON: {e}"),
                None,
            )
        })?);
        Ok(NativePublisher {
            state: Mutex::new(Some(State {
                announced: None,
                publisher,
                rendezvous,
                name: model.name.clone(),
                world: topo.world(),
                config,
                step: None,
                table: None,
                arrays: Vec::new(),
            })),
            rank,
        })
    }

    /// [`NativePublisher::register`]'s body.
    fn register_array(
        &self,
        py: Python<'_>,
        name: &str,
        array: &Bound<'_, PyAny>,
        probe: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let held = self.with(|s| {
            if s.announced.is_some() {
                return Err(invalid(
                    ErrorKind::InvalidInput,
                    format!(
                        "tensor {name:?} registered after the first publish: publisher rank {} \
                         announced its memory already; register every array first",
                        self.rank
                    ),
                    Some(name),
                ));
            }
            let t = s.publisher.tensors().into_iter().find(|t| t.name == name);
            t.ok_or_else(|| {
                invalid(
                    ErrorKind::InvalidInput,
                    format!("publisher rank {} holds no tensor {name:?}", self.rank),
                    Some(name),
                )
            })
        })?;
        let memory = ArrayMemory::export(array, false, name, probe)?;
        if memory.shape != held.bounds.extent || !memory.holds(held.dtype) {
            return Err(invalid(
                ErrorKind::InvalidInput,
                format!(
                    "tensor {name:?} on publisher rank {} is {} {:?}; the array given has \
                     format {:?} ({} bytes per element) and shape {:?}",
                    self.rank,
                    held.dtype,
                    held.bounds.extent,
                    memory.format,
                    memory.itemsize,
                    memory.shape
                ),
                Some(name),
            ));
        }
        let memory = Arc::new(memory);
        let mut guard = self.lock()?;
        let s = guard
            .as_mut()
            .ok_or_else(|| errors::closed("publisher is closed".into()))?;
        let publisher = &mut s.publisher;
        wait(
            py,
            None,
            publisher.register(name, memory.clone() as Arc<dyn HostMemory>),
        )?;
        s.arrays.push((name.to_string(), memory));
        Ok(())
    }

    /// [`NativePublisher::empty`]'s body.
    fn allocate(&self, py: Python<'_>, name: &str) -> PyResult<TransportBuffer> {
        let (bytes, transport) = self.with(|s| {
            let t = s.publisher.tensors().into_iter().find(|t| t.name == name);
            let t = t.ok_or_else(|| {
                invalid(
                    ErrorKind::InvalidInput,
                    format!("publisher rank {} holds no tensor {name:?}", self.rank),
                    Some(name),
                )
            })?;
            Ok((
                t.bounds.elements() * t.dtype.size(),
                s.publisher.transport().clone(),
            ))
        })?;
        let len = usize::try_from(bytes).map_err(|_| {
            invalid(
                ErrorKind::InvalidInput,
                format!("tensor {name:?} does not fit this machine"),
                Some(name),
            )
        })?;
        // Refused with the tensor named, not left to an allocation that aborts the process.
        reshard_core::memory_check(bytes, &format!("tensor {name:?}"))
            .map_err(|e| invalid(e.kind(), e.message().to_string(), Some(name)))?;
        let allocated = wait(py, None, async move { transport.allocate_host(len).await })?;
        let transport_memory = allocated.is_some();
        let memory = allocated.unwrap_or_else(|| {
            Arc::new(reshard_core::HostBuffer::zeroed(len)) as Arc<dyn HostMemory>
        });
        let mut guard = self.lock()?;
        let s = guard
            .as_mut()
            .ok_or_else(|| errors::closed("publisher is closed".into()))?;
        if s.announced.is_some() {
            return Err(invalid(
                ErrorKind::InvalidInput,
                format!("tensor {name:?} allocated after the first publish"),
                Some(name),
            ));
        }
        let publisher = &mut s.publisher;
        wait(py, None, publisher.register(name, memory.clone()))?;
        Ok(TransportBuffer {
            memory,
            transport_memory,
        })
    }

    /// [`NativePublisher::publish`]'s body.
    fn publish_step(&self, py: Python<'_>, step: u64) -> PyResult<()> {
        // The first publish reaches the rendezvous when `connect` did not (etcd's connect
        // timeout bounds it).
        let reached = self.reach(py, FIRST_CONNECT)?;
        let mut guard = self.lock()?;
        let s = guard
            .as_mut()
            .ok_or_else(|| errors::closed(format!("publisher rank {} is closed", self.rank)))?;
        let rank = self.rank;
        if let Some(live) = s.step {
            if step <= live {
                return Err(invalid(
                    ErrorKind::InvalidInput,
                    format!("publisher rank {rank} is at step {live}; step {step} is not newer"),
                    None,
                ));
            }
        }
        // The announced step goes not ready first (no receiver starts reading memory about to
        // be rewritten or found moved), with the GIL released: it waits on the rendezvous.
        if let Some(a) = s.announced.as_ref() {
            wait(py, None, async move {
                a.check_alive()?;
                a.unready().await
            })?;
        }
        // Then the arrays are checked and digested with the GIL held throughout: no Python
        // thread can resize or free one between its check and the digest's read of it (issue
        // 42: the digest ran with the GIL released, after the check).
        let done = match (s.announced.is_some(), s.step) {
            (true, Some(live)) => format!(
                "published, and step {live}, announced over the same memory, is marked not \
                 ready so that no receiver starts reading it"
            ),
            _ => "published".to_string(),
        };
        for (name, memory) in &s.arrays {
            memory.check(py, name, &done)?;
        }
        // Synchronous (rayon), on this thread.
        let table = Bytes::from(s.publisher.digest(step).map(encode_table).py_err()?);
        let rendezvous = reached;
        let State {
            announced,
            publisher,
            name,
            world,
            config,
            ..
        } = s;
        let announced_table = table.clone();
        let fut = async move {
            match announced.as_ref() {
                Some(a) => a.advance(step, table).await?,
                None => {
                    let t = publisher.transport().clone();
                    let held = rendezvous
                        .announce(Announcement {
                            model: name.clone(),
                            rank,
                            world: *world,
                            step,
                            transport: t.name().to_string(),
                            incarnation: t.incarnation(),
                            table,
                            metadata: t.export_metadata().await?,
                            config: config.clone(),
                        })
                        .await?;
                    *announced = Some(held);
                }
            }
            Ok::<_, Error>(())
        };
        wait(py, None, fut)?;
        s.step = Some(step);
        s.table = Some(announced_table);
        Ok(())
    }
}
