//! Stage, apply, roll back (python/README.md, "Stage, apply, roll back"): the [`Staged`] handle
//! of a verified step waiting in the bank that is not live, making it live, and making the
//! previous step live again from the bank that still holds it.
//!
//! Two banks give one step of history. After an apply the bank that was live holds the
//! previous step and is the landing bank of the next stage; a rollback swaps back to it (no
//! wire, no publisher). The next stage's wire leg overwrites it, so from then on there is
//! nothing to roll back to until another apply.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use reshard_core::{Error, ErrorDetail, ErrorKind, NoRollback, NotApplicable, Result};

use super::{Receiver, UpdateReport};

/// A handle's state: still staged, or why not any more (shared by its clones and the receiver).
const PENDING: u8 = 0;
const APPLIED: u8 = 1;
const REPLACED: u8 = 2;
const DISCARDED: u8 = 3;

/// A process-unique receiver id, so a handle staged by one receiver is refused by another.
pub(super) fn next_receiver_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A verified step waiting in the bank that is not live ([`Receiver::stage`]); pass it to
/// [`Receiver::apply`] to make it live. A handle is good for one apply, on the receiver that
/// staged it, until the next stage or refit of that receiver lands in its bank.
#[derive(Debug, Clone)]
pub struct Staged {
    receiver: u64,
    ticket: u64,
    step: u64,
    report: UpdateReport,
    state: Arc<AtomicU8>,
}

impl Staged {
    /// The training step staged.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The stage's report: every stage but `install`, which [`Receiver::apply`] times.
    pub fn report(&self) -> &UpdateReport {
        &self.report
    }

    /// Whether the handle can still be applied, or why not (a later stage replaced it, it was
    /// applied, its buffers were discarded); whether it belongs to a given receiver is
    /// [`Receiver::apply`]'s check.
    pub fn applicable(&self) -> std::result::Result<(), NotApplicable> {
        match self.state.load(Ordering::SeqCst) {
            PENDING => Ok(()),
            APPLIED => Err(NotApplicable::Applied),
            REPLACED => Err(NotApplicable::Replaced),
            _ => Err(NotApplicable::Discarded),
        }
    }
}

/// What one rollback did.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RollbackReport {
    /// Receiver rank.
    pub receiver_rank: u32,
    /// The step live now (the previous one).
    pub step: u64,
    /// The step that was live before the rollback.
    pub rolled_back_from: u64,
    /// Seconds the swap took (no bytes move).
    pub install_s: f64,
}

/// The receiver's side of a staged step.
pub(super) struct Slot {
    ticket: u64,
    generation: u64,
    bank: usize,
    step: u64,
    state: Arc<AtomicU8>,
}

/// A step a rollback can make live again: it is in `bank` of the banks of `generation`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Previous {
    generation: u64,
    bank: usize,
    step: u64,
}

impl Receiver {
    /// The step staged and not applied yet, if any.
    pub fn staged_step(&self) -> Option<u64> {
        self.staged.as_ref().map(|s| s.step)
    }

    /// The step a [`Receiver::rollback`] would make live, or why there is none.
    pub fn rollback_step(&self) -> std::result::Result<u64, NoRollback> {
        self.previous.map(|p| p.step)
    }

    /// Makes `staged` live: the receiver's live weights become the bank it was verified in (a
    /// pointer swap; nothing is copied or moved), and the bank that was live keeps its step for
    /// [`Receiver::rollback`] until the next stage lands in it. Returns the stage's report with
    /// `install` timed.
    ///
    /// Applying a step older or newer than the live one, or not the newest the publishers
    /// offer, is allowed: the caller chose it. Refused with `InvalidInput` and
    /// [`ErrorDetail::NotApplicable`], changing nothing: a handle of another receiver, one
    /// applied already, one a later stage or refit replaced, one whose buffers were discarded.
    pub fn apply(&mut self, staged: &Staged) -> Result<UpdateReport> {
        let t0 = Instant::now();
        let refuse =
            |reason: NotApplicable| not_applicable(self.layout.receiver_rank, staged.step, reason);
        if staged.receiver != self.id {
            return Err(refuse(NotApplicable::OtherReceiver));
        }
        staged.applicable().map_err(refuse)?;
        let slot = match &self.staged {
            Some(s) if s.ticket == staged.ticket => s,
            // A handle of this receiver that is pending but not the staged one: cannot happen
            // (replacing or discarding marks it), refused all the same.
            _ => return Err(refuse(NotApplicable::Replaced)),
        };
        let (generation, bank, step) = (slot.generation, slot.bank, slot.step);
        let prep = match self.prepared.as_mut() {
            Some(p) if p.generation == generation && !self.wire_leg_open => p,
            _ => return Err(refuse(NotApplicable::Discarded)),
        };
        self.previous = match (self.live_at, self.step) {
            (Some((g, b)), Some(live)) if g == generation => Ok(Previous {
                generation,
                bank: b,
                step: live,
            }),
            (_, None) => Err(NoRollback::NoPrevious),
            // The live weights are in banks discarded since: nothing of them to go back to.
            _ => Err(NoRollback::Discarded),
        };
        prep.next = 1 - bank;
        self.live = Some(prep.banks[bank].params.clone());
        self.step = Some(step);
        self.live_at = Some((generation, bank));
        if let Some(s) = self.staged.take() {
            s.state.store(APPLIED, Ordering::SeqCst);
        }
        let mut report = staged.report.clone();
        report.stages.install = t0.elapsed().as_secs_f64();
        report.e2e_s += report.stages.install;
        report.attribution = if report.e2e_s > 0.0 {
            report.stages.sum() / report.e2e_s
        } else {
            1.0
        };
        Ok(report)
    }

    /// Makes the previous step live again from the bank that still holds it: no wire, no
    /// publisher (they may be gone). The step rolled back from stays in the other bank, which
    /// becomes the landing bank. Refused with `InvalidInput` and [`ErrorDetail::NoRollback`],
    /// changing nothing, when there is no previous step in a bank: none was live before the
    /// live one (the first step, or a rollback went back already), a stage or refit landed in
    /// its bank since (a staged step included), or the banks were discarded.
    pub fn rollback(&mut self) -> Result<RollbackReport> {
        let t0 = Instant::now();
        let rank = self.layout.receiver_rank;
        let prev = self.previous.map_err(|r| no_rollback(rank, self.step, r))?;
        let prep = match self.prepared.as_mut() {
            Some(p) if p.generation == prev.generation && !self.wire_leg_open => p,
            _ => return Err(no_rollback(rank, self.step, NoRollback::Discarded)),
        };
        let from = self.step.ok_or_else(|| {
            Error::new(ErrorKind::Internal, "a rollback target with no live step")
        })?;
        prep.next = 1 - prev.bank;
        self.live = Some(prep.banks[prev.bank].params.clone());
        self.step = Some(prev.step);
        self.live_at = Some((prev.generation, prev.bank));
        self.previous = Err(NoRollback::NoPrevious);
        Ok(RollbackReport {
            receiver_rank: rank,
            step: prev.step,
            rolled_back_from: from,
            install_s: t0.elapsed().as_secs_f64(),
        })
    }

    /// Records the step just verified in `bank` as staged, and returns its handle.
    pub(super) fn hold_staged(
        &mut self,
        bank: usize,
        generation: u64,
        step: u64,
        report: UpdateReport,
    ) -> Staged {
        self.tickets += 1;
        let state = Arc::new(AtomicU8::new(PENDING));
        self.staged = Some(Slot {
            ticket: self.tickets,
            generation,
            bank,
            step,
            state: state.clone(),
        });
        Staged {
            receiver: self.id,
            ticket: self.tickets,
            step,
            report,
            state,
        }
    }

    /// The landing bank is about to be written: the staged step and the rollback target it
    /// held are gone.
    pub(super) fn forget_landing(&mut self) {
        if let Some(s) = self.staged.take() {
            s.state.store(REPLACED, Ordering::SeqCst);
        }
        if self.previous.is_ok() {
            self.previous = Err(NoRollback::Overwritten);
        }
    }

    /// Drops both banks (their registrations go back to the transport; the live weights keep
    /// their own references): a staged step and the rollback target go with them.
    pub(super) fn discard_banks(&mut self) {
        self.prepared = None;
        if let Some(s) = self.staged.take() {
            s.state.store(DISCARDED, Ordering::SeqCst);
        }
        if self.previous.is_ok() {
            self.previous = Err(NoRollback::Discarded);
        }
        self.live_at = None;
    }
}

fn not_applicable(rank: u32, step: u64, reason: NotApplicable) -> Error {
    let why = match reason {
        NotApplicable::OtherReceiver => "it was staged by another receiver",
        NotApplicable::Applied => "it was applied already",
        NotApplicable::Replaced => {
            "a later stage or refit landed in its bank (only the newest staged step can be applied)"
        }
        _ => {
            "the receiver discarded its buffers since (a new transport, a wire leg cut short, \
              or closed)"
        }
    };
    Error::new(
        ErrorKind::InvalidInput,
        format!(
            "receiver rank {rank} cannot apply staged step {step}: {why}; nothing changed, the \
             live weights are untouched"
        ),
    )
    .with_detail(ErrorDetail::NotApplicable { step, reason })
}

fn no_rollback(rank: u32, live_step: Option<u64>, reason: NoRollback) -> Error {
    let why = match reason {
        NoRollback::NoPrevious => {
            "no step was live before the live one (the first step, or a rollback went back \
             already)"
        }
        NoRollback::Overwritten => {
            "a stage or refit landed in the bank that held the previous step (two banks keep one \
             step of history, until the next stage)"
        }
        _ => {
            "the receiver discarded its buffers since (a new transport, or a wire leg cut \
              short)"
        }
    };
    let live = live_step.map_or_else(|| "no step".to_string(), |s| format!("step {s}"));
    Error::new(
        ErrorKind::InvalidInput,
        format!(
            "receiver rank {rank} has nothing to roll back to: {why}; nothing changed, {live} \
             stays live"
        ),
    )
    .with_detail(ErrorDetail::NoRollback { live_step, reason })
}
