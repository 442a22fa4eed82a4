//! Completeness checks, the `step-N/` checkpoints of a folder (the newest complete one, or all
//! of them for a publisher that refuses some), and telling that a folder changed.

use std::path::{Path, PathBuf};

use reshard_core::{Error, ErrorKind, Result};

use crate::config::CONFIG_FILE;
use crate::file::ShardFile;
use crate::open::read_index;
use crate::{INDEX_FILE, SINGLE_FILE};

/// Why `dir` is not a complete checkpoint, or `None` when it is (see the crate docs): the index
/// exists and parses, and every shard it names exists with exactly the size its safetensors
/// header implies; or, without an index, `config.json` exists and `model.safetensors` (a
/// single-file checkpoint) has exactly the size its header implies. The reason names the folder
/// and the file that is missing or short. Reads only headers, never tensor data.
pub fn incomplete_reason(dir: &Path) -> Option<String> {
    if !dir.join(INDEX_FILE).exists() {
        if !dir.join(SINGLE_FILE).exists() {
            return Some(format!(
                "{} has neither {INDEX_FILE} (a sharded checkpoint, its index written last) nor \
                 {SINGLE_FILE} (a single-file checkpoint)",
                dir.display()
            ));
        }
        // A single file has no index written last to say it is whole: its header and size do.
        if !dir.join(CONFIG_FILE).exists() {
            return Some(format!(
                "{}: {SINGLE_FILE} is there but {CONFIG_FILE} is missing",
                dir.display()
            ));
        }
        return shard_size_ok(&dir.join(SINGLE_FILE), SINGLE_FILE)
            .err()
            .map(|e| format!("{}: {}", dir.display(), e.message()));
    }
    let index = match read_index(dir) {
        Ok(i) => i,
        Err(e) => return Some(e.message().to_string()),
    };
    let mut files: Vec<&String> = index.weight_map.values().collect();
    files.sort();
    files.dedup();
    for name in files {
        if let Err(e) = shard_size_ok(&dir.join(name), name) {
            return Some(format!("{}: {}", dir.display(), e.message()));
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

/// The checkpoint to publish from `dir`: `dir` itself when it holds an index or a single
/// `model.safetensors` (`Some` only if complete; its step from the index or the file's metadata,
/// else 0), otherwise the complete `step-N/` subfolder with
/// the largest N (incomplete ones are skipped, other entries ignored). `Ok(None)`: nothing
/// complete yet.
pub fn newest_complete(dir: &Path) -> Result<Option<(u64, PathBuf)>> {
    Ok(candidates(dir)?.into_iter().find(|(_, p)| is_complete(p)))
}

/// The checkpoints `dir` offers, newest first: `dir` itself when it holds an index or a single
/// `model.safetensors` (with the step its index or that file's metadata records, else 0), otherwise every `step-N/` subfolder, largest N first, complete
/// or not (other entries ignored).
pub fn candidates(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    if dir.join(INDEX_FILE).exists() || dir.join(SINGLE_FILE).exists() {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{write_checkpoint, write_single_file, Checkpoint, WriteOptions};
    use reshard_planner::presets::{preset, ModelConfig};

    fn tiny() -> ModelConfig {
        let mut m = preset("llama-3-8b").unwrap();
        (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim) = (2, 64, 4, 2, 16);
        (m.intermediate, m.vocab) = (96, 100);
        m
    }

    /// A single `model.safetensors` with `config.json` is complete once its size checks out,
    /// opens to the same tensors and bytes as the sharded checkpoint of the same step, and is
    /// found as the newest step; cut short or without `config.json` it is incomplete, the
    /// reason naming the folder and the file.
    #[test]
    fn a_single_file_checkpoint_is_complete_once_its_header_and_size_check_out() {
        let tmp = tempfile::tempdir().unwrap();
        let (single, sharded) = (tmp.path().join("step-7"), tmp.path().join("sharded"));
        let w = write_single_file(&tiny(), 7, &single).unwrap();
        assert_eq!(w.shards, vec![SINGLE_FILE.to_string()]);
        assert!(!single.join(INDEX_FILE).exists());
        let opts = WriteOptions {
            max_shard_bytes: 16 << 10,
        };
        write_checkpoint(&tiny(), 7, &sharded, &opts).unwrap();
        assert_eq!(incomplete_reason(&single), None);
        let (a, b) = (
            Checkpoint::open(&single).unwrap(),
            Checkpoint::open(&sharded).unwrap(),
        );
        assert_eq!((a.step(), a.shard_files()), (7, vec![SINGLE_FILE]));
        assert_eq!(a.tensors(), b.tensors());
        for t in a.tensors() {
            assert!(a.tensor_bytes(&t.name).unwrap() == b.tensor_bytes(&t.name).unwrap());
        }
        assert_eq!(candidates(&single).unwrap(), vec![(7, single.clone())]);
        std::fs::remove_dir_all(&sharded).unwrap();
        assert_eq!(
            newest_complete(tmp.path()).unwrap(),
            Some((7, single.clone()))
        );

        let file = single.join(SINGLE_FILE);
        let len = std::fs::metadata(&file).unwrap().len();
        let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
        f.set_len(len - 1).unwrap();
        let why = incomplete_reason(&single).unwrap();
        assert!(
            why.contains(&single.display().to_string()) && why.contains(SINGLE_FILE),
            "{why}"
        );
        assert!(why.contains(&format!("{} bytes", len - 1)), "{why}");
        assert_eq!(newest_complete(tmp.path()).unwrap(), None);
        f.set_len(len).unwrap();
        assert_eq!(incomplete_reason(&single), None);
        std::fs::remove_file(single.join(CONFIG_FILE)).unwrap();
        let why = incomplete_reason(&single).unwrap();
        assert!(why.contains(CONFIG_FILE), "{why}");
        std::fs::remove_file(&file).unwrap();
        let why = incomplete_reason(&single).unwrap();
        assert!(
            why.contains(INDEX_FILE) && why.contains(SINGLE_FILE),
            "{why}"
        );
    }
}
