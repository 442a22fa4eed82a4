//! [`ByteReader`], the bounds-checked cursor every decoder of untrusted bytes uses: the shard
//! table decoder here and the backends' metadata decoders.

use std::fmt;

/// A cursor over untrusted little-endian bytes for backends' metadata decoders: every read is
/// bounds-checked and a short input is a [`Truncated`] error, never a panic.
#[derive(Debug, Clone)]
pub struct ByteReader<'a> {
    bytes: &'a [u8],
    at: usize,
}

/// A read ran past the end of the input: where it started and how many bytes were missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Truncated {
    /// Offset of the read that failed.
    pub at: usize,
    /// Bytes missing.
    pub needed: usize,
}

impl fmt::Display for Truncated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "truncated: needed {} more bytes at offset {}",
            self.needed, self.at
        )
    }
}

impl std::error::Error for Truncated {}

impl<'a> ByteReader<'a> {
    /// A reader at the start of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        ByteReader { bytes, at: 0 }
    }

    /// Offset of the next byte.
    pub fn at(&self) -> usize {
        self.at
    }

    /// Bytes not read yet.
    pub fn left(&self) -> usize {
        self.bytes.len() - self.at
    }

    /// Fails unless at least `n` more bytes are present (check counts before allocating).
    pub fn ensure(&self, n: usize) -> std::result::Result<(), Truncated> {
        let left = self.left();
        if n > left {
            return Err(Truncated {
                at: self.at,
                needed: n - left,
            });
        }
        Ok(())
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], Truncated> {
        self.ensure(n)?;
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    /// The next `N` bytes as an array.
    pub fn array<const N: usize>(&mut self) -> std::result::Result<[u8; N], Truncated> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    /// A byte.
    pub fn u8(&mut self) -> std::result::Result<u8, Truncated> {
        Ok(self.array::<1>()?[0])
    }

    /// A little-endian u16.
    pub fn u16(&mut self) -> std::result::Result<u16, Truncated> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    /// A little-endian u32.
    pub fn u32(&mut self) -> std::result::Result<u32, Truncated> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    /// A little-endian u64.
    pub fn u64(&mut self) -> std::result::Result<u64, Truncated> {
        Ok(u64::from_le_bytes(self.array()?))
    }
}
