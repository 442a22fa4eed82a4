//! The conformance suite every reshard transport backend must pass.
