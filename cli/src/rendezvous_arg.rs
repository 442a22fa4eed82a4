//! The flags `publish`, `receive` and `status` share: where to meet, and which transport.

use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use reshard_core::rendezvous::Rendezvous;
use reshard_core::{Error, ErrorKind, Result};
use reshard_rendezvous::{Etcd, EtcdOptions};

/// Where publishers and receivers meet.
#[derive(Args, Clone, Debug)]
pub struct RendezvousArgs {
    /// The metadata service: `etcd://HOST:PORT[,HOST:PORT...]`.
    #[arg(long)]
    pub rendezvous: String,
    /// Seconds after a publisher's death before its announcement disappears (its lease TTL).
    #[arg(long, default_value_t = 10)]
    pub lease_ttl_s: u64,
}

/// The transport a deployed rank serves or reads over.
#[derive(Args, Clone, Debug)]
pub struct TransportArgs {
    /// Transport scheme (overrides `RESHARD_TRANSPORT__KIND` and `reshard.toml`).
    #[arg(long)]
    pub transport: Option<String>,
    /// Config file (default: `$RESHARD_CONFIG`, else `./reshard.toml` when present).
    #[arg(long)]
    pub config: Option<std::path::PathBuf>,
}

impl TransportArgs {
    /// The configuration these flags select.
    pub fn load(&self) -> Result<reshard_core::config::Config> {
        crate::load_config(self.transport.as_deref(), self.config.as_deref())
    }
}

/// Connects to the rendezvous the flags name.
pub async fn connect(args: &RendezvousArgs) -> Result<Arc<dyn Rendezvous>> {
    if args.rendezvous.starts_with("etcd://") {
        let options = EtcdOptions {
            lease_ttl: Duration::from_secs(args.lease_ttl_s),
            ..EtcdOptions::default()
        };
        return Ok(Arc::new(Etcd::connect(&args.rendezvous, options).await?));
    }
    Err(Error::new(
        ErrorKind::Config,
        format!(
            "--rendezvous {:?} is not supported: separate processes meet through etcd \
             (etcd://HOST:PORT); the in-process rendezvous serves one process only",
            args.rendezvous
        ),
    ))
}
