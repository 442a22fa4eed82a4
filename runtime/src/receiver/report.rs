//! What one update reports: [`UpdateReport`] and its per-stage clock, [`StageTimes`]
//! (docs/design.md §7).

use serde::Serialize;

use reshard_core::{DedupReport, PlanStats};

/// Seconds spent in each stage of one update (docs/design.md §7).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StageTimes {
    /// Gathering and decoding publishers' tables.
    pub discover: f64,
    /// Merging tables.
    pub merge: f64,
    /// Replica dedup.
    pub dedup: f64,
    /// Planning (near zero when the cached plan holds).
    pub plan: f64,
    /// Allocating and registering buffers (near zero when cached), and the coverage gate.
    pub register: f64,
    /// Building transport descriptors (near zero when cached; always timed).
    pub descriptor_build: f64,
    /// The wire leg: post all owners, await all, ceiling guard.
    pub wire: f64,
    /// Re-slicing full pulls into parameters (after the wire leg: the baseline arm; the
    /// reshard arm re-slices as the bytes land, inside `wire`, and what is left after it is
    /// timed in `verify`).
    pub reslice: f64,
    /// Swapping the new weights in.
    pub install: f64,
    /// Digest verification (the coverage gate runs in `register`); in the reshard arm, the
    /// checks and re-slices left after the wire leg (the rest ran as the bytes landed).
    pub verify: f64,
}

impl StageTimes {
    /// Stage names in pipeline order.
    pub const NAMES: [&'static str; 10] = [
        "discover",
        "merge",
        "dedup",
        "plan",
        "register",
        "descriptor_build",
        "wire",
        "reslice",
        "install",
        "verify",
    ];

    /// Stage values in [`StageTimes::NAMES`] order.
    pub fn values(&self) -> [f64; 10] {
        [
            self.discover,
            self.merge,
            self.dedup,
            self.plan,
            self.register,
            self.descriptor_build,
            self.wire,
            self.reslice,
            self.install,
            self.verify,
        ]
    }

    /// Builds from values in [`StageTimes::NAMES`] order.
    pub fn from_values(v: [f64; 10]) -> Self {
        StageTimes {
            discover: v[0],
            merge: v[1],
            dedup: v[2],
            plan: v[3],
            register: v[4],
            descriptor_build: v[5],
            wire: v[6],
            reslice: v[7],
            install: v[8],
            verify: v[9],
        }
    }

    /// Sum of all stages.
    pub fn sum(&self) -> f64 {
        self.values().iter().sum()
    }
}

/// What one update did and how long each part took.
#[derive(Debug, Clone, Serialize)]
pub struct UpdateReport {
    /// Receiver rank.
    pub receiver_rank: u32,
    /// Training step installed.
    pub step: u64,
    /// Stage times.
    pub stages: StageTimes,
    /// End-to-end seconds of the update.
    pub e2e_s: f64,
    /// Sum of stages over end-to-end; below 0.95 the breakdown is not reportable.
    pub attribution: f64,
    /// The plan was (re)built in this update.
    pub plan_rebuilt: bool,
    /// Descriptors were (re)built in this update.
    pub descriptors_rebuilt: bool,
    /// Plan statistics.
    pub plan: PlanStats,
    /// Plan fingerprint.
    pub fingerprint: u64,
    /// Dedup report of this update's tables.
    pub dedup: DedupReport,
    /// Reads posted on the wire (after coalescing).
    pub wire_reads: u64,
    /// Bytes moved on the wire.
    pub wire_bytes: u64,
    /// Effective wire rate in GB/s (10^9 bytes per second).
    pub wire_gbytes_per_s: f64,
    /// Digest checks that passed.
    pub checks_passed: u64,
    /// Bytes verified against publisher digests.
    pub checked_bytes: u64,
    /// Of `checked_bytes`, bytes whose segment hashes the backend computed while copying them
    /// (docs/in-flight-safety.md, "Hashing while copying"): their checks only folded the
    /// hashes and read no byte again. The rest were hashed from the destination.
    pub copy_hashed_bytes: u64,
    /// Checks skipped because the publisher sent no digest.
    pub checks_without_digest: u64,
    /// Bytes the re-slice stage wrote into parameters (the re-slice rate's numerator).
    pub resliced_bytes: u64,
    /// Digest checks run while the wire leg was still in flight, as their bytes landed (the
    /// reshard arm; 0 in the baseline arm, which verifies after the wire leg).
    pub checks_while_on_wire: u64,
    /// Re-slices run while the wire leg was still in flight (as `checks_while_on_wire`).
    pub reslices_while_on_wire: u64,
}

impl UpdateReport {
    /// Every byte this update installed was compared with a publisher digest and matched: each
    /// byte on the wire lies under exactly one of the plan's checks (directly in a parameter, or
    /// in staging that the re-slice reads), so the bytes checked must equal the bytes moved,
    /// with no check skipped for want of a digest (docs/design.md §6). False when verification
    /// is off or a publisher sent no digests.
    pub fn fully_checked(&self) -> bool {
        self.checks_without_digest == 0 && self.checked_bytes == self.wire_bytes
    }
}
