//! The one unsafe operation of the crate: mapping a shard file read-only.

use std::fs::File;
use std::path::Path;

use memmap2::Mmap;
use reshard_core::{Error, ErrorKind, Result};

/// Maps `path` read-only.
pub(crate) fn map_file(path: &Path) -> Result<Mmap> {
    let file = File::open(path).map_err(|e| {
        Error::new(
            ErrorKind::Config,
            format!("cannot open shard file {}: {e}", path.display()),
        )
    })?;
    // SAFETY: the map is read-only and private to this process. A complete checkpoint is
    // immutable by contract (crate docs, "Completeness"): the writer never rewrites a shard once
    // the index names it, so the mapped bytes do not change or shrink under us. A file truncated
    // by someone else after opening would fault on access; that contract violation is documented.
    unsafe { Mmap::map(&file) }.map_err(|e| {
        Error::new(
            ErrorKind::Config,
            format!("cannot memory-map shard file {}: {e}", path.display()),
        )
    })
}
