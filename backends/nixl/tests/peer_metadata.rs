//! Envelopes that advertise more than the peer's NIXL agent registered, through the public
//! API: NIXL's own check beside the shared counting family, which `tests/conformance.rs` runs
//! (`counting =` of `reshard_conformance::suite!`).

use std::sync::Arc;

use bytes::Bytes;
use reshard_backend_nixl::{probe, NixlOptions, NixlTransport, SCHEME};
use reshard_conformance::counting::read;
use reshard_core::{ErrorKind, HostBuffer, MemoryBlock, ReadBatch, Transport};

const MIB: u64 = 1 << 20;

fn available() -> bool {
    reshard_conformance::backend_available(SCHEME, probe())
}

fn endpoint(name: &str) -> NixlTransport {
    NixlTransport::new(name, &NixlOptions::default()).expect("nixl endpoint")
}

/// Envelope layout (see `meta.rs`): magic, version, agent name, incarnation, NIXL name, region
/// count, then per region `id, addr, len` (u64 each), kind `u8`, device `u32`; NIXL metadata;
/// XXH3 of everything before it. Enlarges region `region`'s advertised length by `by` and reseals.
fn enlarge_region(meta: &[u8], region: u64, by: u64) -> Bytes {
    let mut v = meta.to_vec();
    let u16_at = |v: &[u8], at: usize| u16::from_le_bytes([v[at], v[at + 1]]) as usize;
    let u64_at = |v: &[u8], at: usize| u64::from_le_bytes(v[at..at + 8].try_into().unwrap());
    let mut at = 5;
    at += 2 + u16_at(&v, at) + 8;
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
    let sum = twox_hash::XxHash3_64::oneshot(&v[..n]);
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
