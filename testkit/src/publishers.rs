//! One interface over synthetic publishers in this process ([`SyntheticCluster`]) and in a
//! child process ([`RemoteCluster`]), so refits and checks run the same code either way.

use bytes::Bytes;

use reshard_core::{OwnerId, Result, ShardTable, Transport, WantedLayout};
use reshard_planner::presets::ModelConfig;

use crate::remote::RemoteCluster;
use crate::synthetic::SyntheticCluster;

/// Synthetic publishers in this process or in a child process, behind one interface.
pub enum Publishers {
    /// Publishers in this process.
    Local(SyntheticCluster),
    /// Publishers in a child process.
    Remote(RemoteCluster),
}

impl Publishers {
    /// One shard table per rank, for the current step.
    pub fn tables(&self) -> Vec<ShardTable> {
        match self {
            Publishers::Local(c) => c.tables(),
            Publishers::Remote(c) => c.tables(),
        }
    }

    /// Loads every rank's metadata into a receiver's transport.
    pub async fn connect(&self, receiver: &dyn Transport) -> Result<()> {
        match self {
            Publishers::Local(c) => c.connect(receiver).await,
            Publishers::Remote(c) => c.connect(receiver).await,
        }
    }

    /// Every rank's transport metadata.
    pub async fn metadata(&self) -> Result<Vec<(OwnerId, Bytes)>> {
        match self {
            Publishers::Local(c) => c.metadata().await,
            Publishers::Remote(c) => Ok(c.metadata().to_vec()),
        }
    }

    /// Publishes the weights of training step `step`.
    pub fn publish_step(&mut self, step: u64) -> Result<()> {
        match self {
            Publishers::Local(c) => {
                c.publish_step(step);
                Ok(())
            }
            Publishers::Remote(c) => c.publish_step(step),
        }
    }

    /// Turns digest publication on or off.
    pub fn set_digests(&mut self, on: bool) -> Result<()> {
        match self {
            Publishers::Local(c) => {
                c.set_digests(on);
                Ok(())
            }
            Publishers::Remote(c) => c.set_digests(on),
        }
    }

    /// Flips one byte of `tensor`'s first buffer after its digest was published.
    pub fn corrupt(&self, tensor: &str, byte: u64) -> Result<u64> {
        match self {
            Publishers::Local(c) => c.corrupt(tensor, byte),
            Publishers::Remote(c) => c.corrupt(tensor, byte),
        }
    }

    /// The current training step.
    pub fn step(&self) -> u64 {
        match self {
            Publishers::Local(c) => c.step(),
            Publishers::Remote(c) => c.step(),
        }
    }

    /// The model published.
    pub fn model(&self) -> &ModelConfig {
        match self {
            Publishers::Local(c) => c.model(),
            Publishers::Remote(c) => c.model(),
        }
    }

    /// Bytes of physical publisher memory.
    pub fn arena_bytes(&self) -> u64 {
        match self {
            Publishers::Local(c) => c.arena_bytes(),
            Publishers::Remote(c) => c.arena_bytes(),
        }
    }

    /// The bytes every parameter of `layout` must hold for the current step.
    pub fn expected_params(&self, layout: &WantedLayout) -> Result<Vec<Vec<u8>>> {
        match self {
            Publishers::Local(c) => c.expected_params(layout),
            Publishers::Remote(c) => c.expected_params(layout),
        }
    }

    /// Kills the publishers' process (see [`RemoteCluster::kill`]); publishers in this process
    /// cannot be killed (`Unsupported`).
    pub fn kill(&mut self) -> Result<()> {
        match self {
            Publishers::Local(_) => Err(reshard_core::Error::new(
                reshard_core::ErrorKind::Unsupported,
                "publishers in this process cannot be killed",
            )),
            Publishers::Remote(c) => c.kill().map(|_| ()),
        }
    }

    /// Process id of the publishers' process (`None` in this process, or after a kill).
    pub fn pid(&self) -> Option<u32> {
        match self {
            Publishers::Local(_) => None,
            Publishers::Remote(c) => c.pid(),
        }
    }

    /// True when the publishers live in another process.
    pub fn is_remote(&self) -> bool {
        matches!(self, Publishers::Remote(_))
    }
}
