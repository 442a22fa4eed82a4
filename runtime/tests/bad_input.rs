//! The bad-input catalogue (docs/bad-input.md): one test per row, each going through the API a
//! user hits (`Receiver::update` / `update_encoded` over the loopback backend, `decode_table`,
//! `table_from_json`, `receiver_layout`) and asserting the typed error kind, what the error
//! names (tensor, owner, byte range, structured detail) and, wherever a receiver is involved,
//! that its live weights and live step are exactly what they were before.

use std::sync::Arc;

use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
use reshard_core::encoding::{
    decode_table, encode_table, table_from_json, table_to_json, SCHEMA_VERSION,
};
use reshard_core::{
    DType, Digest, Error, ErrorDetail, ErrorKind, HostBuffer, MemoryBlock, MemoryKind,
    OfferLocation, ParamSpec, PartDigests, Registration, ShardOffer, ShardTable, TensorBox,
    TensorSpec, Transport, WantedCopy, WantedLayout,
};
use reshard_planner::layouts::receiver_layout;
use reshard_planner::presets::{expert_tensor, layer_tensor, ModelConfig};
use reshard_planner::topology::ReceiverTopology;
use reshard_runtime::{Receiver, ReceiverOptions};
use reshard_testkit::SyntheticCluster;

fn model() -> ModelConfig {
    reshard_testkit::models::tiny_moe(8)
}

const NORM: &str = "model.norm.weight";

fn q_proj() -> String {
    layer_tensor(0, "self_attn.q_proj.weight")
}

fn endpoint(fabric: &LoopbackFabric, agent: &str) -> Arc<dyn Transport> {
    Arc::new(LoopbackTransport::new(fabric, agent, 2).expect("endpoint"))
}

/// Publishers of `topo` and one TP2 receiver (rank 0) that has installed step 0.
struct Setup {
    _fabric: LoopbackFabric,
    cluster: SyntheticCluster,
    rx: Receiver,
}

async fn installed(topo: &str) -> Setup {
    let fabric = LoopbackFabric::new();
    let f = fabric.clone();
    let cluster = SyntheticCluster::new(model(), topo.parse().unwrap(), 7, move |r| {
        Ok(endpoint(&f, &format!("pub-{r}")))
    })
    .await
    .expect("cluster");
    let t = endpoint(&fabric, "rx");
    cluster.connect(t.as_ref()).await.expect("connect");
    let layout = receiver_layout(cluster.model(), &ReceiverTopology::tp(2), 0).unwrap();
    let mut rx = Receiver::new(t, layout, ReceiverOptions::default()).expect("receiver");
    rx.update(&cluster.tables()).await.expect("step 0 installs");
    assert_eq!(rx.live_step(), Some(0));
    Setup {
        _fabric: fabric,
        cluster,
        rx,
    }
}

/// Live step and a copy of every live parameter.
fn live(rx: &Receiver) -> (Option<u64>, Vec<Vec<u8>>) {
    let params = rx
        .live_params()
        .map(|ps| ps.iter().map(|p| p.read().to_vec()).collect())
        .unwrap_or_default();
    (rx.live_step(), params)
}

/// The tables of step 1: had the update installed, the live bytes would differ from step 0's.
fn next_tables(s: &mut Setup) -> Vec<ShardTable> {
    s.cluster.publish_step(1);
    s.cluster.tables()
}

/// Runs an update that must fail and checks the live weights and step did not move.
async fn refused(s: &mut Setup, tables: &[ShardTable]) -> Error {
    let before = live(&s.rx);
    let e = s.rx.update(tables).await.expect_err("the update must fail");
    assert_eq!(live(&s.rx), before, "live weights must be untouched ({e})");
    e
}

/// Same as [`refused`], for encoded tables.
async fn refused_encoded(s: &mut Setup, encoded: &[Vec<u8>]) -> Error {
    let before = live(&s.rx);
    let e = s.rx.update_encoded(encoded).await.expect_err("must fail");
    assert_eq!(live(&s.rx), before, "live weights must be untouched ({e})");
    e
}

/// Indices of the tables that declare `tensor`, in rank order.
fn holders(tables: &[ShardTable], tensor: &str) -> Vec<usize> {
    let mut v: Vec<usize> = (0..tables.len())
        .filter(|&i| tables[i].tensors.iter().any(|t| t.name == tensor))
        .collect();
    v.sort_by_key(|&i| tables[i].publisher.rank);
    v
}

fn spec_mut<'a>(t: &'a mut ShardTable, tensor: &str) -> &'a mut TensorSpec {
    t.tensors.iter_mut().find(|s| s.name == tensor).unwrap()
}

fn offers_mut<'a>(
    t: &'a mut ShardTable,
    tensor: &'a str,
) -> impl Iterator<Item = &'a mut ShardOffer> + 'a {
    t.offers.iter_mut().filter(move |o| o.tensor == tensor)
}

/// Changes `tensor`'s spec in the highest-rank table holding it; the error must name both ranks.
async fn inconsistent(change: impl Fn(&mut TensorSpec)) {
    let mut s = installed("ep=2,dp=2").await;
    let mut tables = next_tables(&mut s);
    let h = holders(&tables, NORM);
    assert!(h.len() >= 2, "the norm is replicated");
    let (first, last) = (h[0], h[h.len() - 1]);
    change(spec_mut(&mut tables[last], NORM));
    let e = refused(&mut s, &tables).await;
    assert_eq!(e.kind(), ErrorKind::InconsistentTensor, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(NORM));
    let rank_last = tables[last].publisher.rank;
    assert_eq!(e.context().owner, Some(rank_last));
    match e.detail() {
        Some(ErrorDetail::InconsistentTensor {
            tensor,
            rank_a,
            rank_b,
            ..
        }) => {
            assert_eq!(tensor, NORM);
            assert_eq!(
                (*rank_a, *rank_b),
                (tables[first].publisher.rank, rank_last)
            );
        }
        other => panic!("expected an inconsistent-tensor detail, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dtype_mismatch_across_ranks() {
    // bf16 and f16 have the same element size: the dtype alone must be refused.
    inconsistent(|s| s.dtype = DType::F16).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn element_size_mismatch_across_ranks() {
    inconsistent(|s| s.dtype = DType::F32).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shape_mismatch_across_ranks() {
    inconsistent(|s| s.shape[0] *= 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dtype_mismatch_with_the_receiver_parameter() {
    // Every publisher agrees on f32, the engine's parameter is bf16: no silent conversion.
    let mut s = installed("ep=2,dp=2").await;
    let mut tables = next_tables(&mut s);
    for i in holders(&tables, NORM) {
        spec_mut(&mut tables[i], NORM).dtype = DType::F32;
    }
    let e = refused(&mut s, &tables).await;
    assert_eq!(e.kind(), ErrorKind::Layout, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(NORM));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn divergent_replicas() {
    let mut s = installed("ep=2,dp=2").await;
    let mut tables = next_tables(&mut s);
    let h = holders(&tables, NORM);
    let (first, last) = (h[0], h[h.len() - 1]);
    for o in offers_mut(&mut tables[last], NORM) {
        o.digest = Some(Digest::of(b"another tensor under the same name"));
        o.parts = None;
    }
    let e = refused(&mut s, &tables).await;
    assert_eq!(e.kind(), ErrorKind::ReplicaDivergence, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(NORM));
    let owners = (tables[first].publisher.rank, tables[last].publisher.rank);
    assert_eq!(e.context().owner, Some(owners.1));
    match e.detail() {
        Some(ErrorDetail::ReplicaDivergence {
            tensor, owners: o, ..
        }) => assert_eq!((tensor.as_str(), *o), (NORM, owners)),
        other => panic!("expected a divergence detail, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_in_the_offers() {
    // No publisher offers rows rows/4..rows/2 of q_proj: a gap inside the first half, which
    // TP rank 0 wants.
    let mut s = installed("ep=2,dp=2").await;
    let mut tables = next_tables(&mut s);
    let q = q_proj();
    let rows = model().q_rows();
    let before: usize = tables.iter().map(|t| t.offers.len()).sum();
    for t in tables.iter_mut() {
        t.offers
            .retain(|o| o.tensor != q || !(rows / 4..rows / 2).contains(&o.tensor_box.offset[0]));
    }
    let after: usize = tables.iter().map(|t| t.offers.len()).sum();
    assert!(after < before, "some offers of q_proj were dropped");
    let e = refused(&mut s, &tables).await;
    assert_eq!(e.kind(), ErrorKind::MissingCoverage, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(q.as_str()));
    match e.detail() {
        Some(ErrorDetail::MissingCoverage { tensor, missing }) => {
            assert_eq!(tensor, &q);
            let (start, end) = (missing.offset[0], missing.end(0));
            assert!(
                start >= rows / 4 && end <= rows / 2,
                "{missing} lies in the gap"
            );
            assert!(missing.elements() > 0);
        }
        other => panic!("expected a missing-coverage detail, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn box_that_leaves_a_hole_outside_the_wanted_part() {
    // A garbled extent: expert 5's down_proj ([128, 96], row-parallel) claims only columns
    // 0..58 on its only holder. TP rank 0 wants columns 0..48, still inside the box, but the box
    // now describes the holder's memory with the wrong row stride and a sub-box read of it
    // matches no digest: the hole at columns 58..96 must refuse the update.
    let mut s = installed("ep=2,dp=2").await;
    let mut tables = next_tables(&mut s);
    let name = expert_tensor(0, 5, "down_proj");
    let h = holders(&tables, &name);
    assert_eq!(
        h.len(),
        1,
        "one holder of an expert under ep=2 in a world of 2"
    );
    let o = offers_mut(&mut tables[h[0]], &name).next().unwrap();
    assert_eq!(o.tensor_box.extent, vec![128, 96]);
    // Garbled rows: the offer's row-chunk digests (16 chunks of 8 rows) no longer fit its box,
    // refused as an invalid table naming tensor and owner.
    o.tensor_box.extent[0] = 100;
    let e = refused(&mut s, &tables).await;
    assert_eq!(e.kind(), ErrorKind::InvalidTable, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(name.as_str()));
    assert_eq!(e.context().owner, Some(tables[h[0]].publisher.rank));
    // Garbled columns on one column block: the digests still fit, and the hole refuses it.
    let o = offers_mut(&mut tables[h[0]], &name).next().unwrap();
    o.tensor_box.extent = vec![128, 58];
    o.parts.as_mut().unwrap().block_cols = 58;
    let e = refused(&mut s, &tables).await;
    assert_eq!(e.kind(), ErrorKind::MissingCoverage, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(name.as_str()));
    match e.detail() {
        Some(ErrorDetail::MissingCoverage { tensor, missing }) => {
            assert_eq!(tensor, &name);
            assert!(
                missing.offset[1] >= 58 && missing.end(1) <= 96,
                "{missing} lies in the hole"
            );
        }
        other => panic!("expected a missing-coverage detail, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_digest_grid() {
    // A publisher's part digests on a grid no publisher makes: one column per block (every
    // 2-byte cell of q_proj's 256-byte rows a segment the receiver would keep a slot and a task
    // for), and a block wider than the row (`block_cols * cell` overflows u64). Both are
    // refused as `Decode` naming tensor and owner, before anything is planned or allocated,
    // from decoded tables and from encoded bytes alike.
    let mut s = installed("ep=2,dp=2").await;
    let tables = next_tables(&mut s);
    let q = q_proj();
    let h = holders(&tables, &q)[0];
    let rank = tables[h].publisher.rank;
    let hostile = |block_cols: u64| {
        let mut t = tables.clone();
        let o = offers_mut(&mut t[h], &q).next().unwrap();
        let cols = o.tensor_box.extent[1];
        assert_eq!(cols, 128, "q_proj's rows are 128 bf16 columns");
        let p = o.parts.as_mut().unwrap();
        p.block_cols = block_cols;
        // As many block digests as the grid has blocks: only the grid is wrong.
        p.blocks = vec![7; cols.div_ceil(block_cols) as usize];
        t
    };
    for block_cols in [1, u64::MAX / 2 + 1] {
        let bad = hostile(block_cols);
        let e = refused(&mut s, &bad).await;
        assert_eq!(e.kind(), ErrorKind::Decode, "{e}");
        assert_eq!(e.context().tensor.as_deref(), Some(q.as_str()));
        assert_eq!(e.context().owner, Some(rank));
        let encoded: Vec<Vec<u8>> = bad.iter().map(encode_table).collect();
        let e = refused_encoded(&mut s, &encoded).await;
        assert_eq!(e.kind(), ErrorKind::Decode, "{e}");
        assert_eq!(e.context().tensor.as_deref(), Some(q.as_str()));
        assert_eq!(e.context().owner, Some(rank));
    }
    // The same tables with the publisher's grid install: only the grid was refused.
    s.rx.update(&tables)
        .await
        .expect("the honest step installs");
    assert_eq!(s.rx.live_step(), Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_overlap_of_offers() {
    // One publisher also offers the top half of q_proj: it overlaps the whole-tensor offers
    // without being a replica of them.
    let mut s = installed("ep=2,dp=2").await;
    let mut tables = next_tables(&mut s);
    let q = q_proj();
    let h = holders(&tables, &q);
    let last = h[h.len() - 1];
    // The offer of the first rows: receiver rank 0 reads them (offers are in a different
    // order on every rank).
    let mut half = tables[last]
        .offers
        .iter()
        .find(|o| o.tensor == q && o.tensor_box.offset[0] == 0)
        .unwrap()
        .clone();
    half.tensor_box.extent[0] /= 2;
    half.digest = None;
    half.parts = None;
    tables[last].offers.push(half);
    let e = refused(&mut s, &tables).await;
    assert_eq!(e.kind(), ErrorKind::OverlappingOffers, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(q.as_str()));
    let ranks: Vec<u32> = h.iter().map(|&i| tables[i].publisher.rank).collect();
    assert!(ranks.contains(&e.context().owner.expect("names an owner")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn box_out_of_bounds() {
    let mut s = installed("ep=2,dp=2").await;
    let mut tables = next_tables(&mut s);
    let h = holders(&tables, NORM);
    let last = h[h.len() - 1];
    let extent = spec_mut(&mut tables[last], NORM).shape[0];
    for o in offers_mut(&mut tables[last], NORM) {
        o.tensor_box.offset[0] = extent; // starts where the tensor ends
    }
    let e = refused(&mut s, &tables).await;
    assert_eq!(e.kind(), ErrorKind::InvalidTable, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(NORM));
    assert_eq!(e.context().owner, Some(tables[last].publisher.rank));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offer_outside_the_registered_region() {
    // The box is fine but the bytes it points at lie beyond the publisher's registered memory.
    let mut s = installed("ep=2,dp=2").await;
    let mut tables = next_tables(&mut s);
    let far = 1u64 << 40;
    for t in tables.iter_mut() {
        for o in offers_mut(t, NORM) {
            o.location.offset = far;
        }
    }
    let e = refused(&mut s, &tables).await;
    assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    let owner = e.context().owner.expect("names the owner");
    assert!(holders(&tables, NORM)
        .iter()
        .any(|&i| tables[i].publisher.rank == owner));
    let range = e.context().range.clone().expect("names the byte range");
    assert!(range.start >= far, "{range:?}");
    assert_eq!(e.context().backend.as_deref(), Some("loopback"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp_that_does_not_divide_an_extent() {
    // 8 query heads (128 rows of q_proj) over TP3.
    let e = receiver_layout(&model(), &ReceiverTopology::tp(3), 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Layout, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(q_proj().as_str()));
    // 96 expert rows over TP5, through the slicing helper the layouts use.
    let spec = TensorSpec::new(expert_tensor(0, 0, "gate_proj"), DType::Bf16, vec![96, 128]);
    let e = reshard_planner::layouts::column_parallel(&spec, 5, 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Layout, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(spec.name.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wanted_tensor_nobody_offers() {
    let mut s = installed("ep=2,dp=2").await;
    let mut tables = next_tables(&mut s);
    let full = TensorSpec::new(NORM, DType::Bf16, vec![model().hidden]).full_box();
    for t in tables.iter_mut() {
        t.tensors.retain(|s| s.name != NORM);
        t.offers.retain(|o| o.tensor != NORM);
    }
    let e = refused(&mut s, &tables).await;
    assert_eq!(e.kind(), ErrorKind::MissingCoverage, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(NORM));
    match e.detail() {
        Some(ErrorDetail::MissingCoverage { tensor, missing }) => {
            assert_eq!((tensor.as_str(), missing), (NORM, &full));
        }
        other => panic!("expected a missing-coverage detail, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_publisher() {
    // EP2 over DP2: rank 1 alone holds experts 4..8, and its table never arrives.
    let mut s = installed("ep=2,dp=2").await;
    let tables = next_tables(&mut s);
    let only_rank_1: Vec<String> = {
        let of = |r: u32| -> Vec<String> {
            let t = tables.iter().find(|t| t.publisher.rank == r).unwrap();
            t.tensors.iter().map(|s| s.name.clone()).collect()
        };
        let zero = of(0);
        of(1).into_iter().filter(|n| !zero.contains(n)).collect()
    };
    assert!(!only_rank_1.is_empty());
    let rest: Vec<ShardTable> = tables
        .into_iter()
        .filter(|t| t.publisher.rank != 1)
        .collect();
    let e = refused(&mut s, &rest).await;
    assert_eq!(e.kind(), ErrorKind::MissingCoverage, "{e}");
    let tensor = e.context().tensor.clone().expect("names the tensor");
    assert!(only_rank_1.contains(&tensor), "{tensor}");
    assert!(matches!(
        e.detail(),
        Some(ErrorDetail::MissingCoverage { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_whose_metadata_was_never_loaded() {
    // Rank 1's table arrives under rank 5, a rank whose transport metadata the receiver never
    // loaded: the plan is fine, building descriptors is not.
    let mut s = installed("ep=2,dp=2").await;
    let mut tables = next_tables(&mut s);
    for t in tables.iter_mut().filter(|t| t.publisher.rank == 1) {
        t.publisher.rank = 5;
    }
    let e = refused(&mut s, &tables).await;
    assert_eq!(e.kind(), ErrorKind::PeerUnknown, "{e}");
    assert_eq!(e.context().owner, Some(5));
    assert!(e.context().range.is_some(), "names the byte range");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_tensor_names_in_a_table() {
    let mut s = installed("ep=2,dp=2").await;
    let mut tables = next_tables(&mut s);
    let dup = tables[1].tensors[0].clone();
    tables[1].tensors.push(dup.clone());
    let rank = tables[1].publisher.rank;
    // Through the wire format, where a user meets it ...
    let encoded: Vec<Vec<u8>> = tables.iter().map(encode_table).collect();
    let e = refused_encoded(&mut s, &encoded).await;
    assert_eq!(e.kind(), ErrorKind::InvalidTable, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(dup.name.as_str()));
    assert_eq!(e.context().owner, Some(rank));
    // ... and as decoded tables.
    let e = refused(&mut s, &tables).await;
    assert_eq!(e.kind(), ErrorKind::InvalidTable, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(dup.name.as_str()));
    assert_eq!(e.context().owner, Some(rank));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_publisher_ranks() {
    let mut s = installed("ep=2,dp=2").await;
    let mut tables = next_tables(&mut s);
    let rank = tables[0].publisher.rank;
    tables[1].publisher.rank = rank;
    let e = refused(&mut s, &tables).await;
    assert_eq!(e.kind(), ErrorKind::InvalidTable, "{e}");
    assert_eq!(e.context().owner, Some(rank));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_table_bytes() {
    let mut s = installed("ep=2,dp=2").await;
    let tables = next_tables(&mut s);
    let mut encoded: Vec<Vec<u8>> = tables.iter().map(encode_table).collect();
    let rank = tables[1].publisher.rank;
    let len = encoded[1].len();
    encoded[1].truncate(len / 2);
    let e = refused_encoded(&mut s, &encoded).await;
    assert_eq!(e.kind(), ErrorKind::Decode, "{e}");
    assert_eq!(e.context().owner, Some(rank), "the header names the rank");
    // Cut inside the header, before the rank: still typed, just without an owner.
    encoded[1].truncate(5);
    let e = refused_encoded(&mut s, &encoded).await;
    assert_eq!(e.kind(), ErrorKind::Decode, "{e}");
    assert_eq!(e.context().owner, None);
}

/// Byte position of the first tensor's dtype code in an encoded table (see the format in
/// `reshard_core::encoding`): header, then the first tensor's name.
fn first_dtype_at(t: &ShardTable) -> usize {
    let varint_len = |v: usize| (usize::BITS - v.max(1).leading_zeros()).div_ceil(7) as usize;
    let agent = t.publisher.agent.len();
    let name = t.tensors[0].name.len();
    4 + 2
        + 4
        + varint_len(agent)
        + agent
        + 8 // incarnation
        + 8 // step
        + varint_len(t.tensors.len())
        + varint_len(name)
        + name
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbled_table_bytes() {
    let mut s = installed("ep=2,dp=2").await;
    let tables = next_tables(&mut s);
    let clean: Vec<Vec<u8>> = tables.iter().map(encode_table).collect();
    // An unknown dtype code: the error names the publisher and the tensor being decoded.
    let mut encoded = clean.clone();
    let at = first_dtype_at(&tables[1]);
    assert_eq!(encoded[1][at], tables[1].tensors[0].dtype.code());
    encoded[1][at] = 0xee;
    let e = refused_encoded(&mut s, &encoded).await;
    assert_eq!(e.kind(), ErrorKind::Decode, "{e}");
    assert_eq!(e.context().owner, Some(tables[1].publisher.rank));
    assert_eq!(
        e.context().tensor.as_deref(),
        Some(tables[1].tensors[0].name.as_str())
    );
    // Not a shard table at all.
    let mut encoded = clean.clone();
    encoded[1][..4].copy_from_slice(b"JUNK");
    let e = refused_encoded(&mut s, &encoded).await;
    assert_eq!(e.kind(), ErrorKind::Decode, "{e}");
    // Flipping any single byte never panics and never installs wrong weights: it is refused
    // with a typed error (live weights untouched), or it hit a byte the refit does not depend
    // on (the agent name, a digest of rows this receiver does not read) and the refit is exact.
    let want = s.cluster.expected_params(s.rx.layout()).unwrap();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..48 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let mut encoded = clean.clone();
        let at = (x % encoded[1].len() as u64) as usize;
        encoded[1][at] ^= 0x5a;
        let before = live(&s.rx);
        match s.rx.update_encoded(&encoded).await {
            Ok(_) => {
                let (_, got) = live(&s.rx);
                assert!(got == want, "byte {at}: installed wrong weights");
            }
            Err(e) => {
                assert_ne!(e.kind(), ErrorKind::Internal, "byte {at}: {e}");
                assert_eq!(live(&s.rx), before, "byte {at}: {e}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_schema_version() {
    let mut s = installed("ep=2,dp=2").await;
    let tables = next_tables(&mut s);
    let mut encoded: Vec<Vec<u8>> = tables.iter().map(encode_table).collect();
    encoded[0][4..6].copy_from_slice(&(SCHEMA_VERSION + 1).to_le_bytes());
    let e = refused_encoded(&mut s, &encoded).await;
    assert_eq!(e.kind(), ErrorKind::Decode, "{e}");
    // The version precedes the rank, so nothing else can be named yet.
    let e = decode_table(&encoded[0]).unwrap_err();
    assert_eq!((e.kind(), e.context().owner), (ErrorKind::Decode, None));
    // JSON says its version too.
    let json = table_to_json(&tables[0]).replacen(
        &format!("\"schema_version\": {SCHEMA_VERSION}"),
        &format!("\"schema_version\": {}", SCHEMA_VERSION + 1),
        1,
    );
    assert_ne!(json, table_to_json(&tables[0]), "the version was replaced");
    let e = table_from_json(&json).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Decode, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_size_tensor() {
    let mut s = installed("ep=2,dp=2").await;
    let mut tables = next_tables(&mut s);
    let h = holders(&tables, NORM);
    let last = h[h.len() - 1];
    let rank = tables[last].publisher.rank;
    // A global shape with a zero extent.
    let mut zero_shape = tables.clone();
    spec_mut(&mut zero_shape[last], NORM).shape[0] = 0;
    let encoded: Vec<Vec<u8>> = zero_shape.iter().map(encode_table).collect();
    let e = refused_encoded(&mut s, &encoded).await;
    assert_eq!(e.kind(), ErrorKind::InvalidTable, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(NORM));
    assert_eq!(e.context().owner, Some(rank));
    let e = refused(&mut s, &zero_shape).await;
    assert_eq!(e.kind(), ErrorKind::InvalidTable, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(NORM));
    // An offer of zero elements.
    for o in offers_mut(&mut tables[last], NORM) {
        o.tensor_box.extent[0] = 0;
        o.parts = None;
    }
    let e = refused(&mut s, &tables).await;
    assert_eq!(e.kind(), ErrorKind::InvalidTable, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(NORM));
    assert_eq!(e.context().owner, Some(rank));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_publisher_step() {
    let mut s = installed("ep=2,dp=2").await;
    s.cluster.publish_step(5);
    s.rx.update(&s.cluster.tables())
        .await
        .expect("step 5 installs");
    // Every publisher went back to step 4 (restarted from an older checkpoint).
    s.cluster.publish_step(4);
    let tables = s.cluster.tables();
    let e = refused(&mut s, &tables).await;
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    let lowest = tables.iter().map(|t| t.publisher.rank).min().unwrap();
    assert_eq!(e.context().owner, Some(lowest));
    assert_eq!(
        e.detail(),
        Some(&ErrorDetail::StaleStep {
            owner: lowest,
            step: 4,
            live_step: 5
        })
    );
    // One publisher lags behind current ones: it is named as stale, not merely different.
    s.cluster.publish_step(6);
    let mut tables = s.cluster.tables();
    tables[1].step = 3;
    let e = refused(&mut s, &tables).await;
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    let rank = tables[1].publisher.rank;
    assert_eq!(e.context().owner, Some(rank));
    assert_eq!(
        e.detail(),
        Some(&ErrorDetail::StaleStep {
            owner: rank,
            step: 3,
            live_step: 5
        })
    );
    // Re-installing the live step is not stale; a newer one installs as usual.
    s.cluster.publish_step(5);
    s.rx.update(&s.cluster.tables())
        .await
        .expect("same step again");
    assert_eq!(s.rx.live_step(), Some(5));
    s.cluster.publish_step(6);
    s.rx.update(&s.cluster.tables()).await.expect("newer step");
    assert_eq!(s.rx.live_step(), Some(6));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_steps_across_publishers() {
    let mut s = installed("ep=2,dp=2").await;
    let mut tables = next_tables(&mut s);
    tables[1].step = 2; // ahead of the others, so not stale
    let e = refused(&mut s, &tables).await;
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    let (a, b) = (tables[0].publisher.rank, tables[1].publisher.rank);
    assert_eq!(e.context().owner, Some(b));
    assert_eq!(
        e.detail(),
        Some(&ErrorDetail::MixedSteps {
            rank_a: a,
            step_a: 1,
            rank_b: b,
            step_b: 2
        })
    );
}

/// One publisher (rank 0) holding tensor `w`, `[8, 8]` u8, at offset 0 of its first region.
struct OnePublisher {
    transport: Arc<dyn Transport>,
    _registration: Registration,
    bytes: Vec<u8>,
}

async fn one_publisher(fabric: &LoopbackFabric, agent: &str, seed: u8) -> OnePublisher {
    let transport = endpoint(fabric, agent);
    let bytes: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(seed) ^ seed).collect();
    let buf = Arc::new(HostBuffer::from_bytes(&bytes));
    let registration = transport
        .register(buf as Arc<dyn MemoryBlock>)
        .await
        .unwrap();
    assert_eq!(registration.id(), 1, "a fresh agent numbers regions from 1");
    OnePublisher {
        transport,
        _registration: registration,
        bytes,
    }
}

fn one_table(p: &OnePublisher, step: u64) -> ShardTable {
    let mut t = ShardTable::new(0, p.transport.agent(), step).bound_to(p.transport.incarnation());
    t.tensors.push(TensorSpec::new("w", DType::U8, vec![8, 8]));
    t.offers.push(ShardOffer {
        tensor: "w".into(),
        tensor_box: TensorBox::new(vec![0, 0], vec![8, 8]),
        location: OfferLocation {
            region: 1,
            offset: 0,
            memory: MemoryKind::Dram,
        },
        digest: Some(PartDigests::compute(&p.bytes, &[8, 8], 1).0),
        parts: None,
    });
    t
}

fn whole_w() -> WantedLayout {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_metadata_changed_for_the_same_name() {
    let fabric = LoopbackFabric::new();
    let first = one_publisher(&fabric, "pub-0", 3).await;
    let rx_t = endpoint(&fabric, "rx");
    rx_t.load_peer(0, first.transport.export_metadata().await.unwrap())
        .await
        .unwrap();
    let mut rx = Receiver::new(rx_t.clone(), whole_w(), ReceiverOptions::default()).unwrap();
    rx.update(&[one_table(&first, 1)]).await.unwrap();
    assert_eq!(rx.live_params().unwrap()[0].read()[..], first.bytes[..]);

    // The publisher restarts under the same agent name with new memory: same table geometry
    // (region 1, offset 0), new metadata. Until it is loaded, reads go nowhere and fail typed.
    drop(first);
    let second = one_publisher(&fabric, "pub-0", 5).await;
    let before = live(&rx);
    let e = rx.update(&[one_table(&second, 2)]).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
    assert_eq!(e.context().owner, Some(0));
    assert_eq!(live(&rx), before, "live weights untouched");

    // Loading the new metadata replaces the peer and bumps the epoch: descriptors are rebuilt
    // (the plan is not: the geometry did not change) and the refit is byte-exact.
    let epoch = rx_t.epoch();
    rx_t.load_peer(0, second.transport.export_metadata().await.unwrap())
        .await
        .unwrap();
    assert!(rx_t.epoch() > epoch);
    let r = rx.update(&[one_table(&second, 2)]).await.unwrap();
    assert!(
        r.descriptors_rebuilt,
        "new peer metadata must rebuild descriptors"
    );
    assert!(!r.plan_rebuilt);
    assert_eq!(rx.live_params().unwrap()[0].read()[..], second.bytes[..]);
    assert_eq!(rx.live_step(), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_not_bound_to_an_endpoint() {
    let fabric = LoopbackFabric::new();
    let p = one_publisher(&fabric, "pub-0", 3).await;
    let rx_t = endpoint(&fabric, "rx");
    rx_t.load_peer(0, p.transport.export_metadata().await.unwrap())
        .await
        .unwrap();
    let mut rx = Receiver::new(rx_t.clone(), whole_w(), ReceiverOptions::default()).unwrap();
    let mut t = one_table(&p, 1);
    t.publisher.incarnation = 0;
    let e = rx.update(&[t]).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidTable, "{e}");
    assert_eq!(e.context().owner, Some(0));
    assert!(e.to_string().contains("not bound"), "{e}");
    assert!(rx.live_params().is_none() || rx.live_step().is_none());
    rx.update(&[one_table(&p, 1)]).await.unwrap();
    assert_eq!(rx.live_params().unwrap()[0].read()[..], p.bytes[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_metadata_from_another_agent_for_the_same_rank() {
    // Decision: the owner rank is the identity offers use, so metadata of a differently named
    // agent for an already-loaded rank replaces the old peer (a restart under a new name). A
    // table bound to another endpoint incarnation than the loaded one is refused before any
    // read; a wrong agent's bytes under a correctly bound table are caught by the digests.
    let fabric = LoopbackFabric::new();
    let first = one_publisher(&fabric, "pub-0", 3).await;
    let rx_t = endpoint(&fabric, "rx");
    rx_t.load_peer(0, first.transport.export_metadata().await.unwrap())
        .await
        .unwrap();
    let mut rx = Receiver::new(rx_t.clone(), whole_w(), ReceiverOptions::default()).unwrap();
    rx.update(&[one_table(&first, 1)]).await.unwrap();

    let other = one_publisher(&fabric, "pub-0-restarted", 9).await;
    rx_t.load_peer(0, other.transport.export_metadata().await.unwrap())
        .await
        .unwrap();
    // A table still bound to the old agent's endpoint is refused before any read is posted.
    let mut stale = one_table(&first, 2);
    let before = live(&rx);
    let e = rx.update(std::slice::from_ref(&stale)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
    assert_eq!(e.context().owner, Some(0));
    assert!(e.to_string().contains("incarnation"), "{e}");
    assert_eq!(live(&rx), before, "live weights untouched");
    // One bound to the new agent that still claims the old agent's bytes (its digest) is
    // refused by verification: the reads reach the new agent, whose bytes differ.
    stale.publisher.agent = other.transport.agent().to_owned();
    stale.publisher.incarnation = other.transport.incarnation();
    let e = rx.update(&[stale]).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Verification, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some("w"));
    assert_eq!(e.context().owner, Some(0));
    assert_eq!(e.context().range, Some(0..64));
    assert_eq!(live(&rx), before, "live weights untouched");
    // The new agent's own table installs its bytes exactly.
    let r = rx.update(&[one_table(&other, 2)]).await.unwrap();
    assert!(!r.plan_rebuilt);
    assert_eq!(rx.live_params().unwrap()[0].read()[..], other.bytes[..]);
}

#[test]
fn garbled_json_table() {
    let mut t = ShardTable::new(2, "pub-2", 1);
    t.tensors.push(TensorSpec::new("w", DType::F32, vec![4]));
    let json = table_to_json(&t);
    assert_eq!(table_from_json(&json).unwrap(), t);
    for bad in [
        &json[..json.len() / 2],
        "{\"schema_version\": 2}",
        "not json",
        &json.replacen("\"f32\"", "\"q4\"", 1),
    ] {
        let e = table_from_json(bad).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Decode, "{bad}: {e}");
    }
}
