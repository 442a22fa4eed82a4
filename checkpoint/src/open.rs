//! Opening a checkpoint: config, index, shard files opened for positioned reads (never mapped:
//! `file`), and validation of every tensor against the architecture `config.json` describes.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use reshard_core::{DType, Error, ErrorKind, Result, TensorSpec};
use reshard_planner::presets::ModelConfig;
use safetensors::tensor::{Metadata, TensorInfo};
use serde_json::Value;

use crate::config::dtype_from_safetensors as from_st_dtype;
use crate::config::{read_config_declared, reconcile_headers};
use crate::file::ShardFile;
use crate::{INDEX_FILE, STEP_KEY};

/// Where one tensor's bytes are.
pub(crate) struct Entry {
    pub(crate) spec: TensorSpec,
    pub(crate) shard: usize,
    /// Absolute byte range inside the shard file.
    pub(crate) start: u64,
    pub(crate) end: u64,
}

/// An opened, validated checkpoint whose shard files are held open for positioned reads.
pub struct Checkpoint {
    dir: PathBuf,
    model: ModelConfig,
    step: u64,
    specs: Vec<TensorSpec>,
    pub(crate) shards: Vec<ShardFile>,
    pub(crate) entries: HashMap<String, Entry>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("model", &self.model.name)
            .field("step", &self.step)
            .field("shards", &self.shards.len())
            .field("tensors", &self.specs.len())
            .finish()
    }
}

pub(crate) fn cfg_err(msg: String) -> Error {
    Error::new(ErrorKind::Config, msg)
}

/// The parsed index: step, and tensor name -> shard file name.
pub(crate) struct Index {
    pub(crate) step: Option<u64>,
    pub(crate) weight_map: BTreeMap<String, String>,
}

/// Reads `dir/model.safetensors.index.json`; a missing index means the folder is incomplete.
pub(crate) fn read_index(dir: &Path) -> Result<Index> {
    let file = dir.join(INDEX_FILE);
    let text = std::fs::read_to_string(&file).map_err(|e| {
        cfg_err(format!(
            "{} is not a complete checkpoint: cannot read {}: {e}",
            dir.display(),
            file.display()
        ))
    })?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| cfg_err(format!("{} is not valid JSON: {e}", file.display())))?;
    let wm = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| cfg_err(format!("{} has no \"weight_map\" object", file.display())))?;
    let mut weight_map = BTreeMap::new();
    for (k, f) in wm {
        let f = f.as_str().ok_or_else(|| {
            cfg_err(format!(
                "{}: weight_map entry of tensor {k} is not a file name",
                file.display()
            ))
            .with_tensor(k)
        })?;
        // The index names files inside the checkpoint folder, never elsewhere.
        if f.contains('/') || f.contains('\\') || f.starts_with('.') {
            return Err(cfg_err(format!(
                "{}: tensor {k} maps to {f:?}, which is not a file name in the folder",
                file.display()
            ))
            .with_tensor(k));
        }
        weight_map.insert(k.clone(), f.to_string());
    }
    let step = v
        .get("metadata")
        .and_then(|m| m.get(STEP_KEY))
        .and_then(|s| {
            s.as_u64()
                .or_else(|| s.as_str().and_then(|s| s.parse().ok()))
        });
    Ok(Index { step, weight_map })
}

/// Checks what the `safetensors` crate checks of a whole file, from the header and the file size
/// alone (the data is never read here): tensors' data ranges inside the file, contiguous from
/// the start of the data, each exactly its dtype x shape in bytes (computed with checked
/// arithmetic), and no bytes after the last. The data starts at file byte `data_start` and is
/// `data_len` bytes (the file size less the header); errors carry file byte ranges. Returns the
/// tensors sorted by data offset, each with its dtype.
pub(crate) fn check_layout<'m>(
    meta: &'m Metadata,
    data_start: u64,
    data_len: u64,
    file: &str,
) -> Result<Vec<(String, &'m TensorInfo, DType)>> {
    // Offsets come from the header: a range past the end must not wrap around when shifted.
    let abs = |b: u64, e: u64| data_start.saturating_add(b)..data_start.saturating_add(e);
    let mut infos: Vec<_> = meta.tensors().into_iter().collect();
    infos.sort_by_key(|(_, i)| i.data_offsets);
    // Ranges past the end first: a truncated file names the tensor it cut.
    for (t, info) in &infos {
        let (b, e) = (info.data_offsets.0 as u64, info.data_offsets.1 as u64);
        if b > e || e > data_len {
            return Err(cfg_err(format!(
                "tensor {t} in shard file {file}: data bytes {b}..{e} lie outside the \
                 {data_len} data bytes of the file (truncated?)"
            ))
            .with_tensor(t.as_str())
            .with_range(abs(b, e)));
        }
    }
    let mut at = 0u64;
    let mut out = Vec::with_capacity(infos.len());
    for (t, info) in infos {
        let (b, e) = (info.data_offsets.0 as u64, info.data_offsets.1 as u64);
        if b != at {
            return Err(cfg_err(format!(
                "tensor {t} in shard file {file}: data bytes {b}..{e} do not start where the \
                 previous tensor ends ({at}): safetensors data is contiguous"
            ))
            .with_tensor(t.as_str())
            .with_range(abs(b, e)));
        }
        let dtype = from_st_dtype(info.dtype).ok_or_else(|| {
            cfg_err(format!(
                "tensor {t} in shard file {file} has unsupported dtype {:?}",
                info.dtype
            ))
            .with_tensor(t.as_str())
        })?;
        let bytes = info
            .shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
            .and_then(|n| n.checked_mul(dtype.size()));
        if bytes != Some(e - b) {
            return Err(cfg_err(format!(
                "tensor {t} in shard file {file}: shape {:?} of {dtype} is {} but its data \
                 bytes {b}..{e} are {} bytes",
                info.shape,
                bytes.map_or("more than u64 bytes".to_string(), |n| format!("{n} bytes")),
                e - b
            ))
            .with_tensor(t.as_str())
            .with_range(abs(b, e)));
        }
        at = e;
        out.push((t, info, dtype));
    }
    if at != data_len {
        return Err(cfg_err(format!(
            "shard file {file}: {} bytes follow the last tensor's data, which ends at data byte \
             {at} of {data_len}",
            data_len - at
        ))
        .with_range(abs(at, data_len)));
    }
    Ok(out)
}

/// The step recorded in a shard's `__metadata__`, if any.
fn shard_step(meta: &Metadata) -> Option<u64> {
    meta.metadata()
        .as_ref()
        .and_then(|m| m.get(STEP_KEY))
        .and_then(|s| s.parse().ok())
}

fn step_from_dir_name(dir: &Path) -> Option<u64> {
    let name = dir
        .canonicalize()
        .ok()?
        .file_name()?
        .to_string_lossy()
        .into_owned();
    name.strip_prefix("step-")?.parse().ok()
}

impl Checkpoint {
    /// Opens the checkpoint in `dir`: reads `config.json` and the index, opens every shard file,
    /// reads its header and validates every tensor against the architecture (see the crate docs
    /// for the error kinds). Tensor data is read later, by [`Checkpoint::copy_box`].
    pub fn open(dir: impl AsRef<Path>) -> Result<Checkpoint> {
        let dir = dir.as_ref();
        let index = read_index(dir)?;
        let (model, declared) = read_config_declared(dir)?;
        let mut files: Vec<&String> = index.weight_map.values().collect();
        files.sort();
        files.dedup();
        let mut shards: Vec<ShardFile> = Vec::with_capacity(files.len());
        let mut found: HashMap<String, Entry> = HashMap::new();
        let mut step = index.step;
        let mut stray: Option<Error> = None;
        for name in files {
            let file = ShardFile::open(&dir.join(name), name)?;
            let (start, meta) = file.read_header()?;
            if let (Some(s), Some(i)) = (shard_step(&meta), step) {
                if s != i {
                    return Err(cfg_err(format!(
                        "shard file {name} is of step {s} but the index says step {i}"
                    )));
                }
            }
            step = step.or(shard_step(&meta));
            let infos = check_layout(&meta, start, file.len() - start, name)?;
            let shard = shards.len();
            for (t, info, dtype) in infos {
                // A tensor the index does not place here is reported after the missing-tensor
                // check: a renamed tensor is then named by what the architecture expects.
                let listed = index.weight_map.get(&t);
                if listed != Some(name) && stray.is_none() {
                    let where_ = listed.map_or("is not in the index".to_string(), |f| {
                        format!("is listed in the index under {f}")
                    });
                    stray = Some(
                        cfg_err(format!(
                            "unexpected tensor {t} in shard file {name}: it {where_}"
                        ))
                        .with_tensor(t.as_str()),
                    );
                }
                let shape = info.shape.iter().map(|&d| d as u64).collect();
                found.insert(
                    t.clone(),
                    Entry {
                        spec: TensorSpec::new(t.clone(), dtype, shape),
                        shard,
                        start: start + info.data_offsets.0 as u64,
                        end: start + info.data_offsets.1 as u64,
                    },
                );
            }
            shards.push(file);
        }
        // Every tensor fits a rule of the family; the headers' dtypes are reconciled with config.json.
        let headers: Vec<(&TensorSpec, &str)> = found
            .values()
            .map(|e| (&e.spec, shards[e.shard].name.as_str()))
            .collect();
        let model = reconcile_headers(model, declared, &headers)?;
        let specs = model.tensors();
        for want in &specs {
            let file = index.weight_map.get(&want.name);
            let have = found.get(&want.name).ok_or_else(|| {
                let why = match file {
                    Some(f) => format!("the index lists it in {f} but that file does not hold it"),
                    None => "it is neither in the index nor in any shard file".into(),
                };
                cfg_err(format!(
                    "missing tensor {} (required by config.json, model {}): {why}",
                    want.name, model.name
                ))
                .with_tensor(&want.name)
            })?;
            let file = &shards[have.shard].name;
            if have.spec.dtype != want.dtype {
                return Err(cfg_err(format!(
                    "tensor {} in shard file {file} has dtype {} but config.json implies {}",
                    want.name, have.spec.dtype, want.dtype
                ))
                .with_tensor(&want.name));
            }
            if have.spec.shape != want.shape {
                return Err(cfg_err(format!(
                    "tensor {} in shard file {file} has shape {:?} but config.json implies {:?}",
                    want.name, have.spec.shape, want.shape
                ))
                .with_tensor(&want.name));
            }
        }
        if let Some(e) = stray {
            return Err(e);
        }
        if found.len() != specs.len() || index.weight_map.len() != specs.len() {
            let known: std::collections::HashSet<&str> =
                specs.iter().map(|s| s.name.as_str()).collect();
            let extra = index
                .weight_map
                .iter()
                .find(|(t, _)| !known.contains(t.as_str()));
            if let Some((t, f)) = extra {
                return Err(cfg_err(format!(
                    "unexpected tensor {t} in shard file {f}: the architecture in config.json \
                     (model {}) has no such tensor",
                    model.name
                ))
                .with_tensor(t.as_str()));
            }
        }
        Ok(Checkpoint {
            step: step.or_else(|| step_from_dir_name(dir)).unwrap_or(0),
            dir: dir.to_path_buf(),
            model,
            specs,
            shards,
            entries: found,
        })
    }

    /// The checkpoint folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The architecture read from `config.json`.
    pub fn model(&self) -> &ModelConfig {
        &self.model
    }

    /// The step: index metadata `reshard_step`, else shard metadata, else a `step-N` folder
    /// name, else 0.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Every tensor, in the architecture's order (`ModelConfig::tensors`).
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.specs
    }

    /// The spec of one tensor, or an `InvalidInput` error naming it.
    pub fn spec(&self, tensor: &str) -> Result<&TensorSpec> {
        Ok(&self.entry(tensor)?.spec)
    }

    /// Shard file names, sorted.
    pub fn shard_files(&self) -> Vec<&str> {
        self.shards.iter().map(|s| s.name.as_str()).collect()
    }

    /// The shard file holding `tensor`.
    pub fn file_of(&self, tensor: &str) -> Result<&str> {
        Ok(&self.shards[self.entry(tensor)?.shard].name)
    }

    /// The whole tensor's bytes, row-major, read from its shard file (an error naming file and
    /// byte range when the file changed since [`Checkpoint::open`]).
    pub fn tensor_bytes(&self, tensor: &str) -> Result<Vec<u8>> {
        let e = self.entry(tensor)?;
        let file = &self.shards[e.shard];
        let len = usize::try_from(e.end - e.start).map_err(|_| {
            Error::new(
                ErrorKind::InvalidInput,
                format!("tensor {tensor} does not fit this machine's memory"),
            )
            .with_tensor(tensor)
        })?;
        // Bounded by the file: open checked the range against the file's size.
        let mut out = vec![0u8; len];
        file.read_exact_at(e.start, &mut out)
            .and_then(|()| file.check_unchanged(&(e.start..e.end)))
            .map_err(|err| err.with_tensor(tensor))?;
        Ok(out)
    }

    pub(crate) fn entry(&self, tensor: &str) -> Result<&Entry> {
        self.entries.get(tensor).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "tensor {tensor} is not in the checkpoint {}",
                    self.dir.display()
                ),
            )
            .with_tensor(tensor)
        })
    }
}
