//! `reshard bench-ranges`: what the number of ranges costs a transport. The same total bytes
//! move as 1k to 1M reads between two endpoints; for each count it times the descriptor build
//! (`prepare`), the first post (prepare + post + wait) and a re-post of the prepared batch, next
//! to a plain memcpy of the same bytes in the same run. This is the curve that explains why the
//! planner fuses ranges.

use clap::Args;
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use reshard_core::{Error, ErrorKind, HostBuffer, MemoryBlock, ReadBatch, ReadDesc, Result};

use crate::bench_cmd::memcpy_gbps;
use crate::Outcome;
use reshard_core::median;

/// Flags of `reshard bench-ranges`.
#[derive(Args)]
pub struct RangesArgs {
    /// Transport scheme (overrides `RESHARD_TRANSPORT__KIND` and `reshard.toml`).
    #[arg(long)]
    transport: Option<String>,
    /// Config file (default: `$RESHARD_CONFIG`, else `./reshard.toml` when present).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Total bytes moved by every batch.
    #[arg(long, default_value_t = 256 << 20)]
    total_bytes: u64,
    /// Range counts to measure.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1000,10000,100000,1000000"
    )]
    counts: Vec<u64>,
    /// Re-posts measured per count (the median is reported).
    #[arg(long, default_value_t = 5)]
    reposts: u32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Runs `reshard bench-ranges`.
pub fn run(args: RangesArgs) -> Result<Outcome> {
    crate::block_on(ranges(args))
}

async fn ranges(args: RangesArgs) -> Result<Outcome> {
    let cfg = crate::load_config(args.transport.as_deref(), args.config.as_deref())?;
    let total = args.total_bytes;
    if total == 0 || args.counts.iter().any(|&c| c == 0 || c > total) {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("every count must be between 1 and --total-bytes ({total})"),
        ));
    }
    let len = usize::try_from(total)
        .map_err(|_| Error::new(ErrorKind::InvalidInput, "--total-bytes is too large"))?;
    let registry = reshard::registry();
    let publisher = registry.create("ranges-publisher", &cfg.transport)?;
    let receiver = registry.create("ranges-receiver", &cfg.transport)?;
    let src_bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8 + 1).collect();
    let src = Arc::new(HostBuffer::from_bytes(&src_bytes));
    let dst = Arc::new(HostBuffer::zeroed(len));
    // Fault the destination in so no measured leg pays first-touch page faults.
    dst.write().fill(0);
    let rs = publisher
        .register(src.clone() as Arc<dyn MemoryBlock>)
        .await?;
    let rd = receiver
        .register(dst.clone() as Arc<dyn MemoryBlock>)
        .await?;
    receiver
        .load_peer(0, publisher.export_metadata().await?)
        .await?;
    let memcpy = memcpy_gbps(total);
    let mut rows = Vec::new();
    for &count in &args.counts {
        // Equal ranges; the last one takes the remainder.
        let each = total / count;
        let reads: Vec<ReadDesc> = (0..count)
            .map(|i| {
                let off = i * each;
                let l = if i + 1 == count { total - off } else { each };
                ReadDesc {
                    owner: 0,
                    remote_region: rs.id(),
                    remote_offset: off,
                    local_region: rd.id(),
                    local_offset: off,
                    len: l,
                    remote_rows: None,
                }
            })
            .collect();
        dst.write().fill(0);
        let t = Instant::now();
        let prepared = receiver.prepare(ReadBatch { reads }).await?;
        let prepare_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        receiver.post(&prepared).await?.wait().await?;
        let first_wire_s = t.elapsed().as_secs_f64();
        if dst.read()[..] != src_bytes[..] {
            return Err(Error::new(
                ErrorKind::Verification,
                format!("{count} ranges: destination differs from the source"),
            ));
        }
        let mut reposts = Vec::new();
        for _ in 0..args.reposts {
            let t = Instant::now();
            receiver.post(&prepared).await?.wait().await?;
            reposts.push(t.elapsed().as_secs_f64());
        }
        let repost_s = median(reposts);
        rows.push(json!({
            "ranges": count,
            "bytes_per_range": each,
            "prepare_s": prepare_s,
            "first_post_s": prepare_s + first_wire_s,
            "repost_s": repost_s,
            "repost_us_per_range": repost_s / count as f64 * 1e6,
            "repost_gbytes_per_s": total as f64 / repost_s / 1e9,
            "repost_fraction_of_memcpy": total as f64 / repost_s / 1e9 / memcpy,
        }));
    }
    drop((rs, rd));
    if args.json {
        let v = json!({
            "transport": cfg.transport.kind,
            "total_bytes": total,
            "memcpy_gbytes_per_s": memcpy,
            "rows": rows,
        });
        outln!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(Outcome(true));
    }
    outln!(
        "bench-ranges over {}: {total} bytes per batch, both endpoints in this process; memcpy {memcpy:.2} GB/s (same run)",
        cfg.transport.kind
    );
    outln!(
        "{:>9} {:>10} {:>12} {:>14} {:>12} {:>12} {:>10} {:>9}",
        "ranges",
        "B/range",
        "prepare ms",
        "first post ms",
        "repost ms",
        "us/range",
        "GB/s",
        "/memcpy"
    );
    for r in &rows {
        let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
        outln!(
            "{:>9} {:>10} {:>12.2} {:>14.2} {:>12.2} {:>12.3} {:>10.2} {:>8.2}x",
            r["ranges"].as_u64().unwrap_or(0),
            r["bytes_per_range"].as_u64().unwrap_or(0),
            f("prepare_s") * 1e3,
            f("first_post_s") * 1e3,
            f("repost_s") * 1e3,
            f("repost_us_per_range"),
            f("repost_gbytes_per_s"),
            f("repost_fraction_of_memcpy"),
        );
    }
    Ok(Outcome(true))
}
