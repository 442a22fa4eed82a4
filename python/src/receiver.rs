//! The native receiver: a [`Subscriber`] (runtime/src/subscriber.rs) that installs every step
//! into its own double-buffered banks, verified, and then either copies the new weights into
//! the engine's arrays (copy install) or lends the live bank itself to the engine (swap
//! install, python/README.md). The engine's arrays are never a landing zone: a failed refit (dead
//! publisher, digest mismatch, timeout, Ctrl-C) returns before the copy or the swap, so the
//! engine keeps the previous step's weights bit for bit. The copy's time is reported as
//! `copy_s`; the swap copies nothing, and refuses to refit into a bank the engine still holds
//! arrays of (bank.rs counts them).
//!
//! A refit is a stage (moved and verified into the bank that is not live; nothing the engine
//! sees changes) and an apply (the swap or the copy); `stage`, `apply` and `rollback` make
//! them apart (python/README.md, "Stage, apply, roll back"), each under the same guards.
//!
//! The engine's arrays must be its own, one per parameter: arrays sharing bytes are refused when
//! the receiver is made (the copy writes every parameter in parallel), and each is checked to be
//! where it was registered before every refit and again before the copy (memory.rs). A refit is
//! cancelled through its own [`CancelToken`], so a cancel can neither be cleared by the refit
//! it was meant for nor leak into the next one.
//!
//! Making a receiver never waits: it checks its arguments and creates its transport endpoint,
//! and connects (reaches etcd, waits for the publishers, learns the model they announce) in
//! `connect`, or in the first `refit` or `stage`, within that call's own timeout
//! (python/README.md, "Connecting").

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use reshard_core::{Error, ErrorKind, HostBuffer, HostMemory, MemoryBlock, ParamSpec, Transport};
use reshard_planner::topology::ReceiverTopology;
use reshard_runtime::{ReceiverOptions, StageTimes, StagedStep, StepReport, Subscriber};

use crate::bank::{BankView, Lent};
use crate::errors::{self, boundary, invalid, IntoPy};
use crate::memory::ArrayMemory;
use crate::{
    layout_of, load_config, registry, rendezvous_spec, runtime, timeout_arg, wait, RendezvousSpec,
};

/// A connected receiver and the engine's arrays, in layout order (none in swap install).
struct State {
    subscriber: Subscriber,
    params: Vec<ArrayMemory>,
    /// The step the landing bank holds (the one installed before the live one, a staged one, or
    /// the one a rollback went back from), for messages.
    previous_step: Option<u64>,
}

/// What a receiver needs to connect, kept from its construction until it has.
struct Pending {
    /// The rendezvous, connected once reached (so a retry does not reconnect).
    rendezvous: RendezvousSpec,
    /// The model name publishers announce under.
    model: String,
    transport: Arc<dyn Transport>,
    topology: ReceiverTopology,
    /// The layout argument as given, for messages.
    layout: String,
    /// The engine's arrays (copy install) and their probes, checked once the layout is known.
    params: Option<Py<PyDict>>,
    probes: Option<Py<PyDict>>,
    /// With `architecture=`: the layout it gives and the engine's arrays checked against it at
    /// construction; the publishers' architecture must give the same parameters.
    early: Option<(Vec<ParamSpec>, Vec<ArrayMemory>)>,
}

/// A receiver's connection: waiting for `connect` (or the first refit or stage), or connected.
enum Conn {
    Pending(Box<Pending>),
    Ready(Box<State>),
}

/// How verified weights reach the engine.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Install {
    /// Copied into the engine's own arrays.
    Copy,
    /// The live bank is lent to the engine; nothing is copied.
    Swap,
}

/// The cancel flag of one refit (`Receiver.refit_async` makes one per call): set once, never
/// cleared. A refit given a token that is already set does nothing and raises
/// `reshard.Aborted`; one that is running when it is set stops as Ctrl-C stops it, unless it
/// has already installed, in which case it returns its report.
#[pyclass(module = "reshard._reshard", frozen)]
pub struct CancelToken {
    flag: Arc<AtomicBool>,
}

#[pymethods]
impl CancelToken {
    #[new]
    fn new() -> PyResult<Self> {
        boundary("CancelToken()", || {
            Ok(CancelToken {
                flag: Arc::new(AtomicBool::new(false)),
            })
        })
    }

    /// Asks the refit holding this token to stop (or never to start).
    fn cancel(&self) -> PyResult<()> {
        boundary("CancelToken.cancel", || {
            self.flag.store(true, Ordering::SeqCst);
            Ok(())
        })
    }

    /// Whether [`CancelToken::cancel`] was called.
    #[getter]
    fn cancelled(&self) -> PyResult<bool> {
        boundary("CancelToken.cancelled", || {
            Ok(self.flag.load(Ordering::SeqCst))
        })
    }
}

/// A verified step staged in the receiver's bank that is not live, waiting for
/// `Receiver.apply` (use `reshard.Receiver.stage`).
#[pyclass(module = "reshard._reshard", frozen)]
pub struct Staged {
    staged: StagedStep,
    /// Seconds the stage's Rust future took (the refit report's `rust_s`).
    rust_s: f64,
}

#[pymethods]
impl Staged {
    /// The training step staged.
    #[getter]
    fn step(&self) -> PyResult<u64> {
        boundary("Staged.step", || Ok(self.staged.step()))
    }

    /// The receiver rank that staged it.
    #[getter]
    fn rank(&self) -> PyResult<u32> {
        boundary("Staged.rank", || {
            Ok(self.staged.staged.report().receiver_rank)
        })
    }

    /// The newest step a publisher stood ready at right after staging, if newer than this one.
    #[getter]
    fn newer_step(&self) -> PyResult<Option<u64>> {
        boundary("Staged.newer_step", || {
            Ok(self.staged.newest_seen.filter(|&n| n > self.staged.step()))
        })
    }

    fn __repr__(&self) -> PyResult<String> {
        boundary("Staged.__repr__", || {
            Ok(format!(
                "Staged(step={}, rank={})",
                self.staged.step(),
                self.staged.staged.report().receiver_rank
            ))
        })
    }
}

/// One receiver rank (use `reshard.Receiver`).
#[pyclass(module = "reshard._reshard", frozen)]
pub struct NativeReceiver {
    state: Mutex<Option<Conn>>,
    rank: u32,
    install: Install,
    /// `(name, dtype, shape, bytes)` of every parameter, in layout order: known once connected,
    /// or from construction when `architecture=` was given.
    specs: std::sync::OnceLock<Vec<Spec>>,
    /// Swap install: the live bank as the last refit left it, for `weights()` (readable while
    /// another refit runs).
    live: Mutex<Option<Vec<Arc<HostBuffer>>>>,
    /// Set once the receiver has connected (readable while a refit runs in another thread).
    connected_once: AtomicBool,
    /// Swap install: live loans of bank buffers to Python.
    lent: Arc<Lent>,
    /// The step the engine's weights hold, readable while a refit runs in another thread.
    installed: Mutex<Option<u64>>,
    /// The step staged and not applied, readable while a refit runs in another thread.
    staged: Mutex<Option<u64>>,
}

/// `(name, dtype, shape, bytes)` of one parameter.
type Spec = (String, String, Vec<u64>, u64);

/// The rows of [`NativeReceiver::specs`] for `params`.
fn spec_rows(params: &[ParamSpec]) -> Vec<Spec> {
    params
        .iter()
        .map(|p| {
            let bytes = p.shape.iter().product::<u64>() * p.dtype.size();
            (p.name.clone(), p.dtype.to_string(), p.shape.clone(), bytes)
        })
        .collect()
}

impl NativeReceiver {
    /// The state, or an error when closed or busy in another thread (waiting for the lock with
    /// the GIL held could deadlock a refit that needs the GIL to check for Ctrl-C).
    fn state(&self) -> PyResult<MutexGuard<'_, Option<Conn>>> {
        let guard = self.state.try_lock().ok_or_else(|| {
            errors::busy(format!(
                "receiver rank {} is busy with a refit in another thread",
                self.rank
            ))
        })?;
        if guard.is_none() {
            return Err(errors::closed(format!(
                "receiver rank {} is closed",
                self.rank
            )));
        }
        Ok(guard)
    }

    /// Swap install: refuses (before anything is posted) a refit whose landing bank the engine
    /// still holds arrays of, naming them: the refit would overwrite weights it may be serving.
    fn check_landing(&self, s: &State) -> PyResult<()> {
        let Some(landing) = s.subscriber.receiver().landing_params() else {
            return Ok(());
        };
        let held: Vec<(&str, usize)> = landing
            .iter()
            .zip(self.specs())
            .filter_map(|(buf, (name, ..))| {
                let n = self.lent.count(buf);
                (n > 0).then_some((name.as_str(), n))
            })
            .collect();
        let Some(&(first, _)) = held.first() else {
            return Ok(());
        };
        let arrays: usize = held.iter().map(|&(_, n)| n).sum();
        let mut names: Vec<&str> = held.iter().map(|&(n, _)| n).take(3).collect();
        if held.len() > 3 {
            names.push("...");
        }
        let step = s
            .previous_step
            .map_or_else(|| "an earlier step".to_string(), |n| format!("step {n}"));
        Err(errors::busy_tensor(
            format!(
                "receiver rank {}: the next refit lands in the buffers of {step}, and {arrays} \
                 array(s) from weights() still view them ({} of {} parameters: {}); an array \
                 from weights() stays valid until the refit after the one that installed it, \
                 so re-point the engine to the newest weights() and drop older arrays before \
                 refitting. Nothing was written",
                self.rank,
                held.len(),
                self.specs().len(),
                names.join(", ")
            ),
            first,
        ))
    }

    /// Copy install: refuses engine arrays that are no longer where they were registered
    /// (memory.rs), naming the first; `done` says what was not done.
    fn check_params(&self, py: Python<'_>, s: &State, done: &str) -> PyResult<()> {
        for (m, (name, ..)) in s.params.iter().zip(self.specs()) {
            m.check(py, name, done)?;
        }
        Ok(())
    }
}

fn stages_dict<'py>(py: Python<'py>, st: &StageTimes) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (name, v) in StageTimes::NAMES.iter().zip(st.values()) {
        d.set_item(name, v)?;
    }
    Ok(d)
}

#[pymethods]
impl NativeReceiver {
    /// See `reshard.Receiver`.
    #[new]
    #[pyo3(signature = (model, layout, rank, rendezvous_arg, params, transport=None, config=None, timeout_s=300.0, install="copy", probes=None, architecture=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model: &str,
        layout: &str,
        rank: u32,
        rendezvous_arg: &Bound<'_, PyAny>,
        params: Option<&Bound<'_, PyDict>>,
        transport: Option<&str>,
        config: Option<&str>,
        timeout_s: f64,
        install: &str,
        probes: Option<&Bound<'_, PyDict>>,
        architecture: Option<&str>,
    ) -> PyResult<Self> {
        boundary("Receiver()", || {
            Self::open(
                py,
                model,
                layout,
                rank,
                rendezvous_arg,
                params,
                transport,
                config,
                timeout_s,
                install,
                probes,
                architecture,
            )
        })
    }

    /// Connects (reaches the rendezvous, waits for the publishers, learns their model),
    /// waiting up to `timeout_s` overall; does nothing when connected already. `cancel`, when
    /// given, stops the wait (see [`CancelToken`]).
    #[pyo3(signature = (timeout_s=300.0, cancel=None))]
    fn connect<'py>(
        &self,
        py: Python<'py>,
        timeout_s: f64,
        cancel: Option<&Bound<'py, CancelToken>>,
    ) -> PyResult<()> {
        boundary("Receiver.connect", || {
            let t0 = Instant::now();
            let timeout = timeout_arg("timeout", timeout_s)?;
            let cancel = cancel.map(|c| c.get().flag.clone());
            self.refuse_cancelled(cancel.as_deref(), "connect")?;
            let mut guard = self.state()?;
            self.connected(py, &mut guard, t0, timeout, cancel.as_deref())?;
            Ok(())
        })
    }

    /// Whether the receiver has connected.
    #[getter]
    fn is_connected(&self) -> PyResult<bool> {
        boundary("Receiver.connected", || {
            Ok(self.connected_once.load(Ordering::SeqCst))
        })
    }

    /// JSON of the model configuration the publishers announce; NotConnected before connecting.
    fn architecture(&self) -> PyResult<String> {
        boundary("Receiver.architecture", || {
            let mut guard = self.state()?;
            let s = self.ready(
                &mut guard,
                "its architecture is what the publishers announce",
            )?;
            serde_json::to_string(s.subscriber.model())
                .map_err(|e| invalid(ErrorKind::Internal, format!("model to JSON: {e}"), None))
        })
    }

    /// Installs the next step (waiting up to `timeout_s` for it) into the engine's arrays and
    /// returns the report as a dict. On any error the arrays and the live step are untouched.
    /// `cancel`, when given, stops the refit (see [`CancelToken`]).
    #[pyo3(signature = (timeout_s=300.0, cancel=None, step=None, allow_older=false))]
    fn refit<'py>(
        &self,
        py: Python<'py>,
        timeout_s: f64,
        cancel: Option<&Bound<'py, CancelToken>>,
        step: Option<u64>,
        allow_older: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        boundary("Receiver.refit", || {
            let t0 = Instant::now();
            let timeout = timeout_arg("timeout", timeout_s)?;
            let cancel = cancel.map(|c| c.get().flag.clone());
            self.refuse_cancelled(cancel.as_deref(), "refit")?;
            let mut guard = self.state()?;
            let s = self.connected(py, &mut guard, t0, timeout, cancel.as_deref())?;
            let left = timeout.saturating_sub(t0.elapsed());
            let staged = self.stage_step(py, s, left, step, allow_older, cancel.as_deref())?;
            self.apply_staged(py, s, &staged, t0)
        })
    }

    /// Moves and verifies a step (the newest above the live one, or exactly `step`) into the
    /// bank that is not live, waiting up to `timeout_s` overall; the engine's weights and the
    /// live step stay as they are. Returns the handle `apply` takes.
    #[pyo3(signature = (timeout_s=60.0, step=None, allow_older=false, cancel=None))]
    fn stage<'py>(
        &self,
        py: Python<'py>,
        timeout_s: f64,
        step: Option<u64>,
        allow_older: bool,
        cancel: Option<&Bound<'py, CancelToken>>,
    ) -> PyResult<Staged> {
        boundary("Receiver.stage", || {
            let t0 = Instant::now();
            let timeout = timeout_arg("timeout", timeout_s)?;
            let cancel = cancel.map(|c| c.get().flag.clone());
            self.refuse_cancelled(cancel.as_deref(), "stage")?;
            let mut guard = self.state()?;
            let s = self.connected(py, &mut guard, t0, timeout, cancel.as_deref())?;
            let left = timeout.saturating_sub(t0.elapsed());
            self.stage_step(py, s, left, step, allow_older, cancel.as_deref())
        })
    }

    /// Makes a staged step live (swap install: a pointer swap; copy install: the copy into
    /// the engine's arrays) and returns the report as a dict.
    fn apply<'py>(
        &self,
        py: Python<'py>,
        staged: &Bound<'py, Staged>,
    ) -> PyResult<Bound<'py, PyDict>> {
        boundary("Receiver.apply", || {
            let t0 = Instant::now();
            let mut guard = self.state()?;
            let s = self.ready(
                &mut guard,
                "nothing was staged, so there is nothing to apply",
            )?;
            self.apply_staged(py, s, staged.get(), t0)
        })
    }

    /// Makes the previous step live again from the bank that still holds it: no wire, no
    /// publisher. Returns `{step, rolled_back_from, install, install_s, copy_s, native_s}`.
    fn rollback<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        boundary("Receiver.rollback", || self.roll_back(py))
    }

    /// The step staged and not applied yet, or None.
    #[getter]
    fn staged_step(&self) -> PyResult<Option<u64>> {
        boundary("Receiver.staged_step", || Ok(*self.staged.lock()))
    }

    /// Swap install: `[(name, view, dtype, shape)]` of the live bank, each view a read-only
    /// buffer of the parameter's bytes that stays valid (and unchanged) while it lives; None
    /// before the first refit. Callable while a refit runs in another thread.
    fn weights<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        boundary("Receiver.weights", || self.lend_weights(py))
    }

    /// The step of the engine's weights, or None before the first refit; while a refit runs
    /// in another thread, the step it is replacing.
    #[getter]
    fn live_step(&self) -> PyResult<Option<u64>> {
        boundary("Receiver.live_step", || Ok(*self.installed.lock()))
    }

    /// `[(name, dtype, shape)]` of this rank's parameters, in engine order: known once
    /// connected, or from construction with `architecture=`; NotConnected otherwise.
    fn params<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        boundary("Receiver.params", || {
            let Some(specs) = self.specs.get() else {
                // Closed wins over not connected.
                drop(self.state()?);
                return Err(errors::not_connected(format!(
                    "receiver rank {} has not connected: its parameters come from the model the \
                     publishers announce (call connect(), or pass architecture=)",
                    self.rank
                )));
            };
            let rows: Vec<(String, String, Vec<u64>)> = specs
                .iter()
                .map(|(n, d, s, _)| (n.clone(), d.clone(), s.clone()))
                .collect();
            PyList::new(py, rows)
        })
    }

    /// Releases the receiver's buffers and the engine's arrays (which it only borrowed).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        boundary("Receiver.close", || {
            let taken = self.state.try_lock().and_then(|mut g| g.take());
            py.allow_threads(move || drop(taken));
            Ok(())
        })
    }
}

impl NativeReceiver {
    /// [`NativeReceiver::new`]'s body: checks every argument and creates the transport
    /// endpoint; connects nothing.
    #[allow(clippy::too_many_arguments)]
    fn open(
        py: Python<'_>,
        model: &str,
        layout: &str,
        rank: u32,
        rendezvous_arg: &Bound<'_, PyAny>,
        params: Option<&Bound<'_, PyDict>>,
        transport: Option<&str>,
        config: Option<&str>,
        timeout_s: f64,
        install: &str,
        probes: Option<&Bound<'_, PyDict>>,
        architecture: Option<&str>,
    ) -> PyResult<Self> {
        // Checked here though only connect() uses it: a bad value fails where it was written.
        timeout_arg("timeout", timeout_s)?;
        let install = match (install, params.is_some()) {
            ("copy", true) => Install::Copy,
            ("swap", false) => Install::Swap,
            ("copy", false) => {
                return Err(invalid(
                    ErrorKind::InvalidInput,
                    "install=\"copy\" copies into the engine's arrays: pass them as params \
                     (or use install=\"swap\" to serve from reshard's buffers)"
                        .into(),
                    None,
                ))
            }
            ("swap", true) => {
                return Err(invalid(
                    ErrorKind::InvalidInput,
                    "install=\"swap\" serves from reshard's own buffers (Receiver.weights()); \
                     it takes no params"
                        .into(),
                    None,
                ))
            }
            (other, _) => {
                return Err(invalid(
                    ErrorKind::InvalidInput,
                    format!("install must be \"copy\" or \"swap\", not {other:?}"),
                    None,
                ))
            }
        };
        let topology: ReceiverTopology = layout.parse().py_err()?;
        let cfg = load_config(transport, config).py_err()?;
        let rendezvous = rendezvous_spec(rendezvous_arg, crate::DEFAULT_LEASE_TTL)?;
        let specs = std::sync::OnceLock::new();
        let early = match architecture {
            Some(arch) => {
                let wanted = layout_of(arch, layout, rank)?.params;
                let arrays = match params {
                    Some(params) => engine_arrays(params, probes, &wanted, rank, layout)?,
                    None => Vec::new(),
                };
                let _ = specs.set(spec_rows(&wanted));
                Some((wanted, arrays))
            }
            None => None,
        };
        let agent = crate::agent_name(&format!("{model}-receiver-{rank}"));
        let rt = runtime().py_err()?;
        let transport = {
            let _guard = rt.enter();
            registry().create(&agent, &cfg.transport).py_err()?
        };
        let _ = py;
        Ok(NativeReceiver {
            state: Mutex::new(Some(Conn::Pending(Box::new(Pending {
                rendezvous,
                model: model.to_string(),
                transport,
                topology,
                layout: layout.to_string(),
                params: params.map(|p| p.clone().unbind()),
                probes: probes.map(|p| p.clone().unbind()),
                early,
            })))),
            rank,
            install,
            specs,
            connected_once: AtomicBool::new(false),
            live: Mutex::new(None),
            lent: Arc::new(Lent::default()),
            installed: Mutex::new(None),
            staged: Mutex::new(None),
        })
    }

    /// The parameters' rows, empty before they are known.
    fn specs(&self) -> &[Spec] {
        self.specs.get().map_or(&[], |v| v.as_slice())
    }

    /// Raises Aborted when `cancel` is set already: the call (`what`) does nothing.
    fn refuse_cancelled(&self, cancel: Option<&AtomicBool>, what: &str) -> PyResult<()> {
        if cancel.is_some_and(|c| c.load(Ordering::SeqCst)) {
            return Err(invalid(
                ErrorKind::Aborted,
                format!(
                    "receiver rank {}: the {what} was cancelled before it started; nothing was \
                     done, the live weights are untouched",
                    self.rank
                ),
                None,
            ));
        }
        Ok(())
    }

    /// The connected state, or NotConnected (saying why `what` needs none) when the receiver
    /// has not connected yet, or Closed.
    fn ready<'g>(&self, guard: &'g mut Option<Conn>, what: &str) -> PyResult<&'g mut State> {
        match guard.as_mut() {
            Some(Conn::Ready(s)) => Ok(&mut **s),
            Some(Conn::Pending(_)) => Err(errors::not_connected(format!(
                "receiver rank {} has not connected to its publishers: {what}",
                self.rank
            ))),
            None => Err(self.closed()),
        }
    }

    /// The connected state, connecting first when the receiver has not: the rendezvous, then
    /// the publishers, all by `t0 + timeout` (the calling method's own deadline). A failure
    /// leaves the receiver unconnected (the next call tries again, reusing a reached etcd).
    fn connected<'g>(
        &self,
        py: Python<'_>,
        guard: &'g mut Option<Conn>,
        t0: Instant,
        timeout: Duration,
        cancel: Option<&AtomicBool>,
    ) -> PyResult<&'g mut State> {
        let conn = guard.as_mut().ok_or_else(|| self.closed())?;
        if let Conn::Pending(p) = conn {
            let state = self.connect_pending(py, p, t0, timeout, cancel)?;
            *conn = Conn::Ready(Box::new(state));
            self.connected_once.store(true, Ordering::SeqCst);
        }
        match conn {
            Conn::Ready(s) => Ok(&mut **s),
            Conn::Pending(_) => Err(invalid(
                ErrorKind::Internal,
                "receiver not connected after connecting".into(),
                None,
            )),
        }
    }

    /// [`NativeReceiver::connected`]'s work: a connected [`State`] from `p`.
    fn connect_pending(
        &self,
        py: Python<'_>,
        p: &mut Pending,
        t0: Instant,
        timeout: Duration,
        cancel: Option<&AtomicBool>,
    ) -> PyResult<State> {
        let rank = self.rank;
        let left = || timeout.saturating_sub(t0.elapsed());
        if let RendezvousSpec::Etcd { url, .. } = &p.rendezvous {
            let url = url.clone();
            let spec = &p.rendezvous;
            let budget = left();
            let reached = wait(py, cancel, async move {
                tokio::time::timeout(budget, spec.connect())
                    .await
                    .unwrap_or_else(|_| {
                        Err(Error::new(
                            ErrorKind::Timeout,
                            format!(
                                "receiver rank {rank}: etcd at {url} did not answer within the \
                                 call's timeout ({timeout:?})"
                            ),
                        ))
                    })
            })?;
            p.rendezvous = RendezvousSpec::Ready(reached);
        }
        let RendezvousSpec::Ready(rendezvous) = &p.rendezvous else {
            return Err(invalid(
                ErrorKind::Internal,
                "rendezvous not reached".into(),
                None,
            ));
        };
        let subscriber = wait(
            py,
            cancel,
            Subscriber::connect(
                rendezvous.clone(),
                &p.model,
                p.transport.clone(),
                &p.topology,
                rank,
                ReceiverOptions::default(),
                left(),
            ),
        )?;
        let announced = &subscriber.receiver().layout().params;
        let arrays = match p.early.take() {
            Some((wanted, arrays)) => {
                if let Err(e) = same_params(&wanted, announced, rank, &p.model) {
                    p.early = Some((wanted, arrays));
                    return Err(e);
                }
                arrays
            }
            None => {
                let _ = self.specs.set(spec_rows(announced));
                match &p.params {
                    Some(params) => engine_arrays(
                        params.bind(py),
                        p.probes.as_ref().map(|d| d.bind(py)),
                        announced,
                        rank,
                        &p.layout,
                    )?,
                    None => Vec::new(),
                }
            }
        };
        Ok(State {
            subscriber,
            params: arrays,
            previous_step: None,
        })
    }

    fn closed(&self) -> PyErr {
        errors::closed(format!("receiver rank {} is closed", self.rank))
    }

    /// Stages a step (the body of `stage` and the first half of `refit`): nothing the engine
    /// can see changes.
    fn stage_step(
        &self,
        py: Python<'_>,
        s: &mut State,
        timeout: Duration,
        step: Option<u64>,
        allow_older: bool,
        cancel: Option<&AtomicBool>,
    ) -> PyResult<Staged> {
        match self.install {
            Install::Swap => self.check_landing(s)?,
            Install::Copy => self.check_params(py, s, "written")?,
        }
        // The Rust path's own time is taken inside the future: what `reshard receive` spends
        // per step, without this binding's GIL release and polling around it.
        let subscriber = &mut s.subscriber;
        let staged = wait(py, cancel, async move {
            let t = Instant::now();
            let r = subscriber.stage(step, allow_older, timeout).await;
            // Whatever the outcome, a step staged before is gone once a stage posted.
            Ok((r, t.elapsed().as_secs_f64()))
        });
        *self.staged.lock() = s.subscriber.receiver().staged_step();
        let (staged, rust_s) = staged?;
        let staged = staged.py_err()?;
        s.previous_step = Some(staged.step());
        Ok(Staged { staged, rust_s })
    }

    /// Applies `staged` (the body of `apply` and the second half of `refit`); `t0` is when the
    /// native call began.
    fn apply_staged<'py>(
        &self,
        py: Python<'py>,
        s: &mut State,
        staged: &Staged,
        t0: Instant,
    ) -> PyResult<Bound<'py, PyDict>> {
        if self.install == Install::Copy {
            // Again, with the GIL held: the engine ran while the stage did. Checked before the
            // receiver's own apply, so a refusal changes nothing.
            let installed = self
                .installed
                .lock()
                .map_or_else(|| "no step".to_string(), |n| format!("step {n}"));
            let done = format!(
                "written: step {} was received and verified but not copied (it stays staged), \
                 the engine's arrays hold {installed}",
                staged.staged.step()
            );
            self.check_params(py, s, &done)?;
        }
        let before = s.subscriber.receiver().live_step();
        let report: StepReport = s.subscriber.apply(&staged.staged).py_err()?;
        *self.staged.lock() = None;
        s.previous_step = before;
        let copy_s = self.install_live(py, s);
        *self.installed.lock() = Some(report.step);
        let u = &report.update;
        let d = PyDict::new(py);
        d.set_item("step", report.step)?;
        // Installed, and every installed byte matched a publisher digest.
        d.set_item("verified", u.fully_checked())?;
        d.set_item("reads", u.wire_reads)?;
        d.set_item("wire_bytes", u.wire_bytes)?;
        d.set_item("stages", stages_dict(py, &u.stages)?)?;
        d.set_item("e2e_s", u.e2e_s)?;
        d.set_item("attribution", u.attribution)?;
        d.set_item("discovery_s", report.discovery_s)?;
        d.set_item("peers_loaded", report.peers_loaded)?;
        d.set_item("plan_rebuilt", u.plan_rebuilt)?;
        d.set_item("checked_bytes", u.checked_bytes)?;
        d.set_item("rust_s", staged.rust_s)?;
        d.set_item("copy_s", copy_s)?;
        d.set_item("install", self.install_name())?;
        d.set_item("native_s", t0.elapsed().as_secs_f64())?;
        d.set_item("newer_step", report.newer_step)?;
        d.set_item("apply_s", u.stages.install + copy_s)?;
        Ok(d)
    }

    /// Hands the receiver's live bank to the engine: copied into its arrays (copy install;
    /// returns the seconds the copy took) or lent as is (swap install; 0).
    /// `_gil` proves the GIL is held: a copy install must run under it (see below).
    fn install_live(&self, _gil: Python<'_>, s: &State) -> f64 {
        let live = s.subscriber.receiver().live_params().unwrap_or(&[]);
        match self.install {
            // With the GIL held, as the arrays were checked: no Python thread can resize or
            // free one between its check and the copy into it (issue 42: the copy once ran with
            // the GIL released). The copy is the apply, inside the engine's pause.
            Install::Copy => copy_into(live, &s.params),
            Install::Swap => {
                *self.live.lock() = Some(live.to_vec());
                0.0
            }
        }
    }

    fn install_name(&self) -> &'static str {
        match self.install {
            Install::Copy => "copy",
            Install::Swap => "swap",
        }
    }

    /// [`NativeReceiver::rollback`]'s body.
    fn roll_back<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t0 = Instant::now();
        let mut guard = self.state()?;
        let s = self.ready(
            &mut guard,
            "no step was ever live, so there is none to go back to",
        )?;
        if self.install == Install::Copy {
            let installed = self
                .installed
                .lock()
                .map_or_else(|| "no step".to_string(), |n| format!("step {n}"));
            let done = format!("rolled back: the engine's arrays hold {installed}");
            self.check_params(py, s, &done)?;
        }
        let r = s.subscriber.rollback().py_err()?;
        s.previous_step = Some(r.rolled_back_from);
        let copy_s = self.install_live(py, s);
        *self.installed.lock() = Some(r.step);
        let d = PyDict::new(py);
        d.set_item("step", r.step)?;
        d.set_item("rolled_back_from", r.rolled_back_from)?;
        d.set_item("install", self.install_name())?;
        d.set_item("install_s", r.install_s)?;
        d.set_item("copy_s", copy_s)?;
        d.set_item("native_s", t0.elapsed().as_secs_f64())?;
        Ok(d)
    }

    /// [`NativeReceiver::weights`]'s body.
    fn lend_weights<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        if self.install != Install::Swap {
            return Err(invalid(
                ErrorKind::InvalidInput,
                format!(
                    "receiver rank {} installs by copy: its weights are the engine's own arrays",
                    self.rank
                ),
                None,
            ));
        }
        let live = self.live.lock();
        let Some(live) = live.as_ref() else {
            return Ok(None);
        };
        let rows = PyList::empty(py);
        for (buf, (name, dtype, shape, bytes)) in live.iter().zip(self.specs()) {
            let view = BankView::lend(buf.clone(), *bytes as usize, self.lent.clone());
            rows.append((name, Py::new(py, view)?, dtype, shape.clone()))?;
        }
        Ok(Some(rows))
    }
}

/// The engine's arrays for copy install, in layout order: every parameter given, of its shape
/// and dtype, writable and C-contiguous, no name the layout lacks, and no two sharing a byte
/// (each error names them). `probes` maps a parameter to the probe of the object its array
/// views (memory.rs).
fn engine_arrays(
    params: &Bound<'_, PyDict>,
    probes: Option<&Bound<'_, PyDict>>,
    specs: &[ParamSpec],
    rank: u32,
    layout: &str,
) -> PyResult<Vec<ArrayMemory>> {
    for key in params.keys() {
        let name: String = key.extract()?;
        if !specs.iter().any(|p| p.name == name) {
            return Err(invalid(
                ErrorKind::InvalidInput,
                format!(
                    "receiver rank {rank} of layout {layout:?} has no parameter {name:?} \
                     (reshard.receiver_params names them)"
                ),
                Some(&name),
            ));
        }
    }
    let mut arrays = Vec::with_capacity(specs.len());
    for p in specs {
        let array = params.get_item(&p.name)?.ok_or_else(|| {
            invalid(
                ErrorKind::InvalidInput,
                format!(
                    "params has no array for parameter {:?} of receiver rank {rank}",
                    p.name
                ),
                Some(&p.name),
            )
        })?;
        let probe = match probes {
            Some(probes) => probes.get_item(&p.name)?,
            None => None,
        };
        let m = ArrayMemory::export(&array, true, &p.name, probe.as_ref())?;
        if m.shape != p.shape || !m.holds(p.dtype) {
            return Err(invalid(
                ErrorKind::InvalidInput,
                format!(
                    "parameter {:?} of receiver rank {rank} is {} {:?}; the array given \
                     has format {:?} ({} bytes per element) and shape {:?}",
                    p.name, p.dtype, p.shape, m.format, m.itemsize, m.shape
                ),
                Some(&p.name),
            ));
        }
        arrays.push(m);
    }
    refuse_overlaps(&arrays, specs, rank)?;
    Ok(arrays)
}

/// Refuses a connection whose publishers' model gives receiver rank `rank` other parameters
/// than the `architecture=` it was made with (`wanted`), naming the first that differs.
fn same_params(
    wanted: &[ParamSpec],
    announced: &[ParamSpec],
    rank: u32,
    model: &str,
) -> PyResult<()> {
    let show = |p: Option<&ParamSpec>| {
        p.map_or_else(
            || "nothing".to_string(),
            |p| format!("{} {} {:?}", p.name, p.dtype, p.shape),
        )
    };
    for i in 0..wanted.len().max(announced.len()) {
        let (w, a) = (wanted.get(i), announced.get(i));
        let same = match (w, a) {
            (Some(w), Some(a)) => w.name == a.name && w.dtype == a.dtype && w.shape == a.shape,
            _ => false,
        };
        if !same {
            return Err(invalid(
                ErrorKind::Config,
                format!(
                    "receiver rank {rank}: the publishers of model {model:?} announce an \
                     architecture that differs from the architecture= given: parameter {i} is \
                     {} there, {} here",
                    show(a),
                    show(w)
                ),
                w.or(a).map(|p| p.name.as_str()),
            ));
        }
    }
    Ok(())
}

/// Refuses engine arrays that share a byte, naming both: the copy writes every parameter in
/// parallel, so two over one memory would race, and one would end up holding the other's bytes.
fn refuse_overlaps(arrays: &[ArrayMemory], specs: &[ParamSpec], rank: u32) -> PyResult<()> {
    let mut spans: Vec<(usize, usize, &str)> = arrays
        .iter()
        .zip(specs)
        .filter(|(m, _)| m.len() > 0)
        .map(|(m, p)| (m.addr(), m.addr() + m.len(), p.name.as_str()))
        .collect();
    spans.sort_unstable();
    // The span reaching furthest so far: any later start below its end overlaps it.
    let mut reach: Option<(usize, &str)> = None;
    for &(start, end, name) in &spans {
        if let Some((far, other)) = reach {
            if start < far {
                return Err(invalid(
                    ErrorKind::InvalidInput,
                    format!(
                        "parameters {other:?} and {name:?} of receiver rank {rank} share memory \
                         (bytes {start:#x}..{:#x}): every parameter needs an array of its own, \
                         since a refit writes them all at once",
                        far.min(end)
                    ),
                    Some(name),
                ));
            }
        }
        if reach.is_none_or(|(far, _)| end > far) {
            reach = Some((end, name));
        }
    }
    Ok(())
}

/// Copies the verified live bank into the engine's arrays (same order, same sizes: checked at
/// construction), in parallel; returns the seconds it took.
fn copy_into(live: &[Arc<reshard_core::HostBuffer>], params: &[ArrayMemory]) -> f64 {
    use rayon::prelude::*;
    let t0 = Instant::now();
    live.par_iter()
        .zip(params.par_iter())
        .for_each(|(src, dst)| {
            let src = src.read();
            let mut dst = dst.bytes_mut();
            let n = src.len().min(dst.len());
            dst[..n].copy_from_slice(&src[..n]);
        });
    t0.elapsed().as_secs_f64()
}
