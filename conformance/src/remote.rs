//! Cross-process conformance: the test binary re-executes itself as the publisher process, so a
//! backend needs no extra binary to run the suite with publishers and receiver in different
//! processes. See [`crate::cross_process_conformance_tests`].

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use reshard_core::encoding::decode_table;
use reshard_core::{ErrorKind, Result, Transport};
use reshard_testkit::RemoteCluster;

use crate::fixtures::{tiny_dense, Harness};

pub use reshard_testkit::remote::is_publisher_process;

/// The libtest name of `test` in the module whose `module_path!()` is `module_path` (the crate
/// segment is not part of a test's name).
pub fn test_name(module_path: &str, test: &str) -> String {
    match module_path.split_once("::") {
        Some((_, rest)) => format!("{rest}::{test}"),
        None => test.to_string(),
    }
}

/// A command that re-runs this test binary with only `test` selected: that test serves as the
/// publisher process (it sees the socket variable and calls [`serve_publishers`]).
pub fn self_command(module_path: &str, test: &str) -> impl Fn() -> Command + Send + Sync {
    let name = test_name(module_path, test);
    move || {
        let exe = std::env::current_exe().unwrap_or_else(|_| "/proc/self/exe".into());
        let mut c = Command::new(exe);
        c.args([name.as_str(), "--exact", "--test-threads=1", "--nocapture"]);
        c
    }
}

/// Body of the publisher process: serves publishers on `endpoint`'s transports until the parent
/// says shutdown; a failure fails the child's test run, which the parent sees.
pub fn serve_publishers(endpoint: impl Fn(&str) -> Result<Arc<dyn Transport>>) {
    if let Err(e) = reshard_testkit::remote::serve(endpoint) {
        panic!("publisher process failed: {e}");
    }
}

/// The plain-test half of the publisher-process entry point: starts a publisher process for a
/// small model, checks its tables and metadata, its typed errors and a published step, then
/// shuts it down and checks it exited cleanly.
pub fn publisher_process_self_test(h: &Harness, command: Command) {
    let model = tiny_dense(4);
    let mut c = RemoteCluster::spawn(
        command,
        model.clone(),
        "tp=2,dp=2".parse().expect("topology"),
        7,
        Duration::from_secs(120),
    )
    .unwrap_or_else(|e| panic!("{}: publisher process did not start: {e}", h.name()));
    let tables = c.tables();
    assert_eq!(tables.len(), 4, "one table per publisher rank");
    assert_eq!(c.metadata().len(), 4, "one metadata blob per rank");
    assert!(c.arena_bytes() > 0);
    for t in &tables {
        assert_eq!(t.step, 0);
        assert!(!t.offers.is_empty());
    }
    c.publish_step(3).expect("publish step 3");
    assert!(c.tables().iter().all(|t| t.step == 3));
    assert_ne!(
        c.tables()[0].offers[0].digest,
        tables[0].offers[0].digest,
        "new step, new bytes"
    );
    let e = c
        .corrupt("no.such.tensor", 0)
        .expect_err("unknown tensor is refused");
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    c.corrupt("model.norm.weight", 0)
        .expect("corrupt a real tensor");
    // Tables crossed the process boundary in the binary encoding; they must decode the same.
    let again = reshard_core::encoding::encode_table(&c.tables()[1]);
    assert_eq!(decode_table(&again).expect("decode"), c.tables()[1]);
    let status = c.shutdown().expect("shutdown");
    assert!(status.success(), "publisher process exited with {status}");
}
