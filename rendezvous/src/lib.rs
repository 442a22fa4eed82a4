#![doc = include_str!("../README.md")]

mod in_process;

pub use in_process::InProcess;
