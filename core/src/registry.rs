//! The transport registry: one factory per scheme, filled by the backend crates' own `register`
//! functions (the `reshard` facade calls them), so core names no backend. Config
//! sections and `RESHARD_*` variables are checked against what is registered, and an unknown
//! scheme is an error naming every scheme that exists in this binary.

use std::path::Path;
use std::sync::Arc;

use crate::config::{Config, TransportConfig};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::Transport;

/// Builds transport endpoints of one scheme.
pub trait TransportFactory: Send + Sync {
    /// The scheme (`transport.kind`, the `[backends.<scheme>]` section, [`Transport::name`]).
    fn scheme(&self) -> &'static str;

    /// Creates an endpoint (agent) named `agent`.
    fn create(&self, agent: &str, config: &TransportConfig) -> Result<Arc<dyn Transport>>;

    /// Whether this backend's native runtime is usable on this machine (`Ok` by default, for
    /// backends with nothing to load); the error says what is missing.
    fn probe(&self) -> Result<()> {
        Ok(())
    }

    /// `RESHARD_*` environment variables this backend reads that are not configuration keys
    /// (e.g. where its native runtime lives), so configuration loading does not take them for
    /// misspelt keys.
    fn env_vars(&self) -> &'static [&'static str] {
        &[]
    }
}

/// Factories by scheme, in registration order.
#[derive(Default)]
pub struct Registry {
    factories: Vec<Box<dyn TransportFactory>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Registry").field(&self.schemes()).finish()
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a factory (replacing one of the same scheme).
    pub fn register(&mut self, factory: Box<dyn TransportFactory>) -> &mut Self {
        self.factories.retain(|f| f.scheme() != factory.scheme());
        self.factories.push(factory);
        self
    }

    /// Builder form of [`Registry::register`].
    pub fn with(mut self, factory: impl TransportFactory + 'static) -> Self {
        self.register(Box::new(factory));
        self
    }

    /// Schemes available in this registry, in registration order.
    pub fn schemes(&self) -> Vec<&'static str> {
        self.factories.iter().map(|f| f.scheme()).collect()
    }

    /// The factory of `scheme`, or a `Config` error listing the schemes that exist.
    pub fn factory(&self, scheme: &str) -> Result<&dyn TransportFactory> {
        self.factories
            .iter()
            .find(|f| f.scheme() == scheme)
            .map(|f| f.as_ref())
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Config,
                    format!(
                        "unknown transport kind {scheme:?}; this binary has: {}",
                        self.schemes().join(", ")
                    ),
                )
            })
    }

    /// Whether `scheme` is registered and its native runtime is usable here.
    pub fn probe(&self, scheme: &str) -> Result<()> {
        self.factory(scheme)?.probe()
    }

    /// Creates an endpoint of `config.kind`.
    pub fn create(&self, agent: &str, config: &TransportConfig) -> Result<Arc<dyn Transport>> {
        self.factory(&config.kind)?.create(agent, config)
    }

    /// Creates an endpoint of `scheme` with its default options and workers.
    pub fn create_default(&self, scheme: &str, agent: &str) -> Result<Arc<dyn Transport>> {
        let config = TransportConfig {
            kind: scheme.to_owned(),
            workers: None,
            options: None,
        };
        self.create(agent, &config)
    }

    /// Checks that every `[backends.<scheme>]` section of `config` and its `transport.kind`
    /// name a registered scheme.
    pub fn check(&self, config: &Config) -> Result<()> {
        if let Some(k) = config
            .backends
            .keys()
            .find(|k| !self.schemes().contains(&k.as_str()))
        {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "unknown backend section [backends.{k}]; this binary has: {}",
                    self.schemes().join(", ")
                ),
            ));
        }
        self.factory(&config.transport.kind).map(|_| ())
    }

    /// `RESHARD_*` variables (without the prefix) that registered backends read and that are
    /// therefore not configuration keys.
    pub fn not_config_env(&self) -> Vec<&'static str> {
        self.factories
            .iter()
            .flat_map(|f| f.env_vars().iter().copied())
            .filter_map(|v| v.strip_prefix(crate::config::ENV_PREFIX))
            .collect()
    }

    /// [`Config::load`] knowing this registry's backends: their own environment variables are
    /// not keys, and every backend section and the selected kind must be registered.
    pub fn load_config(
        &self,
        file: Option<&Path>,
        cli: Option<serde_json::Value>,
    ) -> Result<Config> {
        let config = Config::load_ignoring(file, cli, &self.not_config_env())?;
        self.check(&config)?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A factory that makes nothing: the registry's bookkeeping is what is under test.
    struct Named(&'static str);

    impl TransportFactory for Named {
        fn scheme(&self) -> &'static str {
            self.0
        }

        fn create(&self, _: &str, _: &TransportConfig) -> Result<Arc<dyn Transport>> {
            Err(Error::new(ErrorKind::Unsupported, "test factory"))
        }

        fn env_vars(&self) -> &'static [&'static str] {
            &["RESHARD_PIGEON_HOME"]
        }
    }

    #[test]
    fn unknown_kind_lists_available() {
        let r = Registry::new().with(Named("dove"));
        let cfg = TransportConfig {
            kind: "carrier-pigeon".into(),
            workers: None,
            options: None,
        };
        let e = r.create("a", &cfg).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.message().contains("dove"), "{e}");
    }

    #[test]
    fn sections_and_kind_are_checked_against_what_is_registered() {
        let r = Registry::new().with(Named("dove")).with(Named("loopback"));
        let ok = Config::from_toml("[backends.dove]\nwings = 2\n").unwrap();
        r.check(&ok).unwrap();
        let e = r
            .check(&Config::from_toml("[backends.pigeon]\nwings = 2\n").unwrap())
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(
            e.message().contains("[backends.pigeon]") && e.message().contains("dove"),
            "{e}"
        );
        let e = r
            .check(&Config::from_toml("[transport]\nkind = \"pigeon\"\n").unwrap())
            .unwrap_err();
        assert!(e.message().contains("\"pigeon\""), "{e}");
        assert_eq!(r.not_config_env(), vec!["PIGEON_HOME"; 2]);
    }
}
