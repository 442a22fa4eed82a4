//! Generating a checkpoint: shard files first, `config.json`, then the index last (atomically);
//! or a single-file one: `config.json`, then `model.safetensors` (atomically).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use reshard_core::{Error, ErrorKind, Result, TensorSpec};
use reshard_planner::presets::ModelConfig;
use serde_json::json;

use crate::config::safetensors_dtype as to_st_dtype;
use crate::config::{to_hf_config, CONFIG_FILE};
use crate::content::fill_tensor;
use crate::{INDEX_FILE, SINGLE_FILE, STEP_KEY};

use serde_json::{Map, Value};

/// Options of [`write_checkpoint`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteOptions {
    /// Largest shard file payload in bytes; a tensor larger than this gets a shard of its own.
    pub max_shard_bytes: u64,
}

impl Default for WriteOptions {
    /// 256 MiB: a preset scaled to a couple of layers already spans several files (HF uses 5 GB,
    /// which would put a scaled-down model in one file and leave multi-file reading untested).
    fn default() -> Self {
        WriteOptions {
            max_shard_bytes: 256 << 20,
        }
    }
}

/// What [`write_checkpoint`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The checkpoint folder.
    pub dir: PathBuf,
    /// The step recorded in it.
    pub step: u64,
    /// Shard file names, in index order.
    pub shards: Vec<String>,
    /// Sum of all tensor bytes (the index's `metadata.total_size`).
    pub total_size: u64,
    /// Number of tensors.
    pub tensors: usize,
}

fn io_err(what: &str, path: &Path, e: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::InvalidInput,
        format!("cannot {what} {}: {e}", path.display()),
    )
}

/// HF shard file name: `model-00001-of-00003.safetensors`.
pub fn shard_file_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
}

/// Groups tensors, in model order, into shards of at most `max` bytes (a bigger tensor alone).
fn plan_shards(specs: &[TensorSpec], max: u64) -> Vec<Vec<&TensorSpec>> {
    let mut shards: Vec<Vec<&TensorSpec>> = Vec::new();
    let mut size = 0u64;
    for s in specs {
        let b = s.bytes();
        match shards.last_mut() {
            Some(cur) if size + b <= max => {
                cur.push(s);
                size += b;
            }
            _ => {
                shards.push(vec![s]);
                size = b;
            }
        }
    }
    shards
}

/// Writes a complete checkpoint of `model` at `step` into `out` (created if needed): shard files
/// (each through a temporary name and a rename, so a reader that mapped an older shard keeps its
/// bytes), `config.json`, then `model.safetensors.index.json` last through write-to-temp + rename.
/// An existing index is removed first, so the folder is never complete with mixed content.
pub fn write_checkpoint(
    model: &ModelConfig,
    step: u64,
    out: &Path,
    options: &WriteOptions,
) -> Result<Written> {
    model.validate()?;
    if options.max_shard_bytes == 0 {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "max_shard_bytes must not be zero",
        ));
    }
    fs::create_dir_all(out).map_err(|e| io_err("create", out, e))?;
    let index = out.join(INDEX_FILE);
    match fs::remove_file(&index) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("remove the old index", &index, e)),
    }
    let specs = model.tensors();
    let groups = plan_shards(&specs, options.max_shard_bytes);
    let mut weight_map = serde_json::Map::new();
    let mut shards = Vec::with_capacity(groups.len());
    let mut total = 0u64;
    for (i, group) in groups.iter().enumerate() {
        let name = shard_file_name(i, groups.len());
        let tmp = out.join(format!(".{name}.tmp"));
        write_shard(group, step, &tmp)?;
        sync(&tmp)?;
        let path = out.join(&name);
        fs::rename(&tmp, &path).map_err(|e| io_err("rename into", &path, e))?;
        for s in group {
            weight_map.insert(s.name.clone(), json!(name));
            total += s.bytes();
        }
        shards.push(name);
    }
    write_atomic(&out.join(CONFIG_FILE), hf_config(model)?.as_bytes())?;
    let idx = json!({
        "metadata": { "total_size": total, STEP_KEY: step },
        "weight_map": weight_map,
    });
    let idx = serde_json::to_string_pretty(&idx)
        .map_err(|e| Error::new(ErrorKind::Internal, format!("cannot encode the index: {e}")))?;
    // Last, and atomic: the index appearing is what makes the folder complete.
    write_atomic(&index, idx.as_bytes())?;
    Ok(Written {
        dir: out.to_path_buf(),
        step,
        shards,
        total_size: total,
        tensors: specs.len(),
    })
}

/// Writes a complete single-file checkpoint of `model` at `step` into `out` (created if needed),
/// as Hugging Face publishes models up to a few billion parameters: `config.json`, then every
/// tensor in one `model.safetensors` (its `__metadata__` carrying the step), written through a
/// temporary name, synced and renamed, so the folder is complete once that file appears. An
/// existing index is removed first (it would make the folder a sharded checkpoint).
pub fn write_single_file(model: &ModelConfig, step: u64, out: &Path) -> Result<Written> {
    model.validate()?;
    fs::create_dir_all(out).map_err(|e| io_err("create", out, e))?;
    let index = out.join(INDEX_FILE);
    match fs::remove_file(&index) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("remove the old index", &index, e)),
    }
    let specs = model.tensors();
    write_atomic(&out.join(CONFIG_FILE), hf_config(model)?.as_bytes())?;
    let group: Vec<&TensorSpec> = specs.iter().collect();
    let tmp = out.join(format!(".{SINGLE_FILE}.tmp"));
    write_shard(&group, step, &tmp)?;
    sync(&tmp)?;
    let path = out.join(SINGLE_FILE);
    fs::rename(&tmp, &path).map_err(|e| io_err("rename into", &path, e))?;
    Ok(Written {
        dir: out.to_path_buf(),
        step,
        shards: vec![SINGLE_FILE.to_string()],
        total_size: specs.iter().map(TensorSpec::bytes).sum(),
        tensors: specs.len(),
    })
}

/// `config.json` of `model`, in Hugging Face form.
fn hf_config(model: &ModelConfig) -> Result<String> {
    serde_json::to_string_pretty(&to_hf_config(model)).map_err(|e| {
        Error::new(
            ErrorKind::Internal,
            format!("cannot encode config.json: {e}"),
        )
    })
}

fn sync(path: &Path) -> Result<()> {
    // Durable before the rename that publishes it: after a crash a complete index never names
    // a shard whose bytes were still in the page cache.
    fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| io_err("sync", path, e))
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    fs::write(&tmp, bytes).map_err(|e| io_err("write", &tmp, e))?;
    sync(&tmp)?;
    fs::rename(&tmp, path).map_err(|e| io_err("rename into", path, e))
}

/// The safetensors header of `group`: tensors in model order, data offsets back to back, and
/// `__metadata__` with `format` (transformers refuses shards without it) and the step. Built as a
/// `serde_json` map rather than through `safetensors::serialize_to_file`, whose `__metadata__`
/// is a `HashMap`: its key order, and so the file bytes, would vary from run to run.
fn shard_header(group: &[&TensorSpec], step: u64) -> Vec<u8> {
    let mut h = Map::new();
    h.insert(
        "__metadata__".into(),
        json!({ "format": "pt", STEP_KEY: step.to_string() }),
    );
    let mut at = 0u64;
    for s in group {
        let end = at + s.bytes();
        h.insert(
            s.name.clone(),
            json!({
                "dtype": to_st_dtype(s.dtype),
                "shape": s.shape,
                "data_offsets": [at, end],
            }),
        );
        at = end;
    }
    let mut bytes = serde_json::to_vec(&Value::Object(h)).unwrap_or_default();
    // Pad with spaces to 8 bytes, as the safetensors crate does, so data starts aligned.
    let pad = (8 - bytes.len() % 8) % 8;
    bytes.resize(bytes.len() + pad, b' ');
    bytes
}

/// Writes one shard file: header length, header, then each tensor generated in turn (one
/// tensor in memory at a time).
fn write_shard(group: &[&TensorSpec], step: u64, path: &Path) -> Result<()> {
    let header = shard_header(group, step);
    let f = fs::File::create(path).map_err(|e| io_err("create", path, e))?;
    let mut w = std::io::BufWriter::new(f);
    let mut put = |b: &[u8]| w.write_all(b).map_err(|e| io_err("write", path, e));
    put(&(header.len() as u64).to_le_bytes())?;
    put(&header)?;
    let mut buf = Vec::new();
    for s in group {
        buf.clear();
        buf.resize(s.bytes() as usize, 0);
        fill_tensor(s, step, &mut buf);
        put(&buf)?;
    }
    w.flush().map_err(|e| io_err("write", path, e))
}
