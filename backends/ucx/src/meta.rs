//! Metadata an endpoint exports and its peers load: a versioned binary blob holding the UCP
//! worker address and, per registered region, its id, base address, length, the range its key
//! maps, memory kind and packed remote key.
//!
//! Layout (little endian): the shared header ([`reshard_core::metadata::MetaHeader`]: magic
//! `RSUX`, version `u8`, name length `u16` + UTF-8 agent name, endpoint incarnation `u64`),
//! then address length `u32` + worker address, region count `u32`, then
//! per region `id u64`, `base u64`, `len u64`, `key_base u64`, `key_len u64`, kind `u8` (0 DRAM,
//! 1 VRAM) + device `u32`, key length `u32` + packed key. `key_base..key_base+key_len` is the
//! whole memory the packed key maps (the region itself, or the UCX allocation the region lies
//! in, whose shared segment a peer maps on unpack); it must contain the region. Decoding treats
//! the bytes as untrusted (they come from other processes): every length is checked against the
//! input before it is used, and nothing is allocated beyond what the input holds. The worker
//! address and keys themselves are opaque to us and parsed by UCX.

use bytes::{BufMut, Bytes, BytesMut};
use reshard_core::encoding::ByteReader;
use reshard_core::metadata::{self, MetaDefect, MetaHeader};
use reshard_core::{MemoryKind, Result};

const MAGIC: [u8; 4] = *b"RSUX";
const VERSION: u8 = 3;
/// Fixed bytes of one region entry (everything but the key bytes).
const REGION_FIXED: usize = 8 + 8 + 8 + 8 + 8 + 1 + 4 + 4;

/// One region as a peer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RegionMeta {
    pub(crate) id: u64,
    /// Address of the region's first byte in its owner's address space.
    pub(crate) base: u64,
    pub(crate) len: u64,
    /// First byte of the memory the packed key maps, in the owner's address space.
    pub(crate) key_base: u64,
    /// Bytes the packed key maps: the real size behind the key, which contains the region.
    pub(crate) key_len: u64,
    pub(crate) kind: MemoryKind,
    /// `ucp_rkey_pack` output (empty for zero-length regions, which are never mapped).
    pub(crate) rkey: Vec<u8>,
}

/// What a peer needs to read an endpoint's regions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EndpointMeta {
    pub(crate) agent: String,
    /// The exporting endpoint's incarnation (`Transport::incarnation`).
    pub(crate) incarnation: u64,
    pub(crate) worker_address: Vec<u8>,
    /// Ascending by id, ids unique.
    pub(crate) regions: Vec<RegionMeta>,
}

/// The defects only this format can have (the shared ones are [`MetaDefect`]'s).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum UcxDefect {
    #[error("empty worker address")]
    EmptyAddress,
    #[error("region {0}: base + length overflows")]
    Overflow(u64),
    #[error("region {0}: not inside the memory its key maps")]
    OutsideKey(u64),
    #[error("region {0}: non-empty region without a remote key")]
    MissingKey(u64),
}

/// Why a blob could not be decoded (kept as the source of the public `Decode` error).
pub(crate) type MetaError = MetaDefect<UcxDefect>;

impl EndpointMeta {
    pub(crate) fn encode(&self) -> Bytes {
        let header = MetaHeader {
            magic: MAGIC,
            version: VERSION,
            agent: self.agent.clone(),
            incarnation: self.incarnation,
        };
        let keys: usize = self.regions.iter().map(|r| r.rkey.len()).sum();
        let mut b = BytesMut::with_capacity(
            header.encoded_len()
                + 4
                + self.worker_address.len()
                + 4
                + REGION_FIXED * self.regions.len()
                + keys,
        );
        header.encode_into(&mut b);
        b.put_u32_le(self.worker_address.len() as u32);
        b.put_slice(&self.worker_address);
        b.put_u32_le(self.regions.len() as u32);
        for r in &self.regions {
            b.put_u64_le(r.id);
            b.put_u64_le(r.base);
            b.put_u64_le(r.len);
            b.put_u64_le(r.key_base);
            b.put_u64_le(r.key_len);
            let (tag, device) = metadata::encode_kind(r.kind);
            b.put_u8(tag);
            b.put_u32_le(device);
            b.put_u32_le(r.rkey.len() as u32);
            b.put_slice(&r.rkey);
        }
        b.freeze()
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<EndpointMeta> {
        Self::try_decode(bytes).map_err(|e| e.into_error(crate::SCHEME))
    }

    fn try_decode(bytes: &[u8]) -> Result<EndpointMeta, MetaError> {
        let mut r = ByteReader::new(bytes);
        let MetaHeader {
            agent, incarnation, ..
        } = MetaHeader::decode(&mut r, MAGIC, VERSION)?;
        let addr_len = r.u32()? as usize;
        let worker_address = r.take(addr_len)?.to_vec();
        if worker_address.is_empty() {
            return Err(MetaDefect::Backend(UcxDefect::EmptyAddress));
        }
        let count = metadata::read_region_count(&mut r, REGION_FIXED)?;
        let mut regions = Vec::with_capacity(count);
        for _ in 0..count {
            let id = r.u64()?;
            let base = r.u64()?;
            let len = r.u64()?;
            let key_base = r.u64()?;
            let key_size = r.u64()?;
            let (tag, device) = (r.take(1)?[0], r.u32()?);
            let kind =
                metadata::decode_kind(tag, device).ok_or(MetaDefect::Kind { region: id, tag })?;
            let key_len = r.u32()? as usize;
            let rkey = r.take(key_len)?.to_vec();
            let (Some(end), Some(key_end)) =
                (base.checked_add(len), key_base.checked_add(key_size))
            else {
                return Err(MetaDefect::Backend(UcxDefect::Overflow(id)));
            };
            if len > 0 && (base < key_base || end > key_end) {
                return Err(MetaDefect::Backend(UcxDefect::OutsideKey(id)));
            }
            if len > 0 && rkey.is_empty() {
                return Err(MetaDefect::Backend(UcxDefect::MissingKey(id)));
            }
            regions.push(RegionMeta {
                id,
                base,
                len,
                key_base,
                key_len: key_size,
                kind,
                rkey,
            });
        }
        metadata::refuse_trailing(&r, 0)?;
        metadata::sort_regions(&mut regions, |r| r.id).map_err(MetaDefect::DuplicateRegion)?;
        Ok(EndpointMeta {
            agent,
            incarnation,
            worker_address,
            regions,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> EndpointMeta {
        EndpointMeta {
            agent: "publisher-ä".into(),
            incarnation: 0x0123_4567_89ab_cdef,
            worker_address: vec![9; 37],
            regions: vec![
                RegionMeta {
                    id: 1,
                    base: 0x7f00_0000_1000,
                    len: 4096,
                    key_base: 0x7f00_0000_0000,
                    key_len: 0x10_0000,
                    kind: MemoryKind::Dram,
                    rkey: vec![1, 2, 3, 4, 5],
                },
                RegionMeta {
                    id: 2,
                    base: 0,
                    len: 0,
                    key_base: 0,
                    key_len: 0,
                    kind: MemoryKind::Dram,
                    rkey: vec![],
                },
                RegionMeta {
                    id: 5,
                    base: 0x1000,
                    len: 64,
                    key_base: 0x1000,
                    key_len: 64,
                    kind: MemoryKind::Vram { device: 3 },
                    rkey: vec![7; 40],
                },
            ],
        }
    }

    #[test]
    fn bad_fields_are_named() {
        let full = sample().encode().to_vec();
        let name_len = sample().agent.len();
        let count_at = 4 + 1 + 2 + name_len + 8 + 4 + 37;
        // A huge region count with few bytes present allocates nothing and fails cleanly.
        let mut v = full.clone();
        v[count_at..count_at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            EndpointMeta::try_decode(&v),
            Err(MetaDefect::Truncated(_))
        ));
        // A huge key length too.
        let key_len_at = count_at + 4 + 8 * 5 + 1 + 4;
        let mut v = full.clone();
        v[key_len_at..key_len_at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            EndpointMeta::try_decode(&v),
            Err(MetaDefect::Truncated(_))
        ));
        let mut v = full;
        v[count_at + 4 + 40] = 7;
        assert_eq!(
            EndpointMeta::try_decode(&v),
            Err(MetaDefect::Kind { region: 1, tag: 7 })
        );
        let mut m = sample();
        m.regions[0].base = u64::MAX;
        assert_eq!(
            EndpointMeta::try_decode(&m.encode()),
            Err(MetaDefect::Backend(UcxDefect::Overflow(1)))
        );
        let mut m = sample();
        m.regions[0].len = 0x10_0000;
        assert_eq!(
            EndpointMeta::try_decode(&m.encode()),
            Err(MetaDefect::Backend(UcxDefect::OutsideKey(1)))
        );
        let mut m = sample();
        m.regions[2].key_base = 0x1001;
        assert_eq!(
            EndpointMeta::try_decode(&m.encode()),
            Err(MetaDefect::Backend(UcxDefect::OutsideKey(5)))
        );
        let mut m = sample();
        m.regions[0].key_len = u64::MAX;
        assert_eq!(
            EndpointMeta::try_decode(&m.encode()),
            Err(MetaDefect::Backend(UcxDefect::Overflow(1)))
        );
        let mut m = sample();
        m.regions[0].rkey.clear();
        assert_eq!(
            EndpointMeta::try_decode(&m.encode()),
            Err(MetaDefect::Backend(UcxDefect::MissingKey(1)))
        );
        let mut m = sample();
        m.regions[2].id = 1;
        assert_eq!(
            EndpointMeta::try_decode(&m.encode()),
            Err(MetaDefect::DuplicateRegion(1))
        );
        let mut m = sample();
        m.worker_address.clear();
        assert_eq!(
            EndpointMeta::try_decode(&m.encode()),
            Err(MetaDefect::Backend(UcxDefect::EmptyAddress))
        );
    }

    // The fuzz seed of this codec is checked in fuzz/src/lib.rs.
    reshard_core::metadata_tests!(
        ty: EndpointMeta,
        backend: crate::SCHEME,
        sample: sample(),
        extend: |v| v.push(0),
        reseal: |_| {},
    );
}
