//! Wire throughput of the UCX backend between two endpoints of this process:
//! `cargo run --release -p reshard-backend-ucx --example get_throughput [MiB] [read KiB] [tls]`.
//! Posts the same prepared batch several times and prints GB/s per post.

use std::sync::Arc;
use std::time::Instant;

use reshard_backend_ucx::{UcxOptions, UcxTransport};
use reshard_core::{HostBuffer, MemoryBlock, ReadBatch, ReadDesc, Transport};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> reshard_core::Result<()> {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(256);
    let kib: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(16 << 10);
    let tls = args.next();
    let options = UcxOptions {
        tls,
        ..UcxOptions::default()
    };
    let len = mib << 20;
    let publisher = UcxTransport::new("publisher", options.clone())?;
    let receiver = UcxTransport::new("receiver", options)?;
    let src = Arc::new(HostBuffer::from_bytes(&vec![7u8; len]));
    let dst = Arc::new(HostBuffer::zeroed(len));
    let rs = publisher
        .register(src.clone() as Arc<dyn MemoryBlock>)
        .await?;
    let rd = receiver
        .register(dst.clone() as Arc<dyn MemoryBlock>)
        .await?;
    receiver
        .load_peer(0, publisher.export_metadata().await?)
        .await?;
    let chunk = (kib << 10).min(len as u64);
    let reads = (0..len as u64 / chunk)
        .map(|i| ReadDesc {
            owner: 0,
            remote_region: rs.id(),
            remote_offset: i * chunk,
            local_region: rd.id(),
            local_offset: i * chunk,
            len: chunk,
        })
        .collect();
    let prepared = receiver.prepare(ReadBatch { reads }).await?;
    for _ in 0..5 {
        let t = Instant::now();
        let report = receiver.post(&prepared).await?.wait().await?;
        let s = t.elapsed().as_secs_f64();
        println!(
            "{} reads, {} MiB in {:.4} s: {:.2} GB/s",
            report.reads,
            report.bytes >> 20,
            s,
            report.bytes as f64 / s / 1e9
        );
    }
    assert!(dst.read()[..] == src.read()[..]);
    Ok(())
}
