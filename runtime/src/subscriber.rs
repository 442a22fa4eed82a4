//! A receiver rank fed by a rendezvous (docs/deployment.md): it learns the model's architecture
//! from the publishers' announcements, loads each publisher's transport metadata (again when a
//! publisher restarts with a new incarnation), and installs every new step through the
//! [`Receiver`], which keeps the previous weights on any failure.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use reshard_core::encoding::decode_table;
use reshard_core::rendezvous::{discover, Discovered, Rendezvous, Want};
use reshard_core::{Error, ErrorKind, OwnerId, Result, ShardTable, Transport};
use reshard_planner::layouts::receiver_layout;
use reshard_planner::presets::ModelConfig;
use reshard_planner::topology::ReceiverTopology;

use crate::{Receiver, ReceiverOptions, UpdateReport};

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
        })
    }

    /// Installs the next step above the one live (the first step the publishers are ready at,
    /// when none is live yet), waiting up to `timeout` for it. On an error the live weights
    /// and step are untouched and the next call tries again.
    pub async fn next_step(&mut self, timeout: Duration) -> Result<StepReport> {
        let found = self.discover_next(timeout).await?;
        self.install(found).await
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
    /// `found` describes. On an error the live weights and step are untouched.
    pub async fn install(&mut self, found: Discovered) -> Result<StepReport> {
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
        let update = self.receiver.update(&tables).await?;
        Ok(StepReport {
            step: found.step,
            discovery_s,
            peers_loaded,
            update,
            waited_through,
        })
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
