//! Registration checks every backend's [`Transport::register`](crate::Transport::register)
//! runs, written once: [`check_block`] refuses a block whose address range cannot be real
//! memory, with the same error kind and message in every backend.

use crate::error::{Error, ErrorKind, Result};
use crate::memory::MemoryBlock;

/// Refuses a non-empty block at address 0 or whose end overflows (`OutOfBounds`, naming
/// `backend`). Empty blocks pass wherever they claim to be: no read can touch them, and they
/// still take a region id, so ids stay aligned across backends.
pub fn check_block(backend: &'static str, block: &dyn MemoryBlock) -> Result<()> {
    let (addr, len) = (block.addr(), block.len());
    if len > 0 && (addr == 0 || addr.checked_add(len).is_none()) {
        return Err(Error::new(
            ErrorKind::OutOfBounds,
            format!("block {addr:#x}+{len} is not a valid address range"),
        )
        .with_backend(backend));
    }
    Ok(())
}
