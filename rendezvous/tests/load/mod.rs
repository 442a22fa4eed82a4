//! The rendezvous side of a refit under load, shared by the load example (the measured run,
//! BENCHMARKS.md, "Load held, measured") and the `etcd_load` test (the same code, smaller, in
//! CI so it cannot rot).
//!
//! Publishers: every rank of a planner topology announces its real encoded shard table (digest
//! placeholders, so sizes are those publishers send) through [`Etcd::announce`], each rank under
//! its own lease, keep-alive and probe answerer, from a pool of a few connections (one process
//! standing in for many trainer ranks). Receivers: each on its own connection, all started at
//! once, does what a refit does on the rendezvous side (`runtime`'s `Subscriber`): discovery,
//! the reading claim of the reader fence naming every rank, the members read again to check
//! they still stand ready, then the release; in between, every claim may be held until a
//! publisher has listed them, as its fence does when it advances while receivers read.
//!
//! etcd's own Prometheus counters (`/metrics` of every member, summed) count the requests and
//! bytes, so the figures are the server's, not an estimate.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use reshard_core::encoding::encode_table;
use reshard_core::rendezvous::{discover, Announced, Announcement, ReadClaim, Rendezvous, Want};
use reshard_core::transport::new_incarnation;
use reshard_core::{Error, ErrorKind, OwnerId, Result};
use reshard_planner::presets::preset;
use reshard_planner::topology::{geometry_tables, with_digest_placeholders, PublisherTopology};
use reshard_rendezvous::{Etcd, EtcdOptions};

/// Announcements in flight at once while the pool announces (each is a lease grant, three blob
/// puts and a claim transaction).
const ANNOUNCING: usize = 64;

/// A model's publisher ranks, announced and held.
pub struct Publishers {
    /// The model name they announce under (unique per run).
    pub model: String,
    /// Publisher ranks.
    pub world: u32,
    /// Each rank's incarnation, by rank.
    pub incarnations: Vec<u64>,
    /// Encoded table bytes of all ranks together.
    pub table_bytes: u64,
    /// Offers of all ranks together.
    pub offers: usize,
    /// Bytes of one rank's transport metadata and of the config blob.
    pub metadata_bytes: u64,
    /// Bytes of the config blob.
    pub config_bytes: u64,
    /// Time to announce every rank.
    pub announce: Duration,
    /// The pool's connections.
    pub pool: usize,
    held: Vec<Box<dyn Announced>>,
    conns: Vec<Etcd>,
}

impl Publishers {
    /// Announces every rank of `topology` of preset `model` through `pool` connections to `url`.
    pub async fn announce(
        url: &str,
        model: &str,
        topology: &PublisherTopology,
        pool: usize,
        options: EtcdOptions,
    ) -> Result<Publishers> {
        let config = preset(model)?;
        let mut tables = geometry_tables(&config, topology, 1)?;
        with_digest_placeholders(&mut tables);
        let world = tables.len() as u32;
        let incarnations: Vec<u64> = (0..world).map(|_| new_incarnation()).collect();
        for t in &mut tables {
            t.publisher.incarnation = incarnations[t.publisher.rank as usize];
        }
        let offers = tables.iter().map(|t| t.offers.len()).sum();
        let encoded: Vec<Bytes> = tables
            .iter()
            .map(|t| Bytes::from(encode_table(t)))
            .collect();
        drop(tables);
        let table_bytes = encoded.iter().map(|t| t.len() as u64).sum();
        let config = Bytes::from(serde_json::to_vec(&config).unwrap_or_default());
        // What a UCX worker address and its region keys weigh, about.
        let metadata = Bytes::from(vec![7u8; 2048]);
        let name = format!("load-{}-{}", world, std::process::id());
        let mut conns = Vec::with_capacity(pool.max(1));
        for _ in 0..pool.max(1) {
            conns.push(Etcd::connect(url, options.clone()).await?);
        }
        let start = Instant::now();
        let held: Vec<Box<dyn Announced>> = futures::stream::iter(encoded.into_iter().enumerate())
            .map(|(rank, table)| {
                let etcd = conns[rank % conns.len()].clone();
                let a = Announcement {
                    model: name.clone(),
                    rank: rank as OwnerId,
                    world,
                    step: 1,
                    transport: "ucx".into(),
                    incarnation: incarnations[rank],
                    table,
                    metadata: metadata.clone(),
                    config: config.clone(),
                };
                async move { etcd.announce(a).await }
            })
            .buffered(ANNOUNCING)
            .try_collect()
            .await?;
        Ok(Publishers {
            model: name,
            world,
            incarnations,
            table_bytes,
            offers,
            metadata_bytes: metadata.len() as u64,
            config_bytes: config.len() as u64,
            announce: start.elapsed(),
            pool: conns.len(),
            held,
            conns,
        })
    }

    /// A connection of the publishers' side (the pool's first).
    pub fn connection(&self) -> &Etcd {
        &self.conns[0]
    }

    /// Withdraws every rank (revokes its lease: all its keys go).
    pub async fn withdraw(self) -> Result<()> {
        futures::stream::iter(self.held)
            .map(|h| h.withdraw())
            .buffer_unordered(ANNOUNCING)
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    }
}

/// What one receiver's refit did at the rendezvous.
#[derive(Clone, Debug)]
pub struct Refit {
    /// `discover` until every rank's announcement was fetched.
    pub discovery: Duration,
    /// The reader fence: claim, members read again, release.
    pub fence: Duration,
    /// Announcements discovered.
    pub ranks: usize,
    /// Blob bytes discovered (tables, metadata, config).
    pub fetched_bytes: u64,
    /// Whether every publisher still stood ready at the step after the claim (else a real
    /// receiver reads nothing and discovers again).
    pub still_ready: bool,
    /// The rendezvous failures discovery waited through (`Discovered::waited_through`).
    pub waited_through: Vec<String>,
}

/// One receiver's refit at the rendezvous, as `runtime`'s `Subscriber` does it: discovery, the
/// reading claim naming every rank found, the member list read again, the release. With
/// `reading`, the claim is held until it says so: where the wire leg would run.
pub async fn refit(
    etcd: &Etcd,
    model: &str,
    reader: &str,
    timeout: Duration,
    reading: Option<&Reads>,
) -> Result<Refit> {
    let held = claimed(etcd, model, reader, timeout).await;
    if let Some(r) = reading {
        // Whether or not this receiver got its claim: every other one waits for all.
        r.all_claimed.wait().await;
        r.listed.wait().await;
    }
    let (refit, claim) = held?;
    let released = Instant::now();
    claim.release().await?;
    Ok(Refit {
        fence: refit.fence + released.elapsed(),
        ..refit
    })
}

/// Discovery, the claim and the members read again: the refit so far, and the claim to release.
async fn claimed(
    etcd: &Etcd,
    model: &str,
    reader: &str,
    timeout: Duration,
) -> Result<(Refit, Box<dyn reshard_core::rendezvous::Reading>)> {
    let start = Instant::now();
    let found = discover(
        etcd,
        &Want {
            model: model.to_string(),
            after_step: None,
            timeout,
        },
    )
    .await?;
    let discovery = start.elapsed();
    let fetched_bytes = found
        .announcements
        .iter()
        .map(|a| (a.table.len() + a.metadata.len() + a.config.len()) as u64)
        .sum();
    let fenced = Instant::now();
    let claim = etcd
        .claim_reading(ReadClaim {
            model: model.to_string(),
            step: found.step,
            reader: reader.to_string(),
            ranks: found
                .announcements
                .iter()
                .map(|a| (a.rank, a.incarnation))
                .collect(),
        })
        .await?;
    let (members, _) = etcd.members(model).await?;
    let still_ready = members.len() == found.announcements.len()
        && members.iter().zip(&found.announcements).all(|(m, a)| {
            m.rank == a.rank && m.ready && m.step == found.step && m.incarnation == a.incarnation
        });
    let refit = Refit {
        discovery,
        fence: fenced.elapsed(),
        ranks: found.announcements.len(),
        fetched_bytes,
        still_ready,
        waited_through: found.waited_through,
    };
    Ok((refit, claim))
}

/// Where every receiver of a round holds its claim at once, as while they all read: a
/// publisher's fence lists the claims then.
pub struct Reads {
    /// Passed once every receiver holds its claim (or failed before it).
    all_claimed: tokio::sync::Barrier,
    /// Passed once the publisher side listed the claims.
    listed: tokio::sync::Barrier,
}

/// What a publisher's fence saw while every receiver held its claim: `Rendezvous::readers`, as
/// `wait_released` calls it.
#[derive(Debug)]
pub struct Listing {
    /// Claims listed, or the listing's error.
    pub claims: Result<usize>,
    /// Time the listing took.
    pub took: Duration,
    /// Bytes etcd sent for it (its counters around the listing, every receiver waiting).
    pub sent_bytes: f64,
}

/// `receivers` connections to `url`, one per receiver, each proven to answer.
pub async fn connect_receivers(
    url: &str,
    receivers: usize,
    options: EtcdOptions,
) -> Result<Vec<Arc<Etcd>>> {
    futures::stream::iter(0..receivers)
        .map(|_| {
            let options = options.clone();
            async move { Etcd::connect(url, options).await.map(Arc::new) }
        })
        .buffered(16)
        .try_collect()
        .await
}

/// Every receiver refits at once (each its own task and connection); each receiver's outcome,
/// in receiver order. With `publisher` (a connection of the publishers' side and the cluster's
/// `etcd://` list), every receiver holds its claim until that side listed the claims, and the
/// listing is returned.
pub async fn round(
    receivers: &[Arc<Etcd>],
    model: &str,
    timeout: Duration,
    publisher: Option<(&Etcd, &str)>,
) -> (Vec<Result<Refit>>, Option<Listing>) {
    // Each task waits at the barrier, so none starts before every one is spawned.
    let go = Arc::new(tokio::sync::Barrier::new(receivers.len()));
    let parties = receivers.len() + 1;
    let reads = publisher.map(|_| {
        Arc::new(Reads {
            all_claimed: tokio::sync::Barrier::new(parties),
            listed: tokio::sync::Barrier::new(parties),
        })
    });
    let tasks: Vec<_> = receivers
        .iter()
        .enumerate()
        .map(|(i, etcd)| {
            let (etcd, go, model) = (etcd.clone(), go.clone(), model.to_string());
            let reads = reads.clone();
            tokio::spawn(async move {
                go.wait().await;
                let reader = format!("load receiver {i}");
                refit(&etcd, &model, &reader, timeout, reads.as_deref()).await
            })
        })
        .collect();
    let mut listing = None;
    if let (Some(reads), Some((etcd, url))) = (&reads, publisher) {
        reads.all_claimed.wait().await;
        let before = Counters::scrape(url).await;
        let start = Instant::now();
        let claims = etcd.readers(model).await.map(|(c, _)| c.len());
        let took = start.elapsed();
        let after = Counters::scrape(url).await;
        let sent_bytes = match (before, after) {
            (Ok(b), Ok(a)) => a.since(&b).sent_bytes,
            _ => f64::NAN,
        };
        listing = Some(Listing {
            claims,
            took,
            sent_bytes,
        });
        reads.listed.wait().await;
    }
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.unwrap_or_else(|e| {
            Err(Error::new(
                ErrorKind::Internal,
                format!("receiver task: {e}"),
            ))
        }));
    }
    (out, listing)
}

/// The `q` quantile (0..=1) of `sorted` by the nearest rank.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// etcd's own counters, summed over the members of a cluster: requests by gRPC method and the
/// client bytes it received and sent.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    /// Unary calls started, by method (`Range`, `Txn`, `Put`, `LeaseGrant`, ...).
    pub unary: BTreeMap<String, f64>,
    /// Messages received on streams, by method (`Watch`, `LeaseKeepAlive`).
    pub stream_msgs: BTreeMap<String, f64>,
    /// Streams opened, by method.
    pub streams: BTreeMap<String, f64>,
    /// Bytes etcd received from clients (`etcd_network_client_grpc_received_bytes_total`).
    pub received_bytes: f64,
    /// Bytes etcd sent to clients (`etcd_network_client_grpc_sent_bytes_total`).
    pub sent_bytes: f64,
    /// Ranges etcd's store served (`etcd_debugging_mvcc_range_total`).
    pub mvcc_ranges: f64,
}

impl Counters {
    /// Reads every member's `/metrics` (`etcd://h:p,h:p` names the members' client URLs) and
    /// sums them.
    pub async fn scrape(url: &str) -> Result<Counters> {
        let hosts: Vec<String> = url
            .trim_start_matches("etcd://")
            .split(',')
            .filter(|h| !h.is_empty())
            .map(str::to_string)
            .collect();
        tokio::task::spawn_blocking(move || {
            let mut sum = Counters::default();
            for h in hosts {
                sum.add_text(&http_get(&h, "/metrics")?);
            }
            Ok(sum)
        })
        .await
        .map_err(|e| Error::new(ErrorKind::Internal, format!("scrape task: {e}")))?
    }

    /// Adds the counters of one member's Prometheus text.
    fn add_text(&mut self, text: &str) {
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(v) = value.parse::<f64>() else {
                continue;
            };
            let (name, labels) = series.split_once('{').unwrap_or((series, ""));
            let label = |k: &str| {
                let at = labels.find(&format!("{k}=\""))? + k.len() + 2;
                labels[at..].split('"').next().map(str::to_string)
            };
            match name {
                "grpc_server_started_total" => {
                    let (Some(t), Some(m)) = (label("grpc_type"), label("grpc_method")) else {
                        continue;
                    };
                    let map = if t == "unary" {
                        &mut self.unary
                    } else {
                        &mut self.streams
                    };
                    *map.entry(m).or_default() += v;
                }
                "grpc_server_msg_received_total" => {
                    let (Some(t), Some(m)) = (label("grpc_type"), label("grpc_method")) else {
                        continue;
                    };
                    if t != "unary" {
                        *self.stream_msgs.entry(m).or_default() += v;
                    }
                }
                "etcd_network_client_grpc_received_bytes_total" => self.received_bytes += v,
                "etcd_network_client_grpc_sent_bytes_total" => self.sent_bytes += v,
                "etcd_debugging_mvcc_range_total" => self.mvcc_ranges += v,
                _ => {}
            }
        }
    }

    /// What happened between `before` and `self`.
    pub fn since(&self, before: &Counters) -> Counters {
        let diff = |a: &BTreeMap<String, f64>, b: &BTreeMap<String, f64>| {
            a.iter()
                .map(|(k, v)| (k.clone(), v - b.get(k).copied().unwrap_or(0.0)))
                .filter(|(_, v)| *v != 0.0)
                .collect()
        };
        Counters {
            unary: diff(&self.unary, &before.unary),
            stream_msgs: diff(&self.stream_msgs, &before.stream_msgs),
            streams: diff(&self.streams, &before.streams),
            received_bytes: self.received_bytes - before.received_bytes,
            sent_bytes: self.sent_bytes - before.sent_bytes,
            mvcc_ranges: self.mvcc_ranges - before.mvcc_ranges,
        }
    }

    /// Unary calls of every method together.
    pub fn unary_total(&self) -> f64 {
        self.unary.values().sum()
    }
}

/// `GET path` from `host:port` over plain HTTP/1.0 (etcd's metrics page on 127.0.0.1; no HTTP
/// client crate is needed for one page).
fn http_get(host: &str, path: &str) -> Result<String> {
    let io = |e: std::io::Error| {
        Error::new(
            ErrorKind::Transport,
            format!("GET http://{host}{path}: {e}"),
        )
    };
    let mut s = std::net::TcpStream::connect(host).map_err(io)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(io)?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").map_err(io)?;
    let mut body = String::new();
    s.read_to_string(&mut body).map_err(io)?;
    Ok(body
        .split_once("\r\n\r\n")
        .map_or(body.clone(), |(_, b)| b.to_string()))
}
