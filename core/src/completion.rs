//! Completions reported as they happen: the sink a backend calls once per read of a posted
//! batch, as soon as that read's bytes are all in place ([`crate::Transport::post_reporting`]),
//! so a receiver can verify and re-slice what landed while the rest is still on the wire
//! (docs/in-flight-safety.md, "Completions as they happen"), and the countdown a backend that cuts reads into pieces uses to know
//! when the last piece of a read has finished.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Where a backend reports the reads of one posted batch as they complete, by index into
/// [`crate::PreparedBatch::batch`]'s reads. See [`crate::Transport::post_reporting`] for when a
/// backend may call it.
#[derive(Clone)]
pub struct CompletionSink {
    report: Arc<dyn Fn(usize) + Send + Sync>,
    base: usize,
}

impl CompletionSink {
    /// A sink calling `report` with the index of each completed read. `report` runs on the
    /// backend's own threads, inside its batch (before the batch can end), so it must be cheap
    /// and must never wait for the batch.
    pub fn new(report: impl Fn(usize) + Send + Sync + 'static) -> Self {
        CompletionSink {
            report: Arc::new(report),
            base: 0,
        }
    }

    /// Reports read `read` of the posted batch complete: every byte of it is in place and no
    /// byte of it lands afterwards.
    pub fn complete(&self, read: usize) {
        (self.report)(self.base + read)
    }

    /// The sink of a part of this sink's batch whose read 0 is read `base` of this one (for a
    /// layer that posts a batch in consecutive parts).
    pub fn offset(&self, base: usize) -> Self {
        CompletionSink {
            report: Arc::clone(&self.report),
            base: self.base + base,
        }
    }
}

impl fmt::Debug for CompletionSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CompletionSink(base {})", self.base)
    }
}

/// Bytes still to land per read of a posted batch, for a backend that cuts reads into pieces
/// finishing in any order on several threads: a read is complete when the piece that brings
/// its count to zero finishes, not when its last piece (by offset) does.
#[derive(Debug)]
pub struct Countdown {
    left: Vec<AtomicU64>,
}

impl Countdown {
    /// A countdown of `lens[i]` bytes for read `i`.
    pub fn new(lens: impl IntoIterator<Item = u64>) -> Self {
        Countdown {
            left: lens.into_iter().map(AtomicU64::new).collect(),
        }
    }

    /// Counts `bytes` of read `read` as landed; true for the one call that lands its last
    /// byte (a read of zero bytes is never reported: the contract refuses them at `prepare`).
    pub fn landed(&self, read: usize, bytes: u64) -> bool {
        let Some(left) = self.left.get(read) else {
            return false;
        };
        // AcqRel: the thread that lands the last byte sees every other piece's writes done
        // (their decrements happen after their copies), so its report covers them too.
        let before = left.fetch_sub(bytes, Ordering::AcqRel);
        bytes > 0 && before == bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parking_lot::Mutex;

    #[test]
    fn offsets_add_up_and_the_countdown_fires_once_at_the_last_byte() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = {
            let seen = seen.clone();
            CompletionSink::new(move |i| seen.lock().push(i))
        };
        s.complete(1);
        s.offset(10).complete(2);
        s.offset(10).offset(5).complete(0);
        assert_eq!(*seen.lock(), [1, 12, 15]);

        let c = Countdown::new([10, 4]);
        assert!(!c.landed(0, 3));
        assert!(!c.landed(0, 6));
        assert!(
            c.landed(0, 1),
            "the piece landing the last byte completes the read"
        );
        assert!(c.landed(1, 4));
        assert!(!c.landed(7, 1), "no such read");
    }
}
