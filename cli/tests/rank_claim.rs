//! One holder per rank, and publishers that outlive etcd outages (docs/deployment.md, "One
//! holder per rank" and "Leases through etcd outages"): a private etcd (scripts/etcd.sh),
//! `reshard publish` processes over UCX restricted to TCP, and a `reshard receive` process whose
//! installed weights are compared with the checkpoint files, tensor by tensor.

mod support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::{checkpoint, serial, transport_env, Etcd, Proc, R};

fn available() -> bool {
    support::available("ucx")
}

/// `reshard publish` of rank `rank` of `topology`, JSON lines, a 3 s lease.
fn publish(etcd: &Etcd, ckpts: &Path, topology: &str, rank: u32) -> Command {
    let mut cmd = Command::new(R);
    cmd.args(["publish", "--rendezvous", &etcd.url, "--model", "q"])
        .arg("--checkpoint")
        .arg(ckpts)
        .args(["--publishers", topology, "--rank", &rank.to_string()])
        .args(["--transport", "ucx", "--lease-ttl-s", "3"])
        .args(["--poll-ms", "100", "--json"])
        .envs(transport_env("ucx"));
    cmd
}

/// A TP1 `reshard receive` that installs `steps` steps and dumps them under `dump`.
fn receiver(etcd: &Etcd, steps: u64, dump: &Path) -> Proc {
    Proc::spawn(
        "the receiver",
        Command::new(R)
            .args(["receive", "--rendezvous", &etcd.url, "--model", "q"])
            .args(["--receivers", "tp=1", "--rank", "0", "--transport", "ucx"])
            .args(["--steps", &steps.to_string(), "--json", "--timeout-s", "60"])
            .args(["--lease-ttl-s", "3", "--dump"])
            .arg(dump)
            .envs(transport_env("ucx")),
    )
}

/// Waits for publisher `p`'s line `event` at `step`, skipping the lines that say it waited
/// for the rendezvous.
fn event(p: &Proc, event: &str, step: u64) -> Value {
    loop {
        let v = p.line();
        match v["event"].as_str() {
            Some("rendezvous_unreachable" | "rendezvous_back") => continue,
            Some(e) if e == event && v["step"] == step => return v,
            _ => panic!("expected {event} of step {step}: {v}"),
        }
    }
}

/// Asserts the TP1 receiver's JSON line says `step` installed and verified, and that its dump
/// of that step equals the checkpoint under `ckpts`, parameter by parameter.
fn installed(v: &Value, step: u64, dump: &Path, ckpts: &Path) {
    support::installed(v, step, dump, ckpts, 0, 1);
}

/// A second `reshard publish` for a live rank exits 2 within seconds, naming the rank and the
/// holder (its incarnation, host and pid, as `reshard status` shows them); the holder serves
/// on untouched: a receiver installs step 1 before and step 2 after, verified.
#[test]
fn a_second_publisher_for_a_live_rank_exits_2_naming_the_holder_which_serves_on() {
    if !available() {
        return;
    }
    let _serial = serial();
    let etcd = Etcd::start("rank-claim");
    let ckpts = etcd.ckpts();
    checkpoint(&ckpts, 1);
    let mut holder = Proc::spawn("the holder", &mut publish(&etcd, &ckpts, "tp=1", 0));
    event(&holder, "published", 1);
    let dump = etcd.dir.join("dump");
    let r = receiver(&etcd, 2, &dump);
    installed(&r.line(), 1, &dump, &ckpts);
    let before = etcd.status();
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
    let after = etcd.status();
    assert_eq!(after[0]["holder"], before[0]["holder"]);
    checkpoint(&ckpts, 2);
    event(&holder, "advanced", 2);
    installed(&r.line(), 2, &dump, &ckpts);
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
    let _serial = serial();
    let etcd = Etcd::start("etcd-outage");
    let ckpts = etcd.ckpts();
    checkpoint(&ckpts, 1);
    let mut pubs: Vec<Proc> = (0..2)
        .map(|r| {
            Proc::spawn(
                &format!("publisher {r}"),
                &mut publish(&etcd, &ckpts, "ep=2,dp=2", r),
            )
        })
        .collect();
    for p in &pubs {
        event(p, "published", 1);
    }
    let pids: Vec<u32> = pubs.iter().map(|p| p.child.id()).collect();

    // Down (stopped, data kept) for twice the TTL, step 2 written meanwhile.
    etcd.stop_keeping_data();
    checkpoint(&ckpts, 2);
    std::thread::sleep(Duration::from_secs(6));
    etcd.start_again();
    for p in &pubs {
        event(p, "advanced", 2);
    }

    // Frozen for twice the TTL, step 3 written meanwhile: the leases expire when etcd runs.
    etcd.signal("-STOP");
    checkpoint(&ckpts, 3);
    std::thread::sleep(Duration::from_secs(6));
    let resumed = Instant::now();
    etcd.signal("-CONT");
    for p in &pubs {
        event(p, "advanced", 3);
    }
    let members = etcd.status();
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
    installed(&r.line(), 3, &dump, &ckpts);
    for (r, p) in pubs.iter_mut().enumerate() {
        assert!(p.alive(), "publisher {r} exited");
        assert_eq!(p.child.id(), pids[r]);
    }
}

/// `reshard status` shows the receivers reading now (the reader fence, docs/deployment.md §3):
/// a reading claim put through etcd is listed with its reader, step and publisher ranks, and is
/// gone from the listing once released.
#[test]
fn status_lists_the_receivers_reading_now() {
    use reshard_core::rendezvous::{ReadClaim, Rendezvous};
    use reshard_rendezvous::{Etcd as Client, EtcdOptions};

    let etcd = Etcd::start("status-readers");
    let readers = || {
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
        assert!(out.status.success(), "{out:?}");
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v[0]["readers"].as_array().cloned().unwrap_or_default()
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client = rt
        .block_on(Client::connect(&etcd.url, EtcdOptions::default()))
        .unwrap();
    let claim = rt
        .block_on(client.claim_reading(ReadClaim {
            model: "q".into(),
            step: 4,
            reader: "receiver rank 1 on host engine-0 pid 7".into(),
            ranks: vec![(0, 11), (2, 13)],
        }))
        .unwrap();
    let listed = readers();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(
        listed[0]["reader"],
        "receiver rank 1 on host engine-0 pid 7"
    );
    assert_eq!(listed[0]["step"], 4);
    assert_eq!(listed[0]["ranks"], serde_json::json!([0, 2]));
    rt.block_on(claim.release()).unwrap();
    assert_eq!(readers(), Vec::<Value>::new());
}
