//! The [`Rendezvous`] impl of [`Etcd`]: announcing takes a lease and writes the blobs, then
//! the record; receivers list records, fetch blobs at a record's revision and watch for changes.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{GetOptions, WatchOptions};
use futures::{StreamExt, TryStreamExt};
use parking_lot::Mutex;

use reshard_core::rendezvous::{Announced, Announcement, Fetched, Member, Rendezvous};
use reshard_core::{Error, ErrorKind, OwnerId, Result};

use super::keys::{blob_prefix, member_key, members_prefix, unescape, ROOT};
use super::lease::{keep_alive, Held};
use super::record::{parse_record, BlobRef, Record};
use super::{unix_ms, Etcd, FETCH_CONCURRENCY};

#[async_trait]
impl Rendezvous for Etcd {
    fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    async fn announce(&self, a: Announcement) -> Result<Box<dyn Announced>> {
        a.check()?;
        let ttl = self.options.lease_ttl;
        let lease = self
            .client
            .clone()
            .lease_grant(ttl.as_secs().max(1) as i64, None)
            .await
            .map_err(|e| self.err("grant a lease at", e))?
            .id();
        let lost = Arc::new(Mutex::new(None));
        let keeper = tokio::spawn(keep_alive(self.client.clone(), lease, ttl, lost.clone()));
        let held = Held {
            etcd: self.clone(),
            model: a.model.clone(),
            lease,
            record: Mutex::new(Record {
                rank: a.rank,
                world: a.world,
                step: a.step,
                ready: true,
                transport: a.transport.clone(),
                incarnation: a.incarnation,
                granted_unix_ms: unix_ms(),
                table: BlobRef::default(),
                metadata: BlobRef::default(),
                config: BlobRef::default(),
                note: None,
            }),
            lost,
            keeper,
        };
        let meta = blob_prefix(&a.model, a.rank, lease, "metadata");
        let metadata = self.put_blob(meta, &a.metadata, lease).await?;
        let config = blob_prefix(&a.model, a.rank, lease, "config");
        let config = self.put_blob(config, &a.config, lease).await?;
        {
            let mut record = held.record.lock();
            record.metadata = metadata;
            record.config = config;
        }
        // `advance` writes the table, then the record that makes it visible.
        held.advance(a.step, a.table).await?;
        Ok(Box::new(held))
    }

    async fn members(&self, model: &str) -> Result<(Vec<Member>, u64)> {
        let r = self
            .client
            .clone()
            .get(members_prefix(model), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.err("list members at", e))?;
        let revision = r.header().map_or(0, |h| h.revision()) as u64;
        let now = unix_ms();
        let mut members = Vec::with_capacity(r.kvs().len());
        for kv in r.kvs() {
            // One bad record (garbage, or a count out of bounds) must not blind every receiver
            // to the other members: it is left out, as a member not yet announced, and logged
            // naming its key and field (docs/bad-input.md, "Rendezvous records").
            let rec = match parse_record(model, kv.key(), kv.value()) {
                Ok(rec) => rec,
                Err(e) => {
                    tracing::warn!(endpoint = %self.endpoint, "skipping a member record: {e}");
                    continue;
                }
            };
            members.push(Member {
                rank: rec.rank,
                world: rec.world,
                step: rec.step,
                ready: rec.ready,
                transport: rec.transport,
                incarnation: rec.incarnation,
                age: Duration::from_millis(now.saturating_sub(rec.granted_unix_ms)),
                table_bytes: rec.table.bytes,
                note: rec.note,
            });
        }
        members.sort_by_key(|m| m.rank);
        Ok((members, revision))
    }

    async fn fetch(&self, model: &str, ranks: &[OwnerId]) -> Result<Vec<Fetched>> {
        let mut out: Vec<Fetched> = futures::stream::iter(ranks.iter().copied())
            .map(|rank| async move {
                let r = self
                    .client
                    .clone()
                    .get(member_key(model, rank), None)
                    .await
                    .map_err(|e| self.err("read a member record from", e))?;
                let revision = r.header().map_or(0, |h| h.revision());
                let kv = r.kvs().first().ok_or_else(|| {
                    Error::new(
                        ErrorKind::PeerUnknown,
                        format!(
                            "publisher rank {rank} of model {model:?} is not announced at {}",
                            self.endpoint
                        ),
                    )
                    .with_owner(rank)
                })?;
                let rec = parse_record(model, kv.key(), kv.value())?;
                let (table, metadata, config) = futures::try_join!(
                    self.get_blob(&rec.table, revision, rank),
                    self.get_blob(&rec.metadata, revision, rank),
                    self.get_blob(&rec.config, revision, rank)
                )?;
                Ok::<_, Error>(Fetched {
                    announcement: Announcement {
                        model: model.to_string(),
                        rank,
                        world: rec.world,
                        step: rec.step,
                        transport: rec.transport,
                        incarnation: rec.incarnation,
                        table,
                        metadata,
                        config,
                    },
                    // The blobs are this record's (read at its revision): its readiness is theirs.
                    ready: rec.ready,
                })
            })
            .buffer_unordered(FETCH_CONCURRENCY)
            .try_collect()
            .await?;
        out.sort_by_key(|f| f.announcement.rank);
        Ok(out)
    }

    async fn changed(&self, model: &str, revision: u64, timeout: Duration) -> Result<u64> {
        let watch = async {
            let mut stream = self
                .client
                .clone()
                .watch(
                    members_prefix(model),
                    Some(
                        WatchOptions::new()
                            .with_prefix()
                            .with_start_revision(revision as i64 + 1),
                    ),
                )
                .await
                .map_err(|e| self.err("watch", e))?;
            loop {
                match stream.message().await.map_err(|e| self.err("watch", e))? {
                    None => {
                        return Err(Error::new(
                            ErrorKind::Transport,
                            format!("the watch on {} ended", self.endpoint),
                        ))
                    }
                    // History compacted past `revision`: report a change so the caller
                    // re-reads the members.
                    Some(r) if r.compact_revision() > 0 => return Ok(r.compact_revision() as u64),
                    Some(r) if !r.events().is_empty() => {
                        return Ok(r.header().map_or(revision + 1, |h| h.revision() as u64))
                    }
                    Some(_) => {}
                }
            }
        };
        match tokio::time::timeout(timeout, watch).await {
            Ok(r) => r,
            Err(_) => Ok(revision),
        }
    }

    async fn models(&self) -> Result<Vec<String>> {
        let r = self
            .client
            .clone()
            .get(ROOT, Some(GetOptions::new().with_prefix().with_keys_only()))
            .await
            .map_err(|e| self.err("list models at", e))?;
        let mut models: Vec<String> = r
            .kvs()
            .iter()
            .filter_map(|kv| {
                let key = std::str::from_utf8(kv.key()).ok()?;
                let rest = key.strip_prefix(ROOT)?;
                let (model, tail) = rest.split_once('/')?;
                tail.starts_with("members/").then(|| unescape(model))
            })
            .collect();
        models.dedup();
        Ok(models)
    }
}
