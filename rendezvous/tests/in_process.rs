//! The in-process rendezvous under the discovery rule: late publishers are waited for, a step is
//! never mixed, a dropped handle is a publisher gone, and a timeout says who was seen where.

use std::time::Duration;

use bytes::Bytes;
use reshard_core::rendezvous::{discover, Announcement, Rendezvous, Want};
use reshard_core::ErrorKind;
use reshard_rendezvous::InProcess;

fn announcement(rank: u32, world: u32, step: u64) -> Announcement {
    Announcement {
        model: "qwen".into(),
        rank,
        world,
        step,
        transport: "loopback".into(),
        incarnation: 100 + rank as u64,
        table: Bytes::from(format!("table {rank} {step}")),
        metadata: Bytes::from(format!("meta {rank}")),
    }
}

fn want(after: Option<u64>, timeout_ms: u64) -> Want {
    Want {
        model: "qwen".into(),
        after_step: after,
        timeout: Duration::from_millis(timeout_ms),
    }
}

#[tokio::test]
async fn a_receiver_started_first_waits_for_every_publisher() {
    let hub = InProcess::new();
    let early = hub.announce(announcement(2, 4, 3)).await.unwrap();
    let late = {
        let hub = hub.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            for rank in [1, 0, 3] {
                tokio::time::sleep(Duration::from_millis(20)).await;
                held.push(hub.announce(announcement(rank, 4, 3)).await.unwrap());
            }
            held
        })
    };
    let found = discover(&hub, &want(None, 5_000)).await.unwrap();
    assert_eq!(found.step, 3);
    let ranks: Vec<u32> = found.announcements.iter().map(|a| a.rank).collect();
    assert_eq!(ranks, [0, 1, 2, 3]);
    assert_eq!(found.announcements[1], announcement(1, 4, 3));
    assert!(
        found.elapsed >= Duration::from_millis(40),
        "{:?}",
        found.elapsed
    );
    drop((early, late.await.unwrap()));
}

#[tokio::test]
async fn a_timeout_names_who_was_seen_missing_and_behind() {
    let hub = InProcess::new();
    let _a = hub.announce(announcement(0, 4, 5)).await.unwrap();
    let _b = hub.announce(announcement(1, 4, 5)).await.unwrap();
    let _c = hub.announce(announcement(3, 4, 4)).await.unwrap();
    let e = discover(&hub, &want(None, 50)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout);
    let msg = e.to_string();
    for part in [
        "saw 3 of 4 publishers",
        "missing ranks 2",
        "ranks 3 did not advance to step 5",
        "in-process",
    ] {
        assert!(msg.contains(part), "{part:?} not in {msg}");
    }
}

#[tokio::test]
async fn an_unready_publisher_holds_discovery_until_it_advances() {
    let hub = InProcess::new();
    let a = hub.announce(announcement(0, 2, 1)).await.unwrap();
    let b = hub.announce(announcement(1, 2, 1)).await.unwrap();
    let first = discover(&hub, &want(None, 1_000)).await.unwrap();
    assert_eq!(first.step, 1);
    // Both rewrite their weights; one finishes before the other.
    a.unready().await.unwrap();
    b.unready().await.unwrap();
    a.advance(2, Bytes::from_static(b"t0 2")).await.unwrap();
    let e = discover(&hub, &want(Some(1), 30)).await.unwrap_err();
    assert!(e.to_string().contains("ranks 1 updating at step 1"), "{e}");
    let waiting = {
        let hub = hub.clone();
        tokio::spawn(async move { discover(&hub, &want(Some(1), 5_000)).await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    b.advance(2, Bytes::from_static(b"t1 2")).await.unwrap();
    let second = waiting.await.unwrap().unwrap();
    assert_eq!(second.step, 2);
    assert_eq!(second.announcements[1].table, Bytes::from_static(b"t1 2"));
    assert!(second.revision > first.revision);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_never_mixes_steps_while_publishers_advance() {
    let hub = InProcess::new();
    let world = 4;
    let mut held = Vec::new();
    for rank in 0..world {
        let mut a = announcement(rank, world, 0);
        a.table = Bytes::from("0");
        held.push(hub.announce(a).await.unwrap());
    }
    // Publishers advance one after another as fast as they can, each rank a little behind the
    // one before: most moments hold two steps at once.
    let advancing = tokio::spawn(async move {
        for step in 1..=3_000u64 {
            for h in &held {
                h.advance(step, Bytes::from(step.to_string()))
                    .await
                    .unwrap();
                tokio::task::yield_now().await;
            }
        }
        held
    });
    let mut seen = 0;
    while !advancing.is_finished() {
        let found = discover(&hub, &want(None, 5_000)).await.unwrap();
        assert!(
            found
                .announcements
                .iter()
                .all(|a| a.step == found.step && a.table == found.step.to_string()),
            "a mix of steps: {:?}",
            found.announcements
        );
        seen += 1;
        tokio::task::yield_now().await;
    }
    assert!(seen > 0);
    drop(advancing.await.unwrap());
}

#[tokio::test]
async fn a_dropped_handle_is_a_publisher_gone_and_wakes_watchers() {
    let hub = InProcess::new();
    let a = hub.announce(announcement(0, 2, 1)).await.unwrap();
    let b = hub.announce(announcement(1, 2, 1)).await.unwrap();
    let (members, revision) = hub.members("qwen").await.unwrap();
    assert_eq!(members.len(), 2);
    let watcher = {
        let hub = hub.clone();
        tokio::spawn(async move { hub.changed("qwen", revision, Duration::from_secs(5)).await })
    };
    tokio::time::sleep(Duration::from_millis(10)).await;
    drop(b);
    let after = watcher.await.unwrap().unwrap();
    assert!(after > revision);
    let (members, _) = hub.members("qwen").await.unwrap();
    assert_eq!(members.iter().map(|m| m.rank).collect::<Vec<_>>(), [0]);
    let e = hub.fetch("qwen", &[0, 1]).await.unwrap_err();
    assert_eq!(
        (e.kind(), e.context().owner),
        (ErrorKind::PeerUnknown, Some(1))
    );
    // Nothing changes: a watch times out with the same revision.
    let (_, now) = hub.members("qwen").await.unwrap();
    let same = hub
        .changed("qwen", now, Duration::from_millis(20))
        .await
        .unwrap();
    assert_eq!(same, now);
    a.withdraw().await.unwrap();
    assert!(hub.models().await.unwrap().is_empty());
}

#[tokio::test]
async fn a_restarted_rank_replaces_the_old_lease() {
    let hub = InProcess::new();
    let old = hub.announce(announcement(0, 1, 1)).await.unwrap();
    let mut restarted = announcement(0, 1, 1);
    restarted.incarnation = 999;
    let new = hub.announce(restarted).await.unwrap();
    let e = old.check_alive().unwrap_err();
    assert_eq!(e.context().owner, Some(0), "{e}");
    assert!(old.advance(2, Bytes::new()).await.is_err());
    // The old handle going away must not take the new announcement with it.
    drop(old);
    new.check_alive().unwrap();
    let found = discover(&hub, &want(None, 100)).await.unwrap();
    assert_eq!(found.announcements[0].incarnation, 999);
    let e = hub
        .announce(announcement(3, 2, 1))
        .await
        .err()
        .expect("rank outside world");
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
}
