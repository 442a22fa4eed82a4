//! Shard files read with positioned reads (`pread`), never memory-mapped.
//!
//! A shared mapping of a file that someone truncates raises SIGBUS at the next access to a page
//! past the new end, which kills the process however carefully the bytes were validated when the
//! file was opened. A `pread` of the same bytes returns short instead, so a shard file truncated or
//! rewritten while it is read is an error naming the file and the byte range, and the publisher
//! that read it lives on (README, "Errors").

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::SystemTime;

use reshard_core::{Error, ErrorKind, Result};
use safetensors::tensor::Metadata;

/// The largest safetensors header accepted, in bytes: the `safetensors` crate's own limit
/// (`MAX_HEADER_SIZE`), checked before the header buffer is allocated.
pub(crate) const MAX_HEADER_BYTES: u64 = 100_000_000;

/// An open shard file, with its size and modification time when opened.
pub(crate) struct ShardFile {
    /// File name inside the checkpoint folder (what errors name).
    pub(crate) name: String,
    file: File,
    /// Size when opened: every range the header names was checked against it.
    len: u64,
    /// Modification time when opened (`None` where the platform has none).
    modified: Option<SystemTime>,
}

/// A `Config` error about shard file `name`.
fn file_err(name: &str, m: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Config, format!("shard file {name}: {m}"))
}

impl ShardFile {
    /// Opens `path` (named `name` in errors) for reading and records its size and mtime.
    pub(crate) fn open(path: &Path, name: &str) -> Result<ShardFile> {
        let file = File::open(path).map_err(|e| {
            file_err(name, format!("cannot open {}: {e}", path.display())).with_source(e)
        })?;
        let meta = file
            .metadata()
            .map_err(|e| file_err(name, format!("cannot stat: {e}")).with_source(e))?;
        Ok(ShardFile {
            name: name.to_string(),
            file,
            len: meta.len(),
            modified: meta.modified().ok(),
        })
    }

    /// The file's size when it was opened.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Fails, naming the file and `range`, when the file's size or modification time is no
    /// longer what it was when opened: it was truncated, extended or rewritten in place (a
    /// complete checkpoint is immutable; a replacement by rename keeps this open file intact).
    pub(crate) fn check_unchanged(&self, range: &std::ops::Range<u64>) -> Result<()> {
        let meta = self.file.metadata().map_err(|e| {
            file_err(&self.name, format!("cannot stat: {e}"))
                .with_range(range.clone())
                .with_source(e)
        })?;
        let (len, modified) = (meta.len(), meta.modified().ok());
        if len != self.len || modified != self.modified {
            let what = if len != self.len {
                format!("is now {len} bytes, {} when it was opened", self.len)
            } else {
                "was modified since it was opened".to_string()
            };
            return Err(file_err(
                &self.name,
                format!(
                    "{what}, while bytes {}..{} were read: the checkpoint was changed in \
                     place (write a new step folder instead)",
                    range.start, range.end
                ),
            )
            .with_range(range.clone()));
        }
        Ok(())
    }

    /// Reads exactly `dst.len()` bytes at `offset`. A read that ends early (the file shrank
    /// after it was opened) or fails is a `Config` error naming the file and the byte range.
    pub(crate) fn read_exact_at(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let range = offset..offset + dst.len() as u64;
        let mut done = 0usize;
        while done < dst.len() {
            match self.file.read_at(&mut dst[done..], offset + done as u64) {
                Ok(0) => {
                    let now = self
                        .file
                        .metadata()
                        .map_or("an unknown size".to_string(), |m| {
                            format!("{} bytes", m.len())
                        });
                    return Err(file_err(
                        &self.name,
                        format!(
                            "bytes {}..{}: the file ends at byte {}: it is now {now}, {} when \
                             it was opened (truncated while being read?)",
                            range.start,
                            range.end,
                            offset + done as u64,
                            self.len
                        ),
                    )
                    .with_range(range));
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(file_err(
                        &self.name,
                        format!("cannot read bytes {}..{}: {e}", range.start, range.end),
                    )
                    .with_range(range)
                    .with_source(e))
                }
            }
        }
        Ok(())
    }

    /// Reads and parses the safetensors header: returns where the data starts and the header.
    /// The length prefix is checked against the file size and [`MAX_HEADER_BYTES`] before the
    /// header buffer is allocated.
    pub(crate) fn read_header(&self) -> Result<(u64, Metadata)> {
        let mut n = [0u8; 8];
        if self.len < 8 {
            return Err(file_err(
                &self.name,
                format!("{} bytes, shorter than the 8-byte header length", self.len),
            )
            .with_range(0..8));
        }
        self.read_exact_at(0, &mut n)?;
        let n = u64::from_le_bytes(n);
        if n > self.len - 8 || n > MAX_HEADER_BYTES {
            return Err(file_err(
                &self.name,
                format!(
                    "header length {n} does not fit the {}-byte file (at most {MAX_HEADER_BYTES} \
                     accepted)",
                    self.len
                ),
            )
            .with_range(0..8));
        }
        // Bounded above: n <= MAX_HEADER_BYTES.
        let mut head = vec![0u8; n as usize];
        self.read_exact_at(8, &mut head)?;
        let meta: Metadata = serde_json::from_slice(&head).map_err(|e| {
            file_err(
                &self.name,
                format!("header is not valid safetensors JSON: {e}"),
            )
            .with_range(8..8 + n)
        })?;
        Ok((8 + n, meta))
    }
}
