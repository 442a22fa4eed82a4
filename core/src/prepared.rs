//! Checks at the start of every backend's [`Transport::post`](crate::Transport::post),
//! written once: [`own_state`] takes back the backend's state out of a
//! [`PreparedBatch`] and refuses a batch another backend or endpoint prepared.

use std::any::Any;

use crate::error::{Error, ErrorKind, Result};
use crate::transport::PreparedBatch;

/// The state of type `T` that this endpoint stored in `prepared`, if `mine` accepts it;
/// otherwise `Unsupported` naming the backend that prepared it, and `endpoint` (e.g.
/// `"ucx agent"`) with its `name`. `others` says what else could have prepared it (e.g.
/// `"ucx endpoint"`), for the message: a batch is only valid on the endpoint that prepared it.
pub fn own_state<'a, T: Any>(
    backend: &'static str,
    prepared: &'a PreparedBatch,
    mine: impl FnOnce(&T) -> bool,
    others: &str,
    endpoint: &str,
    name: &str,
) -> Result<&'a T> {
    prepared.state::<T>().filter(|s| mine(s)).ok_or_else(|| {
        Error::new(
            ErrorKind::Unsupported,
            format!(
                "batch was prepared by {} (another backend or {others}), not by {endpoint} \
                 {name:?}",
                prepared.backend(),
            ),
        )
        .with_backend(backend)
    })
}
