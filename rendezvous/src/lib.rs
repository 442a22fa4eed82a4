#![doc = include_str!("../README.md")]

mod etcd;
mod in_process;

pub use etcd::{Etcd, EtcdOptions, CHUNK_BYTES, MAX_BLOB_BYTES, MAX_TRANSPORT_LEN};
pub use in_process::InProcess;
