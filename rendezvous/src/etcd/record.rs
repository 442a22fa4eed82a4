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
