//! The mappings the kernel actually has in this process (`/proc/self/maps`), to check the
//! pointers `ucp_rkey_ptr` returns: UCX computes them as remote address plus a fixed offset
//! and compares them with nothing, so a stale or hostile base or length in a peer's metadata
//! would otherwise turn into a read of arbitrary memory of this process.

use std::ops::Range;

/// One line of `/proc/self/maps`: an address range and whether it is a shared mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mapping {
    pub(crate) range: Range<usize>,
    /// `s` in the permissions column: a shared mapping (System V or POSIX shared memory, a
    /// shared file mapping), as UCX's sysv/posix transports create for peers' segments.
    pub(crate) shared: bool,
    pub(crate) readable: bool,
}

/// A snapshot of this process's mappings, ascending by address.
#[derive(Debug, Clone, Default)]
pub(crate) struct Maps(Vec<Mapping>);

impl Maps {
    /// Reads `/proc/self/maps`; an unreadable file gives no mappings (every check fails, and
    /// reads fall back to `ucp_get_nbx` or are refused).
    pub(crate) fn read() -> Maps {
        match std::fs::read_to_string("/proc/self/maps") {
            Ok(text) => Maps::parse(&text),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read /proc/self/maps");
                Maps::default()
            }
        }
    }

    /// Parses the text of a maps file, skipping malformed lines.
    pub(crate) fn parse(text: &str) -> Maps {
        let mut v: Vec<Mapping> = text
            .lines()
            .filter_map(|line| {
                let mut cols = line.split_ascii_whitespace();
                let (start, end) = cols.next()?.split_once('-')?;
                let perms = cols.next()?.as_bytes();
                let start = usize::from_str_radix(start, 16).ok()?;
                let end = usize::from_str_radix(end, 16).ok()?;
                (start < end && perms.len() >= 4).then(|| Mapping {
                    range: start..end,
                    shared: perms[3] == b's',
                    readable: perms[0] == b'r',
                })
            })
            .collect();
        v.sort_unstable_by_key(|m| m.range.start);
        Maps(v)
    }

    /// The one mapping holding both `first` and `last` (inclusive), if any.
    pub(crate) fn containing(&self, first: usize, last: usize) -> Option<&Mapping> {
        if last < first {
            return None;
        }
        let i = self.0.partition_point(|m| m.range.start <= first);
        let m = self.0.get(i.checked_sub(1)?)?;
        (m.range.contains(&first) && m.range.contains(&last)).then_some(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000100000 rw-s 00000000 00:01 42                         /SYSV00000000 (deleted)
7f0000100000-7f0000200000 rw-p 00000000 00:00 0
7f0000200000-7f0000300000 r--s 00000000 00:05 7                          /dev/shm/ucx_posix
garbage line
";

    #[test]
    fn a_range_must_lie_in_one_mapping() {
        let m = Maps::parse(SAMPLE);
        let sysv = m.containing(0x7f00_0000_0000, 0x7f00_000f_ffff).unwrap();
        assert!(sysv.shared && sysv.readable);
        // Crossing into the next (private) mapping is refused even though both exist.
        assert!(m.containing(0x7f00_0000_0000, 0x7f00_0010_0000).is_none());
        assert!(
            !m.containing(0x55d0_c0a0_0010, 0x55d0_c0a0_0020)
                .unwrap()
                .shared
        );
        assert!(
            m.containing(0x7f00_0020_0000, 0x7f00_002f_ffff)
                .unwrap()
                .shared
        );
        assert!(m.containing(0x1000, 0x1001).is_none());
        assert!(m.containing(0x7f00_0000_0010, 0x7f00_0000_0000).is_none());
    }

    #[test]
    fn this_process_has_its_own_maps() {
        let m = Maps::read();
        let x = 5u64;
        let a = &x as *const u64 as usize;
        let stack = m.containing(a, a + 7).expect("the stack is mapped");
        assert!(!stack.shared && stack.readable);
    }
}
