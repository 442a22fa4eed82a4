//! Verification and re-slice as the bytes land (the reshard arm): while the wire leg runs, the
//! backend reports each read as it completes (`Transport::post_reporting`,
//! docs/in-flight-safety.md, "Completions as they happen"), and a verifier thread runs every
//! digest check and re-slice whose bytes have all landed, so the CPU hashes and copies while
//! the rest of the batch is still on the wire.
//!
//! The unit of "landed" is a receiver buffer (a parameter of the landing bank, or a staging
//! buffer): a buffer has landed once every read into it has been reported. A check runs once
//! its buffer has landed, so every read it covers is complete and none still writes the
//! memory it reads (other buffers may still be written: the verifier only takes the locks of
//! buffers nothing writes any more). A re-slice runs once its staging buffer and its parameter
//! have both landed. Where the plan's re-slice destinations may overlap (`reslice_disjoint`
//! false: strided column blocks of a dense layout whose receiver TP is smaller than the
//! trainer's, or offers that land on the same bytes), the re-slices into one parameter run as
//! one unit in plan order once that parameter and every staging buffer they read have landed,
//! so the last writer still wins as planned and other parameters go on landing. Reads with no report (a layer that reports nothing: several waves,
//! retries) land when `wait` returns `Ok`, and the rest runs then, as before.
//!
//! Checks read bytes no read writes again, and re-slices write parameter bytes no read writes
//! (the plan of a deduplicated batch writes every byte once; the receiver runs this only
//! then), so the order between them does not matter and the verdict is that of the
//! sequential order (re-slice, then verify).

use std::sync::mpsc;
use std::sync::Arc;

use rayon::prelude::*;

use reshard_core::{Dest, Error, ErrorKind, HostBuffer, Plan, Result, SegmentFold};

use super::hashes::CopyHashes;
use super::verify::{dest, run_check, Checked, Digests, Verdict};
use crate::strided;

/// What the verifier thread hears: a read reported complete, or the wire leg's end (`true`:
/// `wait` returned `Ok`, every read has landed).
pub(super) enum Msg {
    /// Read `i` of the batch is complete.
    Read(usize),
    /// The wire leg ended; `true` when it succeeded.
    End(bool),
}

/// One piece of work the verifier runs once its buffers have landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Unit {
    /// Digest check `i` of the plan.
    Check(u32),
    /// Re-slice `i` of the plan.
    Reslice(u32),
    /// Group `i` of a plan whose re-slices may overlap: every re-slice into one parameter, run
    /// in plan order (the last writer wins, as planned) once the parameter and every staging
    /// buffer they read have landed.
    Group(u32),
}

/// Which units wait for which buffers, and how many reads each buffer still waits for.
/// Buffers are numbered parameters first, then staging buffers.
pub(super) struct Schedule {
    /// Per read of the batch: its buffer.
    read_buf: Vec<u32>,
    /// Per read: reported already (a second report of one read changes nothing).
    seen: Vec<bool>,
    /// Per buffer: reads into it not yet reported.
    left: Vec<u32>,
    /// Per buffer: the units waiting for it.
    waiting: Vec<Vec<Unit>>,
    /// Per re-slice: its buffers not yet landed (1 or 2).
    reslice_wait: Vec<u8>,
    /// Per group (plans whose re-slices may overlap): its re-slices, in plan order.
    groups: Vec<Vec<u32>>,
    /// Per group: its buffers not yet landed.
    group_wait: Vec<u32>,
    /// Checks are run (verification on).
    verify: bool,
}

impl Schedule {
    /// The schedule of `plan`'s checks (when `verify`) and re-slices.
    pub(super) fn new(plan: &Plan, verify: bool) -> Self {
        let n_params = plan.params.len();
        let key = |d: Dest| match d {
            Dest::Param(i) => i as usize,
            Dest::Staging(i) => n_params + i as usize,
        };
        let buffers = n_params + plan.staging.len();
        let mut left = vec![0u32; buffers];
        let read_buf: Vec<u32> = plan
            .reads
            .iter()
            .map(|r| {
                let b = key(r.dst);
                left[b] += 1;
                b as u32
            })
            .collect();
        let mut waiting: Vec<Vec<Unit>> = vec![Vec::new(); buffers];
        if verify {
            for (i, c) in plan.checks.iter().enumerate() {
                waiting[key(c.dst)].push(Unit::Check(i as u32));
            }
        }
        let mut reslice_wait = Vec::with_capacity(plan.reslices.len());
        let mut groups = Vec::new();
        let mut group_wait = Vec::new();
        if plan.reslice_disjoint {
            // Every re-slice writes bytes no other writes: each runs on its own.
            for (i, r) in plan.reslices.iter().enumerate() {
                let (s, p) = (key(Dest::Staging(r.staging)), key(Dest::Param(r.param)));
                waiting[s].push(Unit::Reslice(i as u32));
                waiting[p].push(Unit::Reslice(i as u32));
                reslice_wait.push(2);
            }
        } else {
            // Destinations may overlap, but only within one parameter (the planner compares
            // spans per parameter): the re-slices of a parameter run together, in plan order,
            // and parameters stay independent of each other.
            let mut by_param: std::collections::BTreeMap<u32, Vec<u32>> = Default::default();
            for (i, r) in plan.reslices.iter().enumerate() {
                by_param.entry(r.param).or_default().push(i as u32);
            }
            for (param, members) in by_param {
                let g = Unit::Group(groups.len() as u32);
                let mut bufs: Vec<usize> = members
                    .iter()
                    .map(|&i| key(Dest::Staging(plan.reslices[i as usize].staging)))
                    .collect();
                bufs.push(key(Dest::Param(param)));
                bufs.sort_unstable();
                bufs.dedup();
                for &b in &bufs {
                    waiting[b].push(g);
                }
                group_wait.push(bufs.len() as u32);
                groups.push(members);
            }
        }
        Schedule {
            seen: vec![false; read_buf.len()],
            read_buf,
            left,
            waiting,
            reslice_wait,
            groups,
            group_wait,
            verify,
        }
    }

    /// The units runnable before any read completes: those of buffers no read writes.
    pub(super) fn start(&mut self, ready: &mut Vec<Unit>) {
        for b in 0..self.left.len() {
            if self.left[b] == 0 {
                self.landed(b, ready);
            }
        }
    }

    /// Read `i` completed: adds the units that became runnable to `ready`.
    pub(super) fn read_done(&mut self, i: usize, ready: &mut Vec<Unit>) {
        let Some(seen) = self.seen.get_mut(i) else {
            return;
        };
        if std::mem::replace(seen, true) {
            return;
        }
        let b = self.read_buf[i] as usize;
        self.left[b] -= 1;
        if self.left[b] == 0 {
            self.landed(b, ready);
        }
    }

    /// Every read landed (`wait` returned `Ok`): adds every unit not run yet.
    pub(super) fn all_done(&mut self, ready: &mut Vec<Unit>) {
        for i in 0..self.seen.len() {
            self.read_done(i, ready);
        }
    }

    fn landed(&mut self, b: usize, ready: &mut Vec<Unit>) {
        for u in std::mem::take(&mut self.waiting[b]) {
            match u {
                Unit::Check(_) => ready.push(u),
                Unit::Reslice(r) => {
                    let w = &mut self.reslice_wait[r as usize];
                    *w -= 1;
                    if *w == 0 {
                        ready.push(u);
                    }
                }
                Unit::Group(g) => {
                    let w = &mut self.group_wait[g as usize];
                    *w -= 1;
                    if *w == 0 {
                        ready.push(u);
                    }
                }
            }
        }
    }

    /// The re-slices group `g` runs, in plan order.
    pub(super) fn group(&self, g: u32) -> &[u32] {
        &self.groups[g as usize]
    }

    /// Whether checks are run.
    pub(super) fn verifies(&self) -> bool {
        self.verify
    }
}

/// What the verifier did.
#[derive(Default)]
pub(super) struct Landed {
    /// The checks' outcome.
    pub(super) verdict: Verdict,
    /// Checks run before the wire leg ended.
    pub(super) early_checks: u64,
    /// Re-slices run before the wire leg ended.
    pub(super) early_reslices: u64,
}

/// The verifier's view of one update: the plan, the landing bank, staging and digests.
pub(super) struct Verifier {
    pub(super) plan: Arc<Plan>,
    pub(super) params: Vec<Arc<HostBuffer>>,
    pub(super) staging: Vec<Arc<HostBuffer>>,
    pub(super) digests: Digests,
    pub(super) schedule: Schedule,
    /// The segment hashes the backend stores while copying, when the receiver handed it a
    /// hash plan with the batch (its checks then fold them instead of re-reading the bytes).
    pub(super) hashes: Option<Arc<CopyHashes>>,
}

impl Verifier {
    /// Runs units as their buffers land, until the wire leg's end is heard; after a
    /// successful leg, runs the rest. Returns the first failure of a check or re-slice (units
    /// still runnable after it are skipped), or an `Aborted` error when the leg failed (its
    /// own error is the caller's to report).
    pub(super) fn run(mut self, rx: mpsc::Receiver<Msg>) -> Result<Landed> {
        let mut out = Landed::default();
        let mut ready = Vec::new();
        self.schedule.start(&mut ready);
        let ok = loop {
            if !ready.is_empty() {
                let (checks, reslices) = self.count(&ready);
                self.run_units(&ready, &mut out.verdict)?;
                out.early_checks += checks;
                out.early_reslices += reslices;
                ready.clear();
            }
            // Block for the next report, then take every one queued behind it.
            let Ok(first) = rx.recv() else {
                // Every sender is gone without an end: the caller stopped listening.
                break false;
            };
            let mut next = Some(first);
            let mut end = None;
            while let Some(m) = next {
                match m {
                    Msg::Read(i) => self.schedule.read_done(i, &mut ready),
                    Msg::End(ok) => {
                        end = Some(ok);
                        break;
                    }
                }
                next = rx.try_recv().ok();
            }
            if let Some(ok) = end {
                break ok;
            }
        };
        if !ok {
            return Err(Error::new(
                ErrorKind::Aborted,
                "the wire leg failed: verification as the bytes land stopped",
            ));
        }
        self.schedule.all_done(&mut ready);
        self.run_units(&ready, &mut out.verdict)?;
        Ok(out)
    }

    /// Runs `units` in parallel, adding the checks' outcomes to `verdict`.
    fn run_units(&self, units: &[Unit], verdict: &mut Verdict) -> Result<()> {
        let (plan, params, staging) = (&*self.plan, &self.params, &self.staging);
        let results: Vec<Result<Option<Checked>>> = units
            .par_iter()
            .map_init(SegmentFold::new, |fold, &u| match u {
                Unit::Check(i) => {
                    debug_assert!(self.schedule.verifies());
                    let c = &plan.checks[i as usize];
                    let hashes = self
                        .hashes
                        .as_deref()
                        .map(|h| (&*h.plan, h.first_slot[i as usize]));
                    let buf = dest(c.dst, params, staging);
                    run_check(plan, &self.digests, c, buf, fold, hashes)
                }
                Unit::Reslice(i) => {
                    let r = &plan.reslices[i as usize];
                    let src = staging[r.staging as usize].read();
                    let mut dst = params[r.param as usize].write();
                    strided::reslice(r, &src, &mut dst, &plan.tensors[r.tensor as usize])?;
                    Ok(None)
                }
                Unit::Group(g) => {
                    let members = self.schedule.group(g);
                    let Some(&first) = members.first() else {
                        return Ok(None);
                    };
                    let mut dst = params[plan.reslices[first as usize].param as usize].write();
                    for &i in members {
                        let r = &plan.reslices[i as usize];
                        let src = staging[r.staging as usize].read();
                        strided::reslice(r, &src, &mut dst, &plan.tensors[r.tensor as usize])?;
                    }
                    Ok(None)
                }
            })
            .collect();
        for (u, r) in units.iter().zip(results) {
            let r = r?;
            if matches!(u, Unit::Check(_)) {
                verdict.add(r);
            }
        }
        Ok(())
    }
}

impl Verifier {
    /// Checks and re-slices among `units` (a group counts each of its re-slices).
    fn count(&self, units: &[Unit]) -> (u64, u64) {
        units.iter().fold((0, 0), |(c, r), u| match u {
            Unit::Check(_) => (c + 1, r),
            Unit::Reslice(_) => (c, r + 1),
            Unit::Group(g) => (c, r + self.schedule.group(*g).len() as u64),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard_core::{
        CheckedPart, DigestCheck, PlanParam, PlannedRead, Reslice, StagingBuffer, StagingKind,
        TensorBox,
    };

    fn read(owner: u32, dst: Dest, dst_offset: u64, len: u64) -> PlannedRead {
        PlannedRead {
            owner,
            src_region: 1,
            src_offset: 0,
            len,
            dst,
            dst_offset,
            tensor: 0,
            src_rows: None,
        }
    }

    fn check(dst: Dest, dst_offset: u64, rows: u64, row_bytes: u64, stride: u64) -> DigestCheck {
        DigestCheck {
            tensor: 0,
            owner: 0,
            src_region: 1,
            src_offset: 0,
            part: CheckedPart::Whole,
            dst,
            dst_offset,
            rows,
            row_bytes,
            row_stride: stride,
            seg_bytes: row_bytes,
        }
    }

    /// Two parameters and two staging buffers, written by reads of several owners; checks of
    /// whole reads, of rows across two reads and of strided column blocks; re-slices from
    /// each staging buffer into a parameter that reads also write, and into one they do not.
    fn plan() -> Plan {
        // Parameter 2 is written by re-slices only.
        let (p0, p1, s0, s1) = (
            Dest::Param(0),
            Dest::Param(1),
            Dest::Staging(0),
            Dest::Staging(1),
        );
        let staging = |bytes| StagingBuffer {
            tensor: 0,
            tensor_box: TensorBox {
                offset: vec![0],
                extent: vec![bytes],
            },
            kind: StagingKind::FullPull,
            bytes,
        };
        let reslice = |staging, param, dst_offset| Reslice {
            staging,
            src_offset: 0,
            src_strides: vec![1],
            extent: vec![64],
            elem: 1,
            param,
            dst_offset,
            dst_strides: vec![1],
            tensor: 0,
        };
        Plan {
            tensors: vec!["t".into()],
            params: (0..3)
                .map(|i| PlanParam {
                    name: format!("p{i}"),
                    bytes: 1024,
                })
                .collect(),
            staging: vec![staging(256), staging(128)],
            reads: vec![
                read(1, p0, 0, 256),
                read(2, p0, 256, 256),
                read(3, p0, 512, 256),
                read(1, p1, 0, 512),
                read(2, s0, 0, 128),
                read(3, s0, 128, 128),
                read(4, s1, 0, 128),
            ],
            reslices: vec![reslice(0, 0, 768), reslice(1, 2, 0), reslice(0, 2, 64)],
            reslice_disjoint: true,
            checks: vec![
                check(p0, 0, 1, 256, 256),
                check(p0, 128, 2, 128, 256),
                check(p0, 0, 6, 64, 128),
                check(p1, 0, 4, 128, 128),
                check(s0, 0, 2, 128, 128),
                check(s1, 0, 1, 128, 128),
            ],
            ..Plan::default()
        }
    }

    /// The reads (by index) writing any byte `c` covers: an oracle from byte ranges alone.
    fn covering(p: &Plan, c: &DigestCheck) -> Vec<usize> {
        (0..p.reads.len())
            .filter(|&i| {
                let r = &p.reads[i];
                r.dst == c.dst
                    && (0..c.rows).any(|k| {
                        let s = c.dst_offset + k * c.row_stride;
                        s < r.dst_offset + r.len && r.dst_offset < s + c.row_bytes
                    })
            })
            .collect()
    }

    /// Every read writing the staging buffer a re-slice reads or the parameter it writes.
    fn touching(p: &Plan, r: &Reslice) -> Vec<usize> {
        (0..p.reads.len())
            .filter(|&i| {
                let d = p.reads[i].dst;
                d == Dest::Staging(r.staging) || d == Dest::Param(r.param)
            })
            .collect()
    }

    #[test]
    fn a_unit_runs_once_and_only_after_every_read_it_depends_on_completed() {
        every_order_runs_each_unit_once_after_its_reads(&plan());
    }

    #[test]
    fn overlapping_reslices_run_per_parameter_in_plan_order_after_every_read_they_touch() {
        let mut p = plan();
        p.reslice_disjoint = false;
        let s = Schedule::new(&p, true);
        // Parameter 0 takes re-slice 0; parameter 2 takes re-slices 1 and 2, in plan order.
        assert_eq!((s.group(0), s.group(1)), (&[0u32][..], &[1u32, 2][..]));
        every_order_runs_each_unit_once_after_its_reads(&p);
    }

    fn every_order_runs_each_unit_once_after_its_reads(p: &Plan) {
        let n = p.reads.len();
        let groups = Schedule::new(p, true).groups.clone();
        // Every order of completion (7! = 5040), with reports repeated once in some orders.
        let mut order: Vec<usize> = (0..n).collect();
        let mut orders = 0;
        permute(&mut order, 0, &mut |order| {
            orders += 1;
            let mut s = Schedule::new(p, true);
            let mut done = vec![false; n];
            let mut ran = Vec::new();
            let mut ready = Vec::new();
            let check_ready = |ready: &mut Vec<Unit>, done: &[bool], ran: &mut Vec<Unit>| {
                for u in ready.drain(..) {
                    let deps = match u {
                        Unit::Check(i) => covering(p, &p.checks[i as usize]),
                        Unit::Reslice(i) => touching(p, &p.reslices[i as usize]),
                        Unit::Group(g) => groups[g as usize]
                            .iter()
                            .flat_map(|&i| touching(p, &p.reslices[i as usize]))
                            .collect(),
                    };
                    for d in deps {
                        assert!(
                            done[d],
                            "{u:?} released before read {d} completed ({order:?})"
                        );
                    }
                    ran.push(u);
                }
            };
            s.start(&mut ready);
            check_ready(&mut ready, &done, &mut ran);
            for (k, &i) in order.iter().enumerate() {
                done[i] = true;
                s.read_done(i, &mut ready);
                if orders % 3 == 0 && k == 2 {
                    // A second report of a read changes nothing.
                    s.read_done(i, &mut ready);
                }
                check_ready(&mut ready, &done, &mut ran);
            }
            s.all_done(&mut ready);
            check_ready(&mut ready, &done, &mut ran);
            ran.sort_by_key(|u| match u {
                Unit::Check(i) => (0, *i),
                Unit::Reslice(i) => (1, *i),
                Unit::Group(i) => (2, *i),
            });
            let reslices: Vec<Unit> = if p.reslice_disjoint {
                (0..p.reslices.len() as u32).map(Unit::Reslice).collect()
            } else {
                (0..groups.len() as u32).map(Unit::Group).collect()
            };
            let want: Vec<Unit> = (0..p.checks.len() as u32)
                .map(Unit::Check)
                .chain(reslices)
                .collect();
            assert_eq!(ran, want, "every unit runs exactly once ({order:?})");
        });
        assert_eq!(orders, 5040);
    }

    #[test]
    fn a_unit_of_a_read_never_reported_waits_for_the_end_and_no_check_runs_unverified() {
        let p = plan();
        let mut s = Schedule::new(&p, true);
        let mut ready = Vec::new();
        s.start(&mut ready);
        assert!(ready.is_empty(), "every buffer here is written by reads");
        // Read 2 (the last third of parameter 0) is never reported: no check of parameter 0
        // and no re-slice into it runs before the end, and out-of-range reports are ignored.
        for i in [0, 1, 3, 4, 5, 6, 99] {
            s.read_done(i, &mut ready);
        }
        assert!(
            !ready
                .iter()
                .any(|u| matches!(u, Unit::Check(0..=2) | Unit::Reslice(0))),
            "{ready:?}"
        );
        ready.clear();
        s.all_done(&mut ready);
        ready.sort_by_key(|u| format!("{u:?}"));
        assert_eq!(
            ready,
            [
                Unit::Check(0),
                Unit::Check(1),
                Unit::Check(2),
                Unit::Reslice(0)
            ]
        );
        // Without verification only re-slices are scheduled.
        let mut s = Schedule::new(&p, false);
        ready.clear();
        s.all_done(&mut ready);
        assert!(ready.iter().all(|u| matches!(u, Unit::Reslice(_))));
    }

    fn permute(v: &mut Vec<usize>, k: usize, f: &mut impl FnMut(&[usize])) {
        if k == v.len() {
            return f(v);
        }
        for i in k..v.len() {
            v.swap(k, i);
            permute(v, k + 1, f);
            v.swap(k, i);
        }
    }
}
