#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod families;
pub mod layouts;
pub mod plan;
pub mod presets;
pub mod topology;
