//! The explicit transport registry: one factory per scheme. The CLI is the only place that
//! lists backends; an unknown scheme is an error naming every scheme that exists.

use std::sync::Arc;

use crate::config::TransportConfig;
use crate::error::{Error, ErrorKind, Result};
use crate::transport::Transport;

/// Schemes reshard knows about, built into this binary or not.
pub const KNOWN_KINDS: [&str; 3] = ["loopback", "ucx", "nixl"];

/// Builds transport endpoints of one scheme.
pub trait TransportFactory: Send + Sync {
    /// The scheme (`transport.kind`) this factory serves.
    fn kind(&self) -> &'static str;

    /// Creates an endpoint (agent) named `agent`.
    fn create(&self, agent: &str, config: &TransportConfig) -> Result<Arc<dyn Transport>>;
}

/// Factories by scheme, in registration order.
#[derive(Default)]
pub struct Registry {
    factories: Vec<Box<dyn TransportFactory>>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a factory (replacing one of the same scheme).
    pub fn register(&mut self, factory: Box<dyn TransportFactory>) -> &mut Self {
        self.factories.retain(|f| f.kind() != factory.kind());
        self.factories.push(factory);
        self
    }

    /// Builder form of [`Registry::register`].
    pub fn with(mut self, factory: impl TransportFactory + 'static) -> Self {
        self.register(Box::new(factory));
        self
    }

    /// Schemes available in this registry.
    pub fn kinds(&self) -> Vec<&'static str> {
        self.factories.iter().map(|f| f.kind()).collect()
    }

    /// Creates an endpoint of `config.kind`.
    pub fn create(&self, agent: &str, config: &TransportConfig) -> Result<Arc<dyn Transport>> {
        match self.factories.iter().find(|f| f.kind() == config.kind) {
            Some(f) => f.create(agent, config),
            None => {
                let avail = self.kinds().join(", ");
                let msg = if KNOWN_KINDS.contains(&config.kind.as_str()) {
                    format!(
                        "transport kind {:?} is not built into this binary; available: {avail}",
                        config.kind
                    )
                } else {
                    format!(
                        "unknown transport kind {:?}; available: {avail} (reshard knows: {})",
                        config.kind,
                        KNOWN_KINDS.join(", ")
                    )
                };
                Err(Error::new(ErrorKind::Config, msg))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_kind_lists_available() {
        let r = Registry::new();
        let cfg = TransportConfig {
            kind: "carrier-pigeon".into(),
            workers: None,
            options: None,
        };
        let e = r.create("a", &cfg).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.message().contains("loopback"));
    }
}
