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

/// Digests of consecutive dim-0 row chunks of an offer, so a receiver that reads only some rows
/// (a TP slice) can still check what it read. Chunk `k` covers offer rows
/// `k * rows .. min((k + 1) * rows, extent[0])`, each digest taken over those rows' bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkDigests {
    /// Dim-0 rows per chunk (the last chunk may be shorter).
    pub rows: u64,
    /// One digest per chunk, in row order.
    pub digests: Vec<Digest>,
}

impl ChunkDigests {
    /// Digests `offer_bytes` (a row-major offer of `rows_total` dim-0 rows) in chunks of `rows`.
    pub fn of(offer_bytes: &[u8], rows_total: u64, rows: u64) -> Self {
        let rows = rows.max(1);
        let row_bytes = offer_bytes.len() as u64 / rows_total.max(1);
        let chunk = (rows * row_bytes).max(1) as usize;
        ChunkDigests {
            rows,
            digests: offer_bytes.chunks(chunk).map(Digest::of).collect(),
        }
    }

    /// The whole-offer digest and the chunk digests in one pass over the bytes: each chunk is
    /// hashed while it is in cache and fed to the streaming whole-offer hash.
    pub fn with_whole(offer_bytes: &[u8], rows_total: u64, rows: u64) -> (Digest, Self) {
        let rows = rows.max(1);
        let row_bytes = offer_bytes.len() as u64 / rows_total.max(1);
        let chunk = (rows * row_bytes).max(1) as usize;
        let mut whole = xxhash_rust::xxh3::Xxh3::new();
        let digests = offer_bytes
            .chunks(chunk)
            .map(|c| {
                whole.update(c);
                Digest::of(c)
            })
            .collect();
        (
            Digest(whole.digest128().to_le_bytes()),
            ChunkDigests { rows, digests },
        )
    }

    /// Number of chunks an offer of `rows_total` dim-0 rows has.
    pub fn expected_count(rows_total: u64, rows: u64) -> u64 {
        rows_total.div_ceil(rows.max(1))
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
    /// Content digest of the buffer's bytes, when the publisher computed one.
    pub digest: Option<Digest>,
    /// Digests of dim-0 row chunks, when the publisher computed them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunks: Option<ChunkDigests>,
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
    /// offer naming a known tensor with a box inside its shape.
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
            if let Some(c) = &o.chunks {
                let want = ChunkDigests::expected_count(o.tensor_box.extent[0], c.rows);
                if c.rows == 0 || c.digests.len() as u64 != want {
                    return Err(Error::new(
                        ErrorKind::InvalidTable,
                        format!(
                            "offer of box {} has {} chunk digests of {} rows; expected {want}",
                            o.tensor_box,
                            c.digests.len(),
                            c.rows
                        ),
                    )
                    .with_tensor(&o.tensor)
                    .with_owner(self.publisher.rank));
                }
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

    #[test]
    fn one_pass_digests_equal_separate_ones() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let (whole, chunks) = ChunkDigests::with_whole(&bytes, 100, 13);
        assert_eq!(whole, Digest::of(&bytes));
        assert_eq!(chunks, ChunkDigests::of(&bytes, 100, 13));
        assert_eq!(
            chunks.digests.len() as u64,
            ChunkDigests::expected_count(100, 13)
        );
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
            chunks: None,
        });
        let e = t.validate().unwrap_err();
        assert_eq!(e.context().tensor.as_deref(), Some("x"));
        assert_eq!(e.context().owner, Some(1));
    }
}
