//! Checks around a prepared batch, written once: [`check_read_count`] at the start of
//! [`Transport::prepare`](crate::Transport::prepare) for backends that index reads by `u32`,
//! and [`own_state`] at the start of [`Transport::post`](crate::Transport::post), which takes
//! the backend's state back out of a [`PreparedBatch`] and refuses a batch another backend or
//! endpoint prepared.

use std::any::Any;

use crate::error::{Error, ErrorKind, Result};
use crate::transport::{PreparedBatch, ReadBatch};

/// Refuses a batch of more than `u32::MAX` reads (`Unsupported`), for backends whose work
/// lists number reads in 32 bits to halve their size.
pub fn check_read_count(backend: &'static str, batch: &ReadBatch) -> Result<()> {
    if u32::try_from(batch.reads.len()).is_err() {
        return Err(
            Error::new(ErrorKind::Unsupported, "more than 2^32 reads in one batch")
                .with_backend(backend),
        );
    }
    Ok(())
}

/// The state of type `T` that this endpoint stored in `prepared`, if `mine` accepts it;
/// otherwise `Unsupported` naming the backend that prepared it, and `endpoint` (e.g.
/// `"<scheme> agent"`) with its `name`. `others` says what else could have prepared it (e.g.
/// `"<scheme> endpoint"`), for the message: a batch is only valid on the endpoint that prepared it.
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
