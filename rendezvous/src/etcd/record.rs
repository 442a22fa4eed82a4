//! The member record, `members/<rank>`: JSON, written last so that a record that says ready
//! implies its blobs are there.

use etcd_client::PutOptions;
use serde::{Deserialize, Serialize};

use reshard_core::{Error, ErrorKind, OwnerId, Result};

use super::blobs::BlobRef;
use super::keys::member_key;
use super::Etcd;

/// A member record: what `members/<rank>` holds.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Record {
    pub(super) rank: OwnerId,
    pub(super) world: u32,
    pub(super) step: u64,
    pub(super) ready: bool,
    pub(super) transport: String,
    pub(super) incarnation: u64,
    pub(super) granted_unix_ms: u64,
    pub(super) table: BlobRef,
    pub(super) metadata: BlobRef,
    pub(super) config: BlobRef,
    /// The publisher's status line (`Announced::set_note`). Optional both ways: records
    /// without it parse (as written before it existed), and readers that predate it ignore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) note: Option<String>,
}

impl Etcd {
    /// Writes `record` as its rank's member record, attached to `lease`.
    pub(super) async fn put_record(&self, model: &str, record: &Record, lease: i64) -> Result<()> {
        let value = serde_json::to_vec(record)
            .map_err(|e| Error::new(ErrorKind::Internal, format!("member record to JSON: {e}")))?;
        self.client
            .clone()
            .put(
                member_key(model, record.rank),
                value,
                Some(PutOptions::new().with_lease(lease)),
            )
            .await
            .map_err(|e| self.err("write a member record to", e))?;
        Ok(())
    }
}

/// The record `value` of key `key`, or a `Decode` error naming both.
pub(super) fn parse_record(model: &str, key: &[u8], value: &[u8]) -> Result<Record> {
    serde_json::from_slice(value).map_err(|e| {
        Error::new(
            ErrorKind::Decode,
            format!(
                "member record {} of model {model:?} is not a reshard record: {e}",
                String::from_utf8_lossy(key)
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_note_is_optional_both_ways() {
        // A record as written before notes existed.
        let old = br#"{"rank":1,"world":2,"step":3,"ready":true,"transport":"ucx",
            "incarnation":4,"granted_unix_ms":5,
            "table":{"prefix":"t","chunks":1,"bytes":9,"xxh3":0},
            "metadata":{"prefix":"m","chunks":1,"bytes":9,"xxh3":0},
            "config":{"prefix":"c","chunks":1,"bytes":9,"xxh3":0}}"#;
        let mut r = parse_record("q", b"k", old).unwrap();
        assert_eq!(r.note, None);
        // Without a note nothing new is written, so older readers see the same record.
        let v: serde_json::Value = serde_json::to_value(&r).unwrap();
        assert!(v.get("note").is_none(), "{v}");
        r.note = Some("refused step 4".into());
        let back = parse_record("q", b"k", &serde_json::to_vec(&r).unwrap()).unwrap();
        assert_eq!(back.note.as_deref(), Some("refused step 4"));
    }
}
