//! One Python exception class per [`ErrorKind`], all under `reshard.ReshardError`, each raised
//! with the error's context as attributes (`kind`, `tensor`, `owner`, `byte_range`, `backend`,
//! `retryable`), so callers match classes and read attributes, never message text.

use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use reshard_core::{Error, ErrorKind};

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

/// The Python exception for `e`: its kind's class, the message, and the context as attributes.
pub fn to_py(e: Error) -> PyErr {
    Python::with_gil(|py| {
        let class = class_of(py, e.kind());
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
    })
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
