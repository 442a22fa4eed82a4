#![doc = include_str!("../README.md")]

mod etcd;
mod holder;
mod in_process;

pub use etcd::{Etcd, EtcdOptions, CHUNK_BYTES, MAX_BLOB_BYTES, MAX_HOST_LEN, MAX_TRANSPORT_LEN};
pub use in_process::InProcess;
