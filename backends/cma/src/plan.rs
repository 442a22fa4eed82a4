//! Translating a validated batch into system calls: each call reads from one process, moves at
//! most `piece_bytes`, and has at most `iovecs_per_call` iovecs on each side.
//!
//! `process_vm_readv` takes a list of remote ranges and a list of local ranges and copies the
//! concatenation of the first into the concatenation of the second, so the two lists need not
//! pair up: consecutive reads whose remote (or local) bytes are contiguous share one iovec on
//! that side. Many small reads of one owner thus become one call, which is where this backend
//! gets its speed; a read longer than what is left in a call continues in the next one.
//!
//! A gather read ([`RemoteRows`]) lands contiguously but is rows at a pitch at the source: its
//! local side is one range like any read's, its remote side one iovec per row (per row
//! fragment where a call starts or ends mid-row), cut by the contract's own
//! [`ReadDesc::remote_runs`]. Those iovecs count against `iovecs_per_call` like any other, so
//! a gather of more rows than fit one call continues in the next call, as a long read does.

use std::ops::Range;

use reshard_core::{RemoteRows, RemoteRuns};

use crate::sys::Span;

/// One contiguous part of a read inside one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seg {
    /// Index of the read in the batch.
    pub(crate) read: u32,
    /// Address in the peer process of the segment's first byte.
    pub(crate) remote: u64,
    /// Address in this process (the segment's bytes land contiguously from here).
    pub(crate) local: u64,
    /// Offset of the segment's first byte in its read.
    pub(crate) off: u64,
    pub(crate) len: u64,
    /// This segment ends its read: the call that moves it completes the read.
    pub(crate) last: bool,
    /// Where its read's bytes are in the peer process.
    pub(crate) src: Source,
}

/// Where a read's bytes are in the peer process: the address of its first byte and, for a
/// gather read, its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Source {
    /// Address of the read's byte 0.
    pub(crate) addr: u64,
    pub(crate) rows: Option<RemoteRows>,
}

impl Source {
    /// A contiguous source from `addr`.
    #[cfg(test)]
    pub(crate) fn at(addr: u64) -> Self {
        Source { addr, rows: None }
    }

    /// The contiguous source runs `(address, bytes)` of the read's bytes `from..to`: the
    /// contract's cut ([`RemoteRuns`]) from the address the read's first source byte is at.
    pub(crate) fn runs(self, from: u64, to: u64) -> impl Iterator<Item = (u64, u64)> {
        RemoteRuns::new(self.addr, self.rows, from, to).map(|(addr, _, n)| (addr, n))
    }
}

impl Seg {
    /// The source runs `(address, bytes)` of the segment's bytes `from..to` (offsets in the
    /// segment).
    pub(crate) fn runs(&self, from: u64, to: u64) -> impl Iterator<Item = (u64, u64)> {
        self.src.runs(self.off + from, self.off + to)
    }
}

/// One `process_vm_readv`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Call {
    /// Index of the peer (process) read from, in the prepared state.
    pub(crate) peer: u32,
    /// Its segments, in stream order, as a range of [`Calls::segs`].
    pub(crate) segs: Range<usize>,
    pub(crate) bytes: u64,
}

/// A read to translate: peer index, read index, where it is in the peer, local address,
/// length.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Wanted {
    pub(crate) peer: u32,
    pub(crate) read: u32,
    pub(crate) src: Source,
    pub(crate) local: u64,
    pub(crate) len: u64,
}

/// A batch as system calls.
#[derive(Debug, Default)]
pub(crate) struct Calls {
    pub(crate) segs: Vec<Seg>,
    pub(crate) calls: Vec<Call>,
}

/// Packs `wanted` into calls. Reads are grouped by peer first (stable, so batch order holds
/// within a peer), which lets more of them share calls; destinations are disjoint (the
/// contract), so the order calls run in never changes what lands.
pub(crate) fn translate(wanted: &[Wanted], piece_bytes: u64, iovecs: usize) -> Calls {
    let mut order: Vec<usize> = (0..wanted.len()).collect();
    order.sort_by_key(|&i| wanted[i].peer);
    let mut b = Builder {
        piece_bytes,
        iovecs,
        out: Calls::default(),
        open: None,
    };
    for i in order {
        b.push(&wanted[i]);
    }
    b.flush();
    b.out
}

/// The call being filled.
struct Open {
    peer: u32,
    start: usize,
    bytes: u64,
    remote: Vec<Span>,
    local: Vec<Span>,
}

struct Builder {
    piece_bytes: u64,
    iovecs: usize,
    out: Calls,
    open: Option<Open>,
}

/// Whether appending bytes at `addr` to `spans` takes a new iovec.
fn needs_new(spans: &[Span], addr: u64) -> bool {
    spans.last().is_none_or(|s| s.addr + s.len != addr)
}

/// Appends `len` bytes at `addr` to `spans`, extending the last span when contiguous.
fn append(spans: &mut Vec<Span>, addr: u64, len: u64) {
    match spans.last_mut() {
        Some(s) if s.addr + s.len == addr => s.len += len,
        _ => spans.push(Span { addr, len }),
    }
}

impl Builder {
    fn flush(&mut self) {
        if let Some(o) = self.open.take() {
            self.out.calls.push(Call {
                peer: o.peer,
                segs: o.start..self.out.segs.len(),
                bytes: o.bytes,
            });
        }
    }

    fn push(&mut self, w: &Wanted) {
        let mut off = 0u64;
        while off < w.len {
            if self.open.as_ref().is_some_and(|o| o.peer != w.peer) {
                self.flush();
            }
            let start = self.out.segs.len();
            let o = self.open.get_or_insert_with(|| Open {
                peer: w.peer,
                start,
                bytes: 0,
                remote: Vec::new(),
                local: Vec::new(),
            });
            let local = w.local + off;
            let room = self.piece_bytes - o.bytes;
            let iovecs = self.iovecs;
            let over =
                |spans: &[Span], addr| spans.len() + usize::from(needs_new(spans, addr)) > iovecs;
            if room == 0 || over(&o.local, local) {
                self.flush();
                continue;
            }
            // The source runs of what fits the call's bytes, while they fit its iovecs: one
            // run for a contiguous read, one per row (or row fragment) for a gather.
            let end = w.len.min(off + room);
            let mut remote = None;
            let mut take = 0u64;
            for (addr, n) in w.src.runs(off, end) {
                if over(&o.remote, addr) {
                    break;
                }
                append(&mut o.remote, addr, n);
                remote.get_or_insert(addr);
                take += n;
            }
            let Some(remote) = remote else {
                // Not even one more remote iovec fits: the read continues in a new call.
                self.flush();
                continue;
            };
            append(&mut o.local, local, take);
            o.bytes += take;
            off += take;
            self.out.segs.push(Seg {
                read: w.read,
                remote,
                local,
                off: off - take,
                len: take,
                last: off == w.len,
                src: w.src,
            });
        }
    }
}

/// The iovecs of `segs` after their first `skip` bytes, coalesced as the builder counted them
/// (so never more than the call's limit).
#[cfg(test)]
pub(crate) fn spans(segs: &[Seg], skip: u64) -> (Vec<Span>, Vec<Span>) {
    spans_upto(segs, skip, u64::MAX)
}

/// Like [`spans`], but at most `max` bytes (a block hashed right after it lands).
pub(crate) fn spans_upto(segs: &[Seg], skip: u64, max: u64) -> (Vec<Span>, Vec<Span>) {
    let mut remote = Vec::new();
    let mut local = Vec::new();
    let mut skip = skip;
    let mut left = max;
    for s in segs {
        if left == 0 {
            break;
        }
        if skip >= s.len {
            skip -= s.len;
            continue;
        }
        let n = (s.len - skip).min(left);
        for (addr, k) in s.runs(skip, skip + n) {
            append(&mut remote, addr, k);
        }
        append(&mut local, s.local + skip, n);
        left -= n;
        skip = 0;
    }
    (remote, local)
}

/// The segment holding byte `at` of the call's stream (the last one if `at` is past the end).
pub(crate) fn seg_at(segs: &[Seg], at: u64) -> Option<&Seg> {
    let mut acc = 0u64;
    for s in segs {
        acc += s.len;
        if at < acc {
            return Some(s);
        }
    }
    segs.last()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(peer: u32, read: u32, remote: u64, local: u64, len: u64) -> Wanted {
        Wanted {
            peer,
            read,
            src: Source::at(remote),
            local,
            len,
        }
    }

    /// Every byte of every read is in exactly one segment, in order, and every call keeps its
    /// limits; returns the calls.
    fn check(wanted: &[Wanted], piece: u64, iov: usize) -> Calls {
        let c = translate(wanted, piece, iov);
        for call in &c.calls {
            let segs = &c.segs[call.segs.clone()];
            assert!(!segs.is_empty());
            assert_eq!(call.bytes, segs.iter().map(|s| s.len).sum::<u64>());
            assert!(call.bytes <= piece);
            let (r, l) = spans(segs, 0);
            assert!(r.len() <= iov && l.len() <= iov, "{r:?} {l:?}");
            for s in segs {
                assert_eq!(wanted[s.read as usize].peer, call.peer);
            }
        }
        for (i, x) in wanted.iter().enumerate() {
            let mine: Vec<&Seg> = c.segs.iter().filter(|s| s.read == i as u32).collect();
            let mut off = 0;
            for (k, s) in mine.iter().enumerate() {
                let first = x.src.runs(off, off + 1).next().unwrap().0;
                assert_eq!((s.remote, s.local), (first, x.local + off));
                assert_eq!(s.off, off, "the segment's offset in its read");
                off += s.len;
                assert_eq!(s.last, k + 1 == mine.len());
            }
            assert_eq!(off, x.len, "read {i} covered once");
        }
        c
    }

    #[test]
    fn small_reads_of_one_peer_share_calls_and_big_ones_are_cut() {
        let mut v: Vec<Wanted> = (0..3000)
            .map(|i| {
                w(
                    0,
                    i,
                    0x10_0000 + 64 * i as u64 * 2,
                    0x90_0000 + 64 * i as u64,
                    64,
                )
            })
            .collect();
        v.push(w(0, 3000, 0x1000_0000, 0x2000_0000, 10 << 20));
        let c = check(&v, 4 << 20, 1024);
        // 3000 scattered remote reads need 3 calls of <= 1024 remote iovecs (the local side
        // is contiguous); the 10 MiB read fills the rest of the third and continues in two
        // more calls of at most 4 MiB.
        assert_eq!(c.calls.len(), 5, "{:?}", c.calls);
        assert_eq!(c.calls[2].segs.len(), 3000 - 2048 + 1);
        let one = check(&v, 4 << 20, 1);
        assert!(one.calls.len() >= 3000);
    }

    /// A gather of `rows` rows of `row` bytes at `pitch` from `remote`.
    fn g(read: u32, remote: u64, local: u64, rows: u64, row: u64, pitch: u64) -> Wanted {
        Wanted {
            src: Source {
                addr: remote,
                rows: Some(RemoteRows {
                    row_bytes: row,
                    pitch,
                }),
            },
            ..w(0, read, remote, local, rows * row)
        }
    }

    /// The source addresses of every byte the calls read for read `read`, in landing order,
    /// from the calls' remote iovecs (what the kernel is asked for).
    fn source_bytes(c: &Calls, read: u32) -> Vec<u64> {
        let mut out = Vec::new();
        for call in &c.calls {
            let segs = &c.segs[call.segs.clone()];
            let (remote, _) = spans(segs, 0);
            let mut addrs = remote.iter().flat_map(|s| s.addr..s.addr + s.len);
            for s in segs {
                let mine: Vec<u64> = addrs.by_ref().take(s.len as usize).collect();
                if s.read == read {
                    out.extend(mine);
                }
            }
        }
        out
    }

    #[test]
    fn a_gather_is_one_remote_iovec_per_row_and_continues_in_the_next_call() {
        // 3000 rows of 16 bytes every 64: one remote iovec each, so 3 calls of at most 1024
        // iovecs; the local side is one range per call.
        let v = [g(0, 0x10_0000, 0x90_0000, 3000, 16, 64)];
        let c = check(&v, 8 << 20, 1024);
        assert_eq!(c.calls.len(), 3, "{:?}", c.calls);
        for call in &c.calls {
            let (r, l) = spans(&c.segs[call.segs.clone()], 0);
            assert_eq!(l.len(), 1);
            assert!(r.len() <= 1024);
        }
        let want: Vec<u64> = (0..3000u64)
            .flat_map(|i| 0x10_0000 + 64 * i..0x10_0000 + 64 * i + 16)
            .collect();
        assert_eq!(source_bytes(&c, 0), want);
        // Calls of 40 bytes cut rows in the middle: each piece starts and ends mid-row.
        let v = [g(0, 1000, 0x9000, 10, 16, 50)];
        let c = check(&v, 40, 1024);
        assert_eq!(c.calls.len(), 4);
        let want: Vec<u64> = (0..10u64)
            .flat_map(|i| 1000 + 50 * i..1000 + 50 * i + 16)
            .collect();
        assert_eq!(source_bytes(&c, 0), want);
        // After 13 bytes of the second call (bytes 40..80 of the read: row 2 from column 8),
        // the remote iovecs resume at row 3, column 5.
        let segs = &c.segs[c.calls[1].segs.clone()];
        let (r, l) = spans(segs, 13);
        assert_eq!(
            r[0],
            Span {
                addr: 1000 + 150 + 5,
                len: 11
            }
        );
        assert_eq!(
            l,
            [Span {
                addr: 0x9000 + 53,
                len: 27
            }]
        );
    }

    #[test]
    fn a_gather_at_a_pitch_of_its_row_is_one_iovec_and_mixes_with_plain_reads() {
        let v = [
            w(0, 0, 0x5000, 0x9000, 100),
            g(1, 0x1_0000, 0x9000 + 100, 5000, 8, 8),
            w(0, 2, 0x2_0000, 0x9000 + 40_100, 100),
            g(3, 0x3_0000, 0x9000 + 40_200, 3, 4, 1000),
        ];
        let c = check(&v, 8 << 20, 8);
        assert_eq!(c.calls.len(), 1, "{:?}", c.calls);
        let (r, l) = spans(&c.segs, 0);
        // Rows that touch coalesce: the 5000-row gather is one iovec.
        assert_eq!(
            r[1],
            Span {
                addr: 0x1_0000,
                len: 40_000
            }
        );
        assert_eq!(r.len(), 6);
        assert_eq!(l.len(), 1);
        assert_eq!(
            source_bytes(&c, 2),
            (0x2_0000..0x2_0000 + 100).collect::<Vec<_>>()
        );
        let want: Vec<u64> = (0..3u64)
            .flat_map(|i| 0x3_0000 + 1000 * i..0x3_0000 + 1000 * i + 4)
            .collect();
        assert_eq!(source_bytes(&c, 3), want);
    }

    #[test]
    fn contiguous_reads_coalesce_into_one_iovec() {
        let v: Vec<Wanted> = (0..5000)
            .map(|i| w(0, i, 0x1000 + 8 * i as u64, 0x100_0000 + 8 * i as u64, 8))
            .collect();
        let c = check(&v, 8 << 20, 1);
        assert_eq!(c.calls.len(), 1);
    }

    #[test]
    fn peers_are_grouped() {
        let v = [
            w(0, 0, 0x1000, 0x9000, 16),
            w(1, 1, 0x1000, 0x9010, 16),
            w(0, 2, 0x1010, 0x9020, 16),
        ];
        let c = check(&v, 4096, 8);
        assert_eq!(c.calls.len(), 2);
        let reads: Vec<u32> = c.segs.iter().map(|s| s.read).collect();
        assert_eq!(reads, [0, 2, 1], "batch order within a peer");
    }

    #[test]
    fn spans_after_a_short_read_and_the_segment_at_a_byte() {
        let segs = [
            Seg {
                read: 0,
                remote: 100,
                local: 1000,
                off: 0,
                len: 10,
                last: true,
                src: Source::at(100),
            },
            Seg {
                read: 1,
                remote: 500,
                local: 1010,
                off: 0,
                len: 10,
                last: true,
                src: Source::at(500),
            },
        ];
        let (r, l) = spans(&segs, 13);
        assert_eq!(r, [Span { addr: 503, len: 7 }]);
        assert_eq!(l, [Span { addr: 1013, len: 7 }]);
        assert_eq!(seg_at(&segs, 9).unwrap().read, 0);
        assert_eq!(seg_at(&segs, 10).unwrap().read, 1);
        assert_eq!(seg_at(&segs, 99).unwrap().read, 1);
        // At most 6 bytes from byte 7: the last 3 of the first segment, 3 of the second.
        let (r, l) = spans_upto(&segs, 7, 6);
        assert_eq!(r, [Span { addr: 107, len: 3 }, Span { addr: 500, len: 3 }]);
        assert_eq!(l, [Span { addr: 1007, len: 6 }]);
    }
}
