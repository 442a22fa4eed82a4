//! Receiver layouts: the parameters a vLLM (TP, DP, EP) rank holds and the source boxes that
//! fill them, plus the slicing building blocks (column- and row-parallel boxes) that the
//! publisher topologies share.
//!
//! vLLM fuses several HF tensors into one parameter (`qkv_proj`, `gate_up_proj`, the stacked
//! experts `w13_weight` / `w2_weight`), so one parameter is filled by several copies, each a box
//! of one source tensor landing at its own byte offset.

use reshard_core::layout::row_major_strides;
use reshard_core::{
    Error, ErrorKind, ParamSpec, Result, TensorBox, TensorSpec, WantedCopy, WantedLayout,
};

use crate::families::{Family, Rule, Scope, Shard, SCALE_SUFFIX};
use crate::presets::{layer_tensor, ModelConfig, Placement};
use crate::topology::ReceiverTopology;

/// Part `index` of `parts` equal slices of `shape` along dimension `dim`, whole in every other
/// dimension. A `Layout` error names the tensor and the extent when `parts` does not divide it.
pub fn split_box(
    tensor: &str,
    shape: &[u64],
    dim: usize,
    parts: u64,
    index: u64,
) -> Result<TensorBox> {
    let err = |m: String| Error::new(ErrorKind::Layout, m).with_tensor(tensor);
    let Some(&extent) = shape.get(dim) else {
        return Err(err(format!(
            "cannot split dimension {dim} of a rank-{} tensor {shape:?}",
            shape.len()
        )));
    };
    if parts == 0 || index >= parts {
        return Err(err(format!(
            "slice {index} of {parts} does not exist (dimension {dim}, extent {extent})"
        )));
    }
    if extent % parts != 0 {
        return Err(err(format!(
            "extent {extent} of dimension {dim} (shape {shape:?}) is not divisible by {parts}"
        )));
    }
    let len = extent / parts;
    let mut offset = vec![0; shape.len()];
    let mut ext = shape.to_vec();
    offset[dim] = index * len;
    ext[dim] = len;
    Ok(TensorBox::new(offset, ext))
}

/// The dim-0 (output) slice of a column-parallel tensor held by TP rank `rank` of `tp`.
pub fn column_parallel(spec: &TensorSpec, tp: u32, rank: u32) -> Result<TensorBox> {
    split_box(&spec.name, &spec.shape, 0, tp as u64, rank as u64)
}

/// vLLM pads a vocabulary to a multiple of this many rows before it splits it over TP ranks
/// (`VocabParallelEmbedding`, `ParallelLMHead`; docs/models.md).
pub const VOCAB_PADDING: u64 = 64;

/// The rows of a vocab-parallel tensor (`[vocab, ...]`) that TP rank `rank` of `tp` holds, and
/// how many rows its parameter has. As vLLM does it: the vocabulary is padded to a multiple of
/// [`VOCAB_PADDING`], each rank's parameter has `padded / tp` rows, rank `r` holds the real rows
/// from `r * padded / tp` on, and the rows past the real vocabulary are padding (zero, never
/// read). With a vocabulary that is a multiple of 64 this is [`column_parallel`].
pub fn vocab_parallel(spec: &TensorSpec, tp: u32, rank: u32) -> Result<(TensorBox, u64)> {
    let err = |m: String| Error::new(ErrorKind::Layout, m).with_tensor(&spec.name);
    let Some(&vocab) = spec.shape.first() else {
        return Err(err(
            "a vocab-parallel tensor has no dimension to split".into()
        ));
    };
    let padded = vocab
        .div_ceil(VOCAB_PADDING)
        .checked_mul(VOCAB_PADDING)
        .ok_or_else(|| err(format!("vocabulary {vocab} overflows when padded")))?;
    let tp = tp as u64;
    if tp == 0 || rank as u64 >= tp || padded % tp != 0 {
        return Err(err(format!(
            "the vocabulary of {vocab} rows, padded to {padded} (a multiple of \
             {VOCAB_PADDING}), does not split into {tp} TP ranks (rank {rank})"
        )));
    }
    let per = padded / tp;
    let lo = (rank as u64 * per).min(vocab);
    let hi = (rank as u64 * per + per).min(vocab);
    if lo == hi {
        return Err(err(format!(
            "TP rank {rank} of {tp} would hold only padding of the vocabulary ({vocab} rows \
             padded to {padded}, {per} per rank): use fewer TP ranks"
        )));
    }
    Ok((row_block(spec, lo, hi - lo), per))
}

/// The dim-1 (input) slice of a row-parallel tensor held by TP rank `rank` of `tp`.
pub fn row_parallel(spec: &TensorSpec, tp: u32, rank: u32) -> Result<TensorBox> {
    split_box(&spec.name, &spec.shape, 1, tp as u64, rank as u64)
}

/// The dim-0 rows `start..start + len` of a tensor, whole in every other dimension.
pub fn row_block(spec: &TensorSpec, start: u64, len: u64) -> TensorBox {
    let mut b = spec.full_box();
    b.offset[0] = start;
    b.extent[0] = len;
    b
}

/// A copy of `src_box` of `spec` landing `dst_element` elements into a parameter whose
/// row-major strides are `dst_strides` (the byte offset uses the tensor's element size).
pub fn copy_at(
    spec: &TensorSpec,
    src_box: TensorBox,
    dst_element: u64,
    dst_strides: Vec<u64>,
) -> WantedCopy {
    WantedCopy {
        tensor: spec.name.clone(),
        src_box,
        dst_offset: dst_element * spec.dtype.size(),
        dst_strides,
    }
}

/// A parameter that is the whole tensor under the same name (norms, the MoE router).
pub fn replicated(spec: &TensorSpec) -> ParamSpec {
    ParamSpec {
        name: spec.name.clone(),
        dtype: spec.dtype,
        shape: spec.shape.clone(),
        copies: vec![copy_at(
            spec,
            spec.full_box(),
            0,
            row_major_strides(&spec.shape),
        )],
    }
}

/// A parameter holding exactly one box of one tensor, under the tensor's name (a plain column-
/// or row-parallel weight).
pub fn sliced(spec: &TensorSpec, src_box: TensorBox) -> ParamSpec {
    let shape = src_box.extent.clone();
    ParamSpec {
        name: spec.name.clone(),
        dtype: spec.dtype,
        copies: vec![copy_at(spec, src_box, 0, row_major_strides(&shape))],
        shape,
    }
}

/// The tensors of a model with where each comes from, split into the leading globals, each
/// layer and the trailing globals, so layouts and geometry walk positions, never names: a
/// trillion-parameter layout has ~70k expert copies per rank, and formatting plus hashing each
/// name dominated building it.
pub(crate) struct TensorIndex {
    specs: Vec<TensorSpec>,
    places: Vec<Placement>,
    /// `bounds[0]` is where layer 0 starts, `bounds[l + 1]` where layer `l` ends (and the
    /// trailing globals start after the last).
    bounds: Vec<usize>,
    family: Option<&'static Family>,
}

impl TensorIndex {
    pub(crate) fn new(model: &ModelConfig) -> Self {
        let (specs, places): (Vec<_>, Vec<_>) = model.placed_tensors().into_iter().unzip();
        let family = model.family().ok();
        let layered = |p: &Placement| {
            family.is_some_and(|f| matches!(f.rules[p.rule].scope, Scope::Layer | Scope::Expert))
        };
        let mut bounds = Vec::with_capacity(model.layers as usize + 1);
        let first = places.iter().position(layered).unwrap_or_else(|| {
            places
                .iter()
                .position(|p| family.is_some_and(|f| f.rules[p.rule].scope == Scope::Last))
                .unwrap_or(places.len())
        });
        bounds.push(first);
        let mut at = first;
        for l in 0..model.layers {
            while at < places.len() && layered(&places[at]) && places[at].layer == l {
                at += 1;
            }
            bounds.push(at);
        }
        TensorIndex {
            specs,
            places,
            bounds,
            family,
        }
    }

    pub(crate) fn specs(&self) -> &[TensorSpec] {
        &self.specs
    }

    /// The rule of tensor `i`.
    pub(crate) fn rule(&self, i: usize) -> Result<&'static Rule> {
        self.family
            .map(|f| &f.rules[self.places[i].rule])
            .ok_or_else(|| Error::new(ErrorKind::Internal, "model has no family table"))
    }

    pub(crate) fn place(&self, i: usize) -> Placement {
        self.places[i]
    }

    /// Tensor positions of the leading globals.
    pub(crate) fn first(&self) -> std::ops::Range<usize> {
        0..self.bounds[0]
    }

    /// Tensor positions of layer `l`.
    pub(crate) fn layer(&self, l: u64) -> std::ops::Range<usize> {
        self.bounds[l as usize]..self.bounds[l as usize + 1]
    }

    /// Tensor positions of the trailing globals.
    pub(crate) fn last(&self) -> std::ops::Range<usize> {
        self.bounds[self.bounds.len() - 1]..self.specs.len()
    }
}

/// KV heads a receiver (or publisher) TP rank holds: `(first head, heads)`. With at least as many
/// KV heads as ranks they are split; with fewer, each head is replicated over `tp / kv_heads`
/// consecutive ranks.
fn kv_heads_for_rank(model: &ModelConfig, tp: u32, rank: u32) -> Result<(u64, u64)> {
    let (kv, hd, tp64, t) = (model.kv_heads, model.head_dim, tp as u64, rank as u64);
    let name = layer_tensor(0, "self_attn.k_proj.weight");
    let err = |m: String| Error::new(ErrorKind::Layout, m).with_tensor(&name);
    if tp == 0 || t >= tp64 {
        return Err(err(format!("TP rank {rank} of {tp} does not exist")));
    }
    if kv >= tp64 {
        if kv % tp64 != 0 {
            return Err(err(format!(
                "{kv} KV heads (extent {} rows) are not divisible by TP {tp}",
                kv * hd
            )));
        }
        let per = kv / tp64;
        Ok((t * per, per))
    } else {
        if tp64 % kv != 0 {
            return Err(err(format!(
                "TP {tp} is not a multiple of {kv} KV heads (extent {} rows), so KV heads \
                 cannot be replicated evenly",
                kv * hd
            )));
        }
        Ok((t / (tp64 / kv), 1))
    }
}

/// Rows of `k_proj`/`v_proj` a receiver (or publisher) TP rank holds: `(first row, rows)`.
/// With at least as many KV heads as ranks they are split; with fewer, each head is replicated
/// over `tp / kv_heads` consecutive ranks.
pub fn kv_rows_for_rank(model: &ModelConfig, tp: u32, rank: u32) -> Result<(u64, u64)> {
    let (first, n) = kv_heads_for_rank(model, tp, rank)?;
    Ok((first * model.head_dim, n * model.head_dim))
}

/// Checks query heads split evenly over `tp`, naming `q_proj` and its extent otherwise.
pub(crate) fn check_heads(model: &ModelConfig, tp: u32) -> Result<()> {
    if tp == 0 || model.heads % tp as u64 != 0 {
        return Err(Error::new(
            ErrorKind::Layout,
            format!(
                "{} query heads (extent {} rows) are not divisible by TP {tp}",
                model.heads,
                model.q_rows()
            ),
        )
        .with_tensor(layer_tensor(0, "self_attn.q_proj.weight")));
    }
    Ok(())
}

/// Whether the model's family has `QKVParallelLinear` key/value parts (GQA attention).
pub(crate) fn has_kv_heads(model: &ModelConfig) -> bool {
    model
        .family()
        .is_ok_and(|f| f.rules.iter().any(|r| r.shard == Shard::KvHeads))
}

/// The dim-0 rows `rows` (in weight rows) of a tensor that is the fp8 scale of a weight when
/// `scale` is set: rows divided by the block height, a `Layout` error naming the tensor when
/// they do not fall on block boundaries.
pub(crate) fn scaled_rows(
    model: &ModelConfig,
    spec: &TensorSpec,
    (start, len): (u64, u64),
    scale: bool,
) -> Result<TensorBox> {
    if !scale {
        return Ok(row_block(spec, start, len));
    }
    let b = model.arch.fp8_block.map_or(1, |b| b[0]);
    if start % b != 0 || len % b != 0 {
        return Err(Error::new(
            ErrorKind::Layout,
            format!(
                "rows {start}..{} do not fall on the fp8 block height {b}",
                start + len
            ),
        )
        .with_tensor(&spec.name));
    }
    Ok(row_block(spec, start / b, len / b))
}

/// The wanted layout of vLLM receiver rank `rank` (in `0..recv.world()`) of `recv`, as the
/// model's family table says: each tensor sliced by its rule (vocab-, column- or row-parallel,
/// replicated, the rank's KV heads) and landing in its engine parameter at its slot (fused
/// parameters such as `qkv_proj`, `gate_up_proj` or `fused_qkv_a_proj` concatenate their slots
/// along dim 0; stacked experts `w13_weight` / `w2_weight` hold one such block per expert). One
/// copy per source tensor. Everything but the experts follows the rank's TP rank (the same on
/// every DP replica); experts are TP-sliced (`ep = 1`) or this rank's block of whole experts
/// (`ep = tp * dp`).
pub fn receiver_layout(
    model: &ModelConfig,
    recv: &ReceiverTopology,
    rank: u32,
) -> Result<WantedLayout> {
    ReceiverLayouts::new(model, recv)?.layout(rank)
}

/// The wanted layouts of every rank of `recv`, in rank order (`recv.world()` of them).
pub fn receiver_layouts(model: &ModelConfig, recv: &ReceiverTopology) -> Result<Vec<WantedLayout>> {
    let b = ReceiverLayouts::new(model, recv)?;
    (0..recv.world()).map(|r| b.layout(r)).collect()
}

/// Builds the wanted layouts of one receiver topology, rank by rank, after checking the model
/// and topology once; the tensor index is shared so a layout costs only its own copies (at
/// trillion-parameter scale indexing every tensor per rank would dominate).
pub struct ReceiverLayouts<'m> {
    model: &'m ModelConfig,
    recv: ReceiverTopology,
    idx: TensorIndex,
}

/// One engine parameter being filled: its copies, and the rows each slot takes.
struct Acc {
    rule: &'static Rule,
    scale: bool,
    /// Rows and trailing dims of each slot (from its first tensor).
    slots: Vec<Option<(u64, Vec<u64>)>>,
    /// (tensor, box, slot, expert position in the stacked parameter).
    copies: Vec<(usize, TensorBox, usize, u64)>,
}

impl<'m> ReceiverLayouts<'m> {
    /// Checks `model` and `recv` (heads, KV split, experts over `ep`) and indexes the tensors.
    pub fn new(model: &'m ModelConfig, recv: &ReceiverTopology) -> Result<Self> {
        model.validate()?;
        recv.validate_for(model)?;
        check_heads(model, recv.tp)?;
        if has_kv_heads(model) {
            kv_rows_for_rank(model, recv.tp, 0)?;
        }
        Ok(ReceiverLayouts {
            model,
            recv: *recv,
            idx: TensorIndex::new(model),
        })
    }

    /// The receiver topology these layouts are for.
    pub fn topology(&self) -> &ReceiverTopology {
        &self.recv
    }

    /// Number of receiver ranks (`tp * dp`).
    pub fn world(&self) -> u32 {
        self.recv.world()
    }

    /// The wanted layout of receiver rank `rank`; a rank outside the world is a `Layout` error.
    pub fn layout(&self, rank: u32) -> Result<WantedLayout> {
        let (model, recv, idx) = (self.model, &self.recv, &self.idx);
        if rank >= recv.world() {
            return Err(Error::new(
                ErrorKind::Layout,
                format!("receiver rank {rank} does not exist in {recv}"),
            ));
        }
        let mut params = Vec::with_capacity(model.layers as usize * 8 + 3);
        self.fill(rank, 0, idx.first(), &mut params)?;
        for l in 0..model.layers {
            self.fill(rank, l, idx.layer(l), &mut params)?;
        }
        self.fill(rank, 0, idx.last(), &mut params)?;
        let layout = WantedLayout {
            receiver_rank: rank,
            params,
        };
        layout.validate()?;
        Ok(layout)
    }

    /// Experts `(first, count)` whose stacked parameters this rank holds.
    fn local_experts(&self, rank: u32) -> (u64, u64) {
        let experts = self.model.moe.as_ref().map_or(0, |m| m.experts);
        if self.recv.expert_parallel() {
            // validate_for checked that ep divides the experts (vLLM's linear placement).
            let per = experts / self.recv.ep as u64;
            (rank as u64 * per, per)
        } else {
            (0, experts)
        }
    }

    /// The box of tensor `i` that receiver rank `rank` holds, its expert position in a stacked
    /// parameter, and the rows it takes in its parameter's slot (more than the box's for a
    /// padded vocabulary); `None` for an expert this rank does not hold.
    fn wanted_box(&self, rank: u32, i: usize) -> Result<Option<(TensorBox, u64, u64)>> {
        let (model, idx, tp) = (self.model, &self.idx, self.recv.tp);
        let (tp_rank, _) = self.recv.coords(rank);
        let spec = &idx.specs()[i];
        let place = idx.place(i);
        let b = match idx.rule(i)?.shard {
            Shard::Replicated => spec.full_box(),
            Shard::Vocab => {
                let (b, rows) = vocab_parallel(spec, tp, tp_rank)?;
                return Ok(Some((b, 0, rows)));
            }
            Shard::Column | Shard::QHeads => column_parallel(spec, tp, tp_rank)?,
            Shard::Row => row_parallel(spec, tp, tp_rank)?,
            Shard::KvHeads => {
                let (first, n) = kv_heads_for_rank(model, tp, tp_rank)?;
                let hd = model.head_dim;
                scaled_rows(model, spec, (first * hd, n * hd), place.scale)?
            }
            Shard::ExpertColumn | Shard::ExpertRow => {
                let (first, count) = self.local_experts(rank);
                let e = place.expert;
                if e < first || e >= first + count {
                    return Ok(None);
                }
                let b = if self.recv.expert_parallel() {
                    spec.full_box()
                } else if idx.rule(i)?.shard == Shard::ExpertColumn {
                    column_parallel(spec, tp, tp_rank)?
                } else {
                    row_parallel(spec, tp, tp_rank)?
                };
                let rows = b.extent[0];
                return Ok(Some((b, e - first, rows)));
            }
        };
        let rows = b.extent[0];
        Ok(Some((b, 0, rows)))
    }

    /// Appends the parameters filled by tensors `range` (one layer, or the globals) of rank
    /// `rank`, in the order their first tensor appears.
    fn fill(
        &self,
        rank: u32,
        layer: u64,
        range: std::ops::Range<usize>,
        params: &mut Vec<ParamSpec>,
    ) -> Result<()> {
        let idx = &self.idx;
        let mut accs: Vec<Acc> = Vec::new();
        let (first, count) = self.local_experts(rank);
        let mut i = range.start;
        while i < range.end {
            // An expert block is every expert's tensors in expert order, `per` each: jump
            // straight to this rank's experts (a trillion-parameter layer has 1,152 expert
            // tensors, and an EP rank holds 9 of them).
            if idx.rule(i)?.scope == Scope::Expert && idx.place(i).expert == 0 {
                let per = (i..range.end)
                    .take_while(|&k| {
                        idx.place(k).expert == 0
                            && idx.rule(k).is_ok_and(|r| r.scope == Scope::Expert)
                    })
                    .count();
                let experts = self.model.moe.as_ref().map_or(0, |m| m.experts) as usize;
                let block_end = i + per * experts;
                let mine = i + per * first as usize..i + per * (first + count) as usize;
                for k in mine {
                    self.push_copy(rank, k, &mut accs)?;
                }
                i = block_end;
                continue;
            }
            self.push_copy(rank, i, &mut accs)?;
            i += 1;
        }
        let experts = self.local_experts(rank).1;
        for acc in accs {
            params.push(self.param(acc, layer, experts)?);
        }
        Ok(())
    }

    /// Adds tensor `i`'s copy (if rank `rank` wants any of it) to its engine parameter.
    fn push_copy(&self, rank: u32, i: usize, accs: &mut Vec<Acc>) -> Result<()> {
        let idx = &self.idx;
        {
            let Some((b, j, rows)) = self.wanted_box(rank, i)? else {
                return Ok(());
            };
            let rule = idx.rule(i)?;
            let scale = idx.place(i).scale;
            let at = match accs
                .iter()
                .position(|a| a.rule.engine == rule.engine && a.scale == scale)
            {
                Some(at) => at,
                None => {
                    accs.push(Acc {
                        rule,
                        scale,
                        slots: Vec::new(),
                        copies: Vec::new(),
                    });
                    accs.len() - 1
                }
            };
            let acc = &mut accs[at];
            let slot = rule.slot as usize;
            if acc.slots.len() <= slot {
                acc.slots.resize(slot + 1, None);
            }
            if acc.slots[slot].is_none() {
                acc.slots[slot] = Some((rows, b.extent[1..].to_vec()));
            }
            acc.copies.push((i, b, slot, j));
        }
        Ok(())
    }

    /// The parameter an accumulated engine parameter becomes: slots concatenated along dim 0,
    /// experts stacked in front for an expert rule.
    fn param(&self, acc: Acc, layer: u64, experts: u64) -> Result<ParamSpec> {
        let idx = &self.idx;
        let mut name = acc.rule.engine_name(layer);
        if acc.scale {
            name = format!("{}{}", &name[..name.len() - "weight".len()], SCALE_SUFFIX);
        }
        let internal = |m: String| Error::new(ErrorKind::Internal, m).with_tensor(&name);
        let mut offsets = Vec::with_capacity(acc.slots.len());
        let mut rows = 0u64;
        let mut rest: Option<&Vec<u64>> = None;
        for (s, slot) in acc.slots.iter().enumerate() {
            let Some((r, tail)) = slot else {
                return Err(internal(format!(
                    "slot {s} of the fused parameter has no tensor"
                )));
            };
            if rest.is_some_and(|x| x != tail) {
                return Err(internal(
                    "fused slots disagree in their trailing dims".into(),
                ));
            }
            rest = Some(tail);
            offsets.push(rows);
            rows += r;
        }
        let rest = rest.cloned().unwrap_or_default();
        let inner: u64 = rest.iter().product();
        let mut block = vec![rows];
        block.extend_from_slice(&rest);
        let strides = row_major_strides(&block);
        let stacked = acc.rule.scope == Scope::Expert;
        let shape = if stacked {
            let mut s = vec![experts];
            s.extend_from_slice(&block);
            s
        } else {
            block
        };
        let dtype = idx.specs()[acc.copies[0].0].dtype;
        let copies = acc
            .copies
            .into_iter()
            .map(|(i, b, slot, j)| {
                let at = (j * rows + offsets[slot]) * inner;
                copy_at(&idx.specs()[i], b, at, strides.clone())
            })
            .collect();
        Ok(ParamSpec {
            name,
            dtype,
            shape,
            copies,
        })
    }
}
