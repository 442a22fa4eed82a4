//! The rendezvous under load (issue 42 item 7; BENCHMARKS.md, "Load held, measured"): every
//! rank of a publisher topology of full-size Qwen3-30B-A3B announced with its real encoded table
//! and its own lease from a pool of a few connections, then R receivers, each on its own
//! connection, all refitting at once on the rendezvous side (discovery, the reader fence's
//! claim, the members read again, the release). Prints one JSON line per round: discovery p50,
//! p99 and max, and etcd's own counts (every member's `/metrics`, summed) of requests and bytes
//! per refit.
//!
//! ```sh
//! bash scripts/etcd.sh start-cluster /tmp/etcd-load 3     # prints etcd://127.0.0.1:P0,...
//! cargo run --release -p reshard-rendezvous --example load -- etcd://127.0.0.1:P0,... \
//!     --topology pp=8,dp=128,ep=128 --receivers 64 --rounds 3
//! bash scripts/etcd.sh stop /tmp/etcd-load
//! ```
//!
//! Flags: `--topology` (publisher topology, its world the publisher count), `--receivers`,
//! `--rounds` (receivers refit together this many times, on the same connections), `--pool`
//! (the publishers' connections, default 8), `--timeout-s` (each discovery's, default 120).

#[path = "../tests/load/mod.rs"]
mod load;

use std::time::{Duration, Instant};

use load::{connect_receivers, quantile, round, Counters, Publishers};
use reshard_core::{Error, ErrorKind, Result};
use reshard_planner::topology::PublisherTopology;
use reshard_rendezvous::EtcdOptions;

/// The command line.
struct Args {
    url: String,
    topology: PublisherTopology,
    receivers: usize,
    rounds: usize,
    pool: usize,
    timeout: Duration,
}

fn args() -> Result<Args> {
    let mut it = std::env::args().skip(1);
    let bad = |m: String| Error::new(ErrorKind::Config, m);
    let url = it
        .next()
        .ok_or_else(|| bad("usage: load etcd://HOST:PORT,... [--topology T] ...".into()))?;
    let mut a = Args {
        url,
        topology: "pp=8,dp=128,ep=128".parse()?,
        receivers: 64,
        rounds: 3,
        pool: 8,
        timeout: Duration::from_secs(120),
    };
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| bad(format!("flag {flag} needs a value")))?;
        let num = |v: &str| {
            v.parse::<usize>()
                .map_err(|e| bad(format!("{flag} {v}: {e}")))
        };
        match flag.as_str() {
            "--topology" => a.topology = value.parse()?,
            "--receivers" => a.receivers = num(&value)?,
            "--rounds" => a.rounds = num(&value)?,
            "--pool" => a.pool = num(&value)?,
            "--timeout-s" => a.timeout = Duration::from_secs(num(&value)? as u64),
            _ => return Err(bad(format!("unknown flag {flag}"))),
        }
    }
    Ok(a)
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = args()?;
    let options = EtcdOptions::default();
    let pubs = Publishers::announce(
        &a.url,
        "qwen3-30b-a3b",
        &a.topology,
        a.pool,
        options.clone(),
    )
    .await?;
    eprintln!(
        "announced {} ranks ({} offers, {:.1} MB of tables) in {:.2} s through {} connections",
        pubs.world,
        pubs.offers,
        pubs.table_bytes as f64 / 1e6,
        pubs.announce.as_secs_f64(),
        pubs.pool
    );
    let receivers = connect_receivers(&a.url, a.receivers, options.clone()).await?;
    // What the idle publishers cost etcd (their keep-alives), subtracted from each round.
    let idle_from = Counters::scrape(&a.url).await?;
    let idle_start = Instant::now();
    // A whole lease TTL: every publisher's keep-alive renews three times in it.
    tokio::time::sleep(options.lease_ttl).await;
    let idle = Counters::scrape(&a.url).await?.since(&idle_from);
    let idle_s = idle_start.elapsed().as_secs_f64();
    for r in 0..a.rounds {
        let before = Counters::scrape(&a.url).await?;
        let start = Instant::now();
        let (outcomes, listing) = round(
            &receivers,
            &pubs.model,
            a.timeout,
            Some((pubs.connection(), &a.url)),
        )
        .await;
        let listing = listing.expect("listed while every claim was held");
        let wall = start.elapsed().as_secs_f64();
        let c = Counters::scrape(&a.url).await?.since(&before);
        let mut errors: Vec<String> = Vec::new();
        let mut disc: Vec<f64> = Vec::new();
        let mut fence: Vec<f64> = Vec::new();
        let mut fetched = 0u64;
        let mut moved = 0usize;
        let mut waited: Vec<String> = Vec::new();
        for o in &outcomes {
            match o {
                Ok(f) if f.ranks == pubs.world as usize => {
                    disc.push(f.discovery.as_secs_f64());
                    fence.push(f.fence.as_secs_f64());
                    fetched = f.fetched_bytes;
                    moved += usize::from(!f.still_ready);
                    waited.extend(f.waited_through.iter().cloned());
                }
                Ok(f) => errors.push(format!("discovered {} of {} ranks", f.ranks, pubs.world)),
                Err(e) => errors.push(e.to_string()),
            }
        }
        disc.sort_by(f64::total_cmp);
        fence.sort_by(f64::total_cmp);
        let n = a.receivers as f64;
        // The idle publishers' share of this round, by its length.
        let idle_part = wall / idle_s;
        let keepalives = idle
            .stream_msgs
            .get("LeaseKeepAlive")
            .copied()
            .unwrap_or(0.0);
        // Through an election too (one is likely under this load): a few tries.
        let mut claims_left = Err(String::new());
        for _ in 0..5 {
            claims_left =
                reshard_core::rendezvous::Rendezvous::readers(receivers[0].as_ref(), &pubs.model)
                    .await
                    .map(|(c, _)| c.len())
                    .map_err(|e| e.to_string());
            if claims_left.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        errors.sort();
        errors.dedup();
        waited.sort();
        waited.dedup();
        println!(
            "{}",
            serde_json::json!({
                "round": r,
                "publishers": pubs.world,
                "topology": a.topology.to_string(),
                "offers": pubs.offers,
                "table_bytes_per_publisher": pubs.table_bytes / pubs.world as u64,
                "announce_all_s": pubs.announce.as_secs_f64(),
                "receivers": a.receivers,
                "refits_ok": disc.len(),
                "moved_on": moved,
                "errors": errors,
                "waited_through": waited,
                "wall_s": wall,
                "discovery_p50_s": quantile(&disc, 0.5),
                "discovery_p99_s": quantile(&disc, 0.99),
                "discovery_max_s": disc.last(),
                "fence_p50_s": quantile(&fence, 0.5),
                "fence_max_s": fence.last(),
                "fetched_bytes_per_refit": fetched,
                "requests_per_refit": c.unary_total() / n,
                "requests_by_method_per_refit": c.unary.iter()
                    .map(|(k, v)| (k.clone(), v / n)).collect::<std::collections::BTreeMap<_, _>>(),
                "stream_msgs_by_method": c.stream_msgs,
                "etcd_sent_bytes_per_refit": (c.sent_bytes - idle.sent_bytes * idle_part) / n,
                "etcd_received_bytes_per_refit":
                    (c.received_bytes - idle.received_bytes * idle_part) / n,
                "mvcc_ranges_per_refit": c.mvcc_ranges / n,
                "idle_keepalives_per_s": keepalives / idle_s,
                "claims_left_after_release": claims_left,
                "fence_listing_claims": listing.claims.as_ref().map_err(|e| e.to_string()).ok(),
                "fence_listing_error": listing.claims.as_ref().err().map(|e| e.to_string()),
                "fence_listing_s": listing.took.as_secs_f64(),
                "fence_listing_sent_bytes": listing.sent_bytes,
            })
        );
    }
    pubs.withdraw().await?;
    Ok(())
}
