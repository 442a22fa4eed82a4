//! Concurrency across receivers: two receivers in one process and two receiver processes.

use super::*;

/// Two receiver ranks (TP2 ranks 0 and 1, each on its own endpoint) refit concurrently, as two
/// tokio tasks, from the same publishers for several steps; each install is byte-exact.
pub async fn two_receivers_refit_concurrently(h: &Harness) {
    let mut cluster = h.cluster(tiny_moe(), "ep=8,dp=8").await;
    let mut rxs = vec![
        h.receiver(&cluster, 2, 0).await,
        h.receiver(&cluster, 2, 1).await,
    ];
    for step in 0..4 {
        if step > 0 {
            cluster.publish_step(step).expect("publish step");
        }
        let tables = Arc::new(cluster.tables());
        let tasks: Vec<_> = rxs
            .drain(..)
            .map(|mut rx| {
                let tables = tables.clone();
                tokio::spawn(async move {
                    let r = rx.update(&tables).await;
                    (rx, r)
                })
            })
            .collect();
        for t in tasks {
            let (rx, r) = t.await.expect("receiver task");
            r.unwrap_or_else(|e| panic!("rank {} step {step}: {e}", rx.layout().receiver_rank));
            assert_installed(&cluster, &rx);
            rxs.push(rx);
        }
    }
}

/// Environment variable naming the directory a receiver process (see
/// [`two_receiver_processes`]) exchanges files with its parent through; set only in that child.
/// Not `RESHARD_`-prefixed, so configuration loading never sees it.
pub const RECEIVER_DIR_ENV: &str = "CONFORMANCE_RECEIVER_DIR";
/// Environment variable: the receiver rank (TP2) a receiver process refits.
pub const RECEIVER_RANK_ENV: &str = "CONFORMANCE_RECEIVER_RANK";
/// Steps the receiver processes refit.
const RECEIVER_PROCESS_STEPS: u64 = 4;
/// Bound on any one wait of the receiver-process check.
const RECEIVER_PROCESS_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// True in a receiver process started by [`two_receiver_processes`].
pub fn is_receiver_process() -> bool {
    std::env::var_os(RECEIVER_DIR_ENV).is_some()
}

fn unix_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// Writes `bytes` to `path` atomically (a reader polling for `path` never sees it half-written).
fn publish_file(path: &std::path::Path, bytes: &[u8]) {
    let tmp = path.with_extension("part");
    std::fs::write(&tmp, bytes).unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()));
    std::fs::rename(&tmp, path).unwrap_or_else(|e| panic!("rename {}: {e}", path.display()));
}

/// Waits (polling every millisecond) until `path` exists; `alive` is asked between polls and
/// may panic (a child that died).
async fn wait_for_file(path: &std::path::Path, mut alive: impl FnMut()) {
    let t = std::time::Instant::now();
    while !path.exists() {
        alive();
        assert!(
            t.elapsed() < RECEIVER_PROCESS_WAIT,
            "timed out waiting for {}",
            path.display()
        );
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// Body of a receiver process: a TP2 receiver rank ([`RECEIVER_RANK_ENV`]) on an endpoint from
/// `endpoint`, driven through files in [`RECEIVER_DIR_ENV`]. It loads the publishers' metadata,
/// then per step says it is ready, waits for the step's encoded tables, refits, and checks every
/// live parameter against the digests of the parent's reference; any failure panics, which
/// fails the child's test run (its exit status is what the parent checks).
pub fn serve_receiver(endpoint: impl Fn(&str) -> reshard_core::Result<Arc<dyn Transport>>) {
    use reshard_planner::layouts::receiver_layout;
    use reshard_planner::topology::ReceiverTopology;
    let dir = std::path::PathBuf::from(std::env::var_os(RECEIVER_DIR_ENV).expect("receiver dir"));
    let rank: u32 = std::env::var(RECEIVER_RANK_ENV)
        .expect("receiver rank")
        .parse()
        .expect("receiver rank is a number");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        let t = endpoint(&format!("receiver-process-{rank}")).expect("receiver endpoint");
        let owners = std::fs::read_to_string(dir.join("owners")).expect("owners");
        for owner in owners.split_whitespace() {
            let md = std::fs::read(dir.join(format!("meta-{owner}"))).expect("metadata");
            t.load_peer(owner.parse().expect("owner"), md.into())
                .await
                .expect("load publisher metadata");
        }
        let layout = receiver_layout(&medium_dense(), &ReceiverTopology::tp(2), rank)
            .expect("receiver layout");
        let mut rx = Receiver::new(t, layout, ReceiverOptions::default()).expect("receiver");
        for s in 0..RECEIVER_PROCESS_STEPS {
            publish_file(&dir.join(format!("ready-{rank}-{s}")), b"");
            let ready = dir.join(format!("step-{s}"));
            wait_for_file(&ready, || {}).await;
            let count: usize = std::fs::read_to_string(&ready)
                .expect("step file")
                .trim()
                .parse()
                .expect("table count");
            let tables: Vec<ShardTable> = (0..count)
                .map(|i| {
                    let b = std::fs::read(dir.join(format!("step-{s}-table-{i}"))).expect("table");
                    reshard_core::encoding::decode_table(&b).expect("decode table")
                })
                .collect();
            let t0 = unix_nanos();
            rx.update(&tables)
                .await
                .unwrap_or_else(|e| panic!("receiver process {rank}: step {s}: {e}"));
            let t1 = unix_nanos();
            let want = std::fs::read_to_string(dir.join(format!("want-{rank}-{s}")))
                .expect("reference digests");
            let live = rx.live_params().expect("live weights");
            let want: Vec<&str> = want.lines().collect();
            assert_eq!(live.len(), want.len(), "receiver process {rank}: step {s}");
            for ((p, got), want) in rx.layout().params.iter().zip(live).zip(want) {
                assert_eq!(
                    Digest::of(&got.read()).to_hex(),
                    want,
                    "receiver process {rank}: step {s}: parameter {} differs from the reference",
                    p.name
                );
            }
            assert_eq!(rx.live_step(), Some(tables[0].step));
            publish_file(
                &dir.join(format!("ok-{rank}-{s}")),
                format!("{t0} {t1}").as_bytes(),
            );
        }
    });
}

/// Kills and reaps the receiver children if the parent check fails part-way.
struct Children(Vec<std::process::Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// Two receiver processes at once against publishers in a third: the harness's publisher child
/// holds a ~80 MB dense model at TP2; two children started by `command()` (this test binary
/// re-executed as [`serve_receiver`]) are receiver ranks 0 and 1, each on its own endpoint.
/// For each of several steps both children signal ready, the parent hands them the step's
/// tables at once, and both refit concurrently; each checks its live weights byte for byte
/// (by digest) against the generator's reference. Each child reports through its exit status.
pub async fn two_receiver_processes(h: &Harness, command: impl Fn() -> std::process::Command) {
    assert!(h.is_cross_process(), "needs publishers in a child process");
    let started = std::time::Instant::now();
    let mut cluster = h.cluster(medium_dense(), "tp=2").await;
    let dir = std::env::temp_dir().join(format!(
        "reshard-receivers-{}-{}",
        std::process::id(),
        unix_nanos()
    ));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let mut owners = String::new();
    for (owner, md) in cluster.metadata().await.expect("metadata") {
        publish_file(&dir.join(format!("meta-{owner}")), &md);
        owners.push_str(&format!("{owner} "));
    }
    publish_file(&dir.join("owners"), owners.as_bytes());
    let layouts: Vec<_> = (0..2)
        .map(|r| {
            reshard_planner::layouts::receiver_layout(
                cluster.model(),
                &reshard_planner::topology::ReceiverTopology::tp(2),
                r,
            )
            .expect("layout")
        })
        .collect();
    let mut children = Children(
        (0..2)
            .map(|rank| {
                let mut c = command();
                c.env(RECEIVER_DIR_ENV, &dir)
                    .env(RECEIVER_RANK_ENV, rank.to_string())
                    .stdout(std::process::Stdio::null());
                c.spawn().expect("start a receiver process")
            })
            .collect(),
    );
    // A child that exited successfully has finished its last step (it may do so while the
    // other is still refitting); only a failed exit ends the wait early.
    let alive = |children: &mut Children| {
        for (rank, c) in children.0.iter_mut().enumerate() {
            if let Ok(Some(status)) = c.try_wait().map(|s| s.filter(|s| !s.success())) {
                panic!("{}: receiver process {rank} failed: {status}", h.name());
            }
        }
    };
    let mut overlapped = 0;
    for s in 0..RECEIVER_PROCESS_STEPS {
        if s > 0 {
            cluster.publish_step(s).expect("publish step");
        }
        for (rank, layout) in layouts.iter().enumerate() {
            let want: String = cluster
                .expected_params(layout)
                .expect("reference")
                .iter()
                .map(|p| Digest::of(p).to_hex() + "\n")
                .collect();
            publish_file(&dir.join(format!("want-{rank}-{s}")), want.as_bytes());
        }
        let tables = cluster.tables();
        for (i, t) in tables.iter().enumerate() {
            publish_file(
                &dir.join(format!("step-{s}-table-{i}")),
                &reshard_core::encoding::encode_table(t),
            );
        }
        for rank in 0..2 {
            wait_for_file(&dir.join(format!("ready-{rank}-{s}")), || {
                alive(&mut children)
            })
            .await;
        }
        // Both are waiting: hand them the step at once.
        publish_file(
            &dir.join(format!("step-{s}")),
            tables.len().to_string().as_bytes(),
        );
        let mut spans = Vec::new();
        for rank in 0..2 {
            let ok = dir.join(format!("ok-{rank}-{s}"));
            wait_for_file(&ok, || alive(&mut children)).await;
            let span = std::fs::read_to_string(&ok).expect("span");
            let v: Vec<u128> = span
                .split_whitespace()
                .map(|x| x.parse().expect("nanos"))
                .collect();
            spans.push((v[0], v[1]));
        }
        if spans[0].0 < spans[1].1 && spans[1].0 < spans[0].1 {
            overlapped += 1;
        }
    }
    for (rank, c) in children.0.iter_mut().enumerate() {
        let t = std::time::Instant::now();
        let status = loop {
            if let Some(status) = c.try_wait().expect("wait for a receiver process") {
                break status;
            }
            assert!(
                t.elapsed() < RECEIVER_PROCESS_WAIT,
                "receiver process {rank} hangs"
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        };
        assert!(status.success(), "receiver process {rank} failed: {status}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "{}: two receiver processes refit {RECEIVER_PROCESS_STEPS} steps byte-exact in {:.1} s \
         (refits overlapped in time in {overlapped} of them)",
        h.name(),
        started.elapsed().as_secs_f64()
    );
}
