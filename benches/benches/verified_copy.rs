//! The floor of a verified copy on this machine (issue 29's targets, BENCHMARKS.md): what one
//! pass over the bytes costs when the copy must also be hashed from its destination, against the
//! one-call memcpy `reshard bench` reports as its ceiling. Same 1 GiB buffers, pre-faulted, in
//! one run:
//! - `memcpy_one_call`: one `copy_from_slice` of the whole buffer (glibc streams a copy this
//!   large past the cache: the ceiling `reshard bench` divides by);
//! - `blocks_256KiB`: the same copy in 256 KiB blocks through the cache (what a backend that
//!   hashes while copying does, minus the hash);
//! - `blocks_256KiB_hash_dst`: each block copied, then its 2 KiB segments hashed (XXH3-64)
//!   from the destination while in cache (docs/in-flight-safety.md, "Hashing while copying"),
//!   on one and on two threads (disjoint halves).

#![allow(missing_docs)] // criterion_group! generates undocumented items.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

const LEN: usize = 1 << 30;
const BLOCK: usize = 256 << 10;
const SEGMENT: usize = 2 << 10;

fn copy_blocks(src: &[u8], dst: &mut [u8], hash: bool) -> u64 {
    let mut acc = 0u64;
    for (s, d) in src.chunks(BLOCK).zip(dst.chunks_mut(BLOCK)) {
        d.copy_from_slice(s);
        if hash {
            for seg in d.chunks(SEGMENT) {
                acc ^= twox_hash::XxHash3_64::oneshot(seg);
            }
        }
    }
    acc
}

fn split(src: &[u8], dst: &mut [u8], threads: usize, hash: bool) -> u64 {
    let per = src.len().div_ceil(threads);
    std::thread::scope(|s| {
        let jobs: Vec<_> = src
            .chunks(per)
            .zip(dst.chunks_mut(per))
            .map(|(a, b)| s.spawn(move || copy_blocks(a, b, hash)))
            .collect();
        jobs.into_iter()
            .map(|j| j.join().unwrap())
            .fold(0, |a, b| a ^ b)
    })
}

fn verified_copy(c: &mut Criterion) {
    let src: Vec<u8> = (0..LEN).map(|i| (i as u8) | 1).collect();
    let mut dst = vec![0u8; LEN];
    dst.copy_from_slice(&src);
    let mut g = c.benchmark_group("verified_copy_1GiB");
    g.throughput(Throughput::Bytes(LEN as u64));
    g.sample_size(10);
    g.bench_function("memcpy_one_call", |b| {
        b.iter(|| dst.copy_from_slice(std::hint::black_box(&src)))
    });
    for threads in [1, 2] {
        g.bench_with_input(
            BenchmarkId::new("blocks_256KiB", threads),
            &threads,
            |b, &t| b.iter(|| split(&src, &mut dst, t, false)),
        );
        g.bench_with_input(
            BenchmarkId::new("blocks_256KiB_hash_dst", threads),
            &threads,
            |b, &t| b.iter(|| split(&src, &mut dst, t, true)),
        );
    }
    g.finish();
}

criterion_group!(benches, verified_copy);
criterion_main!(benches);
