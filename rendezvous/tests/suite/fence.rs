//! The reader fence (docs/deployment.md, "The reader fence"): a receiver's reading claim holds
//! exactly the publisher memory it names until it is released, and a publisher's wait says who
//! holds it when it times out.

use std::time::Duration;

use reshard_core::rendezvous::{wait_released, ReadClaim};
use reshard_core::ErrorKind;

use super::Sides;

/// A claim by receiver rank `reader` of `ranks` (rank, incarnation) at `step`.
fn claim(s: &Sides, reader: u32, step: u64, ranks: &[(u32, u64)]) -> ReadClaim {
    ReadClaim {
        model: s.model.clone(),
        step,
        reader: format!("receiver rank {reader} of the fence test"),
        ranks: ranks.to_vec(),
    }
}

/// A publisher's wait holds while a claim names its memory, times out naming the reader, and
/// returns once the claim is released, saying whom it waited for.
pub async fn the_fence_holds_while_a_receiver_reads_and_opens_at_release(s: &Sides) {
    let held = s
        .receivers
        .claim_reading(claim(s, 3, 7, &[(0, 100), (1, 101)]))
        .await
        .unwrap();
    let (claims, _) = s.receivers.readers(&s.model).await.unwrap();
    assert_eq!(claims, [claim(s, 3, 7, &[(0, 100), (1, 101)])]);
    let p = s.publishers.clone();
    let e = wait_released(p.as_ref(), &s.model, 1, 101, Duration::from_millis(300))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    let msg = e.to_string();
    for part in [
        "publisher rank 1",
        "receiver rank 3 of the fence test reading step 7",
    ] {
        assert!(msg.contains(part), "{part:?} not in {msg}");
    }
    let model = s.model.clone();
    let waiter = tokio::spawn(async move {
        wait_released(p.as_ref(), &model, 0, 100, Duration::from_secs(20)).await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !waiter.is_finished(),
        "the fence opened while a receiver read"
    );
    held.release().await.unwrap();
    let released = waiter.await.unwrap().unwrap();
    assert_eq!(
        released.readers,
        ["receiver rank 3 of the fence test reading step 7"]
    );
    assert!(s.receivers.readers(&s.model).await.unwrap().0.is_empty());
}

/// A claim holds only the memory it names: another rank, or another incarnation of the same
/// rank (a restarted publisher's new memory), is not held by it; a dropped claim holds nothing.
pub async fn a_claim_holds_only_the_memory_it_names(s: &Sides) {
    let _held = s
        .receivers
        .claim_reading(claim(s, 0, 4, &[(2, 102)]))
        .await
        .unwrap();
    let p = s.publishers.as_ref();
    let t = Duration::from_secs(5);
    for (rank, incarnation) in [(1, 102), (2, 999), (3, 103)] {
        let r = wait_released(p, &s.model, rank, incarnation, t).await;
        assert_eq!(r.unwrap().readers, Vec::<String>::new(), "rank {rank}");
    }
    let dropped = s
        .receivers
        .claim_reading(claim(s, 1, 4, &[(5, 105)]))
        .await
        .unwrap();
    drop(dropped);
    let r = wait_released(p, &s.model, 5, 105, t).await.unwrap();
    assert!(r.waited < t, "{r:?}");
}
