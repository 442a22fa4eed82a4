//! `reshard publish`: one publisher rank as its own process (docs/deployment.md). It holds its
//! Megatron shard of a safetensors checkpoint in registered memory, announces it through the
//! rendezvous, advances when a newer complete checkpoint appears, and withdraws cleanly on
//! SIGTERM or SIGINT.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use clap::Args;
use reshard_checkpoint::{newest_complete, Checkpoint};
use reshard_core::encoding::encode_table;
use reshard_core::rendezvous::{Announced, Announcement};
use reshard_core::{Error, ErrorKind, Result, Transport};
use reshard_planner::topology::PublisherTopology;
use reshard_runtime::ShardPublisher;

use crate::rendezvous_arg::{connect, RendezvousArgs, TransportArgs};
use crate::Outcome;

/// Flags of `reshard publish`.
#[derive(Args)]
pub struct PublishArgs {
    #[command(flatten)]
    rendezvous: RendezvousArgs,
    /// Model name publishers and receivers meet under.
    #[arg(long)]
    model: String,
    /// A checkpoint folder, or a folder of `step-N/` checkpoints (the newest complete one is
    /// published, and a newer complete one is published when it appears).
    #[arg(long)]
    checkpoint: PathBuf,
    /// The trainer's topology, e.g. `ep=8,dp=8` (dp counts every rank).
    #[arg(long)]
    publishers: String,
    /// This process's publisher rank.
    #[arg(long)]
    rank: u32,
    #[command(flatten)]
    transport: TransportArgs,
    /// How often to look for a newer complete checkpoint, in milliseconds.
    #[arg(long, default_value_t = 500)]
    poll_ms: u64,
    /// Print one JSON line per step published.
    #[arg(long)]
    json: bool,
}

/// Runs the publisher until SIGTERM or SIGINT.
pub fn run(args: PublishArgs) -> Result<Outcome> {
    crate::block_on(publish(args))
}

/// The newest complete checkpoint under `dir`, waiting for one to appear.
async fn newest(dir: &Path, after: Option<u64>, poll: Duration) -> Result<(u64, PathBuf)> {
    loop {
        if let Some((step, path)) = newest_complete(dir)? {
            if after.is_none_or(|a| step > a) {
                return Ok((step, path));
            }
        }
        tokio::time::sleep(poll).await;
    }
}

/// Loads step `step` from `path` into the publisher's registered memory.
fn load(publisher: &mut ShardPublisher, step: u64, path: &Path) -> Result<Checkpoint> {
    let ckpt = Checkpoint::open(path)?;
    publisher.fill(step, |spec, tbox, dst| ckpt.copy_box(&spec.name, tbox, dst))?;
    Ok(ckpt)
}

fn line(json: bool, what: &str, rank: u32, step: u64, path: &Path, bytes: u64) {
    if json {
        let v = serde_json::json!({
            "event": what, "rank": rank, "step": step,
            "checkpoint": path, "memory_bytes": bytes,
        });
        println!("{v}");
    } else {
        eprintln!(
            "publisher rank {rank}: {what} step {step} from {} ({:.1} MiB registered)",
            path.display(),
            bytes as f64 / (1u64 << 20) as f64
        );
    }
}

async fn publish(args: PublishArgs) -> Result<Outcome> {
    let cfg = args.transport.load()?;
    let topology: PublisherTopology = args.publishers.parse()?;
    let poll = Duration::from_millis(args.poll_ms.max(10));
    let rendezvous = connect(&args.rendezvous).await?;
    let (mut step, mut path) = newest(&args.checkpoint, None, poll).await?;
    let ckpt = Checkpoint::open(&path)?;
    let model = ckpt.model().clone();
    drop(ckpt);
    let registry = reshard_transports::registry();
    let agent = format!("{}-publisher-{}", args.model, args.rank);
    let transport: Arc<dyn Transport> = registry.create(&agent, &cfg.transport)?;
    let mut publisher =
        ShardPublisher::new(transport.clone(), &model, &topology, args.rank).await?;
    load(&mut publisher, step, &path)?;
    let config = Bytes::from(serde_json::to_vec(&model).map_err(|e| {
        Error::new(
            ErrorKind::Internal,
            format!("model configuration to JSON: {e}"),
        )
    })?);
    let held: Box<dyn Announced> = rendezvous
        .announce(Announcement {
            model: args.model.clone(),
            rank: args.rank,
            world: topology.world(),
            step,
            transport: transport.name().to_string(),
            incarnation: transport.incarnation(),
            table: Bytes::from(encode_table(publisher.table())),
            metadata: transport.export_metadata().await?,
            config,
        })
        .await?;
    line(
        args.json,
        "published",
        args.rank,
        step,
        &path,
        publisher.memory_bytes(),
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| Error::new(ErrorKind::Internal, format!("cannot watch SIGTERM: {e}")))?;
    let outcome = loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break Ok(()),
            _ = term.recv() => break Ok(()),
            next = newest(&args.checkpoint, Some(step), poll) => {
                let (next_step, next_path) = match next {
                    Ok(n) => n,
                    Err(e) => break Err(e),
                };
                if let Err(e) = held.check_alive() {
                    break Err(e);
                }
                let fresh = Checkpoint::open(&next_path)?;
                if fresh.model() != &model {
                    break Err(Error::new(
                        ErrorKind::Config,
                        format!(
                            "checkpoint {} changes the model's architecture; a publisher keeps \
                             one architecture for its life",
                            next_path.display()
                        ),
                    )
                    .with_owner(args.rank));
                }
                drop(fresh);
                // Receivers must not start reading while the memory is rewritten in place; one
                // that already is fails its digest check and keeps its previous weights.
                held.unready().await?;
                load(&mut publisher, next_step, &next_path)?;
                held.advance(next_step, Bytes::from(encode_table(publisher.table())))
                    .await?;
                (step, path) = (next_step, next_path);
                line(args.json, "advanced", args.rank, step, &path, publisher.memory_bytes());
            }
        }
    };
    // Withdraw first (receivers stop discovering this rank), then release the memory.
    let withdrawn = held.withdraw().await;
    drop(publisher);
    outcome?;
    withdrawn?;
    line(args.json, "withdrew", args.rank, step, &path, 0);
    Ok(Outcome(true))
}
