//! The cma backend's peer-metadata decoder on arbitrary bytes: a typed error or metadata,
//! never a panic; the canonical encoding of accepted metadata decodes to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use reshard_backend_cma::decode_metadata;

fuzz_target!(|data: &[u8]| {
    if let Ok(canonical) = decode_metadata(data) {
        assert_eq!(canonical.len(), data.len(), "re-encoding keeps the size");
        assert_eq!(decode_metadata(&canonical).expect("re-decodes"), canonical);
    }
});
