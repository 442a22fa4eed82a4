//! Metadata the fabric contradicts, through the public API: loopback's own check beside the
//! shared counting family, which `tests/conformance.rs` runs (`counting =` of
//! `reshard_conformance::suite!`).

use std::sync::Arc;

use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
use reshard_conformance::counting::read;
use reshard_core::{ErrorKind, HostBuffer, ReadBatch, Transport};

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
