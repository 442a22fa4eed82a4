//! Small arbitrary shard tables and a small wanted layout through merge, dedup and plan (the
//! receiver's pipeline before any byte moves): every stage returns Ok or a typed error, never
//! panics; plans are deterministic; and a table's binary encoding is accepted exactly when the
//! table validates, and never with a digest grid finer than a receiver may keep bookkeeping
//! for (hostile grids are refused as `Decode` naming owner and tensor).
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use reshard_core::encoding::{decode_table, encode_table};
use reshard_core::model::MIN_SEGMENT_BYTES;
use reshard_core::{
    dedup, keep_all, merge, DType, DedupOptions, Digest, ErrorKind, MatrixView, MemoryKind,
    OfferLocation, ParamSpec, PartDigests, ShardOffer, ShardTable, TensorBox, TensorSpec,
    WantedCopy, WantedLayout, PARTS_PER_AXIS,
};
use reshard_planner::plan::{plan, PlanOptions};

/// A dimension: mostly small, sometimes at the edges of u64 arithmetic.
#[derive(Debug, Arbitrary)]
enum Dim {
    Small(u8),
    /// A power of two: equal huge values across tables are likely (replicas of huge boxes).
    Pow2(u8),
    Big(u64),
}

impl Dim {
    fn value(&self) -> u64 {
        match self {
            Dim::Small(v) => u64::from(*v % 17),
            Dim::Pow2(v) => 1 << (v % 64),
            Dim::Big(v) => *v,
        }
    }
}

fn dims(v: &[Dim]) -> Vec<u64> {
    v.iter().take(4).map(Dim::value).collect()
}

#[derive(Debug, Arbitrary)]
struct Tensor {
    name: u8,
    dtype: u8,
    shape: Vec<Dim>,
}

#[derive(Debug, Arbitrary)]
struct Offer {
    tensor: u8,
    offset: Vec<Dim>,
    extent: Vec<Dim>,
    region: u8,
    byte_offset: u32,
    digest: Option<u8>,
    /// Rows per chunk, chunk digests, columns per block, block digests (sizes by
    /// [`part_size`]).
    parts: Option<(u8, Vec<u8>, u8, Vec<u8>)>,
}

#[derive(Debug, Arbitrary)]
struct Table {
    rank: u8,
    step: u8,
    tensors: Vec<Tensor>,
    offers: Vec<Offer>,
}

#[derive(Debug, Arbitrary)]
struct Copy {
    tensor: u8,
    offset: Vec<Dim>,
    extent: Vec<Dim>,
    dst_offset: u16,
    strides: Vec<u8>,
}

#[derive(Debug, Arbitrary)]
struct Param {
    dtype: u8,
    shape: Vec<u8>,
    copies: Vec<Copy>,
}

/// A column slice of a tensor one offer holds whole: random boxes rarely tile a tensor, so
/// without this the fuzzer never reaches a gather read (a probe in 850,000 runs found none).
#[derive(Debug, Arbitrary)]
struct ColumnSlice {
    rows: u8,
    cols: u8,
    /// Columns per digest block of the offer's part digests (a slice of whole blocks is
    /// checked where a gather lands it; without part digests a slice is a full pull).
    block_cols: u8,
    from: u8,
    width: u8,
    dtype: u8,
    region: u8,
    byte_offset: u16,
    /// A grid no publisher makes instead (one block per column, or wider than the row): the
    /// table must be refused as `Decode` naming its owner and tensor. Last, so inputs saved
    /// before it existed keep their meaning.
    hostile_block_cols: Option<Dim>,
}

impl ColumnSlice {
    /// A table of rank 8 (random tables have ranks 0..8) with tensor `g` (rows x cols, whole in
    /// one offer), at `step`; and a parameter taking columns `from..from + width` of every row;
    /// and whether its grid is hostile.
    fn build(&self, step: u64) -> (ShardTable, ParamSpec, bool) {
        let rows = 2 + u64::from(self.rows % 15);
        let cols = 2 + u64::from(self.cols % 31);
        let from = u64::from(self.from) % cols;
        let width = 1 + u64::from(self.width) % (cols - from);
        let dtype = dtype(self.dtype);
        let mut t = ShardTable::new(8, "gather".to_owned(), step);
        t.tensors = vec![TensorSpec::new("g".to_owned(), dtype, vec![rows, cols])];
        t.offers = vec![ShardOffer {
            tensor: "g".to_owned(),
            tensor_box: TensorBox::new(vec![0, 0], vec![rows, cols]),
            location: OfferLocation {
                region: u64::from(self.region % 4),
                offset: u64::from(self.byte_offset),
                memory: MemoryKind::Dram,
            },
            digest: None,
            parts: None,
        }];
        let elem = dtype.size();
        let bytes = vec![self.rows; (rows * cols * elem) as usize];
        // At most PARTS_PER_AXIS blocks, as a publisher cuts rows this short.
        let block_cols = (1 + u64::from(self.block_cols) % cols).max(cols.div_ceil(PARTS_PER_AXIS));
        let (whole, mut parts) =
            PartDigests::compute_on(&bytes, &[rows, cols], elem, rows, block_cols);
        let mut hostile = false;
        if let Some(d) = &self.hostile_block_cols {
            let bc = d.value();
            // Zero is an invalid table, not a hostile grid; rows here are at most 256 bytes, so
            // more than PARTS_PER_AXIS blocks are segments under MIN_SEGMENT_BYTES.
            if bc > cols || (bc > 0 && cols.div_ceil(bc) > PARTS_PER_AXIS) {
                hostile = true;
                parts.block_cols = bc;
                // The digests the grid's counts ask for: only the grid is wrong.
                parts.blocks = vec![0; cols.div_ceil(bc) as usize];
            }
        }
        t.offers[0].digest = Some(whole);
        t.offers[0].parts = Some(parts);
        let param = ParamSpec {
            name: "pg".to_owned(),
            dtype,
            shape: vec![rows, width],
            copies: vec![WantedCopy {
                tensor: "g".to_owned(),
                src_box: TensorBox::new(vec![0, from], vec![rows, width]),
                dst_offset: 0,
                dst_strides: vec![width, 1],
            }],
        };
        (t, param, hostile)
    }
}

#[derive(Debug, Arbitrary)]
struct Input {
    tables: Vec<Table>,
    params: Vec<Param>,
    threshold: u8,
    dedup: bool,
    spread: Option<u8>,
    /// Gather reads off (`None`), or on for rows of at least this many bytes.
    gather_min_row: Option<u8>,
    column_slice: Option<ColumnSlice>,
}

fn name(i: u8) -> String {
    format!("t{}", i % 6)
}

fn dtype(code: u8) -> DType {
    DType::ALL[code as usize % DType::ALL.len()]
}

fn digest(v: u8) -> Digest {
    Digest([v; 16])
}

fn table(t: &Table) -> ShardTable {
    let mut out = ShardTable::new(u32::from(t.rank % 8), format!("a{}", t.rank), t.step.into());
    out.tensors = t
        .tensors
        .iter()
        .take(6)
        .map(|s| TensorSpec::new(name(s.name), dtype(s.dtype), dims(&s.shape)))
        .collect();
    out.offers = t
        .offers
        .iter()
        .take(8)
        .map(|o| ShardOffer {
            tensor: name(o.tensor),
            tensor_box: TensorBox::new(dims(&o.offset), dims(&o.extent)),
            location: OfferLocation {
                region: u64::from(o.region % 4),
                offset: u64::from(o.byte_offset),
                memory: MemoryKind::Dram,
            },
            digest: o.digest.map(digest),
            parts: o.parts.as_ref().map(|(rows, c, cols, b)| PartDigests {
                chunk_rows: part_size(*rows),
                chunks: c.iter().take(8).map(|&v| u64::from(v)).collect(),
                block_cols: part_size(*cols),
                // Up to 40: more than PARTS_PER_AXIS blocks, so a fine grid's counts can match.
                blocks: b.iter().take(40).map(|&v| u64::from(v)).collect(),
            }),
        })
        .collect();
    out
}

/// Rows per chunk or columns per block from one byte: mostly 0..5 (grids of small offers,
/// as before), sometimes 2^48..2^63, wider than any offer (`block_cols * cell` overflows u64).
/// With up to 40 block digests, grids of more than PARTS_PER_AXIS tiny blocks are reached on
/// offers of 32 columns.
fn part_size(v: u8) -> u64 {
    if v < 240 {
        u64::from(v % 5)
    } else {
        1 << (v % 64)
    }
}

/// True when every offer's part digests of `t` (a validated table) keep a receiver's
/// bookkeeping bounded: a block inside its row, and at most PARTS_PER_AXIS blocks per row or
/// blocks of at least MIN_SEGMENT_BYTES (so at most one more than the row's KiB).
fn grids_bounded(t: &ShardTable) -> bool {
    t.offers.iter().all(|o| {
        let Some(p) = &o.parts else { return true };
        let elem = t
            .tensors
            .iter()
            .find(|s| s.name == o.tensor)
            .map_or(1, |s| s.dtype.size());
        let v = MatrixView::of(&o.tensor_box.extent);
        let row_bytes = u128::from(v.cols)
            .saturating_mul(u128::from(v.inner))
            .saturating_mul(u128::from(elem));
        let blocks = u128::from(v.cols.div_ceil(p.block_cols.max(1)));
        p.block_cols <= v.cols
            && p.chunk_rows <= v.rows
            && blocks
                <= u128::from(PARTS_PER_AXIS).max(row_bytes / u128::from(MIN_SEGMENT_BYTES) + 1)
    })
}

fn layout(params: &[Param]) -> WantedLayout {
    WantedLayout {
        receiver_rank: 0,
        params: params
            .iter()
            .take(4)
            .enumerate()
            .map(|(i, p)| ParamSpec {
                name: format!("p{i}"),
                dtype: dtype(p.dtype),
                shape: p.shape.iter().take(4).map(|&d| u64::from(d % 17)).collect(),
                copies: p
                    .copies
                    .iter()
                    .take(4)
                    .map(|c| WantedCopy {
                        tensor: name(c.tensor),
                        src_box: TensorBox::new(dims(&c.offset), dims(&c.extent)),
                        dst_offset: u64::from(c.dst_offset),
                        dst_strides: c.strides.iter().take(4).map(|&s| u64::from(s)).collect(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

fuzz_target!(|input: Input| {
    let mut tables: Vec<ShardTable> = input.tables.iter().take(6).map(table).collect();
    let slice = input.column_slice.as_ref().map(|c| {
        let step = tables.first().map_or(0, |t| t.step);
        c.build(step)
    });
    if let Some((t, _, hostile)) = &slice {
        if *hostile {
            // Refused from bytes and from a table alike, naming the publisher and tensor.
            for e in [
                decode_table(&encode_table(t)).unwrap_err(),
                merge(std::slice::from_ref(t)).unwrap_err(),
            ] {
                assert_eq!(e.kind(), ErrorKind::Decode, "{e}");
                assert_eq!(e.context().owner, Some(8), "{e}");
                assert_eq!(e.context().tensor.as_deref(), Some("g"), "{e}");
            }
        }
        tables.push(t.clone());
    }
    for t in &tables {
        let decoded = decode_table(&encode_table(t));
        let valid = t.validate();
        assert_eq!(decoded.is_ok(), valid.is_ok(), "{t:?}: {decoded:?}");
        match valid {
            Ok(()) => assert!(grids_bounded(t), "a hostile grid validated: {t:?}"),
            // A Decode error of a built table is a bad grid: it names whose and which tensor.
            Err(e) if e.kind() == ErrorKind::Decode => {
                assert_eq!(e.context().owner, Some(t.publisher.rank), "{e}");
                assert!(e.context().tensor.is_some(), "{e}");
            }
            Err(_) => {}
        }
        if let Ok(d) = decoded {
            assert_eq!(&d, t);
        }
    }
    let Ok(merged) = merge(&tables) else {
        return;
    };
    let deduped = if input.dedup {
        let opts = DedupOptions {
            spread_receiver_rank: input.spread.map(u32::from),
        };
        match dedup(&merged, opts) {
            Ok((d, _)) => d,
            Err(_) => return,
        }
    } else {
        keep_all(merged).0
    };
    let mut layout = layout(&input.params);
    if let Some((_, p, _)) = slice {
        layout.params.push(p);
    }
    // Exact reads are enumerated one run at a time: keep wanted copies small so one input
    // cannot take seconds (offers stay unbounded, to exercise overflow checks).
    // Saturating: four u64 extents overflow even u128 (overflow checks are on).
    let wanted: u128 = layout
        .params
        .iter()
        .flat_map(|p| &p.copies)
        .map(|c| {
            c.src_box
                .extent
                .iter()
                .fold(1u128, |n, &e| n.saturating_mul(u128::from(e)))
        })
        .fold(0, u128::saturating_add);
    if wanted > 1 << 16 {
        return;
    }
    let opts = PlanOptions {
        full_pull_threshold: u64::from(input.threshold),
        allow_overlap: !input.dedup,
        gather_reads: input.gather_min_row.is_some(),
        gather_min_row_bytes: input.gather_min_row.map_or(0, u64::from),
    };
    if let Ok(p) = plan(&deduped, &layout, &opts) {
        let again = plan(&deduped, &layout, &opts).expect("same input, same result");
        assert_eq!(p.fingerprint, again.fingerprint);
        assert!(p.reads.iter().all(|r| r.len > 0), "no empty reads");
        // A gather's rows divide it and never overlap (what validate_batch will ask).
        assert!(
            p.reads
                .iter()
                .all(|r| r.src_rows.is_none_or(|g| g.span(r.len).is_some())),
            "malformed gather"
        );
    }
});
