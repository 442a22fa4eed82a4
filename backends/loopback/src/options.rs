//! The loopback backend's options. It has no `[backends.loopback]` keys: its one setting is
//! `transport.workers`, the copy threads of each endpoint, whose default is here.

/// Worker threads used when the configuration does not say: the available cores.
pub fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
