//! A subscriber installs only steps every publisher vouches for (docs/deployment.md, section 2):
//! a set found while connecting that went stale before the first install, or a record that
//! turned not ready between the member list and the fetch, sends discovery round again, and the
//! step then installed is byte-exact. Publishers are TP2 over loopback and the receiver is TP1,
//! so it reads every publisher's memory: a step installed from a publisher that was rewriting
//! would show (as a digest failure, or as wrong bytes). A set that moves on at every claim is
//! discovered again with backoff, within the call's timeout, not in a tight loop.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
use reshard_core::encoding::encode_table;
use reshard_core::rendezvous::{
    Announced, Announcement, Fetched, Member, ReadClaim, Reading, Rendezvous,
};
use reshard_core::{ErrorKind, OwnerId, Result, Transport};
use reshard_planner::presets::ModelConfig;
use reshard_planner::topology::{PublisherTopology, ReceiverTopology};
use reshard_rendezvous::InProcess;
use reshard_runtime::{ReceiverOptions, ShardPublisher, Subscriber};
use reshard_testkit::content;
use reshard_testkit::synthetic::reference_params;

const SEED: u64 = 23;
const MODEL: &str = "tiny";

/// A hook future run once, before the next fetch.
type Hook = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// The in-process hub with a hook that can be armed to run once, just before the next `fetch`
/// reaches the hub: between a receiver's member list and its fetch.
struct Interposed {
    hub: InProcess,
    hook: Mutex<Option<Hook>>,
    fetches: AtomicUsize,
    /// Run once just before the next reading claim reaches the hub: between a receiver's
    /// discovery and its claim (the reader fence).
    claim_hook: Mutex<Option<Hook>>,
    /// `members` calls made.
    members_calls: AtomicUsize,
    /// While set, `members` lists every publisher under another incarnation than it announced:
    /// discovery still finds the set, and the subscriber's check after its claim never agrees
    /// with it (each stage attempt ends `MovedOn`).
    skew_incarnations: AtomicBool,
}

impl Interposed {
    fn arm(&self, hook: Hook) {
        *self.hook.lock().unwrap() = Some(hook);
    }
}

#[async_trait]
impl Rendezvous for Interposed {
    fn endpoint(&self) -> String {
        self.hub.endpoint()
    }
    async fn announce(&self, a: Announcement) -> Result<Box<dyn Announced>> {
        self.hub.announce(a).await
    }
    async fn members(&self, model: &str) -> Result<(Vec<Member>, u64)> {
        self.members_calls.fetch_add(1, Ordering::SeqCst);
        // As a networked service's answer would: a caller looping on these calls can still be
        // timed out (the hub answers without ever yielding).
        tokio::task::yield_now().await;
        let (mut members, revision) = self.hub.members(model).await?;
        if self.skew_incarnations.load(Ordering::SeqCst) {
            for m in &mut members {
                m.incarnation = m.incarnation.wrapping_add(1);
            }
        }
        Ok((members, revision))
    }
    async fn fetch(&self, model: &str, ranks: &[OwnerId]) -> Result<Vec<Fetched>> {
        self.fetches.fetch_add(1, Ordering::SeqCst);
        let hook = self.hook.lock().unwrap().take();
        if let Some(hook) = hook {
            hook.await;
        }
        self.hub.fetch(model, ranks).await
    }
    async fn changed(&self, model: &str, revision: u64, timeout: Duration) -> Result<u64> {
        self.hub.changed(model, revision, timeout).await
    }
    async fn models(&self) -> Result<Vec<String>> {
        self.hub.models().await
    }
    async fn claim_reading(&self, claim: ReadClaim) -> Result<Box<dyn Reading>> {
        let hook = self.claim_hook.lock().unwrap().take();
        if let Some(hook) = hook {
            hook.await;
        }
        self.hub.claim_reading(claim).await
    }
    async fn readers(&self, model: &str) -> Result<(Vec<ReadClaim>, u64)> {
        self.hub.readers(model).await
    }
    async fn readers_changed(&self, model: &str, revision: u64, timeout: Duration) -> Result<u64> {
        self.hub.readers_changed(model, revision, timeout).await
    }
}

/// Publishers of [`MODEL`] at TP2, announced at step 1, and a TP1 subscriber connected to them
/// (nothing installed yet).
struct Rig {
    _fabric: LoopbackFabric,
    model: ModelConfig,
    rendezvous: Arc<Interposed>,
    publishers: Arc<Mutex<Vec<ShardPublisher>>>,
    held: Arc<Vec<Box<dyn Announced>>>,
    sub: Subscriber,
}

fn endpoint(fabric: &LoopbackFabric, agent: &str) -> Arc<dyn Transport> {
    Arc::new(LoopbackTransport::new(fabric, agent, 2).expect("endpoint"))
}

/// Rewrites publisher `p`'s memory in place with the generator's step `step`.
fn fill(p: &mut ShardPublisher, step: u64) {
    p.fill(step, |spec, tbox, dst| {
        let key = content::tensor_key(SEED, step, &spec.name);
        content::fill_box(dst, key, &spec.shape, tbox, spec.dtype.size());
        Ok(())
    })
    .unwrap();
}

/// Marks publisher `rank` not ready, then rewrites its memory with step `step` (in that order,
/// as a real publisher does).
async fn rewrite(
    held: &[Box<dyn Announced>],
    publishers: &Mutex<Vec<ShardPublisher>>,
    rank: usize,
    step: u64,
) {
    held[rank].unready().await.unwrap();
    fill(&mut publishers.lock().unwrap()[rank], step);
}

/// Announces every publisher ready at the step its memory holds, with its current table.
async fn advance(held: &[Box<dyn Announced>], publishers: &Mutex<Vec<ShardPublisher>>) {
    let tables: Vec<_> = publishers
        .lock()
        .unwrap()
        .iter()
        .map(|p| p.table().clone())
        .collect();
    for (h, t) in held.iter().zip(tables) {
        h.advance(t.step, Bytes::from(encode_table(&t)))
            .await
            .unwrap();
    }
}

async fn rig() -> Rig {
    let model = reshard_testkit::models::tiny_moe(8);
    let topo: PublisherTopology = "tp=2".parse().unwrap();
    let fabric = LoopbackFabric::new();
    let rendezvous = Arc::new(Interposed {
        hub: InProcess::new(),
        hook: Mutex::new(None),
        fetches: AtomicUsize::new(0),
        claim_hook: Mutex::new(None),
        members_calls: AtomicUsize::new(0),
        skew_incarnations: AtomicBool::new(false),
    });
    let config = Bytes::from(serde_json::to_vec(&model).unwrap());
    let mut publishers = Vec::new();
    let mut held = Vec::new();
    for rank in 0..topo.world() {
        let t = endpoint(&fabric, &format!("pub-{rank}"));
        let mut p = ShardPublisher::new(t, &model, &topo, rank).await.unwrap();
        fill(&mut p, 1);
        let a = Announcement {
            model: MODEL.into(),
            rank,
            world: topo.world(),
            step: 1,
            transport: p.transport().name().into(),
            incarnation: p.transport().incarnation(),
            table: Bytes::from(encode_table(p.table())),
            metadata: p.transport().export_metadata().await.unwrap(),
            config: config.clone(),
        };
        held.push(rendezvous.announce(a).await.unwrap());
        publishers.push(p);
    }
    let sub = Subscriber::connect(
        rendezvous.clone(),
        MODEL,
        endpoint(&fabric, "rx"),
        &ReceiverTopology::tp(1),
        0,
        ReceiverOptions::default(),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    Rig {
        _fabric: fabric,
        model,
        rendezvous,
        publishers: Arc::new(Mutex::new(publishers)),
        held: Arc::new(held),
        sub,
    }
}

/// The subscriber's live step is `step` and its parameters are exactly the generator's.
fn assert_live(r: &Rig, step: u64) {
    let rx = r.sub.receiver();
    assert_eq!(rx.live_step(), Some(step));
    let expected = reference_params(&r.model.tensors(), SEED, step, rx.layout()).unwrap();
    let live: Vec<Vec<u8>> = rx
        .live_params()
        .unwrap()
        .iter()
        .map(|p| p.read().to_vec())
        .collect();
    assert!(live == expected, "step {step}: installed bytes differ");
}

/// The set `connect` found (every publisher ready at step 1) goes stale before the first
/// `next_step`: the publishers mark themselves not ready and rewrite their memory with step 2.
/// The subscriber does not install step 1 from memory that now holds step 2: it discovers again
/// and installs step 2 once the publishers advance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_found_at_connect_that_went_stale_is_discovered_again() {
    let mut r = rig().await;
    for rank in 0..r.held.len() {
        rewrite(&r.held, &r.publishers, rank, 2).await;
    }
    let (held, publishers) = (r.held.clone(), r.publishers.clone());
    let publish = async move {
        // Not a timing assertion: the receiver installs step 2 whether or not it is waiting yet.
        tokio::time::sleep(Duration::from_millis(50)).await;
        advance(&held, &publishers).await;
    };
    let (report, ()) = tokio::join!(r.sub.next_step(Duration::from_secs(10)), publish);
    assert_eq!(report.unwrap().step, 2);
    assert_live(&r, 2);
}

/// Step 1 is installed; the publishers advance to step 2. Between the subscriber's member list
/// (both ready at step 2) and its fetch, publisher rank 1 marks itself not ready at step 2 and
/// rewrites its memory with step 3; the other follows later and both advance to step 3. The
/// fetched set is all at step 2 but not all ready: the subscriber goes round again and installs
/// step 3, byte-exact, never step 2 with rank 1's memory rewritten under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_not_ready_at_fetch_sends_the_subscriber_round_again() {
    let mut r = rig().await;
    assert_eq!(
        r.sub.next_step(Duration::from_secs(10)).await.unwrap().step,
        1
    );
    assert_live(&r, 1);
    for rank in 0..r.held.len() {
        rewrite(&r.held, &r.publishers, rank, 2).await;
    }
    advance(&r.held, &r.publishers).await;
    let (held, publishers) = (r.held.clone(), r.publishers.clone());
    r.rendezvous.arm(Box::pin(async move {
        rewrite(&held, &publishers, 1, 3).await;
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            rewrite(&held, &publishers, 0, 3).await;
            advance(&held, &publishers).await;
        });
    }));
    let before = r.rendezvous.fetches.load(Ordering::SeqCst);
    let report = r.sub.next_step(Duration::from_secs(10)).await.unwrap();
    assert_eq!(report.step, 3);
    assert_live(&r, 3);
    assert!(
        r.rendezvous.fetches.load(Ordering::SeqCst) - before >= 2,
        "discovery went round again"
    );
}

/// The reader fence from the receiver's side: the set is found (both publishers ready at step
/// 2), and before the receiver's reading claim lands, publisher rank 0 marks itself not ready
/// and rewrites its memory with step 3 (it listed no claim, so for it no receiver reads). The
/// receiver's check after its claim sees rank 0 not ready: it reads nothing of step 2 and
/// discovers again, installing step 3 byte-exact once both advance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_that_unreadies_before_the_claim_lands_is_not_read() {
    let mut r = rig().await;
    assert_eq!(
        r.sub.next_step(Duration::from_secs(10)).await.unwrap().step,
        1
    );
    for rank in 0..r.held.len() {
        rewrite(&r.held, &r.publishers, rank, 2).await;
    }
    advance(&r.held, &r.publishers).await;
    let (held, publishers) = (r.held.clone(), r.publishers.clone());
    *r.rendezvous.claim_hook.lock().unwrap() = Some(Box::pin(async move {
        rewrite(&held, &publishers, 0, 3).await;
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            rewrite(&held, &publishers, 1, 3).await;
            advance(&held, &publishers).await;
        });
    }));
    let report = r.sub.next_step(Duration::from_secs(10)).await.unwrap();
    assert_eq!(report.step, 3);
    assert_live(&r, 3);
    assert!(
        r.rendezvous.claim_hook.lock().unwrap().is_none(),
        "the hook ran"
    );
}

/// Every set the subscriber finds has moved on by the time its claim is checked (the member
/// list shows other incarnations than the announcements): `stage` discovers again after a pause
/// that doubles (50 ms up to 1 s), so a 1 s stage lists the members a handful of times and ends
/// in a `Timeout` at its deadline, nothing read and nothing live. Without the pause it went
/// round as fast as the rendezvous answered (in-process: thousands of member lists a second,
/// and past the deadline, since discovery finds this set at once whatever time is left).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_that_moves_on_at_every_claim_is_staged_again_with_backoff() {
    let mut r = rig().await;
    r.rendezvous.skew_incarnations.store(true, Ordering::SeqCst);
    let before = r.rendezvous.members_calls.load(Ordering::SeqCst);
    let start = Instant::now();
    let staged = tokio::time::timeout(
        Duration::from_secs(10),
        r.sub.stage(None, false, Duration::from_secs(1)),
    )
    .await
    .expect("stage ends near its own 1 s timeout, not 10 s later");
    let took = start.elapsed();
    let e = staged.expect_err("no set held still");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    let calls = r.rendezvous.members_calls.load(Ordering::SeqCst) - before;
    eprintln!("a set moving on at every claim: {calls} member lists in {took:?}: {e}");
    // Two lists per round (discovery's and the claim's check), about 5 rounds in the second.
    assert!(calls < 50, "{calls} member lists in {took:?}");
    assert!(took < Duration::from_millis(2_500), "{took:?}");
    assert_eq!(r.sub.receiver().live_step(), None);
    // Once the list agrees with the announcements again, the step stages and installs.
    r.rendezvous
        .skew_incarnations
        .store(false, Ordering::SeqCst);
    let report = r.sub.next_step(Duration::from_secs(10)).await.unwrap();
    assert_eq!(report.step, 1);
    assert_live(&r, 1);
}
