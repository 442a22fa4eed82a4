//! Unit tests that need test-only hooks (fault injection in copy jobs).

use reshard_core::{
    Error, ErrorKind, HostBuffer, ReadBatch, ReadDesc, Registration, Transport, WireReport,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::transport::Faults;
use crate::{LoopbackFabric, LoopbackTransport};

const MIB: u64 = 1 << 20;

struct Pair {
    _fabric: LoopbackFabric,
    receiver: LoopbackTransport,
    src: Arc<HostBuffer>,
    dst: Arc<HostBuffer>,
    _regs: Vec<Registration>,
    _publisher: LoopbackTransport,
    batch: ReadBatch,
}

/// One publisher (owner 5) with `len` patterned bytes, one receiver, `pieces` equal reads.
async fn pair(len: u64, pieces: u64, workers: usize, faults: Faults) -> Pair {
    let fabric = LoopbackFabric::new();
    let publisher = LoopbackTransport::new(&fabric, "pub", 1).unwrap();
    let mut receiver = LoopbackTransport::new(&fabric, "recv", workers).unwrap();
    receiver.faults = faults;
    let src = Arc::new(HostBuffer::zeroed(len as usize));
    for (i, b) in src.write().iter_mut().enumerate() {
        *b = (i % 251) as u8 + 1;
    }
    let dst = Arc::new(HostBuffer::zeroed(len as usize));
    let rs = publisher.register(src.clone()).await.unwrap();
    let rd = receiver.register(dst.clone()).await.unwrap();
    receiver
        .load_peer(5, publisher.export_metadata().await.unwrap())
        .await
        .unwrap();
    let step = len / pieces;
    let reads = (0..pieces)
        .map(|k| ReadDesc {
            owner: 5,
            remote_region: rs.id(),
            remote_offset: k * step,
            local_region: rd.id(),
            local_offset: k * step,
            len: step,
            remote_rows: None,
        })
        .collect();
    Pair {
        _fabric: fabric,
        receiver,
        src,
        dst,
        _regs: vec![rs, rd],
        _publisher: publisher,
        batch: ReadBatch { reads },
    }
}

impl Pair {
    /// Prepares the batch, posts it and waits for it on the receiver.
    async fn run(&self) -> Result<WireReport, Error> {
        let prepared = self.receiver.prepare(self.batch.clone()).await?;
        self.receiver.post(&prepared).await?.wait().await
    }
}

#[tokio::test]
async fn a_panicking_job_is_a_transport_error_not_a_hang() {
    let faults = Faults {
        panic_at_piece: Some(1),
        ..Faults::default()
    };
    let p = pair(4 * MIB, 4, 1, faults).await;
    let e = tokio::time::timeout(Duration::from_secs(10), p.run())
        .await
        .expect("wait must not hang")
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Transport);
    assert!(!e.is_retryable());
    assert_eq!(e.context().owner, Some(5));
    assert_eq!(e.context().range, Some(MIB..2 * MIB));
    assert_eq!(e.context().backend.as_deref(), Some("loopback"));
    // The pool survives: the same transport still moves bytes.
    let mut ok = p;
    ok.receiver.faults = Faults::default();
    ok.run().await.unwrap();
    assert_eq!(ok.dst.read()[..], ok.src.read()[..]);
}

#[tokio::test]
async fn panics_in_several_workers_are_reported_once_as_transport() {
    let faults = Faults {
        panic_at_piece: Some(0),
        piece_delay: Some(Duration::from_millis(2)),
        ..Faults::default()
    };
    let p = pair(8 * MIB, 8, 4, faults).await;
    let e = p.run().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Transport);
}

#[tokio::test]
async fn abort_stops_between_chunks_and_returns_once_memory_is_quiet() {
    let faults = Faults {
        piece_delay: Some(Duration::from_millis(20)),
        ..Faults::default()
    };
    // 64 pieces of 256 KiB on one worker: about 1.3 s if not aborted.
    let p = pair(16 * MIB, 64, 1, faults).await;
    let prepared = p.receiver.prepare(p.batch.clone()).await.unwrap();
    let started = Instant::now();
    let inflight = p.receiver.post(&prepared).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    inflight.abort().await;
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );
    let snapshot = p.dst.read().to_vec();
    assert_ne!(
        snapshot[..],
        p.src.read()[..],
        "abort came too late to observe"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        p.dst.read()[..],
        snapshot[..],
        "a job touched memory after abort returned"
    );
}

#[tokio::test]
async fn dropping_an_in_flight_batch_stops_it() {
    let faults = Faults {
        piece_delay: Some(Duration::from_millis(20)),
        ..Faults::default()
    };
    let p = pair(16 * MIB, 64, 1, faults).await;
    let prepared = p.receiver.prepare(p.batch.clone()).await.unwrap();
    drop(p.receiver.post(&prepared).await.unwrap());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_ne!(p.dst.read()[..], p.src.read()[..]);
}

#[tokio::test]
async fn one_big_read_is_split_across_workers_and_arrives_exactly() {
    let p = pair(16 * MIB + 12345, 1, 4, Faults::default()).await;
    let prepared = p.receiver.prepare(p.batch.clone()).await.unwrap();
    let st = prepared
        .state::<Arc<crate::transport::Prepared>>()
        .expect("loopback state");
    assert_eq!(st.work.len(), 4);
    let report = p.run().await.unwrap();
    assert_eq!((report.reads, report.bytes), (1, 16 * MIB + 12345));
    assert_eq!(p.dst.read()[..], p.src.read()[..]);
}

/// A batch is cut into more work lists than workers, taken in order as workers free up: while
/// one worker is held up in the first list, the other copies every other list (with one list
/// per worker it would copy only the second half of the batch).
#[tokio::test]
async fn a_held_up_worker_leaves_the_other_lists_to_the_free_one() {
    let faults = Faults {
        stall_read: Some((0, Duration::from_millis(3000))),
        ..Faults::default()
    };
    let p = pair(64 * MIB, 64, 2, faults).await;
    let prepared = p.receiver.prepare(p.batch.clone()).await.unwrap();
    // Read 0 opens the first list, of LIST_BYTES; every byte after it is some other list's.
    let first = crate::work::LIST_BYTES;
    let inflight = p.receiver.post(&prepared).await.unwrap();
    // The free worker copies the other 56 MiB in well under a second, even under ASan.
    let deadline = Instant::now() + Duration::from_millis(2500);
    let rest = first as usize..;
    while p.dst.read()[rest.clone()] != p.src.read()[rest.clone()] {
        assert!(
            Instant::now() < deadline,
            "the lists after the held-up one did not land while it was held up: one worker's \
             share waits behind another"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_ne!(
        p.dst.read()[..first as usize],
        p.src.read()[..first as usize],
        "the held-up list landed early: the stall did not hold"
    );
    inflight.wait().await.unwrap();
    assert_eq!(p.dst.read()[..], p.src.read()[..]);
}

/// A list that fails stops the batch: the lists after it, queued behind it on the one worker,
/// copy nothing instead of running to the end before `wait` reports the failure.
#[tokio::test]
async fn a_failed_list_stops_the_lists_queued_behind_it() {
    let faults = Faults {
        panic_read: Some(0),
        piece_delay: Some(Duration::from_millis(5)),
        ..Faults::default()
    };
    let p = pair(64 * MIB, 64, 1, faults).await;
    let e = p.run().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
    let first = crate::work::LIST_BYTES as usize;
    assert!(
        p.dst.read()[first..].iter().all(|&b| b == 0),
        "lists after the failed one went on copying"
    );
}
