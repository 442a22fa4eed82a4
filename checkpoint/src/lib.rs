#![doc = include_str!("../README.md")]
// Shard files are read with `pread`, never mapped (`file`): nothing here needs unsafe code.
#![forbid(unsafe_code)]

mod complete;
pub mod config;
mod content;
mod file;
mod open;
mod read_box;
mod write;

pub use complete::{candidates, incomplete_reason, is_complete, newest_complete, FolderState};
pub use open::Checkpoint;
pub use write::{shard_file_name, write_checkpoint, write_single_file, WriteOptions, Written};

/// File name of the index that lists every tensor's shard file; written last.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// File name of a single-file checkpoint's only tensor file (with `config.json` and no index):
/// how most models up to a few billion parameters are published.
pub const SINGLE_FILE: &str = "model.safetensors";

/// Key of the step in the index `metadata` (a number) and in each shard's `__metadata__` (a
/// decimal string, as safetensors metadata values are strings).
pub const STEP_KEY: &str = "reshard_step";
