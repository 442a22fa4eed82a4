//! `ucs_status_t` as a typed error: [`UcxStatusError`] keeps UCX's own status name
//! (`UCS_ERR_UNREACHABLE`) and description, and converts into the public [`Error`] with a
//! kind chosen from the status.

use std::fmt;

use reshard_core::{Error, ErrorKind};

use super::sys;

include!("status_names.rs");

/// C name of a status code, as the UCX headers spell it.
pub(crate) fn status_name(code: sys::ucs_status_t) -> &'static str {
    if let Some((_, n)) = STATUS_NAMES.iter().find(|(c, _)| *c == code) {
        return n;
    }
    // Link and endpoint failures are ranges in status.h, only their bounds are named.
    match code {
        -59..=-40 => "UCS_ERR_LINK_FAILURE",
        -89..=-60 => "UCS_ERR_ENDPOINT_FAILURE",
        _ => "UCS_ERR_UNKNOWN",
    }
}

/// A UCX call that returned an error status: the call, the status code, its C name and
/// UCX's description of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UcxStatusError {
    operation: &'static str,
    code: i8,
    description: Option<String>,
}

impl UcxStatusError {
    /// The error `operation` (a UCP function name) reported with status `code`.
    pub fn new(operation: &'static str, code: i8) -> Self {
        UcxStatusError {
            operation,
            code,
            description: super::status_description(code),
        }
    }

    /// The UCP call that failed (`ucp_get_nbx`, ...).
    pub fn operation(&self) -> &'static str {
        self.operation
    }

    /// The raw `ucs_status_t` value.
    pub fn code(&self) -> i8 {
        self.code
    }

    /// UCX's name of the status (`UCS_ERR_UNREACHABLE`).
    pub fn name(&self) -> &'static str {
        status_name(self.code)
    }

    /// The reshard kind this status maps to.
    pub fn kind(&self) -> ErrorKind {
        match self.code {
            sys::UCS_ERR_CANCELED => ErrorKind::Aborted,
            sys::UCS_ERR_TIMED_OUT | sys::UCS_ERR_ENDPOINT_TIMEOUT => ErrorKind::Timeout,
            sys::UCS_ERR_UNSUPPORTED | sys::UCS_ERR_NOT_IMPLEMENTED => ErrorKind::Unsupported,
            sys::UCS_ERR_INVALID_PARAM | sys::UCS_ERR_NO_ELEM => ErrorKind::Config,
            _ => ErrorKind::Transport,
        }
    }

    /// Whether trying again may help: resource shortages, timeouts and lost connections.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.code,
            sys::UCS_ERR_NO_RESOURCE
                | sys::UCS_ERR_BUSY
                | sys::UCS_ERR_TIMED_OUT
                | sys::UCS_ERR_UNREACHABLE
                | sys::UCS_ERR_NOT_CONNECTED
                | sys::UCS_ERR_CONNECTION_RESET
                | -89..=-40
        )
    }
}

impl fmt::Display for UcxStatusError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} returned {}", self.operation, self.name())?;
        if let Some(d) = &self.description {
            write!(f, " ({d})")?;
        }
        Ok(())
    }
}

impl std::error::Error for UcxStatusError {}

impl From<UcxStatusError> for Error {
    fn from(e: UcxStatusError) -> Error {
        Error::new(
            e.kind(),
            format!("{} failed with {}", e.operation, e.name()),
        )
        .with_backend(crate::SCHEME)
        .set_retryable(e.is_retryable())
        .with_source(e)
    }
}

/// `Ok` for `UCS_OK`, else the typed error of `operation`.
pub(crate) fn check(
    operation: &'static str,
    code: sys::ucs_status_t,
) -> Result<(), UcxStatusError> {
    if code == sys::UCS_OK {
        Ok(())
    } else {
        Err(UcxStatusError::new(operation, code))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_come_from_the_headers() {
        assert_eq!(status_name(sys::UCS_ERR_UNREACHABLE), "UCS_ERR_UNREACHABLE");
        assert_eq!(status_name(sys::UCS_OK), "UCS_OK");
        assert_eq!(status_name(-45), "UCS_ERR_LINK_FAILURE");
        assert_eq!(status_name(-70), "UCS_ERR_ENDPOINT_FAILURE");
        assert_eq!(status_name(-99), "UCS_ERR_UNKNOWN");
    }

    #[test]
    fn kinds_follow_the_status() {
        let k = |c| UcxStatusError::new("ucp_get_nbx", c).kind();
        assert_eq!(k(sys::UCS_ERR_CANCELED), ErrorKind::Aborted);
        assert_eq!(k(sys::UCS_ERR_TIMED_OUT), ErrorKind::Timeout);
        assert_eq!(k(sys::UCS_ERR_UNSUPPORTED), ErrorKind::Unsupported);
        assert_eq!(k(sys::UCS_ERR_IO_ERROR), ErrorKind::Transport);
        assert!(UcxStatusError::new("x", sys::UCS_ERR_UNREACHABLE).is_retryable());
        assert!(!UcxStatusError::new("x", sys::UCS_ERR_INVALID_PARAM).is_retryable());
    }
}
