//! Hand-built planner cases (docs/design.md §4): each names one behaviour and checks the exact
//! reads, staging, re-slices and statistics it must produce.

use reshard_core::{
    dedup, merge, CheckedPart, DType, DedupOptions, Dest, ErrorDetail, ErrorKind, MatrixView,
    MemoryKind, MergedTable, OfferLocation, ParamSpec, PartDigests, Plan, PlannedRead, ShardOffer,
    ShardTable, TensorBox, TensorSpec, WantedCopy, WantedLayout,
};
use reshard_planner::plan::{plan, PlanOptions};

/// An offer of `tensor` for [`table`]: box offset, box extent, and the byte gap left before it
/// in the publisher's region.
struct Off<'a> {
    tensor: &'a str,
    offset: Vec<u64>,
    extent: Vec<u64>,
    gap: u64,
}

fn off<'a>(tensor: &'a str, offset: &[u64], extent: &[u64]) -> Off<'a> {
    Off {
        tensor,
        offset: offset.to_vec(),
        extent: extent.to_vec(),
        gap: 0,
    }
}

/// One publisher's table: its offers laid out back to back (plus gaps) in region 7, each with a
/// whole digest and part digests of every row and every column (placeholders: the planner only
/// looks at which digests exist and on what grid), so every read is checked where it lands and
/// the reads are what the geometry alone asks for. [`with_grid`] sets coarser grids.
fn table(rank: u32, specs: &[&TensorSpec], offers: &[Off]) -> ShardTable {
    let mut t = with_grid(bare_table(rank, specs, offers), 1, 1);
    for o in &mut t.offers {
        o.digest = Some(reshard_core::Digest([0; 16]));
    }
    t
}

/// [`table`] without any digests.
fn bare_table(rank: u32, specs: &[&TensorSpec], offers: &[Off]) -> ShardTable {
    let mut t = ShardTable::new(rank, format!("agent{rank}"), 1);
    for s in specs {
        if offers.iter().any(|o| o.tensor == s.name) {
            t.tensors.push((*s).clone());
        }
    }
    let mut at = 0;
    for o in offers {
        let spec = specs.iter().find(|s| s.name == o.tensor).unwrap();
        at += o.gap;
        t.offers.push(ShardOffer {
            tensor: o.tensor.into(),
            tensor_box: TensorBox::new(o.offset.clone(), o.extent.clone()),
            location: OfferLocation {
                region: 7,
                offset: at,
                memory: MemoryKind::Dram,
            },
            digest: None,
            parts: None,
        });
        at += o.extent.iter().product::<u64>() * spec.dtype.size();
    }
    t
}

fn deduped(tables: &[ShardTable]) -> MergedTable {
    dedup(&merge(tables).unwrap(), DedupOptions::default())
        .unwrap()
        .0
}

fn bf16(name: &str, shape: &[u64]) -> TensorSpec {
    TensorSpec::new(name, DType::Bf16, shape.to_vec())
}

fn row_major(shape: &[u64]) -> Vec<u64> {
    reshard_core::layout::row_major_strides(shape)
}

/// A copy of `box` into a parameter of exactly the box's shape, at byte `dst_offset`.
fn copy(tensor: &str, offset: &[u64], extent: &[u64], dst_offset: u64) -> WantedCopy {
    WantedCopy {
        tensor: tensor.into(),
        src_box: TensorBox::new(offset.to_vec(), extent.to_vec()),
        dst_offset,
        dst_strides: row_major(extent),
    }
}

fn param(name: &str, dtype: DType, shape: &[u64], copies: Vec<WantedCopy>) -> ParamSpec {
    ParamSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        copies,
    }
}

fn layout(params: Vec<ParamSpec>) -> WantedLayout {
    WantedLayout {
        receiver_rank: 0,
        params,
    }
}

fn read(owner: u32, src: u64, len: u64, dst: Dest, dst_offset: u64, tensor: u32) -> PlannedRead {
    PlannedRead {
        owner,
        src_region: 7,
        src_offset: src,
        len,
        dst,
        dst_offset,
        tensor,
        src_rows: None,
    }
}

/// The default planner, except that it gathers rows of any length (these cases' rows are a
/// few bytes long).
fn default_plan(t: &MergedTable, l: &WantedLayout) -> Plan {
    let opts = PlanOptions {
        gather_min_row_bytes: 0,
        ..PlanOptions::default()
    };
    plan(t, l, &opts).unwrap()
}

/// The planner without gather reads: a column block is read row by row, or pulled whole and
/// re-sliced (the baseline arm's planner, and what these cases pin down).
const NO_GATHER: PlanOptions = PlanOptions {
    full_pull_threshold: 64,
    allow_overlap: false,
    gather_reads: false,
    gather_min_row_bytes: 0,
};

fn rows_plan(t: &MergedTable, l: &WantedLayout) -> Plan {
    plan(t, l, &NO_GATHER).unwrap()
}

#[test]
fn column_slice_of_dim0_is_one_read() {
    let w = bf16("w", &[8, 4]);
    let t = deduped(&[table(0, &[&w], &[off("w", &[0, 0], &[8, 4])])]);
    let l = layout(vec![param(
        "p",
        DType::Bf16,
        &[4, 4],
        vec![copy("w", &[2, 0], &[4, 4], 0)],
    )]);
    let p = default_plan(&t, &l);
    assert_eq!(p.reads, vec![read(0, 2 * 4 * 2, 32, Dest::Param(0), 0, 0)]);
    assert_eq!(p.tensors, vec!["w".to_string()]);
    assert_eq!(p.stats.reads, 1);
    assert_eq!(p.stats.exact_descriptors, 1);
    assert_eq!(p.stats.full_pull_sources, 0);
    assert_eq!(p.stats.wire_bytes, 32);
    assert_eq!(p.stats.written_bytes, 32);
    assert_eq!(p.stats.param_bytes, 32);
    assert_eq!(p.stats.owners, 1);
    assert!(p.staging.is_empty() && p.reslices.is_empty());
}

#[test]
fn dim1_slice_with_few_rows_reads_each_row() {
    let w = bf16("w", &[4, 8]);
    let t = deduped(&[table(3, &[&w], &[off("w", &[0, 0], &[4, 8])])]);
    let l = layout(vec![param(
        "p",
        DType::Bf16,
        &[4, 4],
        vec![copy("w", &[0, 4], &[4, 4], 0)],
    )]);
    let p = rows_plan(&t, &l);
    let want: Vec<_> = (0..4)
        .map(|r| read(3, r * 16 + 8, 8, Dest::Param(0), r * 8, 0))
        .collect();
    assert_eq!(p.reads, want);
    assert_eq!(p.stats.reads, 4);
    assert_eq!(p.stats.exact_descriptors, 4);
    assert_eq!(p.stats.descriptors_saved, 0);
    assert_eq!(p.stats.extra_wire_bytes, 0);
}

/// 128 rows of a dim-1 half exceed the default threshold of 64 runs; the two dim-0 halves
/// offered by ranks 0 and 1 tile dim 0, so the tensor is pulled whole and re-sliced.
fn row_parallel_case() -> (MergedTable, WantedLayout) {
    let w = bf16("w", &[128, 8]);
    let t = deduped(&[
        table(0, &[&w], &[off("w", &[0, 0], &[64, 8])]),
        table(1, &[&w], &[off("w", &[64, 0], &[64, 8])]),
    ]);
    let l = layout(vec![param(
        "p",
        DType::Bf16,
        &[128, 4],
        vec![copy("w", &[0, 4], &[128, 4], 0)],
    )]);
    (t, l)
}

#[test]
fn dim1_slice_with_many_rows_is_a_full_pull_and_reslice() {
    let (t, l) = row_parallel_case();
    let p = rows_plan(&t, &l);
    assert_eq!(
        p.reads,
        vec![
            read(0, 0, 64 * 16, Dest::Staging(0), 0, 0),
            read(1, 0, 64 * 16, Dest::Staging(0), 64 * 16, 0),
        ]
    );
    assert_eq!(p.staging.len(), 1);
    let s = &p.staging[0];
    assert_eq!(
        (
            s.tensor,
            s.tensor_box.offset[0],
            s.tensor_box.extent[0],
            s.bytes
        ),
        (0, 0, 128, 128 * 16)
    );
    assert_eq!(p.reslices.len(), 1);
    let r = &p.reslices[0];
    assert_eq!(r.staging, 0);
    assert_eq!(r.src_offset, 4 * 2);
    assert_eq!(r.src_strides, vec![8, 1]);
    assert_eq!(r.extent, vec![128, 4]);
    assert_eq!((r.elem, r.param, r.dst_offset), (2, 0, 0));
    assert_eq!(r.dst_strides, vec![4, 1]);
    assert!(p.reslice_disjoint);
    assert_eq!(p.stats.full_pull_sources, 1);
    assert_eq!(p.stats.exact_descriptors, 128);
    assert_eq!(p.stats.reads, 2);
    assert_eq!(p.stats.descriptors_saved, 126);
    assert_eq!(p.stats.wire_bytes, 128 * 16);
    assert_eq!(p.stats.extra_wire_bytes, 128 * 16 - 128 * 8);
    assert_eq!(p.stats.owners, 2);
}

/// A gather read of `rows` rows of `row` bytes at `pitch`.
fn gather(r: PlannedRead, row: u64, pitch: u64) -> PlannedRead {
    PlannedRead {
        src_rows: Some(reshard_core::RemoteRows {
            row_bytes: row,
            pitch,
        }),
        ..r
    }
}

#[test]
fn dim1_slice_is_one_gather_read() {
    let w = bf16("w", &[4, 8]);
    let t = deduped(&[table(3, &[&w], &[off("w", &[0, 0], &[4, 8])])]);
    let l = layout(vec![param(
        "p",
        DType::Bf16,
        &[4, 4],
        vec![copy("w", &[0, 4], &[4, 4], 0)],
    )]);
    let p = default_plan(&t, &l);
    // Columns 4..8 of each 16-byte row: 8 bytes from byte 8, four rows 16 bytes apart.
    assert_eq!(
        p.reads,
        vec![gather(read(3, 8, 32, Dest::Param(0), 0, 0), 8, 16)]
    );
    assert_eq!(p.stats.reads, 1);
    assert_eq!(p.stats.exact_descriptors, 4);
    assert_eq!(p.stats.descriptors_saved, 3);
    assert_eq!((p.stats.wire_bytes, p.stats.extra_wire_bytes), (32, 0));
    assert_ne!(p.fingerprint, rows_plan(&t, &l).fingerprint);
    // Rows shorter than `gather_min_row_bytes` (4 KiB by default) are read one by one.
    let p = plan(&t, &l, &PlanOptions::default()).unwrap();
    assert_eq!(p.stats.reads, 4);
    assert!(p.reads.iter().all(|r| r.src_rows.is_none()));
    let p = plan(
        &t,
        &l,
        &PlanOptions {
            gather_min_row_bytes: 8,
            ..PlanOptions::default()
        },
    )
    .unwrap();
    assert_eq!(p.stats.reads, 1, "rows of exactly the minimum gather");
}

#[test]
fn many_rows_of_a_column_block_are_gathered_instead_of_pulled_whole() {
    // The full-pull case: 128 rows of a dim-1 half. With gather reads each offer's rows are
    // one read of just the wanted columns: no staging, no re-slice, no extra wire bytes.
    let (t, l) = row_parallel_case();
    let p = default_plan(&t, &l);
    assert_eq!(
        p.reads,
        vec![
            gather(read(0, 8, 64 * 8, Dest::Param(0), 0, 0), 8, 16),
            gather(read(1, 8, 64 * 8, Dest::Param(0), 64 * 8, 0), 8, 16),
        ]
    );
    assert!(p.staging.is_empty() && p.reslices.is_empty());
    assert_eq!(p.stats.full_pull_sources, 0);
    assert_eq!(p.stats.exact_descriptors, 128);
    assert_eq!(p.stats.reads, 2);
    assert_eq!((p.stats.wire_bytes, p.stats.extra_wire_bytes), (128 * 8, 0));
    // A destination whose rows do not follow one another (the column half lands in a wider
    // parameter) is no gather: the rows land strided, so the full pull stays.
    let wide = layout(vec![param(
        "p",
        DType::Bf16,
        &[128, 6],
        vec![WantedCopy {
            dst_strides: vec![6, 1],
            ..copy("w", &[0, 4], &[128, 4], 0)
        }],
    )]);
    let p = default_plan(&t, &wide);
    assert!(
        p.reads.iter().all(|r| r.src_rows.is_none()),
        "{:?}",
        p.reads
    );
    assert_eq!(p.stats.full_pull_sources, 1);
}

#[test]
fn full_pull_threshold_is_configurable() {
    let (t, l) = row_parallel_case();
    let exact = plan(
        &t,
        &l,
        &PlanOptions {
            full_pull_threshold: 128,
            gather_reads: false,
            ..PlanOptions::default()
        },
    )
    .unwrap();
    assert_eq!(exact.stats.reads, 128);
    assert_eq!(exact.stats.full_pull_sources, 0);
    assert!(exact.staging.is_empty() && exact.reslices.is_empty());
    let pulled = plan(
        &t,
        &l,
        &PlanOptions {
            full_pull_threshold: 127,
            gather_reads: false,
            ..PlanOptions::default()
        },
    )
    .unwrap();
    assert_eq!(pulled.stats.full_pull_sources, 1);
    assert_ne!(exact.fingerprint, pulled.fingerprint);
}

#[test]
fn staging_holds_only_offers_the_full_pulled_copies_touch() {
    // Four dim-0 blocks of 32 rows; the copy wants rows 40..100 of a dim-1 half (60 runs,
    // threshold 16): blocks 1..3 are staged, block 0 is never read.
    let w = bf16("w", &[128, 8]);
    let t = deduped(&[table(
        2,
        &[&w],
        &[
            off("w", &[0, 0], &[32, 8]),
            off("w", &[32, 0], &[32, 8]),
            off("w", &[64, 0], &[32, 8]),
            off("w", &[96, 0], &[32, 8]),
        ],
    )]);
    let l = layout(vec![param(
        "p",
        DType::Bf16,
        &[60, 4],
        vec![copy("w", &[40, 4], &[60, 4], 0)],
    )]);
    let opts = PlanOptions {
        full_pull_threshold: 16,
        gather_reads: false,
        ..PlanOptions::default()
    };
    let p = plan(&t, &l, &opts).unwrap();
    let s = &p.staging[0];
    assert_eq!(
        (s.tensor_box.offset[0], s.tensor_box.extent[0], s.bytes),
        (32, 96, 96 * 16)
    );
    assert_eq!(p.stats.reads, 3);
    // The three blocks are adjacent at one owner and in staging: one read on the wire.
    assert_eq!(
        p.reads,
        vec![read(2, 32 * 16, 96 * 16, Dest::Staging(0), 0, 0)]
    );
    assert_eq!(p.stats.coalesced_reads, 1);
    assert_eq!(p.reslices[0].src_offset, (8 * 8 + 4) * 2);
    assert_eq!(p.stats.extra_wire_bytes, 96 * 16 - 60 * 8);
}

#[test]
fn two_copies_of_one_tensor_share_one_staging_buffer() {
    let w = bf16("w", &[128, 8]);
    let t = deduped(&[table(0, &[&w], &[off("w", &[0, 0], &[128, 8])])]);
    let l = layout(vec![
        param(
            "a",
            DType::Bf16,
            &[128, 4],
            vec![copy("w", &[0, 0], &[128, 4], 0)],
        ),
        param(
            "b",
            DType::Bf16,
            &[128, 4],
            vec![copy("w", &[0, 4], &[128, 4], 0)],
        ),
    ]);
    let p = rows_plan(&t, &l);
    assert_eq!(p.stats.full_pull_sources, 1);
    assert_eq!(p.stats.reads, 1);
    assert_eq!(p.reslices.len(), 2);
    assert_eq!((p.reslices[0].param, p.reslices[1].param), (0, 1));
    assert!(p.reslice_disjoint);
    // Both halves together are the whole tensor: nothing extra on the wire.
    assert_eq!(p.stats.extra_wire_bytes, 0);
}

#[test]
fn overlapping_reslice_destinations_are_reported() {
    let w = bf16("w", &[128, 8]);
    let t = deduped(&[table(0, &[&w], &[off("w", &[0, 0], &[128, 8])])]);
    // Two copies write alternating columns of one parameter: their bytes are disjoint, but
    // their [first, last] spans overlap, and the check is deliberately conservative.
    let strided = |col: u64| WantedCopy {
        tensor: "w".into(),
        src_box: TensorBox::new(vec![0, col], vec![128, 1]),
        dst_offset: col * 2,
        dst_strides: vec![2, 1],
    };
    let l = layout(vec![param(
        "p",
        DType::Bf16,
        &[128, 2],
        vec![strided(0), strided(1)],
    )]);
    let p = default_plan(&t, &l);
    assert_eq!(p.reslices.len(), 2);
    assert!(!p.reslice_disjoint);
}

#[test]
fn non_tiling_offers_fall_back_to_exact_reads() {
    // Offers split along dim 1 do not tile dim 0: 2 x 128 per-row reads despite the threshold.
    let w = bf16("w", &[128, 8]);
    let t = deduped(&[
        table(0, &[&w], &[off("w", &[0, 0], &[128, 4])]),
        table(1, &[&w], &[off("w", &[0, 4], &[128, 4])]),
    ]);
    let l = layout(vec![param(
        "p",
        DType::Bf16,
        &[128, 4],
        vec![copy("w", &[0, 2], &[128, 4], 0)],
    )]);
    let p = default_plan(&t, &l);
    assert_eq!(p.stats.full_pull_sources, 0);
    assert_eq!(p.stats.exact_descriptors, 256);
    assert_eq!(p.stats.reads, 256);
    assert_eq!(p.stats.descriptors_saved, 0);
    let first = p.reads.iter().find(|r| r.owner == 1).unwrap();
    assert_eq!((first.src_offset, first.len, first.dst_offset), (0, 4, 4));
}

#[test]
fn fused_destination_places_three_sources_and_coalesces_them() {
    let (q, k, v) = (bf16("q", &[4, 2]), bf16("k", &[2, 2]), bf16("v", &[2, 2]));
    let t = deduped(&[table(
        5,
        &[&q, &k, &v],
        &[
            off("q", &[0, 0], &[4, 2]),
            off("k", &[0, 0], &[2, 2]),
            off("v", &[0, 0], &[2, 2]),
        ],
    )]);
    let l = layout(vec![param(
        "qkv",
        DType::Bf16,
        &[8, 2],
        vec![
            copy("q", &[0, 0], &[4, 2], 0),
            copy("k", &[0, 0], &[2, 2], 16),
            copy("v", &[0, 0], &[2, 2], 24),
        ],
    )]);
    let p = default_plan(&t, &l);
    assert_eq!(p.tensors, vec!["q", "k", "v"]);
    assert_eq!(p.stats.reads, 3);
    assert_eq!(p.stats.copies, 3);
    assert_eq!(p.stats.written_bytes, 32);
    // Adjacent at the owner and in the parameter: one wire read, tagged with the first tensor.
    assert_eq!(p.reads, vec![read(5, 0, 32, Dest::Param(0), 0, 0)]);
    assert_eq!(p.stats.coalesced_reads, 1);
    assert_eq!(p.checks.len(), 3);
    assert_eq!(p.checks[1].dst_offset, 16);
}

#[test]
fn adjacent_offers_of_one_owner_coalesce_but_gaps_do_not() {
    let w = bf16("w", &[8, 4]);
    let whole = |gap| {
        deduped(&[table(
            0,
            &[&w],
            &[
                off("w", &[0, 0], &[4, 4]),
                Off {
                    gap,
                    ..off("w", &[4, 0], &[4, 4])
                },
            ],
        )])
    };
    let l = layout(vec![param(
        "p",
        DType::Bf16,
        &[8, 4],
        vec![copy("w", &[0, 0], &[8, 4], 0)],
    )]);
    let p = default_plan(&whole(0), &l);
    assert_eq!((p.stats.reads, p.stats.coalesced_reads), (2, 1));
    assert_eq!(p.reads, vec![read(0, 0, 64, Dest::Param(0), 0, 0)]);
    let p = default_plan(&whole(2), &l);
    assert_eq!((p.stats.reads, p.stats.coalesced_reads), (2, 2));
}

#[test]
fn runs_contiguous_on_both_sides_merge_within_an_overlap() {
    // Dim 1 has extent 1 and an arbitrary destination stride, so the rule does not collapse it
    // (2 exact runs), yet the two runs are adjacent on both sides and become one read.
    let w = bf16("w", &[2, 1, 4]);
    let t = deduped(&[table(0, &[&w], &[off("w", &[0, 0, 0], &[2, 1, 4])])]);
    let c = WantedCopy {
        tensor: "w".into(),
        src_box: TensorBox::new(vec![0, 0, 0], vec![2, 1, 4]),
        dst_offset: 0,
        dst_strides: vec![4, 99, 1],
    };
    let l = layout(vec![param("p", DType::Bf16, &[8], vec![c])]);
    let p = default_plan(&t, &l);
    assert_eq!(p.stats.exact_descriptors, 2);
    assert_eq!(p.stats.reads, 1);
    assert_eq!(p.reads, vec![read(0, 0, 16, Dest::Param(0), 0, 0)]);
}

#[test]
fn non_unit_innermost_destination_stride_is_one_run_per_element() {
    let w = TensorSpec::new("w", DType::F32, vec![3]);
    let t = deduped(&[table(0, &[&w], &[off("w", &[0], &[3])])]);
    let c = WantedCopy {
        tensor: "w".into(),
        src_box: TensorBox::new(vec![0], vec![3]),
        dst_offset: 4,
        dst_strides: vec![2],
    };
    let l = layout(vec![param("p", DType::F32, &[6], vec![c])]);
    // Without digests: nothing to check, one exact read per element.
    let bare = deduped(&[bare_table(0, &[&w], &[off("w", &[0], &[3])])]);
    let p = default_plan(&bare, &l);
    let want: Vec<_> = (0..3)
        .map(|i| read(0, 4 * i, 4, Dest::Param(0), 4 + 8 * i, 0))
        .collect();
    assert_eq!(p.reads, want);
    assert!(p.checks.is_empty());
    // With digests the scattered elements cannot be hashed where they land: the offer is
    // staged, checked there whole, and re-sliced (no extra wire bytes).
    let p = default_plan(&t, &l);
    assert_eq!(p.reads, vec![read(0, 0, 12, Dest::Staging(0), 0, 0)]);
    assert_eq!(p.checks.len(), 1);
    let c = p.checks[0];
    assert_eq!(
        (c.part, c.dst, c.rows, c.row_bytes, c.seg_bytes),
        (CheckedPart::Whole, Dest::Staging(0), 1, 12, 4)
    );
    assert_eq!((p.stats.extra_wire_bytes, p.stats.checked_bytes), (0, 12));
    assert_eq!(
        (p.reslices[0].dst_offset, &p.reslices[0].dst_strides),
        (4, &vec![2])
    );
}

#[test]
fn missing_coverage_names_tensor_and_an_unoffered_box() {
    let w = bf16("w", &[8, 4]);
    let t = deduped(&[table(
        0,
        &[&w],
        &[off("w", &[0, 0], &[4, 4]), off("w", &[4, 0], &[4, 2])],
    )]);
    let l = layout(vec![param(
        "p",
        DType::Bf16,
        &[8, 4],
        vec![copy("w", &[0, 0], &[8, 4], 0)],
    )]);
    let e = plan(&t, &l, &PlanOptions::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::MissingCoverage);
    assert_eq!(e.context().tensor.as_deref(), Some("w"));
    match e.detail() {
        Some(ErrorDetail::MissingCoverage { tensor, missing }) => {
            assert_eq!(tensor, "w");
            assert_eq!(missing, &TensorBox::new(vec![4, 2], vec![4, 2]));
        }
        other => panic!("unexpected detail {other:?}"),
    }
    // The same holds on the no-dedup arm, whose coverage check cannot rely on volumes.
    let e = plan(
        &t,
        &l,
        &PlanOptions {
            allow_overlap: true,
            ..PlanOptions::default()
        },
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::MissingCoverage);
}

#[test]
fn a_tensor_nobody_offers_is_missing_as_a_whole() {
    let w = bf16("w", &[8, 4]);
    let t = deduped(&[table(0, &[&w], &[off("w", &[0, 0], &[8, 4])])]);
    let l = layout(vec![param(
        "p",
        DType::Bf16,
        &[2, 4],
        vec![copy("x", &[1, 0], &[2, 4], 0)],
    )]);
    let e = plan(&t, &l, &PlanOptions::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::MissingCoverage);
    assert_eq!(e.context().tensor.as_deref(), Some("x"));
    match e.detail() {
        Some(ErrorDetail::MissingCoverage { tensor, missing }) => {
            assert_eq!(tensor, "x");
            assert_eq!(missing, &TensorBox::new(vec![1, 0], vec![2, 4]));
        }
        other => panic!("unexpected detail {other:?}"),
    }
}

#[test]
fn partially_overlapping_offers_are_an_error() {
    let w = bf16("w", &[8, 4]);
    let t = deduped(&[
        table(0, &[&w], &[off("w", &[0, 0], &[6, 4])]),
        table(1, &[&w], &[off("w", &[4, 0], &[4, 4])]),
    ]);
    let l = layout(vec![param(
        "p",
        DType::Bf16,
        &[8, 4],
        vec![copy("w", &[0, 0], &[8, 4], 0)],
    )]);
    let e = plan(&t, &l, &PlanOptions::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OverlappingOffers);
    assert_eq!(e.context().tensor.as_deref(), Some("w"));
    assert_eq!(e.context().owner, Some(0));
    // A copy that stays clear of the overlap is fine.
    let l = layout(vec![param(
        "p",
        DType::Bf16,
        &[2, 4],
        vec![copy("w", &[6, 0], &[2, 4], 0)],
    )]);
    assert_eq!(default_plan(&t, &l).stats.reads, 1);
}

#[test]
fn allow_overlap_arm_reads_every_replica() {
    let w = bf16("w", &[4, 4]);
    let tables: Vec<_> = (0..3)
        .map(|r| table(r, &[&w], &[off("w", &[0, 0], &[4, 4])]))
        .collect();
    let merged = merge(&tables).unwrap();
    let l = layout(vec![param(
        "p",
        DType::Bf16,
        &[2, 4],
        vec![copy("w", &[2, 0], &[2, 4], 0)],
    )]);
    let e = plan(&merged, &l, &PlanOptions::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OverlappingOffers);
    let opts = PlanOptions {
        allow_overlap: true,
        ..PlanOptions::default()
    };
    let p = plan(&merged, &l, &opts).unwrap();
    assert_eq!(p.stats.reads, 3);
    assert_eq!(p.stats.owners, 3);
    assert_eq!(p.stats.wire_bytes, 3 * 16);
    assert_eq!(p.stats.written_bytes, 16);
    assert!(p
        .reads
        .iter()
        .all(|r| r.src_offset == 16 && r.dst_offset == 0));
    let d = default_plan(&deduped(&tables), &l);
    assert_eq!(d.stats.reads, 1);
    assert_eq!(d.reads[0].owner, 0);
}

#[test]
fn replicated_offers_do_not_tile_so_no_dedup_reads_per_row() {
    // The docs/design.md §8 o_proj counterfactual in small: 2 replicas of a whole tensor, a dim-1
    // half wanted. With dedup: one full pull; without: 2 x 128 exact rows.
    let w = bf16("w", &[128, 8]);
    let tables: Vec<_> = (0..2)
        .map(|r| table(r, &[&w], &[off("w", &[0, 0], &[128, 8])]))
        .collect();
    let l = layout(vec![param(
        "p",
        DType::Bf16,
        &[128, 4],
        vec![copy("w", &[0, 4], &[128, 4], 0)],
    )]);
    let d = rows_plan(&deduped(&tables), &l);
    assert_eq!((d.stats.reads, d.stats.full_pull_sources), (1, 1));
    let opts = PlanOptions {
        allow_overlap: true,
        gather_reads: false,
        ..PlanOptions::default()
    };
    let n = plan(&merge(&tables).unwrap(), &l, &opts).unwrap();
    assert_eq!((n.stats.reads, n.stats.full_pull_sources), (256, 0));
    assert_eq!(n.stats.exact_descriptors, 256);
}

#[test]
fn digest_checks_cover_whole_offers_and_full_pulls() {
    let (a, b) = (bf16("a", &[4, 4]), bf16("b", &[128, 8]));
    let t = deduped(&[table(
        0,
        &[&a, &b],
        &[
            off("a", &[0, 0], &[2, 4]),
            off("a", &[2, 0], &[2, 4]),
            off("b", &[0, 0], &[128, 8]),
        ],
    )]);
    let l = layout(vec![
        // Rows 1..4 of `a`: the second offer lands whole, the first only its last row (a
        // whole row chunk of it: chunks are one row on this small offer).
        param(
            "pa",
            DType::Bf16,
            &[3, 4],
            vec![copy("a", &[1, 0], &[3, 4], 0)],
        ),
        param(
            "pb",
            DType::Bf16,
            &[128, 4],
            vec![copy("b", &[0, 0], &[128, 4], 0)],
        ),
    ]);
    let p = rows_plan(&t, &l);
    assert_eq!(p.checks.len(), 3);
    let c = &p.checks[0];
    assert_eq!(
        (c.tensor, c.owner, c.src_region, c.part),
        (0, 0, 7, CheckedPart::Chunk(1))
    );
    assert_eq!(
        (c.src_offset, c.dst, c.dst_offset, c.bytes()),
        (0, Dest::Param(0), 0, 8)
    );
    let c = &p.checks[1];
    assert_eq!(
        (c.tensor, c.owner, c.src_region, c.part),
        (0, 0, 7, CheckedPart::Whole)
    );
    assert_eq!(
        (c.src_offset, c.dst, c.dst_offset, c.bytes()),
        (16, Dest::Param(0), 8, 16)
    );
    let c = &p.checks[2];
    assert_eq!(
        (c.tensor, c.src_offset, c.dst, c.dst_offset, c.part),
        (1, 32, Dest::Staging(0), 0, CheckedPart::Whole)
    );
    assert_eq!(c.bytes(), 128 * 16);
    assert_eq!(p.stats.checked_bytes, 8 + 16 + 128 * 16);
    assert_eq!(p.stats.checked_bytes, p.stats.wire_bytes);
}

#[test]
fn fingerprint_is_stable_and_tracks_the_layout() {
    let (t, l) = row_parallel_case();
    let a = default_plan(&t, &l);
    let b = default_plan(&t, &l);
    assert_eq!(a, b);
    assert_eq!(a.fingerprint, a.compute_fingerprint());
    let mut moved = l.clone();
    moved.params[0].shape = vec![129, 4];
    moved.params[0].copies[0].dst_offset = 8;
    let c = default_plan(&t, &moved);
    assert_ne!(a.fingerprint, c.fingerprint);
}

#[test]
fn layout_errors_name_tensor_and_parameter() {
    let w = bf16("w", &[8, 4]);
    let t = deduped(&[table(0, &[&w], &[off("w", &[0, 0], &[8, 4])])]);
    let wrong_dtype = layout(vec![param(
        "p",
        DType::F32,
        &[4, 4],
        vec![copy("w", &[0, 0], &[4, 4], 0)],
    )]);
    let e = plan(&t, &wrong_dtype, &PlanOptions::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Layout);
    assert_eq!(e.context().tensor.as_deref(), Some("w"));
    let outside = layout(vec![param(
        "p",
        DType::Bf16,
        &[4, 4],
        vec![copy("w", &[6, 0], &[4, 4], 0)],
    )]);
    let e = plan(&t, &outside, &PlanOptions::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Layout);
    assert_eq!(e.context().tensor.as_deref(), Some("w"));
    let wrong_rank = layout(vec![param(
        "p",
        DType::Bf16,
        &[4],
        vec![copy("w", &[0], &[4], 0)],
    )]);
    let e = plan(&t, &wrong_rank, &PlanOptions::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Layout);
}

#[test]
fn empty_layout_is_an_empty_plan() {
    let p = default_plan(&MergedTable::default(), &WantedLayout::default());
    assert!(p.reads.is_empty() && p.staging.is_empty() && p.checks.is_empty());
    assert!(p.reslice_disjoint);
    assert_eq!(p.stats, Default::default());
}

/// `t` with part digests on a grid of `rows` by `cols` (placeholder values).
fn with_grid(mut t: ShardTable, rows: u64, cols: u64) -> ShardTable {
    for o in &mut t.offers {
        let v = MatrixView::of(&o.tensor_box.extent);
        o.parts = Some(PartDigests {
            chunk_rows: rows,
            chunks: vec![0; v.rows.div_ceil(rows) as usize],
            block_cols: cols,
            blocks: vec![0; v.cols.div_ceil(cols) as usize],
        });
    }
    t
}

#[test]
fn a_partial_row_read_is_checked_by_whole_chunks_or_staged() {
    let w = bf16("w", &[16, 4]);
    // TP2 rank 1: rows 8..16 of a whole-tensor offer.
    let l = layout(vec![param(
        "p",
        DType::Bf16,
        &[8, 4],
        vec![copy("w", &[8, 0], &[8, 4], 0)],
    )]);
    let whole = || table(0, &[&w], &[off("w", &[0, 0], &[16, 4])]);
    let p = default_plan(&deduped(&[with_grid(whole(), 2, 4)]), &l);
    let chunks: Vec<_> = p
        .checks
        .iter()
        .map(|c| (c.part, c.dst_offset, c.bytes()))
        .collect();
    assert_eq!(
        chunks,
        vec![
            (CheckedPart::Chunk(4), 0, 16),
            (CheckedPart::Chunk(5), 16, 16),
            (CheckedPart::Chunk(6), 32, 16),
            (CheckedPart::Chunk(7), 48, 16)
        ]
    );
    assert_eq!(p.reads, vec![read(0, 64, 64, Dest::Param(0), 0, 0)]);
    assert_eq!((p.stats.checked_bytes, p.stats.extra_wire_bytes), (64, 0));
    // Chunks of 3 rows: 8 is not a chunk start, so rows 6..16 (chunks 2..6) are staged and
    // checked there; the copy re-slices rows 8..16 out of them.
    let p = default_plan(&deduped(&[with_grid(whole(), 3, 4)]), &l);
    let chunks: Vec<_> = p
        .checks
        .iter()
        .map(|c| (c.part, c.dst, c.dst_offset, c.rows))
        .collect();
    let s = Dest::Staging(0);
    assert_eq!(
        chunks,
        vec![
            (CheckedPart::Chunk(2), s, 0, 3),
            (CheckedPart::Chunk(3), s, 24, 3),
            (CheckedPart::Chunk(4), s, 48, 3),
            (CheckedPart::Chunk(5), s, 72, 1)
        ]
    );
    assert_eq!(p.reads, vec![read(0, 48, 80, s, 0, 0)]);
    assert_eq!(
        p.staging[0].tensor_box,
        TensorBox::new(vec![6, 0], vec![10, 4])
    );
    assert_eq!(
        (p.reslices[0].src_offset, p.reslices[0].dst_offset),
        (16, 0)
    );
    assert_eq!(
        (
            p.stats.checked_bytes,
            p.stats.extra_wire_bytes,
            p.stats.staged_parts
        ),
        (80, 16, 1)
    );
    // A whole digest alone: the whole offer is staged.
    let mut t = whole();
    t.offers[0].parts = None;
    let p = default_plan(&deduped(&[t]), &l);
    assert_eq!(p.reads, vec![read(0, 0, 128, s, 0, 0)]);
    assert_eq!((p.stats.checked_bytes, p.stats.extra_wire_bytes), (128, 64));
    assert_eq!((p.stats.staged_offers, p.stats.staged_parts), (1, 0));
    // No digests at all: read exactly, nothing to check.
    let bare = deduped(&[bare_table(0, &[&w], &[off("w", &[0, 0], &[16, 4])])]);
    let p = default_plan(&bare, &l);
    assert!(p.checks.is_empty());
    assert_eq!(p.reads, vec![read(0, 64, 64, Dest::Param(0), 0, 0)]);
}

#[test]
fn a_partial_column_read_is_checked_by_whole_blocks_or_staged() {
    // Row-parallel [4, 16] from one TP1 publisher into a TP4 receiver's quarter (columns 4..8):
    // one run per row, checked by whole column blocks where they land.
    let w = bf16("w", &[4, 16]);
    let l = layout(vec![param(
        "p",
        DType::Bf16,
        &[4, 4],
        vec![copy("w", &[0, 4], &[4, 4], 0)],
    )]);
    let whole = || table(0, &[&w], &[off("w", &[0, 0], &[4, 16])]);
    let p = rows_plan(&deduped(&[with_grid(whole(), 4, 2)]), &l);
    let got: Vec<_> = p
        .checks
        .iter()
        .map(|c| {
            (
                c.part,
                c.dst_offset,
                c.rows,
                c.row_bytes,
                c.row_stride,
                c.seg_bytes,
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (CheckedPart::Block(2), 0, 4, 4, 8, 4),
            (CheckedPart::Block(3), 4, 4, 4, 8, 4)
        ]
    );
    assert_eq!(p.stats.reads, 4);
    assert_eq!((p.stats.checked_bytes, p.stats.wire_bytes), (32, 32));
    // Blocks of 3 columns: 4..8 sits inside blocks 1..3 (columns 3..9), which are staged,
    // one read per row, and checked there; 8 extra bytes for 32 wanted.
    let p = rows_plan(&deduped(&[with_grid(whole(), 4, 3)]), &l);
    let s = Dest::Staging(0);
    let got: Vec<_> = p
        .checks
        .iter()
        .map(|c| (c.part, c.dst, c.dst_offset, c.row_bytes, c.row_stride))
        .collect();
    assert_eq!(
        got,
        vec![
            (CheckedPart::Block(1), s, 0, 6, 12),
            (CheckedPart::Block(2), s, 6, 6, 12)
        ]
    );
    let want: Vec<_> = (0..4)
        .map(|r| read(0, 32 * r + 6, 12, s, 12 * r, 0))
        .collect();
    assert_eq!(p.reads, want);
    assert_eq!(
        p.staging[0].tensor_box,
        TensorBox::new(vec![0, 3], vec![4, 6])
    );
    assert_eq!(
        (
            p.stats.checked_bytes,
            p.stats.wire_bytes,
            p.stats.extra_wire_bytes
        ),
        (48, 48, 16)
    );
    // With gather reads, the same two cases: the checked blocks are one gather straight into
    // the parameter, and the staged blocks one gather into staging, with the same checks.
    let p = default_plan(&deduped(&[with_grid(whole(), 4, 2)]), &l);
    assert_eq!(
        p.reads,
        vec![gather(read(0, 8, 32, Dest::Param(0), 0, 0), 8, 32)]
    );
    assert_eq!((p.stats.checked_bytes, p.stats.wire_bytes), (32, 32));
    let p = default_plan(&deduped(&[with_grid(whole(), 4, 3)]), &l);
    assert_eq!(p.reads, vec![gather(read(0, 6, 48, s, 0, 0), 12, 32)]);
    assert_eq!(p.checks.len(), 2);
    assert_eq!(
        (
            p.stats.checked_bytes,
            p.stats.wire_bytes,
            p.stats.extra_wire_bytes
        ),
        (48, 48, 16)
    );
}

#[test]
fn whole_offer_rows_landing_strided_are_gathered() {
    // Two column blocks of [4, 8] (publisher TP2 row-parallel) into a [4, 8] parameter:
    // each offer's rows land 16 bytes apart.
    let w = bf16("w", &[4, 8]);
    let t = deduped(&[
        table(0, &[&w], &[off("w", &[0, 0], &[4, 4])]),
        table(1, &[&w], &[off("w", &[0, 4], &[4, 4])]),
    ]);
    let l = layout(vec![param(
        "p",
        DType::Bf16,
        &[4, 8],
        vec![copy("w", &[0, 0], &[4, 8], 0)],
    )]);
    let p = default_plan(&t, &l);
    let got: Vec<_> = p
        .checks
        .iter()
        .map(|c| {
            (
                c.owner,
                c.part,
                c.dst_offset,
                c.rows,
                c.row_bytes,
                c.row_stride,
            )
        })
        .collect();
    let whole = CheckedPart::Whole;
    assert_eq!(got, vec![(0, whole, 0, 4, 8, 16), (1, whole, 8, 4, 8, 16)]);
}

#[test]
fn whole_offers_inside_a_copy_are_staged_instead_of_read_row_by_row() {
    // Row-parallel [128, 64] from TP4 publishers (column blocks of 16) into a TP2 receiver's
    // column half [128, 32]: the half holds two whole blocks, each 128 rows of 16 columns.
    let w = bf16("w", &[128, 64]);
    let tables: Vec<_> = (0..4)
        .map(|r| table(r, &[&w], &[off("w", &[0, 16 * r as u64], &[128, 16])]))
        .collect();
    let t = deduped(&tables);
    let c = WantedCopy {
        tensor: "w".into(),
        src_box: TensorBox::new(vec![0, 32], vec![128, 32]),
        dst_offset: 0,
        dst_strides: vec![32, 1],
    };
    let l = layout(vec![param("p", DType::Bf16, &[128, 32], vec![c])]);
    let p = default_plan(&t, &l);
    assert_eq!(p.stats.exact_descriptors, 256);
    assert_eq!(p.stats.reads, 2, "one read per whole offer");
    assert_eq!((p.stats.staged_offers, p.stats.full_pull_sources), (2, 0));
    assert_eq!(p.stats.extra_wire_bytes, 0);
    assert_eq!(p.stats.wire_bytes, 128 * 32 * 2);
    let owners: Vec<_> = p.reads.iter().map(|r| (r.owner, r.len, r.dst)).collect();
    assert_eq!(
        owners,
        vec![(2, 4096, Dest::Staging(0)), (3, 4096, Dest::Staging(1))]
    );
    // Block of owner 3 lands at column 16 of the parameter, rows 64 bytes apart.
    let r = &p.reslices[1];
    assert_eq!((r.src_offset, r.dst_offset), (0, 32));
    assert_eq!(
        (r.src_strides.clone(), r.dst_strides.clone()),
        (vec![16, 1], vec![32, 1])
    );
    assert!(p
        .staging
        .iter()
        .all(|s| s.kind == reshard_core::StagingKind::Offer));
    assert_eq!(
        p.checks.len(),
        2,
        "each staged offer is digest-checked whole"
    );
    // Below the threshold the same copy stays exact.
    let exact = plan(
        &t,
        &l,
        &PlanOptions {
            full_pull_threshold: 1000,
            ..PlanOptions::default()
        },
    )
    .unwrap();
    assert_eq!((exact.stats.reads, exact.stats.staged_offers), (256, 0));
}

/// Copies of huge (valid) boxes: byte statistics that sum over copies exceed u64 and must not
/// overflow (found while fuzzing merge -> dedup -> plan).
#[test]
fn huge_boxes_do_not_overflow_plan_statistics() {
    let w = TensorSpec::new("w", DType::U8, vec![1 << 62]);
    let t = deduped(&[bare_table(0, &[&w], &[off("w", &[0], &[1 << 62])])]);
    let whole = || copy("w", &[0], &[1 << 62], 0);
    let five = || vec![whole(), whole(), whole(), whole(), whole()];
    let l = layout(vec![
        param("p", DType::U8, &[1 << 62], five()),
        param("q", DType::U8, &[1 << 62], five()),
        param("r", DType::U8, &[1 << 62], five()),
        param("s", DType::U8, &[1 << 62], five()),
    ]);
    let opts = PlanOptions {
        allow_overlap: true,
        ..PlanOptions::default()
    };
    match plan(&t, &l, &opts) {
        Ok(p) => assert_eq!(p.stats.param_bytes, u64::MAX),
        Err(e) => assert_ne!(e.kind(), ErrorKind::Internal, "{e}"),
    }
}
