//! Completeness checks, the `step-N/` checkpoints of a folder (the newest complete one, or all
//! of them for a publisher that refuses some), and telling that a folder changed.

use std::path::{Path, PathBuf};

use reshard_core::{Error, ErrorKind, Result};

use crate::file::ShardFile;
use crate::open::read_index;
use crate::INDEX_FILE;

/// Why `dir` is not a complete checkpoint, or `None` when it is (see the crate docs): the index
/// exists and parses, and every shard it names exists with exactly the size its safetensors
/// header implies. Reads only headers, never tensor data.
pub fn incomplete_reason(dir: &Path) -> Option<String> {
    let index = match read_index(dir) {
        Ok(i) => i,
        Err(e) => return Some(e.message().to_string()),
    };
    let mut files: Vec<&String> = index.weight_map.values().collect();
    files.sort();
    files.dedup();
    for name in files {
        if let Err(e) = shard_size_ok(&dir.join(name), name) {
            return Some(e.message().to_string());
        }
    }
    None
}

/// Whether `dir` holds a complete checkpoint.
pub fn is_complete(dir: &Path) -> bool {
    incomplete_reason(dir).is_none()
}

fn shard_size_ok(path: &Path, name: &str) -> Result<()> {
    let file = ShardFile::open(path, name)?;
    let (start, meta) = file.read_header()?;
    let data: u64 = meta
        .tensors()
        .values()
        .map(|i| i.data_offsets.1 as u64)
        .max()
        .unwrap_or(0);
    // `data` comes from the header: an offset near u64::MAX must not wrap around.
    let expect = start.checked_add(data);
    if expect != Some(file.len()) {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "shard file {name}: is {} bytes but its header implies {}",
                file.len(),
                expect.map_or("more than u64 bytes".to_string(), |e| e.to_string())
            ),
        ));
    }
    Ok(())
}

/// The checkpoint to publish from `dir`: `dir` itself when it holds an index (`Some` only if
/// complete; its step from the index, else 0), otherwise the complete `step-N/` subfolder with
/// the largest N (incomplete ones are skipped, other entries ignored). `Ok(None)`: nothing
/// complete yet.
pub fn newest_complete(dir: &Path) -> Result<Option<(u64, PathBuf)>> {
    Ok(candidates(dir)?.into_iter().find(|(_, p)| is_complete(p)))
}

/// The checkpoints `dir` offers, newest first: `dir` itself when it holds an index (with the
/// step of its index, else 0), otherwise every `step-N/` subfolder, largest N first, complete
/// or not (other entries ignored).
pub fn candidates(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    if dir.join(INDEX_FILE).exists() {
        let step = read_index(dir).ok().and_then(|i| i.step).unwrap_or(0);
        return Ok(vec![(step, dir.to_path_buf())]);
    }
    let rd = std::fs::read_dir(dir).map_err(|e| {
        Error::new(
            ErrorKind::Config,
            format!("cannot list checkpoint folder {}: {e}", dir.display()),
        )
    })?;
    let mut steps: Vec<(u64, PathBuf)> = rd
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let n = name.strip_prefix("step-")?.parse::<u64>().ok()?;
            e.path().is_dir().then(|| (n, e.path()))
        })
        .collect();
    steps.sort_by_key(|s| std::cmp::Reverse(s.0));
    Ok(steps)
}

/// What a checkpoint folder holds, as far as telling that it changed goes: every entry's name,
/// size and modification time, and the folder's own modification time. Two reads compare equal
/// when nothing in the folder was written, added, removed or renamed in between (to the file
/// system's timestamp resolution), so a publisher that refused a folder tries it again only
/// after it changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FolderState {
    modified: Option<std::time::SystemTime>,
    entries: Vec<(std::ffi::OsString, u64, Option<std::time::SystemTime>)>,
}

impl FolderState {
    /// Reads the state of `dir`; an unreadable folder or entry reads as absent (so it compares
    /// equal until it becomes readable).
    pub fn read(dir: &Path) -> FolderState {
        let modified = std::fs::metadata(dir).and_then(|m| m.modified()).ok();
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok())
            .map(|e| {
                let meta = e.metadata().ok();
                (
                    e.file_name(),
                    meta.as_ref().map_or(0, |m| m.len()),
                    meta.and_then(|m| m.modified().ok()),
                )
            })
            .collect();
        entries.sort();
        FolderState { modified, entries }
    }
}
