//! `reshard checkpoint`: writes a Hugging Face-style safetensors checkpoint of a preset (scaled
//! down by the same defaults as `reshard refit`), with content that changes with `--step`, so
//! the deployment path can be tried without a trainer (docs/deployment.md).

use std::path::PathBuf;

use clap::Args;
use reshard_checkpoint::{write_checkpoint, WriteOptions};
use reshard_core::Result;
use reshard_planner::presets::preset;

use crate::Outcome;

/// Layers a checkpoint keeps unless `--layers` says otherwise (as `reshard refit`).
const DEFAULT_LAYERS: u64 = 4;
/// Experts per layer a checkpoint keeps on MoE presets unless `--experts` says otherwise.
const DEFAULT_EXPERTS: u64 = 32;

/// Flags of `reshard checkpoint`.
#[derive(Args)]
pub struct CheckpointArgs {
    /// Model preset (`reshard presets` lists them).
    #[arg(long, default_value = "qwen3-30b-a3b")]
    preset: String,
    /// Decoder layers to keep (default 4; the full preset's count writes the whole model).
    #[arg(long)]
    layers: Option<u64>,
    /// Experts per layer to keep on MoE presets (default 32).
    #[arg(long)]
    experts: Option<u64>,
    /// Vocabulary rows to keep (default: the preset's).
    #[arg(long)]
    vocab: Option<u64>,
    /// Training step: recorded in the checkpoint, and every byte depends on it.
    #[arg(long, default_value_t = 0)]
    step: u64,
    /// Output folder (created; an earlier checkpoint there is replaced).
    #[arg(long)]
    out: PathBuf,
    /// Largest shard file, in MiB.
    #[arg(long, default_value_t = 256)]
    max_shard_mib: u64,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Writes the checkpoint and reports what was written.
pub fn run(args: CheckpointArgs) -> Result<Outcome> {
    let base = preset(&args.preset)?;
    let layers = args.layers.unwrap_or(DEFAULT_LAYERS.min(base.layers));
    let experts = match (&base.moe, args.experts) {
        (_, Some(e)) => Some(e),
        (Some(m), None) => Some(DEFAULT_EXPERTS.min(m.experts)),
        (None, None) => None,
    };
    let model = base.with_overrides(Some(layers), experts, args.vocab)?;
    let options = WriteOptions {
        max_shard_bytes: args.max_shard_mib.max(1) << 20,
    };
    let written = write_checkpoint(&model, args.step, &args.out, &options)?;
    if args.json {
        let v = serde_json::json!({
            "dir": written.dir,
            "model": model.name,
            "step": written.step,
            "shards": written.shards,
            "tensors": written.tensors,
            "total_size": written.total_size,
        });
        outln!("{v}");
    } else {
        outln!(
            "wrote {} step {} to {}: {} tensors, {:.1} MiB in {} shard files",
            crate::describe_model(&model),
            written.step,
            written.dir.display(),
            written.tensors,
            written.total_size as f64 / (1u64 << 20) as f64,
            written.shards.len()
        );
    }
    Ok(Outcome(true))
}
