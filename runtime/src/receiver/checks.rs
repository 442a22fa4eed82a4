//! Checks before anything is planned or posted: one training step not older than the live one,
//! tables bound to the incarnation of the peer metadata loaded for them, and the coverage floor
//! of a new plan.

use reshard_core::{Error, ErrorDetail, ErrorKind, Plan, Result, ShardTable, Transport};

use super::Receiver;

impl Receiver {
    pub(super) fn coverage_gate(&self, p: &Plan) -> Result<()> {
        if let Some(floor) = self.opts.min_coverage {
            let cov = if p.stats.param_bytes == 0 {
                1.0
            } else {
                p.stats.written_bytes as f64 / p.stats.param_bytes as f64
            };
            if cov < floor {
                return Err(Error::new(
                    ErrorKind::Guard,
                    format!(
                        "plan writes {:.4} of parameter bytes, below the floor {floor}",
                        cov
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// The one training step of `tables`, which must not be older than the live step.
///
/// A stale table is reported first (naming the lowest stale rank), so a lagging publisher among
/// current ones is named as stale rather than as merely different.
pub(super) fn check_steps(tables: &[ShardTable], live: Option<u64>) -> Result<u64> {
    let Some(first) = tables.first() else {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "no shard tables to refit from",
        ));
    };
    if let Some(live_step) = live {
        // Installing older weights over newer ones would silently roll the model back (a
        // publisher restarted from an old checkpoint, a delayed table). The live step itself
        // stays allowed: refitting it again is idempotent.
        let stale = tables
            .iter()
            .filter(|t| t.step < live_step)
            .min_by_key(|t| t.publisher.rank);
        if let Some(t) = stale {
            let (owner, step) = (t.publisher.rank, t.step);
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "publisher rank {owner} offers training step {step}, older than the live \
                     step {live_step}; refusing to roll the weights back"
                ),
            )
            .with_owner(owner)
            .with_detail(ErrorDetail::StaleStep {
                owner,
                step,
                live_step,
            }));
        }
    }
    if let Some(t) = tables.iter().find(|t| t.step != first.step) {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "publishers are at different training steps (rank {} at {}, rank {} at {})",
                first.publisher.rank, first.step, t.publisher.rank, t.step
            ),
        )
        .with_owner(t.publisher.rank)
        .with_detail(ErrorDetail::MixedSteps {
            rank_a: first.publisher.rank,
            step_a: first.step,
            rank_b: t.publisher.rank,
            step_b: t.step,
        }));
    }
    Ok(first.step)
}

/// Every table must be bound to the incarnation of the peer metadata loaded for its owner.
///
/// A publisher that restarts keeps its rank and agent name but not its memory: reads through
/// the metadata of its previous incarnation reach nothing (a wire error), or, where the old
/// memory stays mapped (UCX shared memory), the departed process's bytes, which only digests
/// would catch. Comparing incarnations before any read is posted catches both, with verification
/// on or off (docs/in-flight-safety.md, "Stale peers"). Owners with no metadata loaded are left
/// to `prepare`, which names the read's byte range.
pub(super) fn check_incarnations(tables: &[ShardTable], transport: &dyn Transport) -> Result<()> {
    for t in tables {
        let (owner, agent) = (t.publisher.rank, &t.publisher.agent);
        let Some(loaded) = transport.peer_incarnation(owner) else {
            continue;
        };
        if t.publisher.incarnation == 0 {
            return Err(Error::new(
                ErrorKind::InvalidTable,
                format!(
                    "the table of rank {owner} (agent {agent:?}) is not bound to a publisher \
                     endpoint (incarnation 0); publishers bind tables with ShardTable::bound_to"
                ),
            )
            .with_owner(owner));
        }
        if t.publisher.incarnation != loaded {
            return Err(Error::new(
                ErrorKind::Transport,
                format!(
                    "rank {owner} (agent {agent:?}) published this table from endpoint \
                     incarnation {:016x}, but the metadata loaded for it is from incarnation \
                     {loaded:016x}: the publisher restarted; load its current metadata",
                    t.publisher.incarnation
                ),
            )
            .with_owner(owner)
            .with_backend(transport.name()));
        }
    }
    Ok(())
}
