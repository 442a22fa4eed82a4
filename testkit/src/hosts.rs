//! Emulated hosts on one machine for tests: a Rust handle on `scripts/hosts.sh`
//! (docs/deployment.md, "Hosts and links on one machine"). Each host is a network namespace
//! with its own PID, IPC, UTS and mount namespace (a private `/dev/shm`), linked to the others
//! through a bridge in a namespace of its own, so processes on different hosts share neither
//! memory nor an address: their traffic crosses the emulated links, which can be rate limited
//! and taken down.
//!
//! A [`Hosts`] set has a name unique to the test run (process id and a counter) and is
//! destroyed when dropped, also while a test panics; a test process killed outright is cleaned
//! up by the script's owner watcher, which destroys the set once this process is gone.

use std::ffi::OsStr;
use std::io;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

/// The environment variable that turns a skip for a missing backend or facility into a
/// failure (the conformance suite's rule, `reshard_conformance::backend_available`).
const REQUIRE_ENV: &str = "RESHARD_REQUIRE_BACKENDS";

/// Sets made by this process so far: the counter in each set's name.
static SETS: AtomicU32 = AtomicU32::new(0);

/// `scripts/hosts.sh` of this repository.
pub fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/hosts.sh")
}

fn failed(what: &str, out: &Output) -> io::Error {
    io::Error::other(format!(
        "hosts.sh {what} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    ))
}

fn run_script<I, S>(args: I) -> io::Result<Output>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    Command::new("bash").arg(script()).args(args).output()
}

/// Whether this machine can make hosts (root, iproute2, util-linux, network namespaces). Where
/// it cannot, says so on stderr (`SKIPPED: ...`) and returns false, unless
/// `RESHARD_REQUIRE_BACKENDS` is set, which makes it panic with the reason instead.
pub fn available() -> bool {
    let why = match run_script(["check"]) {
        Ok(out) if out.status.success() => return true,
        Ok(out) => String::from_utf8_lossy(&out.stdout).trim().to_string(),
        Err(e) => format!("cannot run {}: {e}", script().display()),
    };
    if std::env::var_os(REQUIRE_ENV).is_some_and(|v| !v.is_empty()) {
        panic!("emulated hosts are required ({REQUIRE_ENV}) but unavailable: {why}");
    }
    eprintln!("SKIPPED: emulated hosts unavailable here: {why}");
    false
}

/// A set of emulated hosts; destroyed (every process on them killed, every namespace removed)
/// when dropped.
pub struct Hosts {
    set: String,
    /// Host names and addresses, in the order given.
    addrs: Vec<(String, String)>,
}

impl Hosts {
    /// Makes hosts from specs `NAME` or `NAME:RATE` (a `tc` rate such as `40mbit` on both
    /// directions of that host's link), addressed 10.77.0.1, .2, ... in order.
    pub fn create(specs: &[&str]) -> io::Result<Hosts> {
        let set = format!(
            "rsh{}x{}",
            std::process::id(),
            SETS.fetch_add(1, Ordering::Relaxed)
        );
        let out = Command::new("bash")
            .arg(script())
            .arg("create")
            .arg(&set)
            .args(specs)
            .env("RESHARD_HOSTS_OWNER_PID", std::process::id().to_string())
            .output()?;
        if !out.status.success() {
            return Err(failed("create", &out));
        }
        let addrs = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once(' '))
            .map(|(h, a)| (h.to_string(), a.to_string()))
            .collect();
        Ok(Hosts { set, addrs })
    }

    /// The set's name (the prefix of its namespaces).
    pub fn set(&self) -> &str {
        &self.set
    }

    /// The address of `host`.
    pub fn addr(&self, host: &str) -> &str {
        self.addrs
            .iter()
            .find(|(h, _)| h == host)
            .map(|(_, a)| a.as_str())
            .unwrap_or_else(|| panic!("no host {host} in set {}", self.set))
    }

    /// A command that runs `program` on `host`. Killing the spawned child kills `program`
    /// (not processes it forked, which live on the host until the set is destroyed).
    pub fn command(&self, host: &str, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new("bash");
        c.arg(script()).args(["run", &self.set, host]).arg(program);
        c
    }

    fn ctl(&self, args: &[&str]) -> io::Result<String> {
        let out = run_script(args)?;
        if !out.status.success() {
            return Err(failed(args[0], &out));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Takes `host`'s link down at its switch port: the host keeps its address and sockets,
    /// and every packet to or from it is lost until [`Hosts::up`].
    pub fn down(&self, host: &str) -> io::Result<()> {
        self.ctl(&["down", &self.set, host]).map(drop)
    }

    /// Brings `host`'s link back up.
    pub fn up(&self, host: &str) -> io::Result<()> {
        self.ctl(&["up", &self.set, host]).map(drop)
    }

    /// Bytes the switch has received from `host` and sent to it, so far.
    pub fn port_bytes(&self, host: &str) -> io::Result<(u64, u64)> {
        let s = self.ctl(&["bytes", &self.set, host])?;
        let mut n = s.split_whitespace().map(str::parse::<u64>);
        match (n.next(), n.next()) {
            (Some(Ok(from)), Some(Ok(to))) => Ok((from, to)),
            _ => Err(io::Error::other(format!("hosts.sh bytes printed {s:?}"))),
        }
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        if let Err(e) = self.ctl(&["destroy", &self.set]) {
            eprintln!("could not destroy hosts {}: {e}", self.set);
        }
    }
}
