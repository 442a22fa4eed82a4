//! A loaded peer ([`Peer`]): the publisher process a peer's metadata names, checked to be on
//! this host and alive when it is loaded, held with a pidfd, and its regions probed; and the
//! identity of this endpoint's own process ([`Host`]) that the metadata carries.

use reshard_core::{Error, ErrorKind, OwnerId, Result};
use std::collections::HashMap;
use std::ops::Range;

use crate::meta::{Meta, RegionMeta};
use crate::run;
use crate::sys::{self, Pidfd, Span};
use crate::SCHEME;

fn oob(owner: OwnerId, range: Range<u64>, msg: String) -> Error {
    Error::new(ErrorKind::OutOfBounds, msg)
        .with_owner(owner)
        .with_range(range)
        .with_backend(SCHEME)
}

/// The host and process this endpoint runs in, as its metadata states them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Host {
    pub(crate) boot_id: [u8; 16],
    pub(crate) pid_ns: u64,
    pub(crate) pid: u32,
    pub(crate) start_time: u64,
}

impl Host {
    pub(crate) fn here() -> Result<Host> {
        let pid = std::process::id();
        let fail = |what: &str, e: std::io::Error| {
            Error::new(
                ErrorKind::Unsupported,
                format!("cma needs {what} to identify this process and host: {e}"),
            )
            .with_backend(SCHEME)
            .with_source(e)
        };
        Ok(Host {
            boot_id: sys::boot_id().map_err(|e| fail("/proc/sys/kernel/random/boot_id", e))?,
            pid_ns: sys::pid_namespace().map_err(|e| fail("/proc/self/ns/pid", e))?,
            pid,
            start_time: sys::start_time(pid as i32).map_err(|e| fail("/proc/<pid>/stat", e))?,
        })
    }
}

/// A loaded peer: the process its metadata names, held by a pidfd where the kernel has them.
pub(crate) struct Peer {
    pub(crate) pid: i32,
    pub(crate) agent: String,
    pub(crate) start_time: u64,
    pub(crate) incarnation: u64,
    pidfd: Option<Pidfd>,
    /// By region id.
    pub(crate) regions: HashMap<u64, RegionMeta>,
}

impl Peer {
    /// True while the process the metadata named is alive (so its pid is still its own).
    pub(crate) fn is_same_process(&self) -> bool {
        match &self.pidfd {
            Some(fd) => !fd.exited(),
            None => sys::start_time(self.pid).is_ok_and(|t| t == self.start_time),
        }
    }

    /// Opens the process `meta` names, for `owner`: refuses metadata from another boot or pid
    /// namespace (`Unsupported`), then holds the pid with a pidfd and checks that its start
    /// time is the metadata's, so a dead publisher or a reused pid is `PeerUnknown`.
    pub(crate) fn open(owner: OwnerId, meta: Meta, host: &Host) -> Result<Peer> {
        let refuse = |kind: ErrorKind, msg: String| {
            Error::new(kind, msg).with_owner(owner).with_backend(SCHEME)
        };
        if meta.boot_id != host.boot_id {
            return Err(refuse(
                ErrorKind::Unsupported,
                format!(
                    "metadata of agent {:?} comes from another host (or another boot): cma \
                     reads processes on this host only; use ucx or nixl across hosts",
                    meta.agent
                ),
            ));
        }
        if meta.pid_ns != host.pid_ns {
            return Err(refuse(
                ErrorKind::Unsupported,
                format!(
                    "metadata of agent {:?} comes from another pid namespace (another \
                     container?): its pid {} does not name a process here",
                    meta.agent, meta.pid
                ),
            ));
        }
        let pid = meta.pid as i32;
        let gone = |why: String| {
            refuse(
                ErrorKind::PeerUnknown,
                format!(
                    "process {pid} of agent {:?}, which exported this metadata, {why}",
                    meta.agent
                ),
            )
        };
        // The pidfd is opened first and the start time read after: if they match, the pidfd
        // holds the process the metadata names, and later reads can tell whether the pid is
        // still its own.
        let pidfd = match Pidfd::open(pid) {
            Ok(fd) => fd,
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                return Err(gone("is gone".into()).with_source(e))
            }
            Err(e) => return Err(gone("cannot be opened".into()).with_source(e)),
        };
        if pidfd.as_ref().is_some_and(Pidfd::exited) || sys::state(pid) == Some('Z') {
            return Err(gone("has exited".into()));
        }
        match sys::start_time(pid) {
            Ok(t) if t == meta.start_time => {}
            Ok(t) => {
                return Err(gone(format!(
                    "is gone: pid {pid} now belongs to a process started at tick {t}, the \
                     metadata's started at tick {}",
                    meta.start_time
                )))
            }
            Err(e) => return Err(gone("is gone".into()).with_source(e)),
        }
        Ok(Peer {
            pid,
            agent: meta.agent,
            start_time: meta.start_time,
            incarnation: meta.incarnation,
            pidfd,
            regions: meta.regions.into_iter().map(|r| (r.id, r)).collect(),
        })
    }

    /// Reads the first and last byte of every non-empty region of a peer being loaded: the
    /// kernel's refusals (permissions, unmapped memory) show at `load_peer`, naming the owner,
    /// rather than at the first post.
    pub(crate) fn probe_regions(&self, owner: OwnerId) -> Result<()> {
        let probes: Vec<(u64, u64)> = self
            .regions
            .values()
            .filter(|r| r.len > 0)
            .flat_map(|r| [(r.id, r.addr), (r.id, r.addr + r.len - 1)])
            .collect();
        for chunk in probes.chunks(sys::IOV_MAX) {
            let mut scratch = vec![0u8; chunk.len()];
            let base = scratch.as_mut_ptr() as u64;
            let local = [Span {
                addr: base,
                len: chunk.len() as u64,
            }];
            let remote: Vec<Span> = chunk
                .iter()
                .map(|&(_, a)| Span { addr: a, len: 1 })
                .collect();
            // SAFETY: `scratch` is a local buffer of exactly the bytes asked for; no reference
            // to it is used until the call returns.
            let r = unsafe { sys::read_from(self.pid, &local, &remote) };
            // A fault on the first iovec is EFAULT; on a later one, a short count.
            let faulted = match &r {
                Ok(n) if *n < chunk.len() => Some(*n),
                Err(e) if e.raw_os_error() == Some(libc::EFAULT) => Some(0),
                _ => None,
            };
            if let Some(n) = faulted {
                let (id, addr) = chunk[n];
                let reg = self.regions[&id];
                let off = addr - reg.addr;
                return Err(oob(
                    owner,
                    off..off + 1,
                    format!(
                        "region {id} of owner {owner} (agent {:?}) is not mapped in process {} \
                         at byte {off}",
                        self.agent, self.pid
                    ),
                ));
            }
            if let Err(e) = r {
                let kind = match e.raw_os_error() {
                    Some(libc::EPERM) => ErrorKind::Unsupported,
                    Some(libc::ESRCH) => ErrorKind::PeerUnknown,
                    _ => ErrorKind::Transport,
                };
                let msg = match kind {
                    ErrorKind::Unsupported => run::permission_denied(owner, self),
                    _ => format!(
                        "cannot read process {} of owner {owner} (agent {:?})",
                        self.pid, self.agent
                    ),
                };
                return Err(Error::new(kind, msg)
                    .with_owner(owner)
                    .with_backend(SCHEME)
                    .with_source(e));
            }
        }
        Ok(())
    }
}
