//! The rendezvous suite against the in-process hub.

mod suite;

use std::sync::Arc;
use std::time::Duration;

use reshard_rendezvous::InProcess;
use suite::Sides;

/// The two sides over one fresh hub (the model name is the suite's to ignore: a hub per test).
async fn sides(_model: &str) -> Option<Sides> {
    let hub = Arc::new(InProcess::new());
    Some(Sides {
        publishers: hub.clone(),
        receivers: hub,
        gone_within: Duration::from_millis(50),
        model: "qwen".into(),
    })
}

suite::suite_tests!(sides, 3_000);
