//! The process that holds a publisher rank: named in member records and in the error a second
//! claimant of a live rank fails with (docs/deployment.md, "One holder per rank").

use reshard_core::rendezvous::Holder;
use reshard_core::{Error, ErrorKind, OwnerId};

/// This process as a holder: its host name (empty when the system will not say) and pid.
pub(crate) fn this_process() -> Holder {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its whole length, which is what is passed.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let host = if rc == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        String::new()
    };
    Holder {
        host,
        pid: std::process::id(),
    }
}

/// `incarnation on host H pid P`, or what is known of a holder whose record names none.
pub(crate) fn describe(incarnation: Option<u64>, holder: Option<&Holder>) -> String {
    let inc = incarnation.map_or("an unreadable record".to_string(), |i| {
        format!("incarnation {i:016x}")
    });
    match holder {
        Some(h) => format!("{inc} on host {} pid {}", h.host, h.pid),
        None => format!("{inc} (host and pid not recorded)"),
    }
}

/// The `Config` error of a claim refused because rank `rank` of `model` is held by the process
/// `holder` (as [`describe`] put it); `why` says how the holder was found live.
pub(crate) fn rank_held(model: &str, rank: OwnerId, holder: &str, why: &str) -> Error {
    Error::new(
        ErrorKind::Config,
        format!(
            "publisher rank {rank} of model {model:?} is held by another live process: {holder} \
             ({why}); one process holds a rank: stop that one, or give this one another rank"
        ),
    )
    .with_owner(rank)
}
