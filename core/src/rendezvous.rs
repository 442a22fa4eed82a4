//! Rendezvous: how publishers and receivers that share nothing but a metadata service find each
//! other (docs/deployment.md). A publisher rank announces its encoded shard table and its
//! transport metadata for one step under a lease it keeps alive; a receiver waits until exactly
//! the N ready publishers of a model stand at one step, fetches their announcements, and
//! watches for the next step or a membership change. This module owns the contract and the
//! discovery rule; implementations (in-process, etcd) live beside core in `reshard-rendezvous`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;

use crate::{Error, ErrorKind, OwnerId, Result};

mod fence;
pub use fence::{wait_released, ReadClaim, Reading, Released, MAX_CLAIM_RANKS};

/// What one publisher rank announces: everything a receiver needs to read from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Announcement {
    /// Model name, the rendezvous namespace publishers and receivers share.
    pub model: String,
    /// The publisher's rank, which is the owner id of every offer in its table.
    pub rank: OwnerId,
    /// How many publisher ranks the model has (every member must agree).
    pub world: u32,
    /// Training step whose weights the table describes.
    pub step: u64,
    /// Transport scheme the publisher serves reads on (a receiver must use the same).
    pub transport: String,
    /// The publisher endpoint's incarnation (also in the table's `PublisherId`): a restarted
    /// publisher announces a new one, so stale metadata is never paired with a new table.
    pub incarnation: u64,
    /// The shard table, encoded (`reshard_core::encoding`). Empty: the rank is claimed with no
    /// step to serve yet (a publisher waiting for a checkpoint it can serve, its note saying
    /// why), announced not ready; such a publisher withdraws and announces again to serve.
    pub table: Bytes,
    /// The transport's exported metadata (`Transport::export_metadata`).
    pub metadata: Bytes,
    /// The model's architecture as the publisher read it from its checkpoint (JSON of the
    /// planner's `ModelConfig`), so a receiver needs no preset; every member must agree.
    pub config: Bytes,
}

/// Most publisher ranks one model may have: far above any real deployment (docs/deployment.md
/// measures 1,024), low enough that a world size read from a rendezvous can never size an
/// allocation or a loop beyond reason (docs/bad-input.md, "Rendezvous records").
pub const MAX_WORLD: u32 = 1 << 20;

impl Announcement {
    /// Checks what every implementation refuses before announcing: a rank outside the world, or
    /// a world above [`MAX_WORLD`].
    pub fn check(&self) -> Result<()> {
        if self.world > MAX_WORLD {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "model {:?} announces a world of {} publisher ranks, above the limit of {}",
                    self.model, self.world, MAX_WORLD
                ),
            )
            .with_owner(self.rank));
        }
        if self.rank >= self.world {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "publisher rank {} of model {:?} is outside its world of {} ranks",
                    self.rank, self.model, self.world
                ),
            )
            .with_owner(self.rank));
        }
        Ok(())
    }
}

/// What a rendezvous knows of one member without fetching its table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// The publisher's rank.
    pub rank: OwnerId,
    /// Publisher ranks of the model, as this member announced.
    pub world: u32,
    /// Step of its current announcement.
    pub step: u64,
    /// False while the publisher rewrites its weights for the next step.
    pub ready: bool,
    /// Transport scheme.
    pub transport: String,
    /// Endpoint incarnation.
    pub incarnation: u64,
    /// Time since the member's lease was granted.
    pub age: Duration,
    /// Bytes of its encoded table.
    pub table_bytes: u64,
    /// The publisher's own status line, when it set one ([`Announced::set_note`]): why it does
    /// not advance to a newer checkpoint, for `reshard status`.
    pub note: Option<String>,
    /// The process that holds the rank, when the rendezvous names it (`reshard status`).
    pub holder: Option<Holder>,
}

/// The process holding a publisher rank: one per rank (docs/deployment.md, "One holder per
/// rank").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// Host name of the holding process.
    pub host: String,
    /// Its process id on that host.
    pub pid: u32,
}

/// Longest note a member carries, in bytes; [`clip_note`] cuts a longer one.
pub const MAX_NOTE_BYTES: usize = 512;

/// `note` cut to at most [`MAX_NOTE_BYTES`] bytes on a character boundary (a cut one ends in
/// `...`), so a member record stays small whatever error text it carries.
pub fn clip_note(note: &str) -> String {
    if note.len() <= MAX_NOTE_BYTES {
        return note.to_string();
    }
    let mut end = MAX_NOTE_BYTES - 3;
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &note[..end])
}

/// One rank's announcement as [`Rendezvous::fetch`] read it, with the readiness its record had
/// at that moment: a receiver installs only announcements that were ready at the step it chose.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fetched {
    /// The announcement.
    pub announcement: Announcement,
    /// False while the publisher rewrites its weights (it called [`Announced::unready`] and has
    /// not advanced since): its table may no longer describe its memory.
    pub ready: bool,
}

/// A publisher's hold on its announcement. Dropping it without [`Announced::withdraw`] leaves
/// the announcement to expire with its lease, as a killed publisher's would.
#[async_trait]
pub trait Announced: Send + Sync {
    /// Marks the announcement not ready: the publisher is about to rewrite its weights in place,
    /// so a receiver must not start reading them.
    async fn unready(&self) -> Result<()>;
    /// Announces step `step` with its new table, ready (weights and digests already written).
    async fn advance(&self, step: u64, table: Bytes) -> Result<()>;
    /// Sets (`Some`) or clears (`None`) the member's note, cut by [`clip_note`]; step and
    /// readiness are unchanged. A publisher serving an older step says here why it does not
    /// advance (a newer checkpoint it refused), so `reshard status` shows it.
    async fn set_note(&self, note: Option<String>) -> Result<()>;
    /// Fails once the rank is lost for good (another live process holds it now): the publisher
    /// is no longer seen and must end. A lease the service expired while it was unreachable is
    /// not such a loss where the implementation announces again under a new lease (etcd does).
    fn check_alive(&self) -> Result<()>;
    /// Removes the announcement now.
    async fn withdraw(self: Box<Self>) -> Result<()>;
}

/// A metadata service publishers and receivers meet through.
#[async_trait]
pub trait Rendezvous: Send + Sync {
    /// Where this rendezvous lives, for messages (`etcd://127.0.0.1:2379`, `in-process`).
    fn endpoint(&self) -> String;
    /// Announces under a lease kept alive while the returned handle lives. A rank has one
    /// holder: announcing a rank another live announcement holds fails with a `Config` error
    /// naming the holder (its incarnation, host and pid). One this very process holds in the
    /// same incarnation (a bare claim becoming an announcement) is handed over to the new
    /// handle at once, with no moment where the rank is free; the old handle's writes then fail
    /// and its withdrawal leaves the new announcement in place.
    async fn announce(&self, announcement: Announcement) -> Result<Box<dyn Announced>>;
    /// The current members of `model`, ordered by rank, and the revision they were read at.
    async fn members(&self, model: &str) -> Result<(Vec<Member>, u64)>;
    /// The full announcements of `ranks` of `model` as they are now, ordered by rank, each with
    /// its record's readiness read together with it (never a readiness of another moment).
    async fn fetch(&self, model: &str, ranks: &[OwnerId]) -> Result<Vec<Fetched>>;
    /// Waits until a member of `model` appears, changes or goes after `revision`, or until
    /// `timeout` passes; returns the revision then.
    async fn changed(&self, model: &str, revision: u64, timeout: Duration) -> Result<u64>;
    /// Every model with at least one member.
    async fn models(&self) -> Result<Vec<String>>;
    /// Claims, under a lease of this reader's own (so it expires with a dead reader), that
    /// `claim.reader` reads the memory `claim` names until the returned handle is released
    /// (the reader fence: [`wait_released`]).
    async fn claim_reading(&self, claim: ReadClaim) -> Result<Box<dyn Reading>>;
    /// Every live reading claim of `model` and the revision they were read at (a claim that
    /// does not decode is left out and logged).
    async fn readers(&self, model: &str) -> Result<(Vec<ReadClaim>, u64)>;
    /// Waits until a reading claim of `model` appears or goes after `revision`, or until
    /// `timeout` passes; returns the revision then.
    async fn readers_changed(&self, model: &str, revision: u64, timeout: Duration) -> Result<u64>;
}

/// What [`discover`] waits for.
#[derive(Clone, Debug)]
pub struct Want {
    /// Model name.
    pub model: String,
    /// Only a step above this one (`None`: any step).
    pub after_step: Option<u64>,
    /// How long to wait for a complete, ready set.
    pub timeout: Duration,
}

/// Exactly the publishers of one model at one step, ready.
#[derive(Clone, Debug)]
pub struct Discovered {
    /// The step every announcement stands at.
    pub step: u64,
    /// One announcement per rank `0..world`, ordered by rank.
    pub announcements: Vec<Announcement>,
    /// Revision the set was complete at (pass to [`Rendezvous::changed`] to watch on).
    pub revision: u64,
    /// Time spent waiting and fetching.
    pub elapsed: Duration,
    /// The rendezvous failures discovery waited through before it found the set, one line per
    /// distinct failure with how often it was seen (`3 x transport: could not list ...`);
    /// empty when nothing went wrong.
    pub waited_through: Vec<String>,
}

/// First pause after a rendezvous failure, or after a set that moved on, before discovery (or a
/// caller that discovers again, as `Subscriber::stage` does) looks again; doubled per failure in
/// a row up to [`RETRY_MAX`] by [`backoff`], so an etcd that is down, or a set that never holds
/// still, costs a few requests a second rather than as many as the service answers.
pub const RETRY_FIRST: Duration = Duration::from_millis(50);
/// Longest pause between two looks after rendezvous failures.
const RETRY_MAX: Duration = Duration::from_secs(1);
/// Shortest time one rendezvous request is given, even when the caller's deadline is nearer:
/// a request cut off before it can answer would make a short timeout a certain failure.
const MIN_REQUEST: Duration = Duration::from_secs(1);
/// Distinct failures a [`Discovered`] or a timeout message lists.
const MAX_WAITED: usize = 8;

/// Whether discovery waits through `e` and looks again, rather than returning it: the
/// rendezvous unreachable or slow (`Transport`, `Timeout`), a member that withdrew between the
/// member list and the fetch (`PeerUnknown`), or a record or blob rewritten between two reads
/// (`Decode`). Members that disagree on the world, the transport or the architecture are
/// returned at once: no wait mends them without a person.
pub fn is_transient(e: &Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Transport | ErrorKind::Timeout | ErrorKind::PeerUnknown | ErrorKind::Decode
    )
}

/// The failures one discovery waited through, counted per distinct message.
#[derive(Default)]
struct Waited(Vec<(String, u32)>);

impl Waited {
    fn note(&mut self, e: &Error) {
        let line = e.to_string();
        tracing::warn!("discovery waits through a rendezvous failure and looks again: {line}");
        if let Some(seen) = self.0.iter_mut().find(|(l, _)| *l == line) {
            seen.1 += 1;
        } else if self.0.len() < MAX_WAITED {
            self.0.push((line, 1));
        }
    }

    fn lines(&self) -> Vec<String> {
        self.0.iter().map(|(l, n)| format!("{n} x {l}")).collect()
    }
}

/// What one look at the rendezvous found.
enum Look {
    /// A complete, ready set at one step.
    Found(Discovered),
    /// No complete set: these members, read at this revision.
    Incomplete(Vec<Member>, u64),
    /// A complete set whose fetched announcements moved on meanwhile: look again after a pause.
    Moved(Vec<Member>),
}

/// Waits until every publisher rank of `want.model` is ready at one step (above
/// `want.after_step`), then fetches their announcements. The step is the newest that any ready
/// member stands at; members behind it are waited for. A set whose fetched announcements moved
/// on meanwhile (another step, or not ready any more at the chosen step: a publisher began to
/// rewrite its weights) is discarded and looked at again after a pause ([`backoff`], from
/// [`RETRY_FIRST`], never past `want.timeout`), so the result never mixes steps and never holds
/// a table its publisher had already withdrawn from readiness, and a set that keeps moving on
/// costs a few looks a second, not a loop as fast as the rendezvous answers.
///
/// Each rank counts once. Should a rendezvous list two records for one rank (the contract
/// gives a rank one holder, so only a broken implementation can), the rank counts as ready at a
/// step only when every record claiming it is; its one fetched announcement must then be ready
/// at that step as well, and a fetch that does not return exactly the ranks `0..world`, each
/// once, is looked at again like a set that moved on. Discovery never completes on a rank
/// counted twice nor with a rank missing; a set that stays ambiguous times out, the message
/// naming the ranks claimed by more than one record.
///
/// Rendezvous failures that time mends ([`is_transient`]: etcd unreachable or electing a
/// leader, a member withdrawn between the member list and the fetch, a compacted revision)
/// are waited through with backoff until `want.timeout`; they are listed in
/// [`Discovered::waited_through`], and in the `Timeout` error when no set came in time.
pub async fn discover(rendezvous: &dyn Rendezvous, want: &Want) -> Result<Discovered> {
    discover_at(rendezvous, want, None).await
}

/// [`discover`] of exactly step `step` (`want.after_step` is not consulted): waits until every
/// publisher rank is ready at that step. Publishers at another step, or not ready, are waited
/// for until `want.timeout`, counted from the call (an overall bound, never per look); the
/// `Timeout` error then names each rank that lacks the step and the step it has.
pub async fn discover_exact(
    rendezvous: &dyn Rendezvous,
    want: &Want,
    step: u64,
) -> Result<Discovered> {
    discover_at(rendezvous, want, Some(step)).await
}

/// [`discover`], or [`discover_exact`] when `exact` is set.
async fn discover_at(
    rendezvous: &dyn Rendezvous,
    want: &Want,
    exact: Option<u64>,
) -> Result<Discovered> {
    let start = Instant::now();
    let deadline = start + want.timeout;
    let mut waited = Waited::default();
    let mut pause = RETRY_FIRST;
    let mut seen: Vec<Member> = Vec::new();
    let mut warned_doubled = false;
    loop {
        match bounded(deadline, look(rendezvous, want, exact, start)).await {
            Some(Ok(Look::Found(mut found))) => {
                found.waited_through = waited.lines();
                return Ok(found);
            }
            Some(Ok(Look::Moved(members))) => {
                seen = members;
                // Not at once: a set that keeps moving on (a publisher flapping, or records the
                // member list and the fetch disagree on) would otherwise be looked at as fast as
                // the rendezvous answers, hammering it until the deadline.
                backoff(&mut pause, deadline).await;
            }
            Some(Ok(Look::Incomplete(members, revision))) => {
                seen = members;
                pause = RETRY_FIRST;
                let now = Instant::now();
                if now < deadline {
                    let change = bounded(
                        deadline,
                        rendezvous.changed(&want.model, revision, deadline - now),
                    )
                    .await;
                    if let Some(Err(e)) = change {
                        if !is_transient(&e) {
                            return Err(e);
                        }
                        waited.note(&e);
                        backoff(&mut pause, deadline).await;
                    }
                }
            }
            Some(Err(e)) if is_transient(&e) => {
                waited.note(&e);
                backoff(&mut pause, deadline).await;
            }
            Some(Err(e)) => return Err(e),
            // A request that outran the deadline: the timeout below says so.
            None => {}
        }
        // Once per discovery, not per look: a rendezvous that lists a rank twice stays so.
        let doubled = doubled_ranks(&seen);
        if !warned_doubled && !doubled.is_empty() {
            warned_doubled = true;
            tracing::warn!(
                "the rendezvous at {} lists more than one record for ranks {} of model {:?}; \
                 each counts once, and only while every record of it is ready",
                rendezvous.endpoint(),
                ranges(&doubled),
                want.model
            );
        }
        if Instant::now() >= deadline {
            let target = exact.map_or_else(String::new, |s| format!(" at step {s}"));
            let mut msg = format!(
                "discovery of model {:?}{target} at {} timed out after {:.1} s: {}",
                want.model,
                rendezvous.endpoint(),
                want.timeout.as_secs_f64(),
                describe_at(&seen, want, exact)
            );
            let lines = waited.lines();
            if !lines.is_empty() {
                let _ = write!(msg, "; waited through: {}", lines.join("; "));
            }
            return Err(Error::new(ErrorKind::Timeout, msg));
        }
    }
}

/// `fut`, cut off at `deadline` (but given at least [`MIN_REQUEST`]); `None` when cut off.
async fn bounded<T>(deadline: Instant, fut: impl std::future::Future<Output = T>) -> Option<T> {
    let until = deadline.max(Instant::now() + MIN_REQUEST);
    tokio::time::timeout_at(until.into(), fut).await.ok()
}

/// Sleeps `pause` (never past `deadline`) and doubles it up to [`RETRY_MAX`]: the pause between
/// two looks at a rendezvous after a failure or a set that moved on; start `pause` at
/// [`RETRY_FIRST`].
pub async fn backoff(pause: &mut Duration, deadline: Instant) {
    let left = deadline.saturating_duration_since(Instant::now());
    tokio::time::sleep((*pause).min(left)).await;
    *pause = (*pause * 2).min(RETRY_MAX);
}

/// One look: the member list, and when it is a complete set, their announcements.
async fn look(
    rendezvous: &dyn Rendezvous,
    want: &Want,
    exact: Option<u64>,
    start: Instant,
) -> Result<Look> {
    let (members, revision) = rendezvous.members(&want.model).await?;
    let Some(step) = complete_step_at(&members, want, exact)? else {
        return Ok(Look::Incomplete(members, revision));
    };
    let world = members[0].world;
    let ranks: Vec<OwnerId> = (0..world).collect();
    let fetched = rendezvous.fetch(&want.model, &ranks).await?;
    if fetched.len() != world as usize
        || !fetched.iter().enumerate().all(|(i, f)| {
            f.ready && f.announcement.step == step && f.announcement.rank as usize == i
        })
    {
        // A publisher advanced, left or became not ready between the two reads; or the fetch
        // did not return each rank exactly once (a broken rendezvous), which must not become
        // a set with a rank missing or doubled.
        return Ok(Look::Moved(members));
    }
    let announcements: Vec<Announcement> = fetched.into_iter().map(|f| f.announcement).collect();
    if let Some(a) = announcements
        .iter()
        .find(|a| a.config != announcements[0].config)
    {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "publishers of model {:?} disagree on its architecture: rank {} announces \
                 another config than rank {}",
                want.model, a.rank, announcements[0].rank
            ),
        )
        .with_owner(a.rank));
    }
    Ok(Look::Found(Discovered {
        step,
        announcements,
        revision,
        elapsed: start.elapsed(),
        waited_through: Vec::new(),
    }))
}

/// The step at which `members` are a complete, ready set, if they are. Members that disagree
/// on the world size or the transport are an error: no step can make them one set.
#[cfg(test)]
fn complete_step(members: &[Member], want: &Want) -> Result<Option<u64>> {
    complete_step_at(members, want, None)
}

/// [`complete_step`], of exactly step `exact` when set.
fn complete_step_at(members: &[Member], want: &Want, exact: Option<u64>) -> Result<Option<u64>> {
    let Some(first) = members.first() else {
        return Ok(None);
    };
    for m in members {
        if m.world > MAX_WORLD {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "publisher rank {} of model {:?} announces a world of {} ranks, above the \
                     limit of {MAX_WORLD}",
                    m.rank, want.model, m.world
                ),
            )
            .with_owner(m.rank));
        }
        if m.world != first.world || m.transport != first.transport {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "publishers of model {:?} disagree: rank {} announces {} ranks over {}, rank \
                     {} announces {} ranks over {}",
                    want.model,
                    first.rank,
                    first.world,
                    first.transport,
                    m.rank,
                    m.world,
                    m.transport
                ),
            )
            .with_owner(m.rank));
        }
        if m.rank >= m.world {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "publisher rank {} of model {:?} is outside its world of {} ranks",
                    m.rank, want.model, m.world
                ),
            )
            .with_owner(m.rank));
        }
    }
    let target = match exact {
        Some(step) => Some(step),
        None => target_step(members, want),
    };
    let Some(step) = target else {
        return Ok(None);
    };
    // Ready ranks, not records: a rank claimed by two records (only a rendezvous that breaks the
    // one-holder rule lists one) counts once, and only when every record claiming it is ready
    // at `step`, so a doubled rank can neither stand in for a missing one nor push the count
    // past the world.
    let ready_at_step = ready_ranks_at(members, step).len();
    Ok((ready_at_step == first.world as usize).then_some(step))
}

/// The ranks every record of which is ready at `step`, each once.
fn ready_ranks_at(members: &[Member], step: u64) -> Vec<OwnerId> {
    let mut ready: BTreeMap<OwnerId, bool> = BTreeMap::new();
    for m in members {
        let here = m.ready && m.step == step;
        ready
            .entry(m.rank)
            .and_modify(|all| *all &= here)
            .or_insert(here);
    }
    ready
        .into_iter()
        .filter_map(|(rank, all)| all.then_some(rank))
        .collect()
}

/// Ranks claimed by more than one of `members` (sorted, each once): none, unless the rendezvous
/// broke the one-holder rule.
fn doubled_ranks(members: &[Member]) -> Vec<OwnerId> {
    let mut count: BTreeMap<OwnerId, u32> = BTreeMap::new();
    for m in members {
        *count.entry(m.rank).or_default() += 1;
    }
    count
        .into_iter()
        .filter_map(|(rank, n)| (n > 1).then_some(rank))
        .collect()
}

/// The newest step any ready member stands at, above `want.after_step`.
fn target_step(members: &[Member], want: &Want) -> Option<u64> {
    members
        .iter()
        .filter(|m| m.ready && want.after_step.is_none_or(|after| m.step > after))
        .map(|m| m.step)
        .max()
}

/// Says who was seen, at which steps, who is missing and who did not advance.
pub fn describe(members: &[Member], want: &Want) -> String {
    describe_at(members, want, None)
}

/// [`describe`]; when waiting for exactly step `exact`, it names every rank that lacks that
/// step and the step it has instead.
fn describe_at(members: &[Member], want: &Want, exact: Option<u64>) -> String {
    if members.is_empty() {
        return "no publisher seen".into();
    }
    let world = members[0].world;
    let mut by_state: BTreeMap<(u64, bool), Vec<OwnerId>> = BTreeMap::new();
    for m in members {
        by_state.entry((m.step, m.ready)).or_default().push(m.rank);
    }
    // Ranks, not records: a rank listed twice is one publisher seen (and named below).
    // A set: `world` may be up to MAX_WORLD, and this runs once per rank of it.
    let seen: std::collections::BTreeSet<OwnerId> = members.iter().map(|m| m.rank).collect();
    let mut ready_records: BTreeMap<OwnerId, bool> = BTreeMap::new();
    for m in members {
        ready_records
            .entry(m.rank)
            .and_modify(|all| *all &= m.ready)
            .or_insert(m.ready);
    }
    let ready = ready_records.values().filter(|all| **all).count();
    let mut out = format!("saw {} of {world} publishers, {ready} ready", seen.len());
    for ((step, is_ready), ranks) in &by_state {
        let state = if *is_ready { "ready" } else { "updating" };
        let _ = write!(out, "; ranks {} {state} at step {step}", ranges(ranks));
    }
    let missing: Vec<OwnerId> = (0..world).filter(|r| !seen.contains(r)).collect();
    if !missing.is_empty() {
        let _ = write!(out, "; missing ranks {}", ranges(&missing));
    }
    let doubled = doubled_ranks(members);
    if !doubled.is_empty() {
        let _ = write!(
            out,
            "; ranks {} claimed by more than one record (each counts once, ready only when \
             every record of it is)",
            ranges(&doubled)
        );
    }
    if let Some(step) = exact {
        let lacking: Vec<String> = members
            .iter()
            .filter(|m| !(m.ready && m.step == step))
            .map(|m| {
                let state = if m.ready { "ready" } else { "updating" };
                format!("rank {} has step {} ({state})", m.rank, m.step)
            })
            .collect();
        if !lacking.is_empty() {
            let _ = write!(out, "; lacking step {step}: {}", lacking.join(", "));
        }
    } else if let Some(step) = target_step(members, want) {
        let behind: Vec<OwnerId> = members
            .iter()
            .filter(|m| m.step < step)
            .map(|m| m.rank)
            .collect();
        if !behind.is_empty() {
            let _ = write!(
                out,
                "; ranks {} did not advance to step {step}",
                ranges(&behind)
            );
        }
    } else if let Some(after) = want.after_step {
        let _ = write!(out, "; none ready above step {after}");
    }
    out
}

/// `0-3,5,7-8` for ranks in any order, each named once.
fn ranges(ranks: &[OwnerId]) -> String {
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    // A rank listed twice (two records of it) is named once.
    sorted.dedup();
    let mut out = String::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        if !out.is_empty() {
            out.push(',');
        }
        if j == i {
            let _ = write!(out, "{}", sorted[i]);
        } else {
            let _ = write!(out, "{}-{}", sorted[i], sorted[j]);
        }
        i = j + 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(rank: OwnerId, step: u64, ready: bool) -> Member {
        Member {
            rank,
            world: 4,
            step,
            ready,
            transport: "ucx".into(),
            incarnation: 1,
            age: Duration::ZERO,
            table_bytes: 10,
            note: None,
            holder: None,
        }
    }

    #[test]
    fn a_long_note_is_cut_on_a_character_boundary() {
        assert_eq!(clip_note("short"), "short");
        let long = "é".repeat(MAX_NOTE_BYTES);
        let cut = clip_note(&long);
        assert!(
            cut.len() <= MAX_NOTE_BYTES && cut.ends_with("..."),
            "{}",
            cut.len()
        );
        assert!(long.starts_with(cut.trim_end_matches('.')));
    }

    fn want(after: Option<u64>) -> Want {
        Want {
            model: "m".into(),
            after_step: after,
            timeout: Duration::ZERO,
        }
    }

    #[test]
    fn a_complete_set_is_every_rank_ready_at_the_newest_step() {
        let all = |s| (0..4).map(|r| m(r, s, true)).collect::<Vec<_>>();
        assert_eq!(complete_step(&all(3), &want(None)).unwrap(), Some(3));
        assert_eq!(complete_step(&all(3), &want(Some(3))).unwrap(), None);
        let mut mixed = all(3);
        mixed[2].step = 4;
        assert_eq!(complete_step(&mixed, &want(None)).unwrap(), None);
        mixed[2] = m(2, 3, false);
        assert_eq!(complete_step(&mixed, &want(None)).unwrap(), None);
        assert_eq!(complete_step(&all(3)[..3], &want(None)).unwrap(), None);
        assert_eq!(complete_step(&[], &want(None)).unwrap(), None);
    }

    #[test]
    fn a_rank_claimed_by_two_records_counts_once_and_never_for_a_missing_one() {
        // Ranks 0, 1 and 3 of 4, rank 3 twice: three ranks, never a complete set of four.
        let mut ms = vec![m(0, 3, true), m(1, 3, true), m(3, 3, true), m(3, 3, true)];
        assert_eq!(complete_step(&ms, &want(None)).unwrap(), None);
        let d = describe(&ms, &want(None));
        assert!(d.starts_with("saw 3 of 4 publishers, 3 ready"), "{d}");
        assert!(d.contains("ranks 0-1,3 ready at step 3"), "{d}");
        assert!(d.contains("missing ranks 2"), "{d}");
        assert!(d.contains("ranks 3 claimed by more than one record"), "{d}");
        // Every rank, rank 3 twice: complete, the doubled rank counted once.
        ms.insert(2, m(2, 3, true));
        assert_eq!(complete_step(&ms, &want(None)).unwrap(), Some(3));
        // Not while any record of the doubled rank is not ready at the step, whichever it is.
        for other in [m(3, 3, false), m(3, 2, true)] {
            for at in [3, 4] {
                let mut ms = ms.clone();
                ms[at] = other.clone();
                assert_eq!(complete_step(&ms, &want(None)).unwrap(), None, "{ms:?}");
            }
        }
    }

    #[test]
    fn members_that_cannot_form_one_set_are_a_config_error_naming_the_rank() {
        let mut ms: Vec<Member> = (0..4).map(|r| m(r, 1, true)).collect();
        ms[3].world = 8;
        let e = complete_step(&ms, &want(None)).unwrap_err();
        assert_eq!((e.kind(), e.context().owner), (ErrorKind::Config, Some(3)));
        ms[3].world = 4;
        ms[3].transport = "nixl".into();
        assert!(complete_step(&ms, &want(None))
            .unwrap_err()
            .to_string()
            .contains("nixl"));
        // A world no deployment has is refused before any loop or list is sized from it.
        let huge: Vec<Member> = (0..2)
            .map(|r| Member {
                world: MAX_WORLD + 1,
                ..m(r, 1, true)
            })
            .collect();
        let e = complete_step(&huge, &want(None)).unwrap_err();
        assert_eq!((e.kind(), e.context().owner), (ErrorKind::Config, Some(0)));
    }

    #[test]
    fn the_description_names_missing_updating_and_lagging_ranks() {
        let ms = vec![m(0, 5, true), m(1, 5, true), m(3, 4, true)];
        let d = describe(&ms, &want(None));
        assert!(d.starts_with("saw 3 of 4 publishers, 3 ready"), "{d}");
        assert!(d.contains("ranks 3 ready at step 4"), "{d}");
        assert!(d.contains("ranks 0-1 ready at step 5"), "{d}");
        assert!(d.contains("missing ranks 2"), "{d}");
        assert!(d.contains("ranks 3 did not advance to step 5"), "{d}");
        let d = describe(&[m(0, 2, false)], &want(Some(2)));
        assert!(
            d.contains("updating at step 2") && d.contains("none ready above step 2"),
            "{d}"
        );
        assert_eq!(describe(&[], &want(None)), "no publisher seen");
        assert_eq!(ranges(&[7, 0, 1, 2, 5, 8]), "0-2,5,7-8");
    }
}
