//! One holder per rank, and publishers that outlive etcd outages (docs/deployment.md, "One
//! holder per rank" and "Leases through etcd outages"): a private etcd (scripts/etcd.sh),
//! `reshard publish` processes over UCX restricted to TCP, and a `reshard receive` process whose
//! installed weights are compared with the checkpoint files, tensor by tensor.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use reshard_checkpoint::Checkpoint;
use serde_json::Value;

const R: &str = env!("CARGO_BIN_EXE_reshard");

/// One cluster at a time: the machine has two cores.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn scripts() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts")
}

/// Skips loudly where UCX or etcd is missing, unless `RESHARD_REQUIRE_BACKENDS` asks for them.
fn available() -> bool {
    let probe = reshard_transports::registry().probe("ucx");
    if !reshard_conformance::backend_available("ucx", probe) {
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

/// A process whose stdout JSON lines arrive on a channel; killed when dropped.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<Value>,
}

impl Proc {
    fn spawn(cmd: &mut Command) -> Proc {
        let mut child = cmd
            .env("RESHARD_BACKENDS__UCX__TLS", "tcp")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(|l| l.ok()) {
                let v: Value = serde_json::from_str(&line).expect("JSON line");
                if tx.send(v).is_err() {
                    break;
                }
            }
        });
        Proc { child, lines }
    }

    fn line(&self, who: &str) -> Value {
        match self.lines.recv_timeout(Duration::from_secs(90)) {
            Ok(v) => v,
            Err(mpsc::RecvTimeoutError::Timeout) => panic!("{who} printed nothing for 90 s"),
            Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{who} exited"),
        }
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A private etcd and a scratch folder, both gone when dropped.
struct Etcd {
    dir: PathBuf,
    url: String,
}

impl Etcd {
    fn start(name: &str) -> Etcd {
        let dir =
            Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // The etcd folder is made here, not by the script, so a restart finds its data.
        std::fs::create_dir_all(dir.join("etcd")).unwrap();
        let mut e = Etcd {
            dir,
            url: String::new(),
        };
        e.url = e.run_start(None);
        e
    }

    fn run_start(&self, port: Option<&str>) -> String {
        let mut cmd = Command::new("bash");
        cmd.arg(scripts().join("etcd.sh"))
            .args(["start".as_ref(), self.dir.join("etcd").as_os_str()]);
        if let Some(p) = port {
            cmd.env("ETCD_PORT", p);
        }
        let start = cmd.output().unwrap();
        assert!(
            start.status.success(),
            "{}",
            String::from_utf8_lossy(&start.stderr)
        );
        String::from_utf8(start.stdout).unwrap().trim().to_string()
    }

    fn pid(&self) -> String {
        std::fs::read_to_string(self.dir.join("etcd/pid"))
            .unwrap()
            .trim()
            .to_string()
    }

    fn signal(&self, sig: &str) {
        assert!(Command::new("kill")
            .args([sig, &self.pid()])
            .status()
            .unwrap()
            .success());
    }

    /// Stops etcd (SIGTERM), keeping its data; returns once it is gone.
    fn stop_keeping_data(&self) {
        let pid = self.pid();
        self.signal("-TERM");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Path::new(&format!("/proc/{pid}")).exists() {
            assert!(Instant::now() < deadline, "etcd did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts etcd again on its data and its port.
    fn start_again(&self) {
        let port = self.url.rsplit(':').next().unwrap();
        assert_eq!(self.run_start(Some(port)), self.url);
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-CONT", &self.pid()]).status();
        let _ = Command::new("bash")
            .arg(scripts().join("etcd.sh"))
            .args(["stop".as_ref(), self.dir.join("etcd").as_os_str()])
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Writes step `step` as `dir/step-N` with `reshard checkpoint`.
fn checkpoint(dir: &Path, step: u64) -> PathBuf {
    let out = dir.join(format!("step-{step}"));
    let run = Command::new(R)
        .args(["checkpoint", "--preset", "qwen3-30b-a3b", "--layers", "1"])
        .args(["--experts", "8", "--vocab", "512", "--max-shard-mib", "16"])
        .args(["--step", &step.to_string(), "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    out
}

/// `reshard publish` of rank `rank` of `topology`, JSON lines, a 3 s lease.
fn publish(etcd: &Etcd, ckpts: &Path, topology: &str, rank: u32) -> Command {
    let mut cmd = Command::new(R);
    cmd.args(["publish", "--rendezvous", &etcd.url, "--model", "q"])
        .arg("--checkpoint")
        .arg(ckpts)
        .args(["--publishers", topology, "--rank", &rank.to_string()])
        .args(["--transport", "ucx", "--lease-ttl-s", "3"])
        .args(["--poll-ms", "100", "--json"]);
    cmd
}

/// A TP1 `reshard receive` that installs `steps` steps and dumps them under `dump`.
fn receiver(etcd: &Etcd, steps: u64, dump: &Path) -> Proc {
    Proc::spawn(
        Command::new(R)
            .args(["receive", "--rendezvous", &etcd.url, "--model", "q"])
            .args(["--receivers", "tp=1", "--rank", "0", "--transport", "ucx"])
            .args(["--steps", &steps.to_string(), "--json", "--timeout-s", "60"])
            .args(["--lease-ttl-s", "3", "--dump"])
            .arg(dump),
    )
}

/// `reshard status --json`'s publishers of model `q`.
fn status(etcd: &Etcd) -> Vec<Value> {
    let out = Command::new(R)
        .args([
            "status",
            "--rendezvous",
            &etcd.url,
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
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v[0]["publishers"].as_array().cloned().unwrap_or_default()
}

/// Waits for publisher `who`'s line `event` at `step`, skipping the lines that say it waited
/// for the rendezvous.
fn event(p: &Proc, who: &str, event: &str, step: u64) -> Value {
    loop {
        let v = p.line(who);
        match v["event"].as_str() {
            Some("rendezvous_unreachable" | "rendezvous_back") => continue,
            Some(e) if e == event && v["step"] == step => return v,
            _ => panic!("{who}: expected {event} of step {step}: {v}"),
        }
    }
}

/// What the TP1 receiver holds of each parameter in vLLM's naming, cut from the checkpoint:
/// q, k, v stacked; every expert's gate and up stacked, then every expert's down.
fn expected(ckpt: &Checkpoint, name: &str) -> Vec<u8> {
    let get = |n: &str| ckpt.tensor_bytes(n).unwrap();
    let experts = ckpt.model().moe.as_ref().unwrap().experts;
    let l = "model.layers.0.";
    match name.strip_prefix(l).unwrap_or(name) {
        "self_attn.qkv_proj.weight" => ["q", "k", "v"]
            .iter()
            .flat_map(|p| get(&format!("{l}self_attn.{p}_proj.weight")))
            .collect(),
        "mlp.experts.w13_weight" => (0..experts)
            .flat_map(|x| {
                ["gate_proj", "up_proj"]
                    .iter()
                    .flat_map(|p| get(&format!("{l}mlp.experts.{x}.{p}.weight")))
                    .collect::<Vec<u8>>()
            })
            .collect(),
        "mlp.experts.w2_weight" => (0..experts)
            .flat_map(|x| get(&format!("{l}mlp.experts.{x}.down_proj.weight")))
            .collect(),
        _ => get(name),
    }
}

/// Asserts the receiver's JSON line says `step` installed and verified, and that its dump of
/// that step equals the checkpoint at `ckpt`, parameter by parameter.
fn installed(v: &Value, step: u64, dump: &Path, ckpt: &Path) {
    assert_eq!(v["step"], step, "{v}");
    assert_eq!(v["verified"], true, "{v}");
    let ckpt = Checkpoint::open(ckpt).unwrap();
    let bytes = std::fs::read(dump.join(format!("step-{step}/model.safetensors"))).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.names().len(), 12);
    for name in st.names() {
        let got = st.tensor(name).unwrap();
        assert!(
            got.data() == &expected(&ckpt, name)[..],
            "{name} of step {step} differs from the checkpoint"
        );
    }
}

/// A second `reshard publish` for a live rank exits 2 within seconds, naming the rank and the
/// holder (its incarnation, host and pid, as `reshard status` shows them); the holder serves
/// on untouched: a receiver installs step 1 before and step 2 after, verified.
#[test]
fn a_second_publisher_for_a_live_rank_exits_2_naming_the_holder_which_serves_on() {
    if !available() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let etcd = Etcd::start("rank-claim");
    let ckpts = etcd.dir.join("ckpts");
    let step1 = checkpoint(&ckpts, 1);
    let mut holder = Proc::spawn(&mut publish(&etcd, &ckpts, "tp=1", 0));
    event(&holder, "the holder", "published", 1);
    let dump = etcd.dir.join("dump");
    let r = receiver(&etcd, 2, &dump);
    installed(&r.line("the receiver"), 1, &dump, &step1);
    let before = status(&etcd);
    assert_eq!(before.len(), 1, "{before:?}");
    let h = &before[0]["holder"];
    assert_eq!(h["pid"], holder.child.id(), "{h}");
    let incarnation = h["incarnation"].as_u64().unwrap();
    let host = h["host"].as_str().unwrap().to_string();
    assert!(!host.is_empty(), "{h}");

    let mut second = publish(&etcd, &ckpts, "tp=1", 0)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let code = loop {
        if let Some(s) = second.try_wait().unwrap() {
            break s.code();
        }
        if started.elapsed() > Duration::from_secs(60) {
            let _ = second.kill();
            panic!("the second publisher of rank 0 still runs after 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut second.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(code, Some(2), "{err}");
    for part in [
        "publisher rank 0 ".to_string(),
        "held by another live process".to_string(),
        format!("incarnation {incarnation:016x}"),
        format!("on host {host} pid {}", holder.child.id()),
    ] {
        assert!(err.contains(&part), "{part:?} not in {err}");
    }
    eprintln!(
        "the second claimant exited 2 after {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // The holder is untouched and serves the next step.
    assert!(holder.alive(), "the holder exited");
    let after = status(&etcd);
    assert_eq!(after[0]["holder"], before[0]["holder"]);
    let step2 = checkpoint(&ckpts, 2);
    event(&holder, "the holder", "advanced", 2);
    installed(&r.line("the receiver"), 2, &dump, &step2);
}

/// Two `reshard publish` processes through etcd stopped (SIGTERM) longer than their lease TTL
/// and started again on its data, then frozen (SIGSTOP) longer than the TTL (etcd expires their
/// leases once it runs), with a newer checkpoint written during each outage: the same processes
/// (none restarted) announce again, advance to each newer step, and a `reshard receive`
/// started afterwards installs the last one, verified against the checkpoint files.
#[test]
fn publishers_outlive_etcd_outages_longer_than_their_lease_and_serve_the_next_step() {
    if !available() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let etcd = Etcd::start("etcd-outage");
    let ckpts = etcd.dir.join("ckpts");
    checkpoint(&ckpts, 1);
    let mut pubs: Vec<Proc> = (0..2)
        .map(|r| Proc::spawn(&mut publish(&etcd, &ckpts, "ep=2,dp=2", r)))
        .collect();
    for (r, p) in pubs.iter().enumerate() {
        event(p, &format!("publisher {r}"), "published", 1);
    }
    let pids: Vec<u32> = pubs.iter().map(|p| p.child.id()).collect();

    // Down (stopped, data kept) for twice the TTL, step 2 written meanwhile.
    etcd.stop_keeping_data();
    checkpoint(&ckpts, 2);
    std::thread::sleep(Duration::from_secs(6));
    etcd.start_again();
    for (r, p) in pubs.iter().enumerate() {
        event(p, &format!("publisher {r}"), "advanced", 2);
    }

    // Frozen for twice the TTL, step 3 written meanwhile: the leases expire when etcd runs.
    etcd.signal("-STOP");
    checkpoint(&ckpts, 3);
    std::thread::sleep(Duration::from_secs(6));
    let resumed = Instant::now();
    etcd.signal("-CONT");
    for (r, p) in pubs.iter().enumerate() {
        event(p, &format!("publisher {r}"), "advanced", 3);
    }
    let members = status(&etcd);
    assert_eq!(members.len(), 2, "{members:?}");
    for (r, m) in members.iter().enumerate() {
        assert_eq!(m["holder"]["pid"], pids[r], "{m}");
        assert_eq!(
            (m["step"].as_u64(), m["ready"].as_bool()),
            (Some(3), Some(true))
        );
        // Announced again under a new lease since etcd resumed (the old one expired).
        let age = m["lease_age_s"].as_f64().unwrap();
        assert!(
            age <= resumed.elapsed().as_secs_f64() + 1.0,
            "rank {r}: lease age {age} s predates etcd's resumption"
        );
    }

    let dump = etcd.dir.join("dump");
    let r = receiver(&etcd, 1, &dump);
    installed(&r.line("the receiver"), 3, &dump, &ckpts.join("step-3"));
    for (r, p) in pubs.iter_mut().enumerate() {
        assert!(p.alive(), "publisher {r} exited");
        assert_eq!(p.child.id(), pids[r]);
    }
}
