//! What the reader fence costs through etcd (BENCHMARKS.md, "The reader fence through etcd"):
//! a receiver's claim and release around each refit, and a publisher's wait before it
//! rewrites its memory (nobody reading, and a reader releasing its claim while the publisher
//! waits), while `R` other receivers hold claims on other publishers (a fleet's background).
//! Each figure is the median (min–max) of `N` rounds on one connection per side,
//! timed around the calls a refit makes (`claim_reading`, `Reading::release`,
//! `wait_released`).
//!
//! ```sh
//! bash scripts/etcd.sh start /tmp/etcd-bench      # prints etcd://127.0.0.1:PORT
//! cargo run --release -p reshard-rendezvous --example fence -- etcd://127.0.0.1:PORT 64 200
//! bash scripts/etcd.sh stop /tmp/etcd-bench
//! ```

use std::time::{Duration, Instant};

use reshard_core::rendezvous::{wait_released, ReadClaim, Rendezvous};
use reshard_rendezvous::{Etcd, EtcdOptions};

/// Ranks each claim names: an EP8/DP8 receiver's publishers.
const RANKS_PER_CLAIM: u32 = 8;

/// How long a receiver holds its claim while a publisher waits on it.
const HOLD: Duration = Duration::from_millis(20);

#[tokio::main]
async fn main() -> reshard_core::Result<()> {
    // Arguments: etcd URL, background claims, rounds.
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .unwrap_or_else(|| "etcd://127.0.0.1:2379".into());
    let background: u32 = args.next().and_then(|s| s.parse().ok()).unwrap_or(64);
    let rounds: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(200);
    let model = format!("fence-bench-{}", std::process::id());
    let claim = |reader: String, first_rank: u32| ReadClaim {
        model: model.clone(),
        step: 1,
        reader,
        ranks: (first_rank..first_rank + RANKS_PER_CLAIM)
            .map(|r| (r, 1))
            .collect(),
    };

    // The fleet's background: receivers reading other publishers (ranks from 1000 on), whose
    // claims every publisher's wait lists and skips.
    let fleet = Etcd::connect(&url, EtcdOptions::default()).await?;
    let mut held = Vec::new();
    for k in 0..background {
        held.push(
            fleet
                .claim_reading(claim(format!("background receiver {k}"), 1000 + k))
                .await?,
        );
    }

    let receiver = Etcd::connect(&url, EtcdOptions::default()).await?;
    let publisher = Etcd::connect(&url, EtcdOptions::default()).await?;
    // The first claim grants the connection's lease: timed apart, it is once per process.
    let t = Instant::now();
    receiver
        .claim_reading(claim("receiver 0".into(), 0))
        .await?
        .release()
        .await?;
    let first = t.elapsed();

    let (mut claims, mut releases, mut waits) = (Vec::new(), Vec::new(), Vec::new());
    let mut notices = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        let reading = receiver
            .claim_reading(claim("receiver 0".into(), 0))
            .await?;
        claims.push(t.elapsed());
        let t = Instant::now();
        reading.release().await?;
        releases.push(t.elapsed());
        // The publisher's side once the reads are over: nothing holds rank 0, so the wait is
        // the listing of every claim and the check of each.
        let t = Instant::now();
        let released = wait_released(&publisher, &model, 0, 1, Duration::from_secs(10)).await?;
        waits.push(t.elapsed());
        assert!(released.readers.is_empty(), "nobody holds rank 0 here");
        // A publisher that finds the claim held: how long after the release it may rewrite.
        let reading = receiver
            .claim_reading(claim("receiver 0".into(), 0))
            .await?;
        let ((released, ended), released_at) = tokio::join!(
            async {
                let r = wait_released(&publisher, &model, 0, 1, Duration::from_secs(10)).await;
                (r, Instant::now())
            },
            async {
                tokio::time::sleep(HOLD).await;
                // The reads are over: from here to the end of the publisher's wait is what the
                // fence adds before the trainer may overwrite.
                let at = Instant::now();
                reading.release().await.map(|()| at)
            }
        );
        let (released, released_at) = (released?, released_at?);
        notices.push(ended.saturating_duration_since(released_at));
        assert_eq!(released.readers.len(), 1, "the wait saw the held claim");
    }
    for h in held {
        h.release().await?;
    }
    println!(
        "fence through {url}: {background} background claims of {RANKS_PER_CLAIM} ranks, \
         {rounds} rounds; first claim (lease grant) {:.2} ms",
        ms(first)
    );
    for (what, v) in [
        ("receiver: claim before its reads", &mut claims),
        ("receiver: release after its reads", &mut releases),
        (
            "publisher: wait before it rewrites, nobody reading",
            &mut waits,
        ),
        (
            "publisher: from a reader's release to the end of its wait",
            &mut notices,
        ),
    ] {
        v.sort();
        println!(
            "{what}: {:.2} ms median ({:.2}–{:.2})",
            ms(v[v.len() / 2]),
            ms(v[0]),
            ms(v[v.len() - 1])
        );
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
