//! The [`Rendezvous`] impl of [`Etcd`]: announcing takes a lease, writes the blobs, then claims
//! the rank's record (`lease` owns all of that); receivers list records, fetch blobs at a
//! record's revision and watch for changes.

use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{GetOptions, WatchOptions};
use futures::{StreamExt, TryStreamExt};

use reshard_core::rendezvous::{
    Announced, Announcement, Fetched, Holder, Member, ReadClaim, Reading, Rendezvous,
};
use reshard_core::{Error, ErrorKind, OwnerId, Result};

use super::keys::{member_key, member_rank, members_prefix, readers_prefix, unescape, ROOT};
use super::lease::Held;
use super::record::parse_record;
use super::{unix_ms, Etcd, FETCH_CONCURRENCY};

#[async_trait]
impl Rendezvous for Etcd {
    fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    async fn announce(&self, a: Announcement) -> Result<Box<dyn Announced>> {
        Ok(Box::new(Held::announce(self, a).await?))
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
                holder: (!rec.host.is_empty() || rec.pid != 0).then_some(Holder {
                    host: rec.host,
                    pid: rec.pid,
                }),
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
        self.watch_prefix(members_prefix(model), revision, timeout)
            .await
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
                let (model, _) = rest.split_once('/')?;
                let model = unescape(model);
                // Only a canonical member key makes a model: a stray `members/3` or garbage
                // under `members/` alone is no publisher.
                member_rank(&model, kv.key()).map(|_| model)
            })
            .collect();
        models.dedup();
        Ok(models)
    }

    async fn claim_reading(&self, claim: ReadClaim) -> Result<Box<dyn Reading>> {
        self.put_claim(claim).await
    }

    async fn readers(&self, model: &str) -> Result<(Vec<ReadClaim>, u64)> {
        self.list_claims(model).await
    }

    async fn readers_changed(&self, model: &str, revision: u64, timeout: Duration) -> Result<u64> {
        self.watch_prefix(readers_prefix(model), revision, timeout)
            .await
    }
}

impl Etcd {
    /// Waits until a key below `prefix` changes after `revision`, or until `timeout` passes;
    /// returns the revision then.
    async fn watch_prefix(&self, prefix: String, revision: u64, timeout: Duration) -> Result<u64> {
        let watch = async {
            let mut stream = self
                .client
                .clone()
                .watch(
                    prefix,
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
}
