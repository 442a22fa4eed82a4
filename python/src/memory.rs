//! A Python array's memory as a [`MemoryBlock`]: the bytes of any object exporting the buffer
//! protocol (numpy arrays; torch tensors through `__dlpack__`, converted in `reshard/__init__.py`),
//! held in place. The buffer view is kept for the block's whole life, so the exporter (and,
//! through the probe, the caller's own object, a torch tensor say) stays alive; the block drops
//! only after every registration of it (publisher and receiver release their registrations
//! first, and transports hold the block while a read may touch it).
//!
//! Alive is not the same as in place: numpy resizes an exported array when asked with
//! `refcheck=False`, and a torch tensor's storage can be resized or freed under any export
//! (`untyped_storage().resize_(0)`, as FSDP does). So [`ArrayMemory::check`] asks the exporter
//! again, and the probe the caller's object, where its bytes are now, and the publisher and
//! receiver call it before every publish and refit (python/README.md, "The arrays reshard holds").

use std::ffi::CStr;
use std::ops::{Deref, DerefMut};

use parking_lot::RwLock;
use pyo3::ffi;
use pyo3::prelude::*;

use reshard_core::{DType, ErrorKind, HostMemory, MemoryBlock, MemoryKind};

use crate::errors::invalid;

/// A C-contiguous buffer exported by a Python object, held until drop.
pub struct ArrayMemory {
    /// Boxed so its address stays fixed: `PyBuffer_Release` is given the same struct.
    view: Box<ffi::Py_buffer>,
    /// Guards the views `bytes`/`bytes_mut` hand out.
    lock: RwLock<()>,
    /// Element format (struct-module syntax, e.g. `<f4` is `f`), for dtype checks.
    pub format: String,
    /// Bytes per element.
    pub itemsize: usize,
    /// Shape, in elements.
    pub shape: Vec<u64>,
    /// The buffer-protocol flags of the export, asked again by [`Self::check`].
    flags: std::os::raw::c_int,
    /// A callable returning `(address, bytes)` of the caller's own object as it is now, when
    /// the buffer is a view of it (a torch tensor's numpy view through DLPack); it holds that
    /// object, so the object lives as long as this block.
    probe: Option<Py<PyAny>>,
}

// SAFETY: the view is only read after construction (pointer, length), and released once in
// Drop with the GIL held; the exporter keeps the memory valid while the view lives.
unsafe impl Send for ArrayMemory {}
// SAFETY: as above; byte access goes through `lock` (views) or the MemoryBlock contract.
unsafe impl Sync for ArrayMemory {}

impl ArrayMemory {
    /// Exports `obj`'s buffer, C-contiguous, writable when `writable`; `tensor` names the
    /// tensor in errors. `probe`, when `obj` views another object's memory, returns that
    /// object's `(address, bytes)` now (see [`Self::check`]); it must agree with the export.
    pub fn export(
        obj: &Bound<'_, PyAny>,
        writable: bool,
        tensor: &str,
        probe: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut flags = ffi::PyBUF_C_CONTIGUOUS | ffi::PyBUF_FORMAT;
        if writable {
            flags |= ffi::PyBUF_WRITABLE;
        }
        // SAFETY: an all-zero Py_buffer is the documented initial state before GetBuffer.
        let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
        // SAFETY: `obj` is a live object (we hold the GIL through `Bound`), `view` is writable.
        let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
        if rc != 0 {
            let cause = PyErr::take(obj.py())
                .map(|e| e.to_string())
                .unwrap_or_else(|| "no buffer".to_string());
            let need = if writable {
                "a writable, C-contiguous array"
            } else {
                "a C-contiguous array"
            };
            return Err(invalid(
                ErrorKind::InvalidInput,
                format!("tensor {tensor:?} needs {need} exporting the buffer protocol: {cause}"),
                Some(tensor),
            ));
        }
        let format = if view.format.is_null() {
            "B".to_string()
        } else {
            // SAFETY: a non-null format is a NUL-terminated string owned by the view.
            unsafe { CStr::from_ptr(view.format) }
                .to_string_lossy()
                .into_owned()
        };
        let shape = if view.shape.is_null() || view.ndim == 0 {
            if view.ndim == 0 {
                Vec::new()
            } else {
                vec![(view.len / view.itemsize.max(1)) as u64]
            }
        } else {
            // SAFETY: with PyBUF_ND (implied by C_CONTIGUOUS) shape has ndim entries.
            unsafe { std::slice::from_raw_parts(view.shape, view.ndim as usize) }
                .iter()
                .map(|&d| d as u64)
                .collect()
        };
        let itemsize = view.itemsize as usize;
        let memory = ArrayMemory {
            view,
            lock: RwLock::new(()),
            format,
            itemsize,
            shape,
            flags,
            probe: probe.map(|p| p.clone().unbind()),
        };
        memory.check(obj.py(), tensor, "registered")?;
        Ok(memory)
    }

    /// Refuses (InvalidInput naming `tensor`, saying nothing was `done`) memory that is no
    /// longer where it was exported: the exporter, asked again, gives another address or size
    /// (a numpy array resized with `refcheck=False`), or cannot give a buffer any more (made
    /// read-only); or the probe reports the caller's object elsewhere or smaller (a torch
    /// tensor whose storage was resized, freed or swapped). Reading or writing the old address
    /// then would touch freed memory, or bytes the caller no longer sees.
    pub fn check(&self, py: Python<'_>, tensor: &str, done: &str) -> PyResult<()> {
        let (addr, len) = (self.addr(), self.len());
        if len == 0 {
            // No byte is read or written; an empty array's address means nothing.
            return Ok(());
        }
        let moved = |now: String| {
            invalid(
                ErrorKind::InvalidInput,
                format!(
                    "tensor {tensor:?} is not the memory reshard holds for it ({len} bytes at \
                     {addr:#x}) any more: {now}. An array must keep its memory (not resized, \
                     freed, re-pointed or made read-only) while a Publisher or Receiver holds \
                     it. Nothing was {done}"
                ),
                Some(tensor),
            )
        };
        // SAFETY: an all-zero Py_buffer is the documented initial state before GetBuffer.
        let mut again: ffi::Py_buffer = unsafe { std::mem::zeroed() };
        // SAFETY: `view.obj` is the exporter (a reference the held view owns), alive with us;
        // the GIL is held through `py`.
        let rc = unsafe { ffi::PyObject_GetBuffer(self.view.obj, &mut again, self.flags) };
        if rc != 0 {
            let cause = PyErr::take(py).map_or_else(|| "no buffer".to_string(), |e| e.to_string());
            return Err(moved(format!(
                "the array exports no such buffer now: {cause}"
            )));
        }
        let now = (again.buf as usize, again.len as usize);
        // SAFETY: filled by the successful GetBuffer above, released exactly once.
        unsafe { ffi::PyBuffer_Release(&mut again) };
        if now != (addr, len) {
            return Err(moved(format!(
                "the array now exports {} bytes at {:#x}",
                now.1, now.0
            )));
        }
        if let Some(probe) = &self.probe {
            let now: (usize, usize) = probe
                .bind(py)
                .call0()
                .and_then(|r| r.extract())
                .map_err(|e| moved(format!("asking where it is now failed: {e}")))?;
            if now != (addr, len) {
                return Err(moved(format!(
                    "the tensor now holds {} bytes at {:#x}",
                    now.1, now.0
                )));
            }
        }
        Ok(())
    }

    /// Whether the exported elements can hold `dtype` as is (no conversion ever happens):
    /// floats by their struct code, bf16 and the 8-bit floats as raw unsigned integers (numpy
    /// has no such dtypes; `ml_dtypes` arrays export the same widths).
    pub fn holds(&self, dtype: DType) -> bool {
        let code = self
            .format
            .trim_start_matches(['@', '=', '<', '>', '!'])
            .to_string();
        let size = self.itemsize as u64;
        if size != dtype.size() {
            return false;
        }
        let signed = matches!(code.as_str(), "b" | "h" | "i" | "l" | "q");
        let unsigned = matches!(code.as_str(), "B" | "H" | "I" | "L" | "Q");
        match dtype {
            DType::F32 => code == "f",
            DType::F64 => code == "d",
            DType::F16 => code == "e",
            DType::Bf16 => unsigned || code == "E" || code == "V",
            DType::F8E4m3 | DType::F8E5m2 => unsigned || code == "V",
            DType::I8 | DType::I16 | DType::I32 | DType::I64 => signed,
            DType::U8 => unsigned,
            DType::Bool => code == "?",
        }
    }

    fn slice_ptr(&self) -> *mut u8 {
        self.view.buf as *mut u8
    }
}

impl Drop for ArrayMemory {
    fn drop(&mut self) {
        // Releasing needs the GIL: every path that may drop the last reference while this
        // thread waits for another (a refit, a close) has released the GIL first.
        Python::with_gil(|_| {
            // SAFETY: the view was filled by PyObject_GetBuffer and is released exactly once.
            unsafe { ffi::PyBuffer_Release(&mut *self.view) };
            // The caller's object goes last, after the view of its memory.
            drop(self.probe.take());
        });
    }
}

impl std::fmt::Debug for ArrayMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ArrayMemory({:#x}, {} bytes, {:?})",
            self.addr(),
            self.len(),
            self.format
        )
    }
}

// SAFETY: the exporter keeps `buf..buf+len` valid and fixed while the view is held (until
// drop); Rust never holds a reference to it outside a locked view.
unsafe impl MemoryBlock for ArrayMemory {
    fn addr(&self) -> usize {
        self.view.buf as usize
    }
    fn len(&self) -> usize {
        self.view.len as usize
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::Dram
    }
}

/// A locked view of an array's bytes: the slice is made on each access, so a shared view never
/// holds a `&mut`.
struct View<G> {
    _guard: G,
    ptr: *mut u8,
    len: usize,
}

impl<G> Deref for View<G> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` is the exported buffer, valid while the block lives (the view
        // borrows the block); the guard keeps views of this block apart. Python code writing it
        // concurrently breaks the documented contract (arrays are not written while published
        // or refit), and the digests catch that.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<G> DerefMut for View<G> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; only write-locked views are handed out as `DerefMut`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl HostMemory for ArrayMemory {
    fn bytes(&self) -> Box<dyn Deref<Target = [u8]> + '_> {
        Box::new(View {
            _guard: self.lock.read(),
            ptr: self.slice_ptr(),
            len: self.len(),
        })
    }
    fn bytes_mut(&self) -> Box<dyn DerefMut<Target = [u8]> + '_> {
        Box::new(View {
            _guard: self.lock.write(),
            ptr: self.slice_ptr(),
            len: self.len(),
        })
    }
}

/// Fills `view` for `owner` (a Python object whose life keeps `addr..addr + len` valid and
/// fixed) with those bytes as one dimension of unsigned bytes, read-only when `readonly`
/// (a writable request then fails, as the buffer protocol asks).
///
/// # Safety
/// `view` comes from the interpreter's `__getbuffer__` call, and the memory stays valid while
/// `owner` lives (FillInfo stores a new reference to it in the view).
pub unsafe fn fill_view(
    owner: &Bound<'_, PyAny>,
    view: *mut ffi::Py_buffer,
    addr: usize,
    len: usize,
    readonly: bool,
    flags: std::os::raw::c_int,
) -> PyResult<()> {
    // SAFETY: the caller's contract above.
    let rc = unsafe {
        ffi::PyBuffer_FillInfo(
            view,
            owner.as_ptr(),
            addr as *mut std::os::raw::c_void,
            len as ffi::Py_ssize_t,
            readonly as std::os::raw::c_int,
            flags,
        )
    };
    if rc != 0 {
        return Err(PyErr::fetch(owner.py()));
    }
    Ok(())
}
