//! UCX transport of reshard (work in progress).
