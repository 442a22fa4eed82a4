#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod content;
pub mod hosts;
pub mod meeting;
pub mod models;
pub mod publishers;
pub mod remote;
pub mod rig;
pub mod synthetic;

pub use meeting::Meeting;
pub use publishers::Publishers;
pub use remote::RemoteCluster;
pub use synthetic::{Placement, SyntheticCluster};
