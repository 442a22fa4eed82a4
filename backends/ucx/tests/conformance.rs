//! The shared conformance suite over UCX endpoints (each its own UCP context, worker and
//! progress thread), one `reshard_conformance::suite!` call per configuration: UCX's default
//! transports (every family, the publishers also in a child process), TCP only (module `tcp`),
//! and the counting family with the smallest pieces (module `small_pieces`) and with gets
//! instead of direct copies from shared memory (module `shm_gets`).

use std::sync::Arc;

use reshard_backend_ucx::{UcxOptions, UcxTransport};
use reshard_conformance::counting::{at, Counting, SkipAt, SkipRead};
use reshard_conformance::Harness;
use reshard_core::{Result, Transport};

const MIB: u64 = 1 << 20;

fn endpoint_with(agent: &str, options: UcxOptions) -> Result<Arc<dyn Transport>> {
    Ok(Arc::new(UcxTransport::new(agent, options)?) as Arc<dyn Transport>)
}

/// An endpoint with default options (UCX picks the transports).
fn endpoint(agent: &str) -> Result<Arc<dyn Transport>> {
    endpoint_with(agent, UcxOptions::default())
}

fn harness() -> Harness {
    Harness::new("ucx", endpoint)
}

/// The endpoint of the in-flight safety tests that kill or stop the publishers' process: every
/// read crosses TCP (so reads need the publisher's progress thread, and stopping it stalls
/// them), with a 2 s no-progress timeout.
fn stall_endpoint(agent: &str) -> Result<Arc<dyn Transport>> {
    endpoint_with(
        agent,
        UcxOptions {
            tls: Some("tcp".into()),
            timeout_ms: 2_000,
            ..UcxOptions::default()
        },
    )
}

/// The counting family over endpoints made with `options`, with their skip hook (the
/// `fault-injection` feature, which only this crate's dev-dependency on itself enables). Owner
/// 4 holds user memory (read with `ucp_get_nbx`), owner 9 UCX-allocated shared memory (copied
/// directly out of the segment UCX mapped here); two regions each, the first large enough that
/// a 17 MiB read is cut into two pieces. One receiver with two regions. Five reads over both
/// paths, two of them cut into pieces, of distinct lengths.
fn counting_with(options: fn() -> UcxOptions) -> Counting {
    let harness = Harness::new("ucx", move |agent| {
        Ok(Arc::new(UcxTransport::new(agent, options())?) as Arc<dyn Transport>)
    });
    let endpoint = move |agent: &str| {
        let t = Arc::new(UcxTransport::new(agent, options())?);
        let skip = t.clone();
        let skip: SkipRead = Arc::new(move |read| skip.inject_skip_read(read));
        Ok((t as Arc<dyn Transport>, skip))
    };
    Counting {
        src_lens: [[20 * MIB, MIB]; 2],
        allocated_owner: Some(9),
        dst_lens: [20 * MIB; 2],
        reads: vec![
            at(0, 100, 0, 0, 17 * MIB),
            at(1, 0, 0, 18 * MIB, 3000),
            at(2, 7, 1, 0, 17 * MIB + 5),
            at(3, 20_000, 1, 18 * MIB, 7000),
            at(1, 30_000, 1, 19 * MIB, 11_000),
        ],
        // Reads of owner 9's shared memory, copied directly and hashed block by block as they
        // land: each under one piece (64 KiB at the smallest `piece_bytes`) and the copy pool's
        // 4 MiB split, so one hasher sees all of it; the default pieces' reads span several
        // 256 KiB blocks, with segments across block boundaries. Gets hash nothing.
        hashed_reads: options().shm_fast_path.then(|| {
            if options().piece_bytes >= 4 * MIB {
                vec![
                    at(2, 7, 1, 0, 3 * MIB + 5),
                    at(3, 20_000, 1, 8 * MIB, 700_000),
                ]
            } else {
                vec![at(2, 7, 1, 0, 60_000), at(3, 20_000, 1, 8 * MIB, 40_000)]
            }
        }),
        ..Counting::new(harness, endpoint, SkipAt::Post)
    }
}

reshard_conformance::suite! {
    harness = harness(),
    requires = reshard_backend_ucx::probe(),
    counting = counting_with(UcxOptions::default),
    cross_process = endpoint,
    stall = stall_endpoint,
}

/// The checks and the quiescence family again with `tls = "tcp"`: RMA reads emulated over TCP,
/// which needs the publisher's progress thread to answer them. The other families run in the
/// default configuration above (the stall family over TCP already).
mod tcp {
    use super::*;

    fn harness() -> Harness {
        Harness::new("ucx", |agent| {
            endpoint_with(
                agent,
                UcxOptions {
                    tls: Some("tcp".into()),
                    ..UcxOptions::default()
                },
            )
        })
    }

    reshard_conformance::suite! {
        harness = harness(),
        requires = reshard_backend_ucx::probe(),
        families = [checks, quiescence],
    }
}

/// The counting family again with the smallest `piece_bytes` (64 KiB): every read longer than
/// that is cut into many gets (a 17 MiB read into 272), and each read is still counted, logged
/// and landed once, whole.
mod small_pieces {
    use super::*;

    fn options() -> UcxOptions {
        UcxOptions {
            piece_bytes: reshard_backend_ucx::MIN_PIECE_BYTES,
            ..UcxOptions::default()
        }
    }

    reshard_conformance::suite! {
        requires = reshard_backend_ucx::probe(),
        counting = counting_with(options),
        families = [counting],
    }
}

/// The counting family again with the shared-memory fast path off: owner 9's UCX-allocated
/// shared memory is read with `ucp_get_nbx` over UCX's shared-memory transports instead of
/// copied directly, so every read, gathers row by row included, takes the get path on both
/// owners.
mod shm_gets {
    use super::*;

    fn options() -> UcxOptions {
        UcxOptions {
            shm_fast_path: false,
            ..UcxOptions::default()
        }
    }

    reshard_conformance::suite! {
        requires = reshard_backend_ucx::probe(),
        counting = counting_with(options),
        families = [counting],
    }
}
