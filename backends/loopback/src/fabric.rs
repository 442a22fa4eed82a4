//! The in-process "network": which agents exist and what memory each has registered.

use parking_lot::Mutex;
use reshard_core::regions::RegionTable;
use reshard_core::MemoryBlock;
use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// The in-process network agents attach to; cloning shares it (an `Arc` inside).
///
/// Metadata exported by an agent can only be loaded by agents of the same fabric: that is how
/// the loopback transport refuses peers it cannot reach (another process, another fabric).
#[derive(Clone)]
pub struct LoopbackFabric {
    pub(crate) inner: Arc<FabricInner>,
}

pub(crate) struct FabricInner {
    pub(crate) id: u64,
    /// Attached agents by name; an agent leaves when its transport drops.
    pub(crate) agents: Mutex<HashMap<String, Arc<AgentState>>>,
}

/// One agent's registered regions and epoch; shared (weakly) with registrations and peers.
pub(crate) struct AgentState {
    pub(crate) name: String,
    /// Unique per process: tells a re-created agent of the same name from the one a peer saw.
    pub(crate) uid: u64,
    /// Its registered regions and the epoch.
    pub(crate) regions: Arc<RegionTable<Region>>,
}

/// A registered region: the block (kept alive while registered) and its length.
#[derive(Clone)]
pub(crate) struct Region {
    pub(crate) block: Arc<dyn MemoryBlock>,
    pub(crate) len: u64,
}

impl LoopbackFabric {
    /// A new, empty fabric with an id no other fabric (in any process) is likely to share.
    pub fn new() -> Self {
        LoopbackFabric {
            inner: Arc::new(FabricInner {
                id: fresh_fabric_id(),
                agents: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// This fabric's id, carried in every metadata blob its agents export.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Names of the agents currently attached, sorted.
    pub fn agents(&self) -> Vec<String> {
        let mut v: Vec<String> = self.inner.agents.lock().keys().cloned().collect();
        v.sort_unstable();
        v
    }
}

impl Default for LoopbackFabric {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for LoopbackFabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "LoopbackFabric({:#018x}, {} agents)",
            self.inner.id,
            self.inner.agents.lock().len()
        )
    }
}

impl AgentState {
    pub(crate) fn new(name: &str) -> Self {
        static NEXT_UID: AtomicU64 = AtomicU64::new(1);
        AgentState {
            name: name.to_owned(),
            uid: NEXT_UID.fetch_add(1, Ordering::Relaxed),
            regions: Arc::new(RegionTable::new()),
        }
    }
}

/// A process-random salt plus a counter: unique within the process (the map is a bijection),
/// and unlikely to match a fabric of another process.
fn fresh_fabric_id() -> u64 {
    static SALT: OnceLock<u64> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let salt = *SALT.get_or_init(|| {
        let mut h = RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            h.write_u128(t.as_nanos());
        }
        h.finish()
    });
    salt.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed))
}
