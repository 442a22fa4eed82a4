//! Counted completions, the execution log, typed peer errors and envelopes that advertise
//! more than the peer's NIXL agent registered, through the public API (the skipped read comes
//! from the `fault-injection` feature, which only this crate's dev-dependency on itself
//! enables). The shared checks are the conformance crate's `counting` module; the envelope
//! check is NIXL's own.

use std::sync::Arc;

use bytes::Bytes;
use reshard_backend_nixl::{probe, NixlOptions, NixlTransport, SCHEME};
use reshard_conformance::counting::{at, read, Counting, SkipAt, SkipRead};
use reshard_conformance::Harness;
use reshard_core::{ErrorKind, HostBuffer, MemoryBlock, ReadBatch, Transport};

const MIB: u64 = 1 << 20;

fn available() -> bool {
    reshard_conformance::backend_available(SCHEME, probe())
}

fn endpoint(name: &str) -> NixlTransport {
    NixlTransport::new(name, &NixlOptions::default()).expect("nixl endpoint")
}

/// Owners 4 and 9 with two regions each (owner 4's first one 72 MiB, so its reads need two
/// 64 MiB-capped requests), one receiver with two regions. Six reads: two large ones of owner
/// 4 (one request each: together they exceed 64 MiB) and small ones of both owners sharing
/// requests. NIXL applies an injected skip when it builds requests, at prepare.
fn counting() -> Counting {
    let harness = Harness::new("nixl", |agent| {
        Ok(Arc::new(NixlTransport::new(agent, &NixlOptions::default())?) as Arc<dyn Transport>)
    });
    let endpoint = |agent: &str| {
        let t = Arc::new(NixlTransport::new(agent, &NixlOptions::default())?);
        let skip = t.clone();
        let skip: SkipRead = Arc::new(move |read| skip.inject_skip_read(read));
        Ok((t as Arc<dyn Transport>, skip))
    };
    Counting {
        src_lens: [[72 * MIB, MIB], [MIB, MIB]],
        dst_lens: [72 * MIB, MIB],
        reads: vec![
            at(0, 100, 0, 0, 40 * MIB),
            at(0, 40 * MIB + 200, 0, 40 * MIB, 30 * MIB),
            at(1, 0, 1, 0, 3000),
            at(2, 7, 1, 4096, 5000),
            at(3, 20_000, 1, 16_384, 7000),
            at(1, 30_000, 1, 65_536, 11_000),
        ],
        ..Counting::new(harness, endpoint, SkipAt::Prepare)
    }
}

reshard_conformance::counting_tests!(counting(), requires = probe());

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
