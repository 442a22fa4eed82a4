//! What the deployment tests of `reshard` share (docs/deployment.md): a private etcd
//! (scripts/etcd.sh), processes whose JSON lines arrive on a channel, checkpoints written by
//! `reshard checkpoint`, and this suite's own reading of vLLM's TP layout, against which every
//! installed dump is compared (independent of reshard's planner).
//!
//! Each test binary compiles this module and uses part of it.
#![allow(dead_code)]

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use reshard_checkpoint::Checkpoint;
use serde_json::Value;

/// The `reshard` binary under test.
pub const R: &str = env!("CARGO_BIN_EXE_reshard");

/// One deployment at a time within a binary: each is several processes on two cores.
pub static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Takes [`SERIAL`], also after a test that held it panicked.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The clock of the progress lines tests print on stderr.
static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

/// A progress line on stderr, stamped with the seconds since the binary's first line.
pub fn log(what: &str) {
    let s = START.get_or_init(Instant::now).elapsed().as_secs_f64();
    eprintln!("[{s:8.3} s] {what}");
}

/// The repository's scripts/ folder.
pub fn scripts() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts")
}

/// Whether `transport` and etcd are here. Skips loudly where one is missing, unless
/// `RESHARD_REQUIRE_BACKENDS` asks for every backend (then a missing one fails).
pub fn available(transport: &str) -> bool {
    let probe = reshard::registry().probe(transport);
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

/// The transport restricted to TCP, as between hosts.
pub fn transport_env(transport: &str) -> Vec<(&'static str, &'static str)> {
    match transport {
        "ucx" => vec![("RESHARD_BACKENDS__UCX__TLS", "tcp")],
        _ => vec![("UCX_TLS", "tcp")],
    }
}

/// A process whose stdout JSON lines arrive on a channel (each also logged on stderr, named);
/// killed when dropped.
pub struct Proc {
    /// The process.
    pub child: Child,
    lines: mpsc::Receiver<Value>,
    who: String,
}

impl Proc {
    /// Spawns `cmd` with its stdout piped; a line that is not JSON ends the channel.
    pub fn spawn(who: &str, cmd: &mut Command) -> Proc {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        let name = who.to_string();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(|l| l.ok()) {
                log(&format!("{name}: {line}"));
                let v: Value = match serde_json::from_str(&line) {
                    Ok(v) => v,
                    Err(e) => {
                        log(&format!("{name}: not a JSON line ({e})"));
                        break;
                    }
                };
                if tx.send(v).is_err() {
                    break;
                }
            }
        });
        Proc {
            child,
            lines,
            who: who.to_string(),
        }
    }

    /// The next JSON line, within 90 s.
    pub fn line(&self) -> Value {
        self.line_by(Instant::now() + Duration::from_secs(90))
    }

    /// The next JSON line, which must come before `deadline`.
    pub fn line_by(&self, deadline: Instant) -> Value {
        let wait = deadline.saturating_duration_since(Instant::now());
        match self.lines.recv_timeout(wait) {
            Ok(v) => v,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("{} printed nothing for {wait:?}", self.who)
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                panic!(
                    "{}'s output ended (exited, or not JSON: see above)",
                    self.who
                )
            }
        }
    }

    /// A JSON line already printed and not yet read, if any (without waiting).
    pub fn pending_line(&self) -> Option<Value> {
        self.lines.try_recv().ok()
    }

    /// Whether the process still runs.
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Sends `sig` (as `kill` spells it, e.g. `-STOP`).
    pub fn signal(&self, sig: &str) {
        signal(self.child.id(), sig);
    }

    /// Waits for the process to exit 0.
    pub fn succeeds(&mut self) {
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{} exited {status}", self.who);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `sig` (as `kill` spells it) to process `pid`.
pub fn signal(pid: u32, sig: &str) {
    assert!(Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success());
}

/// A private etcd and a scratch folder (`dir`), both gone when dropped.
pub struct Etcd {
    /// The scratch folder; etcd's data is in `dir/etcd`.
    pub dir: PathBuf,
    /// The `--rendezvous` URL.
    pub url: String,
}

impl Etcd {
    /// Starts etcd with a fresh scratch folder named after `name` and this process.
    pub fn start(name: &str) -> Etcd {
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

    /// etcd's pid.
    pub fn pid(&self) -> u32 {
        std::fs::read_to_string(self.dir.join("etcd/pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    /// Sends `sig` to etcd.
    pub fn signal(&self, sig: &str) {
        signal(self.pid(), sig);
    }

    /// Stops etcd (SIGTERM), keeping its data; returns once it is gone.
    pub fn stop_keeping_data(&self) {
        let pid = self.pid();
        self.signal("-TERM");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Path::new(&format!("/proc/{pid}")).exists() {
            assert!(Instant::now() < deadline, "etcd did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts etcd again on its data and its port.
    pub fn start_again(&self) {
        let port = self.url.rsplit(':').next().unwrap();
        assert_eq!(self.run_start(Some(port)), self.url);
    }

    /// The checkpoint folder publishers watch.
    pub fn ckpts(&self) -> PathBuf {
        self.dir.join("ckpts")
    }

    /// `reshard status --json`'s publishers of model `q`.
    pub fn status(&self) -> Vec<Value> {
        let out = Command::new(R)
            .args([
                "status",
                "--rendezvous",
                &self.url,
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

    /// `reshard status --json`'s first publisher as (step, ready, note); `None` while model `q`
    /// has none.
    pub fn rank0(&self) -> Option<(u64, bool, Option<String>)> {
        let publishers = self.status();
        let p = publishers.first()?;
        Some((
            p["step"].as_u64()?,
            p["ready"].as_bool()?,
            p["note"].as_str().map(str::to_string),
        ))
    }

    /// The (rank, step) of every publisher `reshard status` shows.
    pub fn steps(&self) -> Vec<(u64, u64)> {
        self.status()
            .iter()
            .map(|p| (p["rank"].as_u64().unwrap(), p["step"].as_u64().unwrap()))
            .collect()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("etcd/pid")) {
            let _ = Command::new("kill").args(["-CONT", pid.trim()]).status();
        }
        let _ = Command::new("bash")
            .arg(scripts().join("etcd.sh"))
            .args(["stop".as_ref(), self.dir.join("etcd").as_os_str()])
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Writes step `step` as `dir/step-N` with `reshard checkpoint`: a one-layer, 8-expert
/// Qwen3-MoE in shards of at most 16 MiB.
pub fn checkpoint(dir: &Path, step: u64) -> PathBuf {
    checkpoint_with(dir, step, 8)
}

/// [`checkpoint`] with `experts` experts.
pub fn checkpoint_with(dir: &Path, step: u64, experts: u64) -> PathBuf {
    let out = dir.join(format!("step-{step}"));
    let run = Command::new(R)
        .args(["checkpoint", "--preset", "qwen3-30b-a3b", "--layers", "1"])
        .args(["--experts", &experts.to_string(), "--vocab", "512"])
        .args(["--max-shard-mib", "16"])
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

/// What TP rank `t` of `tp` holds of each parameter of [`checkpoint`]'s model in vLLM's
/// naming, cut from the checkpoint: q, k, v rows stacked; `o_proj` split by columns; every
/// expert's gate and up rows stacked, then every expert's down columns; vocabulary rows split;
/// norms and the router whole.
pub fn expected(ckpt: &Checkpoint, name: &str, t: usize, tp: usize) -> Vec<u8> {
    let m = ckpt.model();
    let (h, e) = (m.hidden as usize, 2usize);
    let hd = m.head_dim as usize;
    let (q, kv) = (m.heads as usize * hd, m.kv_heads as usize * hd);
    let get = |n: &str| ckpt.tensor_bytes(n).unwrap().to_vec();
    let part = |len: usize| (t * len / tp)..((t + 1) * len / tp);
    let l = "model.layers.0.";
    let moe = m.moe.as_ref().unwrap();
    let i = moe.expert_intermediate as usize;
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
        "mlp.experts.w13_weight" => (0..moe.experts)
            .flat_map(|x| {
                let p = |proj: &str| get(&format!("{l}mlp.experts.{x}.{proj}.weight"));
                [
                    rows(&p("gate_proj"), h, e, part(i)),
                    rows(&p("up_proj"), h, e, part(i)),
                ]
                .concat()
            })
            .collect(),
        "mlp.experts.w2_weight" => (0..moe.experts)
            .flat_map(|x| {
                let p = get(&format!("{l}mlp.experts.{x}.down_proj.weight"));
                cols(&p, i, e, part(i))
            })
            .collect(),
        // Norms and the router are replicated: the whole tensor.
        _ => get(name),
    }
}

/// Compares a receiver dump (a safetensors file) with what TP rank `t` of `tp` holds of
/// `ckpt`, parameter by parameter.
pub fn check_dump(dump: &Path, ckpt: &Checkpoint, t: usize, tp: usize) {
    let bytes = std::fs::read(dump).unwrap_or_else(|e| panic!("{}: {e}", dump.display()));
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

/// Asserts a receiver's `installed` JSON line says `step`, verified, and that the dump it wrote
/// of that step under `dump` equals checkpoint `ckpts/step-N` as TP rank `t` of `tp` holds it.
pub fn installed(v: &Value, step: u64, dump: &Path, ckpts: &Path, t: usize, tp: usize) {
    assert_eq!(v["step"], step, "receiver {t}: {v}");
    assert_eq!(v["verified"], true, "receiver {t}: {v}");
    let ckpt = Checkpoint::open(ckpts.join(format!("step-{step}"))).unwrap();
    check_dump(
        &dump.join(format!("step-{step}/model.safetensors")),
        &ckpt,
        t,
        tp,
    );
}
