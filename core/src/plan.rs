//! The fused range plan: pure data produced by the planner and executed by the runtime on any
//! backend. Its fingerprint proves two backends ran the same plan.

use serde::Serialize;

use crate::digest::Fingerprinter;
use crate::model::OwnerId;

/// Where a read lands on the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Dest {
    /// Straight into parameter `i` of the layout.
    Param(u32),
    /// Into staging buffer `i` (a full pull, re-sliced afterwards).
    Staging(u32),
}

/// One wire read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct PlannedRead {
    /// Publisher holding the bytes.
    pub owner: OwnerId,
    /// Owner's region id.
    pub src_region: u64,
    /// Byte offset in the owner's region.
    pub src_offset: u64,
    /// Bytes.
    pub len: u64,
    /// Destination buffer.
    pub dst: Dest,
    /// Byte offset in the destination buffer.
    pub dst_offset: u64,
    /// Index into [`Plan::tensors`] of the (first) tensor the bytes belong to.
    pub tensor: u32,
    /// `Some`: a gather read, whose `len` bytes are rows at a pitch at the source, landing
    /// contiguously (docs/design.md §4, "Gather reads"); `None`: contiguous at the source.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub src_rows: Option<crate::transport::RemoteRows>,
}

impl PlannedRead {
    /// Bytes of the owner's region the read spans from `src_offset` (`len` unless a gather).
    pub fn src_span(&self) -> u64 {
        self.src_rows
            .and_then(|g| g.span(self.len))
            .unwrap_or(self.len)
    }
}

/// A staging buffer holding one box of a tensor, row-major: a dim-0 row range (full pull), one
/// whole offer (a staged offer) or a part of one offer that a receiver could not check where
/// it lands (a staged part: whole row chunks or column blocks around what it wants).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StagingBuffer {
    /// Index into [`Plan::tensors`].
    pub tensor: u32,
    /// The box of the tensor it holds.
    pub tensor_box: crate::model::TensorBox,
    /// What it holds.
    pub kind: StagingKind,
    /// Size in bytes.
    pub bytes: u64,
}

/// What a [`StagingBuffer`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum StagingKind {
    /// A dim-0 row range of a tensor, every offer in it read whole (a full pull).
    FullPull,
    /// One whole offer (a staged offer).
    Offer,
    /// Whole row chunks or column blocks of one offer (a staged part).
    Part,
}

/// A local strided copy from a staging buffer into a parameter (the re-slice of a full pull).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Reslice {
    /// Source staging buffer.
    pub staging: u32,
    /// Byte offset in staging of the box's first element.
    pub src_offset: u64,
    /// Element strides in staging.
    pub src_strides: Vec<u64>,
    /// Box extent.
    pub extent: Vec<u64>,
    /// Element size.
    pub elem: u64,
    /// Destination parameter.
    pub param: u32,
    /// Byte offset in the parameter.
    pub dst_offset: u64,
    /// Element strides in the parameter.
    pub dst_strides: Vec<u64>,
    /// Index into [`Plan::tensors`].
    pub tensor: u32,
}

impl Reslice {
    /// Bytes this re-slice writes.
    pub fn bytes(&self) -> u64 {
        self.extent.iter().product::<u64>() * self.elem
    }
}

/// Which of an offer's published digests a [`DigestCheck`] compares with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum CheckedPart {
    /// The whole-offer digest.
    Whole,
    /// Row chunk `k` ([`crate::PartDigests::chunks`]).
    Chunk(u32),
    /// Column block `j` ([`crate::PartDigests::blocks`]).
    Block(u32),
}

/// Bytes of an offer (whole, one row chunk or one column block) that all land in one receiver
/// buffer as equally spaced rows, so the receiver can gather and check them against the
/// publisher's digest: each row is cut into segments of `seg_bytes` (the publisher's column
/// blocks; the last one of a row may be shorter) and the segment hashes are folded in order
/// ([`crate::SegmentFold`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct DigestCheck {
    /// Index into [`Plan::tensors`].
    pub tensor: u32,
    /// Owner of the offer.
    pub owner: OwnerId,
    /// Offer's region at its owner.
    pub src_region: u64,
    /// Offer's byte offset in that region.
    pub src_offset: u64,
    /// The digest compared with.
    pub part: CheckedPart,
    /// Where the bytes land.
    pub dst: Dest,
    /// Byte offset of the first row there.
    pub dst_offset: u64,
    /// Number of rows.
    pub rows: u64,
    /// Bytes per row (contiguous in the destination).
    pub row_bytes: u64,
    /// Bytes from one row's start to the next in the destination.
    pub row_stride: u64,
    /// Bytes per segment: one column block of one row.
    pub seg_bytes: u64,
}

impl DigestCheck {
    /// Bytes this check covers.
    pub fn bytes(&self) -> u64 {
        self.rows * self.row_bytes
    }
}

/// A receiver parameter as the plan sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlanParam {
    /// Parameter name.
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
}

/// Plan statistics (docs/design.md §4), the figures `reshard plan` prints.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PlanStats {
    /// Wanted copies (source boxes).
    pub copies: u64,
    /// Reads (descriptors), before coalescing across source tensors.
    pub reads: u64,
    /// Reads after merging adjacent reads across tensors; what goes on the wire.
    pub coalesced_reads: u64,
    /// Bytes moved.
    pub wire_bytes: u64,
    /// Descriptors an all-exact plan (no full pulls) would need.
    pub exact_descriptors: u64,
    /// `exact_descriptors - reads`.
    pub descriptors_saved: u64,
    /// Bytes pulled by full pulls and staged parts beyond what the copies need.
    pub extra_wire_bytes: u64,
    /// Source tensors pulled whole (dim-0 full pulls) and re-sliced locally.
    pub full_pull_sources: u64,
    /// Offers read whole into staging and re-sliced, because they lie inside a copy but would
    /// land as too many runs (no extra wire bytes).
    pub staged_offers: u64,
    /// Parts of offers (whole row chunks or column blocks) read into staging because what a
    /// copy wants of them could not be checked where it lands; their extra bytes count in
    /// `extra_wire_bytes`.
    pub staged_parts: u64,
    /// Distinct owners (sessions) read from.
    pub owners: u64,
    /// Parameter bytes the plan writes.
    pub written_bytes: u64,
    /// Parameter bytes of the layout.
    pub param_bytes: u64,
    /// Bytes covered by digest checks.
    pub checked_bytes: u64,
}

/// A complete fused range plan for one receiver.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// Tensor names referenced by reads, re-slices and checks.
    pub tensors: Vec<String>,
    /// Receiver parameters, in layout order.
    pub params: Vec<PlanParam>,
    /// Staging buffers for full pulls.
    pub staging: Vec<StagingBuffer>,
    /// Wire reads (coalesced), grouped by owner.
    pub reads: Vec<PlannedRead>,
    /// Local re-slices, in plan order.
    pub reslices: Vec<Reslice>,
    /// True when no two re-slices write the same parameter byte (one parallel pass is safe).
    pub reslice_disjoint: bool,
    /// Digest checks.
    pub checks: Vec<DigestCheck>,
    /// Statistics.
    pub stats: PlanStats,
    /// Fingerprint of reads, staging and re-slices.
    pub fingerprint: u64,
}

impl Plan {
    /// Computes the fingerprint of the executable content (reads, staging, re-slices).
    pub fn compute_fingerprint(&self) -> u64 {
        let mut f = Fingerprinter::new();
        f.u64(self.reads.len() as u64);
        for r in &self.reads {
            fingerprint_read(&mut f, r);
        }
        f.u64(self.staging.len() as u64);
        for s in &self.staging {
            f.u64(s.tensor as u64).u64(s.bytes).u64(s.kind as u64);
            for d in 0..s.tensor_box.rank() {
                f.u64(s.tensor_box.offset[d]).u64(s.tensor_box.extent[d]);
            }
        }
        f.u64(self.reslices.len() as u64);
        for r in &self.reslices {
            f.u64(r.staging as u64)
                .u64(r.src_offset)
                .u64(r.param as u64)
                .u64(r.dst_offset)
                .u64(r.elem);
            for d in 0..r.extent.len() {
                f.u64(r.extent[d])
                    .u64(r.src_strides[d])
                    .u64(r.dst_strides[d]);
            }
        }
        f.finish()
    }

    /// Fingerprint of a read sequence alone, as a recording transport wrapper sees it.
    /// A gather's rows count: `(owner, region, offset, len, rows)`.
    pub fn reads_fingerprint(
        reads: impl IntoIterator<Item = (OwnerId, u64, u64, u64, Option<crate::transport::RemoteRows>)>,
    ) -> u64 {
        let mut f = Fingerprinter::new();
        for (owner, region, offset, len, rows) in reads {
            f.u64(owner as u64).u64(region).u64(offset).u64(len);
            if let Some(g) = rows {
                f.u64(g.row_bytes).u64(g.pitch);
            }
        }
        f.finish()
    }
}

fn fingerprint_read(f: &mut Fingerprinter, r: &PlannedRead) {
    let (kind, idx) = match r.dst {
        Dest::Param(i) => (0, i),
        Dest::Staging(i) => (1, i),
    };
    f.u64(r.owner as u64)
        .u64(r.src_region)
        .u64(r.src_offset)
        .u64(r.len)
        .u64(kind)
        .u64(idx as u64)
        .u64(r.dst_offset);
    if let Some(g) = r.src_rows {
        f.u64(g.row_bytes).u64(g.pitch);
    }
}
