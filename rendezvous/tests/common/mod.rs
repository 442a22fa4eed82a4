//! What the etcd test binaries share: scripts/etcd.sh, the loud skip where etcd is missing, and
//! two connections to one endpoint list (the suite's publishers' and receivers' sides).
//!
//! Each test binary compiles this module and uses part of it.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use reshard_rendezvous::{Etcd, EtcdOptions};

/// The repository's scripts/etcd.sh.
pub fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/etcd.sh")
}

/// Runs scripts/etcd.sh with `args`, its etcd stopped by the script's watcher once this test
/// binary exits (also where it lives in a static, never dropped, or a test panics first); its
/// stdout, trimmed, or a panic with its stderr.
pub fn etcd_sh(args: &[&std::ffi::OsStr], port: Option<&str>) -> String {
    let mut cmd = Command::new("bash");
    cmd.arg(script())
        .args(args)
        .env("ETCD_OWNER_PID", std::process::id().to_string());
    if let Some(p) = port {
        cmd.env("ETCD_PORT", p);
    }
    let out = cmd.output().expect("run scripts/etcd.sh");
    assert!(
        out.status.success(),
        "scripts/etcd.sh {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// Whether etcd is installed; where it is not and the environment does not require it
/// (`RESHARD_REQUIRE_BACKENDS` set, as in CI), says so loudly.
pub fn etcd_installed() -> bool {
    let installed = Command::new("etcd").arg("--version").output().is_ok();
    if !installed {
        assert!(
            std::env::var_os("RESHARD_REQUIRE_BACKENDS").is_none(),
            "etcd is required here: run scripts/install-deps.sh"
        );
        eprintln!("SKIPPED: etcd is not installed (scripts/install-deps.sh installs it)");
    }
    installed
}

/// Options with a lease of `ttl_s` seconds.
pub fn options(ttl_s: u64) -> EtcdOptions {
    EtcdOptions {
        lease_ttl: Duration::from_secs(ttl_s),
        ..EtcdOptions::default()
    }
}

/// Two connections to `url` with a 1 s lease: the suite's publishers' and receivers' sides.
pub async fn two_connections(url: &str) -> (Arc<Etcd>, Arc<Etcd>) {
    let publishers = Etcd::connect(url, options(1)).await.expect("connect");
    let receivers = Etcd::connect(url, options(1)).await.expect("connect");
    (Arc::new(publishers), Arc::new(receivers))
}
