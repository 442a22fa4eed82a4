//! Fault-injection knobs a backend offers the conformance suite behind its `fault-injection`
//! feature: the one shared piece is which read of a batch to leave out, as a backend that loses
//! a read would (the suite checks that counts, logs and verification all notice).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// No read is skipped.
const NONE: u64 = u64::MAX;

/// Which read (in batch order) the next posts leave out; none unless armed. Clones share one
/// knob, so a transport can arm what its worker thread reads.
#[derive(Debug, Clone)]
pub struct SkipRead(Arc<AtomicU64>);

impl Default for SkipRead {
    fn default() -> Self {
        Self(Arc::new(AtomicU64::new(NONE)))
    }
}

impl SkipRead {
    /// Arms the knob with read `read` of every later batch, or disarms it with `None`.
    pub fn set(&self, read: Option<usize>) {
        let v = read.and_then(|r| u64::try_from(r).ok()).unwrap_or(NONE);
        self.0.store(v, Ordering::Relaxed);
    }

    /// The read to leave out, when armed (reads past `u32::MAX` cannot be named and never are).
    pub fn get(&self) -> Option<u32> {
        u32::try_from(self.0.load(Ordering::Relaxed)).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unarmed_by_default_then_armed_then_disarmed() {
        let k = SkipRead::default();
        assert_eq!(k.get(), None);
        k.set(Some(3));
        assert_eq!(k.get(), Some(3));
        k.set(Some(0));
        assert_eq!(k.get(), Some(0));
        k.set(None);
        assert_eq!(k.get(), None);
        k.set(Some(usize::MAX));
        assert_eq!(k.get(), None);
    }

    #[test]
    fn clones_share_one_knob() {
        let k = SkipRead::default();
        let worker = k.clone();
        k.set(Some(7));
        assert_eq!(worker.get(), Some(7));
        worker.set(None);
        assert_eq!(k.get(), None);
    }
}
