#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub use reshard_core::registry::Registry;
use reshard_core::transport::Capability;

/// The shared types: model, shard tables, the `Transport` and `Rendezvous` contracts, config and
/// the one public error.
pub use reshard_core as core;
pub use reshard_core::{Error, ErrorKind, Result};
/// Model presets, publisher topologies and receiver layouts.
pub use reshard_planner as planner;
/// Where publishers and receivers meet: in-process and etcd.
pub use reshard_rendezvous as rendezvous;
/// The receiver and publishers themselves, and the wire-leg layers.
pub use reshard_runtime as runtime;
pub use reshard_runtime::{
    Receiver, ReceiverOptions, ShardPublisher, StagedStep, StepReport, Subscriber, TensorPublisher,
    UpdateReport,
};

/// Every transport built into this binary, loopback first (the default scheme). Each line is
/// one backend crate's own `register`; a fresh loopback fabric belongs to this registry.
pub fn registry() -> Registry {
    let mut r = Registry::new();
    reshard_backend_loopback::register(&mut r);
    reshard_backend_cma::register(&mut r);
    #[cfg(feature = "ucx")]
    reshard_backend_ucx::register(&mut r);
    #[cfg(feature = "nixl")]
    reshard_backend_nixl::register(&mut r);
    r
}

/// One registered transport as this machine sees it: its scheme, and its capabilities when its
/// runtime is usable here (else why not).
#[derive(Debug)]
pub struct Available {
    /// The scheme (`transport.kind`).
    pub scheme: &'static str,
    /// The backend's own capabilities, read from an endpoint made for the purpose and dropped
    /// at once; the probe's or the creation's error when the runtime is not usable.
    pub capabilities: reshard_core::Result<Capability>,
}

/// Every transport of [`registry`], in its order, probed: the list that docs, tests and the
/// `reshard transports` command take backends from instead of naming them by hand.
pub fn available() -> Vec<Available> {
    let r = registry();
    r.schemes()
        .into_iter()
        .map(|scheme| Available {
            scheme,
            capabilities: r
                .probe(scheme)
                .and_then(|()| r.create_default(scheme, "reshard-available"))
                .map(|t| t.capabilities()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scheme_names_its_factory_and_endpoints() {
        let r = registry();
        assert_eq!(r.schemes()[0], "loopback");
        for scheme in r.schemes() {
            assert_eq!(r.factory(scheme).unwrap().scheme(), scheme);
        }
        let t = r.create_default("loopback", "a").unwrap();
        assert_eq!(t.name(), "loopback");
    }

    /// Core names no backend (docs/architecture.md): outside its test modules no registered
    /// scheme appears as a word in core's sources, except the default `transport.kind`.
    #[test]
    fn core_names_no_backend_outside_its_tests() {
        let core = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../core/src");
        let mut files = vec![core];
        let mut named = Vec::new();
        while let Some(p) = files.pop() {
            if p.is_dir() {
                files.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
                continue;
            }
            if p.extension().is_none_or(|e| e != "rs") || p.ends_with("tests.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap();
            // Test modules sit at the end of a file, after their `#[cfg(test)]`.
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            for (n, line) in code.lines().enumerate() {
                let words = line.split(|c: char| !c.is_ascii_alphanumeric() && c != '_');
                for w in words {
                    let w = w.to_ascii_lowercase();
                    let default_kind = w == "loopback" && p.ends_with("config.rs");
                    if registry().schemes().contains(&w.as_str()) && !default_kind {
                        named.push(format!("{}:{}: {w}", p.display(), n + 1));
                    }
                }
            }
        }
        assert!(named.is_empty(), "core names a backend: {named:#?}");
    }
}
