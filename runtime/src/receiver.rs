//! The receiver runtime: prepare once, then refit every step (docs/design.md §5–§7).
//!
//! Parameters are double-buffered: every update lands in the bank that is not live, is
//! re-sliced and verified there, and only a fully successful update swaps it in. A failed update
//! therefore never touches the live weights.

use rayon::prelude::*;
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reshard_core::config::Config;
use reshard_core::{
    dedup, keep_all, merge, table_geometry_key, ChunkDigests, DedupOptions, DedupReport, Dest,
    Digest, Error, ErrorDetail, ErrorKind, HostBuffer, MemoryBlock, MergedTable, OwnerId, Plan,
    PlanStats, PreparedBatch, ReadBatch, ReadDesc, Registration, ReplicaGroups, Result, ShardTable,
    Transport, WantedLayout, WireReport,
};
use reshard_planner::plan::{plan, PlanOptions};

use crate::copy;
use crate::layers::{self, Layer, RetryLayer, TimeoutLayer};

/// How a receiver plans, verifies and installs.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceiverOptions {
    /// Replica dedup (off only for the benchmark counterfactual).
    pub dedup: bool,
    /// Spread owners across replicas by receiver rank.
    pub spread_owners: bool,
    /// Planner options (full-pull threshold; overlap is allowed automatically without dedup).
    pub plan: PlanOptions,
    /// Check installed bytes against publisher digests.
    pub verify_digests: bool,
    /// Fabric ceiling in Gbit/s; a faster wire leg fails the update before install.
    pub max_wire_gbps: Option<f64>,
    /// Minimum fraction of parameter bytes the plan must write.
    pub min_coverage: Option<f64>,
    /// Re-slice full pulls in one parallel pass (false: one copy at a time, the baseline).
    pub batched_reslice: bool,
    /// Reuse descriptors across updates (false: rebuild every update, the baseline).
    pub cache_descriptors: bool,
    /// Times a wire leg failing with a retryable error is posted again (reads only write the
    /// bank that is not live, so repeating them is safe).
    /// (the receiver's [`RetryLayer`]).
    pub retries: u32,
    /// Backoff before the first retry, doubled for each further one.
    pub retry_backoff: Duration,
    /// Bound on one wire leg with its retries; past it the leg fails with `Timeout` and
    /// [`ErrorDetail::WireLegTimedOut`] (the receiver's [`TimeoutLayer`], outside the retry).
    pub wire_timeout: Option<Duration>,
}

impl Default for ReceiverOptions {
    fn default() -> Self {
        ReceiverOptions {
            dedup: true,
            spread_owners: false,
            plan: PlanOptions::default(),
            verify_digests: true,
            max_wire_gbps: None,
            min_coverage: None,
            batched_reslice: true,
            cache_descriptors: true,
            retries: 0,
            retry_backoff: Duration::from_millis(20),
            wire_timeout: None,
        }
    }
}

impl ReceiverOptions {
    /// Options from the `[planner]` and `[receiver]` config sections.
    pub fn from_config(cfg: &Config) -> Self {
        ReceiverOptions {
            dedup: cfg.planner.dedup,
            spread_owners: cfg.planner.spread_owners,
            plan: PlanOptions {
                full_pull_threshold: cfg.planner.full_pull_threshold,
                ..PlanOptions::default()
            },
            verify_digests: cfg.receiver.verify_digests,
            max_wire_gbps: cfg.receiver.max_wire_gbps,
            min_coverage: cfg.receiver.min_coverage,
            retries: cfg.receiver.retries,
            retry_backoff: Duration::from_millis(cfg.receiver.retry_backoff_ms),
            wire_timeout: cfg.receiver.wire_timeout_ms.map(Duration::from_millis),
            ..ReceiverOptions::default()
        }
    }

    fn plan_options(&self) -> PlanOptions {
        PlanOptions {
            allow_overlap: !self.dedup,
            ..self.plan
        }
    }

    /// The wire-leg policies as transport layers, outermost first: `Timeout(Retry(t))`.
    ///
    /// The retry layer is always there (with 0 retries it only passes through), so batches
    /// prepared under one policy stay valid under another and a policy change keeps the
    /// cached descriptors; the timeout layer forwards `prepare` and is there only when set.
    fn wire_stack(&self, transport: Arc<dyn Transport>) -> Arc<dyn Transport> {
        let retry = RetryLayer {
            retries: self.retries,
            backoff: self.retry_backoff,
        };
        match self.wire_timeout {
            Some(limit) => layers::stack(transport, &[&TimeoutLayer { limit }, &retry]),
            None => retry.layer(transport),
        }
    }

    /// Options that change the plan or its descriptors (the "arm").
    fn arm(&self) -> Arm {
        Arm {
            dedup: self.dedup,
            spread_owners: self.spread_owners,
            full_pull_threshold: self.plan.full_pull_threshold,
        }
    }
}

/// The receiver options a cached plan, its buffers and its descriptors were made under (the
/// "arm" of a benchmark); any other option can change without rebuilding them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Arm {
    /// [`ReceiverOptions::dedup`]: one replica per byte, or every replica (overlapping reads).
    dedup: bool,
    /// [`ReceiverOptions::spread_owners`]: which replica each byte is read from.
    spread_owners: bool,
    /// [`PlanOptions::full_pull_threshold`]: where strided reads become full pulls.
    full_pull_threshold: u64,
}

/// Seconds spent in each stage of one update (docs/design.md §7).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StageTimes {
    /// Gathering and decoding publishers' tables.
    pub discover: f64,
    /// Merging tables.
    pub merge: f64,
    /// Replica dedup.
    pub dedup: f64,
    /// Planning (near zero when the cached plan holds).
    pub plan: f64,
    /// Allocating and registering buffers (near zero when cached), and the coverage gate.
    pub register: f64,
    /// Building transport descriptors (near zero when cached; always timed).
    pub descriptor_build: f64,
    /// The wire leg: post all owners, await all, ceiling guard.
    pub wire: f64,
    /// Re-slicing full pulls into parameters.
    pub reslice: f64,
    /// Swapping the new weights in.
    pub install: f64,
    /// Digest verification (the coverage gate runs in `register`).
    pub verify: f64,
}

impl StageTimes {
    /// Stage names in pipeline order.
    pub const NAMES: [&'static str; 10] = [
        "discover",
        "merge",
        "dedup",
        "plan",
        "register",
        "descriptor_build",
        "wire",
        "reslice",
        "install",
        "verify",
    ];

    /// Stage values in [`StageTimes::NAMES`] order.
    pub fn values(&self) -> [f64; 10] {
        [
            self.discover,
            self.merge,
            self.dedup,
            self.plan,
            self.register,
            self.descriptor_build,
            self.wire,
            self.reslice,
            self.install,
            self.verify,
        ]
    }

    /// Builds from values in [`StageTimes::NAMES`] order.
    pub fn from_values(v: [f64; 10]) -> Self {
        StageTimes {
            discover: v[0],
            merge: v[1],
            dedup: v[2],
            plan: v[3],
            register: v[4],
            descriptor_build: v[5],
            wire: v[6],
            reslice: v[7],
            install: v[8],
            verify: v[9],
        }
    }

    /// Sum of all stages.
    pub fn sum(&self) -> f64 {
        self.values().iter().sum()
    }
}

/// What one update did and how long each part took.
#[derive(Debug, Clone, Serialize)]
pub struct UpdateReport {
    /// Receiver rank.
    pub receiver_rank: u32,
    /// Training step installed.
    pub step: u64,
    /// Stage times.
    pub stages: StageTimes,
    /// End-to-end seconds of the update.
    pub e2e_s: f64,
    /// Sum of stages over end-to-end; below 0.95 the breakdown is not reportable.
    pub attribution: f64,
    /// The plan was (re)built in this update.
    pub plan_rebuilt: bool,
    /// Descriptors were (re)built in this update.
    pub descriptors_rebuilt: bool,
    /// Plan statistics.
    pub plan: PlanStats,
    /// Plan fingerprint.
    pub fingerprint: u64,
    /// Dedup report of this update's tables.
    pub dedup: DedupReport,
    /// Reads posted on the wire (after coalescing).
    pub wire_reads: u64,
    /// Bytes moved on the wire.
    pub wire_bytes: u64,
    /// Effective wire rate in GB/s (10^9 bytes per second).
    pub wire_gbytes_per_s: f64,
    /// Digest checks that passed.
    pub checks_passed: u64,
    /// Bytes verified against publisher digests.
    pub checked_bytes: u64,
    /// Checks skipped because the publisher sent no digest.
    pub checks_without_digest: u64,
    /// Bytes the re-slice stage wrote into parameters (the re-slice rate's numerator).
    pub resliced_bytes: u64,
}

struct Bank {
    params: Vec<Arc<HostBuffer>>,
    regs: Vec<Registration>,
}

struct Cached {
    batch: PreparedBatch,
    epoch: u64,
}

struct Prepared {
    geometry: u64,
    arm: Arm,
    plan: Arc<Plan>,
    banks: [Bank; 2],
    staging: Vec<Arc<HostBuffer>>,
    _staging_regs: Vec<Registration>,
    staging_ids: Vec<u64>,
    descriptors: [Option<Cached>; 2],
    /// Bank that receives the next update.
    next: usize,
}

/// One receiver rank: its transport endpoint, wanted layout, cached plan and live weights.
pub struct Receiver {
    transport: Arc<dyn Transport>,
    /// `transport` wrapped in the wire-leg policies of `opts` ([`ReceiverOptions::wire_stack`]):
    /// every registration, descriptor build and post goes through it.
    stack: Arc<dyn Transport>,
    layout: WantedLayout,
    opts: ReceiverOptions,
    prepared: Option<Prepared>,
    tables_cache: Option<TablesCache>,
    live: Option<Vec<Arc<HostBuffer>>>,
    step: Option<u64>,
    plan_builds: u64,
    descriptor_builds: u64,
}

impl Receiver {
    /// A receiver for `layout` reading through `transport` (peers must be loaded into it).
    pub fn new(
        transport: Arc<dyn Transport>,
        layout: WantedLayout,
        opts: ReceiverOptions,
    ) -> Result<Self> {
        layout.validate()?;
        Ok(Receiver {
            stack: opts.wire_stack(transport.clone()),
            transport,
            layout,
            opts,
            prepared: None,
            tables_cache: None,
            live: None,
            step: None,
            plan_builds: 0,
            descriptor_builds: 0,
        })
    }

    /// The wanted layout.
    pub fn layout(&self) -> &WantedLayout {
        &self.layout
    }

    /// The transport endpoint, as given (without the wire-leg policy layers).
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    /// Current options.
    pub fn options(&self) -> &ReceiverOptions {
        &self.opts
    }

    /// Changes options; a change of arm (dedup, spreading, threshold) drops the cached plan and
    /// descriptors. Live weights stay.
    pub fn set_options(&mut self, opts: ReceiverOptions) {
        if opts.arm() != self.opts.arm() {
            self.prepared = None;
        }
        self.opts = opts;
        self.stack = self.opts.wire_stack(self.transport.clone());
    }

    /// Switches transport: every registration and descriptor is rebuilt. Live weights stay.
    pub fn set_transport(&mut self, transport: Arc<dyn Transport>) {
        self.prepared = None;
        self.stack = self.opts.wire_stack(transport.clone());
        self.transport = transport;
    }

    /// The live weights, one buffer per layout parameter, once an update has succeeded.
    pub fn live_params(&self) -> Option<&[Arc<HostBuffer>]> {
        self.live.as_deref()
    }

    /// Training step of the live weights.
    pub fn live_step(&self) -> Option<u64> {
        self.step
    }

    /// The cached plan, once prepared.
    pub fn plan(&self) -> Option<&Arc<Plan>> {
        self.prepared.as_ref().map(|p| &p.plan)
    }

    /// How many times a plan was built.
    pub fn plan_builds(&self) -> u64 {
        self.plan_builds
    }

    /// How many times descriptors were built.
    pub fn descriptor_builds(&self) -> u64 {
        self.descriptor_builds
    }

    /// Refits from encoded shard tables (decoding is the discover stage).
    pub async fn update_encoded(&mut self, encoded: &[Vec<u8>]) -> Result<UpdateReport> {
        let t0 = Instant::now();
        let tables = encoded
            .iter()
            .map(|b| reshard_core::encoding::decode_table(b))
            .collect::<Result<Vec<_>>>()?;
        self.run(&tables, t0).await
    }

    /// Refits from decoded shard tables.
    ///
    /// Every table must be at one training step, and not older than [`Receiver::live_step`]
    /// (the same step again is a valid re-refit): otherwise `InvalidInput` with
    /// [`ErrorDetail::MixedSteps`] or [`ErrorDetail::StaleStep`] naming the publisher.
    pub async fn update(&mut self, tables: &[ShardTable]) -> Result<UpdateReport> {
        self.run(tables, Instant::now()).await
    }

    /// Prepares without moving any bytes: merge, dedup, plan, allocate and register buffers,
    /// build descriptors. Later updates with the same geometry reuse all of it; calling this is
    /// optional (the first update prepares too) but keeps set-up out of the first refit.
    pub async fn prepare(&mut self, tables: &[ShardTable]) -> Result<StageTimes> {
        Ok(self.front(tables, Instant::now()).await?.stages)
    }

    /// Every stage up to and including `descriptor_build`.
    async fn front(&mut self, tables: &[ShardTable], t0: Instant) -> Result<Front> {
        let mut st = StageTimes::default();
        // Time spent before this call (decoding) belongs to discover too.
        let mut watch = Stopwatch(t0);

        let step = check_steps(tables, self.step)?;
        st.discover = watch.lap();

        // Stable geometry (the normal case, step after step): the previous merge and dedup hold;
        // only the new digests need the replica check.
        let keys: Vec<u64> = tables.iter().map(table_geometry_key).collect();
        let arm = self.opts.arm();
        let (table, dedup_report, geometry) = match &self.tables_cache {
            Some(c) if c.keys == keys && c.arm == arm => {
                st.merge = watch.lap();
                if self.opts.dedup {
                    c.groups.check(tables)?;
                }
                st.dedup = watch.lap();
                (c.table.clone(), c.report, c.geometry)
            }
            _ => {
                let merged = merge(tables)?;
                st.merge = watch.lap();
                let (table, report) = if self.opts.dedup {
                    let spread = self.opts.spread_owners.then_some(self.layout.receiver_rank);
                    dedup(
                        &merged,
                        DedupOptions {
                            spread_receiver_rank: spread,
                        },
                    )?
                } else {
                    keep_all(merged)
                };
                let groups = if self.opts.dedup {
                    ReplicaGroups::of(tables)
                } else {
                    ReplicaGroups::default()
                };
                st.dedup = watch.lap();
                let table = Arc::new(table);
                let geometry = table.geometry_fingerprint();
                self.tables_cache = Some(TablesCache {
                    keys,
                    arm,
                    table: table.clone(),
                    report,
                    geometry,
                    groups,
                });
                (table, report, geometry)
            }
        };

        // After merge (which refuses malformed sets of tables, such as two tables of one rank)
        // and before anything is planned or posted.
        check_incarnations(tables, self.stack.as_ref())?;

        let reuse = matches!(&self.prepared, Some(p) if p.geometry == geometry && p.arm == arm);
        let mut new_plan = None;
        if !reuse {
            let p = plan(&table, &self.layout, &self.opts.plan_options())?;
            self.plan_builds += 1;
            tracing::info!(
                rank = self.layout.receiver_rank,
                reads = p.stats.reads,
                wire_bytes = p.stats.wire_bytes,
                full_pulls = p.stats.full_pull_sources,
                fingerprint = format_args!("{:016x}", p.fingerprint),
                "plan built"
            );
            new_plan = Some(Arc::new(p));
        }
        st.plan = watch.lap();

        let plan_rebuilt = new_plan.is_some();
        if let Some(p) = new_plan {
            self.coverage_gate(&p)?;
            // Drop the old buffers' registrations first; live weights keep their own Arcs.
            self.prepared = None;
            self.prepared = Some(self.allocate(p, geometry, arm).await?);
        }
        st.register = watch.lap();

        let transport = self.stack.clone();
        let cache = self.opts.cache_descriptors;
        let prep = self
            .prepared
            .as_mut()
            .ok_or_else(|| Error::new(ErrorKind::Internal, "receiver has no prepared plan"))?;
        let bank = prep.next;
        let epoch = transport.epoch();
        let valid = cache && matches!(&prep.descriptors[bank], Some(c) if c.epoch == epoch);
        if !valid {
            // Both banks at once when caching, so every later update finds its batch ready.
            let banks: &[usize] = if cache { &[0, 1] } else { &[bank] };
            for &b in banks {
                let batch = build_batch(&prep.plan, &prep.banks[b], &prep.staging_ids);
                prep.descriptors[b] = Some(Cached {
                    batch: transport.prepare(batch).await?,
                    epoch,
                });
                self.descriptor_builds += 1;
            }
            tracing::debug!(rank = self.layout.receiver_rank, epoch, "descriptors built");
        }
        st.descriptor_build = watch.lap();
        Ok(Front {
            stages: st,
            watch,
            step,
            dedup_report,
            plan_rebuilt,
            descriptors_rebuilt: !valid,
        })
    }

    async fn run(&mut self, tables: &[ShardTable], t0: Instant) -> Result<UpdateReport> {
        let Front {
            stages: mut st,
            mut watch,
            step,
            dedup_report,
            plan_rebuilt,
            descriptors_rebuilt,
        } = self.front(tables, t0).await?;
        let mut tick = |slot: &mut f64| *slot = watch.lap();
        let transport = self.stack.clone();
        let prep = self
            .prepared
            .as_mut()
            .ok_or_else(|| Error::new(ErrorKind::Internal, "receiver has no prepared plan"))?;
        let bank = prep.next;

        let cached = prep.descriptors[bank]
            .as_ref()
            .ok_or_else(|| Error::new(ErrorKind::Internal, "descriptors missing"))?;
        let wire_t0 = Instant::now();
        let wire = match wire_leg(transport.as_ref(), &cached.batch).await {
            Ok(w) => w,
            Err(e) => {
                let e = name_tensor(e, &prep.plan);
                if e.is_quarantined() || layers::is_cut_short(&e) {
                    // Bytes of this batch may still land in the bank and staging it targeted
                    // (docs/in-flight-safety.md, rule 3), or the wait was cut short by the
                    // wire-leg timeout: never post into those buffers again. Dropping them
                    // here hands their registrations back to the backend (which defers the
                    // release while reads run); the live weights keep their own Arcs, and the
                    // next update allocates fresh buffers.
                    tracing::warn!(error = %e, "discarding receive buffers after a wire leg that may still write");
                    self.prepared = None;
                }
                return Err(e);
            }
        };
        // A backend that says it finished must have moved every planned byte; a short count
        // is a bug or a lie that digests would only catch when verification is on.
        let planned = cached.batch.batch().bytes();
        if wire.bytes != planned {
            return Err(Error::new(
                ErrorKind::Transport,
                format!(
                    "the transport reported {} bytes moved of the {planned} planned; refusing \
                     to install",
                    wire.bytes
                ),
            )
            .with_backend(transport.name()));
        }
        let wire_s = wire_t0.elapsed().as_secs_f64();
        let gbytes = if wire_s > 0.0 {
            wire.bytes as f64 / wire_s / 1e9
        } else {
            f64::INFINITY
        };
        if let Some(max) = self.opts.max_wire_gbps {
            let gbits = gbytes * 8.0;
            if gbits > max {
                return Err(Error::new(
                    ErrorKind::Guard,
                    format!(
                        "wire leg moved {} bytes at {gbits:.1} Gbit/s, above the fabric ceiling \
                         of {max} Gbit/s: nothing real moved; refusing to install",
                        wire.bytes
                    ),
                )
                .with_backend(transport.name()));
            }
        }
        tick(&mut st.wire);

        run_reslices(
            &prep.plan,
            &prep.staging,
            &prep.banks[bank].params,
            self.opts.batched_reslice,
        )?;
        tick(&mut st.reslice);

        let verdict = if self.opts.verify_digests {
            verify(&prep.plan, tables, &prep.banks[bank].params, &prep.staging)?
        } else {
            Verdict::default()
        };
        tick(&mut st.verify);

        prep.next = 1 - bank;
        self.live = Some(prep.banks[bank].params.clone());
        self.step = Some(step);
        tick(&mut st.install);

        let e2e = t0.elapsed().as_secs_f64();
        let plan = &prep.plan;
        Ok(UpdateReport {
            receiver_rank: self.layout.receiver_rank,
            step,
            stages: st,
            e2e_s: e2e,
            attribution: if e2e > 0.0 { st.sum() / e2e } else { 1.0 },
            plan_rebuilt,
            descriptors_rebuilt,
            plan: plan.stats,
            fingerprint: plan.fingerprint,
            dedup: dedup_report,
            wire_reads: wire.reads,
            wire_bytes: wire.bytes,
            wire_gbytes_per_s: gbytes,
            checks_passed: verdict.passed,
            checked_bytes: verdict.bytes,
            checks_without_digest: verdict.without_digest,
            resliced_bytes: plan
                .reslices
                .iter()
                .map(|r| r.extent.iter().product::<u64>() * r.elem)
                .sum(),
        })
    }

    fn coverage_gate(&self, p: &Plan) -> Result<()> {
        if let Some(floor) = self.opts.min_coverage {
            let cov = if p.stats.param_bytes == 0 {
                1.0
            } else {
                p.stats.written_bytes as f64 / p.stats.param_bytes as f64
            };
            if cov < floor {
                return Err(Error::new(
                    ErrorKind::Guard,
                    format!(
                        "plan writes {:.4} of parameter bytes, below the floor {floor}",
                        cov
                    ),
                ));
            }
        }
        Ok(())
    }

    async fn bank(&self, plan: &Plan) -> Result<Bank> {
        let mut params = Vec::with_capacity(plan.params.len());
        let mut regs = Vec::with_capacity(plan.params.len());
        for p in &plan.params {
            let buf = Arc::new(HostBuffer::zeroed(to_usize(p.bytes)?.max(1)));
            regs.push(
                self.stack
                    .register(buf.clone() as Arc<dyn MemoryBlock>)
                    .await?,
            );
            params.push(buf);
        }
        Ok(Bank { params, regs })
    }

    async fn allocate(&self, plan: Arc<Plan>, geometry: u64, arm: Arm) -> Result<Prepared> {
        let params: u64 = plan.params.iter().map(|p| p.bytes).sum();
        let staging: u64 = plan.staging.iter().map(|s| s.bytes).sum();
        reshard_core::memory_check(2 * params + staging, "receiver banks and staging")?;
        let b0 = self.bank(&plan).await?;
        let b1 = self.bank(&plan).await?;
        let mut staging = Vec::with_capacity(plan.staging.len());
        let mut staging_regs = Vec::with_capacity(plan.staging.len());
        for s in &plan.staging {
            let buf = Arc::new(HostBuffer::zeroed(to_usize(s.bytes)?.max(1)));
            staging_regs.push(
                self.stack
                    .register(buf.clone() as Arc<dyn MemoryBlock>)
                    .await?,
            );
            staging.push(buf);
        }
        let staging_ids = staging_regs.iter().map(|r| r.id()).collect();
        make_resident(b0.params.iter().chain(&b1.params).chain(&staging));
        Ok(Prepared {
            geometry,
            arm,
            plan,
            banks: [b0, b1],
            staging,
            _staging_regs: staging_regs,
            staging_ids,
            descriptors: [None, None],
            next: 0,
        })
    }
}

/// The merged, deduplicated view of the last tables, valid while every table's geometry key and
/// the arm are unchanged.
struct TablesCache {
    keys: Vec<u64>,
    arm: Arm,
    table: Arc<MergedTable>,
    report: DedupReport,
    geometry: u64,
    groups: ReplicaGroups,
}

/// What the stages before the wire leg produced.
struct Front {
    stages: StageTimes,
    watch: Stopwatch,
    step: u64,
    dedup_report: DedupReport,
    plan_rebuilt: bool,
    descriptors_rebuilt: bool,
}

/// Touches every page of freshly zeroed buffers, in parallel, so they are resident before any
/// timed transfer (registration with a NIC pins them just the same). Otherwise first-touch
/// page faults land in whichever wire leg writes a buffer first.
fn make_resident<'a>(bufs: impl Iterator<Item = &'a Arc<HostBuffer>>) {
    let bufs: Vec<&Arc<HostBuffer>> = bufs.collect();
    bufs.par_iter().for_each(|b| {
        let mut bytes = b.write();
        bytes.par_chunks_mut(1 << 20).for_each(|c| {
            // Writing the zero a fresh page already holds faults it in.
            for page in c.chunks_mut(4096) {
                page[0] = 0;
            }
        });
    });
}

/// Laps of a stage clock: each lap is the time since the previous one.
struct Stopwatch(Instant);

impl Stopwatch {
    fn lap(&mut self) -> f64 {
        let now = Instant::now();
        let s = (now - self.0).as_secs_f64();
        self.0 = now;
        s
    }
}

fn to_usize(v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::new(ErrorKind::InvalidInput, "buffer larger than memory"))
}

/// The one training step of `tables`, which must not be older than the live step.
///
/// A stale table is reported first (naming the lowest stale rank), so a lagging publisher among
/// current ones is named as stale rather than as merely different.
fn check_steps(tables: &[ShardTable], live: Option<u64>) -> Result<u64> {
    let Some(first) = tables.first() else {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "no shard tables to refit from",
        ));
    };
    if let Some(live_step) = live {
        // Installing older weights over newer ones would silently roll the model back (a
        // publisher restarted from an old checkpoint, a delayed table). The live step itself
        // stays allowed: refitting it again is idempotent.
        let stale = tables
            .iter()
            .filter(|t| t.step < live_step)
            .min_by_key(|t| t.publisher.rank);
        if let Some(t) = stale {
            let (owner, step) = (t.publisher.rank, t.step);
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "publisher rank {owner} offers training step {step}, older than the live \
                     step {live_step}; refusing to roll the weights back"
                ),
            )
            .with_owner(owner)
            .with_detail(ErrorDetail::StaleStep {
                owner,
                step,
                live_step,
            }));
        }
    }
    if let Some(t) = tables.iter().find(|t| t.step != first.step) {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "publishers are at different training steps (rank {} at {}, rank {} at {})",
                first.publisher.rank, first.step, t.publisher.rank, t.step
            ),
        )
        .with_owner(t.publisher.rank)
        .with_detail(ErrorDetail::MixedSteps {
            rank_a: first.publisher.rank,
            step_a: first.step,
            rank_b: t.publisher.rank,
            step_b: t.step,
        }));
    }
    Ok(first.step)
}

/// Every table must be bound to the incarnation of the peer metadata loaded for its owner.
///
/// A publisher that restarts keeps its rank and agent name but not its memory: reads through
/// the metadata of its previous incarnation reach nothing (a wire error), or, where the old
/// memory stays mapped (UCX shared memory), the departed process's bytes, which only digests
/// would catch. Comparing incarnations before any read is posted catches both, with verification
/// on or off (docs/in-flight-safety.md, "Stale peers"). Owners with no metadata loaded are left
/// to `prepare`, which names the read's byte range.
fn check_incarnations(tables: &[ShardTable], transport: &dyn Transport) -> Result<()> {
    for t in tables {
        let (owner, agent) = (t.publisher.rank, &t.publisher.agent);
        let Some(loaded) = transport.peer_incarnation(owner) else {
            continue;
        };
        if t.publisher.incarnation == 0 {
            return Err(Error::new(
                ErrorKind::InvalidTable,
                format!(
                    "the table of rank {owner} (agent {agent:?}) is not bound to a publisher \
                     endpoint (incarnation 0); publishers bind tables with ShardTable::bound_to"
                ),
            )
            .with_owner(owner));
        }
        if t.publisher.incarnation != loaded {
            return Err(Error::new(
                ErrorKind::Transport,
                format!(
                    "rank {owner} (agent {agent:?}) published this table from endpoint \
                     incarnation {:016x}, but the metadata loaded for it is from incarnation \
                     {loaded:016x}: the publisher restarted; load its current metadata",
                    t.publisher.incarnation
                ),
            )
            .with_owner(owner)
            .with_backend(transport.name()));
        }
    }
    Ok(())
}

fn build_batch(plan: &Plan, bank: &Bank, staging_ids: &[u64]) -> ReadBatch {
    let reads = plan
        .reads
        .iter()
        .map(|r| ReadDesc {
            owner: r.owner,
            remote_region: r.src_region,
            remote_offset: r.src_offset,
            local_region: match r.dst {
                Dest::Param(i) => bank.regs[i as usize].id(),
                Dest::Staging(i) => staging_ids[i as usize],
            },
            local_offset: r.dst_offset,
            len: r.len,
        })
        .collect();
    ReadBatch { reads }
}

/// Posts the prepared batch and waits, through the receiver's stack of wire-leg policies
/// (retries and the timeout are layers of the transport: [`crate::layers`]).
async fn wire_leg(transport: &dyn Transport, batch: &PreparedBatch) -> Result<WireReport> {
    transport.post(batch).await?.wait().await
}

/// Names the tensor of a failed read, found from the owner and byte range the backend reported.
fn name_tensor(e: Error, plan: &Plan) -> Error {
    let Some(owner) = e.context().owner else {
        return e;
    };
    let range = e.context().range.clone();
    let hit = plan.reads.iter().find(|r| {
        r.owner == owner
            && range
                .as_ref()
                .is_none_or(|g| g.start < r.src_offset + r.len && r.src_offset < g.end)
    });
    match hit {
        Some(r) => {
            let name = plan.tensors[r.tensor as usize].clone();
            e.with_tensor(name)
        }
        None => e,
    }
}

fn run_reslices(
    plan: &Plan,
    staging: &[Arc<HostBuffer>],
    params: &[Arc<HostBuffer>],
    batched: bool,
) -> Result<()> {
    let one = |r: &reshard_core::Reslice, dst: &mut [u8]| -> Result<()> {
        let src = staging[r.staging as usize].read();
        copy::reslice(r, &src, dst, &plan.tensors[r.tensor as usize])
    };
    if batched && plan.reslice_disjoint {
        // One parallel pass: destinations are disjoint, so parameters are independent.
        let mut groups: BTreeMap<u32, Vec<&reshard_core::Reslice>> = BTreeMap::new();
        for r in &plan.reslices {
            groups.entry(r.param).or_default().push(r);
        }
        let groups: Vec<_> = groups.into_iter().collect();
        groups.into_par_iter().try_for_each(|(p, rs)| {
            let mut dst = params[p as usize].write();
            rs.into_iter().try_for_each(|r| one(r, &mut dst))
        })
    } else {
        // Plan order: with overlapping destinations the last writer wins, as planned.
        for r in &plan.reslices {
            let mut dst = params[r.param as usize].write();
            one(r, &mut dst)?;
        }
        Ok(())
    }
}

/// Hashes a check's rows in order, as if they were contiguous (streaming XXH3-128 equals the
/// one-shot digest of the concatenation).
fn gather_digest(bytes: &[u8], c: &reshard_core::DigestCheck) -> Option<Digest> {
    let at = |i: u64| {
        let s = c.dst_offset.checked_add(i.checked_mul(c.row_stride)?)? as usize;
        bytes.get(s..s.checked_add(c.row_bytes as usize)?)
    };
    if c.rows == 1 || c.row_stride == c.row_bytes {
        let s = c.dst_offset as usize;
        return bytes
            .get(s..s.checked_add(c.bytes() as usize)?)
            .map(Digest::of);
    }
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for i in 0..c.rows {
        h.update(at(i)?);
    }
    Some(Digest(h.digest128().to_le_bytes()))
}

/// The owner's bytes a digest check covers: the whole offer, or chunk `k`'s rows of it (chunk
/// checks cover whole offer rows, so a source row is `row_bytes` long).
fn checked_source_range(
    c: &reshard_core::DigestCheck,
    chunks: Option<&ChunkDigests>,
) -> std::ops::Range<u64> {
    let start = match (c.chunk, chunks) {
        (Some(k), Some(ch)) => c.src_offset + u64::from(k) * ch.rows * c.row_bytes,
        _ => c.src_offset,
    };
    start..start + c.bytes()
}

#[derive(Default)]
struct Verdict {
    passed: u64,
    bytes: u64,
    without_digest: u64,
}

fn verify(
    plan: &Plan,
    tables: &[ShardTable],
    params: &[Arc<HostBuffer>],
    staging: &[Arc<HostBuffer>],
) -> Result<Verdict> {
    // This step's digests, straight from the tables (the cached merged view has old ones).
    type Digests<'a> = (Option<Digest>, Option<&'a ChunkDigests>);
    let mut offers: FxHashMap<(OwnerId, u64, u64), Digests<'_>> = FxHashMap::default();
    for t in tables {
        for o in &t.offers {
            offers.insert(
                (t.publisher.rank, o.location.region, o.location.offset),
                (o.digest, o.chunks.as_ref()),
            );
        }
    }
    let results: Vec<Result<Option<u64>>> = plan
        .checks
        .par_iter()
        .map(|c| {
            let offer = offers.get(&(c.owner, c.src_region, c.src_offset));
            let want = offer.and_then(|(digest, chunks)| match c.chunk {
                None => *digest,
                Some(k) => chunks.and_then(|ch| ch.digests.get(k as usize).copied()),
            });
            let Some(want) = want else {
                return Ok(None);
            };
            let buf = match c.dst {
                Dest::Param(i) => &params[i as usize],
                Dest::Staging(i) => &staging[i as usize],
            };
            let bytes = buf.read();
            let got = gather_digest(&bytes, c).ok_or_else(|| {
                Error::new(ErrorKind::Internal, "digest check outside its buffer")
                    .with_tensor(plan.tensors[c.tensor as usize].clone())
            })?;
            if got != want {
                let what = match c.chunk {
                    None => "the offer".to_string(),
                    Some(k) => format!("row chunk {k} of the offer"),
                };
                return Err(Error::new(
                    ErrorKind::Verification,
                    format!(
                        "received bytes of {what} hash to {}.. but the publisher's digest is \
                         {}..; live weights left untouched",
                        got.prefix(12),
                        want.prefix(12)
                    ),
                )
                .with_tensor(plan.tensors[c.tensor as usize].clone())
                .with_owner(c.owner)
                .with_range(checked_source_range(c, offer.and_then(|(_, ch)| *ch))));
            }
            Ok(Some(c.bytes()))
        })
        .collect();
    let mut v = Verdict::default();
    for r in results {
        match r? {
            Some(len) => {
                v.passed += 1;
                v.bytes += len;
            }
            None => v.without_digest += 1,
        }
    }
    Ok(v)
}
