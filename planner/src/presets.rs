//! presets (in progress)
