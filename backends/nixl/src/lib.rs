//! NIXL transport of reshard (work in progress).
