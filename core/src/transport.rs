//! The transport abstraction every backend implements: register memory, exchange metadata,
//! prepare a batch of reads once (the descriptor cache), post all owners' reads, then wait or
//! abort.

use async_trait::async_trait;
use bytes::Bytes;
use std::any::Any;
use std::fmt;
use std::sync::Arc;

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

/// One read: `len` bytes from an owner's region into a local registered region.
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
/// - `prepare` validates every read (peer known, both ranges inside registered regions) and
///   translates the batch once; the result is reused by every `post` until any registration
///   or peer changes, which [`Transport::epoch`] reports.
/// - `post` starts every owner's reads before it returns; nothing is awaited per owner.
/// - The [`WireReport`] of `wait` counts reads and bytes from completions as they arrive.
/// - Destinations of one batch are normally disjoint. Where they overlap (the benchmark-only
///   no-dedup arm reads byte-identical replicas into one place), a backend must apply the
///   overlapping reads in batch order, never as concurrent host writes to the same bytes.
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

    /// Validates and translates a batch once.
    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch>;

    /// Posts every read of a prepared batch, all owners before any wait.
    async fn post(&self, batch: &PreparedBatch) -> Result<Box<dyn InFlight>>;

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

/// Implements [`Transport`] for a wrapper by forwarding every method to one of its fields,
/// except the methods written in the braces, which the wrapper implements itself:
///
/// ```ignore
/// reshard_core::forward_transport!(Recording => inner {
///     async fn post(&self, batch: &PreparedBatch) -> Result<Box<dyn InFlight>> {
///         self.posted.lock().push(batch.batch().clone());
///         self.inner.post(batch).await
///     }
/// });
/// ```
///
/// The field is anything that dereferences to a `Transport` (usually `Arc<dyn Transport>`).
/// Overrides are plain `fn` / `async fn` items (attributes allowed, no generics or `where`),
/// written as in an `#[async_trait] impl Transport`; the macro applies `async_trait` itself.
///
/// Why a macro: a hand-written wrapper has to repeat every method, and the methods with a
/// default (`allocate_host`, `set_execution_log`) compile when forgotten, silently turning a
/// wrapped endpoint into one without its shared memory or its execution log. Here every
/// method is listed once; the unit test `forward_transport_names_every_method` fails until a
/// method added to [`Transport`] is added here too, and then every wrapper forwards it.
///
/// Each override and each trait method costs a few levels of macro recursion (about
/// 13 × (overrides + 2) in all), well inside the default limit of 128 for up to 6 overrides.
#[macro_export]
macro_rules! forward_transport {
    ($ty:ty => $field:ident { $($own:tt)* }) => {
        $crate::forward_transport!(@names [$ty, $field, { $($own)* }] [] $($own)*);
    };

    // Collects the names of the methods the wrapper writes itself.
    (@names $cx:tt [$($n:ident)*]
        $(#[$attr:meta])* $(async)? fn $name:ident $args:tt $(-> $ret:ty)? $body:block
        $($rest:tt)*) => {
        $crate::forward_transport!(@names $cx [$($n)* $name] $($rest)*);
    };
    (@names [$ty:ty, $field:ident, $own:tt] [$($n:ident)*]) => {
        $crate::forward_transport!(@next [$ty, $field, $own, [$($n)*]] []
            [name agent capabilities epoch incarnation peer_incarnation allocate_host register
             export_metadata load_peer prepare post set_execution_log]);
    };

    // Takes the next trait method and looks it up among the overrides.
    (@next [$ty:ty, $field:ident, $own:tt, [$($n:ident)*]] $acc:tt [$m:ident $($ms:ident)*]) => {
        $crate::forward_transport!(@find $m [$($n)*] [$ty, $field, $own, [$($n)*]] $acc [$($ms)*]);
    };
    (@next [$ty:ty, $field:ident, { $($own:tt)* }, $names:tt] [$($acc:tt)*] []) => {
        #[$crate::transport::__private::async_trait]
        impl $crate::Transport for $ty {
            $($own)*
            $($acc)*
        }
    };

    // One pair of rules per trait method: skipped when the wrapper writes it (found at the head
    // of the override names), forwarded when the names ran out without it.
    (@find name [name $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find name [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            fn name(&self) -> &'static str {
                self.$f.name()
            }
        ] $todo);
    };
    (@find agent [agent $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find agent [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            fn agent(&self) -> &str {
                self.$f.agent()
            }
        ] $todo);
    };
    (@find capabilities [capabilities $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find capabilities [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            fn capabilities(&self) -> $crate::Capability {
                self.$f.capabilities()
            }
        ] $todo);
    };
    (@find epoch [epoch $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find epoch [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            fn epoch(&self) -> u64 {
                self.$f.epoch()
            }
        ] $todo);
    };
    (@find incarnation [incarnation $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find incarnation [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            fn incarnation(&self) -> u64 {
                self.$f.incarnation()
            }
        ] $todo);
    };
    (@find peer_incarnation [peer_incarnation $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find peer_incarnation [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            fn peer_incarnation(&self, owner: $crate::OwnerId) -> ::core::option::Option<u64> {
                self.$f.peer_incarnation(owner)
            }
        ] $todo);
    };
    (@find allocate_host [allocate_host $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find allocate_host [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            async fn allocate_host(
                &self,
                len: usize,
            ) -> $crate::Result<
                ::core::option::Option<::std::sync::Arc<dyn $crate::HostMemory>>,
            > {
                self.$f.allocate_host(len).await
            }
        ] $todo);
    };
    (@find register [register $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find register [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            async fn register(
                &self,
                block: ::std::sync::Arc<dyn $crate::MemoryBlock>,
            ) -> $crate::Result<$crate::Registration> {
                self.$f.register(block).await
            }
        ] $todo);
    };
    (@find export_metadata [export_metadata $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find export_metadata [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            async fn export_metadata(&self) -> $crate::Result<$crate::transport::__private::Bytes> {
                self.$f.export_metadata().await
            }
        ] $todo);
    };
    (@find load_peer [load_peer $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find load_peer [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            async fn load_peer(
                &self,
                owner: $crate::OwnerId,
                metadata: $crate::transport::__private::Bytes,
            ) -> $crate::Result<()> {
                self.$f.load_peer(owner, metadata).await
            }
        ] $todo);
    };
    (@find prepare [prepare $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find prepare [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            async fn prepare(
                &self,
                batch: $crate::ReadBatch,
            ) -> $crate::Result<$crate::PreparedBatch> {
                self.$f.prepare(batch).await
            }
        ] $todo);
    };
    (@find post [post $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find post [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            async fn post(
                &self,
                batch: &$crate::PreparedBatch,
            ) -> $crate::Result<::std::boxed::Box<dyn $crate::InFlight>> {
                self.$f.post(batch).await
            }
        ] $todo);
    };
    (@find set_execution_log [set_execution_log $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find set_execution_log [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            fn set_execution_log(
                &self,
                log: ::core::option::Option<::std::sync::Arc<$crate::ExecutionLog>>,
            ) -> bool {
                self.$f.set_execution_log(log)
            }
        ] $todo);
    };

    // Not at the head of the override names: look further.
    (@find $m:ident [$h:ident $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@find $m [$($r)*] $cx $acc $todo);
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{Error, ErrorKind};
    use crate::memory::HostBuffer;

    /// A transport that only has what the defaulted methods can lose: its own host memory and
    /// an execution log. Everything else refuses.
    #[derive(Debug, Default)]
    struct Special {
        logging: parking_lot::Mutex<bool>,
    }

    fn refused() -> Error {
        Error::new(ErrorKind::Internal, "not part of this test")
    }

    #[async_trait]
    impl Transport for Special {
        fn name(&self) -> &'static str {
            "special"
        }
        fn agent(&self) -> &str {
            "special-agent"
        }
        fn capabilities(&self) -> Capability {
            Capability {
                one_sided_read: true,
                one_sided_write: false,
                vram: false,
                cross_process: false,
                max_reads_per_post: Some(7),
            }
        }
        fn epoch(&self) -> u64 {
            11
        }
        fn incarnation(&self) -> u64 {
            13
        }
        fn peer_incarnation(&self, owner: OwnerId) -> Option<u64> {
            Some(u64::from(owner) + 100)
        }
        async fn allocate_host(&self, len: usize) -> Result<Option<Arc<dyn HostMemory>>> {
            Ok(Some(Arc::new(HostBuffer::zeroed(len))))
        }
        async fn register(&self, _block: Arc<dyn MemoryBlock>) -> Result<Registration> {
            Err(refused())
        }
        async fn export_metadata(&self) -> Result<Bytes> {
            Ok(Bytes::from_static(b"special"))
        }
        async fn load_peer(&self, _owner: OwnerId, _metadata: Bytes) -> Result<()> {
            Err(refused())
        }
        async fn prepare(&self, _batch: ReadBatch) -> Result<PreparedBatch> {
            Err(refused())
        }
        async fn post(&self, _batch: &PreparedBatch) -> Result<Box<dyn InFlight>> {
            Err(refused())
        }
        fn set_execution_log(&self, log: Option<Arc<ExecutionLog>>) -> bool {
            *self.logging.lock() = log.is_some();
            true
        }
    }

    /// Forwards everything.
    #[derive(Debug)]
    struct Plain {
        inner: Arc<dyn Transport>,
    }
    crate::forward_transport!(Plain => inner {});

    /// Writes two methods itself, one of them defaulted in the trait.
    #[derive(Debug)]
    struct Overriding {
        inner: Arc<dyn Transport>,
    }
    crate::forward_transport!(Overriding => inner {
        fn epoch(&self) -> u64 {
            self.inner.epoch() + 1
        }
        async fn allocate_host(&self, _len: usize) -> Result<Option<Arc<dyn HostMemory>>> {
            Ok(None)
        }
    });

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn forwarding_wrapper_keeps_every_method_of_the_inner_transport() {
        let special = Arc::new(Special::default());
        let t: Arc<dyn Transport> = Arc::new(Plain {
            inner: Arc::new(Plain {
                inner: special.clone(),
            }),
        });
        assert_eq!(t.name(), "special");
        assert_eq!(t.agent(), "special-agent");
        assert_eq!(t.capabilities().max_reads_per_post, Some(7));
        assert_eq!((t.epoch(), t.incarnation()), (11, 13));
        assert_eq!(t.peer_incarnation(2), Some(102));
        block_on(async {
            let host = t.allocate_host(64).await.unwrap();
            assert_eq!(host.map(|h| h.len()), Some(64), "allocate_host forwarded");
            assert_eq!(&t.export_metadata().await.unwrap()[..], b"special");
            assert!(t.register(Arc::new(HostBuffer::zeroed(8))).await.is_err());
            assert!(t.load_peer(1, Bytes::new()).await.is_err());
            assert!(t.prepare(ReadBatch::default()).await.is_err());
            let batch = PreparedBatch::new(Arc::new(ReadBatch::default()), "special", ());
            assert!(t.post(&batch).await.is_err());
        });
        assert!(
            t.set_execution_log(Some(ExecutionLog::new())),
            "log forwarded"
        );
        assert!(*special.logging.lock());
    }

    #[test]
    fn forwarding_wrapper_uses_its_own_methods_where_it_writes_them() {
        let t = Overriding {
            inner: Arc::new(Special::default()),
        };
        assert_eq!(t.epoch(), 12);
        assert_eq!(t.incarnation(), 13);
        assert!(block_on(t.allocate_host(64)).unwrap().is_none());
    }

    /// The names of the `fn`s in the first `{ ... }` block after `start` in this file.
    fn fn_names(start: &str) -> std::collections::BTreeSet<String> {
        let src = include_str!("transport.rs");
        let at = src.find(start).expect(start);
        let open = at + src[at..].find('{').unwrap();
        let mut depth = 0usize;
        let mut end = open;
        for (i, c) in src[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            if depth == 0 {
                end = open + i;
                break;
            }
        }
        src[open..end]
            .split("fn ")
            .skip(1)
            .filter_map(|s| {
                let name: String = s
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                let next = s[name.len()..].trim_start().chars().next();
                // A definition is followed by its arguments or generics; a bare identifier
                // there (`$name`, `fn` inside a comment) is no method.
                (matches!(next, Some('(' | '<')) && !name.is_empty()).then_some(name)
            })
            .collect()
    }

    #[test]
    fn forward_transport_names_every_method() {
        let trait_methods = fn_names("pub trait Transport:");
        assert!(trait_methods.contains("allocate_host"), "{trait_methods:?}");
        let forwarded = fn_names("macro_rules! forward_transport");
        assert_eq!(
            trait_methods, forwarded,
            "every Transport method must have its pair of rules in forward_transport!"
        );
    }
}
