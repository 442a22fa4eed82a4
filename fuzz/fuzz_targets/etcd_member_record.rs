//! The etcd rendezvous' member-record decoder (`rendezvous/src/etcd/record.rs`) on arbitrary
//! bytes: a typed error or a record whose every count and size is within bounds, never a panic
//! and no allocation beyond the input's size; an accepted record's canonical JSON decodes to
//! itself, and a blob assembles only from chunks that add up to exactly its recorded size.
//!
//! Input: the record's value, then optionally a NUL and chunk pieces separated by NULs, each a
//! selector byte (blob = byte % 3: table, metadata, config; chunk index = byte / 3) and the
//! chunk's bytes, as etcd would return them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use reshard_core::rendezvous::MAX_WORLD;
use reshard_fuzz::{
    etcd_decode_member_record, etcd_member_key, ETCD_CHUNK_BYTES, ETCD_MAX_BLOB_BYTES,
};

fuzz_target!(|data: &[u8]| {
    let (value, rest) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let key = etcd_member_key();
    let Ok(record) = etcd_decode_member_record(key.as_bytes(), value) else {
        return;
    };
    let (rank, world) = record.rank_world;
    assert!(rank == 3 && rank < world && world <= MAX_WORLD);
    for (chunks, bytes) in record.blobs {
        assert!(bytes <= ETCD_MAX_BLOB_BYTES);
        assert_eq!(u64::from(chunks), bytes.div_ceil(ETCD_CHUNK_BYTES as u64));
    }
    let again = etcd_decode_member_record(key.as_bytes(), &record.canonical).expect("re-decodes");
    assert_eq!(again.canonical, record.canonical);
    let mut parts: [Vec<(u32, Vec<u8>)>; 3] = Default::default();
    for piece in rest.split(|&b| b == 0).filter(|p| !p.is_empty()) {
        parts[usize::from(piece[0] % 3)].push((u32::from(piece[0] / 3), piece[1..].to_vec()));
    }
    for (blob, parts) in parts.into_iter().enumerate() {
        if let Ok(bytes) = record.assemble(blob, parts) {
            assert_eq!(bytes.len() as u64, record.blobs[blob].1);
        }
    }
});
