//! Checks of what arrived, before the swap: the wire leg's byte count and throughput ceiling,
//! and installed bytes against the publishers' digests (whole offers, row chunks or column
//! blocks).

use rayon::prelude::*;
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::Instant;

use reshard_core::{
    CheckedPart, Dest, Digest, DigestCheck, Error, ErrorKind, HashPlan, HostBuffer, OwnerId,
    PartDigests, Plan, Result, SegmentFold, ShardTable, WireReport,
};

/// The wire-leg guards, before anything is re-sliced or installed: the backend must have moved
/// every `planned` byte, and no faster than the fabric ceiling `max_wire_gbps` (a faster leg
/// moved nothing real). Returns the wire rate in GB/s (10^9 bytes per second).
pub(super) fn guard_wire(
    wire: &WireReport,
    planned: u64,
    wire_t0: Instant,
    max_wire_gbps: Option<f64>,
    backend: &str,
) -> Result<f64> {
    // A backend that says it finished must have moved every planned byte; a short count
    // is a bug or a lie that digests would only catch when verification is on.
    if wire.bytes != planned {
        return Err(Error::new(
            ErrorKind::Transport,
            format!(
                "the transport reported {} bytes moved of the {planned} planned; refusing \
                 to install",
                wire.bytes
            ),
        )
        .with_backend(backend));
    }
    let wire_s = wire_t0.elapsed().as_secs_f64();
    let gbytes = if wire_s > 0.0 {
        wire.bytes as f64 / wire_s / 1e9
    } else {
        f64::INFINITY
    };
    if let Some(max) = max_wire_gbps {
        let gbits = gbytes * 8.0;
        if gbits > max {
            return Err(Error::new(
                ErrorKind::Guard,
                format!(
                    "wire leg moved {} bytes at {gbits:.1} Gbit/s, above the fabric ceiling \
                     of {max} Gbit/s: nothing real moved; refusing to install",
                    wire.bytes
                ),
            )
            .with_backend(backend));
        }
    }
    Ok(gbytes)
}

/// Folds a check's rows, each cut into the publisher's segments, as the publisher did
/// ([`SegmentFold`]); `None` when a row lies outside the buffer.
fn gather_fold(bytes: &[u8], c: &DigestCheck, fold: &mut SegmentFold) -> Option<()> {
    fold.clear();
    for i in 0..c.rows {
        let s = c.dst_offset.checked_add(i.checked_mul(c.row_stride)?)?;
        let s = usize::try_from(s).ok()?;
        let row = bytes.get(s..s.checked_add(usize::try_from(c.row_bytes).ok()?)?)?;
        fold.row(row, c.seg_bytes);
    }
    Some(())
}

/// Folds a check's rows like [`gather_fold`], taking each segment's hash from `hashes` (slots
/// from `first`, in fold order) where the backend stored it while copying, and hashing the
/// others from `bytes`; `None` when a row lies outside the buffer.
fn gather_hashed(
    bytes: &[u8],
    c: &DigestCheck,
    fold: &mut SegmentFold,
    hashes: &HashPlan,
    first: usize,
) -> Option<Checked> {
    fold.clear();
    let seg = usize::try_from(c.seg_bytes.max(1)).ok()?;
    let per_row = usize::try_from(super::hashes::segments_per_row(c)).ok()?;
    let mut out = Checked::default();
    for i in 0..c.rows {
        let s = c.dst_offset.checked_add(i.checked_mul(c.row_stride)?)?;
        let s = usize::try_from(s).ok()?;
        // Only borrowed: a segment whose hash was stored is not read again.
        let row = bytes.get(s..s.checked_add(usize::try_from(c.row_bytes).ok()?)?)?;
        if row.is_empty() {
            fold.segment(row);
            continue;
        }
        let base = first.checked_add(usize::try_from(i).ok()?.checked_mul(per_row)?)?;
        for (j, part) in row.chunks(seg).enumerate() {
            let len = part.len() as u64;
            match hashes.hash(base + j, len) {
                Some(h) => {
                    fold.segment_hash(h);
                    out.from_copy += len;
                }
                None => {
                    fold.segment(part);
                    out.hashed_here += len;
                }
            }
        }
    }
    Some(out)
}

/// Bytes of one check whose hashes were compared: hashed by the backend as it copied them, or
/// here from the destination.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Checked {
    pub(super) from_copy: u64,
    pub(super) hashed_here: u64,
}

/// The owner's bytes a digest check covers, for error messages: the whole offer, chunk `k`'s
/// rows, or column block `j`'s bytes of the offer's first row (the block takes the same
/// columns of every row).
fn checked_source_range(c: &DigestCheck, parts: Option<&PartDigests>) -> std::ops::Range<u64> {
    let (start, len) = match (c.part, parts) {
        // Saturating: only a message's byte range, from a grid `check_grid` already bounded.
        (CheckedPart::Chunk(k), Some(p)) => (
            u64::from(k)
                .saturating_mul(p.chunk_rows)
                .saturating_mul(c.row_bytes),
            c.bytes(),
        ),
        (CheckedPart::Block(j), _) => (u64::from(j).saturating_mul(c.seg_bytes), c.row_bytes),
        _ => (0, c.bytes()),
    };
    c.src_offset.saturating_add(start)..c.src_offset.saturating_add(start).saturating_add(len)
}

/// A published digest a check compares with.
#[derive(Clone, Copy)]
enum Want {
    Whole(Digest),
    Part(u64),
}

impl Want {
    /// The publisher's digest `c` compares with, if it sent one.
    fn of(c: &DigestCheck, digest: Option<Digest>, parts: Option<&PartDigests>) -> Option<Want> {
        match c.part {
            CheckedPart::Whole => digest.map(Want::Whole),
            CheckedPart::Chunk(k) => parts?.chunks.get(k as usize).copied().map(Want::Part),
            CheckedPart::Block(j) => parts?.blocks.get(j as usize).copied().map(Want::Part),
        }
    }

    /// Whether `fold` matches, with both digests' prefixes for the error message.
    fn compare(self, fold: &SegmentFold) -> (bool, String, String) {
        match self {
            Want::Whole(want) => {
                let got = fold.whole();
                (got == want, got.prefix(12), want.prefix(12))
            }
            Want::Part(want) => {
                let got = fold.part();
                (got == want, hex12(got), hex12(want))
            }
        }
    }
}

#[derive(Default)]
pub(super) struct Verdict {
    pub(super) passed: u64,
    /// Bytes whose segment hashes were compared (measured as they were hashed).
    pub(super) bytes: u64,
    /// Of those, bytes the backend hashed while copying them.
    pub(super) from_copy: u64,
    pub(super) without_digest: u64,
}

impl Verdict {
    /// Adds the outcome of one check: `Some(bytes)` hashed and matched, `None` no digest.
    pub(super) fn add(&mut self, checked: Option<Checked>) {
        match checked {
            Some(c) => {
                self.passed += 1;
                self.bytes += c.from_copy + c.hashed_here;
                self.from_copy += c.from_copy;
            }
            None => self.without_digest += 1,
        }
    }
}

/// This step's digests per offer, `(owner, region, offset)`, straight from the tables (the
/// cached merged view has old ones); owned, so a check can run on another thread while the
/// wire leg goes on.
pub(super) type Digests = FxHashMap<(OwnerId, u64, u64), (Option<Digest>, Option<PartDigests>)>;

/// The digests of `tables` (see [`Digests`]).
pub(super) fn digests_of(tables: &[ShardTable]) -> Digests {
    let mut offers = Digests::default();
    for t in tables {
        for o in &t.offers {
            offers.insert(
                (t.publisher.rank, o.location.region, o.location.offset),
                (o.digest, o.parts.clone()),
            );
        }
    }
    offers
}

/// Runs check `c` over `buf` (its destination): `Some(bytes)` when its bytes hash to the
/// publisher's digest, `None` when the publisher sent none, a `Verification` error naming
/// tensor, owner and byte range when they differ. With `hashes` (the plan and the check's
/// first slot), segment hashes the backend stored while copying are folded as they are.
pub(super) fn run_check(
    plan: &Plan,
    digests: &Digests,
    c: &DigestCheck,
    buf: &HostBuffer,
    fold: &mut SegmentFold,
    hashes: Option<(&HashPlan, usize)>,
) -> Result<Option<Checked>> {
    let offer = digests.get(&(c.owner, c.src_region, c.src_offset));
    let parts = offer.and_then(|(_, p)| p.as_ref());
    let Some(want) = Want::of(c, offer.and_then(|(d, _)| *d), parts) else {
        return Ok(None);
    };
    let bytes = buf.read();
    let checked = match hashes {
        Some((h, first)) => gather_hashed(&bytes, c, fold, h, first),
        None => gather_fold(&bytes, c, fold).map(|()| Checked {
            from_copy: 0,
            hashed_here: c.bytes(),
        }),
    }
    .ok_or_else(|| {
        Error::new(ErrorKind::Internal, "digest check outside its buffer")
            .with_tensor(plan.tensors[c.tensor as usize].clone())
    })?;
    let (ok, got, want) = want.compare(fold);
    if !ok {
        let what = match c.part {
            CheckedPart::Whole => "the offer".to_string(),
            CheckedPart::Chunk(k) => format!("row chunk {k} of the offer"),
            CheckedPart::Block(j) => format!("column block {j} of the offer"),
        };
        return Err(Error::new(
            ErrorKind::Verification,
            format!(
                "received bytes of {what} hash to {got}.. but the publisher's digest is \
                 {want}..; live weights left untouched"
            ),
        )
        .with_tensor(plan.tensors[c.tensor as usize].clone())
        .with_owner(c.owner)
        .with_range(checked_source_range(c, parts)));
    }
    Ok(Some(checked))
}

/// The destination buffer of `dst`.
pub(super) fn dest<'a>(
    dst: Dest,
    params: &'a [Arc<HostBuffer>],
    staging: &'a [Arc<HostBuffer>],
) -> &'a HostBuffer {
    match dst {
        Dest::Param(i) => &params[i as usize],
        Dest::Staging(i) => &staging[i as usize],
    }
}

/// Every check of `plan`, after the wire leg and the re-slice (the baseline arm's order).
pub(super) fn verify(
    plan: &Plan,
    tables: &[ShardTable],
    params: &[Arc<HostBuffer>],
    staging: &[Arc<HostBuffer>],
) -> Result<Verdict> {
    let digests = digests_of(tables);
    let results: Vec<Result<Option<Checked>>> = plan
        .checks
        .par_iter()
        .map_init(SegmentFold::new, |fold, c| {
            run_check(plan, &digests, c, dest(c.dst, params, staging), fold, None)
        })
        .collect();
    let mut v = Verdict::default();
    for r in results {
        v.add(r?);
    }
    Ok(v)
}

/// The first 12 hex characters of a 64-bit part digest, for error messages.
fn hex12(d: u64) -> String {
    format!("{d:016x}")[..12].to_string()
}
