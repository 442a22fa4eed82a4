//! Receiver runtime and synthetic publishers of reshard.
