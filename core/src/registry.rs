//! Transport registry (placeholder; filled in by the registry work).
