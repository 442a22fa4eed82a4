//! The re-slice stage: full pulls and staged offers copied from staging into parameters.

use rayon::prelude::*;
use std::collections::BTreeMap;
use std::sync::Arc;

use reshard_core::{HostBuffer, Plan, Result};

use crate::strided;

pub(super) fn run_reslices(
    plan: &Plan,
    staging: &[Arc<HostBuffer>],
    params: &[Arc<HostBuffer>],
    batched: bool,
) -> Result<()> {
    let one = |r: &reshard_core::Reslice, dst: &mut [u8]| -> Result<()> {
        let src = staging[r.staging as usize].read();
        strided::reslice(r, &src, dst, &plan.tensors[r.tensor as usize])
    };
    if batched && plan.reslice_disjoint {
        // One parallel pass: destinations are disjoint, so parameters are independent.
        let mut groups: BTreeMap<u32, Vec<&reshard_core::Reslice>> = BTreeMap::new();
        for r in &plan.reslices {
            groups.entry(r.param).or_default().push(r);
        }
        let groups: Vec<_> = groups.into_iter().collect();
        groups.into_par_iter().try_for_each(|(p, rs)| {
            let mut dst = params[p as usize].write();
            rs.into_iter().try_for_each(|r| one(r, &mut dst))
        })
    } else {
        // Plan order: with overlapping destinations the last writer wins, as planned.
        for r in &plan.reslices {
            let mut dst = params[r.param as usize].write();
            one(r, &mut dst)?;
        }
        Ok(())
    }
}
