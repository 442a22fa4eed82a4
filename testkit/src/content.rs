//! Deterministic synthetic tensor content: every byte is a pure function of (seed, step, tensor
//! name, global byte position), so replicas are byte-identical, any box can be produced on its
//! own, and a receiver's expected parameters can be rebuilt independently of the wire.

use reshard_core::layout::{contiguous_runs, row_major_strides, ContiguousRuns};
use reshard_core::TensorBox;

/// Per-tensor key mixing seed, step and name.
pub fn tensor_key(seed: u64, step: u64, name: &str) -> u64 {
    twox_hash::XxHash3_64::oneshot_with_seed(
        seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        name.as_bytes(),
    )
}

#[inline]
fn word(key: u64, w: u64) -> [u8; 8] {
    // splitmix64 finaliser; every byte forced non-zero so a byte never written (zeroed memory)
    // can never look correct.
    let mut z = key.wrapping_add(w.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z | 0x0101_0101_0101_0101).to_le_bytes()
}

/// Fills `dst` with the bytes at global byte positions `start..start+dst.len()` of a tensor.
pub fn fill(dst: &mut [u8], key: u64, start: u64) {
    // Unaligned head, then whole 8-byte words, then the tail.
    let head = (((8 - start % 8) % 8) as usize).min(dst.len());
    if head > 0 {
        let off = (start % 8) as usize;
        dst[..head].copy_from_slice(&word(key, start / 8)[off..off + head]);
    }
    let mut w = (start + head as u64) / 8;
    let mut chunks = dst[head..].chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&word(key, w));
        w += 1;
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        let n = tail.len();
        tail.copy_from_slice(&word(key, w)[..n]);
    }
}

/// Calls `f(global_byte, len, box_byte)` for each maximal run of `b` that is contiguous in the
/// row-major global tensor of `shape`, in row-major order of the box.
pub fn for_each_span(shape: &[u64], b: &TensorBox, elem: u64, mut f: impl FnMut(u64, u64, u64)) {
    let strides = row_major_strides(shape);
    // Runs contiguous in both the box (row-major over its extent) and the global tensor.
    let ContiguousRuns {
        outer: k,
        block: inner,
    } = contiguous_runs(&b.extent, &row_major_strides(&b.extent), &strides);
    let origin: u64 = b.offset.iter().zip(&strides).map(|(o, s)| o * s).sum();
    let outer: u64 = b.extent[..k].iter().product();
    let mut idx = vec![0u64; k];
    let mut box_byte = 0u64;
    for _ in 0..outer {
        let g = origin + (0..k).map(|d| idx[d] * strides[d]).sum::<u64>();
        f(g * elem, inner * elem, box_byte);
        box_byte += inner * elem;
        for d in (0..k).rev() {
            idx[d] += 1;
            if idx[d] < b.extent[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Writes box `b` of a tensor into `dst` (row-major over the box).
pub fn fill_box(dst: &mut [u8], key: u64, shape: &[u64], b: &TensorBox, elem: u64) {
    for_each_span(shape, b, elem, |g, len, at| {
        fill(&mut dst[at as usize..(at + len) as usize], key, g);
    });
}

/// Writes box `b` of a tensor into `dst` at byte `dst_offset` with element strides `dst_strides`
/// (how a receiver parameter holds a copy): the reference for byte-exact checks.
pub fn fill_strided(
    dst: &mut [u8],
    key: u64,
    shape: &[u64],
    b: &TensorBox,
    elem: u64,
    dst_offset: u64,
    dst_strides: &[u64],
) {
    let n = shape.len();
    let strides = reshard_core::layout::row_major_strides(shape);
    let rows: u64 = b.extent[..n - 1].iter().product();
    let row_len = b.extent[n - 1];
    let mut idx = vec![0u64; n - 1];
    let mut tmp = vec![0u8; (row_len * elem) as usize];
    for _ in 0..rows {
        let mut g = b.offset[n - 1];
        let mut o = 0u64;
        for d in 0..n - 1 {
            g += (b.offset[d] + idx[d]) * strides[d];
            o += idx[d] * dst_strides[d];
        }
        fill(&mut tmp, key, g * elem);
        let base = dst_offset + o * elem;
        if dst_strides[n - 1] == 1 {
            dst[base as usize..(base + row_len * elem) as usize].copy_from_slice(&tmp);
        } else {
            for j in 0..row_len {
                let at = (base + j * dst_strides[n - 1] * elem) as usize;
                dst[at..at + elem as usize]
                    .copy_from_slice(&tmp[(j * elem) as usize..((j + 1) * elem) as usize]);
            }
        }
        for d in (0..n - 1).rev() {
            idx[d] += 1;
            if idx[d] < b.extent[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_is_position_defined_and_non_zero() {
        let mut a = vec![0u8; 100];
        let mut b = vec![0u8; 37];
        fill(&mut a, 7, 1000);
        fill(&mut b, 7, 1013);
        assert_eq!(&a[13..50], &b[..]);
        assert!(a.iter().all(|&x| x != 0));
        let mut c = vec![0u8; 100];
        fill(&mut c, 8, 1000);
        assert_ne!(a, c);
    }

    #[test]
    fn box_matches_full_tensor_slice() {
        let shape = [4u64, 6, 5];
        let elem = 2u64;
        let total = (4 * 6 * 5 * elem) as usize;
        let mut full = vec![0u8; total];
        fill(&mut full, 3, 0);
        let b = TensorBox::new(vec![1, 2, 1], vec![2, 3, 4]);
        let mut got = vec![0u8; (2 * 3 * 4 * elem) as usize];
        fill_box(&mut got, 3, &shape, &b, elem);
        let mut want = Vec::new();
        for i in 1..3u64 {
            for j in 2..5u64 {
                let s = ((i * 30 + j * 5 + 1) * elem) as usize;
                want.extend_from_slice(&full[s..s + (4 * elem) as usize]);
            }
        }
        assert_eq!(got, want);
        // Same box placed with strides equal to its own row-major layout.
        let mut strided = vec![0u8; got.len()];
        fill_strided(&mut strided, 3, &shape, &b, elem, 0, &[12, 4, 1]);
        assert_eq!(strided, want);
    }
}
