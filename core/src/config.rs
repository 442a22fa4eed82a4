//! Configuration (placeholder; filled in by the config work).
