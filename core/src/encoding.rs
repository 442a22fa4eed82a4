//! Shard-table wire encoding (placeholder; filled in by the encoding work).
