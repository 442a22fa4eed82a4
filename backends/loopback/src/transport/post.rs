//! `post`: resolving the batch's regions, what a post writes to the execution log, and starting
//! the batch's jobs on the copy workers ([`crate::posted`]).

use reshard_core::prepared;
use reshard_core::{CompletionSink, Countdown, InFlight, PreparedBatch, Result};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use super::{LoopbackTransport, Prepared};
use crate::posted::{self, PostCtx};
use crate::SCHEME;

impl LoopbackTransport {
    /// Posts `prepared`, reporting each read to `sink` once its last byte has landed.
    pub(super) fn post_with(
        &self,
        prepared: &PreparedBatch,
        sink: Option<CompletionSink>,
    ) -> Result<Box<dyn InFlight>> {
        let st = prepared::own_state::<Arc<Prepared>>(
            SCHEME,
            prepared,
            |st| st.agent_uid == self.agent.uid,
            "loopback agent",
            "loopback agent",
            &self.agent.name,
        )?;
        let (srcs, dsts) = self.resolve(prepared, st)?;
        let pool = self.pool()?;
        let skip = self.skip_read.get();
        if let Some(log) = self.log.read().as_ref() {
            self.record(log, st, &srcs, &dsts, skip);
        }
        let ctx = PostCtx {
            prepared: Arc::clone(st),
            srcs,
            dsts,
            abort: Arc::new(AtomicBool::new(false)),
            gate: Arc::default(),
            completions: sink.map(|sink| {
                let lens = prepared.batch().reads.iter().map(|r| r.len);
                (sink, Countdown::new(lens))
            }),
            #[cfg(feature = "fault-injection")]
            skip_read: skip,
            #[cfg(test)]
            faults: self.faults.clone(),
        };
        tracing::trace!(agent = %self.agent.name, jobs = st.work.len(), "loopback post");
        Ok(Box::new(posted::start(&pool, ctx)))
    }
}
