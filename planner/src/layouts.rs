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

use crate::presets::{expert_tensor, layer_norm_suffixes, layer_tensor, ModelConfig};
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

/// Looks tensors of a model up by name, so shapes have one source: [`ModelConfig::tensors`].
pub(crate) struct TensorIndex {
    specs: Vec<TensorSpec>,
    by_name: rustc_hash::FxHashMap<String, usize>,
    /// Position of layer 0's first expert tensor in `specs` (MoE models only).
    first_expert: usize,
    /// Tensors per decoder layer.
    per_layer: usize,
    /// Experts per layer (0 for a dense model).
    experts: u64,
}

/// Projections of one expert, in [`ModelConfig::tensors`] order.
pub(crate) const EXPERT_PROJS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

impl TensorIndex {
    pub(crate) fn new(model: &ModelConfig) -> Self {
        let specs = model.tensors();
        let by_name = specs
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.clone(), i))
            .collect();
        // ModelConfig::tensors order: the embedding, then per layer q, k, v, o, the norms and,
        // for MoE, the router followed by every expert's gate, up and down projections.
        let norms = layer_norm_suffixes(model).len();
        let experts = model.moe.as_ref().map_or(0, |m| m.experts);
        let mlp = if model.moe.is_some() {
            1 + 3 * experts as usize
        } else {
            3
        };
        TensorIndex {
            specs,
            by_name,
            first_expert: 1 + 4 + norms + 1,
            per_layer: 4 + norms + mlp,
            experts,
        }
    }

    /// Index of a tensor; a missing name is a bug in this crate, reported, not panicked on.
    pub(crate) fn index(&self, name: &str) -> Result<usize> {
        self.by_name.get(name).copied().ok_or_else(|| {
            Error::new(ErrorKind::Internal, "model does not define this tensor").with_tensor(name)
        })
    }

    pub(crate) fn spec(&self, name: &str) -> Result<&TensorSpec> {
        Ok(&self.specs[self.index(name)?])
    }

    /// Index of projection `proj` (an index into [`EXPERT_PROJS`]) of expert `e` of layer `l`,
    /// by position rather than by name: a trillion-parameter layout has ~70k expert copies per
    /// rank, and formatting plus hashing each name dominated building it.
    pub(crate) fn expert_index(&self, l: u64, e: u64, proj: usize) -> Result<usize> {
        let i = (e < self.experts && proj < EXPERT_PROJS.len())
            .then(|| {
                let layer = usize::try_from(l).ok()?.checked_mul(self.per_layer)?;
                layer.checked_add(self.first_expert + 3 * e as usize + proj)
            })
            .flatten()
            .filter(|&i| i < self.specs.len());
        let Some(i) = i else {
            let proj = EXPERT_PROJS.get(proj).copied().unwrap_or("?");
            return Err(
                Error::new(ErrorKind::Internal, "model does not define this tensor")
                    .with_tensor(expert_tensor(l, e, proj)),
            );
        };
        debug_assert_eq!(self.specs[i].name, expert_tensor(l, e, EXPERT_PROJS[proj]));
        Ok(i)
    }

    /// Spec of projection `proj` of expert `e` of layer `l` (see [`TensorIndex::expert_index`]).
    pub(crate) fn expert(&self, l: u64, e: u64, proj: usize) -> Result<&TensorSpec> {
        Ok(&self.specs[self.expert_index(l, e, proj)?])
    }

    pub(crate) fn specs(&self) -> &[TensorSpec] {
        &self.specs
    }
}

/// Rows of `k_proj`/`v_proj` a receiver (or publisher) TP rank holds: `(first row, rows)`.
/// With at least as many KV heads as ranks they are split; with fewer, each head is replicated
/// over `tp / kv_heads` consecutive ranks.
pub fn kv_rows_for_rank(model: &ModelConfig, tp: u32, rank: u32) -> Result<(u64, u64)> {
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
        let per = kv / tp64 * hd;
        Ok((t * per, per))
    } else {
        if tp64 % kv != 0 {
            return Err(err(format!(
                "TP {tp} is not a multiple of {kv} KV heads (extent {} rows), so KV heads \
                 cannot be replicated evenly",
                kv * hd
            )));
        }
        Ok((t / (tp64 / kv) * hd, hd))
    }
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

/// The wanted layout of vLLM receiver rank `rank` (in `0..recv.world()`) of `recv`: fused
/// `qkv_proj` (q rows, then k, then v), row-parallel `o_proj`, whole norms and router, stacked
/// experts `w13_weight` (gate half then up half per expert) and `w2_weight`, or a dense
/// `gate_up_proj` / `down_proj`, and vocab-parallel embedding and `lm_head`. One copy per source
/// tensor. Everything but the experts follows the rank's TP rank (the same on every DP replica);
/// experts are TP-sliced (`ep = 1`) or this rank's block of whole experts (`ep = tp * dp`).
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

impl<'m> ReceiverLayouts<'m> {
    /// Checks `model` and `recv` (heads, KV split, experts over `ep`) and indexes the tensors.
    pub fn new(model: &'m ModelConfig, recv: &ReceiverTopology) -> Result<Self> {
        model.validate()?;
        recv.validate_for(model)?;
        check_heads(model, recv.tp)?;
        kv_rows_for_rank(model, recv.tp, 0)?;
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
        let tp = recv.tp;
        let (tp_rank, _) = recv.coords(rank);
        let (k_start, kr) = kv_rows_for_rank(model, tp, tp_rank)?;
        let (h, r64, t) = (model.hidden, tp as u64, tp_rank as u64);
        let qr = model.q_rows() / r64;
        let mut params = Vec::with_capacity(model.layers as usize * 8 + 3);

        let embed = idx.spec("model.embed_tokens.weight")?;
        params.push(sliced(embed, column_parallel(embed, tp, tp_rank)?));

        for l in 0..model.layers {
            let spec = |s: &str| idx.spec(&layer_tensor(l, s));
            let q = spec("self_attn.q_proj.weight")?;
            let k = spec("self_attn.k_proj.weight")?;
            let v = spec("self_attn.v_proj.weight")?;
            let rows = qr + 2 * kr;
            params.push(ParamSpec {
                name: layer_tensor(l, "self_attn.qkv_proj.weight"),
                dtype: model.dtype,
                shape: vec![rows, h],
                copies: vec![
                    copy_at(q, row_block(q, t * qr, qr), 0, vec![h, 1]),
                    copy_at(k, row_block(k, k_start, kr), qr * h, vec![h, 1]),
                    copy_at(v, row_block(v, k_start, kr), (qr + kr) * h, vec![h, 1]),
                ],
            });
            let o = spec("self_attn.o_proj.weight")?;
            params.push(sliced(o, row_parallel(o, tp, tp_rank)?));
            for n in layer_norm_suffixes(model) {
                params.push(replicated(spec(n)?));
            }
            match &model.moe {
                Some(moe) => {
                    params.push(replicated(spec("mlp.gate.weight")?));
                    let (w13, w2) = if recv.expert_parallel() {
                        self.whole_experts(l, moe.experts, moe.expert_intermediate, rank)?
                    } else {
                        self.sliced_experts(l, moe.experts, moe.expert_intermediate, tp_rank)?
                    };
                    params.push(w13);
                    params.push(w2);
                }
                None => {
                    let gate = spec("mlp.gate_proj.weight")?;
                    let up = spec("mlp.up_proj.weight")?;
                    let down = spec("mlp.down_proj.weight")?;
                    let ip = model.intermediate / r64;
                    let gate_box = column_parallel(gate, tp, tp_rank)?;
                    let up_box = column_parallel(up, tp, tp_rank)?;
                    params.push(ParamSpec {
                        name: layer_tensor(l, "mlp.gate_up_proj.weight"),
                        dtype: model.dtype,
                        shape: vec![2 * ip, h],
                        copies: vec![
                            copy_at(gate, gate_box, 0, vec![h, 1]),
                            copy_at(up, up_box, ip * h, vec![h, 1]),
                        ],
                    });
                    params.push(sliced(down, row_parallel(down, tp, tp_rank)?));
                }
            }
        }

        params.push(replicated(idx.spec("model.norm.weight")?));
        if !model.tied_embeddings {
            let head = idx.spec("lm_head.weight")?;
            params.push(sliced(head, column_parallel(head, tp, tp_rank)?));
        }
        let layout = WantedLayout {
            receiver_rank: rank,
            params,
        };
        layout.validate()?;
        Ok(layout)
    }

    /// Every expert of layer `l`, TP-sliced for TP rank `tp_rank`: `w13_weight`
    /// `[E, 2 * I / tp, h]` (column-parallel gate rows, then up rows, per expert) and
    /// `w2_weight` `[E, h, I / tp]` (row-parallel down columns).
    fn sliced_experts(
        &self,
        l: u64,
        e_count: u64,
        i: u64,
        tp_rank: u32,
    ) -> Result<(ParamSpec, ParamSpec)> {
        let (model, idx, tp) = (self.model, &self.idx, self.recv.tp);
        let h = model.hidden;
        let ip = i / tp as u64;
        let mut w13 = Vec::with_capacity(2 * e_count as usize);
        let mut w2 = Vec::with_capacity(e_count as usize);
        for e in 0..e_count {
            let gate = idx.expert(l, e, 0)?;
            let up = idx.expert(l, e, 1)?;
            let down = idx.expert(l, e, 2)?;
            let base = e * 2 * ip * h;
            w13.push(copy_at(
                gate,
                column_parallel(gate, tp, tp_rank)?,
                base,
                vec![h, 1],
            ));
            w13.push(copy_at(
                up,
                column_parallel(up, tp, tp_rank)?,
                base + ip * h,
                vec![h, 1],
            ));
            w2.push(copy_at(
                down,
                row_parallel(down, tp, tp_rank)?,
                e * h * ip,
                vec![ip, 1],
            ));
        }
        Ok(stacked_experts(model, l, e_count, ip, w13, w2))
    }

    /// Receiver rank `rank`'s block of whole experts of layer `l` (vLLM's linear expert
    /// placement: experts `[rank * E / ep, (rank + 1) * E / ep)`): `w13_weight`
    /// `[E / ep, 2 * I, h]` (gate rows, then up rows, per expert) and `w2_weight` `[E / ep, h, I]`.
    fn whole_experts(
        &self,
        l: u64,
        e_count: u64,
        i: u64,
        rank: u32,
    ) -> Result<(ParamSpec, ParamSpec)> {
        let (model, idx) = (self.model, &self.idx);
        let h = model.hidden;
        // validate_for checked that ep divides the experts.
        let per = e_count / self.recv.ep as u64;
        let first = rank as u64 * per;
        let mut w13 = Vec::with_capacity(2 * per as usize);
        let mut w2 = Vec::with_capacity(per as usize);
        for j in 0..per {
            let e = first + j;
            let gate = idx.expert(l, e, 0)?;
            let up = idx.expert(l, e, 1)?;
            let down = idx.expert(l, e, 2)?;
            let base = j * 2 * i * h;
            w13.push(copy_at(gate, gate.full_box(), base, vec![h, 1]));
            w13.push(copy_at(up, up.full_box(), base + i * h, vec![h, 1]));
            w2.push(copy_at(down, down.full_box(), j * h * i, vec![i, 1]));
        }
        Ok(stacked_experts(model, l, per, i, w13, w2))
    }
}

/// The stacked expert parameters of layer `l`: `w13_weight` `[experts, 2 * ip, h]` and
/// `w2_weight` `[experts, h, ip]` filled by the given copies.
fn stacked_experts(
    model: &ModelConfig,
    l: u64,
    experts: u64,
    ip: u64,
    w13: Vec<WantedCopy>,
    w2: Vec<WantedCopy>,
) -> (ParamSpec, ParamSpec) {
    let h = model.hidden;
    (
        ParamSpec {
            name: layer_tensor(l, "mlp.experts.w13_weight"),
            dtype: model.dtype,
            shape: vec![experts, 2 * ip, h],
            copies: w13,
        },
        ParamSpec {
            name: layer_tensor(l, "mlp.experts.w2_weight"),
            dtype: model.dtype,
            shape: vec![experts, h, ip],
            copies: w2,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets::{preset, MoeConfig};

    #[test]
    fn expert_positions_match_names_for_every_expert() {
        let mut models = vec![preset("qwen3-30b-a3b").unwrap(), preset("kimi-k2").unwrap()];
        let mut m = preset("qwen3-30b-a3b").unwrap();
        m.qk_norm = false;
        m.tied_embeddings = true;
        m.moe = Some(MoeConfig {
            experts: 3,
            expert_intermediate: 8,
        });
        models.push(m);
        for m in models {
            let idx = TensorIndex::new(&m);
            let experts = m.moe.as_ref().unwrap().experts;
            for l in 0..m.layers {
                for e in 0..experts {
                    for (p, proj) in EXPERT_PROJS.iter().enumerate() {
                        let name = expert_tensor(l, e, proj);
                        assert_eq!(
                            idx.expert_index(l, e, p).unwrap(),
                            idx.index(&name).unwrap()
                        );
                    }
                }
            }
            for (l, e, p) in [(m.layers, 0, 0), (0, experts, 0), (0, 0, 3)] {
                let err = idx.expert_index(l, e, p).unwrap_err();
                assert_eq!(err.kind(), ErrorKind::Internal);
            }
        }
        let dense = TensorIndex::new(&preset("llama-3-8b").unwrap());
        assert!(dense.expert_index(0, 0, 0).is_err());
    }
}
