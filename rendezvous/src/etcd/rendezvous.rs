//! The [`Rendezvous`] impl of [`Etcd`]: announcing takes a lease, writes the blobs, then claims
//! the rank's record (`lease` owns all of that); receivers list records, fetch blobs at a
//! record's revision and watch for changes.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::WatchOptions;

use reshard_core::rendezvous::{
    Announced, Announcement, Fetched, Holder, Member, ReadClaim, Reading, Rendezvous,
};
use reshard_core::{Error, ErrorKind, OwnerId, Result};

use super::keys::{member_rank, members_prefix, readers_prefix, unescape, ROOT};
use super::lease::Held;
use super::record::parse_record;
use super::{unix_ms, Etcd, FIRST_PAGE_KEYS};

#[async_trait]
impl Rendezvous for Etcd {
    fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    async fn announce(&self, a: Announcement) -> Result<Box<dyn Announced>> {
        Ok(Box::new(Held::announce(self, a).await?))
    }

    async fn members(&self, model: &str) -> Result<(Vec<Member>, u64)> {
        let (kvs, revision) = self
            .list(
                &members_prefix(model),
                false,
                FIRST_PAGE_KEYS,
                "list members at",
            )
            .await?;
        let revision = revision as u64;
        let now = unix_ms();
        let mut members = Vec::with_capacity(kvs.len());
        for kv in &kvs {
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
        // Every record in one range, then every blob at that range's revision, many chunks per
        // request (`get_blobs`): a request per record and per blob cost etcd 4,100 requests per
        // receiver for 1,024 publishers, which held 64 receivers' discovery to 35-47 s
        // (BENCHMARKS.md, "Load held, measured"). One revision for all also makes the set one
        // snapshot: no record is read at another moment than the others.
        let (kvs, revision) = self
            .list(
                &members_prefix(model),
                false,
                FIRST_PAGE_KEYS,
                "read member records from",
            )
            .await?;
        let mut wanted: Vec<OwnerId> = ranks.to_vec();
        wanted.sort_unstable();
        wanted.dedup();
        let mut records = BTreeMap::new();
        for kv in &kvs {
            // Only the canonical key of a wanted rank: another spelling is no record (`keys`).
            let Some(rank) = member_rank(model, kv.key()) else {
                continue;
            };
            if wanted.binary_search(&rank).is_ok() {
                records.insert(rank, kv);
            }
        }
        let mut recs = Vec::with_capacity(wanted.len());
        for &rank in &wanted {
            let kv = records.get(&rank).ok_or_else(|| {
                Error::new(
                    ErrorKind::PeerUnknown,
                    format!(
                        "publisher rank {rank} of model {model:?} is not announced at {}",
                        self.endpoint
                    ),
                )
                .with_owner(rank)
            })?;
            recs.push(parse_record(model, kv.key(), kv.value())?);
        }
        let blobs: Vec<_> = recs
            .iter()
            .flat_map(|rec| [&rec.table, &rec.metadata, &rec.config].map(|b| (rec.rank, b)))
            .collect();
        let mut blobs = self.get_blobs(&blobs, revision).await?.into_iter();
        let mut out = Vec::with_capacity(recs.len());
        for rec in recs {
            let (Some(table), Some(metadata), Some(config)) =
                (blobs.next(), blobs.next(), blobs.next())
            else {
                return Err(Error::new(
                    ErrorKind::Internal,
                    "fewer blobs read than asked for".to_string(),
                ));
            };
            out.push(Fetched {
                announcement: Announcement {
                    model: model.to_string(),
                    rank: rec.rank,
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
            });
        }
        Ok(out)
    }

    async fn changed(&self, model: &str, revision: u64, timeout: Duration) -> Result<u64> {
        self.watch_prefix(members_prefix(model), revision, timeout)
            .await
    }

    async fn models(&self) -> Result<Vec<String>> {
        let (kvs, _) = self
            .list(ROOT, true, FIRST_PAGE_KEYS, "list models at")
            .await?;
        let mut models: Vec<String> = kvs
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
