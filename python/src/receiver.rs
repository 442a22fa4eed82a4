//! The native receiver: a [`Subscriber`] (runtime/src/subscriber.rs) that installs every step
//! into its own double-buffered banks, verified, and only then copies the new weights into the
//! engine's arrays. The engine's arrays are never a landing zone: a failed refit (dead
//! publisher, digest mismatch, timeout, Ctrl-C) returns before the copy, so they keep the
//! previous step's weights bit for bit. The copy is the price of that guarantee; its time is
//! reported as `copy_s` (BENCHMARKS.md has the numbers).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use reshard_core::{ErrorKind, HostMemory};
use reshard_planner::topology::ReceiverTopology;
use reshard_runtime::{ReceiverOptions, StageTimes, StepReport, Subscriber};

use crate::errors::{invalid, IntoPy};
use crate::memory::ArrayMemory;
use crate::{load_config, registry, rendezvous, runtime, wait};

/// A connected receiver and the engine's arrays, in layout order.
struct State {
    subscriber: Subscriber,
    params: Vec<ArrayMemory>,
}

/// One receiver rank (use `reshard.Receiver`).
#[pyclass(module = "reshard._reshard", frozen)]
pub struct NativeReceiver {
    state: Mutex<Option<State>>,
    cancel: AtomicBool,
    rank: u32,
}

impl NativeReceiver {
    /// The state, or an error when closed or busy in another thread (waiting for the lock with
    /// the GIL held could deadlock a refit that needs the GIL to check for Ctrl-C).
    fn state(&self) -> PyResult<MutexGuard<'_, Option<State>>> {
        let guard = self.state.try_lock().ok_or_else(|| {
            invalid(
                ErrorKind::InvalidInput,
                format!(
                    "receiver rank {} is busy with a refit in another thread",
                    self.rank
                ),
                None,
            )
        })?;
        if guard.is_none() {
            return Err(invalid(
                ErrorKind::InvalidInput,
                format!("receiver rank {} is closed", self.rank),
                None,
            ));
        }
        Ok(guard)
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
    #[pyo3(signature = (model, layout, rank, rendezvous_arg, params, transport=None, config=None, timeout_s=300.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model: &str,
        layout: &str,
        rank: u32,
        rendezvous_arg: &Bound<'_, PyAny>,
        params: &Bound<'_, PyDict>,
        transport: Option<&str>,
        config: Option<&str>,
        timeout_s: f64,
    ) -> PyResult<Self> {
        let topo: ReceiverTopology = layout.parse().py_err()?;
        let cfg = load_config(transport, config).py_err()?;
        let rendezvous = rendezvous(py, rendezvous_arg, 10.0)?;
        let agent = crate::agent_name(&format!("{model}-receiver-{rank}"));
        let rt = runtime().py_err()?;
        let t = {
            let _guard = rt.enter();
            registry().create(&agent, &cfg.transport).py_err()?
        };
        let timeout = Duration::from_secs_f64(timeout_s.max(0.0));
        let subscriber = wait(
            py,
            None,
            Subscriber::connect(
                rendezvous,
                model,
                t,
                &topo,
                rank,
                ReceiverOptions::default(),
                timeout,
            ),
        )?;
        let specs = subscriber.receiver().layout().params.clone();
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
        for p in &specs {
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
            let m = ArrayMemory::export(&array, true, &p.name)?;
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
        Ok(NativeReceiver {
            state: Mutex::new(Some(State {
                subscriber,
                params: arrays,
            })),
            cancel: AtomicBool::new(false),
            rank,
        })
    }

    /// Installs the next step (waiting up to `timeout_s` for it) into the engine's arrays and
    /// returns the report as a dict. On any error the arrays and the live step are untouched.
    #[pyo3(signature = (timeout_s=300.0))]
    fn refit<'py>(&self, py: Python<'py>, timeout_s: f64) -> PyResult<Bound<'py, PyDict>> {
        let t0 = Instant::now();
        let mut guard = self.state()?;
        let s = guard
            .as_mut()
            .ok_or_else(|| invalid(ErrorKind::InvalidInput, "receiver is closed".into(), None))?;
        self.cancel.store(false, Ordering::SeqCst);
        let timeout = Duration::from_secs_f64(timeout_s.max(0.0));
        // The Rust path's own time is taken inside the future: what `reshard receive` spends
        // per step, without this binding's GIL release and polling around it.
        let subscriber = &mut s.subscriber;
        let (report, rust_s): (StepReport, f64) = wait(py, Some(&self.cancel), async move {
            let t = Instant::now();
            let r = subscriber.next_step(timeout).await?;
            Ok((r, t.elapsed().as_secs_f64()))
        })?;
        let copy_s = {
            let live = s.subscriber.receiver().live_params().unwrap_or(&[]);
            let params = &s.params;
            py.allow_threads(|| copy_into(live, params))
        };
        let u = &report.update;
        let d = PyDict::new(py);
        d.set_item("step", report.step)?;
        d.set_item("verified", true)?;
        d.set_item("reads", u.wire_reads)?;
        d.set_item("wire_bytes", u.wire_bytes)?;
        d.set_item("stages", stages_dict(py, &u.stages)?)?;
        d.set_item("e2e_s", u.e2e_s)?;
        d.set_item("attribution", u.attribution)?;
        d.set_item("discovery_s", report.discovery_s)?;
        d.set_item("peers_loaded", report.peers_loaded)?;
        d.set_item("plan_rebuilt", u.plan_rebuilt)?;
        d.set_item("checked_bytes", u.checked_bytes)?;
        d.set_item("rust_s", rust_s)?;
        d.set_item("copy_s", copy_s)?;
        d.set_item("native_s", t0.elapsed().as_secs_f64())?;
        Ok(d)
    }

    /// Asks a running refit (in another thread) to stop; it raises `reshard.Aborted`.
    fn cancel(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }

    /// The step of the weights in the engine's arrays, or None before the first refit.
    #[getter]
    fn live_step(&self) -> PyResult<Option<u64>> {
        let guard = self.state()?;
        Ok(guard
            .as_ref()
            .and_then(|s| s.subscriber.receiver().live_step()))
    }

    /// `[(name, dtype, shape)]` of this rank's parameters, in engine order.
    fn params<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let guard = self.state()?;
        let rows: Vec<(String, String, Vec<u64>)> = guard
            .as_ref()
            .map(|s| {
                s.subscriber
                    .receiver()
                    .layout()
                    .params
                    .iter()
                    .map(|p| (p.name.clone(), p.dtype.to_string(), p.shape.clone()))
                    .collect()
            })
            .unwrap_or_default();
        PyList::new(py, rows)
    }

    /// Releases the receiver's buffers and the engine's arrays (which it only borrowed).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let taken = self.state.try_lock().and_then(|mut g| g.take());
        py.allow_threads(move || drop(taken));
        Ok(())
    }
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
