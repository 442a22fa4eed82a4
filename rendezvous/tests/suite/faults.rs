//! Discovery under rendezvous faults, for every implementation: a member that withdraws (for
//! real) between the member list and the fetch, a service that does not answer for a while, a
//! watch that breaks. Discovery waits each of them through and says so
//! (`Discovered::waited_through`); one that outlasts the caller's timeout is a `Timeout` naming
//! what failed. The faults other than the withdrawal are injected by [`Faulty`], which passes
//! every call through to the real rendezvous once its armed failures are spent. Two faults no
//! correct rendezvous has, but discovery must survive anyway: a set that moves on at every
//! fetch (looked at again with backoff, not in a tight loop) and a rank listed twice (counted
//! once).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use reshard_core::rendezvous::{
    discover, Announced, Announcement, Fetched, Member, ReadClaim, Reading, Rendezvous,
};
use reshard_core::{Error, ErrorKind, OwnerId, Result};

use super::Sides;

/// A real rendezvous with faults a test arms.
pub struct Faulty {
    inner: Arc<dyn Rendezvous>,
    /// `members` calls still to fail as an unreachable service's would.
    fail_members: AtomicUsize,
    /// `changed` calls still to fail as a broken watch would.
    fail_changed: AtomicUsize,
    /// Run once, before the next `fetch` goes through.
    before_fetch: Mutex<Option<BoxFuture<'static, ()>>>,
    /// `members` calls made (failed ones included): how hard a receiver leans on the service.
    members_calls: AtomicUsize,
    /// While set, every fetched record reads not ready: a set that moves on at every fetch.
    unready_fetches: AtomicBool,
    /// A rank whose member each `members` call lists twice, as a rendezvous that broke the
    /// one-holder rule (or spelled a rank's key twice) would.
    doubled: Mutex<Option<OwnerId>>,
}

impl Faulty {
    fn new(inner: Arc<dyn Rendezvous>) -> Self {
        Self {
            inner,
            fail_members: AtomicUsize::new(0),
            fail_changed: AtomicUsize::new(0),
            before_fetch: Mutex::new(None),
            members_calls: AtomicUsize::new(0),
            unready_fetches: AtomicBool::new(false),
            doubled: Mutex::new(None),
        }
    }

    fn spend(counter: &AtomicUsize) -> bool {
        counter
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
}

#[async_trait]
impl Rendezvous for Faulty {
    fn endpoint(&self) -> String {
        self.inner.endpoint()
    }

    async fn announce(&self, a: Announcement) -> Result<Box<dyn Announced>> {
        self.inner.announce(a).await
    }

    async fn members(&self, model: &str) -> Result<(Vec<Member>, u64)> {
        self.members_calls.fetch_add(1, Ordering::SeqCst);
        // As a networked service's answer would: a caller looping on these calls can still be
        // timed out and cancelled (the in-process hub answers without ever yielding).
        tokio::task::yield_now().await;
        if Self::spend(&self.fail_members) {
            return Err(Error::new(
                ErrorKind::Transport,
                format!(
                    "could not list members at {}: connection refused (the test took it away)",
                    self.endpoint()
                ),
            ));
        }
        let (mut members, revision) = self.inner.members(model).await?;
        let doubled = *self.doubled.lock();
        if let Some(twice) = members.iter().find(|m| Some(m.rank) == doubled).cloned() {
            members.push(twice);
            members.sort_by_key(|m| m.rank);
        }
        Ok((members, revision))
    }

    async fn fetch(&self, model: &str, ranks: &[OwnerId]) -> Result<Vec<Fetched>> {
        let before = self.before_fetch.lock().take();
        if let Some(f) = before {
            f.await;
        }
        let mut fetched = self.inner.fetch(model, ranks).await?;
        if self.unready_fetches.load(Ordering::SeqCst) {
            for f in &mut fetched {
                f.ready = false;
            }
        }
        Ok(fetched)
    }

    async fn changed(&self, model: &str, revision: u64, timeout: Duration) -> Result<u64> {
        if Self::spend(&self.fail_changed) {
            return Err(Error::new(
                ErrorKind::Transport,
                format!(
                    "could not watch {}: the watch stream broke (the test broke it)",
                    self.endpoint()
                ),
            ));
        }
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

/// A member that withdraws between the member list and the fetch (the fetch finds no record):
/// discovery looks again, waits for the rank to come back (a restart, new incarnation) and
/// returns the set with the new one.
pub async fn a_member_withdrawn_between_list_and_fetch_is_waited_for(s: &Sides) {
    let p = &s.publishers;
    let held0 = p.announce(s.announcement(0, 2, 1)).await.unwrap();
    let held1 = p.announce(s.announcement(1, 2, 1)).await.unwrap();
    let faulty = Faulty::new(s.receivers.clone());
    let (publishers, restarted) = (p.clone(), {
        let mut a = s.announcement(1, 2, 1);
        a.incarnation = 999;
        a
    });
    let back: Arc<Mutex<Option<Box<dyn Announced>>>> = Arc::new(Mutex::new(None));
    let slot = back.clone();
    *faulty.before_fetch.lock() = Some(Box::pin(async move {
        held1.withdraw().await.unwrap();
        // The rank comes back a little later, as a restarted process would.
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let h = publishers.announce(restarted).await.unwrap();
            *slot.lock() = Some(h);
        });
    }));
    let found = discover(&faulty, &s.want(None, 20_000))
        .await
        .expect("discovery waits through the withdrawal");
    assert_eq!(found.step, 1);
    assert_eq!(
        found.announcements[1].incarnation, 999,
        "the restarted rank"
    );
    assert!(
        found
            .waited_through
            .iter()
            .any(|l| l.contains("peer_unknown")),
        "{:?}",
        found.waited_through
    );
    held0.withdraw().await.unwrap();
    let h = back.lock().take();
    h.unwrap().withdraw().await.unwrap();
}

/// A rendezvous that does not answer for a while (three member lists fail): discovery waits it
/// out with backoff and lists what it waited through.
pub async fn an_unreachable_rendezvous_is_waited_through(s: &Sides) {
    let p = &s.publishers;
    let held = [
        p.announce(s.announcement(0, 2, 4)).await.unwrap(),
        p.announce(s.announcement(1, 2, 4)).await.unwrap(),
    ];
    let faulty = Faulty::new(s.receivers.clone());
    faulty.fail_members.store(3, Ordering::SeqCst);
    let found = discover(&faulty, &s.want(None, 20_000))
        .await
        .expect("discovery waits through an unreachable rendezvous");
    assert_eq!(found.step, 4);
    assert_eq!(found.waited_through.len(), 1, "{:?}", found.waited_through);
    assert!(
        found.waited_through[0].starts_with("3 x transport: could not list members"),
        "{:?}",
        found.waited_through
    );
    for h in held {
        h.withdraw().await.unwrap();
    }
}

/// A watch that breaks while discovery waits for a late publisher: discovery looks again and
/// still sees the publisher arrive.
pub async fn a_broken_watch_is_waited_through(s: &Sides) {
    let p = &s.publishers;
    let held0 = p.announce(s.announcement(0, 2, 2)).await.unwrap();
    let faulty = Arc::new(Faulty::new(s.receivers.clone()));
    faulty.fail_changed.store(2, Ordering::SeqCst);
    let waiting = {
        let (f, want) = (faulty.clone(), s.want(None, 20_000));
        tokio::spawn(async move { discover(f.as_ref(), &want).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held1 = p.announce(s.announcement(1, 2, 2)).await.unwrap();
    let found = waiting
        .await
        .unwrap()
        .expect("discovery waits through the broken watch");
    assert_eq!(found.step, 2);
    assert!(
        found
            .waited_through
            .iter()
            .any(|l| l.starts_with("2 x transport: could not watch")),
        "{:?}",
        found.waited_through
    );
    held0.withdraw().await.unwrap();
    held1.withdraw().await.unwrap();
}

/// A rendezvous that never answers within the caller's timeout: a `Timeout` that names the
/// failure it waited through, not the failure itself (the caller's own timeout decides).
pub async fn a_rendezvous_down_past_the_timeout_is_a_timeout_naming_the_failure(s: &Sides) {
    let faulty = Faulty::new(s.receivers.clone());
    faulty.fail_members.store(usize::MAX, Ordering::SeqCst);
    let e = discover(&faulty, &s.want(None, 400)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("waited through") && msg.contains("connection refused"),
        "{msg}"
    );
}

/// A set the member list shows complete and ready, but every fetch finds not ready (a publisher
/// flapping between ready and not, or a list and records that disagree): discovery looks again
/// after a pause that doubles (50 ms up to 1 s), so over a 1 s timeout it lists the members a
/// handful of times, then times out. Without the pause it looked again as fast as the
/// rendezvous answered, and past the caller's timeout (the retry skipped the deadline check):
/// thousands of member lists in 3 s, against etcd and in-process alike, and no end.
pub async fn a_set_that_keeps_moving_on_is_looked_at_again_with_backoff(s: &Sides) {
    let p = &s.publishers;
    let held = [
        p.announce(s.announcement(0, 2, 1)).await.unwrap(),
        p.announce(s.announcement(1, 2, 1)).await.unwrap(),
    ];
    let faulty = Arc::new(Faulty::new(s.receivers.clone()));
    faulty.unready_fetches.store(true, Ordering::SeqCst);
    let start = Instant::now();
    let looking = {
        let (f, want) = (faulty.clone(), s.want(None, 1_000));
        tokio::spawn(async move { discover(f.as_ref(), &want).await })
    };
    // Bounded here too: before the backoff, a set moving on skipped the deadline check and
    // discovery never ended; the count below is what this test is about, checked first.
    let ended = tokio::time::timeout(Duration::from_secs(3), looking).await;
    let took = start.elapsed();
    let looks = faulty.members_calls.load(Ordering::SeqCst);
    eprintln!("a set moving on at every fetch: {looks} member lists in {took:?}");
    // 50 + 100 + 200 + 400 ms of pauses fit in the second: about 5 looks, 50 is far above.
    assert!((2..50).contains(&looks), "{looks} member lists in {took:?}");
    let e = ended
        .expect("discovery ends at its own timeout")
        .unwrap()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    // The pauses stop at the deadline: the timeout is the caller's, not the backoff's.
    assert!(took < Duration::from_millis(2_500), "{took:?}");
    // Once the fetch agrees with the list again, the set is found.
    faulty.unready_fetches.store(false, Ordering::SeqCst);
    let found = discover(faulty.as_ref(), &s.want(None, 5_000))
        .await
        .unwrap();
    assert_eq!(found.step, 1);
    for h in held {
        h.withdraw().await.unwrap();
    }
}

/// A rendezvous that lists one rank twice (the contract gives a rank one holder; a broken
/// implementation, or a rank's key spelled two ways, could list two): the rank counts once.
/// Two ranks of three announced, one listed twice, is not a complete set (the timeout names
/// the missing rank and the doubled one); before, the doubled rank stood in for the missing
/// one and discovery fetched a rank that did not exist until its timeout. All three announced,
/// one listed twice, is a complete set of three (before, four records never matched a world of
/// three).
pub async fn a_rank_listed_twice_counts_once(s: &Sides) {
    let p = &s.publishers;
    let mut held = vec![
        p.announce(s.announcement(0, 3, 1)).await.unwrap(),
        p.announce(s.announcement(1, 3, 1)).await.unwrap(),
    ];
    let faulty = Faulty::new(s.receivers.clone());
    *faulty.doubled.lock() = Some(1);
    let e = discover(&faulty, &s.want(None, 300)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    let msg = e.to_string();
    for part in [
        "saw 2 of 3 publishers, 2 ready",
        "missing ranks 2",
        "ranks 1 claimed by more than one record",
    ] {
        assert!(msg.contains(part), "{part:?} not in {msg}");
    }
    held.push(p.announce(s.announcement(2, 3, 1)).await.unwrap());
    let found = discover(&faulty, &s.want(None, 5_000)).await.unwrap();
    let ranks: Vec<OwnerId> = found.announcements.iter().map(|a| a.rank).collect();
    assert_eq!(ranks, [0, 1, 2]);
    assert_eq!(found.announcements[1], s.announcement(1, 3, 1));
    for h in held {
        h.withdraw().await.unwrap();
    }
}
