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
    /// a typed struct (unknown keys are errors there); a section for a scheme no backend
    /// registered is an error of [`crate::registry::Registry::check`].
    pub backends: BTreeMap<String, serde_json::Value>,
}

/// `[transport]`: the backend and its shared options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransportConfig {
    /// Backend scheme (`loopback`, the default, or any scheme a backend registered).
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
    /// Read a column block of a row-major tensor as one gather read (rows at a pitch) where
    /// it lands contiguously, instead of one read per row or a full pull (docs/design.md §4).
    pub gather_reads: bool,
    /// The shortest row a gather read is planned for, in bytes; shorter rows are read row by
    /// row or pulled whole (BENCHMARKS.md, "Gather reads").
    pub gather_min_row_bytes: u64,
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
    /// Run digest checks and re-slices as the bytes land, overlapping the wire leg (false:
    /// after it; worth it where the transport's copy does not need every core).
    pub verify_while_landing: bool,
    /// Let a backend whose CPU copies the bytes hash them as it copies (with checks run as
    /// the bytes land).
    pub hash_while_copying: bool,
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
            gather_reads: true,
            gather_min_row_bytes: 4096,
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
            verify_while_landing: true,
            hash_while_copying: true,
        }
    }
}

/// Environment variable naming the config file (default `./reshard.toml` when present).
pub const CONFIG_PATH_ENV: &str = "RESHARD_CONFIG";

/// Prefix of environment overrides: `RESHARD_TRANSPORT__KIND=<scheme>` sets `transport.kind`.
pub const ENV_PREFIX: &str = "RESHARD_";

/// `RESHARD_*` variables that are not configuration keys (after the prefix): the config file
/// path, the log filter, the publisher-process socket, and the test suite's own (required
/// backends, fault-schedule count and seed, the quiescence child). Backends declare their own
/// ([`crate::registry::TransportFactory::env_vars`]); any other `RESHARD_*` variable must name a
/// config key.
pub const NOT_CONFIG_ENV: [&str; 7] = [
    "CONFIG",
    "LOG",
    "PUBLISHER_SOCKET",
    "REQUIRE_BACKENDS",
    "FAULT_CASES",
    "FAULT_SEED",
    "QUIESCENCE_CHILD",
];

impl Config {
    /// Loads defaults < file < environment < `cli` (a partial TOML-shaped value of flags).
    ///
    /// `file`: an explicit path (must exist), or `None` for `$RESHARD_CONFIG` or
    /// `./reshard.toml` when present.
    /// Backend sections are not checked here (core knows no backend): load through
    /// [`crate::registry::Registry::load_config`] to check them against the registered schemes.
    pub fn load(file: Option<&Path>, cli: Option<serde_json::Value>) -> Result<Config> {
        Config::load_ignoring(file, cli, &[])
    }

    /// [`Config::load`], also taking the `RESHARD_*` variables in `not_config` (named without
    /// the prefix) as something other than configuration keys.
    pub fn load_ignoring(
        file: Option<&Path>,
        cli: Option<serde_json::Value>,
        not_config: &[&str],
    ) -> Result<Config> {
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
        let ignored: Vec<&str> = NOT_CONFIG_ENV.iter().chain(not_config).copied().collect();
        fig = fig.merge(Env::prefixed(ENV_PREFIX).ignore(&ignored).split("__"));
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
        // This process's environment is cargo's, which sets a backend's own variable
        // (RESHARD_NIXL_HOME, .cargo/config.toml): passed as the registry passes its backends'.
        let load = |file: &Path, cli| Config::load_ignoring(Some(file), cli, &["NIXL_HOME"]);
        let c = load(&p, None).unwrap();
        assert_eq!(
            (c.transport.kind.as_str(), c.transport.workers),
            ("ucx", Some(3))
        );
        let cli = serde_json::json!({"transport": {"kind": "nixl"}});
        let c = load(&p, Some(cli)).unwrap();
        assert_eq!(c.transport.kind, "nixl");
        assert_eq!(c.planner.full_pull_threshold, 8);
        assert_eq!(
            load(&dir.join("missing.toml"), None).unwrap_err().kind(),
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
        // A section of a scheme nobody registered is the registry's to refuse.
        Config::from_toml("[backends.carrier]\n").unwrap();
        // No section: defaults.
        let c = Config::from_toml("").unwrap();
        assert_eq!(
            backend_options::<Opts>(&c.transport).unwrap(),
            Opts::default()
        );
    }

    /// Marker telling a re-executed copy of this test binary which child scenario to run (not
    /// `RESHARD_`-prefixed, so the loader never sees it as a key).
    const CHILD_ENV: &str = "CONFIG_TEST_CHILD";

    /// Runs the test `name` of this module in a fresh copy of this test binary whose
    /// environment is exactly `env` (plus the marker) and whose working directory is `cwd`:
    /// environment variables are process-global, so setting them here would race every other
    /// test that loads a configuration. Fails if the child fails or did not run the test.
    fn run_child(name: &str, cwd: &Path, env: &[(&str, &str)]) {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = std::process::Command::new(exe);
        cmd.args(["--exact", &format!("config::tests::{name}"), "--nocapture"])
            .args(["--test-threads", "1"])
            .env_clear()
            .env(CHILD_ENV, name)
            .current_dir(cwd);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "child {name} failed:\n{text}");
        assert!(
            text.contains("1 passed"),
            "child {name} did not run:\n{text}"
        );
    }

    /// True in the child started by [`run_child`] for `name`; the child tests do nothing (and
    /// pass) when the test harness runs them directly.
    fn is_child(name: &str) -> bool {
        std::env::var(CHILD_ENV).as_deref() == Ok(name)
    }

    /// A file setting keys of three sections, each to something other than its default.
    const LAYERED_TOML: &str = "[transport]\nkind = \"ucx\"\nworkers = 3\n\
        [planner]\nfull_pull_threshold = 8\nspread_owners = true\n\
        [receiver]\nverify_digests = true\nretries = 2\nmax_wire_gbps = 100.0\n\
        [backends.nixl]\ntimeout_ms = 1000\n";

    #[test]
    fn environment_overrides_the_file_and_the_file_overrides_defaults() {
        let dir = std::env::temp_dir().join(format!("reshard-cfg-env-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("layered.toml");
        std::fs::write(&file, LAYERED_TOML).unwrap();
        let file = file.to_str().unwrap();
        // The file found through $RESHARD_CONFIG, overridden by the environment in four keys
        // of three sections and four types (string, integer, bool, float) and one backend
        // option, with the suite's own variables set alongside.
        run_child(
            "child_env_over_file",
            &dir,
            &[
                (CONFIG_PATH_ENV, file),
                ("RESHARD_TRANSPORT__KIND", "nixl"),
                ("RESHARD_PLANNER__FULL_PULL_THRESHOLD", "16"),
                ("RESHARD_RECEIVER__VERIFY_DIGESTS", "false"),
                ("RESHARD_RECEIVER__MAX_WIRE_GBPS", "12.5"),
                ("RESHARD_BACKENDS__NIXL__TIMEOUT_MS", "5000"),
                ("RESHARD_FAULT_CASES", "3"),
                ("RESHARD_FAULT_SEED", "7"),
                ("RESHARD_REQUIRE_BACKENDS", "ucx,nixl"),
                ("RESHARD_QUIESCENCE_CHILD", "1"),
                ("RESHARD_LOG", "debug"),
                ("RESHARD_EXAMPLE_HOME", "/nonexistent"),
                ("RESHARD_PUBLISHER_SOCKET", "/nonexistent/sock"),
            ],
        );
        // Without any environment the file's values stand (and ./reshard.toml is found).
        std::fs::write(dir.join("reshard.toml"), LAYERED_TOML).unwrap();
        run_child("child_file_over_defaults", &dir, &[]);
        // A RESHARD_ variable that is neither a key nor one of the known others is an error.
        run_child(
            "child_unknown_env_key",
            &dir,
            &[("RESHARD_PLANNER__FULL_PULL_TRESHOLD", "4")],
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn child_env_over_file() {
        if !is_child("child_env_over_file") {
            return;
        }
        // RESHARD_EXAMPLE_HOME stands for a backend's own variable, passed as a registry does.
        let c = Config::load_ignoring(None, None, &["EXAMPLE_HOME"]).unwrap();
        // Environment over file.
        assert_eq!(c.transport.kind, "nixl");
        assert_eq!(c.planner.full_pull_threshold, 16);
        assert!(!c.receiver.verify_digests);
        assert_eq!(c.receiver.max_wire_gbps, Some(12.5));
        assert_eq!(
            c.transport.options,
            Some(serde_json::json!({"timeout_ms": 5000}))
        );
        // File values the environment does not name are kept.
        assert_eq!(c.transport.workers, Some(3));
        assert!(c.planner.spread_owners);
        assert_eq!(c.receiver.retries, 2);
        // Defaults neither names.
        let d = Config::default();
        assert_eq!(c.planner.dedup, d.planner.dedup);
        assert_eq!(c.receiver.retry_backoff_ms, d.receiver.retry_backoff_ms);
        assert_eq!(c.receiver.min_coverage, None);
        // A CLI flag still beats the environment.
        let cli = serde_json::json!({"transport": {"kind": "loopback"}});
        let c = Config::load_ignoring(None, Some(cli), &["EXAMPLE_HOME"]).unwrap();
        assert_eq!(c.transport.kind, "loopback");
        assert_eq!(c.planner.full_pull_threshold, 16);
    }

    #[test]
    fn child_file_over_defaults() {
        if !is_child("child_file_over_defaults") {
            return;
        }
        let c = Config::load(None, None).unwrap();
        let d = Config::default();
        assert_eq!(c.transport.kind, "ucx");
        assert_eq!(c.transport.workers, Some(3));
        assert_eq!(c.planner.full_pull_threshold, 8);
        assert!(c.planner.spread_owners);
        assert_eq!(c.receiver.retries, 2);
        assert_eq!(c.receiver.max_wire_gbps, Some(100.0));
        // The file selected ucx, so the nixl section is not this transport's options.
        assert_eq!(c.transport.options, None);
        assert_eq!(c.backends["nixl"], serde_json::json!({"timeout_ms": 1000}));
        assert_eq!(
            (c.planner.dedup, c.receiver.verify_digests),
            (d.planner.dedup, d.receiver.verify_digests)
        );
        assert_eq!(c.receiver.retry_backoff_ms, d.receiver.retry_backoff_ms);
        assert_eq!(c.receiver.wire_timeout_ms, d.receiver.wire_timeout_ms);
    }

    #[test]
    fn child_unknown_env_key() {
        if !is_child("child_unknown_env_key") {
            return;
        }
        let e = Config::load(None, None).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(
            e.message().contains("full_pull_treshold")
                && e.message().contains("full_pull_threshold"),
            "{e}"
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
