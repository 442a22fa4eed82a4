//! The JSON form of a shard table, for people: the same checks as the binary decoder.

use super::*;

#[derive(Serialize)]
struct JsonOut<'a> {
    schema_version: u16,
    table: &'a ShardTable,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonIn {
    schema_version: u64,
    table: serde_json::Value,
}

/// Pretty JSON for people: `{"schema_version": 3, "table": {...}}`.
pub fn table_to_json(t: &ShardTable) -> String {
    serde_json::to_string_pretty(&JsonOut {
        schema_version: SCHEMA_VERSION,
        table: t,
    })
    // Cannot fail: every map key is a string and no Serialize impl of the model returns errors.
    .expect("a shard table always serializes to JSON")
}

/// Parses the JSON of [`table_to_json`] from untrusted text, with the same checks as
/// [`decode_table`]: another schema version or malformed JSON is [`ErrorKind::Decode`], a table
/// that fails [`ShardTable::validate`] is [`ErrorKind::InvalidTable`].
pub fn table_from_json(s: &str) -> Result<ShardTable> {
    let json_err = |what: &str, e: serde_json::Error| {
        Error::new(ErrorKind::Decode, format!("{what}: {e}")).with_source(e)
    };
    let env: JsonIn = serde_json::from_str(s).map_err(|e| json_err("bad shard-table JSON", e))?;
    if env.schema_version != u64::from(SCHEMA_VERSION) {
        return Err(Error::new(
            ErrorKind::Decode,
            format!(
                "shard-table schema version {} found, this build supports version \
                 {SCHEMA_VERSION} only",
                env.schema_version
            ),
        ));
    }
    let table: ShardTable =
        serde_json::from_value(env.table).map_err(|e| json_err("bad shard table in JSON", e))?;
    let owner = table.publisher.rank;
    if let Some(t) = table.tensors.iter().find(|t| t.name.len() > MAX_NAME_LEN) {
        return Err(Error::new(
            ErrorKind::Decode,
            format!(
                "tensor name is {} bytes long, the limit is {MAX_NAME_LEN}",
                t.name.len()
            ),
        )
        .with_owner(owner));
    }
    table.validate().map_err(|e| e.with_owner(owner))?;
    Ok(table)
}
