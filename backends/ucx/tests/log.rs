//! UCX's own log goes to stderr, never to stdout (module `ucs_log`, README "Configuration"): a
//! process whose stdout carries data (`reshard receive --json`) must not get UCX's warnings
//! mixed into it. UCX warns about a `UCX_*` variable it does not know when its first context is
//! created, which makes it log on demand; the test runs itself as a child process with such a
//! variable set, once as users run it (the warning must be on stderr, not stdout) and once with
//! `UCX_LOG_FILE=stdout` (a user's choice is kept: the warning is on stdout, which also shows
//! the first case would see it there).

use std::process::Command;

use reshard_backend_ucx::{UcxOptions, UcxTransport};

/// Set in the child: it only creates an endpoint.
const CHILD: &str = "RESHARD_UCX_LOG_TEST_CHILD";
/// A variable UCX does not know: it warns `unused env variable: <name>`.
const UNKNOWN: &str = "UCX_RESHARD_LOG_TEST_UNKNOWN";
const NAME: &str = "ucx_log_goes_to_stderr_unless_the_user_chose_a_log_file";

fn available() -> bool {
    reshard_conformance::backend_available("ucx", reshard_backend_ucx::probe())
}

/// Runs this test in a child with `env`; returns its stdout and stderr.
fn child(env: &[(&str, &str)]) -> (String, String) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", NAME, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env(UNKNOWN, "1")
        .env_remove("UCX_LOG_FILE")
        .env_remove("UCX_WARN_UNUSED_ENV_VARS");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    (stdout, stderr)
}

#[test]
fn ucx_log_goes_to_stderr_unless_the_user_chose_a_log_file() {
    if std::env::var_os(CHILD).is_some() {
        let options = UcxOptions {
            tls: Some("tcp".into()),
            ..UcxOptions::default()
        };
        let _endpoint = UcxTransport::new("log-child", options).expect("ucx endpoint");
        return;
    }
    if !available() {
        return;
    }
    let (stdout, stderr) = child(&[]);
    assert!(!stdout.contains(UNKNOWN), "UCX logged to stdout:\n{stdout}");
    let line = stderr
        .lines()
        .find(|l| l.contains(UNKNOWN))
        .unwrap_or_else(|| panic!("UCX's warning is not on stderr:\n{stderr}"));
    assert!(line.starts_with("[ucx WARN "), "{line}");

    // The user's choice is UCX's own behaviour.
    let (stdout, stderr) = child(&[("UCX_LOG_FILE", "stdout")]);
    assert!(stdout.contains(UNKNOWN), "UCX_LOG_FILE=stdout:\n{stdout}");
    assert!(!stderr.contains(UNKNOWN), "UCX_LOG_FILE=stdout:\n{stderr}");
}
