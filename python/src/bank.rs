//! The swap install's loans (python/README.md, "Swap install"): the live bank's buffers lent to
//! Python as read-only arrays, and the count of live loans per buffer that lets a receiver
//! refuse a refit whose landing bank the engine still reads.
//!
//! A loan is a [`BankView`] object: numpy's arrays over it keep it (through their base
//! memoryview) alive exactly as long as any of them lives, so "no `BankView` of a buffer is
//! alive" means "no array can read it". Each view holds its buffer's `Arc`, so the memory
//! outlives the receiver (a `close` while arrays are alive frees nothing under them).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::prelude::*;

use reshard_core::{HostBuffer, MemoryBlock};

use crate::memory::fill_view;

/// Live loans, per buffer address (a lent buffer cannot be freed, so its address stays its own).
#[derive(Default)]
pub struct Lent(Mutex<HashMap<usize, usize>>);

impl Lent {
    fn lend(&self, addr: usize) {
        *self.0.lock().entry(addr).or_insert(0) += 1;
    }

    fn release(&self, addr: usize) {
        let mut map = self.0.lock();
        if let Some(n) = map.get_mut(&addr) {
            *n -= 1;
            if *n == 0 {
                map.remove(&addr);
            }
        }
    }

    /// How many views of `buf` are alive.
    pub fn count(&self, buf: &HostBuffer) -> usize {
        self.0.lock().get(&buf.addr()).copied().unwrap_or(0)
    }
}

/// One parameter of a live bank, lent to Python as a read-only byte buffer numpy wraps without
/// copying (`Receiver.weights()` in swap install).
#[pyclass(module = "reshard._reshard", frozen)]
pub struct BankView {
    buf: Arc<HostBuffer>,
    /// The parameter's bytes (a bank buffer is at least one byte, even for an empty parameter).
    len: usize,
    lent: Arc<Lent>,
}

impl BankView {
    /// Lends the first `len` bytes of `buf`, counted in `lent` until this view is dropped.
    pub fn lend(buf: Arc<HostBuffer>, len: usize, lent: Arc<Lent>) -> Self {
        lent.lend(buf.addr());
        BankView {
            len: len.min(buf.len()),
            buf,
            lent,
        }
    }
}

impl Drop for BankView {
    fn drop(&mut self) {
        self.lent.release(self.buf.addr());
    }
}

#[pymethods]
impl BankView {
    /// Fills `view` with the parameter's bytes, read-only, one dimension of bytes.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let (addr, len) = {
            let me = slf.get();
            (me.buf.addr(), me.len)
        };
        // SAFETY: `view` comes from the interpreter; the buffer stays allocated while `slf`
        // (which FillInfo references from the view) lives, since `slf` holds its Arc. Read-only:
        // FillInfo refuses a writable request. Nothing writes the buffer while it is lent: it is
        // the live bank, or a landing bank the receiver refuses to refit into (receiver.rs).
        unsafe { fill_view(slf.as_any(), view, addr, len, true, flags) }
    }

    /// Nothing to free: FillInfo's format is static and the object reference is the view's.
    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}

    fn __len__(&self) -> usize {
        self.len
    }
}
