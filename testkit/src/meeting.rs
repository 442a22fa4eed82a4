//! Where a rig's publishers and receivers meet: an in-process rendezvous (the hub
//! `reshard refit` runs on), used the way `reshard publish` and `reshard receive` use etcd
//! (docs/deployment.md). Publishers announce their table, transport metadata and architecture;
//! receivers load metadata and take each step's tables only from what [`discover`] returns, so
//! the refit path exercises the same discovery (complete set, one step, never mixed) as a
//! deployment.
//!
//! Publishers in a child process cannot reach a hub in this process: the parent announces on
//! their behalf what the child reported over its control channel.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Mutex;

use reshard_core::encoding::encode_table;
use reshard_core::rendezvous::{discover, Announced, Announcement, Discovered, Rendezvous, Want};
use reshard_core::{Error, ErrorKind, OwnerId, Result, ShardTable, Transport};
use reshard_planner::presets::ModelConfig;
use reshard_rendezvous::InProcess;

/// How long a rig receiver waits for the publishers to be ready at a step by default. Generous:
/// a rig's publishers announce before any receiver looks, so only a broken rig waits this long.
pub const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(60);

/// The rendezvous of one rig's model, and the publishers' announcements on it.
pub struct Meeting {
    hub: Arc<dyn Rendezvous>,
    model: String,
    config: Bytes,
    transport: String,
    timeout: Duration,
    held: Mutex<Vec<Held>>,
}

/// One rank's announcement and the table it last said.
struct Held {
    announced: Box<dyn Announced>,
    table: Bytes,
}

impl Meeting {
    /// A meeting of `model`'s publishers, serving reads over `transport`, on a new in-process
    /// hub.
    pub fn new(model: &ModelConfig, transport: &str) -> Result<Self> {
        Self::on(Arc::new(InProcess::new()), model, transport)
    }

    /// A meeting on `hub` (any rendezvous).
    pub fn on(hub: Arc<dyn Rendezvous>, model: &ModelConfig, transport: &str) -> Result<Self> {
        let config = serde_json::to_vec(model).map_err(|e| {
            Error::new(
                ErrorKind::Internal,
                format!("model {:?} does not serialize: {e}", model.name),
            )
        })?;
        Ok(Self {
            hub,
            model: model.name.clone(),
            config: Bytes::from(config),
            transport: transport.to_string(),
            timeout: DISCOVERY_TIMEOUT,
            held: Mutex::new(Vec::new()),
        })
    }

    /// The meeting with receivers waiting at most `timeout` for a step.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The rendezvous the meeting is on.
    pub fn hub(&self) -> &Arc<dyn Rendezvous> {
        &self.hub
    }

    /// The model name publishers announce under.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Makes the rendezvous say what the publishers hold: the first call announces every rank
    /// (`tables` and `metadata` by rank), later calls advance each rank whose table changed.
    /// A rank is never announced ready at a step its table does not describe.
    pub async fn sync(&self, tables: &[ShardTable], metadata: &[(OwnerId, Bytes)]) -> Result<()> {
        let mut held = self.held.lock().await;
        let world = u32::try_from(tables.len())
            .map_err(|_| Error::new(ErrorKind::InvalidInput, "more than u32 publisher ranks"))?;
        if held.is_empty() {
            for t in tables {
                let rank = t.publisher.rank;
                let md = metadata
                    .iter()
                    .find(|(r, _)| *r == rank)
                    .map(|(_, b)| b.clone())
                    .ok_or_else(|| {
                        Error::new(
                            ErrorKind::Internal,
                            format!("publisher rank {rank} has a table but no transport metadata"),
                        )
                        .with_owner(rank)
                    })?;
                let table = Bytes::from(encode_table(t));
                let announced = self
                    .hub
                    .announce(Announcement {
                        model: self.model.clone(),
                        rank,
                        world,
                        step: t.step,
                        transport: self.transport.clone(),
                        incarnation: t.publisher.incarnation,
                        table: table.clone(),
                        metadata: md,
                        config: self.config.clone(),
                    })
                    .await?;
                held.push(Held { announced, table });
            }
            return Ok(());
        }
        for (h, t) in held.iter_mut().zip(tables) {
            let table = Bytes::from(encode_table(t));
            if table != h.table {
                h.announced.advance(t.step, table.clone()).await?;
                h.table = table;
            }
        }
        Ok(())
    }

    /// Waits for every publisher to be ready at one step above `after` (any step when `None`).
    pub async fn discover(&self, after: Option<u64>) -> Result<Discovered> {
        discover(
            self.hub.as_ref(),
            &Want {
                model: self.model.clone(),
                after_step: after,
                timeout: self.timeout,
            },
        )
        .await
    }

    /// Loads into `receiver` the metadata of every publisher the rendezvous announces, after
    /// checking they serve reads over the receiver's transport.
    pub async fn connect(&self, receiver: &dyn Transport) -> Result<()> {
        let found = self.discover(None).await?;
        for a in &found.announcements {
            check_transport(a, receiver)?;
            receiver.load_peer(a.rank, a.metadata.clone()).await?;
        }
        Ok(())
    }

    /// The encoded tables of the newest complete step above `after`, by rank, checked to be
    /// served over `receiver`'s transport.
    pub async fn tables(&self, after: Option<u64>, receiver: &dyn Transport) -> Result<Vec<Bytes>> {
        let found = self.discover(after).await?;
        found
            .announcements
            .iter()
            .map(|a| check_transport(a, receiver).map(|()| a.table.clone()))
            .collect()
    }
}

fn check_transport(a: &Announcement, receiver: &dyn Transport) -> Result<()> {
    if a.transport == receiver.name() {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::Config,
        format!(
            "publisher rank {} of model {:?} serves reads over {:?}, this receiver uses {:?}",
            a.rank,
            a.model,
            a.transport,
            receiver.name()
        ),
    )
    .with_owner(a.rank))
}
