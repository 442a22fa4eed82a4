//! Counted completions, the execution log, typed peer errors and envelopes that advertise
//! more than the peer's NIXL agent registered, through the public API (the skipped read comes
//! from the `fault-injection` feature, which only this crate's dev-dependency on itself
//! enables).

use std::sync::Arc;

use bytes::Bytes;
use reshard_backend_nixl::{probe, NixlOptions, NixlTransport, BACKEND};
use reshard_conformance::fixtures::tiny_dense;
use reshard_conformance::Harness;
use reshard_core::{
    ErrorKind, ExecutionLog, HostBuffer, MemoryBlock, ReadBatch, ReadDesc, Registration, Transport,
};
use reshard_runtime::ReceiverOptions;

const MIB: u64 = 1 << 20;

fn available() -> bool {
    reshard_conformance::backend_available(BACKEND, probe())
}

fn endpoint(name: &str) -> NixlTransport {
    NixlTransport::new(name, &NixlOptions::default()).expect("nixl endpoint")
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

/// Owners 4 and 9 with two regions each (owner 4's first one 72 MiB, so its reads need two
/// 64 MiB-capped requests), one receiver with two regions.
struct Setup {
    _pubs: Vec<NixlTransport>,
    receiver: NixlTransport,
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
        let first = if owner == 4 { 72 * MIB } else { MIB };
        for (j, len) in [first, MIB].into_iter().enumerate() {
            let fill: Vec<u8> = (0..len as usize)
                .map(|i| (i % 251) as u8 ^ (owner as u8 * 16 + j as u8))
                .collect();
            let b = Arc::new(HostBuffer::from_bytes(&fill)) as Arc<dyn MemoryBlock>;
            src.push((owner, t.register(b).await.unwrap()));
        }
        receiver
            .load_peer(owner, t.export_metadata().await.unwrap())
            .await
            .unwrap();
        pubs.push(t);
    }
    let dst_bufs = vec![
        Arc::new(HostBuffer::zeroed(72 * MIB as usize)),
        Arc::new(HostBuffer::zeroed(MIB as usize)),
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

/// Six reads: two large ones of owner 4 (one request each: together they exceed 64 MiB) and
/// small ones of both owners sharing requests.
fn batch(s: &Setup) -> ReadBatch {
    let r = |i: usize, so: u64, d: usize, dof: u64, len: u64| {
        let (owner, reg) = &s.src[i];
        read(*owner, reg, so, &s.dst[d], dof, len)
    };
    ReadBatch {
        reads: vec![
            r(0, 100, 0, 0, 40 * MIB),
            r(0, 40 * MIB + 200, 0, 40 * MIB, 30 * MIB),
            r(1, 0, 1, 0, 3000),
            r(2, 7, 1, 4096, 5000),
            r(3, 20_000, 1, 16_384, 7000),
            r(1, 30_000, 1, 65_536, 11_000),
        ],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_counts_completed_requests_and_a_skipped_read_is_missing() {
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
    assert_eq!((full.reads, full.bytes), (6, b.bytes()));
    for skip in [0usize, 2, 4] {
        s.dst_bufs[1].write().fill(0);
        s.receiver.inject_skip_read(Some(skip));
        let p = s.receiver.prepare(b.clone()).await;
        s.receiver.inject_skip_read(None);
        let short = s
            .receiver
            .post(&p.unwrap())
            .await
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert_eq!(short.reads, 5, "skipped read {skip}");
        assert_eq!(
            short.bytes,
            b.bytes() - b.reads[skip].len,
            "skipped read {skip}"
        );
    }
    // The last skipped read (4) really did not move.
    let r4 = &b.reads[4];
    let d = s.dst_bufs[1].read();
    assert!(
        d[r4.local_offset as usize..(r4.local_offset + r4.len) as usize]
            .iter()
            .all(|&x| x == 0)
    );
    drop(d);
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
    let h = Harness::new("nixl", |agent| {
        Ok(Arc::new(NixlTransport::new(agent, &NixlOptions::default())?) as Arc<dyn Transport>)
    });
    let mut cluster = h.cluster(tiny_dense(4), "tp=2").await;
    let t = Arc::new(endpoint("receiver"));
    let opts = ReceiverOptions {
        verify_digests: false,
        // NIXL's skip acts at prepare: rebuild descriptors at every update.
        cache_descriptors: false,
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
    let (_, reg) = &s.src[2];
    let e = s
        .receiver
        .prepare(ReadBatch {
            reads: vec![
                read(9, reg, 0, &s.dst[1], 0, 8),
                read(77, reg, 40, &s.dst[1], 8, 16),
            ],
        })
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerUnknown, "{e}");
    assert_eq!(e.context().owner, Some(77));
    assert_eq!(e.context().range, Some(40..56));
    assert_eq!(e.context().backend.as_deref(), Some("nixl"));
}

/// Envelope layout (see `meta.rs`): magic, version, agent name, NIXL name, region count, then
/// per region `id, addr, len` (u64 each), kind `u8`, device `u32`; NIXL metadata; XXH3 of
/// everything before it. Enlarges region `region`'s advertised length by `by` and reseals.
fn enlarge_region(meta: &[u8], region: u64, by: u64) -> Bytes {
    let mut v = meta.to_vec();
    let u16_at = |v: &[u8], at: usize| u16::from_le_bytes([v[at], v[at + 1]]) as usize;
    let u64_at = |v: &[u8], at: usize| u64::from_le_bytes(v[at..at + 8].try_into().unwrap());
    let mut at = 5;
    at += 2 + u16_at(&v, at);
    at += 2 + u16_at(&v, at);
    let count = u32::from_le_bytes(v[at..at + 4].try_into().unwrap());
    at += 4;
    let mut found = false;
    for _ in 0..count {
        if u64_at(&v, at) == region {
            let len = u64_at(&v, at + 16) + by;
            v[at + 16..at + 24].copy_from_slice(&len.to_le_bytes());
            found = true;
        }
        at += 29;
    }
    assert!(found, "region {region} not in metadata");
    let n = v.len() - 8;
    let sum = xxhash_rust::xxh3::xxh3_64(&v[..n]);
    v[n..].copy_from_slice(&sum.to_le_bytes());
    v.into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_advertising_a_region_larger_than_registered_is_refused_at_load() {
    if !available() {
        return;
    }
    let publisher = endpoint("publisher");
    let receiver = endpoint("receiver");
    let src = publisher
        .register(Arc::new(HostBuffer::zeroed(MIB as usize)) as Arc<dyn MemoryBlock>)
        .await
        .unwrap();
    let dst = receiver
        .register(Arc::new(HostBuffer::zeroed(2 * MIB as usize)) as Arc<dyn MemoryBlock>)
        .await
        .unwrap();
    let meta = publisher.export_metadata().await.unwrap();
    let tampered = enlarge_region(&meta, src.id(), MIB);
    let e = receiver
        .load_peer(6, tampered)
        .await
        .expect_err("an enlarged region must be refused");
    assert!(
        matches!(e.kind(), ErrorKind::OutOfBounds | ErrorKind::InvalidInput),
        "{e}"
    );
    assert_eq!(e.context().owner, Some(6));
    assert_eq!(e.context().range, Some(0..2 * MIB));
    assert_eq!(e.context().backend.as_deref(), Some("nixl"));
    // Nothing of the lie was kept: owner 6 is unknown, and the honest metadata loads and
    // serves a read afterwards.
    let e = receiver
        .prepare(ReadBatch {
            reads: vec![read(6, &src, MIB, &dst, 0, 4096)],
        })
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerUnknown, "{e}");
    receiver.load_peer(6, meta).await.unwrap();
    let p = receiver
        .prepare(ReadBatch {
            reads: vec![read(6, &src, 0, &dst, 0, 4096)],
        })
        .await
        .unwrap();
    receiver.post(&p).await.unwrap().wait().await.unwrap();
}
