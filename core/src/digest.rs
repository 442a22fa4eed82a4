//! Content digests of offer bytes: XXH3, position-sensitive (a permuted row, a changed value and
//! a torn tail all change it). Chosen over BLAKE3 by measurement; see BENCHMARKS.md.
//!
//! An offer's digests are folds of *segment hashes* (docs/design.md §6, "Digests"): the offer is a
//! matrix of rows and column blocks ([`crate::MatrixView`]); each segment (one row's bytes of one
//! column block) is hashed once with XXH3-64, and a digest of any rectangle of segments (the whole
//! offer, a run of rows, a column block) is the XXH3 hash of its segment hashes, little-endian,
//! in row-major order ([`SegmentFold`]). A publisher hashes each byte once for all its digests;
//! a receiver that read only part of an offer computes the same fold over what it read.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// A 128-bit content digest of a byte buffer.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u8; 16]);

impl Digest {
    /// Digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Digest {
        Digest(twox_hash::XxHash3_128::oneshot(bytes).to_le_bytes())
    }

    /// Lower-case hex of the whole digest.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The first `n` hex characters, for error messages.
    pub fn prefix(&self, n: usize) -> String {
        let mut h = self.to_hex();
        h.truncate(n);
        h
    }

    /// Parses 32 hex characters.
    pub fn from_hex(s: &str) -> Option<Digest> {
        if s.len() != 32 || !s.is_ascii() {
            return None;
        }
        let mut out = [0u8; 16];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Digest(out))
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", self.to_hex())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl Serialize for Digest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Digest::from_hex(&s).ok_or_else(|| serde::de::Error::custom("digest must be 32 hex chars"))
    }
}

/// The fold of a rectangle of segment hashes (see the module docs): rows are added in order,
/// each split into segments of one column block's bytes.
#[derive(Debug, Default, Clone)]
pub struct SegmentFold {
    hashes: Vec<u8>,
}

impl SegmentFold {
    /// An empty fold.
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets every row added so far (keeps the allocation).
    pub fn clear(&mut self) {
        self.hashes.clear();
    }

    /// Adds one row of the rectangle: `row` split into segments of `seg_bytes` bytes (the last
    /// may be shorter: the offer's last column block is narrower when the columns do not divide).
    pub fn row(&mut self, row: &[u8], seg_bytes: u64) {
        let seg = usize::try_from(seg_bytes.max(1)).unwrap_or(usize::MAX);
        if row.is_empty() {
            self.segment(row);
        }
        for s in row.chunks(seg) {
            self.segment(s);
        }
    }

    /// Adds one segment.
    pub fn segment(&mut self, bytes: &[u8]) {
        self.hashes
            .extend_from_slice(&twox_hash::XxHash3_64::oneshot(bytes).to_le_bytes());
    }

    /// Adds one segment by its hash (computed elsewhere, e.g. while the bytes were copied:
    /// [`crate::HashPlan`]).
    pub fn segment_hash(&mut self, hash: u64) {
        self.hashes.extend_from_slice(&hash.to_le_bytes());
    }

    /// The 64-bit digest of a part (a row chunk or a column block).
    pub fn part(&self) -> u64 {
        twox_hash::XxHash3_64::oneshot(&self.hashes)
    }

    /// The 128-bit digest of a whole offer.
    pub fn whole(&self) -> Digest {
        Digest(twox_hash::XxHash3_128::oneshot(&self.hashes).to_le_bytes())
    }

    /// Segment hashes added so far, as little-endian bytes (8 per segment).
    pub fn hashes(&self) -> &[u8] {
        &self.hashes
    }
}

/// A 64-bit hasher for fingerprints built incrementally from plan fields.
pub struct Fingerprinter(twox_hash::XxHash3_64);

impl Default for Fingerprinter {
    fn default() -> Self {
        Fingerprinter(twox_hash::XxHash3_64::new())
    }
}

impl Fingerprinter {
    /// A fresh fingerprinter.
    pub fn new() -> Self {
        Self::default()
    }

    /// Mixes in one integer.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        std::hash::Hasher::write(&mut self.0, &v.to_le_bytes());
        self
    }

    /// Mixes in a string (length-prefixed, so concatenations do not collide).
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        std::hash::Hasher::write(&mut self.0, s.as_bytes());
        self
    }

    /// The 64-bit result.
    pub fn finish(&self) -> u64 {
        std::hash::Hasher::finish(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows() -> Vec<u8> {
        (0..4096u64)
            .map(|i| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
            .collect()
    }

    /// Digests are exchanged between processes built at different times, so the hash is a
    /// standard one pinned by value: XXH3's published empty-input answers, and a 4133-byte input
    /// (the striped SIMD loop and a tail) as a second XXH3 implementation (xxhash-rust 0.8.21,
    /// this workspace's hash before twox-hash) computes it. Whichever SIMD path the CPU selects
    /// at run time must give these.
    #[test]
    fn xxh3_answers_are_the_standard_ones() {
        use twox_hash::{XxHash3_128, XxHash3_64};
        assert_eq!(XxHash3_64::oneshot(b""), 0x2d06800538d394c2);
        assert_eq!(
            XxHash3_128::oneshot(b""),
            0x99aa06d3014798d86001c324468d497f
        );
        let v: Vec<u8> = (0..4133u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        assert_eq!(XxHash3_64::oneshot(&v), 0x3be87eb01e5e1b5c);
        assert_eq!(XxHash3_128::oneshot(&v), 0xe5a1010928a04a383be87eb01e5e1b5c);
        assert_eq!(
            XxHash3_64::oneshot_with_seed(7, &v[..100]),
            0xc819088e86e5f418
        );
        assert_eq!(
            Digest::of(&v).to_hex(),
            "5c1b5e1eb07ee83b384aa0280901a1e5",
            "Digest is the little-endian XXH3-128"
        );
        let mut f = Fingerprinter::new();
        f.u64(7).str("x");
        let mut bytes = 7u64.to_le_bytes().to_vec();
        bytes.extend(1u64.to_le_bytes());
        bytes.push(b'x');
        assert_eq!(
            f.finish(),
            XxHash3_64::oneshot(&bytes),
            "streaming = one shot"
        );
    }

    #[test]
    fn detects_changed_value_permuted_rows_and_torn_tail() {
        let base = rows();
        let d = Digest::of(&base);
        let mut changed = base.clone();
        changed[1234] ^= 1;
        assert_ne!(Digest::of(&changed), d);
        let mut permuted = base.clone();
        let (a, b) = permuted.split_at_mut(1024);
        a.swap_with_slice(&mut b[..1024]);
        assert_ne!(Digest::of(&permuted), d);
        assert_ne!(Digest::of(&base[..base.len() - 1]), d);
        assert_eq!(Digest::of(&base), d);
    }

    #[test]
    fn segment_folds_see_order_values_and_segment_bounds() {
        let base = rows();
        let fold = |bytes: &[u8], row: usize, seg: u64| {
            let mut f = SegmentFold::new();
            for r in bytes.chunks(row) {
                f.row(r, seg);
            }
            (f.part(), f.whole())
        };
        let d = fold(&base, 512, 128);
        assert_eq!(fold(&base, 512, 128), d);
        let mut changed = base.clone();
        changed[4000] ^= 0x80;
        assert_ne!(fold(&changed, 512, 128), d);
        let mut permuted = base.clone();
        let (a, b) = permuted.split_at_mut(512);
        a.swap_with_slice(&mut b[..512]);
        assert_ne!(fold(&permuted, 512, 128), d);
        // The same bytes cut into other segments are another digest: checks must use the
        // publisher's column blocks.
        assert_ne!(fold(&base, 512, 64), d);
        assert_ne!(fold(&base[..base.len() - 1], 512, 128), d);
        // Segments added by their hashes fold the same.
        let mut f = SegmentFold::new();
        for s in base.chunks(128) {
            f.segment_hash(twox_hash::XxHash3_64::oneshot(s));
        }
        assert_eq!((f.part(), f.whole()), d);
    }

    #[test]
    fn hex_round_trip() {
        let d = Digest::of(b"reshard");
        assert_eq!(Digest::from_hex(&d.to_hex()), Some(d));
        assert_eq!(d.prefix(8).len(), 8);
        assert_eq!(Digest::from_hex("zz"), None);
    }
}
