//! `post`: takes a prepared batch out of `IDLE` after re-checking it, and starts it.

use reshard_core::{
    prepared, CompletionSink, Countdown, Error, ErrorKind, InFlight, PreparedBatch, Result,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::prepared::{Prepared, BUSY, IDLE, QUARANTINED, RETIRED};
use super::NixlTransport;
use crate::xfer::NixlInFlight;
use crate::{quarantine, SCHEME};

impl NixlTransport {
    /// [`reshard_core::Transport::post`], and with a sink `post_reporting`.
    pub(super) async fn post_batch(
        &self,
        prepared: &PreparedBatch,
        sink: Option<CompletionSink>,
    ) -> Result<Box<dyn InFlight>> {
        let p = prepared::own_state::<Arc<Prepared>>(
            SCHEME,
            prepared,
            |p| p.shared.uid == self.shared.uid,
            "nixl endpoint",
            "nixl endpoint",
            &self.shared.name,
        )?;
        {
            // Under the state lock: a peer reload never sees a batch leave IDLE meanwhile.
            let st = self.shared.state.lock();
            match p.phase.load(Ordering::Acquire) {
                BUSY => {
                    return Err(Error::new(
                        ErrorKind::Transport,
                        "this prepared batch is still in flight; wait for or abort it first",
                    )
                    .with_backend(SCHEME)
                    .set_retryable(true))
                }
                QUARANTINED => {
                    return Err(Error::new(
                        ErrorKind::Transport,
                        format!(
                            "this prepared batch was ended while its reads still ran and is \
                             quarantined (local regions {:?} kept alive until they finish); it \
                             is never posted again: prepare a new batch",
                            p.local_regions()
                        ),
                    )
                    .with_backend(SCHEME)
                    .set_quarantined())
                }
                RETIRED => {
                    return Err(Error::new(
                        ErrorKind::Transport,
                        "the metadata of a peer of this batch was reloaded after prepare; \
                         prepare again",
                    )
                    .with_backend(SCHEME))
                }
                _ => {}
            }
            p.check_live(&st)?;
            let busy = quarantine::conflicts(self.shared.uid, p.local_ranges());
            if !busy.is_empty() {
                let ranges: Vec<String> = busy
                    .iter()
                    .map(|(a, b)| format!("{a:#x}..{b:#x}"))
                    .collect();
                return Err(Error::new(
                    ErrorKind::Transport,
                    format!(
                        "local memory {} is quarantined: reads of an earlier batch may still \
                         land in it; use other memory or wait until they finish",
                        ranges.join(", ")
                    ),
                )
                .with_backend(SCHEME)
                .set_quarantined());
            }
            if p.phase
                .compare_exchange(IDLE, BUSY, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                return Err(Error::new(
                    ErrorKind::Transport,
                    "this prepared batch is being posted concurrently",
                )
                .with_backend(SCHEME)
                .set_retryable(true));
            }
        }
        let sink = sink.map(|s| {
            (
                s,
                Countdown::new(prepared.batch().reads.iter().map(|r| r.len)),
            )
        });
        let flight = NixlInFlight::start(Arc::clone(p), sink).await?;
        Ok(Box::new(flight))
    }
}
