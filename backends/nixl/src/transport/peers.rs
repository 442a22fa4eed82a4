//! Peers: loading a peer's metadata (`load_peer`), retiring the batches made from
//! metadata it replaces, and checking an envelope's regions against NIXL's.

use bytes::Bytes;
use reshard_core::{Error, ErrorKind, MemoryKind, OwnerId, Result};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use super::prepared::{Prepared, BUSY, IDLE, QUARANTINED, RETIRED};
use super::regions::space;
use super::{oob, NixlTransport, Shared, State};
use crate::agent::NixlAgent;
use crate::meta::{incarnation_of, AgentMeta, RegionMeta};
use crate::SCHEME;

/// A loaded peer: its NIXL name, the regions its metadata lists, and the exact bytes loaded.
pub(super) struct Peer {
    pub(super) nixl_name: String,
    /// Its incarnation ([`incarnation_of`] its NIXL name).
    pub(super) incarnation: u64,
    agent: String,
    pub(super) regions: HashMap<u64, RegionMeta>,
    pub(super) generation: u64,
    raw: Bytes,
}

impl NixlTransport {
    /// [`reshard_core::Transport::load_peer`].
    pub(super) fn load_peer_metadata(&self, owner: OwnerId, metadata: Bytes) -> Result<()> {
        let s = &self.shared;
        let meta = AgentMeta::decode(&metadata).map_err(|e| e.with_owner(owner))?;
        if meta.nixl_name == s.nixl_name {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "an endpoint cannot load its own metadata as a peer",
            )
            .with_owner(owner)
            .with_backend(SCHEME));
        }
        let mut st = s.state.lock();
        if st.peers.get(&owner).is_some_and(|p| p.raw == metadata) {
            // Same bytes again: nothing changed, prepared batches stay valid.
            return Ok(());
        }
        let peer = match st.loaded.get(&meta.nixl_name) {
            Some(p) if p.raw == metadata => Arc::clone(p),
            old => {
                if old.is_some() {
                    // Replace, not merge: drop what NIXL holds for the old metadata first,
                    // but never under a request made from it (invalidation destroys the
                    // remote keys those requests read with, and their completion could no
                    // longer be observed).
                    retire_users(&mut st, &meta.nixl_name, owner)?;
                    s.invalidate_remote(&meta.nixl_name)
                        .map_err(|e| e.with_owner(owner))?;
                    st.loaded.remove(&meta.nixl_name);
                }
                let name = match s.load_remote(&meta.nixl_md) {
                    Ok(name) => name,
                    Err((e, loaded)) => {
                        // A later lane refused what lane 0 loaded: forget it on the lanes that
                        // took it, unless that agent is one this endpoint already uses.
                        if let Some(name) = loaded {
                            if !st.loaded.contains_key(&name) && !has_users(&mut st, &name) {
                                let _ = s.invalidate_remote(&name);
                            }
                        }
                        return Err(e.with_owner(owner));
                    }
                };
                if name != meta.nixl_name {
                    // Forget what was just loaded, unless that agent is one this endpoint
                    // already uses (its batches' requests need its keys).
                    if !st.loaded.contains_key(&name) && !has_users(&mut st, &name) {
                        let _ = s.invalidate_remote(&name);
                    }
                    return Err(Error::new(
                        ErrorKind::Decode,
                        format!(
                            "metadata envelope names NIXL agent {:?} but carries metadata of \
                             {name:?}",
                            meta.nixl_name
                        ),
                    )
                    .with_owner(owner)
                    .with_backend(SCHEME));
                }
                // The envelope's regions are the peer's claim; NIXL's own metadata holds the
                // descriptors it registered. A region advertised beyond them is refused here,
                // before any read is prepared against it.
                if let Err(e) = check_regions(s.agent(), &name, owner, &meta.regions) {
                    if !st.loaded.contains_key(&name) && !has_users(&mut st, &name) {
                        let _ = s.invalidate_remote(&name);
                    }
                    return Err(e);
                }
                let p = Arc::new(Peer {
                    incarnation: incarnation_of(&name),
                    nixl_name: name.clone(),
                    agent: meta.agent.clone(),
                    regions: meta.regions.iter().map(|r| (r.id, *r)).collect(),
                    generation: s.generation(),
                    raw: metadata,
                });
                // Owners that named the old metadata of this agent now see the new one.
                for v in st.peers.values_mut() {
                    if v.nixl_name == name {
                        *v = Arc::clone(&p);
                    }
                }
                st.loaded.insert(name, Arc::clone(&p));
                p
            }
        };
        tracing::debug!(agent = %s.name, owner, peer = %peer.agent, "nixl peer");
        st.peers.insert(owner, peer);
        drop(st);
        s.bump();
        Ok(())
    }
}

impl Shared {
    /// Loads a peer's NIXL metadata on every lane; returns the agent name NIXL read from it.
    /// On failure, also the name lanes already loaded, if any, for the caller to forget.
    fn load_remote(&self, md: &[u8]) -> std::result::Result<String, (Error, Option<String>)> {
        let name = self.agent().load_remote(md).map_err(|e| (e, None))?;
        for (k, lane) in self.lanes.iter().enumerate().skip(1) {
            match lane.agent.load_remote(md) {
                Ok(n) if n == name => {}
                Ok(n) => {
                    let _ = lane.agent.invalidate_remote(&n);
                    let e = Error::new(
                        ErrorKind::Internal,
                        format!("NIXL read agent {n:?} on lane {k} but {name:?} on lane 0"),
                    )
                    .with_backend(SCHEME);
                    return Err((e, Some(name)));
                }
                Err(e) => return Err((e, Some(name))),
            }
        }
        Ok(name)
    }

    /// Forgets a peer agent's NIXL metadata on every lane that holds it; the first error, if
    /// any, after trying every lane.
    fn invalidate_remote(&self, name: &str) -> Result<()> {
        let mut first = Ok(());
        for agent in self.agents() {
            if let Err(e) = agent.invalidate_remote(name) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
}

/// Live batches of the endpoint whose remote lists were made from agent `nixl_name`'s
/// metadata (forgets dead ones).
fn users(st: &mut State, nixl_name: &str) -> Vec<Arc<Prepared>> {
    st.batches.retain(|w| w.strong_count() > 0);
    st.batches
        .iter()
        .filter_map(Weak::upgrade)
        .filter(|p| p.remote_agents.iter().any(|a| a == nixl_name))
        .collect()
}

fn has_users(st: &mut State, nixl_name: &str) -> bool {
    !users(st, nixl_name).is_empty()
}

/// Before the metadata of agent `nixl_name` is invalidated: refuses while a batch made from it
/// is posted or quarantined (its requests may be in progress), and releases the NIXL objects
/// of the idle ones, which can then never be posted again.
///
/// Releasing them now, rather than keeping the old remote loaded until they are dropped, is
/// deliberate: NIXL keeps one metadata per agent name, so the new metadata cannot be loaded
/// while the old one stays, and idle requests and lists are safe to release at any time.
/// They already fail `check_live` (the peer's generation changes), so nothing is lost, and
/// their later drop finds nothing made from the freed metadata. Runs under the state lock, so
/// no `post` can move a batch out of `IDLE` meanwhile.
fn retire_users(st: &mut State, nixl_name: &str, owner: OwnerId) -> Result<()> {
    let users = users(st, nixl_name);
    for p in &users {
        let what = match p.phase.load(Ordering::Acquire) {
            BUSY => "is in flight: wait for it or abort it first",
            QUARANTINED => {
                "was ended while its reads still ran and is quarantined until they finish: \
                 wait for them (NixlTransport::quarantined) first"
            }
            _ => continue,
        };
        return Err(Error::new(
            ErrorKind::Transport,
            format!(
                "cannot reload the metadata of owner {owner} (NIXL agent {nixl_name}): a batch \
                 reading from it {what}"
            ),
        )
        .with_owner(owner)
        .with_backend(SCHEME)
        .set_retryable(true));
    }
    for p in users {
        let idle = p
            .phase
            .compare_exchange(IDLE, RETIRED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if idle || p.phase.load(Ordering::Acquire) == RETIRED {
            p.release_nixl();
        }
    }
    Ok(())
}

/// Checks every non-empty region of a peer's envelope against the registrations in the NIXL
/// metadata just loaded for agent `name` (one prepared remote list per memory kind; only when
/// that fails, one per region to name the culprit): `OutOfBounds` naming the owner and the
/// advertised byte range of the first region NIXL does not find registered.
fn check_regions(
    agent: &NixlAgent,
    name: &str,
    owner: OwnerId,
    regions: &[RegionMeta],
) -> Result<()> {
    let mut kinds: Vec<MemoryKind> = regions.iter().map(|r| r.kind).collect();
    kinds.sort_unstable_by_key(|&k| space(k));
    kinds.dedup();
    for kind in kinds {
        let of_kind: Vec<&RegionMeta> = regions
            .iter()
            .filter(|r| r.kind == kind && r.len > 0)
            .collect();
        let descs: Vec<(u64, u64)> = of_kind.iter().map(|r| (r.addr, r.len)).collect();
        if descs.is_empty() || agent.prep_dlist(name, kind, &descs).is_ok() {
            continue;
        }
        for r in of_kind {
            if let Err(e) = agent.prep_dlist(name, kind, &[(r.addr, r.len)]) {
                return Err(oob(
                    owner,
                    0..r.len,
                    format!(
                        "metadata of owner {owner} advertises region {} as {} bytes at {:#x}, \
                         but its NIXL agent registered no such memory ({e})",
                        r.id, r.len, r.addr
                    ),
                )
                .with_source(e));
            }
        }
    }
    Ok(())
}
