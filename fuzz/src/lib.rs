//! Decoders the fuzz targets reach that their crates keep private.
//!
//! The UCX backend's metadata module is private to `reshard-backend-ucx` (its public API
//! decodes peer metadata only inside `load_peer`, which needs libucp and a live worker), so the
//! very source file the backend compiles, `backends/ucx/src/meta.rs`, is compiled into this
//! crate as well: the target fuzzes the real decoder, not a copy, and needs no UCX runtime.

/// The UCX backend's metadata codec (`backends/ucx/src/meta.rs`, compiled here unchanged).
#[path = "../../backends/ucx/src/meta.rs"]
#[allow(dead_code, unreachable_pub)]
mod ucx_meta;

/// What `meta.rs` names in its errors as `crate::SCHEME`.
const SCHEME: &str = "ucx";

/// Decodes UCX peer metadata from untrusted bytes and returns its canonical encoding (regions
/// ascending by id); any defect is a typed `Decode` error, never a panic.
pub fn ucx_decode_metadata(bytes: &[u8]) -> reshard_core::Result<bytes::Bytes> {
    ucx_meta::EndpointMeta::decode(bytes).map(|m| m.encode())
}

/// Metadata as a real UCX endpoint exports it: an agent name, an opaque worker address, and
/// three regions (DRAM inside a larger UCX allocation, an empty one without a key, VRAM that is
/// its own key's whole range), encoded by the backend's own encoder: the seed corpus entry
/// `fuzz/corpus/ucx_metadata/seed-three-regions`.
pub fn ucx_seed() -> bytes::Bytes {
    use reshard_core::MemoryKind;
    use ucx_meta::{EndpointMeta, RegionMeta};
    EndpointMeta {
        agent: "publisher-3".into(),
        incarnation: 0x5eed_0003,
        worker_address: (0..61u8).map(|i| i.wrapping_mul(37)).collect(),
        regions: vec![
            RegionMeta {
                id: 1,
                base: 0x7f00_0000_1000,
                len: 4096,
                key_base: 0x7f00_0000_0000,
                key_len: 0x10_0000,
                kind: MemoryKind::Dram,
                rkey: vec![0x11; 24],
            },
            RegionMeta {
                id: 2,
                base: 0,
                len: 0,
                key_base: 0,
                key_len: 0,
                kind: MemoryKind::Dram,
                rkey: vec![],
            },
            RegionMeta {
                id: 3,
                base: 0x2000,
                len: 64,
                key_base: 0x2000,
                key_len: 64,
                kind: MemoryKind::Vram { device: 1 },
                rkey: vec![0x22; 16],
            },
        ],
    }
    .encode()
}

#[cfg(test)]
mod tests {
    /// The checked-in seed is exactly what the encoder writes (`UPDATE_SEEDS=1 cargo test`
    /// in fuzz/ rewrites it after a format change), and it decodes to itself.
    #[test]
    fn ucx_seed_is_the_encoders_output() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/corpus/ucx_metadata/seed-three-regions"
        );
        let seed = super::ucx_seed();
        if std::env::var_os("UPDATE_SEEDS").is_some() {
            std::fs::write(path, &seed).unwrap();
        }
        assert_eq!(std::fs::read(path).unwrap(), &seed[..]);
        assert_eq!(super::ucx_decode_metadata(&seed).unwrap(), seed);
    }
}
