//! A publisher's and a receiver's start-up and etcd restarts (docs/deployment.md §2 and §5): a
//! publisher and a receiver started while etcd is down wait for it, then announce and install;
//! a receiver keeps its weights through an etcd restart longer than the lease TTL and installs
//! the next step afterwards; a folder with no complete checkpoint is said to be so within a
//! second (which folder, which file is short), in the log, the JSON lines and `reshard status`,
//! and a single-file checkpoint (`model.safetensors` + `config.json`) is published like a
//! sharded one. A private etcd (scripts/etcd.sh), `reshard publish` and `reshard receive`
//! processes over UCX restricted to TCP; what the receiver installs is compared with the
//! checkpoint files, tensor by tensor.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use reshard_checkpoint::{write_single_file, Checkpoint, SINGLE_FILE};
use reshard_planner::presets::{preset, ModelConfig};
use serde_json::Value;

const R: &str = env!("CARGO_BIN_EXE_reshard");

/// One etcd at a time: the machine has two cores.
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

    /// Waits for the process to exit (up to 60 s) and returns its exit code.
    fn exit_code(&mut self, who: &str) -> Option<i32> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code();
            }
            assert!(Instant::now() < deadline, "{who} did not exit");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A private etcd on a fixed port (started later, or stopped and started again on its data)
/// and a scratch folder, both gone when dropped.
struct Etcd {
    dir: PathBuf,
    port: u16,
    url: String,
}

impl Etcd {
    /// A scratch folder and a free port; etcd is not started.
    fn new(name: &str) -> Etcd {
        let dir =
            Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // The etcd folder is made here, not by the script, so a restart finds its data.
        std::fs::create_dir_all(dir.join("etcd")).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Etcd {
            dir,
            port,
            url: format!("etcd://127.0.0.1:{port}"),
        }
    }

    /// Starts etcd on its port and data.
    fn start(&self) {
        let start = Command::new("bash")
            .arg(scripts().join("etcd.sh"))
            .args(["start".as_ref(), self.dir.join("etcd").as_os_str()])
            .env("ETCD_PORT", self.port.to_string())
            .output()
            .unwrap();
        assert!(
            start.status.success(),
            "{}",
            String::from_utf8_lossy(&start.stderr)
        );
        assert_eq!(String::from_utf8(start.stdout).unwrap().trim(), self.url);
    }

    fn pid(&self) -> String {
        std::fs::read_to_string(self.dir.join("etcd/pid"))
            .unwrap()
            .trim()
            .to_string()
    }

    /// Stops etcd (SIGTERM), keeping its data; returns once it is gone.
    fn stop_keeping_data(&self) {
        let pid = self.pid();
        assert!(Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Path::new(&format!("/proc/{pid}")).exists() {
            assert!(Instant::now() < deadline, "etcd did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(scripts().join("etcd.sh"))
            .args(["stop".as_ref(), self.dir.join("etcd").as_os_str()])
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The architecture `reshard checkpoint --preset qwen3-30b-a3b --layers 1 --experts 8
/// --vocab 512` writes.
fn model() -> ModelConfig {
    preset("qwen3-30b-a3b")
        .unwrap()
        .with_overrides(Some(1), Some(8), Some(512))
        .unwrap()
}

/// Writes step `step` as `dir/step-N`, sharded, with `reshard checkpoint`.
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

/// `reshard publish` of rank 0 of TP1, JSON lines, a 2 s lease, a 100 ms poll.
fn publisher(etcd: &Etcd, ckpts: &Path) -> Proc {
    Proc::spawn(
        Command::new(R)
            .args(["publish", "--rendezvous", &etcd.url, "--model", "q"])
            .arg("--checkpoint")
            .arg(ckpts)
            .args(["--publishers", "tp=1", "--rank", "0", "--transport", "ucx"])
            .args(["--lease-ttl-s", "2", "--poll-ms", "100", "--json"]),
    )
}

/// A TP1 `reshard receive` that installs `steps` steps and dumps them under `dump`.
fn receiver(etcd: &Etcd, steps: u64, dump: &Path) -> Proc {
    Proc::spawn(
        Command::new(R)
            .args(["receive", "--rendezvous", &etcd.url, "--model", "q"])
            .args(["--receivers", "tp=1", "--rank", "0", "--transport", "ucx"])
            .args(["--steps", &steps.to_string(), "--json", "--timeout-s", "60"])
            .args(["--lease-ttl-s", "2", "--dump"])
            .arg(dump),
    )
}

/// `reshard status --json`'s entry for rank 0: (step, ready, note); `None` while model `q` has
/// no publisher.
fn status_of(etcd: &Etcd) -> Option<(u64, bool, Option<String>)> {
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
    let p = &v[0]["publishers"][0];
    Some((
        p["step"].as_u64()?,
        p["ready"].as_bool()?,
        p["note"].as_str().map(str::to_string),
    ))
}

/// [`status_of`], the rank present.
fn status(etcd: &Etcd) -> (u64, bool, Option<String>) {
    status_of(etcd).expect("rank 0 in reshard status")
}

/// Waits for the publisher's line `event` at `step`, skipping the lines that say it waited
/// for the rendezvous; returns them too.
fn event(p: &Proc, event: &str, step: u64) -> (Value, Vec<Value>) {
    let mut waited = Vec::new();
    loop {
        let v = p.line("the publisher");
        match v["event"].as_str() {
            Some("rendezvous_unreachable" | "rendezvous_back") => waited.push(v),
            Some(e) if e == event && v["step"] == step => return (v, waited),
            _ => panic!("expected {event} of step {step}: {v}"),
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

/// Asserts that the safetensors file `file` (a receiver's dump) equals the checkpoint at
/// `ckpt`, parameter by parameter.
fn same_as(file: &Path, ckpt: &Path) {
    let ckpt = Checkpoint::open(ckpt).unwrap();
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.names().len(), 12);
    for name in st.names() {
        let got = st.tensor(name).unwrap();
        assert!(
            got.data() == &expected(&ckpt, name)[..],
            "{name} in {} differs from {}",
            file.display(),
            ckpt.dir().display()
        );
    }
}

/// Asserts the receiver's JSON line says `step` installed and verified, and that its dump of
/// that step equals the checkpoint at `ckpt`.
fn installed(v: &Value, step: u64, dump: &Path, ckpt: &Path) {
    assert_eq!(v["step"], step, "{v}");
    assert_eq!(v["verified"], true, "{v}");
    same_as(&dump.join(format!("step-{step}/model.safetensors")), ckpt);
}

/// A publisher and a receiver both started while etcd is down: neither exits; the publisher
/// says once that the rendezvous is unreachable (its step loaded, not announced), the
/// receiver says it waits; once etcd starts the publisher announces and the receiver installs
/// the step, verified against the checkpoint files.
#[test]
fn a_publisher_and_a_receiver_started_while_etcd_is_down_wait_for_it() {
    if !available() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let etcd = Etcd::new("startup-etcd-down");
    let ckpts = etcd.dir.join("ckpts");
    let step1 = checkpoint(&ckpts, 1);
    let mut p = publisher(&etcd, &ckpts);
    let dump = etcd.dir.join("dump");
    let mut r = receiver(&etcd, 1, &dump);
    let v = p.line("the publisher");
    assert_eq!(v["event"], "rendezvous_unreachable", "{v}");
    assert_eq!(v["serving_step"], 1, "{v}");
    assert_eq!(v["announced"], false, "{v}");
    assert!(
        ["transport", "timeout"].contains(&v["error"]["kind"].as_str().unwrap()),
        "{v}"
    );
    let w = r.line("the receiver");
    assert_eq!(w["event"], "waiting", "{w}");
    assert!(
        w["error"]["message"].as_str().unwrap().contains(&etcd.url),
        "{w}"
    );
    // Down for a few connection attempts of each: both wait, the publisher said it once.
    std::thread::sleep(Duration::from_secs(3));
    assert!(p.alive(), "the publisher exited while etcd was down");
    assert!(r.alive(), "the receiver exited while etcd was down");
    assert!(
        p.lines.try_recv().is_err(),
        "the publisher said the outage more than once"
    );

    etcd.start();
    let (_, waited) = event(&p, "published", 1);
    assert_eq!(waited.len(), 1, "{waited:?}");
    assert_eq!(waited[0]["event"], "rendezvous_back");
    assert!(waited[0]["waited_s"].as_f64().unwrap() >= 3.0);
    let v = loop {
        let v = r.line("the receiver");
        if v["event"] != "waiting" {
            break v;
        }
    };
    installed(&v, 1, &dump, &step1);
    assert_eq!(r.exit_code("the receiver"), Some(0));
    assert_eq!(status(&etcd), (1, true, None));
    eprintln!("wall time {:.1} s", started.elapsed().as_secs_f64());
}

/// A receiver live at step 1 while etcd is stopped for longer than the lease TTL and started
/// again on its data, step 2 written meanwhile: the receiver never exits, prints no failure,
/// its weights stay step 1's (its dump), and it installs step 2 afterwards, verified, its line
/// saying what discovery waited through.
#[test]
fn a_receiver_keeps_its_weights_through_an_etcd_restart_and_installs_the_next_step() {
    if !available() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let etcd = Etcd::new("startup-etcd-restart");
    etcd.start();
    let ckpts = etcd.dir.join("ckpts");
    let step1 = checkpoint(&ckpts, 1);
    let p = publisher(&etcd, &ckpts);
    event(&p, "published", 1);
    let dump = etcd.dir.join("dump");
    let mut r = receiver(&etcd, 2, &dump);
    installed(&r.line("the receiver"), 1, &dump, &step1);

    // Down for twice the TTL (2 s), step 2 written meanwhile.
    etcd.stop_keeping_data();
    let step2 = checkpoint(&ckpts, 2);
    std::thread::sleep(Duration::from_secs(4));
    assert!(r.alive(), "the receiver exited while etcd was down");
    assert!(
        r.lines.try_recv().is_err(),
        "the receiver reported a failure while etcd was down"
    );
    etcd.start();
    event(&p, "advanced", 2);
    let mut failures = 0;
    let v = loop {
        let v = r.line("the receiver");
        if v["verified"] == false {
            // A refit that failed keeps step 1 live: its dump is step 1's bytes.
            assert_eq!(v["live_step"], 1, "{v}");
            same_as(Path::new(v["dump"].as_str().unwrap()), &step1);
            failures += 1;
            continue;
        }
        break v;
    };
    installed(&v, 2, &dump, &step2);
    let waited: Vec<&str> = v["waited_through"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap())
        .collect();
    assert!(
        waited.iter().any(|l| l.contains(&etcd.url)),
        "the installed line says what it waited through: {v}"
    );
    // Step 1's dump, written when it was installed, still holds step 1.
    same_as(&dump.join("step-1/model.safetensors"), &step1);
    assert_eq!(r.exit_code("the receiver"), Some(0));
    eprintln!(
        "wall time {:.1} s, {failures} failed refits, waited through {waited:?}",
        started.elapsed().as_secs_f64()
    );
}

/// A folder whose only checkpoint is a single `model.safetensors` cut short: within a second
/// the publisher says so (a `no_checkpoint` line naming the folder and the file and its
/// size), once while nothing changes, and `reshard status` shows the rank claimed, not ready,
/// with that note. A whole single-file step 2 appears: it is published like a sharded one and
/// a receiver installs it, verified against the file.
#[test]
fn no_complete_checkpoint_is_said_within_a_second_and_a_single_file_is_published() {
    if !available() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let etcd = Etcd::new("startup-single-file");
    etcd.start();
    let ckpts = etcd.dir.join("ckpts");
    let step1 = ckpts.join("step-1");
    write_single_file(&model(), 1, &step1).unwrap();
    let file = step1.join(SINGLE_FILE);
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len / 2)
        .unwrap();

    let spawned = Instant::now();
    let mut p = publisher(&etcd, &ckpts);
    let v = p.line("the publisher");
    let said = spawned.elapsed();
    assert_eq!(v["event"], "no_checkpoint", "{v}");
    let reason = v["reason"].as_str().unwrap();
    for part in [
        step1.display().to_string(),
        SINGLE_FILE.to_string(),
        format!("{} bytes", len / 2),
        format!("implies {len}"),
    ] {
        assert!(reason.contains(&part), "{part:?} not in {reason}");
    }
    assert!(
        said < Duration::from_secs(1),
        "said why after {:.2} s",
        said.as_secs_f64()
    );
    // The claim's note, as `reshard status` shows it (written right after the line).
    let deadline = Instant::now() + Duration::from_secs(10);
    let (step, ready, note) = loop {
        if let Some(s @ (_, _, Some(_))) = status_of(&etcd) {
            break s;
        }
        assert!(Instant::now() < deadline, "no note in reshard status");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!((step, ready), (0, false));
    let note = note.unwrap();
    assert!(
        note.contains("serving no step") && note.contains(SINGLE_FILE),
        "{note}"
    );
    // Said once: nothing changed over ten polls.
    std::thread::sleep(Duration::from_secs(1));
    assert!(p.lines.try_recv().is_err(), "said again without a change");
    assert!(p.alive());

    // A whole single-file step 2, moved in in one rename.
    let aside = etcd.dir.join("aside");
    write_single_file(&model(), 2, &aside).unwrap();
    let step2 = ckpts.join("step-2");
    std::fs::rename(&aside, &step2).unwrap();
    event(&p, "published", 2);
    let dump = etcd.dir.join("dump");
    let mut r = receiver(&etcd, 1, &dump);
    installed(&r.line("the receiver"), 2, &dump, &step2);
    assert_eq!(r.exit_code("the receiver"), Some(0));
    assert_eq!(status(&etcd), (2, true, None));
    eprintln!(
        "said why {:.3} s after spawning; wall time {:.1} s",
        said.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
}
