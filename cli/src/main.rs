//! `reshard`: plan a refit, run one, or list the model presets.

// First, so that every command module below can use `outln!` and `out!`.
#[macro_use]
mod output;
#[cfg(feature = "demo")]
mod bench_cmd;
mod checkpoint_cmd;
mod plan_cmd;
mod publish_cmd;
#[cfg(feature = "demo")]
mod ranges_cmd;
mod receive_cmd;
#[cfg(feature = "demo")]
mod refit_cmd;
mod rendezvous_arg;
#[cfg(feature = "demo")]
mod soak_cmd;
mod status_cmd;
mod table_cmd;

use clap::{Args, Parser, Subcommand};
use std::process::ExitCode;

use reshard_planner::presets::{preset, ModelConfig};
use reshard_planner::topology::{PublisherTopology, ReceiverTopology};

/// Moves model weights from trainer shards to inference ranks, byte-exact.
#[derive(Parser)]
#[command(name = "reshard", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Build the fused range plan of every receiver rank and print its statistics.
    Plan(plan_cmd::PlanArgs),
    /// Run a refit end to end: warm-up plus N measured updates, verified byte-exact.
    #[cfg(feature = "demo")]
    Refit(refit_cmd::RefitArgs),
    /// Measure the baseline and reshard arms and a memcpy ceiling in one run (the seed note's
    /// before/after table).
    #[cfg(feature = "demo")]
    Bench(bench_cmd::BenchArgs),
    /// Time one transport moving the same bytes as 1k to 1M ranges (prepare, first post,
    /// re-post), next to a memcpy of the same bytes.
    #[cfg(feature = "demo")]
    BenchRanges(ranges_cmd::RangesArgs),
    /// Run many consecutive verified updates on one cluster and report resident memory,
    /// rebuilds and registration release.
    #[cfg(feature = "demo")]
    Soak(soak_cmd::SoakArgs),
    /// List the model presets.
    Presets(PresetsArgs),
    /// List the transports built into this binary (the registry), whether each runtime is
    /// usable here, and each one's capabilities.
    Transports(TransportsArgs),
    /// Write a Hugging Face-style safetensors checkpoint of a preset (deployment trials).
    Checkpoint(checkpoint_cmd::CheckpointArgs),
    /// Serve one publisher rank's shard of a checkpoint through a rendezvous until SIGTERM.
    Publish(publish_cmd::PublishArgs),
    /// Run one receiver rank: discover the publishers, refit every new step, verify.
    Receive(receive_cmd::ReceiveArgs),
    /// Show what a rendezvous holds: publishers, steps, readiness, lease ages.
    Status(status_cmd::StatusArgs),
    /// Show a publisher's shard table as JSON, write it in binary, or decode a binary one.
    Table(table_cmd::TableArgs),
    /// The child side of `refit --publisher-process process` (not for direct use).
    #[cfg(feature = "demo")]
    #[command(hide = true)]
    ServePublishers(refit_cmd::ServeArgs),
}

/// Model and topology flags shared by `plan` and `refit`.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Model preset (see `reshard presets`).
    #[arg(long, default_value = "qwen3-30b-a3b")]
    pub preset: String,
    /// Publisher topology, e.g. `ep=8,dp=8` or `tp=4,dp=2` (keys tp, ep, dp, pp).
    #[arg(long, default_value = "ep=8,dp=8")]
    pub publishers: String,
    /// Receiver topology, e.g. `tp=2`.
    #[arg(long, default_value = "tp=2")]
    pub receivers: String,
    /// Keep only the first N layers.
    #[arg(long)]
    pub layers: Option<u64>,
    /// Keep only the first N experts per layer (MoE presets).
    #[arg(long)]
    pub experts: Option<u64>,
    /// Override the vocabulary size.
    #[arg(long)]
    pub vocab: Option<u64>,
}

impl ModelArgs {
    /// Resolves the preset with overrides and parses both topologies.
    pub fn resolve(
        &self,
    ) -> reshard_core::Result<(ModelConfig, PublisherTopology, ReceiverTopology)> {
        let model = preset(&self.preset)?.with_overrides(self.layers, self.experts, self.vocab)?;
        Ok((model, self.publishers.parse()?, self.receivers.parse()?))
    }
}

#[derive(Args)]
struct PresetsArgs {
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn presets(args: PresetsArgs) -> reshard_core::Result<Outcome> {
    let all = reshard_planner::presets::presets();
    if args.json {
        let v: Vec<_> = all
            .iter()
            .map(|p| {
                serde_json::json!({
                    "name": p.name,
                    "description": p.description,
                    "source": p.source,
                    "tensors": p.config.tensors().len(),
                    "bytes": p.config.total_bytes(),
                    "layers": p.config.layers,
                    "experts": p.config.moe.as_ref().map(|m| m.experts),
                })
            })
            .collect();
        outln!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(Outcome(true));
    }
    outln!(
        "{:<16} {:>8} {:>10}  description",
        "preset",
        "tensors",
        "GiB"
    );
    for p in &all {
        outln!(
            "{:<16} {:>8} {:>10.2}  {}",
            p.name,
            p.config.tensors().len(),
            p.config.total_bytes() as f64 / (1u64 << 30) as f64,
            p.description
        );
        outln!("{:<16} {:>8} {:>10}  source: {}", "", "", "", p.source);
    }
    Ok(Outcome(true))
}

#[derive(Args)]
struct TransportsArgs {
    /// Print JSON: `[{"transport","usable","reason","capabilities"}]`, in registration order.
    #[arg(long)]
    json: bool,
}

/// Every registered transport, probed, with its capabilities (`reshard::available`).
fn transports(args: TransportsArgs) -> reshard_core::Result<Outcome> {
    let rows: Vec<serde_json::Value> = reshard::available()
        .into_iter()
        .map(|a| match a.capabilities {
            Ok(c) => serde_json::json!({
                "transport": a.scheme,
                "usable": true,
                "reason": null,
                "capabilities": {
                    "one_sided_read": c.one_sided_read,
                    "one_sided_write": c.one_sided_write,
                    "vram": c.vram,
                    "cross_process": c.cross_process,
                    "max_reads_per_post": c.max_reads_per_post,
                },
            }),
            Err(e) => serde_json::json!({
                "transport": a.scheme,
                "usable": false,
                "reason": e.to_string(),
                "capabilities": null,
            }),
        })
        .collect();
    if args.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&rows).unwrap_or_default()
        );
        return Ok(Outcome(true));
    }
    for r in &rows {
        let name = r["transport"].as_str().unwrap_or_default();
        if r["usable"] == true {
            let c = &r["capabilities"];
            let mut has: Vec<&str> = ["one_sided_read", "one_sided_write", "vram", "cross_process"]
                .into_iter()
                .filter(|k| c[*k] == true)
                .collect();
            if has.is_empty() {
                has.push("-");
            }
            outln!("{name:<10} usable       {}", has.join(","));
        } else {
            outln!(
                "{name:<10} unavailable  {}",
                r["reason"].as_str().unwrap_or_default()
            );
        }
    }
    Ok(Outcome(true))
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RESHARD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Plan(a) => plan_cmd::run(a),
        Command::Presets(a) => presets(a),
        Command::Transports(a) => transports(a),
        Command::Checkpoint(a) => checkpoint_cmd::run(a),
        Command::Publish(a) => publish_cmd::run(a),
        Command::Receive(a) => receive_cmd::run(a),
        Command::Status(a) => status_cmd::run(a),
        #[cfg(feature = "demo")]
        Command::Refit(a) => refit_cmd::run(a),
        #[cfg(feature = "demo")]
        Command::Bench(a) => bench_cmd::run(a),
        #[cfg(feature = "demo")]
        Command::BenchRanges(a) => ranges_cmd::run(a),
        #[cfg(feature = "demo")]
        Command::Soak(a) => soak_cmd::run(a),
        Command::Table(a) => table_cmd::run(a),
        #[cfg(feature = "demo")]
        Command::ServePublishers(a) => refit_cmd::serve(a),
    };
    match result {
        Ok(code) => code.into(),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

/// Runs `fut` to completion on a multi-thread tokio runtime (the async subcommands).
pub fn block_on<T>(
    fut: impl std::future::Future<Output = reshard_core::Result<T>>,
) -> reshard_core::Result<T> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            reshard_core::Error::new(
                reshard_core::ErrorKind::Internal,
                "cannot start the async runtime",
            )
            .with_source(e)
        })?;
    rt.block_on(fut)
}

/// Loads the configuration with `--transport` (when given) as the CLI layer, its backend
/// sections and kind checked against the backends built into this binary.
pub fn load_config(
    transport: Option<&str>,
    file: Option<&std::path::Path>,
) -> reshard_core::Result<reshard_core::config::Config> {
    let cli = transport.map(|k| serde_json::json!({"transport": {"kind": k}}));
    reshard::registry().load_config(file, cli)
}

/// `name (N layers, M experts)`, as the commands' summaries name a model.
pub fn describe_model(model: &ModelConfig) -> String {
    let experts = model
        .moe
        .as_ref()
        .map(|m| format!(", {} experts", m.experts))
        .unwrap_or_default();
    format!("{} ({} layers{experts})", model.name, model.layers)
}

/// What a subcommand returns on success: 0, or 1 when it ran but found a failure.
pub struct Outcome(pub bool);

impl From<Outcome> for ExitCode {
    fn from(o: Outcome) -> Self {
        if o.0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard_core::HostBuffer;
    use reshard_planner::layouts::receiver_layout;
    use reshard_planner::topology::ReceiverTopology;
    use std::sync::Arc;

    /// Exit code 1 is reserved for a refit that ran but installed bytes that differ from the
    /// reference: no input reaches it from outside (every refused refit exits 2), so the verdict
    /// and its exit code are checked here on live buffers with one flipped byte.
    #[test]
    fn installed_bytes_that_differ_from_the_reference_exit_1() {
        let model = preset("llama-3-8b")
            .and_then(|m| m.with_overrides(Some(1), None, Some(512)))
            .expect("model");
        let layout = receiver_layout(&model, &ReceiverTopology::tp(2), 1).expect("layout");
        let want: Vec<Vec<u8>> = layout
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| vec![i as u8 + 1; p.bytes() as usize])
            .collect();
        let live: Vec<Arc<HostBuffer>> = want
            .iter()
            .map(|w| Arc::new(HostBuffer::from_bytes(w)))
            .collect();
        let exit =
            |failures: &[String]| format!("{:?}", ExitCode::from(Outcome(failures.is_empty())));
        let same = reshard_testkit::rig::differing_params(&layout, &live, &want, 3, 1);
        assert!(same.is_empty(), "{same:?}");
        assert_eq!(exit(&same), format!("{:?}", ExitCode::SUCCESS));
        live[2].write()[7] ^= 1;
        let differ = reshard_testkit::rig::differing_params(&layout, &live, &want, 3, 1);
        assert_eq!(differ.len(), 1, "{differ:?}");
        assert!(differ[0].contains(&layout.params[2].name), "{differ:?}");
        assert_eq!(exit(&differ), format!("{:?}", ExitCode::from(1)));
    }
}
