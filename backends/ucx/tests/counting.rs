//! Counted completions, the execution log, typed peer errors and metadata that contradicts
//! what UCX mapped, through the public API (the skipped read comes from the
//! `fault-injection` feature, which only this crate's dev-dependency on itself enables).

use std::sync::Arc;

use bytes::Bytes;
use reshard_backend_ucx::{UcxOptions, UcxTransport};
use reshard_conformance::fixtures::tiny_dense;
use reshard_conformance::Harness;
use reshard_core::{
    ErrorKind, ExecutionLog, HostBuffer, MemoryBlock, ReadBatch, ReadDesc, Registration, Transport,
};
use reshard_runtime::ReceiverOptions;

const MIB: u64 = 1 << 20;

/// Skips (loudly) when UCX is not installed, unless `RESHARD_REQUIRE_BACKENDS` names ucx.
fn available() -> bool {
    reshard_conformance::backend_available("ucx", reshard_backend_ucx::probe())
}

fn endpoint(agent: &str) -> UcxTransport {
    UcxTransport::new(agent, UcxOptions::default()).expect("ucx endpoint")
}

fn read(
    owner: u32,
    src: &Registration,
    so: u64,
    dst: &Registration,
    dof: u64,
    len: u64,
) -> ReadDesc {
    ReadDesc {
        owner,
        remote_region: src.id(),
        remote_offset: so,
        local_region: dst.id(),
        local_offset: dof,
        len,
    }
}

/// Owner 4 holds user memory (read with `ucp_get_nbx`), owner 9 UCX-allocated shared memory
/// (copied directly out of the segment UCX mapped here); two regions each, the first large
/// enough that a 17 MiB read is cut into two pieces. One receiver with two regions.
struct Setup {
    _pubs: Vec<UcxTransport>,
    receiver: UcxTransport,
    src: Vec<(u32, Registration)>,
    dst_bufs: Vec<Arc<HostBuffer>>,
    dst: Vec<Registration>,
}

async fn setup() -> Setup {
    let receiver = endpoint("receiver");
    let mut pubs = Vec::new();
    let mut src = Vec::new();
    for owner in [4u32, 9] {
        let t = endpoint(&format!("publisher-{owner}"));
        for (j, len) in [20 * MIB, MIB].into_iter().enumerate() {
            let fill: Vec<u8> = (0..len as usize)
                .map(|i| (i % 251) as u8 ^ (owner as u8 * 16 + j as u8))
                .collect();
            let block: Arc<dyn MemoryBlock> = if owner == 9 {
                let m = t.allocate_host(len as usize).await.unwrap().unwrap();
                m.bytes_mut().copy_from_slice(&fill);
                m
            } else {
                Arc::new(HostBuffer::from_bytes(&fill))
            };
            src.push((owner, t.register(block).await.unwrap()));
        }
        receiver
            .load_peer(owner, t.export_metadata().await.unwrap())
            .await
            .unwrap();
        pubs.push(t);
    }
    let dst_bufs = vec![
        Arc::new(HostBuffer::zeroed(20 * MIB as usize)),
        Arc::new(HostBuffer::zeroed(20 * MIB as usize)),
    ];
    let mut dst = Vec::new();
    for b in &dst_bufs {
        dst.push(
            receiver
                .register(b.clone() as Arc<dyn MemoryBlock>)
                .await
                .unwrap(),
        );
    }
    Setup {
        _pubs: pubs,
        receiver,
        src,
        dst_bufs,
        dst,
    }
}

/// Five reads over both paths, two of them cut into pieces, of distinct lengths.
fn batch(s: &Setup) -> ReadBatch {
    let r = |i: usize, so: u64, d: usize, dof: u64, len: u64| {
        let (owner, reg) = &s.src[i];
        read(*owner, reg, so, &s.dst[d], dof, len)
    };
    ReadBatch {
        reads: vec![
            r(0, 100, 0, 0, 17 * MIB),
            r(1, 0, 0, 18 * MIB, 3000),
            r(2, 7, 1, 0, 17 * MIB + 5),
            r(3, 20_000, 1, 18 * MIB, 7000),
            r(1, 30_000, 1, 19 * MIB, 11_000),
        ],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_counts_completed_reads_and_a_skipped_read_is_missing() {
    if !available() {
        return;
    }
    let s = setup().await;
    let b = batch(&s);
    let prepared = s.receiver.prepare(b.clone()).await.unwrap();
    let full = s
        .receiver
        .post(&prepared)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!((full.reads, full.bytes), (5, b.bytes()));
    for skip in 0..b.reads.len() {
        s.receiver.inject_skip_read(Some(skip));
        let short = s.receiver.post(&prepared).await.unwrap().wait().await;
        s.receiver.inject_skip_read(None);
        let short = short.unwrap();
        assert_eq!(short.reads, 4, "skipped read {skip}");
        assert_eq!(
            short.bytes,
            b.bytes() - b.reads[skip].len,
            "skipped read {skip}"
        );
    }
    // The skipped (last) read really did not move.
    s.dst_bufs[1].write().fill(0);
    s.receiver.inject_skip_read(Some(2));
    s.receiver
        .post(&prepared)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    s.receiver.inject_skip_read(None);
    let r2 = &b.reads[2];
    assert!(s.dst_bufs[1].read()[..r2.len as usize]
        .iter()
        .all(|&x| x == 0));
    let again = s
        .receiver
        .post(&prepared)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(again, full);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_read_fails_the_update_without_verification_and_keeps_live_weights() {
    if !available() {
        return;
    }
    let h = Harness::new("ucx", |agent| {
        Ok(Arc::new(UcxTransport::new(agent, UcxOptions::default())?) as Arc<dyn Transport>)
    });
    let mut cluster = h.cluster(tiny_dense(4), "tp=2").await;
    let t = Arc::new(endpoint("receiver"));
    let opts = ReceiverOptions {
        verify_digests: false,
        ..ReceiverOptions::default()
    };
    let mut rx = h
        .receiver_on(&cluster, t.clone() as Arc<dyn Transport>, 2, 0, opts)
        .await;
    rx.update(&cluster.tables()).await.expect("first refit");
    let snapshot = |rx: &reshard_runtime::Receiver| -> Vec<Vec<u8>> {
        rx.live_params()
            .unwrap()
            .iter()
            .map(|b| b.read().to_vec())
            .collect()
    };
    let before = snapshot(&rx);
    cluster.publish_step(1).expect("publish step");
    t.inject_skip_read(Some(0));
    let e = rx
        .update(&cluster.tables())
        .await
        .expect_err("a lost read must fail the update");
    t.inject_skip_read(None);
    assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
    assert!(e.to_string().contains("planned"), "{e}");
    assert_eq!(snapshot(&rx), before, "live weights must be untouched");
    assert_eq!(rx.live_step(), Some(0));
    rx.update(&cluster.tables())
        .await
        .expect("refit after the fault");
    assert_eq!(rx.live_step(), Some(1));
}

fn sorted(mut v: Vec<ReadDesc>) -> Vec<ReadDesc> {
    v.sort_unstable_by_key(|r| {
        (
            r.owner,
            r.remote_region,
            r.remote_offset,
            r.local_region,
            r.local_offset,
            r.len,
        )
    });
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_execution_log_holds_the_reads_posted_with_region_ids_per_endpoint() {
    if !available() {
        return;
    }
    let s = setup().await;
    assert_eq!(
        s.src.iter().map(|x| x.1.id()).collect::<Vec<_>>(),
        [1, 2, 1, 2]
    );
    assert_eq!(s.dst.iter().map(|r| r.id()).collect::<Vec<_>>(), [1, 2]);
    let b = batch(&s);
    let prepared = s.receiver.prepare(b.clone()).await.unwrap();
    s.receiver
        .post(&prepared)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    let log = ExecutionLog::new();
    assert!(s.receiver.set_execution_log(Some(log.clone())));
    s.receiver
        .post(&prepared)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    // Reads cut into pieces are recorded once, whole.
    assert_eq!(sorted(log.take()), sorted(b.reads.clone()));
    assert!(s.receiver.set_execution_log(None));
    s.receiver
        .post(&prepared)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert!(log.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_peer_names_owner_range_and_backend() {
    if !available() {
        return;
    }
    let s = setup().await;
    let (_, reg) = &s.src[0];
    let e = s
        .receiver
        .prepare(ReadBatch {
            reads: vec![
                read(4, reg, 0, &s.dst[0], 0, 8),
                read(77, reg, 40, &s.dst[0], 8, 16),
            ],
        })
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerUnknown, "{e}");
    assert_eq!(e.context().owner, Some(77));
    assert_eq!(e.context().range, Some(40..56));
    assert_eq!(e.context().backend.as_deref(), Some("ucx"));
}

/// Metadata layout (see `meta.rs`): magic, version, name, worker address, region count, then
/// per region `id, base, len, key_base, key_len` (u64 each), kind `u8`, device `u32`, key
/// length `u32` and key. Enlarges region `region`'s length and its key's range by `by`
/// (a consistent lie, so decoding accepts it).
fn enlarge_region(meta: &[u8], region: u64, by: u64) -> Bytes {
    let mut v = meta.to_vec();
    let u16_at = |v: &[u8], at: usize| u16::from_le_bytes([v[at], v[at + 1]]) as usize;
    let u32_at = |v: &[u8], at: usize| u32::from_le_bytes(v[at..at + 4].try_into().unwrap());
    let u64_at = |v: &[u8], at: usize| u64::from_le_bytes(v[at..at + 8].try_into().unwrap());
    let mut at = 5;
    at += 2 + u16_at(&v, at);
    at += 4 + u32_at(&v, at) as usize;
    let count = u32_at(&v, at);
    at += 4;
    for _ in 0..count {
        if u64_at(&v, at) == region {
            for field in [at + 16, at + 32] {
                let x = u64_at(&v, field) + by;
                v[field..field + 8].copy_from_slice(&x.to_le_bytes());
            }
            return v.into();
        }
        at += 40 + 1 + 4;
        at += 4 + u32_at(&v, at) as usize;
    }
    panic!("region {region} not in metadata");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_advertising_shared_memory_larger_than_mapped_is_refused_at_prepare() {
    if !available() {
        return;
    }
    let publisher = endpoint("publisher");
    let receiver = endpoint("receiver");
    let mem = publisher
        .allocate_host(MIB as usize)
        .await
        .unwrap()
        .unwrap();
    let src = publisher
        .register(mem as Arc<dyn MemoryBlock>)
        .await
        .unwrap();
    let dst = receiver
        .register(Arc::new(HostBuffer::zeroed(MIB as usize)) as Arc<dyn MemoryBlock>)
        .await
        .unwrap();
    let meta = publisher.export_metadata().await.unwrap();
    // Honest metadata: the read is prepared and moves.
    receiver.load_peer(3, meta.clone()).await.unwrap();
    let p = receiver
        .prepare(ReadBatch {
            reads: vec![read(3, &src, 0, &dst, 0, 4096)],
        })
        .await
        .unwrap();
    receiver.post(&p).await.unwrap().wait().await.unwrap();
    // The same segment advertised 64 MiB larger than UCX mapped it: even a read inside the
    // honest range is refused at prepare, before anything is posted.
    receiver
        .load_peer(6, enlarge_region(&meta, src.id(), 64 * MIB))
        .await
        .unwrap();
    let e = receiver
        .prepare(ReadBatch {
            reads: vec![read(6, &src, 0, &dst, 0, 4096)],
        })
        .await
        .expect_err("a region larger than its mapping must be refused");
    assert!(
        matches!(e.kind(), ErrorKind::OutOfBounds | ErrorKind::InvalidInput),
        "{e}"
    );
    assert_eq!(e.context().owner, Some(6));
    assert_eq!(e.context().range, Some(0..4096));
    assert_eq!(e.context().backend.as_deref(), Some("ucx"));
}
