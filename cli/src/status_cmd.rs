//! `reshard status`: what the rendezvous holds: per model, every publisher rank with its step,
//! readiness, transport, its holder (incarnation, host, pid), table size and lease age, and the
//! publisher's note when it set one (its last error: why it does not advance to a newer
//! checkpoint, or why it serves no step while it holds its rank with no table).

use clap::Args;
use reshard_core::Result;

use crate::rendezvous_arg::{connect, RendezvousArgs};
use crate::Outcome;

/// Flags of `reshard status`.
#[derive(Args)]
pub struct StatusArgs {
    #[command(flatten)]
    rendezvous: RendezvousArgs,
    /// Only this model (default: every model announced).
    #[arg(long)]
    model: Option<String>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Prints the announcements.
pub fn run(args: StatusArgs) -> Result<Outcome> {
    crate::block_on(status(args))
}

async fn status(args: StatusArgs) -> Result<Outcome> {
    let rendezvous = connect(&args.rendezvous).await?;
    let models = match &args.model {
        Some(m) => vec![m.clone()],
        None => rendezvous.models().await?,
    };
    let mut out = Vec::new();
    for model in models {
        let (members, revision) = rendezvous.members(&model).await?;
        // Receivers reading now (the reader fence, docs/deployment.md §3).
        let (readers, _) = rendezvous.readers(&model).await?;
        let world = members.first().map(|m| m.world);
        if !args.json {
            outln!(
                "model {model:?}: {} of {} publishers (revision {revision})",
                members.len(),
                world.map_or("?".to_string(), |w| w.to_string())
            );
            for m in &members {
                outln!(
                    "  rank {:>4}  step {:>6}  {:<8}  {:<9}  incarnation {:016x}  table {:>9} B  lease age {:.1} s  holder {}",
                    m.rank,
                    m.step,
                    match (m.ready, m.table_bytes) {
                        (true, _) => "ready",
                        // A claim with no table: the publisher has no step to serve (its note
                        // says why, docs/deployment.md §5).
                        (false, 0) => "no step",
                        (false, _) => "updating",
                    },
                    m.transport,
                    m.incarnation,
                    m.table_bytes,
                    m.age.as_secs_f64(),
                    m.holder
                        .as_ref()
                        .map_or("not recorded".to_string(), |h| format!("{} pid {}", h.host, h.pid))
                );
                if let Some(note) = &m.note {
                    outln!("             note: {note}");
                }
            }
            for c in &readers {
                outln!(
                    "  reading  step {:>6}  {} publisher(s)  {}",
                    c.step,
                    c.ranks.len(),
                    c.reader
                );
            }
        }
        out.push(serde_json::json!({
            "model": model,
            "world": world,
            "revision": revision,
            "publishers": members.iter().map(|m| serde_json::json!({
                "rank": m.rank, "step": m.step, "ready": m.ready, "transport": m.transport,
                "incarnation": m.incarnation, "table_bytes": m.table_bytes,
                "lease_age_s": m.age.as_secs_f64(), "note": m.note,
                "holder": m.holder.as_ref().map(|h| serde_json::json!({
                    "host": h.host, "pid": h.pid, "incarnation": m.incarnation,
                })),
            })).collect::<Vec<_>>(),
            "readers": readers.iter().map(|c| serde_json::json!({
                "reader": c.reader, "step": c.step,
                "ranks": c.ranks.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        }));
    }
    if args.json {
        outln!("{}", serde_json::Value::Array(out));
    }
    Ok(Outcome(true))
}
