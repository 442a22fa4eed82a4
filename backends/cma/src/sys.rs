//! The Linux calls this backend makes: `process_vm_readv`, `pidfd_open` and `poll` on it,
//! `prctl(PR_SET_PTRACER)`, and the `/proc` files that identify a process and its host. This is
//! the only module with `unsafe`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Most iovecs one `process_vm_readv` takes on each side (`IOV_MAX` on Linux; more is `EINVAL`).
pub(crate) const IOV_MAX: usize = 1024;

/// One contiguous range of a process's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) addr: u64,
    pub(crate) len: u64,
}

fn iovecs(spans: &[Span]) -> Vec<libc::iovec> {
    spans
        .iter()
        .map(|s| libc::iovec {
            iov_base: s.addr as usize as *mut libc::c_void,
            iov_len: s.len as usize,
        })
        .collect()
}

/// Reads the bytes of `remote` (addresses in process `pid`, in order) into `local` (addresses
/// in this process, in order); both lists hold the same total and at most [`IOV_MAX`] spans.
/// Returns the bytes moved, which is less than asked when a remote span is not mapped part-way.
///
/// # Safety
/// Every `local` span must be memory of this process that may be written for the whole call
/// and that nothing else reads or writes meanwhile: the kernel writes it as if by `memcpy`.
pub(crate) unsafe fn read_from(pid: i32, local: &[Span], remote: &[Span]) -> io::Result<usize> {
    debug_assert!(local.len() <= IOV_MAX && remote.len() <= IOV_MAX);
    let l = iovecs(local);
    let r = iovecs(remote);
    // SAFETY: the iovec arrays are valid for their lengths during the call; the caller promises
    // the local spans are writable and unshared. Remote addresses are only dereferenced by the
    // kernel, which checks them against the target's mappings (EFAULT, never our memory).
    let n = unsafe {
        libc::process_vm_readv(
            pid,
            l.as_ptr(),
            l.len() as libc::c_ulong,
            r.as_ptr(),
            r.len() as libc::c_ulong,
            0,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Reads 8 bytes of this process's own memory through `process_vm_readv`: the kernel (and a
/// seccomp filter, if any) allows cross-memory attach here exactly when this succeeds.
pub(crate) fn read_self() -> io::Result<()> {
    let src: u64 = 0x5245_5348_4152_4421;
    let dst = std::cell::UnsafeCell::new(0u64);
    let local = [Span {
        addr: dst.get() as u64,
        len: 8,
    }];
    let remote = [Span {
        addr: &src as *const u64 as u64,
        len: 8,
    }];
    // SAFETY: `dst` is a local this function owns, written only by the kernel during the call;
    // no reference to it exists until the call returns.
    let n = unsafe { read_from(std::process::id() as i32, &local, &remote)? };
    if n != 8 || dst.into_inner() != src {
        return Err(io::Error::other(format!(
            "process_vm_readv of 8 bytes of this process moved {n} bytes or wrong bytes"
        )));
    }
    Ok(())
}

/// A process handle that cannot be confused with a later process of the same pid.
#[derive(Debug)]
pub(crate) struct Pidfd(OwnedFd);

impl Pidfd {
    /// Opens `pid`; `Ok(None)` when the kernel has no `pidfd_open` (before Linux 5.3).
    pub(crate) fn open(pid: i32) -> io::Result<Option<Pidfd>> {
        // SAFETY: plain system call with integer arguments; the result is a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENOSYS) => Ok(None),
                _ => Err(e),
            };
        }
        // SAFETY: `fd` is a fresh descriptor owned by nobody else.
        Ok(Some(Pidfd(unsafe { OwnedFd::from_raw_fd(fd as i32) })))
    }

    /// True once the process has exited (its pid may then be reused after it is reaped).
    pub(crate) fn exited(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n > 0 && p.revents != 0
    }
}

/// Start time of process `pid` in clock ticks since boot: field 22 of `/proc/<pid>/stat`.
/// Together with the pid it names one process for the life of the host.
pub(crate) fn start_time(pid: i32) -> io::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_start_time(&stat).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("cannot parse /proc/{pid}/stat"),
        )
    })
}

/// Field 22 of a `stat` line. The command name (field 2) may hold spaces and parentheses, so
/// fields are counted from the last `)`, which is field 2's end: field 3 comes next.
pub(crate) fn parse_start_time(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(22 - 3)?.parse().ok()
}

/// The state letter of `/proc/<pid>/stat` (field 3): `Z` for a zombie.
pub(crate) fn state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_ascii_whitespace().next()?.chars().next()
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`, a UUID) as 16 bytes: equal ids mean the
/// same running kernel, so the same host.
pub(crate) fn boot_id() -> io::Result<[u8; 16]> {
    let s = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
    parse_uuid(s.trim()).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("boot_id {s:?} is not a UUID"),
        )
    })
}

fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = s.bytes().filter(|&b| b != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        out[i] = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(out)
}

/// The inode of this process's pid namespace (`/proc/self/ns/pid` reads `pid:[<inode>]`): pids
/// in metadata mean the same process only inside the same namespace.
pub(crate) fn pid_namespace() -> io::Result<u64> {
    let link = std::fs::read_link("/proc/self/ns/pid")?;
    let s = link.to_string_lossy();
    s.strip_prefix("pid:[")
        .and_then(|s| s.strip_suffix(']'))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("/proc/self/ns/pid is {s:?}"),
            )
        })
}

/// Lets any process of the same user read this one under Yama `ptrace_scope` 1
/// (`prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`); applies to the whole process.
pub(crate) fn allow_any_ptracer() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    let r = unsafe {
        libc::prctl(
            libc::PR_SET_PTRACER,
            libc::PR_SET_PTRACER_ANY as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    if r < 0 {
        let e = io::Error::last_os_error();
        // Without Yama the option does not exist and nothing needs allowing.
        if e.raw_os_error() == Some(libc::EINVAL) {
            return Ok(());
        }
        return Err(e);
    }
    Ok(())
}

/// Yama's `ptrace_scope` (None when Yama is not built in), for error messages.
pub(crate) fn ptrace_scope() -> Option<u8> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_is_field_22_even_with_parentheses_in_the_name() {
        let line = "1234 (a) b) (c) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 \
                    987654 1000 10 18446744073709551615";
        assert_eq!(parse_start_time(line), Some(987654));
        assert_eq!(parse_start_time("1 (x) S 1 2"), None);
        assert_eq!(parse_start_time("no paren"), None);
    }

    #[test]
    fn own_start_time_boot_id_and_namespace_read() {
        let pid = std::process::id() as i32;
        assert!(start_time(pid).unwrap() > 0);
        assert_ne!(boot_id().unwrap(), [0; 16]);
        assert!(pid_namespace().unwrap() > 0);
        assert_eq!(
            parse_uuid("0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0").unwrap()[..3],
            [0x0b, 0x1c, 0x2d]
        );
        assert_eq!(parse_uuid("zz"), None);
    }

    #[test]
    fn a_pidfd_sees_a_child_exit() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let fd = Pidfd::open(child.id() as i32).unwrap().expect("pidfd_open");
        assert!(!fd.exited());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(fd.exited());
    }
}
