//! Unit tests of the endpoint that need the progress thread's test hooks.

use super::*;
use reshard_core::{HostBuffer, MemoryBlock, ReadBatch, ReadDesc};
use std::time::Instant;

/// Gets that do not complete within the no-progress bound after their endpoint was
/// "force-closed" (the close is skipped here, so they run on) are quarantined: the error
/// says so and is not retryable, posts into their memory are refused until they complete,
/// then the memory is released and a clean post works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unstoppable_gets_are_quarantined_then_released() {
    if !reshard_conformance::backend_available("ucx", crate::probe()) {
        return;
    }
    engine::TEST_IGNORE_FORCE_CLOSE.store(true, Ordering::Relaxed);
    let options = UcxOptions {
        tls: Some("tcp".into()),
        reads_in_flight: 512,
        // Far below the ~25 ms one 16 MiB read over TCP takes here.
        timeout_ms: 1,
        ..UcxOptions::default()
    };
    let len: usize = 512 << 20;
    let publisher = UcxTransport::new("publisher", options.clone()).unwrap();
    let receiver = UcxTransport::new("receiver", options).unwrap();
    let src = Arc::new(HostBuffer::from_bytes(
        &(0..len).map(|i| (i % 251) as u8).collect::<Vec<_>>(),
    ));
    let dst = Arc::new(HostBuffer::zeroed(len));
    let rs = publisher
        .register(src.clone() as Arc<dyn MemoryBlock>)
        .await
        .unwrap();
    let rd = receiver
        .register(dst.clone() as Arc<dyn MemoryBlock>)
        .await
        .unwrap();
    receiver
        .load_peer(7, publisher.export_metadata().await.unwrap())
        .await
        .unwrap();
    let batch = |n: u64, chunk: u64| ReadBatch {
        reads: (0..n / chunk)
            .map(|i| ReadDesc {
                owner: 7,
                remote_region: rs.id(),
                remote_offset: i * chunk,
                local_region: rd.id(),
                local_offset: i * chunk,
                len: chunk,
                remote_rows: None,
            })
            .collect(),
    };
    let prepared = receiver.prepare(batch(len as u64, 16 << 20)).await.unwrap();
    let mut quarantined = None;
    for _ in 0..10 {
        match receiver.post(&prepared).await {
            Ok(f) => match f.wait().await {
                Err(e) if e.is_quarantined() => {
                    quarantined = Some(e);
                    break;
                }
                // Completed, or ended (quiet) before the bound: try again.
                _ => continue,
            },
            // Refused while an earlier attempt's gets are quarantined.
            Err(e) => assert!(e.is_quarantined(), "{e}"),
        }
    }
    engine::TEST_IGNORE_FORCE_CLOSE.store(false, Ordering::Relaxed);
    let e = quarantined.expect("a batch was quarantined");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(!e.is_retryable(), "{e}");
    assert_eq!(e.context().owner, Some(7), "{e}");
    assert!(e.to_string().contains("owner(s) {7}"), "{e}");
    // While its gets run, their memory is not reused.
    let e = match receiver.post(&prepared).await {
        Ok(f) => f
            .wait()
            .await
            .expect_err("quarantined memory is not posted into"),
        Err(e) => e,
    };
    assert!(e.is_quarantined() && !e.is_retryable(), "{e}");
    // Once they completed, the quarantine is released and a clean (short) post works.
    let head = receiver.prepare(batch(32 << 20, 1 << 20)).await.unwrap();
    let start = Instant::now();
    loop {
        let r = match receiver.post(&head).await {
            Ok(f) => f.wait().await,
            Err(e) => Err(e),
        };
        match r {
            Ok(_) => break,
            Err(e) if e.is_quarantined() || e.is_retryable() => {
                assert!(start.elapsed() < Duration::from_secs(20), "{e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(dst.read()[..32 << 20] == src.read()[..32 << 20]);
}
