//! The deterministic test content a generated checkpoint holds.
//!
//! Each tensor gets a seed from xxh3 of its name with the step as hash seed; 8-byte block `k` of
//! its row-major bytes is a splitmix64 finalisation of `seed + k * golden`. Being counter-based
//! (no sequential PRNG state) keeps the content a pure function of (name, byte index, step), so any
//! block can be produced independently and the writer never holds more than one tensor. bf16
//! values are then forced into small finite magnitudes so an engine loading the checkpoint does
//! not meet NaN or infinity.

use reshard_core::{DType, TensorSpec};

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `dst` with the whole content of `spec` at `step` (`dst` is the tensor's byte size).
pub(crate) fn fill_tensor(spec: &TensorSpec, step: u64, dst: &mut [u8]) {
    let seed = twox_hash::XxHash3_64::oneshot_with_seed(step, spec.name.as_bytes());
    for (k, chunk) in dst.chunks_mut(8).enumerate() {
        let w = mix(seed.wrapping_add((k as u64).wrapping_mul(GOLDEN))).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
    if spec.dtype == DType::Bf16 {
        for e in dst.chunks_exact_mut(2) {
            let v = u16::from_le_bytes([e[0], e[1]]);
            // Keep sign and 7 mantissa bits; exponent 120..=123, i.e. |x| in [2^-7, 2^-3).
            let exp = 120 + ((v >> 7) & 0x3);
            let b = (v & 0x807F) | (exp << 7);
            e.copy_from_slice(&b.to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_depends_on_name_and_step_and_bf16_is_finite() {
        let a = TensorSpec::new("a", DType::Bf16, vec![4, 8]);
        let b = TensorSpec::new("b", DType::Bf16, vec![4, 8]);
        let gen = |s: &TensorSpec, step| {
            let mut v = vec![0u8; 64];
            fill_tensor(s, step, &mut v);
            v
        };
        assert_eq!(gen(&a, 1), gen(&a, 1));
        assert_ne!(gen(&a, 1), gen(&a, 2));
        assert_ne!(gen(&a, 1), gen(&b, 1));
        for e in gen(&a, 3).chunks_exact(2) {
            let exp = (u16::from_le_bytes([e[0], e[1]]) >> 7) & 0xFF;
            assert!((120..=123).contains(&exp));
        }
    }
}
