//! `abort` on a posted batch: it must stop reads that have not run, and nothing may land after it
//! returns.

use super::*;

/// A dense model of about 130 MB in bf16, the source of [`abort_stops_a_posted_batch`]: a batch
/// reading all of it stays on the wire for tens of milliseconds even within one process.
pub fn abort_model() -> reshard_planner::presets::ModelConfig {
    reshard_planner::presets::ModelConfig {
        name: "abort-dense".into(),
        layers: 1,
        vocab: 4000,
        ..crate::quiescence::large_dense()
    }
}

/// Byte the abort check's destination holds before any read lands.
const SENTINEL: u8 = 0xA5;
/// Bytes per read of the abort check.
const ABORT_READ: u64 = 256 << 10;
/// Bytes at the end of each read the quick landed-or-not probe looks at (a random source has
/// them all equal to the sentinel with probability 2^-64).
const PROBE: usize = 8;

/// Reads covering every offer of `tables`, in 256 KiB pieces, into one destination region:
/// Per offer of [`read_every_offer`]: its destination range, digest, box extent and element
/// size (what its digest is computed over).
type OfferSpans = Vec<(std::ops::Range<usize>, Option<Digest>, Vec<u64>, u64)>;

/// returns the reads and, per offer, its destination range and digest.
fn read_every_offer(tables: &[ShardTable], dst_region: u64) -> (Vec<ReadDesc>, OfferSpans) {
    let mut reads = Vec::new();
    let mut offers = Vec::new();
    let mut at = 0u64;
    for t in tables {
        for o in &t.offers {
            let spec = t
                .tensors
                .iter()
                .find(|s| s.name == o.tensor)
                .expect("offer of a declared tensor");
            let len = o.tensor_box.extent.iter().product::<u64>() * spec.dtype.size();
            let span = at as usize..(at + len) as usize;
            offers.push((
                span,
                o.digest,
                o.tensor_box.extent.clone(),
                spec.dtype.size(),
            ));
            let mut k = 0;
            while k < len {
                let n = ABORT_READ.min(len - k);
                reads.push(ReadDesc {
                    owner: t.publisher.rank,
                    remote_region: o.location.region,
                    remote_offset: o.location.offset + k,
                    local_region: dst_region,
                    local_offset: at + k,
                    len: n,
                    remote_rows: None,
                });
                k += n;
            }
            at += len;
        }
    }
    (reads, offers)
}

/// Reads of `reads` none of whose bytes landed in `dst` (every byte still the sentinel).
fn untouched(dst: &HostBuffer, reads: &[ReadDesc]) -> usize {
    let d = dst.read();
    reads
        .iter()
        .filter(|r| {
            d[r.local_offset as usize..(r.local_offset + r.len) as usize]
                .iter()
                .all(|&b| b == SENTINEL)
        })
        .count()
}

/// Reads whose last [`PROBE`] bytes still hold the sentinel (quick: a few bytes per read).
fn probably_pending(dst: &HostBuffer, reads: &[ReadDesc]) -> usize {
    let d = dst.read();
    reads
        .iter()
        .filter(|r| {
            let end = (r.local_offset + r.len) as usize;
            d[end - PROBE.min(r.len as usize)..end]
                .iter()
                .all(|&b| b == SENTINEL)
        })
        .count()
}

/// Abort cuts a posted batch short and returns once nothing touches the buffers; the prepared
/// batch still works afterwards.
///
/// The source is a cluster's publishers (in a child process for a cross-process harness); the
/// batch reads every byte they offer (~130 MB, 256 KiB reads) into a sentinel-filled
/// destination. A clean post-and-wait measures the batch's time `T`. Then each try posts, aborts
/// at once, and requires: nothing lands after `abort` returned (the destination is unchanged
/// after `max(2 T, 200 ms)`), and — the point of abort — some reads never landed at all, so
/// abort did not just wait for the whole batch. A try where `post` itself moved every byte
/// cannot show that and does not count (NOTE when every try was like that, as in the in-flight
/// safety checks); otherwise at least one try must have been cut short. Every try ends with a
/// clean transfer of the same prepared batch, checked against the publishers' digests.
pub async fn abort_stops_a_posted_batch(h: &Harness) {
    const TRIES: usize = 6;
    let cluster = h.cluster(abort_model(), "tp=2").await;
    let rx = h.endpoint("abort-dst").expect("endpoint");
    cluster.connect(rx.as_ref()).await.expect("load metadata");
    let tables = cluster.tables();
    let (probe_reads, _) = read_every_offer(&tables, 0);
    let len: u64 = probe_reads.iter().map(|r| r.len).sum();
    let dst = Arc::new(HostBuffer::zeroed(len as usize));
    let reg = rx
        .register(dst.clone() as Arc<dyn MemoryBlock>)
        .await
        .expect("register");
    let (reads, offers) = read_every_offer(&tables, reg.id());
    let n = reads.len();
    let prepared = rx
        .prepare(ReadBatch {
            reads: reads.clone(),
        })
        .await
        .expect("prepare");
    let check_exact = |ctx: &str| {
        let d = dst.read();
        for (range, digest, extent, elem) in &offers {
            if let Some(want) = digest {
                assert_eq!(
                    &reshard_core::offer_digest(&d[range.clone()], extent, *elem),
                    want,
                    "{ctx}: destination bytes {range:?} differ from the publisher's"
                );
            }
        }
    };
    let clean = |ctx: &'static str| {
        let (rx, prepared, dst) = (&rx, &prepared, &dst);
        async move {
            dst.write().fill(SENTINEL);
            let t = std::time::Instant::now();
            let report = post_and_wait(rx.as_ref(), prepared, ctx).await;
            let took = t.elapsed();
            assert_eq!(report.bytes, len, "{ctx}: bytes moved");
            took
        }
    };
    let took = clean("clean transfer")
        .await
        .min(clean("clean transfer").await);
    check_exact("clean transfer");

    let (mut cut, mut synchronous) = (0usize, 0usize);
    let mut log = Vec::new();
    for attempt in 0..TRIES {
        dst.write().fill(SENTINEL);
        let t = std::time::Instant::now();
        let inflight = rx.post(&prepared).await.expect("post");
        let pending_at_post = probably_pending(&dst, &reads);
        inflight.abort().await;
        let aborted_after = t.elapsed();
        // From here on not one byte may land.
        let before = twox_hash::XxHash3_128::oneshot(&dst.read());
        let left = untouched(&dst, &reads);
        tokio::time::sleep((took * 2).max(std::time::Duration::from_millis(200))).await;
        let after = twox_hash::XxHash3_128::oneshot(&dst.read());
        let still = untouched(&dst, &reads);
        assert!(
            before == after && left == still,
            "{}: try {attempt}: bytes landed after abort returned ({left} -> {still} of {n} \
             reads untouched; abort returned {aborted_after:?} after post, a clean batch takes \
             {took:?})",
            h.name()
        );
        log.push(format!(
            "{aborted_after:?}: {pending_at_post} pending at post, {left} of {n} never landed"
        ));
        if pending_at_post == 0 {
            synchronous += 1;
        } else if left > 0 {
            cut += 1;
        }
        // The same prepared batch moves every byte exactly again.
        clean("transfer after abort").await;
        check_exact("transfer after abort");
        if cut >= 2 {
            break;
        }
    }
    eprintln!(
        "{}: abort (clean batch {took:?}): {}",
        h.name(),
        log.join("; ")
    );
    if cut == 0 {
        if synchronous == log.len() {
            eprintln!(
                "NOTE: {} abort: every post completed the whole batch before returning; nothing \
                 was in flight to abort",
                h.name()
            );
            return;
        }
        panic!(
            "{}: abort never cut the batch short in {} tries ({synchronous} completed inside \
             post): it waits for every read instead of stopping them ({})",
            h.name(),
            log.len(),
            log.join("; ")
        );
    }
    drop(reg);
}
