//! `reshard._reshard`, the native half of the `reshard` Python package (python/reshard/): the
//! publisher and receiver of the deployment path (docs/deployment.md) driven in-process, over
//! arrays the caller owns. The pure-Python half adds the context manager, `refit_async` and the
//! report class; this file holds what both classes share: one tokio runtime, one transport
//! registry (so in-process loopback endpoints share a fabric), rendezvous, model and timeout
//! arguments, and waiting with the GIL released while Ctrl-C stays live. Every exported function
//! and method runs behind [`errors::boundary`], so no Rust panic reaches Python as PyO3's
//! `PanicException`.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyList;

use reshard_core::config::Config;
use reshard_core::registry::Registry;
use reshard_core::rendezvous::Rendezvous;
use reshard_core::{Error, ErrorKind, Result, WantedLayout};
use reshard_planner::layouts::receiver_layout;
use reshard_planner::presets::{preset, ModelConfig};
use reshard_planner::topology::{PublisherTopology, ReceiverTopology};
use reshard_rendezvous::{Etcd, EtcdOptions, InProcess};

mod bank;
mod errors;
mod memory;
mod publisher;
mod receiver;

use errors::{boundary, IntoPy};

/// The runtime every call blocks on (two workers: transfers are driven by the backends' own
/// threads, the runtime only sequences them).
fn runtime() -> Result<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<std::result::Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("reshard")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| {
        Error::new(
            ErrorKind::Internal,
            format!("cannot start the async runtime: {e}"),
        )
    })
}

/// One registry per process: its loopback fabric is what lets an in-process publisher and
/// receiver reach each other.
fn registry() -> &'static Registry {
    static REG: OnceLock<Registry> = OnceLock::new();
    REG.get_or_init(reshard::registry)
}

/// A transport agent name unique in this process (`base`, the pid and a counter): endpoints of
/// one loopback fabric must not share a name, and one process may hold several of one rank.
fn agent_name(base: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{base}-{}-{n}", std::process::id())
}

/// The transport configuration: `config` (a JSON object, as `reshard.toml` would give it) with
/// the scheme `transport` on top; environment variables apply as in the CLI.
fn load_config(transport: Option<&str>, config: Option<&str>) -> Result<Config> {
    let mut cli = match config {
        Some(text) => serde_json::from_str::<serde_json::Value>(text).map_err(|e| {
            Error::new(
                ErrorKind::Config,
                format!("config is not a JSON object: {e}"),
            )
        })?,
        None => serde_json::json!({}),
    };
    if let Some(kind) = transport {
        if !cli.is_object() {
            return Err(Error::new(ErrorKind::Config, "config must be a dict"));
        }
        cli["transport"]["kind"] = serde_json::Value::from(kind);
    }
    registry().load_config(None, Some(cli))
}

/// An in-process rendezvous: publishers and receivers of one Python process meet through it.
#[pyclass(module = "reshard._reshard", frozen)]
pub struct InProcessHub {
    hub: Arc<InProcess>,
}

#[pymethods]
impl InProcessHub {
    #[new]
    fn new() -> PyResult<Self> {
        boundary("InProcessHub()", || {
            Ok(InProcessHub {
                hub: Arc::new(InProcess::new()),
            })
        })
    }

    fn __repr__(&self) -> PyResult<String> {
        boundary("InProcessHub.__repr__", || Ok("InProcessHub()".to_string()))
    }
}

/// The longest wait handed on to the runtime: a century, which every deadline computed from it
/// (an `Instant` plus this) still represents, and which no wait outlives in practice. A
/// timeout of `inf`, or of a century or more, is this: no timeout.
const NO_TIMEOUT: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The timeout argument `arg` in seconds: NaN or negative is InvalidInput naming `arg`; `inf`
/// (and any value of a century or more) means no timeout ([`NO_TIMEOUT`]). Never panics, unlike
/// `Duration::from_secs_f64`, which does for NaN, negative, infinite and huge values.
fn timeout_arg(arg: &str, seconds: f64) -> PyResult<Duration> {
    if seconds.is_nan() || seconds < 0.0 {
        return Err(errors::invalid(
            ErrorKind::InvalidInput,
            format!(
                "{arg} must be a number of seconds >= 0, or inf for no timeout; {seconds} is not"
            ),
            None,
        ));
    }
    if seconds >= NO_TIMEOUT.as_secs_f64() {
        return Ok(NO_TIMEOUT);
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// The lease a receiver's rendezvous client is given (it announces nothing, so holds none).
const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);

/// The longest lease, in seconds: etcd's own maximum.
const MAX_LEASE_TTL_S: f64 = 9e9;

/// The lease TTL argument in seconds: finite, 0 to [`MAX_LEASE_TTL_S`], raised to etcd's
/// one-second granularity. An infinite lease is refused rather than capped: it would keep a dead
/// publisher's announcement, and receivers waiting on it, forever.
fn lease_ttl_arg(seconds: f64) -> PyResult<Duration> {
    if !(0.0..=MAX_LEASE_TTL_S).contains(&seconds) {
        return Err(errors::invalid(
            ErrorKind::InvalidInput,
            format!(
                "lease_ttl must be a finite number of seconds from 0 to {MAX_LEASE_TTL_S:e} \
                 (etcd's longest lease; how long a dead publisher's announcement outlives it); \
                 {seconds} is not"
            ),
            None,
        ));
    }
    Ok(Duration::from_secs_f64(seconds.max(1.0)))
}

/// A rendezvous named but not necessarily reached yet: an in-process hub (nothing to reach), an
/// etcd cluster already connected, or an etcd URL to connect to (a receiver connects lazily, so
/// its constructor never waits on the network).
pub(crate) enum RendezvousSpec {
    /// Ready to use.
    Ready(Arc<dyn Rendezvous>),
    /// `etcd://HOST:PORT[,...]`, connected by [`RendezvousSpec::connect`].
    Etcd { url: String, lease_ttl: Duration },
}

impl RendezvousSpec {
    /// The rendezvous, connecting to etcd first when it is not connected yet.
    pub(crate) async fn connect(&self) -> Result<Arc<dyn Rendezvous>> {
        match self {
            RendezvousSpec::Ready(r) => Ok(r.clone()),
            RendezvousSpec::Etcd { url, lease_ttl } => {
                let options = EtcdOptions {
                    lease_ttl: *lease_ttl,
                    ..EtcdOptions::default()
                };
                Ok(Arc::new(Etcd::connect(url, options).await?))
            }
        }
    }
}

/// The rendezvous `arg` names (an [`InProcessHub`], or `etcd://HOST:PORT[,...]` with an etcd
/// lease `lease_ttl` long), checked but not connected: no I/O.
pub(crate) fn rendezvous_spec(
    arg: &Bound<'_, PyAny>,
    lease_ttl: Duration,
) -> PyResult<RendezvousSpec> {
    if let Ok(hub) = arg.downcast::<InProcessHub>() {
        return Ok(RendezvousSpec::Ready(
            hub.get().hub.clone() as Arc<dyn Rendezvous>
        ));
    }
    let url: String = arg.extract().map_err(|_| {
        errors::invalid(
            ErrorKind::Config,
            "rendezvous must be an InProcessHub or an etcd://HOST:PORT string".into(),
            None,
        )
    })?;
    if !url.starts_with("etcd://") {
        return Err(errors::invalid(
            ErrorKind::Config,
            format!(
                "rendezvous {url:?} is not supported: processes meet through etcd \
                 (etcd://HOST:PORT), one process through reshard.InProcessHub()"
            ),
            None,
        ));
    }
    Ok(RendezvousSpec::Etcd { url, lease_ttl })
}

/// Runs `fut` to completion on the runtime with the GIL released. Every 10 ms it looks for
/// Ctrl-C (`check_signals`, which raises KeyboardInterrupt) and for `cancel` (set once, never
/// cleared: one flag per call, see `CancelToken`); either drops the future, which is
/// cancel-safe in reshard (docs/in-flight-safety.md: a receiver whose wire leg is cut short
/// discards the buffers it targeted, the live weights stay). A future that completed wins over
/// a cancel seen at the same time: its result is returned.
fn wait<T, F>(py: Python<'_>, cancel: Option<&AtomicBool>, fut: F) -> PyResult<T>
where
    T: Send,
    F: Future<Output = Result<T>> + Send,
{
    let rt = runtime().py_err()?;
    py.allow_threads(|| {
        let mut fut = std::pin::pin!(fut);
        loop {
            let polled = rt.block_on(async {
                tokio::time::timeout(Duration::from_millis(10), fut.as_mut()).await
            });
            if let Ok(done) = polled {
                return done.py_err();
            }
            if cancel.is_some_and(|c| c.load(Ordering::SeqCst)) {
                return Err(errors::invalid(
                    ErrorKind::Aborted,
                    "cancelled; the live weights are untouched".into(),
                    None,
                ));
            }
            Python::with_gil(|py| py.check_signals())?;
        }
    })
}

/// A model configuration: `model` is a preset name or a JSON object of one.
fn model_from(text: &str) -> Result<ModelConfig> {
    if text.trim_start().starts_with('{') {
        let m: ModelConfig = serde_json::from_str(text).map_err(|e| {
            Error::new(
                ErrorKind::Config,
                format!("model is not a model configuration: {e}"),
            )
        })?;
        m.validate()?;
        Ok(m)
    } else {
        preset(text)
    }
}

/// `(step, world)` of the newest step above `after` at which every publisher rank of `model` is
/// ready on `rendezvous_arg` (an `InProcessHub` or `etcd://...`), waiting up to `timeout_s` for
/// one: what a caller pins so that every engine rank installs the same step.
#[pyfunction]
#[pyo3(signature = (rendezvous_arg, model, timeout_s, after=None))]
fn published_step(
    py: Python<'_>,
    rendezvous_arg: &Bound<'_, PyAny>,
    model: &str,
    timeout_s: f64,
    after: Option<u64>,
) -> PyResult<(u64, u32)> {
    boundary("published_step", || {
        let timeout = timeout_arg("timeout", timeout_s)?;
        let spec = rendezvous_spec(rendezvous_arg, DEFAULT_LEASE_TTL)?;
        let want = reshard_core::rendezvous::Want {
            model: model.to_string(),
            after_step: after,
            timeout,
        };
        let found = wait(py, None, async move {
            let r = spec.connect().await?;
            reshard_core::rendezvous::discover(r.as_ref(), &want).await
        })?;
        Ok((found.step, found.announcements.len() as u32))
    })
}

/// JSON of the model a Hugging Face `config.json` describes (`text`, its contents; `label`
/// names it in errors): the families and keys `reshard checkpoint` reads (docs/models.md).
#[pyfunction]
fn hf_model_config(text: &str, label: &str) -> PyResult<String> {
    boundary("hf_model_config", || {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::new(ErrorKind::Config, format!("{label} is not valid JSON: {e}")))
            .py_err()?;
        let m = reshard_checkpoint::config::from_hf_config(&v, label).py_err()?;
        m.validate().py_err()?;
        serde_json::to_string(&m)
            .map_err(|e| errors::invalid(ErrorKind::Internal, e.to_string(), None))
    })
}

/// JSON of preset `name`, scaled down by `layers`, `experts`, `vocab`.
#[pyfunction]
#[pyo3(signature = (name, layers=None, experts=None, vocab=None))]
fn model_config(
    name: &str,
    layers: Option<u64>,
    experts: Option<u64>,
    vocab: Option<u64>,
) -> PyResult<String> {
    boundary("model_config", || {
        let m = preset(name)
            .and_then(|m| m.with_overrides(layers, experts, vocab))
            .py_err()?;
        serde_json::to_string(&m)
            .map_err(|e| errors::invalid(ErrorKind::Internal, e.to_string(), None))
    })
}

/// Receiver rank `rank`'s layout of `model` (a model JSON) under `layout` (e.g. `tp=2`).
fn layout_of(model: &str, layout: &str, rank: u32) -> PyResult<WantedLayout> {
    let m = model_from(model).py_err()?;
    let topo: ReceiverTopology = layout.parse().py_err()?;
    receiver_layout(&m, &topo, rank).py_err()
}

/// `[(name, dtype, shape)]` of receiver rank `rank` of `layout` (e.g. `tp=2`): the arrays an
/// engine hands to the receiver, in engine order.
#[pyfunction]
fn receiver_params<'py>(
    py: Python<'py>,
    model: &str,
    layout: &str,
    rank: u32,
) -> PyResult<Bound<'py, PyList>> {
    boundary("receiver_params", || {
        let l = layout_of(model, layout, rank)?;
        let rows: Vec<(String, String, Vec<u64>)> = l
            .params
            .into_iter()
            .map(|p| (p.name, p.dtype.to_string(), p.shape))
            .collect();
        PyList::new(py, rows)
    })
}

/// `[(param, [(tensor, offset, extent, dst_offset, dst_strides)])]` of receiver rank `rank`:
/// which box of which tensor lands where in each parameter (byte offset, element strides), so
/// tests can compute what a parameter must hold from what the trainers wrote.
#[pyfunction]
fn receiver_copies<'py>(
    py: Python<'py>,
    model: &str,
    layout: &str,
    rank: u32,
) -> PyResult<Bound<'py, PyList>> {
    boundary("receiver_copies", || {
        receiver_copy_rows(py, model, layout, rank)
    })
}

/// The rows of [`receiver_copies`].
fn receiver_copy_rows<'py>(
    py: Python<'py>,
    model: &str,
    layout: &str,
    rank: u32,
) -> PyResult<Bound<'py, PyList>> {
    let l = layout_of(model, layout, rank)?;
    type Copy = (String, Vec<u64>, Vec<u64>, u64, Vec<u64>);
    let rows: Vec<(String, Vec<Copy>)> = l
        .params
        .into_iter()
        .map(|p| {
            let copies = p
                .copies
                .into_iter()
                .map(|c| {
                    (
                        c.tensor,
                        c.src_box.offset,
                        c.src_box.extent,
                        c.dst_offset,
                        c.dst_strides,
                    )
                })
                .collect();
            (p.name, copies)
        })
        .collect();
    PyList::new(py, rows)
}

/// `[(name, dtype, offset, shape)]` of publisher rank `rank` of `topology` (e.g. `ep=8,dp=8`):
/// the arrays a trainer registers (each the rank's box of the tensor, at `offset` in global
/// coordinates).
#[pyfunction]
fn publisher_tensors<'py>(
    py: Python<'py>,
    model: &str,
    topology: &str,
    rank: u32,
) -> PyResult<Bound<'py, PyList>> {
    boundary("publisher_tensors", || {
        let m = model_from(model).py_err()?;
        let topo: PublisherTopology = topology.parse().py_err()?;
        let rt = runtime().py_err()?;
        // The geometry needs an endpoint only to name itself; a private loopback one costs
        // nothing.
        let t = {
            let _guard = rt.enter();
            registry().create_default("loopback", "geometry").py_err()?
        };
        let p = reshard_runtime::TensorPublisher::new(t, &m, &topo, rank).py_err()?;
        publisher::tensor_rows(py, &p.tensors())
    })
}

/// `(scheme, reason, cross_process)` of every transport built into this module, in registry
/// order: `reason` is `None` where the runtime is usable here, else why not.
#[pyfunction]
fn transports() -> PyResult<Vec<(String, Option<String>, bool)>> {
    boundary("transports", || {
        Ok(reshard::available()
            .into_iter()
            .map(|a| match a.capabilities {
                Ok(c) => (a.scheme.to_string(), None, c.cross_process),
                Err(e) => (a.scheme.to_string(), Some(e.to_string()), false),
            })
            .collect())
    })
}

/// The native module.
#[pymodule]
fn _reshard(m: &Bound<'_, PyModule>) -> PyResult<()> {
    boundary("import reshard._reshard", || {
        errors::add(m)?;
        // The package's version is the crate's (maturin takes the wheel's from it too).
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add_class::<InProcessHub>()?;
        m.add_class::<publisher::NativePublisher>()?;
        m.add_class::<publisher::TransportBuffer>()?;
        m.add_class::<receiver::NativeReceiver>()?;
        m.add_class::<receiver::CancelToken>()?;
        m.add_class::<receiver::Staged>()?;
        m.add_class::<bank::BankView>()?;
        m.add_function(wrap_pyfunction!(model_config, m)?)?;
        m.add_function(wrap_pyfunction!(hf_model_config, m)?)?;
        m.add_function(wrap_pyfunction!(published_step, m)?)?;
        m.add_function(wrap_pyfunction!(receiver_params, m)?)?;
        m.add_function(wrap_pyfunction!(publisher_tensors, m)?)?;
        m.add_function(wrap_pyfunction!(receiver_copies, m)?)?;
        m.add_function(wrap_pyfunction!(transports, m)?)?;
        Ok(())
    })
}
