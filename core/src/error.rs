//! The one public error type of reshard: a kind, a message, context (tensor, owner, byte range,
//! backend) and a retryable flag. Tests assert [`ErrorKind`], never message text.

use std::fmt;
use std::ops::Range;

/// What went wrong, as a stable, matchable kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// An argument is invalid (unknown tensor, bad size, ...).
    InvalidInput,
    /// Encoded shard table or metadata could not be decoded (truncated, wrong version, bad value).
    Decode,
    /// A shard table is internally invalid (box outside shape, zero extent, duplicate names...).
    InvalidTable,
    /// Two publishers disagree on a tensor's dtype or global shape.
    InconsistentTensor,
    /// Offers with the same box carry different digests: they are not replicas.
    ReplicaDivergence,
    /// A wanted box is not (fully) offered by any publisher.
    MissingCoverage,
    /// Distinct offers partially overlap inside a wanted box (would read bytes twice).
    OverlappingOffers,
    /// A receiver layout cannot be built (TP does not divide an extent, bad strides...).
    Layout,
    /// A read or registration falls outside a registered memory region.
    OutOfBounds,
    /// A read names an owner whose metadata was never loaded.
    PeerUnknown,
    /// The transport failed to move bytes.
    Transport,
    /// The operation was aborted.
    Aborted,
    /// Installed bytes do not match the publisher's digest.
    Verification,
    /// A guard (throughput ceiling, coverage floor) refused the update.
    Guard,
    /// Configuration is invalid (unknown key, unknown transport kind...).
    Config,
    /// The backend does not support what was asked.
    Unsupported,
    /// A backend's native library or runtime is not installed on this machine (the message
    /// says how to install it).
    Unavailable,
    /// A wait (connect, post, completion, discovery) ran past its configured timeout.
    Timeout,
    /// A bug or broken invariant inside reshard.
    Internal,
}

impl ErrorKind {
    /// Every kind, for parsing names back (errors that crossed a process boundary).
    pub const ALL: [ErrorKind; 19] = [
        ErrorKind::InvalidInput,
        ErrorKind::Decode,
        ErrorKind::InvalidTable,
        ErrorKind::InconsistentTensor,
        ErrorKind::ReplicaDivergence,
        ErrorKind::MissingCoverage,
        ErrorKind::OverlappingOffers,
        ErrorKind::Layout,
        ErrorKind::OutOfBounds,
        ErrorKind::PeerUnknown,
        ErrorKind::Transport,
        ErrorKind::Aborted,
        ErrorKind::Verification,
        ErrorKind::Guard,
        ErrorKind::Config,
        ErrorKind::Unsupported,
        ErrorKind::Unavailable,
        ErrorKind::Timeout,
        ErrorKind::Internal,
    ];

    /// The kind whose [`ErrorKind::as_str`] is `name`.
    pub fn from_name(name: &str) -> Option<ErrorKind> {
        Self::ALL.into_iter().find(|k| k.as_str() == name)
    }

    /// A short snake_case name, stable for JSON output.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidInput => "invalid_input",
            ErrorKind::Decode => "decode",
            ErrorKind::InvalidTable => "invalid_table",
            ErrorKind::InconsistentTensor => "inconsistent_tensor",
            ErrorKind::ReplicaDivergence => "replica_divergence",
            ErrorKind::MissingCoverage => "missing_coverage",
            ErrorKind::OverlappingOffers => "overlapping_offers",
            ErrorKind::Layout => "layout",
            ErrorKind::OutOfBounds => "out_of_bounds",
            ErrorKind::PeerUnknown => "peer_unknown",
            ErrorKind::Transport => "transport",
            ErrorKind::Aborted => "aborted",
            ErrorKind::Verification => "verification",
            ErrorKind::Guard => "guard",
            ErrorKind::Config => "config",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Internal => "internal",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where an error happened: every field is optional and filled in by whoever knows it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ErrorContext {
    /// Tensor (global name) involved.
    pub tensor: Option<String>,
    /// Publisher rank / owner involved.
    pub owner: Option<u32>,
    /// Byte range involved (in the owner's region, or the local buffer).
    pub range: Option<Range<u64>>,
    /// Backend (transport scheme) that reported it.
    pub backend: Option<String>,
}

/// Structured facts for the domain errors that users act on, beyond kind and context.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorDetail {
    /// Two publishers disagree on one tensor.
    InconsistentTensor {
        /// Tensor name.
        tensor: String,
        /// First publisher rank.
        rank_a: u32,
        /// Second publisher rank.
        rank_b: u32,
        /// What differs ("dtype bf16 vs f32", "shape [4, 8] vs [4, 16]").
        what: String,
    },
    /// Same box, different digests.
    ReplicaDivergence {
        /// Tensor name.
        tensor: String,
        /// The shared box.
        tensor_box: crate::model::TensorBox,
        /// The two owners whose digests differ.
        owners: (u32, u32),
        /// Hex prefixes of the two digests.
        digest_prefixes: (String, String),
    },
    /// A wanted box (or part of it) that nobody offers.
    MissingCoverage {
        /// Tensor name.
        tensor: String,
        /// A box of the tensor that is wanted and not offered.
        missing: crate::model::TensorBox,
    },
    /// A publisher's table is older than the weights the receiver already installed.
    StaleStep {
        /// The stale publisher's rank.
        owner: u32,
        /// The training step of its table.
        step: u64,
        /// The training step of the receiver's live weights.
        live_step: u64,
    },
    /// Publishers in one update are at different training steps.
    MixedSteps {
        /// Rank of the first table's publisher.
        rank_a: u32,
        /// Its step.
        step_a: u64,
        /// Rank of the first publisher at another step.
        rank_b: u32,
        /// Its step.
        step_b: u64,
    },
    /// A wire leg (post, wait and any retries inside the bound) ran past the limit of a
    /// timeout layer, which dropped the wait part-way (kind [`ErrorKind::Timeout`], retryable).
    ///
    /// Dropping the wait ends the batch by the transport contract, but a receiver treats the
    /// buffers the batch targeted as suspect: the wait was cut short rather than answered.
    WireLegTimedOut {
        /// The limit that was exceeded, in milliseconds.
        limit_ms: u64,
    },
    /// A staged step cannot be applied (kind [`ErrorKind::InvalidInput`]); nothing changed.
    NotApplicable {
        /// The step the handle staged.
        step: u64,
        /// Why.
        reason: NotApplicable,
    },
    /// The publishers of a step moved on (one began to rewrite its memory, advanced or
    /// restarted) between discovery and the moment this receiver claimed their memory (the
    /// reader fence, docs/deployment.md): nothing was read, the live weights are untouched, and
    /// discovering again finds the step to read (kind [`ErrorKind::PeerUnknown`], retryable).
    MovedOn {
        /// The step that was found and not read.
        step: u64,
    },
    /// A rollback found no earlier step to make live (kind [`ErrorKind::InvalidInput`]);
    /// nothing changed.
    NoRollback {
        /// The live step, which stays live.
        live_step: Option<u64>,
        /// Why.
        reason: NoRollback,
    },
}

/// Why a staged step cannot be applied ([`ErrorDetail::NotApplicable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum NotApplicable {
    /// The handle was staged by another receiver.
    OtherReceiver,
    /// The handle was applied already.
    Applied,
    /// A later stage (or refit) landed in the bank this step was staged in.
    Replaced,
    /// The receiver discarded its buffers since (a new transport, a wire leg cut short), or
    /// was closed.
    Discarded,
}

impl NotApplicable {
    /// A stable name (`other_receiver`, `applied`, `replaced`, `discarded`).
    pub fn as_str(self) -> &'static str {
        match self {
            NotApplicable::OtherReceiver => "other_receiver",
            NotApplicable::Applied => "applied",
            NotApplicable::Replaced => "replaced",
            NotApplicable::Discarded => "discarded",
        }
    }
}

/// Why there is no step to roll back to ([`ErrorDetail::NoRollback`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum NoRollback {
    /// No step was live before the live one (the first step, or a rollback already went back).
    NoPrevious,
    /// A stage (or refit) landed in the bank that held the previous step.
    Overwritten,
    /// The receiver discarded its buffers since (a new transport, a wire leg cut short).
    Discarded,
}

impl NoRollback {
    /// A stable name (`no_previous`, `overwritten`, `discarded`).
    pub fn as_str(self) -> &'static str {
        match self {
            NoRollback::NoPrevious => "no_previous",
            NoRollback::Overwritten => "overwritten",
            NoRollback::Discarded => "discarded",
        }
    }
}

/// The public error of every reshard crate (boxed, so `Result`s stay one pointer wide).
pub struct Error(Box<Inner>);

struct Inner {
    kind: ErrorKind,
    message: String,
    context: ErrorContext,
    detail: Option<Box<ErrorDetail>>,
    retryable: bool,
    quarantined: bool,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

/// Result alias using [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A new error of `kind` with a human message.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error(Box::new(Inner {
            kind,
            message: message.into(),
            context: ErrorContext::default(),
            detail: None,
            retryable: false,
            quarantined: false,
            source: None,
        }))
    }

    /// The kind, for matching.
    pub fn kind(&self) -> ErrorKind {
        self.0.kind
    }

    /// The message without context.
    pub fn message(&self) -> &str {
        &self.0.message
    }

    /// The context collected so far.
    pub fn context(&self) -> &ErrorContext {
        &self.0.context
    }

    /// Structured facts, for the errors that have them.
    pub fn detail(&self) -> Option<&ErrorDetail> {
        self.0.detail.as_deref()
    }

    /// Attaches structured facts.
    pub fn with_detail(mut self, detail: ErrorDetail) -> Self {
        self.0.detail = Some(Box::new(detail));
        self
    }

    /// Whether retrying the same operation may succeed.
    pub fn is_retryable(&self) -> bool {
        self.0.retryable
    }

    /// Names the tensor (keeps an existing one).
    pub fn with_tensor(mut self, tensor: impl Into<String>) -> Self {
        if self.0.context.tensor.is_none() {
            self.0.context.tensor = Some(tensor.into());
        }
        self
    }

    /// Names the owner (keeps an existing one).
    pub fn with_owner(mut self, owner: u32) -> Self {
        if self.0.context.owner.is_none() {
            self.0.context.owner = Some(owner);
        }
        self
    }

    /// Names the byte range (keeps an existing one).
    pub fn with_range(mut self, range: Range<u64>) -> Self {
        if self.0.context.range.is_none() {
            self.0.context.range = Some(range);
        }
        self
    }

    /// Names the backend (keeps an existing one).
    pub fn with_backend(mut self, backend: impl Into<String>) -> Self {
        if self.0.context.backend.is_none() {
            self.0.context.backend = Some(backend.into());
        }
        self
    }

    /// Marks the error retryable or not (a quarantined error stays not retryable).
    pub fn set_retryable(mut self, retryable: bool) -> Self {
        self.0.retryable = retryable && !self.0.quarantined;
        self
    }

    /// Whether bytes of the failed batch may still land: reads that could not be stopped were
    /// left running, and the backend keeps their memory alive and out of use (quarantined)
    /// until they are seen to finish. Such an error is never retryable into the same memory.
    pub fn is_quarantined(&self) -> bool {
        self.0.quarantined
    }

    /// Marks the error quarantined (see [`Error::is_quarantined`]); clears `retryable`.
    pub fn set_quarantined(mut self) -> Self {
        self.0.quarantined = true;
        self.0.retryable = false;
        self
    }

    /// Attaches an underlying cause (keeps native status codes of backends).
    pub fn with_source(
        mut self,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        self.0.source = Some(source.into());
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.0.kind, self.0.message)?;
        let c = &self.0.context;
        if let Some(t) = &c.tensor {
            write!(f, " [tensor {t}]")?;
        }
        if let Some(o) = c.owner {
            write!(f, " [owner {o}]")?;
        }
        if let Some(r) = &c.range {
            write!(f, " [bytes {}..{}]", r.start, r.end)?;
        }
        if let Some(b) = &c.backend {
            write!(f, " [backend {b}]")?;
        }
        if self.0.retryable {
            f.write_str(" (retryable)")?;
        }
        if self.0.quarantined {
            f.write_str(" (reads still in flight: memory quarantined)")?;
        }
        if let Some(s) = &self.0.source {
            write!(f, ": {s}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0
            .source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_names_parse_back() {
        for k in ErrorKind::ALL {
            assert_eq!(ErrorKind::from_name(k.as_str()), Some(k));
        }
        let mut names: Vec<_> = ErrorKind::ALL.iter().map(|k| k.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ErrorKind::ALL.len(), "names are distinct");
        assert_eq!(ErrorKind::from_name("nope"), None);
    }

    #[test]
    fn context_is_kept_and_not_overwritten() {
        let e = Error::new(ErrorKind::Transport, "boom")
            .with_owner(3)
            .with_owner(4)
            .with_tensor("w")
            .with_range(10..20)
            .with_backend("loopback")
            .set_retryable(true);
        assert_eq!(e.kind(), ErrorKind::Transport);
        assert_eq!(e.context().owner, Some(3));
        assert_eq!(e.context().range, Some(10..20));
        assert!(e.is_retryable());
        let s = e.to_string();
        assert!(s.contains("owner 3") && s.contains("tensor w") && s.contains("10..20"));
    }

    #[test]
    fn quarantined_errors_are_never_retryable() {
        let e = Error::new(ErrorKind::Timeout, "stuck")
            .set_retryable(true)
            .set_quarantined();
        assert!(e.is_quarantined() && !e.is_retryable());
        let e = e.set_retryable(true);
        assert!(
            !e.is_retryable(),
            "quarantine wins over a later set_retryable"
        );
        assert!(e.to_string().contains("quarantined"));
    }
}
