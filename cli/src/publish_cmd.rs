//! `reshard publish`: one publisher rank as its own process (docs/deployment.md). It holds its
//! Megatron shard of a safetensors checkpoint in registered memory, announces it through the
//! rendezvous, advances when a newer complete checkpoint appears, and withdraws cleanly on
//! SIGTERM or SIGINT.
//!
//! Nothing at start ends it but a bad configuration (flags, transport, topology), a signal or
//! its rank held by another live process (exit 2, naming that process); docs/deployment.md §5:
//! - A checkpoint folder that cannot be published (incomplete though indexed, unreadable, of
//!   another architecture, changed while it was read) is refused, at start as once a step is
//!   served: it says why (a log line, a `refused` JSON line, and the note `reshard status`
//!   shows), tries the next older complete one, and tries that folder again only once the
//!   folder changes. Once a step is served it keeps serving it past a refused newer one.
//! - With no complete checkpoint it can serve, it says why within one look (which folder, which
//!   file is missing or short, which were refused), once per change, and claims its rank
//!   announced not ready with that note, until a checkpoint it can serve appears.
//! - etcd out of reach, at start or later, never ends it: connecting, claiming and announcing
//!   are tried again with backoff (said once per outage: `rendezvous_unreachable`, then
//!   `rendezvous_back`); a rendezvous write that fails for that (marking itself not ready,
//!   advancing, setting its note) is tried again at the next look, and the memory is never
//!   rewritten before "not ready" is written. Its lease outlives the outage
//!   (`reshard-rendezvous` reconnects, and announces the same incarnation again if the lease
//!   expired meanwhile).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Args;
use reshard_checkpoint::{candidates, incomplete_reason, Checkpoint, FolderState, INDEX_FILE};
use reshard_core::encoding::encode_table;
use reshard_core::rendezvous::{wait_released, Announced, Announcement, Rendezvous};
use reshard_core::{Error, ErrorKind, Result, Transport};
use reshard_planner::presets::ModelConfig;
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
    /// Longest wait, in seconds, for receivers still reading the served step to finish before
    /// its memory is overwritten with a newer checkpoint (the reader fence). Past it the memory
    /// is overwritten anyway, said in a `fence_timeout` line: those receivers' digest checks
    /// refuse what changed under them and they keep their weights.
    #[arg(long, default_value_t = 60.0)]
    fence_timeout_s: f64,
    /// Print one JSON line per step published.
    #[arg(long)]
    json: bool,
}

/// Runs the publisher until SIGTERM or SIGINT.
pub fn run(args: PublishArgs) -> Result<Outcome> {
    crate::block_on(publish(args))
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
        outln!("{v}");
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

/// Where the rendezvous comes from: connected already, or to connect to (and again, with
/// backoff, while etcd is out of reach).
enum Meeting {
    Connected(Arc<dyn Rendezvous>),
    To(RendezvousArgs),
}

/// Longest pause between two tries to reach an etcd that is out of reach at start.
const CONNECT_BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Why no checkpoint is served, as last said: said again only when `key` changes (the folders
/// and what is wrong with each, without the byte counts of a file still being written).
struct Unserved {
    key: String,
    message: String,
}

/// A publisher rank: its memory once a step is loaded, its announcement once the rendezvous
/// answered, and what it has refused.
struct Running {
    rank: u32,
    json: bool,
    dir: PathBuf,
    model_name: String,
    topology: PublisherTopology,
    transport: Arc<dyn Transport>,
    meeting: Meeting,
    /// No connect is tried before this instant (backoff while etcd is out of reach).
    connect_after: Instant,
    connect_backoff: Duration,
    /// The architecture, fixed by the first step loaded: a publisher keeps one for its life.
    model: Option<ModelConfig>,
    /// Registered memory, laid out once the architecture is known.
    publisher: Option<ShardPublisher>,
    /// The announcement, once made: a claim without a step (`claim_only`) or a served step.
    held: Option<Box<dyn Announced>>,
    /// `held` claims the rank with no step to serve (an empty table, not ready).
    claim_only: bool,
    /// The step the announcement carries (ready only while `serving` is `Some`).
    announced: u64,
    serving: Option<Serving>,
    /// Refused step folders by path; each is tried again only once its state differs.
    refused: BTreeMap<PathBuf, Refused>,
    /// Why the checkpoint folder cannot be listed, while it cannot.
    listing: Option<String>,
    /// Why no step is served, after the served step could not be loaded again.
    lost: Option<String>,
    /// Why no checkpoint is served since start, while none is.
    unserved: Option<Unserved>,
    /// The note last set on the announcement.
    note: Option<String>,
    /// Step folders tried so far (each refused one once per state it is in).
    tried: u64,
    /// A step in memory whose announcement could not be written yet (etcd out of reach): the
    /// record says not ready (or nothing is announced) until it is.
    pending: Option<u64>,
    /// Since when the rendezvous fails (etcd out of reach), while it does.
    deferred: Option<Instant>,
    /// Longest wait for readers of the served step before its memory is overwritten.
    fence_timeout: Duration,
}

/// `text` without its digits: two reasons that differ only in byte counts (a file still being
/// written) are one reason.
fn without_digits(text: &str) -> String {
    text.chars().filter(|c| !c.is_ascii_digit()).collect()
}

impl Running {
    /// A publisher of rank `rank` of `topology` that serves nothing yet: its first
    /// [`Running::look`] finds a checkpoint, and announces it once the rendezvous answers.
    #[allow(clippy::too_many_arguments)]
    fn new(
        meeting: Meeting,
        transport: Arc<dyn Transport>,
        model_name: &str,
        topology: PublisherTopology,
        rank: u32,
        json: bool,
        dir: PathBuf,
        poll: Duration,
    ) -> Running {
        Running {
            rank,
            json,
            dir,
            model_name: model_name.to_string(),
            topology,
            transport,
            meeting,
            connect_after: Instant::now(),
            connect_backoff: poll,
            model: None,
            publisher: None,
            held: None,
            claim_only: false,
            announced: 0,
            serving: None,
            refused: BTreeMap::new(),
            listing: None,
            lost: None,
            unserved: None,
            note: None,
            tried: 0,
            pending: None,
            deferred: None,
            fence_timeout: Duration::from_secs(60),
        }
    }

    /// Whether receivers may be reading the memory: a step is announced (not a bare claim).
    fn readable(&self) -> bool {
        self.held.is_some() && !self.claim_only
    }

    /// The step a newer checkpoint must be above: the one served, else the one announced (a
    /// publisher that lost its served step never goes back to an older one: receivers hold
    /// that step already); none before a step was announced (at start every step is a
    /// candidate, newest first).
    fn floor(&self) -> Option<u64> {
        match (&self.serving, self.readable()) {
            (Some(s), _) => Some(s.step),
            (None, true) => Some(self.announced),
            (None, false) => None,
        }
    }

    /// Fails once the rank is lost for good to another live process.
    fn check_alive(&self) -> Result<()> {
        self.held.as_ref().map_or(Ok(()), |h| h.check_alive())
    }

    /// One look at the checkpoint folder: tries the newest step above the one served that is
    /// complete (a sharded folder without its index, or a single file whose size does not
    /// check out yet, is still being written) and is not refused in its current state,
    /// falling back to older ones while they are refused. With nothing served, says why, and
    /// claims the rank not ready. Only rendezvous failures that end the process are returned.
    async fn look(&mut self) -> Result<()> {
        // A step loaded but not announced comes first: until it is, memory that receivers may
        // read is not touched.
        if let Some(step) = self.pending {
            match self.advance(step).await {
                Ok(true) => {}
                Ok(false) | Err(Failure::Later) if self.readable() => return Ok(()),
                Ok(false) | Err(Failure::Later) => {}
                Err(Failure::Fatal(e) | Failure::Refused(e)) => return Err(e),
            }
        }
        let list = match candidates(&self.dir) {
            Ok(l) => l,
            Err(e) => {
                self.listing = Some(e.message().to_string());
                return self.settle(&[]).await;
            }
        };
        self.listing = None;
        let floor = self.floor();
        for (step, path) in &list {
            let (step, path) = (*step, path.clone());
            if floor.is_some_and(|f| step <= f) {
                break;
            }
            // A sharded folder's index is written last: with it, the folder claims to be
            // complete, and one that is not is refused. Without it, or for a single file,
            // an incomplete folder is still being written.
            if !path.join(INDEX_FILE).exists() && incomplete_reason(&path).is_some() {
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
        let floor = self.floor();
        self.refused
            .retain(|p, r| floor.is_none_or(|f| r.step > f) && list.iter().any(|(_, q)| q == p));
        self.settle(&list).await
    }

    /// After a look at `list`: says why nothing is served (once per change), claims the rank
    /// while nothing is announced, and sets the note.
    async fn settle(&mut self, list: &[(u64, PathBuf)]) -> Result<()> {
        if self.serving.is_none() && self.lost.is_none() {
            self.say_unserved(list);
        } else {
            self.unserved = None;
        }
        if self.held.is_none() && self.pending.is_none() && self.serving.is_none() {
            match self.claim().await {
                Ok(()) | Err(Failure::Later) => {}
                Err(Failure::Fatal(e) | Failure::Refused(e)) => return Err(e),
            }
        }
        self.update_note().await
    }

    /// Says why no checkpoint in the folder can be served: which folders there are and what is
    /// wrong with each (the file missing or short, or why it was refused). Said when it changes.
    fn say_unserved(&mut self, list: &[(u64, PathBuf)]) {
        let dir = self.dir.display();
        let (key, message) = if let Some(why) = &self.listing {
            (why.clone(), why.clone())
        } else if list.is_empty() {
            let m = format!(
                "no checkpoint in {dir}: no step-N/ folder, and no {INDEX_FILE} or \
                 model.safetensors in it"
            );
            (m.clone(), m)
        } else {
            let mut parts = Vec::new();
            let mut key = String::new();
            for (step, path) in list.iter().take(4) {
                let why = match self.refused.get(path) {
                    Some(r) => format!("refused: {}", r.reason),
                    None => incomplete_reason(path).unwrap_or_else(|| "not tried yet".into()),
                };
                key.push_str(&format!("{}|{}|", path.display(), without_digits(&why)));
                parts.push(format!("step {step}: {why}"));
            }
            if list.len() > 4 {
                parts.push(format!("and {} older step folders", list.len() - 4));
            }
            let m = format!(
                "no complete checkpoint in {dir} can be served: {}",
                parts.join("; ")
            );
            (key, m)
        };
        if self.unserved.as_ref().is_some_and(|u| u.key == key) {
            return;
        }
        if self.json {
            outln!(
                "{}",
                serde_json::json!({"event": "no_checkpoint", "rank": self.rank,
                    "checkpoint": self.dir, "reason": message})
            );
        } else {
            eprintln!(
                "publisher rank {}: serving no step: {message}; waiting for one",
                self.rank
            );
        }
        self.unserved = Some(Unserved { key, message });
    }

    /// The rendezvous, connecting to it when not yet connected (with backoff); `Later` while
    /// etcd is out of reach.
    async fn rendezvous(&mut self) -> std::result::Result<Arc<dyn Rendezvous>, Failure> {
        let args = match &self.meeting {
            Meeting::Connected(r) => return Ok(r.clone()),
            Meeting::To(args) => args.clone(),
        };
        if Instant::now() < self.connect_after {
            return Err(Failure::Later);
        }
        match connect(&args).await {
            Ok(r) => {
                self.meeting = Meeting::Connected(r.clone());
                self.resumed();
                Ok(r)
            }
            Err(e) => {
                self.connect_after = Instant::now() + self.connect_backoff;
                self.connect_backoff = (self.connect_backoff * 2).min(CONNECT_BACKOFF_MAX);
                Err(self.rendezvous_failure(e))
            }
        }
    }

    /// Claims the rank with no step to serve (an empty table: not ready), so `reshard status`
    /// shows the note saying why, and a second process for the rank is refused.
    async fn claim(&mut self) -> std::result::Result<(), Failure> {
        let rendezvous = self.rendezvous().await?;
        let a = self.announcement(0, Bytes::new(), Bytes::new()).await?;
        match rendezvous.announce(a).await {
            Ok(h) => {
                self.resumed();
                self.held = Some(h);
                self.claim_only = true;
                self.note = None;
                Ok(())
            }
            Err(e) => Err(self.rendezvous_failure(e)),
        }
    }

    /// The announcement of this rank at `step` with `table` and architecture `config`.
    async fn announcement(
        &self,
        step: u64,
        table: Bytes,
        config: Bytes,
    ) -> std::result::Result<Announcement, Failure> {
        Ok(Announcement {
            model: self.model_name.clone(),
            rank: self.rank,
            world: self.topology.world(),
            step,
            transport: self.transport.name().to_string(),
            incarnation: self.transport.incarnation(),
            table,
            metadata: self
                .transport
                .export_metadata()
                .await
                .map_err(Failure::Fatal)?,
            config,
        })
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
                format!("not a complete checkpoint: {why}"),
            ));
        }
        let fresh = Checkpoint::open(path)?;
        if self.model.as_ref().is_some_and(|m| fresh.model() != m) {
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
    /// it again, so receivers keep reading it; the failure is returned as a refusal. The first
    /// step loaded lays out the memory.
    async fn install(
        &mut self,
        step: u64,
        path: &Path,
        fresh: Checkpoint,
    ) -> std::result::Result<(), Failure> {
        // Receivers must not start reading while the memory is rewritten in place (one that
        // already is fails its digest check and keeps its previous weights): no write of "not
        // ready", no rewrite.
        if self.readable() {
            if let Some(h) = &self.held {
                if let Err(e) = h.unready().await {
                    return Err(self.rendezvous_failure(e));
                }
            }
            self.resumed();
            self.fence(step).await;
        }
        if self.publisher.is_none() {
            // A topology the checkpoint's architecture does not divide into is this
            // checkpoint's problem as much as the flags': refused, said, waited past.
            let p = ShardPublisher::new(
                self.transport.clone(),
                fresh.model(),
                &self.topology,
                self.rank,
            )
            .await
            .map_err(Failure::Refused)?;
            self.model = Some(fresh.model().clone());
            self.publisher = Some(p);
        }
        let Some(publisher) = &mut self.publisher else {
            return Err(Failure::Fatal(Error::new(
                ErrorKind::Internal,
                "publisher memory missing after it was laid out",
            )));
        };
        if let Err(e) = load(publisher, step, &fresh) {
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

    /// The reader fence before memory receivers may be reading is overwritten with step `step`
    /// (the announcement is not ready already, so no new reader starts): waits until no
    /// receiver claims this rank's memory, up to `fence_timeout`. Readers waited for are said
    /// in a `fence` line; past the timeout a `fence_timeout` line names who still reads, and
    /// the memory is overwritten anyway (their digest checks refuse it; a rendezvous out of
    /// reach is waited through until then).
    async fn fence(&mut self, step: u64) {
        let Meeting::Connected(rendezvous) = &self.meeting else {
            return;
        };
        let incarnation = self.transport.incarnation();
        let released = wait_released(
            rendezvous.as_ref(),
            &self.model_name,
            self.rank,
            incarnation,
            self.fence_timeout,
        )
        .await;
        let rank = self.rank;
        match released {
            Ok(r) if r.readers.is_empty() => {}
            Ok(r) if self.json => outln!(
                "{}",
                serde_json::json!({"event": "fence", "rank": rank, "step": step,
                    "waited_s": r.waited.as_secs_f64(), "readers": r.readers})
            ),
            Ok(r) => eprintln!(
                "publisher rank {rank}: waited {:.3} s for {} reader(s) before loading step \
                 {step}: {}",
                r.waited.as_secs_f64(),
                r.readers.len(),
                r.readers.join("; ")
            ),
            Err(e) if self.json => outln!(
                "{}",
                serde_json::json!({"event": "fence_timeout", "rank": rank, "step": step,
                    "error": error_json(&e)})
            ),
            Err(e) => eprintln!(
                "publisher rank {rank}: loading step {step} over memory still being read: {e}; \
                 those receivers' digest checks refuse what changes under them"
            ),
        }
    }

    /// After a failed load (`why`): loads the served step again and announces it ready. When
    /// that fails too, the publisher serves nothing (stays unready) until a newer step loads.
    async fn restore(&mut self, why: &Error) -> std::result::Result<(), Failure> {
        let (Some(s), Some(publisher)) = (&self.serving, &mut self.publisher) else {
            return Ok(());
        };
        let step = s.step;
        match load(publisher, step, &s.ckpt) {
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
                    outln!(
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
    /// false when etcd is out of reach, the step left `pending` for the next look. The first
    /// announcement of a step replaces the bare claim, if one was made.
    async fn advance(&mut self, step: u64) -> std::result::Result<bool, Failure> {
        let table = match &self.publisher {
            Some(p) => Bytes::from(encode_table(p.table())),
            None => return Ok(false),
        };
        let written = match &self.held {
            Some(h) if !self.claim_only => h.advance(step, table).await,
            _ => return self.announce(step, table).await,
        };
        if let Err(e) = written {
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
            self.said("advanced", step);
        }
        Ok(true)
    }

    /// The first announcement of a served step (`table` the memory's): a bare claim made while
    /// nothing was served is replaced by it (its record carries no architecture), with no
    /// moment where the rank is free. `false` (the step `pending`) while etcd is out of reach.
    async fn announce(&mut self, step: u64, table: Bytes) -> std::result::Result<bool, Failure> {
        let rendezvous = match self.rendezvous().await {
            Ok(r) => r,
            Err(Failure::Later) => {
                self.pending = Some(step);
                return Ok(false);
            }
            Err(f) => return Err(f),
        };
        let config = self.model.as_ref().map_or(Ok(Vec::new()), |m| {
            serde_json::to_vec(m).map_err(|e| {
                Failure::Fatal(Error::new(
                    ErrorKind::Internal,
                    format!("model configuration to JSON: {e}"),
                ))
            })
        })?;
        let a = self.announcement(step, table, Bytes::from(config)).await?;
        // A bare claim held by this process is handed over to the announcement in one step (the
        // rendezvous moves the record to the new lease: same process, same incarnation), then
        // withdrawn, which removes only its own lease's keys. Withdrawing first left a moment in
        // which a second claimant could take the rank.
        match rendezvous.announce(a).await {
            Ok(h) => {
                if let Some(claim) = self.held.take() {
                    // Best effort: a claim that could not be revoked expires with its lease.
                    let _ = claim.withdraw().await;
                }
                self.resumed();
                self.held = Some(h);
                self.claim_only = false;
                self.note = None;
                self.pending = None;
                self.announced = step;
                self.said("published", step);
                Ok(true)
            }
            Err(e) => match self.rendezvous_failure(e) {
                Failure::Later => {
                    self.pending = Some(step);
                    Ok(false)
                }
                f => Err(f),
            },
        }
    }

    /// Prints `what` (published, advanced) of step `step` from the folder served.
    fn said(&self, what: &str, step: u64) {
        if let (Some(s), Some(p)) = (&self.serving, &self.publisher) {
            line(self.json, what, self.rank, step, &s.path, p.memory_bytes());
        }
    }

    /// What a failed rendezvous request means: [`Failure::Later`] while etcd is out of reach
    /// and the rank still this process's (said once per outage), else [`Failure::Fatal`].
    fn rendezvous_failure(&mut self, e: Error) -> Failure {
        let transient = matches!(e.kind(), ErrorKind::Transport | ErrorKind::Timeout);
        if let Err(lost) = self.check_alive() {
            return Failure::Fatal(lost);
        }
        if !transient {
            return Failure::Fatal(e);
        }
        if self.deferred.is_none() {
            if self.json {
                outln!(
                    "{}",
                    serde_json::json!({"event": "rendezvous_unreachable", "rank": self.rank,
                        "step": self.announced, "pending_step": self.pending,
                        "serving_step": self.serving.as_ref().map(|s| s.step),
                        "announced": self.readable(), "error": error_json(&e)})
                );
            } else {
                eprintln!(
                    "publisher rank {}: the rendezvous cannot be reached ({e}); {}, trying \
                     again with backoff",
                    self.rank,
                    match (&self.serving, self.readable()) {
                        (Some(s), true) => format!("serving step {} on", s.step),
                        (Some(s), false) =>
                            format!("step {} loaded, announced once it answers", s.step),
                        (None, _) => "serving no step".to_string(),
                    }
                );
            }
        }
        self.deferred.get_or_insert_with(Instant::now);
        Failure::Later
    }

    /// A rendezvous request succeeded: an outage in progress is over (said once).
    fn resumed(&mut self) {
        if let Some(since) = self.deferred.take() {
            let waited = since.elapsed().as_secs_f64();
            if self.json {
                outln!(
                    "{}",
                    serde_json::json!({"event": "rendezvous_back", "rank": self.rank,
                        "waited_s": waited})
                );
            } else {
                eprintln!(
                    "publisher rank {}: the rendezvous answers again after {waited:.1} s",
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
            outln!("{v}");
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

    /// Sets the announcement's note to what `reshard status` should say now: a lost step, an
    /// unlistable folder or why nothing is served first, then the newest refused folder; none
    /// when all is well.
    async fn update_note(&mut self) -> Result<()> {
        let Some(held) = &self.held else {
            return Ok(());
        };
        let serving = self
            .serving
            .as_ref()
            .map_or("serving no step".to_string(), |s| {
                format!("serving step {}", s.step)
            });
        let note = if let Some(u) = &self.unserved {
            Some(format!("serving no step: {}", u.message))
        } else {
            let refused = self
                .refused
                .values()
                .max_by_key(|r| r.step)
                .map(|r| format!("refused step {}: {}; {serving}", r.step, r.reason));
            let trouble = match (&self.lost, &self.listing) {
                (Some(a), Some(b)) => Some(format!("{a}; {b}")),
                (a, b) => a.clone().or_else(|| b.clone()),
            };
            match (&trouble, refused) {
                (Some(t), Some(r)) => Some(format!("{t}; {r}")),
                (Some(t), None) => Some(format!("{t}; {serving}")),
                (None, r) => r,
            }
        };
        if note != self.note {
            match held.set_note(note.clone()).await {
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

/// `--fence-timeout-s` as a duration: finite and not negative.
fn fence_timeout(seconds: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(seconds).map_err(|_| {
        Error::new(
            ErrorKind::Config,
            format!("--fence-timeout-s must be a finite number of seconds >= 0; {seconds} is not"),
        )
    })
}

async fn publish(args: PublishArgs) -> Result<Outcome> {
    // A bad configuration ends the process at once: nothing else at start does.
    let cfg = args.transport.load()?;
    let topology: PublisherTopology = args.publishers.parse()?;
    if args.rank >= topology.world() {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "--rank {} is outside the {} ranks of --publishers {}",
                args.rank,
                topology.world(),
                args.publishers
            ),
        ));
    }
    if !args.rendezvous.rendezvous.starts_with("etcd://") {
        // The same refusal `connect` gives, before anything waits.
        connect(&args.rendezvous).await?;
    }
    let poll = Duration::from_millis(args.poll_ms.max(10));
    let registry = reshard::registry();
    let agent = format!("{}-publisher-{}", args.model, args.rank);
    let transport: Arc<dyn Transport> = registry.create(&agent, &cfg.transport)?;
    let mut running = Running::new(
        Meeting::To(args.rendezvous.clone()),
        transport,
        &args.model,
        topology,
        args.rank,
        args.json,
        args.checkpoint.clone(),
        poll,
    );
    running.fence_timeout = fence_timeout(args.fence_timeout_s)?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| Error::new(ErrorKind::Internal, format!("cannot watch SIGTERM: {e}")))?;
    // The first look at once: why nothing can be served is said within a second of starting.
    let mut pause = Duration::ZERO;
    let outcome = loop {
        let step = async {
            tokio::time::sleep(pause).await;
            running.check_alive()?;
            running.look().await.map_err(|e| e.with_owner(args.rank))
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break Ok(()),
            _ = term.recv() => break Ok(()),
            r = step => if let Err(e) = r { break Err(e) },
        }
        pause = poll;
    };
    // Withdraw first (receivers stop discovering this rank), then release the memory.
    let Running {
        held,
        publisher,
        announced,
        serving,
        ..
    } = running;
    let withdrawn = match held {
        Some(h) => h.withdraw().await,
        None => Ok(()),
    };
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
        r.publisher.as_ref().unwrap().memory().bytes().to_vec()
    }

    /// Rank 0 of TP1 of model "tiny" over loopback, meeting on `hub`, reading `dir`.
    fn running(hub: &InProcess, dir: &Path) -> Running {
        let cfg = crate::load_config(Some("loopback"), None).unwrap();
        let transport = reshard::registry()
            .create("tiny-publisher-0", &cfg.transport)
            .unwrap();
        Running::new(
            Meeting::Connected(Arc::new(hub.clone())),
            transport,
            "tiny",
            "tp=1".parse().unwrap(),
            0,
            true,
            dir.to_path_buf(),
            Duration::from_millis(10),
        )
    }

    fn scratch(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "reshard-publish-unit-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        Scratch(dir)
    }

    /// At start: with no complete checkpoint the rank is claimed not ready, the note naming the
    /// folder and the file that is short; a bad newest step is refused and the older good one
    /// served; the refused folder is not tried again until it changes, and is published then.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_publisher_starts_on_the_newest_good_step_and_says_why_when_there_is_none() {
        let scratch = scratch("start");
        let dir = scratch.0.clone();
        std::fs::create_dir_all(&dir).unwrap();
        let hub = InProcess::new();
        let mut r = running(&hub, &dir);
        r.look().await.unwrap();
        let (step, ready, note) = member(&hub).await;
        assert_eq!((step, ready), (0, false), "claimed, not ready");
        let note = note.expect("a note");
        assert!(note.contains("no checkpoint in"), "{note}");

        // A single file cut short: incomplete, said with the folder and the file.
        let one = dir.join("step-1");
        reshard_checkpoint::write_single_file(&reshard_testkit::models::tiny_moe(4), 1, &one)
            .unwrap();
        let file = one.join(reshard_checkpoint::SINGLE_FILE);
        let len = std::fs::metadata(&file).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&file)
            .unwrap()
            .set_len(len - 8)
            .unwrap();
        r.look().await.unwrap();
        let (_, ready, note) = member(&hub).await;
        let note = note.unwrap();
        assert!(!ready);
        assert!(
            note.contains("step-1") && note.contains("model.safetensors"),
            "{note}"
        );
        assert_eq!(r.tried, 0, "an incomplete single file is not tried");

        // Whole again, and a newer sharded step 2 cut short under its index: 2 is refused,
        // 1 is served (a single file, published as a sharded one is).
        reshard_checkpoint::write_single_file(&reshard_testkit::models::tiny_moe(4), 1, &one)
            .unwrap();
        let step2 = write(&dir, 2);
        truncate_shards(&step2);
        r.look().await.unwrap();
        let (step, ready, note) = member(&hub).await;
        assert_eq!((step, ready), (1, true));
        assert!(note.unwrap().contains("refused step 2"));
        let tried = r.tried;
        r.look().await.unwrap();
        assert_eq!(
            r.tried, tried,
            "an unchanged refused folder is not tried again"
        );
        write(&dir, 2);
        r.look().await.unwrap();
        assert_eq!(member(&hub).await, (2, true, None));
        r.held.take().unwrap().withdraw().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bad_newer_step_never_ends_a_publisher_that_serves_a_good_one() {
        let scratch = scratch("newer");
        let dir = scratch.0.clone();
        let step1 = write(&dir, 1);
        let hub = InProcess::new();
        let mut r = running(&hub, &dir);
        r.look().await.unwrap();
        assert_eq!(member(&hub).await, (1, true, None));
        assert_eq!(r.serving.as_ref().map(|s| &s.path), Some(&step1));
        let served = memory(&r);
        let table = encode_table(r.publisher.as_ref().unwrap().table());

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
        assert_eq!(encode_table(r.publisher.as_ref().unwrap().table()), table);
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
        r.held.take().unwrap().withdraw().await.unwrap();
    }

    /// The reader fence in `reshard publish`: while a receiver claims to read the served step,
    /// a newer checkpoint is not loaded over it: the announcement goes not ready (no new
    /// reader starts) and the memory keeps the served step's bytes until the claim is released;
    /// then the new step is loaded and announced. Past `--fence-timeout-s` it loads anyway.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_newer_checkpoint_waits_for_the_readers_of_the_served_one() {
        use reshard_core::rendezvous::ReadClaim;

        let dir = scratch("fence");
        write(&dir.0, 1);
        let hub = InProcess::new();
        let mut r = running(&hub, &dir.0);
        r.look().await.unwrap();
        assert_eq!(member(&hub).await, (1, true, None));
        let step1 = memory(&r);
        let incarnation = r.transport.incarnation();
        let claim = |step| ReadClaim {
            model: "tiny".into(),
            step,
            reader: "receiver rank 0 of the unit test".into(),
            ranks: vec![(0, incarnation)],
        };
        let reading = hub.claim_reading(claim(1)).await.unwrap();
        write(&dir.0, 2);
        {
            let look = r.look();
            tokio::pin!(look);
            let held = tokio::time::timeout(Duration::from_millis(300), &mut look).await;
            assert!(held.is_err(), "a newer step loaded while a receiver read");
            assert_eq!(member(&hub).await, (1, false, None));
            reading.release().await.unwrap();
            look.await.unwrap();
        }
        assert_eq!(member(&hub).await, (2, true, None));
        assert_ne!(memory(&r), step1);

        // A reader that never lets go: loaded after the timeout, said in a fence_timeout line.
        r.fence_timeout = Duration::from_millis(200);
        let _stuck = hub.claim_reading(claim(2)).await.unwrap();
        write(&dir.0, 3);
        tokio::time::timeout(Duration::from_secs(30), r.look())
            .await
            .expect("the fence timeout bounds the wait")
            .unwrap();
        assert_eq!(member(&hub).await, (3, true, None));
    }
}
