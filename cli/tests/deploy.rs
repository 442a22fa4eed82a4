//! The deployment path as separate processes (docs/deployment.md): a private etcd
//! (scripts/etcd.sh), `reshard publish` processes serving a safetensors checkpoint folder over
//! UCX restricted to TCP, and `reshard receive` processes that refit every new step and dump
//! what they installed. Each dump is compared with slices cut directly from the checkpoint
//! files by this test's own reading of vLLM's TP layout, not through reshard's planner.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use reshard_checkpoint::Checkpoint;

const R: &str = env!("CARGO_BIN_EXE_reshard");

/// One cluster at a time: each is ten processes, and the machine has two cores.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn scripts() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts")
}

/// Skips loudly where the transport or etcd is missing, unless `RESHARD_REQUIRE_BACKENDS`
/// asks for every backend.
fn available(transport: &str) -> bool {
    let probe = reshard_transports::registry().probe(transport);
    if !reshard_conformance::backend_available(transport, probe) {
        return false;
    }
    let etcd = Command::new("etcd").arg("--version").output().is_ok();
    assert!(
        etcd || std::env::var_os("RESHARD_REQUIRE_BACKENDS").is_none(),
        "etcd is required here: run scripts/install-deps.sh"
    );
    if !etcd {
        eprintln!("SKIPPED: etcd is not installed (scripts/install-deps.sh installs it)");
    }
    etcd
}

/// A private etcd, a checkpoint folder, publisher and receiver processes; everything is killed
/// and etcd stopped when the test ends, whatever happened.
struct Cluster {
    dir: PathBuf,
    etcd: String,
    transport: &'static str,
    env: Vec<(&'static str, &'static str)>,
    publishers: Vec<Option<Child>>,
    receivers: Vec<(Child, mpsc::Receiver<serde_json::Value>)>,
    /// Publishers' lease: short, so a killed one expires within a test.
    lease_ttl_s: &'static str,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in self.publishers.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for (c, _) in &mut self.receivers {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("bash")
            .arg(scripts().join("etcd.sh"))
            .arg("stop")
            .arg(self.dir.join("etcd"))
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The transport each test runs over, restricted to TCP as between hosts.
fn transport_env(transport: &str) -> Vec<(&'static str, &'static str)> {
    match transport {
        "ucx" => vec![("RESHARD_BACKENDS__UCX__TLS", "tcp")],
        _ => vec![("UCX_TLS", "tcp")],
    }
}

impl Cluster {
    fn start(name: &str, transport: &'static str) -> Cluster {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("deploy-{name}-{transport}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let start = Command::new("bash")
            .arg(scripts().join("etcd.sh"))
            .arg("start")
            .arg(dir.join("etcd"))
            .output()
            .unwrap();
        assert!(
            start.status.success(),
            "{}",
            String::from_utf8_lossy(&start.stderr)
        );
        let etcd = String::from_utf8(start.stdout).unwrap().trim().to_string();
        Cluster {
            dir,
            etcd,
            transport,
            env: transport_env(transport),
            publishers: Vec::new(),
            receivers: Vec::new(),
            lease_ttl_s: "3",
        }
    }

    fn ckpts(&self) -> PathBuf {
        self.dir.join("ckpts")
    }

    /// Starts receiver `t` of TP2; its JSON lines arrive on the channel kept with it.
    fn receiver(&mut self, t: usize, steps: u64) {
        let mut child = Command::new(R)
            .args(["receive", "--rendezvous", &self.etcd, "--model", "q"])
            .args(["--receivers", "tp=2", "--rank", &t.to_string()])
            .args(["--transport", self.transport, "--steps", &steps.to_string()])
            .args(["--json", "--timeout-s", "60", "--lease-ttl-s", "3"])
            .arg("--dump")
            .arg(self.dir.join(format!("dump-{t}")))
            .envs(self.env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let (tx, rx) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(|l| l.ok()) {
                let v: serde_json::Value = serde_json::from_str(&line).expect("JSON line");
                if tx.send(v).is_err() {
                    break;
                }
            }
        });
        self.receivers.push((child, rx));
    }

    /// Starts (or restarts) publisher rank `r` of EP8/DP8.
    fn publisher(&mut self, r: usize) {
        let child = Command::new(R)
            .args([
                "publish",
                "--rendezvous",
                &self.etcd,
                "--model",
                "q",
                "--checkpoint",
            ])
            .arg(self.ckpts())
            .args(["--publishers", "ep=8,dp=8", "--rank", &r.to_string()])
            .args([
                "--transport",
                self.transport,
                "--lease-ttl-s",
                self.lease_ttl_s,
                "--poll-ms",
                "100",
            ])
            .envs(self.env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        if self.publishers.len() <= r {
            self.publishers.resize_with(r + 1, || None);
        }
        self.publishers[r] = Some(child);
    }

    fn signal(&self, r: usize, sig: &str) {
        let pid = self.publishers[r].as_ref().unwrap().id().to_string();
        assert!(Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success());
    }

    /// The next JSON line of receiver `t`.
    fn line(&self, t: usize) -> serde_json::Value {
        self.receivers[t]
            .1
            .recv_timeout(Duration::from_secs(90))
            .unwrap_or_else(|_| panic!("receiver {t} printed nothing for 90 s"))
    }

    /// Waits for every receiver to exit 0.
    fn receivers_succeed(&mut self) {
        for (t, (c, _)) in self.receivers.iter_mut().enumerate() {
            let status = c.wait().unwrap();
            assert!(status.success(), "receiver {t} exited {status}");
        }
    }

    /// Members `reshard status` shows, as (rank, step).
    fn status(&self) -> Vec<(u64, u64)> {
        let out = Command::new(R)
            .args([
                "status",
                "--rendezvous",
                &self.etcd,
                "--model",
                "q",
                "--json",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v[0]["publishers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p["rank"].as_u64().unwrap(), p["step"].as_u64().unwrap()))
            .collect()
    }

    /// Asserts an installed step's JSON line and its dump against the checkpoint files.
    fn installed(&self, t: usize, v: &serde_json::Value, step: u64) {
        assert_eq!(v["step"], step, "receiver {t}: {v}");
        assert_eq!(v["verified"], true, "receiver {t}: {v}");
        for key in ["reads", "wire_bytes", "stages_s", "e2e_s", "attribution"] {
            assert!(v.get(key).is_some(), "receiver {t}: no {key} in {v}");
        }
        let ckpt = Checkpoint::open(self.ckpts().join(format!("step-{step}"))).unwrap();
        let dump = self
            .dir
            .join(format!("dump-{t}/step-{step}/model.safetensors"));
        check_dump(&dump, &ckpt, t, 2);
    }
}

fn checkpoint(dir: &Path, step: u64) {
    let out = Command::new(R)
        .args(["checkpoint", "--preset", "qwen3-30b-a3b", "--layers", "1"])
        .args(["--experts", "8", "--vocab", "512", "--max-shard-mib", "16"])
        .args(["--step", &step.to_string(), "--out"])
        .arg(dir.join(format!("step-{step}")))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Bytes of rows `rows` of a row-major 2-D tensor with `cols` columns of `elem` bytes.
fn rows(t: &[u8], cols: usize, elem: usize, rows: std::ops::Range<usize>) -> Vec<u8> {
    t[rows.start * cols * elem..rows.end * cols * elem].to_vec()
}

/// Columns `c` of every row of a row-major 2-D tensor.
fn cols(t: &[u8], ncols: usize, elem: usize, c: std::ops::Range<usize>) -> Vec<u8> {
    t.chunks(ncols * elem)
        .flat_map(|row| row[c.start * elem..c.end * elem].to_vec())
        .collect()
}

/// What TP rank `t` of `tp` holds of each parameter in vLLM's naming, cut from the checkpoint.
fn expected(ckpt: &Checkpoint, name: &str, t: usize, tp: usize) -> Vec<u8> {
    let m = ckpt.model();
    let (h, e) = (m.hidden as usize, 2usize);
    let hd = m.head_dim as usize;
    let (q, kv) = (m.heads as usize * hd, m.kv_heads as usize * hd);
    let get = |n: &str| ckpt.tensor_bytes(n).unwrap().to_vec();
    let part = |len: usize| (t * len / tp)..((t + 1) * len / tp);
    let l = "model.layers.0.";
    match name.strip_prefix(l).unwrap_or(name) {
        "model.embed_tokens.weight" | "lm_head.weight" => {
            rows(&get(name), h, e, part(m.vocab as usize))
        }
        "self_attn.qkv_proj.weight" => [
            rows(&get(&format!("{l}self_attn.q_proj.weight")), h, e, part(q)),
            rows(&get(&format!("{l}self_attn.k_proj.weight")), h, e, part(kv)),
            rows(&get(&format!("{l}self_attn.v_proj.weight")), h, e, part(kv)),
        ]
        .concat(),
        "self_attn.o_proj.weight" => cols(&get(name), q, e, part(q)),
        "mlp.experts.w13_weight" => {
            let i = m.moe.as_ref().unwrap().expert_intermediate as usize;
            (0..m.moe.as_ref().unwrap().experts)
                .flat_map(|x| {
                    let p = |proj: &str| get(&format!("{l}mlp.experts.{x}.{proj}.weight"));
                    [
                        rows(&p("gate_proj"), h, e, part(i)),
                        rows(&p("up_proj"), h, e, part(i)),
                    ]
                    .concat()
                })
                .collect()
        }
        "mlp.experts.w2_weight" => {
            let i = m.moe.as_ref().unwrap().expert_intermediate as usize;
            (0..m.moe.as_ref().unwrap().experts)
                .flat_map(|x| {
                    cols(
                        &get(&format!("{l}mlp.experts.{x}.down_proj.weight")),
                        i,
                        e,
                        part(i),
                    )
                })
                .collect()
        }
        // Norms and the router are replicated: the whole tensor.
        _ => get(name),
    }
}

/// Compares receiver `t`'s dump of `step` with the checkpoint, parameter by parameter.
fn check_dump(dump: &Path, ckpt: &Checkpoint, t: usize, tp: usize) {
    let bytes = std::fs::read(dump).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let names = st.names();
    assert_eq!(names.len(), 12, "{names:?}");
    for name in names {
        let got = st.tensor(name).unwrap();
        let want = expected(ckpt, name, t, tp);
        assert!(
            got.data() == &want[..],
            "receiver {t}: {name} differs from the checkpoint ({} vs {} bytes)",
            got.data().len(),
            want.len()
        );
    }
}

/// etcd, 8 publisher processes (EP8/DP8) and 2 receiver processes (TP2, started first: they
/// wait), 3 steps of changing weights, every dump byte-exact against the checkpoint files.
fn three_steps(transport: &'static str) {
    if !available(transport) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = Cluster::start("steps", transport);
    for t in 0..2 {
        c.receiver(t, 3);
    }
    checkpoint(&c.ckpts(), 1);
    for r in 0..8 {
        c.publisher(r);
    }
    for step in 1..=3u64 {
        if step > 1 {
            checkpoint(&c.ckpts(), step);
        }
        for t in 0..2 {
            let v = c.line(t);
            c.installed(t, &v, step);
            assert_eq!(v["plan_rebuilt"], step == 1, "planned once: {v}");
        }
    }
    c.receivers_succeed();
    // SIGTERM: every publisher withdraws at once (well inside its 3 s lease) and exits 0.
    let stopped = Instant::now();
    for r in 0..8 {
        c.signal(r, "-TERM");
    }
    for r in 0..8 {
        let status = c.publishers[r].take().unwrap().wait().unwrap();
        assert!(status.success(), "publisher {r} exited {status}");
    }
    assert!(c.status().is_empty(), "withdrawn: {:?}", c.status());
    assert!(
        stopped.elapsed() < Duration::from_secs(3),
        "{:?}",
        stopped.elapsed()
    );
}

/// All eight publishers and both receivers (each to exit after `steps` steps) at step 1, then
/// rank 5 stopped (SIGSTOP) and step 2 written: returns once rank 3 is announced at step 2, so
/// the set for step 2 cannot complete until rank 5 continues.
fn rank3_ahead_of_stopped_rank5(c: &mut Cluster, steps: u64) {
    checkpoint(&c.ckpts(), 1);
    for r in 0..8 {
        c.publisher(r);
    }
    for t in 0..2 {
        c.receiver(t, steps);
    }
    for t in 0..2 {
        let v = c.line(t);
        c.installed(t, &v, 1);
    }
    c.signal(5, "-STOP");
    checkpoint(&c.ckpts(), 2);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !c.status().contains(&(3, 2)) {
        assert!(
            Instant::now() < deadline,
            "rank 3 never advanced: {:?}",
            c.status()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A publisher killed during a refit: the receivers' refit fails naming it and their live
/// weights and step stay; its lease expires; restarted, it is loaded again and refits succeed.
///
/// The kill lands between the announcement and the reads deterministically: rank 5 is stopped
/// (SIGSTOP) so the set for step 2 cannot complete; rank 3 advances to step 2 and is killed
/// (SIGKILL); rank 5 continues and advances; the receivers now see all eight ready at step 2
/// (rank 3's record lives until its lease expires) and read from a dead process.
fn killed_publisher(transport: &'static str) {
    if !available(transport) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = Cluster::start("kill", transport);
    rank3_ahead_of_stopped_rank5(&mut c, 3);
    c.signal(3, "-KILL");
    let _ = c.publishers[3].take().unwrap().wait();
    c.signal(5, "-CONT");
    for t in 0..2 {
        let v = c.line(t);
        assert_eq!(
            v["verified"], false,
            "receiver {t} read from a dead publisher: {v}"
        );
        assert_eq!(v["error"]["owner"], 3, "the error names rank 3: {v}");
        assert_eq!(v["live_step"], 1, "live step untouched: {v}");
        // The weights live after the failure, read from the receiver's memory: step 1's.
        let after = PathBuf::from(v["dump"].as_str().expect("a dump after the failure"));
        let ckpt = Checkpoint::open(c.ckpts().join("step-1")).unwrap();
        check_dump(&after, &ckpt, t, 2);
    }
    // The lease runs out: rank 3 disappears.
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.status().iter().any(|&(r, _)| r == 3) {
        assert!(Instant::now() < deadline, "rank 3's lease never expired");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The dumps of step 1 are still what was live; restart rank 3 and refits succeed again.
    c.publisher(3);
    let deadline = Instant::now() + Duration::from_secs(60);
    for t in 0..2 {
        let v = loop {
            let v = c.line(t);
            if v["verified"] == true {
                break v;
            }
            assert_eq!(v["live_step"], 1, "receiver {t}: {v}");
            assert!(
                Instant::now() < deadline,
                "no recovery after the restart: {v}"
            );
        };
        c.installed(t, &v, 2);
        assert!(
            v["peers_loaded"].as_u64().unwrap() >= 1,
            "rank 3 reloaded: {v}"
        );
    }
    checkpoint(&c.ckpts(), 3);
    for t in 0..2 {
        let v = c.line(t);
        c.installed(t, &v, 3);
    }
    c.receivers_succeed();
}

/// A publisher that exits cleanly (SIGTERM) after announcing a step the receivers have not read
/// yet: it withdraws before it releases its memory, so the receivers never read from it and
/// never fail; they wait for a complete set and install the step once it is restarted.
///
/// Deterministic as in [`killed_publisher`]: rank 5 is stopped so the set for step 2 cannot
/// complete while rank 3 (already at step 2) exits.
fn withdrawn_publisher(transport: &'static str) {
    if !available(transport) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = Cluster::start("withdraw", transport);
    // Rank 5 stays stopped while rank 3 exits: a lease that outlives the stop keeps it a member
    // throughout (one that ran out would be re-announced once it continues, under a new lease;
    // docs/deployment.md, "Leases through etcd outages").
    c.lease_ttl_s = "30";
    rank3_ahead_of_stopped_rank5(&mut c, 2);
    c.signal(3, "-TERM");
    let status = c.publishers[3].take().unwrap().wait().unwrap();
    assert!(status.success(), "rank 3 exited {status} on SIGTERM");
    // Withdrawn at once, not when its lease runs out.
    assert!(
        !c.status().iter().any(|&(r, _)| r == 3),
        "rank 3 still announced after its clean exit: {:?}",
        c.status()
    );
    c.signal(5, "-CONT");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !c.status().contains(&(5, 2)) {
        assert!(Instant::now() < deadline, "rank 5 never advanced");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Seven of eight at step 2: the receivers wait (a failed line here would be a read from
    // the exited publisher). Restarted, rank 3 completes the set and step 2 installs.
    std::thread::sleep(Duration::from_millis(500));
    c.publisher(3);
    for t in 0..2 {
        let v = c.line(t);
        c.installed(t, &v, 2);
    }
    c.receivers_succeed();
}

#[test]
fn ucx_publishers_and_receivers_meet_through_etcd_and_refit_every_step_byte_exact() {
    three_steps("ucx");
}

#[test]
fn nixl_publishers_and_receivers_meet_through_etcd_and_refit_every_step_byte_exact() {
    three_steps("nixl");
}

#[test]
fn ucx_a_killed_publisher_fails_the_refit_naming_it_and_a_restart_recovers() {
    killed_publisher("ucx");
}

#[test]
fn nixl_a_killed_publisher_fails_the_refit_naming_it_and_a_restart_recovers() {
    killed_publisher("nixl");
}

#[test]
fn ucx_a_publisher_that_exits_cleanly_is_withdrawn_and_never_read_from() {
    withdrawn_publisher("ucx");
}
