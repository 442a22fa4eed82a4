//! The typed `[backends.cma]` options.

use reshard_core::{Error, ErrorKind, Result};
use serde::{Deserialize, Serialize};

use crate::sys::IOV_MAX;
use crate::SCHEME;

/// Options of the cma transport; every key is optional and an unknown key is a `Config` error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CmaOptions {
    /// Copy threads, each running one `process_vm_readv` at a time (default: available cores;
    /// `transport.workers` overrides it when the endpoint comes from the registry).
    pub workers: usize,
    /// Most bytes one `process_vm_readv` call moves (at least 4096). A call cannot be
    /// interrupted, so this is the step at which `abort` and a dropped batch stop, and at
    /// which the no-progress timer sees a batch advance.
    pub piece_bytes: u64,
    /// Most iovecs on each side of one call (1..=1024): many small reads of one owner go into
    /// one system call. 1 turns the batching off (for measurements).
    pub iovecs_per_call: usize,
    /// The no-progress bound, in milliseconds: how long `wait` goes on while no call of the
    /// batch completes, and how long `wait`, `abort` or a dropped batch wait for calls still
    /// running after the batch ended before quarantining them.
    pub timeout_ms: u64,
    /// Let any process of the same user read this one when Yama's `ptrace_scope` is 1, with
    /// `prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)` at endpoint creation. Off by default: it
    /// widens, for the whole process and its whole life, who may read (and ptrace) it.
    pub allow_any_reader: bool,
}

impl Default for CmaOptions {
    fn default() -> Self {
        CmaOptions {
            workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
            piece_bytes: 8 << 20,
            iovecs_per_call: IOV_MAX,
            timeout_ms: 30_000,
            allow_any_reader: false,
        }
    }
}

impl CmaOptions {
    /// Refuses values the transport cannot work with (`Config`, naming the option).
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::new(ErrorKind::Config, msg).with_backend(SCHEME));
        if self.workers == 0 {
            return bad("[backends.cma] workers must be at least 1".into());
        }
        if self.piece_bytes < 4096 {
            return bad(format!(
                "[backends.cma] piece_bytes must be at least 4096, not {}",
                self.piece_bytes
            ));
        }
        if !(1..=IOV_MAX).contains(&self.iovecs_per_call) {
            return bad(format!(
                "[backends.cma] iovecs_per_call must be 1..={IOV_MAX}, not {}",
                self.iovecs_per_call
            ));
        }
        if self.timeout_ms == 0 {
            return bad("[backends.cma] timeout_ms must be at least 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard_core::config::{backend_options, TransportConfig};

    fn config(options: serde_json::Value) -> TransportConfig {
        TransportConfig {
            kind: "cma".into(),
            workers: None,
            options: Some(options),
        }
    }

    #[test]
    fn options_parse_with_defaults_and_refuse_unknown_keys() {
        let o: CmaOptions =
            backend_options(&config(serde_json::json!({"piece_bytes": 65536}))).unwrap();
        assert_eq!(o.piece_bytes, 65536);
        assert_eq!(o.timeout_ms, CmaOptions::default().timeout_ms);
        assert!(!o.allow_any_reader);
        let e =
            backend_options::<CmaOptions>(&config(serde_json::json!({"piece": 1}))).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
    }

    #[test]
    fn out_of_range_values_are_config_errors() {
        for o in [
            CmaOptions {
                workers: 0,
                ..CmaOptions::default()
            },
            CmaOptions {
                piece_bytes: 4095,
                ..CmaOptions::default()
            },
            CmaOptions {
                iovecs_per_call: 0,
                ..CmaOptions::default()
            },
            CmaOptions {
                iovecs_per_call: IOV_MAX + 1,
                ..CmaOptions::default()
            },
            CmaOptions {
                timeout_ms: 0,
                ..CmaOptions::default()
            },
        ] {
            assert_eq!(o.validate().unwrap_err().kind(), ErrorKind::Config, "{o:?}");
        }
        CmaOptions::default().validate().unwrap();
    }
}
