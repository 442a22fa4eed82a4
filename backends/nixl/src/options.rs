//! The typed `[backends.nixl]` options (TOML section or `RESHARD_BACKENDS__NIXL__KEY`).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Default of [`NixlOptions::lanes`] (measured: BENCHMARKS.md, "NIXL lanes").
pub(crate) const DEFAULT_LANES: usize = 1;

/// Most lanes an endpoint may have (each is a NIXL agent with its own progress thread).
pub(crate) const MAX_LANES: usize = 16;

/// Options of the NIXL transport; every key is optional and an unknown key is a `Config` error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NixlOptions {
    /// NIXL plugin that moves the bytes (default `"UCX"`).
    #[serde(alias = "backends")]
    pub backend: String,
    /// Folder of NIXL plugins, checked against the one NIXL uses (`NIXL_PLUGIN_DIR` as the
    /// process was started with, else `plugins/` next to `libnixl.so`); a different folder is a
    /// `Config` error, because NIXL reads it only from the environment, which reshard never
    /// changes in a running process.
    pub plugin_dir: Option<PathBuf>,
    /// The no-progress bound of `wait` (and of `abort`'s drain), in milliseconds: how long
    /// they go on while no pending request of the batch completes. Past it the batch's reads,
    /// which NIXL cannot stop, are quarantined and the error is a quarantined `Timeout`.
    #[serde(alias = "progress_timeout_ms")]
    pub timeout_ms: u64,
    /// Overrides of the plugin's own parameters (for UCX: `ucx_devices`, `num_workers`,
    /// `ucx_error_handling_mode`); a key the plugin does not list is a `Config` error. UCX
    /// itself also reads its usual environment (`UCX_TLS`, `UCX_NET_DEVICES`).
    pub plugin_params: BTreeMap<String, String>,
    /// The GPU of this rank: VRAM blocks on another device are refused at registration.
    pub device_id: Option<u32>,
    /// Run NIXL's progress thread (needed by publishers whose reads travel over transports
    /// that emulate one-sided reads, such as TCP).
    pub progress_thread: bool,
    /// Delay of the progress thread between polls, in microseconds.
    pub progress_delay_us: u64,
    /// Most bytes one NIXL transfer request carries; longer reads are split. NIXL reports
    /// completion per request, so this is the step at which the no-progress timer sees a
    /// transfer advance and at which `abort` can stop one (at least 1 MiB).
    pub request_bytes: u64,
    /// Requests per owner in flight at once (at least 1): a request that does not complete
    /// inside `post` takes a slot until it completes, and the next one of that owner is posted
    /// then. `abort`, which cannot stop a posted read, waits for at most this many requests
    /// of `request_bytes` per owner; raise both on fast fabrics with few owners.
    pub requests_in_flight: usize,
    /// NIXL agents per endpoint ("lanes", 1..=16): every local region is registered and every
    /// peer loaded on each, a prepared batch's requests are spread over them by bytes, and a
    /// post starts the requests of different lanes from different threads, so copies that
    /// NIXL's UCX makes on the posting thread (cross-memory attach on one host) run in
    /// parallel. Each lane has its own agent lock, UCX worker and progress thread. More than
    /// one is refused unless [`NixlOptions::experimental_lanes`] is set (a known defect).
    pub lanes: usize,
    /// Accept `lanes` above 1 despite their known defect: with several lanes on every endpoint
    /// a cross-process refit can stall until the no-progress bound quarantines it (nothing
    /// unsafe; README, "Lanes"). Off by default, so nobody turns it on by accident.
    pub experimental_lanes: bool,
}

impl Default for NixlOptions {
    fn default() -> Self {
        NixlOptions {
            backend: "UCX".into(),
            plugin_dir: None,
            timeout_ms: 30_000,
            plugin_params: BTreeMap::new(),
            device_id: None,
            progress_thread: true,
            progress_delay_us: 100,
            request_bytes: 16 << 20,
            requests_in_flight: 2,
            lanes: DEFAULT_LANES,
            experimental_lanes: false,
        }
    }
}
