#![doc = include_str!("../README.md")]

mod etcd;
mod in_process;

pub use etcd::{Etcd, EtcdOptions, CHUNK_BYTES};
pub use in_process::InProcess;
