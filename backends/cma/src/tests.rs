//! Unit tests of peer loading (dead and reused pids, other hosts), kernel refusals and
//! ordering, with metadata crafted inside the crate.

use std::sync::Arc;

use reshard_core::{
    ErrorKind, HostBuffer, MemoryBlock, MemoryKind, ReadBatch, ReadDesc, Transport,
};

use crate::meta::{Meta, RegionMeta};
use crate::{CmaOptions, CmaTransport, SCHEME};

fn endpoint(agent: &str) -> CmaTransport {
    CmaTransport::new(agent, CmaOptions::default()).expect("endpoint")
}

async fn own_meta(t: &CmaTransport) -> Meta {
    Meta::decode(&t.export_metadata().await.unwrap()).unwrap()
}

#[tokio::test]
async fn a_dead_pid_is_peer_unknown_naming_owner_and_pid() {
    let rx = endpoint("rx");
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let pid = child.id();
    let start_time = crate::sys::start_time(pid as i32).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    let meta = Meta {
        pid,
        start_time,
        regions: vec![],
        ..own_meta(&rx).await
    };
    let e = rx.load_peer(5, meta.encode()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerUnknown, "{e}");
    assert_eq!(e.context().owner, Some(5));
    assert_eq!(e.context().backend.as_deref(), Some(SCHEME));
    assert!(e.message().contains(&pid.to_string()), "{e}");
    assert_eq!(rx.peer_incarnation(5), None);
}

#[tokio::test]
async fn a_reused_pid_is_refused_by_its_start_time() {
    let rx = endpoint("rx");
    let honest = own_meta(&rx).await;
    rx.load_peer(1, honest.encode()).await.unwrap();
    let epoch = rx.epoch();
    let reused = Meta {
        start_time: honest.start_time + 1,
        incarnation: 77,
        ..honest
    };
    let e = rx.load_peer(2, reused.encode()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerUnknown, "{e}");
    assert_eq!(e.context().owner, Some(2));
    assert!(e.message().contains("now belongs"), "{e}");
    assert_eq!(rx.peer_incarnation(2), None);
    assert_eq!(rx.epoch(), epoch, "a refused peer changes nothing");
}

#[tokio::test]
async fn metadata_from_another_host_or_pid_namespace_is_unsupported() {
    let rx = endpoint("rx");
    let honest = own_meta(&rx).await;
    let mut other_host = honest.clone();
    other_host.boot_id[0] ^= 1;
    let mut other_ns = honest.clone();
    other_ns.pid_ns += 1;
    for (m, what) in [(other_host, "host"), (other_ns, "namespace")] {
        let e = rx.load_peer(3, m.encode()).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
        assert_eq!(e.context().owner, Some(3));
        assert!(e.message().contains(what), "{e}");
    }
}

/// Anonymous memory the test maps and then protects, to make addresses the kernel refuses.
#[derive(Debug)]
struct Mapped {
    addr: usize,
    len: usize,
}

impl Mapped {
    fn new(len: usize) -> Self {
        // SAFETY: a fresh private anonymous mapping.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Mapped {
            addr: p as usize,
            len,
        }
    }

    /// Makes `len` bytes at `off` unreadable (`PROT_NONE`): the kernel faults reading them,
    /// as it would on freed memory, and, unlike `munmap`, no other allocation can move in.
    fn protect(&self, off: usize, len: usize) {
        // SAFETY: a part of the mapping made in `new`; nothing of it is referenced.
        let r = unsafe { libc::mprotect((self.addr + off) as *mut _, len, libc::PROT_NONE) };
        assert_eq!(r, 0);
    }
}

// SAFETY: a private mapping at a fixed address, never unmapped; the test only protects it.
unsafe impl MemoryBlock for Mapped {
    fn addr(&self) -> usize {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::Dram
    }
}

#[tokio::test]
async fn unreadable_source_memory_is_typed_at_load_and_at_the_read() {
    let tx = endpoint("tx");
    let rx = endpoint("rx");
    let page = 4096;
    let mem = Arc::new(Mapped::new(4 * page));
    let src = tx.register(mem.clone()).await.unwrap();
    let dst = rx
        .register(Arc::new(HostBuffer::zeroed(4 * page)))
        .await
        .unwrap();
    let meta = tx.export_metadata().await.unwrap();
    rx.load_peer(7, meta.clone()).await.unwrap();
    let read = |off: u64, len: u64| ReadDesc {
        owner: 7,
        remote_region: src.id(),
        remote_offset: off,
        local_region: dst.id(),
        local_offset: off,
        len,
        remote_rows: None,
    };
    let p = rx
        .prepare(ReadBatch {
            reads: vec![read(0, 100), read(page as u64, 3 * page as u64)],
        })
        .await
        .unwrap();
    rx.post(&p).await.unwrap().wait().await.unwrap();
    // The publisher frees the memory after exporting: the read faults in the kernel.
    mem.protect(0, 4 * page);
    let e = rx.post(&p).await.unwrap().wait().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
    assert_eq!(e.context().owner, Some(7));
    assert_eq!(e.context().range, Some(0..100));
    assert!(!e.is_retryable());
    // Loading the same metadata now refuses the region at load.
    let e = rx.load_peer(8, meta).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    assert_eq!(e.context().owner, Some(8));
    assert_eq!(e.context().range, Some(0..1));
}

#[tokio::test]
async fn a_fault_part_way_through_a_call_names_the_read_it_hit() {
    let tx = endpoint("tx");
    let rx = CmaTransport::new(
        "rx",
        CmaOptions {
            workers: 1,
            ..CmaOptions::default()
        },
    )
    .unwrap();
    let page = 4096u64;
    let mem = Arc::new(Mapped::new(4 * page as usize));
    let src = tx.register(mem.clone()).await.unwrap();
    let dst = rx
        .register(Arc::new(HostBuffer::zeroed(4 * page as usize)))
        .await
        .unwrap();
    rx.load_peer(7, tx.export_metadata().await.unwrap())
        .await
        .unwrap();
    // Three reads in one call; only the third page becomes unreadable.
    let reads = [(0, 10), (page, 10), (2 * page + 100, 50)]
        .map(|(off, len)| ReadDesc {
            owner: 7,
            remote_region: src.id(),
            remote_offset: off,
            local_region: dst.id(),
            local_offset: off,
            len,
            remote_rows: None,
        })
        .to_vec();
    let p = rx.prepare(ReadBatch { reads }).await.unwrap();
    mem.protect(2 * page as usize, page as usize);
    let e = rx.post(&p).await.unwrap().wait().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
    assert_eq!(e.context().range, Some(2 * page + 100..2 * page + 150));
}

/// A gather whose rows fault part-way through is a `Transport` error naming the gather's
/// whole source span (first row to last), not `len` bytes from its offset.
#[tokio::test]
async fn a_fault_in_a_gather_names_its_source_span() {
    let tx = endpoint("tx");
    let rx = endpoint("rx");
    let page = 4096u64;
    let mem = Arc::new(Mapped::new(4 * page as usize));
    let src = tx.register(mem.clone()).await.unwrap();
    let dst = rx
        .register(Arc::new(HostBuffer::zeroed(page as usize)))
        .await
        .unwrap();
    rx.load_peer(7, tx.export_metadata().await.unwrap())
        .await
        .unwrap();
    // 4 rows of 100 bytes a page apart from byte 50: bytes 50..12_438 of the region.
    let read = ReadDesc {
        owner: 7,
        remote_region: src.id(),
        remote_offset: 50,
        local_region: dst.id(),
        local_offset: 0,
        len: 400,
        remote_rows: Some(reshard_core::RemoteRows {
            row_bytes: 100,
            pitch: page,
        }),
    };
    let p = rx.prepare(ReadBatch { reads: vec![read] }).await.unwrap();
    rx.post(&p).await.unwrap().wait().await.unwrap();
    mem.protect(2 * page as usize, page as usize);
    let e = rx.post(&p).await.unwrap().wait().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
    assert_eq!(e.context().owner, Some(7));
    assert_eq!(e.context().range, Some(50..50 + 3 * page + 100), "{e}");
}

#[tokio::test]
async fn registration_is_host_only_with_ids_from_one_and_epochs_move() {
    let t = endpoint("t");
    let e0 = t.epoch();
    let a = t.register(Arc::new(HostBuffer::zeroed(8))).await.unwrap();
    let b = t.register(Arc::new(HostBuffer::zeroed(8))).await.unwrap();
    assert_eq!((a.id(), b.id()), (1, 2));
    assert!(t.epoch() > e0);
    let e1 = t.epoch();
    drop(a);
    assert!(t.epoch() > e1);
    #[derive(Debug)]
    struct Device;
    // SAFETY: never dereferenced: registration refuses it.
    unsafe impl MemoryBlock for Device {
        fn addr(&self) -> usize {
            0x1000
        }
        fn len(&self) -> usize {
            8
        }
        fn kind(&self) -> MemoryKind {
            MemoryKind::Vram { device: 0 }
        }
    }
    let e = t.register(Arc::new(Device)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
}

#[tokio::test]
async fn the_factory_reads_options_and_workers_override_them() {
    use reshard_core::config::TransportConfig;
    use reshard_core::registry::Registry;
    let mut reg = Registry::new();
    crate::register(&mut reg);
    assert_eq!(reg.schemes(), [SCHEME]);
    let cfg = TransportConfig {
        kind: SCHEME.into(),
        workers: Some(3),
        options: Some(serde_json::json!({"workers": 9, "piece_bytes": 65536})),
    };
    let t = reg.create("f", &cfg).unwrap();
    let dbg = format!("{t:?}");
    assert!(
        dbg.contains("workers: 3") && dbg.contains("piece_bytes: 65536"),
        "{dbg}"
    );
    let bad = TransportConfig {
        options: Some(serde_json::json!({"pieces": 1})),
        ..cfg
    };
    assert_eq!(reg.create("f", &bad).unwrap_err().kind(), ErrorKind::Config);
}

#[test]
fn probe_passes_here_and_decode_metadata_is_canonical() {
    crate::probe().unwrap();
    let m = Meta {
        boot_id: [1; 16],
        pid_ns: 1,
        pid: 1,
        start_time: 1,
        incarnation: 1,
        agent: "a".into(),
        regions: vec![
            RegionMeta {
                id: 2,
                addr: 0x2000,
                len: 1,
            },
            RegionMeta {
                id: 1,
                addr: 0x1000,
                len: 1,
            },
        ],
    };
    let canon = crate::decode_metadata(&m.encode()).unwrap();
    assert_eq!(crate::decode_metadata(&canon).unwrap(), canon);
    assert_ne!(canon, m.encode(), "regions come back sorted by id");
    assert_eq!(
        crate::decode_metadata(b"RSCM").unwrap_err().kind(),
        ErrorKind::Decode
    );
}

#[tokio::test]
async fn prepare_refuses_zero_length_and_local_ranges_outside_with_owner_and_range() {
    let tx = endpoint("tx");
    let rx = endpoint("rx");
    let src = tx
        .register(Arc::new(HostBuffer::zeroed(4096)))
        .await
        .unwrap();
    let dst = rx
        .register(Arc::new(HostBuffer::zeroed(4096)))
        .await
        .unwrap();
    rx.load_peer(2, tx.export_metadata().await.unwrap())
        .await
        .unwrap();
    let read = |local_region: u64, local_offset: u64, len: u64| ReadDesc {
        owner: 2,
        remote_region: src.id(),
        remote_offset: 8,
        local_region,
        local_offset,
        len,
        remote_rows: None,
    };
    for (r, range) in [
        (read(dst.id(), 0, 0), 8..8),
        (read(dst.id(), 4000, 100), 4000..4100),
        (read(dst.id(), u64::MAX, 2), u64::MAX..u64::MAX),
        (read(dst.id() + 1, 0, 16), 0..16),
    ] {
        let e = rx
            .prepare(ReadBatch { reads: vec![r] })
            .await
            .expect_err("must be refused");
        assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{r:?}: {e}");
        assert_eq!(e.context().owner, Some(2));
        assert_eq!(e.context().range, Some(range), "{r:?}");
        assert_eq!(e.context().backend.as_deref(), Some(SCHEME));
    }
}

/// The remote side of prepare's checks (`reshard_core::contract::validate_batch`): an owner
/// never loaded is `PeerUnknown`, a region the peer does not advertise or a range past its end
/// `OutOfBounds`, each naming owner and the remote byte range.
#[tokio::test]
async fn prepare_refuses_unknown_owners_regions_and_remote_ranges_outside() {
    let tx = endpoint("tx");
    let rx = endpoint("rx");
    let src = tx
        .register(Arc::new(HostBuffer::zeroed(4096)))
        .await
        .unwrap();
    let dst = rx
        .register(Arc::new(HostBuffer::zeroed(8192)))
        .await
        .unwrap();
    rx.load_peer(2, tx.export_metadata().await.unwrap())
        .await
        .unwrap();
    let read = |owner, remote_region: u64, remote_offset: u64, len: u64| ReadDesc {
        owner,
        remote_region,
        remote_offset,
        local_region: dst.id(),
        local_offset: 0,
        len,
        remote_rows: None,
    };
    for (r, kind, range) in [
        (read(3, src.id(), 8, 16), ErrorKind::PeerUnknown, 8..24),
        (read(2, src.id() + 1, 0, 16), ErrorKind::OutOfBounds, 0..16),
        (
            read(2, src.id(), 4000, 100),
            ErrorKind::OutOfBounds,
            4000..4100,
        ),
        // One byte past the end.
        (
            read(2, src.id(), 4090, 7),
            ErrorKind::OutOfBounds,
            4090..4097,
        ),
        (
            read(2, src.id(), u64::MAX, 2),
            ErrorKind::OutOfBounds,
            u64::MAX..u64::MAX,
        ),
    ] {
        let e = rx
            .prepare(ReadBatch { reads: vec![r] })
            .await
            .expect_err("must be refused");
        assert_eq!(e.kind(), kind, "{r:?}: {e}");
        assert_eq!(e.context().owner, Some(r.owner), "{r:?}");
        assert_eq!(e.context().range, Some(range), "{r:?}");
        assert_eq!(e.context().backend.as_deref(), Some(SCHEME));
    }
    // The whole region is fine.
    rx.prepare(ReadBatch {
        reads: vec![read(2, src.id(), 0, 4096)],
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_batch_prepared_before_its_destination_was_deregistered_is_refused_at_post() {
    let tx = endpoint("tx");
    let rx = endpoint("rx");
    let src = tx
        .register(Arc::new(HostBuffer::from_bytes(&[9; 4096])))
        .await
        .unwrap();
    let buf = Arc::new(HostBuffer::zeroed(4096));
    let dst = rx.register(buf.clone()).await.unwrap();
    rx.load_peer(4, tx.export_metadata().await.unwrap())
        .await
        .unwrap();
    let p = rx
        .prepare(ReadBatch {
            reads: vec![ReadDesc {
                owner: 4,
                remote_region: src.id(),
                remote_offset: 0,
                local_region: dst.id(),
                local_offset: 100,
                len: 64,
                remote_rows: None,
            }],
        })
        .await
        .unwrap();
    drop(dst);
    let e = match rx.post(&p).await {
        Ok(_) => panic!("posted into a deregistered region"),
        Err(e) => e,
    };
    assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
    assert_eq!(e.context().owner, Some(4));
    assert_eq!(e.context().range, Some(100..164));
    assert!(buf.read().iter().all(|&b| b == 0), "nothing landed");
}

/// A userfaultfd over pages of a mapping that were never touched: any access to them, also
/// the kernel's on behalf of a `process_vm_readv`, blocks until the fd answers the fault or
/// is closed. So a read of such a page is a system call that does not return on its own.
struct Uffd(std::os::fd::OwnedFd);

/// `struct uffdio_api` of linux/userfaultfd.h.
#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

/// `struct uffdio_register` of linux/userfaultfd.h (its range inlined).
#[repr(C)]
struct UffdioRegister {
    start: u64,
    len: u64,
    mode: u64,
    ioctls: u64,
}

const UFFD_API: u64 = 0xAA;
/// `_IOWR(0xAA, 0x3F, struct uffdio_api)`.
const UFFDIO_API: u64 = 0xC018_AA3F;
/// `_IOWR(0xAA, 0x00, struct uffdio_register)`.
const UFFDIO_REGISTER: u64 = 0xC020_AA00;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;

impl Uffd {
    /// `None` (saying why) where userfaultfd is not permitted: it needs CAP_SYS_PTRACE unless
    /// vm.unprivileged_userfaultfd is 1, and faults taken by the kernel are only held for such
    /// a descriptor.
    fn new() -> Option<Self> {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: a plain system call creating a descriptor.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) };
        if fd < 0 {
            eprintln!(
                "NOTE: userfaultfd is not permitted here ({}): the stalled-read test is skipped",
                std::io::Error::last_os_error()
            );
            return None;
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) };
        let mut api = UffdioApi {
            api: UFFD_API,
            features: 0,
            ioctls: 0,
        };
        // SAFETY: the ioctl reads and writes `api`, a live struct of the size it encodes.
        let r = unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API as _, &mut api) };
        assert_eq!(r, 0, "UFFDIO_API: {}", std::io::Error::last_os_error());
        Some(Uffd(fd))
    }

    /// Holds every first access to the `len` bytes at `addr` (untouched anonymous memory).
    fn hold(&self, addr: usize, len: usize) {
        use std::os::fd::AsRawFd;
        let mut reg = UffdioRegister {
            start: addr as u64,
            len: len as u64,
            mode: UFFDIO_REGISTER_MODE_MISSING,
            ioctls: 0,
        };
        // SAFETY: the ioctl reads and writes `reg`, a live struct of the size it encodes.
        let r = unsafe { libc::ioctl(self.0.as_raw_fd(), UFFDIO_REGISTER as _, &mut reg) };
        assert_eq!(r, 0, "UFFDIO_REGISTER: {}", std::io::Error::last_os_error());
    }
}

/// A `process_vm_readv` that never returns (its source page is held by a userfaultfd nobody
/// answers) cannot hold `wait`, `abort` or a dropped handle past the no-progress bound
/// (docs/in-flight-safety.md, rule 4): `wait` ends with a quarantined, not retryable
/// `Timeout` naming the read, and after each ending the bytes the call may still write are
/// quarantined (rule 3): posts into them are refused with a quarantined error while other
/// memory stays usable, until the call returns; then the same batch moves every byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quiescence_is_bounded_when_a_read_never_returns() {
    let Some(uffd) = Uffd::new() else {
        return;
    };
    let page = 4096usize;
    let pages = 16usize;
    // Not the first or last page: `load_peer` reads those to check the region is mapped.
    let held = 8usize;
    let tx = endpoint("tx");
    let mem = Arc::new(Mapped::new(pages * page));
    uffd.hold(mem.addr + held * page, page);
    for p in (0..pages).filter(|&p| p != held) {
        // SAFETY: a page of the test's own mapping, not referenced anywhere else yet.
        unsafe { std::ptr::write_bytes((mem.addr + p * page) as *mut u8, p as u8 + 1, page) };
    }
    let src = tx.register(mem.clone()).await.unwrap();
    let meta = tx.export_metadata().await.unwrap();
    let options = CmaOptions {
        workers: 2,
        // One page per call, so only the held page's call stalls.
        piece_bytes: page as u64,
        iovecs_per_call: 1,
        timeout_ms: 100,
        ..CmaOptions::default()
    };
    let reads = |region: u64, skip_held: bool| ReadBatch {
        reads: (0..pages)
            .filter(|&p| !(skip_held && p == held))
            .map(|p| ReadDesc {
                owner: 1,
                remote_region: src.id(),
                remote_offset: (p * page) as u64,
                local_region: region,
                local_offset: (p * page) as u64,
                len: page as u64,
                remote_rows: None,
            })
            .collect(),
    };
    let held_range = Some((held * page) as u64..((held + 1) * page) as u64);
    const RETURNS: std::time::Duration = std::time::Duration::from_secs(60);
    let mut stalled = Vec::new();
    // One receiver per ending: each stalled call keeps one of its copy threads.
    for ending in ["wait", "abort", "drop"] {
        let rx = CmaTransport::new(ending, options.clone()).unwrap();
        rx.load_peer(1, meta.clone()).await.unwrap();
        let dst = Arc::new(HostBuffer::zeroed(pages * page));
        let other = Arc::new(HostBuffer::zeroed(pages * page));
        let rd = rx.register(dst.clone()).await.unwrap();
        let ro = rx.register(other.clone()).await.unwrap();
        let prepared = rx.prepare(reads(rd.id(), false)).await.unwrap();
        let inflight = rx.post(&prepared).await.unwrap();
        // Calls are claimed in page order: once every other page has landed, the held page's
        // call has been running (stalled) since before the last of them.
        let start = std::time::Instant::now();
        while (0..pages)
            .filter(|&p| p != held)
            .any(|p| dst.read()[p * page] != p as u8 + 1)
        {
            assert!(start.elapsed() < std::time::Duration::from_secs(30));
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        match ending {
            "wait" => {
                let e = tokio::time::timeout(RETURNS, inflight.wait())
                    .await
                    .expect("wait on a batch whose read never returns returned")
                    .expect_err("a batch whose read never returns fails");
                assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
                assert!(e.is_quarantined() && !e.is_retryable(), "{e}");
                assert_eq!(e.context().owner, Some(1), "{e}");
                assert_eq!(e.context().range, held_range, "{e}");
                assert_eq!(e.context().backend.as_deref(), Some(SCHEME));
            }
            // Each must return (a generous guard, so an unbounded wait fails the test rather
            // than hanging it; the bound itself is 100 ms).
            "abort" => tokio::time::timeout(RETURNS, inflight.abort())
                .await
                .expect("abort of a batch whose read never returns returned"),
            _ => tokio::time::timeout(RETURNS, tokio::task::spawn_blocking(move || drop(inflight)))
                .await
                .expect("dropping a batch whose read never returns returned")
                .unwrap(),
        }
        // It returned; the call still runs, so the bytes it may write are not posted into ...
        let e = match rx.post(&prepared).await {
            Ok(_) => panic!("{ending}: posted into bytes a stalled read may still write"),
            Err(e) => e,
        };
        assert!(e.is_quarantined() && !e.is_retryable(), "{ending}: {e}");
        assert_eq!(e.context().owner, Some(1), "{ending}: {e}");
        assert_eq!(e.context().range, held_range, "{ending}: {e}");
        // ... while other memory is (without the held page, which would stall again).
        let p = rx.prepare(reads(ro.id(), true)).await.unwrap();
        let report = rx.post(&p).await.unwrap().wait().await.unwrap();
        assert_eq!(report.bytes, ((pages - 1) * page) as u64, "{ending}");
        assert!(other.read()[..page].iter().all(|&b| b == 1), "{ending}");
        stalled.push((rx, prepared, dst, rd, ro));
    }
    // Closing the userfaultfd lets the held page fault in (as zeros): the stalled calls return.
    drop(uffd);
    for (rx, prepared, dst, ..) in &stalled {
        let start = std::time::Instant::now();
        let report = loop {
            match rx.post(prepared).await {
                Ok(f) => break f.wait().await.unwrap(),
                Err(e) if e.is_quarantined() => {
                    // The stalled calls return as their threads are scheduled again.
                    assert!(start.elapsed() < std::time::Duration::from_secs(30), "{e}");
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
                Err(e) => panic!("{e}"),
            }
        };
        assert_eq!(report.bytes, (pages * page) as u64);
        // SAFETY: the test's own mapping, every page of it now present and only read here.
        let src = unsafe { std::slice::from_raw_parts(mem.addr as *const u8, pages * page) };
        assert!(
            dst.read()[..] == src[..],
            "byte exact once the read returned"
        );
    }
}
