//! Receiver runtime behaviour over the loopback backend: descriptor-cache invalidation (one test
//! per docs/design.md §5 condition), batched versus per-copy re-slice, and stage accounting.

use std::sync::Arc;

use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
use reshard_core::{DType, Transport};
use reshard_planner::layouts::receiver_layout;
use reshard_planner::plan::PlanOptions;
use reshard_planner::presets::ModelConfig;
use reshard_planner::topology::ReceiverTopology;
use reshard_runtime::{Receiver, ReceiverOptions, StageTimes};
use reshard_testkit::SyntheticCluster;

fn model() -> ModelConfig {
    reshard_testkit::models::tiny_moe(8)
}

struct Setup {
    fabric: LoopbackFabric,
    cluster: SyntheticCluster,
    rx: Receiver,
}

fn endpoint(fabric: &LoopbackFabric, agent: &str) -> Arc<dyn Transport> {
    Arc::new(LoopbackTransport::new(fabric, agent, 2).expect("endpoint"))
}

async fn setup(topo: &str, opts: ReceiverOptions) -> Setup {
    let fabric = LoopbackFabric::new();
    let f = fabric.clone();
    let cluster = SyntheticCluster::new(model(), topo.parse().unwrap(), 1, move |r| {
        Ok(endpoint(&f, &format!("pub-{r}")))
    })
    .await
    .expect("cluster");
    let t = endpoint(&fabric, "rx");
    cluster.connect(t.as_ref()).await.expect("connect");
    let layout = receiver_layout(cluster.model(), &ReceiverTopology::tp(2), 0).unwrap();
    let rx = Receiver::new(t, layout, opts).expect("receiver");
    Setup {
        fabric,
        cluster,
        rx,
    }
}

fn assert_exact(s: &Setup) {
    let want = s.cluster.expected_params(s.rx.layout()).unwrap();
    for (got, want) in s.rx.live_params().unwrap().iter().zip(&want) {
        assert!(got.read()[..] == want[..]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stable_plan_reuses_descriptors() {
    let mut s = setup("ep=4,dp=4", ReceiverOptions::default()).await;
    let first = s.rx.update(&s.cluster.tables()).await.unwrap();
    assert!(first.plan_rebuilt && first.descriptors_rebuilt);
    let builds = s.rx.descriptor_builds();
    for step in 1..4 {
        s.cluster.publish_step(step);
        let r = s.rx.update(&s.cluster.tables()).await.unwrap();
        assert!(!r.plan_rebuilt && !r.descriptors_rebuilt);
        assert_exact(&s);
    }
    assert_eq!(s.rx.descriptor_builds(), builds);
}

/// The buffers of `bank`, by address (a bank's identity).
fn addrs(bank: &[Arc<reshard_core::HostBuffer>]) -> Vec<usize> {
    bank.iter().map(|b| Arc::as_ptr(b) as usize).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_alternate_banks_and_land_where_landing_params_says() {
    let mut s = setup("ep=2,dp=2", ReceiverOptions::default()).await;
    assert!(s.rx.landing_params().is_none(), "nothing prepared yet");
    s.rx.update(&s.cluster.tables()).await.unwrap();
    let first = addrs(s.rx.live_params().unwrap());
    let landing = addrs(s.rx.landing_params().unwrap());
    assert_ne!(
        first, landing,
        "the next update never lands in the live bank"
    );
    s.cluster.publish_step(1);
    s.rx.update(&s.cluster.tables()).await.unwrap();
    assert_eq!(addrs(s.rx.live_params().unwrap()), landing);
    assert_eq!(addrs(s.rx.landing_params().unwrap()), first);
    s.cluster.publish_step(2);
    s.rx.update(&s.cluster.tables()).await.unwrap();
    assert_eq!(addrs(s.rx.live_params().unwrap()), first);
    assert_exact(&s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_rebuild_invalidates_descriptors() {
    let mut s = setup("ep=4,dp=4", ReceiverOptions::default()).await;
    s.rx.update(&s.cluster.tables()).await.unwrap();
    let builds = s.rx.descriptor_builds();
    s.cluster.publish_step(1);
    let mut tables = s.cluster.tables();
    for t in tables.iter_mut().filter(|t| t.publisher.rank == 0) {
        // Rank 0 stops offering the final norm; rank 1's replica becomes the kept offer.
        t.offers.retain(|o| o.tensor != "model.norm.weight");
    }
    let r = s.rx.update(&tables).await.unwrap();
    assert!(r.plan_rebuilt, "geometry changed");
    assert!(r.descriptors_rebuilt);
    assert!(s.rx.descriptor_builds() > builds);
    assert_eq!(s.rx.plan_builds(), 2);
    assert_exact(&s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arm_change_invalidates_plan_and_descriptors() {
    let mut s = setup("ep=4,dp=4", ReceiverOptions::default()).await;
    s.rx.update(&s.cluster.tables()).await.unwrap();
    // A knob that is not part of the arm keeps everything cached.
    s.rx.set_options(ReceiverOptions {
        batched_reslice: false,
        ..ReceiverOptions::default()
    });
    let r = s.rx.update(&s.cluster.tables()).await.unwrap();
    assert!(!r.plan_rebuilt && !r.descriptors_rebuilt);
    // The no-dedup arm is a different plan.
    s.rx.set_options(ReceiverOptions {
        dedup: false,
        ..ReceiverOptions::default()
    });
    s.cluster.publish_step(2);
    let r = s.rx.update(&s.cluster.tables()).await.unwrap();
    assert!(r.plan_rebuilt && r.descriptors_rebuilt);
    assert!(r.plan.reads > 0);
    assert_exact(&s);
    // Spreading owners is another arm.
    s.rx.set_options(ReceiverOptions {
        spread_owners: true,
        ..ReceiverOptions::default()
    });
    let r = s.rx.update(&s.cluster.tables()).await.unwrap();
    assert!(r.plan_rebuilt && r.descriptors_rebuilt);
    assert_exact(&s);
    // So are the gather options (issue 42: a change of either once kept the old plan).
    let defaults = ReceiverOptions::default();
    for plan in [
        PlanOptions {
            gather_reads: !defaults.plan.gather_reads,
            ..defaults.plan
        },
        PlanOptions {
            gather_min_row_bytes: defaults.plan.gather_min_row_bytes + 1,
            ..defaults.plan
        },
    ] {
        s.rx.set_options(ReceiverOptions {
            plan,
            ..ReceiverOptions::default()
        });
        let r = s.rx.update(&s.cluster.tables()).await.unwrap();
        assert!(r.plan_rebuilt && r.descriptors_rebuilt, "{plan:?}");
        assert_exact(&s);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_change_invalidates_descriptors() {
    let mut s = setup("ep=4,dp=4", ReceiverOptions::default()).await;
    s.rx.update(&s.cluster.tables()).await.unwrap();
    let t = endpoint(&s.fabric, "rx-2");
    s.cluster.connect(t.as_ref()).await.unwrap();
    s.rx.set_transport(t);
    let r = s.rx.update(&s.cluster.tables()).await.unwrap();
    assert!(r.descriptors_rebuilt);
    assert_exact(&s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_change_invalidates_descriptors_but_not_the_plan() {
    let mut s = setup("ep=4,dp=4", ReceiverOptions::default()).await;
    s.rx.update(&s.cluster.tables()).await.unwrap();
    let builds = s.rx.descriptor_builds();
    // Publishers re-announce their registrations (e.g. after re-registering memory).
    s.cluster.connect(s.rx.transport().as_ref()).await.unwrap();
    let r = s.rx.update(&s.cluster.tables()).await.unwrap();
    assert!(!r.plan_rebuilt);
    assert!(r.descriptors_rebuilt);
    assert!(s.rx.descriptor_builds() > builds);
    assert_exact(&s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncached_arm_rebuilds_every_update_and_is_still_exact() {
    let opts = ReceiverOptions {
        cache_descriptors: false,
        batched_reslice: false,
        ..ReceiverOptions::default()
    };
    let mut s = setup("ep=4,dp=4", opts).await;
    for step in 0..3 {
        s.cluster.publish_step(step);
        let r = s.rx.update(&s.cluster.tables()).await.unwrap();
        assert!(r.descriptors_rebuilt);
        assert_exact(&s);
    }
    assert_eq!(s.rx.descriptor_builds(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stages_are_attributed_and_named() {
    let mut s = setup("ep=2,dp=2", ReceiverOptions::default()).await;
    let r = s.rx.update(&s.cluster.tables()).await.unwrap();
    assert_eq!(StageTimes::NAMES.len(), r.stages.values().len());
    assert!(r.stages.sum() <= r.e2e_s * 1.0001);
    assert!(
        r.attribution > 0.5 && r.attribution <= 1.0001,
        "{}",
        r.attribution
    );
    assert!(r.stages.wire > 0.0);
    assert_eq!(r.wire_bytes, r.plan.wire_bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishers_at_different_steps_are_rejected() {
    let mut s = setup("ep=2,dp=2", ReceiverOptions::default()).await;
    let mut tables = s.cluster.tables();
    tables[1].step = 99;
    let e = s.rx.update(&tables).await.unwrap_err();
    assert_eq!(e.kind(), reshard_core::ErrorKind::InvalidInput);
    assert_eq!(e.context().owner, Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_builds_everything_without_moving_bytes() {
    let mut s = setup("ep=4,dp=4", ReceiverOptions::default()).await;
    let st = s.rx.prepare(&s.cluster.tables()).await.unwrap();
    assert_eq!(st.wire, 0.0);
    assert!(s.rx.live_params().is_none(), "nothing installed yet");
    assert_eq!(s.rx.plan_builds(), 1);
    assert_eq!(s.rx.descriptor_builds(), 2, "both banks");
    let r = s.rx.update(&s.cluster.tables()).await.unwrap();
    assert!(!r.plan_rebuilt && !r.descriptors_rebuilt);
    assert_exact(&s);
}

/// Two full-pulled copies write the same parameter bytes: re-slices run in plan order and the
/// last writer wins, as specified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_reslices_run_in_plan_order() {
    use reshard_core::{
        HostBuffer, MemoryBlock, MemoryKind, OfferLocation, ParamSpec, ShardOffer, ShardTable,
        TensorBox, TensorSpec, WantedCopy, WantedLayout,
    };
    use reshard_planner::plan::PlanOptions;

    let fabric = LoopbackFabric::new();
    let publisher = endpoint(&fabric, "pub");
    // Tensors a and b, [4, 8] u8, held back to back in one buffer.
    let data: Vec<u8> = (0..64u8).map(|i| i + 1).collect();
    let buf = Arc::new(HostBuffer::from_bytes(&data));
    let reg = publisher
        .register(buf.clone() as Arc<dyn MemoryBlock>)
        .await
        .unwrap();
    let mut table = ShardTable::new(0, "pub", 1).bound_to(publisher.incarnation());
    for (i, name) in ["a", "b"].into_iter().enumerate() {
        table
            .tensors
            .push(TensorSpec::new(name, DType::U8, vec![4, 8]));
        table.offers.push(ShardOffer {
            tensor: name.into(),
            tensor_box: TensorBox::new(vec![0, 0], vec![4, 8]),
            location: OfferLocation {
                region: reg.id(),
                offset: 32 * i as u64,
                memory: MemoryKind::Dram,
            },
            digest: None,
            parts: None,
        });
    }
    // Both copies land on the whole [4, 4] parameter: a's left half, then b's right half.
    let copy = |tensor: &str, col: u64| WantedCopy {
        tensor: tensor.into(),
        src_box: TensorBox::new(vec![0, col], vec![4, 4]),
        dst_offset: 0,
        dst_strides: vec![4, 1],
    };
    let layout = WantedLayout {
        receiver_rank: 0,
        params: vec![ParamSpec {
            name: "p".into(),
            dtype: DType::U8,
            shape: vec![4, 4],
            copies: vec![copy("a", 0), copy("b", 4)],
        }],
    };
    let rx_t = endpoint(&fabric, "rx");
    rx_t.load_peer(0, publisher.export_metadata().await.unwrap())
        .await
        .unwrap();
    let opts = ReceiverOptions {
        // One run per row is already "too many": both copies become full pulls (a gather
        // would read each copy's columns as one read and need no re-slice).
        plan: PlanOptions {
            full_pull_threshold: 1,
            gather_reads: false,
            ..PlanOptions::default()
        },
        ..ReceiverOptions::default()
    };
    let mut rx = Receiver::new(rx_t, layout, opts).unwrap();
    let r = rx.update(std::slice::from_ref(&table)).await.unwrap();
    assert_eq!(r.plan.full_pull_sources, 2);
    // Each re-slice writes a [4, 4] box of u8: both count, though they land on the same bytes.
    assert_eq!(r.resliced_bytes, 2 * 16);
    assert!(!rx.plan().unwrap().reslice_disjoint);
    let want: Vec<u8> = (0..4u8)
        .flat_map(|row| (4..8u8).map(move |c| 32 + row * 8 + c + 1))
        .collect();
    assert_eq!(
        rx.live_params().unwrap()[0].read()[..],
        want[..],
        "b wrote last"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn divergence_is_caught_on_the_cached_fast_path_too() {
    let mut s = setup("ep=4,dp=4", ReceiverOptions::default()).await;
    s.rx.update(&s.cluster.tables()).await.unwrap();
    s.cluster.publish_step(1);
    // Same geometry: the receiver skips merge and dedup, and must still compare replicas.
    let mut tables = s.cluster.tables();
    let o = tables[2]
        .offers
        .iter_mut()
        .find(|o| o.tensor == "model.layers.1.input_layernorm.weight")
        .unwrap();
    o.digest = Some(reshard_core::Digest::of(b"a different stage"));
    let e = s.rx.update(&tables).await.unwrap_err();
    assert_eq!(e.kind(), reshard_core::ErrorKind::ReplicaDivergence, "{e}");
    assert_eq!(
        e.context().tensor.as_deref(),
        Some("model.layers.1.input_layernorm.weight")
    );
    assert_eq!(s.rx.live_step(), Some(0));
    // And with honest digests the same step installs.
    let r = s.rx.update(&s.cluster.tables()).await.unwrap();
    assert!(!r.plan_rebuilt);
    assert_exact(&s);
}

/// The coverage gate: a plan that writes too little of the parameters is refused when the gate
/// is on, and allowed when it is off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coverage_floor_refuses_plans_that_write_too_little() {
    use reshard_core::{
        HostBuffer, MemoryBlock, MemoryKind, OfferLocation, ParamSpec, ShardOffer, ShardTable,
        TensorBox, TensorSpec, WantedCopy, WantedLayout,
    };
    let fabric = LoopbackFabric::new();
    let publisher = endpoint(&fabric, "pub");
    let buf = Arc::new(HostBuffer::from_bytes(&[7u8; 16]));
    let reg = publisher
        .register(buf.clone() as Arc<dyn MemoryBlock>)
        .await
        .unwrap();
    let mut table = ShardTable::new(0, "pub", 1).bound_to(publisher.incarnation());
    table
        .tensors
        .push(TensorSpec::new("a", DType::U8, vec![16]));
    table.offers.push(ShardOffer {
        tensor: "a".into(),
        tensor_box: TensorBox::new(vec![0], vec![16]),
        location: OfferLocation {
            region: reg.id(),
            offset: 0,
            memory: MemoryKind::Dram,
        },
        digest: None,
        parts: None,
    });
    // The engine's parameter has 32 bytes; publishers fill 16 of them.
    let layout = WantedLayout {
        receiver_rank: 0,
        params: vec![ParamSpec {
            name: "p".into(),
            dtype: DType::U8,
            shape: vec![32],
            copies: vec![WantedCopy {
                tensor: "a".into(),
                src_box: TensorBox::new(vec![0], vec![16]),
                dst_offset: 0,
                dst_strides: vec![1],
            }],
        }],
    };
    let t = endpoint(&fabric, "rx");
    t.load_peer(0, publisher.export_metadata().await.unwrap())
        .await
        .unwrap();
    let gated = ReceiverOptions {
        min_coverage: Some(0.9),
        ..ReceiverOptions::default()
    };
    let mut rx = Receiver::new(t.clone(), layout.clone(), gated).unwrap();
    let e = rx.update(std::slice::from_ref(&table)).await.unwrap_err();
    assert_eq!(e.kind(), reshard_core::ErrorKind::Guard, "{e}");
    assert!(rx.live_params().is_none());
    let mut rx = Receiver::new(t, layout, ReceiverOptions::default()).unwrap();
    let r = rx.update(std::slice::from_ref(&table)).await.unwrap();
    assert_eq!((r.plan.written_bytes, r.plan.param_bytes), (16, 32));
}

/// Fails the first `fail` posts with a typed error (retryable or not), then delegates; or
/// delays every wait by `delay`.
#[derive(Debug)]
struct Flaky {
    inner: Arc<dyn Transport>,
    fail: std::sync::atomic::AtomicU32,
    retryable: bool,
    /// The injected failure says bytes may still land (quarantined).
    quarantined: bool,
    delay: std::time::Duration,
    short: bool,
    posts: std::sync::atomic::AtomicU32,
}

struct Delayed {
    inner: Box<dyn reshard_core::InFlight>,
    delay: std::time::Duration,
    short: bool,
}

#[async_trait::async_trait]
impl reshard_core::InFlight for Delayed {
    async fn wait(self: Box<Self>) -> reshard_core::Result<reshard_core::WireReport> {
        tokio::time::sleep(self.delay).await;
        let mut r = self.inner.wait().await?;
        if self.short {
            r.bytes -= 1;
        }
        Ok(r)
    }
    async fn abort(self: Box<Self>) {
        self.inner.abort().await
    }
}

reshard_core::forward_transport!(Flaky => inner {
    async fn post(
        &self,
        batch: &reshard_core::PreparedBatch,
    ) -> reshard_core::Result<Box<dyn reshard_core::InFlight>> {
        use std::sync::atomic::Ordering;
        self.posts.fetch_add(1, Ordering::SeqCst);
        let left = self.fail.load(Ordering::SeqCst);
        if left > 0 {
            self.fail.store(left - 1, Ordering::SeqCst);
            let e = reshard_core::Error::new(
                reshard_core::ErrorKind::Transport,
                "injected: link flapped",
            )
            .with_owner(1)
            .set_retryable(self.retryable);
            return Err(if self.quarantined {
                e.set_quarantined()
            } else {
                e
            });
        }
        let inner = self.inner.post(batch).await?;
        Ok(Box::new(Delayed {
            inner,
            delay: self.delay,
            short: self.short,
        }))
    }
});

async fn flaky_setup(
    fail: u32,
    retryable: bool,
    delay_ms: u64,
    opts: ReceiverOptions,
) -> (Setup, Arc<Flaky>) {
    flaky_setup_short(fail, retryable, delay_ms, false, opts).await
}

async fn flaky_setup_short(
    fail: u32,
    retryable: bool,
    delay_ms: u64,
    short: bool,
    opts: ReceiverOptions,
) -> (Setup, Arc<Flaky>) {
    let mut s = setup("ep=4,dp=4", ReceiverOptions::default()).await;
    s.rx.update(&s.cluster.tables()).await.unwrap();
    let flaky = Arc::new(Flaky {
        inner: endpoint(&s.fabric, "rx-flaky"),
        fail: fail.into(),
        retryable,
        quarantined: false,
        delay: std::time::Duration::from_millis(delay_ms),
        short,
        posts: 0.into(),
    });
    s.cluster.connect(flaky.as_ref()).await.unwrap();
    s.rx.set_transport(flaky.clone());
    s.rx.set_options(opts);
    s.cluster.publish_step(1);
    (s, flaky)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retryable_wire_failures_are_retried_within_the_budget() {
    use std::sync::atomic::Ordering;
    let opts = ReceiverOptions {
        retries: 2,
        retry_backoff: std::time::Duration::from_millis(1),
        ..ReceiverOptions::default()
    };
    // Two flaps, two retries: the update lands, byte-exact, after three posts.
    let (mut s, flaky) = flaky_setup(2, true, 0, opts.clone()).await;
    s.rx.update(&s.cluster.tables()).await.expect("retried");
    assert_eq!(flaky.posts.load(Ordering::SeqCst), 3);
    assert_eq!(s.rx.live_step(), Some(1));
    assert_exact(&s);
    // Three flaps exhaust two retries: typed error, live weights stay at step 0.
    let (mut s, flaky) = flaky_setup(3, true, 0, opts.clone()).await;
    let e = s.rx.update(&s.cluster.tables()).await.unwrap_err();
    assert_eq!(e.kind(), reshard_core::ErrorKind::Transport, "{e}");
    assert_eq!(e.context().owner, Some(1));
    assert_eq!(flaky.posts.load(Ordering::SeqCst), 3);
    assert_eq!(s.rx.live_step(), Some(0));
    // A failure that is not retryable is never retried.
    let (mut s, flaky) = flaky_setup(1, false, 0, opts).await;
    s.rx.update(&s.cluster.tables()).await.unwrap_err();
    assert_eq!(flaky.posts.load(Ordering::SeqCst), 1);
    assert_eq!(s.rx.live_step(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quarantined_wire_failures_are_not_retried_and_retire_the_buffers() {
    use std::sync::atomic::Ordering;
    let opts = ReceiverOptions {
        retries: 3,
        retry_backoff: std::time::Duration::from_millis(1),
        ..ReceiverOptions::default()
    };
    // A retryable failure keeps the buffers: the next update reuses plan and descriptors.
    let (mut s, flaky) = flaky_setup(1, true, 0, ReceiverOptions::default()).await;
    s.rx.update(&s.cluster.tables()).await.unwrap_err();
    let r = s.rx.update(&s.cluster.tables()).await.expect("next update");
    assert!(!r.plan_rebuilt && !r.descriptors_rebuilt);
    assert_eq!(flaky.posts.load(Ordering::SeqCst), 2);
    assert_exact(&s);
    // A quarantined failure (bytes may still land) is never retried, leaves the live weights
    // untouched, and the next update lands in freshly allocated buffers.
    let (mut s, flaky) = flaky_setup(0, true, 0, opts).await;
    let quarantined = Arc::new(Flaky {
        inner: Arc::clone(&flaky.inner),
        fail: 1.into(),
        retryable: true,
        quarantined: true,
        delay: std::time::Duration::ZERO,
        short: false,
        posts: 0.into(),
    });
    s.rx.set_transport(quarantined.clone());
    let e = s.rx.update(&s.cluster.tables()).await.unwrap_err();
    assert!(e.is_quarantined() && !e.is_retryable(), "{e}");
    assert_eq!(quarantined.posts.load(Ordering::SeqCst), 1, "not retried");
    assert_eq!(s.rx.live_step(), Some(0));
    let r = s.rx.update(&s.cluster.tables()).await.expect("next update");
    assert!(r.plan_rebuilt && r.descriptors_rebuilt, "fresh buffers");
    assert_eq!(s.rx.live_step(), Some(1));
    assert_exact(&s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wire_leg_past_its_timeout_fails_typed_and_installs_nothing() {
    let opts = ReceiverOptions {
        wire_timeout: Some(std::time::Duration::from_millis(30)),
        ..ReceiverOptions::default()
    };
    let (mut s, _) = flaky_setup(0, true, 2_000, opts).await;
    let t = std::time::Instant::now();
    let e = s.rx.update(&s.cluster.tables()).await.unwrap_err();
    assert_eq!(e.kind(), reshard_core::ErrorKind::Timeout, "{e}");
    assert!(t.elapsed() < std::time::Duration::from_secs(1), "bounded");
    assert_eq!(s.rx.live_step(), Some(0));
    // Without the delay the next update installs byte-exact.
    s.rx.set_options(ReceiverOptions::default());
    s.rx.set_transport(endpoint(&s.fabric, "rx-plain"));
    s.cluster.connect(s.rx.transport().as_ref()).await.unwrap();
    s.rx.update(&s.cluster.tables())
        .await
        .expect("clean update");
    assert_exact(&s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wire_leg_cut_short_by_the_timeout_retires_the_buffers() {
    let opts = ReceiverOptions {
        wire_timeout: Some(std::time::Duration::from_millis(30)),
        ..ReceiverOptions::default()
    };
    let (mut s, _) = flaky_setup(0, true, 300, opts).await;
    let e = s.rx.update(&s.cluster.tables()).await.unwrap_err();
    assert_eq!(e.kind(), reshard_core::ErrorKind::Timeout, "{e}");
    assert!(e.is_retryable(), "{e}");
    assert!(
        matches!(
            e.detail(),
            Some(reshard_core::ErrorDetail::WireLegTimedOut { limit_ms: 30 })
        ),
        "{e}"
    );
    // The wait was cut short: the next update (no bound now, same slow transport) lands in
    // freshly allocated buffers, never in the ones the cut-short batch targeted.
    s.rx.set_options(ReceiverOptions::default());
    let r = s.rx.update(&s.cluster.tables()).await.expect("next update");
    assert!(r.plan_rebuilt && r.descriptors_rebuilt, "fresh buffers");
    assert_exact(&s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_dropped_in_its_wire_leg_retires_the_buffers() {
    use std::sync::atomic::Ordering;
    // A slow wire leg, dropped once its batch is posted (as Ctrl-C or a cancelled task drops a
    // refit): a read the backend could not end would be quarantined with no error to say so,
    // so the next update must land in freshly allocated buffers.
    let (mut s, flaky) = flaky_setup(0, true, 2_000, ReceiverOptions::default()).await;
    let tables = s.cluster.tables();
    {
        let mut update = Box::pin(s.rx.update(&tables));
        while flaky.posts.load(Ordering::SeqCst) == 0 {
            tokio::select! {
                r = &mut update => panic!("the update ended before it was dropped: {r:?}"),
                _ = tokio::time::sleep(std::time::Duration::from_millis(1)) => {}
            }
        }
    }
    assert_eq!(s.rx.live_step(), Some(0));
    assert!(
        s.rx.landing_params().is_none(),
        "no landing bank until fresh ones exist"
    );
    let r = s.rx.update(&tables).await.expect("next update");
    assert!(r.plan_rebuilt && r.descriptors_rebuilt, "fresh buffers");
    assert_eq!(s.rx.live_step(), Some(1));
    assert_exact(&s);
    // A wire leg that returned leaves its buffers in use.
    s.cluster.publish_step(2);
    let r = s.rx.update(&s.cluster.tables()).await.expect("step 2");
    assert!(!r.plan_rebuilt, "the buffers prepared for step 1's update");
    assert_exact(&s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transport_reporting_fewer_bytes_than_planned_installs_nothing() {
    // Even with digest verification off, a short byte count is refused before the swap.
    let opts = ReceiverOptions {
        verify_digests: false,
        ..ReceiverOptions::default()
    };
    let (mut s, _) = flaky_setup_short(0, true, 0, true, opts).await;
    let e = s.rx.update(&s.cluster.tables()).await.unwrap_err();
    assert_eq!(e.kind(), reshard_core::ErrorKind::Transport, "{e}");
    assert_eq!(e.context().backend.as_deref(), Some("loopback"));
    assert_eq!(s.rx.live_step(), Some(0));
}

/// Loopback advertising at most `max` reads per post, refusing longer batches in `prepare` (as
/// a backend with such a limit would) and counting its posts.
#[derive(Debug)]
struct AtMost {
    inner: Arc<dyn Transport>,
    max: usize,
    posts: std::sync::atomic::AtomicUsize,
}

reshard_core::forward_transport!(AtMost => inner {
    fn capabilities(&self) -> reshard_core::Capability {
        reshard_core::Capability {
            max_reads_per_post: Some(self.max),
            ..self.inner.capabilities()
        }
    }

    async fn prepare(
        &self,
        batch: reshard_core::ReadBatch,
    ) -> reshard_core::Result<reshard_core::PreparedBatch> {
        if batch.reads.len() > self.max {
            return Err(reshard_core::Error::new(
                reshard_core::ErrorKind::Unsupported,
                format!("{} reads in one post, at most {}", batch.reads.len(), self.max),
            ));
        }
        self.inner.prepare(batch).await
    }

    async fn post(
        &self,
        batch: &reshard_core::PreparedBatch,
    ) -> reshard_core::Result<Box<dyn reshard_core::InFlight>> {
        self.posts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.post(batch).await
    }
});

/// `Capability::max_reads_per_post` is consulted: a transport that takes at most 7 reads per
/// post still refits byte-exact, every update in posts of at most 7 reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transport_limiting_reads_per_post_gets_batches_within_its_limit() {
    use std::sync::atomic::Ordering;
    let mut s = setup("ep=4,dp=4", ReceiverOptions::default()).await;
    let at_most = Arc::new(AtMost {
        inner: endpoint(&s.fabric, "rx-at-most"),
        max: 7,
        posts: 0.into(),
    });
    s.cluster.connect(at_most.as_ref()).await.unwrap();
    s.rx.set_transport(at_most.clone());
    let r =
        s.rx.update(&s.cluster.tables())
            .await
            .expect("refit in parts");
    assert!(
        r.wire_reads > 7,
        "the plan needs more than one post: {}",
        r.wire_reads
    );
    let posts = at_most.posts.load(Ordering::SeqCst);
    assert_eq!(
        posts as u64,
        r.wire_reads.div_ceil(7),
        "parts of at most 7 reads"
    );
    assert_exact(&s);
    s.cluster.publish_step(1);
    s.rx.update(&s.cluster.tables()).await.expect("next step");
    assert_eq!(s.rx.live_step(), Some(1));
    assert_exact(&s);
}

/// Tables of the cluster's current step in another geometry: rank 0 stops offering the final
/// norm, so rank 1's replica becomes the kept offer and the plan is rebuilt.
fn other_geometry(s: &Setup) -> Vec<reshard_core::ShardTable> {
    let mut tables = s.cluster.tables();
    for t in tables.iter_mut().filter(|t| t.publisher.rank == 0) {
        t.offers.retain(|o| o.tensor != "model.norm.weight");
    }
    tables
}

fn bytes_of(bank: &[Arc<reshard_core::HostBuffer>]) -> Vec<Vec<u8>> {
    bank.iter().map(|b| b.read().to_vec()).collect()
}

/// Issue 42: a new plan (a new geometry, or a new arm) keeps the receiver's banks, and with
/// them the step staged in one and the rollback target: both were discarded before the new
/// buffers were allocated, so a failure there (or a mere `prepare`) lost them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_plan_keeps_the_banks_the_staged_step_and_the_rollback_target() {
    let mut s = setup("ep=4,dp=4", ReceiverOptions::default()).await;
    s.rx.update(&s.cluster.tables()).await.unwrap();
    let step0 = bytes_of(s.rx.live_params().unwrap());
    s.cluster.publish_step(1);
    s.rx.update(&s.cluster.tables()).await.unwrap();
    let banks = (
        addrs(s.rx.live_params().unwrap()),
        addrs(s.rx.landing_params().unwrap()),
    );
    let builds = s.rx.plan_builds();

    // Live step 1, rollback target step 0; a new geometry is planned and prepared.
    s.rx.prepare(&other_geometry(&s)).await.unwrap();
    assert_eq!(s.rx.plan_builds(), builds + 1, "the geometry changed");
    assert_eq!(
        s.rx.rollback_step(),
        Ok(0),
        "the new plan dropped the rollback target"
    );
    assert_eq!(addrs(s.rx.live_params().unwrap()), banks.0);
    assert_eq!(addrs(s.rx.landing_params().unwrap()), banks.1);
    let back = s.rx.rollback().unwrap();
    assert_eq!((back.step, back.rolled_back_from), (0, 1));
    assert!(bytes_of(s.rx.live_params().unwrap()) == step0);

    // A step staged, then a new geometry and a new arm planned: the staged step still applies.
    s.cluster.publish_step(2);
    let staged = s.rx.stage(&s.cluster.tables(), false).await.unwrap();
    s.rx.prepare(&s.cluster.tables()).await.unwrap();
    s.rx.set_options(ReceiverOptions {
        spread_owners: true,
        ..ReceiverOptions::default()
    });
    s.rx.prepare(&other_geometry(&s)).await.unwrap();
    assert_eq!(s.rx.plan_builds(), builds + 3);
    assert_eq!(s.rx.staged_step(), Some(2));
    s.rx.apply(&staged).unwrap();
    assert_exact(&s);
    assert_eq!(s.rx.rollback_step(), Ok(0));

    // And an update in the new geometry lands exactly, in the same two banks.
    s.cluster.publish_step(3);
    let r = s.rx.update(&other_geometry(&s)).await.unwrap();
    assert!(!r.plan_rebuilt, "prepared already");
    assert_exact(&s);
    let mut now = vec![
        addrs(s.rx.live_params().unwrap()),
        addrs(s.rx.landing_params().unwrap()),
    ];
    now.sort();
    let mut then = vec![banks.0, banks.1];
    then.sort();
    assert_eq!(now, then, "a new plan allocated new banks");
}
