//! The in-process rendezvous: a hub shared by publishers and receivers of one process. It keeps
//! the etcd implementation's semantics where they matter to a receiver (a revision that grows
//! with every change, announcements that vanish with their lease, a step that is never mixed),
//! so code that works against it works against etcd. A rank has one holder here too: announcing
//! a rank a live handle holds is refused, naming it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::watch;

use reshard_core::rendezvous::{
    clip_note, Announced, Announcement, Fetched, Holder, Member, ReadClaim, Reading, Rendezvous,
};
use reshard_core::{Error, ErrorKind, OwnerId, Result};

use crate::holder;

/// A rendezvous hub in this process; clones share it.
#[derive(Clone)]
pub struct InProcess {
    hub: Arc<Hub>,
}

struct Hub {
    state: Mutex<State>,
    /// This process, the holder of every announcement here.
    holder: Holder,
    /// The hub's revision after each change; `changed` waits on it.
    revision: watch::Sender<u64>,
}

#[derive(Default)]
struct State {
    revision: u64,
    /// Per model: its members by rank, and the revision it last changed at.
    models: BTreeMap<String, Model>,
    /// Per model: the reading claims by id, and the revision they last changed at.
    readers: BTreeMap<String, Readers>,
    next_lease: u64,
}

#[derive(Default)]
struct Readers {
    claims: BTreeMap<u64, ReadClaim>,
    changed_at: u64,
}

#[derive(Default)]
struct Model {
    members: BTreeMap<OwnerId, Entry>,
    changed_at: u64,
}

struct Entry {
    announcement: Announcement,
    ready: bool,
    note: Option<String>,
    lease: u64,
    granted: Instant,
}

impl Default for InProcess {
    fn default() -> Self {
        Self::new()
    }
}

impl InProcess {
    /// An empty hub.
    pub fn new() -> Self {
        Self {
            hub: Arc::new(Hub {
                state: Mutex::new(State::default()),
                holder: holder::this_process(),
                revision: watch::channel(0).0,
            }),
        }
    }
}

impl Hub {
    /// Applies `change` to `model`'s members under the lock and, when it reports a change, bumps
    /// the revision and wakes every waiter. A model without members is not kept.
    fn change<T>(&self, model: &str, change: impl FnOnce(&mut Model) -> (bool, T)) -> T {
        let mut state = self.state.lock();
        let mut entry = state.models.remove(model).unwrap_or_default();
        let (changed, out) = change(&mut entry);
        if changed {
            state.revision += 1;
            entry.changed_at = state.revision;
            self.revision.send_replace(state.revision);
        }
        if !entry.members.is_empty() {
            state.models.insert(model.to_string(), entry);
        }
        out
    }

    /// Applies `change` to `model`'s reading claims under the lock, bumps the revision and wakes
    /// every waiter.
    fn change_readers<T>(&self, model: &str, change: impl FnOnce(&mut Readers) -> T) -> T {
        let mut state = self.state.lock();
        let mut entry = state.readers.remove(model).unwrap_or_default();
        let out = change(&mut entry);
        state.revision += 1;
        entry.changed_at = state.revision;
        self.revision.send_replace(state.revision);
        if !entry.claims.is_empty() {
            state.readers.insert(model.to_string(), entry);
        }
        out
    }

    /// Waits until `at(state)` (a model's last change) is above `revision` or `timeout` passes.
    async fn changed(
        &self,
        revision: u64,
        timeout: Duration,
        at: impl Fn(&State) -> u64,
    ) -> Result<u64> {
        // Subscribed before looking, so a change after the look still wakes the wait.
        let mut rx = self.revision.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let now = {
                let state = self.state.lock();
                if at(&state) > revision {
                    return Ok(state.revision);
                }
                state.revision
            };
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                return Ok(now);
            }
        }
    }

    fn lease_lost(model: &str, rank: OwnerId) -> Error {
        Error::new(
            ErrorKind::Transport,
            format!(
                "the in-process rendezvous lease of publisher rank {rank} of model {model:?} is \
                 gone"
            ),
        )
        .with_owner(rank)
    }
}

/// A publisher's hold on its in-process announcement.
struct Held {
    hub: Arc<Hub>,
    model: String,
    rank: OwnerId,
    lease: u64,
}

impl Held {
    /// Applies `f` to this lease's entry, or fails when the lease is gone.
    fn with_entry(&self, f: impl FnOnce(&mut Entry) -> bool) -> Result<()> {
        let (model, rank, lease) = (&self.model, self.rank, self.lease);
        self.hub.change(model, |m| match m.members.get_mut(&rank) {
            Some(e) if e.lease == lease => (f(e), Ok(())),
            _ => (false, Err(Hub::lease_lost(model, rank))),
        })
    }
}

#[async_trait]
impl Announced for Held {
    async fn unready(&self) -> Result<()> {
        self.with_entry(|e| std::mem::replace(&mut e.ready, false))
    }

    async fn advance(&self, step: u64, table: Bytes) -> Result<()> {
        self.with_entry(|e| {
            e.announcement.step = step;
            e.announcement.table = table;
            e.ready = true;
            true
        })
    }

    async fn set_note(&self, note: Option<String>) -> Result<()> {
        let note = note.as_deref().map(clip_note);
        self.with_entry(|e| {
            let changed = e.note != note;
            e.note = note;
            changed
        })
    }

    fn check_alive(&self) -> Result<()> {
        let state = self.hub.state.lock();
        match state
            .models
            .get(&self.model)
            .and_then(|m| m.members.get(&self.rank))
        {
            Some(e) if e.lease == self.lease => Ok(()),
            _ => Err(Hub::lease_lost(&self.model, self.rank)),
        }
    }

    async fn withdraw(self: Box<Self>) -> Result<()> {
        // Drop does the removal.
        Ok(())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let (rank, lease) = (self.rank, self.lease);
        self.hub.change(&self.model, |m| {
            let ours = m.members.get(&rank).is_some_and(|e| e.lease == lease);
            if ours {
                m.members.remove(&rank);
            }
            (ours, ())
        });
    }
}

#[async_trait]
impl Rendezvous for InProcess {
    fn endpoint(&self) -> String {
        "in-process".into()
    }

    async fn announce(&self, announcement: Announcement) -> Result<Box<dyn Announced>> {
        announcement.check()?;
        let lease = {
            let mut state = self.hub.state.lock();
            state.next_lease += 1;
            state.next_lease
        };
        let (model, rank) = (announcement.model.clone(), announcement.rank);
        let hub = &self.hub;
        self.hub.change(&model, |m| {
            // A live handle holds the rank (a dropped one removed its entry): refused, unless
            // it is this process's in the same incarnation, which the new entry replaces (the
            // old handle's lease no longer matches: its writes fail, its drop removes nothing).
            if let Some(e) = m
                .members
                .get(&rank)
                .filter(|e| e.announcement.incarnation != announcement.incarnation)
            {
                let who = holder::describe(Some(e.announcement.incarnation), Some(&hub.holder));
                let e = holder::rank_held(&model, rank, &who, "its handle is alive");
                return (false, Err(e));
            }
            // An empty table claims the rank with no step to serve: not ready.
            let ready = !announcement.table.is_empty();
            m.members.insert(
                rank,
                Entry {
                    announcement,
                    ready,
                    note: None,
                    lease,
                    granted: Instant::now(),
                },
            );
            (true, Ok(()))
        })?;
        Ok(Box::new(Held {
            hub: self.hub.clone(),
            model,
            rank,
            lease,
        }))
    }

    async fn members(&self, model: &str) -> Result<(Vec<Member>, u64)> {
        let state = self.hub.state.lock();
        let members = state
            .models
            .get(model)
            .map(|m| {
                m.members
                    .values()
                    .map(|e| Member {
                        rank: e.announcement.rank,
                        world: e.announcement.world,
                        step: e.announcement.step,
                        ready: e.ready,
                        transport: e.announcement.transport.clone(),
                        incarnation: e.announcement.incarnation,
                        age: e.granted.elapsed(),
                        table_bytes: e.announcement.table.len() as u64,
                        note: e.note.clone(),
                        holder: Some(self.hub.holder.clone()),
                    })
                    .collect()
            })
            .unwrap_or_default();
        Ok((members, state.revision))
    }

    async fn fetch(&self, model: &str, ranks: &[OwnerId]) -> Result<Vec<Fetched>> {
        let state = self.hub.state.lock();
        let members = state.models.get(model);
        let mut ranks = ranks.to_vec();
        ranks.sort_unstable();
        ranks
            .iter()
            .map(|&rank| {
                members
                    .and_then(|m| m.members.get(&rank))
                    // Read under the same lock as the announcement: the readiness of this very
                    // table, as etcd reads both from one record.
                    .map(|e| Fetched {
                        announcement: e.announcement.clone(),
                        ready: e.ready,
                    })
                    .ok_or_else(|| {
                        Error::new(
                            ErrorKind::PeerUnknown,
                            format!("publisher rank {rank} of model {model:?} is not announced"),
                        )
                        .with_owner(rank)
                    })
            })
            .collect()
    }

    async fn changed(&self, model: &str, revision: u64, timeout: Duration) -> Result<u64> {
        // A model without members may have lost its last one after `revision`: any hub change
        // then counts (a spurious wake-up costs the caller one `members` call).
        self.hub
            .changed(revision, timeout, |state| {
                state
                    .models
                    .get(model)
                    .map_or(state.revision, |m| m.changed_at)
            })
            .await
    }

    async fn models(&self) -> Result<Vec<String>> {
        Ok(self.hub.state.lock().models.keys().cloned().collect())
    }

    async fn claim_reading(&self, claim: ReadClaim) -> Result<Box<dyn Reading>> {
        let id = {
            let mut state = self.hub.state.lock();
            state.next_lease += 1;
            state.next_lease
        };
        let model = claim.model.clone();
        self.hub
            .change_readers(&model, |r| r.claims.insert(id, claim));
        Ok(Box::new(Claimed {
            hub: self.hub.clone(),
            model,
            id,
        }))
    }

    async fn readers(&self, model: &str) -> Result<(Vec<ReadClaim>, u64)> {
        let state = self.hub.state.lock();
        let claims = state
            .readers
            .get(model)
            .map(|r| r.claims.values().cloned().collect())
            .unwrap_or_default();
        Ok((claims, state.revision))
    }

    async fn readers_changed(&self, model: &str, revision: u64, timeout: Duration) -> Result<u64> {
        // As in `changed`: a model whose last claim went counts any hub change.
        self.hub
            .changed(revision, timeout, |state| {
                state
                    .readers
                    .get(model)
                    .map_or(state.revision, |r| r.changed_at)
            })
            .await
    }
}

/// A receiver's hold on an in-process reading claim; dropping it removes the claim.
struct Claimed {
    hub: Arc<Hub>,
    model: String,
    id: u64,
}

#[async_trait]
impl Reading for Claimed {
    async fn release(self: Box<Self>) -> Result<()> {
        // Drop does the removal.
        Ok(())
    }
}

impl Drop for Claimed {
    fn drop(&mut self) {
        let id = self.id;
        self.hub
            .change_readers(&self.model, |r| r.claims.remove(&id));
    }
}
