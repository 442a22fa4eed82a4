//! Segment hashes computed while copying (docs/in-flight-safety.md, "Hashing while copying"):
//! the [`HashPlan`] a receiver hands a backend with a batch (inside its [`CompletionSink`]),
//! telling for each read which destination segments to hash and in which slot to store each
//! hash, and the [`PieceHasher`] a backend whose CPU copies the bytes feeds with each block
//! right after copying it, so the segment hashes of a digest check ([`crate::SegmentFold`])
//! are computed while the block is still in cache and the check only folds them.
//!
//! A slot holds the XXH3-64 of one segment's destination bytes and a tag: the generation of
//! the post that stored it ([`HashPlan::begin`]) and the length hashed. The receiver takes a
//! hash only when both match the current post and the segment it expects; any segment not
//! stored (a backend that does not hash, a segment straddling two reads or two pieces of one
//! read) it hashes itself from the destination, so every check ends with the publisher's
//! digest whichever way its hashes came.
//!
//! [`CompletionSink`]: crate::CompletionSink

use std::sync::atomic::{AtomicU64, Ordering};

/// One segment to hash: `len` bytes at `offset` in its read (from the read's first destination
/// byte), its hash stored in slot `slot` of the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentTask {
    /// Byte offset of the segment in its read.
    pub offset: u64,
    /// Bytes of the segment (below 2^32: longer segments are never planned).
    pub len: u32,
    /// Slot its hash is stored in.
    pub slot: u32,
}

/// One stored hash: the hash, then the tag `generation << 32 | len` written after it.
#[derive(Debug, Default)]
struct Slot {
    hash: AtomicU64,
    tag: AtomicU64,
}

/// Which destination segments of each read of a batch to hash while copying, and where the
/// hashes go (see the module docs). Built once per plan by the receiver, reused by every post
/// of its batch; [`HashPlan::begin`] before each post makes earlier posts' hashes stale.
#[derive(Debug)]
pub struct HashPlan {
    /// Per read `i`: its tasks are `tasks[starts[i]..starts[i + 1]]`, sorted by offset.
    starts: Vec<usize>,
    tasks: Vec<SegmentTask>,
    slots: Box<[Slot]>,
    /// The current post's generation (never 0, so a fresh slot matches none).
    generation: AtomicU64,
}

impl HashPlan {
    /// A plan over `reads` reads and `slots` slots; `tasks` lists `(read, task)` in any
    /// order. Tasks naming a read or slot out of range are dropped (the receiver then hashes
    /// those segments itself).
    pub fn new(
        reads: usize,
        slots: usize,
        tasks: impl IntoIterator<Item = (usize, SegmentTask)>,
    ) -> Self {
        let mut tasks: Vec<(usize, SegmentTask)> = tasks
            .into_iter()
            .filter(|(r, t)| *r < reads && (t.slot as usize) < slots)
            .collect();
        tasks.sort_unstable_by_key(|(r, t)| (*r, t.offset, t.len));
        let mut starts = vec![0usize; reads + 1];
        for (r, _) in &tasks {
            starts[r + 1] += 1;
        }
        for i in 0..reads {
            starts[i + 1] += starts[i];
        }
        HashPlan {
            starts,
            tasks: tasks.into_iter().map(|(_, t)| t).collect(),
            slots: (0..slots).map(|_| Slot::default()).collect(),
            generation: AtomicU64::new(1),
        }
    }

    /// Reads the plan covers.
    pub fn reads(&self) -> usize {
        self.starts.len() - 1
    }

    /// Slots the plan stores into.
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// The tasks of read `read`, sorted by offset (empty for a read out of range).
    pub fn tasks(&self, read: usize) -> &[SegmentTask] {
        match (self.starts.get(read), self.starts.get(read + 1)) {
            (Some(&a), Some(&b)) => &self.tasks[a..b],
            _ => &[],
        }
    }

    /// Starts a new post: hashes stored by earlier posts no longer count. Call it before the
    /// post whose hashes are read, never while a post of this plan runs.
    pub fn begin(&self) {
        let g = self.generation.load(Ordering::Relaxed);
        // 32 bits of generation in the tag: wraps after 2^32 posts, skipping 0.
        let next = (g + 1) & 0xffff_ffff;
        self.generation.store(next.max(1), Ordering::Release);
    }

    /// Stores `hash` of a `len`-byte segment in `slot` for the post of generation
    /// `generation`.
    fn store(&self, slot: u32, len: u32, hash: u64, generation: u64) {
        let s = &self.slots[slot as usize];
        s.hash.store(hash, Ordering::Relaxed);
        // Release: a reader that sees the tag sees the hash.
        s.tag
            .store((generation << 32) | u64::from(len), Ordering::Release);
    }

    /// The hash stored in `slot` by the current post for a segment of `len` bytes, if any.
    pub fn hash(&self, slot: usize, len: u64) -> Option<u64> {
        let s = self.slots.get(slot)?;
        let len = u32::try_from(len).ok()?;
        let want = (self.generation.load(Ordering::Acquire) << 32) | u64::from(len);
        (s.tag.load(Ordering::Acquire) == want).then(|| s.hash.load(Ordering::Relaxed))
    }

    /// A hasher for one piece of read `read`: the bytes from `offset` in the read on, which the
    /// caller copies in order on one thread. Only tasks starting at or after `offset` are
    /// hashed by it.
    pub fn piece(&self, read: usize, offset: u64) -> PieceHasher<'_> {
        let tasks = self.tasks(read);
        let next = tasks.partition_point(|t| t.offset < offset);
        PieceHasher {
            plan: self,
            tasks: &tasks[next..],
            start: offset,
            hashed: 0,
            // Taken now: a piece still running after a later `begin` (a call given up on)
            // stores under its own post, which no later reader takes.
            generation: self.generation.load(Ordering::Acquire),
        }
    }
}

/// Hashes the planned segments of one piece of one read as its bytes land (see
/// [`HashPlan::piece`] and [`crate::Transport::post_reporting`]).
#[derive(Debug)]
pub struct PieceHasher<'a> {
    plan: &'a HashPlan,
    /// Tasks not hashed yet, sorted by offset.
    tasks: &'a [SegmentTask],
    /// The piece's first byte, as an offset in its read.
    start: u64,
    hashed: u64,
    generation: u64,
}

impl PieceHasher<'_> {
    /// `landed` is the piece's destination bytes from its first byte up to the last byte
    /// copied so far (each call a longer prefix of the same memory), read back after the
    /// copy: hashes and stores every planned segment now wholly inside it. Returns the bytes
    /// hashed by this call.
    pub fn landed(&mut self, landed: &[u8]) -> u64 {
        let mut n = 0u64;
        while let Some(t) = self.tasks.first() {
            let from = (t.offset - self.start) as usize;
            let Some(bytes) = landed.get(from..from + t.len as usize) else {
                break;
            };
            let h = twox_hash::XxHash3_64::oneshot(bytes);
            self.plan.store(t.slot, t.len, h, self.generation);
            n += u64::from(t.len);
            self.tasks = &self.tasks[1..];
        }
        self.hashed += n;
        n
    }

    /// Bytes hashed so far.
    pub fn hashed(&self) -> u64 {
        self.hashed
    }

    /// Whether a planned segment is left that starts inside this piece (its bytes have not all
    /// landed yet, or it reaches past the piece).
    pub fn pending(&self) -> bool {
        !self.tasks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(offset: u64, len: u32, slot: u32) -> SegmentTask {
        SegmentTask { offset, len, slot }
    }

    #[test]
    fn pieces_hash_whole_segments_as_they_land_and_generations_expire_them() {
        let bytes: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        // Read 1: segments 0..100, 100..300, 300..301, 700..1000; read 0: one; a task of a
        // read out of range is dropped.
        let plan = HashPlan::new(
            2,
            6,
            [
                (1, t(300, 1, 2)),
                (1, t(0, 100, 0)),
                (1, t(100, 200, 1)),
                (0, t(0, 10, 4)),
                (1, t(700, 300, 3)),
                (5, t(0, 1, 5)),
            ],
        );
        assert_eq!(plan.tasks(1).len(), 4);
        assert!(plan.tasks(5).is_empty());
        let h = |r: std::ops::Range<usize>| twox_hash::XxHash3_64::oneshot(&bytes[r]);
        // Piece 0..500 of read 1, landing in blocks of 150 bytes.
        let mut p = plan.piece(1, 0);
        assert_eq!(p.landed(&bytes[..150]), 100);
        assert_eq!(plan.hash(0, 100), Some(h(0..100)));
        assert_eq!(plan.hash(1, 200), None, "not landed yet");
        assert_eq!(p.landed(&bytes[..300]), 200);
        assert_eq!(p.landed(&bytes[..500]), 1);
        assert_eq!(p.hashed(), 301);
        assert!(p.pending(), "700..1000 lies past this piece");
        // A piece from 650: the segment at 700 is its to hash; nothing before it.
        let mut q = plan.piece(1, 650);
        assert_eq!(q.landed(&bytes[650..1000]), 300);
        assert!(!q.pending());
        assert_eq!(plan.hash(3, 300), Some(h(700..1000)));
        assert_eq!(plan.hash(1, 200), Some(h(100..300)));
        assert_eq!(plan.hash(1, 199), None, "another length is another segment");
        // The next post: nothing stored counts until stored again, and a piece of the post
        // before that stores late stores under its own generation.
        let mut late = plan.piece(1, 0);
        plan.begin();
        late.landed(&bytes[..100]);
        assert_eq!(plan.hash(0, 100), None);
        assert_eq!(plan.hash(0, 100), None);
        plan.piece(1, 0).landed(&bytes[..100]);
        assert_eq!(plan.hash(0, 100), Some(h(0..100)));
        assert_eq!(plan.hash(99, 1), None);
    }
}
