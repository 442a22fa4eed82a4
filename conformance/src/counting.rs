//! Counted completions, the execution log, typed unknown-peer errors and refused overlapping
//! destinations, through the public `Transport` API: the `counting` family of
//! [`crate::suite!`] (its `counting =` argument), which every backend's `tests/conformance.rs`
//! runs.
//!
//! A lost read must show up in the [`reshard_core::WireReport`] a batch's `wait` returns: a
//! backend counts completions, not what it posted. To lose one on purpose each backend has a
//! dev-only `fault-injection` feature adding `inject_skip_read(Option<usize>)` to its transport
//! type; since an `Arc<dyn Transport>` cannot be downcast, the backend's test makes endpoints
//! itself and hands the suite each one with a [`SkipRead`] hook that calls it.

use std::sync::Arc;

use reshard_core::{
    CompletionSink, ErrorKind, ExecutionLog, HashPlan, HostBuffer, MemoryBlock, OwnerId,
    PreparedBatch, ReadBatch, ReadDesc, Registration, RemoteRows, Result, SegmentFold, SegmentTask,
    Transport, WireReport,
};
use reshard_runtime::{Layer, Receiver, ReceiverOptions, WavesLayer};

use crate::fixtures::tiny_dense;
use crate::Harness;

/// Makes the endpoint it came with skip read `i` of the batches it handles (`Some(i)`), or
/// stop skipping (`None`): the backend's `inject_skip_read`.
pub type SkipRead = Arc<dyn Fn(Option<usize>) + Send + Sync>;

/// Creates an endpoint by agent name, on the same fabric as the harness's endpoints, with its
/// [`SkipRead`] hook.
pub type MakeSkippable = dyn Fn(&str) -> Result<(Arc<dyn Transport>, SkipRead)> + Send + Sync;

/// When the backend applies an injected skip.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SkipAt {
    /// When a batch is posted: a batch prepared earlier loses the read (loopback, UCX).
    Post,
    /// When a batch is prepared (NIXL builds its requests there): only a batch prepared while
    /// the skip is set loses the read, so the receiver must not reuse cached descriptors
    /// (`ReceiverOptions::cache_descriptors: false`).
    Prepare,
}

/// One read of a [`Counting::reads`] batch, by index into the setup's regions: source region
/// `src` (owner 4's two regions, then owner 9's two), offset `src_offset`, into destination
/// region `dst` (0 or 1) at `dst_offset`, `len` bytes.
#[derive(Clone, Copy, Debug)]
pub struct ReadAt {
    /// Index of the source region: 0 and 1 are owner 4's, 2 and 3 owner 9's.
    pub src: usize,
    /// Offset in the source region.
    pub src_offset: u64,
    /// Index of the destination region (0 or 1).
    pub dst: usize,
    /// Offset in the destination region.
    pub dst_offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// `ReadAt { src, src_offset, dst, dst_offset, len }`, shorter.
pub const fn at(src: usize, src_offset: u64, dst: usize, dst_offset: u64, len: u64) -> ReadAt {
    ReadAt {
        src,
        src_offset,
        dst,
        dst_offset,
        len,
    }
}

/// What a backend hands the counting checks: its harness, skippable endpoints, and the region
/// sizes and batch that exercise its own ways of cutting reads (pieces, request caps).
#[derive(Clone)]
pub struct Counting {
    /// The backend's harness (name, endpoints for clusters).
    pub harness: Harness,
    /// Endpoints with a skip hook, on the harness's fabric.
    pub endpoint: Arc<MakeSkippable>,
    /// When the backend applies the skip.
    pub skip_at: SkipAt,
    /// Lengths of the two source regions of owner 4 and of owner 9.
    pub src_lens: [[u64; 2]; 2],
    /// An owner whose source regions the transport allocates (`Transport::allocate_host`)
    /// instead of plain host buffers, to cover a second read path (UCX shared memory).
    pub allocated_owner: Option<OwnerId>,
    /// Lengths of the receiver's two destination regions.
    pub dst_lens: [u64; 2],
    /// The batch: non-overlapping destinations, distinct lengths, over every source region.
    pub reads: Vec<ReadAt>,
    /// A single read the backend cuts into pieces, whose execution log must still hold it
    /// once, whole.
    pub split_read: Option<ReadAt>,
    /// `Some(reads)` for a backend that hashes while copying (`Transport::post_reporting`,
    /// "Hashing while copying"): a batch whose reads it copies each as one piece, so that
    /// every planned segment of a read must be stored by the time the read is reported.
    /// `None`: the backend does not hash (any hash it stores must still be right).
    pub hashed_reads: Option<Vec<ReadAt>>,
}

impl Counting {
    /// Counting checks for `harness`, endpoints from `endpoint`, with skips applied at
    /// `skip_at`; the regions and batch are set with the other fields.
    pub fn new(
        harness: Harness,
        endpoint: impl Fn(&str) -> Result<(Arc<dyn Transport>, SkipRead)> + Send + Sync + 'static,
        skip_at: SkipAt,
    ) -> Self {
        Counting {
            harness,
            endpoint: Arc::new(endpoint),
            skip_at,
            src_lens: [[1 << 20; 2]; 2],
            allocated_owner: None,
            dst_lens: [1 << 20; 2],
            reads: Vec::new(),
            split_read: None,
            hashed_reads: None,
        }
    }

    /// A fresh endpoint and its skip hook.
    fn skippable(&self, agent: &str) -> (Arc<dyn Transport>, SkipRead) {
        (self.endpoint)(agent).expect("endpoint")
    }
}

/// A read descriptor: `len` bytes from `src` at `src_offset` of `owner` into `dst` at
/// `dst_offset`.
pub fn read(
    owner: OwnerId,
    src: &Registration,
    src_offset: u64,
    dst: &Registration,
    dst_offset: u64,
    len: u64,
) -> ReadDesc {
    ReadDesc {
        owner,
        remote_region: src.id(),
        remote_offset: src_offset,
        local_region: dst.id(),
        local_offset: dst_offset,
        len,
        remote_rows: None,
    }
}

/// Owners 4 and 9 with two regions each, one receiver with two regions.
struct Setup {
    _pubs: Vec<Arc<dyn Transport>>,
    receiver: Arc<dyn Transport>,
    skip: SkipRead,
    src: Vec<(OwnerId, Registration)>,
    dst_bufs: Vec<Arc<HostBuffer>>,
    dst: Vec<Registration>,
}

impl Setup {
    /// Posts `prepared` on the receiver and waits for it; both must succeed.
    async fn post_and_wait(&self, prepared: &PreparedBatch) -> WireReport {
        self.receiver
            .post(prepared)
            .await
            .expect("post")
            .wait()
            .await
            .expect("wait")
    }

    fn read(&self, r: &ReadAt) -> ReadDesc {
        let (owner, reg) = &self.src[r.src];
        read(
            *owner,
            reg,
            r.src_offset,
            &self.dst[r.dst],
            r.dst_offset,
            r.len,
        )
    }

    fn batch(&self, reads: &[ReadAt]) -> ReadBatch {
        ReadBatch {
            reads: reads.iter().map(|r| self.read(r)).collect(),
        }
    }
}

/// The bytes owner `owner`'s source region `j` holds at `offset..offset + len` (what
/// [`setup`] fills it with).
fn source_bytes(owner: OwnerId, j: usize, offset: u64, len: u64) -> Vec<u8> {
    (offset..offset + len)
        .map(|i| (i % 251) as u8 ^ (owner as u8 * 16 + j as u8))
        .collect()
}

async fn setup(c: &Counting) -> Setup {
    let (receiver, skip) = c.skippable("receiver");
    let mut pubs = Vec::new();
    let mut src = Vec::new();
    for (owner, lens) in [4u32, 9].into_iter().zip(c.src_lens) {
        let (t, _) = c.skippable(&format!("publisher-{owner}"));
        for (j, len) in lens.into_iter().enumerate() {
            let fill = source_bytes(owner, j, 0, len);
            let block: Arc<dyn MemoryBlock> = if c.allocated_owner == Some(owner) {
                let m = t
                    .allocate_host(len as usize)
                    .await
                    .unwrap()
                    .expect("the transport allocates host memory");
                m.bytes_mut().copy_from_slice(&fill);
                m
            } else {
                Arc::new(HostBuffer::from_bytes(&fill))
            };
            src.push((owner, t.register(block).await.unwrap()));
        }
        receiver
            .load_peer(owner, t.export_metadata().await.unwrap())
            .await
            .unwrap();
        pubs.push(t);
    }
    let dst_bufs: Vec<Arc<HostBuffer>> = c
        .dst_lens
        .iter()
        .map(|&len| Arc::new(HostBuffer::zeroed(len as usize)))
        .collect();
    let mut dst = Vec::new();
    for b in &dst_bufs {
        dst.push(
            receiver
                .register(b.clone() as Arc<dyn MemoryBlock>)
                .await
                .unwrap(),
        );
    }
    Setup {
        _pubs: pubs,
        receiver,
        skip,
        src,
        dst_bufs,
        dst,
    }
}

/// `wait` reports every read of the batch and its bytes; with read `i` skipped (each in turn)
/// it reports one read fewer and exactly read `i`'s bytes fewer, and read `i`'s destination
/// stays untouched; without the skip the same prepared batch reports everything again.
pub async fn wait_counts_completed_reads_and_a_skipped_read_is_missing(c: &Counting) {
    let s = setup(c).await;
    let b = s.batch(&c.reads);
    let n = b.reads.len() as u64;
    assert!(n >= 2, "the batch needs several reads");
    let prepared = s.receiver.prepare(b.clone()).await.unwrap();
    let full = s.post_and_wait(&prepared).await;
    assert_eq!((full.reads, full.bytes), (n, b.bytes()));
    for (skip, r) in b.reads.iter().enumerate() {
        let range = r.local_offset as usize..(r.local_offset + r.len) as usize;
        s.dst_bufs[c.reads[skip].dst].write()[range.clone()].fill(0);
        (s.skip)(Some(skip));
        let short = match c.skip_at {
            SkipAt::Post => s.receiver.post(&prepared).await,
            SkipAt::Prepare => {
                let p = s.receiver.prepare(b.clone()).await;
                (s.skip)(None);
                s.receiver.post(&p.unwrap()).await
            }
        };
        let short = match short {
            Ok(in_flight) => in_flight.wait().await,
            Err(e) => Err(e),
        };
        (s.skip)(None);
        let short = short.unwrap();
        assert_eq!(short.reads, n - 1, "skipped read {skip}");
        assert_eq!(short.bytes, b.bytes() - r.len, "skipped read {skip}");
        // The skipped read really did not move: its destination bytes stayed zero.
        assert!(
            s.dst_bufs[c.reads[skip].dst].read()[range]
                .iter()
                .all(|&x| x == 0),
            "skipped read {skip} moved"
        );
    }
    let again = s.post_and_wait(&prepared).await;
    assert_eq!(again, full);
}

/// What a [`CompletionSink`] of [`reads_are_reported_once_each_only_after_their_bytes_landed`]
/// saw: each report checked as it arrived, on the backend's thread.
struct Reports {
    /// Per read: the bytes its destination must hold once it is reported.
    want: Vec<(usize, std::ops::Range<usize>, Vec<u8>)>,
    dst: Vec<Arc<HostBuffer>>,
    /// Times each read was reported.
    seen: parking_lot::Mutex<Vec<u32>>,
    /// The batch has ended (its `wait` or `abort` returned): no report may come any more.
    ended: std::sync::atomic::AtomicBool,
    /// Every broken rule, described (a panic on the backend's thread would hide it).
    broken: parking_lot::Mutex<Vec<String>>,
}

impl Reports {
    fn new(s: &Setup, reads: &[ReadAt]) -> Arc<Self> {
        let want = reads
            .iter()
            .map(|r| {
                let (owner, j) = (s.src[r.src].0, r.src % 2);
                let range = r.dst_offset as usize..(r.dst_offset + r.len) as usize;
                (r.dst, range, source_bytes(owner, j, r.src_offset, r.len))
            })
            .collect();
        Arc::new(Reports {
            want,
            dst: s.dst_bufs.clone(),
            seen: parking_lot::Mutex::new(vec![0; reads.len()]),
            ended: std::sync::atomic::AtomicBool::new(false),
            broken: parking_lot::Mutex::new(Vec::new()),
        })
    }

    fn sink(self: &Arc<Self>) -> CompletionSink {
        let me = Arc::clone(self);
        CompletionSink::new(move |i| me.report(i))
    }

    fn report(&self, i: usize) {
        use std::sync::atomic::Ordering;
        let mut broken = Vec::new();
        if self.ended.load(Ordering::Acquire) {
            broken.push(format!("read {i} reported after its batch ended"));
        }
        match self.want.get(i) {
            None => broken.push(format!(
                "read {i} reported, but the batch has {}",
                self.want.len()
            )),
            Some((d, range, want)) => {
                self.seen.lock()[i] += 1;
                // Only this read's bytes are looked at: other reads may still be landing.
                if self.dst[*d].read()[range.clone()] != want[..] {
                    broken.push(format!(
                        "read {i} reported complete before all its bytes landed"
                    ));
                }
            }
        }
        self.broken.lock().extend(broken);
    }

    fn end(&self) {
        self.ended.store(true, std::sync::atomic::Ordering::Release);
    }

    fn broken(&self) -> Vec<String> {
        self.broken.lock().clone()
    }

    fn times_seen(&self) -> Vec<u32> {
        self.seen.lock().clone()
    }
}

/// The completion contract (`Transport::post_reporting`): every read of a batch is reported
/// exactly once, before `wait` returns `Ok`, each only once all its bytes are in its
/// destination (checked as the report arrives, on the backend's thread), and as many reads as
/// the `WireReport` counts; a skipped read is never reported; after `abort` returns nothing
/// more is reported, and whatever was reported had landed. Also for a read the backend cuts
/// into pieces.
pub async fn reads_are_reported_once_each_only_after_their_bytes_landed(c: &Counting) {
    let s = setup(c).await;
    let zero = |s: &Setup| s.dst_bufs.iter().for_each(|b| b.write().fill(0));
    let mut batches = vec![c.reads.clone()];
    if let Some(split) = c.split_read {
        batches.push(vec![split]);
    }
    for reads in &batches {
        let b = s.batch(reads);
        let prepared = s.receiver.prepare(b.clone()).await.unwrap();
        for round in 0..3 {
            zero(&s);
            let r = Reports::new(&s, reads);
            let report = s
                .receiver
                .post_reporting(&prepared, r.sink())
                .await
                .expect("post")
                .wait()
                .await
                .expect("wait");
            r.end();
            assert_eq!(r.broken(), Vec::<String>::new(), "round {round}");
            assert_eq!(
                r.times_seen(),
                vec![1; reads.len()],
                "every read reported exactly once before wait returned (round {round})"
            );
            assert_eq!(report.reads, reads.len() as u64);
        }
    }
    // A skipped read moves nothing and is never reported; the others are, once.
    let b = s.batch(&c.reads);
    let skip = c.reads.len() - 1;
    zero(&s);
    (s.skip)(Some(skip));
    let prepared = s.receiver.prepare(b.clone()).await.unwrap();
    let r = Reports::new(&s, &c.reads);
    let posted = s.receiver.post_reporting(&prepared, r.sink()).await;
    (s.skip)(None);
    let report = posted.expect("post").wait().await.expect("wait");
    r.end();
    assert_eq!(r.broken(), Vec::<String>::new());
    let mut want = vec![1; c.reads.len()];
    want[skip] = 0;
    assert_eq!(r.times_seen(), want, "the skipped read is not reported");
    assert_eq!(report.reads, c.reads.len() as u64 - 1);
    // Aborted at once: what was reported had landed, nothing is reported after abort returned
    // (a later batch gives a late report time to show up), and nothing twice.
    let prepared = s.receiver.prepare(b.clone()).await.unwrap();
    zero(&s);
    let r = Reports::new(&s, &c.reads);
    let flight = s
        .receiver
        .post_reporting(&prepared, r.sink())
        .await
        .expect("post");
    flight.abort().await;
    r.end();
    s.post_and_wait(&prepared).await;
    assert_eq!(r.broken(), Vec::<String>::new());
    assert!(
        r.times_seen().iter().all(|&n| n <= 1),
        "{:?}",
        r.times_seen()
    );
}

fn snapshot(rx: &Receiver) -> Vec<Vec<u8>> {
    rx.live_params()
        .unwrap()
        .iter()
        .map(|b| b.read().to_vec())
        .collect()
}

/// With digest verification off, a read the backend loses still fails the update (the
/// receiver compares counted bytes with the plan), the live weights and step stay, and the
/// next update without the fault installs the new step.
pub async fn a_lost_read_fails_the_update_without_verification_and_keeps_live_weights(
    c: &Counting,
) {
    let h = &c.harness;
    let mut cluster = h.cluster(tiny_dense(4), "tp=2").await;
    let (t, skip) = c.skippable("receiver");
    let opts = ReceiverOptions {
        verify_digests: false,
        // A skip applied at prepare needs descriptors rebuilt at every update.
        cache_descriptors: c.skip_at == SkipAt::Post,
        ..ReceiverOptions::default()
    };
    let mut rx = h.receiver_on(&cluster, t, 2, 0, opts).await;
    rx.update(&cluster.tables()).await.expect("first refit");
    let before = snapshot(&rx);
    cluster.publish_step(1).expect("publish step");
    skip(Some(0));
    let e = rx
        .update(&cluster.tables())
        .await
        .expect_err("a lost read must fail the update");
    skip(None);
    assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
    assert!(e.to_string().contains("planned"), "{e}");
    assert_eq!(snapshot(&rx), before, "live weights must be untouched");
    assert_eq!(rx.live_step(), Some(0));
    // Without the fault the next update installs step 1.
    rx.update(&cluster.tables())
        .await
        .expect("refit after the fault");
    assert_eq!(rx.live_step(), Some(1));
}

fn sorted(mut v: Vec<ReadDesc>) -> Vec<ReadDesc> {
    v.sort_unstable_by_key(|r| {
        (
            r.owner,
            r.remote_region,
            r.remote_offset,
            r.local_region,
            r.local_offset,
            r.len,
            r.remote_rows.map(|g| (g.row_bytes, g.pitch)),
        )
    });
    v
}

/// Region ids are 1, 2, ... per endpoint; the execution log records nothing while unset, the
/// reads posted (as posted, once each, even when cut into pieces) while set, and nothing once
/// unset again.
pub async fn the_execution_log_holds_the_reads_posted_with_region_ids_per_endpoint(c: &Counting) {
    let s = setup(c).await;
    // Region ids are 1, 2, ... per endpoint.
    assert_eq!(
        s.src.iter().map(|x| x.1.id()).collect::<Vec<_>>(),
        [1, 2, 1, 2]
    );
    assert_eq!(s.dst.iter().map(|r| r.id()).collect::<Vec<_>>(), [1, 2]);
    let b = s.batch(&c.reads);
    let prepared = s.receiver.prepare(b.clone()).await.unwrap();
    // Nothing is recorded while no log is set.
    s.post_and_wait(&prepared).await;
    let log = ExecutionLog::new();
    assert!(s.receiver.set_execution_log(Some(log.clone())));
    s.post_and_wait(&prepared).await;
    // Reads cut into pieces are recorded once, whole.
    assert_eq!(sorted(log.take()), sorted(b.reads.clone()));
    if let Some(split) = &c.split_read {
        // A read the backend cuts into pieces, alone: recorded once, whole.
        let big = s.batch(std::slice::from_ref(split));
        let p2 = s.receiver.prepare(big.clone()).await.unwrap();
        s.post_and_wait(&p2).await;
        assert_eq!(log.take(), big.reads);
    }
    assert!(s.receiver.set_execution_log(None));
    s.post_and_wait(&prepared).await;
    assert!(log.is_empty());
}

/// A batch naming an owner whose metadata was never loaded, next to a read of a known owner,
/// fails `prepare` with `PeerUnknown` naming that owner, its read's remote range and the
/// backend; tried next to a read of each known owner.
pub async fn unknown_peer_names_owner_range_and_backend(c: &Counting) {
    let s = setup(c).await;
    // Owner 4's first region into the first destination, owner 9's first into the second.
    for (src, dst) in [(0, 0), (2, 1)] {
        let (owner, reg) = &s.src[src];
        let e = s
            .receiver
            .prepare(ReadBatch {
                reads: vec![
                    read(*owner, reg, 0, &s.dst[dst], 0, 8),
                    read(77, reg, 40, &s.dst[dst], 8, 16),
                ],
            })
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PeerUnknown, "{e}");
        assert_eq!(e.context().owner, Some(77));
        assert_eq!(e.context().range, Some(40..56));
        assert_eq!(e.context().backend.as_deref(), Some(c.harness.name()));
    }
}

/// Destinations of one batch are disjoint (the contract): a batch two of whose reads write the
/// same local bytes fails `prepare` with `InvalidInput` naming the later read's owner, the bytes
/// both write and the backend, before any byte moves, also when the two destinations are one
/// memory registered as two regions. The same reads posted through the
/// runtime's [`WavesLayer`] (disjoint waves, one after another) land in batch order: the last
/// read of the batch wins, in either order.
pub async fn overlapping_destinations_are_refused_and_land_in_order_as_waves(c: &Counting) {
    let s = setup(c).await;
    let len = c.src_lens[0][0]
        .min(c.src_lens[0][1])
        .min(c.src_lens[1][0])
        .min(c.dst_lens[0])
        .min(c.dst_lens[1])
        .min(256 << 10);
    // Owner 4's first region and owner 9's first both into destination 0 (the same bytes);
    // owner 4's second into destination 1.
    let (a, b, other) = (&s.src[0], &s.src[2], &s.src[1]);
    let onto = |x: &(OwnerId, Registration), d: usize| read(x.0, &x.1, 0, &s.dst[d], 0, len);
    let e = s
        .receiver
        .prepare(ReadBatch {
            reads: vec![onto(a, 0), onto(other, 1), onto(b, 0)],
        })
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert_eq!(e.context().owner, Some(b.0), "{e}");
    assert_eq!(e.context().range, Some(0..len), "{e}");
    assert_eq!(e.context().backend.as_deref(), Some(c.harness.name()));
    assert!(
        s.dst_bufs.iter().all(|d| d.read().iter().all(|&x| x == 0)),
        "a refused batch moves no byte"
    );
    // One memory registered twice is one destination: reads through both regions overlap
    // by address and are refused the same way (the layer above, which knows only region ids,
    // cannot split them; the backend must not write them concurrently).
    let alias = s
        .receiver
        .register(s.dst_bufs[0].clone() as Arc<dyn MemoryBlock>)
        .await
        .expect("register the destination again");
    let e = s
        .receiver
        .prepare(ReadBatch {
            reads: vec![
                onto(a, 0),
                read(b.0, &b.1, 0, &alias, len / 2, len - len / 2),
            ],
        })
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert_eq!(e.context().owner, Some(b.0), "{e}");
    assert_eq!(e.context().range, Some(len / 2..len), "{e}");
    drop(alias);
    let waves = WavesLayer.layer(s.receiver.clone());
    let fill = |owner: OwnerId, j: u8| -> Vec<u8> {
        (0..len as usize)
            .map(|i| (i % 251) as u8 ^ (owner as u8 * 16 + j))
            .collect()
    };
    for (first, last, last_region) in [(a, b, 0u8), (b, a, 0)] {
        let prepared = waves
            .prepare(ReadBatch {
                reads: vec![onto(first, 0), onto(other, 1), onto(last, 0)],
            })
            .await
            .expect("prepared as waves");
        let report = waves
            .post(&prepared)
            .await
            .expect("post")
            .wait()
            .await
            .expect("wait");
        assert_eq!((report.reads, report.bytes), (3, 3 * len));
        assert!(
            s.dst_bufs[0].read()[..len as usize] == fill(last.0, last_region)[..],
            "the last read of the batch (owner {}) wins",
            last.0
        );
        assert!(s.dst_bufs[1].read()[..len as usize] == fill(other.0, 1)[..]);
    }
}

/// A hash plan over `reads`: per read, segments of 1000, 1, 4096 and 333 bytes in turn (so
/// many straddle any block boundary), from a small offset on, with gaps between some; slots
/// numbered in batch order. Returns the plan and, per read, its tasks.
fn segment_plan(reads: &[ReadAt]) -> (Arc<HashPlan>, Vec<Vec<SegmentTask>>) {
    const LENS: [u32; 4] = [1000, 1, 4096, 333];
    let mut per_read = Vec::new();
    let mut slot = 0u32;
    for (i, r) in reads.iter().enumerate() {
        let mut tasks = Vec::new();
        let mut at = (i as u64 * 7) % 50;
        for k in 0.. {
            let len = LENS[k % LENS.len()];
            if at + u64::from(len) > r.len {
                break;
            }
            tasks.push(SegmentTask {
                offset: at,
                len,
                slot,
            });
            slot += 1;
            // A gap after every third segment: bytes no segment covers.
            at += u64::from(len) + if k % 3 == 2 { 17 } else { 0 };
        }
        per_read.push(tasks);
    }
    let all = per_read
        .iter()
        .enumerate()
        .flat_map(|(i, t)| t.iter().map(move |t| (i, *t)))
        .collect::<Vec<_>>();
    (
        Arc::new(HashPlan::new(reads.len(), slot as usize, all)),
        per_read,
    )
}

/// Hashing while copying (`Transport::post_reporting` with a sink carrying a [`HashPlan`]):
/// every hash a backend stores is XXH3-64 of its segment's bytes as they landed in the
/// destination (which held other bytes before the post), in the segment's own slot, so the
/// stored hashes of a read fold ([`SegmentFold`]) to the fold of its landed bytes; hashes of
/// an earlier post never count for a later one. For a backend that hashes
/// ([`Counting::hashed_reads`]), every planned segment of a read is stored by the time the
/// read is reported (checked on the backend's thread, as the report arrives).
pub async fn copy_hashes_are_the_landed_bytes_and_stored_before_the_report(c: &Counting) {
    let s = setup(c).await;
    let mut batches = vec![(c.reads.clone(), false)];
    if let Some(split) = c.split_read {
        batches.push((vec![split], false));
    }
    if let Some(reads) = &c.hashed_reads {
        batches.push((reads.clone(), true));
    }
    for (reads, strict) in &batches {
        let (plan, tasks) = segment_plan(reads);
        let tasks = Arc::new(tasks);
        let prepared = s.receiver.prepare(s.batch(reads)).await.unwrap();
        for round in 0..3u8 {
            // Bytes that are not the source's: a hash taken before the copy is wrong.
            s.dst_bufs.iter().for_each(|b| b.write().fill(0xA5 ^ round));
            plan.begin();
            let missing = Arc::new(parking_lot::Mutex::new(Vec::<String>::new()));
            let sink = {
                let (p, tasks, missing) = (plan.clone(), tasks.clone(), missing.clone());
                let strict = *strict;
                CompletionSink::new(move |i| {
                    let Some(t) = tasks.get(i) else { return };
                    let unstored = t
                        .iter()
                        .filter(|t| p.hash(t.slot as usize, u64::from(t.len)).is_none())
                        .count();
                    if strict && unstored > 0 {
                        missing.lock().push(format!(
                            "read {i} reported with {unstored} of its {} segment hashes not stored",
                            t.len()
                        ));
                    }
                })
                .with_hashes(plan.clone())
            };
            let report = s
                .receiver
                .post_reporting(&prepared, sink)
                .await
                .expect("post")
                .wait()
                .await
                .expect("wait");
            assert_eq!(report.reads, reads.len() as u64);
            assert_eq!(*missing.lock(), Vec::<String>::new(), "round {round}");
            let mut stored_bytes = 0u64;
            for (i, (r, t)) in reads.iter().zip(tasks.iter()).enumerate() {
                let landed = s.dst_bufs[r.dst].read();
                let landed = &landed[r.dst_offset as usize..(r.dst_offset + r.len) as usize];
                let (owner, j) = (s.src[r.src].0, r.src % 2);
                assert_eq!(
                    landed,
                    &source_bytes(owner, j, r.src_offset, r.len)[..],
                    "read {i} landed"
                );
                let (mut from_bytes, mut from_hashes) = (SegmentFold::new(), SegmentFold::new());
                let mut all = true;
                for t in t {
                    let seg = &landed[t.offset as usize..(t.offset + u64::from(t.len)) as usize];
                    from_bytes.segment(seg);
                    match plan.hash(t.slot as usize, u64::from(t.len)) {
                        Some(h) => {
                            assert_eq!(
                                h,
                                twox_hash::XxHash3_64::oneshot(seg),
                                "round {round}: the hash in slot {} (read {i}, {} bytes at \
                                 {}) is not the hash of the bytes that landed there",
                                t.slot,
                                t.len,
                                t.offset
                            );
                            from_hashes.segment_hash(h);
                            stored_bytes += u64::from(t.len);
                        }
                        None => all = false,
                    }
                }
                if all {
                    assert_eq!(from_hashes.part(), from_bytes.part(), "read {i}");
                }
                assert!(!strict || all, "read {i}: every segment stored");
            }
            if *strict {
                let planned: u64 = tasks.iter().flatten().map(|t| u64::from(t.len)).sum();
                assert_eq!(stored_bytes, planned, "round {round}");
                assert!(planned > 0);
            }
        }
        // Without a hash plan the same batch stores nothing: hashes of the last post stop
        // counting at the next `begin`.
        plan.begin();
        s.post_and_wait(&prepared).await;
        assert!(
            tasks
                .iter()
                .flatten()
                .all(|t| plan.hash(t.slot as usize, u64::from(t.len)).is_none()),
            "a post without a hash plan stored hashes"
        );
    }
}

/// One gather read of [`gather_reads_land_their_rows_in_order_and_hash_what_landed`]: source
/// region `src` (as in [`ReadAt`]), first row at `src_offset`, `rows` rows of `row` bytes at
/// `pitch`, landing in destination `dst` from `dst_offset`.
#[derive(Clone, Copy, Debug)]
struct GatherAt {
    src: usize,
    src_offset: u64,
    row: u64,
    pitch: u64,
    rows: u64,
    dst: usize,
    dst_offset: u64,
}

impl GatherAt {
    fn desc(&self, s: &Setup) -> ReadDesc {
        let (owner, reg) = &s.src[self.src];
        ReadDesc {
            remote_rows: (self.pitch != 0).then_some(RemoteRows {
                row_bytes: self.row,
                pitch: self.pitch,
            }),
            ..read(
                *owner,
                reg,
                self.src_offset,
                &s.dst[self.dst],
                self.dst_offset,
                self.row * self.rows,
            )
        }
    }

    /// The bytes the read must land: its rows of the source, one after another.
    fn expected(&self, s: &Setup) -> Vec<u8> {
        let (owner, j) = (s.src[self.src].0, self.src % 2);
        let pitch = if self.pitch == 0 {
            self.row
        } else {
            self.pitch
        };
        (0..self.rows)
            .flat_map(|i| source_bytes(owner, j, self.src_offset + i * pitch, self.row))
            .collect()
    }
}

/// Gather reads ([`reshard_core::RemoteRows`]: rows at a pitch at the source, landing one after
/// another): narrow rows (a TP column block), thousands of rows, rows as long as the pitch
/// (contiguous), rows long enough for a backend to cut them into pieces, a single row, and a
/// plain read beside them, over both owners (both of a backend's read paths). Each lands its
/// rows in order, byte-exact, and is reported only once they all landed; `wait` counts the
/// bytes moved (not the source bytes spanned); any hash a backend stores while copying is the
/// hash of the bytes that landed; the execution log holds the gathers as posted; a gather whose
/// last row passes its region's end is refused at `prepare` with `OutOfBounds` naming its
/// owner and its whole source span, before any byte moves.
pub async fn gather_reads_land_their_rows_in_order_and_hash_what_landed(c: &Counting) {
    let s = setup(c).await;
    let g = |src, src_offset, row, pitch, rows, dst, dst_offset| GatherAt {
        src,
        src_offset,
        row,
        pitch,
        rows,
        dst,
        dst_offset,
    };
    let gathers = [
        // Half of each 1536-byte row: a TP2 column block of a bf16 [300, 768] matrix.
        g(0, 0, 768, 1536, 300, 0, 0),
        // Thousands of narrow rows, from an odd offset.
        g(3, 12, 24, 40, 3000, 1, 1000),
        // Rows as long as the pitch: one contiguous run written as a gather.
        g(1, 5000, 64, 64, 100, 1, 300_000),
        // Two rows of 400 kB: long enough for a backend to cut each into pieces.
        g(2, 0, 400_000, 600_000, 2, 0, 240_000),
        // A plain read beside them (`pitch` 0: no `remote_rows`).
        g(2, 777, 50_000, 0, 1, 1, 200_000),
        // One row.
        g(1, 100, 4096, 8192, 1, 1, 400_000),
    ];
    let batch = ReadBatch {
        reads: gathers.iter().map(|x| x.desc(&s)).collect(),
    };
    let expected: Vec<Vec<u8>> = gathers.iter().map(|x| x.expected(&s)).collect();
    let prepared = s.receiver.prepare(batch.clone()).await.expect("prepare");
    let log = ExecutionLog::new();
    assert!(s.receiver.set_execution_log(Some(log.clone())));
    // Segments over each read's landed bytes, as the receiver plans them: 768 bytes each.
    let mut tasks = Vec::new();
    let mut slot = 0u32;
    for (i, x) in gathers.iter().enumerate() {
        let len = x.row * x.rows;
        for k in 0..(len / 768).min(200) {
            tasks.push((
                i,
                SegmentTask {
                    offset: k * 768,
                    len: 768,
                    slot,
                },
            ));
            slot += 1;
        }
    }
    let plan = Arc::new(HashPlan::new(gathers.len(), slot as usize, tasks.clone()));
    for round in 0..2u8 {
        s.dst_bufs.iter().for_each(|b| b.write().fill(0x5A ^ round));
        plan.begin();
        let broken = Arc::new(parking_lot::Mutex::new(Vec::<String>::new()));
        let sink = {
            let (dst, broken) = (s.dst_bufs.clone(), broken.clone());
            let at: Vec<_> = gathers.iter().map(|x| (x.dst, x.dst_offset)).collect();
            let expected = expected.clone();
            CompletionSink::new(move |i| {
                let (d, off) = at[i];
                let landed = dst[d].read();
                let landed = &landed[off as usize..off as usize + expected[i].len()];
                if landed != &expected[i][..] {
                    broken
                        .lock()
                        .push(format!("read {i} reported before its rows landed"));
                }
            })
            .with_hashes(plan.clone())
        };
        let report = s
            .receiver
            .post_reporting(&prepared, sink)
            .await
            .expect("post")
            .wait()
            .await
            .expect("wait");
        assert_eq!(*broken.lock(), Vec::<String>::new(), "round {round}");
        assert_eq!(
            (report.reads, report.bytes),
            (gathers.len() as u64, batch.bytes()),
            "round {round}: wait counts the bytes moved"
        );
        for (i, x) in gathers.iter().enumerate() {
            let landed = s.dst_bufs[x.dst].read();
            let at = x.dst_offset as usize;
            let landed = &landed[at..at + expected[i].len()];
            assert!(
                landed == &expected[i][..],
                "round {round}: gather {i} ({x:?}) did not land its rows in order (first \
                 differing byte {:?})",
                landed.iter().zip(&expected[i]).position(|(a, b)| a != b)
            );
            for (_, t) in tasks.iter().filter(|(r, _)| *r == i) {
                let seg = &landed[t.offset as usize..(t.offset + u64::from(t.len)) as usize];
                if let Some(h) = plan.hash(t.slot as usize, u64::from(t.len)) {
                    assert_eq!(
                        h,
                        twox_hash::XxHash3_64::oneshot(seg),
                        "round {round}: gather {i}: the hash of {} bytes at {} is not the \
                         hash of what landed there",
                        t.len,
                        t.offset
                    );
                }
            }
        }
        assert_eq!(
            sorted(log.take()),
            sorted(batch.reads.clone()),
            "round {round}: the execution log holds the gathers as posted"
        );
    }
    assert!(s.receiver.set_execution_log(None));
    // Three rows of 4 KiB at a pitch that puts the last row past owner 4's first region:
    // refused whole, naming the source span, though its 12 KiB would fit from its offset.
    let len0 = c.src_lens[0][0];
    let over = g(0, 4096, 4096, len0 / 2, 3, 0, 0);
    let e = s
        .receiver
        .prepare(ReadBatch {
            reads: vec![over.desc(&s)],
        })
        .await
        .expect_err("a gather past its region's end");
    assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    assert_eq!(e.context().owner, Some(4), "{e}");
    assert_eq!(e.context().range, Some(4096..4096 + len0 + 4096), "{e}");
    assert_eq!(e.context().backend.as_deref(), Some(c.harness.name()));
}
