//! topology (in progress)
