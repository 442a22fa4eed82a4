//! The transport abstraction every backend implements: register memory, exchange metadata,
//! prepare a batch of reads once (the descriptor cache), post all owners' reads, then wait or
//! abort.

use async_trait::async_trait;
use bytes::Bytes;
use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::completion::CompletionSink;
use crate::error::Result;
use crate::memory::{HostMemory, MemoryBlock};
use crate::model::{MemoryKind, OwnerId};

/// What a backend can do; tests and the runtime consult this, never the backend's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capability {
    /// One-sided READ from a peer's registered memory.
    pub one_sided_read: bool,
    /// One-sided WRITE into a peer's registered memory.
    pub one_sided_write: bool,
    /// Can register and move device (VRAM) memory.
    pub vram: bool,
    /// Peers may live in other processes or hosts.
    pub cross_process: bool,
    /// Largest number of reads one post accepts, if limited.
    pub max_reads_per_post: Option<usize>,
}

/// RAII handle of a registered memory region; dropping it deregisters the region.
pub struct Registration {
    id: u64,
    len: u64,
    kind: MemoryKind,
    release: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl Registration {
    /// Builds a handle; `release` runs once on drop and must not panic.
    pub fn new(
        id: u64,
        len: u64,
        kind: MemoryKind,
        release: impl FnOnce() + Send + Sync + 'static,
    ) -> Self {
        Registration {
            id,
            len,
            kind,
            release: Some(Box::new(release)),
        }
    }

    /// Region id: what offers put in `OfferLocation::region`, and reads name as local region.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Length of the region in bytes (reads are checked against it).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when the region has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Memory kind of the region.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(f) = self.release.take() {
            f();
        }
    }
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Registration(id {}, {} bytes, {})",
            self.id, self.len, self.kind
        )
    }
}

/// One read: `len` bytes from an owner's region into a local registered region. They land
/// contiguously from `local_offset`; at the source they are contiguous from `remote_offset`
/// too, or, for a gather read ([`RemoteRows`]), rows at a pitch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReadDesc {
    /// Publisher that holds the source bytes.
    pub owner: OwnerId,
    /// Region id in the owner's registrations.
    pub remote_region: u64,
    /// Byte offset in that region.
    pub remote_offset: u64,
    /// Local region id (from a [`Registration`] of this transport).
    pub local_region: u64,
    /// Byte offset in the local region.
    pub local_offset: u64,
    /// Bytes to move.
    pub len: u64,
    /// `None`: the source bytes are contiguous. `Some`: a gather read, whose source is rows at
    /// a pitch (docs/design.md §4, "Gather reads").
    pub remote_rows: Option<RemoteRows>,
}

/// The source layout of a gather read: its `len` bytes are `len / row_bytes` rows of
/// `row_bytes` bytes each, row `i` starting at `remote_offset + i * pitch` in the owner's
/// region, and they land one after another from `local_offset` (the column block of a
/// row-major matrix read into a narrower one: one descriptor instead of one read per row).
/// [`crate::contract::validate_batch`] refuses `row_bytes == 0`, a `len` that is no multiple of
/// it and `pitch < row_bytes`, so rows never share source bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RemoteRows {
    /// Bytes of one row.
    pub row_bytes: u64,
    /// Bytes from one row's first source byte to the next row's.
    pub pitch: u64,
}

impl RemoteRows {
    /// Source bytes a gather of `len` bytes spans: `(rows - 1) * pitch + row_bytes`; `None`
    /// when it overflows or the gather is malformed (see [`RemoteRows`]).
    pub fn span(&self, len: u64) -> Option<u64> {
        let RemoteRows { row_bytes, pitch } = *self;
        if row_bytes == 0 || len % row_bytes != 0 || pitch < row_bytes || len == 0 {
            return None;
        }
        (len / row_bytes - 1)
            .checked_mul(pitch)?
            .checked_add(row_bytes)
    }
}

impl ReadDesc {
    /// Bytes of the owner's region the read spans from `remote_offset`: `len` for a contiguous
    /// read, `(rows - 1) * pitch + row_bytes` for a gather; `None` when that overflows or the
    /// gather is malformed (see [`RemoteRows`]).
    pub fn remote_span(&self) -> Option<u64> {
        match self.remote_rows {
            None => Some(self.len),
            Some(rows) => rows.span(self.len),
        }
    }

    /// The contiguous source runs of the read's bytes `from..to` (offsets in the read, from its
    /// first landing byte), in order: `(remote offset in the region, offset in the read,
    /// bytes)`. One run for a contiguous read; one per row touched for a gather. The caller
    /// keeps `from <= to <= len` and a read that passed [`crate::contract::validate_batch`].
    pub fn remote_runs(&self, from: u64, to: u64) -> RemoteRuns {
        RemoteRuns::new(self.remote_offset, self.remote_rows, from, to.min(self.len))
    }
}

/// Iterator of [`ReadDesc::remote_runs`].
#[derive(Debug, Clone)]
pub struct RemoteRuns {
    base: u64,
    /// Row bytes (`u64::MAX`: one contiguous run).
    row: u64,
    pitch: u64,
    at: u64,
    to: u64,
}

impl RemoteRuns {
    /// The contiguous source runs of bytes `from..to` of a read whose first source byte is at
    /// `base` and whose source is `rows` (`None`: contiguous): [`ReadDesc::remote_runs`] for a
    /// backend that keeps a read's source as an address or a piece of its own.
    pub fn new(base: u64, rows: Option<RemoteRows>, from: u64, to: u64) -> Self {
        let (row, pitch) = match rows {
            Some(RemoteRows { row_bytes, pitch }) if row_bytes > 0 => (row_bytes, pitch),
            _ => (u64::MAX, 0),
        };
        RemoteRuns {
            base,
            row,
            pitch,
            at: from,
            to,
        }
    }
}

impl Iterator for RemoteRuns {
    type Item = (u64, u64, u64);

    fn next(&mut self) -> Option<(u64, u64, u64)> {
        if self.at >= self.to {
            return None;
        }
        let (r, c) = (self.at / self.row, self.at % self.row);
        let n = (self.row - c).min(self.to - self.at);
        let item = (self.base + r * self.pitch + c, self.at, n);
        self.at += n;
        Some(item)
    }
}

/// Every read of one update, in plan order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadBatch {
    /// The reads.
    pub reads: Vec<ReadDesc>,
}

impl ReadBatch {
    /// Total bytes moved.
    pub fn bytes(&self) -> u64 {
        self.reads.iter().map(|r| r.len).sum()
    }

    /// Distinct owners, ascending.
    pub fn owners(&self) -> Vec<OwnerId> {
        let mut o: Vec<_> = self.reads.iter().map(|r| r.owner).collect();
        o.sort_unstable();
        o.dedup();
        o
    }
}

/// A batch checked and translated by a backend once, reusable for every update: this is the
/// descriptor cache. It keeps the original batch for wrappers (recording, fault injection).
pub struct PreparedBatch {
    batch: Arc<ReadBatch>,
    backend: &'static str,
    state: Box<dyn Any + Send + Sync>,
}

impl PreparedBatch {
    /// Wraps backend state for `batch`.
    pub fn new(
        batch: Arc<ReadBatch>,
        backend: &'static str,
        state: impl Any + Send + Sync,
    ) -> Self {
        PreparedBatch {
            batch,
            backend,
            state: Box::new(state),
        }
    }

    /// The reads this batch moves.
    pub fn batch(&self) -> &Arc<ReadBatch> {
        &self.batch
    }

    /// Name of the backend that prepared it.
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// The backend's own state, if it is of type `T`.
    pub fn state<T: Any>(&self) -> Option<&T> {
        self.state.downcast_ref()
    }
}

impl fmt::Debug for PreparedBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "PreparedBatch({}, {} reads)",
            self.backend,
            self.batch.reads.len()
        )
    }
}

/// What one completed batch moved, counted by the backend from its completions (never copied
/// from the batch), so a receiver can refuse an install when fewer bytes arrived than planned.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WireReport {
    /// Reads whose completion the backend saw.
    pub reads: u64,
    /// Bytes those completions delivered, summed as they completed.
    pub bytes: u64,
}

/// Where a backend records every read it hands to its wire library, as it resolved it (owner
/// from the peer endpoint used, region and offset from the address or handle used), so tests
/// and audits see what was executed rather than what was asked. Recorded at post time; a
/// backend that cannot resolve a read back to a region records what it can and never skips it.
#[derive(Debug, Default)]
pub struct ExecutionLog {
    reads: parking_lot::Mutex<Vec<ReadDesc>>,
}

impl ExecutionLog {
    /// An empty log.
    pub fn new() -> Arc<Self> {
        Arc::new(ExecutionLog::default())
    }

    /// Appends reads the backend executed.
    pub fn record(&self, reads: impl IntoIterator<Item = ReadDesc>) {
        self.reads.lock().extend(reads);
    }

    /// Takes every read recorded so far, leaving the log empty.
    pub fn take(&self) -> Vec<ReadDesc> {
        std::mem::take(&mut *self.reads.lock())
    }

    /// Number of reads recorded and not yet taken.
    pub fn len(&self) -> usize {
        self.reads.lock().len()
    }

    /// True when nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A posted batch: every owner's reads are already in flight.
///
/// Ending a batch — `wait` returning (`Ok` or `Err`), `abort` returning, the `wait` or `abort`
/// future being dropped part-way, or the handle being dropped — means no byte of it lands
/// afterwards, unless the error says otherwise ([`crate::Error::is_quarantined`]); see the
/// in-flight rules on [`Transport`].
#[async_trait]
pub trait InFlight: Send {
    /// Waits for every read; the first failure is returned naming its owner and byte range.
    /// Cancel-safe: dropping the future part-way ends the batch as `abort` would.
    async fn wait(self: Box<Self>) -> Result<WireReport>;
    /// Stops what has not run yet and waits until nothing touches the buffers any more.
    async fn abort(self: Box<Self>);
}

/// A fresh endpoint incarnation: random, never 0, distinct across endpoints and processes with
/// overwhelming probability (std's randomly keyed hasher over the process id, the time and a
/// per-process counter, so no extra dependency is needed for a nonce).
pub fn new_incarnation() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u64(COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    h.finish().max(1)
}

/// A backend that moves bytes from publishers' registered memory into local memory.
///
/// # Contract
/// - `register` keeps the block alive until the returned handle drops; reads outside a
///   registered region are a typed `OutOfBounds` error, never undefined behaviour. Region ids
///   are assigned 1, 2, 3, ... in registration order per endpoint, so the same registrations
///   give the same ids (and the same plan fingerprint) on every backend.
/// - `prepare` validates every read (peer known, both ranges inside registered regions) with
///   [`crate::contract::validate_batch`], the one implementation of these checks, and
///   translates the batch once; the result is reused by every `post` until any registration
///   or peer changes, which [`Transport::epoch`] reports.
/// - `post` starts every owner's reads before it returns; nothing is awaited per owner.
/// - The [`WireReport`] of `wait` counts reads and bytes from completions as they arrive.
/// - Completions as they happen ([`Transport::post_reporting`]): read `i` of a batch (its index
///   in [`PreparedBatch::batch`]) is reported to the [`CompletionSink`] exactly once, and only
///   when every byte of it is in its destination and none of it can land again (after its
///   last piece *finished*, whichever piece that is); a read that failed, was skipped or was
///   stopped is never reported. Before `wait` returns `Ok`, every read has been reported (as
///   many as the [`WireReport`] counts). Reports come from the backend's own threads, inside
///   the batch: once the batch has ended (in-flight rule 1 below), the sink is not called
///   again. A receiver may read a reported read's bytes while the rest of the batch is on the
///   wire (docs/in-flight-safety.md, "Completions as they happen").
/// - Hashing while copying: a sink may carry a [`crate::HashPlan`] (the receiver's digest
///   segments, per read, each with a slot). A backend whose own CPU copies the bytes hashes
///   them as it copies: it takes a [`CompletionSink::piece_hasher`] for each contiguous piece
///   of a read it copies on one thread, and right after copying each block (at most a few
///   hundred KiB, so it is still in cache) passes the piece's destination bytes landed so far
///   to [`crate::PieceHasher::landed`], which stores the hash of every planned segment now
///   wholly inside them. Hashes are of the *destination* bytes read back after the copy,
///   never of the source nor before the copy, and every hash of a read is stored before the
///   read is reported. A backend that hashes while copying stores every planned segment that
///   lies inside one piece; segments straddling two pieces or two reads may stay unstored. A
///   backend whose bytes are copied out of its sight (a NIC, a library's own progress) ignores
///   the plan. The receiver hashes every segment not stored, so a check's digest is the
///   publisher's either way.
/// - Destinations of one batch are disjoint: [`crate::contract::validate_batch`] refuses a batch
///   whose destinations overlap in memory (judged by address, so one memory registered as two
///   regions counts), so a backend never orders writes to the same bytes. Callers that want
///   overlapping reads (the benchmark-only no-dedup arm) post them as consecutive disjoint
///   batches ([`crate::overlap::disjoint_waves`]; the runtime's `WavesLayer`).
/// - Errors name owner, byte range and backend; `retryable` says whether trying again may help.
///
/// # In-flight rules (docs/in-flight-safety.md)
/// One-sided reads write into the receiver's memory with no further say from the receiver, so
/// every backend holds these four rules:
/// 1. After `wait` returns (`Ok` or `Err`), `abort` returns, or a dropped [`InFlight`] (or a
///    dropped `wait`/`abort` future) finishes its drop, no byte of that batch lands anywhere.
/// 2. No memory is deregistered or freed while any posted read targets or reads it: dropping a
///    [`Registration`], a [`PreparedBatch`] or the transport while reads are in flight defers
///    the release until they have ended; it is neither skipped nor performed early.
/// 3. A read that cannot be stopped is waited out, or its memory is quarantined: kept alive,
///    never reused, and reported by an error with [`crate::Error::is_quarantined`] set. An
///    error after which bytes may still land is never retryable.
/// 4. Every wait is bounded by a no-progress timer (time since the batch last made progress),
///    not a total deadline, and dropping the transport wakes every waiter with an error.
///
/// A wrapper around another transport implements this with [`forward_transport!`](crate::forward_transport),
/// which forwards every method it does not write itself; a method added here is added there too.
#[async_trait]
pub trait Transport: Send + Sync + fmt::Debug {
    /// Scheme of the backend: its `transport.kind` and registry key.
    fn name(&self) -> &'static str;

    /// This endpoint's agent name.
    fn agent(&self) -> &str;

    /// What the backend can do.
    fn capabilities(&self) -> Capability;

    /// Changes whenever a local registration or a loaded peer changes: prepared batches made
    /// under another epoch must be rebuilt.
    fn epoch(&self) -> u64;

    /// This endpoint's incarnation: drawn with [`new_incarnation`] when the endpoint is created
    /// and carried in its exported metadata. Publishers bind their tables to it
    /// ([`crate::ShardTable::bound_to`]).
    fn incarnation(&self) -> u64;

    /// The incarnation in the metadata loaded for `owner` (`None`: no peer loaded under it).
    /// A receiver compares it with the table it reads by before posting anything.
    fn peer_incarnation(&self, owner: OwnerId) -> Option<u64>;

    /// Allocates `len` bytes of zeroed host memory that this backend moves faster than memory
    /// the caller allocated (e.g. shared memory its peers map directly), to be registered like
    /// any block. `Ok(None)` (the default) means the backend has no such memory: use a
    /// [`crate::HostBuffer`]. The allocation may be registered on other endpoints of the same
    /// backend too; it stays valid until the last `Arc` and every registration of it drop.
    async fn allocate_host(&self, len: usize) -> Result<Option<Arc<dyn HostMemory>>> {
        let _ = len;
        Ok(None)
    }

    /// Registers memory for reading from (publisher) or writing into (receiver).
    async fn register(&self, block: Arc<dyn MemoryBlock>) -> Result<Registration>;

    /// Serialises what a peer needs to read this endpoint's registered regions.
    async fn export_metadata(&self) -> Result<Bytes>;

    /// Loads a peer's metadata under the publisher rank its offers use.
    async fn load_peer(&self, owner: OwnerId, metadata: Bytes) -> Result<()>;

    /// Validates and translates a batch once ([`crate::contract::validate_batch`]). A gather
    /// read ([`RemoteRows`]) is executed row by row as its source runs
    /// ([`ReadDesc::remote_runs`]) say, landing contiguously like any read; it is one read for
    /// completions, reports and the execution log.
    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch>;

    /// Posts every read of a prepared batch, all owners before any wait.
    async fn post(&self, batch: &PreparedBatch) -> Result<Box<dyn InFlight>>;

    /// Posts like [`Transport::post`] and reports each read to `sink` as it completes, under
    /// the rules of "Completions as they happen" above. The default posts and reports nothing
    /// (its caller learns completion at `wait` only), which is what a wrapper written by hand
    /// gets: a wrapper that changes `post` must not let reads around it be reported.
    /// [`forward_transport!`](crate::forward_transport) forwards this to the inner transport
    /// only when the wrapper writes neither method; every backend implements it, and the
    /// conformance suite checks that it does.
    async fn post_reporting(
        &self,
        batch: &PreparedBatch,
        sink: CompletionSink,
    ) -> Result<Box<dyn InFlight>> {
        let _ = sink;
        self.post(batch).await
    }

    /// Starts (`Some`) or stops (`None`) recording every read this endpoint posts into `log`,
    /// resolved from the backend's own translated state (see [`ExecutionLog`]). Returns false
    /// when the backend cannot record (the default), which the conformance suite fails.
    fn set_execution_log(&self, log: Option<Arc<ExecutionLog>>) -> bool {
        let _ = log;
        false
    }
}

/// What [`forward_transport!`](crate::forward_transport) expands to, reachable from the crates
/// that use it without their own dependency on these.
#[doc(hidden)]
pub mod __private {
    pub use async_trait::async_trait;
    pub use bytes::Bytes;
}
