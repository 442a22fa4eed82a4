//! One Python exception class per [`ErrorKind`], all under `reshard.ReshardError`, each raised
//! with the error's context as attributes (`kind`, `tensor`, `owner`, `byte_range`, `backend`,
//! `retryable`), so callers match classes and read attributes, never message text; and the
//! boundary every entry point runs behind ([`boundary`]), which raises a Rust panic as
//! `reshard.Panic` (a `reshard.Internal`) instead of PyO3's `PanicException`, a BaseException
//! that `except Exception` lets through.
//!
//! Where Python has a class for the same failure, a kind's class is also that class, so code that
//! knows nothing of reshard catches it the standard way (python/README.md, "Errors"): `Timeout` is a
//! `TimeoutError`, `Transport` a `ConnectionError`, `InvalidInput`, `Layout` and `Config` are
//! `ValueError`s. An object used from two threads at once is `Busy`, one used after `close()` is
//! `Closed`: neither is an invalid value.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::exceptions::{PyConnectionError, PyException, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyTuple, PyType};

use reshard_core::{Error, ErrorDetail, ErrorKind};

pyo3::create_exception!(
    reshard,
    ReshardError,
    PyException,
    "Base of every reshard error; attributes: kind, tensor, owner, byte_range, backend, retryable."
);

/// Which standard Python class a kind's class also derives from, if any.
#[derive(Clone, Copy)]
enum Std {
    None,
    Value,
    Timeout,
    Connection,
}

/// Every class this module raises, made once per interpreter ([`classes`]), in [`CLASSES`]'
/// order.
static TYPES: GILOnceCell<Vec<Py<PyType>>> = GILOnceCell::new();

/// Name, the kind it stands for (`None`: the classes that are not kinds), standard base, doc.
const CLASSES: &[(&str, Option<ErrorKind>, Std, &str)] = &[
    ("InvalidInput", Some(ErrorKind::InvalidInput), Std::Value, "An argument is invalid (unknown tensor, wrong shape or dtype, missing array); also a ValueError."),
    ("Decode", Some(ErrorKind::Decode), Std::None, "An encoded shard table or metadata could not be decoded."),
    ("InvalidTable", Some(ErrorKind::InvalidTable), Std::None, "A shard table is internally invalid."),
    ("InconsistentTensor", Some(ErrorKind::InconsistentTensor), Std::None, "Two publishers disagree on a tensor's dtype or shape."),
    ("ReplicaDivergence", Some(ErrorKind::ReplicaDivergence), Std::None, "Replicas of one box carry different digests."),
    ("MissingCoverage", Some(ErrorKind::MissingCoverage), Std::None, "A wanted box is not offered by any publisher."),
    ("OverlappingOffers", Some(ErrorKind::OverlappingOffers), Std::None, "Distinct offers partially overlap inside a wanted box."),
    ("Layout", Some(ErrorKind::Layout), Std::Value, "A receiver layout cannot be built for this model and topology; also a ValueError."),
    ("OutOfBounds", Some(ErrorKind::OutOfBounds), Std::None, "A read falls outside a registered memory region."),
    ("PeerUnknown", Some(ErrorKind::PeerUnknown), Std::None, "A read names an owner whose metadata was never loaded."),
    ("Transport", Some(ErrorKind::Transport), Std::Connection, "The transport failed to move bytes (a dead publisher, a broken link); also a ConnectionError."),
    ("Aborted", Some(ErrorKind::Aborted), Std::None, "The operation was aborted or cancelled."),
    ("Verification", Some(ErrorKind::Verification), Std::None, "Installed bytes do not match the publisher's digest."),
    ("Guard", Some(ErrorKind::Guard), Std::None, "A guard (throughput ceiling, coverage floor) refused the update."),
    ("Config", Some(ErrorKind::Config), Std::Value, "Configuration is invalid (unknown transport, bad topology); also a ValueError."),
    ("Unsupported", Some(ErrorKind::Unsupported), Std::None, "The backend does not support what was asked."),
    ("Unavailable", Some(ErrorKind::Unavailable), Std::None, "A backend's native runtime is not installed on this machine."),
    ("Timeout", Some(ErrorKind::Timeout), Std::Timeout, "A wait (discovery, connect, completion) ran past its timeout; also a TimeoutError."),
    ("Internal", Some(ErrorKind::Internal), Std::None, "A bug or broken invariant inside reshard."),
    ("Busy", None, Std::None, "The object is in use: by a call in another thread, or (swap install) its landing bank by arrays the engine still holds."),
    ("Closed", None, Std::None, "The object was closed: make a new one."),
    ("NotConnected", None, Std::None, "A receiver has not connected to its publishers yet: call connect(), or refit, stage or wait_for_step, which connect first."),
];

/// Classes made after [`CLASSES`], from one of them: name, base, doc.
const DERIVED: &[(&str, &str, &str)] = &[
    ("Panic", "Internal", "reshard panicked: a bug, raised as an Internal error rather than PyO3's PanicException."),
    ("NotApplicable", "InvalidInput", "A staged step cannot be applied (`reason`: other_receiver, applied, replaced, discarded); nothing changed."),
    ("NoRollback", "InvalidInput", "No previous step to roll back to (`reason`: no_previous, overwritten, discarded); nothing changed."),
];

/// The classes of [`CLASSES`], then those of [`DERIVED`], made on first use: `type(name,
/// (ReshardError, std), ...)` (pyo3's declared exceptions take one base; these need two).
fn classes(py: Python<'_>) -> PyResult<&Vec<Py<PyType>>> {
    TYPES.get_or_try_init(py, || {
        let base = py.get_type::<ReshardError>();
        let make = |name: &str, bases: Bound<'_, PyTuple>, doc: &str| -> PyResult<Py<PyType>> {
            let ns = PyDict::new(py);
            ns.set_item("__module__", "reshard")?;
            ns.set_item("__doc__", doc)?;
            let t = py
                .get_type::<PyType>()
                .call1((name, bases, ns))?
                .downcast_into::<PyType>()?;
            Ok(t.unbind())
        };
        let mut out = Vec::with_capacity(CLASSES.len() + DERIVED.len());
        for &(name, _, std, doc) in CLASSES {
            let bases = match std {
                Std::None => PyTuple::new(py, [base.clone()])?,
                Std::Value => PyTuple::new(py, [base.clone(), py.get_type::<PyValueError>()])?,
                Std::Timeout => PyTuple::new(py, [base.clone(), py.get_type::<PyTimeoutError>()])?,
                Std::Connection => {
                    PyTuple::new(py, [base.clone(), py.get_type::<PyConnectionError>()])?
                }
            };
            out.push(make(name, bases, doc)?);
        }
        for &(name, base, doc) in DERIVED {
            let at = CLASSES.iter().position(|c| c.0 == base).unwrap_or(0);
            let base = out[at].bind(py).clone();
            out.push(make(name, PyTuple::new(py, [base])?, doc)?);
        }
        Ok(out)
    })
}

/// The class named `name` ([`CLASSES`] or [`DERIVED`]); `ReshardError` if the classes could
/// not be made (out of memory at import: then the base class is still the right answer).
fn class_named<'py>(py: Python<'py>, name: &str) -> Bound<'py, PyType> {
    let at = CLASSES
        .iter()
        .map(|c| c.0)
        .chain(DERIVED.iter().map(|d| d.0))
        .position(|n| n == name);
    match (classes(py), at) {
        (Ok(all), Some(at)) => all[at].bind(py).clone(),
        _ => py.get_type::<ReshardError>(),
    }
}

/// The Python class of `kind`.
fn class_of(py: Python<'_>, kind: ErrorKind) -> Bound<'_, PyType> {
    match CLASSES.iter().position(|c| c.1 == Some(kind)) {
        Some(at) => class_named(py, CLASSES[at].0),
        None => py.get_type::<ReshardError>(),
    }
}

/// Adds the base class and every other class to the module.
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("ReshardError", py.get_type::<ReshardError>())?;
    let all = classes(py)?;
    let names = CLASSES
        .iter()
        .map(|c| c.0)
        .chain(DERIVED.iter().map(|d| d.0));
    for (i, name) in names.enumerate() {
        m.add(name, all[i].bind(py))?;
    }
    Ok(())
}

/// The Python exception for `e`: its kind's class, the message, and the context as attributes.
pub fn to_py(e: Error) -> PyErr {
    Python::with_gil(|py| {
        // A refused apply or rollback has a class of its own, with the `reason` attribute.
        let (class, reason) = match e.detail() {
            Some(ErrorDetail::NotApplicable { reason, .. }) => {
                (class_named(py, "NotApplicable"), Some(reason.as_str()))
            }
            Some(ErrorDetail::NoRollback { reason, .. }) => {
                (class_named(py, "NoRollback"), Some(reason.as_str()))
            }
            _ => (class_of(py, e.kind()), None),
        };
        let err = raise_as(py, class, e);
        if let Some(reason) = reason {
            let _ = err.value(py).setattr("reason", reason);
        }
        err
    })
}

/// `reshard.Busy` (kind `busy`, retryable: the other user may finish): `message` says what is
/// in use and by what.
pub fn busy(message: String) -> PyErr {
    plain("Busy", "busy", message, None, true)
}

/// `reshard.Busy` naming `tensor` (its `tensor` attribute): memory of it is in use.
pub fn busy_tensor(message: String, tensor: &str) -> PyErr {
    plain("Busy", "busy", message, Some(tensor), true)
}

/// `reshard.Closed` (kind `closed`): the object was closed.
pub fn closed(message: String) -> PyErr {
    plain("Closed", "closed", message, None, false)
}

/// `reshard.NotConnected` (kind `not_connected`, retryable: connecting may still succeed):
/// `message` says what needs the connection.
pub fn not_connected(message: String) -> PyErr {
    plain("NotConnected", "not_connected", message, None, true)
}

/// An exception of class `class` that is no [`ErrorKind`], with the attributes every reshard
/// error carries (no owner, range or backend).
fn plain(class: &str, kind: &str, message: String, tensor: Option<&str>, retryable: bool) -> PyErr {
    Python::with_gil(|py| {
        let text = match tensor {
            Some(t) => format!("{kind}: {message} [tensor {t}]"),
            None => format!("{kind}: {message}"),
        };
        let err = PyErr::from_type(class_named(py, class), text);
        let value = err.value(py);
        let _ = (|| -> PyResult<()> {
            value.setattr("kind", kind)?;
            value.setattr("tensor", tensor)?;
            for none in ["owner", "byte_range", "backend"] {
                value.setattr(none, py.None())?;
            }
            value.setattr("retryable", retryable)?;
            Ok(())
        })();
        err
    })
}

/// `e` as an exception of `class`, the context as attributes.
fn raise_as(py: Python<'_>, class: Bound<'_, pyo3::types::PyType>, e: Error) -> PyErr {
    {
        let ctx = e.context();
        let err = PyErr::from_type(class, e.to_string());
        let value = err.value(py);
        let range = ctx
            .range
            .as_ref()
            .map(|r| PyTuple::new(py, [r.start, r.end]))
            .transpose();
        // Attributes are set on a fresh exception instance: failing here would mean the
        // interpreter is out of memory, where the bare exception is still the right answer.
        let _ = (|| -> PyResult<()> {
            value.setattr("kind", e.kind().as_str())?;
            value.setattr("tensor", ctx.tensor.clone())?;
            value.setattr("owner", ctx.owner)?;
            value.setattr("byte_range", range?)?;
            value.setattr("backend", ctx.backend.clone())?;
            value.setattr("retryable", e.is_retryable())?;
            Ok(())
        })();
        err
    }
}

/// Shorthand: a reshard error of `kind` naming `tensor`, as a Python exception.
pub fn invalid(kind: ErrorKind, message: String, tensor: Option<&str>) -> PyErr {
    let mut e = Error::new(kind, message);
    if let Some(t) = tensor {
        e = e.with_tensor(t);
    }
    to_py(e)
}

/// Converts `Result`s of reshard into Python results.
pub trait IntoPy<T> {
    /// The value, or the error as its Python exception.
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for reshard_core::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

/// Runs the body of entry point `what` (e.g. `Receiver.refit`) and raises a panic inside it as
/// `reshard.Panic` naming the entry point and the panic's message. Every function and method
/// the native module exports runs behind it; the panic unwinds through the body first, so what
/// the body held is dropped as on any early return (a refit future dropped mid-transfer is
/// cancel-safe, docs/in-flight-safety.md).
pub fn boundary<T>(what: &str, body: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_panic(body, |message| {
        let e = Error::new(
            ErrorKind::Internal,
            format!(
                "reshard panicked in {what} (a bug in reshard, please report it; the object it \
                 was called on may be unusable, close it): {message}"
            ),
        );
        Python::with_gil(|py| raise_as(py, class_named(py, "Panic"), e))
    })
}

/// `body`'s result, or `on_panic` of the panic's message when it panicked: the part of
/// [`boundary`] that needs no interpreter (unit-tested below).
fn catch_panic<T, E>(
    body: impl FnOnce() -> Result<T, E>,
    on_panic: impl FnOnce(String) -> E,
) -> Result<T, E> {
    // AssertUnwindSafe: nothing the body borrowed is used after a panic except through the
    // objects' own locks (parking_lot, which do not poison) and the error raised here.
    catch_unwind(AssertUnwindSafe(body))
        .unwrap_or_else(|payload| Err(on_panic(message_of(&*payload))))
}

/// The message a panic carried (`panic!` gives a `&str` or a `String`).
fn message_of(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

#[cfg(test)]
mod tests {
    //! Only what runs without an interpreter: the extension module links no libpython, so a
    //! test that touched a Python object could not even link (python/Cargo.toml).
    use super::*;

    #[test]
    fn a_panic_becomes_the_error_with_its_message() {
        let r: Result<u32, String> = catch_panic(|| panic!("index {} out of range", 7), |m| m);
        assert_eq!(r, Err("index 7 out of range".to_string()));
        let r: Result<u32, String> = catch_panic(|| panic!("static message"), |m| m);
        assert_eq!(r, Err("static message".to_string()));
        let r: Result<u32, String> = catch_panic(|| std::panic::panic_any(42u8), |m| m);
        assert_eq!(r, Err("a panic without a message".to_string()));
    }

    #[test]
    fn results_pass_through_untouched() {
        let ok: Result<u32, String> = catch_panic(|| Ok(3), |_| unreachable!());
        assert_eq!(ok, Ok(3));
        let err: Result<u32, String> = catch_panic(|| Err("no".to_string()), |_| unreachable!());
        assert_eq!(err, Err("no".to_string()));
    }
}
