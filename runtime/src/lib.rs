#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod copy;
pub mod layers;
pub mod publisher;
pub mod receiver;

pub use layers::{Layer, PostLimitLayer, RetryLayer, TimeoutLayer, WavesLayer};
pub use publisher::ShardPublisher;
pub use receiver::{Receiver, ReceiverOptions, StageTimes, UpdateReport};
