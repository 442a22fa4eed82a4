//! Benchmarks and the report command of reshard.
