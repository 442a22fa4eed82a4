//! The no-progress timer of docs/in-flight-safety.md, rule 4, written once: every wait for a
//! batch (and every drain after it ended) is bounded by the time since the batch last
//! progressed, never by a total deadline. [`NoProgress`] is that clock; each backend decides
//! what counts as progress (a call returned, a request or get ended) and keeps its own bound
//! and error messages. [`longest_first`] orders the owners a timeout names, the same way in
//! every backend that names them.

use std::time::{Duration, Instant};

use crate::model::OwnerId;

/// When a batch last progressed and, once it was ended, since when: the time without progress
/// is counted from the later of the two, so a batch ended after a long quiet spell still gets
/// its whole bound to wind down.
#[derive(Debug, Clone, Copy)]
pub struct NoProgress {
    last: Instant,
    ended: Option<Instant>,
}

impl Default for NoProgress {
    fn default() -> Self {
        Self::new()
    }
}

impl NoProgress {
    /// A clock started now (a batch starting counts as progress).
    pub fn new() -> Self {
        NoProgress {
            last: Instant::now(),
            ended: None,
        }
    }

    /// The batch progressed at `now`.
    pub fn progressed(&mut self, now: Instant) {
        self.last = now;
    }

    /// The batch ended at `now`; true for the first end (later ends change nothing).
    pub fn end(&mut self, now: Instant) -> bool {
        if self.ended.is_some() {
            return false;
        }
        self.ended = Some(now);
        true
    }

    /// Whether the batch has ended.
    pub fn is_ended(&self) -> bool {
        self.ended.is_some()
    }

    /// How long the batch has not progressed at `now`, counted from its end at the earliest.
    pub fn idle(&self, now: Instant) -> Duration {
        let from = match self.ended {
            Some(at) => at.max(self.last),
            None => self.last,
        };
        now.saturating_duration_since(from)
    }

    /// Whether the batch has not progressed for at least `bound` at `now`.
    pub fn stalled(&self, now: Instant, bound: Duration) -> bool {
        self.idle(now) >= bound
    }

    /// How much of `bound` is left at `now` (zero once stalled).
    pub fn left(&self, now: Instant, bound: Duration) -> Duration {
        bound.saturating_sub(self.idle(now))
    }
}

/// Orders owners with how long their reads made no progress: the longest first (the owner a
/// dead link cut off first, not a healthy one that merely has a read pending), ties by owner.
pub fn longest_first(stalled: &mut [(OwnerId, Duration)]) {
    stalled.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn idle_counts_from_the_last_progress() {
        let mut c = NoProgress::new();
        let t0 = Instant::now();
        c.progressed(t0);
        assert_eq!(c.idle(t0 + 30 * MS), 30 * MS);
        assert!(!c.stalled(t0 + 30 * MS, 31 * MS));
        assert!(
            c.stalled(t0 + 31 * MS, 31 * MS),
            "the bound itself is stalled"
        );
        assert_eq!(c.left(t0 + 30 * MS, 50 * MS), 20 * MS);
        assert_eq!(c.left(t0 + 80 * MS, 50 * MS), Duration::ZERO);
        c.progressed(t0 + 40 * MS);
        assert_eq!(c.idle(t0 + 50 * MS), 10 * MS, "progress restarts the clock");
        assert_eq!(c.idle(t0), Duration::ZERO, "never negative");
    }

    #[test]
    fn after_the_end_idle_counts_from_the_end_at_the_earliest() {
        let mut c = NoProgress::new();
        let t0 = Instant::now();
        c.progressed(t0);
        assert!(!c.is_ended());
        assert!(c.end(t0 + 100 * MS), "the first end");
        assert!(!c.end(t0 + 200 * MS), "a later end changes nothing");
        assert!(c.is_ended());
        assert_eq!(c.idle(t0 + 110 * MS), 10 * MS);
        c.progressed(t0 + 150 * MS);
        assert_eq!(c.idle(t0 + 160 * MS), 10 * MS);
    }

    #[test]
    fn longest_stalled_owner_first_then_by_owner() {
        let mut v = vec![(3, 5 * MS), (1, 9 * MS), (2, 5 * MS), (0, MS)];
        longest_first(&mut v);
        assert_eq!(v, [(1, 9 * MS), (2, 5 * MS), (3, 5 * MS), (0, MS)]);
    }
}
