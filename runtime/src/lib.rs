#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod content;
pub mod copy;
pub mod publishers;
pub mod receiver;
pub mod remote;
pub mod synthetic;

pub use publishers::Publishers;
pub use receiver::{Receiver, ReceiverOptions, StageTimes, UpdateReport};
pub use remote::RemoteCluster;
pub use synthetic::{Placement, SyntheticCluster};

/// Fails with a clear error, instead of an allocation abort, when `bytes` exceed the memory the
/// OS reports available (Linux `MemAvailable`; skipped where that is unknown).
pub fn memory_check(bytes: u64, what: &str) -> reshard_core::Result<()> {
    let Some(avail) = available_memory() else {
        return Ok(());
    };
    if bytes > avail {
        return Err(reshard_core::Error::new(
            reshard_core::ErrorKind::InvalidInput,
            format!(
                "{what} need {:.2} GiB but only {:.2} GiB of memory is available; scale the \
                 model down (--layers, --experts, --vocab)",
                bytes as f64 / (1u64 << 30) as f64,
                avail as f64 / (1u64 << 30) as f64
            ),
        ));
    }
    Ok(())
}

fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
