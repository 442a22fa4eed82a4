//! `reshard checkpoint` as users run it: an HF-style checkpoint that reshard-checkpoint (and any
//! safetensors reader) opens, with the preset's architecture and the step asked for.

use std::process::Command;

use reshard_checkpoint::Checkpoint;
use reshard_planner::presets::preset;

#[test]
fn checkpoint_writes_a_complete_checkpoint_of_the_scaled_preset() {
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-checkpoint");
    let _ = std::fs::remove_dir_all(&out);
    let run = Command::new(env!("CARGO_BIN_EXE_reshard"))
        .args([
            "checkpoint",
            "--preset",
            "qwen3-30b-a3b",
            "--layers",
            "1",
            "--experts",
            "4",
            "--vocab",
            "512",
            "--step",
            "7",
            "--max-shard-mib",
            "8",
            "--json",
            "--out",
        ])
        .arg(&out)
        .output()
        .expect("run reshard");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&run.stdout).expect("JSON");
    for key in ["dir", "model", "step", "shards", "tensors", "total_size"] {
        assert!(v.get(key).is_some(), "missing {key}: {v}");
    }
    assert_eq!(v["step"], 7);
    assert!(
        v["shards"].as_array().unwrap().len() > 1,
        "several shard files"
    );
    let ckpt = Checkpoint::open(&out).expect("opens");
    assert_eq!(ckpt.step(), 7);
    let want = preset("qwen3-30b-a3b")
        .unwrap()
        .with_overrides(Some(1), Some(4), Some(512))
        .unwrap();
    assert_eq!(
        ckpt.model().tensors(),
        want.tensors(),
        "the preset's tensors"
    );
    assert_eq!(v["tensors"], want.tensors().len());
    assert!(reshard_checkpoint::is_complete(&out));
    let _ = std::fs::remove_dir_all(&out);
}
