//! Content digests of offer bytes: XXH3-128, position-sensitive (a permuted row, a changed value
//! and a torn tail all change it). Chosen over BLAKE3 by measurement; see BENCHMARKS.md.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// A 128-bit content digest of a byte buffer.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u8; 16]);

impl Digest {
    /// Digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Digest {
        Digest(xxhash_rust::xxh3::xxh3_128(bytes).to_le_bytes())
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

/// A 64-bit hasher for fingerprints built incrementally from plan fields.
#[derive(Default)]
pub struct Fingerprinter(xxhash_rust::xxh3::Xxh3);

impl Fingerprinter {
    /// A fresh fingerprinter.
    pub fn new() -> Self {
        Self::default()
    }

    /// Mixes in one integer.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.update(&v.to_le_bytes());
        self
    }

    /// Mixes in a string (length-prefixed, so concatenations do not collide).
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.0.update(s.as_bytes());
        self
    }

    /// The 64-bit result.
    pub fn finish(&self) -> u64 {
        self.0.digest()
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
    fn hex_round_trip() {
        let d = Digest::of(b"reshard");
        assert_eq!(Digest::from_hex(&d.to_hex()), Some(d));
        assert_eq!(d.prefix(8).len(), 8);
        assert_eq!(Digest::from_hex("zz"), None);
    }
}
