//! [`UcxOptions`]: the typed `[backends.ucx]` section (or `RESHARD_BACKENDS__UCX__*`).

use reshard_core::config::{backend_options, TransportConfig};
use reshard_core::{Error, ErrorKind, Result};
use serde::{Deserialize, Serialize};

/// Reads kept in flight per posted batch when the configuration does not say.
pub const DEFAULT_READS_IN_FLIGHT: usize = 512;
/// Completion timeout when the configuration does not say (milliseconds).
pub const DEFAULT_TIMEOUT_MS: u64 = 30_000;
/// Most bytes one get carries when the configuration does not say.
pub const DEFAULT_PIECE_BYTES: u64 = 16 << 20;
/// Smallest `piece_bytes` accepted: smaller gets cost more per byte than they help.
pub const MIN_PIECE_BYTES: u64 = 64 << 10;

/// Options of the UCX backend. Unknown keys are `Config` errors.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UcxOptions {
    /// UCX transports to use, as `UCX_TLS` spells them (`"posix,cma,tcp"`, `"tcp"`); UCX's
    /// own default (its environment, else every transport) when unset.
    pub tls: Option<String>,
    /// Network devices, as `UCX_NET_DEVICES` spells them (`"eth0"`, `"mlx5_0:1"`).
    pub net_devices: Option<String>,
    /// Most reads of one posted batch outstanding at once; more are issued as they complete.
    pub reads_in_flight: usize,
    /// No-progress bound (milliseconds): a posted batch whose reads of some owner make no
    /// progress for this long (none of its gets on that owner completes) fails with `Timeout`
    /// naming that owner, and its outstanding reads are ended by force-closing their
    /// endpoints; reads that still do not complete within another such period are
    /// quarantined. It must exceed the time one get of `piece_bytes` takes at the owner's
    /// share of the slowest link. Connection set-up is bounded by it too, but never by less
    /// than one second.
    pub timeout_ms: u64,
    /// Most bytes one get carries; longer reads are cut into pieces. UCX reports a get only
    /// when it completes, so this is the step at which the no-progress timer sees an owner's
    /// reads advance: lower it on slow links or with a tight `timeout_ms` (at least 64 KiB).
    pub piece_bytes: u64,
    /// Threads that copy reads served straight from a peer's shared memory (`ucp_rkey_ptr`);
    /// the machine's available parallelism when unset. 1 copies on the progress thread.
    pub copy_threads: Option<usize>,
    /// Serve reads of a peer's UCX-allocated shared memory with local copies out of the
    /// segment UCX mapped here (`ucp_rkey_ptr`), after checking every read against the size
    /// the peer's metadata gives and the mapping the kernel reports; `false` sends every read
    /// through `ucp_get_nbx`.
    pub shm_fast_path: bool,
}

impl Default for UcxOptions {
    fn default() -> Self {
        UcxOptions {
            tls: None,
            net_devices: None,
            reads_in_flight: DEFAULT_READS_IN_FLIGHT,
            timeout_ms: DEFAULT_TIMEOUT_MS,
            piece_bytes: DEFAULT_PIECE_BYTES,
            copy_threads: None,
            shm_fast_path: true,
        }
    }
}

impl UcxOptions {
    /// Parses the `[backends.ucx]` section of `config` and checks it.
    pub fn from_transport_config(config: &TransportConfig) -> Result<Self> {
        let o: UcxOptions = backend_options(config).map_err(|e| e.with_backend(crate::SCHEME))?;
        o.validate()?;
        Ok(o)
    }

    /// Copy threads to use: the configured count, else the machine's available parallelism.
    pub fn effective_copy_threads(&self) -> usize {
        self.copy_threads.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        })
    }

    /// Checks value ranges.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::new(ErrorKind::Config, m).with_backend(crate::SCHEME));
        if self.reads_in_flight == 0 {
            return bad("backends.ucx.reads_in_flight must be at least 1");
        }
        if self.timeout_ms == 0 {
            return bad("backends.ucx.timeout_ms must be at least 1");
        }
        if self.copy_threads == Some(0) {
            return bad("backends.ucx.copy_threads must be at least 1");
        }
        if self.piece_bytes < MIN_PIECE_BYTES {
            return bad(&format!(
                "backends.ucx.piece_bytes must be at least {MIN_PIECE_BYTES} (64 KiB)"
            ));
        }
        for (key, v) in [("tls", &self.tls), ("net_devices", &self.net_devices)] {
            if let Some(v) = v {
                if v.trim().is_empty() || v.contains('\0') {
                    return bad(&format!(
                        "backends.ucx.{key} must be a non-empty list without NUL bytes"
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard_core::config::Config;

    const MIB_FOR_TEST: u64 = 1 << 20;

    #[test]
    fn section_is_typed_and_checked() {
        let c = Config::from_toml(
            "[transport]\nkind = \"ucx\"\n[backends.ucx]\ntls = \"tcp\"\nreads_in_flight = 8\n",
        )
        .unwrap();
        let o = UcxOptions::from_transport_config(&c.transport).unwrap();
        assert_eq!(o.tls.as_deref(), Some("tcp"));
        assert_eq!(o.reads_in_flight, 8);
        assert_eq!(o.timeout_ms, DEFAULT_TIMEOUT_MS);
        assert!(
            o.shm_fast_path,
            "the shared-memory fast path is on by default"
        );
        let c = Config::from_toml(
            "[transport]\nkind = \"ucx\"\n[backends.ucx]\nshm_fast_path = false\n",
        )
        .unwrap();
        let o = UcxOptions::from_transport_config(&c.transport).unwrap();
        assert!(!o.shm_fast_path);
        let c = Config::from_toml(
            "[transport]\nkind = \"ucx\"\n[backends.ucx]\nshm_fast_path = \"yes\"\n",
        )
        .unwrap();
        let e = UcxOptions::from_transport_config(&c.transport).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        let c = Config::from_toml("[transport]\nkind = \"ucx\"\n[backends.ucx]\ntlz = \"x\"\n")
            .unwrap();
        let e = UcxOptions::from_transport_config(&c.transport).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        let c =
            Config::from_toml("[transport]\nkind = \"ucx\"\n[backends.ucx]\nreads_in_flight = 0\n")
                .unwrap();
        let e = UcxOptions::from_transport_config(&c.transport).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        let c =
            Config::from_toml("[transport]\nkind = \"ucx\"\n[backends.ucx]\ncopy_threads = 0\n")
                .unwrap();
        let e = UcxOptions::from_transport_config(&c.transport).unwrap_err();
        assert!(e.to_string().contains("copy_threads"), "{e}");
        let c =
            Config::from_toml("[transport]\nkind = \"ucx\"\n[backends.ucx]\npiece_bytes = 65535\n")
                .unwrap();
        let e = UcxOptions::from_transport_config(&c.transport).unwrap_err();
        assert!(e.to_string().contains("piece_bytes"), "{e}");
        let c = Config::from_toml(
            "[transport]\nkind = \"ucx\"\n[backends.ucx]\npiece_bytes = 1048576\n",
        )
        .unwrap();
        let o = UcxOptions::from_transport_config(&c.transport).unwrap();
        assert_eq!(o.piece_bytes, MIB_FOR_TEST);
        assert_eq!(UcxOptions::default().piece_bytes, DEFAULT_PIECE_BYTES);
        let c = Config::from_toml("").unwrap();
        assert_eq!(
            UcxOptions::from_transport_config(&c.transport).unwrap(),
            UcxOptions::default()
        );
    }
}
