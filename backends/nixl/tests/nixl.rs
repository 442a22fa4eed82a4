//! Focused tests of the NIXL backend: metadata decoding, prepare-time validation, peer reloads,
//! the descriptor cache across many posts, overlap and deregistration rules, a missing runtime,
//! and options. The in-flight scenarios (timeouts, quarantine) are in `in_flight.rs`.

use bytes::Bytes;
use reshard_backend_nixl::{probe, NixlFactory, NixlOptions, NixlTransport, SCHEME};
use reshard_core::config::TransportConfig;
use reshard_core::registry::TransportFactory;
use reshard_core::{
    ErrorKind, HostBuffer, MemoryBlock, ReadBatch, ReadDesc, Registration, Transport,
};
use std::sync::Arc;

fn available() -> bool {
    reshard_conformance::backend_available(SCHEME, probe())
}

fn endpoint(name: &str) -> NixlTransport {
    NixlTransport::new(name, &NixlOptions::default()).expect("nixl endpoint")
}

fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 31 + salt as usize * 7) % 251) as u8)
        .collect()
}

async fn register(t: &NixlTransport, b: &Arc<HostBuffer>) -> Registration {
    t.register(Arc::clone(b) as Arc<dyn MemoryBlock>)
        .await
        .expect("register")
}

fn read(owner: u32, src: &Registration, dst: &Registration, off: u64, len: u64) -> ReadDesc {
    ReadDesc {
        owner,
        remote_region: src.id(),
        remote_offset: off,
        local_region: dst.id(),
        local_offset: off,
        len,
        remote_rows: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbled_truncated_and_foreign_metadata_are_decode_errors() {
    if !available() {
        return;
    }
    let a = endpoint("md-src");
    let b = endpoint("md-dst");
    let _r = register(&a, &Arc::new(HostBuffer::zeroed(4096))).await;
    let good = a.export_metadata().await.expect("metadata");
    for cut in [0, 3, 5, 9, good.len() / 2, good.len() - 1] {
        let e = b
            .load_peer(1, good.slice(..cut))
            .await
            .expect_err("truncated");
        assert_eq!(e.kind(), ErrorKind::Decode, "cut {cut}: {e}");
        assert_eq!(e.context().owner, Some(1));
    }
    let mut v = good.to_vec();
    v[4] = 200; // version
    let e = b.load_peer(1, Bytes::from(v)).await.expect_err("version");
    assert_eq!(e.kind(), ErrorKind::Decode);
    let mut v = good.to_vec();
    v.push(1);
    let e = b.load_peer(1, Bytes::from(v)).await.expect_err("trailing");
    assert_eq!(e.kind(), ErrorKind::Decode);
    let e = b
        .load_peer(
            1,
            Bytes::from_static(b"RSLB\x01garbage from another backend"),
        )
        .await
        .expect_err("foreign");
    assert_eq!(e.kind(), ErrorKind::Decode);
    // A loopback-sized garbage blob with the right magic but a corrupt NIXL part.
    let mut v = good.to_vec();
    let n = v.len();
    v[n - 8..].copy_from_slice(&[0xAB; 8]);
    let e = b
        .load_peer(1, Bytes::from(v))
        .await
        .expect_err("corrupt nixl md");
    assert!(
        matches!(e.kind(), ErrorKind::Decode | ErrorKind::Transport),
        "{e}"
    );
    // Nothing was loaded: the epoch is unchanged and reads from owner 1 are unknown.
    b.load_peer(1, good)
        .await
        .expect("the good bytes still load");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_rejects_unknown_peers_and_out_of_bounds_reads() {
    if !available() {
        return;
    }
    let a = endpoint("oob-src");
    let b = endpoint("oob-dst");
    let src = register(&a, &Arc::new(HostBuffer::zeroed(4096))).await;
    let dst = register(&b, &Arc::new(HostBuffer::zeroed(8192))).await;
    let batch = |reads| ReadBatch { reads };
    let e = b
        .prepare(batch(vec![read(3, &src, &dst, 0, 16)]))
        .await
        .expect_err("unknown peer");
    assert_eq!(e.kind(), ErrorKind::PeerUnknown);
    assert_eq!(e.context().owner, Some(3));
    b.load_peer(3, a.export_metadata().await.unwrap())
        .await
        .unwrap();
    // Past the end of the publisher's region (the local region is large enough).
    let e = b
        .prepare(batch(vec![
            read(3, &src, &dst, 0, 16),
            read(3, &src, &dst, 4000, 200),
        ]))
        .await
        .expect_err("remote out of bounds");
    assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    assert_eq!(e.context().owner, Some(3));
    assert_eq!(e.context().range, Some(4000..4200));
    // A region the publisher never registered, a local region that does not exist, a local
    // range past its end, an overflowing offset and a zero-length read.
    let mut bad = read(3, &src, &dst, 0, 16);
    bad.remote_region = 99;
    let mut no_local = read(3, &src, &dst, 0, 16);
    no_local.local_region = 42;
    let mut past_local = read(3, &src, &dst, 0, 16);
    past_local.local_offset = 8190;
    let mut wrap = read(3, &src, &dst, 0, 16);
    wrap.remote_offset = u64::MAX - 4;
    for r in [bad, no_local, past_local, wrap, read(3, &src, &dst, 0, 0)] {
        let e = b.prepare(batch(vec![r])).await.expect_err("invalid read");
        assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{r:?}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloading_a_changed_peer_bumps_the_epoch_and_the_next_prepare_uses_it() {
    if !available() {
        return;
    }
    let a = endpoint("reload-src");
    let b = endpoint("reload-dst");
    let first = Arc::new(HostBuffer::from_bytes(&pattern(4096, 1)));
    let r1 = register(&a, &first).await;
    let dst = Arc::new(HostBuffer::zeroed(8192));
    let rd = register(&b, &dst).await;
    let md1 = a.export_metadata().await.unwrap();
    b.load_peer(0, md1.clone()).await.unwrap();
    let e0 = b.epoch();
    // The same bytes again change nothing.
    b.load_peer(0, md1).await.unwrap();
    assert_eq!(b.epoch(), e0);
    // Reading region 2 before the publisher registered it: out of bounds.
    let second = Arc::new(HostBuffer::from_bytes(&pattern(4096, 2)));
    let r2 = register(&a, &second).await;
    assert_eq!(r2.id(), r1.id() + 1);
    let want = ReadBatch {
        reads: vec![ReadDesc {
            owner: 0,
            remote_region: r2.id(),
            remote_offset: 0,
            local_region: rd.id(),
            local_offset: 4096,
            len: 4096,
            remote_rows: None,
        }],
    };
    let e = b.prepare(want.clone()).await.expect_err("stale metadata");
    assert_eq!(e.kind(), ErrorKind::OutOfBounds);
    b.load_peer(0, a.export_metadata().await.unwrap())
        .await
        .unwrap();
    assert_ne!(b.epoch(), e0, "a changed peer bumps the epoch");
    let p = b
        .prepare(want)
        .await
        .expect("prepare with the new metadata");
    b.post(&p).await.unwrap().wait().await.expect("read");
    assert_eq!(dst.read()[4096..], pattern(4096, 2)[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_batch_is_reposted_byte_exact_across_many_updates() {
    if !available() {
        return;
    }
    let pubs = [endpoint("repost-src-0"), endpoint("repost-src-1")];
    let rx = endpoint("repost-dst");
    let len = 64 * 1024;
    let srcs: Vec<Arc<HostBuffer>> = (0..2)
        .map(|i| Arc::new(HostBuffer::from_bytes(&pattern(len, i))))
        .collect();
    let mut regs = Vec::new();
    for (i, (p, s)) in pubs.iter().zip(&srcs).enumerate() {
        regs.push(register(p, s).await);
        rx.load_peer(i as u32, p.export_metadata().await.unwrap())
            .await
            .unwrap();
    }
    let dst = Arc::new(HostBuffer::zeroed(2 * len));
    let rd = register(&rx, &dst).await;
    // Interleaved 4 KiB reads from both owners: owner k fills its half of dst.
    let chunk = 4096u64;
    let mut reads = Vec::new();
    for c in 0..(len as u64 / chunk) {
        for (k, r) in regs.iter().enumerate() {
            reads.push(ReadDesc {
                owner: k as u32,
                remote_region: r.id(),
                remote_offset: c * chunk,
                local_region: rd.id(),
                local_offset: k as u64 * len as u64 + c * chunk,
                len: chunk,
                remote_rows: None,
            });
        }
    }
    let epoch = rx.epoch();
    let prepared = rx.prepare(ReadBatch { reads }).await.expect("prepare");
    let stats = NixlTransport::prepared_stats(&prepared).expect("nixl batch");
    assert_eq!(stats.requests, 2, "one request per owner");
    assert_eq!((stats.local_lists, stats.remote_lists), (1, 2));
    for step in 0..25u8 {
        for (i, s) in srcs.iter().enumerate() {
            s.write()
                .copy_from_slice(&pattern(len, step.wrapping_mul(3) + i as u8));
        }
        let report = rx
            .post(&prepared)
            .await
            .unwrap()
            .wait()
            .await
            .expect("wait");
        assert_eq!(report.bytes, 2 * len as u64);
        let got = dst.read();
        for i in 0..2 {
            assert!(
                got[i * len..(i + 1) * len] == pattern(len, step.wrapping_mul(3) + i as u8)[..],
                "step {step}, owner {i}"
            );
        }
    }
    let stats = NixlTransport::prepared_stats(&prepared).unwrap();
    assert_eq!(stats.request_builds, 1, "the same requests are re-posted");
    assert_eq!(stats.posts, 25);
    assert_eq!(rx.epoch(), epoch, "posting changes no epoch");
}

#[test]
fn options_with_an_unknown_key_are_a_config_error() {
    let cfg = TransportConfig {
        kind: "nixl".into(),
        workers: None,
        options: Some(serde_json::json!({"timeout_ms": 5, "ucx_tls": "tcp"})),
    };
    let e = NixlFactory::new().create("x", &cfg).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.message().contains("ucx_tls"), "{e}");
    let cfg = TransportConfig {
        options: Some(serde_json::json!({"timeout_ms": "soon"})),
        ..cfg
    };
    assert_eq!(
        NixlFactory::new().create("x", &cfg).unwrap_err().kind(),
        ErrorKind::Config
    );
}

#[test]
fn an_unknown_plugin_parameter_is_a_config_error() {
    if !available() {
        return;
    }
    let mut opts = NixlOptions::default();
    opts.plugin_params.insert("ucx_tls".into(), "tcp".into());
    let e = NixlTransport::new("params", &opts).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    // A parameter the plugin lists is accepted.
    let mut opts = NixlOptions::default();
    opts.plugin_params.insert("num_workers".into(), "1".into());
    NixlTransport::new("params-ok", &opts).expect("known parameter");
}

/// Environment variable telling a re-executed test binary to act as the missing-runtime child.
const CHILD_ENV: &str = "RESHARD_NIXL_TEST_MISSING_RUNTIME_CHILD";

#[test]
fn a_missing_runtime_is_unavailable_not_an_abort() {
    if std::env::var_os(CHILD_ENV).is_some() {
        // Child: the runtime home is empty, so nothing may load and nothing may abort.
        let e = probe().expect_err("no runtime");
        assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
        assert!(e.message().contains("install-deps.sh"), "{e}");
        let e = NixlFactory::new()
            .create(
                "x",
                &TransportConfig {
                    kind: "nixl".into(),
                    workers: None,
                    options: None,
                },
            )
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
        println!("child-saw-unavailable");
        return;
    }
    let empty = std::env::temp_dir().join(format!("reshard-nixl-none-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_missing_runtime_is_unavailable_not_an_abort",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .env("RESHARD_NIXL_HOME", &empty)
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .expect("run the child");
    std::fs::remove_dir_all(&empty).ok();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("child-saw-unavailable"),
        "child failed ({:?}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A VRAM block description (no GPU memory behind it: registration must refuse it first).
#[derive(Debug)]
struct FakeVram(u32);

unsafe impl MemoryBlock for FakeVram {
    fn addr(&self) -> usize {
        0x1000
    }
    fn len(&self) -> usize {
        4096
    }
    fn kind(&self) -> reshard_core::MemoryKind {
        reshard_core::MemoryKind::Vram { device: self.0 }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vram_on_another_device_is_refused_and_not_advertised() {
    if !available() {
        return;
    }
    let opts = NixlOptions {
        device_id: Some(0),
        ..NixlOptions::default()
    };
    let t = NixlTransport::new("vram", &opts).unwrap();
    assert!(!t.capabilities().vram);
    let e = t
        .register(Arc::new(FakeVram(1)) as Arc<dyn MemoryBlock>)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert_eq!(t.epoch(), 0, "nothing was registered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_dropped_without_wait_leaves_the_batch_usable() {
    if !available() {
        return;
    }
    let a = endpoint("drop-src");
    let b = endpoint("drop-dst");
    let len = 1 << 20;
    let src = Arc::new(HostBuffer::from_bytes(&pattern(len, 4)));
    let dst = Arc::new(HostBuffer::zeroed(len));
    let rs = register(&a, &src).await;
    let rd = register(&b, &dst).await;
    b.load_peer(0, a.export_metadata().await.unwrap())
        .await
        .unwrap();
    let prepared = b
        .prepare(ReadBatch {
            reads: vec![read(0, &rs, &rd, 0, len as u64)],
        })
        .await
        .unwrap();
    drop(b.post(&prepared).await.unwrap());
    // Posting while a post is still being waited for is refused, then works once it is done.
    let flight = b.post(&prepared).await.expect("post after a dropped post");
    let e = b.post(&prepared).await.err().expect("busy");
    assert_eq!(e.kind(), ErrorKind::Transport);
    assert!(e.is_retryable());
    flight.wait().await.expect("wait");
    assert_eq!(dst.read()[..], pattern(len, 4)[..]);
    // A batch from another endpoint is refused.
    let other = a
        .prepare(ReadBatch { reads: vec![] })
        .await
        .expect("empty batch");
    assert_eq!(
        b.post(&other).await.err().expect("foreign batch").kind(),
        ErrorKind::Unsupported
    );
}

/// Dropping a `Registration` while a prepared batch still reads into its region defers the
/// NIXL deregistration until the batch is gone; the batch can no longer be posted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_registration_stays_registered_while_a_batch_uses_it() {
    if !available() {
        return;
    }
    let a = endpoint("defer-src");
    let b = endpoint("defer-dst");
    let src = Arc::new(HostBuffer::from_bytes(&pattern(4096, 3)));
    let rs = register(&a, &src).await;
    let dst = Arc::new(HostBuffer::zeroed(4096));
    let rd = register(&b, &dst).await;
    let spare = register(&b, &Arc::new(HostBuffer::zeroed(4096))).await;
    assert_eq!(b.registrations(), 2);
    b.load_peer(0, a.export_metadata().await.unwrap())
        .await
        .unwrap();
    let prepared = b
        .prepare(ReadBatch {
            reads: vec![read(0, &rs, &rd, 0, 4096)],
        })
        .await
        .unwrap();
    drop(rd);
    assert_eq!(b.registrations(), 2, "the batch still holds the region");
    let e = b.post(&prepared).await.err().expect("region gone");
    assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
    drop(prepared);
    assert_eq!(b.registrations(), 1, "deregistered with the last user");
    drop(spare);
    assert_eq!(b.registrations(), 0);
}

/// A block that records, when it is dropped, how many NIXL registrations its endpoint still
/// holds.
#[derive(Debug)]
struct Watched {
    buf: HostBuffer,
    endpoint: Arc<NixlTransport>,
    seen: Arc<std::sync::Mutex<Option<usize>>>,
}

unsafe impl MemoryBlock for Watched {
    fn addr(&self) -> usize {
        self.buf.addr()
    }
    fn len(&self) -> usize {
        self.buf.len()
    }
    fn kind(&self) -> reshard_core::MemoryKind {
        self.buf.kind()
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        *self.seen.lock().unwrap() = Some(self.endpoint.registrations());
    }
}

/// The memory of a region is let go only after its NIXL registration is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_outlives_its_registration() {
    if !available() {
        return;
    }
    let t = Arc::new(endpoint("order"));
    let seen = Arc::new(std::sync::Mutex::new(None));
    let block = Arc::new(Watched {
        buf: HostBuffer::zeroed(4096),
        endpoint: Arc::clone(&t),
        seen: Arc::clone(&seen),
    });
    let reg = t.register(block as Arc<dyn MemoryBlock>).await.unwrap();
    assert_eq!(t.registrations(), 1);
    drop(reg);
    assert_eq!(
        *seen.lock().unwrap(),
        Some(0),
        "the block was dropped after its deregistration"
    );
}

// ---------------------------------------------------------------------------------------------
// Gather reads: rows at a pitch at the source, landing contiguously.

/// Bytes no shift of which equals itself (unlike `pattern`, periodic at 251): a row read one
/// row too early or late, or a source read as contiguous, lands different bytes.
fn unique(len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8 ^ (i >> 8) as u8)
        .collect()
}

/// A gather from owner 1 of `rows` rows of `row` bytes at `pitch` from `remote_offset`,
/// landing at `local_offset`.
fn gather(
    src: &Registration,
    dst: &Registration,
    remote_offset: u64,
    local_offset: u64,
    (rows, row, pitch): (u64, u64, u64),
) -> ReadDesc {
    ReadDesc {
        local_offset,
        remote_rows: Some(reshard_core::RemoteRows {
            row_bytes: row,
            pitch,
        }),
        ..read(1, src, dst, remote_offset, rows * row)
    }
}

/// What `reads` leave in a zeroed destination of `len` bytes, computed row by row from `src`.
fn expected(src: &[u8], reads: &[ReadDesc], len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    for r in reads {
        let (row, pitch) = match r.remote_rows {
            Some(g) => (g.row_bytes as usize, g.pitch as usize),
            None => (r.len as usize, 0),
        };
        for i in 0..r.len as usize / row {
            let from = r.remote_offset as usize + i * pitch;
            let to = r.local_offset as usize + i * row;
            out[to..to + row].copy_from_slice(&src[from..from + row]);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gather_reads_are_byte_exact_reported_whole_and_logged_as_asked() {
    if !available() {
        return;
    }
    // Gathers of thousands of small rows, of rows longer than a request (cut into pieces), a
    // gather whose pitch equals its row, and plain reads in one batch, posted twice.
    let opts = NixlOptions {
        request_bytes: 1 << 20,
        ..NixlOptions::default()
    };
    let a = NixlTransport::new("gather-src", &opts).expect("nixl endpoint");
    let b = NixlTransport::new("gather-dst", &opts).expect("nixl endpoint");
    let len = 8 << 20;
    let data = unique(len);
    let src = register(&a, &Arc::new(HostBuffer::from_bytes(&data))).await;
    let dst_buf = Arc::new(HostBuffer::zeroed(len));
    let dst = register(&b, &dst_buf).await;
    b.load_peer(1, a.export_metadata().await.unwrap())
        .await
        .unwrap();
    let plain = |remote_offset, local_offset, len| ReadDesc {
        local_offset,
        ..read(1, &src, &dst, remote_offset, len)
    };
    let reads = vec![
        // 5000 rows of 24 bytes at a pitch of 40, from an odd offset.
        gather(&src, &dst, 13, 0, (5000, 24, 40)),
        plain(300_001, 120_000, 7777),
        // Pitch equal to the row: a contiguous source written as a gather.
        gather(&src, &dst, 400_000, 130_000, (100, 64, 64)),
        // Rows of 1.5 MiB, longer than a request.
        gather(&src, &dst, 500_000, 200_000, (3, 3 << 19, 2 << 20)),
        // A single row.
        gather(&src, &dst, 7_000_000, 5_000_000, (1, 333, 1000)),
        plain(2, 6_000_000, 4096),
    ];
    let want = expected(&data, &reads, len);
    let prepared = b
        .prepare(ReadBatch {
            reads: reads.clone(),
        })
        .await
        .expect("prepare");
    let log = reshard_core::ExecutionLog::new();
    assert!(b.set_execution_log(Some(log.clone())));
    for round in 0..2 {
        dst_buf.write().fill(0);
        let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let sink = {
            let (seen, dst_buf, reads, want) =
                (seen.clone(), dst_buf.clone(), reads.clone(), want.clone());
            reshard_core::CompletionSink::new(move |i| {
                // Reported only once every row of the read is in place.
                let r = &reads[i];
                let at = r.local_offset as usize..(r.local_offset + r.len) as usize;
                let whole = dst_buf.read()[at.clone()] == want[at];
                seen.lock().push((i, whole));
            })
        };
        let report = b
            .post_reporting(&prepared, sink)
            .await
            .expect("post")
            .wait()
            .await
            .expect("wait");
        let total: u64 = reads.iter().map(|r| r.len).sum();
        assert_eq!((report.reads, report.bytes), (reads.len() as u64, total));
        assert!(dst_buf.read()[..] == want[..], "round {round}: byte-exact");
        let mut seen = seen.lock().clone();
        seen.sort_unstable();
        let all: Vec<_> = (0..reads.len()).map(|i| (i, true)).collect();
        assert_eq!(seen, all, "each read reported once, whole");
        let key = |r: &ReadDesc| (r.local_offset, r.remote_offset, r.len);
        let mut logged = log.take();
        logged.sort_unstable_by_key(key);
        let mut asked = reads.clone();
        asked.sort_unstable_by_key(key);
        assert_eq!(logged, asked, "the log records the gathers as asked");
    }
    let stats = NixlTransport::prepared_stats(&prepared).unwrap();
    assert_eq!(stats.request_builds, 1, "the same requests are re-posted");
}
