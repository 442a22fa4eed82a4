//! Local strided copies (the re-slice of full pulls): collapse trailing dimensions contiguous in
//! both buffers, then move each run with one `copy_from_slice`.

use reshard_core::layout::{contiguous_runs, ContiguousRuns};
use reshard_core::{Error, ErrorKind, Reslice, Result};

/// Copies `r.extent` elements from `src` (staging) into `dst` (parameter) per the re-slice.
/// Bounds are checked up front; a violation is an `Internal` error naming the tensor.
pub fn reslice(r: &Reslice, src: &[u8], dst: &mut [u8], tensor: &str) -> Result<()> {
    let e = r.elem;
    let last = |off: u64, strides: &[u64]| -> u64 {
        off + e
            * (1 + r
                .extent
                .iter()
                .zip(strides)
                .map(|(x, s)| (x - 1) * s)
                .sum::<u64>())
    };
    if last(r.src_offset, &r.src_strides) > src.len() as u64
        || last(r.dst_offset, &r.dst_strides) > dst.len() as u64
    {
        return Err(
            Error::new(ErrorKind::Internal, "re-slice outside its buffers").with_tensor(tensor),
        );
    }
    // Collapse: dims k.. form one contiguous run in both buffers.
    let ContiguousRuns {
        outer: k,
        block: run,
    } = contiguous_runs(&r.extent, &r.src_strides, &r.dst_strides);
    let run_bytes = (run * e) as usize;
    let outer: u64 = r.extent[..k].iter().product();
    let mut idx = vec![0u64; k];
    for _ in 0..outer {
        let (mut s, mut d) = (r.src_offset, r.dst_offset);
        for (j, &i) in idx.iter().enumerate() {
            s += i * r.src_strides[j] * e;
            d += i * r.dst_strides[j] * e;
        }
        dst[d as usize..d as usize + run_bytes]
            .copy_from_slice(&src[s as usize..s as usize + run_bytes]);
        for j in (0..k).rev() {
            idx[j] += 1;
            if idx[j] < r.extent[j] {
                break;
            }
            idx[j] = 0;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_half_of_a_matrix() {
        // 4x6 u8 matrix, take columns 3..6 into a 4x3 destination.
        let src: Vec<u8> = (0..24).collect();
        let mut dst = vec![0u8; 12];
        let r = Reslice {
            staging: 0,
            src_offset: 3,
            src_strides: vec![6, 1],
            extent: vec![4, 3],
            elem: 1,
            param: 0,
            dst_offset: 0,
            dst_strides: vec![3, 1],
            tensor: 0,
        };
        reslice(&r, &src, &mut dst, "t").unwrap();
        assert_eq!(dst, vec![3, 4, 5, 9, 10, 11, 15, 16, 17, 21, 22, 23]);
        let mut small = vec![0u8; 11];
        assert_eq!(
            reslice(&r, &src, &mut small, "t").unwrap_err().kind(),
            ErrorKind::Internal
        );
    }

    #[test]
    fn contiguous_box_is_one_run() {
        let src: Vec<u8> = (0..32).collect();
        let mut dst = vec![0u8; 16];
        let r = Reslice {
            staging: 0,
            src_offset: 8,
            src_strides: vec![4, 1],
            extent: vec![4, 4],
            elem: 1,
            param: 0,
            dst_offset: 0,
            dst_strides: vec![4, 1],
            tensor: 0,
        };
        reslice(&r, &src, &mut dst, "t").unwrap();
        assert_eq!(dst, (8..24).collect::<Vec<u8>>());
    }
}
