//! Completions reported as they happen: the sink a backend calls once per read of a posted
//! batch, as soon as that read's bytes are all in place ([`crate::Transport::post_reporting`]),
//! so a receiver can verify and re-slice what landed while the rest is still on the wire
//! (docs/in-flight-safety.md, "Completions as they happen"), and the countdown a backend that cuts reads into pieces uses to know
//! when the last piece of a read has finished. A sink may carry a [`HashPlan`]: the segments a
//! backend that copies with its own CPU hashes right after copying them (docs/in-flight-safety.md,
//! "Hashing while copying").

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::copyhash::{HashPlan, PieceHasher};

/// Where a backend reports the reads of one posted batch as they complete, by index into
/// [`crate::PreparedBatch::batch`]'s reads. See [`crate::Transport::post_reporting`] for when a
/// backend may call it.
#[derive(Clone)]
pub struct CompletionSink {
    report: Arc<dyn Fn(usize) + Send + Sync>,
    base: usize,
    hashes: Option<Arc<HashPlan>>,
}

impl CompletionSink {
    /// A sink calling `report` with the index of each completed read. `report` runs on the
    /// backend's own threads, inside its batch (before the batch can end), so it must be cheap
    /// and must never wait for the batch.
    pub fn new(report: impl Fn(usize) + Send + Sync + 'static) -> Self {
        CompletionSink {
            report: Arc::new(report),
            base: 0,
            hashes: None,
        }
    }

    /// This sink carrying `plan`: the segments of each read to hash while copying, indexed
    /// like the reads this sink reports (see [`crate::Transport::post_reporting`]).
    pub fn with_hashes(mut self, plan: Arc<HashPlan>) -> Self {
        self.hashes = Some(plan);
        self
    }

    /// Whether this sink carries a [`HashPlan`].
    pub fn hashes(&self) -> bool {
        self.hashes.is_some()
    }

    /// The hasher of one piece of read `read` (of the posted batch): the bytes from `offset`
    /// in the read on, copied in order by one thread; `None` when the sink carries no plan.
    pub fn piece_hasher(&self, read: usize, offset: u64) -> Option<PieceHasher<'_>> {
        let plan = self.hashes.as_deref()?;
        Some(plan.piece(self.base + read, offset))
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
            hashes: self.hashes.clone(),
        }
    }
}

impl fmt::Debug for CompletionSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CompletionSink(base {}, hashes {})",
            self.base,
            self.hashes.is_some()
        )
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

    #[test]
    fn a_part_sink_hashes_the_reads_of_its_part() {
        use crate::copyhash::{HashPlan, SegmentTask};
        let plan = Arc::new(HashPlan::new(
            3,
            2,
            [(
                2,
                SegmentTask {
                    offset: 0,
                    len: 4,
                    slot: 1,
                },
            )],
        ));
        let s = CompletionSink::new(|_| {}).with_hashes(plan.clone());
        assert!(s.hashes() && !CompletionSink::new(|_| {}).hashes());
        // Read 0 of the part from read 2 is read 2 of the batch.
        let part = s.offset(2);
        part.piece_hasher(0, 0).unwrap().landed(b"abcd");
        assert_eq!(
            plan.hash(1, 4),
            Some(twox_hash::XxHash3_64::oneshot(b"abcd"))
        );
        assert!(CompletionSink::new(|_| {}).piece_hasher(0, 0).is_none());
    }
}
