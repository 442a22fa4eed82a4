//! Counted completions, the execution log and metadata the fabric contradicts, through the
//! public API (the skipped read comes from the `fault-injection` feature, which only this
//! crate's dev-dependency on itself enables).

use std::sync::Arc;

use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
use reshard_conformance::fixtures::tiny_dense;
use reshard_conformance::Harness;
use reshard_core::{
    ErrorKind, ExecutionLog, HostBuffer, ReadBatch, ReadDesc, Registration, Transport,
};
use reshard_runtime::ReceiverOptions;

fn patterned(len: usize, seed: u8) -> Arc<HostBuffer> {
    let v: Vec<u8> = (0..len).map(|i| (i % 251) as u8 ^ seed).collect();
    Arc::new(HostBuffer::from_bytes(&v))
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

/// Two publishers (owners 4 and 9) with two regions each, one receiver with two regions.
struct Setup {
    _fabric: LoopbackFabric,
    _pubs: Vec<LoopbackTransport>,
    receiver: LoopbackTransport,
    src: Vec<(u32, Arc<HostBuffer>, Registration)>,
    dst_bufs: Vec<Arc<HostBuffer>>,
    dst: Vec<Registration>,
}

async fn setup() -> Setup {
    let fabric = LoopbackFabric::new();
    let receiver = LoopbackTransport::new(&fabric, "recv", 2).unwrap();
    let mut pubs = Vec::new();
    let mut src = Vec::new();
    for (k, owner) in [4u32, 9].into_iter().enumerate() {
        let t = LoopbackTransport::new(&fabric, &format!("pub{owner}"), 1).unwrap();
        for j in 0..2u8 {
            let b = patterned(1 << 20, (k as u8) * 16 + j + 1);
            let r = t.register(b.clone()).await.unwrap();
            src.push((owner, b, r));
        }
        receiver
            .load_peer(owner, t.export_metadata().await.unwrap())
            .await
            .unwrap();
        pubs.push(t);
    }
    let dst_bufs = vec![
        Arc::new(HostBuffer::zeroed(1 << 20)),
        Arc::new(HostBuffer::zeroed(1 << 20)),
    ];
    let mut dst = Vec::new();
    for b in &dst_bufs {
        dst.push(receiver.register(b.clone()).await.unwrap());
    }
    Setup {
        _fabric: fabric,
        _pubs: pubs,
        receiver,
        src,
        dst_bufs,
        dst,
    }
}

/// Five reads over every source and destination region, of distinct lengths.
fn batch(s: &Setup) -> ReadBatch {
    let r = |i: usize, so: u64, d: usize, dof: u64, len: u64| {
        let (owner, _, reg) = &s.src[i];
        read(*owner, reg, so, &s.dst[d], dof, len)
    };
    ReadBatch {
        reads: vec![
            r(0, 100, 0, 0, 1000),
            r(1, 0, 0, 4096, 3000),
            r(2, 7, 1, 0, 5000),
            r(3, 20_000, 1, 8192, 7000),
            r(0, 30_000, 1, 20_000, 11_000),
        ],
    }
}

#[tokio::test]
async fn wait_counts_completed_reads_and_a_skipped_read_is_missing() {
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
    for skip in [0usize, 3] {
        s.dst_bufs[1].write().fill(0);
        s.receiver.inject_skip_read(Some(skip));
        let short = s
            .receiver
            .post(&prepared)
            .await
            .unwrap()
            .wait()
            .await
            .unwrap();
        s.receiver.inject_skip_read(None);
        assert_eq!(short.reads, 4, "skipped read {skip}");
        assert_eq!(
            short.bytes,
            b.bytes() - b.reads[skip].len,
            "skipped read {skip}"
        );
    }
    // Read 3 really did not move: its destination bytes stayed zero.
    let r3 = &b.reads[3];
    let d = s.dst_bufs[1].read();
    assert!(
        d[r3.local_offset as usize..(r3.local_offset + r3.len) as usize]
            .iter()
            .all(|&x| x == 0)
    );
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

#[tokio::test]
async fn a_lost_read_fails_the_update_without_verification_and_keeps_live_weights() {
    let fabric = LoopbackFabric::new();
    let f = fabric.clone();
    let h = Harness::new("loopback", move |agent| {
        Ok(Arc::new(LoopbackTransport::new(&f, agent, 2)?) as Arc<dyn Transport>)
    });
    let mut cluster = h.cluster(tiny_dense(4), "tp=2").await;
    let t = Arc::new(LoopbackTransport::new(&fabric, "receiver", 2).unwrap());
    let opts = ReceiverOptions {
        verify_digests: false,
        ..ReceiverOptions::default()
    };
    let mut rx = h
        .receiver_on(&cluster, t.clone() as Arc<dyn Transport>, 2, 0, opts)
        .await;
    rx.update(&cluster.tables()).await.expect("first refit");
    let before: Vec<Vec<u8>> = rx
        .live_params()
        .unwrap()
        .iter()
        .map(|b| b.read().to_vec())
        .collect();
    cluster.publish_step(1).expect("publish step");
    t.inject_skip_read(Some(0));
    let e = rx
        .update(&cluster.tables())
        .await
        .expect_err("a lost read must fail the update");
    t.inject_skip_read(None);
    assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
    assert!(e.to_string().contains("planned"), "{e}");
    let after: Vec<Vec<u8>> = rx
        .live_params()
        .unwrap()
        .iter()
        .map(|b| b.read().to_vec())
        .collect();
    assert_eq!(after, before, "live weights must be untouched");
    assert_eq!(rx.live_step(), Some(0));
    // Without the fault the next update installs step 1.
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

#[tokio::test]
async fn the_execution_log_holds_the_reads_posted_with_region_ids_per_endpoint() {
    let s = setup().await;
    // Region ids are 1, 2, ... per endpoint.
    assert_eq!(
        s.src.iter().map(|x| x.2.id()).collect::<Vec<_>>(),
        [1, 2, 1, 2]
    );
    assert_eq!(s.dst.iter().map(|r| r.id()).collect::<Vec<_>>(), [1, 2]);
    let b = batch(&s);
    let prepared = s.receiver.prepare(b.clone()).await.unwrap();
    // Nothing is recorded while no log is set.
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
    // A read split between the two workers (1 MiB: two 512 KiB pieces) is recorded once,
    // whole.
    let (owner, _, reg) = &s.src[1];
    let big = ReadBatch {
        reads: vec![read(*owner, reg, 0, &s.dst[0], 0, 1 << 20)],
    };
    let p2 = s.receiver.prepare(big.clone()).await.unwrap();
    s.receiver.post(&p2).await.unwrap().wait().await.unwrap();
    assert_eq!(log.take(), big.reads);
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

#[tokio::test]
async fn unknown_peer_names_owner_range_and_backend() {
    let s = setup().await;
    let (_, _, reg) = &s.src[0];
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
    assert_eq!(e.context().backend.as_deref(), Some("loopback"));
}

/// Metadata layout (see `meta.rs`): magic, version, fabric id, agent uid, name, region count,
/// then `(id u64, len u64)` per region.
fn enlarge_region(meta: &[u8], region: u64, by: u64) -> Vec<u8> {
    let mut v = meta.to_vec();
    let name_len = u16::from_le_bytes([v[21], v[22]]) as usize;
    let count_at = 23 + name_len;
    let count = u32::from_le_bytes(v[count_at..count_at + 4].try_into().unwrap()) as usize;
    for k in 0..count {
        let at = count_at + 4 + 16 * k;
        if u64::from_le_bytes(v[at..at + 8].try_into().unwrap()) == region {
            let len = u64::from_le_bytes(v[at + 8..at + 16].try_into().unwrap());
            v[at + 8..at + 16].copy_from_slice(&(len + by).to_le_bytes());
            return v;
        }
    }
    panic!("region {region} not in metadata");
}

#[tokio::test]
async fn a_peer_advertising_a_region_larger_than_registered_is_refused_at_load() {
    let fabric = LoopbackFabric::new();
    let publisher = LoopbackTransport::new(&fabric, "pub", 1).unwrap();
    let receiver = LoopbackTransport::new(&fabric, "recv", 1).unwrap();
    let _a = publisher
        .register(Arc::new(HostBuffer::zeroed(4096)))
        .await
        .unwrap();
    let b = publisher
        .register(Arc::new(HostBuffer::zeroed(8192)))
        .await
        .unwrap();
    let meta = publisher.export_metadata().await.unwrap();
    // The honest metadata loads.
    receiver.load_peer(3, meta.clone()).await.unwrap();
    let tampered = enlarge_region(&meta, b.id(), 1 << 20);
    let e = receiver
        .load_peer(6, tampered.into())
        .await
        .expect_err("an enlarged region must be refused");
    assert!(
        matches!(e.kind(), ErrorKind::OutOfBounds | ErrorKind::InvalidInput),
        "{e}"
    );
    assert_eq!(e.context().owner, Some(6));
    assert_eq!(e.context().range, Some(8192..8192 + (1 << 20)));
    assert_eq!(e.context().backend.as_deref(), Some("loopback"));
    // Owner 6 was not loaded: a read from it is refused as unknown, nothing was posted.
    let dst = receiver
        .register(Arc::new(HostBuffer::zeroed(4096)))
        .await
        .unwrap();
    let e = receiver
        .prepare(ReadBatch {
            reads: vec![read(6, &b, 8192, &dst, 0, 16)],
        })
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerUnknown, "{e}");
}
