//! The shard-table data model: dtypes, tensor specs, boxes, offers and tables (docs/design.md §2).

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

use crate::digest::Digest;
use crate::error::{Error, ErrorKind, Result};

/// A publisher rank; the owner of offers and the peer a receiver reads from.
pub type OwnerId = u32;

/// Element type of a tensor; byte-exact transport never converts between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
    /// IEEE double.
    F64,
    /// 8-bit float, 4 exponent / 3 mantissa bits.
    F8E4m3,
    /// 8-bit float, 5 exponent / 2 mantissa bits.
    F8E5m2,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 8-bit integer.
    U8,
    /// Boolean, one byte.
    Bool,
}

impl DType {
    /// Every dtype, in wire-code order.
    pub const ALL: [DType; 12] = [
        DType::Bf16,
        DType::F16,
        DType::F32,
        DType::F64,
        DType::F8E4m3,
        DType::F8E5m2,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::Bool,
    ];

    /// Size of one element in bytes.
    pub fn size(self) -> u64 {
        match self {
            DType::F8E4m3 | DType::F8E5m2 | DType::I8 | DType::U8 | DType::Bool => 1,
            DType::Bf16 | DType::F16 | DType::I16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    /// Canonical lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F8E4m3 => "f8_e4m3",
            DType::F8E5m2 => "f8_e5m2",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::Bool => "bool",
        }
    }

    /// Stable one-byte code used by the binary encoding.
    pub fn code(self) -> u8 {
        DType::ALL.iter().position(|d| *d == self).unwrap_or(0) as u8
    }

    /// Inverse of [`DType::code`].
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(code as usize).copied()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        DType::ALL
            .iter()
            .copied()
            .find(|d| d.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = DType::ALL.iter().map(|d| d.name()).collect();
                Error::new(
                    ErrorKind::Decode,
                    format!("unknown dtype {s:?}; known: {}", names.join(", ")),
                )
            })
    }
}

/// A tensor's global identity: HF-canonical name, dtype and global shape.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Globally unique, HF-canonical name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape (row-major).
    pub shape: Vec<u64>,
}

impl TensorSpec {
    /// A spec from its parts.
    pub fn new(name: impl Into<String>, dtype: DType, shape: Vec<u64>) -> Self {
        TensorSpec {
            name: name.into(),
            dtype,
            shape,
        }
    }

    /// Number of elements, or an error naming the tensor when it overflows u64.
    pub fn checked_elements(&self) -> Result<u64> {
        checked_product(&self.shape).ok_or_else(|| {
            Error::new(ErrorKind::InvalidTable, "element count overflows u64")
                .with_tensor(&self.name)
        })
    }

    /// Size in bytes, or an error naming the tensor when it overflows u64.
    pub fn checked_bytes(&self) -> Result<u64> {
        self.checked_elements()?
            .checked_mul(self.dtype.size())
            .ok_or_else(|| {
                Error::new(ErrorKind::InvalidTable, "byte size overflows u64")
                    .with_tensor(&self.name)
            })
    }

    /// Size in bytes (call only on validated specs).
    pub fn bytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.size()
    }

    /// The box covering the whole tensor.
    pub fn full_box(&self) -> TensorBox {
        TensorBox::new(vec![0; self.shape.len()], self.shape.clone())
    }

    /// Checks the shape: at least one dim, no zero extent, sizes fit in u64.
    pub fn validate(&self) -> Result<()> {
        if self.name.is_empty() {
            return Err(Error::new(ErrorKind::InvalidTable, "empty tensor name"));
        }
        if self.shape.is_empty() {
            return Err(
                Error::new(ErrorKind::InvalidTable, "tensor has no dimensions")
                    .with_tensor(&self.name),
            );
        }
        if let Some(d) = self.shape.iter().position(|&e| e == 0) {
            return Err(Error::new(
                ErrorKind::InvalidTable,
                format!("dimension {d} of the global shape has zero extent"),
            )
            .with_tensor(&self.name));
        }
        self.checked_bytes().map(|_| ())
    }
}

fn checked_product(v: &[u64]) -> Option<u64> {
    v.iter().try_fold(1u64, |acc, &x| acc.checked_mul(x))
}

/// A hyper-rectangle of a tensor: per-dimension offset and extent in global coordinates.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorBox {
    /// Start index per dimension.
    pub offset: Vec<u64>,
    /// Length per dimension.
    pub extent: Vec<u64>,
}

impl TensorBox {
    /// A box from offsets and extents (same rank assumed; see [`TensorBox::validate_in`]).
    pub fn new(offset: Vec<u64>, extent: Vec<u64>) -> Self {
        TensorBox { offset, extent }
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.extent.len()
    }

    /// Number of elements (call only on validated boxes).
    pub fn elements(&self) -> u64 {
        self.extent.iter().product()
    }

    /// Exclusive end along dimension `d`.
    pub fn end(&self, d: usize) -> u64 {
        self.offset[d] + self.extent[d]
    }

    /// The intersection with `other`, or `None` when they do not overlap.
    pub fn intersect(&self, other: &TensorBox) -> Option<TensorBox> {
        if self.rank() != other.rank() {
            return None;
        }
        let mut offset = Vec::with_capacity(self.rank());
        let mut extent = Vec::with_capacity(self.rank());
        for d in 0..self.rank() {
            let lo = self.offset[d].max(other.offset[d]);
            let hi = self.end(d).min(other.end(d));
            if hi <= lo {
                return None;
            }
            offset.push(lo);
            extent.push(hi - lo);
        }
        Some(TensorBox { offset, extent })
    }

    /// True when `other` lies entirely inside `self`.
    pub fn contains(&self, other: &TensorBox) -> bool {
        self.rank() == other.rank()
            && (0..self.rank())
                .all(|d| other.offset[d] >= self.offset[d] && other.end(d) <= self.end(d))
    }

    /// Checks the box against a global shape: same rank, non-zero extents, inside the shape.
    pub fn validate_in(&self, spec: &TensorSpec) -> Result<()> {
        let err = |msg: String| Error::new(ErrorKind::InvalidTable, msg).with_tensor(&spec.name);
        if self.offset.len() != self.extent.len() {
            return Err(err(format!(
                "box has {} offsets but {} extents",
                self.offset.len(),
                self.extent.len()
            )));
        }
        if self.rank() != spec.shape.len() {
            return Err(err(format!(
                "box rank {} does not match tensor rank {} (shape {:?})",
                self.rank(),
                spec.shape.len(),
                spec.shape
            )));
        }
        for d in 0..self.rank() {
            if self.extent[d] == 0 {
                return Err(err(format!("box {self} has zero extent in dimension {d}")));
            }
            let end = self.offset[d]
                .checked_add(self.extent[d])
                .ok_or_else(|| err(format!("box {self} overflows u64 in dimension {d}")))?;
            if end > spec.shape[d] {
                return Err(err(format!(
                    "box {self} lies outside the global shape {:?} in dimension {d}",
                    spec.shape
                )));
            }
        }
        let bytes = checked_product(&self.extent).and_then(|e| e.checked_mul(spec.dtype.size()));
        if bytes.is_none() {
            return Err(err(format!("byte size of box {self} overflows u64")));
        }
        Ok(())
    }
}

impl fmt::Display for TensorBox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for d in 0..self.extent.len() {
            if d > 0 {
                f.write_str(", ")?;
            }
            let o = self.offset.get(d).copied().unwrap_or(0);
            write!(f, "{}..{}", o, o.saturating_add(self.extent[d]))?;
        }
        f.write_str("]")
    }
}

/// Where bytes live: host memory, or device memory of a given GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryKind {
    /// Host DRAM.
    Dram,
    /// GPU memory on `device`.
    Vram {
        /// CUDA device ordinal.
        device: u32,
    },
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryKind::Dram => f.write_str("dram"),
            MemoryKind::Vram { device } => write!(f, "vram:{device}"),
        }
    }
}

/// Where an offer's bytes live in its owner's registered memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OfferLocation {
    /// Region id assigned when the owner registered the memory.
    pub region: u64,
    /// Byte offset of the offer's first byte inside that region.
    pub offset: u64,
    /// Memory kind of that region.
    pub memory: MemoryKind,
}

/// Cuts of an offer along each axis of its matrix view that carry their own digest: up to 16
/// row chunks and up to 16 column blocks, so every TP slice of up to 16 times the publisher's
/// own (on an offer whose rows or columns divide by 16) is whole chunks or whole blocks, which
/// a receiver reading only its slice can check (docs/design.md §6). Column blocks are fewer on
/// narrow rows ([`MIN_SEGMENT_BYTES`]).
pub const PARTS_PER_AXIS: u64 = 16;

/// The fewest bytes a segment (one row of one column block) of the standard grid holds, unless
/// the whole row is shorter or is cut in two ([`MIN_HALF_SEGMENT_BYTES`]): a row of `n` bytes
/// gets the largest power-of-two number of blocks, at most [`PARTS_PER_AXIS`], that keeps its
/// segments at least this long. Every byte a receiver checks is hashed one segment at a time,
/// and XXH3 on a few hundred bytes runs at about 0.6 of its speed on long inputs, 0.8 at 1 KiB
/// (BENCHMARKS.md, "Digest coverage"); a 512-byte grid everywhere cost about 5% of a refit
/// (BENCHMARKS.md, "Gather reads").
pub const MIN_SEGMENT_BYTES: u64 = 1024;

/// The fewest bytes of a segment in a row cut into two column blocks: any row of at least twice
/// this is cut at least in two, so a TP2 receiver's half of a 1.5 KiB row (a Qwen3-30B
/// expert's `down_proj`) is a whole column block, checkable where a gather read lands it
/// instead of staged (BENCHMARKS.md, "Gather reads").
pub const MIN_HALF_SEGMENT_BYTES: u64 = 512;

/// An offer's box as a matrix: `rows` (dim 0) by `cols` (dim 1) cells of `inner` elements (the
/// product of dims 2..). A 1-D box is one row of columns, a scalar one cell. Row chunks and
/// column blocks ([`PartDigests`]) cut this matrix; a segment is one row's bytes of one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatrixView {
    /// Rows.
    pub rows: u64,
    /// Columns per row.
    pub cols: u64,
    /// Elements per column cell.
    pub inner: u64,
}

impl MatrixView {
    /// The matrix view of a box of extent `extent`.
    pub fn of(extent: &[u64]) -> Self {
        match extent {
            [] => MatrixView {
                rows: 1,
                cols: 1,
                inner: 1,
            },
            [n] => MatrixView {
                rows: 1,
                cols: *n,
                inner: 1,
            },
            [r, c, rest @ ..] => MatrixView {
                rows: *r,
                cols: *c,
                inner: rest.iter().product(),
            },
        }
    }

    /// Rows per row chunk and columns per column block of the standard grid for elements of
    /// `elem` bytes: [`PARTS_PER_AXIS`] row chunks (fewer when there are fewer rows), and a
    /// power of two of column blocks up to [`PARTS_PER_AXIS`] whose segments hold at least
    /// [`MIN_SEGMENT_BYTES`], or two blocks of at least [`MIN_HALF_SEGMENT_BYTES`] (one block
    /// when the row is shorter).
    pub fn grid(&self, elem: u64) -> (u64, u64) {
        let row_bytes = self.cols.saturating_mul(self.inner).saturating_mul(elem);
        let halves = (row_bytes / MIN_HALF_SEGMENT_BYTES).min(2);
        let fit = (row_bytes / MIN_SEGMENT_BYTES)
            .max(halves)
            .clamp(1, PARTS_PER_AXIS);
        let blocks = 1u64 << (63 - fit.leading_zeros());
        (
            self.rows.div_ceil(PARTS_PER_AXIS).max(1),
            self.cols.div_ceil(blocks).max(1),
        )
    }
}

/// Digests of an offer's parts, so a receiver that reads only some rows (a TP slice of a
/// column-parallel tensor) or only some columns (a TP slice of a row-parallel one) can still
/// check what it read (docs/design.md §6). Row chunk `k` holds rows
/// `k * chunk_rows .. min((k + 1) * chunk_rows, rows)` of the offer's [`MatrixView`], every
/// column; column block `j` holds columns `j * block_cols .. min((j + 1) * block_cols, cols)`,
/// every row. Each digest is the 64-bit [`crate::SegmentFold`] of its segments.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartDigests {
    /// Matrix rows per row chunk (the last chunk may be shorter).
    pub chunk_rows: u64,
    /// One digest per row chunk, in row order.
    #[serde(with = "hex_u64s")]
    pub chunks: Vec<u64>,
    /// Matrix columns per column block (the last block may be narrower).
    pub block_cols: u64,
    /// One digest per column block, in column order.
    #[serde(with = "hex_u64s")]
    pub blocks: Vec<u64>,
}

impl PartDigests {
    /// The whole digest and the part digests on the standard grid ([`MatrixView::grid`]) of an
    /// offer's row-major `bytes` (box extent `extent`, `elem` bytes per element), hashing each
    /// byte once.
    pub fn compute(bytes: &[u8], extent: &[u64], elem: u64) -> (Digest, PartDigests) {
        let (chunk_rows, block_cols) = MatrixView::of(extent).grid(elem);
        Self::compute_on(bytes, extent, elem, chunk_rows, block_cols)
    }

    /// [`Self::compute`] on a grid of `chunk_rows` by `block_cols` (each at least 1).
    pub fn compute_on(
        bytes: &[u8],
        extent: &[u64],
        elem: u64,
        chunk_rows: u64,
        block_cols: u64,
    ) -> (Digest, PartDigests) {
        let v = MatrixView::of(extent);
        let (chunk_rows, block_cols) = (chunk_rows.max(1), block_cols.max(1));
        let nb = v.cols.div_ceil(block_cols) as usize;
        let row_bytes = (v.cols * v.inner * elem) as usize;
        // Saturating: a block wider than the row (a grid `check_grid` refuses) is one
        // segment per row, never an overflow.
        let seg = block_cols.saturating_mul(v.inner).saturating_mul(elem);
        let mut fold = crate::digest::SegmentFold::new();
        if row_bytes == 0 {
            fold.row(&[], seg);
        }
        for row in bytes.chunks(row_bytes.max(1)) {
            fold.row(row, seg);
        }
        // Folds of the segment hashes: row chunks are contiguous runs of them, column blocks
        // every nb-th one.
        let hashes = fold.hashes();
        let per_row = 8 * nb.max(1);
        let chunks = hashes
            .chunks(per_row * chunk_rows as usize)
            .map(twox_hash::XxHash3_64::oneshot)
            .collect();
        let mut column = Vec::with_capacity(8 * v.rows as usize);
        let blocks = (0..nb)
            .map(|j| {
                column.clear();
                for r in hashes.chunks(per_row) {
                    column.extend_from_slice(&r[8 * j..8 * j + 8]);
                }
                twox_hash::XxHash3_64::oneshot(&column)
            })
            .collect();
        (
            fold.whole(),
            PartDigests {
                chunk_rows,
                chunks,
                block_cols,
                blocks,
            },
        )
    }

    /// Checks this grid, read from an untrusted table, against the offer it describes (extent
    /// `extent`, `elem` bytes per element, `tensor` of publisher `owner`): `chunk_rows` and
    /// `block_cols` at most the offer's rows and columns, and at most [`PARTS_PER_AXIS`] column
    /// blocks unless each segment holds at least [`MIN_SEGMENT_BYTES`]. A receiver keeps a slot
    /// and a hashing task for every segment (one row of one column block) of the checks it
    /// plans, so a grid finer than any publisher needs multiplies its bookkeeping: `block_cols
    /// = 1` makes every cell a segment. Every grid a publisher makes passes: the standard grid
    /// ([`MatrixView::grid`]) has at most [`PARTS_PER_AXIS`] blocks, and so has any grid of
    /// whole TP slices of up to [`PARTS_PER_AXIS`] ranks. A refused grid is
    /// [`ErrorKind::Decode`] naming tensor, owner and field, like any other bad value a decoder
    /// reads.
    pub fn check_grid(
        &self,
        extent: &[u64],
        elem: u64,
        tensor: &str,
        owner: OwnerId,
    ) -> Result<()> {
        let v = MatrixView::of(extent);
        let refuse = |field: &str, why: String| {
            Err(Error::new(
                ErrorKind::Decode,
                format!("rank {owner}'s offer of {tensor} has a bad digest grid: {field} {why}"),
            )
            .with_tensor(tensor)
            .with_owner(owner))
        };
        // Zero is refused as an invalid table by `ShardTable::validate`; a size above the
        // offer's is never made by a publisher and would overflow `block_cols * cell`.
        if self.chunk_rows > v.rows {
            return refuse(
                "chunk_rows",
                format!("{} exceeds the offer's {} rows", self.chunk_rows, v.rows),
            );
        }
        if self.block_cols > v.cols {
            return refuse(
                "block_cols",
                format!("{} exceeds the offer's {} columns", self.block_cols, v.cols),
            );
        }
        let blocks = v.cols.div_ceil(self.block_cols.max(1));
        let seg = self
            .block_cols
            .checked_mul(v.inner)
            .and_then(|c| c.checked_mul(elem));
        match seg {
            Some(seg) if blocks <= PARTS_PER_AXIS || seg >= MIN_SEGMENT_BYTES => Ok(()),
            Some(seg) => refuse(
                "block_cols",
                format!(
                    "{} cuts each row into {blocks} column blocks of {seg}-byte segments; at \
                     most {PARTS_PER_AXIS} blocks, or segments of at least {MIN_SEGMENT_BYTES} \
                     bytes",
                    self.block_cols
                ),
            ),
            None => refuse(
                "block_cols",
                format!("{}: segment bytes overflow u64", self.block_cols),
            ),
        }
    }

    /// Numbers of row chunks and column blocks an offer of extent `extent` has on this grid.
    pub fn expected_counts(&self, extent: &[u64]) -> (u64, u64) {
        let v = MatrixView::of(extent);
        (
            v.rows.div_ceil(self.chunk_rows.max(1)),
            v.cols.div_ceil(self.block_cols.max(1)),
        )
    }
}

/// The whole digest of an offer's row-major `bytes` (a box of extent `extent`, `elem` bytes per
/// element), as its publisher computes it ([`PartDigests::compute`]).
pub fn offer_digest(bytes: &[u8], extent: &[u64], elem: u64) -> Digest {
    PartDigests::compute(bytes, extent, elem).0
}

/// Part digests as lower-case hex strings of 16 characters in JSON.
mod hex_u64s {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &[u64], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(v.iter().map(|d| format!("{d:016x}")))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u64>, D::Error> {
        let v = Vec::<String>::deserialize(d)?;
        v.iter()
            .map(|h| {
                if h.len() != 16 {
                    return Err(serde::de::Error::custom("part digest must be 16 hex chars"));
                }
                u64::from_str_radix(h, 16)
                    .map_err(|_| serde::de::Error::custom("part digest must be 16 hex chars"))
            })
            .collect()
    }
}

/// One publisher's contiguous, row-major buffer holding a box of one tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardOffer {
    /// Global tensor name (must be in the table's tensor list).
    pub tensor: String,
    /// The box of the tensor this buffer holds.
    pub tensor_box: TensorBox,
    /// Where its bytes live.
    pub location: OfferLocation,
    /// Content digest of the buffer's bytes (the 128-bit [`crate::SegmentFold`] of all its
    /// segments), when the publisher computed one.
    pub digest: Option<Digest>,
    /// Digests of row chunks and column blocks, when the publisher computed them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parts: Option<PartDigests>,
}

/// Who published a table.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PublisherId {
    /// Publisher rank (the owner id of all offers in the table).
    pub rank: OwnerId,
    /// Transport agent name of that rank.
    pub agent: String,
    /// Incarnation of the endpoint whose regions the offers name
    /// ([`crate::Transport::incarnation`]): a restarted publisher keeps its rank and agent name
    /// but gets a new incarnation, so a receiver can tell that the peer metadata it holds is not
    /// the one this table was written against (docs/in-flight-safety.md, "Stale peers"). 0 means
    /// unbound: such a table is never read from.
    #[serde(default)]
    pub incarnation: u64,
}

/// One publisher's offers, with its identity and training step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardTable {
    /// Who published it.
    pub publisher: PublisherId,
    /// Training step the bytes belong to.
    pub step: u64,
    /// Tensors referenced by offers, each name once.
    pub tensors: Vec<TensorSpec>,
    /// The offers.
    pub offers: Vec<ShardOffer>,
}

impl ShardTable {
    /// An empty table for a publisher.
    pub fn new(rank: OwnerId, agent: impl Into<String>, step: u64) -> Self {
        ShardTable {
            publisher: PublisherId {
                rank,
                agent: agent.into(),
                incarnation: 0,
            },
            step,
            tensors: Vec::new(),
            offers: Vec::new(),
        }
    }

    /// This table bound to the publisher endpoint incarnation its offers were written against.
    pub fn bound_to(mut self, incarnation: u64) -> Self {
        self.publisher.incarnation = incarnation;
        self
    }

    /// The owner of every offer in this table.
    pub fn owner(&self) -> OwnerId {
        self.publisher.rank
    }

    /// Checks everything a decoder must not trust: unique tensor names, valid shapes, every
    /// offer naming a known tensor with a box inside its shape, and part digests on a bounded
    /// grid ([`PartDigests::check_grid`]).
    pub fn validate(&self) -> Result<()> {
        let mut seen =
            rustc_hash::FxHashMap::with_capacity_and_hasher(self.tensors.len(), Default::default());
        for (i, t) in self.tensors.iter().enumerate() {
            t.validate()?;
            if seen.insert(t.name.as_str(), i).is_some() {
                return Err(Error::new(
                    ErrorKind::InvalidTable,
                    format!(
                        "tensor name appears twice in the table of rank {}",
                        self.publisher.rank
                    ),
                )
                .with_tensor(&t.name)
                .with_owner(self.publisher.rank));
            }
        }
        for o in &self.offers {
            let Some(&i) = seen.get(o.tensor.as_str()) else {
                return Err(Error::new(
                    ErrorKind::InvalidTable,
                    "offer names a tensor the table does not declare",
                )
                .with_tensor(&o.tensor)
                .with_owner(self.publisher.rank));
            };
            o.tensor_box
                .validate_in(&self.tensors[i])
                .map_err(|e| e.with_owner(self.publisher.rank))?;
            if let Some(p) = &o.parts {
                let (chunks, blocks) = p.expected_counts(&o.tensor_box.extent);
                if p.chunk_rows == 0
                    || p.block_cols == 0
                    || p.chunks.len() as u64 != chunks
                    || p.blocks.len() as u64 != blocks
                {
                    return Err(Error::new(
                        ErrorKind::InvalidTable,
                        format!(
                            "offer of box {} has {} row-chunk digests of {} rows and {} \
                             column-block digests of {} columns; expected {chunks} and {blocks}",
                            o.tensor_box,
                            p.chunks.len(),
                            p.chunk_rows,
                            p.blocks.len(),
                            p.block_cols
                        ),
                    )
                    .with_tensor(&o.tensor)
                    .with_owner(self.publisher.rank));
                }
                p.check_grid(
                    &o.tensor_box.extent,
                    self.tensors[i].dtype.size(),
                    &o.tensor,
                    self.publisher.rank,
                )?;
            }
            let bytes = o.tensor_box.elements() * self.tensors[i].dtype.size();
            if o.location.offset.checked_add(bytes).is_none() {
                return Err(Error::new(
                    ErrorKind::InvalidTable,
                    "offer's byte range overflows u64",
                )
                .with_tensor(&o.tensor)
                .with_owner(self.publisher.rank));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fold the receiver computes over a rectangle of an offer's matrix view.
    fn fold_of(
        bytes: &[u8],
        v: MatrixView,
        elem: u64,
        rows: std::ops::Range<u64>,
        cols: std::ops::Range<u64>,
        block: u64,
    ) -> crate::digest::SegmentFold {
        let mut f = crate::digest::SegmentFold::new();
        let row_bytes = v.cols * v.inner * elem;
        let cell = v.inner * elem;
        for r in rows {
            let s = (r * row_bytes + cols.start * cell) as usize;
            f.row(
                &bytes[s..s + ((cols.end - cols.start) * cell) as usize],
                block * cell,
            );
        }
        f
    }

    #[test]
    fn part_digests_equal_folds_of_what_a_receiver_reads() {
        // A [10, 7, 3] offer of 2-byte elements: matrix 10 x 7 of 3-element cells; a grid of
        // 4 rows by 2 columns leaves a short last chunk and a narrow last block.
        let extent = [10u64, 7, 3];
        let bytes: Vec<u8> = (0..420u32).map(|i| (i * 31 % 251) as u8).collect();
        let v = MatrixView::of(&extent);
        assert_eq!((v.rows, v.cols, v.inner), (10, 7, 3));
        let (whole, p) = PartDigests::compute_on(&bytes, &extent, 2, 4, 2);
        assert_eq!(p.expected_counts(&extent), (3, 4));
        assert_eq!((p.chunks.len(), p.blocks.len()), (3, 4));
        assert_eq!(fold_of(&bytes, v, 2, 0..10, 0..7, 2).whole(), whole);
        for (k, d) in p.chunks.iter().enumerate() {
            let rows = 4 * k as u64..(4 * k as u64 + 4).min(10);
            assert_eq!(fold_of(&bytes, v, 2, rows, 0..7, 2).part(), *d, "chunk {k}");
        }
        for (j, d) in p.blocks.iter().enumerate() {
            let cols = 2 * j as u64..(2 * j as u64 + 2).min(7);
            assert_eq!(
                fold_of(&bytes, v, 2, 0..10, cols, 2).part(),
                *d,
                "block {j}"
            );
        }
        // The standard grid: 16 row chunks at most, and one column block on rows this short.
        let (_, std) = PartDigests::compute(&bytes, &extent, 2);
        assert_eq!((std.chunk_rows, std.block_cols), (1, 7));
        // Rows of 4 KiB: four blocks of 1 KiB; 64 KiB rows: sixteen; 1.5 KiB: two (a TP2
        // half of a Qwen3 expert's down_proj row is one block); 1 KiB: two of 512 bytes; 768
        // bytes: one.
        assert_eq!(MatrixView::of(&[4096, 2048]).grid(2), (256, 512));
        assert_eq!(MatrixView::of(&[4096, 1024]).grid(2), (256, 512));
        assert_eq!(MatrixView::of(&[10, 512]).grid(2), (1, 256));
        assert_eq!(MatrixView::of(&[4096, 14336]).grid(4), (256, 896));
        assert_eq!(MatrixView::of(&[2048, 768]).grid(2), (128, 384));
        assert_eq!(MatrixView::of(&[2048, 384]).grid(2), (128, 384));
        assert_eq!(MatrixView::of(&[3, 4096, 8]).grid(1), (1, 256));
        assert_eq!(MatrixView::of(&[2048]).grid(2), (1, 512));
        assert_eq!(MatrixView::of(&[7]).grid(2), (1, 7));
        assert_eq!(MatrixView::of(&[]).grid(8), (1, 1));
    }

    #[test]
    fn part_digests_round_trip_through_json() {
        let (_, p) = PartDigests::compute(&[7u8; 64], &[4, 8], 2);
        let j = serde_json::to_string(&p).unwrap();
        assert!(j.contains(&format!("{:016x}", p.chunks[0])), "{j}");
        assert_eq!(serde_json::from_str::<PartDigests>(&j).unwrap(), p);
        let bad = j.replacen(&format!("{:016x}", p.chunks[0]), "zz", 1);
        assert!(serde_json::from_str::<PartDigests>(&bad).is_err());
    }

    #[test]
    fn dtype_sizes_and_names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            assert_eq!(DType::from_code(d.code()), Some(d));
        }
        assert_eq!(DType::Bf16.size(), 2);
        assert_eq!(DType::F8E4m3.size(), 1);
        assert_eq!(DType::I64.size(), 8);
        assert_eq!("q4".parse::<DType>().unwrap_err().kind(), ErrorKind::Decode);
    }

    #[test]
    fn box_intersection() {
        let a = TensorBox::new(vec![0, 0], vec![4, 8]);
        let b = TensorBox::new(vec![2, 4], vec![4, 8]);
        assert_eq!(
            a.intersect(&b),
            Some(TensorBox::new(vec![2, 4], vec![2, 4]))
        );
        let c = TensorBox::new(vec![4, 0], vec![1, 1]);
        assert_eq!(a.intersect(&c), None);
        assert!(a.contains(&TensorBox::new(vec![1, 1], vec![2, 2])));
    }

    #[test]
    fn box_validation_names_the_problem() {
        let spec = TensorSpec::new("w", DType::F32, vec![4, 8]);
        let bad = [
            TensorBox::new(vec![0], vec![4]),
            TensorBox::new(vec![0, 0], vec![0, 8]),
            TensorBox::new(vec![2, 0], vec![4, 8]),
            TensorBox::new(vec![u64::MAX, 0], vec![2, 8]),
        ];
        for b in bad {
            let e = b.validate_in(&spec).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidTable);
            assert_eq!(e.context().tensor.as_deref(), Some("w"));
        }
    }

    /// A table of rank 5 with one bf16 offer of extent `extent` and part digests on a grid of
    /// `chunk_rows` by `block_cols`, with as many digests as that grid has parts.
    fn gridded(extent: &[u64], chunk_rows: u64, block_cols: u64) -> ShardTable {
        let mut t = ShardTable::new(5, "a", 0);
        t.tensors
            .push(TensorSpec::new("w", DType::Bf16, extent.to_vec()));
        let v = MatrixView::of(extent);
        t.offers.push(ShardOffer {
            tensor: "w".into(),
            tensor_box: TensorBox::new(vec![0; extent.len()], extent.to_vec()),
            location: OfferLocation {
                region: 0,
                offset: 0,
                memory: MemoryKind::Dram,
            },
            digest: None,
            parts: Some(PartDigests {
                chunk_rows,
                chunks: vec![0; v.rows.div_ceil(chunk_rows.max(1)) as usize],
                block_cols,
                blocks: vec![0; v.cols.div_ceil(block_cols.max(1)) as usize],
            }),
        });
        t
    }

    #[test]
    fn hostile_digest_grids_are_refused_naming_owner_tensor_and_field() {
        let refused = |t: ShardTable, field: &str| {
            let e = t.validate().unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Decode, "{e}");
            assert_eq!(e.context().tensor.as_deref(), Some("w"));
            assert_eq!(e.context().owner, Some(5));
            // The field is named only in the message (no structured detail carries it).
            assert!(e.message().contains(field), "{e}");
        };
        // Every 2-byte cell a segment: 4096 column blocks on a row of 8 KiB.
        refused(gridded(&[64, 4096], 4, 1), "block_cols");
        // 17 blocks of 2-byte segments: one past the most a publisher cuts a short row into.
        refused(gridded(&[4, 17], 1, 1), "block_cols");
        // Wider than the row: `block_cols * cell` overflows u64 (one block digest, as the
        // counts then ask).
        refused(gridded(&[4, 8], 4, u64::MAX / 2 + 1), "block_cols");
        refused(gridded(&[4, 8], 4, 9), "block_cols");
        refused(gridded(&[4, 8], 5, 8), "chunk_rows");
        refused(gridded(&[4, 8], u64::MAX, 8), "chunk_rows");
    }

    #[test]
    fn every_grid_a_publisher_makes_passes() {
        for extent in [
            &[4096u64, 14336][..],
            &[2048, 768],
            &[128, 96],
            &[10, 7, 3],
            &[7],
            &[1 << 20],
            &[3, 4096, 8],
        ] {
            let v = MatrixView::of(extent);
            let (cr, bc) = v.grid(2);
            gridded(extent, cr, bc).validate().unwrap();
            // Whole TP slices of up to 16 ranks: column blocks of cols / 16.
            gridded(extent, 1, v.cols.div_ceil(PARTS_PER_AXIS))
                .validate()
                .unwrap();
        }
        // Finer than 16 blocks with segments of at least MIN_SEGMENT_BYTES: 64 blocks of 1 KiB.
        gridded(&[8, 32768], 8, 512).validate().unwrap();
        // Tiny test grids: every cell a block of a 4-column row.
        gridded(&[16, 4], 1, 1).validate().unwrap();
    }

    #[test]
    fn table_rejects_duplicate_names_and_unknown_tensors() {
        let mut t = ShardTable::new(1, "a", 0);
        t.tensors.push(TensorSpec::new("w", DType::F32, vec![4]));
        t.tensors.push(TensorSpec::new("w", DType::F32, vec![4]));
        assert_eq!(t.validate().unwrap_err().kind(), ErrorKind::InvalidTable);
        t.tensors.pop();
        t.offers.push(ShardOffer {
            tensor: "x".into(),
            tensor_box: TensorBox::new(vec![0], vec![4]),
            location: OfferLocation {
                region: 0,
                offset: 0,
                memory: MemoryKind::Dram,
            },
            digest: None,
            parts: None,
        });
        let e = t.validate().unwrap_err();
        assert_eq!(e.context().tensor.as_deref(), Some("x"));
        assert_eq!(e.context().owner, Some(1));
    }
}
