//! The nixl backend's peer-metadata decoder on arbitrary bytes: a typed error or metadata, never
//! a panic. Each input is tried as is and, so that mutations reach past the checksum, with a
//! valid XXH3-64 checksum appended; accepted metadata re-encodes to a blob that decodes to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use reshard_backend_nixl::decode_metadata;

fn check(bytes: &[u8]) {
    if let Ok(canonical) = decode_metadata(bytes) {
        assert_eq!(canonical.len(), bytes.len(), "re-encoding keeps the size");
        assert_eq!(decode_metadata(&canonical).expect("re-decodes"), canonical);
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    let mut sealed = data.to_vec();
    sealed.extend_from_slice(&twox_hash::XxHash3_64::oneshot(data).to_le_bytes());
    check(&sealed);
});
