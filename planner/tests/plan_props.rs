//! Property tests of the planner (issue §10, STYLE 8): random tensors, publisher splits with
//! replicas, and receiver layouts; every plan is executed on a byte simulator whose source bytes
//! are position-unique tags, and compared with a brute-force oracle. Publishers digest their
//! offers (whole, or with row chunks and column blocks on random grids), and the simulator runs
//! the plan's digest checks as a receiver does: every byte a plan reads must be checked exactly
//! once, and a changed source byte must fail a check (docs/design.md §6).

use std::collections::HashMap;

use proptest::prelude::*;
use reshard_core::{
    dedup, merge, CheckedPart, DType, DedupOptions, Dest, ErrorDetail, ErrorKind, MatrixView,
    MemoryKind, MergedTable, OfferLocation, ParamSpec, PartDigests, Plan, SegmentFold, ShardOffer,
    ShardTable, StagingKind, TensorBox, TensorSpec, WantedCopy, WantedLayout,
};
use reshard_planner::plan::{plan, PlanOptions};

const PUBLISHERS: u32 = 4;
const DTYPES: [DType; 3] = [DType::U8, DType::Bf16, DType::F32];
/// Source bytes outside every offer: reading one shows up as a wrong installed byte.
const GARBAGE: u64 = u64::MAX;

/// One wanted box, as raw numbers normalised against the tensor shape by [`build`].
#[derive(Debug, Clone)]
struct RawWant {
    lo: [u64; 3],
    len: [u64; 3],
    pad: [u64; 3],
    pos: [u64; 3],
    /// Place the box column-major (innermost destination stride is not 1).
    column_major: bool,
    /// Share the previous parameter (a fused destination) when dtypes agree.
    fuse: bool,
    /// Want the whole tensor (replicated parameters such as norms).
    whole: bool,
}

/// One tensor, how publishers split it, and what the receiver wants of it.
#[derive(Debug, Clone)]
struct RawTensor {
    shape: Vec<u64>,
    dtype: usize,
    split_dim: usize,
    cuts: Vec<u64>,
    replicas: u32,
    /// Replica 1 cuts one element later: partial overlaps dedup does not collapse.
    misaligned: bool,
    /// Drop one part from every replica: a coverage gap.
    drop_part: Option<usize>,
    /// Keep all parts of a replica at one owner (adjacent offers coalesce on the wire).
    one_owner_per_replica: bool,
    wants: Vec<RawWant>,
}

/// Which digests publishers send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Digests {
    None,
    /// The whole-offer digest only.
    Whole,
    /// Whole, and row chunks and column blocks on the standard grid.
    Standard,
    /// Whole, and parts on a grid cut from these raw numbers per offer (rarely aligned with
    /// what a receiver wants, so parts get staged).
    Grid(u64, u64),
}

#[derive(Debug, Clone)]
struct RawCase {
    tensors: Vec<RawTensor>,
    threshold: u64,
    gap: u64,
    two_regions: bool,
    digests: Digests,
    gather: bool,
}

fn want_strategy() -> impl Strategy<Value = RawWant> {
    (
        any::<[u64; 3]>(),
        any::<[u64; 3]>(),
        any::<[u64; 3]>(),
        any::<[u64; 3]>(),
        prop::bool::weighted(0.2),
        any::<bool>(),
        prop::bool::weighted(0.3),
    )
        .prop_map(|(lo, len, pad, pos, column_major, fuse, whole)| RawWant {
            lo,
            len,
            pad,
            pos,
            column_major,
            fuse,
            whole,
        })
}

fn tensor_strategy() -> impl Strategy<Value = RawTensor> {
    (
        prop::collection::vec(1u64..=7, 1..=3),
        0..DTYPES.len(),
        0usize..2,
        prop::collection::vec(any::<u64>(), 0..4),
        1u32..=3,
        prop::bool::weighted(0.15),
        prop::option::weighted(0.15, any::<usize>()),
        any::<bool>(),
        prop::collection::vec(want_strategy(), 1..=3),
    )
        .prop_map(
            |(shape, dtype, split_dim, cuts, replicas, misaligned, drop_part, one_owner, wants)| {
                RawTensor {
                    shape,
                    dtype,
                    split_dim,
                    cuts,
                    replicas,
                    misaligned,
                    drop_part,
                    one_owner_per_replica: one_owner,
                    wants,
                }
            },
        )
}

fn case_strategy() -> impl Strategy<Value = RawCase> {
    (
        prop::collection::vec(tensor_strategy(), 1..=3),
        0u64..12,
        prop_oneof![3 => Just(0u64), 1 => 1u64..4],
        prop::bool::weighted(0.3),
        prop_oneof![
            1 => Just(Digests::None),
            1 => Just(Digests::Whole),
            1 => Just(Digests::Standard),
            3 => any::<(u64, u64)>().prop_map(|(r, c)| Digests::Grid(r, c)),
        ],
        prop::bool::weighted(0.7),
    )
        .prop_map(
            |(tensors, threshold, gap, two_regions, digests, gather)| RawCase {
                tensors,
                threshold,
                gap,
                two_regions,
                digests,
                gather,
            },
        )
}

/// A built scenario: tables, the source memory they describe, a layout and its expected bytes.
struct Case {
    specs: Vec<TensorSpec>,
    tables: Vec<ShardTable>,
    /// (owner, region) -> byte tags; [`GARBAGE`] where no offer lives.
    memory: HashMap<(u32, u64), Vec<u64>>,
    layout: WantedLayout,
    /// Expected parameter bytes (0 where no copy writes).
    expected: Vec<Vec<u64>>,
    threshold: u64,
    digests: Digests,
    /// Plan with gather reads.
    gather: bool,
}

/// The tag of byte `b` of global element `g` of tensor `t`: unique across the whole case.
fn tag(t: usize, g: u64, elem: u64, b: u64) -> u64 {
    1 + ((t as u64) << 40) + g * elem + b
}

/// The byte value a tagged byte holds (what publishers digest and receivers hash).
fn byte_of(tag: u64) -> u8 {
    (tag.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

fn row_major(shape: &[u64]) -> Vec<u64> {
    reshard_core::layout::row_major_strides(shape)
}

/// Calls `f` with every multi-index of `bx`, in row-major order.
fn for_each_index(bx: &TensorBox, mut f: impl FnMut(&[u64])) {
    let r = bx.rank();
    let mut idx = bx.offset.clone();
    loop {
        f(&idx);
        let mut d = r;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < bx.end(d) {
                break;
            }
            idx[d] = bx.offset[d];
        }
    }
}

fn dot(a: &[u64], b: &[u64]) -> u64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Part boundaries along the split dim, from raw cut points.
fn boundaries(extent: u64, cuts: &[u64], shift: u64) -> Vec<u64> {
    let mut b: Vec<u64> = cuts
        .iter()
        .map(|c| (c % extent + shift).min(extent))
        .filter(|&c| c > 0 && c < extent)
        .collect();
    b.push(0);
    b.push(extent);
    b.sort_unstable();
    b.dedup();
    b
}

fn build(raw: &RawCase) -> Case {
    let mut specs = Vec::new();
    let mut tables: Vec<ShardTable> = (0..PUBLISHERS)
        .map(|r| ShardTable::new(r, format!("agent{r}"), 3))
        .collect();
    let mut cursor: HashMap<(u32, u64), u64> = HashMap::new();
    let mut placed: Vec<(u32, u64, u64, usize, TensorBox, usize)> = Vec::new();
    for (ti, rt) in raw.tensors.iter().enumerate() {
        let dtype = DTYPES[rt.dtype];
        let spec = TensorSpec::new(format!("t{ti}"), dtype, rt.shape.clone());
        let sd = rt.split_dim % rt.shape.len();
        for r in 0..rt.replicas {
            let shift = u64::from(rt.misaligned && r == 1);
            let b = boundaries(rt.shape[sd], &rt.cuts, shift);
            for (p, w) in b.windows(2).enumerate() {
                if rt.drop_part.is_some_and(|k| k % (b.len() - 1) == p) {
                    continue;
                }
                // Replicas always land on distinct owners (replicas < PUBLISHERS).
                let spread = if rt.one_owner_per_replica {
                    0
                } else {
                    p as u32
                };
                let owner = (spread + r + ti as u32) % PUBLISHERS;
                let region = if raw.two_regions { p as u64 % 2 } else { 0 };
                let mut offset = vec![0; rt.shape.len()];
                let mut extent = rt.shape.clone();
                offset[sd] = w[0];
                extent[sd] = w[1] - w[0];
                let bx = TensorBox::new(offset, extent);
                let at = cursor.entry((owner, region)).or_insert(0);
                *at += raw.gap;
                let t = &mut tables[owner as usize];
                if !t.tensors.contains(&spec) {
                    t.tensors.push(spec.clone());
                }
                t.offers.push(ShardOffer {
                    tensor: spec.name.clone(),
                    tensor_box: bx.clone(),
                    location: OfferLocation {
                        region,
                        offset: *at,
                        memory: MemoryKind::Dram,
                    },
                    digest: None,
                    parts: None,
                });
                placed.push((owner, region, *at, ti, bx.clone(), t.offers.len() - 1));
                *at += bx.elements() * dtype.size();
            }
        }
        specs.push(spec);
    }
    // Fill publisher memory with the tags of the elements each offer holds.
    let mut memory: HashMap<(u32, u64), Vec<u64>> = cursor
        .iter()
        .map(|(&k, &len)| (k, vec![GARBAGE; len as usize]))
        .collect();
    for (owner, region, at, ti, bx, _) in &placed {
        let spec = &specs[*ti];
        let elem = spec.dtype.size();
        let (gs, ls) = (row_major(&spec.shape), row_major(&bx.extent));
        let buf = memory.get_mut(&(*owner, *region)).unwrap();
        for_each_index(bx, |idx| {
            let g = dot(idx, &gs);
            let local: Vec<u64> = idx.iter().zip(&bx.offset).map(|(i, o)| i - o).collect();
            let l = dot(&local, &ls);
            for b in 0..elem {
                buf[(at + l * elem + b) as usize] = tag(*ti, g, elem, b);
            }
        });
    }
    // Digests of what each offer holds, as its publisher computes them.
    for (owner, region, at, ti, bx, oi) in &placed {
        let elem = specs[*ti].dtype.size();
        let len = bx.elements() * elem;
        let bytes: Vec<u8> = memory[&(*owner, *region)][*at as usize..(at + len) as usize]
            .iter()
            .map(|&t| byte_of(t))
            .collect();
        let v = MatrixView::of(&bx.extent);
        let (whole, parts) = match raw.digests {
            Digests::None => continue,
            Digests::Whole => (PartDigests::compute(&bytes, &bx.extent, elem).0, None),
            Digests::Standard => {
                let (w, p) = PartDigests::compute(&bytes, &bx.extent, elem);
                (w, Some(p))
            }
            Digests::Grid(r, c) => {
                // At most PARTS_PER_AXIS column blocks, as publishers cut rows (a finer grid
                // is refused: `PartDigests::check_grid`).
                let cols = (1 + c % v.cols).max(v.cols.div_ceil(reshard_core::PARTS_PER_AXIS));
                let rows = 1 + r % v.rows;
                let (w, p) = PartDigests::compute_on(&bytes, &bx.extent, elem, rows, cols);
                (w, Some(p))
            }
        };
        let o = &mut tables[*owner as usize].offers[*oi];
        o.digest = Some(whole);
        o.parts = parts;
    }
    // Receiver layout: each want a padded block, consecutive same-dtype wants sometimes fused.
    let mut params: Vec<ParamSpec> = Vec::new();
    let mut sizes: Vec<u64> = Vec::new();
    for (ti, rt) in raw.tensors.iter().enumerate() {
        let spec = &specs[ti];
        let rank = spec.shape.len();
        for w in &rt.wants {
            let mut lo = vec![0; rank];
            let mut ext = vec![0; rank];
            let mut padded = vec![0; rank];
            let mut pos = vec![0; rank];
            for d in 0..rank {
                if w.whole {
                    ext[d] = spec.shape[d];
                } else {
                    lo[d] = w.lo[d] % spec.shape[d];
                    ext[d] = 1 + w.len[d] % (spec.shape[d] - lo[d]);
                }
                padded[d] = ext[d] + w.pad[d] % 3;
                pos[d] = w.pos[d] % (padded[d] - ext[d] + 1);
            }
            let strides = if w.column_major && rank > 1 {
                let mut s = vec![1; rank];
                for d in 1..rank {
                    s[d] = s[d - 1] * padded[d - 1];
                }
                s
            } else {
                row_major(&padded)
            };
            let block: u64 = padded.iter().product();
            let fuse = w.fuse && params.last().is_some_and(|p| p.dtype == spec.dtype);
            if !fuse {
                params.push(ParamSpec {
                    name: format!("p{}", params.len()),
                    dtype: spec.dtype,
                    shape: vec![0],
                    copies: Vec::new(),
                });
                sizes.push(0);
            }
            let (p, base) = (params.last_mut().unwrap(), sizes.last_mut().unwrap());
            p.copies.push(WantedCopy {
                tensor: spec.name.clone(),
                src_box: TensorBox::new(lo, ext),
                dst_offset: spec.dtype.size() * (*base + dot(&pos, &strides)),
                dst_strides: strides,
            });
            *base += block;
            p.shape = vec![*base];
        }
    }
    let layout = WantedLayout {
        receiver_rank: 0,
        params,
    };
    let expected = expected_params(&specs, &layout);
    Case {
        specs,
        tables,
        memory,
        layout,
        expected,
        threshold: raw.threshold,
        digests: raw.digests,
        gather: raw.gather,
    }
}

/// The parameter bytes a correct install produces, built from the full tensors.
fn expected_params(specs: &[TensorSpec], layout: &WantedLayout) -> Vec<Vec<u64>> {
    layout
        .params
        .iter()
        .map(|p| {
            let mut buf = vec![0u64; p.bytes() as usize];
            for c in &p.copies {
                let ti = specs.iter().position(|s| s.name == c.tensor).unwrap();
                let elem = p.dtype.size();
                let gs = row_major(&specs[ti].shape);
                for_each_index(&c.src_box, |idx| {
                    let local: Vec<u64> = idx
                        .iter()
                        .zip(&c.src_box.offset)
                        .map(|(i, o)| i - o)
                        .collect();
                    let at = c.dst_offset + elem * dot(&local, &c.dst_strides);
                    for b in 0..elem {
                        buf[(at + b) as usize] = tag(ti, dot(idx, &gs), elem, b);
                    }
                });
            }
            buf
        })
        .collect()
}

/// What a correct planner must answer: the error kind of the first failing copy, if any.
/// The first copy of a tensor first needs the offers to tile the whole tensor (a hole
/// anywhere is missing coverage); within a copy, overlapping offers are reported before missing
/// coverage.
fn oracle(table: &MergedTable, layout: &WantedLayout, allow_overlap: bool) -> Option<ErrorKind> {
    let mut seen = std::collections::HashSet::new();
    for p in &layout.params {
        for c in &p.copies {
            // A tensor every part of which was dropped is absent from the table.
            let offers = table.get(&c.tensor).map_or(&[][..], |t| &t.offers);
            if let Some(t) = table.get(&c.tensor) {
                if seen.insert(c.tensor.clone()) {
                    let whole = TensorBox::new(vec![0; t.spec.shape.len()], t.spec.shape.clone());
                    let mut hole = false;
                    for_each_index(&whole, |idx| {
                        hole |= !offers.iter().any(|o| {
                            (0..idx.len()).all(|d| {
                                idx[d] >= o.tensor_box.offset[d] && idx[d] < o.tensor_box.end(d)
                            })
                        });
                    });
                    if hole {
                        return Some(ErrorKind::MissingCoverage);
                    }
                }
            }
            let (mut double, mut missing) = (false, false);
            for_each_index(&c.src_box, |idx| {
                let n = offers
                    .iter()
                    .filter(|o| {
                        (0..idx.len()).all(|d| {
                            let b = &o.tensor_box;
                            idx[d] >= b.offset[d] && idx[d] < b.end(d)
                        })
                    })
                    .count();
                double |= n > 1;
                missing |= n == 0;
            });
            if double && !allow_overlap {
                return Some(ErrorKind::OverlappingOffers);
            }
            if missing {
                return Some(ErrorKind::MissingCoverage);
            }
        }
    }
    None
}

/// Byte ranges `[start, end)` of all offers per (owner, region), adjacent ones merged.
fn offer_ranges(table: &MergedTable) -> HashMap<(u32, u64), Vec<(u64, u64)>> {
    let mut m: HashMap<(u32, u64), Vec<(u64, u64)>> = HashMap::new();
    for t in &table.tensors {
        let elem = t.spec.dtype.size();
        for o in &t.offers {
            let start = o.location.offset;
            m.entry((o.owner, o.location.region))
                .or_default()
                .push((start, start + o.tensor_box.elements() * elem));
        }
    }
    for v in m.values_mut() {
        v.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::new();
        for (s, e) in v.drain(..) {
            match merged.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        *v = merged;
    }
    m
}

/// Result of running a plan on the simulator.
struct Installed {
    params: Vec<Vec<u64>>,
    /// Times each parameter byte was written (reads and re-slices).
    writes: Vec<Vec<u32>>,
    /// Times each parameter byte was written by a wire read.
    read_writes: Vec<Vec<u32>>,
    staging: Vec<Vec<u64>>,
    /// Times each staging byte was written (by wire reads only).
    staged: Vec<Vec<u32>>,
}

/// Executes `plan`: reads from publisher memory into staging and parameters, then re-slices.
/// Fails (as a test case error) on any access outside an offer, a staging buffer or a parameter.
fn execute(case: &Case, table: &MergedTable, plan: &Plan) -> Result<Installed, TestCaseError> {
    let ranges = offer_ranges(table);
    let mut params: Vec<Vec<u64>> = plan
        .params
        .iter()
        .map(|p| vec![0; p.bytes as usize])
        .collect();
    let mut writes: Vec<Vec<u32>> = plan
        .params
        .iter()
        .map(|p| vec![0; p.bytes as usize])
        .collect();
    let mut staging: Vec<Vec<u64>> = plan
        .staging
        .iter()
        .map(|s| vec![0; s.bytes as usize])
        .collect();
    let mut staged: Vec<Vec<u32>> = plan
        .staging
        .iter()
        .map(|s| vec![0; s.bytes as usize])
        .collect();
    for r in &plan.reads {
        // A gather's rows, one after another; a plain read is one row.
        let mut src = Vec::with_capacity(r.len as usize);
        for (s, len) in src_rows(r) {
            let e = s + len;
            let inside = ranges
                .get(&(r.owner, r.src_region))
                .is_some_and(|v| v.iter().any(|&(a, b)| a <= s && e <= b));
            prop_assert!(inside, "read {r:?} leaves the offers of its owner");
            src.extend_from_slice(&case.memory[&(r.owner, r.src_region)][s as usize..e as usize]);
        }
        let src = &src[..];
        let (buf, count) = match r.dst {
            Dest::Param(i) => (&mut params[i as usize], &mut writes[i as usize]),
            Dest::Staging(i) => (&mut staging[i as usize], &mut staged[i as usize]),
        };
        let d = r.dst_offset as usize;
        prop_assert!(
            d + src.len() <= buf.len(),
            "read {r:?} overruns its destination"
        );
        buf[d..d + src.len()].copy_from_slice(src);
        count[d..d + src.len()].iter_mut().for_each(|c| *c += 1);
    }
    let read_writes = writes.clone();
    for c in staged.iter().flatten() {
        prop_assert!(*c <= 1, "a staging byte was written twice");
    }
    for rs in &plan.reslices {
        let bx = TensorBox::new(vec![0; rs.extent.len()], rs.extent.clone());
        let (src, filled) = (&staging[rs.staging as usize], &staged[rs.staging as usize]);
        let mut err = None;
        for_each_index(&bx, |idx| {
            let s = (rs.src_offset + rs.elem * dot(idx, &rs.src_strides)) as usize;
            let d = (rs.dst_offset + rs.elem * dot(idx, &rs.dst_strides)) as usize;
            for b in 0..rs.elem as usize {
                if s + b >= src.len() || filled[s + b] == 0 {
                    err.get_or_insert(format!("re-slice {rs:?} reads an unfilled staging byte"));
                    return;
                }
                params[rs.param as usize][d + b] = src[s + b];
                writes[rs.param as usize][d + b] += 1;
            }
        });
        if let Some(e) = err {
            return Err(TestCaseError::fail(e));
        }
    }
    Ok(Installed {
        params,
        writes,
        read_writes,
        staging,
        staged,
    })
}

/// What running a plan's digest checks found.
struct Checked {
    /// Checks whose fold differs from the publisher's digest.
    failed: usize,
    /// Times each parameter byte was hashed by a check.
    params: Vec<Vec<u32>>,
    /// Times each staging byte was hashed by a check.
    staging: Vec<Vec<u32>>,
}

/// Runs `plan`'s digest checks over what `got` installed, as a receiver does: each check's rows
/// cut into segments and folded, compared with its offer's digest in the case's tables. The
/// byte of source tag `flip` (if any) is changed on its way to the receiver.
fn run_checks(
    case: &Case,
    plan: &Plan,
    got: &Installed,
    flip: Option<u64>,
) -> Result<Checked, TestCaseError> {
    let offers: HashMap<(u32, u64, u64), &ShardOffer> = case
        .tables
        .iter()
        .flat_map(|t| t.offers.iter().map(move |o| (t.publisher.rank, o)))
        .map(|(r, o)| ((r, o.location.region, o.location.offset), o))
        .collect();
    let mut out = Checked {
        failed: 0,
        params: got.params.iter().map(|p| vec![0; p.len()]).collect(),
        staging: got.staging.iter().map(|s| vec![0; s.len()]).collect(),
    };
    let mut fold = SegmentFold::new();
    for c in &plan.checks {
        let o = offers[&(c.owner, c.src_region, c.src_offset)];
        let (tags, count) = match c.dst {
            Dest::Param(i) => (&got.params[i as usize], &mut out.params[i as usize]),
            Dest::Staging(i) => (&got.staging[i as usize], &mut out.staging[i as usize]),
        };
        fold.clear();
        for r in 0..c.rows {
            let s = (c.dst_offset + r * c.row_stride) as usize;
            let e = s + c.row_bytes as usize;
            prop_assert!(e <= tags.len(), "check {c:?} leaves its buffer");
            let row: Vec<u8> = tags[s..e]
                .iter()
                .map(|&t| byte_of(t) ^ u8::from(Some(t) == flip))
                .collect();
            fold.row(&row, c.seg_bytes);
            count[s..e].iter_mut().for_each(|n| *n += 1);
        }
        let parts = o.parts.as_ref();
        let ok = match c.part {
            CheckedPart::Whole => Some(fold.whole()) == o.digest,
            CheckedPart::Chunk(k) => {
                parts.and_then(|p| p.chunks.get(k as usize)) == Some(&fold.part())
            }
            CheckedPart::Block(j) => {
                parts.and_then(|p| p.blocks.get(j as usize)) == Some(&fold.part())
            }
        };
        out.failed += usize::from(!ok);
    }
    Ok(out)
}

/// With digests, every byte a wire read writes (into a parameter or staging) is hashed by
/// exactly one check, every check passes, checked bytes equal wire bytes, and a changed byte
/// at the source of any read fails a check. Without digests there are no checks.
fn checks_cover_every_read_byte(
    case: &Case,
    plan: &Plan,
    got: &Installed,
    pick: (u64, u64),
) -> Result<(), TestCaseError> {
    if case.digests == Digests::None {
        prop_assert!(plan.checks.is_empty());
        return Ok(());
    }
    let checked = run_checks(case, plan, got, None)?;
    prop_assert_eq!(checked.failed, 0, "a check fails on a correct install");
    for (pi, (c, w)) in checked.params.iter().zip(&got.read_writes).enumerate() {
        for (b, (&c, &w)) in c.iter().zip(w).enumerate() {
            prop_assert_eq!(
                c,
                w,
                "param {} byte {}: checked {} times, read {} times",
                pi,
                b,
                c,
                w
            );
        }
    }
    for (si, (c, w)) in checked.staging.iter().zip(&got.staged).enumerate() {
        for (b, (&c, &w)) in c.iter().zip(w).enumerate() {
            prop_assert_eq!(
                c,
                w,
                "staging {} byte {}: checked {} times, read {} times",
                si,
                b,
                c,
                w
            );
        }
    }
    prop_assert_eq!(plan.stats.checked_bytes, plan.stats.wire_bytes);
    if let Some(r) = plan
        .reads
        .get((pick.0 % plan.reads.len().max(1) as u64) as usize)
    {
        let x = pick.1 % r.len;
        let at = match r.src_rows {
            Some(g) => r.src_offset + x / g.row_bytes * g.pitch + x % g.row_bytes,
            None => r.src_offset + x,
        };
        let tag = case.memory[&(r.owner, r.src_region)][at as usize];
        let bad = run_checks(case, plan, got, Some(tag))?;
        prop_assert!(
            bad.failed > 0,
            "a changed byte under read {:?} passed every check",
            r
        );
    }
    Ok(())
}

/// The source runs of read `r`, `(offset, bytes)`: its rows for a gather, else the whole read.
fn src_rows(r: &reshard_core::PlannedRead) -> Vec<(u64, u64)> {
    match r.src_rows {
        Some(g) => (0..r.len / g.row_bytes)
            .map(|i| (r.src_offset + i * g.pitch, g.row_bytes))
            .collect(),
        None => vec![(r.src_offset, r.len)],
    }
}

fn options(case: &Case, allow_overlap: bool) -> PlanOptions {
    PlanOptions {
        full_pull_threshold: case.threshold,
        allow_overlap,
        gather_reads: case.gather,
        gather_min_row_bytes: 0,
    }
}

fn deduped(case: &Case) -> MergedTable {
    dedup(&merge(&case.tables).unwrap(), DedupOptions::default())
        .unwrap()
        .0
}

/// Checks a missing-coverage error names a box of a wanted tensor, outside every offer.
fn check_missing(
    case: &Case,
    table: &MergedTable,
    e: &reshard_core::Error,
) -> Result<(), TestCaseError> {
    let Some(ErrorDetail::MissingCoverage { tensor, missing }) = e.detail() else {
        return Err(TestCaseError::fail(format!("no missing box in {e}")));
    };
    prop_assert_eq!(e.context().tensor.as_ref(), Some(tensor));
    let wanted = case
        .layout
        .params
        .iter()
        .flat_map(|p| &p.copies)
        .any(|c| &c.tensor == tensor);
    prop_assert!(wanted, "missing box {} is not of a wanted tensor", missing);
    if let Some(t) = table.get(tensor) {
        let whole = TensorBox::new(vec![0; t.spec.shape.len()], t.spec.shape.clone());
        prop_assert!(
            whole.contains(missing),
            "missing box {} is outside the tensor",
            missing
        );
    }
    let offers = table.get(tensor).map_or(&[][..], |t| &t.offers);
    prop_assert!(offers
        .iter()
        .all(|o| o.tensor_box.intersect(missing).is_none()));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Every wanted byte lands exactly right and is written exactly once; nothing else is
    /// written; every read stays inside offers; or the planner fails as the oracle says.
    #[test]
    fn dedup_plan_installs_every_wanted_byte_exactly_once(raw in case_strategy()) {
        let case = build(&raw);
        let table = deduped(&case);
        let result = plan(&table, &case.layout, &options(&case, false));
        match (oracle(&table, &case.layout, false), result) {
            (None, Ok(p)) => {
                let got = execute(&case, &table, &p)?;
                prop_assert_eq!(&got.params, &case.expected);
                for (pi, (w, e)) in got.writes.iter().zip(&case.expected).enumerate() {
                    for (b, (&n, &x)) in w.iter().zip(e).enumerate() {
                        prop_assert_eq!(n, u32::from(x != 0), "param {} byte {}", pi, b);
                    }
                }
            }
            (Some(kind), Err(e)) => {
                prop_assert_eq!(e.kind(), kind, "{}", e);
                if kind == ErrorKind::MissingCoverage {
                    check_missing(&case, &table, &e)?;
                }
            }
            (want, got) => {
                return Err(TestCaseError::fail(format!(
                    "oracle expects {want:?}, planner gave {:?}", got.map(|p| p.stats)
                )));
            }
        }
    }

    /// Every installed byte is under a digest check (docs/design.md §6): each byte a wire read
    /// brings, straight into a parameter or into staging that re-slices from it, is hashed by
    /// exactly one check against the publisher's digests; all pass on a correct install, and a
    /// byte changed at the source fails one. Checked bytes equal wire bytes.
    #[test]
    fn every_installed_byte_is_checked(raw in case_strategy(), pick in any::<(u64, u64)>()) {
        let case = build(&raw);
        let table = deduped(&case);
        if let Ok(p) = plan(&table, &case.layout, &options(&case, false)) {
            let got = execute(&case, &table, &p)?;
            prop_assert_eq!(&got.params, &case.expected);
            checks_cover_every_read_byte(&case, &p, &got, pick)?;
        }
    }

    /// The benchmark-only no-dedup arm reads every replica and installs the same bytes as the
    /// deduplicated plan.
    #[test]
    fn no_dedup_arm_installs_identical_bytes(raw in case_strategy()) {
        let case = build(&raw);
        let all = merge(&case.tables).unwrap();
        let result = plan(&all, &case.layout, &options(&case, true));
        match (oracle(&all, &case.layout, true), result) {
            (None, Ok(p)) => {
                let got = execute(&case, &all, &p)?;
                prop_assert_eq!(&got.params, &case.expected);
                let table = deduped(&case);
                if let Ok(d) = plan(&table, &case.layout, &options(&case, false)) {
                    prop_assert_eq!(&execute(&case, &table, &d)?.params, &got.params);
                }
            }
            (Some(kind), Err(e)) => {
                prop_assert_eq!(e.kind(), kind, "{}", e);
                check_missing(&case, &all, &e)?;
            }
            (want, got) => {
                return Err(TestCaseError::fail(format!(
                    "oracle expects {want:?}, planner gave {:?}", got.map(|p| p.stats)
                )));
            }
        }
    }

    /// Same input, same plan and fingerprint, whatever order the tables arrive in.
    #[test]
    fn same_input_gives_the_same_fingerprint(raw in case_strategy()) {
        let case = build(&raw);
        let mut reversed = case.tables.clone();
        reversed.reverse();
        let a_table = deduped(&case);
        let b_table = dedup(&merge(&reversed).unwrap(), DedupOptions::default()).unwrap().0;
        for allow_overlap in [false, true] {
            let opts = options(&case, allow_overlap);
            let a = plan(&a_table, &case.layout, &opts);
            let b = plan(&b_table, &case.layout, &opts);
            match (a, b) {
                (Ok(a), Ok(b)) => {
                    prop_assert_eq!(a.fingerprint, b.fingerprint);
                    prop_assert_eq!(a.fingerprint, a.compute_fingerprint());
                    prop_assert_eq!(&a, &b);
                }
                (Err(a), Err(b)) => prop_assert_eq!(a.kind(), b.kind()),
                (a, b) => {
                    return Err(TestCaseError::fail(format!(
                        "runs disagree: {:?} vs {:?}", a.map(|p| p.stats), b.map(|p| p.stats)
                    )));
                }
            }
        }
    }

    /// Statistics agree with the plan they describe.
    #[test]
    fn statistics_describe_the_plan(raw in case_strategy()) {
        let case = build(&raw);
        let table = deduped(&case);
        let Ok(p) = plan(&table, &case.layout, &options(&case, false)) else {
            return Ok(());
        };
        let s = p.stats;
        prop_assert_eq!(s.copies, case.layout.copies() as u64);
        prop_assert_eq!(s.coalesced_reads, p.reads.len() as u64);
        prop_assert!(s.coalesced_reads <= s.reads);
        prop_assert_eq!(s.wire_bytes, p.reads.iter().map(|r| r.len).sum::<u64>());
        prop_assert_eq!(s.descriptors_saved, s.exact_descriptors.saturating_sub(s.reads));
        prop_assert_eq!(
            s.full_pull_sources + s.staged_offers + s.staged_parts,
            p.staging.len() as u64
        );
        let kinds = |k: StagingKind| p.staging.iter().filter(|s| s.kind == k).count() as u64;
        prop_assert_eq!(
            (s.full_pull_sources, s.staged_offers, s.staged_parts),
            (kinds(StagingKind::FullPull), kinds(StagingKind::Offer), kinds(StagingKind::Part))
        );
        prop_assert_eq!(s.param_bytes, case.layout.bytes());
        let written: u64 = case.expected.iter().flatten().filter(|&&x| x != 0).count() as u64;
        prop_assert_eq!(s.written_bytes, written);
        // Exact reads carry each wanted byte once; staging reads carry whole offers or parts.
        let resliced: u64 = p.reslices.iter().map(|r| r.bytes()).sum();
        let staged: u64 = p
            .reads
            .iter()
            .filter(|r| matches!(r.dst, Dest::Staging(_)))
            .map(|r| r.len)
            .sum();
        prop_assert_eq!(s.wire_bytes, written - resliced + staged);
        // Extra bytes: what full pulls, and staged offers and parts, read beyond what is
        // re-sliced out of them.
        let extra = |full: bool| {
            let of = |i: u32| (p.staging[i as usize].kind == StagingKind::FullPull) == full;
            let pulled: u64 = p
                .reads
                .iter()
                .filter(|r| matches!(r.dst, Dest::Staging(i) if of(i)))
                .map(|r| r.len)
                .sum();
            let resliced: u64 = p.reslices.iter().filter(|r| of(r.staging)).map(|r| r.bytes()).sum();
            pulled.saturating_sub(resliced)
        };
        prop_assert_eq!(s.extra_wire_bytes, extra(true) + extra(false));
        prop_assert_eq!(s.checked_bytes, p.checks.iter().map(|c| c.bytes()).sum::<u64>());
        prop_assert!(p.tensors.iter().all(|t| case.specs.iter().any(|s| &s.name == t)));
        let mut owners: Vec<u32> = p.reads.iter().map(|r| r.owner).collect();
        owners.sort_unstable();
        owners.dedup();
        prop_assert_eq!(s.owners, owners.len() as u64);
    }
}
