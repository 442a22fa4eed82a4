//! The read checks every backend's [`Transport::prepare`](crate::Transport::prepare) runs,
//! written once: [`validate_batch`] checks a [`ReadBatch`] against the regions a backend's
//! loaded peers advertise and its own registrations, and returns the typed error the
//! [`Transport`](crate::Transport) contract promises (kind, owner, byte range, backend).
//! Backends keep only the checks that are really theirs (batch-size limits of their wire
//! library, endpoints they lost, mappings they verify).

use std::ops::Range;

use crate::error::{Error, ErrorKind, Result};
use crate::memory::MemoryBlock;
use crate::model::{MemoryKind, OwnerId};
use crate::overlap::{first_overlap_of, space, Span};
use crate::transport::{ReadBatch, ReadDesc, RemoteRows};

/// What a backend knows about a remote region a read names, from its loaded peer metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteLookup {
    /// The owner's metadata was never loaded (or was dropped).
    NoPeer,
    /// The owner is loaded but advertises no region with this id.
    NoRegion,
    /// The region the owner advertises, of this many bytes.
    Len(u64),
}

/// The look-up [`validate_batch`] wants for a remote region: `peer` is the owner's loaded
/// metadata (`None`: never loaded), `region_len` the length of the region it advertises
/// (`None`: not advertised).
pub fn remote_lookup<P>(
    peer: Option<P>,
    region_len: impl FnOnce(P) -> Option<u64>,
) -> RemoteLookup {
    match peer {
        None => RemoteLookup::NoPeer,
        Some(p) => region_len(p).map_or(RemoteLookup::NoRegion, RemoteLookup::Len),
    }
}

/// What a backend knows about one of its own registered regions: enough to check a read's
/// range and to compare destinations by address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalLookup {
    /// Bytes in the region.
    pub len: u64,
    /// Address of its first byte (host or device, as `kind` says).
    pub addr: u64,
    /// The memory it lies in.
    pub kind: MemoryKind,
}

impl LocalLookup {
    /// The look-up of a registered block.
    pub fn of(block: &dyn MemoryBlock) -> Self {
        LocalLookup {
            len: block.len() as u64,
            addr: block.addr() as u64,
            kind: block.kind(),
        }
    }
}

/// `off..off + len`, saturating: the byte range errors name, even for a read that overflows.
pub fn span(off: u64, len: u64) -> Range<u64> {
    off..off.saturating_add(len)
}

/// Checks every read of `batch`, in order, and returns the first violation:
///
/// 1. zero length: `OutOfBounds`;
/// 2. owner not loaded (`remote` says [`RemoteLookup::NoPeer`]): `PeerUnknown`;
/// 3. remote region not advertised: `OutOfBounds`;
/// 4. a malformed gather ([`RemoteRows`]: empty rows, a length no multiple of them, rows
///    closer than their length): `InvalidInput`; remote range (a gather's whole span) past the
///    region's end, or overflowing: `OutOfBounds`;
/// 5. local region not registered (`local` says `None`), local range past its end or
///    overflowing: `OutOfBounds`;
/// 6. two reads writing the same local bytes, compared by address (one memory registered as
///    two regions is one destination): `InvalidInput` naming both reads, the later read's
///    owner and its local bytes that the earlier one writes too ([`crate::overlap`]: a backend
///    only ever receives disjoint destinations; callers split overlapping reads into waves).
///
/// Every error names the read's owner, the byte range concerned (remote for 1-4, local for 5-6)
/// and `backend`; its message names the read index, the region and the lengths. `remote`
/// answers for `(owner, remote region)`, `local` for a local region; `agent` (this endpoint's
/// name) is only for messages. Consecutive reads of the same regions are looked up once; check
/// 6 sorts the destinations once (`O(n log n)` at prepare, whose result backends cache).
pub fn validate_batch(
    backend: &'static str,
    agent: &str,
    batch: &ReadBatch,
    mut remote: impl FnMut(OwnerId, u64) -> RemoteLookup,
    mut local: impl FnMut(u64) -> Option<LocalLookup>,
) -> Result<()> {
    let err = |kind: ErrorKind, r: &ReadDesc, range: Range<u64>, msg: String| {
        Error::new(kind, msg)
            .with_owner(r.owner)
            .with_range(range)
            .with_backend(backend)
    };
    // (owner, region, what `remote` said) of the previous read; (region, len) likewise.
    let mut last_remote: Option<(OwnerId, u64, RemoteLookup)> = None;
    let mut last_local: Option<(u64, Option<LocalLookup>)> = None;
    // Destinations by address, for check 6.
    let mut spans: Vec<Span> = Vec::with_capacity(batch.reads.len());
    for (i, r) in batch.reads.iter().enumerate() {
        let rrange = span(r.remote_offset, r.remote_span().unwrap_or(r.len));
        if r.len == 0 {
            let msg = format!("read {i} has zero length");
            return Err(err(ErrorKind::OutOfBounds, r, rrange, msg));
        }
        if let Some(RemoteRows { row_bytes, pitch }) = r.remote_rows {
            if row_bytes == 0 || r.len % row_bytes != 0 || pitch < row_bytes {
                let msg = format!(
                    "read {i}: gather of {} bytes in rows of {row_bytes} bytes at a pitch of \
                     {pitch} (rows must be non-empty, divide the read and not overlap)",
                    r.len
                );
                return Err(err(ErrorKind::InvalidInput, r, rrange, msg));
            }
        }
        let found = match last_remote {
            Some((o, g, found)) if (o, g) == (r.owner, r.remote_region) => found,
            _ => {
                let found = remote(r.owner, r.remote_region);
                last_remote = Some((r.owner, r.remote_region, found));
                found
            }
        };
        let rlen = match found {
            RemoteLookup::Len(len) => len,
            RemoteLookup::NoPeer => {
                let msg = format!(
                    "read {i} names owner {} whose metadata was never loaded",
                    r.owner
                );
                return Err(err(ErrorKind::PeerUnknown, r, rrange, msg));
            }
            RemoteLookup::NoRegion => {
                let msg = format!(
                    "read {i}: owner {} has no region {}",
                    r.owner, r.remote_region
                );
                return Err(err(ErrorKind::OutOfBounds, r, rrange, msg));
            }
        };
        let end = r.remote_span().and_then(|n| r.remote_offset.checked_add(n));
        if end.is_none_or(|e| e > rlen) {
            let msg = format!(
                "read {i}: bytes {}..{} outside region {} of owner {} ({rlen} bytes)",
                rrange.start, rrange.end, r.remote_region, r.owner
            );
            return Err(err(ErrorKind::OutOfBounds, r, rrange, msg));
        }
        let lrange = span(r.local_offset, r.len);
        let found = match last_local {
            Some((g, found)) if g == r.local_region => found,
            _ => {
                let found = local(r.local_region);
                last_local = Some((r.local_region, found));
                found
            }
        };
        let Some(LocalLookup {
            len: llen,
            addr,
            kind,
        }) = found
        else {
            let msg = format!(
                "read {i}: local region {} is not registered on agent {agent:?}",
                r.local_region
            );
            return Err(err(ErrorKind::OutOfBounds, r, lrange, msg));
        };
        if r.local_offset.checked_add(r.len).is_none_or(|e| e > llen) {
            let msg = format!(
                "read {i}: local bytes {}..{} outside local region {} ({llen} bytes)",
                lrange.start, lrange.end, r.local_region
            );
            return Err(err(ErrorKind::OutOfBounds, r, lrange, msg));
        }
        let start = addr.saturating_add(r.local_offset);
        spans.push((space(kind), start, start.saturating_add(r.len), i));
    }
    if let Some((i, j)) = first_overlap_of(&mut spans) {
        // Spans are sorted now; find both again to name the shared bytes in `j`'s region.
        let at = |k: usize| spans.iter().find(|s| s.3 == k).copied();
        let (Some((_, sa, ea, _)), Some((_, sb, eb, _))) = (at(i), at(j)) else {
            let msg = "the overlapping reads' spans went missing";
            return Err(Error::new(ErrorKind::Internal, msg).with_backend(backend));
        };
        let b = &batch.reads[j];
        let off = b.local_offset + (sa.max(sb) - sb);
        let both = off..off + (ea.min(eb) - sa.max(sb));
        let msg = format!(
            "reads {i} and {j} write the same local bytes ({} bytes from byte {} of local \
             region {}; read {i} writes local region {}): destinations of one batch must be \
             disjoint (split overlapping reads into waves with \
             reshard_core::overlap::disjoint_waves and post them one after another)",
            both.end - both.start,
            both.start,
            b.local_region,
            batch.reads[i].local_region
        );
        return Err(err(ErrorKind::InvalidInput, b, both, msg));
    }
    Ok(())
}

/// The error for a look-up that [`validate_batch`] already proved succeeds, failing anyway in
/// a backend's translation (a bug, never the caller's fault): `Internal`, naming read `i`'s
/// owner and remote range, and `what` was missing.
pub fn validated_lookup_failed(backend: &'static str, i: usize, r: &ReadDesc, what: &str) -> Error {
    Error::new(
        ErrorKind::Internal,
        format!("read {i}: {what} missing after the batch was validated"),
    )
    .with_owner(r.owner)
    .with_range(span(r.remote_offset, r.len))
    .with_backend(backend)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// Owner 1 advertises region 10 of 100 bytes and region 11 of `u64::MAX` bytes; owner 2
    /// is loaded with no regions; local region 5 has 50 bytes, local region 6 `u64::MAX`.
    fn remote(owner: OwnerId, region: u64) -> RemoteLookup {
        match (owner, region) {
            (1, 10) => RemoteLookup::Len(100),
            (1, 11) => RemoteLookup::Len(u64::MAX),
            (1 | 2, _) => RemoteLookup::NoRegion,
            _ => RemoteLookup::NoPeer,
        }
    }

    /// Local region 5: 50 host bytes at 0x1000; 8: the same memory registered again; 6:
    /// `u64::MAX` bytes of device memory.
    fn local(region: u64) -> Option<LocalLookup> {
        let host = |len| LocalLookup {
            len,
            addr: 0x1000,
            kind: MemoryKind::Dram,
        };
        match region {
            5 | 8 => Some(host(50)),
            6 => Some(LocalLookup {
                len: u64::MAX,
                addr: 0,
                kind: MemoryKind::Vram { device: 0 },
            }),
            _ => None,
        }
    }

    fn read(owner: OwnerId, remote_region: u64, remote_offset: u64, len: u64) -> ReadDesc {
        ReadDesc {
            owner,
            remote_region,
            remote_offset,
            local_region: 5,
            local_offset: 0,
            len,
            remote_rows: None,
        }
    }

    fn check(reads: Vec<ReadDesc>) -> Result<()> {
        validate_batch("test", "rx", &ReadBatch { reads }, remote, local)
    }

    /// Asserts kind, owner, range and backend of the error for a batch whose last read is bad
    /// (after one good read, so the index in the message is 1); returns the message.
    fn refused(bad: ReadDesc, kind: ErrorKind, range: Range<u64>) -> String {
        let e = check(vec![read(1, 10, 0, 10), bad]).expect_err("refused");
        assert_eq!(e.kind(), kind, "{e}");
        assert_eq!(e.context().owner, Some(bad.owner), "{e}");
        assert_eq!(e.context().range, Some(range), "{e}");
        assert_eq!(e.context().backend.as_deref(), Some("test"), "{e}");
        assert!(e.message().starts_with("read 1"), "{e}");
        e.message().to_owned()
    }

    #[test]
    fn good_batches_pass() {
        check(vec![
            ReadDesc {
                local_region: 6,
                ..read(1, 10, 0, 100)
            },
            read(1, 10, 99, 1),
            ReadDesc {
                local_region: 6,
                local_offset: 100,
                ..read(1, 11, u64::MAX - 50, 50)
            },
            ReadDesc {
                local_offset: 49,
                ..read(1, 10, 0, 1)
            },
        ])
        .unwrap();
        check(vec![]).unwrap();
    }

    #[test]
    fn zero_length_is_out_of_bounds() {
        let m = refused(read(1, 10, 7, 0), ErrorKind::OutOfBounds, 7..7);
        assert!(m.contains("zero length"), "{m}");
        // Even for an owner nobody loaded: zero length is checked first.
        refused(read(9, 10, 7, 0), ErrorKind::OutOfBounds, 7..7);
    }

    #[test]
    fn unknown_owner_is_peer_unknown_with_its_remote_range() {
        let m = refused(read(9, 10, 30, 4), ErrorKind::PeerUnknown, 30..34);
        assert!(m.contains("owner 9") && m.contains("never loaded"), "{m}");
    }

    #[test]
    fn unknown_remote_region_is_out_of_bounds() {
        let m = refused(read(2, 10, 0, 4), ErrorKind::OutOfBounds, 0..4);
        assert!(m.contains("has no region 10"), "{m}");
        refused(read(1, 12, 0, 4), ErrorKind::OutOfBounds, 0..4);
    }

    #[test]
    fn remote_range_past_the_end_is_out_of_bounds() {
        let m = refused(read(1, 10, 90, 11), ErrorKind::OutOfBounds, 90..101);
        assert!(m.contains("region 10") && m.contains("(100 bytes)"), "{m}");
    }

    fn gather(remote_offset: u64, len: u64, row_bytes: u64, pitch: u64) -> ReadDesc {
        ReadDesc {
            remote_rows: Some(RemoteRows { row_bytes, pitch }),
            ..read(1, 10, remote_offset, len)
        }
    }

    #[test]
    fn a_gather_is_checked_over_its_whole_source_span() {
        // Rows 0..4, 30..34, 60..64, 90..94: the span ends at byte 94 of 100.
        check(vec![
            read(1, 10, 0, 10),
            ReadDesc {
                local_offset: 10,
                ..gather(0, 16, 4, 30)
            },
        ])
        .unwrap();
        // Three rows of 4 at pitch 48 from byte 8 end at 8 + 96 + 4 = 108 > 100, although the
        // 12 bytes it moves would fit from byte 8.
        let m = refused(gather(8, 12, 4, 48), ErrorKind::OutOfBounds, 8..108);
        assert!(m.contains("bytes 8..108 outside region 10"), "{m}");
        // A span that overflows u64 is out of bounds too.
        let e = check(vec![ReadDesc {
            remote_region: 11,
            ..gather(0, 8, 4, u64::MAX)
        }])
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    }

    #[test]
    fn a_malformed_gather_is_invalid_input() {
        for (len, row, pitch) in [(8, 0, 4), (10, 4, 8), (8, 4, 3)] {
            let m = refused(gather(0, len, row, pitch), ErrorKind::InvalidInput, 0..len);
            assert!(m.contains("gather"), "{m}");
        }
        // Pitch equal to the row: a contiguous read written as a gather is fine.
        check(vec![gather(0, 50, 10, 10)]).unwrap();
    }

    #[test]
    fn remote_runs_cut_a_gather_at_rows() {
        let g = gather(5, 12, 4, 10);
        assert_eq!(g.remote_span(), Some(24));
        let runs: Vec<_> = g.remote_runs(0, 12).collect();
        assert_eq!(runs, [(5, 0, 4), (15, 4, 4), (25, 8, 4)]);
        // A piece from the middle of a row to the middle of another.
        let runs: Vec<_> = g.remote_runs(2, 9).collect();
        assert_eq!(runs, [(7, 2, 2), (15, 4, 4), (25, 8, 1)]);
        assert_eq!(g.remote_runs(12, 12).count(), 0);
        // A contiguous read is one run.
        let c = read(1, 10, 5, 12);
        assert_eq!(c.remote_runs(3, 12).collect::<Vec<_>>(), [(8, 3, 9)]);
        assert_eq!(c.remote_span(), Some(12));
    }

    #[test]
    fn remote_overflow_at_u64_max_is_out_of_bounds() {
        // The region is u64::MAX bytes long, so only the overflow check can refuse this read.
        let m = refused(
            read(1, 11, u64::MAX, 1),
            ErrorKind::OutOfBounds,
            u64::MAX..u64::MAX,
        );
        assert!(m.contains("outside region 11"), "{m}");
        refused(
            read(1, 11, 2, u64::MAX - 1),
            ErrorKind::OutOfBounds,
            2..u64::MAX,
        );
    }

    #[test]
    fn unknown_local_region_is_out_of_bounds_with_the_local_range() {
        let bad = ReadDesc {
            local_region: 7,
            local_offset: 3,
            ..read(1, 10, 0, 4)
        };
        let m = refused(bad, ErrorKind::OutOfBounds, 3..7);
        assert!(m.contains("local region 7") && m.contains("\"rx\""), "{m}");
    }

    #[test]
    fn local_range_past_the_end_is_out_of_bounds() {
        let bad = ReadDesc {
            local_offset: 45,
            ..read(1, 10, 0, 6)
        };
        let m = refused(bad, ErrorKind::OutOfBounds, 45..51);
        assert!(
            m.contains("local region 5") && m.contains("(50 bytes)"),
            "{m}"
        );
    }

    #[test]
    fn local_overflow_at_u64_max_is_out_of_bounds() {
        let bad = ReadDesc {
            local_region: 6,
            local_offset: u64::MAX,
            ..read(1, 10, 0, 1)
        };
        let m = refused(bad, ErrorKind::OutOfBounds, u64::MAX..u64::MAX);
        assert!(m.contains("local region 6"), "{m}");
    }

    #[test]
    fn the_first_bad_read_is_named() {
        let e = check(vec![
            read(1, 10, 0, 1),
            read(1, 10, 200, 1),
            read(9, 10, 0, 1),
        ])
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
        assert!(e.message().starts_with("read 1:"), "{e}");
    }

    #[test]
    fn consecutive_reads_of_one_region_are_looked_up_once() {
        let (remotes, locals) = (Cell::new(0), Cell::new(0));
        let batch = ReadBatch {
            reads: [(10, 0), (10, 1), (11, 0), (10, 2)]
                .into_iter()
                .enumerate()
                .map(|(i, (g, off))| ReadDesc {
                    local_offset: i as u64,
                    ..read(1, g, off, 1)
                })
                .collect(),
        };
        validate_batch(
            "test",
            "rx",
            &batch,
            |o, g| {
                remotes.set(remotes.get() + 1);
                remote(o, g)
            },
            |g| {
                locals.set(locals.get() + 1);
                local(g)
            },
        )
        .unwrap();
        assert_eq!((remotes.get(), locals.get()), (3, 1));
    }

    #[test]
    fn overlapping_destinations_are_invalid_input_naming_both_reads() {
        // Reads 1 and 3 both write local bytes 6..8 of region 5; read 2 is in region 6.
        let at = |off: u64, len: u64, g: u64| ReadDesc {
            local_region: g,
            local_offset: off,
            ..read(1, 10, 0, len)
        };
        let e = check(vec![at(0, 2, 5), at(4, 4, 5), at(4, 4, 6), at(6, 4, 5)]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
        assert_eq!(e.context().range, Some(6..8), "{e}");
        assert_eq!(e.context().owner, Some(1), "{e}");
        assert_eq!(e.context().backend.as_deref(), Some("test"), "{e}");
        assert!(
            e.message().starts_with("reads 1 and 3") && e.message().contains("region 5"),
            "{e}"
        );
        // Touching is not overlapping; per-read errors still come first.
        check(vec![at(0, 4, 5), at(4, 4, 5)]).unwrap();
        // One memory registered twice: reads into both regions overlap by address, and the
        // range is in the later read's region.
        let e = check(vec![at(0, 4, 5), at(2, 4, 8)]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
        assert_eq!(e.context().range, Some(2..4), "{e}");
        assert!(e.message().contains("local region 8"), "{e}");
        check(vec![at(0, 4, 5), at(4, 4, 8)]).unwrap();
        let e = check(vec![at(0, 4, 5), at(0, 4, 5), at(49, 4, 5)]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    }

    #[test]
    fn lookup_failures_after_validation_are_internal() {
        let r = read(3, 10, 8, 8);
        let e = validated_lookup_failed("test", 4, &r, "peer");
        assert_eq!(e.kind(), ErrorKind::Internal);
        assert_eq!(e.context().owner, Some(3));
        assert_eq!(e.context().range, Some(8..16));
        assert!(e.message().starts_with("read 4: peer"), "{e}");
    }
}
