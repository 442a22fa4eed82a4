//! A publisher's lease: the keep-alive task that holds it and the [`Announced`] handle that
//! advances, unreadies and withdraws the publisher's record under it (and writes that record).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use etcd_client::{Client, DeleteOptions, PutOptions};
use parking_lot::Mutex;

use reshard_core::rendezvous::{clip_note, Announced};
use reshard_core::{Error, ErrorKind, Result};

use super::keys::{blob_prefix, member_key};
use super::record::Record;
use super::Etcd;

impl Etcd {
    /// Writes `record` as its rank's member record, attached to `lease`, after the checks every
    /// receiver runs on it (a limit fails here, naming the field, not at every receiver).
    pub(super) async fn put_record(&self, model: &str, record: &Record, lease: i64) -> Result<()> {
        record.check(model, record.rank).map_err(|(field, why)| {
            Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "the member record of publisher rank {} of model {model:?} would be refused \
                     by every receiver: field `{field}` {why}",
                    record.rank
                ),
            )
            .with_owner(record.rank)
        })?;
        let value = serde_json::to_vec(record)
            .map_err(|e| Error::new(ErrorKind::Internal, format!("member record to JSON: {e}")))?;
        self.client
            .clone()
            .put(
                member_key(model, record.rank),
                value,
                Some(PutOptions::new().with_lease(lease)),
            )
            .await
            .map_err(|e| self.err("write a member record to", e))?;
        Ok(())
    }
}

/// A publisher's lease and the keep-alive task that holds it.
pub(super) struct Held {
    pub(super) etcd: Etcd,
    pub(super) model: String,
    pub(super) lease: i64,
    pub(super) record: Mutex<Record>,
    /// Why the lease was lost, once it was.
    pub(super) lost: Arc<Mutex<Option<String>>>,
    pub(super) keeper: tokio::task::JoinHandle<()>,
}

impl Drop for Held {
    fn drop(&mut self) {
        // Without a keep-alive the lease runs out and etcd removes every key of this publisher,
        // as for a killed one; `withdraw` revokes it at once instead.
        self.keeper.abort();
    }
}

impl Held {
    fn current(&self) -> Record {
        self.record.lock().clone()
    }
}

#[async_trait]
impl Announced for Held {
    async fn unready(&self) -> Result<()> {
        self.check_alive()?;
        let mut record = self.current();
        record.ready = false;
        self.etcd
            .put_record(&self.model, &record, self.lease)
            .await?;
        *self.record.lock() = record;
        Ok(())
    }

    async fn advance(&self, step: u64, table: Bytes) -> Result<()> {
        self.check_alive()?;
        let mut record = self.current();
        let old = record.table.prefix.clone();
        let name = format!("table-{step:020}");
        let prefix = blob_prefix(&self.model, record.rank, self.lease, &name);
        record.table = self
            .etcd
            .put_blob(prefix.clone(), &table, self.lease)
            .await?;
        record.step = step;
        record.ready = true;
        self.etcd
            .put_record(&self.model, &record, self.lease)
            .await?;
        *self.record.lock() = record;
        // An empty prefix is the first table's absent predecessor (and would delete every key).
        if !old.is_empty() && old != prefix {
            // Readers of the previous record read at its revision, where these keys still are.
            self.etcd
                .client
                .clone()
                .delete(old, Some(DeleteOptions::new().with_prefix()))
                .await
                .map_err(|e| self.etcd.err("delete an old table from", e))?;
        }
        Ok(())
    }

    async fn set_note(&self, note: Option<String>) -> Result<()> {
        self.check_alive()?;
        let mut record = self.current();
        record.note = note.as_deref().map(clip_note);
        self.etcd
            .put_record(&self.model, &record, self.lease)
            .await?;
        *self.record.lock() = record;
        Ok(())
    }

    fn check_alive(&self) -> Result<()> {
        match &*self.lost.lock() {
            None => Ok(()),
            Some(why) => {
                let rank = self.record.lock().rank;
                Err(Error::new(
                    ErrorKind::Transport,
                    format!(
                        "publisher rank {rank} of model {:?} lost its lease at {}: {why}",
                        self.model, self.etcd.endpoint
                    ),
                )
                .with_owner(rank))
            }
        }
    }

    async fn withdraw(self: Box<Self>) -> Result<()> {
        // Revoking the lease is the removal: etcd deletes every key attached to it (the record
        // and its blobs) at once, so no reader sees half an announcement.
        self.keeper.abort();
        self.etcd
            .client
            .clone()
            .lease_revoke(self.lease)
            .await
            .map_err(|e| self.etcd.err("revoke a lease at", e))?;
        Ok(())
    }
}

/// Keeps `lease` alive every third of its TTL; records why in `lost` when it cannot.
pub(super) async fn keep_alive(
    mut client: Client,
    lease: i64,
    ttl: Duration,
    lost: Arc<Mutex<Option<String>>>,
) {
    let why = match client.lease_keep_alive(lease).await {
        Err(e) => format!("keep-alive could not start: {e}"),
        Ok((mut keeper, mut stream)) => {
            let mut tick = tokio::time::interval(ttl / 3);
            loop {
                tick.tick().await;
                if let Err(e) = keeper.keep_alive().await {
                    break format!("keep-alive failed: {e}");
                }
                match stream.message().await {
                    Ok(Some(r)) if r.ttl() > 0 => {}
                    Ok(Some(_)) => break "etcd says the lease expired".to_string(),
                    Ok(None) => break "the keep-alive stream ended".to_string(),
                    Err(e) => break format!("keep-alive failed: {e}"),
                }
            }
        }
    };
    *lost.lock() = Some(why);
}
