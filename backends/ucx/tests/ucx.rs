//! Focused tests of the UCX backend: typed errors, prepare-time validation, metadata
//! decoding, epochs, abort, the in-flight cap, overlap ordering and configuration.

use std::error::Error as _;
use std::sync::Arc;

use bytes::Bytes;
use reshard_backend_ucx::{UcxFactory, UcxOptions, UcxStatusError, UcxTransport};
use reshard_core::config::TransportConfig;
use reshard_core::registry::TransportFactory;
use reshard_core::{
    ErrorKind, HostBuffer, MemoryBlock, MemoryKind, ReadBatch, ReadDesc, Registration, Transport,
};

/// Skips (loudly) when UCX is not installed, unless `RESHARD_REQUIRE_BACKENDS` names ucx.
fn available() -> bool {
    reshard_conformance::backend_available("ucx", reshard_backend_ucx::probe())
}

fn endpoint(agent: &str, options: UcxOptions) -> UcxTransport {
    UcxTransport::new(agent, options).expect("ucx endpoint")
}

fn tcp(reads_in_flight: usize) -> UcxOptions {
    UcxOptions {
        tls: Some("tcp".into()),
        reads_in_flight,
        ..UcxOptions::default()
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i % 251) as u8 ^ seed.wrapping_mul(31))
        .collect()
}

struct Pair {
    publisher: UcxTransport,
    receiver: UcxTransport,
    src: Arc<HostBuffer>,
    dst: Arc<HostBuffer>,
    rs: Registration,
    rd: Registration,
}

/// A publisher with `len` patterned bytes and a receiver with `len` zero bytes, loaded as
/// owner 7.
async fn pair(len: usize, options: UcxOptions) -> Pair {
    let publisher = endpoint("publisher", options.clone());
    let receiver = endpoint("receiver", options);
    let src = Arc::new(HostBuffer::from_bytes(&pattern(len, 1)));
    let dst = Arc::new(HostBuffer::zeroed(len));
    let rs = publisher
        .register(src.clone() as Arc<dyn MemoryBlock>)
        .await
        .expect("register src");
    let rd = receiver
        .register(dst.clone() as Arc<dyn MemoryBlock>)
        .await
        .expect("register dst");
    receiver
        .load_peer(7, publisher.export_metadata().await.expect("export"))
        .await
        .expect("load");
    Pair {
        publisher,
        receiver,
        src,
        dst,
        rs,
        rd,
    }
}

fn chunked(p: &Pair, len: u64, chunk: u64) -> ReadBatch {
    ReadBatch {
        reads: (0..len / chunk)
            .map(|i| ReadDesc {
                owner: 7,
                remote_region: p.rs.id(),
                remote_offset: i * chunk,
                local_region: p.rd.id(),
                local_offset: i * chunk,
                len: chunk,
                remote_rows: None,
            })
            .collect(),
    }
}

#[test]
fn status_becomes_a_typed_error_with_the_ucx_name() {
    let e = UcxStatusError::new("ucp_get_nbx", -6);
    assert_eq!(e.name(), "UCS_ERR_UNREACHABLE");
    assert_eq!(e.operation(), "ucp_get_nbx");
    let err: reshard_core::Error = e.into();
    assert_eq!(err.kind(), ErrorKind::Transport);
    assert!(err.is_retryable());
    assert_eq!(err.context().backend.as_deref(), Some("ucx"));
    let src = err
        .source()
        .and_then(|s| s.downcast_ref::<UcxStatusError>())
        .expect("keeps the UCX status");
    assert_eq!(src.code(), -6);
    let cancelled: reshard_core::Error = UcxStatusError::new("ucp_get_nbx", -16).into();
    assert_eq!(cancelled.kind(), ErrorKind::Aborted);
    let timed_out: reshard_core::Error = UcxStatusError::new("ucp_get_nbx", -20).into();
    assert_eq!(timed_out.kind(), ErrorKind::Timeout);
}

#[test]
fn unknown_config_key_is_a_config_error() {
    let config = TransportConfig {
        kind: "ucx".into(),
        workers: None,
        options: Some(serde_json::json!({ "tls": "tcp", "tlz": "x" })),
    };
    let e = UcxFactory::new().create("a", &config).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    let config = TransportConfig {
        options: Some(serde_json::json!({ "reads_in_flight": 0 })),
        ..config
    };
    let e = UcxFactory::new().create("a", &config).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn factory_endpoint_and_capabilities() {
    if !available() {
        return;
    }
    let config = TransportConfig {
        kind: "ucx".into(),
        workers: Some(3),
        options: Some(serde_json::json!({ "tls": "tcp", "reads_in_flight": 4 })),
    };
    let t = UcxFactory::new().create("factory-made", &config).unwrap();
    assert_eq!((t.name(), t.agent()), ("ucx", "factory-made"));
    let caps = t.capabilities();
    assert!(caps.one_sided_read && caps.cross_process && caps.max_reads_per_post.is_none());
    // No CUDA-enabled UCX on CI machines: VRAM is refused with a typed error there.
    if !caps.vram {
        #[derive(Debug)]
        struct FakeVram;
        unsafe impl MemoryBlock for FakeVram {
            fn addr(&self) -> usize {
                0x1000
            }
            fn len(&self) -> usize {
                64
            }
            fn kind(&self) -> MemoryKind {
                MemoryKind::Vram { device: 0 }
            }
        }
        let e = t.register(Arc::new(FakeVram)).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_ucx_option_value_is_a_typed_error() {
    if !available() {
        return;
    }
    // UCX itself rejects the device list when creating the context: the error is typed
    // and keeps UCX's status name.
    let e = UcxTransport::new(
        "bad-devices",
        UcxOptions {
            net_devices: Some("definitely-not-a-device:99".into()),
            tls: Some("tcp".into()),
            ..UcxOptions::default()
        },
    )
    .unwrap_err();
    let status = e
        .source()
        .and_then(|s| s.downcast_ref::<UcxStatusError>())
        .expect("keeps the UCX status");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert_eq!(status.operation(), "ucp_init");
    assert!(status.name().starts_with("UCS_ERR_"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_bounds_remote_read_is_rejected_at_prepare() {
    if !available() {
        return;
    }
    let p = pair(4096, UcxOptions::default()).await;
    let mut batch = chunked(&p, 4096, 1024);
    batch.reads[2].remote_offset = 4000;
    let e = p.receiver.prepare(batch).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    assert_eq!(e.context().owner, Some(7));
    assert_eq!(e.context().range, Some(4000..5024));
    // Local bounds too, and an unknown remote region.
    let mut batch = chunked(&p, 4096, 1024);
    batch.reads[0].local_offset = 3500;
    let e = p.receiver.prepare(batch).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    let mut batch = chunked(&p, 4096, 1024);
    batch.reads[1].remote_region = 99;
    let e = p.receiver.prepare(batch).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    assert!(p.dst.read().iter().all(|&b| b == 0), "nothing was posted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_peer_is_typed() {
    if !available() {
        return;
    }
    let p = pair(4096, UcxOptions::default()).await;
    let mut batch = chunked(&p, 4096, 1024);
    batch.reads[3].owner = 9;
    let e = p.receiver.prepare(batch).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerUnknown, "{e}");
    assert_eq!(e.context().owner, Some(9));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_metadata_is_a_decode_error() {
    if !available() {
        return;
    }
    let p = pair(4096, UcxOptions::default()).await;
    let good = p.publisher.export_metadata().await.unwrap();
    let epoch = p.receiver.epoch();
    let mut cases: Vec<Vec<u8>> = vec![
        good[..good.len() / 2].to_vec(),
        good[..3].to_vec(),
        Vec::new(),
        b"garbage garbage garbage".to_vec(),
    ];
    let mut wrong_version = good.to_vec();
    wrong_version[4] = 200;
    cases.push(wrong_version);
    let mut trailing = good.to_vec();
    trailing.push(1);
    cases.push(trailing);
    for bytes in cases {
        let e = p
            .receiver
            .load_peer(3, Bytes::from(bytes.clone()))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Decode, "{e} for {bytes:?}");
        assert_eq!(e.context().owner, Some(3));
    }
    assert_eq!(p.receiver.epoch(), epoch, "failed loads change nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloading_a_peer_bumps_the_epoch_and_prepared_batches_follow() {
    if !available() {
        return;
    }
    let p = pair(64 << 10, UcxOptions::default()).await;
    let prepared = p
        .receiver
        .prepare(chunked(&p, 64 << 10, 4096))
        .await
        .unwrap();
    let before = p.receiver.epoch();
    // The publisher registers another region and re-exports: reload replaces endpoint and keys.
    let extra = Arc::new(HostBuffer::from_bytes(&pattern(4096, 9)));
    let rx = p
        .publisher
        .register(extra.clone() as Arc<dyn MemoryBlock>)
        .await
        .unwrap();
    assert_eq!(
        (p.rs.id(), p.rd.id(), rx.id()),
        (1, 1, 2),
        "ids in registration order"
    );
    p.receiver
        .load_peer(7, p.publisher.export_metadata().await.unwrap())
        .await
        .unwrap();
    assert!(p.receiver.epoch() > before);
    // A batch prepared under the old epoch is re-resolved transparently.
    let report = p
        .receiver
        .post(&prepared)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(report.bytes, 64 << 10);
    assert_eq!(p.dst.read()[..], p.src.read()[..]);
    // A local deregistration bumps the epoch, and the stale batch now fails typed.
    let before = p.receiver.epoch();
    let Pair { receiver, rd, .. } = p;
    drop(rd);
    // Deregistration is applied by the progress thread; the next command sees it.
    let _ = receiver.export_metadata().await.unwrap();
    assert!(receiver.epoch() > before);
    let e = match receiver.post(&prepared).await {
        Ok(f) => f.wait().await.unwrap_err(),
        Err(e) => e,
    };
    assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_in_flight_cap_smaller_than_the_batch_is_byte_exact() {
    if !available() {
        return;
    }
    for options in [
        tcp(3),
        UcxOptions {
            reads_in_flight: 1,
            ..UcxOptions::default()
        },
    ] {
        let len = 1 << 20;
        let p = pair(len, options).await;
        // Odd-sized reads in reverse order, so the cap and ordering both matter.
        let mut batch = chunked(&p, len as u64, 1000);
        batch.reads.reverse();
        let tail = (len as u64 / 1000) * 1000;
        batch.reads.push(ReadDesc {
            owner: 7,
            remote_region: p.rs.id(),
            remote_offset: tail,
            local_region: p.rd.id(),
            local_offset: tail,
            len: len as u64 - tail,
            remote_rows: None,
        });
        let prepared = p.receiver.prepare(batch).await.unwrap();
        for _ in 0..2 {
            let report = p
                .receiver
                .post(&prepared)
                .await
                .unwrap()
                .wait()
                .await
                .unwrap();
            assert_eq!(report.bytes, len as u64);
            assert_eq!(report.reads, prepared.batch().reads.len() as u64);
            assert!(p.dst.read()[..] == p.src.read()[..], "byte exact");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_mid_batch_then_repost_completes() {
    if !available() {
        return;
    }
    let len = 4 << 20;
    let p = pair(len, tcp(2)).await;
    let prepared = p
        .receiver
        .prepare(chunked(&p, len as u64, 512))
        .await
        .unwrap();
    let inflight = p.receiver.post(&prepared).await.unwrap();
    inflight.abort().await;
    // After abort nothing writes the buffer any more: it stays as it is.
    let snapshot = p.dst.read().to_vec();
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    assert!(
        p.dst.read()[..] == snapshot[..],
        "no write after abort returned"
    );
    // Dropping an in-flight batch without waiting stops it too.
    drop(p.receiver.post(&prepared).await.unwrap());
    let report = p
        .receiver
        .post(&prepared)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(report.bytes, len as u64);
    assert!(p.dst.read()[..] == p.src.read()[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_from_another_endpoint_is_refused() {
    if !available() {
        return;
    }
    let p = pair(4096, UcxOptions::default()).await;
    let prepared = p.receiver.prepare(chunked(&p, 4096, 4096)).await.unwrap();
    let e = match p.publisher.post(&prepared).await {
        Ok(_) => panic!("another endpoint's batch must be refused"),
        Err(e) => e,
    };
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_publisher_fails_the_read_naming_owner_and_range() {
    if !available() {
        return;
    }
    // A peer lost over TCP is reported by UCX's peer failure handling, or else by the
    // no-progress timeout.
    let options = UcxOptions {
        timeout_ms: 500,
        ..tcp(16)
    };
    let p = pair(1 << 20, options).await;
    let prepared = p
        .receiver
        .prepare(chunked(&p, 1 << 20, 1 << 16))
        .await
        .unwrap();
    p.receiver
        .post(&prepared)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    let Pair {
        publisher,
        receiver,
        rs,
        ..
    } = p;
    drop(rs);
    drop(publisher);
    let e = match receiver.post(&prepared).await {
        Ok(f) => f.wait().await.unwrap_err(),
        Err(e) => e,
    };
    assert!(
        matches!(e.kind(), ErrorKind::Transport | ErrorKind::Timeout),
        "{e}"
    );
    assert_eq!(e.context().owner, Some(7), "{e}");
    assert!(e.context().range.is_some(), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_allocated_memory_is_shared_by_endpoints_and_read_byte_exact() {
    if !available() {
        return;
    }
    // Two publisher endpoints of one configuration register one allocation (the synthetic
    // cluster's arena); a receiver reads halves through each owner, in pieces large enough
    // for the streaming copy and with odd offsets; an endpoint of another configuration
    // (tcp) registers the same memory as plain user memory.
    let len = (3 << 20) + 4099;
    let a = endpoint("publisher-a", UcxOptions::default());
    let b = endpoint("publisher-b", UcxOptions::default());
    let arena = a
        .allocate_host(len)
        .await
        .expect("allocate")
        .expect("ucx allocates host memory");
    assert_eq!(arena.len(), len);
    assert!(
        arena.bytes().iter().all(|&x| x == 0),
        "allocation is zeroed"
    );
    let data = pattern(len, 5);
    arena.bytes_mut().copy_from_slice(&data);
    let block = arena.clone() as Arc<dyn MemoryBlock>;
    let ra = a.register(block.clone()).await.expect("register on a");
    let rb = b.register(block.clone()).await.expect("register on b");
    let t = endpoint("publisher-tcp", tcp(8));
    let rt = t.register(block).await.expect("register on a tcp endpoint");
    // The owner drops its handle first: registrations keep the memory alive.
    drop(arena);
    let receiver = endpoint("receiver", UcxOptions::default());
    let dst = Arc::new(HostBuffer::zeroed(len));
    let rd = receiver
        .register(dst.clone() as Arc<dyn MemoryBlock>)
        .await
        .expect("register dst");
    receiver
        .load_peer(1, a.export_metadata().await.unwrap())
        .await
        .unwrap();
    receiver
        .load_peer(2, b.export_metadata().await.unwrap())
        .await
        .unwrap();
    let half = (len / 2) as u64 + 3;
    let read = |owner, region: &Registration, off: u64, n: u64| ReadDesc {
        owner,
        remote_region: region.id(),
        remote_offset: off,
        local_region: rd.id(),
        local_offset: off,
        len: n,
        remote_rows: None,
    };
    let batch = ReadBatch {
        reads: vec![read(1, &ra, 0, half), read(2, &rb, half, len as u64 - half)],
    };
    let prepared = receiver.prepare(batch).await.expect("prepare");
    for _ in 0..2 {
        let report = receiver
            .post(&prepared)
            .await
            .expect("post")
            .wait()
            .await
            .expect("wait");
        assert_eq!(report.bytes, len as u64);
        assert!(dst.read()[..] == data[..], "byte-exact through both owners");
        dst.write().fill(0);
    }
    // Reading out of the allocation through the tcp endpoint (emulated reads).
    let tcp_receiver = endpoint("receiver-tcp", tcp(8));
    let rd2 = tcp_receiver
        .register(dst.clone() as Arc<dyn MemoryBlock>)
        .await
        .unwrap();
    tcp_receiver
        .load_peer(3, t.export_metadata().await.unwrap())
        .await
        .unwrap();
    let batch = ReadBatch {
        reads: vec![ReadDesc {
            owner: 3,
            remote_region: rt.id(),
            remote_offset: 0,
            local_region: rd2.id(),
            local_offset: 0,
            len: len as u64,
            remote_rows: None,
        }],
    };
    let p = tcp_receiver.prepare(batch).await.unwrap();
    tcp_receiver.post(&p).await.unwrap().wait().await.unwrap();
    assert!(dst.read()[..] == data[..], "byte-exact over tcp");
    drop((ra, rb, rt));
}
