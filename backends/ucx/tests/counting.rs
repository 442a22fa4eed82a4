//! Counted completions, the execution log, typed peer errors and metadata that contradicts
//! what UCX mapped, through the public API (the skipped read comes from the
//! `fault-injection` feature, which only this crate's dev-dependency on itself enables). The
//! shared checks are the conformance crate's `counting` module; the metadata check is UCX's own.

use std::sync::Arc;

use bytes::Bytes;
use reshard_backend_ucx::{UcxOptions, UcxTransport};
use reshard_conformance::counting::{at, read, Counting, SkipAt, SkipRead};
use reshard_conformance::Harness;
use reshard_core::{ErrorKind, HostBuffer, MemoryBlock, ReadBatch, Transport};

const MIB: u64 = 1 << 20;

/// Skips (loudly) when UCX is not installed, unless `RESHARD_REQUIRE_BACKENDS` names ucx.
fn available() -> bool {
    reshard_conformance::backend_available("ucx", reshard_backend_ucx::probe())
}

fn endpoint(agent: &str) -> UcxTransport {
    UcxTransport::new(agent, UcxOptions::default()).expect("ucx endpoint")
}

/// Owner 4 holds user memory (read with `ucp_get_nbx`), owner 9 UCX-allocated shared memory
/// (copied directly out of the segment UCX mapped here); two regions each, the first large
/// enough that a 17 MiB read is cut into two pieces. One receiver with two regions. Five reads
/// over both paths, two of them cut into pieces, of distinct lengths.
fn counting() -> Counting {
    let harness = Harness::new("ucx", |agent| {
        Ok(Arc::new(UcxTransport::new(agent, UcxOptions::default())?) as Arc<dyn Transport>)
    });
    let endpoint = |agent: &str| {
        let t = Arc::new(UcxTransport::new(agent, UcxOptions::default())?);
        let skip = t.clone();
        let skip: SkipRead = Arc::new(move |read| skip.inject_skip_read(read));
        Ok((t as Arc<dyn Transport>, skip))
    };
    Counting {
        src_lens: [[20 * MIB, MIB]; 2],
        allocated_owner: Some(9),
        dst_lens: [20 * MIB; 2],
        reads: vec![
            at(0, 100, 0, 0, 17 * MIB),
            at(1, 0, 0, 18 * MIB, 3000),
            at(2, 7, 1, 0, 17 * MIB + 5),
            at(3, 20_000, 1, 18 * MIB, 7000),
            at(1, 30_000, 1, 19 * MIB, 11_000),
        ],
        // Reads of owner 9's shared memory, copied directly and hashed block by block as they
        // land: each under the copy pool's 4 MiB split (one piece, one hasher), several
        // 256 KiB blocks each, with segments across block boundaries.
        hashed_reads: Some(vec![
            at(2, 7, 1, 0, 3 * MIB + 5),
            at(3, 20_000, 1, 8 * MIB, 700_000),
        ]),
        ..Counting::new(harness, endpoint, SkipAt::Post)
    }
}

reshard_conformance::counting_tests!(counting(), requires = reshard_backend_ucx::probe());

/// The same checks with the smallest `piece_bytes` (64 KiB): every read longer than that is cut
/// into many gets (a 17 MiB read into 272), and each read is still counted, logged and landed
/// once, whole.
mod small_pieces {
    use super::*;

    fn options() -> UcxOptions {
        UcxOptions {
            piece_bytes: reshard_backend_ucx::MIN_PIECE_BYTES,
            ..UcxOptions::default()
        }
    }

    fn counting() -> Counting {
        let harness = Harness::new("ucx", |agent| {
            Ok(Arc::new(UcxTransport::new(agent, options())?) as Arc<dyn Transport>)
        });
        let endpoint = |agent: &str| {
            let t = Arc::new(UcxTransport::new(agent, options())?);
            let skip = t.clone();
            let skip: SkipRead = Arc::new(move |read| skip.inject_skip_read(read));
            Ok((t as Arc<dyn Transport>, skip))
        };
        Counting {
            endpoint: Arc::new(endpoint),
            harness,
            // Reads of shared memory under one 64 KiB piece: each is one piece of one copy,
            // so every segment is hashed (longer reads leave segments across pieces unstored,
            // which the verifier hashes).
            hashed_reads: Some(vec![
                at(2, 7, 1, 0, 60_000),
                at(3, 20_000, 1, 8 * MIB, 40_000),
            ]),
            ..super::counting()
        }
    }

    reshard_conformance::counting_tests!(counting(), requires = reshard_backend_ucx::probe());
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
