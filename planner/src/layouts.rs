//! layouts (in progress)
