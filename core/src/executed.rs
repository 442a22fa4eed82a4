//! The rule every backend's execution log follows to name a read it executed, written once:
//! [`locate`] turns an address the backend actually read or wrote back into a region id and
//! an offset, so two backends executing the same plan log the same reads; [`read`] is the
//! log entry that names both sides of one read that way.

use crate::model::OwnerId;
use crate::transport::ReadDesc;

/// Where the `len` bytes at `addr` lie among `regions` (`(id, start address, length)` each):
/// `(prefer, offset)` if `prefer` holds them all (the region the read named, when one memory
/// is registered as several regions), else the lowest-numbered region that does, else
/// `(0, addr)` (no region holds them: the log shows the raw address, so a misdirected read
/// is visible instead of dropped).
pub fn locate(
    regions: impl IntoIterator<Item = (u64, u64, u64)>,
    addr: u64,
    len: u64,
    prefer: Option<u64>,
) -> (u64, u64) {
    let mut best: Option<(u64, u64)> = None;
    for (id, start, rlen) in regions {
        if addr < start || addr.saturating_add(len) > start.saturating_add(rlen) {
            continue;
        }
        if Some(id) == prefer {
            return (id, addr - start);
        }
        if best.is_none_or(|(b, _)| id < b) {
            best = Some((id, addr - start));
        }
    }
    best.unwrap_or((0, addr))
}

/// The log entry of one executed read: `len` bytes from `owner` at `remote` (region and
/// offset, found by [`locate`] among the peer's regions or by the backend's own lookup) into
/// the local region [`locate`] finds for `local_addr` among `locals` (preferring
/// `prefer_local`).
pub fn read(
    owner: OwnerId,
    remote: (u64, u64),
    locals: impl IntoIterator<Item = (u64, u64, u64)>,
    local_addr: u64,
    len: u64,
    prefer_local: Option<u64>,
) -> ReadDesc {
    let (remote_region, remote_offset) = remote;
    let (local_region, local_offset) = locate(locals, local_addr, len, prefer_local);
    ReadDesc {
        owner,
        remote_region,
        remote_offset,
        local_region,
        local_offset,
        len,
        remote_rows: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefers_the_named_region_then_the_lowest_id() {
        let regions = [(3, 100, 50), (2, 100, 50), (5, 120, 10)];
        assert_eq!(locate(regions, 120, 10, None), (2, 20));
        assert_eq!(locate(regions, 120, 10, Some(5)), (5, 0));
        assert_eq!(locate(regions, 120, 10, Some(3)), (3, 20));
        // A preferred region that does not hold the bytes is passed over.
        assert_eq!(locate(regions, 100, 30, Some(5)), (2, 0));
        assert_eq!(locate(regions, 140, 20, None), (0, 140));
        assert_eq!(locate(regions, u64::MAX, 1, None), (0, u64::MAX));
    }

    #[test]
    fn a_read_names_its_local_side_by_the_same_rule() {
        let locals = [(4, 1000, 100), (3, 1000, 100)];
        let r = read(7, (2, 16), locals, 1010, 8, None);
        assert_eq!(
            r,
            ReadDesc {
                owner: 7,
                remote_region: 2,
                remote_offset: 16,
                local_region: 3,
                local_offset: 10,
                len: 8,
                remote_rows: None,
            }
        );
        assert_eq!(read(7, (2, 16), locals, 1010, 8, Some(4)).local_region, 4);
        // No local region holds the bytes: the raw address shows.
        let r = read(7, (0, 5), locals, 50, 8, Some(4));
        assert_eq!((r.local_region, r.local_offset), (0, 50));
    }
}
