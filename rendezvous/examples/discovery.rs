//! Discovery time and table traffic through etcd (BENCHMARKS.md, "Rendezvous"): N publishers of
//! full-size Qwen3-30B-A3B announce real encoded shard tables (every offer with a whole digest
//! and eight row-chunk digests, as publishers send them); a receiver on a fresh connection
//! discovers them, repeatedly, and the median is reported with the bytes fetched.
//!
//! ```sh
//! bash scripts/etcd.sh start /tmp/etcd-bench      # prints etcd://127.0.0.1:PORT
//! cargo run --release -p reshard-rendezvous --example discovery -- etcd://127.0.0.1:PORT ep=8,dp=8
//! cargo run --release -p reshard-rendezvous --example discovery -- etcd://127.0.0.1:PORT ep=8,dp=64
//! bash scripts/etcd.sh stop /tmp/etcd-bench
//! ```

use std::time::{Duration, Instant};

use bytes::Bytes;
use reshard_core::encoding::encode_table;
use reshard_core::rendezvous::{discover, Announcement, Rendezvous, Want};
use reshard_planner::presets::preset;
use reshard_planner::topology::{geometry_tables, with_digest_placeholders, PublisherTopology};
use reshard_rendezvous::{Etcd, EtcdOptions};

#[tokio::main]
async fn main() -> reshard_core::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let url = args
        .get(1)
        .map(String::as_str)
        .unwrap_or("etcd://127.0.0.1:2379");
    let topo: PublisherTopology = args
        .get(2)
        .map(String::as_str)
        .unwrap_or("ep=8,dp=8")
        .parse()?;
    let runs: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(7);
    let model = preset("qwen3-30b-a3b")?;
    let mut tables = geometry_tables(&model, &topo, 1)?;
    // Realistic size: each offer with its whole digest and row-chunk and column-block digests.
    with_digest_placeholders(&mut tables);
    for t in &mut tables {
        t.publisher.incarnation = 1;
    }
    let world = tables.len() as u32;
    let name = format!("bench-{}-{}", topo_label(&args), std::process::id());
    let publishers = Etcd::connect(url, EtcdOptions::default()).await?;
    let config = Bytes::from(serde_json::to_vec(&model).unwrap_or_default());
    let mut held = Vec::new();
    let mut table_bytes = 0u64;
    let announce_start = Instant::now();
    for t in &tables {
        let table = Bytes::from(encode_table(t));
        table_bytes += table.len() as u64;
        held.push(
            publishers
                .announce(Announcement {
                    model: name.clone(),
                    rank: t.publisher.rank,
                    world,
                    step: 1,
                    transport: "ucx".into(),
                    incarnation: 1,
                    table,
                    metadata: Bytes::from(vec![7u8; 2048]),
                    config: config.clone(),
                })
                .await?,
        );
    }
    let announce_s = announce_start.elapsed().as_secs_f64();
    let mut times = Vec::new();
    for _ in 0..runs {
        // A fresh connection per run: a receiver that just started.
        let receiver = Etcd::connect(url, EtcdOptions::default()).await?;
        let start = Instant::now();
        let found = discover(
            &receiver,
            &Want {
                model: name.clone(),
                after_step: None,
                timeout: Duration::from_secs(60),
            },
        )
        .await?;
        times.push(start.elapsed().as_secs_f64());
        assert_eq!(found.announcements.len(), world as usize);
    }
    times.sort_by(f64::total_cmp);
    let fetched = table_bytes + world as u64 * (2048 + config.len() as u64);
    println!(
        "{}",
        serde_json::json!({
            "publishers": world,
            "offers": tables.iter().map(|t| t.offers.len()).sum::<usize>(),
            "table_bytes_per_publisher": table_bytes / world as u64,
            "fetched_bytes_per_receiver": fetched,
            "announce_all_s": announce_s,
            "discover_median_s": times[times.len() / 2],
            "discover_min_s": times[0],
            "discover_max_s": times[times.len() - 1],
            "runs": runs,
        })
    );
    for h in held {
        h.withdraw().await?;
    }
    Ok(())
}

fn topo_label(args: &[String]) -> String {
    args.get(2)
        .cloned()
        .unwrap_or_default()
        .replace([',', '='], "")
}
