//! A publisher's hold on its rank: the lease, the keep-alive task that renews it through etcd
//! outages, the claim transaction that makes one process the rank's only holder, and the
//! [`Announced`] handle whose writes land only while this process holds the rank
//! (docs/deployment.md, "Leases through etcd outages" and "One holder per rank").
//!
//! - **Claim**: the member record is created in one transaction, only if its key is absent
//!   (`create_revision == 0`), attached to the lease. When another lease holds the key, the
//!   claimant asks the holder itself: it puts a probe (`probes/<rank>`, a nonce) and the
//!   holder's answering task writes the nonce back under its own lease. An answer through the
//!   lease that holds the key means a live holder (the claim fails, naming it); the lease
//!   expiring means a dead one (the claim is tried again). Liveness is not read from the lease's
//!   remaining TTL: an etcd leader change refreshes every lease's TTL, a dead holder's too, and
//!   a restart across an election was once refused naming its own dead predecessor.
//! - **Writes** (advance, unready, note) are transactions that put the record only while the
//!   key is still attached to this process's lease, so a process that lost its rank never
//!   overwrites the new holder's record; withdrawing revokes this process's own lease, which
//!   deletes only keys attached to it.
//! - **Keep-alive** renews every third of the TTL; a stream that errs or does not answer within
//!   a third of the TTL is opened again (with backoff up to that third, through any endpoint of
//!   the client), and the same lease goes on while etcd has it. When etcd says the lease is gone
//!   (it expired while etcd was out of reach longer than the TTL), the same incarnation is
//!   announced again under a new lease: its metadata, config and table blobs written anew, the
//!   record claimed with the same step, readiness and note. If another live process holds the
//!   rank by then, the hold is lost for good: every call fails naming that holder.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use etcd_client::{
    Compare, CompareOp, DeleteOptions, EventType, PutOptions, Txn, TxnOp, TxnOpResponse,
    WatchOptions,
};
use parking_lot::Mutex;

use reshard_core::rendezvous::{clip_note, Announced, Announcement, Holder};
use reshard_core::{Error, ErrorKind, OwnerId, Result};

use super::keys::{blob_prefix, member_key, probe_key};
use super::record::{parse_record, BlobRef, Record};
use super::{unix_ms, Etcd};
use crate::holder;

/// How often a claim looks again at the lease of a rank's other holder.
const HOLDER_POLL: Duration = Duration::from_millis(200);

/// How long past its granted TTL another holder's lease may still exist before the claim
/// counts it renewed (etcd revokes expired leases on a half-second tick, then through Raft).
const EXPIRY_SLACK: Duration = Duration::from_secs(2);

/// What a probe of a rank's holder says (followed by its nonce), and what the holder's answer
/// says (followed by the same nonce).
const PROBE: &[u8] = b"probe:";
const ANSWER: &[u8] = b"answer:";

/// The least time a write is tried again for while etcd fails transiently: an election takes
/// about a second (docs/deployment.md, "An etcd cluster").
const WRITE_RETRY_FOR: Duration = Duration::from_secs(2);

/// How long one attempt at writing a rank's record may go unanswered before it is abandoned
/// and tried again. A write that reaches a member whose leader just died waits there for etcd's
/// own request timeout (about 7 s; docs/deployment.md, "The chaos run") although a new leader is
/// elected in about a second, and one sent to a stopped member waits for the client's request
/// timeout. Abandoning is safe although etcd may still apply the abandoned requests, even after
/// later writes (one queued at a stopped member runs when it runs again): the record's put is
/// guarded by the revision it follows, so a late one is refused (`Etcd::put_held`), and a retry
/// that finds its own record already there takes it as written. A late blob put can only leave
/// an orphaned table under this rank's lease, which goes with the lease.
const WRITE_ATTEMPT_FOR: Duration = Duration::from_secs(2);

/// The first pause before a broken keep-alive stream is opened again (doubling up to a third
/// of the TTL).
const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// Whether `e` (a failed request) says the lease it named does not exist (any more).
pub(super) fn lease_not_found(e: &Error) -> bool {
    e.message().contains("lease not found")
}

/// The revision a transaction committed at: the revision of every key it put.
fn txn_revision(r: &etcd_client::TxnResponse) -> i64 {
    r.header().map_or(0, |h| h.revision())
}

/// The key a failed guarded write read back instead (its transaction's `Get`), if it exists.
fn read_back(r: etcd_client::TxnResponse) -> Option<etcd_client::KeyValue> {
    r.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Get(g) => g.kvs().first().cloned(),
        _ => None,
    })
}

/// What a claim found.
enum Claimed {
    /// The record is written, attached to the lease: the key's revision.
    Written(i64),
    /// Another live process holds the rank: the error says who.
    Held(Error),
}

impl Etcd {
    /// `record` as the JSON value of its member key, after the checks every receiver runs on it
    /// (a limit fails here, naming the field, not at every receiver).
    fn encode_record(&self, model: &str, record: &Record) -> Result<Vec<u8>> {
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
        serde_json::to_vec(record)
            .map_err(|e| Error::new(ErrorKind::Internal, format!("member record to JSON: {e}")))
    }

    /// Puts `value` at `key`, attached to `lease`, if every comparison of `when` holds, else
    /// reads the key back (one transaction); etcd's answer. `what` names the request in errors.
    async fn put_attached_if(
        &self,
        what: &str,
        key: &str,
        value: &[u8],
        lease: i64,
        when: Vec<Compare>,
    ) -> Result<etcd_client::TxnResponse> {
        let txn = Txn::new()
            .when(when)
            .and_then([TxnOp::put(
                key,
                value,
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(key, None)]);
        self.client
            .clone()
            .txn(txn)
            .await
            .map_err(|e| self.err(what, e))
    }

    /// Puts `record` only while its key is attached to `lease` and, given `after`, was last
    /// written at revision `after`: the key's revision after the put, or `None` when the key is
    /// gone or another process's lease holds it. A refused put whose key already holds exactly
    /// `record` under `lease` counts as written: an earlier attempt of the same write committed
    /// and its answer was lost or abandoned.
    ///
    /// `after` is what keeps a stale attempt from landing late. An abandoned attempt can sit in
    /// a stopped etcd member's queue and be applied once the member runs again, after later
    /// writes of this rank; guarded by the revision it was meant to follow, it is refused
    /// instead of putting an old step back (whose table blobs a later write deleted).
    async fn put_held(
        &self,
        model: &str,
        record: &Record,
        lease: i64,
        after: Option<i64>,
    ) -> Result<Option<i64>> {
        let key = member_key(model, record.rank);
        let value = self.encode_record(model, record)?;
        let mut when = vec![Compare::lease(key.clone(), CompareOp::Equal, lease)];
        if let Some(rev) = after {
            when.push(Compare::mod_revision(key.clone(), CompareOp::Equal, rev));
        }
        let r = self
            .put_attached_if("write a member record to", &key, &value, lease, when)
            .await?;
        if r.succeeded() {
            return Ok(Some(txn_revision(&r)));
        }
        Ok(read_back(r)
            .filter(|kv| kv.lease() == lease && kv.value() == value.as_slice())
            .map(|kv| kv.mod_revision()))
    }

    /// The remaining TTL of `lease` in whole seconds (rounded down: 0 for a live lease with
    /// under a second left) and its granted TTL, or `None` when etcd has no such lease (it
    /// answers -1) or it expired a second ago and awaits revocation.
    async fn lease_ttl(&self, lease: i64) -> Result<Option<(i64, i64)>> {
        let r = self
            .client
            .clone()
            .lease_time_to_live(lease, None)
            .await
            .map_err(|e| self.err("read a lease's time to live at", e))?;
        Ok((r.ttl() >= 0).then(|| (r.ttl(), r.granted_ttl())))
    }

    /// Revokes `lease`; one etcd no longer has counts as revoked.
    async fn revoke(&self, lease: i64) -> Result<()> {
        match self.client.clone().lease_revoke(lease).await {
            Ok(_) => Ok(()),
            Err(e) => {
                let e = self.err("revoke a lease at", e);
                if lease_not_found(&e) {
                    Ok(())
                } else {
                    Err(e)
                }
            }
        }
    }

    /// Creates `record`'s member key attached to `lease` if it is absent (one transaction).
    /// When another lease holds the key, its holder is probed (module doc): once that lease is
    /// gone the claim is tried again; once the holder answers (or its lease outlives twice its
    /// TTL unanswered), the holder is live and the rank is [`Claimed::Held`]. `lease` is
    /// renewed meanwhile (the wait can outlast it). Errors are etcd's (unreachable, ...).
    async fn claim(
        &self,
        model: &str,
        record: &Record,
        lease: i64,
        hand_over: bool,
    ) -> Result<Claimed> {
        tokio::select! {
            claimed = self.claim_waiting(model, record, lease, hand_over) => claimed,
            never = self.renew_while_waiting(lease) => match never {},
        }
    }

    /// Renews `lease` every third of the TTL, forever; failures are left to the claim's own
    /// requests to report.
    async fn renew_while_waiting(&self, lease: i64) -> std::convert::Infallible {
        let period = (self.options.lease_ttl / 3).max(Duration::from_millis(100));
        loop {
            tokio::time::sleep(period).await;
            // Opening a keep-alive stream renews once and reads the answer.
            let _ = tokio::time::timeout(period, self.client.clone().lease_keep_alive(lease)).await;
        }
    }

    /// [`Etcd::claim`] without the renewal.
    async fn claim_waiting(
        &self,
        model: &str,
        record: &Record,
        lease: i64,
        hand_over: bool,
    ) -> Result<Claimed> {
        let key = member_key(model, record.rank);
        let value = self.encode_record(model, record)?;
        // The probe of the holder of the moment: its lease, nonce and when it was put.
        let probe = probe_key(model, record.rank);
        let mut probing: Option<Probing> = None;
        let mut probes = 0u64;
        loop {
            let absent = Compare::create_revision(key.clone(), CompareOp::Equal, 0);
            let r = self
                .put_attached_if(
                    "claim a member record at",
                    &key,
                    &value,
                    lease,
                    vec![absent],
                )
                .await?;
            if r.succeeded() {
                return Ok(Claimed::Written(txn_revision(&r)));
            }
            let Some(kv) = read_back(r) else {
                continue; // deleted between the compare and the read: try again
            };
            let other = kv.lease();
            if other == lease {
                // Already ours (a claim whose answer was lost): a guarded write finishes it.
                if let Some(rev) = self.put_held(model, record, lease, None).await? {
                    return Ok(Claimed::Written(rev));
                }
                continue;
            }
            let found = parse_record(model, kv.key(), kv.value()).ok();
            if hand_over
                && found.as_ref().is_some_and(|f| {
                    (f.incarnation, &f.host, f.pid)
                        == (record.incarnation, &record.host, record.pid)
                })
            {
                // This very process holds the rank under another of its leases (a bare claim
                // becoming an announcement): the record moves to `lease` in one transaction
                // guarded by the revision just read, so no other claimant can take the rank
                // in between, as it could between a withdrawal and a new claim.
                let unchanged =
                    Compare::mod_revision(key.clone(), CompareOp::Equal, kv.mod_revision());
                let r = self
                    .put_attached_if(
                        "hand a member record over at",
                        &key,
                        &value,
                        lease,
                        vec![unchanged],
                    )
                    .await?;
                if r.succeeded() {
                    return Ok(Claimed::Written(txn_revision(&r)));
                }
                continue; // changed since it was read: look again
            }
            let who = holder::describe(
                found.as_ref().map(|r| r.incarnation),
                found
                    .as_ref()
                    .filter(|r| !r.host.is_empty() || r.pid != 0)
                    .map(|r| Holder {
                        host: r.host.clone(),
                        pid: r.pid,
                    })
                    .as_ref(),
            );
            if other == 0 {
                let why = "its record is on no lease and never expires";
                return Ok(Claimed::Held(holder::rank_held(
                    model,
                    record.rank,
                    &who,
                    why,
                )));
            }
            let Some((_, granted)) = self.lease_ttl(other).await? else {
                // Expired: etcd deletes its keys with it; the next claim finds the key absent.
                tokio::time::sleep(HOLDER_POLL / 4).await;
                continue;
            };
            let now = Instant::now();
            match &probing {
                Some(p) if p.lease == other => {
                    if self.answered(&probe, &p.nonce, other).await? {
                        return Ok(Claimed::Held(holder::rank_held(
                            model,
                            record.rank,
                            &who,
                            &format!(
                                "it answered this process's probe through its lease {other:x}"
                            ),
                        )));
                    }
                    // A holder that never answers while its lease lives on (a reshard that
                    // answers no probes, or an endless run of elections each refreshing a
                    // dead holder's TTL): past twice its TTL, counted live as before probes.
                    let patience = 2 * Duration::from_secs(granted.max(0) as u64) + EXPIRY_SLACK;
                    if now.duration_since(p.since) > patience {
                        return Ok(Claimed::Held(holder::rank_held(
                            model,
                            record.rank,
                            &who,
                            &format!(
                                "its lease {other:x} lived {:.0} s past this process's probe, \
                                 unanswered",
                                patience.as_secs_f64()
                            ),
                        )));
                    }
                }
                _ => {
                    probes += 1;
                    let nonce = format!("{:016x}-{probes}", record.incarnation).into_bytes();
                    let mut value = PROBE.to_vec();
                    value.extend_from_slice(&nonce);
                    self.client
                        .clone()
                        .put(
                            probe.clone(),
                            value,
                            Some(PutOptions::new().with_lease(lease)),
                        )
                        .await
                        .map_err(|e| self.err("probe a rank's holder at", e))?;
                    probing = Some(Probing {
                        lease: other,
                        nonce,
                        since: now,
                    });
                }
            }
            tokio::time::sleep(HOLDER_POLL).await;
        }
    }
}

/// A claimant's probe of a rank's holder ([`Etcd::claim`]).
struct Probing {
    /// The lease that held the rank's key when the probe was put.
    lease: i64,
    /// What the holder must write back.
    nonce: Vec<u8>,
    /// When the probe was put.
    since: Instant,
}

impl Etcd {
    /// Whether the holder on `lease` answered the probe `nonce` at key `probe`: the answer is
    /// written under the lease that holds the rank, so only the live holder can give it.
    async fn answered(&self, probe: &str, nonce: &[u8], lease: i64) -> Result<bool> {
        let r = self
            .client
            .clone()
            .get(probe, None)
            .await
            .map_err(|e| self.err("read a probe's answer at", e))?;
        Ok(r.kvs().first().is_some_and(|kv| {
            kv.lease() == lease && kv.value().strip_prefix(ANSWER) == Some(nonce)
        }))
    }
}

/// Answers claimants' probes of this rank's holder for as long as the hold lives: each probe
/// put at `probes/<rank>` is written back as an answer with its nonce, under the current lease
/// (the one the member key is attached to). A rank lost for good is not answered for. The watch
/// is opened again after a failure; a probe put while none ran is seen by the look that starts
/// each watch.
async fn answer_probes(shared: Arc<Shared>) {
    let key = probe_key(&shared.model, shared.rank);
    let mut pause = FIRST_BACKOFF;
    loop {
        let mut client = shared.etcd.client.clone();
        let watched = async {
            let r = client.get(key.clone(), None).await?;
            let revision = r.header().map_or(0, |h| h.revision());
            if let Some(kv) = r.kvs().first() {
                answer(&shared, &key, kv.value()).await;
            }
            let mut stream = client
                .watch(
                    key.clone(),
                    Some(WatchOptions::new().with_start_revision(revision + 1)),
                )
                .await?;
            while let Some(r) = stream.message().await? {
                for event in r.events() {
                    if let (EventType::Put, Some(kv)) = (event.event_type(), event.kv()) {
                        answer(&shared, &key, kv.value()).await;
                    }
                }
            }
            Ok::<(), etcd_client::Error>(())
        };
        if watched.await.is_ok() {
            pause = FIRST_BACKOFF;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// Writes the answer to `value` at `key` when it is a probe (a failed write is the
/// claimant's to wait through: it probes until the lease expires or answers).
async fn answer(shared: &Shared, key: &str, value: &[u8]) {
    let Some(nonce) = value.strip_prefix(PROBE) else {
        return;
    };
    let lease = shared.lease.load(Ordering::SeqCst);
    if lease == 0 || shared.fatal.lock().is_some() {
        return;
    }
    let mut answer = ANSWER.to_vec();
    answer.extend_from_slice(nonce);
    let mut client = shared.etcd.client.clone();
    let put = client.put(key, answer, Some(PutOptions::new().with_lease(lease)));
    match tokio::time::timeout(WRITE_ATTEMPT_FOR, put).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::debug!("publisher rank {}: a probe's answer: {e}", shared.rank),
        Err(_) => tracing::debug!("publisher rank {}: a probe's answer timed out", shared.rank),
    }
}

/// What the rank's record says now, and the lease it is attached to.
struct State {
    /// The lease the record is attached to (gone from etcd while a re-announcement is due).
    lease: i64,
    /// The record as last written under `lease`.
    record: Record,
    /// The table `record.table` refers to, to write again under a new lease.
    table: Bytes,
    /// The member key's revision after `record` was written: the next write is put only over
    /// it (`Etcd::put_held`).
    revision: i64,
}

/// What the handle and its keep-alive task share.
struct Shared {
    etcd: Etcd,
    model: String,
    rank: OwnerId,
    /// The announcement's metadata and config, written again under every new lease.
    metadata: Bytes,
    config: Bytes,
    /// The current lease, for the keep-alive (`state.lease`, readable without waiting on a
    /// write in progress).
    lease: AtomicI64,
    state: tokio::sync::Mutex<State>,
    /// Why the rank is lost for good (another live process holds it), once it is: the error's
    /// kind and message, given again by every later call.
    fatal: Mutex<Option<(ErrorKind, String)>>,
}

/// A publisher's hold on its rank: the shared state and the keep-alive task.
pub(super) struct Held {
    shared: Arc<Shared>,
    keeper: tokio::task::JoinHandle<()>,
    /// Answers claimants' probes ([`answer_probes`]).
    answerer: tokio::task::JoinHandle<()>,
}

impl Drop for Held {
    fn drop(&mut self) {
        // Without a keep-alive the lease runs out and etcd removes every key of this publisher,
        // as for a killed one; `withdraw` revokes it at once instead. Nobody answers for it.
        self.keeper.abort();
        self.answerer.abort();
    }
}

impl Held {
    /// Announces `a`: a new lease, its blobs, then the claim of its rank. Fails naming the
    /// holder when another live process holds the rank.
    pub(super) async fn announce(etcd: &Etcd, a: Announcement) -> Result<Held> {
        a.check()?;
        let me = holder::this_process();
        let record = Record {
            rank: a.rank,
            world: a.world,
            step: a.step,
            // An empty table claims the rank with no step to serve (`Announcement::table`).
            ready: !a.table.is_empty(),
            transport: a.transport.clone(),
            incarnation: a.incarnation,
            host: me.host,
            pid: me.pid,
            granted_unix_ms: 0,
            table: BlobRef::default(),
            metadata: BlobRef::default(),
            config: BlobRef::default(),
            note: None,
        };
        let shared = Shared {
            etcd: etcd.clone(),
            model: a.model,
            rank: a.rank,
            metadata: a.metadata,
            config: a.config,
            lease: AtomicI64::new(0),
            state: tokio::sync::Mutex::new(State {
                lease: 0,
                record: record.clone(),
                table: a.table.clone(),
                revision: 0,
            }),
            fatal: Mutex::new(None),
        };
        let state = shared.establish(record, a.table, true).await??;
        shared.lease.store(state.lease, Ordering::SeqCst);
        *shared.state.lock().await = state;
        let shared = Arc::new(shared);
        let keeper = tokio::spawn(keep_alive(shared.clone(), etcd.options.lease_ttl));
        let answerer = tokio::spawn(answer_probes(shared.clone()));
        Ok(Held {
            shared,
            keeper,
            answerer,
        })
    }
}

impl Shared {
    /// The error every call returns once the rank is lost for good.
    fn check_fatal(&self) -> Result<()> {
        match &*self.fatal.lock() {
            None => Ok(()),
            Some((kind, msg)) => Err(Error::new(*kind, msg.clone()).with_owner(self.rank)),
        }
    }

    /// Announces `record` (step, readiness, note as given) under a new lease: grants it, writes
    /// the metadata, config and `table` blobs under it, then claims the rank; with `hand_over`
    /// (a first announcement, never a recovery, so an old handle cannot take the rank back) a
    /// record this very process holds under another lease moves to the new one. The outer error is
    /// etcd's; the inner one says another live process holds the rank. On any failure the new
    /// lease is revoked (best effort: it would expire anyway).
    async fn establish(
        &self,
        mut record: Record,
        table: Bytes,
        hand_over: bool,
    ) -> Result<std::result::Result<State, Error>> {
        let ttl = self.etcd.options.lease_ttl.as_secs().max(1) as i64;
        let lease = self
            .etcd
            .client
            .clone()
            .lease_grant(ttl, None)
            .await
            .map_err(|e| self.etcd.err("grant a lease at", e))?
            .id();
        let written = async {
            let (model, rank) = (&self.model, self.rank);
            let meta = blob_prefix(model, rank, lease, "metadata");
            record.metadata = self.etcd.put_blob(meta, &self.metadata, lease).await?;
            let config = blob_prefix(model, rank, lease, "config");
            record.config = self.etcd.put_blob(config, &self.config, lease).await?;
            let name = format!("table-{:020}", record.step);
            let prefix = blob_prefix(model, rank, lease, &name);
            record.table = self.etcd.put_blob(prefix, &table, lease).await?;
            record.granted_unix_ms = unix_ms();
            self.etcd.claim(model, &record, lease, hand_over).await
        }
        .await;
        match written {
            Ok(Claimed::Written(revision)) => Ok(Ok(State {
                lease,
                record,
                table,
                revision,
            })),
            Ok(Claimed::Held(e)) => {
                let _ = self.etcd.revoke(lease).await;
                Ok(Err(e))
            }
            Err(e) => {
                let _ = self.etcd.revoke(lease).await;
                Err(e)
            }
        }
    }

    /// Makes etcd say `next` (with `table`) for this rank after a guarded write found the key
    /// not attached to `state.lease`: claimed again under the same lease while etcd still has
    /// it (the key was deleted), else announced again under a new lease. Another live holder
    /// makes the loss final (`fatal`). `state` changes only on success.
    async fn recover(&self, state: &mut State, next: Record, table: Bytes) -> Result<()> {
        let lease = state.lease;
        let outcome = if self.etcd.lease_ttl(lease).await?.is_some() {
            // The lease lives (the key alone was deleted): its metadata and config are there;
            // the table is written again, as `next` may name a step whose table was not.
            let mut next = next;
            let name = format!("table-{:020}", next.step);
            let prefix = blob_prefix(&self.model, self.rank, lease, &name);
            next.table = self.etcd.put_blob(prefix, &table, lease).await?;
            match self.etcd.claim(&self.model, &next, lease, false).await? {
                Claimed::Written(revision) => Ok(State {
                    lease,
                    record: next,
                    table,
                    revision,
                }),
                Claimed::Held(e) => Err(e),
            }
        } else {
            self.establish(next, table, false).await?
        };
        match outcome {
            Ok(s) => {
                if s.lease != lease {
                    tracing::warn!(
                        endpoint = %self.etcd.endpoint,
                        "publisher rank {} of model {:?}: lease {lease:x} expired while etcd was \
                         out of reach; announced again under lease {:x}, incarnation {:016x}, \
                         step {}",
                        self.rank, self.model, s.lease, s.record.incarnation, s.record.step
                    );
                }
                self.lease.store(s.lease, Ordering::SeqCst);
                *state = s;
                Ok(())
            }
            Err(held) => {
                let e = Error::new(
                    held.kind(),
                    format!(
                        "publisher rank {} of model {:?} lost its rank while its lease {lease:x} \
                         was gone: {}",
                        self.rank,
                        self.model,
                        held.message()
                    ),
                )
                .with_owner(self.rank);
                tracing::error!(endpoint = %self.etcd.endpoint, "{e}");
                *self.fatal.lock() = Some((e.kind(), e.message().to_string()));
                Err(e)
            }
        }
    }

    /// [`Shared::write_once`], tried again with backoff while etcd fails transiently (a
    /// `Transport` or `Timeout` error: a leader election, a member going down), for up to a
    /// third of the TTL and at least [`WRITE_RETRY_FOR`] after a first attempt's own bound
    /// ([`WRITE_ATTEMPT_FOR`]); then the error is the caller's to retry later (`reshard publish`
    /// defers the write to its next look).
    async fn write(&self, next: Record, new_table: Option<Bytes>) -> Result<()> {
        // The first attempt's bound comes on top: an attempt abandoned because it reached a
        // member whose leader had just died must still be followed by one through the new
        // leader (issue 42: it used the whole window, so the write failed after 2 s).
        let until = Instant::now()
            + (self.etcd.options.lease_ttl / 3).max(WRITE_RETRY_FOR)
            + WRITE_ATTEMPT_FOR.min(self.etcd.options.request_timeout);
        let mut pause = FIRST_BACKOFF;
        loop {
            match self.write_once(next.clone(), new_table.clone()).await {
                Err(e)
                    if matches!(e.kind(), ErrorKind::Transport | ErrorKind::Timeout)
                        && self.fatal.lock().is_none()
                        && Instant::now() + pause < until =>
                {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                r => return r,
            }
        }
    }

    /// Writes `next` as the rank's record (with `new_table` as its table, written first, when
    /// given) under the current lease, recovering the hold when the key is no longer attached
    /// to it. `state` changes only on success; etcd's errors are returned as they are.
    async fn write_once(&self, next: Record, new_table: Option<Bytes>) -> Result<()> {
        let mut state = self.state.lock().await;
        self.check_fatal()?;
        // `next` was copied from the record before this lock was taken (`current`), and the
        // keep-alive may have announced again under a new lease since, its blobs under new keys
        // and the old ones gone with the old lease. So only what a write changes (step,
        // readiness, note) comes from `next`; the rest, the blob references first, from the
        // record as it is now. (The chaos run caught the race: a publisher stopped for two TTLs
        // wrote its next step naming the expired lease's blobs, and no receiver could fetch it.)
        let mut next = Record {
            step: next.step,
            ready: next.ready,
            note: next.note,
            ..state.record.clone()
        };
        let lease = state.lease;
        let table = new_table.clone().unwrap_or_else(|| state.table.clone());
        let old = state.record.table.prefix.clone();
        let after = state.revision;
        let bound = WRITE_ATTEMPT_FOR.min(self.etcd.options.request_timeout);
        let attempt = self
            .etcd
            .bounded("write a member record to", bound, async {
                if let Some(t) = &new_table {
                    let name = format!("table-{:020}", next.step);
                    let prefix = blob_prefix(&self.model, self.rank, lease, &name);
                    next.table = self.etcd.put_blob(prefix, t, lease).await?;
                }
                self.etcd
                    .put_held(&self.model, &next, lease, Some(after))
                    .await
            })
            .await;
        match attempt {
            Ok(Some(revision)) => {
                let new = next.table.prefix.clone();
                state.record = next;
                state.table = table;
                state.revision = revision;
                // An empty prefix is the first table's absent predecessor (and would delete
                // every key). Readers of the previous record read at its revision, where these
                // keys still are.
                if !old.is_empty() && old != new {
                    if let Err(e) = self
                        .etcd
                        .client
                        .clone()
                        .delete(old.clone(), Some(DeleteOptions::new().with_prefix()))
                        .await
                    {
                        // Attached to this lease: they go with it at the latest.
                        tracing::warn!("could not delete the old table {old}: {e}");
                    }
                }
                Ok(())
            }
            Ok(None) => self.recover(&mut state, next, table).await,
            Err(e) if lease_not_found(&e) => self.recover(&mut state, next, table).await,
            Err(e) => Err(e),
        }
    }

    /// A copy of the record as last written.
    async fn current(&self) -> Record {
        self.state.lock().await.record.clone()
    }
}

#[async_trait]
impl Announced for Held {
    async fn unready(&self) -> Result<()> {
        let mut next = self.shared.current().await;
        next.ready = false;
        self.shared.write(next, None).await
    }

    async fn advance(&self, step: u64, table: Bytes) -> Result<()> {
        let mut next = self.shared.current().await;
        next.step = step;
        next.ready = true;
        self.shared.write(next, Some(table)).await
    }

    async fn set_note(&self, note: Option<String>) -> Result<()> {
        let mut next = self.shared.current().await;
        next.note = note.as_deref().map(clip_note);
        self.shared.write(next, None).await
    }

    fn check_alive(&self) -> Result<()> {
        self.shared.check_fatal()
    }

    async fn withdraw(self: Box<Self>) -> Result<()> {
        // Revoking the lease is the removal: etcd deletes every key attached to it (the record
        // and its blobs) at once, so no reader sees half an announcement. Only this process's
        // lease: a rank another process holds now keeps its record.
        self.keeper.abort();
        self.answerer.abort();
        let state = self.shared.state.lock().await;
        self.shared.etcd.revoke(state.lease).await
    }
}

/// Why one keep-alive stream ended.
enum Ended {
    /// etcd says the lease does not exist (any more).
    Gone,
    /// The current lease is another one now (a write announced again).
    Replaced,
    /// The stream failed or went silent: open it again.
    Broken(String),
}

/// An outage of the keep-alive, said once when it starts and once when it ends.
struct Outage {
    since: Option<Instant>,
    backoff: Duration,
}

impl Outage {
    /// etcd answered: an outage in progress is over.
    fn answered(&mut self, shared: &Shared, lease: i64) {
        if let Some(since) = self.since.take() {
            tracing::warn!(
                endpoint = %shared.etcd.endpoint,
                "publisher rank {} of model {:?}: lease {lease:x} renewed again after {:.1} s",
                shared.rank, shared.model, since.elapsed().as_secs_f64()
            );
        }
        self.backoff = FIRST_BACKOFF;
    }

    /// Something failed (`why`): says so when an outage starts; returns the pause before the
    /// next try, and doubles it up to `cap`.
    fn failed(&mut self, shared: &Shared, why: &str, cap: Duration) -> Duration {
        if self.since.is_none() {
            tracing::warn!(
                endpoint = %shared.etcd.endpoint,
                "publisher rank {} of model {:?}: {why}; trying again every {:?} at most",
                shared.rank, shared.model, cap
            );
            self.since = Some(Instant::now());
        }
        let pause = self.backoff;
        self.backoff = (self.backoff * 2).min(cap);
        pause
    }
}

/// Renews `lease` on one keep-alive stream every `period` until something ends it.
async fn renew(shared: &Shared, lease: i64, period: Duration, outage: &mut Outage) -> Ended {
    let mut client = shared.etcd.client.clone();
    // Opening sends the first renewal and reads its answer.
    let (mut keeper, mut stream) =
        match tokio::time::timeout(period, client.lease_keep_alive(lease)).await {
            Err(_) => return Ended::Broken(format!("no answer within {period:?}")),
            Ok(Err(e)) => {
                let e = shared.etcd.err("keep a lease alive at", e);
                return if lease_not_found(&e) {
                    Ended::Gone
                } else {
                    Ended::Broken(e.to_string())
                };
            }
            Ok(Ok(opened)) => opened,
        };
    outage.answered(shared, lease);
    loop {
        tokio::time::sleep(period).await;
        if shared.lease.load(Ordering::SeqCst) != lease {
            return Ended::Replaced;
        }
        if let Err(e) = keeper.keep_alive().await {
            return Ended::Broken(e.to_string());
        }
        match tokio::time::timeout(period, stream.message()).await {
            Ok(Ok(Some(r))) if r.ttl() > 0 => {}
            Ok(Ok(Some(_))) => return Ended::Gone,
            Ok(Ok(None)) => return Ended::Broken("the keep-alive stream ended".into()),
            Ok(Err(e)) => return Ended::Broken(e.to_string()),
            Err(_) => return Ended::Broken(format!("no answer within {period:?}")),
        }
    }
}

/// Holds the rank for as long as the handle lives: renews the lease every third of `ttl`,
/// opens the stream again with backoff (up to that third, so a renewal lands within the TTL
/// once etcd answers) when it breaks, and announces again under a new lease when etcd says
/// the lease is gone. Ends only when the rank is lost for good.
async fn keep_alive(shared: Arc<Shared>, ttl: Duration) {
    let period = (ttl / 3).max(Duration::from_millis(100));
    let mut outage = Outage {
        since: None,
        backoff: FIRST_BACKOFF,
    };
    loop {
        if shared.fatal.lock().is_some() {
            return;
        }
        let lease = shared.lease.load(Ordering::SeqCst);
        let pause = match renew(&shared, lease, period, &mut outage).await {
            Ended::Replaced => Duration::ZERO,
            Ended::Broken(why) => {
                let why = format!("keeping lease {lease:x} alive failed ({why})");
                outage.failed(&shared, &why, period)
            }
            Ended::Gone => {
                let mut state = shared.state.lock().await;
                if state.lease != lease {
                    Duration::ZERO // a write already announced again
                } else {
                    let (next, table) = (state.record.clone(), state.table.clone());
                    match shared.recover(&mut state, next, table).await {
                        Ok(()) => {
                            outage.answered(&shared, lease);
                            Duration::ZERO
                        }
                        Err(_) if shared.fatal.lock().is_some() => return,
                        Err(e) => {
                            let why = format!("announcing again after lease {lease:x} ({e})");
                            outage.failed(&shared, &why, period)
                        }
                    }
                }
            }
        };
        tokio::time::sleep(pause).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EtcdOptions;
    use reshard_core::rendezvous::Rendezvous;
    use std::process::Command;

    /// An etcd of this test binary (scripts/etcd.sh, stopped by the script's watcher when the
    /// binary exits), or `None`, loudly, where etcd is missing and not required (CI requires it).
    fn private_etcd(name: &str) -> Option<String> {
        if Command::new("etcd").arg("--version").output().is_err() {
            assert!(
                std::env::var_os("RESHARD_REQUIRE_BACKENDS").is_none(),
                "etcd is required here: run scripts/install-deps.sh"
            );
            eprintln!("SKIPPED: etcd is not installed (scripts/install-deps.sh installs it)");
            return None;
        }
        let dir = std::env::temp_dir().join(format!("reshard-{name}-{}", std::process::id()));
        let out = Command::new("bash")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/etcd.sh"))
            .arg("start")
            .arg(&dir)
            .env("ETCD_OWNER_PID", std::process::id().to_string())
            .output()
            .expect("run scripts/etcd.sh");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(String::from_utf8(out.stdout).unwrap().trim().to_string())
    }

    /// Rank 0 of 1 of `model` at step 1, as the tests here announce it.
    fn step_one(model: &str) -> Announcement {
        Announcement {
            model: model.into(),
            rank: 0,
            world: 1,
            step: 1,
            transport: "loopback".into(),
            incarnation: 7,
            table: Bytes::from_static(b"table 1"),
            metadata: Bytes::from_static(b"meta 0"),
            config: Bytes::from_static(b"{}"),
        }
    }

    /// A write whose record was copied (`current`) before the keep-alive announced the rank
    /// again under a new lease names the new lease's blobs, not the ones etcd deleted with the
    /// old lease: a receiver can fetch what it wrote. The chaos run found this race (a publisher
    /// SIGSTOPped for two TTLs: on SIGCONT its keep-alive and its next step's write both woke).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_copied_before_the_rank_was_announced_again_names_the_new_blobs() {
        let Some(url) = private_etcd("stale-write") else {
            return;
        };
        let options = EtcdOptions {
            lease_ttl: Duration::from_secs(3),
            ..EtcdOptions::default()
        };
        let etcd = Etcd::connect(&url, options).await.unwrap();
        let model = "stale-write";
        let held = Held::announce(&etcd, step_one(model)).await.unwrap();
        // The next step's record, copied now, as `advance` does before it writes.
        let mut next = held.shared.current().await;
        (next.step, next.ready) = (2, true);
        // etcd lets the lease go (as after a pause longer than the TTL): the record and its
        // blobs go with it, and the keep-alive announces the rank again under a new lease.
        let first = held.shared.lease.load(Ordering::SeqCst);
        etcd.revoke(first).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while held.shared.lease.load(Ordering::SeqCst) == first {
            assert!(
                Instant::now() < deadline,
                "the keep-alive never announced again"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        held.shared
            .write(next, Some(Bytes::from_static(b"table 2")))
            .await
            .unwrap();
        let fetched = etcd
            .fetch(model, &[0])
            .await
            .expect("the record names blobs that exist");
        let a = &fetched[0].announcement;
        assert_eq!((a.step, a.incarnation), (2, 7));
        assert_eq!(
            (&a.table[..], &a.metadata[..]),
            (&b"table 2"[..], &b"meta 0"[..])
        );
    }

    /// The member key's revision in etcd now.
    async fn key_revision(etcd: &Etcd, model: &str) -> i64 {
        let r = etcd.client.clone().get(member_key(model, 0), None).await;
        r.unwrap().kvs()[0].mod_revision()
    }

    /// An abandoned attempt of a record write that etcd applies late (one queued at a stopped
    /// member runs when the member runs again) is refused once a later write landed, so the
    /// record never goes back to an old step whose table blobs are deleted; and a retry that
    /// finds its own abandoned attempt committed takes it as written, without a second put.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_attempt_applied_late_is_refused_and_a_retry_of_a_committed_one_is_done() {
        let Some(url) = private_etcd("late-write") else {
            return;
        };
        let etcd = Etcd::connect(&url, EtcdOptions::default()).await.unwrap();
        let model = "late-write";
        let held = Held::announce(&etcd, step_one(model)).await.unwrap();
        let lease = held.shared.lease.load(Ordering::SeqCst);
        let first = held.shared.state.lock().await.revision;
        assert_eq!(first, key_revision(&etcd, model).await);
        // A note's write, as its abandoned attempt sent it: over the announcement's revision.
        let mut noted = held.shared.current().await;
        noted.note = Some("draining".into());
        let attempt = || etcd.put_held(model, &noted, lease, Some(first));
        // The attempt commits although its caller gave up on it; the retry finds it there.
        let committed = attempt()
            .await
            .unwrap()
            .expect("the first attempt is written");
        held.set_note(Some("draining".into())).await.unwrap();
        assert_eq!(held.shared.state.lock().await.revision, committed);
        assert_eq!(
            key_revision(&etcd, model).await,
            committed,
            "the retry put the record a second time (or announced again)"
        );
        assert_eq!(held.shared.lease.load(Ordering::SeqCst), lease);
        // A later step lands; then the same attempt is applied again, late.
        held.advance(2, Bytes::from_static(b"table 2"))
            .await
            .unwrap();
        let later = key_revision(&etcd, model).await;
        assert_eq!(attempt().await.unwrap(), None, "a late attempt was written");
        assert_eq!(key_revision(&etcd, model).await, later);
        let fetched = etcd
            .fetch(model, &[0])
            .await
            .expect("the record names blobs that exist");
        let a = &fetched[0].announcement;
        assert_eq!((a.step, &a.table[..]), (2, &b"table 2"[..]));
    }
}
