//! A publisher's and a receiver's start-up and etcd restarts (docs/deployment.md §2 and §5): a
//! publisher and a receiver started while etcd is down wait for it, then announce and install;
//! a receiver keeps its weights through an etcd restart longer than the lease TTL and installs
//! the next step afterwards; a folder with no complete checkpoint is said to be so within a
//! second (which folder, which file is short), in the log, the JSON lines and `reshard status`,
//! and a single-file checkpoint (`model.safetensors` + `config.json`) is published like a
//! sharded one. A private etcd (scripts/etcd.sh), `reshard publish` and `reshard receive`
//! processes over UCX restricted to TCP; what the receiver installs is compared with the
//! checkpoint files, tensor by tensor.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use reshard_checkpoint::{write_single_file, Checkpoint, SINGLE_FILE};
use reshard_planner::presets::{preset, ModelConfig};
use serde_json::Value;
use support::{available, check_dump, checkpoint, installed, serial, transport_env, Etcd, Proc, R};

/// A scratch folder and an etcd URL on a free port, etcd not started
/// ([`Etcd::start_again`] starts it there).
fn etcd_not_started(name: &str) -> Etcd {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("etcd")).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    Etcd {
        dir,
        url: format!("etcd://127.0.0.1:{port}"),
    }
}

/// Waits (up to 60 s) for `p` to exit and returns its exit code.
fn exit_code(p: &mut Proc) -> Option<i32> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(s) = p.child.try_wait().unwrap() {
            return s.code();
        }
        assert!(Instant::now() < deadline, "it did not exit");
        std::thread::sleep(Duration::from_millis(50));
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

/// `reshard publish` of rank 0 of TP1, JSON lines, a 2 s lease, a 100 ms poll.
fn publisher(etcd: &Etcd, ckpts: &Path) -> Proc {
    Proc::spawn(
        "the publisher",
        Command::new(R)
            .envs(transport_env("ucx"))
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
        "the receiver",
        Command::new(R)
            .envs(transport_env("ucx"))
            .args(["receive", "--rendezvous", &etcd.url, "--model", "q"])
            .args(["--receivers", "tp=1", "--rank", "0", "--transport", "ucx"])
            .args(["--steps", &steps.to_string(), "--json", "--timeout-s", "60"])
            .args(["--lease-ttl-s", "2", "--dump"])
            .arg(dump),
    )
}

/// `reshard status --json`'s entry for rank 0: (step, ready, note), the rank present.
fn status(etcd: &Etcd) -> (u64, bool, Option<String>) {
    etcd.rank0().expect("rank 0 in reshard status")
}

/// Waits for the publisher's line `event` at `step`, skipping the lines that say it waited
/// for the rendezvous; returns them too.
fn event(p: &Proc, event: &str, step: u64) -> (Value, Vec<Value>) {
    let mut waited = Vec::new();
    loop {
        let v = p.line();
        match v["event"].as_str() {
            Some("rendezvous_unreachable" | "rendezvous_back") => waited.push(v),
            Some(e) if e == event && v["step"] == step => return (v, waited),
            _ => panic!("expected {event} of step {step}: {v}"),
        }
    }
}

/// Asserts that the safetensors file `file` (a receiver's dump) equals what TP1 holds of the
/// checkpoint at `ckpt`, parameter by parameter.
fn same_as(file: &Path, ckpt: &Path) {
    check_dump(file, &Checkpoint::open(ckpt).unwrap(), 0, 1);
}

/// A publisher and a receiver both started while etcd is down: neither exits; the publisher
/// says once that the rendezvous is unreachable (its step loaded, not announced), the
/// receiver says it waits; once etcd starts the publisher announces and the receiver installs
/// the step, verified against the checkpoint files.
#[test]
fn a_publisher_and_a_receiver_started_while_etcd_is_down_wait_for_it() {
    if !available("ucx") {
        return;
    }
    let _serial = serial();
    let started = Instant::now();
    let etcd = etcd_not_started("startup-etcd-down");
    let ckpts = etcd.dir.join("ckpts");
    checkpoint(&ckpts, 1);
    let mut p = publisher(&etcd, &ckpts);
    let dump = etcd.dir.join("dump");
    let mut r = receiver(&etcd, 1, &dump);
    let v = p.line();
    assert_eq!(v["event"], "rendezvous_unreachable", "{v}");
    assert_eq!(v["serving_step"], 1, "{v}");
    assert_eq!(v["announced"], false, "{v}");
    assert!(
        ["transport", "timeout"].contains(&v["error"]["kind"].as_str().unwrap()),
        "{v}"
    );
    let w = r.line();
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
        p.pending_line().is_none(),
        "the publisher said the outage more than once"
    );

    etcd.start_again();
    let (_, waited) = event(&p, "published", 1);
    assert_eq!(waited.len(), 1, "{waited:?}");
    assert_eq!(waited[0]["event"], "rendezvous_back");
    assert!(waited[0]["waited_s"].as_f64().unwrap() >= 3.0);
    let v = loop {
        let v = r.line();
        if v["event"] != "waiting" {
            break v;
        }
    };
    installed(&v, 1, &dump, &ckpts, 0, 1);
    assert_eq!(exit_code(&mut r), Some(0));
    assert_eq!(status(&etcd), (1, true, None));
    eprintln!("wall time {:.1} s", started.elapsed().as_secs_f64());
}

/// A receiver live at step 1 while etcd is stopped for longer than the lease TTL and started
/// again on its data, step 2 written meanwhile: the receiver never exits, prints no failure,
/// its weights stay step 1's (its dump), and it installs step 2 afterwards, verified, its line
/// saying what discovery waited through.
#[test]
fn a_receiver_keeps_its_weights_through_an_etcd_restart_and_installs_the_next_step() {
    if !available("ucx") {
        return;
    }
    let _serial = serial();
    let started = Instant::now();
    let etcd = Etcd::start("startup-etcd-restart");
    let ckpts = etcd.dir.join("ckpts");
    let step1 = checkpoint(&ckpts, 1);
    let p = publisher(&etcd, &ckpts);
    event(&p, "published", 1);
    let dump = etcd.dir.join("dump");
    let mut r = receiver(&etcd, 2, &dump);
    installed(&r.line(), 1, &dump, &ckpts, 0, 1);

    // Down for twice the TTL (2 s), step 2 written meanwhile.
    etcd.stop_keeping_data();
    checkpoint(&ckpts, 2);
    std::thread::sleep(Duration::from_secs(4));
    assert!(r.alive(), "the receiver exited while etcd was down");
    assert!(
        r.pending_line().is_none(),
        "the receiver reported a failure while etcd was down"
    );
    etcd.start_again();
    event(&p, "advanced", 2);
    let mut failures = 0;
    let v = loop {
        let v = r.line();
        if v["verified"] == false {
            // A refit that failed keeps step 1 live: its dump is step 1's bytes.
            assert_eq!(v["live_step"], 1, "{v}");
            same_as(Path::new(v["dump"].as_str().unwrap()), &step1);
            failures += 1;
            continue;
        }
        break v;
    };
    installed(&v, 2, &dump, &ckpts, 0, 1);
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
    assert_eq!(exit_code(&mut r), Some(0));
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
    if !available("ucx") {
        return;
    }
    let _serial = serial();
    let started = Instant::now();
    let etcd = Etcd::start("startup-single-file");
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
    let v = p.line();
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
        if let Some(s @ (_, _, Some(_))) = etcd.rank0() {
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
    assert!(p.pending_line().is_none(), "said again without a change");
    assert!(p.alive());

    // A whole single-file step 2, moved in in one rename.
    let aside = etcd.dir.join("aside");
    write_single_file(&model(), 2, &aside).unwrap();
    let step2 = ckpts.join("step-2");
    std::fs::rename(&aside, &step2).unwrap();
    event(&p, "published", 2);
    let dump = etcd.dir.join("dump");
    let mut r = receiver(&etcd, 1, &dump);
    installed(&r.line(), 2, &dump, &ckpts, 0, 1);
    assert_eq!(exit_code(&mut r), Some(0));
    assert_eq!(status(&etcd), (2, true, None));
    eprintln!(
        "said why {:.3} s after spawning; wall time {:.1} s",
        said.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
}
