//! The metadata an endpoint exports and its peers load: the shared header
//! ([`reshard_core::metadata::MetaHeader`]: which endpoint, by agent name and incarnation),
//! then who the process is (host, pid namespace, pid, start time) and where its regions are in
//! its address space.
//!
//! Layout, little endian: the shared header (magic `RSCM`, version `u8`, agent name length
//! `u16` + UTF-8 name, incarnation `u64`), boot id `[u8; 16]`, pid namespace inode `u64`, pid
//! `u32`, start time `u64` (clock ticks since boot), region count `u32`, then
//! `(id u64, addr u64, len u64)` per region. Decoding treats the bytes as untrusted
//! (docs/bad-input.md): magic and version are checked first, every count is checked against
//! the bytes present before anything is allocated for it, and any defect is a typed `Decode`.

use bytes::{BufMut, Bytes, BytesMut};
use reshard_core::encoding::ByteReader;
use reshard_core::metadata::{self, MetaDefect, MetaHeader};
use reshard_core::Result;

use crate::SCHEME;

const MAGIC: [u8; 4] = *b"RSCM";
/// 2: the shared header first (agent name and incarnation before the process identity).
const VERSION: u8 = 2;
/// Bytes of one region entry.
const REGION_BYTES: usize = 24;
/// Bytes of the process identity after the header: boot id, pid namespace, pid, start time.
const PROCESS_BYTES: usize = 16 + 8 + 4 + 8;

/// A registered region as a peer sees it: its id and where it is in the exporter's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RegionMeta {
    pub(crate) id: u64,
    pub(crate) addr: u64,
    pub(crate) len: u64,
}

/// What a peer needs to read an endpoint's regions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Meta {
    pub(crate) boot_id: [u8; 16],
    pub(crate) pid_ns: u64,
    pub(crate) pid: u32,
    pub(crate) start_time: u64,
    pub(crate) incarnation: u64,
    pub(crate) agent: String,
    /// Ascending by id, ids distinct.
    pub(crate) regions: Vec<RegionMeta>,
}

/// The defects only this format can have (the shared ones are [`MetaDefect`]'s).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum CmaDefect {
    #[error("pid {0} names no process (a pid is 1 to {max})", max = i32::MAX)]
    Pid(u32),
}

/// Why a blob could not be decoded (kept as the source of the public `Decode` error).
pub(crate) type MetaError = MetaDefect<CmaDefect>;

impl Meta {
    fn header(&self) -> MetaHeader {
        MetaHeader {
            magic: MAGIC,
            version: VERSION,
            agent: self.agent.clone(),
            incarnation: self.incarnation,
        }
    }

    pub(crate) fn encode(&self) -> Bytes {
        let header = self.header();
        let mut b = BytesMut::with_capacity(
            header.encoded_len() + PROCESS_BYTES + 4 + REGION_BYTES * self.regions.len(),
        );
        // Agent names are limited to u16::MAX bytes when the endpoint is created.
        header.encode_into(&mut b);
        b.put_slice(&self.boot_id);
        b.put_u64_le(self.pid_ns);
        b.put_u32_le(self.pid);
        b.put_u64_le(self.start_time);
        b.put_u32_le(self.regions.len() as u32);
        for r in &self.regions {
            b.put_u64_le(r.id);
            b.put_u64_le(r.addr);
            b.put_u64_le(r.len);
        }
        b.freeze()
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Meta> {
        Self::try_decode(bytes).map_err(|e| e.into_error(SCHEME))
    }

    fn try_decode(bytes: &[u8]) -> Result<Meta, MetaError> {
        let mut r = ByteReader::new(bytes);
        let MetaHeader {
            agent, incarnation, ..
        } = MetaHeader::decode(&mut r, MAGIC, VERSION)?;
        let boot_id = r.array()?;
        let pid_ns = r.u64()?;
        let pid = r.u32()?;
        if pid == 0 || pid > i32::MAX as u32 {
            return Err(MetaDefect::Backend(CmaDefect::Pid(pid)));
        }
        let start_time = r.u64()?;
        let count = metadata::read_region_count(&mut r, REGION_BYTES)?;
        metadata::refuse_trailing(&r, count * REGION_BYTES)?;
        let mut regions = Vec::with_capacity(count);
        for _ in 0..count {
            let (id, addr, len) = (r.u64()?, r.u64()?, r.u64()?);
            if len > 0 && (addr == 0 || addr.checked_add(len).is_none()) {
                return Err(MetaDefect::Range {
                    region: id,
                    addr,
                    len,
                });
            }
            regions.push(RegionMeta { id, addr, len });
        }
        metadata::sort_regions(&mut regions, |r| r.id).map_err(MetaDefect::DuplicateRegion)?;
        Ok(Meta {
            boot_id,
            pid_ns,
            pid,
            start_time,
            incarnation,
            agent,
            regions,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard_core::metadata::HeaderError;
    use reshard_core::ErrorKind;

    pub(crate) fn sample() -> Meta {
        Meta {
            boot_id: [7; 16],
            pid_ns: 4026531836,
            pid: 4242,
            start_time: 123_456,
            incarnation: 99,
            agent: "publisher-ä".into(),
            regions: vec![
                RegionMeta {
                    id: 1,
                    addr: 0x7f00_0000_0000,
                    len: 4096,
                },
                RegionMeta {
                    id: 2,
                    addr: 0,
                    len: 0,
                },
                RegionMeta {
                    id: 9,
                    addr: 0x1000,
                    len: u64::MAX - 0x1000,
                },
            ],
        }
    }

    fn decode_err(bytes: &[u8]) -> MetaError {
        let e = Meta::decode(bytes).expect_err("must not decode");
        assert_eq!(e.kind(), ErrorKind::Decode);
        assert_eq!(e.context().backend.as_deref(), Some(SCHEME));
        Meta::try_decode(bytes).unwrap_err()
    }

    /// Where the process identity starts: after the shared header.
    fn process_at() -> usize {
        sample().header().encoded_len()
    }

    #[test]
    fn the_layout_is_the_shared_header_then_the_process_then_the_regions() {
        let m = sample();
        let v = m.encode();
        let mut head = Vec::new();
        m.header().encode_into(&mut head);
        assert_eq!(&v[..head.len()], &head[..], "starts with the shared header");
        assert_eq!(&v[..5], b"RSCM\x02");
        let at = process_at();
        assert_eq!(v[at..at + 16], [7; 16]);
        assert_eq!(v[at + 16..at + 24], 4026531836u64.to_le_bytes());
        assert_eq!(v[at + 24..at + 28], 4242u32.to_le_bytes());
        assert_eq!(v[at + 28..at + 36], 123_456u64.to_le_bytes());
        assert_eq!(v[at + 36..at + 40], 3u32.to_le_bytes());
        assert_eq!(v.len(), at + PROCESS_BYTES + 4 + 3 * REGION_BYTES);
    }

    #[test]
    fn an_old_version_and_bad_pids_are_named() {
        let full = sample().encode().to_vec();
        // The version-1 layout (process identity before the name) is refused by its version.
        let mut v = full.clone();
        v[4] = 1;
        assert_eq!(
            decode_err(&v),
            MetaDefect::Header(HeaderError::Version {
                found: 1,
                supported: VERSION
            })
        );
        let pid = process_at() + 24;
        let mut v = full.clone();
        v[pid..pid + 4].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(decode_err(&v), MetaDefect::Backend(CmaDefect::Pid(0)));
        let mut v = full;
        v[pid..pid + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        let e = decode_err(&v);
        assert_eq!(e, MetaDefect::Backend(CmaDefect::Pid(u32::MAX)));
        assert!(
            e.to_string().contains("pid 4294967295 names no process"),
            "{e}"
        );
    }

    #[test]
    fn a_huge_region_count_is_refused_before_allocating() {
        let m = Meta {
            regions: vec![],
            ..sample()
        };
        let mut v = m.encode().to_vec();
        let at = v.len() - 4;
        v[at..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode_err(&v), MetaDefect::Truncated(_)));
    }

    #[test]
    fn duplicate_regions_and_wrapping_ranges_are_refused() {
        let mut m = sample();
        m.regions[1].id = 1;
        assert_eq!(
            decode_err(&m.encode()),
            MetaDefect::DuplicateRegion(1),
            "duplicates found after sorting"
        );
        let mut m = sample();
        m.regions[2].len = u64::MAX;
        assert!(matches!(
            decode_err(&m.encode()),
            MetaDefect::Range { region: 9, .. }
        ));
        let mut m = sample();
        m.regions[0].addr = 0;
        assert!(matches!(
            decode_err(&m.encode()),
            MetaDefect::Range { region: 1, .. }
        ));
    }

    reshard_core::metadata_tests!(
        ty: Meta,
        backend: SCHEME,
        sample: sample(),
        extend: |v| v.push(0),
        reseal: |_| {},
        // `UPDATE_SEEDS=1 cargo test -p reshard-backend-cma seed` rewrites it after a format
        // change.
        seed: {
            path: "fuzz/corpus/cma_metadata/seed-two-regions",
            value: Meta {
                boot_id: [0x5e; 16],
                pid_ns: 4_026_531_836,
                pid: 4242,
                start_time: 123_456,
                incarnation: 0x5eed_0004,
                agent: "pub-0".into(),
                regions: vec![
                    RegionMeta {
                        id: 1,
                        addr: 0x7f00_0000_1000,
                        len: 4096,
                    },
                    RegionMeta {
                        id: 2,
                        addr: 0x7f00_0010_0000,
                        len: 64,
                    },
                ],
            },
            stored: |b| b,
        },
    );
}
