//! Checkpoint reads: the `pread` copy of `Checkpoint::copy_box` against the shared-mmap copy it
//! replaced (BENCHMARKS.md, "Checkpoint reads"), on the same checkpoint, in one run.
//!
//! ```sh
//! cargo run --release -p reshard-cli -- checkpoint --preset qwen3-30b-a3b --layers 4 \
//!     --experts 32 --step 1 --out /tmp/ckpt-bench
//! cargo run --release -p reshard-checkpoint --example read_bench -- /tmp/ckpt-bench 5 \
//!     ep=8,dp=8 tp=4
//! ```
//!
//! For each publisher topology every rank's boxes are copied, as `reshard publish` loads a step:
//! open the checkpoint, then one copy per offer into a buffer the size of the rank's shard. The
//! two arms alternate per iteration on one thread, with the page cache warm (both read once
//! before timing): what is measured is the copy out of the cache, not the disk. The mmap arm is
//! the code this crate had before (map every shard file, parse its header with the
//! `safetensors` crate, copy each contiguous run out of the map).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use memmap2::Mmap;
use reshard_checkpoint::Checkpoint;
use reshard_core::layout::{contiguous_runs, row_major_strides};
use reshard_core::{TensorBox, TensorSpec};
use reshard_planner::topology::{rank_geometry, PublisherTopology};

/// One offer: a tensor and the box of it a publisher rank holds.
type Offer = (TensorSpec, TensorBox);

/// One arm: copies every offer of a checkpoint folder through a buffer, handing each copy to a
/// sink; returns the bytes copied.
type Arm = fn(&Path, &[Offer], &mut [u8], &mut dyn FnMut(&[u8])) -> u64;

/// Every rank's offers under `topo`.
fn boxes(ckpt: &Checkpoint, topo: &PublisherTopology) -> Vec<Offer> {
    let specs = ckpt.tensors();
    let mut out = Vec::new();
    for r in 0..topo.world() {
        for s in rank_geometry(ckpt.model(), topo, r).unwrap().shards {
            out.push((specs[s.tensor].clone(), s.tensor_box));
        }
    }
    out
}

/// The pread arm: `Checkpoint::open` and `copy_box`.
fn pread_arm(dir: &Path, boxes: &[Offer], dst: &mut [u8], sink: &mut dyn FnMut(&[u8])) -> u64 {
    let ckpt = Checkpoint::open(dir).unwrap();
    let mut bytes = 0;
    for (spec, b) in boxes {
        let n = (b.elements() * spec.dtype.size()) as usize;
        ckpt.copy_box(&spec.name, b, &mut dst[..n]).unwrap();
        sink(&dst[..n]);
        bytes += n as u64;
    }
    bytes
}

/// The mmap arm: the crate's former reader, written out here.
fn mmap_arm(dir: &Path, boxes: &[Offer], dst: &mut [u8], sink: &mut dyn FnMut(&[u8])) -> u64 {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(reshard_checkpoint::INDEX_FILE)).unwrap())
            .unwrap();
    let weight_map = index["weight_map"].as_object().unwrap();
    let mut maps: HashMap<String, Mmap> = HashMap::new();
    for f in weight_map.values() {
        let f = f.as_str().unwrap();
        if !maps.contains_key(f) {
            let file = std::fs::File::open(dir.join(f)).unwrap();
            // SAFETY: read-only map of a file nothing else writes during the benchmark.
            let map = unsafe { Mmap::map(&file) }.unwrap();
            maps.insert(f.to_string(), map);
        }
    }
    let parsed: HashMap<&str, safetensors::SafeTensors> = maps
        .iter()
        .map(|(f, m)| {
            (
                f.as_str(),
                safetensors::SafeTensors::deserialize(m).unwrap(),
            )
        })
        .collect();
    let mut bytes = 0;
    for (spec, tbox) in boxes {
        let file = weight_map[&spec.name].as_str().unwrap();
        let view = parsed[file].tensor(&spec.name).unwrap();
        let src = view.data();
        let esize = spec.dtype.size() as usize;
        let n = (tbox.elements() * spec.dtype.size()) as usize;
        let dst = &mut dst[..n];
        let src_strides = row_major_strides(&spec.shape);
        let dst_strides = row_major_strides(&tbox.extent);
        let runs = contiguous_runs(&tbox.extent, &src_strides, &dst_strides);
        let run_bytes = runs.block as usize * esize;
        let base: u64 = (runs.outer..tbox.rank())
            .map(|d| tbox.offset[d] * src_strides[d])
            .sum();
        let mut idx = vec![0u64; runs.outer];
        'runs: loop {
            let mut s = base;
            let mut t = 0u64;
            for d in 0..runs.outer {
                s += (tbox.offset[d] + idx[d]) * src_strides[d];
                t += idx[d] * dst_strides[d];
            }
            let (s, t) = (s as usize * esize, t as usize * esize);
            dst[t..t + run_bytes].copy_from_slice(&src[s..s + run_bytes]);
            let mut d = runs.outer;
            loop {
                if d == 0 {
                    sink(dst);
                    break 'runs;
                }
                d -= 1;
                idx[d] += 1;
                if idx[d] < tbox.extent[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        bytes += n as u64;
    }
    bytes
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let usage = "usage: read_bench <checkpoint dir> <iterations> <publisher topology>...";
    let dir = PathBuf::from(args.next().expect(usage));
    let iters: usize = args.next().expect(usage).parse().expect(usage);
    let topos: Vec<PublisherTopology> = args.map(|t| t.parse().unwrap()).collect();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let files: u64 = ckpt
        .shard_files()
        .iter()
        .map(|f| std::fs::metadata(dir.join(f)).unwrap().len())
        .sum();
    println!(
        "checkpoint {}: {} tensors, {:.2} GiB in {} shard files",
        dir.display(),
        ckpt.tensors().len(),
        files as f64 / (1u64 << 30) as f64,
        ckpt.shard_files().len()
    );
    println!("| publishers | boxes | GiB copied | boxes of runs < 16 KiB | mmap s (GB/s) | pread s (GB/s) | pread / mmap |");
    println!("|---|---|---|---|---|---|---|");
    for topo in topos {
        let boxes = boxes(&ckpt, &topo);
        let largest = boxes
            .iter()
            .map(|(s, b)| (b.elements() * s.dtype.size()) as usize)
            .max()
            .unwrap();
        let short = boxes
            .iter()
            .filter(|(s, b)| {
                let r = contiguous_runs(
                    &b.extent,
                    &row_major_strides(&s.shape),
                    &row_major_strides(&b.extent),
                );
                (r.block * s.dtype.size()) < (16 << 10) && r.outer > 0
            })
            .count();
        let mut dst = vec![0u8; largest];
        // Warm the page cache and check both arms copy the same bytes.
        let hashes = |arm: Arm, dst: &mut [u8]| {
            let mut h = Vec::new();
            let n = arm(&dir, &boxes, dst, &mut |b| {
                h.push(twox_hash::XxHash3_64::oneshot(b))
            });
            (n, h)
        };
        let (a, ha) = hashes(mmap_arm, &mut dst);
        let (b, hb) = hashes(pread_arm, &mut dst);
        assert!(a == b && ha == hb, "the arms copied different bytes");
        let (mut tm, mut tp) = (Vec::new(), Vec::new());
        for _ in 0..iters {
            let t = Instant::now();
            mmap_arm(&dir, &boxes, &mut dst, &mut |_| {});
            tm.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            pread_arm(&dir, &boxes, &mut dst, &mut |_| {});
            tp.push(t.elapsed().as_secs_f64());
        }
        let (m, p) = (median(&mut tm), median(&mut tp));
        let gb = a as f64 / 1e9;
        println!(
            "| `{topo}` | {} | {:.2} | {short} | {m:.3} ({:.2}) | {p:.3} ({:.2}) | {:.2} |",
            boxes.len(),
            a as f64 / (1u64 << 30) as f64,
            gb / m,
            gb / p,
            p / m
        );
    }
}
