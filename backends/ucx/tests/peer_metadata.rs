//! Metadata that contradicts what UCX mapped, through the public API: UCX's own check beside
//! the shared counting family, which `tests/conformance.rs` runs (`counting =` of
//! `reshard_conformance::suite!`).

use std::sync::Arc;

use bytes::Bytes;
use reshard_backend_ucx::{UcxOptions, UcxTransport};
use reshard_conformance::counting::read;
use reshard_core::{ErrorKind, HostBuffer, MemoryBlock, ReadBatch, Transport};

const MIB: u64 = 1 << 20;

/// Skips (loudly) when UCX is not installed, unless `RESHARD_REQUIRE_BACKENDS` names ucx.
fn available() -> bool {
    reshard_conformance::backend_available("ucx", reshard_backend_ucx::probe())
}

fn endpoint(agent: &str) -> UcxTransport {
    UcxTransport::new(agent, UcxOptions::default()).expect("ucx endpoint")
}

/// Metadata layout (see `meta.rs`): magic, version, name, incarnation, worker address, region
/// count, then per region `id, base, len, key_base, key_len` (u64 each), kind `u8`, device
/// `u32`, key length `u32` and key. Enlarges region `region`'s length and its key's range by `by`
/// (a consistent lie, so decoding accepts it).
fn enlarge_region(meta: &[u8], region: u64, by: u64) -> Bytes {
    let mut v = meta.to_vec();
    let u16_at = |v: &[u8], at: usize| u16::from_le_bytes([v[at], v[at + 1]]) as usize;
    let u32_at = |v: &[u8], at: usize| u32::from_le_bytes(v[at..at + 4].try_into().unwrap());
    let u64_at = |v: &[u8], at: usize| u64::from_le_bytes(v[at..at + 8].try_into().unwrap());
    let mut at = 5;
    at += 2 + u16_at(&v, at);
    at += 8;
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
