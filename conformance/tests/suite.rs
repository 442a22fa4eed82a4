//! The capability gate of `reshard_conformance::suite!`: over a transport that declares
//! `cross_process = false`, the cross-process families do not run (each test says it is
//! inapplicable), and a family the transport declares cannot be left out by omitting its
//! endpoint argument.

use std::sync::Arc;

use bytes::Bytes;
use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
use reshard_conformance::suite::{assert_family_inapplicable, Family};
use reshard_conformance::Harness;
use reshard_core::{Capability, Result, Transport};

/// Loopback declaring `cross_process = declared`. Its metadata cannot be exported: every
/// cross-process test needs publishers in a child process to export theirs, so one that runs
/// although the gate should have stopped it fails here, loudly, instead of passing by chance.
#[derive(Debug)]
struct Declaring {
    inner: Arc<dyn Transport>,
    declared: bool,
}

reshard_core::forward_transport!(Declaring => inner {
    fn capabilities(&self) -> Capability {
        Capability {
            cross_process: self.declared,
            ..self.inner.capabilities()
        }
    }
    async fn export_metadata(&self) -> Result<Bytes> {
        panic!(
            "a cross-process family ran over a transport declaring cross_process = {}",
            self.declared
        )
    }
});

fn declaring(declared: bool) -> impl Fn(&str) -> Result<Arc<dyn Transport>> + Send + Sync {
    let fabric = LoopbackFabric::new();
    move |agent| {
        Ok(Arc::new(Declaring {
            inner: Arc::new(LoopbackTransport::new(&fabric, agent, 1)?),
            declared,
        }) as Arc<dyn Transport>)
    }
}

/// An endpoint that declares `cross_process = false`, given to the cross-process families.
fn in_process_only(agent: &str) -> Result<Arc<dyn Transport>> {
    declaring(false)(agent)
}

fn harness() -> Harness {
    Harness::new("loopback", in_process_only)
}

/// Both cross-process families with their endpoints: every test must report itself
/// inapplicable rather than run (running reaches `export_metadata` in the child and fails).
mod with_endpoints {
    use super::*;

    reshard_conformance::suite! {
        harness = harness(),
        cross_process = in_process_only,
        stall = in_process_only,
        families = [cross_process, stall],
    }
}

/// Both cross-process families without their endpoints: one `family_inapplicable` test each,
/// which passes because the transport declares `cross_process = false`.
mod without_endpoints {
    use super::*;

    reshard_conformance::suite! {
        harness = harness(),
        families = [cross_process, stall],
    }
}

/// A backend declaring `cross_process = true` whose suite call leaves out the endpoint fails
/// the family's `family_inapplicable` test; declaring false, it passes.
#[test]
fn a_declared_family_cannot_be_left_out() {
    for family in [Family::CrossProcess, Family::Stall] {
        let claims = Harness::new("loopback", declaring(true));
        let left_out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            assert_family_inapplicable(&claims, Ok(()), family);
        }));
        assert!(left_out.is_err(), "{family:?} left out although declared");
        assert_family_inapplicable(&harness(), Ok(()), family);
    }
}

/// Only the cross-process families depend on a capability, and only on `cross_process`.
#[test]
fn only_the_cross_process_families_are_gated_and_on_cross_process() {
    let with = |cross_process| Capability {
        one_sided_read: true,
        one_sided_write: false,
        vram: false,
        cross_process,
        max_reads_per_post: None,
    };
    for family in [
        Family::Checks,
        Family::Fault,
        Family::Quiescence,
        Family::Counting,
    ] {
        assert_eq!(family.inapplicable(&with(false)), None, "{family:?}");
    }
    for family in [Family::CrossProcess, Family::Stall] {
        assert_eq!(family.inapplicable(&with(true)), None, "{family:?}");
        let reason = family.inapplicable(&with(false)).expect("inapplicable");
        assert!(reason.contains("cross_process = false"), "{reason}");
    }
}
