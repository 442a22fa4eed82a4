//! The mailbox: the commands the transport sends the progress thread, the queue and eventfd
//! that carry them, and the stop/quiet signal a posted batch shares with its handle.

use std::ops::Deref;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::{Condvar, Mutex};
use reshard_core::{CompletionSink, MemoryBlock, OwnerId, ReadBatch, WireReport};

use super::Reply;
use crate::meta::EndpointMeta;

/// A request to the progress thread.
pub(crate) enum Cmd {
    /// Register a block; answers `(region id, length)`.
    Register {
        block: Arc<dyn MemoryBlock>,
        reply: Reply<u64>,
    },
    /// Drop a registration (from `Registration`'s release; nobody waits).
    Deregister { id: u64 },
    /// Encode this endpoint's metadata.
    Export { reply: Reply<Bytes> },
    /// Connect to a peer and unpack its keys, replacing what `owner` had.
    LoadPeer {
        owner: OwnerId,
        meta: EndpointMeta,
        reply: Reply<()>,
    },
    /// Validate and resolve a batch, kept under `id` until `Forget`; answers its piece count.
    Prepare {
        id: u64,
        batch: Arc<ReadBatch>,
        reply: Reply<usize>,
    },
    /// The `PreparedBatch` of `id` was dropped.
    Forget { id: u64 },
    /// Start prepared batch `prepared` as in-flight batch `batch`; `ack` answers once the
    /// first window of reads (every owner's) is issued, `done` when all completed.
    Post {
        prepared: u64,
        batch: u64,
        signal: BatchHold,
        ack: Reply<()>,
        done: Reply<WireReport>,
        /// Where its reads are reported as they complete (`Transport::post_reporting`).
        sink: Option<CompletionSink>,
    },
    /// End `batch` as abort does: stop issuing and copying, force-close the endpoints its
    /// gets are outstanding on and answer `done` (and signal quiet) once none is left, or
    /// once they are quarantined.
    Cancel { batch: u64 },
}

/// What a posted batch's handle ([`crate::transport`]'s in-flight batch) and the progress
/// thread share: the stop flag the shared-memory copies check between pieces, and the
/// *quiet* signal, set once no byte of the batch can land any more (every get completed), or
/// once its remaining gets were quarantined.
pub(crate) struct BatchSignal {
    pub(super) stop: AtomicBool,
    quiet: Mutex<bool>,
    cv: Condvar,
}

impl BatchSignal {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(BatchSignal {
            stop: AtomicBool::new(false),
            quiet: Mutex::new(false),
            cv: Condvar::new(),
        })
    }

    /// Stops the batch's copies before their next piece (the progress thread ends the rest).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }

    pub(super) fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    pub(super) fn set_quiet(&self) {
        *self.quiet.lock() = true;
        self.cv.notify_all();
    }

    /// Blocks until the batch is quiet; false if the progress thread died first (it answers
    /// every batch before it stops, so this only happens after a panic there).
    pub(crate) fn wait_quiet(&self, alive: &AtomicBool) -> bool {
        let mut quiet = self.quiet.lock();
        while !*quiet {
            if !alive.load(Ordering::Acquire) {
                return false;
            }
            self.cv.wait_for(&mut quiet, Duration::from_millis(50));
        }
        true
    }
}

/// The progress thread's hold on a posted batch's [`BatchSignal`], made with the post command
/// and carried by it, by the deferred post and then by the running batch. Dropping it signals
/// the batch quiet, so however the thread lets go of a batch (finished, never started because
/// its handle was dropped first, refused, or dropped unread with the queue when the thread
/// stops) the handle waiting for it wakes. The thread drops it only when none of the batch's
/// gets is outstanding: a quarantined batch keeps it (and is signalled quiet by hand).
pub(crate) struct BatchHold(Arc<BatchSignal>);

impl BatchHold {
    pub(crate) fn new(signal: Arc<BatchSignal>) -> Self {
        BatchHold(signal)
    }
}

impl Deref for BatchHold {
    type Target = BatchSignal;

    fn deref(&self) -> &BatchSignal {
        &self.0
    }
}

impl Drop for BatchHold {
    fn drop(&mut self) {
        self.0.set_quiet();
    }
}

/// The sending side of the progress thread's queue; cheap to clone, `Send + Sync`.
#[derive(Clone)]
pub(crate) struct Mailbox {
    pub(super) tx: mpsc::Sender<Option<Cmd>>,
    pub(super) wake: Arc<OwnedFd>,
    pub(super) alive: Arc<AtomicBool>,
}

impl Mailbox {
    /// Cleared when the progress thread exits (also by a panic).
    pub(crate) fn alive(&self) -> &AtomicBool {
        &self.alive
    }

    /// Queues `cmd` and wakes the thread; false when the thread has stopped.
    pub(crate) fn send(&self, cmd: Cmd) -> bool {
        self.push(Some(cmd))
    }

    /// Asks the thread to stop (after ending every running batch as abort does).
    pub(crate) fn shutdown(&self) {
        self.push(None);
    }

    fn push(&self, cmd: Option<Cmd>) -> bool {
        if self.tx.send(cmd).is_err() {
            return false;
        }
        // An eventfd counter only overflows after 2^64 - 2 writes; a failed write (EAGAIN)
        // means it is already signalled, which is all we need.
        let _ = rustix::io::write(&*self.wake, &1u64.to_ne_bytes());
        true
    }
}
