//! Loaded peers: connecting to them, unpacking their keys, waiting for wire-up, and
//! installing the latest load of each owner.

use std::cell::Cell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Instant;

use reshard_core::{Error, ErrorKind, OwnerId, Result};

use super::{ucx_err, Engine, Reply, CONNECT_MIN};
use crate::meta::EndpointMeta;
use crate::raw::{self, Endpoint, RKey, Request, UcxStatusError};
use crate::SCHEME;

/// A loaded peer: its endpoint and unpacked keys (each key holds the endpoint, so keys are
/// destroyed before it closes).
pub(super) struct Peer {
    pub(super) regions: HashMap<u64, RemoteRegion>,
    pub(super) agent: String,
    pub(super) ep: Rc<Endpoint>,
    /// What it was loaded from: a force-closed endpoint is re-created from it.
    pub(super) meta: EndpointMeta,
    /// Load sequence number: of two loads of one owner, the later one wins.
    pub(super) seq: u64,
    /// When a get through this endpoint last completed successfully, whichever batch posted
    /// it: proof that the link to this owner moves bytes (the no-progress timer of every
    /// batch reading through it, see `Engine::stalled_owners`).
    pub(super) last_completion: Cell<Option<Instant>>,
}

pub(super) struct RemoteRegion {
    pub(super) base: u64,
    pub(super) len: u64,
    /// `None` for zero-length regions.
    pub(super) rkey: Option<RKey>,
}

/// A peer whose endpoint is still being wired up (its flush has not completed).
pub(super) struct Connecting {
    pub(super) owner: OwnerId,
    pub(super) peer: Peer,
    flush: Request,
    started: Instant,
    /// `None` when re-creating an endpoint that was force-closed.
    pub(super) reply: Option<Reply<()>>,
}

impl Engine {
    /// Connects to a peer and unpacks its keys, then flushes the new endpoint so the reply
    /// comes once the connection is wired up (bounded by the timeout). Waiting for wire-up
    /// also keeps UCX 1.13's TCP transport from failing an assertion when an endpoint is
    /// closed while its peer's wire-up reply is still queued.
    ///
    /// Loads of one owner are numbered: only the latest one is installed, whichever flush
    /// completes first (an earlier load finishing later is dropped, and answers `Ok`).
    /// `reply` is `None` when re-creating a force-closed endpoint.
    pub(super) fn start_connect(
        &mut self,
        owner: OwnerId,
        meta: EndpointMeta,
        reply: Option<Reply<()>>,
    ) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let peer = match self.connect(owner, meta.clone(), seq) {
            Ok(p) => p,
            Err(e) => return self.connect_failed(owner, meta, e, reply),
        };
        match peer.ep.flush() {
            Ok(None) => {
                self.peer_seq.insert(owner, seq);
                self.install_peer(owner, peer);
                if let Some(r) = reply {
                    let _ = r.send(Ok(()));
                }
            }
            Ok(Some(flush)) => {
                self.peer_seq.insert(owner, seq);
                self.connecting.push(Connecting {
                    owner,
                    peer,
                    flush,
                    started: Instant::now(),
                    reply,
                })
            }
            Err(e) => self.connect_failed(owner, meta, ucx_err(e).with_owner(owner), reply),
        }
    }

    /// Answers a failed load, or records a failed re-creation (retried at the next post).
    fn connect_failed(
        &mut self,
        owner: OwnerId,
        meta: EndpointMeta,
        e: Error,
        reply: Option<Reply<()>>,
    ) {
        match reply {
            Some(r) => {
                let _ = r.send(Err(e));
            }
            // A later load installed the owner meanwhile: nothing is lost.
            None if self.peers.contains_key(&owner) => {}
            None => {
                tracing::warn!(agent = %self.agent, owner, error = %e, "ucx endpoint not re-created");
                self.lost.insert(owner, (meta, e.to_string()));
            }
        }
    }

    fn connect(&mut self, owner: OwnerId, meta: EndpointMeta, seq: u64) -> Result<Peer> {
        let ep = Endpoint::connect(&self.worker, &meta.worker_address)
            .map_err(|e| ucx_err(e).with_owner(owner))?;
        let mut regions = HashMap::with_capacity(meta.regions.len());
        for r in &meta.regions {
            let rkey = if r.len == 0 {
                None
            } else {
                Some(
                    RKey::unpack(&ep, &r.rkey)
                        .map_err(|e| ucx_err(e).with_owner(owner).with_range(0..r.len))?,
                )
            };
            regions.insert(
                r.id,
                RemoteRegion {
                    base: r.base,
                    len: r.len,
                    rkey,
                },
            );
        }
        Ok(Peer {
            regions,
            agent: meta.agent.clone(),
            ep,
            meta,
            seq,
            last_completion: Cell::new(None),
        })
    }

    /// Installs `peer` if it is the latest load of `owner` (else drops it).
    fn install_peer(&mut self, owner: OwnerId, peer: Peer) {
        if self.peer_seq.get(&owner) != Some(&peer.seq) {
            tracing::debug!(agent = %self.agent, owner, "ucx peer load superseded by a later one");
            return;
        }
        tracing::debug!(agent = %self.agent, owner, peer = %peer.agent, "ucx peer loaded");
        // The old peer (if any) closes once no running batch uses it.
        self.peers.insert(owner, Rc::new(peer));
        self.lost.remove(&owner);
        self.bump_epoch();
    }

    /// Finishes connections whose flush completed or timed out; true on work.
    pub(super) fn poll_connecting(&mut self) -> bool {
        if self.connecting.is_empty() {
            return false;
        }
        let mut worked = false;
        for c in std::mem::take(&mut self.connecting) {
            let st = c.flush.status();
            let bound = self.opts.timeout.max(CONNECT_MIN);
            let error = if st == raw::sys::UCS_INPROGRESS {
                if c.started.elapsed() <= bound {
                    self.connecting.push(c);
                    continue;
                }
                Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "connecting to owner {} (agent {:?}) took over {} ms",
                        c.owner,
                        c.peer.agent,
                        bound.as_millis()
                    ),
                )
                .with_owner(c.owner)
                .with_backend(SCHEME)
                .set_retryable(true)
            } else if st == raw::sys::UCS_OK {
                let Connecting {
                    owner, peer, reply, ..
                } = c;
                self.install_peer(owner, peer);
                if let Some(r) = reply {
                    let _ = r.send(Ok(()));
                }
                worked = true;
                continue;
            } else {
                ucx_err(UcxStatusError::new("ucp_ep_flush_nbx", st)).with_owner(c.owner)
            };
            worked = true;
            let Connecting {
                owner, peer, reply, ..
            } = c;
            let meta = peer.meta.clone();
            drop(peer);
            self.connect_failed(owner, meta, error, reply);
        }
        worked
    }
}
