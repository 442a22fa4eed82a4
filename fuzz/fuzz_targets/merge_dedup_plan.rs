//! Small arbitrary shard tables and a small wanted layout through merge, dedup and plan (the
//! receiver's pipeline before any byte moves): every stage returns Ok or a typed error, never
//! panics; plans are deterministic; and a table's binary encoding is accepted exactly when the
//! table validates.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use reshard_core::encoding::{decode_table, encode_table};
use reshard_core::{
    dedup, keep_all, merge, DType, DedupOptions, Digest, MemoryKind, OfferLocation, ParamSpec,
    PartDigests, ShardOffer, ShardTable, TensorBox, TensorSpec, WantedCopy, WantedLayout,
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
}

impl ColumnSlice {
    /// A table of rank 8 (random tables have ranks 0..8) with tensor `g` (rows x cols, whole in
    /// one offer), at `step`; and a parameter taking columns `from..from + width` of every row.
    fn build(&self, step: u64) -> (ShardTable, ParamSpec) {
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
        let block_cols = 1 + u64::from(self.block_cols) % cols;
        let (whole, parts) = PartDigests::compute_on(&bytes, &[rows, cols], elem, rows, block_cols);
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
        (t, param)
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
                chunk_rows: u64::from(*rows % 5),
                chunks: c.iter().take(8).map(|&v| u64::from(v)).collect(),
                block_cols: u64::from(*cols % 5),
                blocks: b.iter().take(8).map(|&v| u64::from(v)).collect(),
            }),
        })
        .collect();
    out
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
    if let Some((t, _)) = &slice {
        tables.push(t.clone());
    }
    for t in &tables {
        let decoded = decode_table(&encode_table(t));
        assert_eq!(decoded.is_ok(), t.validate().is_ok(), "{t:?}: {decoded:?}");
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
    if let Some((_, p)) = slice {
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
