//! Digest candidates on a 64 MiB buffer: XXH3-128 (chosen) against BLAKE3.

#![allow(missing_docs)] // criterion_group! generates undocumented items.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};

fn digests(c: &mut Criterion) {
    let buf: Vec<u8> = (0..64u64 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let mut g = c.benchmark_group("digest_64MiB");
    g.throughput(Throughput::Bytes(buf.len() as u64));
    g.sample_size(10);
    g.bench_function("xxh3_128", |b| b.iter(|| xxhash_rust::xxh3::xxh3_128(&buf)));
    g.bench_function("blake3", |b| b.iter(|| blake3::hash(&buf)));
    g.finish();
}

criterion_group!(benches, digests);
criterion_main!(benches);
