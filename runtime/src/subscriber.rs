//! A receiver rank fed by a rendezvous (docs/deployment.md): it learns the model's architecture
//! from the publishers' announcements, loads each publisher's transport metadata (again when a
//! publisher restarts with a new incarnation), and installs every new step through the
//! [`Receiver`], which keeps the previous weights on any failure: in one call
//! ([`Subscriber::next_step`]), or staged (the newest step, or exactly step n) and applied when
//! the engine chooses, with a rollback to the previous step that needs no publisher.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reshard_core::encoding::decode_table;
use reshard_core::rendezvous::{
    backoff, discover, discover_exact, Discovered, ReadClaim, Reading, Rendezvous, Want,
    RETRY_FIRST,
};
use reshard_core::{Error, ErrorDetail, ErrorKind, OwnerId, Result, ShardTable, Transport};
use reshard_planner::layouts::receiver_layout;
use reshard_planner::presets::ModelConfig;
use reshard_planner::topology::ReceiverTopology;

use crate::{Receiver, ReceiverOptions, RollbackReport, Staged, UpdateReport};

/// One step installed through a rendezvous.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// The step installed.
    pub step: u64,
    /// Seconds spent waiting for and fetching the publishers' announcements.
    pub discovery_s: f64,
    /// Publishers whose metadata was (re)loaded for this step.
    pub peers_loaded: u32,
    /// The receiver's report of the update.
    pub update: UpdateReport,
    /// Rendezvous failures discovery waited through before it found this step
    /// ([`Discovered::waited_through`]).
    pub waited_through: Vec<String>,
    /// A step newer than the one installed that a publisher stood ready at when this
    /// subscriber last looked (right after staging), if it saw one: the engine applied an older
    /// step than the newest.
    pub newer_step: Option<u64>,
}

/// A step staged through a rendezvous ([`Subscriber::stage`]), waiting for
/// [`Subscriber::apply`].
#[derive(Debug, Clone)]
pub struct StagedStep {
    /// The receiver's handle.
    pub staged: Staged,
    /// Seconds spent waiting for and fetching the publishers' announcements.
    pub discovery_s: f64,
    /// Publishers whose metadata was (re)loaded for this step.
    pub peers_loaded: u32,
    /// Rendezvous failures discovery waited through ([`Discovered::waited_through`]).
    pub waited_through: Vec<String>,
    /// The newest step any publisher stood ready at right after [`Subscriber::stage`] (one
    /// member list read; None when that read failed, and from [`Subscriber::stage_found`]).
    pub newest_seen: Option<u64>,
}

impl StagedStep {
    /// The step staged.
    pub fn step(&self) -> u64 {
        self.staged.step()
    }
}

/// `on host H pid P`: this process in a reading claim.
fn this_process() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    format!("on host {host} pid {}", std::process::id())
}

/// A receiver rank that refits from whatever the rendezvous announces.
pub struct Subscriber {
    rendezvous: Arc<dyn Rendezvous>,
    model_name: String,
    model: ModelConfig,
    receiver: Receiver,
    /// Incarnation whose metadata is loaded, per publisher rank.
    peers: HashMap<OwnerId, u64>,
    /// A set found while connecting, installed by the first [`Self::next_step`].
    pending: Option<Discovered>,
    /// This receiver in reading claims and messages (`receiver rank 1 on host h pid 42`).
    reader: String,
}

impl Subscriber {
    /// Waits up to `timeout` for every publisher of `model_name` to be ready at one step, reads
    /// the architecture they announce, and builds receiver rank `rank` of `topology` over
    /// `transport` (nothing is installed yet).
    pub async fn connect(
        rendezvous: Arc<dyn Rendezvous>,
        model_name: &str,
        transport: Arc<dyn Transport>,
        topology: &ReceiverTopology,
        rank: u32,
        options: ReceiverOptions,
        timeout: Duration,
    ) -> Result<Self> {
        let want = Want {
            model: model_name.to_string(),
            after_step: None,
            timeout,
        };
        let found = discover(rendezvous.as_ref(), &want).await?;
        let first = &found.announcements[0];
        let model: ModelConfig = serde_json::from_slice(&first.config).map_err(|e| {
            Error::new(
                ErrorKind::Decode,
                format!(
                    "publisher rank {} of model {model_name:?} announces an architecture that is \
                     not a model configuration: {e}",
                    first.rank
                ),
            )
            .with_owner(first.rank)
        })?;
        let layout = receiver_layout(&model, topology, rank)?;
        let receiver = Receiver::new(transport, layout, options)?;
        Ok(Self {
            rendezvous,
            model_name: model_name.to_string(),
            model,
            receiver,
            peers: HashMap::new(),
            pending: Some(found),
            reader: format!("receiver rank {rank} {}", this_process()),
        })
    }

    /// Installs the next step above the one live (the first step the publishers are ready at,
    /// when none is live yet), waiting up to `timeout` for it. On an error the live weights
    /// and step are untouched and the next call tries again.
    pub async fn next_step(&mut self, timeout: Duration) -> Result<StepReport> {
        let staged = self.stage(None, false, timeout).await?;
        self.apply(&staged)
    }

    /// Waits up to `timeout` for the publishers to be ready at a step above the one live. The
    /// set found while connecting is used only while every publisher still stands ready at its
    /// step; one that went stale since (a publisher began to rewrite its weights, advanced or
    /// restarted) sends discovery round again rather than reading memory its publisher no
    /// longer vouches for.
    pub async fn discover_next(&mut self, timeout: Duration) -> Result<Discovered> {
        if let Some(found) = self.pending.take() {
            // A rendezvous that cannot say (unreachable) sends discovery round, which waits it out.
            if Some(found.step) > self.receiver.live_step()
                && matches!(self.still_ready(&found).await, Ok(true))
            {
                return Ok(found);
            }
        }
        let want = Want {
            model: self.model_name.clone(),
            after_step: self.receiver.live_step(),
            timeout,
        };
        discover(self.rendezvous.as_ref(), &want).await
    }

    /// Whether the rendezvous still shows every publisher of `found` ready at its step, under
    /// the incarnation `found` announced (one `members` read, no tables fetched).
    async fn still_ready(&self, found: &Discovered) -> Result<bool> {
        let (members, _) = self.rendezvous.members(&self.model_name).await?;
        Ok(members.len() == found.announcements.len()
            && members.iter().zip(&found.announcements).all(|(m, a)| {
                m.rank == a.rank
                    && m.ready
                    && m.step == found.step
                    && m.incarnation == a.incarnation
            }))
    }

    /// Loads the metadata of publishers not loaded yet (or restarted) and installs the step
    /// `found` describes. On an error the live weights and step are untouched; one with
    /// [`ErrorDetail::MovedOn`] read nothing (the publishers moved on since `found`): discover
    /// again.
    pub async fn install(&mut self, found: Discovered) -> Result<StepReport> {
        let staged = self.stage_found(found, false).await?;
        self.apply(&staged)
    }

    /// Stages a step (see [`Receiver::stage`]): the newest the publishers are all ready at
    /// above the live one (`step` None), or exactly `step` across all publishers. The live
    /// weights stay as they are. `timeout` bounds the whole call, discovery, metadata loads and
    /// the wire leg together; a pinned step not reached in time is `Timeout` naming each
    /// publisher rank that lacks it and the step it has. A pinned step older than the live one
    /// is refused (`InvalidInput`, nothing waited for) unless `allow_older`.
    pub async fn stage(
        &mut self,
        step: Option<u64>,
        allow_older: bool,
        timeout: Duration,
    ) -> Result<StagedStep> {
        let start = Instant::now();
        let live = self.receiver.live_step();
        if let (Some(n), Some(live)) = (step, live) {
            if n < live && !allow_older {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    format!(
                        "receiver rank {}: step {n} is older than the live step {live}; pass \
                         allow_older to go back to it (or roll back, which needs no wire)",
                        self.receiver.layout().receiver_rank
                    ),
                ));
            }
        }
        // A set that moves on between discovery and the reader's claim (a publisher began to
        // rewrite its memory) read nothing: discovered again, within the same overall bound,
        // after a pause that doubles while the sets keep moving on (a publisher flapping, or a
        // member list the claim's check never agrees with), so the loop costs a few rendezvous
        // requests a second rather than as many as the rendezvous answers.
        let deadline = start + timeout;
        let mut pause = RETRY_FIRST;
        let (staged, found_step) = loop {
            let left = timeout.saturating_sub(start.elapsed());
            let found = match step {
                None => self.discover_next(left).await?,
                Some(n) => self.discover_exact(n, left).await?,
            };
            let left = timeout.saturating_sub(start.elapsed());
            let found_step = found.step;
            match tokio::time::timeout(left, self.stage_found(found, allow_older)).await {
                Ok(Err(e)) if matches!(e.detail(), Some(ErrorDetail::MovedOn { .. })) => {
                    if Instant::now() >= deadline {
                        // Every set moved on until the time ran out. Checked here, not left to
                        // discovery: a rendezvous that answers at once would find a set again
                        // and again, past any deadline.
                        return Err(Error::new(
                            ErrorKind::Timeout,
                            format!(
                                "receiver rank {}: no step held still long enough to stage \
                                 within {:.1} s: {e}",
                                self.receiver.layout().receiver_rank,
                                timeout.as_secs_f64()
                            ),
                        ));
                    }
                    tracing::debug!("{e}; discovering again after {pause:?}");
                    backoff(&mut pause, deadline).await;
                }
                staged => break (staged, found_step),
            }
        };
        match staged {
            Ok(staged) => {
                let mut staged = staged?;
                // What the engine chooses between: one member list read (not on `install`'s
                // path, whose step is the newest by construction).
                staged.newest_seen = match self.rendezvous.members(&self.model_name).await {
                    Ok((members, _)) => members.iter().filter(|m| m.ready).map(|m| m.step).max(),
                    Err(_) => None,
                };
                Ok(staged)
            }
            Err(_) => Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "receiver rank {}: staging step {found_step} ran past its timeout of {:.1} s \
                     (discovery, metadata loads and the wire leg together) and was cut short; \
                     the live weights are untouched",
                    self.receiver.layout().receiver_rank,
                    timeout.as_secs_f64()
                ),
            )),
        }
    }

    /// Waits up to `timeout` for every publisher to be ready at exactly step `step`.
    async fn discover_exact(&mut self, step: u64, timeout: Duration) -> Result<Discovered> {
        if let Some(found) = self.pending.take() {
            if found.step == step && matches!(self.still_ready(&found).await, Ok(true)) {
                return Ok(found);
            }
        }
        let want = Want {
            model: self.model_name.clone(),
            after_step: None,
            timeout,
        };
        discover_exact(self.rendezvous.as_ref(), &want, step).await
    }

    /// Makes a staged step live (see [`Receiver::apply`]); no wire, no rendezvous.
    pub fn apply(&mut self, staged: &StagedStep) -> Result<StepReport> {
        let update = self.receiver.apply(&staged.staged)?;
        Ok(StepReport {
            step: staged.step(),
            discovery_s: staged.discovery_s,
            peers_loaded: staged.peers_loaded,
            update,
            waited_through: staged.waited_through.clone(),
            newer_step: staged.newest_seen.filter(|&n| n > staged.step()),
        })
    }

    /// Makes the previous step live again (see [`Receiver::rollback`]): no wire, no rendezvous,
    /// no publisher needed.
    pub fn rollback(&mut self) -> Result<RollbackReport> {
        self.receiver.rollback()
    }

    /// Loads the metadata of publishers not loaded yet (or restarted) and stages the step
    /// `found` describes (see [`Receiver::stage`]), under a reading claim on the publishers'
    /// memory (the reader fence); [`ErrorDetail::MovedOn`] when they moved on since `found`.
    pub async fn stage_found(
        &mut self,
        found: Discovered,
        allow_older: bool,
    ) -> Result<StagedStep> {
        let discovery_s = found.elapsed.as_secs_f64();
        let waited_through = found.waited_through.clone();
        let transport = self.receiver.transport().clone();
        let mut tables: Vec<ShardTable> = Vec::with_capacity(found.announcements.len());
        let mut peers_loaded = 0;
        for a in &found.announcements {
            if a.transport != transport.name() {
                return Err(Error::new(
                    ErrorKind::Config,
                    format!(
                        "publisher rank {} of model {:?} serves reads over {:?}, this receiver \
                         uses {:?}",
                        a.rank,
                        self.model_name,
                        a.transport,
                        transport.name()
                    ),
                )
                .with_owner(a.rank));
            }
            if self.peers.get(&a.rank) != Some(&a.incarnation) {
                transport.load_peer(a.rank, a.metadata.clone()).await?;
                self.peers.insert(a.rank, a.incarnation);
                peers_loaded += 1;
            }
            let table = decode_table(&a.table).map_err(|e| e.with_owner(a.rank))?;
            if table.publisher.rank != a.rank || table.step != a.step {
                return Err(Error::new(
                    ErrorKind::Decode,
                    format!(
                        "publisher rank {} announced step {} but its table is rank {}'s at step \
                         {}",
                        a.rank, a.step, table.publisher.rank, table.step
                    ),
                )
                .with_owner(a.rank));
            }
            tables.push(table);
        }
        // The reader fence: claim the publishers' memory, then check they still stand ready
        // at this step; a publisher that marked itself not ready before the claim landed is
        // not read (it may be rewriting), one that does so after waits for the release.
        let claim = self.claim(&found).await?;
        let staged = self.receiver.stage(&tables, allow_older).await;
        // Every read is over (waited for or aborted: the transport contract), whatever the
        // outcome. A release that fails leaves the claim to expire with the reader's lease.
        if let Err(e) = claim.release().await {
            tracing::warn!("{e}");
        }
        let staged = staged?;
        Ok(StagedStep {
            staged,
            discovery_s,
            peers_loaded,
            waited_through,
            newest_seen: None,
        })
    }

    /// Claims the memory of every publisher of `found` for this receiver's reads (the reader
    /// fence, docs/deployment.md), then checks that each still stands ready at `found`'s step
    /// in the same incarnation; when one does not, the claim is released and the error is
    /// [`ErrorDetail::MovedOn`] (nothing read).
    async fn claim(&self, found: &Discovered) -> Result<Box<dyn Reading>> {
        let claim = ReadClaim {
            model: self.model_name.clone(),
            step: found.step,
            reader: self.reader.clone(),
            ranks: found
                .announcements
                .iter()
                .map(|a| (a.rank, a.incarnation))
                .collect(),
        };
        let held = self.rendezvous.claim_reading(claim).await?;
        match self.still_ready(found).await {
            Ok(true) => Ok(held),
            still => {
                let _ = held.release().await;
                still?;
                Err(Error::new(
                    ErrorKind::PeerUnknown,
                    format!(
                        "{}: the publishers of step {} moved on before its reads began (one \
                         began to rewrite its memory, advanced or restarted); nothing was read \
                         and the live weights are untouched",
                        self.reader, found.step
                    ),
                )
                .with_detail(ErrorDetail::MovedOn { step: found.step }))
            }
        }
    }

    /// The model's architecture, as the publishers announced it.
    pub fn model(&self) -> &ModelConfig {
        &self.model
    }

    /// The receiver (live weights, step, plan).
    pub fn receiver(&self) -> &Receiver {
        &self.receiver
    }
}
