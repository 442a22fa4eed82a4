//! Discovery under rendezvous faults, for every implementation: a member that withdraws (for
//! real) between the member list and the fetch, a service that does not answer for a while, a
//! watch that breaks. Discovery waits each of them through and says so
//! (`Discovered::waited_through`); one that outlasts the caller's timeout is a `Timeout` naming
//! what failed. The faults other than the withdrawal are injected by [`Faulty`], which passes
//! every call through to the real rendezvous once its armed failures are spent.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

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
}

impl Faulty {
    fn new(inner: Arc<dyn Rendezvous>) -> Self {
        Self {
            inner,
            fail_members: AtomicUsize::new(0),
            fail_changed: AtomicUsize::new(0),
            before_fetch: Mutex::new(None),
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
        if Self::spend(&self.fail_members) {
            return Err(Error::new(
                ErrorKind::Transport,
                format!(
                    "could not list members at {}: connection refused (the test took it away)",
                    self.endpoint()
                ),
            ));
        }
        self.inner.members(model).await
    }

    async fn fetch(&self, model: &str, ranks: &[OwnerId]) -> Result<Vec<Fetched>> {
        let before = self.before_fetch.lock().take();
        if let Some(f) = before {
            f.await;
        }
        self.inner.fetch(model, ranks).await
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
