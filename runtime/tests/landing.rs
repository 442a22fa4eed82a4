//! Verification as the bytes land, over the loopback backend: a digest check never runs before
//! every read into its buffer has been reported complete, and checks do run while other reads
//! are still on the wire (docs/in-flight-safety.md, "Completions as they happen").

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
use reshard_core::{
    CompletionSink, HostBuffer, InFlight, MemoryBlock, PreparedBatch, Registration, Result,
    Transport, WireReport,
};
use reshard_planner::layouts::receiver_layout;
use reshard_planner::topology::ReceiverTopology;
use reshard_runtime::{Receiver, ReceiverOptions};
use reshard_testkit::SyntheticCluster;

/// How long the held read stays corrupted and unreported while every other read has been
/// reported: the receiver's verifier has this long to (wrongly) check its buffer. A delay
/// that makes a bug show, not a timed assertion: correct code passes however long it is.
const HOLD: Duration = Duration::from_millis(500);

/// A receiver endpoint that, when armed with the landing bank's buffers, takes the report of
/// the first read into one of them, overwrites that read's bytes with garbage (as if they had
/// not landed yet), reports every other read, waits [`HOLD`], then puts the bytes back and
/// reports it last. A receiver that verified a buffer before all its reads were reported
/// would hash the garbage and fail the update.
#[derive(Debug)]
struct HoldBack {
    inner: Arc<dyn Transport>,
    /// Registered blocks by region id: their addresses.
    regions: Mutex<HashMap<u64, usize>>,
    /// The landing bank's buffers by address, when armed.
    armed: Mutex<HashMap<usize, Arc<HostBuffer>>>,
}

/// The wrapper's batch: the inner one, and the thread forwarding its reports.
struct Held {
    inner: Box<dyn InFlight>,
    forwarder: Option<std::thread::JoinHandle<()>>,
}

#[async_trait::async_trait]
impl InFlight for Held {
    async fn wait(mut self: Box<Self>) -> Result<WireReport> {
        let r = self.inner.wait().await;
        // Every report is forwarded before this batch's wait returns (the contract).
        if let Some(f) = self.forwarder.take() {
            f.join().expect("forwarder");
        }
        r
    }

    async fn abort(mut self: Box<Self>) {
        self.inner.abort().await;
        if let Some(f) = self.forwarder.take() {
            f.join().expect("forwarder");
        }
    }
}

reshard_core::forward_transport!(HoldBack => inner {
    async fn register(&self, block: Arc<dyn MemoryBlock>) -> Result<Registration> {
        let addr = block.addr();
        let reg = self.inner.register(block).await?;
        self.regions.lock().unwrap().insert(reg.id(), addr);
        Ok(reg)
    }

    async fn post_reporting(
        &self,
        batch: &PreparedBatch,
        sink: CompletionSink,
    ) -> Result<Box<dyn InFlight>> {
        let armed = self.armed.lock().unwrap().clone();
        if armed.is_empty() {
            return self.inner.post_reporting(batch, sink).await;
        }
        let regions = self.regions.lock().unwrap().clone();
        let reads = batch.batch().clone();
        // Held back: the last read (in batch order) into the parameter of the landing bank
        // that the most reads write, so the others into it complete while it is held.
        let into = |r: &reshard_core::ReadDesc| {
            let addr = regions.get(&r.local_region)?;
            armed.get(addr).map(|b| (*addr, b.clone()))
        };
        let mut per_buf: HashMap<usize, usize> = HashMap::new();
        for r in &reads.reads {
            if let Some((addr, _)) = into(r) {
                *per_buf.entry(addr).or_default() += 1;
            }
        }
        let busiest = per_buf.iter().max_by_key(|(a, n)| (**n, **a)).map(|(a, _)| *a);
        let (held, buf) = reads
            .reads
            .iter()
            .enumerate()
            .rev()
            .find_map(|(i, r)| into(r).filter(|(a, _)| Some(*a) == busiest).map(|(_, b)| (i, b)))
            .expect("a read into the landing bank");
        assert!(per_buf[&buf.addr()] >= 2, "the held read's parameter has other reads");
        let (tx, rx) = mpsc::channel::<usize>();
        let inner = self
            .inner
            .post_reporting(batch, CompletionSink::new(move |i| {
                let _ = tx.send(i);
            }))
            .await?;
        let n = reads.reads.len();
        let forwarder = std::thread::spawn(move || {
            let r = reads.reads[held];
            let range = r.local_offset as usize..(r.local_offset + r.len) as usize;
            let mut saved = None;
            let mut seen = 0;
            while seen < n {
                let Ok(i) = rx.recv() else { break };
                seen += 1;
                if i == held {
                    let mut b = buf.write();
                    saved = Some(b[range.clone()].to_vec());
                    b[range.clone()].fill(0xEE);
                } else {
                    sink.complete(i);
                }
            }
            if let Some(bytes) = saved {
                std::thread::sleep(HOLD);
                buf.write()[range].copy_from_slice(&bytes);
                sink.complete(held);
            }
        });
        Ok(Box::new(Held {
            inner,
            forwarder: Some(forwarder),
        }))
    }
});

/// Publishers of `model` under `topology` over loopback, and a TP2 receiver of rank 0 behind a
/// [`HoldBack`] (disarmed), after a first verified update.
async fn held_receiver(
    model: reshard_planner::presets::ModelConfig,
    topology: &str,
) -> (SyntheticCluster, Arc<HoldBack>, Receiver) {
    let fabric = LoopbackFabric::new();
    let f = fabric.clone();
    let cluster = SyntheticCluster::new(model, topology.parse().unwrap(), 1, move |r| {
        Ok(Arc::new(LoopbackTransport::new(&f, &format!("pub-{r}"), 2)?) as _)
    })
    .await
    .expect("cluster");
    let hold = Arc::new(HoldBack {
        inner: Arc::new(LoopbackTransport::new(&fabric, "rx", 2).expect("endpoint")),
        regions: Mutex::default(),
        armed: Mutex::default(),
    });
    cluster.connect(hold.as_ref()).await.expect("connect");
    let layout = receiver_layout(cluster.model(), &ReceiverTopology::tp(2), 0).unwrap();
    let mut rx = Receiver::new(hold.clone(), layout, ReceiverOptions::default()).unwrap();
    let first = rx.update(&cluster.tables()).await.expect("first update");
    assert!(first.fully_checked());
    (cluster, hold, rx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_is_verified_only_after_every_read_into_it_was_reported() {
    let (mut cluster, hold, mut rx) =
        held_receiver(reshard_testkit::models::tiny_moe(8), "ep=4,dp=4").await;
    for step in 1..4 {
        cluster.publish_step(step);
        *hold.armed.lock().unwrap() = rx
            .landing_params()
            .expect("prepared")
            .iter()
            .map(|b| (b.addr(), b.clone()))
            .collect();
        let r = rx
            .update(&cluster.tables())
            .await
            .expect("a held read is verified only once it is reported");
        assert!(
            r.fully_checked(),
            "checked {} of {}",
            r.checked_bytes,
            r.wire_bytes
        );
        assert!(
            r.checks_while_on_wire > 0,
            "checks of the other buffers ran while the held read was on the wire"
        );
        let want = cluster.expected_params(rx.layout()).unwrap();
        for (got, want) in rx.live_params().unwrap().iter().zip(&want) {
            assert!(got.read()[..] == want[..], "step {step} byte-exact");
        }
    }
}

/// Hashing while copying: over loopback (which hashes each block right after copying it), the
/// checks fold the hashes the copy stored (`copy_hashed_bytes`) and every byte is still
/// compared with the publisher's digests; a byte corrupted in publisher memory after the
/// digests were published lands corrupted, is hashed as it landed, and fails the update with
/// the tensor named, the live weights untouched. With hashing off the same bytes are checked,
/// all hashed by the verifier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_byte_is_caught_when_the_hashes_come_from_the_copy() {
    let fabric = LoopbackFabric::new();
    let f = fabric.clone();
    let mut cluster = SyntheticCluster::new(
        reshard_testkit::models::tiny_moe(8),
        "ep=4,dp=4".parse().unwrap(),
        1,
        move |r| Ok(Arc::new(LoopbackTransport::new(&f, &format!("pub-{r}"), 2)?) as _),
    )
    .await
    .expect("cluster");
    let t: Arc<dyn Transport> = Arc::new(LoopbackTransport::new(&fabric, "rx", 2).unwrap());
    cluster.connect(t.as_ref()).await.expect("connect");
    let layout = receiver_layout(cluster.model(), &ReceiverTopology::tp(2), 0).unwrap();
    let mut rx = Receiver::new(t, layout, ReceiverOptions::default()).unwrap();
    for step in 0..3 {
        if step > 0 {
            cluster.publish_step(step);
        }
        let r = rx.update(&cluster.tables()).await.expect("update");
        assert!(r.fully_checked(), "{} of {}", r.checked_bytes, r.wire_bytes);
        assert_eq!(
            r.copy_hashed_bytes, r.checked_bytes,
            "step {step}: every segment here lies inside one piece of one read, so the copy \
             hashed all of them"
        );
        let want = cluster.expected_params(rx.layout()).unwrap();
        for (got, want) in rx.live_params().unwrap().iter().zip(&want) {
            assert!(got.read()[..] == want[..], "step {step} byte-exact");
        }
    }
    let live: Vec<Vec<u8>> = rx
        .live_params()
        .unwrap()
        .iter()
        .map(|b| b.read().to_vec())
        .collect();
    cluster.publish_step(3);
    let name = "model.layers.0.mlp.experts.1.up_proj.weight";
    cluster.corrupt(name, 777).expect("corrupt");
    let e = rx
        .update(&cluster.tables())
        .await
        .expect_err("a corrupted byte hashed as it was copied");
    assert_eq!(e.kind(), reshard_core::ErrorKind::Verification, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(name), "{e}");
    let now: Vec<Vec<u8>> = rx
        .live_params()
        .unwrap()
        .iter()
        .map(|b| b.read().to_vec())
        .collect();
    assert!(now == live, "live weights untouched");
    // Hashing off: the same checks, every byte hashed by the verifier.
    cluster.publish_step(4);
    rx.set_options(ReceiverOptions {
        hash_while_copying: false,
        ..ReceiverOptions::default()
    });
    let r = rx.update(&cluster.tables()).await.expect("update");
    assert!(r.fully_checked());
    assert_eq!(r.copy_hashed_bytes, 0);
}

/// Dense TP down (trainer TP4 with DP2, receiver TP2): the strided column blocks of several
/// trainer ranks re-slice into one receiver parameter, so the plan's re-slices are not
/// disjoint. Checks still run as the bytes land (a held read keeps one buffer on the wire while
/// the others are checked), the re-slices of each parameter run in plan order, the copy hashes
/// its blocks when nothing stands between it and the receiver, and every step installs byte
/// for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dense_tp_down_verifies_as_the_bytes_land_with_overlapping_reslices() {
    let (mut cluster, hold, mut rx) =
        held_receiver(reshard_testkit::models::tiny_dense(4), "tp=4,dp=2").await;
    let plan = rx.plan().expect("planned").clone();
    assert!(
        !plan.reslice_disjoint && !plan.reslices.is_empty(),
        "this layout re-slices several trainer blocks into one parameter"
    );
    for step in 1..5 {
        cluster.publish_step(step);
        // Steps 1-3 hold a read back (the wrapper reports through a sink of its own, so the
        // copy hashes nothing); step 4 goes straight to loopback, which hashes as it copies.
        let held = step < 4;
        *hold.armed.lock().unwrap() = if held {
            rx.landing_params()
                .expect("prepared")
                .iter()
                .map(|b| (b.addr(), b.clone()))
                .collect()
        } else {
            HashMap::new()
        };
        let r = rx.update(&cluster.tables()).await.expect("update");
        assert!(
            r.fully_checked(),
            "checked {} of {}",
            r.checked_bytes,
            r.wire_bytes
        );
        if held {
            assert!(
                r.checks_while_on_wire > 0,
                "checks of the other buffers ran while the held read was on the wire"
            );
        } else {
            assert!(r.copy_hashed_bytes > 0, "the copy hashed its blocks");
        }
        let want = cluster.expected_params(rx.layout()).unwrap();
        for (got, want) in rx.live_params().unwrap().iter().zip(&want) {
            assert!(got.read()[..] == want[..], "step {step} byte-exact");
        }
    }
}
