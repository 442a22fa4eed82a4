//! In-flight safety of the NIXL backend (docs/in-flight-safety.md): no-progress bounds,
//! quarantine, deferred deregistration and peer reloads while reads run.
//!
//! Reads must stay in flight under the test's control, which one process over shared memory
//! does not allow (UCX finishes them inside the post). So every scenario runs in a child
//! process (this binary re-executed) with UCX restricted to TCP, against publishers without
//! NIXL's progress thread: over TCP a READ needs its target to make progress, so a publisher's
//! reads stay in flight until the test *pumps* it (the publisher posts small reads of its own
//! and polls them, which progresses its UCX worker). The test thereby decides when each
//! publisher's bytes may land.

use reshard_backend_nixl::{probe, NixlOptions, NixlTransport, SCHEME};
use reshard_core::{
    ErrorKind, HostBuffer, MemoryBlock, PreparedBatch, ReadBatch, ReadDesc, Registration, Transport,
};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Names the scenario a re-executed child runs.
const CHILD_ENV: &str = "RESHARD_NIXL_IN_FLIGHT_CHILD";
/// Bytes each publisher serves.
const LEN: usize = 4 << 20;
/// Bytes per read.
const READ: u64 = 256 << 10;
/// The destination's byte before any read lands; the source pattern never contains it.
const CANARY: u8 = 0xCD;
/// How long the destination is watched for late bytes.
const WATCH: Duration = Duration::from_millis(400);

fn available() -> bool {
    reshard_conformance::backend_available(SCHEME, probe())
}

/// Runs `name` in a child process (TCP only) and asserts it passed; in the child, runs `body`.
fn scenario<F: Future<Output = ()>>(name: &str, body: impl FnOnce() -> F) {
    if std::env::var(CHILD_ENV).as_deref() == Ok(name) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(body());
        println!("child-ok");
        return;
    }
    if std::env::var_os(CHILD_ENV).is_some() || !available() {
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, name)
        .env("UCX_TLS", "tcp")
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("child-ok"),
        "child {name} failed ({:?}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

fn pattern(len: usize, salt: u8) -> Vec<u8> {
    // 1..=200: never the canary.
    (0..len)
        .map(|i| ((i * 31 + salt as usize * 7 + (i >> 12)) % 200) as u8 + 1)
        .collect()
}

/// A publisher whose reads only progress while it is pumped.
struct Publisher {
    t: Arc<NixlTransport>,
    src: Arc<HostBuffer>,
    reg: Registration,
    /// A small read from the receiver's ping region: posting and waiting for it progresses
    /// this publisher's UCX worker.
    pump: PreparedBatch,
}

/// A receiver with several gated publishers.
struct Rig {
    rx: Arc<NixlTransport>,
    dst: Arc<HostBuffer>,
    rd: Option<Registration>,
    pubs: Vec<Arc<Publisher>>,
    _ping: (Arc<HostBuffer>, Registration),
}

fn quiet() -> NixlOptions {
    let mut o = NixlOptions {
        progress_thread: false,
        ..NixlOptions::default()
    };
    // One worker: the one the pump progresses is the one serving the receiver's reads.
    o.plugin_params.insert("num_workers".into(), "1".into());
    o
}

async fn rig(tag: &str, publishers: usize, timeout_ms: u64) -> Rig {
    let rx = Arc::new(
        NixlTransport::new(
            &format!("{tag}-rx"),
            &NixlOptions {
                timeout_ms,
                ..NixlOptions::default()
            },
        )
        .unwrap(),
    );
    let ping = Arc::new(HostBuffer::from_bytes(&[7u8; 4096]));
    let ping_reg = rx
        .register(Arc::clone(&ping) as Arc<dyn MemoryBlock>)
        .await
        .unwrap();
    let dst = Arc::new(HostBuffer::zeroed(publishers * LEN));
    let rd = rx
        .register(Arc::clone(&dst) as Arc<dyn MemoryBlock>)
        .await
        .unwrap();
    let rx_md = rx.export_metadata().await.unwrap();
    let mut pubs = Vec::new();
    for k in 0..publishers {
        let t = Arc::new(NixlTransport::new(&format!("{tag}-pub{k}"), &quiet()).unwrap());
        let src = Arc::new(HostBuffer::from_bytes(&pattern(LEN, k as u8)));
        let reg = t
            .register(Arc::clone(&src) as Arc<dyn MemoryBlock>)
            .await
            .unwrap();
        let sink = t
            .register(Arc::new(HostBuffer::zeroed(4096)) as Arc<dyn MemoryBlock>)
            .await
            .unwrap();
        t.load_peer(0, rx_md.clone()).await.unwrap();
        let pump = t
            .prepare(ReadBatch {
                reads: vec![ReadDesc {
                    owner: 0,
                    remote_region: ping_reg.id(),
                    remote_offset: 0,
                    local_region: sink.id(),
                    local_offset: 0,
                    len: 4096,
                    remote_rows: None,
                }],
            })
            .await
            .unwrap();
        std::mem::forget(sink); // lives as long as the publisher's process
        rx.load_peer(k as u32, t.export_metadata().await.unwrap())
            .await
            .unwrap();
        pubs.push(Arc::new(Publisher { t, src, reg, pump }));
    }
    let rig = Rig {
        rx,
        dst,
        rd: Some(rd),
        pubs,
        _ping: (ping, ping_reg),
    };
    // Wire every connection up (both directions) before any test read.
    for k in 0..publishers {
        rig.pump(k, Duration::from_millis(50)).await;
    }
    rig
}

impl Rig {
    /// Every publisher's whole source into its slice of the destination.
    fn batch(&self) -> ReadBatch {
        let rd = self.rd.as_ref().unwrap();
        let mut reads = Vec::new();
        for (k, p) in self.pubs.iter().enumerate() {
            for i in 0..(LEN as u64 / READ) {
                reads.push(ReadDesc {
                    owner: k as u32,
                    remote_region: p.reg.id(),
                    remote_offset: i * READ,
                    local_region: rd.id(),
                    local_offset: (k * LEN) as u64 + i * READ,
                    len: READ,
                    remote_rows: None,
                });
            }
        }
        ReadBatch { reads }
    }

    fn fill_canary(&self) {
        self.dst.write().fill(CANARY);
    }

    /// Whether publisher `k`'s slice of the destination holds its source exactly.
    fn landed(&self, k: usize) -> bool {
        self.dst.read()[k * LEN..(k + 1) * LEN] == self.pubs[k].src.read()[..]
    }

    fn snapshot(&self) -> Vec<u8> {
        self.dst.read().to_vec()
    }

    /// Progresses publisher `k` for `d`.
    async fn pump(&self, k: usize, d: Duration) {
        pump(Arc::clone(&self.pubs[k]), d, || false).await;
    }
}

/// Pumps `p` for at most `d`, or until `stop` says so.
async fn pump(p: Arc<Publisher>, d: Duration, stop: impl Fn() -> bool) {
    let start = Instant::now();
    while start.elapsed() < d && !stop() {
        let f = p.t.post(&p.pump).await.expect("pump post");
        f.wait().await.expect("pump wait");
    }
}

/// Pumps publisher `k` of `rig` from `after` on until its slice has landed (at most 10 s).
fn pump_later(rig: &Rig, k: usize, after: Duration) -> tokio::task::JoinHandle<()> {
    let p = Arc::clone(&rig.pubs[k]);
    let dst = Arc::clone(&rig.dst);
    tokio::spawn(async move {
        tokio::time::sleep(after).await;
        let want = p.src.read().to_vec();
        pump(p, Duration::from_secs(10), move || {
            dst.read()[k * LEN..(k + 1) * LEN] == want[..]
        })
        .await;
    })
}

/// Watches the destination: it must not change after the ending call returned.
async fn assert_quiet(rig: &Rig, before: &[u8], what: &str) {
    tokio::time::sleep(WATCH).await;
    let now = rig.snapshot();
    let changed = before.iter().zip(&now).filter(|(a, b)| a != b).count();
    assert_eq!(
        changed, 0,
        "{what}: {changed} bytes landed after it returned"
    );
}

/// Posts a fresh batch and pumps every publisher until it completes: must be byte-exact.
async fn clean_transfer(rig: &Rig) {
    rig.fill_canary();
    let p = rig.rx.prepare(rig.batch()).await.expect("prepare");
    let f = rig.rx.post(&p).await.expect("post");
    let pumps: Vec<_> = (0..rig.pubs.len())
        .map(|k| pump_later(rig, k, Duration::ZERO))
        .collect();
    f.wait().await.expect("clean transfer");
    for h in pumps {
        h.await.unwrap();
    }
    for k in 0..rig.pubs.len() {
        assert!(
            rig.landed(k),
            "clean transfer of publisher {k} is byte-exact"
        );
    }
}

/// Waits until `cond` holds (at most 10 s).
async fn eventually(what: &str, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(10), "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ---------------------------------------------------------------------------------------

/// The bound is on time without progress, not on the whole wait: publisher 0 lands from 0.6 T,
/// publisher 1 from 1.1 T; the wait goes on (progress at 0.6 T) and returns the whole batch.
/// With a total deadline the wait would give up at T while publisher 1's read still runs,
/// and its bytes would land after `wait` returned. Publisher 1 has 0.5 T (1.5 s) before the
/// no-progress bound: under AddressSanitizer on a loaded 2-core CI machine, 0.3 T of 2 s was
/// not always enough for its first request to end.
#[test]
fn quiescent_after_wait_that_outlives_a_total_deadline() {
    scenario(
        "quiescent_after_wait_that_outlives_a_total_deadline",
        || async {
            let t = Duration::from_millis(3000);
            let rig = rig("np-wait", 2, t.as_millis() as u64).await;
            let prepared = rig.rx.prepare(rig.batch()).await.unwrap();
            rig.fill_canary();
            let f = rig.rx.post(&prepared).await.unwrap();
            let p0 = pump_later(&rig, 0, t * 6 / 10);
            let p1 = pump_later(&rig, 1, t * 11 / 10);
            let started = Instant::now();
            let r = f.wait().await;
            let before = rig.snapshot();
            let took = started.elapsed();
            // A failed wait quarantines the batch, whose reads may still land (rule 3): only a
            // wait that returned the batch must see nothing land afterwards, so say first
            // which of the two happened.
            let report = r.unwrap_or_else(|e| {
                panic!("the batch kept making progress, yet wait failed after {took:?}: {e}")
            });
            p0.await.unwrap();
            p1.await.unwrap();
            assert_quiet(&rig, &before, "wait").await;
            assert_eq!(report.bytes, 2 * LEN as u64);
            assert!(took > t, "it did outlive one bound ({took:?})");
            assert!(rig.landed(0) && rig.landed(1));
            clean_transfer(&rig).await;
        },
    );
}

/// `abort` drains while the batch makes progress (publisher 0 from 0.6 T, publisher 1 from
/// 1.1 T): once it returns, nothing lands. A drain bounded by a total deadline returned at T
/// and publisher 1's bytes landed afterwards.
#[test]
fn quiescent_after_abort_of_a_batch_still_making_progress() {
    scenario(
        "quiescent_after_abort_of_a_batch_still_making_progress",
        || async {
            let t = Duration::from_millis(3000);
            let rig = rig("np-abort", 2, t.as_millis() as u64).await;
            let prepared = rig.rx.prepare(rig.batch()).await.unwrap();
            rig.fill_canary();
            let f = rig.rx.post(&prepared).await.unwrap();
            let p0 = pump_later(&rig, 0, t * 6 / 10);
            let p1 = pump_later(&rig, 1, t * 11 / 10);
            tokio::time::sleep(Duration::from_millis(100)).await;
            f.abort().await;
            let before = rig.snapshot();
            p0.await.unwrap();
            p1.await.unwrap();
            assert_quiet(&rig, &before, "abort").await;
            assert_eq!(rig.rx.quarantined(), 0, "nothing had to be quarantined");
            // The same prepared batch is usable again and byte-exact.
            rig.fill_canary();
            let f = rig.rx.post(&prepared).await.expect("post after abort");
            let pumps: Vec<_> = (0..2)
                .map(|k| pump_later(&rig, k, Duration::ZERO))
                .collect();
            f.wait().await.expect("wait after abort");
            for h in pumps {
                h.await.unwrap();
            }
            assert!(rig.landed(0) && rig.landed(1));
        },
    );
}

/// A batch that makes no progress for the bound is quarantined, not released: the error is
/// a quarantined (never retryable) `Timeout` naming the owner and the local region, the batch
/// cannot be posted again, its memory cannot be read into by another batch, and a dropped
/// registration of it stays registered until the reads end. Once they do (the publisher is
/// pumped), the quarantine lets everything go, and nothing lands afterwards.
#[test]
fn quiescent_after_a_quarantined_timeout_once_the_reads_end() {
    scenario(
        "quiescent_after_a_quarantined_timeout_once_the_reads_end",
        || async {
            let mut rig = rig("quarantine", 1, 300).await;
            let prepared = rig.rx.prepare(rig.batch()).await.unwrap();
            rig.fill_canary();
            let regs = rig.rx.registrations();
            let started = Instant::now();
            let e = rig
                .rx
                .post(&prepared)
                .await
                .unwrap()
                .wait()
                .await
                .expect_err("the publisher never progresses");
            assert!(started.elapsed() >= Duration::from_millis(300));
            assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
            assert!(e.is_quarantined(), "bytes may still land: {e}");
            assert!(!e.is_retryable(), "{e}");
            assert_eq!(e.context().owner, Some(0));
            let rd = rig.rd.as_ref().unwrap().id();
            assert!(
                e.message().contains("owner 0") && e.message().contains(&format!("[{rd}]")),
                "names owner and local region: {e}"
            );
            assert_eq!(rig.rx.quarantined(), 1);
            // Never posted again; its memory is not handed to another batch either.
            let again = rig
                .rx
                .post(&prepared)
                .await
                .err()
                .expect("quarantined batch");
            assert!(again.is_quarantined() && !again.is_retryable(), "{again}");
            let other = rig.rx.prepare(rig.batch()).await.unwrap();
            let busy = rig.rx.post(&other).await.err().expect("quarantined memory");
            assert!(busy.is_quarantined(), "{busy}");
            drop(other);
            // Dropping the registration and the batch releases nothing yet.
            drop(rig.rd.take());
            drop(prepared);
            assert_eq!(
                rig.rx.registrations(),
                regs,
                "still registered while quarantined"
            );
            // The reads end: the quarantine releases the batch, and the registration goes.
            pump_later(&rig, 0, Duration::ZERO).await.unwrap();
            eventually("the quarantine lets the batch go", || {
                rig.rx.quarantined() == 0
            })
            .await;
            eventually("the region is deregistered", || {
                rig.rx.registrations() == regs - 1
            })
            .await;
            assert!(rig.landed(0), "the quarantined read did finish");
            let before = rig.snapshot();
            assert_quiet(&rig, &before, "the quarantine release").await;
            // A new registration of the same memory moves the bytes exactly.
            rig.rd = Some(
                rig.rx
                    .register(Arc::clone(&rig.dst) as Arc<dyn MemoryBlock>)
                    .await
                    .unwrap(),
            );
            clean_transfer(&rig).await;
        },
    );
}

/// Dropping the `wait` future (what `tokio::time::timeout` does) while reads run never
/// releases them: the drop waits them out while they progress, and reads that stop progressing
/// for the no-progress bound (here 300 ms: the publisher is never pumped) are quarantined;
/// neither dropping the batch nor the registration frees their memory early.
#[test]
fn quiescent_after_a_dropped_wait_future_once_the_reads_end() {
    scenario(
        "quiescent_after_a_dropped_wait_future_once_the_reads_end",
        || async {
            let mut rig = rig("drop-wait", 1, 300).await;
            let prepared = rig.rx.prepare(rig.batch()).await.unwrap();
            rig.fill_canary();
            let regs = rig.rx.registrations();
            let f = rig.rx.post(&prepared).await.unwrap();
            let started = Instant::now();
            let r = tokio::time::timeout(Duration::from_millis(100), f.wait()).await;
            assert!(
                r.is_err(),
                "the wait cannot finish: the publisher never progresses"
            );
            // The no-progress bound runs from the post (the last progress): 100 ms of `wait`,
            // then the drop waits out the rest of the 300 ms.
            assert!(
                started.elapsed() >= Duration::from_millis(250)
                    && started.elapsed() < Duration::from_secs(3),
                "the drop waits for the no-progress bound, no more ({:?})",
                started.elapsed()
            );
            assert_eq!(
                rig.rx.quarantined(),
                1,
                "the running reads were quarantined"
            );
            let e = rig
                .rx
                .post(&prepared)
                .await
                .err()
                .expect("quarantined batch");
            assert!(e.is_quarantined(), "{e}");
            let t = Instant::now();
            drop(prepared);
            drop(rig.rd.take());
            assert!(
                t.elapsed() < Duration::from_millis(100),
                "dropping the batch does not block ({:?})",
                t.elapsed()
            );
            assert_eq!(
                rig.rx.registrations(),
                regs,
                "still registered while in flight"
            );
            pump_later(&rig, 0, Duration::ZERO).await.unwrap();
            eventually("the quarantine lets the batch go", || {
                rig.rx.quarantined() == 0 && rig.rx.registrations() == regs - 1
            })
            .await;
            let before = rig.snapshot();
            assert_quiet(&rig, &before, "the quarantine release").await;
            rig.rd = Some(
                rig.rx
                    .register(Arc::clone(&rig.dst) as Arc<dyn MemoryBlock>)
                    .await
                    .unwrap(),
            );
            clean_transfer(&rig).await;
        },
    );
}

/// Dropping the registration, the batch, the transport and then the in-flight handle while
/// the reads run keeps the agent, its registrations and the memory until the reads end.
#[test]
fn quiescent_after_dropping_registration_batch_and_transport_once_the_reads_end() {
    scenario(
        "quiescent_after_dropping_registration_batch_and_transport_once_the_reads_end",
        || async {
            let mut rig = rig("drop-all", 1, 300).await;
            let prepared = rig.rx.prepare(rig.batch()).await.unwrap();
            rig.fill_canary();
            let f = rig.rx.post(&prepared).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(rig.rd.take());
            drop(prepared);
            let rx = std::mem::replace(
                &mut rig.rx,
                Arc::new(NixlTransport::new("drop-all-rx2", &NixlOptions::default()).unwrap()),
            );
            let weak = Arc::downgrade(&rx);
            drop(rx);
            assert!(weak.upgrade().is_none());
            let t = Instant::now();
            drop(f);
            assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
            // The old receiver's agent still serves the pump (its ping region and progress
            // thread live on with the quarantined batch), and the read completes into memory
            // that is still registered.
            pump_later(&rig, 0, Duration::ZERO).await.unwrap();
            assert!(rig.landed(0), "the read finished into live memory");
            let before = rig.snapshot();
            assert_quiet(&rig, &before, "the drops").await;
        },
    );
}

/// Dropping the transport wakes a waiter with an error (rule 4), but only once the reads it
/// posted have ended: nothing lands after `wait` returned.
#[test]
fn quiescent_after_wait_on_a_dropped_transport() {
    scenario("quiescent_after_wait_on_a_dropped_transport", || async {
        let mut rig = rig("drop-rx", 1, 5000).await;
        let prepared = rig.rx.prepare(rig.batch()).await.unwrap();
        rig.fill_canary();
        let f = rig.rx.post(&prepared).await.unwrap();
        let waiter = tokio::spawn(f.wait());
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(rig.rd.take());
        drop(prepared);
        let rx = std::mem::replace(
            &mut rig.rx,
            Arc::new(NixlTransport::new("drop-rx-rx2", &NixlOptions::default()).unwrap()),
        );
        drop(rx);
        let p = pump_later(&rig, 0, Duration::from_millis(300));
        let r = tokio::time::timeout(Duration::from_secs(4), waiter)
            .await
            .expect("the waiter woke before the 5 s bound")
            .unwrap();
        let before = rig.snapshot();
        p.await.unwrap();
        let e = r.expect_err("the transport was dropped");
        assert_eq!(e.kind(), ErrorKind::Aborted, "{e}");
        assert!(
            !e.is_quarantined(),
            "the reads ended before wait returned: {e}"
        );
        assert!(rig.landed(0), "the drained read finished");
        assert_quiet(&rig, &before, "wait").await;
    });
}

/// Reloading a peer's changed metadata while a batch reads from it would destroy the keys
/// the reads use: it is refused (typed, saying to wait or abort) until the batch ended. An
/// idle batch prepared from the old metadata can then no longer be posted, and dropping it
/// later is harmless.
#[test]
fn reloading_a_peer_under_a_batch_in_flight_is_refused() {
    scenario(
        "reloading_a_peer_under_a_batch_in_flight_is_refused",
        || async {
            let rig = rig("reload", 1, 5000).await;
            let prepared = rig.rx.prepare(rig.batch()).await.unwrap();
            let idle = rig.rx.prepare(rig.batch()).await.unwrap();
            rig.fill_canary();
            let f = rig.rx.post(&prepared).await.unwrap();
            // The publisher registers one more region: its metadata changes.
            let extra = rig.pubs[0]
                .t
                .register(Arc::new(HostBuffer::zeroed(4096)) as Arc<dyn MemoryBlock>)
                .await
                .unwrap();
            let md = rig.pubs[0].t.export_metadata().await.unwrap();
            let e = rig
                .rx
                .load_peer(0, md.clone())
                .await
                .expect_err("a batch reads from that peer");
            assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
            assert!(e.message().contains("wait for it or abort it"), "{e}");
            assert_eq!(e.context().owner, Some(0));
            // The batch is unharmed: it completes byte-exact.
            let p = pump_later(&rig, 0, Duration::ZERO);
            f.wait().await.expect("the batch finishes");
            p.await.unwrap();
            assert!(rig.landed(0));
            // Now the reload goes through; batches prepared before it are refused.
            rig.rx.load_peer(0, md).await.expect("reload once idle");
            // Their requests and lists were released before the old metadata was invalidated.
            for b in [&prepared, &idle] {
                let stats = NixlTransport::prepared_stats(b).unwrap();
                assert_eq!((stats.local_lists, stats.remote_lists), (0, 0));
            }
            for b in [&prepared, &idle] {
                let e = rig
                    .rx
                    .post(b)
                    .await
                    .err()
                    .expect("prepared from the old metadata");
                assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
            }
            drop(idle);
            drop(prepared);
            drop(extra);
            clean_transfer(&rig).await;
        },
    );
}

/// No environment variable is written: the efa exclusion goes through UCX's own
/// configuration API (`set_var` in a multi-threaded process is unsound).
#[test]
fn loading_the_runtime_leaves_the_environment_alone() {
    if std::env::var_os("RESHARD_NIXL_ENV_CHILD").is_some() {
        assert!(std::env::var_os("UCX_MODULES").is_none());
        let _t = NixlTransport::new("env", &NixlOptions::default()).expect("endpoint");
        assert_eq!(std::env::var_os("UCX_MODULES"), None, "UCX_MODULES was set");
        assert_eq!(
            std::env::var_os("NIXL_PLUGIN_DIR"),
            None,
            "NIXL_PLUGIN_DIR was set"
        );
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert!(
            !maps.contains("libefa"),
            "the wheel's UCX efa module (and the system libefa) stayed out"
        );
        // A plugin folder NIXL would not use is a Config error, not an environment change.
        let e = NixlTransport::new(
            "env2",
            &NixlOptions {
                plugin_dir: Some(std::env::temp_dir()),
                ..NixlOptions::default()
            },
        )
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert!(e.message().contains("NIXL_PLUGIN_DIR="), "{e}");
        println!("child-ok");
        return;
    }
    if std::env::var_os(CHILD_ENV).is_some() || !available() {
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "loading_the_runtime_leaves_the_environment_alone",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("RESHARD_NIXL_ENV_CHILD", "1")
        .env_remove("UCX_MODULES")
        .env_remove("NIXL_PLUGIN_DIR")
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("child-ok"),
        "child failed ({:?}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
