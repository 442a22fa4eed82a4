//! Publisher (Megatron TP/EP/DP/PP) and receiver (vLLM TP/DP/EP) topologies, and the boxes each
//! publisher rank offers: the geometry of a training job's shard tables, without any bytes.
//!
//! Megatron rank order is `rank = pp_rank * (tp * dp) + dp_rank * tp + tp_rank`. Expert
//! parallelism lives inside data parallelism: `ep_rank = dp_rank % ep`, so each expert has
//! `dp / ep` replicas (EDP), while every dense box is replicated on all `dp` ranks.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use reshard_core::{
    Error, ErrorKind, MemoryKind, OfferLocation, Result, ShardOffer, ShardTable, TensorBox,
};

use crate::families::Shard;
use crate::layouts::{
    check_heads, column_parallel, has_kv_heads, kv_rows_for_rank, row_block, row_parallel,
    TensorIndex,
};
use crate::presets::{layer_tensor, ModelConfig};

/// How the trainer shards the model: tensor, expert, data and pipeline parallel degrees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct PublisherTopology {
    /// Tensor-parallel degree.
    pub tp: u32,
    /// Expert-parallel degree (inside data parallelism).
    pub ep: u32,
    /// Data-parallel degree (replicas of every dense box).
    pub dp: u32,
    /// Pipeline-parallel degree (stages of consecutive layers).
    pub pp: u32,
}

impl Default for PublisherTopology {
    fn default() -> Self {
        PublisherTopology {
            tp: 1,
            ep: 1,
            dp: 1,
            pp: 1,
        }
    }
}

impl PublisherTopology {
    /// Number of publisher ranks, `tp * dp * pp` (saturating; parsing rejects overflow).
    pub fn world(&self) -> u32 {
        self.tp.saturating_mul(self.dp).saturating_mul(self.pp)
    }

    /// `(tp_rank, dp_rank, pp_rank)` of a global rank, in Megatron order.
    pub fn coords(&self, rank: u32) -> (u32, u32, u32) {
        let (tp, dp) = (self.tp.max(1), self.dp.max(1));
        (rank % tp, (rank / tp) % dp, rank / tp.saturating_mul(dp))
    }

    /// Checks degrees are non-zero and the world size fits in a `u32`.
    pub fn validate(&self) -> Result<()> {
        for (k, v) in [
            ("tp", self.tp),
            ("ep", self.ep),
            ("dp", self.dp),
            ("pp", self.pp),
        ] {
            if v == 0 {
                return Err(Error::new(
                    ErrorKind::Config,
                    format!("publisher {k} must be at least 1"),
                ));
            }
        }
        if self
            .tp
            .checked_mul(self.dp)
            .and_then(|x| x.checked_mul(self.pp))
            .is_none()
        {
            return Err(Error::new(
                ErrorKind::Config,
                format!("publisher world size of {self} overflows u32"),
            ));
        }
        Ok(())
    }
}

impl fmt::Display for PublisherTopology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tp={},ep={},dp={},pp={}",
            self.tp, self.ep, self.dp, self.pp
        )
    }
}

impl FromStr for PublisherTopology {
    type Err = Error;
    /// Parses `key=value` pairs separated by commas, keys `tp`, `ep`, `dp`, `pp`, each default 1.
    fn from_str(s: &str) -> Result<Self> {
        let mut t = PublisherTopology::default();
        for (k, v) in parse_pairs(s, "publisher", &["tp", "ep", "dp", "pp"])? {
            match k {
                "tp" => t.tp = v,
                "ep" => t.ep = v,
                "dp" => t.dp = v,
                _ => t.pp = v,
            }
        }
        t.validate()?;
        Ok(t)
    }
}

/// How the inference engine shards the model: vLLM's tensor-, data- and expert-parallel degrees.
///
/// Receiver rank order is `rank = dp_rank * tp + tp_rank`. Attention, dense and vocabulary
/// weights are TP-sliced by `tp_rank` and replicated over the `dp` replicas. Experts are either
/// TP-sliced like dense weights (`ep = 1`), or, with vLLM's `--enable-expert-parallel`
/// (`ep = tp * dp`), held whole, `experts / ep` consecutive experts per rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct ReceiverTopology {
    /// Tensor-parallel degree (ranks of one engine replica).
    pub tp: u32,
    /// Data-parallel degree (engine replicas).
    pub dp: u32,
    /// Expert-parallel degree: 1 (experts TP-sliced) or `tp * dp` (experts spread whole).
    pub ep: u32,
}

impl Default for ReceiverTopology {
    fn default() -> Self {
        ReceiverTopology::tp(1)
    }
}

impl ReceiverTopology {
    /// One TP group: `tp` ranks, no data or expert parallelism.
    pub fn tp(n: u32) -> Self {
        ReceiverTopology {
            tp: n,
            dp: 1,
            ep: 1,
        }
    }

    /// Number of receiver ranks, `tp * dp` (saturating; [`ReceiverTopology::validate`] rejects
    /// overflow).
    pub fn world(&self) -> u32 {
        self.tp.saturating_mul(self.dp)
    }

    /// `(tp_rank, dp_rank)` of a receiver rank (`rank = dp_rank * tp + tp_rank`).
    pub fn coords(&self, rank: u32) -> (u32, u32) {
        let tp = self.tp.max(1);
        (rank % tp, rank / tp)
    }

    /// The lowest rank whose wanted layout equals `rank`'s apart from `receiver_rank`: with
    /// experts TP-sliced every DP replica holds what its TP rank does in replica 0, so that TP
    /// rank; under expert parallelism each rank holds its own experts, so `rank` itself. Lets a
    /// caller plan each distinct layout once without building the others.
    pub fn same_layout_as(&self, rank: u32) -> u32 {
        if self.expert_parallel() {
            rank
        } else {
            self.coords(rank).0
        }
    }

    /// Whether experts are spread whole over every rank (vLLM expert parallel) rather than
    /// TP-sliced.
    pub fn expert_parallel(&self) -> bool {
        self.ep > 1
    }

    /// Checks degrees are non-zero, the world fits a `u32` and `ep` is 1 or `tp * dp`; a
    /// `Config` error names the key.
    pub fn validate(&self) -> Result<()> {
        let cfg = |m: String| Error::new(ErrorKind::Config, m);
        for (k, v) in [("tp", self.tp), ("dp", self.dp), ("ep", self.ep)] {
            if v == 0 {
                return Err(cfg(format!("receiver {k} must be at least 1")));
            }
        }
        let Some(world) = self.tp.checked_mul(self.dp) else {
            return Err(cfg(format!("receiver world size of {self} overflows u32")));
        };
        // vLLM has exactly two placements: experts TP-sliced inside every replica, or with
        // --enable-expert-parallel one expert group spanning all tp * dp ranks.
        if self.ep != 1 && self.ep != world {
            return Err(cfg(format!(
                "receiver ep={} must be 1 (experts TP-sliced, replicated over dp) or tp*dp={world} (expert parallel over every rank)",
                self.ep
            )));
        }
        Ok(())
    }

    /// Checks this topology against a model: expert parallelism needs experts, and they must
    /// split evenly over `ep` (a `Config` or `Layout` error naming the model or tensor).
    pub fn validate_for(&self, model: &ModelConfig) -> Result<()> {
        self.validate()?;
        if self.ep == 1 {
            return Ok(());
        }
        let ep = self.ep as u64;
        match &model.moe {
            None => Err(Error::new(
                ErrorKind::Config,
                format!(
                    "receiver ep={ep} given but {} is a dense model with no experts",
                    model.name
                ),
            )),
            Some(m) if m.experts % ep != 0 => Err(Error::new(
                ErrorKind::Layout,
                format!(
                    "{} experts (extent {} of dimension 0 of the stacked expert weights) are not divisible by receiver ep={ep}",
                    m.experts, m.experts
                ),
            )
            .with_tensor(layer_tensor(0, "mlp.experts.w13_weight"))),
            Some(_) => Ok(()),
        }
    }
}

impl fmt::Display for ReceiverTopology {
    /// `tp=N`, then `dp` and `ep` only when they are not 1 (so a plain TP group prints as before).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tp={}", self.tp)?;
        if self.dp != 1 {
            write!(f, ",dp={}", self.dp)?;
        }
        if self.ep != 1 {
            write!(f, ",ep={}", self.ep)?;
        }
        Ok(())
    }
}

impl FromStr for ReceiverTopology {
    type Err = Error;
    /// Parses `tp=N[,dp=N][,ep=N]`: `tp` is required (a receiver always names its TP degree),
    /// `dp` and `ep` default to 1.
    fn from_str(s: &str) -> Result<Self> {
        let mut t = ReceiverTopology::default();
        let mut has_tp = false;
        for (k, v) in parse_pairs(s, "receiver", &["tp", "dp", "ep"])? {
            match k {
                "tp" => {
                    t.tp = v;
                    has_tp = true;
                }
                "dp" => t.dp = v,
                _ => t.ep = v,
            }
        }
        if !has_tp {
            return Err(Error::new(
                ErrorKind::Config,
                format!("receiver topology {s:?} does not give tp (e.g. tp=8,dp=16,ep=128)"),
            ));
        }
        t.validate()?;
        Ok(t)
    }
}

/// Parses `k=v,k=v`: known keys only, each at most once, values positive integers.
fn parse_pairs<'k>(s: &str, what: &str, keys: &[&'k str]) -> Result<Vec<(&'k str, u32)>> {
    let cfg = |m: String| Error::new(ErrorKind::Config, m);
    if s.trim().is_empty() {
        return Err(cfg(format!(
            "empty {what} topology; expected comma-separated key=value with keys {}",
            keys.join(", ")
        )));
    }
    let mut out: Vec<(&'k str, u32)> = Vec::new();
    for item in s.split(',') {
        let item = item.trim();
        let Some((k, v)) = item.split_once('=') else {
            return Err(cfg(format!(
                "{what} topology item {item:?} is not key=value (keys: {})",
                keys.join(", ")
            )));
        };
        let k = k.trim();
        let Some(&key) = keys.iter().find(|&&x| x == k) else {
            return Err(cfg(format!(
                "unknown {what} topology key {k:?}; available: {}",
                keys.join(", ")
            )));
        };
        if out.iter().any(|(x, _)| *x == key) {
            return Err(cfg(format!("{what} topology key {key:?} given twice")));
        }
        let v: u32 = v.trim().parse().map_err(|_| {
            cfg(format!(
                "{what} topology {key}={:?} is not a positive integer",
                v.trim()
            ))
        })?;
        if v == 0 {
            return Err(cfg(format!("{what} topology {key} must be at least 1")));
        }
        out.push((key, v));
    }
    Ok(out)
}

/// One box a publisher rank offers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ShardGeometry {
    /// Index into [`ModelConfig::tensors`].
    pub tensor: usize,
    /// Box of that tensor, in global coordinates.
    pub tensor_box: TensorBox,
}

/// Every box one publisher rank offers, in its buffer order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankGeometry {
    /// Global publisher rank.
    pub rank: u32,
    /// Offered boxes, in the order they are packed in the rank's memory.
    pub shards: Vec<ShardGeometry>,
}

/// The boxes every rank of a Megatron job offers, in rank order.
///
/// Attention q, k and v are offered per KV group (Megatron's fused QKV is stored group by group,
/// so one group's q block sits between other tensors' blocks in memory, never next to the next
/// group's q block). With more TP ranks than KV heads, the ranks sharing a group each hold a
/// slice of its q rows and only the first of them offers the group's k and v.
pub fn publisher_geometry(
    model: &ModelConfig,
    topo: &PublisherTopology,
) -> Result<Vec<RankGeometry>> {
    geometry_with(model, topo, &TensorIndex::new(model))
}

/// The boxes publisher rank `rank` offers (one rank of [`publisher_geometry`]): the topology is
/// validated and a rank outside it is `InvalidInput` naming the rank.
pub fn rank_geometry(
    model: &ModelConfig,
    topo: &PublisherTopology,
    rank: u32,
) -> Result<RankGeometry> {
    topo.validate()?;
    if rank >= topo.world() {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "publisher rank {rank} is outside the topology's {} ranks",
                topo.world()
            ),
        )
        .with_owner(rank));
    }
    publisher_geometry(model, topo)?
        .into_iter()
        .find(|g| g.rank == rank)
        .ok_or_else(|| {
            Error::new(
                ErrorKind::Internal,
                format!("the topology has no geometry for rank {rank}"),
            )
        })
}

fn geometry_with(
    model: &ModelConfig,
    topo: &PublisherTopology,
    idx: &TensorIndex,
) -> Result<Vec<RankGeometry>> {
    model.validate()?;
    topo.validate()?;
    let plan = StagePlan::new(model, topo)?;
    (0..topo.world())
        .map(|rank| {
            Ok(RankGeometry {
                rank,
                shards: rank_shards(model, topo, &plan, idx, rank)?,
            })
        })
        .collect()
}

/// Checked, model-wide facts shared by every rank.
struct StagePlan {
    layers_per_stage: u64,
    experts_per_rank: u64,
}

impl StagePlan {
    fn new(model: &ModelConfig, topo: &PublisherTopology) -> Result<Self> {
        let cfg = |m: String| Error::new(ErrorKind::Config, m);
        let pp = topo.pp as u64;
        if model.layers % pp != 0 {
            return Err(cfg(format!(
                "{} layers of {} do not split evenly over pp={pp}",
                model.layers, model.name
            )));
        }
        check_heads(model, topo.tp)?;
        // Validates the KV split once, naming k_proj, before any rank is built.
        if has_kv_heads(model) {
            kv_rows_for_rank(model, topo.tp, 0)?;
        }
        let experts_per_rank = match &model.moe {
            Some(m) => {
                let (ep, dp) = (topo.ep as u64, topo.dp as u64);
                if dp % ep != 0 {
                    return Err(cfg(format!(
                        "ep={ep} must divide dp={dp}: expert parallelism lives inside data \
                         parallelism"
                    )));
                }
                if m.experts % ep != 0 {
                    return Err(cfg(format!(
                        "{} experts of {} do not split evenly over ep={ep}",
                        m.experts, model.name
                    )));
                }
                m.experts / ep
            }
            None if topo.ep > 1 => {
                return Err(cfg(format!(
                    "ep={} given but {} is a dense model with no experts",
                    topo.ep, model.name
                )))
            }
            None => 0,
        };
        Ok(StagePlan {
            layers_per_stage: model.layers / pp,
            experts_per_rank,
        })
    }
}

fn rank_shards(
    model: &ModelConfig,
    topo: &PublisherTopology,
    plan: &StagePlan,
    idx: &TensorIndex,
    rank: u32,
) -> Result<Vec<ShardGeometry>> {
    let (t, dp_rank, pp_rank) = topo.coords(rank);
    let mut out = Vec::new();
    if pp_rank == 0 {
        stage_shards(model, topo, plan, idx, (t, dp_rank), idx.first(), &mut out)?;
    }
    let first = pp_rank as u64 * plan.layers_per_stage;
    for l in first..first + plan.layers_per_stage {
        stage_shards(model, topo, plan, idx, (t, dp_rank), idx.layer(l), &mut out)?;
    }
    if pp_rank + 1 == topo.pp {
        stage_shards(model, topo, plan, idx, (t, dp_rank), idx.last(), &mut out)?;
    }
    Ok(out)
}

/// The boxes TP rank `t` of DP rank `dp_rank` offers of tensors `range` (one layer or the
/// globals), by each tensor's rule: vocab- and column-parallel tensors a dim-0 slice,
/// row-parallel a dim-1 slice, replicated whole, routed experts of this rank's EP group TP-sliced,
/// and the parts of the fused QKV per KV group (see [`publisher_geometry`]).
fn stage_shards(
    model: &ModelConfig,
    topo: &PublisherTopology,
    plan: &StagePlan,
    idx: &TensorIndex,
    (t, dp_rank): (u32, u32),
    range: std::ops::Range<usize>,
    out: &mut Vec<ShardGeometry>,
) -> Result<()> {
    let tp = topo.tp;
    // Tensors are pushed by index: a trillion-parameter job has ~1M offers, and looking each
    // one's name up again cost more than building it.
    let mut push = |tensor: usize, tensor_box: TensorBox| {
        out.push(ShardGeometry { tensor, tensor_box });
    };
    let specs = idx.specs();
    let ep_rank = (dp_rank % topo.ep) as u64;
    let per = plan.experts_per_rank;
    let mut qkv_done: Vec<(&str, bool)> = Vec::new();
    for i in range.clone() {
        let rule = idx.rule(i)?;
        let place = idx.place(i);
        let spec = &specs[i];
        match rule.shard {
            Shard::Replicated => push(i, spec.full_box()),
            Shard::Vocab | Shard::Column => push(i, column_parallel(spec, tp, t)?),
            Shard::Row => push(i, row_parallel(spec, tp, t)?),
            Shard::ExpertColumn | Shard::ExpertRow => {
                if place.expert / per.max(1) == ep_rank && per > 0 {
                    let b = if rule.shard == Shard::ExpertColumn {
                        column_parallel(spec, tp, t)?
                    } else {
                        row_parallel(spec, tp, t)?
                    };
                    push(i, b);
                }
            }
            Shard::QHeads | Shard::KvHeads => {
                let key = (rule.engine, place.scale);
                if qkv_done.contains(&key) {
                    continue;
                }
                qkv_done.push(key);
                // Megatron's fused QKV is stored group by group: every part of this fused
                // parameter, one KV group after another.
                let parts: Vec<usize> = range
                    .clone()
                    .filter(|&j| {
                        idx.rule(j).is_ok_and(|r| r.engine == rule.engine)
                            && idx.place(j).scale == place.scale
                    })
                    .collect();
                qkv_groups(model, topo, idx, t, &parts, &mut push)?;
            }
        }
    }
    Ok(())
}

/// The per-KV-group boxes of the parts (`q`, `k`, `v`, in slot order) of one fused QKV
/// parameter that TP rank `t` offers. With more TP ranks than KV heads, the ranks sharing a
/// group each hold a slice of its q rows and only the first of them offers the group's k and v.
fn qkv_groups(
    model: &ModelConfig,
    topo: &PublisherTopology,
    idx: &TensorIndex,
    t: u32,
    parts: &[usize],
    push: &mut impl FnMut(usize, TensorBox),
) -> Result<()> {
    let (tp64, t64, kv) = (topo.tp as u64, t as u64, model.kv_heads);
    let rows = |j: usize| -> Result<u64> {
        let spec = &idx.specs()[j];
        let rows = spec.shape[0];
        if rows % kv != 0 {
            return Err(Error::new(
                ErrorKind::Layout,
                format!("{rows} rows are not divisible by {kv} KV groups"),
            )
            .with_tensor(&spec.name));
        }
        Ok(rows / kv)
    };
    if tp64 <= kv {
        let per = kv / tp64;
        for g in t64 * per..(t64 + 1) * per {
            for &j in parts {
                let r = rows(j)?;
                push(j, row_block(&idx.specs()[j], g * r, r));
            }
        }
    } else {
        let r = tp64 / kv;
        let g = t64 / r;
        for &j in parts {
            let spec = &idx.specs()[j];
            let n = rows(j)?;
            if idx.rule(j)?.shard == Shard::QHeads {
                let sub = n / r;
                push(j, row_block(spec, g * n + (t64 % r) * sub, sub));
            } else if t64 % r == 0 {
                push(j, row_block(spec, g * n, n));
            }
        }
    }
    Ok(())
}

/// Gives every offer of `tables` the digests a production publisher sends (a whole digest and
/// row-chunk and column-block digests on the standard grid, [`reshard_core::PartDigests`]),
/// with placeholder values: what a plan holds depends on which digests exist and on their grid,
/// never on their values, so a geometry table planned this way plans what a deployment does.
pub fn with_digest_placeholders(tables: &mut [ShardTable]) {
    for t in tables {
        let elem: rustc_hash::FxHashMap<&str, u64> = t
            .tensors
            .iter()
            .map(|s| (s.name.as_str(), s.dtype.size()))
            .collect();
        for o in &mut t.offers {
            // An offer of an undeclared tensor gets none: validation refuses it anyway.
            let Some(&elem) = elem.get(o.tensor.as_str()) else {
                continue;
            };
            let v = reshard_core::MatrixView::of(&o.tensor_box.extent);
            let (chunk_rows, block_cols) = v.grid(elem);
            o.digest = Some(reshard_core::Digest([0; 16]));
            o.parts = Some(reshard_core::PartDigests {
                chunk_rows,
                chunks: vec![0; v.rows.div_ceil(chunk_rows) as usize],
                block_cols,
                blocks: vec![0; v.cols.div_ceil(block_cols) as usize],
            });
        }
    }
}

/// Geometry-only shard tables (no bytes): each rank's offers packed back to back in region 0
/// in shard order, in DRAM, without digests ([`with_digest_placeholders`] adds them), published
/// by agent `publisher-{rank}`.
pub fn geometry_tables(
    model: &ModelConfig,
    topo: &PublisherTopology,
    step: u64,
) -> Result<Vec<ShardTable>> {
    let idx = TensorIndex::new(model);
    let geometry = geometry_with(model, topo, &idx)?;
    let specs = idx.specs();
    let mut tables = Vec::with_capacity(geometry.len());
    for g in geometry {
        let mut table = ShardTable::new(g.rank, format!("publisher-{}", g.rank), step);
        let mut declared = vec![false; specs.len()];
        let mut offset = 0u64;
        for s in g.shards {
            let spec = &specs[s.tensor];
            if !declared[s.tensor] {
                declared[s.tensor] = true;
                table.tensors.push(spec.clone());
            }
            let bytes = s.tensor_box.elements() * spec.dtype.size();
            table.offers.push(ShardOffer {
                tensor: spec.name.clone(),
                tensor_box: s.tensor_box,
                location: OfferLocation {
                    region: 0,
                    offset,
                    memory: MemoryKind::Dram,
                },
                digest: None,
                parts: None,
            });
            offset = offset.checked_add(bytes).ok_or_else(|| {
                Error::new(
                    ErrorKind::Config,
                    "publisher rank holds more than u64 bytes",
                )
                .with_owner(g.rank)
            })?;
        }
        tables.push(table);
    }
    Ok(tables)
}
