//! Wire throughput of the UCX backend between two endpoints:
//! `cargo run --release -p reshard-backend-ucx --example get_throughput [MiB] [read KiB] [tls]
//! [user|alloc] [thread|process]`.
//!
//! The publisher's memory is either a `HostBuffer` (`user`, served by emulated reads) or
//! UCX-allocated shared memory from `allocate_host` (`alloc`, read directly by the receiver);
//! the publisher is another endpoint of this process (`thread`) or a child process
//! (`process`, this example re-executed). Posts the same prepared batch several times and
//! prints GB/s per post, and a plain memcpy of the same bytes for comparison.

use std::io::{BufRead, Read, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use reshard_backend_ucx::{UcxOptions, UcxTransport};
use reshard_core::{HostBuffer, HostMemory, MemoryBlock, ReadBatch, ReadDesc, Transport};

const CHILD: &str = "GET_THROUGHPUT_CHILD";

/// Publisher memory of `len` bytes filled with 7s, registered on `publisher`.
async fn source(
    publisher: &UcxTransport,
    len: usize,
    alloc: bool,
) -> reshard_core::Result<(Arc<dyn HostMemory>, reshard_core::Registration)> {
    let src: Arc<dyn HostMemory> = match alloc {
        true => publisher
            .allocate_host(len)
            .await?
            .expect("ucx allocates host memory"),
        false => Arc::new(HostBuffer::zeroed(len)),
    };
    src.bytes_mut().fill(7);
    let reg = publisher
        .register(src.clone() as Arc<dyn MemoryBlock>)
        .await?;
    Ok((src, reg))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> reshard_core::Result<()> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut args = argv.iter().cloned();
    let mib: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(256);
    let kib: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(16 << 10);
    let tls = args.next().filter(|t| t != "-");
    let alloc = args.next().as_deref() == Some("alloc");
    let process = args.next().as_deref() == Some("process");
    let options = UcxOptions {
        tls,
        ..UcxOptions::default()
    };
    let len = mib << 20;
    if std::env::var_os(CHILD).is_some() {
        // The publisher process: print metadata, serve until stdin closes.
        let publisher = UcxTransport::new("publisher", options)?;
        let (_src, reg) = source(&publisher, len, alloc).await?;
        println!("{} {}", reg.id(), hex(&publisher.export_metadata().await?));
        std::io::stdout().flush().ok();
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        return Ok(());
    }
    let receiver = UcxTransport::new("receiver", options.clone())?;
    let dst = Arc::new(HostBuffer::zeroed(len));
    let rd = receiver
        .register(dst.clone() as Arc<dyn MemoryBlock>)
        .await?;
    let mut child = None;
    let mut local = None;
    let (src_region, metadata) = if process {
        let exe = std::env::current_exe().expect("own path");
        let mut c = Command::new(exe)
            .args(&argv)
            .env(CHILD, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the publisher process");
        let mut line = String::new();
        std::io::BufReader::new(c.stdout.take().expect("child stdout"))
            .read_line(&mut line)
            .expect("publisher metadata");
        let (id, md) = line.trim().split_once(' ').expect("id and metadata");
        child = Some(c);
        (id.parse().expect("region id"), Bytes::from(unhex(md)))
    } else {
        let publisher = UcxTransport::new("publisher", options)?;
        let (src, reg) = source(&publisher, len, alloc).await?;
        let md = publisher.export_metadata().await?;
        let id = reg.id();
        local = Some((publisher, src, reg));
        (id, md)
    };
    receiver.load_peer(0, metadata).await?;
    let chunk = (kib << 10).min(len as u64);
    let reads = (0..len as u64 / chunk)
        .map(|i| ReadDesc {
            owner: 0,
            remote_region: src_region,
            remote_offset: i * chunk,
            local_region: rd.id(),
            local_offset: i * chunk,
            len: chunk,
            remote_rows: None,
        })
        .collect();
    let prepared = receiver.prepare(ReadBatch { reads }).await?;
    println!(
        "publisher memory: {}, publisher in another {}",
        if alloc {
            "ucx-allocated"
        } else {
            "user (HostBuffer)"
        },
        if process { "process" } else { "thread" }
    );
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
    assert!(dst.read().iter().all(|&b| b == 7));
    let copy = vec![1u8; len];
    let t = Instant::now();
    dst.write().copy_from_slice(&copy);
    let s = t.elapsed().as_secs_f64();
    println!("memcpy of the same bytes: {:.2} GB/s", len as f64 / s / 1e9);
    drop(local);
    if let Some(mut c) = child {
        drop(c.stdin.take());
        let _ = c.wait();
    }
    Ok(())
}
