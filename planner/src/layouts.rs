//! Receiver layouts: the parameters a vLLM tensor-parallel rank holds and the source boxes that
//! fill them, plus the slicing building blocks (column- and row-parallel boxes) that the
//! publisher topologies share.
//!
//! vLLM fuses several HF tensors into one parameter (`qkv_proj`, `gate_up_proj`, the stacked
//! experts `w13_weight` / `w2_weight`), so one parameter is filled by several copies, each a box
//! of one source tensor landing at its own byte offset.

use std::collections::HashMap;

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
    by_name: HashMap<String, usize>,
}

impl TensorIndex {
    pub(crate) fn new(model: &ModelConfig) -> Self {
        let specs = model.tensors();
        let by_name = specs
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.clone(), i))
            .collect();
        TensorIndex { specs, by_name }
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

/// The wanted layout of vLLM TP rank `rank` of `recv`: fused `qkv_proj` (q rows, then k, then
/// v), row-parallel `o_proj`, whole norms and router, stacked experts `w13_weight` (gate half
/// then up half per expert) and `w2_weight`, or a dense `gate_up_proj` / `down_proj`, and
/// vocab-parallel embedding and `lm_head`. One copy per source tensor.
pub fn receiver_layout(
    model: &ModelConfig,
    recv: &ReceiverTopology,
    rank: u32,
) -> Result<WantedLayout> {
    model.validate()?;
    let tp = recv.tp;
    if tp == 0 || rank >= tp {
        return Err(Error::new(
            ErrorKind::Layout,
            format!("receiver rank {rank} does not exist in {recv}"),
        ));
    }
    check_heads(model, tp)?;
    let (k_start, kr) = kv_rows_for_rank(model, tp, rank)?;
    let idx = TensorIndex::new(model);
    let (h, r64, t) = (model.hidden, tp as u64, rank as u64);
    let qr = model.q_rows() / r64;
    let mut params = Vec::with_capacity(model.layers as usize * 8 + 3);

    let embed = idx.spec("model.embed_tokens.weight")?;
    params.push(sliced(embed, column_parallel(embed, tp, rank)?));

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
        params.push(sliced(o, row_parallel(o, tp, rank)?));
        for n in layer_norm_suffixes(model) {
            params.push(replicated(spec(n)?));
        }
        match &model.moe {
            Some(moe) => {
                params.push(replicated(spec("mlp.gate.weight")?));
                let (e_count, i) = (moe.experts, moe.expert_intermediate);
                let ip = i / r64;
                let mut w13 = Vec::with_capacity(2 * e_count as usize);
                let mut w2 = Vec::with_capacity(e_count as usize);
                for e in 0..e_count {
                    let gate = idx.spec(&expert_tensor(l, e, "gate_proj"))?;
                    let up = idx.spec(&expert_tensor(l, e, "up_proj"))?;
                    let down = idx.spec(&expert_tensor(l, e, "down_proj"))?;
                    let base = e * 2 * ip * h;
                    w13.push(copy_at(
                        gate,
                        column_parallel(gate, tp, rank)?,
                        base,
                        vec![h, 1],
                    ));
                    w13.push(copy_at(
                        up,
                        column_parallel(up, tp, rank)?,
                        base + ip * h,
                        vec![h, 1],
                    ));
                    w2.push(copy_at(
                        down,
                        row_parallel(down, tp, rank)?,
                        e * h * ip,
                        vec![ip, 1],
                    ));
                }
                params.push(ParamSpec {
                    name: layer_tensor(l, "mlp.experts.w13_weight"),
                    dtype: model.dtype,
                    shape: vec![e_count, 2 * ip, h],
                    copies: w13,
                });
                params.push(ParamSpec {
                    name: layer_tensor(l, "mlp.experts.w2_weight"),
                    dtype: model.dtype,
                    shape: vec![e_count, h, ip],
                    copies: w2,
                });
            }
            None => {
                let gate = spec("mlp.gate_proj.weight")?;
                let up = spec("mlp.up_proj.weight")?;
                let down = spec("mlp.down_proj.weight")?;
                let ip = model.intermediate / r64;
                let gate_box = column_parallel(gate, tp, rank)?;
                let up_box = column_parallel(up, tp, rank)?;
                params.push(ParamSpec {
                    name: layer_tensor(l, "mlp.gate_up_proj.weight"),
                    dtype: model.dtype,
                    shape: vec![2 * ip, h],
                    copies: vec![
                        copy_at(gate, gate_box, 0, vec![h, 1]),
                        copy_at(up, up_box, ip * h, vec![h, 1]),
                    ],
                });
                params.push(sliced(down, row_parallel(down, tp, rank)?));
            }
        }
    }

    params.push(replicated(idx.spec("model.norm.weight")?));
    if !model.tied_embeddings {
        let head = idx.spec("lm_head.weight")?;
        params.push(sliced(head, column_parallel(head, tp, rank)?));
    }
    let layout = WantedLayout {
        receiver_rank: rank,
        params,
    };
    layout.validate()?;
    Ok(layout)
}

/// The wanted layouts of every rank of `recv`, in rank order.
pub fn receiver_layouts(model: &ModelConfig, recv: &ReceiverTopology) -> Result<Vec<WantedLayout>> {
    (0..recv.tp)
        .map(|r| receiver_layout(model, recv, r))
        .collect()
}
