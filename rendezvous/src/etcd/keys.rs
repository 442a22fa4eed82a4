//! The key layout under [`ROOT`] and the escaping that makes a model name one key segment.

use reshard_core::OwnerId;

/// A model name as one key segment: `/` and `%` are percent-escaped (HF names have slashes).
pub(super) fn escape(model: &str) -> String {
    model.replace('%', "%25").replace('/', "%2F")
}

/// The model name [`escape`] made a key segment of.
pub(super) fn unescape(segment: &str) -> String {
    segment.replace("%2F", "/").replace("%25", "%")
}

/// Where every key of this protocol version lies.
pub(super) const ROOT: &str = "/reshard/v1/";

/// Every key of one model.
fn model_prefix(model: &str) -> String {
    format!("{ROOT}{}/", escape(model))
}

/// The member records of one model.
pub(super) fn members_prefix(model: &str) -> String {
    format!("{}members/", model_prefix(model))
}

/// One rank's member record.
pub(super) fn member_key(model: &str, rank: OwnerId) -> String {
    format!("{}{rank:08}", members_prefix(model))
}

/// The rank a member record's key names, if `key` is one of `model`'s member keys: the prefix,
/// then the rank exactly as [`member_key`] spells it (eight digits, zero-padded). Any other
/// spelling of a rank (`members/3`, `members/000000003`) is no member key: were two spellings
/// accepted, one rank could have two records, and a receiver would count it twice
/// (docs/deployment.md, "etcd keys").
pub(super) fn member_rank(model: &str, key: &[u8]) -> Option<OwnerId> {
    let digits = key.strip_prefix(members_prefix(model).as_bytes())?;
    if digits.is_empty() || digits.len() > 10 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let rank: OwnerId = std::str::from_utf8(digits).ok()?.parse().ok()?;
    // The one canonical spelling: what `member_key` writes for this rank, byte for byte.
    (format!("{rank:08}").as_bytes() == digits).then_some(rank)
}

/// Where a claimant of rank `rank` asks the rank's holder whether it lives, and the holder
/// answers (docs/deployment.md, "One holder per rank").
pub(super) fn probe_key(model: &str, rank: OwnerId) -> String {
    format!("{}probes/{rank:08}", model_prefix(model))
}

/// The reading claims of one model (the reader fence).
pub(super) fn readers_prefix(model: &str) -> String {
    format!("{}readers/", model_prefix(model))
}

/// One reading claim: the `n`th under the reader's `lease`.
pub(super) fn reader_key(model: &str, lease: i64, n: u64) -> String {
    format!("{}{lease:x}-{n}", readers_prefix(model))
}

/// Every blob of one rank lies below this prefix, whatever its lease.
pub(super) fn blob_root(model: &str, rank: OwnerId) -> String {
    format!("{}blobs/{rank:08}/", model_prefix(model))
}

/// Where one blob of a rank's lease lies, its chunks numbered below it. Blobs are keyed by
/// lease, not incarnation: when an old lease of a restarted rank expires, it deletes only its
/// own keys.
pub(super) fn blob_prefix(model: &str, rank: OwnerId, lease: i64, name: &str) -> String {
    format!("{}{lease:x}/{name}/", blob_root(model, rank))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_with_slashes_are_one_key_segment() {
        for name in ["Qwen/Qwen3-30B-A3B", "a%2Fb", "plain"] {
            let e = escape(name);
            assert!(!e.contains('/'), "{e}");
            assert_eq!(unescape(&e), name);
        }
        assert_eq!(
            member_key("Qwen/Q", 7),
            "/reshard/v1/Qwen%2FQ/members/00000007"
        );
    }

    #[test]
    fn a_member_key_gives_back_its_rank_and_nothing_else_does() {
        for rank in [0, 7, 99_999_999, u32::MAX] {
            assert_eq!(
                member_rank("m/x", member_key("m/x", rank).as_bytes()),
                Some(rank)
            );
        }
        let prefix = members_prefix("m");
        for bad in [
            prefix.clone(),
            format!("{prefix}12a"),
            format!("{prefix}+1"),
            format!("{prefix}4294967296"),
            format!("{prefix}00000000000"),
            member_key("other", 1),
            // Other spellings of a rank that has a canonical key: never a second member key.
            format!("{prefix}3"),
            format!("{prefix}0000003"),
            format!("{prefix}000000003"),
            format!("{prefix}0"),
            format!("{prefix}0123456789"),
        ] {
            assert_eq!(member_rank("m", bad.as_bytes()), None, "{bad}");
        }
        assert!(blob_prefix("m", 3, 0x1f, "table").starts_with(&blob_root("m", 3)));
    }
}
