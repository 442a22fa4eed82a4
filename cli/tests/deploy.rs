//! The deployment path as separate processes (docs/deployment.md): a private etcd
//! (scripts/etcd.sh), `reshard publish` processes serving a safetensors checkpoint folder over
//! UCX restricted to TCP, and `reshard receive` processes that refit every new step and dump
//! what they installed. Each dump is compared with slices cut directly from the checkpoint
//! files by this test's own reading of vLLM's TP layout, not through reshard's planner.

mod support;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reshard_checkpoint::Checkpoint;
use support::{available, check_dump, checkpoint, serial, transport_env, Etcd, Proc, R};

/// A private etcd, a checkpoint folder, publisher and receiver processes; everything is killed
/// and etcd stopped when the test ends, whatever happened.
struct Cluster {
    transport: &'static str,
    env: Vec<(&'static str, &'static str)>,
    publishers: Vec<Option<Child>>,
    receivers: Vec<Proc>,
    /// Publishers' lease: short, so a killed one expires within a test.
    lease_ttl_s: &'static str,
    // Last: the processes above end before etcd does.
    etcd: Etcd,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in self.publishers.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Cluster {
    fn start(name: &str, transport: &'static str) -> Cluster {
        Cluster {
            etcd: Etcd::start(&format!("deploy-{name}-{transport}")),
            transport,
            env: transport_env(transport),
            publishers: Vec::new(),
            receivers: Vec::new(),
            lease_ttl_s: "3",
        }
    }

    fn ckpts(&self) -> PathBuf {
        self.etcd.ckpts()
    }

    /// Starts receiver `t` of TP2; its JSON lines arrive on the channel kept with it.
    fn receiver(&mut self, t: usize, steps: u64) {
        let p = Proc::spawn(
            &format!("receiver {t}"),
            Command::new(R)
                .args(["receive", "--rendezvous", &self.etcd.url, "--model", "q"])
                .args(["--receivers", "tp=2", "--rank", &t.to_string()])
                .args(["--transport", self.transport, "--steps", &steps.to_string()])
                .args(["--json", "--timeout-s", "60", "--lease-ttl-s", "3"])
                .arg("--dump")
                .arg(self.etcd.dir.join(format!("dump-{t}")))
                .envs(self.env.iter().copied()),
        );
        self.receivers.push(p);
    }

    /// Starts (or restarts) publisher rank `r` of EP8/DP8.
    fn publisher(&mut self, r: usize) {
        let child = Command::new(R)
            .args(["publish", "--rendezvous", &self.etcd.url, "--model", "q"])
            .arg("--checkpoint")
            .arg(self.ckpts())
            .args(["--publishers", "ep=8,dp=8", "--rank", &r.to_string()])
            .args(["--transport", self.transport])
            .args(["--lease-ttl-s", self.lease_ttl_s, "--poll-ms", "100"])
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
        support::signal(self.publishers[r].as_ref().unwrap().id(), sig);
    }

    /// The next JSON line of receiver `t`.
    fn line(&self, t: usize) -> serde_json::Value {
        self.receivers[t].line()
    }

    /// Waits for every receiver to exit 0.
    fn receivers_succeed(&mut self) {
        for r in &mut self.receivers {
            r.succeeds();
        }
    }

    /// Members `reshard status` shows, as (rank, step).
    fn status(&self) -> Vec<(u64, u64)> {
        self.etcd.steps()
    }

    /// Asserts an installed step's JSON line and its dump against the checkpoint files.
    fn installed(&self, t: usize, v: &serde_json::Value, step: u64) {
        for key in ["reads", "wire_bytes", "stages_s", "e2e_s", "attribution"] {
            assert!(v.get(key).is_some(), "receiver {t}: no {key} in {v}");
        }
        let dump = self.etcd.dir.join(format!("dump-{t}"));
        support::installed(v, step, &dump, &self.ckpts(), t, 2);
    }
}

/// etcd, 8 publisher processes (EP8/DP8) and 2 receiver processes (TP2, started first: they
/// wait), 3 steps of changing weights, every dump byte-exact against the checkpoint files.
fn three_steps(transport: &'static str) {
    if !available(transport) {
        return;
    }
    let _serial = serial();
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
    let _serial = serial();
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
    let _serial = serial();
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
