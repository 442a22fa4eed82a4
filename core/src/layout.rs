//! A receiver's wanted layout: its parameters and the copies that fill them (docs/design.md §2).

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::model::{DType, TensorBox};

/// One box of a source tensor and where it lands inside a parameter.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WantedCopy {
    /// Source tensor's global name.
    pub tensor: String,
    /// Box of the source tensor, in global coordinates.
    pub src_box: TensorBox,
    /// Byte offset in the parameter of the box's first element.
    pub dst_offset: u64,
    /// Element strides in the parameter, one per box dimension.
    pub dst_strides: Vec<u64>,
}

/// One receiver parameter (a contiguous buffer) and the copies that fill it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamSpec {
    /// Engine-side parameter name (e.g. `...qkv_proj.weight`).
    pub name: String,
    /// Element type; every source must match it (no conversions).
    pub dtype: DType,
    /// Shape of the parameter.
    pub shape: Vec<u64>,
    /// Copies filling it.
    pub copies: Vec<WantedCopy>,
}

impl ParamSpec {
    /// Size in bytes.
    pub fn bytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.size()
    }
}

/// Everything one receiver rank wants.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WantedLayout {
    /// Receiver rank (used by owner spreading, and in reports).
    pub receiver_rank: u32,
    /// Parameters, in engine order.
    pub params: Vec<ParamSpec>,
}

impl WantedLayout {
    /// Number of copies across all parameters.
    pub fn copies(&self) -> usize {
        self.params.iter().map(|p| p.copies.len()).sum()
    }

    /// Total parameter bytes (saturating: each validated parameter fits u64, the sum need not).
    pub fn bytes(&self) -> u64 {
        self.params
            .iter()
            .fold(0u64, |a, p| a.saturating_add(p.bytes()))
    }

    /// Checks every copy stays inside its parameter; errors name parameter and tensor.
    pub fn validate(&self) -> Result<()> {
        for p in &self.params {
            let pbytes = p
                .shape
                .iter()
                .try_fold(p.dtype.size(), |a, &x| a.checked_mul(x))
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::Layout,
                        format!("parameter {} overflows u64", p.name),
                    )
                })?;
            for c in &p.copies {
                let err = |m: String| Error::new(ErrorKind::Layout, m).with_tensor(&c.tensor);
                if c.dst_strides.len() != c.src_box.rank()
                    || c.src_box.offset.len() != c.src_box.rank()
                {
                    return Err(err(format!(
                        "copy into {} has {} strides for a rank-{} box",
                        p.name,
                        c.dst_strides.len(),
                        c.src_box.rank()
                    )));
                }
                if c.src_box.extent.contains(&0) {
                    return Err(err(format!("copy into {} has a zero extent", p.name)));
                }
                let last = c
                    .src_box
                    .extent
                    .iter()
                    .zip(&c.dst_strides)
                    .try_fold(0u64, |a, (&e, &s)| {
                        (e - 1).checked_mul(s).and_then(|v| a.checked_add(v))
                    })
                    .and_then(|v| v.checked_add(1))
                    .and_then(|v| v.checked_mul(p.dtype.size()))
                    .and_then(|v| v.checked_add(c.dst_offset));
                match last {
                    Some(end) if end <= pbytes => {}
                    _ => {
                        return Err(err(format!(
                            "copy of box {} lands outside parameter {} ({} bytes)",
                            c.src_box, p.name, pbytes
                        )))
                    }
                }
            }
        }
        Ok(())
    }
}

/// Row-major element strides of a shape.
pub fn row_major_strides(shape: &[u64]) -> Vec<u64> {
    let mut s = vec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// How a box of elements splits into runs that are contiguous in two strided buffers at once:
/// the trailing dims collapse into one block, the leading ones enumerate the runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContiguousRuns {
    /// Number of leading dims not collapsed (a run per combination of their indices).
    pub outer: usize,
    /// Elements per run.
    pub block: u64,
}

/// Collapses the trailing dims of a box of extent `extent` that are contiguous in both buffers
/// (element strides `a_strides` and `b_strides`): the innermost dim joins when both its strides
/// are 1, and each dim further out while both its strides equal the elements already collapsed.
/// A box whose innermost stride is not 1 on either side has one element per run. The planner
/// (wire reads), the re-slice copy and the test-content writer all split boxes this way.
pub fn contiguous_runs(extent: &[u64], a_strides: &[u64], b_strides: &[u64]) -> ContiguousRuns {
    let r = extent.len();
    let mut runs = ContiguousRuns { outer: r, block: 1 };
    if r == 0 || a_strides[r - 1] != 1 || b_strides[r - 1] != 1 {
        return runs;
    }
    runs.outer = r - 1;
    runs.block = extent[r - 1];
    while runs.outer > 0 {
        let d = runs.outer - 1;
        if a_strides[d] != runs.block || b_strides[d] != runs.block {
            break;
        }
        runs.block *= extent[d];
        runs.outer = d;
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_runs_collapse_while_both_sides_are_row_major() {
        let runs = |outer, block| ContiguousRuns { outer, block };
        // Whole rows of a [4, 8] box in two [4, 8] buffers: one run of 32 elements.
        assert_eq!(contiguous_runs(&[4, 8], &[8, 1], &[8, 1]), runs(0, 32));
        // Half rows: one run per row.
        assert_eq!(contiguous_runs(&[4, 4], &[8, 1], &[4, 1]), runs(1, 4));
        // A [2, 3, 4] box: whole in both, then whole rows of its inner [3, 4] only, then rows.
        assert_eq!(
            contiguous_runs(&[2, 3, 4], &[12, 4, 1], &[12, 4, 1]),
            runs(0, 24)
        );
        assert_eq!(
            contiguous_runs(&[2, 3, 4], &[24, 4, 1], &[12, 4, 1]),
            runs(1, 12)
        );
        assert_eq!(
            contiguous_runs(&[2, 3, 4], &[24, 8, 1], &[12, 4, 1]),
            runs(2, 4)
        );
        // Innermost stride not 1 on either side: every element is a run.
        assert_eq!(contiguous_runs(&[4, 4], &[4, 1], &[1, 4]), runs(2, 1));
        assert_eq!(contiguous_runs(&[4, 4], &[1, 4], &[4, 1]), runs(2, 1));
        assert_eq!(contiguous_runs(&[], &[], &[]), runs(0, 1));
    }

    #[test]
    fn strides_are_row_major() {
        assert_eq!(row_major_strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(row_major_strides(&[5]), vec![1]);
    }

    #[test]
    fn copy_outside_param_is_a_layout_error() {
        let l = WantedLayout {
            receiver_rank: 0,
            params: vec![ParamSpec {
                name: "p".into(),
                dtype: DType::Bf16,
                shape: vec![4, 4],
                copies: vec![WantedCopy {
                    tensor: "w".into(),
                    src_box: TensorBox::new(vec![0, 0], vec![4, 4]),
                    dst_offset: 2,
                    dst_strides: vec![4, 1],
                }],
            }],
        };
        let e = l.validate().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Layout);
        assert_eq!(e.context().tensor.as_deref(), Some("w"));
    }
}
