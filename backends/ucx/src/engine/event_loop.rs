//! The progress thread's loop (commands, progress, issue, sleep), its command dispatch, and
//! posts deferred until their owners' endpoints are (re-)created.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::rc::Rc;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reshard_core::{CompletionSink, Error, ErrorKind, OwnerId, ReadBatch, WireReport};
use rustix::event::{PollFd, PollFlags, Timespec};

use super::mailbox::{BatchHold, Cmd};
use super::resolve::PreparedEntry;
use super::{Engine, Reply, BUSY_NAP, HOT, IDLE_NAP, MIN_NAP, PROGRESS_ROUNDS, SPIN};
use crate::meta::EndpointMeta;
use crate::raw;
use crate::SCHEME;

/// A prepare waiting for one of its owners' endpoints to be (re-)created.
pub(super) struct DeferredPrepare {
    id: u64,
    batch: Arc<ReadBatch>,
    reply: Reply<usize>,
}

impl DeferredPrepare {
    /// Answers the prepare without resolving it.
    pub(super) fn answer(self, r: reshard_core::Result<usize>) {
        let _ = self.reply.send(r);
    }
}

/// A post waiting for one of its owners' endpoints to be (re-)created.
pub(super) struct DeferredPost {
    prepared: u64,
    pub(super) batch: u64,
    signal: BatchHold,
    pub(super) ack: Reply<()>,
    done: Reply<WireReport>,
    sink: Option<CompletionSink>,
}

impl Engine {
    /// The thread's loop: commands, progress, issue, sleep.
    pub(super) fn run(mut self, rx: mpsc::Receiver<Option<Cmd>>, wake: Arc<OwnedFd>) {
        let efd = match self.worker.event_fd() {
            Ok(fd) => Some(fd),
            Err(e) => {
                tracing::warn!(agent = %self.agent, "no ucx event fd ({e}); polling on a timer");
                None
            }
        };
        let mut last_work = Instant::now();
        // Last time UCX itself had work (progress returned true). Reads served from mapped
        // shared memory never touch UCX, so a receiver that only copied does not stay hot.
        let mut last_ucx = Instant::now();
        loop {
            let mut worked = false;
            loop {
                match rx.try_recv() {
                    Ok(Some(cmd)) => {
                        self.handle(cmd);
                        worked = true;
                    }
                    Ok(None) | Err(mpsc::TryRecvError::Disconnected) => {
                        self.shutdown();
                        return;
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            // Bounded, so a worker with a steady stream of events cannot starve the mailbox.
            let mut rounds = 0;
            while rounds < PROGRESS_ROUNDS && self.worker.progress() {
                rounds += 1;
            }
            if rounds > 0 {
                worked = true;
                // Only for napping: activity of the worker is not progress of any batch's
                // reads (it stays busy reconnecting while a link is down); completions are
                // (`Engine::stalled_owners`).
                last_ucx = Instant::now();
            }
            worked |= self.apply_completions();
            worked |= self.pump();
            worked |= self.poll_connecting();
            worked |= self.retry_deferred();
            worked |= self.poll_releasing();
            if worked {
                last_work = Instant::now();
                continue;
            }
            let quiet = last_work.elapsed();
            if quiet < SPIN {
                std::hint::spin_loop();
                continue;
            }
            // Not every piece of UCX's work is announced on the event fd: a publisher
            // answering emulated reads (shared-memory or TCP active messages) may hold reply
            // fragments queued until the FIFO drains, with no event when it does. So a worker
            // whose UCX was just active only naps briefly, and the nap grows with the quiet
            // time.
            let busy = !self.running.is_empty()
                || !self.connecting.is_empty()
                || !self.quarantine.is_empty()
                || !self.releasing.is_empty();
            let cap = if busy { BUSY_NAP } else { IDLE_NAP };
            let nap = if last_ucx.elapsed() < HOT {
                MIN_NAP
            } else {
                (quiet / 4).clamp(MIN_NAP, cap)
            };
            self.sleep(efd, &wake, nap, busy);
        }
    }

    /// Arms the worker and sleeps until an event, a command or `nap` passes.
    fn sleep(&self, efd: Option<i32>, wake: &OwnedFd, nap: Duration, busy: bool) {
        let efd = match (efd, self.worker.arm()) {
            (_, Ok(raw::Armed::Busy)) => return,
            (Some(fd), Ok(raw::Armed::Yes)) => Some(fd),
            (_, Err(e)) => {
                tracing::debug!(agent = %self.agent, "ucp_worker_arm: {e}");
                None
            }
            (None, Ok(raw::Armed::Yes)) => None,
        };
        // Without a usable event fd, nap briefly so outstanding reads keep progressing.
        let nap = if efd.is_none() && busy {
            Duration::from_micros(200)
        } else {
            nap
        };
        let timeout = Timespec {
            tv_sec: nap.as_secs() as _,
            tv_nsec: nap.subsec_nanos() as _,
        };
        // SAFETY: the worker's event fd stays open while the worker lives, which outlives
        // this call (the engine owns the worker).
        let efd = efd.map(|fd| unsafe { BorrowedFd::borrow_raw(fd) });
        let mut fds = vec![PollFd::new(wake, PollFlags::IN)];
        if let Some(fd) = &efd {
            fds.push(PollFd::new(fd, PollFlags::IN));
        }
        let _ = rustix::event::poll(&mut fds, Some(&timeout));
        // Reset the mailbox eventfd; commands sent after this read signal it again.
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(wake, &mut buf);
    }

    pub(super) fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Register { block, reply } => {
                let _ = reply.send(self.register(block));
            }
            Cmd::Deregister { id } => {
                // Running (and quarantined) batches hold the region: it is unmapped once the
                // last of them is released, and not before peers' reads of it are served.
                if let Some(region) = self.regions.remove(&id) {
                    self.bump_epoch();
                    tracing::debug!(agent = %self.agent, region = id, "ucx deregister");
                    self.release_after_flush(region);
                }
            }
            Cmd::Export { reply } => {
                let _ = reply.send(Ok(self.export()));
            }
            Cmd::LoadPeer { owner, meta, reply } => self.start_connect(owner, meta, Some(reply)),
            Cmd::Prepare { id, batch, reply } => {
                let owners = batch.owners();
                self.reconnect_lost(&owners);
                let d = DeferredPrepare { id, batch, reply };
                if self.connecting_any(&owners) {
                    // An endpoint it reads through is being (re-)created, e.g. after an abort
                    // force-closed it: resolve once it is there (bounded by the connect bound).
                    self.deferred_prepares.push(d);
                } else {
                    self.prepare(d);
                }
            }
            Cmd::Forget { id } => {
                self.prepared.remove(&id);
            }
            Cmd::Post {
                prepared,
                batch,
                signal,
                ack,
                done,
                sink,
            } => {
                if let Some(owners) = self.prepared.get(&prepared).map(|e| e.owners.clone()) {
                    self.reconnect_lost(&owners);
                }
                let d = DeferredPost {
                    prepared,
                    batch,
                    signal,
                    ack,
                    done,
                    sink,
                };
                if self.blocked_by_connect(d.prepared) {
                    self.deferred.push(d);
                } else {
                    self.start_post(d);
                }
            }
            Cmd::Cancel { batch } => self.cancel(batch),
        }
    }

    /// Whether prepared batch `prepared` names an owner whose newest endpoint is still being
    /// created (after a forced close, or a load racing this post): its post waits for it.
    fn blocked_by_connect(&self, prepared: u64) -> bool {
        self.prepared
            .get(&prepared)
            .is_some_and(|entry| self.connecting_any(&entry.owners))
    }

    /// Whether the newest endpoint of any of `owners` is still being created.
    fn connecting_any(&self, owners: &[OwnerId]) -> bool {
        self.connecting
            .iter()
            .any(|c| self.peer_seq.get(&c.owner) == Some(&c.peer.seq) && owners.contains(&c.owner))
    }

    /// Starts re-creating the endpoints of `owners` whose earlier re-creation failed; posts
    /// and prepares naming them then wait for them.
    fn reconnect_lost(&mut self, owners: &[OwnerId]) {
        let retry: Vec<(OwnerId, EndpointMeta)> = owners
            .iter()
            .filter(|o| !self.peers.contains_key(o))
            .filter(|o| !self.connecting.iter().any(|c| c.owner == **o))
            .filter_map(|o| self.lost.get(o).map(|(m, _)| (*o, m.clone())))
            .collect();
        for (owner, meta) in retry {
            tracing::debug!(agent = %self.agent, owner, "ucx re-creating a lost endpoint");
            self.start_connect(owner, meta, None);
        }
    }

    /// Validates and resolves a batch and keeps it under its id; answers its piece count.
    fn prepare(&mut self, d: DeferredPrepare) {
        let DeferredPrepare { id, batch, reply } = d;
        let r = self.translate(&batch).map(|res| {
            let pieces = res.ops.len();
            self.prepared.insert(
                id,
                PreparedEntry {
                    owners: batch.owners(),
                    batch,
                    resolved: Some(Rc::new(res)),
                },
            );
            pieces
        });
        let _ = reply.send(r);
    }

    fn start_post(&mut self, d: DeferredPost) {
        let DeferredPost {
            prepared,
            batch,
            signal,
            ack,
            done,
            sink,
        } = d;
        if ack.is_closed() || signal.stopping() {
            // The post was given up, or its handle dropped, before it started: start nothing
            // (dropping `signal` tells the handle's drop the batch is quiet).
            let _ = ack.send(Err(Error::new(
                ErrorKind::Aborted,
                "the ucx batch was ended before it started",
            )
            .with_backend(SCHEME)));
            return;
        }
        let _ = ack.send(self.post(prepared, batch, signal, done, sink));
    }

    /// Resolves the deferred prepares, then starts the deferred posts, whose endpoints are
    /// ready; true on work.
    fn retry_deferred(&mut self) -> bool {
        let mut worked = false;
        for d in std::mem::take(&mut self.deferred_prepares) {
            if self.connecting_any(&d.batch.owners()) {
                self.deferred_prepares.push(d);
            } else {
                self.prepare(d);
                worked = true;
            }
        }
        for d in std::mem::take(&mut self.deferred) {
            if self.blocked_by_connect(d.prepared) {
                self.deferred.push(d);
            } else {
                self.start_post(d);
                worked = true;
            }
        }
        worked
    }
}
