//! Full-scale plan of the docs/design.md §8 setup (Qwen3-30B-A3B, EP8/DP8 -> TP2), both receiver
//! ranks.

#![allow(missing_docs)] // criterion_group! generates undocumented items.

use criterion::{criterion_group, criterion_main, Criterion};

fn plans(c: &mut Criterion) {
    let (table, layouts) = reshard_benches::reference_geometry().expect("geometry");
    let mut g = c.benchmark_group("plan_qwen3_30b_a3b_ep8dp8_tp2");
    g.sample_size(20);
    g.bench_function("both_ranks", |b| {
        b.iter(|| reshard_benches::time_plans(&table, &layouts).expect("plan"))
    });
    g.finish();
}

criterion_group!(benches, plans);
criterion_main!(benches);
