//! Versioned wire encoding of a [`ShardTable`]: a compact binary form that crosses process
//! boundaries, and pretty JSON for people. Both decoders treat their input as untrusted: every
//! failure is a typed [`Error`] (never a panic), and no length field can make them allocate more
//! than a small multiple of the input size.
//!
//! # Binary format, version 3
//!
//! Fixed-width integers are little-endian; `varint` is unsigned LEB128 (at most 10 bytes, minimal
//! form only); `str` is a varint byte length followed by that many bytes of UTF-8.
//!
//! ```text
//! magic          4 bytes   "RSHT"
//! version        u16       SCHEMA_VERSION
//! publisher rank u32
//! agent          str
//! incarnation    u64       of the publisher's endpoint (0 = unbound)
//! step           u64
//! tensor count   varint
//!   name         str       at most MAX_NAME_LEN bytes
//!   dtype        u8        DType::code
//!   rank         varint
//!   shape        rank x varint
//! offer count    varint
//!   tensor       varint    index into the tensor list above
//!   rank         varint
//!   offset       rank x varint
//!   extent       rank x varint
//!   region       varint
//!   byte offset  varint    of the offer's first byte inside the region
//!   memory       u8        0 = DRAM, 1 = VRAM followed by its device (varint, fits u32)
//!   digest       u8        0 = none, 1 = followed by 16 digest bytes
//!   parts        u8        0 = none, 1 = followed by (model::PartDigests, over the box's
//!                          matrix view: rows = extent[0], columns = extent[1]; a 1-D box is
//!                          one row):
//!     chunk rows varint    rows per row chunk (at least 1)
//!     count      varint    ceil(rows / chunk rows)
//!     digests    count x 8 bytes (u64 little-endian)
//!     block cols varint    columns per column block (at least 1)
//!     count      varint    ceil(columns / block cols)
//!     digests    count x 8 bytes (u64 little-endian)
//! (end of input: trailing bytes are an error)
//! ```
//!
//! # Errors
//!
//! [`ErrorKind::Decode`] means the bytes (or JSON) are not a well-formed version-3 encoding: bad
//! magic, another schema version, truncation (the message names the field), trailing bytes,
//! invalid UTF-8, an unknown dtype, memory or digest tag, a malformed varint, a name longer than
//! [`MAX_NAME_LEN`], or offers whose copied tensor names would take more than 64 times the input
//! size (plus 1 MiB) in memory. [`ErrorKind::InvalidTable`] means a well-formed encoding of a table that
//! [`ShardTable::validate`] refuses, or an offer whose tensor index is out of range. Errors carry
//! the publisher rank and tensor name once they are known.

mod json;
mod reader;

pub use json::{table_from_json, table_to_json};
pub use reader::{ByteReader, Truncated};

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::digest::Digest;
use crate::error::{Error, ErrorKind, Result};
use crate::model::{
    DType, MemoryKind, OfferLocation, PartDigests, PublisherId, ShardOffer, ShardTable, TensorBox,
    TensorSpec,
};

/// Schema version written by this build and the only one its decoders accept.
pub const SCHEMA_VERSION: u16 = 3;

/// The four bytes every binary shard table starts with.
pub const MAGIC: [u8; 4] = *b"RSHT";

/// Longest tensor name (in bytes) the encoding accepts.
///
/// Every decoded offer owns a copy of its tensor's name, so an unbounded name referenced by many
/// tiny offers would let a small input expand enormously in memory.
pub const MAX_NAME_LEN: usize = 1024;

const TAG_DRAM: u8 = 0;
const TAG_VRAM: u8 = 1;
const DIGEST_NONE: u8 = 0;
const DIGEST_SOME: u8 = 1;

/// Smallest possible encodings, used to reject counts the remaining input cannot hold before
/// anything is allocated for them.
const MIN_TENSOR_BYTES: usize = 3; // name length, dtype, rank
const MIN_OFFER_BYTES: usize = 7; // tensor, rank, region, byte offset, memory, digest, parts

/// The decoder copies each offer's tensor name; together those copies may take at most this many
/// bytes per input byte (plus [`NAME_COPY_FLOOR`]). Real tables stay far below (about 1.5).
const NAME_COPY_FACTOR: usize = 64;
const NAME_COPY_FLOOR: usize = 1 << 20;

// ---------------------------------------------------------------------------------------------
// Binary encoding

/// Encodes `t` in the compact binary format (see the module docs).
///
/// Writes what it is given: a table that fails [`ShardTable::validate`] encodes to bytes that
/// [`decode_table`] rejects (an offer naming an undeclared tensor gets an out-of-range index, a box
/// whose offsets and extents differ in length is padded with values that cannot validate).
pub fn encode_table(t: &ShardTable) -> Vec<u8> {
    let names: usize = t.tensors.iter().map(|s| s.name.len()).sum();
    let mut w = Vec::with_capacity(
        32 + t.publisher.agent.len() + names + 16 * t.tensors.len() + 40 * t.offers.len(),
    );
    w.extend_from_slice(&MAGIC);
    w.extend_from_slice(&SCHEMA_VERSION.to_le_bytes());
    w.extend_from_slice(&t.publisher.rank.to_le_bytes());
    put_str(&mut w, &t.publisher.agent);
    w.extend_from_slice(&t.publisher.incarnation.to_le_bytes());
    w.extend_from_slice(&t.step.to_le_bytes());

    put_varint(&mut w, t.tensors.len() as u64);
    let mut index = std::collections::HashMap::with_capacity(t.tensors.len());
    for (i, s) in t.tensors.iter().enumerate() {
        index.entry(s.name.as_str()).or_insert(i);
        put_str(&mut w, &s.name);
        w.push(s.dtype.code());
        put_varint(&mut w, s.shape.len() as u64);
        for &d in &s.shape {
            put_varint(&mut w, d);
        }
    }

    put_varint(&mut w, t.offers.len() as u64);
    for o in &t.offers {
        // An undeclared tensor gets the first out-of-range index, which the decoder rejects.
        let i = index
            .get(o.tensor.as_str())
            .copied()
            .unwrap_or(t.tensors.len());
        put_varint(&mut w, i as u64);
        let b = &o.tensor_box;
        let rank = b.offset.len().max(b.extent.len());
        put_varint(&mut w, rank as u64);
        // Padding of a malformed box: a missing offset overflows with any extent, a missing
        // extent is zero; either way the decoded box fails validation like the original.
        for d in 0..rank {
            put_varint(&mut w, b.offset.get(d).copied().unwrap_or(u64::MAX));
        }
        for d in 0..rank {
            put_varint(&mut w, b.extent.get(d).copied().unwrap_or(0));
        }
        put_varint(&mut w, o.location.region);
        put_varint(&mut w, o.location.offset);
        match o.location.memory {
            MemoryKind::Dram => w.push(TAG_DRAM),
            MemoryKind::Vram { device } => {
                w.push(TAG_VRAM);
                put_varint(&mut w, u64::from(device));
            }
        }
        match &o.digest {
            None => w.push(DIGEST_NONE),
            Some(d) => {
                w.push(DIGEST_SOME);
                w.extend_from_slice(&d.0);
            }
        }
        match &o.parts {
            None => w.push(DIGEST_NONE),
            Some(p) => {
                w.push(DIGEST_SOME);
                for (per, digests) in [(p.chunk_rows, &p.chunks), (p.block_cols, &p.blocks)] {
                    put_varint(&mut w, per);
                    put_varint(&mut w, digests.len() as u64);
                    for d in digests {
                        w.extend_from_slice(&d.to_le_bytes());
                    }
                }
            }
        }
    }
    w
}

fn put_varint(w: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        w.push((v as u8) | 0x80);
        v >>= 7;
    }
    w.push(v as u8);
}

fn put_str(w: &mut Vec<u8>, s: &str) {
    put_varint(w, s.len() as u64);
    w.extend_from_slice(s.as_bytes());
}

/// Decodes a binary shard table from untrusted bytes, then validates it.
///
/// Returns [`ErrorKind::Decode`] for malformed bytes and [`ErrorKind::InvalidTable`] for a
/// well-formed table that is not valid (see the module docs).
pub fn decode_table(bytes: &[u8]) -> Result<ShardTable> {
    let mut r = Reader::new(bytes);

    let magic = r.take(MAGIC.len(), "magic")?;
    if magic != MAGIC {
        return Err(r.fail_at(
            0,
            format!("bad magic {magic:02x?}: not a reshard shard table (expected \"RSHT\")"),
        ));
    }
    let version = r.u16("schema version")?;
    if version != SCHEMA_VERSION {
        return Err(r.fail_at(
            4,
            format!(
                "shard-table schema version {version} found, this build supports version \
                 {SCHEMA_VERSION} only"
            ),
        ));
    }
    let rank = r.u32("publisher rank")?;
    r.owner = Some(rank);
    let agent = r.string("agent name", usize::MAX)?;
    let incarnation = r.u64("incarnation")?;
    let step = r.u64("step")?;

    let n_tensors = r.count("tensor count", MIN_TENSOR_BYTES)?;
    let mut tensors = Vec::with_capacity(n_tensors);
    for i in 0..n_tensors {
        r.section = Section::Tensor(i);
        tensors.push(decode_tensor(&mut r)?);
    }

    r.section = Section::Offers;
    let n_offers = r.count("offer count", MIN_OFFER_BYTES)?;
    let mut offers = Vec::with_capacity(n_offers);
    let name_budget = bytes
        .len()
        .saturating_mul(NAME_COPY_FACTOR)
        .saturating_add(NAME_COPY_FLOOR);
    let mut name_bytes = 0usize;
    for i in 0..n_offers {
        r.section = Section::Offer(i);
        let offer = decode_offer(&mut r, &tensors, rank)?;
        name_bytes = name_bytes.saturating_add(offer.tensor.len());
        if name_bytes > name_budget {
            return Err(r.fail(format!(
                "offer tensor names expand to more than {name_budget} bytes; refusing to decode"
            )));
        }
        offers.push(offer);
    }

    r.section = Section::End;
    if r.remaining() > 0 {
        return Err(r.fail(format!(
            "{} trailing bytes after the last offer",
            r.remaining()
        )));
    }

    let table = ShardTable {
        publisher: PublisherId {
            rank,
            agent,
            incarnation,
        },
        step,
        tensors,
        offers,
    };
    table.validate().map_err(|e| e.with_owner(rank))?;
    Ok(table)
}

fn decode_tensor(r: &mut Reader<'_>) -> Result<TensorSpec> {
    let name = r.string("tensor name", MAX_NAME_LEN)?;
    let (dtype, shape) = decode_tensor_body(r).map_err(|e| e.with_tensor(&name))?;
    Ok(TensorSpec { name, dtype, shape })
}

fn decode_tensor_body(r: &mut Reader<'_>) -> Result<(DType, Vec<u64>)> {
    let at = r.pos();
    let code = r.u8("dtype")?;
    let dtype = DType::from_code(code).ok_or_else(|| {
        r.fail_at(
            at,
            format!(
                "unknown dtype code {code} (known: 0..={})",
                DType::ALL.len() - 1
            ),
        )
    })?;
    let rank = r.count("tensor rank", 1)?;
    let mut shape = Vec::with_capacity(rank);
    for _ in 0..rank {
        shape.push(r.varint("tensor shape")?);
    }
    Ok((dtype, shape))
}

fn decode_offer(r: &mut Reader<'_>, tensors: &[TensorSpec], owner: u32) -> Result<ShardOffer> {
    let at = r.pos();
    let index = r.varint("tensor index")?;
    let Some(spec) = usize::try_from(index).ok().and_then(|i| tensors.get(i)) else {
        return Err(Error::new(
            ErrorKind::InvalidTable,
            format!(
                "tensor index {index} out of range: the table declares {} tensors ({}, at byte \
                 {at})",
                tensors.len(),
                r.section
            ),
        )
        .with_owner(owner));
    };
    decode_offer_body(r, &spec.name).map_err(|e| e.with_tensor(&spec.name))
}

fn decode_offer_body(r: &mut Reader<'_>, tensor: &str) -> Result<ShardOffer> {
    let rank = r.count("box rank", 2)?;
    let mut offset = Vec::with_capacity(rank);
    for _ in 0..rank {
        offset.push(r.varint("box offset")?);
    }
    let mut extent = Vec::with_capacity(rank);
    for _ in 0..rank {
        extent.push(r.varint("box extent")?);
    }
    let region = r.varint("region")?;
    let byte_offset = r.varint("byte offset")?;
    let at = r.pos();
    let memory = match r.u8("memory kind")? {
        TAG_DRAM => MemoryKind::Dram,
        TAG_VRAM => {
            let at = r.pos();
            let device = r.varint("device")?;
            let device = u32::try_from(device)
                .map_err(|_| r.fail_at(at, format!("device {device} does not fit u32")))?;
            MemoryKind::Vram { device }
        }
        tag => {
            return Err(r.fail_at(
                at,
                format!("unknown memory kind tag {tag} (known: 0 = dram, 1 = vram)"),
            ))
        }
    };
    let at = r.pos();
    let digest = match r.u8("digest flag")? {
        DIGEST_NONE => None,
        DIGEST_SOME => {
            let mut d = [0u8; 16];
            d.copy_from_slice(r.take(16, "digest")?);
            Some(Digest(d))
        }
        flag => {
            return Err(r.fail_at(
                at,
                format!("unknown digest flag {flag} (known: 0 = none, 1 = present)"),
            ))
        }
    };
    let at = r.pos();
    let parts = match r.u8("part digests flag")? {
        DIGEST_NONE => None,
        DIGEST_SOME => {
            let (chunk_rows, chunks) =
                part_digests(r, ["row chunk rows", "row chunk count", "row chunk digest"])?;
            let (block_cols, blocks) = part_digests(
                r,
                [
                    "column block cols",
                    "column block count",
                    "column block digest",
                ],
            )?;
            Some(PartDigests {
                chunk_rows,
                chunks,
                block_cols,
                blocks,
            })
        }
        flag => {
            return Err(r.fail_at(
                at,
                format!("unknown part digests flag {flag} (known: 0 = none, 1 = present)"),
            ))
        }
    };
    Ok(ShardOffer {
        tensor: tensor.to_owned(),
        tensor_box: TensorBox { offset, extent },
        location: OfferLocation {
            region,
            offset: byte_offset,
            memory,
        },
        digest,
        parts,
    })
}

/// One axis of an offer's part digests: the part size, then a counted list of 64-bit digests.
fn part_digests(r: &mut Reader<'_>, fields: [&str; 3]) -> Result<(u64, Vec<u64>)> {
    let [size, count_field, digest] = fields;
    let per = r.varint(size)?;
    let at = r.pos();
    let count = r.varint(count_field)?;
    // Bounded by the input before allocating: each digest takes 8 bytes.
    if count > (r.remaining() / 8) as u64 {
        return Err(r.fail_at(
            at,
            format!("truncated: {count} digests announced ({count_field}), input too short"),
        ));
    }
    let mut digests = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let mut d = [0u8; 8];
        d.copy_from_slice(r.take(8, digest)?);
        digests.push(u64::from_le_bytes(d));
    }
    Ok((per, digests))
}

/// Where in the encoding the decoder is, for error messages.
#[derive(Clone, Copy)]
enum Section {
    Header,
    Tensor(usize),
    Offers,
    Offer(usize),
    End,
}

impl fmt::Display for Section {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Section::Header => f.write_str("in the header"),
            Section::Tensor(i) => write!(f, "in tensor {i}"),
            Section::Offers => f.write_str("before the offers"),
            Section::Offer(i) => write!(f, "in offer {i}"),
            Section::End => f.write_str("after the offers"),
        }
    }
}

/// The table decoder's cursor: a [`ByteReader`] (every read bounds-checked) whose failures
/// become `Decode` errors naming the field, the section and the owner.
struct Reader<'a> {
    inner: ByteReader<'a>,
    section: Section,
    owner: Option<u32>,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Reader {
            inner: ByteReader::new(bytes),
            section: Section::Header,
            owner: None,
        }
    }

    fn pos(&self) -> usize {
        self.inner.at()
    }

    fn remaining(&self) -> usize {
        self.inner.left()
    }

    fn fail(&self, msg: impl fmt::Display) -> Error {
        self.fail_at(self.pos(), msg)
    }

    fn fail_at(&self, at: usize, msg: impl fmt::Display) -> Error {
        let e = Error::new(
            ErrorKind::Decode,
            format!("{msg} ({}, at byte {at})", self.section),
        );
        match self.owner {
            Some(o) => e.with_owner(o),
            None => e,
        }
    }

    /// Runs one read of the byte reader, naming `field` if the input is too short.
    fn read<T>(
        &mut self,
        field: &str,
        read: impl FnOnce(&mut ByteReader<'a>) -> std::result::Result<T, Truncated>,
    ) -> Result<T> {
        read(&mut self.inner).map_err(|t| {
            // A failed read consumes nothing, so what remains is what it found.
            let left = self.remaining();
            self.fail(format!(
                "truncated: {field} needs {} bytes, {left} remain",
                left + t.needed
            ))
        })
    }

    fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8]> {
        self.read(field, |r| r.take(n))
    }

    fn u8(&mut self, field: &str) -> Result<u8> {
        self.read(field, ByteReader::u8)
    }

    fn u16(&mut self, field: &str) -> Result<u16> {
        self.read(field, ByteReader::u16)
    }

    fn u32(&mut self, field: &str) -> Result<u32> {
        self.read(field, ByteReader::u32)
    }

    fn u64(&mut self, field: &str) -> Result<u64> {
        self.read(field, ByteReader::u64)
    }

    /// Unsigned LEB128, minimal form, at most 10 bytes.
    fn varint(&mut self, field: &str) -> Result<u64> {
        let start = self.pos();
        let mut v = 0u64;
        for i in 0..10 {
            let Ok(b) = self.inner.u8() else {
                return Err(self.fail_at(
                    start,
                    format!("truncated: varint {field} ends after {i} bytes"),
                ));
            };
            if i == 9 && b > 1 {
                return Err(self.fail_at(start, format!("varint {field} overflows u64")));
            }
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                if b == 0 && i > 0 {
                    return Err(self.fail_at(start, format!("varint {field} is not minimal")));
                }
                return Ok(v);
            }
        }
        // Only reachable for a tenth byte of 0 or 1 with its continuation bit set, caught above.
        Err(self.fail_at(start, format!("varint {field} overflows u64")))
    }

    /// A count of items that each take at least `min_bytes` of the remaining input; rejecting
    /// counts the input cannot hold bounds every allocation sized from it.
    fn count(&mut self, field: &str, min_bytes: usize) -> Result<usize> {
        let at = self.pos();
        let n = self.varint(field)?;
        let fits = self.remaining() / min_bytes.max(1);
        match usize::try_from(n) {
            Ok(n) if n <= fits => Ok(n),
            _ => Err(self.fail_at(
                at,
                format!(
                    "truncated: {field} is {n} but only {} bytes remain",
                    self.remaining()
                ),
            )),
        }
    }

    fn string(&mut self, field: &str, max_len: usize) -> Result<String> {
        let at = self.pos();
        let len = self.count(field, 1)?;
        if len > max_len {
            return Err(self.fail_at(
                at,
                format!("{field} is {len} bytes long, the limit is {max_len}"),
            ));
        }
        let raw = self.take(len, field)?;
        match std::str::from_utf8(raw) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(self
                .fail_at(at, format!("{field} is not valid UTF-8"))
                .with_source(e)),
        }
    }
}

#[cfg(test)]
mod tests;
