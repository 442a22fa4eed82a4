//! The member record, `members/<rank>`, and the blob references it carries: JSON, written last
//! so that a record that says ready implies its blobs are there.
//!
//! A record comes from another process through etcd, so every count and size in it is checked
//! against the key it was read under, the rest of the record and absolute limits before anything
//! is sized from it (docs/bad-input.md, "Rendezvous records"). This file is pure decoding, with
//! no etcd client, so the fuzz target `etcd_member_record` compiles it unchanged.

use std::collections::BTreeSet;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use reshard_core::rendezvous::MAX_WORLD;
use reshard_core::{Error, ErrorKind, OwnerId, Result};

use super::keys::{blob_root, member_rank};

/// Largest value one blob chunk holds: well under etcd's default 1.5 MiB request limit, with
/// room for the key and the gRPC framing.
pub const CHUNK_BYTES: usize = 512 * 1024;

/// Most bytes one blob may declare. A blob this size is 2,048 chunks, far beyond what etcd
/// should carry per publisher (docs/deployment.md, "Traffic at scale": the table of an EP8 rank
/// of full-size Qwen3-30B-A3B is 0.46 MB); the limit bounds the requests one record can make a
/// receiver send.
pub const MAX_BLOB_BYTES: u64 = 1 << 30;

/// Longest transport scheme name a record may carry (the registry's are a few letters).
pub const MAX_TRANSPORT_LEN: usize = 64;

/// Longest holder host name a record may carry (a DNS name is at most 253 bytes).
pub const MAX_HOST_LEN: usize = 255;

/// Where a blob's chunks are and what they must add up to.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct BlobRef {
    pub(super) prefix: String,
    pub(super) chunks: u32,
    pub(super) bytes: u64,
    pub(super) xxh3: u64,
}

/// A member record: what `members/<rank>` holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Record {
    pub(super) rank: OwnerId,
    pub(super) world: u32,
    pub(super) step: u64,
    pub(super) ready: bool,
    pub(super) transport: String,
    pub(super) incarnation: u64,
    /// Host name of the process holding the rank (`reshard status`, and the error a second
    /// claimant of the rank exits with). Empty in records written before holders were named.
    #[serde(default)]
    pub(super) host: String,
    /// Process id of the holder on `host` (0 in records written before holders were named).
    #[serde(default)]
    pub(super) pid: u32,
    pub(super) granted_unix_ms: u64,
    pub(super) table: BlobRef,
    pub(super) metadata: BlobRef,
    pub(super) config: BlobRef,
    /// The publisher's status line (`Announced::set_note`). Optional both ways: records
    /// without it parse (as written before it existed), and readers that predate it ignore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) note: Option<String>,
}

/// The record `value` of key `key`, decoded and checked (see [`Record::check`]), or a `Decode`
/// error naming the key and the field that is wrong, with the key's rank as owner when the key
/// names one.
pub(super) fn parse_record(model: &str, key: &[u8], value: &[u8]) -> Result<Record> {
    let shown = String::from_utf8_lossy(key);
    let Some(key_rank) = member_rank(model, key) else {
        return Err(Error::new(
            ErrorKind::Decode,
            format!(
                "key {shown} under the members of model {model:?} names no publisher rank (a \
                 member key is the rank in eight digits, as members/00000003; another spelling \
                 never counts)"
            ),
        ));
    };
    let record: Record = serde_json::from_slice(value).map_err(|e| {
        Error::new(
            ErrorKind::Decode,
            format!("member record {shown} of model {model:?} is not a reshard record: {e}"),
        )
        .with_owner(key_rank)
    })?;
    record.check(model, key_rank).map_err(|(field, why)| {
        Error::new(
            ErrorKind::Decode,
            format!("member record {shown} of model {model:?}: field `{field}` {why}"),
        )
        .with_owner(key_rank)
    })?;
    Ok(record)
}

impl Record {
    /// Checks every count and size against the rank `key_rank` its key names, the rest of the
    /// record and the absolute limits, before anything is allocated or looped over from them;
    /// returns the first field out of bounds (as a JSON path) and why. Publishers run it on the
    /// record they write, so a limit fails where it can be fixed.
    pub(super) fn check(
        &self,
        model: &str,
        key_rank: OwnerId,
    ) -> std::result::Result<(), (String, String)> {
        let field = |name: &str, why: String| Err((name.to_string(), why));
        if self.world == 0 || self.world > MAX_WORLD {
            return field(
                "world",
                format!("= {} is outside 1..={MAX_WORLD}", self.world),
            );
        }
        if self.rank != key_rank {
            return field(
                "rank",
                format!(
                    "= {} differs from the rank {key_rank} of its key",
                    self.rank
                ),
            );
        }
        if self.rank >= self.world {
            return field(
                "rank",
                format!(
                    "= {} is outside its world of {} ranks",
                    self.rank, self.world
                ),
            );
        }
        if self.transport.is_empty() || self.transport.len() > MAX_TRANSPORT_LEN {
            return field(
                "transport",
                format!(
                    "is {} bytes long, outside 1..={MAX_TRANSPORT_LEN}",
                    self.transport.len()
                ),
            );
        }
        if self.host.len() > MAX_HOST_LEN {
            return field(
                "host",
                format!(
                    "is {} bytes long, above the limit of {MAX_HOST_LEN}",
                    self.host.len()
                ),
            );
        }
        let root = blob_root(model, self.rank);
        for (name, blob) in [
            ("table", &self.table),
            ("metadata", &self.metadata),
            ("config", &self.config),
        ] {
            blob.check(&root)
                .map_err(|(field, why)| (format!("{name}.{field}"), why))?;
        }
        Ok(())
    }
}

impl BlobRef {
    /// Checks the blob's size against [`MAX_BLOB_BYTES`], its chunk count against its size (the
    /// writer's rule: `ceil(bytes / CHUNK_BYTES)` chunks, so a count never asks for more
    /// requests than the size needs), and that its chunks lie below `root`, its rank's blobs.
    fn check(&self, root: &str) -> std::result::Result<(), (&'static str, String)> {
        if self.bytes > MAX_BLOB_BYTES {
            return Err((
                "bytes",
                format!("= {} is above the limit of {MAX_BLOB_BYTES}", self.bytes),
            ));
        }
        let expected = self.bytes.div_ceil(CHUNK_BYTES as u64);
        if u64::from(self.chunks) != expected {
            return Err((
                "chunks",
                format!(
                    "= {} does not match its {} bytes in chunks of {CHUNK_BYTES} (expected {expected})",
                    self.chunks, self.bytes
                ),
            ));
        }
        let below_root = self
            .prefix
            .strip_prefix(root)
            .is_some_and(|rest| !rest.is_empty() && rest.ends_with('/'));
        if !below_root {
            return Err((
                "prefix",
                format!("{:?} does not lie below {root:?}", self.prefix),
            ));
        }
        Ok(())
    }

    /// The blob from its chunks as read (`(chunk index, value)`, in any order), checked to be
    /// exactly chunks `0..self.chunks` adding up to the recorded size and hash. The output is
    /// sized from the bytes that arrived, never from the record.
    pub(super) fn assemble(&self, mut parts: Vec<(u32, Vec<u8>)>, rank: OwnerId) -> Result<Bytes> {
        let wrong = |what: String| {
            Error::new(
                ErrorKind::Decode,
                format!(
                    "publisher rank {rank}'s blob {} does not match its record ({} chunks, {} \
                     bytes, xxh3 {:016x}): {what}",
                    self.prefix, self.chunks, self.bytes, self.xxh3
                ),
            )
            .with_owner(rank)
        };
        parts.sort_unstable_by_key(|(i, _)| *i);
        let indices: BTreeSet<u32> = parts.iter().map(|(i, _)| *i).collect();
        if indices.len() != parts.len() || parts.len() as u64 != u64::from(self.chunks) {
            return Err(wrong(format!(
                "read {} chunks ({} distinct)",
                parts.len(),
                indices.len()
            )));
        }
        if let Some(&(i, _)) = parts.iter().find(|(i, _)| *i >= self.chunks) {
            return Err(wrong(format!("read chunk {i}")));
        }
        let arrived = parts
            .iter()
            .fold(0u64, |n, (_, c)| n.saturating_add(c.len() as u64));
        if arrived != self.bytes {
            return Err(wrong(format!("read {arrived} bytes")));
        }
        let mut out = Vec::with_capacity(arrived as usize);
        for (_, chunk) in &parts {
            out.extend_from_slice(chunk);
        }
        if twox_hash::XxHash3_64::oneshot(&out) != self.xxh3 {
            return Err(wrong(format!(
                "read bytes of xxh3 {:016x}",
                twox_hash::XxHash3_64::oneshot(&out)
            )));
        }
        Ok(Bytes::from(out))
    }
}

#[cfg(test)]
mod tests {
    use super::super::keys::{blob_prefix, member_key};
    use super::*;

    const MODEL: &str = "Qwen/Q";

    fn blob(name: &str, content: &[u8]) -> BlobRef {
        BlobRef {
            prefix: blob_prefix(MODEL, 3, 0x2a, name),
            chunks: content.len().div_ceil(CHUNK_BYTES) as u32,
            bytes: content.len() as u64,
            xxh3: twox_hash::XxHash3_64::oneshot(content),
        }
    }

    /// Rank 3 of 4, as a publisher writes it.
    fn good() -> Record {
        Record {
            rank: 3,
            world: 4,
            step: 9,
            ready: true,
            transport: "ucx".into(),
            incarnation: 77,
            host: "trainer-3".into(),
            pid: 4242,
            granted_unix_ms: 1,
            table: blob("table-9", &[1; CHUNK_BYTES + 1]),
            metadata: blob("metadata", b"meta"),
            config: blob("config", b""),
            note: None,
        }
    }

    fn parse(r: &serde_json::Value) -> Result<Record> {
        let value = serde_json::to_vec(r).unwrap();
        parse_record(MODEL, member_key(MODEL, 3).as_bytes(), &value)
    }

    /// The field a refused record's error names, after checking it is a `Decode` error owned by
    /// the key's rank.
    fn refused_field(r: &serde_json::Value) -> String {
        let e = parse(r).expect_err("refused");
        assert_eq!(
            (e.kind(), e.context().owner),
            (ErrorKind::Decode, Some(3)),
            "{e}"
        );
        let msg = e.message();
        let start = msg.find("field `").expect("names a field") + "field `".len();
        msg[start..start + msg[start..].find('`').unwrap()].to_string()
    }

    #[test]
    fn a_record_as_publishers_write_it_parses_back() {
        let r = good();
        assert_eq!(parse(&serde_json::to_value(&r).unwrap()).unwrap(), r);
        assert_eq!(r.table.chunks, 2);
    }

    #[test]
    fn every_count_and_size_out_of_bounds_is_refused_naming_its_field() {
        let root = blob_root(MODEL, 3);
        let cases: Vec<(&str, serde_json::Value)> = vec![
            ("world", serde_json::json!(0)),
            ("world", serde_json::json!(u32::MAX)),
            ("world", serde_json::json!(MAX_WORLD + 1)),
            ("rank", serde_json::json!(5)),
            ("rank", serde_json::json!(2)),
            ("transport", serde_json::json!("")),
            ("host", serde_json::json!("h".repeat(MAX_HOST_LEN + 1))),
            (
                "transport",
                serde_json::json!("x".repeat(MAX_TRANSPORT_LEN + 1)),
            ),
            ("table.bytes", serde_json::json!(u64::MAX)),
            ("table.bytes", serde_json::json!(MAX_BLOB_BYTES + 1)),
            ("table.chunks", serde_json::json!(u32::MAX)),
            ("table.chunks", serde_json::json!(0)),
            ("metadata.chunks", serde_json::json!(2)),
            ("config.chunks", serde_json::json!(1)),
            ("table.prefix", serde_json::json!("")),
            ("metadata.prefix", serde_json::json!("/reshard/v1/")),
            ("config.prefix", serde_json::json!(root)),
            (
                "table.prefix",
                serde_json::json!(blob_prefix(MODEL, 2, 0x2a, "table-9")),
            ),
        ];
        for (field, value) in cases {
            let mut r = serde_json::to_value(good()).unwrap();
            let mut at = &mut r;
            for part in field.split('.') {
                at = &mut at[part];
            }
            *at = value.clone();
            // A world of 0 or above the limit is refused as the world, before any rank check.
            assert_eq!(refused_field(&r), field, "{field} = {value}");
        }
        // A consistent but huge size: the size is refused, not its (matching) chunk count.
        let mut r = good();
        r.table.bytes = MAX_BLOB_BYTES + 1;
        r.table.chunks = r.table.bytes.div_ceil(CHUNK_BYTES as u64) as u32;
        assert_eq!(
            refused_field(&serde_json::to_value(&r).unwrap()),
            "table.bytes"
        );
        // The rank must be the key's, and inside the world.
        let mut r = good();
        r.world = 3;
        assert_eq!(refused_field(&serde_json::to_value(&r).unwrap()), "rank");
    }

    #[test]
    fn bytes_that_are_no_record_or_a_key_that_is_no_rank_are_decode_errors() {
        let key = member_key(MODEL, 3);
        for value in [&b"garbage"[..], b"{}", b"[1,2]", br#"{"rank":-1}"#, b""] {
            let e = parse_record(MODEL, key.as_bytes(), value).unwrap_err();
            assert_eq!(
                (e.kind(), e.context().owner),
                (ErrorKind::Decode, Some(3)),
                "{e}"
            );
        }
        let value = serde_json::to_vec(&good()).unwrap();
        let e = parse_record(MODEL, b"/reshard/v1/Qwen%2FQ/members/x", &value).unwrap_err();
        assert_eq!(
            (e.kind(), e.context().owner),
            (ErrorKind::Decode, None),
            "{e}"
        );
    }

    #[test]
    fn a_blob_assembles_only_from_exactly_its_chunks() {
        let content: Vec<u8> = (0..CHUNK_BYTES * 2 + 5).map(|i| i as u8).collect();
        let b = blob("table-9", &content);
        let parts = |order: &[u32]| -> Vec<(u32, Vec<u8>)> {
            order
                .iter()
                .map(|&i| {
                    let start = (i as usize * CHUNK_BYTES).min(content.len());
                    let end = (start + CHUNK_BYTES).min(content.len());
                    (i, content[start..end].to_vec())
                })
                .collect()
        };
        assert_eq!(b.assemble(parts(&[2, 0, 1]), 3).unwrap(), content);
        for bad in [
            parts(&[0, 1]),
            parts(&[0, 1, 1]),
            parts(&[0, 1, 3]),
            parts(&[0, 1, 2, 3]),
        ] {
            let e = b.assemble(bad, 3).unwrap_err();
            assert_eq!(
                (e.kind(), e.context().owner),
                (ErrorKind::Decode, Some(3)),
                "{e}"
            );
        }
        let mut flipped = parts(&[0, 1, 2]);
        flipped[1].1[7] ^= 1;
        assert_eq!(
            b.assemble(flipped, 3).unwrap_err().kind(),
            ErrorKind::Decode
        );
        let mut long = parts(&[0, 1, 2]);
        long[2].1.push(0);
        assert_eq!(b.assemble(long, 3).unwrap_err().kind(), ErrorKind::Decode);
        // Every byte present and the hash right, but under the wrong chunk number: refused.
        let mut renumbered = parts(&[0, 1, 2]);
        renumbered[2].0 = 3;
        assert_eq!(
            b.assemble(renumbered, 3).unwrap_err().kind(),
            ErrorKind::Decode
        );
        // Two equal chunks: chunk 0 read twice matches the bytes and the hash of 0 and 1.
        let twice = blob("table-9", &[5; 2 * CHUNK_BYTES]);
        let zero_twice = vec![(0, vec![5; CHUNK_BYTES]), (0, vec![5; CHUNK_BYTES])];
        assert_eq!(
            twice.assemble(zero_twice, 3).unwrap_err().kind(),
            ErrorKind::Decode
        );
        // Bytes that hash right but are not the size the record declares.
        let mut shorter = blob("metadata", b"meta");
        shorter.bytes = 5;
        let e = shorter
            .assemble(vec![(0, b"meta".to_vec())], 3)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Decode);
    }

    #[test]
    fn a_record_without_a_holder_parses_with_none_named() {
        // As written before holders were named.
        let mut old = serde_json::to_value(good()).unwrap();
        let o = old.as_object_mut().unwrap();
        o.remove("host");
        o.remove("pid");
        let r = parse(&old).unwrap();
        assert_eq!((r.host.as_str(), r.pid), ("", 0));
    }

    #[test]
    fn the_note_is_optional_both_ways() {
        // A record as written before notes existed.
        let mut old = serde_json::to_value(good()).unwrap();
        assert!(old.get("note").is_none(), "no note, nothing written: {old}");
        old.as_object_mut().unwrap().remove("note");
        let mut r = parse(&old).unwrap();
        assert_eq!(r.note, None);
        r.note = Some("refused step 4".into());
        let back = parse(&serde_json::to_value(&r).unwrap()).unwrap();
        assert_eq!(back.note.as_deref(), Some("refused step 4"));
    }
}
