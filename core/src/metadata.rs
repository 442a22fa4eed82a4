//! The header every backend's peer metadata starts with, encoded and decoded once:
//! [`MetaHeader`]. Backends write their own payload (regions, keys, addresses) after it; the
//! rules every region list in a payload follows are here too: [`read_region_count`] (a count
//! checked against the bytes present before anything is allocated), [`sort_regions`] (ascending
//! ids, none twice) and [`encode_kind`] / [`decode_kind`] (the memory kind of a region), and
//! the defects a decoder finds are one type, [`MetaDefect`], whose [`MetaDefect::into_error`]
//! is the `Decode` error every backend returns.
//!
//! Layout (little endian): magic (4 bytes, one per backend), version `u8` (of the backend's
//! whole format), agent name (`u16` length + 1..=`u16::MAX` bytes of UTF-8), endpoint
//! incarnation `u64` ([`crate::Transport::incarnation`]). Decoding treats the bytes as
//! untrusted: magic and version are checked before anything else is read, every length is
//! checked against the input before it is used, and failures are a typed [`HeaderError`].

use std::convert::Infallible;
use std::fmt;

use bytes::BufMut;

use crate::encoding::{ByteReader, Truncated};
use crate::error::{Error, ErrorKind};
use crate::model::MemoryKind;

/// The shared head of a backend's peer metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaHeader {
    /// Identifies the backend's format (`RSLB`, `RSUX`, `RSNX`).
    pub magic: [u8; 4],
    /// Version of the backend's whole format.
    pub version: u8,
    /// The exporting endpoint's agent name (1..=`u16::MAX` bytes; endpoints refuse others when
    /// they are created).
    pub agent: String,
    /// The exporting endpoint's incarnation.
    pub incarnation: u64,
}

/// Why a header could not be decoded; backends keep it as the source of their `Decode` error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderError {
    /// The input does not start with the expected magic.
    Magic {
        /// The magic the decoder expected.
        expected: [u8; 4],
    },
    /// Another version of the format.
    Version {
        /// The version the input carries.
        found: u8,
        /// The version this build reads.
        supported: u8,
    },
    /// The input ends inside the header.
    Truncated(Truncated),
    /// The agent name is empty or not UTF-8.
    Name,
}

impl fmt::Display for HeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeaderError::Magic { expected } => write!(
                f,
                "bad magic (not {} metadata)",
                String::from_utf8_lossy(expected)
            ),
            HeaderError::Version { found, supported } => write!(
                f,
                "unsupported metadata version {found} (this build reads {supported})"
            ),
            HeaderError::Truncated(t) => t.fmt(f),
            HeaderError::Name => f.write_str("agent name is empty or not UTF-8"),
        }
    }
}

impl std::error::Error for HeaderError {}

impl From<Truncated> for HeaderError {
    fn from(t: Truncated) -> Self {
        HeaderError::Truncated(t)
    }
}

/// Why a backend's peer metadata could not be decoded: the defects every format shares, and
/// `E`, the ones only one backend's format can have (none for [`Infallible`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetaDefect<E = Infallible> {
    /// The shared header is damaged.
    Header(HeaderError),
    /// The input ends inside the payload, or a count claims more than the input holds.
    Truncated(Truncated),
    /// Bytes are left after the last field of the format.
    Trailing(usize),
    /// A region id is listed twice.
    DuplicateRegion(u64),
    /// A region's memory kind tag is not one [`encode_kind`] writes.
    Kind {
        /// The region's id.
        region: u64,
        /// The unknown tag.
        tag: u8,
    },
    /// A region's address range cannot be real memory (its end overflows, or the backend's
    /// own rule refuses it).
    Range {
        /// The region's id.
        region: u64,
        /// Its first address.
        addr: u64,
        /// Its length in bytes.
        len: u64,
    },
    /// A defect only this backend's format can have.
    Backend(E),
}

impl<E: fmt::Display> fmt::Display for MetaDefect<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetaDefect::Header(e) => e.fmt(f),
            MetaDefect::Truncated(t) => t.fmt(f),
            MetaDefect::Trailing(n) => write!(f, "{n} trailing bytes after the last field"),
            MetaDefect::DuplicateRegion(id) => write!(f, "region {id} listed twice"),
            MetaDefect::Kind { region, tag } => {
                write!(f, "region {region} has an unknown memory kind {tag}")
            }
            MetaDefect::Range { region, addr, len } => write!(
                f,
                "region {region} at {addr:#x} + {len} bytes is not an address range"
            ),
            MetaDefect::Backend(e) => e.fmt(f),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for MetaDefect<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            // Transparent, as the message is: the inner error's own cause, if any.
            MetaDefect::Backend(e) => e.source(),
            _ => None,
        }
    }
}

impl<E> From<HeaderError> for MetaDefect<E> {
    fn from(e: HeaderError) -> Self {
        MetaDefect::Header(e)
    }
}

impl<E> From<Truncated> for MetaDefect<E> {
    fn from(t: Truncated) -> Self {
        MetaDefect::Truncated(t)
    }
}

impl<E: std::error::Error + Send + Sync + 'static> MetaDefect<E> {
    /// The `Decode` error a backend's metadata decoder returns, naming `backend` in its
    /// message and context, with this defect as its source.
    pub fn into_error(self, backend: &'static str) -> Error {
        Error::new(
            ErrorKind::Decode,
            format!("invalid {backend} peer metadata: {self}"),
        )
        .with_backend(backend)
        .with_source(self)
    }
}

/// Refuses more than `need` bytes left in `r` (`need`: what the rest of the format takes; 0
/// after its last field) as [`MetaDefect::Trailing`] with the excess.
pub fn refuse_trailing<E>(r: &ByteReader<'_>, need: usize) -> Result<(), MetaDefect<E>> {
    match r.left().checked_sub(need) {
        Some(extra) if extra > 0 => Err(MetaDefect::Trailing(extra)),
        _ => Ok(()),
    }
}

impl MetaHeader {
    /// Bytes [`MetaHeader::encode_into`] writes.
    pub fn encoded_len(&self) -> usize {
        4 + 1 + 2 + self.agent.len() + 8
    }

    /// Appends the header to `out`. The agent name must be at most `u16::MAX` bytes (endpoints
    /// check it when they are created); a longer one is cut to that length, never wrapped.
    pub fn encode_into(&self, out: &mut impl BufMut) {
        let name = self.agent.as_bytes();
        let name = &name[..name.len().min(u16::MAX as usize)];
        out.put_slice(&self.magic);
        out.put_u8(self.version);
        out.put_u16_le(name.len() as u16);
        out.put_slice(name);
        out.put_u64_le(self.incarnation);
    }

    /// Reads a header of format `magic`, version `version` from `r`, leaving `r` at the
    /// backend's payload.
    pub fn decode(
        r: &mut ByteReader<'_>,
        magic: [u8; 4],
        version: u8,
    ) -> Result<Self, HeaderError> {
        let bad_magic = HeaderError::Magic { expected: magic };
        if r.take(4).map_err(|_| bad_magic.clone())? != magic {
            return Err(bad_magic);
        }
        let found = r.u8()?;
        if found != version {
            return Err(HeaderError::Version {
                found,
                supported: version,
            });
        }
        let len = r.u16()? as usize;
        let agent = std::str::from_utf8(r.take(len)?).map_err(|_| HeaderError::Name)?;
        if agent.is_empty() {
            return Err(HeaderError::Name);
        }
        let agent = agent.to_owned();
        let incarnation = r.u64()?;
        Ok(MetaHeader {
            magic,
            version,
            agent,
            incarnation,
        })
    }
}

/// Reads a region count (`u32`, little endian) and checks that at least `count * min_bytes`
/// bytes follow (`min_bytes`: the fixed part of one region), so a forged count allocates
/// nothing and fails as [`Truncated`].
pub fn read_region_count(r: &mut ByteReader<'_>, min_bytes: usize) -> Result<usize, Truncated> {
    let count = u32::from_le_bytes(r.array()?) as usize;
    r.ensure(count.saturating_mul(min_bytes))?;
    Ok(count)
}

/// Sorts decoded regions by `id` (what every backend's metadata promises its users) and
/// refuses an id listed twice: `Err(id)`, for the backend's own typed defect.
pub fn sort_regions<T>(regions: &mut [T], id: impl Fn(&T) -> u64) -> Result<(), u64> {
    regions.sort_unstable_by_key(&id);
    match regions.windows(2).find(|w| id(&w[0]) == id(&w[1])) {
        Some(w) => Err(id(&w[0])),
        None => Ok(()),
    }
}

/// A region's memory kind on the wire: a tag byte (0 host, 1 device) and the device number
/// (0 for host memory).
pub fn encode_kind(kind: MemoryKind) -> (u8, u32) {
    match kind {
        MemoryKind::Dram => (0, 0),
        MemoryKind::Vram { device } => (1, device),
    }
}

/// The memory kind [`encode_kind`] wrote; `None` for an unknown tag (the device number of
/// host memory is ignored).
pub fn decode_kind(tag: u8, device: u32) -> Option<MemoryKind> {
    match tag {
        0 => Some(MemoryKind::Dram),
        1 => Some(MemoryKind::Vram { device }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAGIC: [u8; 4] = *b"RSTT";

    fn sample() -> MetaHeader {
        MetaHeader {
            magic: MAGIC,
            version: 3,
            agent: "publisher-ä".into(),
            incarnation: 0x0123_4567_89ab_cdef,
        }
    }

    fn encoded() -> Vec<u8> {
        let mut v = Vec::new();
        sample().encode_into(&mut v);
        v
    }

    fn decode(bytes: &[u8]) -> Result<MetaHeader, HeaderError> {
        MetaHeader::decode(&mut ByteReader::new(bytes), MAGIC, 3)
    }

    #[test]
    fn round_trips_and_stops_at_the_payload() {
        let mut v = encoded();
        assert_eq!(v.len(), sample().encoded_len());
        v.extend_from_slice(b"payload");
        let mut r = ByteReader::new(&v);
        let h = MetaHeader::decode(&mut r, MAGIC, 3).unwrap();
        assert_eq!(h, sample());
        assert_eq!(r.take(r.left()).unwrap(), b"payload");
    }

    #[test]
    fn the_layout_is_magic_version_name_incarnation() {
        let v = encoded();
        let n = "publisher-ä".len();
        assert_eq!(&v[..4], b"RSTT");
        assert_eq!(v[4], 3);
        assert_eq!(u16::from_le_bytes([v[5], v[6]]) as usize, n);
        assert_eq!(&v[7..7 + n], "publisher-ä".as_bytes());
        assert_eq!(v[7 + n..], 0x0123_4567_89ab_cdefu64.to_le_bytes());
    }

    #[test]
    fn every_truncation_is_an_error() {
        let v = encoded();
        for cut in 0..v.len() {
            assert!(decode(&v[..cut]).is_err(), "cut at {cut}");
        }
        assert_eq!(decode(&v[..3]), Err(HeaderError::Magic { expected: MAGIC }));
        assert!(matches!(
            decode(&v[..v.len() - 1]),
            Err(HeaderError::Truncated(_))
        ));
    }

    #[test]
    fn bad_fields_are_named() {
        let mut v = encoded();
        v[0] = b'X';
        assert_eq!(decode(&v), Err(HeaderError::Magic { expected: MAGIC }));
        let mut v = encoded();
        v[4] = 99;
        let e = decode(&v).unwrap_err();
        assert_eq!(
            e,
            HeaderError::Version {
                found: 99,
                supported: 3
            }
        );
        assert!(e.to_string().contains("version 99"), "{e}");
        let mut v = encoded();
        v[7] = 0xff;
        assert_eq!(decode(&v), Err(HeaderError::Name));
        // An empty name is refused even though the rest is well formed.
        let mut h = sample();
        h.agent.clear();
        let mut v = Vec::new();
        h.encode_into(&mut v);
        assert_eq!(decode(&v), Err(HeaderError::Name));
        // A huge name length with few bytes present fails cleanly.
        let mut v = encoded();
        v[5..7].copy_from_slice(&u16::MAX.to_le_bytes());
        assert!(matches!(decode(&v), Err(HeaderError::Truncated(_))));
    }

    #[test]
    fn magic_errors_name_the_expected_format() {
        let e = decode(b"RSLBxxxx").unwrap_err();
        assert!(e.to_string().contains("not RSTT metadata"), "{e}");
    }

    #[test]
    fn region_list_rules() {
        let bytes = [1, 0, 0, 0, 1, 2, 3, 4];
        let mut r = ByteReader::new(&bytes);
        assert_eq!(read_region_count(&mut r, 4), Ok(1));
        let mut r = ByteReader::new(&bytes);
        assert!(read_region_count(&mut r, 5).is_err());
        let mut v = vec![(3, 'a'), (1, 'b'), (2, 'c')];
        assert_eq!(sort_regions(&mut v, |r| r.0), Ok(()));
        assert_eq!(v, [(1, 'b'), (2, 'c'), (3, 'a')]);
        v.push((2, 'd'));
        assert_eq!(sort_regions(&mut v, |r| r.0), Err(2));
        for kind in [MemoryKind::Dram, MemoryKind::Vram { device: 7 }] {
            let (tag, device) = encode_kind(kind);
            assert_eq!(decode_kind(tag, device), Some(kind));
        }
        assert_eq!(decode_kind(0, 9), Some(MemoryKind::Dram));
        assert_eq!(decode_kind(2, 0), None);
    }

    #[derive(Debug, Clone, PartialEq)]
    struct Own;

    impl fmt::Display for Own {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("own defect")
        }
    }

    impl std::error::Error for Own {}

    #[test]
    fn defects_become_decode_errors_naming_the_backend() {
        let cases: [(MetaDefect<Own>, &str); 6] = [
            (HeaderError::Name.into(), "agent name is empty"),
            (MetaDefect::Trailing(3), "3 trailing bytes"),
            (MetaDefect::DuplicateRegion(4), "region 4 listed twice"),
            (
                MetaDefect::Kind { region: 5, tag: 9 },
                "region 5 has an unknown memory kind 9",
            ),
            (
                MetaDefect::Range {
                    region: 6,
                    addr: 0x10,
                    len: 2,
                },
                "region 6 at 0x10 + 2 bytes",
            ),
            (MetaDefect::Backend(Own), "own defect"),
        ];
        for (defect, says) in cases {
            let e = defect.clone().into_error("tt");
            assert_eq!(e.kind(), ErrorKind::Decode);
            assert_eq!(e.context().backend.as_deref(), Some("tt"));
            let msg = e.to_string();
            assert!(msg.contains("invalid tt peer metadata: "), "{msg}");
            assert!(msg.contains(says), "{msg}");
            let source = std::error::Error::source(&e).expect("the defect is the source");
            assert_eq!(source.downcast_ref::<MetaDefect<Own>>(), Some(&defect));
        }
    }

    #[test]
    fn only_bytes_beyond_what_the_format_takes_are_trailing() {
        let bytes = [0u8; 5];
        let mut r = ByteReader::new(&bytes);
        r.take(1).unwrap();
        assert_eq!(refuse_trailing::<Own>(&r, 4), Ok(()));
        assert_eq!(
            refuse_trailing::<Own>(&r, 9),
            Ok(()),
            "a shortfall is not trailing"
        );
        assert_eq!(refuse_trailing::<Own>(&r, 1), Err(MetaDefect::Trailing(3)));
        assert_eq!(refuse_trailing::<Own>(&r, 0), Err(MetaDefect::Trailing(4)));
    }
}
