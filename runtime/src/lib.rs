#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod layers;
pub mod publisher;
pub mod receiver;
pub mod strided;
pub mod subscriber;
pub mod tensor_publisher;

pub use layers::{Layer, PostLimitLayer, RetryLayer, TimeoutLayer, WavesLayer};
pub use publisher::ShardPublisher;
pub use receiver::{Receiver, ReceiverOptions, RollbackReport, StageTimes, Staged, UpdateReport};
pub use subscriber::{StagedStep, StepReport, Subscriber};
pub use tensor_publisher::{HeldTensor, TensorPublisher};
