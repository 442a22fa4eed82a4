//! Decoders the fuzz targets reach that their crates keep private.
//!
//! The backends export their metadata decoders (`reshard_backend_<scheme>::decode_metadata`),
//! which the targets call directly. The etcd rendezvous' member-record decoder,
//! `rendezvous/src/etcd/record.rs`, and the key layout it checks records against, `keys.rs`, are
//! private to `reshard-rendezvous` and free of its etcd client, so the very source files compile
//! here unchanged, and the fuzz build needs neither etcd-client nor protoc.

/// The etcd rendezvous' key layout (`rendezvous/src/etcd/keys.rs`, compiled here unchanged).
#[path = "../../rendezvous/src/etcd/keys.rs"]
#[allow(dead_code, unreachable_pub)]
mod keys;

/// The etcd member record and its blob references (`rendezvous/src/etcd/record.rs`, compiled
/// here unchanged).
#[path = "../../rendezvous/src/etcd/record.rs"]
#[allow(dead_code, unreachable_pub)]
mod record;

/// Decodes UCX peer metadata from untrusted bytes and returns its canonical encoding (regions
/// ascending by id); any defect is a typed `Decode` error, never a panic.
pub use reshard_backend_ucx::decode_metadata as ucx_decode_metadata;

/// Metadata as a real UCX endpoint exports it: the seed corpus entry
/// `fuzz/corpus/ucx_metadata/seed-three-regions`.
pub use reshard_backend_ucx::example_metadata as ucx_seed;

pub use record::{CHUNK_BYTES as ETCD_CHUNK_BYTES, MAX_BLOB_BYTES as ETCD_MAX_BLOB_BYTES};

/// The model every fuzzed etcd member record belongs to (a name that needs escaping).
pub const ETCD_MODEL: &str = "Qwen/Qwen3-30B-A3B";

/// The key fuzzed member records are read under: rank 3's record of [`ETCD_MODEL`].
pub fn etcd_member_key() -> String {
    keys::member_key(ETCD_MODEL, 3)
}

/// An etcd member record as a receiver accepted it.
pub struct EtcdRecord {
    record: record::Record,
    /// The record re-encoded as JSON (what a publisher would have written).
    pub canonical: Vec<u8>,
    /// Rank and world.
    pub rank_world: (u32, u32),
    /// Chunk count and size of the table, metadata and config blobs, in that order.
    pub blobs: [(u32, u64); 3],
}

/// Decodes and checks a member record read under `key` as the etcd rendezvous does
/// (`parse_record`): the record, or a typed error.
pub fn etcd_decode_member_record(key: &[u8], value: &[u8]) -> reshard_core::Result<EtcdRecord> {
    let record = record::parse_record(ETCD_MODEL, key, value)?;
    let canonical = serde_json::to_vec(&record).expect("a record encodes");
    let b = |r: &record::BlobRef| (r.chunks, r.bytes);
    Ok(EtcdRecord {
        canonical,
        rank_world: (record.rank, record.world),
        blobs: [b(&record.table), b(&record.metadata), b(&record.config)],
        record,
    })
}

impl EtcdRecord {
    /// Assembles blob `blob` (0 table, 1 metadata, 2 config) from chunks as etcd returned them,
    /// `(chunk index, value)`, as a receiver's fetch does.
    pub fn assemble(
        &self,
        blob: usize,
        parts: Vec<(u32, Vec<u8>)>,
    ) -> reshard_core::Result<bytes::Bytes> {
        let r = [
            &self.record.table,
            &self.record.metadata,
            &self.record.config,
        ][blob % 3];
        r.assemble(parts, self.record.rank)
    }
}

/// A member record as a publisher writes it (rank 3 of 4, step 9, an empty table, 4 bytes of
/// metadata, a 2-byte config), followed by those two blobs' chunks in the target's input
/// format: the seed corpus entry `fuzz/corpus/etcd_member_record/seed-rank-3`.
pub fn etcd_member_record_seed() -> Vec<u8> {
    let blob = |name: &str, content: &[u8]| record::BlobRef {
        prefix: keys::blob_prefix(ETCD_MODEL, 3, 0x694d_2a31, name),
        chunks: content.len().div_ceil(record::CHUNK_BYTES) as u32,
        bytes: content.len() as u64,
        xxh3: twox_hash::XxHash3_64::oneshot(content),
    };
    let r = record::Record {
        rank: 3,
        world: 4,
        step: 9,
        ready: true,
        transport: "ucx".into(),
        incarnation: 0x5eed_0003,
        host: "trainer-3".into(),
        pid: 4242,
        granted_unix_ms: 1_700_000_000_000,
        table: blob("table-00000000000000000009", b""),
        metadata: blob("metadata", b"meta"),
        config: blob("config", b"{}"),
        note: None,
    };
    let mut out = serde_json::to_vec(&r).expect("a record encodes");
    // Chunk pieces after a NUL: a selector byte (blob = byte % 3, chunk = byte / 3), then data.
    out.extend_from_slice(b"\0\x01meta\0\x02{}");
    out
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

    /// The checked-in etcd member record seed is what the record's own encoder writes, and its
    /// record and both non-empty blobs are accepted.
    #[test]
    fn etcd_member_record_seed_is_the_encoders_output() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/corpus/etcd_member_record/seed-rank-3"
        );
        let seed = super::etcd_member_record_seed();
        if std::env::var_os("UPDATE_SEEDS").is_some() {
            std::fs::create_dir_all(std::path::Path::new(path).parent().unwrap()).unwrap();
            std::fs::write(path, &seed).unwrap();
        }
        assert_eq!(std::fs::read(path).unwrap(), seed);
        let end = seed.iter().position(|&b| b == 0).unwrap();
        let key = super::etcd_member_key();
        let r = super::etcd_decode_member_record(key.as_bytes(), &seed[..end]).unwrap();
        assert_eq!(r.canonical, &seed[..end]);
        assert_eq!(
            r.assemble(1, vec![(0, b"meta".to_vec())]).unwrap(),
            &b"meta"[..]
        );
        assert_eq!(
            r.assemble(2, vec![(0, b"{}".to_vec())]).unwrap(),
            &b"{}"[..]
        );
        assert_eq!(r.assemble(0, vec![]).unwrap(), &b""[..]);
    }
}
