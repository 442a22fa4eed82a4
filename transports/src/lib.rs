#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

use reshard_core::registry::Registry;

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
