#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod content;
pub mod copy;
pub mod receiver;
pub mod synthetic;

pub use receiver::{Receiver, ReceiverOptions, StageTimes, UpdateReport};
pub use synthetic::SyntheticCluster;
