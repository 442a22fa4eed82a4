//! The emulated hosts of `scripts/hosts.sh` (docs/deployment.md, "Hosts and links on one
//! machine") keep what a real host keeps to itself: processes, shared memory, SysV IPC and its
//! name; they reach each other only over their links, only while those are up, and nothing
//! outside the set; dropping the set ends every process on it and removes its namespaces.
//! Skipped (loudly) where not root or without namespace support, unless
//! `RESHARD_REQUIRE_BACKENDS` is set.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use reshard_testkit::hosts::{self, Hosts};

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "{}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn on(h: &Hosts, host: &str, script: &str) -> Output {
    h.command(host, "sh").args(["-c", script]).output().unwrap()
}

/// Waits until `script` succeeds on `host`.
fn until(h: &Hosts, host: &str, script: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !on(h, host, script).status.success() {
        assert!(Instant::now() < deadline, "never true on {host}: {script}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn processes_shared_memory_ipc_and_names_stay_on_their_host() {
    if !hosts::available() {
        return;
    }
    let h = Hosts::create(&["a", "b"]).unwrap();
    let name = format!("rsh-probe-{}", std::process::id());
    // On a: a POSIX shared-memory file, a SysV segment (its id printed), a marked process.
    let mut holder = h
        .command("a", "sh")
        .args([
            "-c",
            &format!("echo x >/dev/shm/{name} && ipcmk -M 4096 && exec sleep 300"),
        ])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    until(&h, "a", &format!("test -e /dev/shm/{name}"));
    until(&h, "a", "pgrep -x sleep | grep -q .");
    // a sees them; b and this (root) namespace do not.
    assert!(ok(on(&h, "a", "ipcs -m")).contains("4096"));
    assert!(!ok(on(&h, "b", "ipcs -m")).contains("4096"));
    assert!(!on(&h, "b", &format!("test -e /dev/shm/{name}"))
        .status
        .success());
    assert!(!std::path::Path::new(&format!("/dev/shm/{name}")).exists());
    // b cannot see a's processes, so cannot name one to attach to (process_vm_readv, ptrace).
    let a_sleep = ok(on(&h, "a", "pgrep -x sleep"));
    assert!(!a_sleep.trim().is_empty());
    let b_sleep = ok(on(&h, "b", "pgrep -x sleep || true"));
    for pid in b_sleep.split_whitespace() {
        // Only b's own init keeps a sleep; a's marked one (300 s) is not among them.
        let cmd = ok(on(
            &h,
            "b",
            &format!("cat /proc/{pid}/cmdline | tr '\\0' ' '"),
        ));
        assert!(!cmd.contains("300"), "b sees a's process: {cmd}");
    }
    assert_eq!(ok(on(&h, "a", "hostname")).trim(), "a");
    assert_eq!(ok(on(&h, "b", "hostname")).trim(), "b");
    let _ = holder.kill();
    let _ = holder.wait();
}

/// A one-shot TCP exchange from `from` to `to`'s address: "ok", or the client's error.
fn connect(h: &Hosts, from: &str, addr: &str) -> String {
    let out = h
        .command(from, "python3")
        .args([
            "-c",
            "import socket, sys\n\
             try:\n    \
                 s = socket.create_connection((sys.argv[1], 7000), timeout=2)\n    \
                 print(s.recv(2).decode())\n\
             except OSError as e:\n    \
                 print(type(e).__name__, e)",
            addr,
        ])
        .output()
        .unwrap();
    ok(out).trim().to_string()
}

#[test]
fn hosts_reach_each_other_only_over_their_link_and_only_while_it_is_up() {
    if !hosts::available() {
        return;
    }
    let h = Hosts::create(&["a", "b"]).unwrap();
    let server = "import socket, sys\n\
                  s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
                  s.bind((sys.argv[1], 7000)); s.listen()\n\
                  while True:\n    \
                      c, _ = s.accept(); c.sendall(b'ok'); c.close()";
    let mut srv = h
        .command("b", "python3")
        .args(["-c", server, h.addr("b")])
        .spawn()
        .unwrap();
    until(&h, "b", "ss -ltn | grep -q ':7000'");
    assert_eq!(connect(&h, "a", h.addr("b")), "ok");
    let (from_b, _) = h.port_bytes("b").unwrap();
    assert!(from_b > 0, "b's reply crossed the switch");
    h.down("b").unwrap();
    let cut = connect(&h, "a", h.addr("b"));
    assert!(cut.starts_with("TimeoutError"), "link down: {cut}");
    h.up("b").unwrap();
    assert_eq!(connect(&h, "a", h.addr("b")), "ok");
    // Nothing outside the set is routed: not the machine's networks, not the internet.
    let out = connect(&h, "a", "192.0.2.1");
    assert!(out.contains("unreachable"), "{out}");
    let _ = srv.kill();
    let _ = srv.wait();
}

#[test]
fn dropping_the_set_ends_its_processes_and_removes_its_namespaces() {
    if !hosts::available() {
        return;
    }
    let h = Hosts::create(&["a"]).unwrap();
    let set = h.set().to_string();
    // A process forked away from what the test started: only the set's teardown ends it.
    ok(on(&h, "a", "sleep 300 >/dev/null 2>&1 & echo started"));
    let netns = || {
        let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.starts_with(&format!("{set}.")))
            .count()
    };
    assert_eq!(netns(), 2, "the host and the switch");
    let pids: Vec<String> = String::from_utf8_lossy(
        &Command::new("ip")
            .args(["netns", "pids", &format!("{set}.a")])
            .output()
            .unwrap()
            .stdout,
    )
    .split_whitespace()
    .map(str::to_string)
    .collect();
    assert!(pids.len() >= 2, "init and the sleep: {pids:?}");
    drop(h);
    assert_eq!(netns(), 0);
    for pid in pids {
        // Gone, or dead and not yet reaped by whoever inherited it (a zombie, state Z).
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat.rsplit_once(") ").map(|(_, rest)| &rest[..1]);
        assert!(
            matches!(state, None | Some("Z")),
            "process {pid} outlived its host: {stat}"
        );
    }
    // Destroying again is harmless.
    let again = Command::new("bash")
        .arg(hosts::script())
        .args(["destroy", &set])
        .status()
        .unwrap();
    assert!(again.success());
}
