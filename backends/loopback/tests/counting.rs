//! Counted completions, the execution log and metadata the fabric contradicts, through the
//! public API (the skipped read comes from the `fault-injection` feature, which only this
//! crate's dev-dependency on itself enables). The shared checks are the conformance crate's
//! `counting` module; the metadata check is loopback's own.

use std::sync::Arc;

use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
use reshard_conformance::counting::{at, read, Counting, SkipAt, SkipRead};
use reshard_conformance::Harness;
use reshard_core::{ErrorKind, HostBuffer, ReadBatch, Transport};

/// Loopback endpoints on one fabric (two copy workers each), with their skip hook. Regions
/// of 1 MiB; five reads over every source and destination region, of distinct lengths; a
/// 1 MiB read is split between the two workers (two 512 KiB pieces).
fn counting() -> Counting {
    let fabric = LoopbackFabric::new();
    let f = fabric.clone();
    let harness = Harness::new("loopback", move |agent| {
        Ok(Arc::new(LoopbackTransport::new(&f, agent, 2)?) as Arc<dyn Transport>)
    });
    let endpoint = move |agent: &str| {
        let t = Arc::new(LoopbackTransport::new(&fabric, agent, 2)?);
        let skip = t.clone();
        let skip: SkipRead = Arc::new(move |read| skip.inject_skip_read(read));
        Ok((t as Arc<dyn Transport>, skip))
    };
    Counting {
        reads: vec![
            at(0, 100, 0, 0, 1000),
            at(1, 0, 0, 4096, 3000),
            at(2, 7, 1, 0, 5000),
            at(3, 20_000, 1, 8192, 7000),
            at(0, 30_000, 1, 20_000, 11_000),
        ],
        split_read: Some(at(1, 0, 0, 0, 1 << 20)),
        // Reads below 512 KiB stay whole with one worker; the 400 000-byte one is copied (and
        // hashed) in two blocks, with segments across the block boundary.
        hashed_reads: Some(vec![
            at(0, 100, 0, 0, 1000),
            at(2, 7, 1, 0, 5000),
            at(1, 3, 0, 8192, 400_000),
            at(3, 20_000, 1, 8192, 70_000),
        ]),
        ..Counting::new(harness, endpoint, SkipAt::Post)
    }
}

reshard_conformance::counting_tests!(counting());

/// Metadata layout (see `meta.rs`): magic, version, name, agent uid, fabric id, region count,
/// then `(id u64, len u64)` per region.
fn enlarge_region(meta: &[u8], region: u64, by: u64) -> Vec<u8> {
    let mut v = meta.to_vec();
    let name_len = u16::from_le_bytes([v[5], v[6]]) as usize;
    let count_at = 7 + name_len + 8 + 8;
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
