//! Lanes (`[backends.nixl] lanes`): several NIXL agents per endpoint, a batch's requests spread
//! over them. What each lane moved is read from what its own NIXL agent reported complete
//! (`NixlTransport::lane_stats`), never from the batch. The in-flight, abort and quiescence
//! families run with several lanes in `conformance.rs` (`mod lanes`).

use reshard_backend_nixl::{probe, NixlOptions, NixlTransport, SCHEME};
use reshard_core::{
    CompletionSink, ErrorKind, HostBuffer, MemoryBlock, ReadBatch, ReadDesc, Registration,
    Transport,
};
use std::sync::{Arc, Mutex};

const MIB: u64 = 1 << 20;

fn available() -> bool {
    reshard_conformance::backend_available(SCHEME, probe())
}

fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 31 + salt as usize * 7) % 251) as u8)
        .collect()
}

async fn register(t: &NixlTransport, b: &Arc<HostBuffer>) -> Registration {
    t.register(Arc::clone(b) as Arc<dyn MemoryBlock>)
        .await
        .expect("register")
}

fn lanes(n: usize) -> NixlOptions {
    NixlOptions {
        lanes: n,
        experimental_lanes: true,
        request_bytes: MIB,
        ..NixlOptions::default()
    }
}

/// Two owners, a receiver with three lanes and 1 MiB requests: 26 reads (some split over
/// requests, some sharing one) land byte-exact at every step, every lane's agent completes
/// requests, the lanes together complete exactly the batch's bytes, and no lane carries more
/// than one request's worth above another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_spread_over_the_lanes_and_each_lane_completes_its_share() {
    if !available() {
        return;
    }
    let pubs = [
        NixlTransport::new("lanes-src-0", &NixlOptions::default()).unwrap(),
        NixlTransport::new("lanes-src-1", &NixlOptions::default()).unwrap(),
    ];
    let rx = NixlTransport::new("lanes-dst", &lanes(3)).unwrap();
    assert_eq!(rx.lanes(), 3);
    let len = 8 * MIB as usize;
    let srcs: Vec<Arc<HostBuffer>> = (0..2)
        .map(|i| Arc::new(HostBuffer::from_bytes(&pattern(len, i))))
        .collect();
    let mut regs = Vec::new();
    for (i, (p, s)) in pubs.iter().zip(&srcs).enumerate() {
        regs.push(register(p, s).await);
        rx.load_peer(i as u32, p.export_metadata().await.unwrap())
            .await
            .unwrap();
    }
    let dst = Arc::new(HostBuffer::zeroed(2 * len));
    let rd = register(&rx, &dst).await;
    // Per owner: two 2.5 MiB reads (split over requests), then 3 MiB in 12 small reads
    // (sharing requests).
    let mut reads = Vec::new();
    for (k, r) in regs.iter().enumerate() {
        let mut at = 0u64;
        let mut lens = vec![5 * MIB / 2, 5 * MIB / 2];
        lens.extend(std::iter::repeat_n(MIB / 4, 12));
        for l in lens {
            reads.push(ReadDesc {
                owner: k as u32,
                remote_region: r.id(),
                remote_offset: at,
                local_region: rd.id(),
                local_offset: k as u64 * len as u64 + at,
                len: l,
                remote_rows: None,
            });
            at += l;
        }
    }
    let total: u64 = reads.iter().map(|r| r.len).sum();
    let n_reads = reads.len();
    let prepared = rx.prepare(ReadBatch { reads }).await.expect("prepare");
    let stats = NixlTransport::prepared_stats(&prepared).unwrap();
    assert_eq!(stats.lanes, 3, "requests on every lane: {stats:?}");
    let steps = 4u8;
    for step in 0..steps {
        for (i, s) in srcs.iter().enumerate() {
            s.write().copy_from_slice(&pattern(len, step * 5 + i as u8));
        }
        dst.write().fill(0);
        // Every read is reported once, by whichever lane landed its last byte.
        let seen = Arc::new(Mutex::new(vec![0u32; n_reads]));
        let sink = {
            let seen = Arc::clone(&seen);
            CompletionSink::new(move |i| seen.lock().unwrap()[i] += 1)
        };
        let report = rx
            .post_reporting(&prepared, sink)
            .await
            .unwrap()
            .wait()
            .await
            .expect("wait");
        assert_eq!((report.reads, report.bytes), (n_reads as u64, total));
        assert!(seen.lock().unwrap().iter().all(|&n| n == 1), "step {step}");
        let got = dst.read();
        for i in 0..2 {
            let want = pattern(len, step * 5 + i as u8);
            let used = (total / 2) as usize;
            assert!(
                got[i * len..i * len + used] == want[..used],
                "step {step}, owner {i}"
            );
        }
    }
    let per_lane = rx.lane_stats();
    assert_eq!(per_lane.len(), 3);
    let bytes: Vec<u64> = per_lane.iter().map(|l| l.bytes).collect();
    assert!(
        per_lane.iter().all(|l| l.requests > 0 && l.bytes > 0),
        "every lane's agent completed requests: {per_lane:?}"
    );
    assert_eq!(
        bytes.iter().sum::<u64>(),
        total * u64::from(steps),
        "the lanes moved the batch, once per step: {per_lane:?}"
    );
    let (lo, hi) = (bytes.iter().min().unwrap(), bytes.iter().max().unwrap());
    assert!(
        hi - lo <= MIB * u64::from(steps),
        "lanes within one request of each other per step: {per_lane:?}"
    );
    // The publishers' single lanes moved nothing: they only serve reads.
    assert!(pubs.iter().all(|p| p.lane_stats()[0].bytes == 0));
}

/// One lane carries everything: with the default (or `lanes = 1`) the first lane's agent
/// completes every request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_lane_completes_every_request() {
    if !available() {
        return;
    }
    let p = NixlTransport::new("one-lane-src", &NixlOptions::default()).unwrap();
    let rx = NixlTransport::new("one-lane-dst", &lanes(1)).unwrap();
    let src = Arc::new(HostBuffer::from_bytes(&pattern(3 * MIB as usize, 9)));
    let s = register(&p, &src).await;
    rx.load_peer(0, p.export_metadata().await.unwrap())
        .await
        .unwrap();
    let dst = Arc::new(HostBuffer::zeroed(3 * MIB as usize));
    let d = register(&rx, &dst).await;
    let batch = ReadBatch {
        reads: vec![ReadDesc {
            owner: 0,
            remote_region: s.id(),
            remote_offset: 0,
            local_region: d.id(),
            local_offset: 0,
            len: 3 * MIB,
            remote_rows: None,
        }],
    };
    let prepared = rx.prepare(batch).await.unwrap();
    rx.post(&prepared).await.unwrap().wait().await.unwrap();
    assert!(dst.read()[..] == src.read()[..]);
    let per_lane = rx.lane_stats();
    assert_eq!(per_lane.len(), 1);
    assert_eq!((per_lane[0].requests, per_lane[0].bytes), (3, 3 * MIB));
}

#[test]
fn lanes_outside_one_to_sixteen_are_a_config_error() {
    if !available() {
        return;
    }
    for n in [0, 17] {
        let e = NixlTransport::new("bad-lanes", &lanes(n)).expect_err("refused");
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert!(e.message().contains("lanes"), "{e}");
    }
}

/// More than one lane is refused unless `experimental_lanes` is set: they can stall a
/// cross-process refit (README, "Lanes"; issue 42 item 6), so a `Config` error says why and how
/// to run them anyway.
#[test]
fn more_than_one_lane_is_refused_without_the_experimental_flag() {
    let options = NixlOptions {
        lanes: 2,
        ..NixlOptions::default()
    };
    let e = match NixlTransport::new("lanes-refused", &options) {
        Ok(_) => panic!("two lanes accepted without experimental_lanes"),
        Err(e) => e,
    };
    assert_eq!(e.kind(), reshard_core::ErrorKind::Config, "{e}");
    assert!(e.message().contains("experimental_lanes"), "{e}");
    assert!(NixlTransport::new("lanes-accepted", &lanes(2)).is_ok());
}
