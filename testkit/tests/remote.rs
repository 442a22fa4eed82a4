//! The publisher-process control channel: this test binary re-executes itself as the child.
//! Loopback endpoints cannot move bytes across processes, so these tests check the control
//! protocol (tables, metadata, steps, typed errors, shutdown, failures to start); the backends'
//! cross-process conformance suites check the bytes.

use std::process::Command;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
use reshard_core::{DType, ErrorKind, Result, Transport};
use reshard_planner::presets::ModelConfig;
use reshard_testkit::remote::{is_publisher_process, serve};
use reshard_testkit::RemoteCluster;

fn endpoint(agent: &str) -> Result<Arc<dyn Transport>> {
    static FABRIC: OnceLock<LoopbackFabric> = OnceLock::new();
    let fabric = FABRIC.get_or_init(LoopbackFabric::new);
    Ok(Arc::new(LoopbackTransport::new(fabric, agent, 1)?))
}

fn model() -> ModelConfig {
    ModelConfig {
        name: "remote-dense".into(),
        layers: 1,
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        intermediate: 128,
        moe: None,
        vocab: 128,
        tied_embeddings: true,
        qk_norm: false,
        dtype: DType::Bf16,
        arch: Default::default(),
    }
}

fn child() -> Command {
    let mut c = Command::new(std::env::current_exe().expect("test binary"));
    c.args(["publisher_process", "--exact", "--test-threads=1"]);
    c
}

#[test]
fn publisher_process() {
    if is_publisher_process() {
        serve(endpoint).expect("serve");
        return;
    }
    let topo = "tp=2,dp=2".parse().expect("topology");
    let mut c = RemoteCluster::spawn(child(), model(), topo, 11, Duration::from_secs(60))
        .expect("publisher process starts");
    assert!(c.pid().is_some());
    assert_eq!(c.tables().len(), 4);
    assert_eq!(c.metadata().len(), 4);
    let ranks: Vec<u32> = c.tables().iter().map(|t| t.publisher.rank).collect();
    assert_eq!(ranks, vec![0, 1, 2, 3]);
    let first = c.tables();
    c.publish_step(5).expect("publish");
    assert_eq!(c.step(), 5);
    assert!(c.tables().iter().all(|t| t.step == 5));
    assert_ne!(first[0].offers[0].digest, c.tables()[0].offers[0].digest);
    c.set_digests(false).expect("digests off");
    assert!(c.tables()[0].offers.iter().all(|o| o.digest.is_none()));
    // An error in the child comes back with its kind.
    let e = c.corrupt("missing.weight", 1).expect_err("unknown tensor");
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(e.message().contains("missing.weight"), "{e}");
    c.corrupt("model.norm.weight", 1).expect("corrupt");
    // The reference bytes are computed in this process from the generator.
    let layout = reshard_planner::layouts::receiver_layout(
        c.model(),
        &reshard_planner::topology::ReceiverTopology::tp(2),
        0,
    )
    .expect("layout");
    assert_eq!(
        c.expected_params(&layout).expect("reference").len(),
        layout.params.len()
    );
    let status = c.shutdown().expect("shutdown");
    assert!(status.success(), "{status}");
}

#[test]
fn a_child_that_exits_before_connecting_is_an_error() {
    let e = RemoteCluster::spawn(
        Command::new("true"),
        model(),
        Default::default(),
        1,
        Duration::from_secs(30),
    )
    .expect_err("never connects");
    assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
    assert!(e.message().contains("exited before connecting"), "{e}");
}

#[test]
fn a_child_that_never_connects_times_out() {
    let mut cmd = Command::new("sleep");
    cmd.arg("30");
    let started = Instant::now();
    let e = RemoteCluster::spawn(
        cmd,
        model(),
        Default::default(),
        1,
        Duration::from_millis(300),
    )
    .expect_err("times out");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the child was killed"
    );
}
