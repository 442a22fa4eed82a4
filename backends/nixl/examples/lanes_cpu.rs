//! Who copies during a post, with 1 and 2 lanes: both endpoints in this process, 512 MiB in
//! 32 reads of 16 MiB, three re-posts per setting. Prints the wall time, the CPU time of the
//! posting thread and of the whole process, and each lane's completed requests and bytes. With
//! two lanes the posting thread's CPU halves while the process's stays: the other half of the
//! `process_vm_readv` copies ran on the second lane's thread (BENCHMARKS.md, "NIXL lanes").
//!
//! `cargo run --release -p reshard-backend-nixl --example lanes_cpu`

use reshard_backend_nixl::{NixlOptions, NixlTransport};
use reshard_core::{HostBuffer, MemoryBlock, ReadBatch, ReadDesc, Transport};
use std::sync::Arc;

/// User plus system CPU seconds of `who` (`RUSAGE_THREAD` or `RUSAGE_SELF`).
fn cpu(who: i32) -> f64 {
    // SAFETY: `getrusage` writes one `rusage` into the zeroed value it is given.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut u);
        u
    };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> reshard_core::Result<()> {
    reshard_backend_nixl::probe()?;
    let len = 512usize << 20;
    for lanes in [1usize, 2] {
        let p = NixlTransport::new("cpu-src", &NixlOptions::default())?;
        let options = NixlOptions {
            lanes,
            ..NixlOptions::default()
        };
        let rx = NixlTransport::new("cpu-dst", &options)?;
        let src = Arc::new(HostBuffer::from_bytes(&vec![7u8; len]));
        let s = p.register(src as Arc<dyn MemoryBlock>).await?;
        rx.load_peer(0, p.export_metadata().await?).await?;
        let dst = Arc::new(HostBuffer::zeroed(len));
        let d = rx.register(dst as Arc<dyn MemoryBlock>).await?;
        let reads = (0..32u64)
            .map(|i| ReadDesc {
                owner: 0,
                remote_region: s.id(),
                remote_offset: i << 24,
                local_region: d.id(),
                local_offset: i << 24,
                len: 1 << 24,
                remote_rows: None,
            })
            .collect();
        let prepared = rx.prepare(ReadBatch { reads }).await?;
        rx.post(&prepared).await?.wait().await?; // warm-up
        for _ in 0..3 {
            let (t0, p0) = (cpu(libc::RUSAGE_THREAD), cpu(libc::RUSAGE_SELF));
            let w0 = std::time::Instant::now();
            rx.post(&prepared).await?.wait().await?;
            let wall = w0.elapsed().as_secs_f64();
            let (t1, p1) = (cpu(libc::RUSAGE_THREAD), cpu(libc::RUSAGE_SELF));
            println!(
                "lanes {lanes}: wall {:.0} ms, posting thread cpu {:.0} ms, process cpu {:.0} ms, \
                 per lane {:?}",
                wall * 1e3,
                (t1 - t0) * 1e3,
                (p1 - p0) * 1e3,
                rx.lane_stats()
            );
        }
    }
    Ok(())
}
