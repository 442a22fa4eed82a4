#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod copy;
pub mod layers;
pub mod receiver;

pub use layers::{Layer, PostLimitLayer, RetryLayer, TimeoutLayer, WavesLayer};
pub use receiver::{Receiver, ReceiverOptions, StageTimes, UpdateReport};
