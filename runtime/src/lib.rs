#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod copy;
pub mod receiver;

pub use receiver::{Receiver, ReceiverOptions, StageTimes, UpdateReport};
