//! The suite's transport wrappers hand the caller everything their inner endpoint has,
//! including what the trait gives a default for: a wrapped ucx endpoint must keep its shared
//! memory (`allocate_host`) and its execution log.

use std::sync::Arc;

use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
use reshard_conformance::faults::FaultyTransport;
use reshard_conformance::wrappers::{
    FailingTransport, Misdirect, MisdirectingTransport, RecordingTransport,
};
use reshard_core::{ExecutionLog, HostBuffer, HostMemory, Result, Transport};

/// Loopback with memory of its own: the loopback backend has none (`allocate_host` is `None`),
/// so this stands in for a backend that has.
#[derive(Debug)]
struct WithHostMemory {
    inner: Arc<dyn Transport>,
}

reshard_core::forward_transport!(WithHostMemory => inner {
    async fn allocate_host(&self, len: usize) -> Result<Option<Arc<dyn HostMemory>>> {
        Ok(Some(Arc::new(HostBuffer::zeroed(len))))
    }
});

fn wrapped() -> Vec<(&'static str, Arc<dyn Transport>)> {
    let fabric = LoopbackFabric::new();
    let inner = |agent: &str| -> Arc<dyn Transport> {
        Arc::new(WithHostMemory {
            inner: Arc::new(LoopbackTransport::new(&fabric, agent, 1).expect("endpoint")),
        })
    };
    let rule = Misdirect::Offset {
        owner: 0,
        offset: 0,
        by: 1,
    };
    vec![
        (
            "recording",
            Arc::new(RecordingTransport::new(inner("recording"))),
        ),
        (
            "failing",
            Arc::new(FailingTransport::new(inner("failing"), 0)),
        ),
        (
            "misdirecting",
            Arc::new(MisdirectingTransport::new(inner("misdirecting"), rule)),
        ),
        ("faulty", Arc::new(FaultyTransport::new(inner("faulty")))),
    ]
}

#[tokio::test]
async fn wrappers_forward_allocate_host() {
    for (name, t) in wrapped() {
        let host = t.allocate_host(4096).await.expect(name);
        let host = host.unwrap_or_else(|| panic!("{name}: allocate_host not forwarded"));
        assert_eq!(host.len(), 4096, "{name}");
        // The memory is registered like any block, through the same wrapper.
        let reg = t.register(host).await.expect(name);
        assert_eq!(reg.len(), 4096, "{name}");
    }
}

#[test]
fn wrappers_forward_the_execution_log() {
    for (name, t) in wrapped() {
        assert!(t.set_execution_log(Some(ExecutionLog::new())), "{name}");
        assert!(t.set_execution_log(None), "{name}");
    }
}
