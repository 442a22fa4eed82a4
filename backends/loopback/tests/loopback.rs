//! Integration tests of the loopback transport through its public API.

use reshard_backend_loopback::{LoopbackFabric, LoopbackFactory, LoopbackTransport};
use reshard_core::config::TransportConfig;
use reshard_core::registry::Registry;
use reshard_core::{
    ErrorKind, HostBuffer, MemoryBlock, MemoryKind, ReadBatch, ReadDesc, Registration, Transport,
};
use std::sync::Arc;

const KIB: u64 = 1024;
const MIB: u64 = 1 << 20;

/// A small deterministic generator (xorshift), so tests need no extra crates.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn patterned(len: usize, seed: u64) -> Arc<HostBuffer> {
    let b = HostBuffer::zeroed(len);
    let mut r = Rng(seed | 1);
    for chunk in b.write().chunks_mut(8) {
        let v = r.next().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    Arc::new(b)
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
        remote_rows: None,
    }
}

/// One receiver with a 1 MiB destination and one publisher (owner 0) with a 1 MiB source.
struct Simple {
    fabric: LoopbackFabric,
    publisher: LoopbackTransport,
    receiver: LoopbackTransport,
    src_buf: Arc<HostBuffer>,
    dst_buf: Arc<HostBuffer>,
    src: Registration,
    dst: Registration,
}

async fn simple() -> Simple {
    let fabric = LoopbackFabric::new();
    let publisher = LoopbackTransport::new(&fabric, "pub0", 1).unwrap();
    let receiver = LoopbackTransport::new(&fabric, "recv", 2).unwrap();
    let src_buf = patterned(MIB as usize, 42);
    let dst_buf = Arc::new(HostBuffer::zeroed(MIB as usize));
    let src = publisher.register(src_buf.clone()).await.unwrap();
    let dst = receiver.register(dst_buf.clone()).await.unwrap();
    let meta = publisher.export_metadata().await.unwrap();
    receiver.load_peer(0, meta).await.unwrap();
    Simple {
        fabric,
        publisher,
        receiver,
        src_buf,
        dst_buf,
        src,
        dst,
    }
}

#[tokio::test]
async fn bytes_arrive_exactly_from_several_owners_with_many_reads_and_split_chunks() {
    let fabric = LoopbackFabric::new();
    let receiver = LoopbackTransport::new(&fabric, "recv", 4).unwrap();
    let mut rng = Rng(7);
    // Three publishers (owners 10, 11, 12), two regions each, of mixed sizes.
    let mut pubs = Vec::new();
    let mut srcs = Vec::new();
    for (k, owner) in [10u32, 11, 12].into_iter().enumerate() {
        let t = LoopbackTransport::new(&fabric, &format!("pub{owner}"), 1).unwrap();
        for j in 0..2u64 {
            let len = (3 + j as usize * 2) * MIB as usize + k * 4099;
            let buf = patterned(len, 100 + owner as u64 * 10 + j);
            let reg = t.register(buf.clone()).await.unwrap();
            srcs.push((owner, buf, reg));
        }
        receiver
            .load_peer(owner, t.export_metadata().await.unwrap())
            .await
            .unwrap();
        pubs.push(t);
    }
    // Two destinations; reads fill them front to back with disjoint ranges.
    let dst_bufs = [
        Arc::new(HostBuffer::zeroed(24 * MIB as usize)),
        Arc::new(HostBuffer::zeroed(9 * MIB as usize)),
    ];
    let mut dsts = Vec::new();
    for b in &dst_bufs {
        dsts.push(receiver.register(b.clone()).await.unwrap());
    }
    let mut expected: Vec<Vec<u8>> = dst_bufs.iter().map(|b| vec![0u8; b.len()]).collect();
    let mut reads = Vec::new();
    for (d, dst) in dsts.iter().enumerate() {
        let cap = dst_bufs[d].len() as u64;
        let mut at = 0u64;
        loop {
            // Mostly small reads, some medium, a few big ones that must be split.
            let len = match rng.below(50) {
                0 => MIB + rng.below(2 * MIB),
                1..=2 => 200 * KIB + rng.below(200 * KIB),
                _ => 1 + rng.below(8 * KIB),
            };
            let len = len.min(cap - at);
            if len == 0 {
                break;
            }
            let (owner, buf, reg) = &srcs[rng.below(srcs.len() as u64) as usize];
            let so = rng.below(buf.len() as u64 - len + 1);
            reads.push(read(*owner, reg, so, dst, at, len));
            let s = buf.read();
            expected[d][at as usize..(at + len) as usize]
                .copy_from_slice(&s[so as usize..(so + len) as usize]);
            at = (at + len + rng.below(3)).min(cap);
        }
    }
    assert!(reads.len() > 400, "{}", reads.len());
    let batch = ReadBatch { reads };
    let (n, bytes) = (batch.reads.len() as u64, batch.bytes());
    assert_eq!(batch.owners(), vec![10, 11, 12]);
    let prepared = receiver.prepare(batch).await.unwrap();
    let report = receiver
        .post(&prepared)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!((report.reads, report.bytes), (n, bytes));
    for (d, b) in dst_bufs.iter().enumerate() {
        assert!(b.read()[..] == expected[d][..], "destination {d} differs");
    }
}

#[tokio::test]
async fn every_owner_is_posted_before_any_wait() {
    let fabric = LoopbackFabric::new();
    let receiver = LoopbackTransport::new(&fabric, "recv", 2).unwrap();
    let dst_buf = Arc::new(HostBuffer::zeroed(4 * MIB as usize));
    let dst = receiver.register(dst_buf.clone()).await.unwrap();
    let mut keep = Vec::new();
    let mut prepared = Vec::new();
    for owner in 0..4u32 {
        let t = LoopbackTransport::new(&fabric, &format!("p{owner}"), 1).unwrap();
        let buf = patterned(MIB as usize, owner as u64 + 1);
        let reg = t.register(buf.clone()).await.unwrap();
        receiver
            .load_peer(owner, t.export_metadata().await.unwrap())
            .await
            .unwrap();
        let batch = ReadBatch {
            reads: vec![read(owner, &reg, 0, &dst, owner as u64 * MIB, MIB)],
        };
        prepared.push(receiver.prepare(batch).await.unwrap());
        keep.push((t, buf, reg));
    }
    let mut inflight = Vec::new();
    for p in &prepared {
        inflight.push(receiver.post(p).await.unwrap());
    }
    for f in inflight {
        assert_eq!(f.wait().await.unwrap().bytes, MIB);
    }
    for (owner, (_, buf, _)) in keep.iter().enumerate() {
        let at = owner * MIB as usize;
        assert!(dst_buf.read()[at..at + MIB as usize] == buf.read()[..]);
    }
}

#[tokio::test]
async fn a_prepared_batch_is_reused_across_many_posts() {
    let s = simple().await;
    let batch = ReadBatch {
        reads: (0..16)
            .map(|k| {
                read(
                    0,
                    &s.src,
                    (15 - k) * 64 * KIB,
                    &s.dst,
                    k * 64 * KIB,
                    64 * KIB,
                )
            })
            .collect(),
    };
    let prepared = s.receiver.prepare(batch).await.unwrap();
    for round in 0..20u8 {
        s.src_buf
            .write()
            .iter_mut()
            .step_by(997)
            .for_each(|b| *b = b.wrapping_add(round));
        let report = s
            .receiver
            .post(&prepared)
            .await
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert_eq!((report.reads, report.bytes), (16, MIB));
        let (src, dst) = (s.src_buf.read(), s.dst_buf.read());
        for k in 0..16usize {
            let d = k * 64 * 1024;
            let so = (15 - k) * 64 * 1024;
            assert!(
                dst[d..d + 65536] == src[so..so + 65536],
                "round {round} read {k}"
            );
        }
    }
}

#[tokio::test]
async fn out_of_bounds_remote_reads_name_owner_and_range() {
    let s = simple().await;
    let cases = [
        (MIB - 10, 11),      // runs past the end
        (MIB, 1),            // starts at the end
        (u64::MAX - 4, 100), // offset + len overflows
    ];
    for (off, len) in cases {
        let batch = ReadBatch {
            reads: vec![
                read(0, &s.src, 0, &s.dst, 0, 8),
                read(0, &s.src, off, &s.dst, 8, len),
            ],
        };
        let e = s.receiver.prepare(batch).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{off}+{len}");
        assert_eq!(e.context().owner, Some(0));
        assert_eq!(e.context().range, Some(off..off.saturating_add(len)));
        assert_eq!(e.context().backend.as_deref(), Some("loopback"));
    }
    // A region the owner never registered.
    let mut r = read(0, &s.src, 0, &s.dst, 0, 8);
    r.remote_region = 999;
    let e = s
        .receiver
        .prepare(ReadBatch { reads: vec![r] })
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfBounds);
    assert_eq!(e.context().owner, Some(0));
}

#[tokio::test]
async fn out_of_bounds_local_reads_name_owner_and_range() {
    let s = simple().await;
    let e = s
        .receiver
        .prepare(ReadBatch {
            reads: vec![read(0, &s.src, 0, &s.dst, MIB - 4, 8)],
        })
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfBounds);
    assert_eq!(e.context().owner, Some(0));
    assert_eq!(e.context().range, Some(MIB - 4..MIB + 4));
    assert_eq!(e.context().backend.as_deref(), Some("loopback"));
    // A local region id that only exists on another agent (the publisher) is not ours.
    let other = s
        .publisher
        .register(Arc::new(HostBuffer::zeroed(64)))
        .await
        .unwrap();
    let mut r = read(0, &s.src, 0, &s.dst, 0, 8);
    assert_ne!(other.id(), s.dst.id());
    r.local_region = other.id();
    let e = s
        .receiver
        .prepare(ReadBatch { reads: vec![r] })
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfBounds);
}

#[tokio::test]
async fn zero_length_reads_are_rejected() {
    let s = simple().await;
    let e = s
        .receiver
        .prepare(ReadBatch {
            reads: vec![read(0, &s.src, 16, &s.dst, 0, 0)],
        })
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfBounds);
    assert_eq!(e.context().owner, Some(0));
}

#[tokio::test]
async fn unknown_peer_is_peer_unknown_naming_the_owner() {
    let s = simple().await;
    let e = s
        .receiver
        .prepare(ReadBatch {
            reads: vec![
                read(0, &s.src, 0, &s.dst, 0, 8),
                read(3, &s.src, 0, &s.dst, 8, 8),
            ],
        })
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerUnknown);
    assert_eq!(e.context().owner, Some(3));
}

#[tokio::test]
async fn garbage_metadata_is_a_decode_error() {
    let s = simple().await;
    let good = s.publisher.export_metadata().await.unwrap();
    let epoch = s.receiver.epoch();
    let garbage: Vec<bytes::Bytes> = vec![
        bytes::Bytes::new(),
        bytes::Bytes::from_static(b"{\"agent\": \"pub0\"}"),
        bytes::Bytes::from(vec![0xffu8; 64]),
        good.slice(..good.len() - 3),
        {
            let mut v = good.to_vec();
            v.extend_from_slice(b"extra");
            bytes::Bytes::from(v)
        },
    ];
    for g in garbage {
        let e = s.receiver.load_peer(9, g).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Decode);
    }
    assert_eq!(s.receiver.epoch(), epoch, "a failed load changes nothing");
}

#[tokio::test]
async fn metadata_from_another_fabric_is_unsupported() {
    let s = simple().await;
    let elsewhere = LoopbackFabric::new();
    assert_ne!(elsewhere.id(), s.fabric.id());
    let stranger = LoopbackTransport::new(&elsewhere, "pub0", 1).unwrap();
    let _r = stranger
        .register(Arc::new(HostBuffer::zeroed(64)))
        .await
        .unwrap();
    let meta = stranger.export_metadata().await.unwrap();
    let e = s.receiver.load_peer(1, meta).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert_eq!(e.context().owner, Some(1));
    assert!(e.message().contains("ucx") && e.message().contains("nixl"));
}

#[tokio::test]
async fn a_source_deregistered_after_prepare_fails_the_post_naming_the_owner() {
    let s = simple().await;
    let prepared = s
        .receiver
        .prepare(ReadBatch {
            reads: vec![read(0, &s.src, 128, &s.dst, 0, 256)],
        })
        .await
        .unwrap();
    s.receiver
        .post(&prepared)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    drop(s.src);
    let e = s
        .receiver
        .post(&prepared)
        .await
        .err()
        .expect("post must fail");
    assert_eq!(e.kind(), ErrorKind::Transport);
    assert!(!e.is_retryable());
    assert_eq!(e.context().owner, Some(0));
    assert_eq!(e.context().range, Some(128..384));
    assert_eq!(e.context().backend.as_deref(), Some("loopback"));
}

#[tokio::test]
async fn a_destination_deregistered_after_prepare_fails_the_post() {
    let s = simple().await;
    let prepared = s
        .receiver
        .prepare(ReadBatch {
            reads: vec![read(0, &s.src, 0, &s.dst, 64, 256)],
        })
        .await
        .unwrap();
    drop(s.dst);
    let e = s
        .receiver
        .post(&prepared)
        .await
        .err()
        .expect("post must fail");
    assert_eq!(e.kind(), ErrorKind::Transport);
    assert_eq!(e.context().owner, Some(0));
    assert_eq!(e.context().range, Some(64..320));
}

#[tokio::test]
async fn a_publisher_that_left_fails_the_post_and_cannot_be_loaded() {
    let s = simple().await;
    let meta = s.publisher.export_metadata().await.unwrap();
    let prepared = s
        .receiver
        .prepare(ReadBatch {
            reads: vec![read(0, &s.src, 0, &s.dst, 0, 8)],
        })
        .await
        .unwrap();
    drop(s.publisher);
    let e = s
        .receiver
        .post(&prepared)
        .await
        .err()
        .expect("post must fail");
    assert_eq!(e.kind(), ErrorKind::Transport);
    assert_eq!(e.context().owner, Some(0));
    assert_eq!(
        s.receiver.load_peer(0, meta).await.unwrap_err().kind(),
        ErrorKind::PeerUnknown
    );
    // Its name is free again, and the new agent is not mistaken for the old one.
    let again = LoopbackTransport::new(&s.fabric, "pub0", 1).unwrap();
    assert_eq!(again.agent(), "pub0");
    drop(s.src);
}

#[tokio::test]
async fn a_batch_prepared_elsewhere_is_refused_by_post() {
    let s = simple().await;
    let prepared = s
        .receiver
        .prepare(ReadBatch {
            reads: vec![read(0, &s.src, 0, &s.dst, 0, 8)],
        })
        .await
        .unwrap();
    let e = s
        .publisher
        .post(&prepared)
        .await
        .err()
        .expect("post must fail");
    assert_eq!(e.kind(), ErrorKind::Unsupported);
}

#[tokio::test]
async fn abort_returns_and_leaves_no_job_running() {
    let s = simple().await;
    let reads = (0..16)
        .map(|k| read(0, &s.src, k * 64 * KIB, &s.dst, k * 64 * KIB, 64 * KIB))
        .collect();
    let prepared = s.receiver.prepare(ReadBatch { reads }).await.unwrap();
    let inflight = s.receiver.post(&prepared).await.unwrap();
    inflight.abort().await;
    let snapshot = s.dst_buf.read().to_vec();
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert!(s.dst_buf.read()[..] == snapshot[..]);
    // The transport is still usable afterwards.
    s.receiver
        .post(&prepared)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert!(s.dst_buf.read()[..] == s.src_buf.read()[..]);
}

#[tokio::test]
async fn epoch_changes_on_register_deregister_and_load_peer() {
    let s = simple().await;
    let e0 = s.receiver.epoch();
    let r = s
        .receiver
        .register(Arc::new(HostBuffer::zeroed(16)))
        .await
        .unwrap();
    let e1 = s.receiver.epoch();
    assert_ne!(e1, e0);
    drop(r);
    let e2 = s.receiver.epoch();
    assert_ne!(e2, e1);
    let meta = s.publisher.export_metadata().await.unwrap();
    s.receiver.load_peer(0, meta).await.unwrap();
    assert_ne!(s.receiver.epoch(), e2);
    let e3 = s.receiver.epoch();
    let prepared = s
        .receiver
        .prepare(ReadBatch {
            reads: vec![read(0, &s.src, 0, &s.dst, 0, 8)],
        })
        .await
        .unwrap();
    s.receiver
        .post(&prepared)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    s.receiver.export_metadata().await.unwrap();
    assert_eq!(
        s.receiver.epoch(),
        e3,
        "prepare, post and export change nothing"
    );
}

#[tokio::test]
async fn region_ids_start_at_one_and_are_unique_per_agent() {
    let fabric = LoopbackFabric::new();
    let t = LoopbackTransport::new(&fabric, "a", 1).unwrap();
    let a = t.register(Arc::new(HostBuffer::zeroed(8))).await.unwrap();
    let b = t.register(Arc::new(HostBuffer::zeroed(0))).await.unwrap();
    assert_eq!((a.id(), b.id()), (1, 2));
    assert_eq!((a.len(), a.kind()), (8, MemoryKind::Dram));
    drop(a);
    let c = t.register(Arc::new(HostBuffer::zeroed(8))).await.unwrap();
    assert_eq!(c.id(), 3, "ids are never reused");
    let other = LoopbackTransport::new(&fabric, "b", 1).unwrap();
    assert_eq!(
        other
            .register(Arc::new(HostBuffer::zeroed(8)))
            .await
            .unwrap()
            .id(),
        1
    );
}

#[derive(Debug)]
struct FakeVram;
unsafe impl MemoryBlock for FakeVram {
    fn addr(&self) -> usize {
        0x7000_0000
    }
    fn len(&self) -> usize {
        4096
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::Vram { device: 0 }
    }
}

#[tokio::test]
async fn vram_registration_is_unsupported() {
    let fabric = LoopbackFabric::new();
    let t = LoopbackTransport::new(&fabric, "a", 1).unwrap();
    assert!(!t.capabilities().vram);
    let e = t.register(Arc::new(FakeVram)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
}

#[tokio::test]
async fn capabilities_and_name() {
    let fabric = LoopbackFabric::new();
    let t = LoopbackTransport::new(&fabric, "a", 3).unwrap();
    let c = t.capabilities();
    assert!(c.one_sided_read && !c.one_sided_write && !c.vram && !c.cross_process);
    assert_eq!(c.max_reads_per_post, None);
    assert_eq!((t.name(), t.agent(), t.workers()), ("loopback", "a", 3));
}

#[tokio::test]
async fn agent_names_are_unique_per_fabric_and_workers_positive() {
    let fabric = LoopbackFabric::new();
    let a = LoopbackTransport::new(&fabric, "a", 1).unwrap();
    assert_eq!(
        LoopbackTransport::new(&fabric, "a", 1).unwrap_err().kind(),
        ErrorKind::Config
    );
    assert_eq!(
        LoopbackTransport::new(&fabric, "z", 0).unwrap_err().kind(),
        ErrorKind::Config
    );
    assert_eq!(
        LoopbackTransport::new(&fabric, "", 1).unwrap_err().kind(),
        ErrorKind::Config
    );
    LoopbackTransport::new(&LoopbackFabric::new(), "a", 1).unwrap();
    assert_eq!(fabric.agents(), vec!["a".to_string()]);
    drop(a);
    assert!(fabric.agents().is_empty());
    LoopbackTransport::new(&fabric, "a", 1).unwrap();
}

#[tokio::test]
async fn an_empty_batch_completes_with_nothing_moved() {
    let s = simple().await;
    let prepared = s.receiver.prepare(ReadBatch::default()).await.unwrap();
    let r = s
        .receiver
        .post(&prepared)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!((r.reads, r.bytes), (0, 0));
}

#[tokio::test]
async fn reads_within_one_agent_and_one_block_work() {
    // An agent may load its own metadata; an overlapping in-block move uses an overlap-safe copy.
    let fabric = LoopbackFabric::new();
    let t = LoopbackTransport::new(&fabric, "self", 2).unwrap();
    let buf = patterned(64 * KIB as usize, 3);
    let before = buf.read().to_vec();
    let reg = t.register(buf.clone()).await.unwrap();
    t.load_peer(0, t.export_metadata().await.unwrap())
        .await
        .unwrap();
    let prepared = t
        .prepare(ReadBatch {
            reads: vec![read(0, &reg, 0, &reg, 100, 1000)],
        })
        .await
        .unwrap();
    t.post(&prepared).await.unwrap().wait().await.unwrap();
    assert!(buf.read()[100..1100] == before[..1000]);
    assert!(buf.read()[..100] == before[..100]);
}

#[tokio::test]
async fn the_factory_creates_agents_through_the_registry() {
    let fabric = LoopbackFabric::new();
    let registry = Registry::new().with(LoopbackFactory::new(fabric.clone()));
    assert_eq!(registry.schemes(), vec!["loopback"]);
    let cfg = TransportConfig {
        kind: "loopback".into(),
        workers: Some(2),
        ..Default::default()
    };
    let publisher = registry.create("pub", &cfg).unwrap();
    let receiver = registry
        .create("recv", &TransportConfig::default())
        .unwrap();
    assert_eq!((publisher.name(), receiver.agent()), ("loopback", "recv"));
    assert_eq!(fabric.agents(), vec!["pub".to_string(), "recv".to_string()]);
    assert_eq!(
        registry.create("pub", &cfg).unwrap_err().kind(),
        ErrorKind::Config
    );

    let src_buf = patterned(300 * KIB as usize, 5);
    let dst_buf = Arc::new(HostBuffer::zeroed(300 * KIB as usize));
    let src = publisher.register(src_buf.clone()).await.unwrap();
    let dst = receiver.register(dst_buf.clone()).await.unwrap();
    receiver
        .load_peer(4, publisher.export_metadata().await.unwrap())
        .await
        .unwrap();
    let prepared = receiver
        .prepare(ReadBatch {
            reads: vec![read(4, &src, 0, &dst, 0, 300 * KIB)],
        })
        .await
        .unwrap();
    receiver
        .post(&prepared)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert!(dst_buf.read()[..] == src_buf.read()[..]);
}

/// A host block whose reported length can shrink, to exercise the re-check at post.
#[derive(Debug)]
struct Shrinking {
    buf: HostBuffer,
    len: std::sync::atomic::AtomicUsize,
}
unsafe impl MemoryBlock for Shrinking {
    fn addr(&self) -> usize {
        self.buf.addr()
    }
    fn len(&self) -> usize {
        self.len.load(std::sync::atomic::Ordering::Relaxed)
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::Dram
    }
}

#[tokio::test]
async fn post_rechecks_bounds_against_the_live_block() {
    let s = simple().await;
    let block = Arc::new(Shrinking {
        buf: HostBuffer::zeroed(4096),
        len: 4096.into(),
    });
    let reg = s.publisher.register(block.clone()).await.unwrap();
    s.receiver
        .load_peer(0, s.publisher.export_metadata().await.unwrap())
        .await
        .unwrap();
    let prepared = s
        .receiver
        .prepare(ReadBatch {
            reads: vec![read(0, &reg, 1000, &s.dst, 0, 3000)],
        })
        .await
        .unwrap();
    s.receiver
        .post(&prepared)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    block.len.store(2048, std::sync::atomic::Ordering::Relaxed);
    let e = s
        .receiver
        .post(&prepared)
        .await
        .err()
        .expect("post must fail");
    assert_eq!(e.kind(), ErrorKind::OutOfBounds);
    assert_eq!(e.context().owner, Some(0));
    assert_eq!(e.context().range, Some(1000..4000));
}
