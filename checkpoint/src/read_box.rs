//! Copying one box of a tensor from its shard file straight into a destination buffer, with
//! positioned reads (`file`).

use reshard_core::layout::{contiguous_runs, row_major_strides};
use reshard_core::{Error, ErrorKind, Result, TensorBox};

use crate::file::ShardFile;
use crate::open::Checkpoint;

/// Runs of at least this many bytes are read straight into the destination, one `pread` each.
const DIRECT_RUN: usize = 16 << 10;
/// Shorter runs (the rows of a narrow column box) are gathered: the source span under
/// consecutive runs, up to this many bytes, is read at once into a bounce buffer and the runs
/// copied out of it, trading the bytes the box skips for fewer system calls.
const GATHER_WINDOW: usize = 1 << 20;
/// Largest gap between two runs that still joins them in one gathered read: one system call
/// costs about as much as copying this many bytes (BENCHMARKS.md, "Checkpoint reads").
const GATHER_GAP: u64 = 8 << 10;

/// Consecutive short runs waiting to be read as one span.
struct Gather {
    /// Tensor byte offset where the span starts (the first run's source).
    start: u64,
    /// (source offset in the tensor, destination offset) of each run.
    runs: Vec<(u64, usize)>,
    buf: Vec<u8>,
}

impl Gather {
    /// Reads the span under the pending runs and copies each run to `dst`.
    fn flush(&mut self, file: &ShardFile, at: u64, run: usize, dst: &mut [u8]) -> Result<()> {
        let Some(&(last, _)) = self.runs.last() else {
            return Ok(());
        };
        if let [(s, t)] = self.runs[..] {
            file.read_exact_at(at + s, &mut dst[t..t + run])?;
        } else {
            // At most GATHER_WINDOW bytes (runs join only while the span stays under it).
            let span = (last - self.start) as usize + run;
            self.buf.resize(span, 0);
            file.read_exact_at(at + self.start, &mut self.buf)?;
            for &(s, t) in &self.runs {
                let from = (s - self.start) as usize;
                dst[t..t + run].copy_from_slice(&self.buf[from..from + run]);
            }
        }
        self.runs.clear();
        Ok(())
    }
}

impl Checkpoint {
    /// Copies box `tbox` (global coordinates) of `tensor` into `dst`, row-major in the box's own
    /// shape. Bytes go from the shard file straight into `dst` (the publisher's registered
    /// memory) by positioned reads: a dim-0 (row) box is one read, a box of long rows one read
    /// per row, and a box of short rows (a narrow column split) is gathered through a small
    /// bounce buffer. Bad arguments are `InvalidInput` naming tensor and box; a shard file that
    /// ends early or changed since [`Checkpoint::open`] is a `Config` error naming tensor, file
    /// and byte range (then `dst` holds a partial copy).
    pub fn copy_box(&self, tensor: &str, tbox: &TensorBox, dst: &mut [u8]) -> Result<()> {
        let entry = self.entry(tensor)?;
        let spec = &entry.spec;
        tbox.validate_in(spec).map_err(|e| {
            Error::new(
                ErrorKind::InvalidInput,
                format!("box {tbox} of tensor {tensor}: {}", e.message()),
            )
            .with_tensor(tensor)
        })?;
        let esize = spec.dtype.size() as usize;
        // validate_in proved the box's byte size fits u64; usize may still be narrower.
        let want = usize::try_from(tbox.elements() * spec.dtype.size()).ok();
        if want != Some(dst.len()) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "box {tbox} of tensor {tensor} is {} bytes but the destination is {} bytes",
                    tbox.elements() * spec.dtype.size(),
                    dst.len()
                ),
            )
            .with_tensor(tensor));
        }
        let file = &self.shards[entry.shard];
        let src_strides = row_major_strides(&spec.shape);
        let dst_strides = row_major_strides(&tbox.extent);
        let runs = contiguous_runs(&tbox.extent, &src_strides, &dst_strides);
        let run = runs.block as usize * esize;
        // The collapsed inner dims start at the box offset; only the outer dims are enumerated.
        let base: u64 = (runs.outer..tbox.rank())
            .map(|d| tbox.offset[d] * src_strides[d])
            .sum();
        let mut gather = Gather {
            start: 0,
            runs: Vec::new(),
            buf: Vec::new(),
        };
        let mut idx = vec![0u64; runs.outer];
        let mut copy = || -> Result<()> {
            loop {
                let mut s = base;
                let mut t = 0u64;
                for d in 0..runs.outer {
                    s += (tbox.offset[d] + idx[d]) * src_strides[d];
                    t += idx[d] * dst_strides[d];
                }
                // Byte offsets: source inside the tensor, destination inside `dst`.
                let (s, t) = (s * esize as u64, t as usize * esize);
                if run >= DIRECT_RUN {
                    file.read_exact_at(entry.start + s, &mut dst[t..t + run])?;
                } else {
                    // Runs come in increasing source order (both sides row-major).
                    let joins = gather.runs.last().is_some_and(|&(prev, _)| {
                        s - (prev + run as u64) <= GATHER_GAP
                            && (s - gather.start) as usize + run <= GATHER_WINDOW
                    });
                    if !joins {
                        gather.flush(file, entry.start, run, dst)?;
                        gather.start = s;
                    }
                    gather.runs.push((s, t));
                }
                // Odometer over the outer dims, innermost fastest (row-major destination order).
                let mut d = runs.outer;
                loop {
                    if d == 0 {
                        return gather.flush(file, entry.start, run, dst);
                    }
                    d -= 1;
                    idx[d] += 1;
                    if idx[d] < tbox.extent[d] {
                        break;
                    }
                    idx[d] = 0;
                }
            }
        };
        // The size and mtime checked after the reads: a file rewritten in place during them
        // (same size, other bytes) is refused too.
        copy()
            .and_then(|()| file.check_unchanged(&(entry.start..entry.end)))
            .map_err(|e| e.with_tensor(tensor))
    }
}
