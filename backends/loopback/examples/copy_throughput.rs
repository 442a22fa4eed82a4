//! Loopback wire-leg throughput against a plain memcpy of the same bytes, in one run.
//!
//! `cargo run --release -p reshard-backend-loopback --example copy_throughput [MiB] [read KiB]`

use reshard_backend_loopback::{default_workers, LoopbackFabric, LoopbackTransport};
use reshard_core::{median, HostBuffer, ReadBatch, ReadDesc, Transport};
use std::sync::Arc;
use std::time::Instant;

const ROUNDS: usize = 5;

#[tokio::main]
async fn main() -> reshard_core::Result<()> {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(512);
    let read_kib: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1024);
    let len = mib << 20;
    let src = Arc::new(HostBuffer::zeroed(len));
    src.write()
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = i as u8 | 1);
    let dst = Arc::new(HostBuffer::zeroed(len));
    dst.write().fill(0); // fault the pages in before timing

    let step = read_kib * 1024;
    // Plain single-threaded memcpy of the same bytes: once whole, once per read.
    let (mut whole, mut per_read) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let (s, mut d) = (src.read(), dst.write());
        let t = Instant::now();
        d.copy_from_slice(&s);
        whole.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        for (d, s) in d.chunks_mut(step as usize).zip(s.chunks(step as usize)) {
            d.copy_from_slice(std::hint::black_box(s));
        }
        per_read.push(t.elapsed().as_secs_f64());
    }
    let (whole, per_read) = (median(whole), median(per_read));
    println!(
        "memcpy whole, 1 thread     {:>8.2} GB/s",
        len as f64 / whole / 1e9
    );
    println!(
        "memcpy per read, 1 thread  {:>8.2} GB/s",
        len as f64 / per_read / 1e9
    );
    let memcpy = whole;

    for workers in [1, default_workers()] {
        let fabric = LoopbackFabric::new();
        let publisher = LoopbackTransport::new(&fabric, "pub", 1)?;
        let receiver = LoopbackTransport::new(&fabric, "recv", workers)?;
        let rs = publisher.register(src.clone()).await?;
        let rd = receiver.register(dst.clone()).await?;
        receiver
            .load_peer(0, publisher.export_metadata().await?)
            .await?;
        let reads = (0..len as u64 / step)
            .map(|k| ReadDesc {
                owner: 0,
                remote_region: rs.id(),
                remote_offset: k * step,
                local_region: rd.id(),
                local_offset: k * step,
                len: step,
                remote_rows: None,
            })
            .collect();
        let t = Instant::now();
        let prepared = receiver.prepare(ReadBatch { reads }).await?;
        let prep = t.elapsed().as_secs_f64();
        let mut wire = Vec::new();
        for _ in 0..ROUNDS {
            let t = Instant::now();
            receiver.post(&prepared).await?.wait().await?;
            wire.push(t.elapsed().as_secs_f64());
        }
        let wire = median(wire);
        println!(
            "loopback, {workers} worker(s)   {:>8.2} GB/s  ({:.2}x whole memcpy, {:.2}x per-read; {} reads of {read_kib} KiB, prepare {:.2} ms)",
            len as f64 / wire / 1e9,
            memcpy / wire,
            per_read / wire,
            len as u64 / step,
            prep * 1e3
        );
        assert!(dst.read()[..] == src.read()[..]);
        dst.write().fill(0);
    }
    Ok(())
}
