//! In-process loopback transport of reshard (the embedded default).
