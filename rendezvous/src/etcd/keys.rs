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

/// Where one blob of a rank's lease lies, its chunks numbered below it. Blobs are keyed by lease, not incarnation: when an old lease of a restarted rank expires, it
/// deletes only its own keys.
pub(super) fn blob_prefix(model: &str, rank: OwnerId, lease: i64, name: &str) -> String {
    format!("{}blobs/{rank:08}/{lease:x}/{name}/", model_prefix(model))
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
}
