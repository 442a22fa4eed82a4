//! A model configuration from outside, both ways it arrives: a checkpoint's `config.json`
//! (`from_hf_config`) and a publisher's announcement (the planner's `ModelConfig` as JSON, which
//! a receiver validates before it sizes anything from it). Either a typed `Config`/`Decode`
//! error or a model within reshard's bounds, never a panic or an abort: an accepted model's
//! tensors are built (bounded allocations: the smoke run's malloc limit catches a count that
//! slipped through), agree with its formulas, and round-trip through `config.json`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use reshard_checkpoint::config::{from_hf_config, to_hf_config};
use reshard_core::TensorSpec;
use reshard_planner::layouts::receiver_layout;
use reshard_planner::presets::{ModelConfig, MAX_TENSORS};
use reshard_planner::topology::ReceiverTopology;

/// Everything a publisher and a receiver build from an accepted model, checked against the
/// model's own formulas.
fn build(model: &ModelConfig) {
    assert!(
        model.out_of_bounds().is_none(),
        "accepted out of bounds: {model:?}"
    );
    let tensors = model.tensors();
    assert_eq!(tensors.len(), model.tensor_count());
    assert!(tensors.len() as u64 <= MAX_TENSORS);
    assert_eq!(
        tensors.iter().map(TensorSpec::bytes).sum::<u64>(),
        model.total_bytes()
    );
    // The receiver's path (tensor index and one rank's layout): a layout or a typed error.
    let tp1: ReceiverTopology = "tp=1".parse().expect("topology");
    let _ = receiver_layout(model, &tp1, 0);
}

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    if let Ok(model) = from_hf_config(&value, "config.json") {
        build(&model);
        let again = from_hf_config(&to_hf_config(&model), "again").expect("round trip");
        assert_eq!(again, model);
    }
    if let Ok(model) = serde_json::from_value::<ModelConfig>(value) {
        if model.validate().is_ok() {
            build(&model);
        }
    }
});
