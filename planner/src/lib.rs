//! Pure, synchronous fused range planner and model presets of reshard.
