//! `reshard publish`: one publisher rank as its own process (docs/deployment.md). It holds its
//! Megatron shard of a safetensors checkpoint in registered memory, announces it through the
//! rendezvous, advances when a newer complete checkpoint appears, and withdraws cleanly on
//! SIGTERM or SIGINT.
//!
//! A bad checkpoint at start is an error (exit 2). Once a step is served, a newer step folder
//! that cannot be published (incomplete though indexed, unreadable, of another architecture,
//! changed while it was read) never ends the process: it keeps serving the step it has, says
//! why (a log line, a `refused` JSON line, and the note `reshard status` shows), and tries that
//! folder again only once the folder changes (docs/deployment.md §5).
//!
//! Nor does etcd out of reach end it: a rendezvous write that fails for that (marking itself not
//! ready, advancing, setting its note) is tried again at the next look, and the memory is never
//! rewritten before "not ready" is written. Its lease outlives the outage (`reshard-rendezvous`
//! reconnects, and announces the same incarnation again if the lease expired meanwhile). Only
//! losing its rank to another live process ends it (exit 2, naming that process).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use clap::Args;
use reshard_checkpoint::{
    candidates, incomplete_reason, newest_complete, Checkpoint, FolderState, INDEX_FILE,
};
use reshard_core::encoding::encode_table;
use reshard_core::rendezvous::{Announced, Announcement, Rendezvous};
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
async fn newest(dir: &Path, poll: Duration) -> Result<(u64, PathBuf)> {
    loop {
        if let Some(found) = newest_complete(dir)? {
            return Ok(found);
        }
        tokio::time::sleep(poll).await;
    }
}

/// Loads step `step` of `ckpt` into the publisher's registered memory.
fn load(publisher: &mut ShardPublisher, step: u64, ckpt: &Checkpoint) -> Result<()> {
    publisher.fill(step, |spec, tbox, dst| ckpt.copy_box(&spec.name, tbox, dst))
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

/// The step served, and the open checkpoint it was loaded from: its files stay open, so after
/// a failed load of a newer step it can be loaded again even when its folder was replaced.
struct Serving {
    step: u64,
    path: PathBuf,
    ckpt: Checkpoint,
}

/// A step folder this publisher refused, with the folder's state when it tried.
struct Refused {
    step: u64,
    state: FolderState,
    reason: String,
}

/// Why a newer step was not published.
enum Failure {
    /// The step folder is bad: refuse it, keep serving.
    Refused(Error),
    /// The rendezvous could not be written just now (etcd out of reach): nothing is refused,
    /// the publisher tries again at its next look.
    Later,
    /// The rendezvous refused for good (the rank is held by another process, a record no
    /// receiver would accept): the publisher ends.
    Fatal(Error),
}

/// A publisher that serves: its memory, announcement and what it has refused.
struct Running {
    rank: u32,
    json: bool,
    dir: PathBuf,
    model: reshard_planner::presets::ModelConfig,
    publisher: ShardPublisher,
    held: Box<dyn Announced>,
    /// The step the announcement carries (ready only while `serving` is `Some`).
    announced: u64,
    serving: Option<Serving>,
    /// Refused step folders by path; each is tried again only once its state differs.
    refused: BTreeMap<PathBuf, Refused>,
    /// Why the checkpoint folder cannot be listed, while it cannot.
    listing: Option<String>,
    /// Why no step is served, after the served step could not be loaded again.
    lost: Option<String>,
    /// The note last set on the announcement.
    note: Option<String>,
    /// Step folders tried so far (each refused one once per state it is in).
    tried: u64,
    /// A step in memory whose announcement could not be written yet (etcd out of reach): the
    /// record says not ready until it is.
    pending: Option<u64>,
    /// Since when rendezvous writes fail (etcd out of reach), while they do.
    deferred: Option<std::time::Instant>,
}

impl Running {
    /// One look at the checkpoint folder: tries the newest step above the announced one that
    /// has an index (a folder without one is still being written) and is not refused in its
    /// current state, falling back to older ones while they are refused. Only rendezvous
    /// failures are returned.
    async fn look(&mut self) -> Result<()> {
        // A step loaded but not announced comes first: until it is, the memory is not touched.
        if let Some(step) = self.pending {
            match self.advance(step).await {
                Ok(true) => {}
                Ok(false) | Err(Failure::Later) => return Ok(()),
                Err(Failure::Fatal(e) | Failure::Refused(e)) => return Err(e),
            }
        }
        let list = match candidates(&self.dir) {
            Ok(l) => l,
            Err(e) => {
                self.listing = Some(e.message().to_string());
                return self.update_note().await;
            }
        };
        self.listing = None;
        let floor = self.announced;
        for (step, path) in &list {
            let (step, path) = (*step, path.clone());
            if step <= floor {
                break;
            }
            if !path.join(INDEX_FILE).exists() {
                continue;
            }
            // Read before trying, so a change made while the step loads is seen next time.
            let state = FolderState::read(&path);
            if self.refused.get(&path).is_some_and(|r| r.state == state) {
                continue;
            }
            match self.try_step(step, &path).await {
                Ok(()) => {
                    self.refused.remove(&path);
                    break;
                }
                Err(Failure::Fatal(e)) => return Err(e),
                // Tried again at the next look, as if not seen yet.
                Err(Failure::Later) => break,
                Err(Failure::Refused(e)) => {
                    self.refuse(step, &path, &e);
                    self.refused.insert(
                        path,
                        Refused {
                            step,
                            state,
                            reason: e.to_string(),
                        },
                    );
                }
            }
        }
        // Refusals of folders that are gone or no longer newer say nothing any more.
        let floor = self.announced;
        self.refused
            .retain(|p, r| r.step > floor && list.iter().any(|(_, q)| q == p));
        self.update_note().await
    }

    /// Publishes step `step` from `path`: [`Running::check`], then [`Running::install`].
    async fn try_step(&mut self, step: u64, path: &Path) -> std::result::Result<(), Failure> {
        self.tried += 1;
        let fresh = self.check(path).map_err(Failure::Refused)?;
        self.install(step, path, fresh).await
    }

    /// Checks step folder `path` whole before the memory is touched: complete, every header
    /// valid, the same architecture as the step served.
    fn check(&self, path: &Path) -> Result<Checkpoint> {
        if let Some(why) = incomplete_reason(path) {
            return Err(Error::new(
                ErrorKind::Config,
                format!("{} is not a complete checkpoint: {why}", path.display()),
            ));
        }
        let fresh = Checkpoint::open(path)?;
        if fresh.model() != &self.model {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "checkpoint {} changes the model's architecture; a publisher keeps one \
                     architecture for its life",
                    path.display()
                ),
            ));
        }
        Ok(fresh)
    }

    /// Unready, load `fresh` as step `step`, advance. A load that fails part-way (a shard file
    /// changed after `check`) reloads the served step (its files are still open) and announces
    /// it again, so receivers keep reading it; the failure is returned as a refusal.
    async fn install(
        &mut self,
        step: u64,
        path: &Path,
        fresh: Checkpoint,
    ) -> std::result::Result<(), Failure> {
        // Receivers must not start reading while the memory is rewritten in place (one that
        // already is fails its digest check and keeps its previous weights): no write of "not
        // ready", no rewrite.
        if let Err(e) = self.held.unready().await {
            return Err(self.rendezvous_failure(e));
        }
        self.resumed();
        if let Err(e) = load(&mut self.publisher, step, &fresh) {
            self.restore(&e).await?;
            return Err(Failure::Refused(e));
        }
        self.serving = Some(Serving {
            step,
            path: path.to_path_buf(),
            ckpt: fresh,
        });
        self.lost = None;
        // Announced now, or at a later look once etcd answers (`pending`).
        self.advance(step).await?;
        Ok(())
    }

    /// After a failed load (`why`): loads the served step again and announces it ready. When
    /// that fails too, the publisher serves nothing (stays unready) until a newer step loads.
    async fn restore(&mut self, why: &Error) -> std::result::Result<(), Failure> {
        let Some(s) = &self.serving else {
            return Ok(());
        };
        let step = s.step;
        match load(&mut self.publisher, step, &s.ckpt) {
            Ok(()) => self.advance(step).await.map(|_| ()),
            Err(e) => {
                let msg = format!(
                    "serving no step: step {step} ({}) could not be loaded again after a newer \
                     step failed ({}): {e}",
                    s.path.display(),
                    why.message()
                );
                self.lost = Some(msg.clone());
                self.serving = None;
                if self.json {
                    println!(
                        "{}",
                        serde_json::json!({"event": "unserved", "rank": self.rank,
                            "step": step, "error": error_json(&e)})
                    );
                } else {
                    eprintln!("publisher rank {}: {msg}", self.rank);
                }
                Ok(())
            }
        }
    }

    /// Announces the memory's current contents as step `step`, ready: true when announced;
    /// false when etcd is out of reach, the step left `pending` for the next look.
    async fn advance(&mut self, step: u64) -> std::result::Result<bool, Failure> {
        let table = Bytes::from(encode_table(self.publisher.table()));
        if let Err(e) = self.held.advance(step, table).await {
            return match self.rendezvous_failure(e) {
                Failure::Later => {
                    self.pending = Some(step);
                    Ok(false)
                }
                f => Err(f),
            };
        }
        self.resumed();
        self.pending = None;
        let newer = step > self.announced;
        self.announced = step;
        if newer {
            if let Some(s) = &self.serving {
                line(
                    self.json,
                    "advanced",
                    self.rank,
                    step,
                    &s.path,
                    self.publisher.memory_bytes(),
                );
            }
        }
        Ok(true)
    }

    /// What a failed rendezvous write means: [`Failure::Later`] while etcd is out of reach and
    /// the rank still this process's (said once per outage), else [`Failure::Fatal`].
    fn rendezvous_failure(&mut self, e: Error) -> Failure {
        let transient = matches!(e.kind(), ErrorKind::Transport | ErrorKind::Timeout);
        if let Err(lost) = self.held.check_alive() {
            return Failure::Fatal(lost);
        }
        if !transient {
            return Failure::Fatal(e);
        }
        if self.deferred.is_none() {
            if self.json {
                println!(
                    "{}",
                    serde_json::json!({"event": "rendezvous_unreachable", "rank": self.rank,
                        "step": self.announced, "pending_step": self.pending,
                        "error": error_json(&e)})
                );
            } else {
                eprintln!(
                    "publisher rank {}: the rendezvous cannot be written ({e}); serving step {}                      on, trying again every poll",
                    self.rank, self.announced
                );
            }
        }
        self.deferred.get_or_insert_with(std::time::Instant::now);
        Failure::Later
    }

    /// A rendezvous write succeeded: an outage in progress is over (said once).
    fn resumed(&mut self) {
        if let Some(since) = self.deferred.take() {
            let waited = since.elapsed().as_secs_f64();
            if self.json {
                println!(
                    "{}",
                    serde_json::json!({"event": "rendezvous_back", "rank": self.rank,
                        "waited_s": waited})
                );
            } else {
                eprintln!(
                    "publisher rank {}: the rendezvous is written again after {waited:.1} s",
                    self.rank
                );
            }
        }
    }

    /// Says that step folder `path` was refused, and why.
    fn refuse(&self, step: u64, path: &Path, e: &Error) {
        let serving = self.serving.as_ref().map(|s| s.step);
        if self.json {
            let v = serde_json::json!({
                "event": "refused", "rank": self.rank, "step": step, "checkpoint": path,
                "serving_step": serving, "error": error_json(e),
            });
            println!("{v}");
        } else {
            eprintln!(
                "publisher rank {}: refused step {step} from {}: {e}; {}; tried again when \
                 the folder changes",
                self.rank,
                path.display(),
                serving.map_or("serving no step".to_string(), |s| format!(
                    "still serving step {s}"
                ))
            );
        }
    }

    /// Sets the announcement's note to what `reshard status` should say now: a lost step or an
    /// unlistable folder first, then the newest refused folder; none when all is well.
    async fn update_note(&mut self) -> Result<()> {
        let serving = self
            .serving
            .as_ref()
            .map_or("serving no step".to_string(), |s| {
                format!("serving step {}", s.step)
            });
        let refused = self
            .refused
            .values()
            .max_by_key(|r| r.step)
            .map(|r| format!("refused step {}: {}; {serving}", r.step, r.reason));
        let trouble = match (&self.lost, &self.listing) {
            (Some(a), Some(b)) => Some(format!("{a}; {b}")),
            (a, b) => a.clone().or_else(|| b.clone()),
        };
        let note = match (&trouble, refused) {
            (Some(t), Some(r)) => Some(format!("{t}; {r}")),
            (Some(t), None) => Some(format!("{t}; {serving}")),
            (None, r) => r,
        };
        if note != self.note {
            match self.held.set_note(note.clone()).await {
                Ok(()) => {
                    self.resumed();
                    self.note = note;
                }
                // Written at a later look (`self.note` still differs).
                Err(e) => match self.rendezvous_failure(e) {
                    Failure::Fatal(e) | Failure::Refused(e) => return Err(e),
                    Failure::Later => {}
                },
            }
        }
        Ok(())
    }
}

/// An error as JSON, as `reshard receive --json` prints one, with the byte range when known.
fn error_json(e: &Error) -> serde_json::Value {
    let c = e.context();
    serde_json::json!({
        "kind": e.kind().as_str(),
        "message": e.to_string(),
        "tensor": c.tensor,
        "range": c.range.as_ref().map(|r| [r.start, r.end]),
    })
}

impl Running {
    /// Lays out rank `rank` of `topology`, loads step `step` of `ckpt` (from `path`, found in
    /// the checkpoint folder `dir`) and announces it ready as model `model_name`.
    #[allow(clippy::too_many_arguments)]
    async fn start(
        rendezvous: &dyn Rendezvous,
        transport: Arc<dyn Transport>,
        model_name: &str,
        topology: &PublisherTopology,
        rank: u32,
        json: bool,
        dir: PathBuf,
        (step, path, ckpt): (u64, PathBuf, Checkpoint),
    ) -> Result<Running> {
        let model = ckpt.model().clone();
        let mut publisher = ShardPublisher::new(transport.clone(), &model, topology, rank).await?;
        load(&mut publisher, step, &ckpt)?;
        let config = Bytes::from(serde_json::to_vec(&model).map_err(|e| {
            Error::new(
                ErrorKind::Internal,
                format!("model configuration to JSON: {e}"),
            )
        })?);
        let held: Box<dyn Announced> = rendezvous
            .announce(Announcement {
                model: model_name.to_string(),
                rank,
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
            json,
            "published",
            rank,
            step,
            &path,
            publisher.memory_bytes(),
        );
        Ok(Running {
            rank,
            json,
            dir,
            model,
            publisher,
            held,
            announced: step,
            serving: Some(Serving { step, path, ckpt }),
            refused: BTreeMap::new(),
            listing: None,
            lost: None,
            note: None,
            tried: 0,
            pending: None,
            deferred: None,
        })
    }
}

async fn publish(args: PublishArgs) -> Result<Outcome> {
    let cfg = args.transport.load()?;
    let topology: PublisherTopology = args.publishers.parse()?;
    let poll = Duration::from_millis(args.poll_ms.max(10));
    let rendezvous = connect(&args.rendezvous).await?;
    // At start a bad checkpoint is an error: there is nothing good to keep serving.
    let (step, path) = newest(&args.checkpoint, poll).await?;
    let ckpt = Checkpoint::open(&path)?;
    let registry = reshard_transports::registry();
    let agent = format!("{}-publisher-{}", args.model, args.rank);
    let transport: Arc<dyn Transport> = registry.create(&agent, &cfg.transport)?;
    let mut running = Running::start(
        rendezvous.as_ref(),
        transport,
        &args.model,
        &topology,
        args.rank,
        args.json,
        args.checkpoint.clone(),
        (step, path, ckpt),
    )
    .await?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| Error::new(ErrorKind::Internal, format!("cannot watch SIGTERM: {e}")))?;
    let outcome = loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break Ok(()),
            _ = term.recv() => break Ok(()),
            _ = tokio::time::sleep(poll) => {
                if let Err(e) = running.held.check_alive() {
                    break Err(e);
                }
                if let Err(e) = running.look().await {
                    break Err(e.with_owner(args.rank));
                }
            }
        }
    };
    // Withdraw first (receivers stop discovering this rank), then release the memory.
    let Running {
        held,
        publisher,
        announced,
        serving,
        ..
    } = running;
    let withdrawn = held.withdraw().await;
    drop(publisher);
    outcome?;
    withdrawn?;
    let path = serving.map_or(args.checkpoint.clone(), |s| s.path);
    line(args.json, "withdrew", args.rank, announced, &path, 0);
    Ok(Outcome(true))
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard_checkpoint::{write_checkpoint, WriteOptions};
    use reshard_rendezvous::InProcess;

    /// A scratch folder removed when dropped.
    struct Scratch(PathBuf);

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn write(dir: &Path, step: u64) -> PathBuf {
        let model = reshard_testkit::models::tiny_moe(4);
        let path = dir.join(format!("step-{step}"));
        let opts = WriteOptions {
            max_shard_bytes: 64 << 10,
        };
        write_checkpoint(&model, step, &path, &opts).unwrap();
        path
    }

    /// Cuts every shard file of `path` to half its size, in place.
    fn truncate_shards(path: &Path) {
        for e in std::fs::read_dir(path).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "safetensors") {
                let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
                let len = f.metadata().unwrap().len();
                f.set_len(len / 2).unwrap();
            }
        }
    }

    /// (step, ready, note) of rank 0 as the rendezvous shows it.
    async fn member(hub: &InProcess) -> (u64, bool, Option<String>) {
        let (m, _) = hub.members("tiny").await.unwrap();
        (m[0].step, m[0].ready, m[0].note.clone())
    }

    fn memory(r: &Running) -> Vec<u8> {
        r.publisher.memory().bytes().to_vec()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bad_newer_step_never_ends_a_publisher_that_serves_a_good_one() {
        let scratch = Scratch(
            std::env::temp_dir().join(format!("reshard-publish-unit-{}", std::process::id())),
        );
        let dir = scratch.0.clone();
        let _ = std::fs::remove_dir_all(&dir);
        let step1 = write(&dir, 1);
        let hub = InProcess::new();
        let cfg = crate::load_config(Some("loopback"), None).unwrap();
        let transport = reshard_transports::registry()
            .create("tiny-publisher-0", &cfg.transport)
            .unwrap();
        let topology: PublisherTopology = "tp=1".parse().unwrap();
        let ckpt = Checkpoint::open(&step1).unwrap();
        let mut r = Running::start(
            &hub,
            transport,
            "tiny",
            &topology,
            0,
            true,
            dir.clone(),
            (1, step1, ckpt),
        )
        .await
        .unwrap();
        let served = memory(&r);
        let table = encode_table(r.publisher.table());

        // Step 2 passes every check, then its shard files are cut before the load: the load
        // fails part-way, the served step is loaded again and announced ready.
        let step2 = write(&dir, 2);
        let fresh = r.check(&step2).unwrap();
        truncate_shards(&step2);
        let e = match r.install(2, &step2, fresh).await {
            Err(Failure::Refused(e)) => e,
            Err(Failure::Fatal(e)) => panic!("fatal: {e}"),
            Err(Failure::Later) => panic!("deferred"),
            Ok(()) => panic!("installed a truncated step"),
        };
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert!(e.message().contains(".safetensors"), "{e}");
        assert!(e.context().range.is_some(), "{e}");
        assert!(memory(&r) == served, "the served step's bytes are back");
        assert_eq!(encode_table(r.publisher.table()), table);
        assert_eq!(member(&hub).await, (1, true, None));

        // Seen by the poll: refused once with the reason in the note, not tried again while
        // the folder stays as it is.
        r.look().await.unwrap();
        let tried = r.tried;
        let (step, ready, note) = member(&hub).await;
        assert_eq!((step, ready), (1, true));
        let note = note.expect("a note");
        assert!(
            note.contains("refused step 2") && note.contains("serving step 1"),
            "{note}"
        );
        for _ in 0..3 {
            r.look().await.unwrap();
        }
        assert_eq!(
            r.tried, tried,
            "an unchanged refused folder is not tried again"
        );
        assert!(memory(&r) == served);

        // Rewritten, it is tried again and published; the note clears.
        write(&dir, 2);
        r.look().await.unwrap();
        assert_eq!(member(&hub).await, (2, true, None));
        assert!(memory(&r) != served);

        // When the served step's own files are cut too (its folder rewritten in place, against
        // the contract), nothing good is left: unready, saying so, until a newer step loads.
        let step3 = write(&dir, 3);
        let fresh = r.check(&step3).unwrap();
        truncate_shards(&step3);
        truncate_shards(&dir.join("step-2"));
        assert!(matches!(
            r.install(3, &step3, fresh).await,
            Err(Failure::Refused(_))
        ));
        r.look().await.unwrap();
        let (step, ready, note) = member(&hub).await;
        assert_eq!((step, ready), (2, false));
        assert!(note.unwrap().contains("serving no step"));
        write(&dir, 4);
        r.look().await.unwrap();
        assert_eq!(member(&hub).await, (4, true, None));
        r.held.withdraw().await.unwrap();
    }
}
