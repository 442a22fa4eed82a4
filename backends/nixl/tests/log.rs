//! UCX's own log goes to stderr, never to stdout, for the UCX the NIXL runtime bundles too
//! (README "Options"; `reshard_backend_ucx::ucs_log`): a process whose stdout carries data
//! (`reshard receive --json`) must not get UCX's warnings mixed into it. UCX warns about a
//! `UCX_*` variable it does not know when the UCX plugin creates its context, which makes it
//! log on demand; the test runs itself as a child process with such a variable set, once as
//! users run it (the warning must be on stderr, not stdout) and once with `UCX_LOG_FILE=stdout`
//! (a user's choice is kept: the warning is on stdout, which also shows the first case would
//! see it there).

use std::process::Command;

use reshard_backend_nixl::{probe, NixlOptions, NixlTransport, SCHEME};

/// Set in the child: it only creates an endpoint.
const CHILD: &str = "RESHARD_NIXL_LOG_TEST_CHILD";
/// A variable UCX does not know: it warns `unused env variable: <name>`.
const UNKNOWN: &str = "UCX_RESHARD_LOG_TEST_UNKNOWN";
const NAME: &str = "ucx_log_of_the_nixl_runtime_goes_to_stderr_unless_the_user_chose_a_log_file";

/// Runs this test in a child with `env`; returns its stdout and stderr.
fn child(env: &[(&str, &str)]) -> (String, String) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", NAME, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env(UNKNOWN, "1")
        .env("UCX_TLS", "tcp")
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
fn ucx_log_of_the_nixl_runtime_goes_to_stderr_unless_the_user_chose_a_log_file() {
    if std::env::var_os(CHILD).is_some() {
        let _endpoint =
            NixlTransport::new("log-child", &NixlOptions::default()).expect("nixl endpoint");
        return;
    }
    if !reshard_conformance::backend_available(SCHEME, probe()) {
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
