//! Completeness checks and picking the newest complete `step-N/` checkpoint of a folder.

use std::io::Read;
use std::path::{Path, PathBuf};

use reshard_core::{Error, ErrorKind, Result};

use crate::open::{parse_header, read_index};
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
    let err = |m: String| Error::new(ErrorKind::Config, format!("shard file {name}: {m}"));
    let mut f = std::fs::File::open(path).map_err(|e| err(format!("cannot open: {e}")))?;
    let len = f
        .metadata()
        .map_err(|e| err(format!("cannot stat: {e}")))?
        .len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .map_err(|e| err(format!("cannot read the header length: {e}")))?;
    let n = u64::from_le_bytes(n);
    // Bound the header read by the file size (and the crate's 100 MB header limit).
    if n > len.saturating_sub(8) || n > 100_000_000 {
        return Err(err(format!(
            "header length {n} does not fit the {len}-byte file"
        )));
    }
    let mut head = vec![0u8; 8 + n as usize];
    f.read_exact(&mut head[8..])
        .map_err(|e| err(format!("cannot read the header: {e}")))?;
    head[..8].copy_from_slice(&n.to_le_bytes());
    let (start, meta) = parse_header(&head, name)?;
    let data: u64 = meta
        .tensors()
        .values()
        .map(|i| i.data_offsets.1 as u64)
        .max()
        .unwrap_or(0);
    let expect = start as u64 + data;
    if len != expect {
        return Err(err(format!(
            "is {len} bytes but its header implies {expect}"
        )));
    }
    Ok(())
}

/// The checkpoint to publish from `dir`: `dir` itself when it holds an index (`Some` only if
/// complete; its step from the index, else 0), otherwise the complete `step-N/` subfolder with
/// the largest N (incomplete ones are skipped, other entries ignored). `Ok(None)`: nothing
/// complete yet.
pub fn newest_complete(dir: &Path) -> Result<Option<(u64, PathBuf)>> {
    if dir.join(INDEX_FILE).exists() {
        if !is_complete(dir) {
            return Ok(None);
        }
        let step = read_index(dir)?.step.unwrap_or(0);
        return Ok(Some((step, dir.to_path_buf())));
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
    Ok(steps.into_iter().find(|(_, p)| is_complete(p)))
}
