//! The binary shard-table decoder on arbitrary bytes: a typed error or a table, never a panic,
//! and every table it accepts re-encodes to exactly the input (the encoding is canonical).
#![no_main]

use libfuzzer_sys::fuzz_target;
use reshard_core::encoding::{decode_table, encode_table};

fuzz_target!(|data: &[u8]| {
    if let Ok(table) = decode_table(data) {
        let again = encode_table(&table);
        assert_eq!(again, data, "decode then encode must give the input back");
        assert_eq!(decode_table(&again).expect("re-decodes"), table);
    }
});
