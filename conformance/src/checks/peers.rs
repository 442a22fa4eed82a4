//! Catalogue rows about peers: offers outside registered memory, a publisher never loaded,
//! peer metadata replaced under the same name or rank.

use super::*;

/// Catalogue row "offer outside the registered region": an offer whose box is valid but whose
/// bytes lie beyond the publisher's registered memory is `OutOfBounds` naming the owner, the
/// byte range (in the owner's region) and the backend; the live weights stay at the previous
/// step.
pub async fn offer_outside_the_registered_region(h: &Harness) {
    let (cluster, mut rx, reference) = refit_then_advance(h, tiny_moe(), "ep=2,dp=2", 0).await;
    let mut tables = cluster.tables();
    let far = 1u64 << 40;
    let mut holders = Vec::new();
    for t in tables.iter_mut() {
        for o in t
            .offers
            .iter_mut()
            .filter(|o| o.tensor == "model.norm.weight")
        {
            o.location.offset = far;
            holders.push(t.publisher.rank);
        }
    }
    assert!(!holders.is_empty(), "someone offers the norm");
    let e = rx.update(&tables).await.expect_err("out of bounds");
    assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    let owner = e.context().owner.expect("names the owner");
    assert!(
        holders.contains(&owner),
        "owner {owner} holds no moved offer: {e}"
    );
    let range = e.context().range.clone().expect("names the byte range");
    assert!(range.start >= far, "{range:?}: {e}");
    assert_eq!(e.context().backend.as_deref(), Some(h.name()), "{e}");
    assert_kept(&rx, &reference, 0, "offer outside the registered region");
}

/// Catalogue row "publisher whose metadata was never loaded": a table under a rank whose
/// transport metadata the receiver never loaded is `PeerUnknown` naming that owner and a byte
/// range of one of its offers; the live weights stay at the previous step.
pub async fn publisher_whose_metadata_was_never_loaded(h: &Harness) {
    let (cluster, mut rx, reference) = refit_then_advance(h, tiny_moe(), "ep=2,dp=2", 0).await;
    let mut tables = cluster.tables();
    let mut ranges = Vec::new();
    for t in tables.iter_mut().filter(|t| t.publisher.rank == 1) {
        t.publisher.rank = 5;
        for o in &t.offers {
            let spec = t.tensors.iter().find(|s| s.name == o.tensor).expect("spec");
            let len = o.tensor_box.extent.iter().product::<u64>() * spec.dtype.size();
            ranges.push(o.location.offset..o.location.offset + len);
        }
    }
    let e = rx.update(&tables).await.expect_err("rank 5 is unknown");
    assert_eq!(e.kind(), ErrorKind::PeerUnknown, "{e}");
    assert_eq!(e.context().owner, Some(5), "{e}");
    let range = e
        .context()
        .range
        .clone()
        .unwrap_or_else(|| panic!("names no byte range: {e}"));
    assert!(
        !range.is_empty()
            && ranges
                .iter()
                .any(|r| r.start < range.end && range.start < r.end),
        "{range:?} is not a byte range of the unknown rank's offers: {e}"
    );
    assert_kept(&rx, &reference, 0, "publisher never loaded");
}

/// Catalogue row "peer metadata changed for the same name": the publishers restart under their
/// agent names with new memory and the same table geometry (a new cluster; in a new process for
/// a cross-process harness). Until their metadata is loaded the refit fails with `Transport`
/// naming an owner and keeps the previous step; after `load_peer` the epoch has moved,
/// descriptors are rebuilt, the plan is kept and the refit is byte-exact.
pub async fn peer_metadata_changed_for_the_same_name(h: &Harness) {
    let first = h.cluster(tiny_moe(), "ep=2,dp=2").await;
    let mut rx = h.receiver(&first, 2, 0).await;
    rx.update(&first.tables()).await.expect("refit");
    let reference = first.expected_params(rx.layout()).expect("reference");
    let geometry = |tables: Vec<ShardTable>| -> Vec<(u32, String, u64, u64)> {
        tables
            .into_iter()
            .flat_map(|t| {
                let rank = t.publisher.rank;
                t.offers
                    .into_iter()
                    .map(move |o| (rank, o.tensor, o.location.region, o.location.offset))
            })
            .collect()
    };
    let first_geometry = geometry(first.tables());
    drop(first);
    let mut second = h.cluster(tiny_moe(), "ep=2,dp=2").await;
    second.publish_step(1).expect("publish step");
    let e = rx
        .update(&second.tables())
        .await
        .expect_err("the old metadata reaches nothing");
    // The catalogue promises a transport failure: the backend must notice the old peer is gone
    // (a wire error, or its no-progress timer), never read whatever the old metadata still
    // reaches (that is caught by digests only when they are on).
    assert!(
        matches!(e.kind(), ErrorKind::Transport | ErrorKind::Timeout),
        "{}: a read through the departed peer's metadata must fail on the wire, got: {e}",
        h.name()
    );
    let owner = e.context().owner.expect("names the owner");
    assert!(
        second.tables().iter().any(|t| t.publisher.rank == owner),
        "{e}"
    );
    assert_kept(&rx, &reference, 0, "peer restarted, metadata not loaded");

    let epoch = rx.transport().epoch();
    second
        .connect(rx.transport().as_ref())
        .await
        .expect("load the new metadata");
    assert_ne!(
        rx.transport().epoch(),
        epoch,
        "new peer metadata moves the epoch"
    );
    let r = rx.update(&second.tables()).await.expect("refit");
    assert!(
        r.descriptors_rebuilt,
        "new peer metadata must rebuild descriptors"
    );
    // The plan is kept when the restarted publishers' offers sit where the old ones did (a
    // backend whose region ids are not reproducible legitimately re-plans).
    // A quarantining failure (bytes may still land) makes the receiver drop its buffers and
    // re-plan, which is correct too.
    if geometry(second.tables()) == first_geometry && !e.is_quarantined() {
        assert!(!r.plan_rebuilt, "the geometry did not change");
    }
    assert_installed(&second, &rx);
}

/// One hand-made publisher: tensor `w`, `[8, 8]` u8, in its own registered region.
struct OnePublisher {
    transport: Arc<dyn Transport>,
    region: u64,
    _registration: reshard_core::Registration,
    bytes: Vec<u8>,
}

async fn one_publisher(h: &Harness, agent: &str, seed: u8) -> OnePublisher {
    let transport = h.endpoint(agent).expect("endpoint");
    let bytes: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(seed) ^ seed).collect();
    let buf = Arc::new(HostBuffer::from_bytes(&bytes));
    let registration = transport
        .register(buf as Arc<dyn MemoryBlock>)
        .await
        .expect("register");
    OnePublisher {
        region: registration.id(),
        transport,
        _registration: registration,
        bytes,
    }
}

fn one_table(p: &OnePublisher, region: u64, digest_of: &[u8], step: u64) -> ShardTable {
    use reshard_core::{DType, MemoryKind, OfferLocation, ShardOffer, TensorBox, TensorSpec};
    let mut t = ShardTable::new(0, p.transport.agent(), step).bound_to(p.transport.incarnation());
    t.tensors.push(TensorSpec::new("w", DType::U8, vec![8, 8]));
    t.offers.push(ShardOffer {
        tensor: "w".into(),
        tensor_box: TensorBox::new(vec![0, 0], vec![8, 8]),
        location: OfferLocation {
            region,
            offset: 0,
            memory: MemoryKind::Dram,
        },
        digest: Some(reshard_core::offer_digest(digest_of, &[8, 8], 1)),
        parts: None,
    });
    t
}

fn whole_w() -> reshard_core::WantedLayout {
    use reshard_core::{DType, ParamSpec, TensorBox, WantedCopy, WantedLayout};
    WantedLayout {
        receiver_rank: 0,
        params: vec![ParamSpec {
            name: "w".into(),
            dtype: DType::U8,
            shape: vec![8, 8],
            copies: vec![WantedCopy {
                tensor: "w".into(),
                src_box: TensorBox::new(vec![0, 0], vec![8, 8]),
                dst_offset: 0,
                dst_strides: vec![8, 1],
            }],
        }],
    }
}

/// Catalogue row "peer metadata of another agent for the same rank": `load_peer` of a
/// differently named agent's metadata for a loaded rank is accepted and replaces the peer; a
/// table still bound to the old agent's endpoint fails `Transport` before any read; one bound to
/// the new agent but describing the old agent's bytes fails `Verification` naming tensor, owner
/// and byte range, with the live weights kept; the new agent's own table installs exactly. (The
/// publishers are made in this process by every harness: the row is about `load_peer`.)
pub async fn peer_metadata_from_another_agent_for_the_same_rank(h: &Harness) {
    let tag = if h.is_cross_process() { "x" } else { "i" };
    let first = one_publisher(h, &format!("bi-{tag}-pub-0"), 3).await;
    let rx_t = h.endpoint(&format!("bi-{tag}-rx")).expect("endpoint");
    rx_t.load_peer(
        0,
        first.transport.export_metadata().await.expect("metadata"),
    )
    .await
    .expect("load");
    let mut rx =
        Receiver::new(rx_t.clone(), whole_w(), ReceiverOptions::default()).expect("receiver");
    rx.update(&[one_table(&first, first.region, &first.bytes, 1)])
        .await
        .expect("refit");
    assert_eq!(
        rx.live_params().expect("live")[0].read()[..],
        first.bytes[..]
    );

    let other = one_publisher(h, &format!("bi-{tag}-pub-0-restarted"), 9).await;
    rx_t.load_peer(
        0,
        other.transport.export_metadata().await.expect("metadata"),
    )
    .await
    .expect("another agent's metadata for a loaded rank is accepted");
    // A table still bound to the old agent's endpoint is refused before any read is posted.
    let mut stale = one_table(&first, other.region, &first.bytes, 2);
    let before = snapshot(&rx);
    let e = rx
        .update(std::slice::from_ref(&stale))
        .await
        .expect_err("table of another incarnation");
    assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
    assert_eq!(e.context().owner, Some(0), "{e}");
    assert!(e.to_string().contains("incarnation"), "{e}");
    assert_eq!(snapshot(&rx), before, "live weights untouched");
    // Bound to the new agent but still claiming the old agent's bytes (its digest): the reads
    // reach the new agent and verification refuses them.
    stale.publisher.agent = other.transport.agent().to_owned();
    stale.publisher.incarnation = other.transport.incarnation();
    let e = rx.update(&[stale]).await.expect_err("stale digest");
    assert_eq!(e.kind(), ErrorKind::Verification, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some("w"), "{e}");
    assert_eq!(e.context().owner, Some(0), "{e}");
    assert_eq!(e.context().range, Some(0..64), "{e}");
    assert_eq!(snapshot(&rx), before, "live weights untouched");
    assert_kept(
        &rx,
        std::slice::from_ref(&first.bytes),
        1,
        "stale table of another agent",
    );
    let r = rx
        .update(&[one_table(&other, other.region, &other.bytes, 2)])
        .await
        .expect("the new agent's table installs");
    assert!(!r.plan_rebuilt || first.region != other.region);
    assert_eq!(
        rx.live_params().expect("live")[0].read()[..],
        other.bytes[..]
    );
    assert_eq!(rx.live_step(), Some(2));
}

// ---- Concurrent receivers.
