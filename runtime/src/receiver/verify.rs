//! Checks of what arrived, before the swap: the wire leg's byte count and throughput ceiling,
//! and installed bytes against the publishers' digests (whole offers or row chunks).

use rayon::prelude::*;
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::Instant;

use reshard_core::{
    ChunkDigests, Dest, Digest, Error, ErrorKind, HostBuffer, OwnerId, Plan, Result, ShardTable,
    WireReport,
};

/// The wire-leg guards, before anything is re-sliced or installed: the backend must have moved
/// every `planned` byte, and no faster than the fabric ceiling `max_wire_gbps` (a faster leg
/// moved nothing real). Returns the wire rate in GB/s (10^9 bytes per second).
pub(super) fn guard_wire(
    wire: &WireReport,
    planned: u64,
    wire_t0: Instant,
    max_wire_gbps: Option<f64>,
    backend: &str,
) -> Result<f64> {
    // A backend that says it finished must have moved every planned byte; a short count
    // is a bug or a lie that digests would only catch when verification is on.
    if wire.bytes != planned {
        return Err(Error::new(
            ErrorKind::Transport,
            format!(
                "the transport reported {} bytes moved of the {planned} planned; refusing \
                 to install",
                wire.bytes
            ),
        )
        .with_backend(backend));
    }
    let wire_s = wire_t0.elapsed().as_secs_f64();
    let gbytes = if wire_s > 0.0 {
        wire.bytes as f64 / wire_s / 1e9
    } else {
        f64::INFINITY
    };
    if let Some(max) = max_wire_gbps {
        let gbits = gbytes * 8.0;
        if gbits > max {
            return Err(Error::new(
                ErrorKind::Guard,
                format!(
                    "wire leg moved {} bytes at {gbits:.1} Gbit/s, above the fabric ceiling \
                     of {max} Gbit/s: nothing real moved; refusing to install",
                    wire.bytes
                ),
            )
            .with_backend(backend));
        }
    }
    Ok(gbytes)
}

/// Hashes a check's rows in order, as if they were contiguous (streaming XXH3-128 equals the
/// one-shot digest of the concatenation).
fn gather_digest(bytes: &[u8], c: &reshard_core::DigestCheck) -> Option<Digest> {
    let at = |i: u64| {
        let s = c.dst_offset.checked_add(i.checked_mul(c.row_stride)?)? as usize;
        bytes.get(s..s.checked_add(c.row_bytes as usize)?)
    };
    if c.rows == 1 || c.row_stride == c.row_bytes {
        let s = c.dst_offset as usize;
        return bytes
            .get(s..s.checked_add(c.bytes() as usize)?)
            .map(Digest::of);
    }
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for i in 0..c.rows {
        h.update(at(i)?);
    }
    Some(Digest(h.digest128().to_le_bytes()))
}

/// The owner's bytes a digest check covers: the whole offer, or chunk `k`'s rows of it (chunk
/// checks cover whole offer rows, so a source row is `row_bytes` long).
fn checked_source_range(
    c: &reshard_core::DigestCheck,
    chunks: Option<&ChunkDigests>,
) -> std::ops::Range<u64> {
    let start = match (c.chunk, chunks) {
        (Some(k), Some(ch)) => c.src_offset + u64::from(k) * ch.rows * c.row_bytes,
        _ => c.src_offset,
    };
    start..start + c.bytes()
}

#[derive(Default)]
pub(super) struct Verdict {
    pub(super) passed: u64,
    pub(super) bytes: u64,
    pub(super) without_digest: u64,
}

pub(super) fn verify(
    plan: &Plan,
    tables: &[ShardTable],
    params: &[Arc<HostBuffer>],
    staging: &[Arc<HostBuffer>],
) -> Result<Verdict> {
    // This step's digests, straight from the tables (the cached merged view has old ones).
    type Digests<'a> = (Option<Digest>, Option<&'a ChunkDigests>);
    let mut offers: FxHashMap<(OwnerId, u64, u64), Digests<'_>> = FxHashMap::default();
    for t in tables {
        for o in &t.offers {
            offers.insert(
                (t.publisher.rank, o.location.region, o.location.offset),
                (o.digest, o.chunks.as_ref()),
            );
        }
    }
    let results: Vec<Result<Option<u64>>> = plan
        .checks
        .par_iter()
        .map(|c| {
            let offer = offers.get(&(c.owner, c.src_region, c.src_offset));
            let want = offer.and_then(|(digest, chunks)| match c.chunk {
                None => *digest,
                Some(k) => chunks.and_then(|ch| ch.digests.get(k as usize).copied()),
            });
            let Some(want) = want else {
                return Ok(None);
            };
            let buf = match c.dst {
                Dest::Param(i) => &params[i as usize],
                Dest::Staging(i) => &staging[i as usize],
            };
            let bytes = buf.read();
            let got = gather_digest(&bytes, c).ok_or_else(|| {
                Error::new(ErrorKind::Internal, "digest check outside its buffer")
                    .with_tensor(plan.tensors[c.tensor as usize].clone())
            })?;
            if got != want {
                let what = match c.chunk {
                    None => "the offer".to_string(),
                    Some(k) => format!("row chunk {k} of the offer"),
                };
                return Err(Error::new(
                    ErrorKind::Verification,
                    format!(
                        "received bytes of {what} hash to {}.. but the publisher's digest is \
                         {}..; live weights left untouched",
                        got.prefix(12),
                        want.prefix(12)
                    ),
                )
                .with_tensor(plan.tensors[c.tensor as usize].clone())
                .with_owner(c.owner)
                .with_range(checked_source_range(c, offer.and_then(|(_, ch)| *ch))));
            }
            Ok(Some(c.bytes()))
        })
        .collect();
    let mut v = Verdict::default();
    for r in results {
        match r? {
            Some(len) => {
                v.passed += 1;
                v.bytes += len;
            }
            None => v.without_digest += 1,
        }
    }
    Ok(v)
}
