//! The rule every backend's execution log follows to name a read it executed, written once:
//! [`locate`] turns an address the backend actually read or wrote back into a region id and
//! an offset, so two backends executing the same plan log the same reads.

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
}
