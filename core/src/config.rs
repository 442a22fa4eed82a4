//! Configuration: `reshard.toml`, then `RESHARD_*` environment variables, then CLI flags, each
//! overriding the one before; defaults are the embedded loopback transport. Unknown keys are
//! errors that list the keys that exist.

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorKind, Result};

/// The whole configuration.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Which transport moves the bytes.
    pub transport: TransportConfig,
    /// Planner knobs.
    pub planner: PlannerConfig,
    /// Receiver knobs (verification, guards).
    pub receiver: ReceiverConfig,
    /// Backend-specific sections, `[backends.<kind>]`: each backend parses its own section into
    /// a typed struct (unknown keys are errors there); a section for an unknown kind is an
    /// error here.
    pub backends: BTreeMap<String, serde_json::Value>,
}

/// `[transport]`: the backend and its shared options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransportConfig {
    /// Backend scheme: `loopback` (default), `ucx`, `nixl`.
    pub kind: String,
    /// Worker threads for backends that copy on the host (default: available cores).
    pub workers: Option<usize>,
    /// The `[backends.<kind>]` section of the selected kind, copied here by [`Config::load`]
    /// so a factory sees its own options; read it with [`backend_options`].
    #[serde(skip)]
    pub options: Option<serde_json::Value>,
}

/// Parses the selected backend's `[backends.<kind>]` section into its typed options (defaults
/// when the section is absent); a wrong or unknown key is a `Config` error naming the backend.
pub fn backend_options<T: DeserializeOwned + Default>(config: &TransportConfig) -> Result<T> {
    match &config.options {
        None => Ok(T::default()),
        Some(v) => serde_json::from_value(v.clone()).map_err(|e| {
            Error::new(
                ErrorKind::Config,
                format!("invalid [backends.{}] options: {e}", config.kind),
            )
        }),
    }
}

/// `[planner]`: how plans are built.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlannerConfig {
    /// A copy needing more runs than this is pulled whole and re-sliced (when offers tile dim 0).
    pub full_pull_threshold: u64,
    /// Spread owners across replicas by receiver rank (off by default: measured slower).
    pub spread_owners: bool,
    /// Replica dedup; turning it off is the benchmark-only counterfactual arm.
    pub dedup: bool,
}

/// `[receiver]`: verification and guards.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReceiverConfig {
    /// Check installed bytes against publisher digests before swapping them in.
    pub verify_digests: bool,
    /// Fabric ceiling in Gbit/s: a faster wire leg means nothing real moved (off when unset).
    pub max_wire_gbps: Option<f64>,
    /// Minimum fraction of parameter bytes a plan must write (off when unset).
    pub min_coverage: Option<f64>,
    /// Times a wire leg that failed with a retryable error is posted again (0: never).
    pub retries: u32,
    /// Backoff before the first retry, doubled for each further one.
    pub retry_backoff_ms: u64,
    /// Bound on one wire leg including its retries and backoff (off when unset).
    pub wire_timeout_ms: Option<u64>,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            kind: "loopback".into(),
            workers: None,
            options: None,
        }
    }
}

impl Default for PlannerConfig {
    fn default() -> Self {
        PlannerConfig {
            full_pull_threshold: 64,
            spread_owners: false,
            dedup: true,
        }
    }
}

impl Default for ReceiverConfig {
    fn default() -> Self {
        ReceiverConfig {
            verify_digests: true,
            max_wire_gbps: None,
            min_coverage: None,
            retries: 0,
            retry_backoff_ms: 20,
            wire_timeout_ms: None,
        }
    }
}

/// Environment variable naming the config file (default `./reshard.toml` when present).
pub const CONFIG_PATH_ENV: &str = "RESHARD_CONFIG";

/// Prefix of environment overrides: `RESHARD_TRANSPORT__KIND=ucx` sets `transport.kind`.
pub const ENV_PREFIX: &str = "RESHARD_";

/// `RESHARD_*` variables that are not configuration keys (after the prefix): the config file
/// path, the log filter, the publisher-process socket, the NIXL runtime folder, and the test
/// suite's own (required backends, fault-schedule count and seed, the quiescence child). Any
/// other `RESHARD_*` variable must name a config key.
pub const NOT_CONFIG_ENV: [&str; 8] = [
    "CONFIG",
    "LOG",
    "PUBLISHER_SOCKET",
    "REQUIRE_BACKENDS",
    "NIXL_HOME",
    "FAULT_CASES",
    "FAULT_SEED",
    "QUIESCENCE_CHILD",
];

impl Config {
    /// Loads defaults < file < environment < `cli` (a partial TOML-shaped value of flags).
    ///
    /// `file`: an explicit path (must exist), or `None` for `$RESHARD_CONFIG` or
    /// `./reshard.toml` when present.
    pub fn load(file: Option<&Path>, cli: Option<serde_json::Value>) -> Result<Config> {
        let path: Option<PathBuf> = match file {
            Some(p) => {
                if !p.exists() {
                    return Err(Error::new(
                        ErrorKind::Config,
                        format!("config file {} does not exist", p.display()),
                    ));
                }
                Some(p.to_path_buf())
            }
            None => match std::env::var_os(CONFIG_PATH_ENV) {
                Some(p) => Some(PathBuf::from(p)),
                None => Some(PathBuf::from("reshard.toml")).filter(|p| p.exists()),
            },
        };
        let mut fig = Figment::from(Serialized::defaults(Config::default()));
        if let Some(p) = &path {
            fig = fig.merge(Toml::file_exact(p));
        }
        fig = fig.merge(
            Env::prefixed(ENV_PREFIX)
                .ignore(&NOT_CONFIG_ENV)
                .split("__"),
        );
        if let Some(v) = cli {
            fig = fig.merge(Serialized::defaults(v));
        }
        let mut cfg: Config = fig
            .extract()
            .map_err(|e| Error::new(ErrorKind::Config, config_message(e)))?;
        cfg.validate()?;
        cfg.select_backend_options();
        Ok(cfg)
    }

    /// Parses a TOML string over the defaults (no environment), for tests and embedding.
    pub fn from_toml(text: &str) -> Result<Config> {
        let mut cfg: Config = Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::string(text))
            .extract()
            .map_err(|e| Error::new(ErrorKind::Config, config_message(e)))?;
        cfg.validate()?;
        cfg.select_backend_options();
        Ok(cfg)
    }

    /// Copies the selected kind's `[backends.<kind>]` section into `transport.options`.
    pub fn select_backend_options(&mut self) {
        self.transport.options = self.backends.get(&self.transport.kind).cloned();
    }

    /// Checks value ranges.
    pub fn validate(&self) -> Result<()> {
        if let Some(k) = self
            .backends
            .keys()
            .find(|k| !crate::registry::KNOWN_KINDS.contains(&k.as_str()))
        {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "unknown backend section [backends.{k}]; known: {}",
                    crate::registry::KNOWN_KINDS.join(", ")
                ),
            ));
        }
        if self.planner.full_pull_threshold == 0 {
            return Err(Error::new(
                ErrorKind::Config,
                "planner.full_pull_threshold must be at least 1",
            ));
        }
        if self.transport.workers == Some(0) {
            return Err(Error::new(
                ErrorKind::Config,
                "transport.workers must be at least 1",
            ));
        }
        if let Some(g) = self.receiver.max_wire_gbps {
            if !(g.is_finite() && g > 0.0) {
                return Err(Error::new(
                    ErrorKind::Config,
                    "receiver.max_wire_gbps must be a positive number",
                ));
            }
        }
        if self.receiver.wire_timeout_ms == Some(0) {
            return Err(Error::new(
                ErrorKind::Config,
                "receiver.wire_timeout_ms must be at least 1",
            ));
        }
        if let Some(c) = self.receiver.min_coverage {
            if !(0.0..=1.0).contains(&c) {
                return Err(Error::new(
                    ErrorKind::Config,
                    "receiver.min_coverage must be between 0 and 1",
                ));
            }
        }
        Ok(())
    }
}

fn config_message(e: figment::Error) -> String {
    let all: Vec<String> = e.into_iter().map(|e| e.to_string()).collect();
    format!("invalid configuration: {}", all.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_loopback_with_dedup() {
        let c = Config::from_toml("").unwrap();
        assert_eq!(c.transport.kind, "loopback");
        assert_eq!(c.planner.full_pull_threshold, 64);
        assert!(c.planner.dedup && !c.planner.spread_owners && c.receiver.verify_digests);
    }

    #[test]
    fn unknown_key_is_an_error_listing_known_keys() {
        let e = Config::from_toml("[transport]\nknd = \"ucx\"\n").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.message().contains("kind"), "{e}");
        let e = Config::from_toml("[nope]\n").unwrap_err();
        assert!(e.message().contains("transport"), "{e}");
    }

    #[test]
    fn file_then_env_then_cli() {
        let dir = std::env::temp_dir().join(format!("reshard-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("reshard.toml");
        std::fs::write(
            &p,
            "[transport]\nkind = \"ucx\"\nworkers = 3\n[planner]\nfull_pull_threshold = 8\n",
        )
        .unwrap();
        let c = Config::load(Some(&p), None).unwrap();
        assert_eq!(
            (c.transport.kind.as_str(), c.transport.workers),
            ("ucx", Some(3))
        );
        let cli = serde_json::json!({"transport": {"kind": "nixl"}});
        let c = Config::load(Some(&p), Some(cli)).unwrap();
        assert_eq!(c.transport.kind, "nixl");
        assert_eq!(c.planner.full_pull_threshold, 8);
        assert_eq!(
            Config::load(Some(&dir.join("missing.toml")), None)
                .unwrap_err()
                .kind(),
            ErrorKind::Config
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn backend_sections_reach_the_selected_factory_typed() {
        #[derive(Debug, Default, Deserialize, PartialEq)]
        #[serde(deny_unknown_fields, default)]
        struct Opts {
            tls: Option<String>,
            in_flight: Option<u32>,
        }
        let c = Config::from_toml(
            "[transport]\nkind = \"ucx\"\n[backends.ucx]\ntls = \"tcp\"\nin_flight = 8\n[backends.nixl]\nx = 1\n",
        )
        .unwrap();
        let o: Opts = backend_options(&c.transport).unwrap();
        assert_eq!((o.tls.as_deref(), o.in_flight), (Some("tcp"), Some(8)));
        let c = Config::from_toml("[backends.ucx]\ntlz = \"tcp\"\n[transport]\nkind = \"ucx\"\n")
            .unwrap();
        let e = backend_options::<Opts>(&c.transport).unwrap_err();
        assert!(
            e.message().contains("tlz") && e.message().contains("backends.ucx"),
            "{e}"
        );
        let e = Config::from_toml("[backends.carrier]\n").unwrap_err();
        assert!(
            e.message().contains("carrier") && e.message().contains("ucx"),
            "{e}"
        );
        // No section: defaults.
        let c = Config::from_toml("").unwrap();
        assert_eq!(
            backend_options::<Opts>(&c.transport).unwrap(),
            Opts::default()
        );
    }

    #[test]
    fn bad_values_are_rejected() {
        for t in [
            "[planner]\nfull_pull_threshold = 0\n",
            "[receiver]\nmax_wire_gbps = -1.0\n",
            "[receiver]\nmin_coverage = 2.0\n",
            "[transport]\nworkers = 0\n",
            "[receiver]\nwire_timeout_ms = 0\n",
        ] {
            assert_eq!(
                Config::from_toml(t).unwrap_err().kind(),
                ErrorKind::Config,
                "{t}"
            );
        }
    }
}
