//! `post`: what is re-checked at post, what a post writes to the execution log, and starting
//! the batch on the copy threads.

use reshard_core::contract::span;
use reshard_core::{executed, prepared};
use reshard_core::{
    CompletionSink, Error, ErrorKind, ExecutionLog, InFlight, PreparedBatch, ReadDesc, Result,
    Transport,
};
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::peer::Peer;
use crate::plan::Source;
use crate::run::{remote_range, CmaInFlight, Run};
use crate::SCHEME;

use super::*;

impl CmaTransport {
    /// At post, when the epoch moved since prepare: every peer and destination the batch was
    /// resolved against must still be the one loaded or registered under its name.
    pub(super) fn still_valid(&self, prepared: &PreparedBatch, st: &Prepared) -> Result<()> {
        let reads = &prepared.batch().reads;
        let first = |pred: &dyn Fn(&ReadDesc) -> bool| reads.iter().find(|r| pred(r));
        let peers = self.peers.read();
        for (owner, peer) in &st.peers {
            if !peers.get(owner).is_some_and(|p| Arc::ptr_eq(p, peer)) {
                let r = first(&|r| r.owner == *owner);
                let mut e = Error::new(
                    ErrorKind::Transport,
                    format!(
                        "the metadata of owner {owner} was replaced or dropped after this batch \
                         was prepared; prepare it again"
                    ),
                )
                .with_owner(*owner)
                .with_backend(SCHEME);
                if let Some(r) = r {
                    e = e.with_range(remote_range(r));
                }
                return Err(e);
            }
        }
        let local = self.local.read();
        for (region, block) in &st.dsts {
            if !local.get(region).is_some_and(|b| same_block(b, block)) {
                let r = first(&|r| r.local_region == *region);
                let mut e = Error::new(
                    ErrorKind::Transport,
                    format!("local region {region} was deregistered after this batch was prepared"),
                )
                .with_backend(SCHEME);
                if let Some(r) = r {
                    e = e
                        .with_owner(r.owner)
                        .with_range(span(r.local_offset, r.len));
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Refuses a batch that writes bytes which quarantined calls of an earlier batch (ended
    /// while they had not returned) may still write (docs/in-flight-safety.md, rule 3): a
    /// quarantined error naming the first such read. Once those calls return, their bytes are
    /// free again.
    pub(super) fn refuse_quarantined(&self, prepared: &PreparedBatch, st: &Prepared) -> Result<()> {
        let busy: Vec<Range<u64>> = self
            .live
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .flat_map(|run| run.quarantined_ranges())
            .collect();
        if busy.is_empty() {
            return Ok(());
        }
        let hit = st.calls.segs.iter().find(|s| {
            busy.iter()
                .any(|b| b.start < s.local + s.len && s.local < b.end)
        });
        let Some(r) = hit.and_then(|s| prepared.batch().reads.get(s.read as usize)) else {
            return Ok(());
        };
        Err(Error::new(
            ErrorKind::Transport,
            format!(
                "a read writes local bytes {}..{} of region {}, which a process_vm_readv of an \
                 earlier batch that has not returned may still write (quarantined); use other \
                 memory or wait until it returns",
                r.local_offset,
                r.local_offset.saturating_add(r.len),
                r.local_region
            ),
        )
        .with_owner(r.owner)
        .with_range(remote_range(r))
        .with_backend(SCHEME)
        .set_quarantined())
    }

    /// Records every read of a post as its calls will execute it: the owner is one under which
    /// the peer process actually read from is loaded (the batch's own owner when that is
    /// still so), and regions and offsets are resolved back from the addresses the calls use,
    /// in that peer's regions and this endpoint's registrations. A read cut into several
    /// segments is recorded once, whole; a skipped read (fault injection) not at all.
    pub(super) fn record(&self, log: &ExecutionLog, st: &Prepared, skip: Option<u32>) {
        // Per read: peer index, first remote address, first local address, bytes, and where
        // its source is (a gather's rows).
        let mut ext: BTreeMap<u32, (u32, u64, u64, u64, Source)> = BTreeMap::new();
        for call in &st.calls.calls {
            for s in &st.calls.segs[call.segs.clone()] {
                if Some(s.read) == skip {
                    continue;
                }
                let e = ext
                    .entry(s.read)
                    .or_insert((call.peer, s.remote, s.local, 0, s.src));
                e.1 = e.1.min(s.remote);
                e.2 = e.2.min(s.local);
                e.3 += s.len;
            }
        }
        let peers = self.peers.read();
        let local = self.local.read();
        let mut out = Vec::with_capacity(ext.len());
        for (_, (p, ra, la, len, src)) in ext {
            let (owner, used) = &st.peers[p as usize];
            let same = |q: &Arc<Peer>| {
                q.pid == used.pid
                    && q.start_time == used.start_time
                    && q.incarnation == used.incarnation
            };
            let owner = if peers.get(owner).is_some_and(same) {
                *owner
            } else {
                peers
                    .iter()
                    .filter(|(_, q)| same(q))
                    .map(|(&o, _)| o)
                    .min()
                    .unwrap_or(*owner)
            };
            // A gather spans from its first row's first byte to its last row's last byte.
            let last = src.runs(len - 1, len).last().map_or(ra, |(a, _)| a);
            let remote = executed::locate(
                used.regions.values().map(|r| (r.id, r.addr, r.len)),
                ra,
                last + 1 - ra,
                None,
            );
            let locals = local
                .iter()
                .map(|(&id, b)| (id, b.addr() as u64, b.len() as u64));
            out.push(ReadDesc {
                remote_rows: src.rows,
                ..executed::read(owner, remote, locals, la, len, None)
            });
        }
        log.record(out);
    }

    /// Posts `prepared`, reporting each read to `sink` once all its bytes have moved.
    pub(super) fn post_with(
        &self,
        prepared: &PreparedBatch,
        sink: Option<CompletionSink>,
    ) -> Result<Box<dyn InFlight>> {
        // "endpoint" alone for what else could have prepared it: the message cma always gave.
        let st = prepared::own_state::<Arc<Prepared>>(
            SCHEME,
            prepared,
            |st| st.endpoint == self.incarnation,
            "endpoint",
            "cma endpoint",
            &self.agent,
        )?;
        if st.epoch != self.epoch() {
            self.still_valid(prepared, st)?;
        }
        self.refuse_quarantined(prepared, st)?;
        let pool = self.pool()?;
        let skip = self.skip_read.get();
        if let Some(log) = self.log.read().as_ref() {
            self.record(log, st, skip);
        }
        let run = Arc::new(Run::new(
            Arc::clone(st),
            Arc::clone(prepared.batch()),
            skip,
            sink,
        ));
        {
            let mut live = self.live.lock();
            live.retain(|w| w.strong_count() > 0);
            live.push(Arc::downgrade(&run));
        }
        let timeout = Duration::from_millis(self.options.timeout_ms);
        Ok(Box::new(CmaInFlight::start(run, pool, st.lanes, timeout)))
    }
}
