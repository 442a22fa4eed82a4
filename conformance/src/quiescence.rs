//! The in-flight safety checks (docs/in-flight-safety.md): a batch caught mid-flight is ended
//! in each way the contract allows, and afterwards not one byte of it may land.
//!
//! Each check fills the destination with a canary, measures a clean transfer of the same batch
//! (duration `T`), posts again and ends it part-way; once the ending call has returned it
//! snapshots the destination, waits `2 T` (at least [`MIN_WATCH`]) and requires the destination
//! unchanged. A run only counts when the batch really was caught mid-flight (some but not all
//! canary bytes overwritten); the delay before the ending is adjusted until one is. Finally a
//! clean transfer of the same bytes must be byte-exact again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use reshard_core::{
    ErrorKind, HostBuffer, HostMemory, InFlight, MemoryBlock, PreparedBatch, ReadBatch, ReadDesc,
    Registration, Transport,
};

use crate::fixtures::Harness;

/// Bytes one check moves: large enough to stay in flight for milliseconds even in one process.
pub const QUIESCENCE_BYTES: usize = 256 << 20;
/// Bytes per read (many reads, so every backend has many completions to be part-way through).
const READ_LEN: u64 = 256 << 10;
/// The destination's byte before any read lands; the source pattern never contains it.
const CANARY: u8 = 0xCD;
/// Shortest time the destination is watched after the ending call returned.
pub const MIN_WATCH: Duration = Duration::from_millis(200);
/// Tries at catching the batch mid-flight before the check gives up.
const TRIES: usize = 8;
/// Tries after which a backend whose every post so far moved the whole batch before returning
/// is taken to always do so (NIXL over shared memory): more tries of 256 MiB each would only
/// repeat that, at seconds apiece under AddressSanitizer.
const SYNCHRONOUS_TRIES: usize = 3;

/// How a posted batch is ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// `InFlight::abort`.
    Abort,
    /// The `wait` future is dropped part-way (what `tokio::time::timeout` around it does).
    DroppedWaitFuture,
    /// The `InFlight` handle is dropped without `wait` or `abort`.
    DroppedHandle,
    /// The destination's `Registration`, the `PreparedBatch`, the receiving transport and
    /// then the `InFlight` handle are dropped while the batch is in flight.
    DroppedEverything,
    /// The `Registration`, `PreparedBatch` and transport are dropped while the batch is in
    /// flight, then `wait` is called: it must return (rule 4), and afterwards nothing lands.
    WaitAfterDroppedTransport,
}

fn pattern(i: usize) -> u8 {
    // 1..=200: never the canary (205).
    (i.wrapping_mul(7).wrapping_add(i >> 12) % 200) as u8 + 1
}

/// One receiving side: endpoint, destination, its registration and the prepared batch.
struct Side {
    /// `None` once [`Ending::DroppedEverything`] dropped it.
    rx: Option<Arc<dyn Transport>>,
    dst: Arc<HostBuffer>,
    reg: Option<Registration>,
    prepared: Option<PreparedBatch>,
}

impl Side {
    /// Drops the destination's registration, the prepared batch and the endpoint (the only
    /// reference to it outside the backend), keeping the destination memory to watch.
    fn drop_handles(&mut self) {
        drop(self.reg.take());
        drop(self.prepared.take());
        drop(self.rx.take());
    }
}

/// Publisher endpoint and source, kept for the whole check.
struct Source {
    tx: Arc<dyn Transport>,
    src: Arc<dyn HostMemory>,
    region: u64,
    _reg: Registration,
}

async fn source(h: &Harness, tag: &str) -> Source {
    let tx = h
        .endpoint(&format!("{tag}-src"))
        .expect("publisher endpoint");
    // The backend's own host memory where it has one (the fast path a publisher uses).
    let src: Arc<dyn HostMemory> = match tx
        .allocate_host(QUIESCENCE_BYTES)
        .await
        .expect("allocate_host")
    {
        Some(m) => m,
        None => Arc::new(HostBuffer::zeroed(QUIESCENCE_BYTES)),
    };
    {
        let mut b = src.bytes_mut();
        for (i, x) in b.iter_mut().enumerate() {
            *x = pattern(i);
        }
    }
    let reg = tx
        .register(Arc::clone(&src) as Arc<dyn MemoryBlock>)
        .await
        .expect("register source");
    Source {
        region: reg.id(),
        tx,
        src,
        _reg: reg,
    }
}

async fn side(h: &Harness, s: &Source, agent: &str) -> Side {
    let rx = h.endpoint(agent).expect("receiver endpoint");
    rx.load_peer(3, s.tx.export_metadata().await.expect("metadata"))
        .await
        .expect("load peer");
    let dst = Arc::new(HostBuffer::zeroed(QUIESCENCE_BYTES));
    let reg = rx
        .register(Arc::clone(&dst) as Arc<dyn MemoryBlock>)
        .await
        .expect("register destination");
    // Reads in an interleaved order (every 7th chunk first), so a part-way batch leaves holes
    // all over the destination rather than one clean prefix.
    let n = QUIESCENCE_BYTES as u64 / READ_LEN;
    let reads = (0..n)
        .map(|k| (k * 7) % n)
        .map(|i| ReadDesc {
            owner: 3,
            remote_region: s.region,
            remote_offset: i * READ_LEN,
            local_region: reg.id(),
            local_offset: i * READ_LEN,
            len: READ_LEN,
            remote_rows: None,
        })
        .collect();
    let prepared = rx.prepare(ReadBatch { reads }).await.expect("prepare");
    Side {
        rx: Some(rx),
        dst,
        reg: Some(reg),
        prepared: Some(prepared),
    }
}

fn fill_canary(dst: &HostBuffer) {
    dst.write().fill(CANARY);
}

/// Distance between sampled bytes: every read covers many samples, and a sample takes
/// microseconds, so the snapshot right after the ending is taken before a late read could
/// finish unseen.
const SAMPLE_STRIDE: usize = 4096;

/// Every [`SAMPLE_STRIDE`]-th byte of the destination.
fn samples(dst: &HostBuffer) -> Vec<u8> {
    dst.read().iter().step_by(SAMPLE_STRIDE).copied().collect()
}

fn canaries(dst: &HostBuffer) -> usize {
    dst.read().iter().filter(|&&b| b == CANARY).count()
}

fn fingerprint(dst: &HostBuffer) -> u128 {
    twox_hash::XxHash3_128::oneshot(&dst.read())
}

fn assert_exact(dst: &HostBuffer, src: &dyn HostMemory, ctx: &str) {
    let (got, want) = (dst.read(), src.bytes());
    if got[..] != want[..] {
        let at = got.iter().zip(want.iter()).position(|(a, b)| a != b);
        panic!("{ctx}: destination differs from the source at byte {at:?}");
    }
}

/// A clean post and wait into `s`; returns how long it took.
async fn clean(s: &Side, src: &dyn HostMemory, ctx: &str) -> Duration {
    fill_canary(&s.dst);
    let t = Instant::now();
    let prepared = s.prepared.as_ref().expect("prepared batch");
    let rx = s.rx.as_ref().expect("endpoint");
    let report = crate::checks::post_and_wait(rx.as_ref(), prepared, ctx).await;
    let took = t.elapsed();
    assert_eq!(report.bytes, QUIESCENCE_BYTES as u64, "{ctx}: bytes moved");
    assert_exact(&s.dst, src, ctx);
    took
}

/// Canary bytes among the samples: how much of the batch has not landed yet.
fn sampled_canaries(dst: &HostBuffer) -> usize {
    samples(dst).iter().filter(|&&b| b == CANARY).count()
}

/// Ends `inflight` as `ending` says, `delay` after it was posted. Returns when the ending call
/// has returned (for the dropped variants: when the drop has finished), with the sampled canary
/// count at the moment the ending began (`None`: the batch had finished by itself first).
async fn end(
    ending: Ending,
    inflight: Box<dyn InFlight>,
    delay: Duration,
    s: &mut Side,
) -> Option<usize> {
    match ending {
        Ending::Abort => {
            tokio::time::sleep(delay).await;
            let at = sampled_canaries(&s.dst);
            inflight.abort().await;
            Some(at)
        }
        Ending::DroppedWaitFuture => {
            // What `tokio::time::timeout` around `wait` does when it elapses: the `wait`
            // future, and with it the handle, is dropped part-way.
            let mut wait = inflight.wait();
            tokio::select! {
                r = &mut wait => {
                    r.expect("a batch that finished must have succeeded");
                    None
                }
                _ = tokio::time::sleep(delay) => {
                    let at = sampled_canaries(&s.dst);
                    drop(wait);
                    Some(at)
                }
            }
        }
        Ending::DroppedHandle => {
            tokio::time::sleep(delay).await;
            let at = sampled_canaries(&s.dst);
            drop(inflight);
            Some(at)
        }
        Ending::DroppedEverything => {
            tokio::time::sleep(delay).await;
            let at = sampled_canaries(&s.dst);
            s.drop_handles();
            drop(inflight);
            Some(at)
        }
        Ending::WaitAfterDroppedTransport => {
            tokio::time::sleep(delay).await;
            let at = sampled_canaries(&s.dst);
            s.drop_handles();
            // Every waiter wakes (rule 4): with the bytes or with an error, but it returns.
            let r = tokio::time::timeout(Duration::from_secs(60), inflight.wait())
                .await
                .expect("wait on a batch whose transport was dropped must return");
            if let Err(e) = r {
                eprintln!("wait after dropping the transport: {e}");
            }
            Some(at)
        }
    }
}

/// The check: catch a batch mid-flight, end it with `ending`, and prove no byte lands after.
pub async fn quiescent_after(h: &Harness, ending: Ending) {
    let tag = format!("quiet-{ending:?}").to_lowercase();
    let src = source(h, &tag).await;
    let mut caught = 0usize;
    let mut synchronous = 0usize;
    let mut delay: Option<Duration> = None;
    let mut log = Vec::new();
    let mut tries = 0usize;
    for attempt in 0..TRIES {
        tries += 1;
        let mut s = side(h, &src, &format!("{tag}-dst{attempt}")).await;
        let took = clean(&s, &*src.src, &format!("{ending:?}: clean transfer")).await;
        let d = *delay.get_or_insert(took / 4);
        fill_canary(&s.dst);
        let prepared = s.prepared.as_ref().expect("prepared batch");
        let inflight =
            s.rx.as_ref()
                .expect("endpoint")
                .post(prepared)
                .await
                .expect("post");
        // A backend may move everything inside `post` (NIXL over shared memory does): then
        // nothing is in flight for the caller to end, and the attempt cannot count.
        if samples(&s.dst).iter().all(|&b| b != CANARY) {
            synchronous += 1;
        }
        let at_end = end(ending, inflight, d, &mut s).await;
        // The ending call has returned: from here on not one byte may land. A quick sampled
        // snapshot first (a late read would change it), then the full picture.
        let first = samples(&s.dst);
        let left = canaries(&s.dst);
        let before = fingerprint(&s.dst);
        tokio::time::sleep((took * 2).max(MIN_WATCH)).await;
        let last = samples(&s.dst);
        let after = fingerprint(&s.dst);
        let still = canaries(&s.dst);
        let moved = first.iter().zip(&last).filter(|(a, b)| a != b).count();
        assert!(
            moved == 0 && before == after,
            "{ending:?}: bytes of the batch landed after the ending call returned ({moved} of \
             {} sampled bytes changed; canary bytes {left} -> {still}; clean transfer took \
             {took:?}, ended after {d:?})",
            first.len()
        );
        let left = first.iter().filter(|&&b| b == CANARY).count() * SAMPLE_STRIDE;
        let n = first.len();
        log.push(match at_end {
            Some(at) => format!(
                "{d:?}: ~{} canary bytes when ended, ~{left} after",
                at * SAMPLE_STRIDE
            ),
            None => format!("{d:?}: finished before it was ended"),
        });
        match at_end {
            // Finished before it was ended: end sooner.
            None | Some(0) => delay = Some(d / 3),
            // Nothing had landed yet: end later.
            Some(at) if at == n => delay = Some((d * 2).max(Duration::from_micros(200))),
            // Part-way: whether the ending stopped the rest or waited it out, nothing landed
            // after it returned (checked above).
            Some(_) => caught += 1,
        }
        if s.rx.is_some() {
            // The same prepared batch moves the bytes exactly again: the ending left the
            // backend's state clean (nothing was quarantined: the peer is alive).
            clean(
                &s,
                &*src.src,
                &format!("{ending:?}: transfer after the ending"),
            )
            .await;
        } else {
            let s = side(h, &src, &format!("{tag}-again{attempt}")).await;
            clean(
                &s,
                &*src.src,
                &format!("{ending:?}: transfer on a new endpoint"),
            )
            .await;
        }
        if caught >= 2 {
            return;
        }
        if synchronous == tries && tries >= SYNCHRONOUS_TRIES {
            break;
        }
    }
    if synchronous == tries {
        // Every post returned with every byte landed: there was never a batch in flight to
        // end, so rule 1 holds trivially here. The backend's own tests must catch it mid-flight
        // another way (nixl: tests/in_flight.rs, over TCP with publishers it drives).
        eprintln!(
            "NOTE: {} {ending:?}: every post completed the whole batch before returning; \
             nothing was in flight to end",
            h.name()
        );
        return;
    }
    panic!(
        "{ending:?}: caught the batch mid-flight only {caught} times in {tries} tries \
         ({synchronous} completed inside post; {})",
        log.join("; ")
    );
}

/// A dense model of about 300 MB in bf16: a refit of one TP-2 rank stays on the wire for tens
/// of milliseconds in shared memory and for hundreds over TCP.
pub fn large_dense() -> reshard_planner::presets::ModelConfig {
    reshard_planner::presets::ModelConfig {
        name: "large-dense".into(),
        layers: 2,
        hidden: 2048,
        heads: 16,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 5632,
        moe: None,
        vocab: 16000,
        tied_embeddings: false,
        qk_norm: false,
        dtype: reshard_core::DType::Bf16,
        arch: Default::default(),
    }
}

fn live_fingerprint(rx: &reshard_runtime::Receiver) -> Vec<u128> {
    rx.live_params()
        .expect("live weights")
        .iter()
        .map(|b| fingerprint(b))
        .collect()
}

/// Kills the publishers' process (SIGKILL) while a refit is reading from it. The refit must
/// return (rule 4) — with an error, leaving the previous weights exactly as they were, or, where
/// the bytes were still reachable (shared memory outlives its creator's death), having installed
/// and verified them — and afterwards nothing may change; a refit from a new publisher process
/// is then byte-exact. Needs a harness with publishers in a child process.
pub async fn quiescent_after_publisher_killed(h: &Harness) {
    assert!(h.is_cross_process(), "needs publishers in a child process");
    let mut caught = 0usize;
    let mut log = Vec::new();
    let mut delay: Option<Duration> = None;
    for _attempt in 0..TRIES {
        let mut cluster = h.cluster(large_dense(), "tp=2").await;
        let mut rx = h.receiver(&cluster, 2, 0).await;
        let t = Instant::now();
        rx.update(&cluster.tables()).await.expect("first refit");
        let took = t.elapsed();
        let d = *delay.get_or_insert(took / 4);
        let before = live_fingerprint(&rx);
        cluster.publish_step(1).expect("publish step 1");
        let want = cluster
            .expected_params(rx.layout())
            .expect("reference parameters");
        let tables = cluster.tables();
        let ranks: Vec<_> = tables.iter().map(|t| t.publisher.rank).collect();
        let started = Instant::now();
        let (r, ()) = tokio::join!(
            tokio::time::timeout(Duration::from_secs(120), rx.update(&tables)),
            async {
                tokio::time::sleep(d).await;
                cluster.kill().expect("kill the publisher process");
            }
        );
        let r = r.expect("a refit whose publisher died must return");
        let ran = started.elapsed();
        // Whatever happened, from here on the live weights must not change.
        let now = live_fingerprint(&rx);
        match &r {
            Err(e) => {
                assert_eq!(now, before, "a failed refit changed the live weights ({e})");
                assert_eq!(rx.live_step(), Some(0));
                // A typed wire failure that names a publisher of the dead process.
                let owner = crate::checks::wire_failure_owner(
                    e,
                    &[
                        ErrorKind::Transport,
                        ErrorKind::Timeout,
                        ErrorKind::PeerUnknown,
                    ],
                    "a dead publisher is a transport failure",
                );
                assert!(
                    ranks.contains(&owner),
                    "the error names owner {owner}, not a publisher of the killed process \
                     ({ranks:?}): {e}"
                );
                log.push(format!("{d:?}: failed after {ran:?}: {e}"));
                caught += 1;
            }
            Ok(_) => {
                let live = rx.live_params().expect("live weights");
                for (got, want) in live.iter().zip(&want) {
                    assert!(got.read()[..] == want[..], "installed weights are exact");
                }
                log.push(format!("{d:?}: installed after {ran:?}"));
                // Too late to catch it on the wire when the transfer ended before the kill.
                if ran <= d {
                    delay = Some(d / 3);
                } else {
                    caught += 1;
                }
            }
        }
        tokio::time::sleep((took * 2).max(MIN_WATCH)).await;
        assert_eq!(
            live_fingerprint(&rx),
            now,
            "live weights changed after the refit returned ({})",
            log.last().map_or("", String::as_str)
        );
        // A new publisher process: the same receiver refits from it, byte-exact.
        let mut fresh = h.cluster(large_dense(), "tp=2").await;
        fresh.publish_step(2).expect("publish step 2");
        fresh
            .connect(rx.transport().as_ref())
            .await
            .expect("load the new publishers' metadata");
        rx.update(&fresh.tables())
            .await
            .unwrap_or_else(|e| panic!("refit from a new publisher process: {e}"));
        crate::checks::assert_installed(&fresh, &rx);
        if caught >= 2 {
            eprintln!("publisher killed: {}", log.join("; "));
            return;
        }
    }
    panic!(
        "caught the refit on the wire only {caught} times in {TRIES} tries ({})",
        log.join("; ")
    );
}

/// Sends `signal` (`STOP`, `CONT`) to process `pid` with the system's `kill` command.
fn signal(pid: u32, signal: &str) {
    let ok = std::process::Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{signal} {pid}");
}

/// Stops the publishers' process (SIGSTOP) while a refit reads from it, so reads that need the
/// publisher (one-sided reads emulated over TCP) stop progressing. The refit must return by
/// itself — the backend's no-progress timer, not a total deadline, ends it (rule 4) — with an
/// error that leaves the previous weights untouched (or, on a path that needs no help from the
/// publisher, installed and verified); nothing may change afterwards, not even once the
/// publisher runs again (SIGCONT) and answers the reads it had pending; and the next refit from
/// the same publishers is byte-exact. Needs a harness with publishers in a child process whose
/// endpoints have a short no-progress timeout (a few seconds).
pub async fn quiescent_after_publisher_stalled(h: &Harness) {
    assert!(h.is_cross_process(), "needs publishers in a child process");
    let mut cluster = h.cluster(large_dense(), "tp=2").await;
    let pid = cluster.pid().expect("publisher process id");
    let mut rx = h.receiver(&cluster, 2, 0).await;
    let t = Instant::now();
    rx.update(&cluster.tables()).await.expect("first refit");
    let took = t.elapsed();
    let before = live_fingerprint(&rx);
    cluster.publish_step(1).expect("publish step 1");
    let tables = cluster.tables();
    let started = Instant::now();
    let (r, ()) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(120), rx.update(&tables)),
        async {
            tokio::time::sleep(took / 4).await;
            signal(pid, "STOP");
        }
    );
    let r = r.expect("a refit whose publisher stopped must end by its no-progress timer");
    let ran = started.elapsed();
    let now = live_fingerprint(&rx);
    match &r {
        Err(e) => {
            assert_eq!(now, before, "a failed refit changed the live weights ({e})");
            assert_eq!(rx.live_step(), Some(0));
            eprintln!("publisher stalled: refit failed after {ran:?}: {e}");
        }
        Ok(_) => {
            crate::checks::assert_installed(&cluster, &rx);
            eprintln!("publisher stalled: refit installed after {ran:?} (did not need it)");
        }
    }
    // The publisher runs again and answers whatever it had pending: none of it may land.
    signal(pid, "CONT");
    tokio::time::sleep((took * 2).max(MIN_WATCH) + Duration::from_millis(500)).await;
    assert_eq!(
        live_fingerprint(&rx),
        now,
        "live weights changed after the refit returned"
    );
    // The same publishers, running again: the next refit is byte-exact.
    cluster.publish_step(2).expect("publish step 2");
    let t = Instant::now();
    loop {
        match rx.update(&cluster.tables()).await {
            Ok(_) => break,
            // Reads quarantined by the stall are released once the publisher answered them;
            // until then the backend may refuse with a retryable error.
            Err(e) if e.is_retryable() && t.elapsed() < Duration::from_secs(60) => {
                eprintln!("refit after the stall, retrying: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("refit after the publisher resumed: {e}"),
        }
    }
    crate::checks::assert_installed(&cluster, &rx);
}
