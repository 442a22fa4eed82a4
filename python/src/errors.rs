//! One Python exception class per [`ErrorKind`], all under `reshard.ReshardError`, each raised
//! with the error's context as attributes (`kind`, `tensor`, `owner`, `byte_range`, `backend`,
//! `retryable`), so callers match classes and read attributes, never message text; and the
//! boundary every entry point runs behind ([`boundary`]), which raises a Rust panic as
//! `reshard.Panic` (a `reshard.Internal`) instead of PyO3's `PanicException`, a BaseException
//! that `except Exception` lets through.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use reshard_core::{Error, ErrorDetail, ErrorKind};

pyo3::create_exception!(
    reshard,
    ReshardError,
    PyException,
    "Base of every reshard error; attributes: kind, tensor, owner, byte_range, backend, retryable."
);

/// Declares one exception class per kind, and the kind-to-class table.
macro_rules! kinds {
    ($($kind:ident => $class:ident: $doc:literal),* $(,)?) => {
        $(pyo3::create_exception!(reshard, $class, ReshardError, $doc);)*

        /// The Python class of `kind`.
        fn class_of(py: Python<'_>, kind: ErrorKind) -> Bound<'_, pyo3::types::PyType> {
            match kind {
                $(ErrorKind::$kind => py.get_type::<$class>(),)*
                _ => py.get_type::<ReshardError>(),
            }
        }

        /// Adds the base class and every kind's class to the module.
        pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
            let py = m.py();
            m.add("ReshardError", py.get_type::<ReshardError>())?;
            $(m.add(stringify!($class), py.get_type::<$class>())?;)*
            m.add("Panic", py.get_type::<Panic>())?;
            m.add("NotApplicable", py.get_type::<NotApplicable>())?;
            m.add("NoRollback", py.get_type::<NoRollback>())?;
            Ok(())
        }
    };
}

kinds! {
    InvalidInput => InvalidInput: "An argument is invalid (unknown tensor, wrong shape or dtype, missing array).",
    Decode => Decode: "An encoded shard table or metadata could not be decoded.",
    InvalidTable => InvalidTable: "A shard table is internally invalid.",
    InconsistentTensor => InconsistentTensor: "Two publishers disagree on a tensor's dtype or shape.",
    ReplicaDivergence => ReplicaDivergence: "Replicas of one box carry different digests.",
    MissingCoverage => MissingCoverage: "A wanted box is not offered by any publisher.",
    OverlappingOffers => OverlappingOffers: "Distinct offers partially overlap inside a wanted box.",
    Layout => Layout: "A receiver layout cannot be built for this model and topology.",
    OutOfBounds => OutOfBounds: "A read falls outside a registered memory region.",
    PeerUnknown => PeerUnknown: "A read names an owner whose metadata was never loaded.",
    Transport => Transport: "The transport failed to move bytes (a dead publisher, a broken link).",
    Aborted => Aborted: "The operation was aborted or cancelled.",
    Verification => Verification: "Installed bytes do not match the publisher's digest.",
    Guard => Guard: "A guard (throughput ceiling, coverage floor) refused the update.",
    Config => Config: "Configuration is invalid (unknown transport, bad topology).",
    Unsupported => Unsupported: "The backend does not support what was asked.",
    Unavailable => Unavailable: "A backend's native runtime is not installed on this machine.",
    Timeout => Timeout: "A wait (discovery, connect, completion) ran past its timeout.",
    Internal => Internal: "A bug or broken invariant inside reshard.",
}

pyo3::create_exception!(
    reshard,
    Panic,
    Internal,
    "reshard panicked: a bug, raised as an Internal error rather than PyO3's PanicException."
);

pyo3::create_exception!(
    reshard,
    NotApplicable,
    InvalidInput,
    "A staged step cannot be applied (`reason`: other_receiver, applied, replaced, discarded); nothing changed."
);

pyo3::create_exception!(
    reshard,
    NoRollback,
    InvalidInput,
    "No previous step to roll back to (`reason`: no_previous, overwritten, discarded); nothing changed."
);

/// The Python exception for `e`: its kind's class, the message, and the context as attributes.
pub fn to_py(e: Error) -> PyErr {
    Python::with_gil(|py| {
        let (class, reason) = match e.detail() {
            Some(ErrorDetail::NotApplicable { reason, .. }) => {
                (py.get_type::<NotApplicable>(), Some(reason.as_str()))
            }
            Some(ErrorDetail::NoRollback { reason, .. }) => {
                (py.get_type::<NoRollback>(), Some(reason.as_str()))
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
        Python::with_gil(|py| raise_as(py, py.get_type::<Panic>(), e))
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
