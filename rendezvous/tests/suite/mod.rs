//! One suite every rendezvous implementation passes: late publishers are waited for, a step is
//! never mixed, a record that is not ready is never part of a set, a publisher gone (dropped
//! handle, expired lease) wakes watchers, and a timeout says who was seen where. Publishers and
//! receivers use separate clients where the implementation has clients, as separate processes
//! would.

pub mod faults;
pub mod fence;
pub use faults::*;
pub use fence::*;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::future::BoxFuture;
use reshard_core::rendezvous::{
    discover, Announced, Announcement, Fetched, Member, ReadClaim, Reading, Rendezvous, Want,
    MAX_NOTE_BYTES, MAX_WORLD,
};
use reshard_core::{ErrorKind, OwnerId, Result};

/// The two sides of a rendezvous and how long a dropped publisher takes to disappear.
pub struct Sides {
    /// What publishers announce through.
    pub publishers: Arc<dyn Rendezvous>,
    /// What receivers discover through.
    pub receivers: Arc<dyn Rendezvous>,
    /// Upper bound for a dropped handle's announcement to disappear (a lease TTL for etcd).
    pub gone_within: Duration,
    /// The model this test announces (tests sharing a service use their own).
    pub model: String,
}

impl Sides {
    fn announcement(&self, rank: u32, world: u32, step: u64) -> Announcement {
        let mut a = announcement(rank, world, step);
        a.model = self.model.clone();
        a
    }

    fn want(&self, after: Option<u64>, timeout_ms: u64) -> Want {
        Want {
            model: self.model.clone(),
            after_step: after,
            timeout: Duration::from_millis(timeout_ms),
        }
    }
}

/// Rank `rank` of `world` at `step`, with a table and metadata that name them.
pub fn announcement(rank: u32, world: u32, step: u64) -> Announcement {
    Announcement {
        model: "qwen".into(),
        rank,
        world,
        step,
        transport: "loopback".into(),
        incarnation: 100 + rank as u64,
        table: Bytes::from(format!("table {rank} {step}")),
        metadata: Bytes::from(format!("meta {rank}")),
        config: Bytes::from_static(br#"{"name":"qwen"}"#),
    }
}

/// A bare claim (an empty table: the rank held, nothing served, as `reshard publish` holds its
/// rank before it has a checkpoint) becomes an announcement of the same process and
/// incarnation without a moment where the rank is free (issue 42): the new handle holds it at
/// once, a rival is refused throughout, the old handle's writes fail and its withdrawal leaves
/// the announcement in place.
pub async fn a_bare_claim_is_handed_over_to_the_announcement_with_no_gap(s: &Sides) {
    let mut bare = s.announcement(0, 1, 1);
    bare.table = Bytes::new();
    let claim = s.publishers.announce(bare).await.unwrap();
    let served = s
        .publishers
        .announce(s.announcement(0, 1, 1))
        .await
        .unwrap();
    served.check_alive().unwrap();
    let mut rival = s.announcement(0, 1, 1);
    rival.incarnation = 4242;
    let e = s
        .publishers
        .announce(rival)
        .await
        .err()
        .expect("the rank is held");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(
        claim.unready().await.is_err(),
        "the old handle still writes"
    );
    let lost = claim
        .check_alive()
        .expect_err("the bare claim's handle lost the rank");
    assert_eq!(lost.context().owner, Some(0), "{lost}");
    let _ = claim.withdraw().await;
    served.check_alive().unwrap();
    let found = discover(s.receivers.as_ref(), &s.want(None, 1_000))
        .await
        .unwrap();
    assert_eq!(found.step, 1);
    assert_eq!(found.announcements[0].table, s.announcement(0, 1, 1).table);
}

/// A receiver started before any publisher waits, then proceeds with every rank.
pub async fn a_receiver_started_first_waits_for_every_publisher(s: &Sides) {
    let receiver = {
        let (r, want) = (s.receivers.clone(), s.want(None, 10_000));
        tokio::spawn(async move { discover(r.as_ref(), &want).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut held = Vec::new();
    for rank in [2, 1, 0, 3] {
        tokio::time::sleep(Duration::from_millis(20)).await;
        held.push(
            s.publishers
                .announce(s.announcement(rank, 4, 3))
                .await
                .unwrap(),
        );
    }
    let found = receiver.await.unwrap().unwrap();
    assert_eq!(found.step, 3);
    let ranks: Vec<u32> = found.announcements.iter().map(|a| a.rank).collect();
    assert_eq!(ranks, [0, 1, 2, 3]);
    assert_eq!(found.announcements[1], s.announcement(1, 4, 3));
    assert!(
        found.elapsed >= Duration::from_millis(80),
        "{:?}",
        found.elapsed
    );
    for h in held {
        h.withdraw().await.unwrap();
    }
}

/// A timeout names who was seen, who is missing and who did not advance.
pub async fn a_timeout_names_who_was_seen_missing_and_behind(s: &Sides) {
    let p = &s.publishers;
    let _held = [
        p.announce(s.announcement(0, 4, 5)).await.unwrap(),
        p.announce(s.announcement(1, 4, 5)).await.unwrap(),
        p.announce(s.announcement(3, 4, 4)).await.unwrap(),
    ];
    let e = discover(s.receivers.as_ref(), &s.want(None, 100))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout);
    let msg = e.to_string();
    for part in [
        "saw 3 of 4 publishers",
        "missing ranks 2",
        "ranks 3 did not advance to step 5",
        &s.receivers.endpoint(),
    ] {
        assert!(msg.contains(part), "{part:?} not in {msg}");
    }
}

/// A publisher rewriting its weights holds discovery until it advances.
pub async fn an_unready_publisher_holds_discovery_until_it_advances(s: &Sides) {
    let a = s
        .publishers
        .announce(s.announcement(0, 2, 1))
        .await
        .unwrap();
    let b = s
        .publishers
        .announce(s.announcement(1, 2, 1))
        .await
        .unwrap();
    let r = s.receivers.clone();
    let first = discover(r.as_ref(), &s.want(None, 5_000)).await.unwrap();
    assert_eq!(first.step, 1);
    a.unready().await.unwrap();
    b.unready().await.unwrap();
    a.advance(2, Bytes::from_static(b"t0 2")).await.unwrap();
    let e = discover(r.as_ref(), &s.want(Some(1), 100))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("ranks 1 updating at step 1"), "{e}");
    let later = s.want(Some(1), 10_000);
    let waiting = tokio::spawn(async move { discover(r.as_ref(), &later).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    b.advance(2, Bytes::from_static(b"t1 2")).await.unwrap();
    let second = waiting.await.unwrap().unwrap();
    assert_eq!(second.step, 2);
    assert_eq!(second.announcements[1].table, Bytes::from_static(b"t1 2"));
    assert!(second.revision > first.revision);
}

/// Publishers advance as fast as they can while a receiver discovers again and again: every
/// set found is one step, with that step's tables.
pub async fn discovery_never_mixes_steps_while_publishers_advance(s: &Sides, steps: u64) {
    let world = 4;
    let mut held = Vec::new();
    for rank in 0..world {
        let mut a = s.announcement(rank, world, 0);
        a.table = Bytes::from("0");
        held.push(s.publishers.announce(a).await.unwrap());
    }
    // Each rank a little behind the one before: most moments hold two steps at once.
    let advancing = tokio::spawn(async move {
        for step in 1..=steps {
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
        let found = discover(s.receivers.as_ref(), &s.want(None, 10_000))
            .await
            .unwrap();
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

/// A dropped handle is a publisher gone (at once in-process, at lease expiry in etcd), and a
/// watcher wakes for it.
pub async fn a_dropped_handle_is_a_publisher_gone_and_wakes_watchers(s: &Sides) {
    let a = s
        .publishers
        .announce(s.announcement(0, 2, 1))
        .await
        .unwrap();
    let b = s
        .publishers
        .announce(s.announcement(1, 2, 1))
        .await
        .unwrap();
    let r = s.receivers.clone();
    let (members, revision) = r.members(&s.model).await.unwrap();
    assert_eq!(members.len(), 2);
    let watcher = {
        let r = r.clone();
        let limit = s.gone_within * 3;
        let model = s.model.clone();
        tokio::spawn(async move { r.changed(&model, revision, limit).await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let dropped = std::time::Instant::now();
    drop(b);
    let after = watcher.await.unwrap().unwrap();
    assert!(
        after > revision,
        "no change seen within {:?}",
        s.gone_within * 3
    );
    assert!(
        dropped.elapsed() <= s.gone_within * 2,
        "{:?}",
        dropped.elapsed()
    );
    let (members, _) = r.members(&s.model).await.unwrap();
    assert_eq!(members.iter().map(|m| m.rank).collect::<Vec<_>>(), [0]);
    let e = r.fetch(&s.model, &[0, 1]).await.unwrap_err();
    assert_eq!(
        (e.kind(), e.context().owner),
        (ErrorKind::PeerUnknown, Some(1))
    );
    // Nothing changes: a watch times out with the same revision.
    let (_, now) = r.members(&s.model).await.unwrap();
    let same = r
        .changed(&s.model, now, Duration::from_millis(100))
        .await
        .unwrap();
    assert_eq!(same, now);
    a.withdraw().await.unwrap();
    let (members, _) = r.members(&s.model).await.unwrap();
    assert!(members.is_empty(), "withdraw removes at once");
    assert!(!r.models().await.unwrap().contains(&s.model));
}

/// One holder per rank: announcing a rank a live handle holds is refused with a `Config` error
/// naming the rank and the holder (incarnation, host, pid), and the holder serves on untouched;
/// once the holder is gone (dropped: at once in-process, at its lease's expiry in etcd), a
/// restarted rank claims it. The member names its holder.
pub async fn one_holder_per_rank_and_a_restarted_rank_claims_it(s: &Sides) {
    let old = s
        .publishers
        .announce(s.announcement(0, 1, 1))
        .await
        .unwrap();
    let mut restarted = s.announcement(0, 1, 1);
    restarted.incarnation = 999;
    let e = s
        .publishers
        .announce(restarted.clone())
        .await
        .err()
        .expect("a live rank is refused");
    assert_eq!(
        (e.kind(), e.context().owner),
        (ErrorKind::Config, Some(0)),
        "{e}"
    );
    let msg = e.to_string();
    for part in [
        "publisher rank 0 ".to_string(),
        format!("incarnation {:016x}", 100),
        format!("pid {}", std::process::id()),
    ] {
        assert!(msg.contains(&part), "{part:?} not in {msg}");
    }
    old.check_alive().unwrap();
    let found = discover(s.receivers.as_ref(), &s.want(None, 1_000))
        .await
        .unwrap();
    assert_eq!(found.announcements[0].incarnation, 100);
    let (members, _) = s.receivers.members(&s.model).await.unwrap();
    let holder = members[0]
        .holder
        .clone()
        .expect("the member names its holder");
    assert_eq!(holder.pid, std::process::id());
    assert!(
        msg.contains(&format!("on host {} pid", holder.host)),
        "{msg}"
    );
    drop(old);
    let new = s.publishers.announce(restarted).await.unwrap();
    new.check_alive().unwrap();
    let found = discover(s.receivers.as_ref(), &s.want(None, 1_000))
        .await
        .unwrap();
    assert_eq!(found.announcements[0].incarnation, 999);
    let e = s
        .publishers
        .announce(s.announcement(3, 2, 1))
        .await
        .err()
        .expect("rank outside world");
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    new.withdraw().await.unwrap();
}

/// Tables and metadata of several MiB (large models) arrive intact.
pub async fn large_tables_arrive_intact(s: &Sides) {
    let mut a = s.announcement(0, 1, 4);
    let table: Vec<u8> = (0..3_300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    a.table = Bytes::from(table);
    a.metadata = Bytes::from(vec![9u8; 700_000]);
    a.config = Bytes::from(vec![b'c'; 600_000]);
    let held = s.publishers.announce(a.clone()).await.unwrap();
    let found = discover(s.receivers.as_ref(), &s.want(None, 5_000))
        .await
        .unwrap();
    assert_eq!(found.announcements, vec![a]);
    let (members, _) = s.receivers.members(&s.model).await.unwrap();
    assert_eq!(members[0].table_bytes, 3_300_000);
    held.withdraw().await.unwrap();
}

/// A live publisher's announcement outlasts its lease TTL many times over (the keep-alive).
pub async fn a_live_publisher_outlasts_its_lease(s: &Sides) {
    let held = s
        .publishers
        .announce(s.announcement(0, 1, 2))
        .await
        .unwrap();
    tokio::time::sleep(s.gone_within * 2).await;
    held.check_alive().unwrap();
    let found = discover(s.receivers.as_ref(), &s.want(None, 100))
        .await
        .unwrap();
    assert_eq!(found.step, 2);
    held.withdraw().await.unwrap();
}

/// Members that announce different architectures are refused, naming one.
pub async fn a_disagreeing_architecture_is_refused(s: &Sides) {
    let a = s
        .publishers
        .announce(s.announcement(0, 2, 1))
        .await
        .unwrap();
    let mut other = s.announcement(1, 2, 1);
    other.config = Bytes::from_static(b"{}");
    let b = s.publishers.announce(other).await.unwrap();
    let e = discover(s.receivers.as_ref(), &s.want(None, 2_000))
        .await
        .unwrap_err();
    assert_eq!(
        (e.kind(), e.context().owner),
        (ErrorKind::Config, Some(1)),
        "{e}"
    );
    a.withdraw().await.unwrap();
    b.withdraw().await.unwrap();
}

/// A rendezvous that runs a hook once, just before the first `fetch` reaches the real one: the
/// moment between a receiver's member list and its fetch, where a publisher's state can change.
pub struct BeforeFirstFetch {
    inner: Arc<dyn Rendezvous>,
    hook: parking_lot::Mutex<Option<BoxFuture<'static, ()>>>,
    /// Fetches made so far.
    pub fetches: AtomicUsize,
}

impl BeforeFirstFetch {
    /// `inner`, with `hook` run before its first fetch.
    pub fn new(inner: Arc<dyn Rendezvous>, hook: BoxFuture<'static, ()>) -> Self {
        Self {
            inner,
            hook: parking_lot::Mutex::new(Some(hook)),
            fetches: AtomicUsize::new(0),
        }
    }
}

#[async_trait]
impl Rendezvous for BeforeFirstFetch {
    fn endpoint(&self) -> String {
        self.inner.endpoint()
    }
    async fn announce(&self, a: Announcement) -> Result<Box<dyn Announced>> {
        self.inner.announce(a).await
    }
    async fn members(&self, model: &str) -> Result<(Vec<Member>, u64)> {
        self.inner.members(model).await
    }
    async fn fetch(&self, model: &str, ranks: &[OwnerId]) -> Result<Vec<Fetched>> {
        self.fetches.fetch_add(1, Ordering::SeqCst);
        let hook = self.hook.lock().take();
        if let Some(hook) = hook {
            hook.await;
        }
        self.inner.fetch(model, ranks).await
    }
    async fn changed(&self, model: &str, revision: u64, timeout: Duration) -> Result<u64> {
        self.inner.changed(model, revision, timeout).await
    }
    async fn models(&self) -> Result<Vec<String>> {
        self.inner.models().await
    }
    async fn claim_reading(&self, claim: ReadClaim) -> Result<Box<dyn Reading>> {
        self.inner.claim_reading(claim).await
    }
    async fn readers(&self, model: &str) -> Result<(Vec<ReadClaim>, u64)> {
        self.inner.readers(model).await
    }
    async fn readers_changed(&self, model: &str, revision: u64, timeout: Duration) -> Result<u64> {
        self.inner.readers_changed(model, revision, timeout).await
    }
}

/// `fetch` reads each record's readiness together with its announcement: a publisher that
/// marked itself not ready is fetched as not ready, at the step it still stands at, until it
/// advances.
pub async fn fetch_reports_each_records_readiness(s: &Sides) {
    let a = s
        .publishers
        .announce(s.announcement(0, 2, 1))
        .await
        .unwrap();
    let b = s
        .publishers
        .announce(s.announcement(1, 2, 1))
        .await
        .unwrap();
    let r = &s.receivers;
    let ready = |f: &[Fetched]| {
        f.iter()
            .map(|f| (f.announcement.rank, f.ready))
            .collect::<Vec<_>>()
    };
    let f = r.fetch(&s.model, &[1, 0]).await.unwrap();
    assert_eq!(
        ready(&f),
        [(0, true), (1, true)],
        "ordered by rank, both ready"
    );
    assert_eq!(f[1].announcement, s.announcement(1, 2, 1));
    b.unready().await.unwrap();
    let f = r.fetch(&s.model, &[0, 1]).await.unwrap();
    assert_eq!(ready(&f), [(0, true), (1, false)]);
    assert_eq!(
        f[1].announcement,
        s.announcement(1, 2, 1),
        "still step 1's table"
    );
    b.advance(2, Bytes::from_static(b"t1 2")).await.unwrap();
    let f = r.fetch(&s.model, &[1]).await.unwrap();
    assert_eq!((f[0].ready, f[0].announcement.step), (true, 2));
    a.withdraw().await.unwrap();
    b.withdraw().await.unwrap();
}

/// Between a receiver's member list (every rank ready at step 1) and its fetch, rank 1 marks
/// itself not ready at step 1, the step discovery chose, to rewrite its weights. The fetched set
/// is all at step 1 but not all ready: discovery goes round again and returns step 2 once both
/// ranks advanced, with step 2's tables, never step 1 with a table its publisher withdrew.
pub async fn a_record_not_ready_at_fetch_sends_discovery_round_again(s: &Sides) {
    let held: Arc<Vec<Box<dyn Announced>>> = Arc::new(vec![
        s.publishers
            .announce(s.announcement(0, 2, 1))
            .await
            .unwrap(),
        s.publishers
            .announce(s.announcement(1, 2, 1))
            .await
            .unwrap(),
    ]);
    let (tx, advanced) = tokio::sync::oneshot::channel();
    let hook = {
        let held = held.clone();
        Box::pin(async move {
            held[1].unready().await.unwrap();
            // Both advance later, while discovery waits: rank 0 first, so one moment holds rank 0
            // ready at step 2 and rank 1 still updating at step 1.
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                held[0]
                    .advance(2, Bytes::from_static(b"t0 2"))
                    .await
                    .unwrap();
                held[1]
                    .advance(2, Bytes::from_static(b"t1 2"))
                    .await
                    .unwrap();
                let _ = tx.send(held);
            });
        })
    };
    let r = BeforeFirstFetch::new(s.receivers.clone(), hook);
    let found = discover(&r, &s.want(None, 10_000)).await.unwrap();
    assert_eq!(found.step, 2, "{:?}", found.announcements);
    let tables: Vec<&[u8]> = found.announcements.iter().map(|a| &a.table[..]).collect();
    assert_eq!(tables, [&b"t0 2"[..], b"t1 2"]);
    assert!(r.fetches.load(Ordering::SeqCst) >= 2, "went round again");
    drop(held);
    let held = Arc::try_unwrap(advanced.await.unwrap())
        .ok()
        .expect("the only holder");
    for h in held {
        h.withdraw().await.unwrap();
    }
}

/// A world above `MAX_WORLD` is refused before anything is announced.
pub async fn a_world_above_the_limit_is_refused_at_announce(s: &Sides) {
    let e = s
        .publishers
        .announce(s.announcement(0, MAX_WORLD + 1, 1))
        .await
        .err()
        .expect("refused");
    assert_eq!(
        (e.kind(), e.context().owner),
        (ErrorKind::InvalidInput, Some(0))
    );
    let (members, _) = s.receivers.members(&s.model).await.unwrap();
    assert!(members.is_empty(), "{members:?}");
}

/// A publisher's note reaches the members list and clears again; it changes neither step nor
/// readiness (discovery still finds the step), and a long one arrives cut to the limit.
pub async fn a_note_is_shown_with_the_member_and_clears(s: &Sides) {
    let a = s
        .publishers
        .announce(s.announcement(0, 1, 3))
        .await
        .unwrap();
    let r = s.receivers.clone();
    let note = |r: Arc<dyn Rendezvous>, model: String| async move {
        let (m, _) = r.members(&model).await.unwrap();
        (m[0].step, m[0].ready, m[0].note.clone())
    };
    assert_eq!(note(r.clone(), s.model.clone()).await, (3, true, None));
    a.set_note(Some("refused step 4: bad header".into()))
        .await
        .unwrap();
    assert_eq!(
        note(r.clone(), s.model.clone()).await,
        (3, true, Some("refused step 4: bad header".into()))
    );
    assert_eq!(
        discover(r.as_ref(), &s.want(None, 5_000))
            .await
            .unwrap()
            .step,
        3
    );
    a.set_note(Some("x".repeat(10 * MAX_NOTE_BYTES)))
        .await
        .unwrap();
    let (_, _, long) = note(r.clone(), s.model.clone()).await;
    assert!(long.unwrap().len() <= MAX_NOTE_BYTES);
    // Advancing keeps the note (the publisher clears it when it has nothing to say).
    a.unready().await.unwrap();
    a.advance(5, Bytes::from_static(b"t 5")).await.unwrap();
    assert!(note(r.clone(), s.model.clone()).await.2.is_some());
    a.set_note(None).await.unwrap();
    assert_eq!(note(r, s.model.clone()).await, (5, true, None));
}

/// Every test of the suite as a `#[tokio::test]` of the calling binary. `$sides` is an async fn
/// giving the [`Sides`] of a model name (`None`: skipped, said loudly by it); `$rounds` is how
/// many steps the advancing test runs (a hub takes thousands where etcd takes tens).
macro_rules! suite_tests {
    ($sides:path, $rounds:expr) => {
        $crate::suite::suite_tests!(@each $sides;
            a_receiver_started_first_waits_for_every_publisher,
            a_timeout_names_who_was_seen_missing_and_behind,
            an_unready_publisher_holds_discovery_until_it_advances,
            discovery_never_mixes_steps_while_publishers_advance($rounds),
            a_dropped_handle_is_a_publisher_gone_and_wakes_watchers,
            one_holder_per_rank_and_a_restarted_rank_claims_it,
            a_bare_claim_is_handed_over_to_the_announcement_with_no_gap,
            large_tables_arrive_intact,
            a_live_publisher_outlasts_its_lease,
            a_disagreeing_architecture_is_refused,
            fetch_reports_each_records_readiness,
            a_record_not_ready_at_fetch_sends_discovery_round_again,
            a_world_above_the_limit_is_refused_at_announce,
            a_note_is_shown_with_the_member_and_clears,
            a_member_withdrawn_between_list_and_fetch_is_waited_for,
            an_unreachable_rendezvous_is_waited_through,
            a_broken_watch_is_waited_through,
            a_rendezvous_down_past_the_timeout_is_a_timeout_naming_the_failure,
            a_set_that_keeps_moving_on_is_looked_at_again_with_backoff,
            a_rank_listed_twice_counts_once,
            the_fence_holds_while_a_receiver_reads_and_opens_at_release,
            a_claim_holds_only_the_memory_it_names,
        );
    };
    (@each $sides:path; $($name:ident $(($arg:expr))?),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let Some(s) = $sides(stringify!($name)).await else { return };
            $crate::suite::$name(&s $(, $arg)?).await;
        }
    )*};
}
pub(crate) use suite_tests;
