//! Metadata an agent exports and its peers load: a small versioned binary blob.
//!
//! Layout (little endian): the shared header ([`reshard_core::metadata::MetaHeader`]: magic
//! `RSLB`, version `u8`, name length `u16` + UTF-8 name, agent uid `u64` as the incarnation),
//! fabric id `u64`, region count `u32`, then `(id u64, len u64)` per region. Decoding treats the bytes as untrusted: every length is checked before it is used and
//! nothing is allocated beyond what the input itself holds.

use bytes::{BufMut, Bytes, BytesMut};
use reshard_core::encoding::ByteReader;
use reshard_core::metadata::{self, MetaDefect, MetaHeader};
use reshard_core::Result;

const MAGIC: [u8; 4] = *b"RSLB";
/// 2: the shared header (name before the agent uid, the fabric id after them).
const VERSION: u8 = 2;

/// What a peer needs to read an agent's regions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AgentMeta {
    pub(crate) fabric: u64,
    pub(crate) agent_uid: u64,
    pub(crate) agent: String,
    /// `(region id, length)`, ascending by id.
    pub(crate) regions: Vec<(u64, u64)>,
}

impl AgentMeta {
    pub(crate) fn encode(&self) -> Bytes {
        let header = MetaHeader {
            magic: MAGIC,
            version: VERSION,
            agent: self.agent.clone(),
            incarnation: self.agent_uid,
        };
        let mut b = BytesMut::with_capacity(header.encoded_len() + 8 + 4 + 16 * self.regions.len());
        header.encode_into(&mut b);
        b.put_u64_le(self.fabric);
        b.put_u32_le(self.regions.len() as u32);
        for &(id, len) in &self.regions {
            b.put_u64_le(id);
            b.put_u64_le(len);
        }
        b.freeze()
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<AgentMeta> {
        Self::try_decode(bytes).map_err(|e| e.into_error(crate::SCHEME))
    }

    fn try_decode(bytes: &[u8]) -> Result<AgentMeta, MetaDefect> {
        let mut r = ByteReader::new(bytes);
        let MetaHeader {
            agent,
            incarnation: agent_uid,
            ..
        } = MetaHeader::decode(&mut r, MAGIC, VERSION)?;
        let fabric = r.u64()?;
        let count = metadata::read_region_count(&mut r, 16)?;
        metadata::refuse_trailing(&r, count * 16)?;
        let mut regions = Vec::with_capacity(count);
        for _ in 0..count {
            regions.push((r.u64()?, r.u64()?));
        }
        metadata::sort_regions(&mut regions, |r| r.0).map_err(MetaDefect::DuplicateRegion)?;
        Ok(AgentMeta {
            fabric,
            agent_uid,
            agent,
            regions,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AgentMeta {
        AgentMeta {
            fabric: 0xfeed_beef,
            agent_uid: 7,
            agent: "publisher-ä".into(),
            regions: vec![(1, 4096), (2, 0), (9, u64::MAX)],
        }
    }

    #[test]
    fn bad_fields_are_named() {
        let full = sample().encode().to_vec();
        // A huge region count with few bytes present allocates nothing and fails cleanly.
        let name_len = sample().agent.len();
        let count_at = 4 + 1 + 2 + name_len + 8 + 8;
        let mut v = full;
        v[count_at..count_at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            AgentMeta::try_decode(&v),
            Err(MetaDefect::Truncated(_))
        ));
        let mut m = sample();
        m.regions = vec![(3, 1), (3, 2)];
        assert_eq!(
            AgentMeta::try_decode(&m.encode()),
            Err(MetaDefect::DuplicateRegion(3))
        );
    }

    reshard_core::metadata_tests!(
        ty: AgentMeta,
        backend: crate::SCHEME,
        sample: sample(),
        extend: |v| v.push(0),
        reseal: |_| {},
        // `UPDATE_SEEDS=1 cargo test -p reshard-backend-loopback seed` rewrites it after a
        // format change.
        seed: {
            path: "fuzz/corpus/loopback_metadata/seed-two-regions",
            value: AgentMeta {
                fabric: 0xfeed_beef,
                agent_uid: 7,
                agent: "pub-0".into(),
                regions: vec![(1, 4096), (2, 64)],
            },
            stored: |b| b,
        },
    );
}
