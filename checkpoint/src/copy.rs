//! Copying one box of a tensor from the mapped file straight into a destination buffer.

use reshard_core::layout::{contiguous_runs, row_major_strides};
use reshard_core::{Error, ErrorKind, Result, TensorBox};

use crate::open::Checkpoint;

impl Checkpoint {
    /// Copies box `tbox` (global coordinates) of `tensor` into `dst`, row-major in the box's own
    /// shape. Bytes go from the mapped file straight into `dst` (the publisher's registered
    /// memory), one `copy_from_slice` per contiguous run: a dim-0 (row) box is one run, a dim-1
    /// (column) box one run per row. Errors are `InvalidInput` naming tensor and box.
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
        let src = &self.shards[entry.shard].map[entry.start..entry.end];
        let src_strides = row_major_strides(&spec.shape);
        let dst_strides = row_major_strides(&tbox.extent);
        let runs = contiguous_runs(&tbox.extent, &src_strides, &dst_strides);
        let run_bytes = runs.block as usize * esize;
        // The collapsed inner dims start at the box offset; only the outer dims are enumerated.
        let base: u64 = (runs.outer..tbox.rank())
            .map(|d| tbox.offset[d] * src_strides[d])
            .sum();
        let mut idx = vec![0u64; runs.outer];
        loop {
            let mut s = base;
            let mut t = 0u64;
            for d in 0..runs.outer {
                s += (tbox.offset[d] + idx[d]) * src_strides[d];
                t += idx[d] * dst_strides[d];
            }
            let (s, t) = (s as usize * esize, t as usize * esize);
            dst[t..t + run_bytes].copy_from_slice(&src[s..s + run_bytes]);
            // Odometer over the outer dims, innermost fastest (row-major destination order).
            let mut d = runs.outer;
            loop {
                if d == 0 {
                    return Ok(());
                }
                d -= 1;
                idx[d] += 1;
                if idx[d] < tbox.extent[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }
}
