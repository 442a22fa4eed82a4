//! Digests: XXH3-128 (chosen) against BLAKE3 on a 64 MiB buffer; twox-hash's XXH3 (SIMD path
//! chosen at run time) against xxhash-rust's (fixed at compile time: SSE2 on a portable build),
//! one-shot from memory and per 2 KiB segment in cache, as a copy that hashes uses it; and the segment folds a
//! receiver computes to check bytes (256-byte and 2 KiB segments; one expert at the standard
//! grid's 1 KiB); and what a publisher pays per step to digest its offers: today's whole digest with row-chunk and column-block digests
//! (`PartDigests::compute`, docs/design.md §6) against the schema-2 scheme it replaced (a
//! streaming whole XXH3-128 plus eight row-chunk XXH3-128 digests, one pass), on the same bytes
//! in the same run.

#![allow(missing_docs)] // criterion_group! generates undocumented items.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rayon::prelude::*;
use reshard_core::PartDigests;

fn bytes(len: u64, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| ((i ^ seed).wrapping_mul(2654435761) >> 13) as u8)
        .collect()
}

fn digests(c: &mut Criterion) {
    let buf = bytes(64 << 20, 0);
    let mut g = c.benchmark_group("digest_64MiB");
    g.throughput(Throughput::Bytes(buf.len() as u64));
    g.sample_size(10);
    g.bench_function("xxh3_128", |b| {
        b.iter(|| twox_hash::XxHash3_128::oneshot(&buf))
    });
    g.bench_function("blake3", |b| b.iter(|| blake3::hash(&buf)));
    // What a receiver computes to check the same bytes as rows of 4 KiB in 16 column blocks
    // (a [*, 2048] BF16 tensor): one XXH3-64 per 256-byte segment, folded.
    g.bench_function("segment_fold_256B", |b| {
        b.iter(|| {
            let mut f = reshard_core::SegmentFold::new();
            for row in buf.chunks(4096) {
                f.row(row, 256);
            }
            f.whole()
        })
    });
    g.bench_function("segment_fold_2KiB", |b| {
        b.iter(|| {
            let mut f = reshard_core::SegmentFold::new();
            for row in buf.chunks(16384) {
                f.row(row, 2048);
            }
            f.whole()
        })
    });
    g.finish();
    // One expert's gate_proj ([768, 2048] BF16, 3 MiB, in cache) checked whole: the plain
    // one-shot XXH3-128 of schema 2 against the fold of its segments on the standard grid.
    let gate = bytes(768 * 2048 * 2, 7);
    let mut g = c.benchmark_group("check_expert_3MiB");
    g.throughput(Throughput::Bytes(gate.len() as u64));
    g.bench_function("plain_xxh3_128", |b| {
        b.iter(|| twox_hash::XxHash3_128::oneshot(&gate))
    });
    g.bench_function("segment_fold", |b| {
        b.iter(|| PartDigests::compute(&gate, &[768, 2048], 2).0)
    });
    g.finish();
}

/// The schema-2 publisher digests of one offer: the whole XXH3-128, streamed, and one XXH3-128
/// per eighth of its rows, each chunk hashed while in cache.
fn schema2(bytes: &[u8], rows: u64) -> ([u8; 16], Vec<u128>) {
    let per = rows.div_ceil(8).max(1);
    let chunk = (per * (bytes.len() as u64 / rows.max(1))).max(1) as usize;
    let mut whole = twox_hash::XxHash3_128::new();
    let chunks = bytes
        .chunks(chunk)
        .map(|c| {
            whole.write(c);
            twox_hash::XxHash3_128::oneshot(c)
        })
        .collect();
    (whole.finish_128().to_le_bytes(), chunks)
}

/// One EP8 publisher rank of Qwen3-30B-A3B's layer, BF16: its attention (replicated under EP),
/// norms, router and 16 whole experts, digested as a publisher does (offers in parallel).
fn publisher_step(c: &mut Criterion) {
    let shapes: Vec<Vec<u64>> = [
        vec![
            vec![4096, 2048],
            vec![512, 2048],
            vec![512, 2048],
            vec![2048, 4096],
        ],
        vec![
            vec![128],
            vec![128],
            vec![2048],
            vec![2048],
            vec![128, 2048],
        ],
        (0..16)
            .flat_map(|_| [vec![768, 2048], vec![768, 2048], vec![2048, 768]])
            .collect(),
    ]
    .concat();
    let offers: Vec<(Vec<u8>, Vec<u64>)> = shapes
        .into_iter()
        .enumerate()
        .map(|(i, s)| (bytes(2 * s.iter().product::<u64>(), i as u64), s))
        .collect();
    let total: u64 = offers.iter().map(|(b, _)| b.len() as u64).sum();
    let mut g = c.benchmark_group("publisher_digests_qwen3_layer_ep8_rank");
    g.throughput(Throughput::Bytes(total));
    g.sample_size(20);
    g.bench_function("schema2_whole_and_8_row_chunks", |b| {
        b.iter(|| {
            offers
                .par_iter()
                .map(|(bytes, s)| schema2(bytes, s[0]))
                .collect::<Vec<_>>()
        })
    });
    g.bench_function("plain_whole_plus_parts", |b| {
        b.iter(|| {
            offers
                .par_iter()
                .map(|(bytes, s)| {
                    let mut whole = twox_hash::XxHash3_128::new();
                    let v = reshard_core::MatrixView::of(s);
                    let row = (v.cols * v.inner * 2) as usize;
                    let (_, bc) = v.grid(2);
                    let mut f = reshard_core::SegmentFold::new();
                    for r in bytes.chunks(row) {
                        whole.write(r);
                        f.row(r, bc * v.inner * 2);
                    }
                    (whole.finish_128(), f.part())
                })
                .collect::<Vec<_>>()
        })
    });
    g.bench_function("whole_row_chunks_and_column_blocks", |b| {
        b.iter(|| {
            offers
                .par_iter()
                .map(|(bytes, s)| PartDigests::compute(bytes, s, 2))
                .collect::<Vec<_>>()
        })
    });
    g.finish();
}

/// The same XXH3 from the two implementations, in one run: a 64 MiB buffer hashed whole (from
/// memory, as a publisher digests an offer) and a 256 KiB block hashed per 2 KiB segment (in
/// cache, as a backend hashes what it just copied).
fn implementations(c: &mut Criterion) {
    let buf = bytes(64 << 20, 3);
    let mut g = c.benchmark_group("xxh3_64MiB_one_shot");
    g.throughput(Throughput::Bytes(buf.len() as u64));
    g.sample_size(10);
    g.bench_function("twox_hash", |b| {
        b.iter(|| twox_hash::XxHash3_128::oneshot(&buf))
    });
    g.bench_function("xxhash_rust", |b| {
        b.iter(|| xxhash_rust::xxh3::xxh3_128(&buf))
    });
    g.finish();
    let block = &buf[..256 << 10];
    let mut g = c.benchmark_group("xxh3_256KiB_block_2KiB_segments");
    g.throughput(Throughput::Bytes(block.len() as u64));
    g.bench_function("twox_hash", |b| {
        b.iter(|| {
            block
                .chunks(2048)
                .fold(0u64, |a, s| a ^ twox_hash::XxHash3_64::oneshot(s))
        })
    });
    g.bench_function("xxhash_rust", |b| {
        b.iter(|| {
            block
                .chunks(2048)
                .fold(0u64, |a, s| a ^ xxhash_rust::xxh3::xxh3_64(s))
        })
    });
    g.finish();
}

criterion_group!(benches, digests, implementations, publisher_step);
criterion_main!(benches);
