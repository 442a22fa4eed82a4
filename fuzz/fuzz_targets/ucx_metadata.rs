//! The ucx backend's peer-metadata decoder (`backends/ucx/src/meta.rs`) on arbitrary bytes: a
//! typed error or metadata, never a panic and no allocation beyond the input's size; the
//! canonical encoding of accepted metadata decodes to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use reshard_fuzz::ucx_decode_metadata;

fuzz_target!(|data: &[u8]| {
    if let Ok(canonical) = ucx_decode_metadata(data) {
        assert_eq!(canonical.len(), data.len(), "re-encoding keeps the size");
        assert_eq!(
            ucx_decode_metadata(&canonical).expect("re-decodes"),
            canonical
        );
    }
});
