//! One interface over synthetic publishers in this process ([`SyntheticCluster`]) and in a
//! child process ([`RemoteCluster`]), so refits and checks run the same code either way, and
//! the in-process rendezvous they announce on ([`Meeting`]).

use bytes::Bytes;

use reshard_core::{OwnerId, Result, ShardTable, Transport, WantedLayout};
use reshard_planner::presets::ModelConfig;

use crate::meeting::Meeting;
use crate::remote::RemoteCluster;
use crate::synthetic::SyntheticCluster;

/// Synthetic publishers in this process or in a child process, behind one interface, and the
/// rendezvous they announce on.
pub struct Publishers {
    site: Site,
    meeting: Meeting,
}

/// Where the publishers run.
enum Site {
    /// Publishers in this process.
    Local(SyntheticCluster),
    /// Publishers in a child process.
    Remote(RemoteCluster),
}

impl Publishers {
    /// Publishers in this process, announced on a new in-process rendezvous.
    pub async fn local(cluster: SyntheticCluster) -> Result<Self> {
        let meeting = Meeting::new(cluster.model(), cluster.transport_name())?;
        Self::announced(Site::Local(cluster), meeting).await
    }

    /// Publishers in a child process, announced (by this process, on their behalf) on a new
    /// in-process rendezvous.
    pub async fn remote(cluster: RemoteCluster) -> Result<Self> {
        let meeting = Meeting::new(cluster.model(), cluster.transport_name())?;
        Self::announced(Site::Remote(cluster), meeting).await
    }

    async fn announced(site: Site, meeting: Meeting) -> Result<Self> {
        let me = Self { site, meeting };
        me.announce().await?;
        Ok(me)
    }

    /// Makes the rendezvous say the publishers' current tables (see [`Meeting::sync`]).
    pub async fn announce(&self) -> Result<()> {
        let metadata = self.metadata().await?;
        self.meeting.sync(&self.tables(), &metadata).await
    }

    /// The rendezvous the publishers announce on.
    pub fn meeting(&self) -> &Meeting {
        &self.meeting
    }

    /// One shard table per rank, for the current step.
    pub fn tables(&self) -> Vec<ShardTable> {
        match &self.site {
            Site::Local(c) => c.tables(),
            Site::Remote(c) => c.tables(),
        }
    }

    /// Loads every rank's metadata into a receiver's transport, as the rendezvous announces it
    /// (announcing the current tables first).
    pub async fn connect(&self, receiver: &dyn Transport) -> Result<()> {
        self.announce().await?;
        self.meeting.connect(receiver).await
    }

    /// Every rank's transport metadata.
    pub async fn metadata(&self) -> Result<Vec<(OwnerId, Bytes)>> {
        match &self.site {
            Site::Local(c) => c.metadata().await,
            Site::Remote(c) => Ok(c.metadata().to_vec()),
        }
    }

    /// Publishes the weights of training step `step`.
    pub fn publish_step(&mut self, step: u64) -> Result<()> {
        match &mut self.site {
            Site::Local(c) => {
                c.publish_step(step);
                Ok(())
            }
            Site::Remote(c) => c.publish_step(step),
        }
    }

    /// Turns digest publication on or off.
    pub fn set_digests(&mut self, on: bool) -> Result<()> {
        match &mut self.site {
            Site::Local(c) => {
                c.set_digests(on);
                Ok(())
            }
            Site::Remote(c) => c.set_digests(on),
        }
    }

    /// Flips one byte of `tensor`'s first buffer after its digest was published.
    pub fn corrupt(&self, tensor: &str, byte: u64) -> Result<u64> {
        match &self.site {
            Site::Local(c) => c.corrupt(tensor, byte),
            Site::Remote(c) => c.corrupt(tensor, byte),
        }
    }

    /// The current training step.
    pub fn step(&self) -> u64 {
        match &self.site {
            Site::Local(c) => c.step(),
            Site::Remote(c) => c.step(),
        }
    }

    /// The model published.
    pub fn model(&self) -> &ModelConfig {
        match &self.site {
            Site::Local(c) => c.model(),
            Site::Remote(c) => c.model(),
        }
    }

    /// Bytes of physical publisher memory.
    pub fn arena_bytes(&self) -> u64 {
        match &self.site {
            Site::Local(c) => c.arena_bytes(),
            Site::Remote(c) => c.arena_bytes(),
        }
    }

    /// The bytes every parameter of `layout` must hold for the current step.
    pub fn expected_params(&self, layout: &WantedLayout) -> Result<Vec<Vec<u8>>> {
        match &self.site {
            Site::Local(c) => c.expected_params(layout),
            Site::Remote(c) => c.expected_params(layout),
        }
    }

    /// Kills the publishers' process (see [`RemoteCluster::kill`]); publishers in this process
    /// cannot be killed (`Unsupported`).
    pub fn kill(&mut self) -> Result<()> {
        match &mut self.site {
            Site::Local(_) => Err(reshard_core::Error::new(
                reshard_core::ErrorKind::Unsupported,
                "publishers in this process cannot be killed",
            )),
            Site::Remote(c) => c.kill().map(|_| ()),
        }
    }

    /// Process id of the publishers' process (`None` in this process, or after a kill).
    pub fn pid(&self) -> Option<u32> {
        match &self.site {
            Site::Local(_) => None,
            Site::Remote(c) => c.pid(),
        }
    }

    /// True when the publishers live in another process.
    pub fn is_remote(&self) -> bool {
        matches!(self.site, Site::Remote(_))
    }
}
