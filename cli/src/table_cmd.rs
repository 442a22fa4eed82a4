//! `reshard table`: show one publisher's shard table as JSON for people, write its binary
//! encoding, or decode a binary table someone sent (untrusted input, typed errors).

use clap::Args;
use std::path::PathBuf;

use reshard_core::encoding::{decode_table, encode_table, table_to_json};
use reshard_core::{Error, ErrorKind, Result};
use reshard_planner::topology::geometry_tables;

use crate::{ModelArgs, Outcome};

/// Flags of `reshard table`.
#[derive(Args)]
pub struct TableArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Publisher rank whose (geometry-only) table to show.
    #[arg(long, default_value_t = 0)]
    rank: u32,
    /// Write the compact binary encoding to this file instead of printing JSON.
    #[arg(long, conflicts_with = "decode")]
    binary: Option<PathBuf>,
    /// Decode this binary table file and print it as JSON.
    #[arg(long)]
    decode: Option<PathBuf>,
}

/// Runs `reshard table`.
pub fn run(args: TableArgs) -> Result<Outcome> {
    if let Some(path) = &args.decode {
        let bytes = std::fs::read(path).map_err(|e| {
            Error::new(
                ErrorKind::InvalidInput,
                format!("cannot read {}", path.display()),
            )
            .with_source(e)
        })?;
        outln!("{}", table_to_json(&decode_table(&bytes)?));
        return Ok(Outcome(true));
    }
    let (model, pubs, _) = args.model.resolve()?;
    let tables = geometry_tables(&model, &pubs, 0)?;
    let table = tables
        .into_iter()
        .find(|t| t.publisher.rank == args.rank)
        .ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidInput,
                format!("publisher rank {} does not exist in {pubs}", args.rank),
            )
        })?;
    match &args.binary {
        Some(path) => {
            let bytes = encode_table(&table);
            std::fs::write(path, &bytes).map_err(|e| {
                Error::new(
                    ErrorKind::InvalidInput,
                    format!("cannot write {}", path.display()),
                )
                .with_source(e)
            })?;
            eprintln!(
                "wrote {} bytes ({} tensors, {} offers) to {}",
                bytes.len(),
                table.tensors.len(),
                table.offers.len(),
                path.display()
            );
        }
        None => outln!("{}", table_to_json(&table)),
    }
    Ok(Outcome(true))
}
