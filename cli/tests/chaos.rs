//! The chaos run (docs/deployment.md §7, "The chaos run"; issue 27 item 6): a whole deployment
//! on emulated hosts (scripts/hosts.sh) — a real 3-member etcd cluster on one host, 8 `reshard
//! publish` processes (Megatron TP2/EP4/DP4 on 4 hosts, a TP group each) and 2 `reshard
//! receive` processes (vLLM TP2, one host each) over UCX restricted to TCP on the hosts' links
//! — taken through the faults an ordinary day brings, one after the other:
//!
//! 1. every etcd member down (SIGTERM) longer than the lease TTL, then back on its data;
//! 2. the etcd leader SIGKILLed (restarted once the next step is in);
//! 3. a publisher SIGKILLed and restarted;
//! 4. a publisher SIGSTOPped past its TTL, then continued;
//! 5. a second `reshard publish` for a live rank;
//! 6. garbage keys under the model's `members/` prefix;
//! 7. a newer step with a corrupt `config.json`, then one with a truncated shard;
//! 8. a publisher host's link down while the receivers read from it;
//! 9. a receiver SIGKILLed while it reads, its reading claim held, then started again.
//!
//! After each, a new checkpoint step must install on both receivers, verified by reshard and
//! byte for byte against slices this test cuts from the checkpoint files itself (vLLM's TP
//! layout, not reshard's planner). For each fault the test records steps attempted, installed,
//! refused or failed with a typed error (which kind), weights lost (the live step or the live
//! bytes a receiver reports after a fault differ from the last installed step: must be 0) and
//! seconds to recover (fault end to the next step verified on both receivers), prints that as
//! a Markdown table, and asserts the invariants.
//!
//! Skipped (loudly) where not root, without network namespaces, UCX or etcd, unless
//! `RESHARD_REQUIRE_BACKENDS` is set.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use reshard_checkpoint::Checkpoint;
use reshard_testkit::hosts::{self, Hosts};
use serde_json::Value;

mod support;
use support::{expected, log, scripts, R};

/// Model name the run meets under.
const MODEL: &str = "chaos";

/// Publishers' lease TTL: short, so "longer than the TTL" costs seconds.
const TTL_S: u64 = 3;

/// The trainer's layout: 8 ranks, TP2 inside each of 4 DP replicas, 4 experts over EP4.
const PUBLISHERS: &str = "tp=2,ep=4,dp=4";
const WORLD: usize = 8;

/// The inference engine's layout: TP2, one receiver process per rank.
const RECEIVERS: usize = 2;

/// Milliseconds a publisher's reads may make no progress before the refit fails (the link-down
/// fault): the bound `cli/tests/hosts.rs` measured on this kind of machine.
const NO_PROGRESS_MS: &str = "3000";

/// The rate of the link taken down while it serves reads, so "mid-refit" is a wide window (as
/// in `cli/tests/hosts.rs`); no other link is limited.
const SLOW_LINK: &str = "160mbit";

/// Longest a step may take to install on both receivers after its fault ended.
const RECOVER_WITHIN: Duration = Duration::from_secs(90);

/// Skips loudly where the hosts, UCX or etcd are missing, unless `RESHARD_REQUIRE_BACKENDS`
/// asks for them.
fn available() -> bool {
    hosts::available() && support::available("ucx")
}

/// UCX over TCP on the host's one interface, with gets of 1 MiB and a no-progress bound that
/// turns a dead link into an error within seconds (as `cli/tests/hosts.rs`).
const UCX_ENV: [(&str, &str); 4] = [
    ("RESHARD_BACKENDS__UCX__TLS", "tcp"),
    ("RESHARD_BACKENDS__UCX__NET_DEVICES", "eth0"),
    ("RESHARD_BACKENDS__UCX__TIMEOUT_MS", NO_PROGRESS_MS),
    ("RESHARD_BACKENDS__UCX__PIECE_BYTES", "1048576"),
];

/// A process on an emulated host: its stdout JSON lines arrive on a channel, its stderr is
/// copied to the test's (prefixed with `who`) and kept. Killed when dropped.
struct Proc {
    who: String,
    /// `nsenter`, which runs the program in the host's namespaces and waits for it.
    child: Child,
    /// The program's pid in the root PID namespace (signals go there).
    pid: u32,
    /// The program's pid on its host (what `reshard status` shows as the holder's pid).
    host_pid: u32,
    /// Stdout's JSON lines, each with when it was read.
    lines: mpsc::Receiver<(Instant, Value)>,
    stderr: Arc<Mutex<Vec<String>>>,
}

/// The pid of `nsenter`'s child running `reshard`, once it runs.
fn program_pid(nsenter: u32) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let comm = |p: u32| std::fs::read_to_string(format!("/proc/{p}/comm")).unwrap_or_default();
        if comm(nsenter).trim() == "nsenter" {
            let kids = std::fs::read_to_string(format!("/proc/{nsenter}/task/{nsenter}/children"))
                .unwrap_or_default();
            if let Some(p) = kids
                .split_whitespace()
                .filter_map(|p| p.parse::<u32>().ok())
                .find(|&p| comm(p).trim() == "reshard")
            {
                return p;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no reshard under nsenter pid {nsenter}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The pid `pid` (root namespace) has in its own PID namespace.
fn host_pid(pid: u32) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("NSpid:")).unwrap();
    line.split_whitespace().last().unwrap().parse().unwrap()
}

impl Proc {
    fn spawn(who: &str, cmd: &mut Command) -> Proc {
        let mut child = cmd
            .envs(UCX_ENV)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        let name = who.to_string();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(|l| l.ok()) {
                log(&format!("{name}: {line}"));
                let v: Value = serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("{name}: not a JSON line ({e}): {line}"));
                if tx.send((Instant::now(), v)).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let (err, kept, name) = (
            child.stderr.take().unwrap(),
            stderr.clone(),
            who.to_string(),
        );
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(err).lines().map_while(|l| l.ok()) {
                eprintln!("    {name} stderr: {line}");
                kept.lock().unwrap().push(line);
            }
        });
        let pid = program_pid(child.id());
        Proc {
            who: who.to_string(),
            host_pid: host_pid(pid),
            child,
            pid,
            lines,
            stderr,
        }
    }

    /// The next JSON line, which must come before `deadline`.
    fn line_by(&self, deadline: Instant) -> Value {
        self.line_at(deadline).1
    }

    /// The next JSON line and when it was printed; it must come before `deadline`.
    fn line_at(&self, deadline: Instant) -> (Instant, Value) {
        let wait = deadline.saturating_duration_since(Instant::now());
        match self.lines.recv_timeout(wait) {
            Ok(v) => v,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("{} printed nothing for {wait:?}", self.who)
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                panic!(
                    "{}'s output ended (it exited, or printed a line that is not JSON)",
                    self.who
                )
            }
        }
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.pid.to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {} ({})", self.pid, self.who);
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Waits for the process to exit, at most `within`; its exit code.
    fn exit_code(&mut self, within: Duration) -> Option<i32> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code();
            }
            assert!(
                Instant::now() < deadline,
                "{} still runs after {within:?}",
                self.who
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stderr_text(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // While nsenter runs, `pid` is still its child: never signal a pid that may be reused.
        if self.alive() {
            let _ = Command::new("kill")
                .args(["-CONT", &self.pid.to_string()])
                .status();
            let _ = Command::new("kill")
                .args(["-KILL", &self.pid.to_string()])
                .status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What one fault cost, as the table shows it.
struct Row {
    fault: &'static str,
    attempted: u64,
    installed: u64,
    refused: Vec<String>,
    lost: u64,
    recover_s: f64,
}

/// The deployment: hosts, etcd cluster, publishers, receivers and the figures recorded so far.
/// Processes are killed, etcd stopped and the hosts destroyed when dropped.
struct Run {
    dir: PathBuf,
    etcd: String,
    publishers: Vec<Option<Proc>>,
    receivers: Vec<Proc>,
    /// The step every receiver has installed last, verified.
    live: u64,
    /// The last step written.
    written: u64,
    /// Failure dumps checked so far, per receiver.
    failures: Vec<u64>,
    /// Each receiver's last installed line.
    installed: Vec<Value>,
    rows: Vec<Row>,
    // Last: the processes above are killed before their hosts go.
    hosts: Hosts,
}

impl Drop for Run {
    fn drop(&mut self) {
        self.publishers.clear();
        self.receivers.clear();
        let _ = self
            .hosts
            .command("etcd", "bash")
            .arg(scripts().join("etcd.sh"))
            .arg("stop")
            .arg(self.dir.join("etcd"))
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Publisher hosts: each holds one TP group (ranks `2h` and `2h + 1`), as a trainer node does.
const PUBLISHER_HOSTS: usize = WORLD / 2;

/// The host of publisher rank `r`.
fn publisher_host(r: usize) -> String {
    format!("p{}", r / 2)
}

impl Run {
    fn start() -> Run {
        let dir =
            Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("chaos-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let names: Vec<String> = std::iter::once("etcd".to_string())
            .chain((0..PUBLISHER_HOSTS).map(|h| format!("p{h}")))
            .chain((0..RECEIVERS).map(|t| format!("r{t}")))
            .collect();
        let specs: Vec<&str> = names.iter().map(String::as_str).collect();
        let hosts = Hosts::create(&specs).unwrap();
        log("hosts made");
        let mut run = Run {
            dir,
            etcd: String::new(),
            publishers: Vec::new(),
            receivers: Vec::new(),
            live: 0,
            written: 0,
            failures: vec![0; RECEIVERS],
            installed: vec![Value::Null; RECEIVERS],
            rows: Vec::new(),
            hosts,
        };
        let addr = run.hosts.addr("etcd").to_string();
        run.etcd = run.etcd_sh(&["start-cluster", "3"], &[("ETCD_HOST", &addr)]);
        assert!(
            run.etcd.starts_with(&format!("etcd://{addr}:")),
            "{}",
            run.etcd
        );
        log(&format!("etcd cluster at {}", run.etcd));
        run
    }

    /// Runs `scripts/etcd.sh CMD DIR ARGS...` on the etcd host; its stdout, trimmed.
    fn etcd_sh(&self, args: &[&str], env: &[(&str, &str)]) -> String {
        let out = self
            .etcd_sh_cmd(args)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "scripts/etcd.sh {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }

    fn etcd_sh_cmd(&self, args: &[&str]) -> Command {
        let mut cmd = self.hosts.command("etcd", "bash");
        cmd.arg(scripts().join("etcd.sh"))
            .arg(args[0])
            .arg(self.dir.join("etcd"))
            .args(&args[1..]);
        cmd
    }

    /// Runs `scripts/etcd.sh CMD DIR i` for every member `i` at once (a member started alone
    /// is not healthy until a quorum runs).
    fn every_member(&self, cmd: &str) {
        let kids: Vec<Child> = (0..3)
            .map(|i| {
                self.etcd_sh_cmd(&[cmd, &i.to_string()])
                    .stdout(Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for (i, mut k) in kids.into_iter().enumerate() {
            let status = k.wait().unwrap();
            assert!(status.success(), "etcd.sh {cmd} member {i}: {status}");
        }
    }

    /// A small script of Python on the etcd host against etcd's JSON gateway (no etcdctl).
    fn etcd_kv(&self, op: &str, key: &str, value: &str) {
        let url = self
            .etcd
            .trim_start_matches("etcd://")
            .split(',')
            .next()
            .unwrap();
        let script = r#"
import base64, json, sys, urllib.request
url, op, key, value = sys.argv[1:5]
b = lambda s: base64.b64encode(s.encode()).decode()
body = {"key": b(key)}
if op == "put":
    body["value"] = b(value)
req = urllib.request.Request("http://" + url + "/v3/kv/" + op, data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
urllib.request.urlopen(req, timeout=10).read()
"#;
        let out = self
            .hosts
            .command("etcd", "python3")
            .args(["-c", script, url, op, key, value])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "etcd {op} {key}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn ckpts(&self) -> PathBuf {
        self.dir.join("ckpts")
    }

    /// Writes step `step` aside (not yet seen by the publishers); `move_in` moves it in. Four
    /// experts (one per EP rank) rather than `support::checkpoint`'s eight: a step half the
    /// bytes, a dozen of them in the run.
    fn write_aside(&self, step: u64) -> PathBuf {
        support::checkpoint_with(&self.dir.join("aside"), step, 4)
    }

    /// Moves a step written aside into the checkpoint folder, in one rename.
    fn move_in(&mut self, aside: &Path) {
        let name = aside.file_name().unwrap();
        std::fs::create_dir_all(self.ckpts()).unwrap();
        std::fs::rename(aside, self.ckpts().join(name)).unwrap();
        let step: u64 = name.to_str().unwrap()["step-".len()..].parse().unwrap();
        self.written = self.written.max(step);
        log(&format!("step {step} moved in"));
    }

    /// Starts (or restarts) publisher rank `r` on its host.
    fn publisher(&mut self, r: usize) {
        let who = format!("publisher {r}");
        let p = Proc::spawn(
            &who,
            self.hosts
                .command(&publisher_host(r), R)
                .args(self.publish_args(r)),
        );
        if self.publishers.len() <= r {
            self.publishers.resize_with(r + 1, || None);
        }
        self.publishers[r] = Some(p);
    }

    fn publish_args(&self, r: usize) -> Vec<String> {
        let ckpts = self.ckpts().display().to_string();
        [
            "publish",
            "--rendezvous",
            &self.etcd,
            "--model",
            MODEL,
            "--checkpoint",
            &ckpts,
            "--publishers",
            PUBLISHERS,
            "--rank",
            &r.to_string(),
            "--transport",
            "ucx",
            "--lease-ttl-s",
            &TTL_S.to_string(),
            "--poll-ms",
            "100",
            "--json",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    fn pubr(&self, r: usize) -> &Proc {
        self.publishers[r].as_ref().unwrap()
    }

    /// Starts receiver `t` on its host.
    fn receiver(&mut self, t: usize) {
        let dump = self.dir.join(format!("dump-{t}"));
        let p = Proc::spawn(
            &format!("receiver {t}"),
            self.hosts
                .command(&format!("r{t}"), R)
                .args(["receive", "--rendezvous", &self.etcd, "--model", MODEL])
                .args(["--receivers", "tp=2", "--rank", &t.to_string()])
                .args(["--transport", "ucx", "--json", "--timeout-s", "120"])
                .args(["--lease-ttl-s", &TTL_S.to_string()])
                .arg("--dump")
                .arg(dump),
        );
        if t < self.receivers.len() {
            self.receivers[t] = p;
        } else {
            self.receivers.push(p);
        }
    }

    /// Waits for publisher `r`'s line `event` at `step`; lines of other events on the way
    /// (the rendezvous out of reach and back, a refusal) are returned too, in order.
    fn publisher_event(&self, r: usize, event: &str, step: u64) -> Vec<Value> {
        let p = self.pubr(r);
        let deadline = Instant::now() + RECOVER_WITHIN;
        let mut seen = Vec::new();
        loop {
            let v = p.line_by(deadline);
            let done = v["event"] == event && v["step"] == step;
            seen.push(v);
            if done {
                return seen;
            }
        }
    }

    /// `reshard status --json`'s publishers of the model, read from the etcd host.
    fn status(&self) -> Vec<Value> {
        let out = self
            .hosts
            .command("etcd", R)
            .args([
                "status",
                "--rendezvous",
                &self.etcd,
                "--model",
                MODEL,
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

    /// Every rank has exactly one record and its holder is the process this test runs for it
    /// (its host, its pid there), ready at `step`.
    fn one_holder_per_rank(&self, step: u64) {
        let members = self.status();
        let ranks: Vec<u64> = members
            .iter()
            .map(|m| m["rank"].as_u64().unwrap())
            .collect();
        assert_eq!(ranks, (0..WORLD as u64).collect::<Vec<_>>(), "{members:?}");
        for (r, m) in members.iter().enumerate() {
            let p = self.pubr(r);
            assert_eq!(m["holder"]["host"], publisher_host(r), "rank {r}: {m}");
            assert_eq!(m["holder"]["pid"], p.host_pid, "rank {r}: {m}");
            assert_eq!(
                (m["step"].as_u64(), m["ready"].as_bool()),
                (Some(step), Some(true)),
                "{m}"
            );
        }
    }

    /// Global pids of the publishers now.
    fn publisher_pids(&self) -> Vec<u32> {
        (0..WORLD).map(|r| self.pubr(r).pid).collect()
    }

    /// Waits until both receivers have installed `step` (which must be the next step either
    /// installs), checking every line on the way: a `waiting` line or a failed refit must say
    /// the live step is the last installed one, and a failed refit's dump of the live weights
    /// must equal that step's checkpoint, byte for byte (else a weight was lost). Returns the
    /// failed refits seen (as `kind (owner N)`), the weights lost, and when the last receiver
    /// said it installed the step.
    fn install(&mut self, step: u64, within: Duration) -> (Vec<String>, u64, Instant) {
        let deadline = Instant::now() + within;
        let mut failed = Vec::new();
        let mut lost = 0;
        let mut done = Instant::now();
        for t in 0..RECEIVERS {
            loop {
                let (at, v) = self.receivers[t].line_at(deadline);
                if v["verified"] == true {
                    done = if t == 0 { at } else { done.max(at) };
                    assert_eq!(v["step"], step, "receiver {t} installed another step: {v}");
                    self.check_dump(t, &format!("step-{step}"), step);
                    self.installed[t] = v;
                    break;
                }
                if v["live_step"] != self.live {
                    log(&format!(
                        "LOST: receiver {t} says step {} is live, not {}",
                        v["live_step"], self.live
                    ));
                    lost += 1;
                }
                if v["event"] == "waiting" {
                    continue;
                }
                let kind = v["error"]["kind"]
                    .as_str()
                    .expect("a typed error")
                    .to_string();
                failed.push(format!("{kind} (owner {})", v["error"]["owner"]));
                self.failures[t] += 1;
                let n = self.failures[t];
                let dumped = PathBuf::from(v["dump"].as_str().expect("a dump after the failure"));
                assert!(
                    dumped.ends_with(format!("failure-{n}/model.safetensors")),
                    "{v}"
                );
                if !self.dump_matches(t, &format!("failure-{n}"), self.live) {
                    log(&format!(
                        "LOST: receiver {t}'s live weights differ from step {}",
                        self.live
                    ));
                    lost += 1;
                }
            }
        }
        // The previous step's dumps were checked when it installed: keep the disk small.
        for t in 0..RECEIVERS {
            let _ = std::fs::remove_dir_all(self.dir.join(format!("dump-{t}/step-{}", self.live)));
        }
        self.live = step;
        (failed, lost, done)
    }

    /// Asserts receiver `t`'s dump `folder` equals checkpoint step `step`.
    fn check_dump(&self, t: usize, folder: &str, step: u64) {
        assert!(
            self.dump_matches(t, folder, step),
            "receiver {t}: {folder} differs from checkpoint step {step}"
        );
    }

    fn dump_matches(&self, t: usize, folder: &str, step: u64) -> bool {
        let ckpt = Checkpoint::open(self.ckpts().join(format!("step-{step}"))).unwrap();
        let dump = self
            .dir
            .join(format!("dump-{t}/{folder}/model.safetensors"));
        let bytes = std::fs::read(&dump).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let names = st.names();
        assert_eq!(names.len(), 12, "{names:?}");
        names.iter().all(|name| {
            let same = st.tensor(name).unwrap().data() == &expected(&ckpt, name, t, RECEIVERS)[..];
            if !same {
                log(&format!(
                    "receiver {t}: {name} of {folder} differs from step {step}"
                ));
            }
            same
        })
    }

    /// Waits for both receivers to install the last step written (moved in after the fault,
    /// or during it), and records the fault's row: recovery counts from `fault_end` to the
    /// later of the two receivers' installed lines.
    fn row(
        &mut self,
        fault: &'static str,
        fault_end: Instant,
        refused: Vec<String>,
        attempted: u64,
    ) {
        let step = self.written;
        let (failed, lost, done) = self.install(step, RECOVER_WITHIN);
        let recover_s = done.saturating_duration_since(fault_end).as_secs_f64();
        log(&format!("{fault}: step {step} installed on both receivers, {recover_s:.1} s after the fault ended"));
        let mut refused = refused;
        refused.extend(failed.iter().map(|f| format!("refit failed: {f}")));
        self.rows.push(Row {
            fault,
            attempted,
            installed: 1,
            refused,
            lost,
            recover_s,
        });
    }

    fn table(&self) -> String {
        let mut s = String::from(
            "| # | fault | steps attempted | installed and verified | refused / failed with a typed error | weights lost | recovery (s) |\n|---|---|---|---|---|---|---|\n",
        );
        for (i, r) in self.rows.iter().enumerate() {
            let mut counted: BTreeMap<&str, usize> = BTreeMap::new();
            for x in &r.refused {
                *counted.entry(x).or_default() += 1;
            }
            let refused = if counted.is_empty() {
                "none".to_string()
            } else {
                counted
                    .iter()
                    .map(|(k, n)| format!("{n} x {k}"))
                    .collect::<Vec<_>>()
                    .join("; ")
            };
            s += &format!(
                "| {} | {} | {} | {} | {} | {} | {:.1} |\n",
                i + 1,
                r.fault,
                r.attempted,
                r.installed,
                refused,
                r.lost,
                r.recover_s
            );
        }
        s
    }
}

/// The shard files of checkpoint `dir`, sorted.
fn shards(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    v
}

/// Sets (`RATE`) or removes (`none`) `host`'s link rate limit (scripts/hosts.sh rate).
fn set_rate(hosts: &Hosts, host: &str, rate: &str) {
    let ok = Command::new("bash")
        .arg(hosts::script())
        .args(["rate", hosts.set(), host, rate])
        .status()
        .unwrap()
        .success();
    assert!(ok, "hosts.sh rate {host} {rate}");
}

/// Waits for every publisher's `refused` line of `step`, whose message must name `what`; their
/// error kinds.
fn refusals(run: &Run, step: u64, what: &str) -> Vec<String> {
    (0..WORLD)
        .map(|r| {
            let seen = run.publisher_event(r, "refused", step);
            let v = seen.last().unwrap();
            assert_eq!(
                v["serving_step"], run.live,
                "publisher {r} still serves the live step: {v}"
            );
            let kind = v["error"]["kind"].as_str().expect("a typed error");
            let message = v["error"]["message"].as_str().unwrap();
            assert!(
                message.contains(what),
                "publisher {r}: {what} not named: {v}"
            );
            format!("publisher refused step {step}: {kind}")
        })
        .collect()
}

#[test]
fn chaos_run_eight_publishers_two_receivers_every_fault_costs_no_weights() {
    if !available() {
        return;
    }
    let began = Instant::now();
    log("chaos run starts");
    let mut run = Run::start();
    let ttl = Duration::from_secs(TTL_S);

    // Step 1 served by all eight, installed on both receivers.
    let s1 = run.write_aside(1);
    run.move_in(&s1);
    for r in 0..WORLD {
        run.publisher(r);
    }
    for r in 0..WORLD {
        run.publisher_event(r, "published", 1);
    }
    for t in 0..RECEIVERS {
        run.receiver(t);
    }
    let (failed, lost, _) = run.install(1, RECOVER_WITHIN);
    assert!(failed.is_empty() && lost == 0, "{failed:?}");
    run.one_holder_per_rank(1);
    let pids = run.publisher_pids();

    // 1. Every etcd member down (SIGTERM, data kept) for twice the TTL; the next step appears
    // meanwhile. The same eight processes serve it once etcd is back.
    log("fault 1: etcd down");
    run.every_member("stop-member");
    let down = Instant::now();
    let s = run.write_aside(2);
    run.move_in(&s);
    std::thread::sleep((2 * ttl).saturating_sub(down.elapsed()));
    run.every_member("restart-member");
    let back = Instant::now();
    log(&format!(
        "etcd back after {:.1} s down",
        (back - down).as_secs_f64()
    ));
    run.row(
        "every etcd member down 2 x TTL, back on its data",
        back,
        vec![],
        1,
    );
    assert_eq!(run.publisher_pids(), pids, "a publisher was restarted");
    for (t, v) in run.installed.iter().enumerate() {
        let waited = v["waited_through"].as_array().unwrap();
        assert!(
            !waited.is_empty(),
            "receiver {t} says it waited through nothing: {v}"
        );
    }
    for r in 0..WORLD {
        let pid = run.pubr(r).pid;
        assert!(
            run.publishers[r].as_mut().unwrap().alive(),
            "publisher {r} (pid {pid}) exited"
        );
    }
    // Still held a TTL and more later: the keep-alive renews again after the outage (a lease
    // etcd extended on restart but nobody renews would be gone by now).
    std::thread::sleep(2 * ttl);
    run.one_holder_per_rank(2);

    // 2. The leader SIGKILLed; the next step goes through the two left; the member restarted.
    let leader: usize = run.etcd_sh(&["leader"], &[]).parse().unwrap();
    log(&format!("fault 2: etcd leader {leader} killed"));
    run.etcd_sh(&["kill-member", &leader.to_string()], &[]);
    let killed = Instant::now();
    let s = run.write_aside(3);
    run.move_in(&s);
    run.row("etcd leader SIGKILLed", killed, vec![], 1);
    let new: usize = run.etcd_sh(&["leader"], &[]).parse().unwrap();
    assert_ne!(new, leader, "a new leader among the living");
    run.etcd_sh(&["restart-member", &leader.to_string()], &[]);

    // 3. A publisher SIGKILLed and restarted at once (it waits out the dead one's lease).
    let s = run.write_aside(4);
    log("fault 3: publisher 2 SIGKILLed and restarted");
    run.pubr(2).signal("-KILL");
    let code = run.publishers[2]
        .as_mut()
        .unwrap()
        .exit_code(Duration::from_secs(10));
    assert_ne!(code, Some(0));
    run.publisher(2);
    let restarted = Instant::now();
    run.move_in(&s);
    run.row("publisher SIGKILLed and restarted", restarted, vec![], 1);
    run.one_holder_per_rank(4);

    // 4. A publisher SIGSTOPped for twice its TTL (its lease expires) while the next step
    // appears; continued, it announces again and advances: one holder per rank, the same
    // process, and what the receivers install is the new step byte for byte.
    log("fault 4: publisher 5 SIGSTOPped");
    let pid5 = run.pubr(5).pid;
    let incarnation = run.status()[5]["incarnation"].clone();
    run.pubr(5).signal("-STOP");
    let stopped = Instant::now();
    let s = run.write_aside(5);
    run.move_in(&s);
    std::thread::sleep((2 * ttl).saturating_sub(stopped.elapsed()));
    run.pubr(5).signal("-CONT");
    let resumed = Instant::now();
    run.row(
        "publisher SIGSTOPped 2 x TTL, then SIGCONT",
        resumed,
        vec![],
        1,
    );
    assert_eq!(run.pubr(5).pid, pid5);
    run.one_holder_per_rank(5);
    let m5 = run.status()[5].clone();
    assert_eq!(m5["incarnation"], incarnation, "the same incarnation: {m5}");
    let age = m5["lease_age_s"].as_f64().unwrap();
    assert!(
        age <= resumed.elapsed().as_secs_f64() + 1.0,
        "rank 5's lease ({age} s old) predates its continuation: it was not announced again"
    );

    // 5. A second `reshard publish` for live rank 6 (on its host): exits 2 naming the rank and
    // the holder; the holder serves the next step.
    log("fault 5: a second claimant for rank 6");
    let holder = (publisher_host(6), run.pubr(6).host_pid);
    let mut second = Proc::spawn(
        "second claimant of rank 6",
        run.hosts
            .command(&publisher_host(6), R)
            .args(run.publish_args(6)),
    );
    let claimed = Instant::now();
    let code = second.exit_code(Duration::from_secs(30));
    let ended = Instant::now();
    log(&format!(
        "the second claimant exited {code:?} after {:.1} s",
        (ended - claimed).as_secs_f64()
    ));
    let err = second.stderr_text();
    assert_eq!(code, Some(2), "{err}");
    for part in [
        "publisher rank 6 ".to_string(),
        "held by another live process".to_string(),
        format!("on host {} pid {}", holder.0, holder.1),
    ] {
        assert!(err.contains(&part), "{part:?} not in {err}");
    }
    let s = run.write_aside(6);
    run.move_in(&s);
    run.row(
        "second `reshard publish` for a live rank",
        ended,
        vec!["second claimant exit 2: config (rank held)".to_string()],
        1,
    );
    run.one_holder_per_rank(6);

    // 6. Garbage under the model's members/ prefix: skipped with a warning naming the key.
    log("fault 6: garbage keys under members/");
    let prefix = format!("/reshard/v1/{MODEL}/members/");
    let garbage = [
        (format!("{prefix}00000042"), "{\"step\": \"not a number\""),
        (format!("{prefix}not-a-rank"), "\u{1}\u{2} binary junk"),
    ];
    for (k, v) in &garbage {
        run.etcd_kv("put", k, v);
    }
    let put = Instant::now();
    let s = run.write_aside(7);
    run.move_in(&s);
    run.row("garbage keys under `members/`", put, vec![], 1);
    for t in 0..RECEIVERS {
        let err = run.receivers[t].stderr_text();
        for (k, _) in &garbage {
            assert!(
                err.lines()
                    .any(|l| l.contains("skipping a member record") && l.contains(k.as_str())),
                "receiver {t} did not warn about {k}"
            );
        }
    }
    for (k, _) in &garbage {
        run.etcd_kv("deleterange", k, "");
    }

    // 7. A newer step with a corrupt config.json, then one with a truncated shard: every
    // publisher refuses each with a typed error and serves on; the next good step installs.
    log("fault 7: bad newer steps");
    let bad = run.write_aside(8);
    std::fs::write(
        bad.join("config.json"),
        b"{\"hidden_size\": 2048, \"num_hidden_",
    )
    .unwrap();
    run.move_in(&bad);
    let mut refused = refusals(&run, 8, "config.json");
    let bad = run.write_aside(9);
    let cut = shards(&bad)[1].clone();
    let len = std::fs::metadata(&cut).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&cut)
        .unwrap()
        .set_len(len / 3)
        .unwrap();
    run.move_in(&bad);
    let file = cut.file_name().unwrap().to_str().unwrap().to_string();
    refused.extend(refusals(&run, 9, &file));
    for r in 0..WORLD {
        assert!(
            run.pubr(r).lines.try_recv().is_err(),
            "publisher {r} did more"
        );
    }
    for t in 0..RECEIVERS {
        assert!(
            run.receivers[t].lines.try_recv().is_err(),
            "receiver {t} reacted to a refused step"
        );
    }
    let s = run.write_aside(10);
    // What each publisher sends for one step: fault 8 cuts the link of the one the receivers
    // read most from (DP replicas share the reads), a quarter into a step.
    let sent = |run: &Run| -> Vec<u64> {
        (0..PUBLISHER_HOSTS)
            .map(|h| run.hosts.port_bytes(&format!("p{h}")).unwrap().0)
            .collect()
    };
    let before = sent(&run);
    let good = Instant::now();
    run.move_in(&s);
    run.row(
        "newer step with corrupt config.json, then one with a truncated shard",
        good,
        refused,
        3,
    );
    let per_host: Vec<u64> = sent(&run).iter().zip(&before).map(|(a, b)| a - b).collect();
    let h = (0..PUBLISHER_HOSTS).max_by_key(|&h| per_host[h]).unwrap();
    let (host, cut) = (format!("p{h}"), [2 * h, 2 * h + 1]);
    let other = (2 * h + 2) % WORLD;
    let per_step = per_host[h];
    log(&format!(
        "bytes sent per publisher host for one step: {per_host:?}"
    ));

    // 8. The link of the host the receivers read most from goes down while they read from it:
    // a rank on another host is stopped so the set for step 11 completes only when it
    // continues; the link is slowed so the reads take a while, and cut once the host has sent
    // a quarter of a step's bytes.
    log(&format!(
        "fault 8: {host}'s link (publishers {cut:?}) down mid-refit"
    ));
    set_rate(&run.hosts, &host, SLOW_LINK);
    run.pubr(other).signal("-STOP");
    let s = run.write_aside(11);
    run.move_in(&s);
    for r in cut {
        run.publisher_event(r, "advanced", 11);
    }
    let base = run.hosts.port_bytes(&host).unwrap().0;
    run.pubr(other).signal("-CONT");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let sent = run.hosts.port_bytes(&host).unwrap().0 - base;
        if sent > per_step / 4 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{host} sent {sent} of {per_step} bytes"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    run.hosts.down(&host).unwrap();
    let cut_at = Instant::now();
    log(&format!("{host}'s link down"));
    // Each receiver's refit fails, naming the publisher cut off, keeping the live step.
    let mut failed = Vec::new();
    let mut lost = 0;
    for t in 0..RECEIVERS {
        let v = loop {
            let v = run.receivers[t].line_by(cut_at + Duration::from_secs(20));
            if v["event"] != "waiting" {
                break v;
            }
            if v["live_step"] != run.live {
                lost += 1;
            }
        };
        assert_eq!(
            v["verified"], false,
            "receiver {t} installed with {host} cut off: {v}"
        );
        let owner = v["error"]["owner"].as_u64().unwrap() as usize;
        assert!(
            cut.contains(&owner),
            "the error names a publisher on {host}: {v}"
        );
        let kind = v["error"]["kind"].as_str().unwrap();
        assert!(kind == "timeout" || kind == "transport", "typed: {v}");
        failed.push(format!("refit failed: {kind} (owner {owner})"));
        if v["live_step"] != run.live {
            lost += 1;
        }
        run.failures[t] += 1;
        let n = run.failures[t];
        if !run.dump_matches(t, &format!("failure-{n}"), run.live) {
            lost += 1;
        }
    }
    run.hosts.up(&host).unwrap();
    set_rate(&run.hosts, &host, "none");
    let up = Instant::now();
    log(&format!(
        "{host}'s link up after {:.1} s",
        (up - cut_at).as_secs_f64()
    ));
    run.row(
        "a publisher host's link down mid-refit, then up",
        up,
        failed,
        1,
    );
    run.rows.last_mut().unwrap().lost += lost;

    // 9. A receiver SIGKILLed while it reads (its reading claim held): nothing of it runs any
    // more, so only its claim's lease ends the claim. The publishers' next overwrite waits for
    // it no longer than that lease's TTL (not their 60 s fence timeout), the other receiver
    // installs both steps, and the receiver started again installs the newest.
    log(&format!(
        "fault 9: receiver 0 SIGKILLed while it reads from {host}"
    ));
    set_rate(&run.hosts, &host, SLOW_LINK);
    let s = run.write_aside(12);
    let base = run.hosts.port_bytes(&host).unwrap().0;
    run.move_in(&s);
    let deadline = Instant::now() + Duration::from_secs(60);
    while run.hosts.port_bytes(&host).unwrap().0 - base < per_step / 4 {
        assert!(
            Instant::now() < deadline,
            "{host} sent too little of step 12"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    run.receivers[0].signal("-KILL");
    let killed = Instant::now();
    // Killed by the signal: no exit code, and gone within the bound.
    assert_eq!(run.receivers[0].exit_code(Duration::from_secs(10)), None);
    set_rate(&run.hosts, &host, "none");
    let s = run.write_aside(13);
    run.move_in(&s);
    let mut refused = Vec::new();
    let mut fence_s: f64 = 0.0;
    for r in 0..WORLD {
        let seen = run.publisher_event(r, "advanced", 13);
        assert!(
            !seen.iter().any(|v| v["event"] == "fence_timeout"),
            "publisher {r} waited out its fence timeout: {seen:?}"
        );
        let fence = seen
            .iter()
            .find(|v| v["event"] == "fence" && v["step"] == 13)
            .unwrap_or_else(|| panic!("publisher {r} waited for no reader: {seen:?}"));
        let readers = fence["readers"].to_string();
        assert!(
            readers.contains("receiver rank 0"),
            "publisher {r}: {fence}"
        );
        fence_s = fence_s.max(fence["waited_s"].as_f64().unwrap());
    }
    log(&format!(
        "the publishers' fence opened after at most {fence_s:.1} s (receivers' lease TTL {TTL_S} s)"
    ));
    assert!(
        fence_s < TTL_S as f64 + 2.0,
        "a dead receiver held the fence {fence_s:.1} s"
    );
    refused.push(format!(
        "receiver 0 killed: its claim held the fence {fence_s:.1} s"
    ));
    // Receiver 1 finishes step 12 (the fence kept its memory) and installs 13; receiver 0,
    // started again with no weights, installs 13.
    let mut lost = 0;
    let v = loop {
        let v = run.receivers[1].line_by(killed + RECOVER_WITHIN);
        if v["verified"] == true {
            break v;
        }
        lost += u64::from(v["live_step"] != run.live);
        if v["event"] != "waiting" {
            refused.push(format!("receiver 1 refit failed: {}", v["error"]["kind"]));
        }
    };
    assert_eq!(v["step"], 12, "receiver 1: {v}");
    run.check_dump(1, "step-12", 12);
    run.receiver(0);
    run.failures[0] = 0;
    let mut done = killed;
    for (t, from) in [(0, Value::Null), (1, Value::from(12))] {
        let (at, v) = loop {
            let (at, v) = run.receivers[t].line_at(killed + RECOVER_WITHIN);
            if v["verified"] == true {
                break (at, v);
            }
            lost += u64::from(v["live_step"] != from);
            if v["event"] != "waiting" {
                refused.push(format!("receiver {t} refit failed: {}", v["error"]["kind"]));
            }
        };
        assert_eq!(v["step"], 13, "receiver {t}: {v}");
        run.check_dump(t, "step-13", 13);
        run.installed[t] = v;
        done = done.max(at);
    }
    run.live = 13;
    let recover_s = done.saturating_duration_since(killed).as_secs_f64();
    log(&format!(
        "fault 9: step 13 installed on both receivers, {recover_s:.1} s after the kill"
    ));
    run.rows.push(Row {
        fault: "a receiver SIGKILLed mid-refit, holding its reading claim",
        attempted: 2,
        installed: 1,
        refused,
        lost,
        recover_s,
    });

    // Still one holder per rank, each the process this test started for it.
    run.one_holder_per_rank(13);
    for r in 0..WORLD {
        assert!(
            run.publishers[r].as_mut().unwrap().alive(),
            "publisher {r} exited"
        );
    }
    for t in 0..RECEIVERS {
        assert!(run.receivers[t].alive(), "receiver {t} exited");
    }

    let table = run.table();
    eprintln!(
        "\nchaos run: {} faults, {:.0} s in all\n\n{table}",
        run.rows.len(),
        began.elapsed().as_secs_f64()
    );
    for row in &run.rows {
        assert_eq!(row.lost, 0, "{}: weights lost\n{table}", row.fault);
        assert_eq!(row.installed, 1, "{}\n{table}", row.fault);
    }
}
