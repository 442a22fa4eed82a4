//! The gate that ends a posted batch (docs/in-flight-safety.md, rule 1), for backends whose own
//! threads touch the batch's memory (copy workers, `process_vm_readv` calls).
//!
//! A worker [enters](GateGuard::enter) under a ticket of its choosing (a job or call index)
//! before its first access to the batch's memory and [leaves](GateGuard::leave) after its last
//! one, including any completion it reports; ending the batch [closes](GateGuard::close) the
//! gate, after which no worker enters, and then waits until no one is inside
//! ([`BatchGate::close_and_wait`], unbounded, or [`BatchGate::drain`], bounded). What the gate
//! guarantees:
//!
//! - once a close has seen the gate empty, nothing of the batch touches memory again: every
//!   worker that entered has left, and every later [`enter`](GateGuard::enter) fails;
//! - a worker that reports a completion while still inside, under the gate's lock, reports
//!   before the ending sees the gate empty, or after the ending gave up on it
//!   ([`BatchGate::drain`] hands the caller the still-locked gate to quarantine those inside,
//!   which the worker then sees under the same lock and reports nothing);
//! - the bounded wait counts from the last time a worker left, and never from before the close:
//!   it gives up only when no worker has left for the whole bound since the batch ended.
//!
//! The gate keeps its backend's own per-batch state `S` under the same lock, so what a worker
//! claims, counts or reports changes atomically with who is inside. The gate does not stop a
//! worker that is inside; a backend does that with its own means (an abort flag checked between
//! chunks, work cut into pieces), so that a close waits for one piece per worker.

use std::ops::{Deref, DerefMut};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::progress::NoProgress;

/// One posted batch's gate and the backend's state `S` kept under its lock.
pub struct BatchGate<S = ()> {
    state: Mutex<GateState<S>>,
    /// Signalled whenever a worker leaves.
    left: Condvar,
}

struct GateState<S> {
    /// When a worker last left (or the gate was made), and when the gate closed: ended once
    /// (by the first close) and never reopened, so no worker enters afterwards.
    clock: NoProgress,
    /// Tickets of the workers inside.
    inside: Vec<usize>,
    extra: S,
}

/// The locked gate: who is inside, open or closed, and the backend's state (through `Deref`).
pub struct GateGuard<'a, S> {
    st: MutexGuard<'a, GateState<S>>,
    left: &'a Condvar,
}

impl<S: Default> Default for BatchGate<S> {
    fn default() -> Self {
        Self::new(S::default())
    }
}

impl<S> BatchGate<S> {
    /// An open gate with no one inside, keeping `state`.
    pub fn new(state: S) -> Self {
        BatchGate {
            state: Mutex::new(GateState {
                clock: NoProgress::new(),
                inside: Vec::new(),
                extra: state,
            }),
            left: Condvar::new(),
        }
    }

    /// Locks the gate.
    pub fn lock(&self) -> GateGuard<'_, S> {
        GateGuard {
            st: self.state.lock(),
            left: &self.left,
        }
    }

    /// Closes the gate and blocks until no worker is inside, however long that takes: for
    /// backends whose workers stop within a bounded piece of work once asked.
    pub fn close_and_wait(&self) {
        let mut g = self.lock();
        g.close();
        while !g.st.inside.is_empty() {
            self.left.wait(&mut g.st);
        }
    }

    /// Blocks until no worker is inside (call after a close), or until no worker has left for
    /// `bound` since the gate closed (counted from the close at the earliest); then returns the
    /// gate still locked, so the caller can quarantine the workers inside before any of them
    /// reports again.
    pub fn drain(&self, bound: Duration) -> Result<(), GateGuard<'_, S>> {
        let mut g = self.lock();
        loop {
            if g.st.inside.is_empty() {
                return Ok(());
            }
            let idle = g.idle_since_end();
            if idle >= bound {
                return Err(g);
            }
            self.left.wait_for(&mut g.st, bound - idle);
        }
    }
}

impl<S> GateGuard<'_, S> {
    /// Enters under `ticket` unless the gate is closed (then false: the worker must not touch
    /// the batch's memory).
    pub fn enter(&mut self, ticket: usize) -> bool {
        if self.st.clock.is_ended() {
            return false;
        }
        self.st.inside.push(ticket);
        true
    }

    /// Leaves (the worker under `ticket` touches the batch's memory no more), which counts as
    /// progress, and wakes a waiting close.
    pub fn leave(&mut self, ticket: usize) {
        if let Some(k) = self.st.inside.iter().position(|&t| t == ticket) {
            self.st.inside.swap_remove(k);
        }
        self.st.clock.progressed(Instant::now());
        self.left.notify_all();
    }

    /// Closes the gate: no worker enters from now on. True if this call closed it (the first
    /// close), false if it was closed already.
    pub fn close(&mut self) -> bool {
        self.st.clock.end(Instant::now())
    }

    /// Whether the gate is closed.
    pub fn is_closed(&self) -> bool {
        self.st.clock.is_ended()
    }

    /// Tickets of the workers inside, in no particular order.
    pub fn inside(&self) -> &[usize] {
        &self.st.inside
    }

    /// How long no worker has left, counted from the close at the earliest.
    pub fn idle_since_end(&self) -> Duration {
        self.st.clock.idle(Instant::now())
    }
}

impl<S> Deref for GateGuard<'_, S> {
    type Target = S;
    fn deref(&self) -> &S {
        &self.st.extra
    }
}

impl<S> DerefMut for GateGuard<'_, S> {
    fn deref_mut(&mut self) -> &mut S {
        &mut self.st.extra
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::thread;

    #[test]
    fn closed_gate_refuses_entry_and_first_close_says_so() {
        let g: BatchGate = BatchGate::default();
        assert!(g.lock().enter(0));
        assert_eq!(g.lock().inside(), [0]);
        let mut l = g.lock();
        assert!(!l.is_closed());
        assert!(l.close(), "the first close closes");
        assert!(!l.close(), "a second finds it closed");
        assert!(!l.enter(1), "no worker enters a closed gate");
        assert_eq!(l.inside(), [0]);
        l.leave(0);
        assert!(l.inside().is_empty());
    }

    #[test]
    fn close_and_wait_returns_only_after_the_worker_inside_left() {
        let g = Arc::new(BatchGate::<()>::default());
        let done = Arc::new(AtomicBool::new(false));
        assert!(g.lock().enter(7));
        let worker = {
            let (g, done) = (Arc::clone(&g), Arc::clone(&done));
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(50));
                done.store(true, Ordering::SeqCst);
                g.lock().leave(7);
            })
        };
        g.close_and_wait();
        assert!(
            done.load(Ordering::SeqCst),
            "returned before the worker left"
        );
        assert!(!g.lock().enter(8));
        worker.join().unwrap();
    }

    #[test]
    fn drain_waits_for_progress_and_gives_up_only_after_the_bound_without_it() {
        let g = Arc::new(BatchGate::new(0u32));
        {
            let mut l = g.lock();
            assert!(l.enter(1) && l.enter(2));
            *l += 1;
        }
        // Worker 1 leaves within the bound; worker 2 never does.
        let worker = {
            let g = Arc::clone(&g);
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(60));
                g.lock().leave(1);
            })
        };
        g.lock().close();
        let start = Instant::now();
        let stuck = g
            .drain(Duration::from_millis(100))
            .expect_err("worker 2 stays");
        // Worker 1 left at ~60 ms, which restarted the bound: the drain gave up at ~160 ms.
        assert!(
            start.elapsed() >= Duration::from_millis(150),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(stuck.inside(), [2]);
        assert_eq!(*stuck, 1, "the backend's state is kept under the lock");
        drop(stuck);
        worker.join().unwrap();
        g.lock().leave(2);
        assert!(g.drain(Duration::ZERO).is_ok());
    }

    #[test]
    fn drain_counts_from_the_close_not_from_an_earlier_leave() {
        let g = BatchGate::<()>::default();
        assert!(g.lock().enter(0));
        thread::sleep(Duration::from_millis(80));
        g.lock().close();
        let start = Instant::now();
        assert!(g.drain(Duration::from_millis(50)).is_err());
        assert!(
            start.elapsed() >= Duration::from_millis(45),
            "{:?}",
            start.elapsed()
        );
    }
}
