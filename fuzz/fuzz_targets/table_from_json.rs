//! The JSON shard-table parser on arbitrary text: a typed error or a table, never a panic; an
//! accepted table survives a JSON and a binary round trip unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use reshard_core::encoding::{decode_table, encode_table, table_from_json, table_to_json};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(table) = table_from_json(text) {
        let json = table_to_json(&table);
        assert_eq!(table_from_json(&json).expect("re-parses"), table);
        assert_eq!(decode_table(&encode_table(&table)).expect("binary"), table);
    }
});
