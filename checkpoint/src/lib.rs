#![doc = include_str!("../README.md")]
// Unsafe code lives in `mmap` alone: mapping a shard file read-only.
#![deny(unsafe_code)]

mod complete;
pub mod config;
mod content;
mod copy;
#[allow(unsafe_code)]
mod mmap;
mod open;
mod write;

pub use complete::{incomplete_reason, is_complete, newest_complete};
pub use open::Checkpoint;
pub use write::{shard_file_name, write_checkpoint, WriteOptions, Written};

use reshard_core::DType;
use safetensors::tensor::Dtype;

/// File name of the index that lists every tensor's shard file; written last.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Key of the step in the index `metadata` (a number) and in each shard's `__metadata__` (a
/// decimal string, as safetensors metadata values are strings).
pub const STEP_KEY: &str = "reshard_step";

pub(crate) fn to_st_dtype(d: DType) -> Dtype {
    match d {
        DType::Bf16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F8E4m3 => Dtype::F8_E4M3,
        DType::F8E5m2 => Dtype::F8_E5M2,
        DType::I8 => Dtype::I8,
        DType::I16 => Dtype::I16,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
        DType::U8 => Dtype::U8,
        DType::Bool => Dtype::BOOL,
    }
}

pub(crate) fn from_st_dtype(d: Dtype) -> Option<DType> {
    DType::ALL.into_iter().find(|x| to_st_dtype(*x) == d)
}
