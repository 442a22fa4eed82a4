//! Metadata an endpoint exports and its peers load: NIXL's own agent metadata inside a small
//! versioned envelope that also lists reshard's regions.
//!
//! Layout (little endian): the shared header ([`reshard_core::metadata::MetaHeader`]: magic
//! `RSNX`, version `u8`, agent name (`u16` length + UTF-8), incarnation `u64`, which must be
//! [`incarnation_of`] the NIXL name), NIXL agent name (`u16` length + UTF-8), region count `u32`, then per region `id u64, addr u64,
//! len u64, kind u8 (0 DRAM, 1 VRAM), device u32`, then the NIXL metadata (`u32` length +
//! bytes), then an XXH3-64 checksum of everything before it. Decoding treats the bytes as
//! untrusted: every length is checked before it is used and nothing is allocated beyond what
//! the input itself holds. The checksum matters because NIXL's own metadata parser is not
//! robust against damaged input (garbled bytes can crash it), so damage must be caught here;
//! it is no defence against a forged blob, which peers on a trusted network do not send.

use bytes::{BufMut, Bytes, BytesMut};
use reshard_core::encoding::ByteReader;
use reshard_core::metadata::{self, MetaDefect, MetaHeader};
use reshard_core::{MemoryKind, Result};
use twox_hash::XxHash3_64;

const MAGIC: [u8; 4] = *b"RSNX";
/// Version this build writes and reads (2: the shared header, with the incarnation).
pub(crate) const VERSION: u8 = 2;

/// The incarnation of the endpoint whose NIXL agent has this name: names are unique per
/// endpoint creation, so the name already identifies the incarnation.
pub(crate) fn incarnation_of(nixl_name: &str) -> u64 {
    XxHash3_64::oneshot(nixl_name.as_bytes()).max(1)
}
const REGION_BYTES: usize = 8 + 8 + 8 + 1 + 4;

/// One registered region as a peer sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RegionMeta {
    pub(crate) id: u64,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) kind: MemoryKind,
}

/// What a peer needs to read an endpoint's regions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AgentMeta {
    /// reshard's agent name (for messages).
    pub(crate) agent: String,
    /// The unique name NIXL knows the agent by.
    pub(crate) nixl_name: String,
    /// Regions, ascending by id.
    pub(crate) regions: Vec<RegionMeta>,
    /// `nixlAgent::getLocalMD` output.
    pub(crate) nixl_md: Vec<u8>,
}

/// The defects only this format can have (the shared ones are [`MetaDefect`]'s).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum NixlDefect {
    #[error("agent name is not UTF-8, is empty or holds a NUL")]
    Name,
    #[error("incarnation {0:#x} is not the one the NIXL agent name stands for")]
    Incarnation(u64),
    #[error("the NIXL metadata is empty")]
    EmptyNixl,
    #[error("checksum mismatch (damaged metadata)")]
    Checksum,
}

/// Why a blob could not be decoded (kept as the source of the public `Decode` error).
pub(crate) type MetaError = MetaDefect<NixlDefect>;

impl AgentMeta {
    /// Encodes; names are at most `u16::MAX` bytes (checked when the endpoint is created).
    pub(crate) fn encode(&self) -> Bytes {
        let header = MetaHeader {
            magic: MAGIC,
            version: VERSION,
            agent: self.agent.clone(),
            incarnation: incarnation_of(&self.nixl_name),
        };
        let n = self.nixl_name.as_bytes();
        let mut b = BytesMut::with_capacity(
            header.encoded_len()
                + 2
                + n.len()
                + 4
                + REGION_BYTES * self.regions.len()
                + 4
                + self.nixl_md.len()
                + 8,
        );
        header.encode_into(&mut b);
        b.put_u16_le(n.len() as u16);
        b.put_slice(n);
        b.put_u32_le(self.regions.len() as u32);
        for r in &self.regions {
            b.put_u64_le(r.id);
            b.put_u64_le(r.addr);
            b.put_u64_le(r.len);
            let (tag, device) = metadata::encode_kind(r.kind);
            b.put_u8(tag);
            b.put_u32_le(device);
        }
        b.put_u32_le(self.nixl_md.len() as u32);
        b.put_slice(&self.nixl_md);
        let sum = XxHash3_64::oneshot(&b);
        b.put_u64_le(sum);
        b.freeze()
    }

    /// Decodes untrusted bytes; any defect is a `Decode` error.
    pub(crate) fn decode(bytes: &[u8]) -> Result<AgentMeta> {
        Self::try_decode(bytes).map_err(|e| e.into_error(crate::SCHEME))
    }

    pub(crate) fn try_decode(bytes: &[u8]) -> Result<AgentMeta, MetaError> {
        let mut r = ByteReader::new(bytes);
        let header = MetaHeader::decode(&mut r, MAGIC, VERSION)?;
        if header.agent.contains('\0') {
            return Err(MetaDefect::Backend(NixlDefect::Name));
        }
        // Verify the checksum before parsing anything past the header (which is ours and
        // parsed defensively): NIXL's own parser must never see damaged bytes.
        r.ensure(8)?;
        let body = bytes.len() - 8;
        let mut sum = [0u8; 8];
        sum.copy_from_slice(&bytes[body..]);
        if XxHash3_64::oneshot(&bytes[..body]) != u64::from_le_bytes(sum) {
            return Err(MetaDefect::Backend(NixlDefect::Checksum));
        }
        let bytes = &bytes[..body];
        // Go on over the checksummed body only, from where the header ended.
        let at = r.at();
        let mut r = ByteReader::new(bytes);
        r.take(at)?;
        let nixl_name = read_name(&mut r)?;
        if header.incarnation != incarnation_of(&nixl_name) {
            return Err(MetaDefect::Backend(NixlDefect::Incarnation(
                header.incarnation,
            )));
        }
        let count = metadata::read_region_count(&mut r, REGION_BYTES)?;
        let mut regions = Vec::with_capacity(count);
        for _ in 0..count {
            let id = r.u64()?;
            let addr = r.u64()?;
            let len = r.u64()?;
            let tag = r.take(1)?[0];
            let device = u32::from_le_bytes(r.array()?);
            let kind =
                metadata::decode_kind(tag, device).ok_or(MetaDefect::Kind { region: id, tag })?;
            if addr.checked_add(len).is_none() {
                return Err(MetaDefect::Range {
                    region: id,
                    addr,
                    len,
                });
            }
            regions.push(RegionMeta {
                id,
                addr,
                len,
                kind,
            });
        }
        metadata::sort_regions(&mut regions, |r| r.id).map_err(MetaDefect::DuplicateRegion)?;
        let md_len = u32::from_le_bytes(r.array()?) as usize;
        let nixl_md = r.take(md_len)?.to_vec();
        if nixl_md.is_empty() {
            return Err(MetaDefect::Backend(NixlDefect::EmptyNixl));
        }
        metadata::refuse_trailing(&r, 0)?;
        Ok(AgentMeta {
            agent: header.agent,
            nixl_name,
            regions,
            nixl_md,
        })
    }
}

/// A u16-length-prefixed UTF-8 name.
fn read_name(r: &mut ByteReader<'_>) -> Result<String, MetaError> {
    let len = u16::from_le_bytes(r.array()?) as usize;
    let s = std::str::from_utf8(r.take(len)?).map_err(|_| MetaDefect::Backend(NixlDefect::Name))?;
    if s.is_empty() || s.contains('\0') {
        return Err(MetaDefect::Backend(NixlDefect::Name));
    }
    Ok(s.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AgentMeta {
        AgentMeta {
            agent: "publisher-ä".into(),
            nixl_name: "publisher-ä@1.2".into(),
            regions: vec![
                RegionMeta {
                    id: 1,
                    addr: 0x1000,
                    len: 4096,
                    kind: MemoryKind::Dram,
                },
                RegionMeta {
                    id: 2,
                    addr: 0x7f00_0000,
                    len: 0,
                    kind: MemoryKind::Vram { device: 3 },
                },
            ],
            nixl_md: vec![9, 8, 7, 6],
        }
    }

    /// Recomputes the checksum after a test edited the bytes.
    fn reseal(v: &mut [u8]) {
        let n = v.len() - 8;
        let sum = XxHash3_64::oneshot(&v[..n]);
        v[n..].copy_from_slice(&sum.to_le_bytes());
    }

    #[test]
    fn every_flipped_bit_is_a_decode_error() {
        let full = sample().encode();
        for at in 5..full.len() {
            let mut v = full.to_vec();
            v[at] ^= 0x10;
            assert!(AgentMeta::decode(&v).is_err(), "flip at {at}");
        }
    }

    #[test]
    fn bad_fields_are_named() {
        let full = sample().encode().to_vec();
        let m = sample();
        let incarnation_at = 4 + 1 + 2 + m.agent.len();
        let mut v = full.clone();
        v[incarnation_at] ^= 1;
        reseal(&mut v);
        assert!(matches!(
            AgentMeta::try_decode(&v),
            Err(MetaDefect::Backend(NixlDefect::Incarnation(_)))
        ));
        let count_at = incarnation_at + 8 + 2 + m.nixl_name.len();
        let mut v = full.clone();
        v[count_at..count_at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        reseal(&mut v);
        assert!(matches!(
            AgentMeta::try_decode(&v),
            Err(MetaDefect::Truncated(_))
        ));
        let kind_at = count_at + 4 + 24;
        let mut v = full.clone();
        v[kind_at] = 7;
        reseal(&mut v);
        assert_eq!(
            AgentMeta::try_decode(&v),
            Err(MetaDefect::Kind { region: 1, tag: 7 })
        );
        let mut m = sample();
        m.regions[1].id = 1;
        assert_eq!(
            AgentMeta::try_decode(&m.encode()),
            Err(MetaDefect::DuplicateRegion(1))
        );
        let mut m = sample();
        m.regions[0].addr = u64::MAX;
        assert!(matches!(
            AgentMeta::try_decode(&m.encode()),
            Err(MetaDefect::Range { region: 1, .. })
        ));
        let mut m = sample();
        m.agent = "pub\0lisher".into();
        assert_eq!(
            AgentMeta::try_decode(&m.encode()),
            Err(MetaDefect::Backend(NixlDefect::Name))
        );
        let mut v = full;
        v[10] ^= 1;
        assert_eq!(
            AgentMeta::try_decode(&v),
            Err(MetaDefect::Backend(NixlDefect::Checksum))
        );
    }

    reshard_core::metadata_tests!(
        ty: AgentMeta,
        backend: crate::SCHEME,
        sample: sample(),
        // One byte more inside the sealed body (before the checksum), sealed again.
        extend: |v| {
            v.insert(v.len() - 8, 0);
            reseal(v);
        },
        reseal: |v| reseal(v),
        // The seed is the body without its checksum (the fuzz target appends one);
        // `UPDATE_SEEDS=1 cargo test -p reshard-backend-nixl seed` rewrites it after a format
        // change.
        seed: {
            path: "fuzz/corpus/nixl_metadata/seed-body-two-regions",
            value: AgentMeta {
                agent: "pub-0".into(),
                nixl_name: "pub-0@1.2".into(),
                regions: vec![
                    RegionMeta {
                        id: 1,
                        addr: 0x1000,
                        len: 4096,
                        kind: MemoryKind::Dram,
                    },
                    RegionMeta {
                        id: 2,
                        addr: 0x7f00_0000,
                        len: 64,
                        kind: MemoryKind::Vram { device: 3 },
                    },
                ],
                nixl_md: b"nixl".to_vec(),
            },
            stored: |b| &b[..b.len() - 8],
        },
    );
}
