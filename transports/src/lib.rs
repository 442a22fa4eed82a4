#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

use reshard_core::registry::Registry;
use reshard_core::transport::Capability;

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
}
