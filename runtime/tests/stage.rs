//! Stage, apply, roll back through a rendezvous (python/README.md, "Stage, apply, roll back"):
//! a step staged while the engine serves another leaves the live weights bit for bit as they
//! were; applying it makes it live bit for bit; a rollback brings the previous step back bit
//! for bit with every publisher gone. Handles and rollbacks that cannot be honoured are typed
//! errors that change nothing. Publishers are TP2 over loopback and the receiver TP1, so it
//! reads every publisher's memory; "bit for bit" is against the generator that wrote the
//! publishers' memory.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
use reshard_core::encoding::encode_table;
use reshard_core::rendezvous::{Announced, Announcement, Rendezvous};
use reshard_core::{ErrorDetail, ErrorKind, HostBuffer, NoRollback, NotApplicable, Transport};
use reshard_planner::presets::ModelConfig;
use reshard_planner::topology::{PublisherTopology, ReceiverTopology};
use reshard_rendezvous::InProcess;
use reshard_runtime::{ReceiverOptions, ShardPublisher, Subscriber};
use reshard_testkit::content;
use reshard_testkit::synthetic::reference_params;

const SEED: u64 = 29;
const MODEL: &str = "tiny";
const WAIT: Duration = Duration::from_secs(10);

/// TP2 publishers of [`MODEL`] announced at step 1 on a shared hub, and the fabric they serve on.
struct Rig {
    fabric: LoopbackFabric,
    model: ModelConfig,
    hub: Arc<InProcess>,
    publishers: Vec<ShardPublisher>,
    held: Vec<Box<dyn Announced>>,
}

fn endpoint(fabric: &LoopbackFabric, agent: &str) -> Arc<dyn Transport> {
    Arc::new(LoopbackTransport::new(fabric, agent, 2).expect("endpoint"))
}

fn fill(p: &mut ShardPublisher, step: u64) {
    p.fill(step, |spec, tbox, dst| {
        let key = content::tensor_key(SEED, step, &spec.name);
        content::fill_box(dst, key, &spec.shape, tbox, spec.dtype.size());
        Ok(())
    })
    .unwrap();
}

impl Rig {
    async fn new() -> Rig {
        let model = reshard_testkit::models::tiny_moe(8);
        let topo: PublisherTopology = "tp=2".parse().unwrap();
        let fabric = LoopbackFabric::new();
        let hub = Arc::new(InProcess::new());
        let config = Bytes::from(serde_json::to_vec(&model).unwrap());
        let (mut publishers, mut held) = (Vec::new(), Vec::new());
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
            held.push(hub.announce(a).await.unwrap());
            publishers.push(p);
        }
        Rig {
            fabric,
            model,
            hub,
            publishers,
            held,
        }
    }

    async fn subscriber(&self, agent: &str) -> Subscriber {
        Subscriber::connect(
            self.hub.clone(),
            MODEL,
            endpoint(&self.fabric, agent),
            &ReceiverTopology::tp(1),
            0,
            ReceiverOptions::default(),
            WAIT,
        )
        .await
        .unwrap()
    }

    /// Every publisher marks itself not ready, rewrites its memory with `step`, and announces it
    /// ready (as a real publisher does).
    async fn publish(&mut self, step: u64) {
        for (h, p) in self.held.iter().zip(&mut self.publishers) {
            h.unready().await.unwrap();
            fill(p, step);
            h.advance(step, Bytes::from(encode_table(p.table())))
                .await
                .unwrap();
        }
    }

    /// What receiver rank 0 must hold at `step`: the generator's bytes, as the publishers wrote.
    fn expected(&self, sub: &Subscriber, step: u64) -> Vec<Vec<u8>> {
        reference_params(&self.model.tensors(), SEED, step, sub.receiver().layout()).unwrap()
    }
}

fn bytes_of(bufs: &[Arc<HostBuffer>]) -> Vec<Vec<u8>> {
    bufs.iter().map(|b| b.read().to_vec()).collect()
}

/// The subscriber's live step is `step` and its live weights are `want`, bit for bit.
fn assert_live(sub: &Subscriber, step: u64, want: &[Vec<u8>]) {
    let rx = sub.receiver();
    assert_eq!(rx.live_step(), Some(step));
    assert!(
        bytes_of(rx.live_params().unwrap()) == want,
        "live weights are not step {step}'s"
    );
}

fn detail(e: &reshard_core::Error) -> ErrorDetail {
    e.detail().cloned().expect("a typed detail")
}

/// Done-when line 1 of issue 28: stage step 2 while step 1 is served, apply it, roll back to
/// step 1 with every publisher stopped, bit for bit at each point.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stage_apply_then_roll_back_with_every_publisher_gone() {
    let mut r = Rig::new().await;
    let mut sub = r.subscriber("rx").await;
    let (one, two) = (r.expected(&sub, 1), r.expected(&sub, 2));
    assert!(
        one != two,
        "steps 1 and 2 must differ for the test to mean anything"
    );
    sub.next_step(WAIT).await.unwrap();
    assert_live(&sub, 1, &one);
    let serving: Vec<Arc<HostBuffer>> = sub.receiver().live_params().unwrap().to_vec();

    r.publish(2).await;
    let staged = sub.stage(None, false, WAIT).await.unwrap();
    assert_eq!(staged.step(), 2);
    assert_eq!(sub.receiver().staged_step(), Some(2));
    // The engine kept serving step 1 from the same buffers, unchanged, throughout the stage.
    assert_live(&sub, 1, &one);
    let live_now = sub.receiver().live_params().unwrap();
    assert!(serving.iter().zip(live_now).all(|(a, b)| Arc::ptr_eq(a, b)));
    assert!(
        bytes_of(&serving) == one,
        "staging wrote the buffers being served"
    );

    let report = sub.apply(&staged).unwrap();
    assert_eq!(report.step, 2);
    assert!(report.update.fully_checked());
    assert_eq!(report.newer_step, None);
    assert_eq!(sub.receiver().staged_step(), None);
    assert_live(&sub, 2, &two);
    assert_eq!(sub.receiver().rollback_step(), Ok(1));

    // Every publisher stopped: announcements withdrawn, endpoints and memory dropped.
    for h in r.held.drain(..) {
        h.withdraw().await.unwrap();
    }
    r.publishers.clear();
    let back = sub.rollback().unwrap();
    assert_eq!((back.step, back.rolled_back_from), (1, 2));
    assert_live(&sub, 1, &one);
    // Nothing older is held: a second rollback is refused and changes nothing.
    let e = sub.rollback().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert!(matches!(
        detail(&e),
        ErrorDetail::NoRollback {
            live_step: Some(1),
            reason: NoRollback::NoPrevious
        }
    ));
    assert_live(&sub, 1, &one);
}

/// Handles that cannot be applied and rollbacks with nothing to go back to are typed errors
/// that change nothing: a handle replaced by a later stage, applied twice, of another
/// receiver; a rollback before any previous step, and after a stage overwrote it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_handles_and_rollbacks_change_nothing() {
    let mut r = Rig::new().await;
    let mut sub = r.subscriber("rx").await;
    let mut other = r.subscriber("rx-other").await;
    let (one, two, three) = (
        r.expected(&sub, 1),
        r.expected(&sub, 2),
        r.expected(&sub, 3),
    );

    // The first step: nothing to roll back to.
    let first = sub.stage(None, false, WAIT).await.unwrap();
    let e = sub.rollback().unwrap_err();
    assert!(matches!(
        detail(&e),
        ErrorDetail::NoRollback {
            live_step: None,
            reason: NoRollback::NoPrevious
        }
    ));
    // Another receiver's handle is refused, and its own receiver is untouched.
    let theirs = other.stage(None, false, WAIT).await.unwrap();
    let e = sub.apply(&theirs).unwrap_err();
    assert!(matches!(
        detail(&e),
        ErrorDetail::NotApplicable {
            step: 1,
            reason: NotApplicable::OtherReceiver
        }
    ));
    assert_eq!(sub.receiver().live_step(), None);
    sub.apply(&first).unwrap();
    assert_live(&sub, 1, &one);
    let e = sub.apply(&first).unwrap_err();
    assert!(matches!(
        detail(&e),
        ErrorDetail::NotApplicable {
            reason: NotApplicable::Applied,
            ..
        }
    ));
    assert_live(&sub, 1, &one);

    // Staging while a step is staged: the new stage replaces the old one.
    r.publish(2).await;
    let a = sub.stage(None, false, WAIT).await.unwrap();
    let b = sub.stage(Some(2), false, WAIT).await.unwrap();
    let e = sub.apply(&a).unwrap_err();
    assert!(matches!(
        detail(&e),
        ErrorDetail::NotApplicable {
            step: 2,
            reason: NotApplicable::Replaced
        }
    ));
    assert_live(&sub, 1, &one);
    assert_eq!(sub.receiver().staged_step(), Some(2));
    sub.apply(&b).unwrap();
    assert_live(&sub, 2, &two);

    // A stage lands in the bank that held step 1: the rollback to it is gone, typed, and the
    // live step stays.
    r.publish(3).await;
    let c = sub.stage(None, false, WAIT).await.unwrap();
    let e = sub.rollback().unwrap_err();
    assert!(matches!(
        detail(&e),
        ErrorDetail::NoRollback {
            live_step: Some(2),
            reason: NoRollback::Overwritten
        }
    ));
    assert_live(&sub, 2, &two);
    sub.apply(&c).unwrap();
    assert_live(&sub, 3, &three);
    // After the apply, the bank of step 2 is the rollback target again.
    sub.rollback().unwrap();
    assert_live(&sub, 2, &two);
}

/// `stage(step=n)` waits for exactly step n: a step the publishers do not reach times out
/// naming each rank that lacks it and the step it has; a step older than the live one is
/// refused unless `allow_older`, and then staged and applied like any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_steps_wait_for_exactly_that_step() {
    let mut r = Rig::new().await;
    let mut sub = r.subscriber("rx").await;
    let (one, two) = (r.expected(&sub, 1), r.expected(&sub, 2));
    r.publish(2).await;
    // Exactly step 2, although the publishers are ready at it and would be found by None too.
    let s = sub.stage(Some(2), false, WAIT).await.unwrap();
    sub.apply(&s).unwrap();
    assert_live(&sub, 2, &two);

    let e = sub
        .stage(Some(3), false, Duration::from_millis(300))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout);
    let msg = e.to_string();
    assert!(
        msg.contains("lacking step 3")
            && msg.contains("rank 0 has step 2")
            && msg.contains("rank 1 has step 2"),
        "{msg}"
    );
    assert_eq!(sub.receiver().staged_step(), None);

    // The publishers go back to step 1 (a restore from an older checkpoint).
    r.publish(1).await;
    let e = sub.stage(Some(1), false, WAIT).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert!(e.to_string().contains("allow_older"), "{e}");
    assert_live(&sub, 2, &two);
    let s = sub.stage(Some(1), true, WAIT).await.unwrap();
    assert_live(&sub, 2, &two);
    sub.apply(&s).unwrap();
    assert_live(&sub, 1, &one);
}
