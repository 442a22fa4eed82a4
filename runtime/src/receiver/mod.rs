//! The receiver runtime: prepare once, then refit every step (docs/design.md §5–§7).
//!
//! Parameters are double-buffered: every update lands in the bank that is not live, is
//! re-sliced and verified there, and only a fully successful update swaps it in. A failed update
//! therefore never touches the live weights.
//!
//! An update is two moves, which a caller may make apart (python/README.md, "Stage, apply,
//! roll back"): [`Receiver::stage`] lands and verifies a step in the bank that is not live
//! while the live weights stay as they are, and [`Receiver::apply`] makes it live (a pointer
//! swap); [`Receiver::update`] is both. The bank that was live keeps its step until the next
//! stage lands in it, which is what [`Receiver::rollback`] goes back to, without any wire.
//!
//! Split by concern: `options` ([`ReceiverOptions`] and the wire-leg layers it
//! composes), `report` ([`UpdateReport`], [`StageTimes`]), `stage` ([`Staged`],
//! [`RollbackReport`], apply and rollback), `banks` (buffers, registration,
//! staging, read batches), `checks` (steps, incarnations, coverage), `reslice`, `verify`
//! (wire guards, digests) and `landing` (verification and re-slice as the bytes land). This file holds the [`Receiver`] and its pipeline.

use std::sync::Arc;
use std::time::Instant;

use reshard_core::{
    dedup, keep_all, merge, table_geometry_key, CompletionSink, DedupOptions, DedupReport, Error,
    ErrorKind, HashPlan, HostBuffer, MergedTable, Plan, PreparedBatch, ReplicaGroups, Result,
    ShardTable, Transport, WantedLayout, WireReport,
};
use reshard_planner::plan::plan;

use crate::layers;

mod banks;
mod checks;
mod hashes;
mod landing;
mod options;
mod report;
mod reslice;
mod stage;
mod verify;

pub use options::ReceiverOptions;
pub use report::{StageTimes, UpdateReport};
pub use stage::{RollbackReport, Staged};

use banks::{build_batch, Cached, Prepared};
use checks::{check_incarnations, check_steps};
use options::Arm;
use reslice::run_reslices;
use stage::{Previous, Slot};
use verify::Verdict;

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
    /// Set while a wire leg runs, cleared when it returns: still set afterwards, it says an
    /// update's future was dropped part-way through its wire leg. A read the backend could not
    /// end by then is quarantined (docs/in-flight-safety.md, rule 3) with no error to say so,
    /// so bytes may still land in the bank and staging that leg targeted: the next update
    /// discards them and lands in freshly allocated buffers.
    wire_leg_open: bool,
    /// This receiver among all in the process: a [`Staged`] handle names it.
    id: u64,
    /// Stages begun so far (each [`Staged`] handle carries its number).
    tickets: u64,
    /// Bank allocations made so far ([`Prepared::generation`]).
    generations: u64,
    /// The step staged and not applied yet, in the landing bank.
    staged: Option<Slot>,
    /// The bank of the live weights, when it is one of the current banks: `(generation, bank)`.
    live_at: Option<(u64, usize)>,
    /// The step a rollback makes live again (in the landing bank), or why there is none.
    previous: std::result::Result<Previous, reshard_core::NoRollback>,
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
            wire_leg_open: false,
            id: stage::next_receiver_id(),
            tickets: 0,
            generations: 0,
            staged: None,
            live_at: None,
            previous: Err(reshard_core::NoRollback::NoPrevious),
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

    /// Changes options; a change of arm (dedup, spreading, threshold, gathers) makes the next
    /// update build a new plan and descriptors. Live weights, the staged step and the rollback
    /// target stay, in the same banks.
    pub fn set_options(&mut self, opts: ReceiverOptions) {
        self.opts = opts;
        self.stack = self.opts.wire_stack(self.transport.clone());
    }

    /// Switches transport: every registration and descriptor is rebuilt. Live weights stay.
    pub fn set_transport(&mut self, transport: Arc<dyn Transport>) {
        self.discard_banks();
        self.stack = self.opts.wire_stack(transport.clone());
        self.transport = transport;
    }

    /// The live weights, one buffer per layout parameter, once an update has succeeded.
    pub fn live_params(&self) -> Option<&[Arc<HostBuffer>]> {
        self.live.as_deref()
    }

    /// The bank the next update lands in, once prepared (None before the first update and
    /// after buffers were discarded, or are to be after a wire leg dropped part-way: the next
    /// update then lands in freshly allocated ones).
    /// A caller that lends the live bank out (the Python binding's swap install) checks that
    /// none of these buffers is still lent before it starts an update.
    pub fn landing_params(&self) -> Option<&[Arc<HostBuffer>]> {
        if self.wire_leg_open {
            return None;
        }
        self.prepared
            .as_ref()
            .map(|p| p.banks[p.next].params.as_slice())
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
    pub async fn update_encoded<B: AsRef<[u8]> + Sync>(
        &mut self,
        encoded: &[B],
    ) -> Result<UpdateReport> {
        let t0 = Instant::now();
        let tables = encoded
            .iter()
            .map(|b| reshard_core::encoding::decode_table(b.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        let staged = self.run(&tables, t0, false).await?;
        self.apply(&staged)
    }

    /// Refits from decoded shard tables: [`Receiver::stage`], then [`Receiver::apply`].
    ///
    /// Every table must be at one training step, and not older than [`Receiver::live_step`]
    /// (the same step again is a valid re-refit): otherwise `InvalidInput` with
    /// [`ErrorDetail::MixedSteps`](reshard_core::ErrorDetail::MixedSteps) or
    /// [`ErrorDetail::StaleStep`](reshard_core::ErrorDetail::StaleStep) naming the publisher.
    pub async fn update(&mut self, tables: &[ShardTable]) -> Result<UpdateReport> {
        let staged = self.run(tables, Instant::now(), false).await?;
        self.apply(&staged)
    }

    /// Moves and verifies the step of `tables` into the bank that is not live, leaving the live
    /// weights and step as they are; [`Receiver::apply`] makes it live. The steps are checked
    /// as in [`Receiver::update`], except that `allow_older` admits a step older than the live
    /// one (going back on purpose).
    ///
    /// Staging lands in the bank that holds the step a rollback would return to, and in the
    /// bank of a step staged before and not applied: from its wire leg on, that rollback is
    /// gone and that earlier handle is refused by `apply` ([`reshard_core::NotApplicable::Replaced`]).
    /// A stage that fails before its wire leg changes nothing.
    pub async fn stage(&mut self, tables: &[ShardTable], allow_older: bool) -> Result<Staged> {
        self.run(tables, Instant::now(), allow_older).await
    }

    /// Prepares without moving any bytes: merge, dedup, plan, allocate and register buffers,
    /// build descriptors. Later updates with the same geometry reuse all of it; calling this is
    /// optional (the first update prepares too) but keeps set-up out of the first refit.
    pub async fn prepare(&mut self, tables: &[ShardTable]) -> Result<StageTimes> {
        Ok(self.front(tables, Instant::now(), false).await?.stages)
    }

    /// Every stage up to and including `descriptor_build`.
    async fn front(
        &mut self,
        tables: &[ShardTable],
        t0: Instant,
        allow_older: bool,
    ) -> Result<Front> {
        if std::mem::take(&mut self.wire_leg_open) {
            // The last wire leg was dropped part-way: never post into its buffers again.
            self.discard_banks();
        }
        let mut st = StageTimes::default();
        // Time spent before this call (decoding) belongs to discover too.
        let mut watch = Stopwatch(t0);

        let step = check_steps(tables, if allow_older { None } else { self.step })?;
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
            // The banks are the layout's, which a new geometry or arm does not change: kept,
            // with the step staged in them and the rollback target (issue 42: discarding them
            // first lost both when the allocation that followed failed).
            if !self.replan(&p, geometry, arm).await? {
                // No banks yet (or banks for other parameters, which one layout never asks
                // for): nothing staged or to roll back to is lost.
                self.discard_banks();
                self.generations += 1;
                let generation = self.generations;
                self.prepared = Some(self.allocate(p, geometry, arm, generation).await?);
            }
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
        if self.opts.hash_while_copying
            && self.opts.verify_digests
            && Self::overlaps_with(&self.opts)
            && prep.copy_hashes.is_none()
        {
            // Once per plan, timed with the descriptors it goes with.
            prep.copy_hashes = Some(Arc::new(hashes::CopyHashes::of(&prep.plan)));
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

    /// Stages `tables` (see [`Receiver::stage`]): every stage but `install`.
    async fn run(
        &mut self,
        tables: &[ShardTable],
        t0: Instant,
        allow_older: bool,
    ) -> Result<Staged> {
        let Front {
            stages: mut st,
            mut watch,
            step,
            dedup_report,
            plan_rebuilt,
            descriptors_rebuilt,
        } = self.front(tables, t0, allow_older).await?;
        // The landing bank is written from here on: the step it held (a rollback target, or a
        // step staged before) is gone.
        self.forget_landing();
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
        // The reshard arm verifies and re-slices as the bytes land; the baseline arm (no
        // dedup, per-copy re-slice) keeps the order it measures: wire leg, re-slice, verify.
        let overlap = Self::overlaps_with(&self.opts);
        let hashes = match &prep.copy_hashes {
            Some(h) if overlap && self.opts.verify_digests && self.opts.hash_while_copying => {
                // Hashes stored by an earlier post no longer count.
                h.plan.begin();
                Some(h.clone())
            }
            _ => None,
        };
        let landing = overlap.then(|| {
            let verifier = landing::Verifier {
                plan: prep.plan.clone(),
                params: prep.banks[bank].params.clone(),
                staging: prep.staging.clone(),
                digests: if self.opts.verify_digests {
                    verify::digests_of(tables)
                } else {
                    Default::default()
                },
                schedule: landing::Schedule::new(&prep.plan, self.opts.verify_digests),
                hashes: hashes.clone(),
            };
            let (tx, rx) = std::sync::mpsc::channel();
            let thread = std::thread::Builder::new()
                .name("reshard-verify".into())
                .spawn(move || verifier.run(rx));
            (tx, thread)
        });
        let (tx, verifier) = match landing {
            Some((tx, Ok(thread))) => (Some(tx), Some(thread)),
            Some((_, Err(e))) => {
                return Err(Error::new(
                    ErrorKind::Internal,
                    format!("cannot start the verifier thread: {e}"),
                ))
            }
            None => (None, None),
        };
        let wire_t0 = Instant::now();
        self.wire_leg_open = true;
        let outcome = wire_leg(
            transport.as_ref(),
            &cached.batch,
            tx.clone(),
            hashes.map(|h| h.plan.clone()),
        )
        .await;
        self.wire_leg_open = false;
        // The verifier only reads and re-slices buffers whose reads all reported; it is
        // joined before this update returns either way, so no later update writes a bank
        // it still reads.
        let landed = verifier.map(|thread| {
            if let Some(tx) = &tx {
                let _ = tx.send(landing::Msg::End(outcome.is_ok()));
            }
            thread.join()
        });
        let wire = match outcome {
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
                    self.discard_banks();
                }
                return Err(e);
            }
        };
        let gbytes = verify::guard_wire(
            &wire,
            cached.batch.batch().bytes(),
            wire_t0,
            self.opts.max_wire_gbps,
            transport.name(),
        )?;
        tick(&mut st.wire);

        let (verdict, early) = match landed {
            Some(joined) => {
                let landed = joined.map_err(|_| {
                    Error::new(ErrorKind::Internal, "the verifier thread panicked")
                })??;
                // What ran as the bytes landed is inside the wire leg; what was left after
                // it (re-slices and checks of the last buffers) is timed as `verify`.
                tick(&mut st.verify);
                (landed.verdict, (landed.early_checks, landed.early_reslices))
            }
            None => {
                run_reslices(
                    &prep.plan,
                    &prep.staging,
                    &prep.banks[bank].params,
                    self.opts.batched_reslice,
                )?;
                tick(&mut st.reslice);
                let verdict = if self.opts.verify_digests {
                    verify::verify(&prep.plan, tables, &prep.banks[bank].params, &prep.staging)?
                } else {
                    Verdict::default()
                };
                tick(&mut st.verify);
                (verdict, (0, 0))
            }
        };

        let e2e = t0.elapsed().as_secs_f64();
        let plan = &prep.plan;
        let generation = prep.generation;
        let report = UpdateReport {
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
            copy_hashed_bytes: verdict.from_copy,
            checks_without_digest: verdict.without_digest,
            checks_while_on_wire: early.0,
            reslices_while_on_wire: early.1,
            resliced_bytes: plan
                .reslices
                .iter()
                .map(|r| r.extent.iter().product::<u64>() * r.elem)
                .sum(),
        };
        Ok(self.hold_staged(bank, generation, step, report))
    }
}

impl Receiver {
    /// Whether checks and re-slices run as the bytes land under `opts` (the reshard arm, on
    /// every plan: re-slices that may overlap run per parameter in plan order,
    /// [`landing`]); the baseline arm (no dedup, per-copy re-slice) keeps its order: wire leg,
    /// re-slice, verify.
    fn overlaps_with(opts: &ReceiverOptions) -> bool {
        opts.verify_while_landing && opts.dedup && opts.batched_reslice
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

/// Posts the prepared batch and waits, through the receiver's stack of wire-leg policies
/// (retries and the timeout are layers of the transport: [`crate::layers`]).
/// With `landed`, reads are reported to it as they complete, and with `hashes` the backend
/// may hash their digest segments as it copies them.
async fn wire_leg(
    transport: &dyn Transport,
    batch: &PreparedBatch,
    landed: Option<std::sync::mpsc::Sender<landing::Msg>>,
    hashes: Option<Arc<HashPlan>>,
) -> Result<WireReport> {
    let flight = match landed {
        Some(tx) => {
            let sink = CompletionSink::new(move |i| {
                // The verifier may have stopped (a check failed): nothing listens any more.
                let _ = tx.send(landing::Msg::Read(i));
            });
            let sink = match hashes {
                Some(h) => sink.with_hashes(h),
                None => sink,
            };
            transport.post_reporting(batch, sink).await?
        }
        None => transport.post(batch).await?,
    };
    flight.wait().await
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
                .is_none_or(|g| g.start < r.src_offset + r.src_span() && r.src_offset < g.end)
    });
    match hit {
        Some(r) => {
            let name = plan.tensors[r.tensor as usize].clone();
            e.with_tensor(name)
        }
        None => e,
    }
}
