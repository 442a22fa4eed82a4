//! A throughput measurement, not a check (ignored by default): 256 MiB read in this process
//! through the kernel, as one read and as many small scattered reads, with and without packing
//! reads into one `process_vm_readv`. Run with
//! `cargo test -p reshard-backend-cma --release --test throughput -- --ignored --nocapture`.

use std::sync::Arc;
use std::time::Instant;

use reshard_backend_cma::{CmaOptions, CmaTransport};
use reshard_core::{HostBuffer, ReadBatch, ReadDesc, Transport};

const TOTAL: usize = 256 << 20;

async fn measure(label: &str, read_len: usize, options: CmaOptions) {
    let tx = CmaTransport::new("tx", CmaOptions::default()).unwrap();
    let rx = CmaTransport::new("rx", options).unwrap();
    let src_bytes: Vec<u8> = (0..TOTAL).map(|i| (i % 251) as u8).collect();
    let src = tx
        .register(Arc::new(HostBuffer::from_bytes(&src_bytes)))
        .await
        .unwrap();
    let dst_buf = Arc::new(HostBuffer::zeroed(TOTAL));
    let dst = rx.register(dst_buf.clone()).await.unwrap();
    rx.load_peer(0, tx.export_metadata().await.unwrap())
        .await
        .unwrap();
    let n = TOTAL / read_len;
    // Read i takes source block (i * 7919) mod n, an odd stride over a power of two: every
    // block once, no two consecutive reads contiguous in the source.
    let reads = (0..n)
        .map(|i| ReadDesc {
            owner: 0,
            remote_region: src.id(),
            remote_offset: ((i * 7919) % n * read_len) as u64,
            local_region: dst.id(),
            local_offset: (i * read_len) as u64,
            len: read_len as u64,
            remote_rows: None,
        })
        .collect();
    let t = Instant::now();
    let p = rx.prepare(ReadBatch { reads }).await.unwrap();
    let prep = t.elapsed();
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        let r = rx.post(&p).await.unwrap().wait().await.unwrap();
        best = best.min(t.elapsed().as_secs_f64());
        assert_eq!(r.bytes, TOTAL as u64);
        assert_eq!(r.reads, n as u64);
    }
    let d = dst_buf.read();
    for i in [0, n / 3, n - 1] {
        let at = (i * 7919) % n * read_len;
        assert_eq!(d[i * read_len..][..read_len], src_bytes[at..][..read_len]);
    }
    println!(
        "{label:<44} {n:>7} reads of {read_len:>8} B: {:>6.2} GB/s (best of 5, {:.1} ms; \
         prepare {:.1} ms)",
        TOTAL as f64 / best / 1e9,
        best * 1e3,
        prep.as_secs_f64() * 1e3
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement; run with --ignored --nocapture"]
async fn throughput_256_mib() {
    let base = |workers| CmaOptions {
        workers,
        ..CmaOptions::default()
    };
    let unpacked = |workers| CmaOptions {
        iovecs_per_call: 1,
        ..base(workers)
    };
    // A plain memcpy of the same bytes in one thread, for scale.
    let a = vec![1u8; TOTAL];
    let mut b = vec![0u8; TOTAL];
    let t = Instant::now();
    b.copy_from_slice(&a);
    let s = t.elapsed().as_secs_f64();
    println!("memcpy, 1 thread: {:.2} GB/s", TOTAL as f64 / s / 1e9);
    drop((a, b));
    for workers in [1, 2] {
        measure(
            &format!("one read, {workers} worker(s)"),
            TOTAL,
            base(workers),
        )
        .await;
        measure(
            &format!("64 KiB reads, packed, {workers} worker(s)"),
            64 << 10,
            base(workers),
        )
        .await;
        measure(
            &format!("64 KiB reads, 1 iovec/call, {workers} worker(s)"),
            64 << 10,
            unpacked(workers),
        )
        .await;
        measure(
            &format!("4 KiB reads, packed, {workers} worker(s)"),
            4 << 10,
            base(workers),
        )
        .await;
        measure(
            &format!("4 KiB reads, 1 iovec/call, {workers} worker(s)"),
            4 << 10,
            unpacked(workers),
        )
        .await;
    }
}
