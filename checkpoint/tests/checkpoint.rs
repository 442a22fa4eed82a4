//! Real checkpoints in a temp dir: written, reopened, compared against the files themselves.

use std::fs;
use std::path::{Path, PathBuf};

use reshard_checkpoint::{
    candidates, incomplete_reason, is_complete, newest_complete, write_checkpoint, Checkpoint,
    FolderState, WriteOptions, INDEX_FILE,
};
use reshard_core::{ErrorKind, TensorBox};
use reshard_planner::presets::{preset, ModelConfig, MoeConfig};
use safetensors::SafeTensors;
use serde_json::Value;

/// Qwen3-30B-A3B at its real widths, one layer, two experts, a 512-row vocabulary (~60 MB).
fn qwen_scaled() -> ModelConfig {
    preset("qwen3-30b-a3b")
        .unwrap()
        .with_overrides(Some(1), Some(2), Some(512))
        .unwrap()
}

/// The Qwen3 MoE architecture at toy widths, for tests that write many checkpoints.
fn qwen_tiny() -> ModelConfig {
    let mut m = preset("qwen3-30b-a3b").unwrap();
    m.layers = 2;
    m.hidden = 64;
    m.heads = 4;
    m.kv_heads = 2;
    m.head_dim = 16;
    m.moe = Some(MoeConfig {
        experts: 4,
        expert_intermediate: 32,
    });
    m.vocab = 128;
    m
}

/// Llama-3-8B's architecture (dense, no q/k norm) at toy widths: its real widths make even one
/// layer ~430 MB, too much for a unit test.
fn llama_tiny() -> ModelConfig {
    let mut m = preset("llama-3-8b").unwrap();
    m.layers = 2;
    m.hidden = 64;
    m.heads = 4;
    m.kv_heads = 2;
    m.head_dim = 16;
    m.intermediate = 96;
    m.vocab = 100;
    m
}

fn small_shards() -> WriteOptions {
    WriteOptions {
        max_shard_bytes: 16 << 10,
    }
}

/// A safetensors file parsed by hand (not with the crate): header length, header JSON, bytes.
struct RawFile {
    header: serde_json::Map<String, Value>,
    data_start: usize,
    bytes: Vec<u8>,
}

fn raw(path: &Path) -> RawFile {
    let bytes = fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    RawFile {
        header: header.as_object().unwrap().clone(),
        data_start: 8 + n,
        bytes,
    }
}

impl RawFile {
    fn tensor(&self, name: &str) -> &[u8] {
        let off = &self.header[name]["data_offsets"];
        let (b, e) = (off[0].as_u64().unwrap(), off[1].as_u64().unwrap());
        &self.bytes[self.data_start + b as usize..self.data_start + e as usize]
    }

    /// Writes the (edited) header back with the original data bytes.
    fn write(&self, path: &Path) {
        let h = serde_json::to_vec(&Value::Object(self.header.clone())).unwrap();
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&h);
        out.extend_from_slice(&self.bytes[self.data_start..]);
        fs::write(path, out).unwrap();
    }
}

fn index(dir: &Path) -> Value {
    serde_json::from_slice(&fs::read(dir.join(INDEX_FILE)).unwrap()).unwrap()
}

fn file_of(dir: &Path, tensor: &str) -> PathBuf {
    dir.join(index(dir)["weight_map"][tensor].as_str().unwrap())
}

fn whole_tensors_equal_the_crate_view(model: &ModelConfig, opts: &WriteOptions) {
    let tmp = tempfile::tempdir().unwrap();
    let w = write_checkpoint(model, 7, tmp.path(), opts).unwrap();
    assert!(w.shards.len() > 2, "several shard files: {:?}", w.shards);
    let ck = Checkpoint::open(tmp.path()).unwrap();
    assert_eq!(ck.model(), model);
    assert_eq!(ck.step(), 7);
    assert_eq!(ck.tensors(), model.tensors().as_slice());
    for name in &w.shards {
        let bytes = fs::read(tmp.path().join(name)).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (t, view) in st.tensors() {
            let spec = ck.spec(&t).unwrap().clone();
            assert_eq!(ck.file_of(&t).unwrap(), name);
            let mut dst = vec![0u8; spec.bytes() as usize];
            ck.copy_box(&t, &spec.full_box(), &mut dst).unwrap();
            assert!(dst == view.data(), "{t} differs from the file");
            assert!(ck.tensor_bytes(&t).unwrap() == view.data());
        }
    }
}

#[test]
fn scaled_qwen3_moe_round_trips_through_files() {
    whole_tensors_equal_the_crate_view(
        &qwen_scaled(),
        &WriteOptions {
            max_shard_bytes: 16 << 20,
        },
    );
}

#[test]
fn scaled_llama_round_trips_through_files() {
    whole_tensors_equal_the_crate_view(&llama_tiny(), &small_shards());
}

#[test]
fn files_follow_the_hf_format_parsed_by_hand() {
    let tmp = tempfile::tempdir().unwrap();
    let model = qwen_tiny();
    let w = write_checkpoint(&model, 3, tmp.path(), &small_shards()).unwrap();
    let idx = index(tmp.path());
    assert_eq!(idx["metadata"]["reshard_step"], 3);
    let total: u64 = model.tensors().iter().map(|s| s.bytes()).sum();
    assert_eq!(idx["metadata"]["total_size"].as_u64(), Some(total));
    let wm = idx["weight_map"].as_object().unwrap();
    assert_eq!(wm.len(), model.tensors().len());
    let n = w.shards.len();
    for (i, name) in w.shards.iter().enumerate() {
        assert_eq!(name, &format!("model-{:05}-of-{n:05}.safetensors", i + 1));
        let f = raw(&tmp.path().join(name));
        assert_eq!(f.header["__metadata__"]["reshard_step"], "3");
        let mut end = 0;
        for (t, info) in &f.header {
            if t == "__metadata__" {
                continue;
            }
            assert_eq!(wm[t], name.as_str());
            assert_eq!(info["dtype"], "BF16");
            let spec = model.tensors().into_iter().find(|s| &s.name == t).unwrap();
            let shape: Vec<u64> = info["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect();
            assert_eq!(shape, spec.shape);
            end = end.max(info["data_offsets"][1].as_u64().unwrap());
        }
        assert_eq!(f.bytes.len() as u64, f.data_start as u64 + end);
    }
    let cfg: Value =
        serde_json::from_slice(&fs::read(tmp.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "qwen3_moe");
    assert_eq!(cfg["architectures"][0], "Qwen3MoeForCausalLM");
    assert_eq!(cfg["num_experts"], 4);
    assert_eq!(cfg["torch_dtype"], "bfloat16");
    let llama = tempfile::tempdir().unwrap();
    write_checkpoint(&llama_tiny(), 0, llama.path(), &small_shards()).unwrap();
    let cfg: Value =
        serde_json::from_slice(&fs::read(llama.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "llama");
    assert!(cfg.get("num_experts").is_none());
}

#[test]
fn column_row_and_inner_boxes_equal_hand_slices_of_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let model = qwen_tiny();
    write_checkpoint(&model, 1, tmp.path(), &small_shards()).unwrap();
    let ck = Checkpoint::open(tmp.path()).unwrap();
    // k_proj is [kv_rows 32, hidden 64], bf16: a row is 128 bytes.
    let t = "model.layers.1.self_attn.k_proj.weight";
    assert_eq!(ck.spec(t).unwrap().shape, vec![32, 64]);
    let f = raw(&file_of(tmp.path(), t));
    let all = f.tensor(t);
    let (cols, es) = (64usize, 2usize);
    let hand = |r0: usize, rows: usize, c0: usize, ncols: usize| -> Vec<u8> {
        let mut v = Vec::new();
        for r in r0..r0 + rows {
            v.extend_from_slice(&all[(r * cols + c0) * es..(r * cols + c0 + ncols) * es]);
        }
        v
    };
    for (off, ext) in [
        ([0u64, 16u64], [32u64, 16u64]), // column box: TP split of dim 1
        ([8, 0], [8, 64]),               // row box: TP split of dim 0
        ([5, 3], [7, 11]),               // neither
        ([31, 63], [1, 1]),              // last element
    ] {
        let b = TensorBox::new(off.to_vec(), ext.to_vec());
        let mut dst = vec![0u8; (ext[0] * ext[1]) as usize * es];
        ck.copy_box(t, &b, &mut dst).unwrap();
        let want = hand(
            off[0] as usize,
            ext[0] as usize,
            off[1] as usize,
            ext[1] as usize,
        );
        assert!(dst == want, "box {b} of {t}");
    }
}

#[test]
fn content_is_deterministic_and_changes_with_the_step() {
    let (a, b, c) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let model = qwen_tiny();
    let w = write_checkpoint(&model, 1, a.path(), &small_shards()).unwrap();
    write_checkpoint(&model, 2, b.path(), &small_shards()).unwrap();
    write_checkpoint(&model, 1, c.path(), &small_shards()).unwrap();
    for name in &w.shards {
        assert_eq!(
            fs::read(a.path().join(name)).unwrap(),
            fs::read(c.path().join(name)).unwrap(),
            "same step, same file bytes"
        );
    }
    let kc = Checkpoint::open(c.path()).unwrap();
    let (ka, kb) = (
        Checkpoint::open(a.path()).unwrap(),
        Checkpoint::open(b.path()).unwrap(),
    );
    assert_eq!((ka.step(), kb.step()), (1, 2));
    for s in model.tensors() {
        let (x, y) = (
            ka.tensor_bytes(&s.name).unwrap(),
            kb.tensor_bytes(&s.name).unwrap(),
        );
        assert_ne!(x, y, "{} must change with the step", s.name);
        assert_eq!(
            x,
            kc.tensor_bytes(&s.name).unwrap(),
            "same step, same bytes"
        );
    }
}

fn open_err(dir: &Path) -> reshard_core::Error {
    Checkpoint::open(dir).expect_err("must not open")
}

#[test]
fn a_renamed_tensor_fits_no_rule_naming_it_and_its_file() {
    let tmp = tempfile::tempdir().unwrap();
    write_checkpoint(&qwen_tiny(), 1, tmp.path(), &small_shards()).unwrap();
    let t = "model.layers.0.mlp.experts.2.up_proj.weight";
    let path = file_of(tmp.path(), t);
    let mut f = raw(&path);
    let info = f.header.remove(t).unwrap();
    let renamed = "model.layers.0.mlp.experts.2.upp_proj.weight";
    f.header.insert(renamed.into(), info);
    f.write(&path);
    let e = open_err(tmp.path());
    assert_eq!(e.kind(), ErrorKind::Config);
    // The name no rule of the family has is what is wrong (issue 31).
    let t = renamed;
    assert_eq!(e.context().tensor.as_deref(), Some(t));
    assert!(e.message().contains("fits no rule"), "{e}");
    let file = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        e.message().contains(t) && e.message().contains(&file),
        "{e}"
    );
}

#[test]
fn a_tensor_the_architecture_lacks_is_unexpected() {
    let tmp = tempfile::tempdir().unwrap();
    write_checkpoint(&llama_tiny(), 1, tmp.path(), &small_shards()).unwrap();
    // One layer fewer in config.json: every layer-1 tensor is now unexpected.
    let cfg = tmp.path().join("config.json");
    let mut v: Value = serde_json::from_slice(&fs::read(&cfg).unwrap()).unwrap();
    v["num_hidden_layers"] = 1.into();
    fs::write(&cfg, serde_json::to_vec(&v).unwrap()).unwrap();
    let e = open_err(tmp.path());
    assert_eq!(e.kind(), ErrorKind::Config);
    let t = e.context().tensor.clone().unwrap();
    assert!(t.starts_with("model.layers.1."), "{e}");
    assert!(e.message().contains("unexpected") && e.message().contains(".safetensors"));
}

#[test]
fn a_wrong_shape_names_tensor_and_file() {
    let tmp = tempfile::tempdir().unwrap();
    write_checkpoint(&qwen_tiny(), 1, tmp.path(), &small_shards()).unwrap();
    let t = "model.layers.1.self_attn.k_proj.weight";
    let path = file_of(tmp.path(), t);
    let mut f = raw(&path);
    // Same byte count, transposed: only the shape check can catch it.
    f.header.get_mut(t).unwrap()["shape"] = serde_json::json!([64, 32]);
    f.write(&path);
    let e = open_err(tmp.path());
    assert_eq!(e.kind(), ErrorKind::Config);
    assert_eq!(e.context().tensor.as_deref(), Some(t));
    let file = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        e.message().contains("shape") && e.message().contains(&file),
        "{e}"
    );
}

#[test]
fn a_truncated_shard_names_the_tensor_past_the_end() {
    let tmp = tempfile::tempdir().unwrap();
    let w = write_checkpoint(&qwen_tiny(), 1, tmp.path(), &small_shards()).unwrap();
    let name = &w.shards[1];
    let path = tmp.path().join(name);
    let f = raw(&path);
    let last = f
        .header
        .iter()
        .filter(|(t, _)| *t != "__metadata__")
        .max_by_key(|(_, i)| i["data_offsets"][1].as_u64().unwrap())
        .map(|(t, _)| t.clone())
        .unwrap();
    fs::write(&path, &f.bytes[..f.bytes.len() - 10]).unwrap();
    let e = open_err(tmp.path());
    assert_eq!(e.kind(), ErrorKind::Config);
    assert_eq!(e.context().tensor.as_deref(), Some(last.as_str()));
    assert!(e.message().contains(name.as_str()), "{e}");
    assert!(!is_complete(tmp.path()));
    assert!(incomplete_reason(tmp.path())
        .unwrap()
        .contains(name.as_str()));
}

#[test]
fn a_folder_without_index_is_incomplete() {
    let tmp = tempfile::tempdir().unwrap();
    write_checkpoint(&llama_tiny(), 1, tmp.path(), &small_shards()).unwrap();
    assert!(is_complete(tmp.path()));
    fs::remove_file(tmp.path().join(INDEX_FILE)).unwrap();
    let e = open_err(tmp.path());
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.message().contains(INDEX_FILE), "{e}");
    assert!(!is_complete(tmp.path()));
}

#[test]
fn bad_copy_box_arguments_are_invalid_input_naming_tensor_and_box() {
    let tmp = tempfile::tempdir().unwrap();
    write_checkpoint(&llama_tiny(), 1, tmp.path(), &small_shards()).unwrap();
    let ck = Checkpoint::open(tmp.path()).unwrap();
    let t = "model.norm.weight";
    let b = TensorBox::new(vec![60], vec![8]);
    let e = ck.copy_box(t, &b, &mut [0u8; 16]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert_eq!(e.context().tensor.as_deref(), Some(t));
    assert!(e.message().contains("60..68"), "{e}");
    let b = TensorBox::new(vec![0], vec![8]);
    let e = ck.copy_box(t, &b, &mut [0u8; 15]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert!(
        e.message().contains(t) && e.message().contains("0..8"),
        "{e}"
    );
    let e = ck.copy_box("nope", &b, &mut [0u8; 16]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
}

#[test]
fn newest_complete_picks_the_largest_complete_step() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    assert_eq!(newest_complete(r).unwrap(), None);
    let m = llama_tiny();
    let o = small_shards();
    let mut written = Vec::new();
    for s in [1, 3, 4, 5] {
        written.push(write_checkpoint(&m, s, &r.join(format!("step-{s}")), &o).unwrap());
    }
    fs::create_dir(r.join("step-9")).unwrap(); // being written: no index yet
    fs::remove_file(r.join("step-5").join(INDEX_FILE)).unwrap();
    let step4 = r.join("step-4").join(&written[2].shards[0]);
    let len = fs::metadata(&step4).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&step4)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    fs::create_dir(r.join("notes")).unwrap();
    assert_eq!(newest_complete(r).unwrap(), Some((3, r.join("step-3"))));
    // A checkpoint folder itself is its own answer, with the step of its index.
    let d = r.join("step-1");
    assert_eq!(newest_complete(&d).unwrap(), Some((1, d.clone())));
    assert_eq!(newest_complete(&r.join("step-5")).unwrap(), None);
}

#[test]
fn a_wrong_dtype_names_tensor_and_file() {
    let tmp = tempfile::tempdir().unwrap();
    write_checkpoint(&llama_tiny(), 1, tmp.path(), &small_shards()).unwrap();
    let t = "model.layers.0.mlp.down_proj.weight";
    let path = file_of(tmp.path(), t);
    let mut f = raw(&path);
    // Same element size: only the dtype check can catch it.
    f.header.get_mut(t).unwrap()["dtype"] = "F16".into();
    f.write(&path);
    let e = open_err(tmp.path());
    assert_eq!(e.kind(), ErrorKind::Config);
    assert_eq!(e.context().tensor.as_deref(), Some(t));
    let file = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        e.message().contains("dtype") && e.message().contains(&file),
        "{e}"
    );
}

#[test]
fn without_a_recorded_step_the_step_folder_name_is_used() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("step-42");
    write_checkpoint(&llama_tiny(), 42, &dir, &small_shards()).unwrap();
    // As a checkpoint from elsewhere: no reshard_step in the index or the shard headers.
    let mut idx = index(&dir);
    idx["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("reshard_step");
    fs::write(dir.join(INDEX_FILE), serde_json::to_vec(&idx).unwrap()).unwrap();
    for f in fs::read_dir(&dir).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            let mut r = raw(&p);
            r.header.remove("__metadata__");
            r.write(&p);
        }
    }
    assert_eq!(Checkpoint::open(&dir).unwrap().step(), 42);
    assert_eq!(newest_complete(root.path()).unwrap(), Some((42, dir)));
}

/// The shard file holding `tensor`, the tensor's byte range in it, and the checkpoint opened.
fn opened_with_tensor(dir: &Path, tensor: &str) -> (Checkpoint, PathBuf, std::ops::Range<u64>) {
    let ck = Checkpoint::open(dir).unwrap();
    let path = file_of(dir, tensor);
    let f = raw(&path);
    let off = &f.header[tensor]["data_offsets"];
    let start = f.data_start as u64 + off[0].as_u64().unwrap();
    let end = f.data_start as u64 + off[1].as_u64().unwrap();
    (ck, path, start..end)
}

#[test]
fn a_shard_truncated_under_an_open_checkpoint_is_an_error_naming_file_and_range() {
    let tmp = tempfile::tempdir().unwrap();
    write_checkpoint(&qwen_tiny(), 1, tmp.path(), &small_shards()).unwrap();
    let t = "model.layers.1.self_attn.o_proj.weight";
    let (ck, path, range) = opened_with_tensor(tmp.path(), t);
    let spec = ck.spec(t).unwrap().clone();
    // Cut the file in the middle of the tensor, after open validated it: a shared mapping
    // would raise SIGBUS on the first page past the new end (this test process would die).
    let cut = (range.start + range.end) / 2;
    fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(cut)
        .unwrap();
    let file = path.file_name().unwrap().to_string_lossy().into_owned();
    // A column box (one read per row) and the whole tensor (one read).
    let cols = TensorBox::new(vec![0, 16], vec![64, 16]);
    for b in [cols, spec.full_box()] {
        let mut dst = vec![0u8; (b.elements() * 2) as usize];
        let e = ck.copy_box(t, &b, &mut dst).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert_eq!(e.context().tensor.as_deref(), Some(t));
        assert!(e.message().contains(&file), "{e}");
        // The read itself came back short (not only the size check after it).
        assert!(e.message().contains("the file ends at byte"), "{e}");
        let r = e.context().range.clone().expect("a byte range");
        assert!(
            r.start < r.end && r.end > cut && r.start >= range.start,
            "{r:?} {e}"
        );
        assert!(r.end <= range.end, "{r:?} {e}");
    }
    let e = ck.tensor_bytes(t).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert_eq!(e.context().range.clone(), Some(range.clone()));
    // A tensor before the cut still reads, but the file is reported changed all the same: its
    // bytes belong to a checkpoint that is no longer what was opened.
    let early = ck
        .tensors()
        .iter()
        .find(|s| file_of(tmp.path(), &s.name) == path)
        .unwrap()
        .clone();
    let e = ck.tensor_bytes(&early.name).unwrap_err();
    assert!(e.message().contains("is now"), "{e}");
}

#[test]
fn a_shard_rewritten_in_place_with_the_same_size_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    write_checkpoint(&llama_tiny(), 1, tmp.path(), &small_shards()).unwrap();
    let t = "model.layers.0.mlp.up_proj.weight";
    let (ck, path, range) = opened_with_tensor(tmp.path(), t);
    let mut dst = vec![0u8; (range.end - range.start) as usize];
    let spec = ck.spec(t).unwrap().clone();
    ck.copy_box(t, &spec.full_box(), &mut dst).unwrap();
    // Another step's bytes written over the same file, same size: nothing is short. (The
    // pause puts the rewrite in a later tick of the file system's coarse clock, as any real
    // rewrite after the checkpoint was opened is; it is not a timing assertion.)
    std::thread::sleep(std::time::Duration::from_millis(20));
    let mut bytes = fs::read(&path).unwrap();
    for b in &mut bytes[range.start as usize..range.end as usize] {
        *b ^= 0x5a;
    }
    fs::write(&path, &bytes).unwrap();
    let e = ck.copy_box(t, &spec.full_box(), &mut dst).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert_eq!(e.context().tensor.as_deref(), Some(t));
    assert_eq!(e.context().range.clone(), Some(range.clone()));
    assert!(e.message().contains("modified"), "{e}");
    // A folder rewritten by rename (the writer's way) leaves the open files intact: the open
    // checkpoint still reads the bytes it opened.
    let ck = Checkpoint::open(tmp.path()).unwrap();
    write_checkpoint(&llama_tiny(), 2, tmp.path(), &small_shards()).unwrap();
    ck.copy_box(t, &spec.full_box(), &mut dst).unwrap();
    assert!(dst == bytes[range.start as usize..range.end as usize]);
    assert!(
        fs::read(&path).unwrap() != bytes,
        "step 2 replaced the file"
    );
}

/// Rewrites `path`'s header through `edit` (tensor name -> info), keeping the data bytes.
fn edit_header(path: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let mut f = raw(path);
    edit(&mut f.header);
    f.write(path);
}

#[test]
fn headers_are_checked_against_the_file_before_anything_is_allocated() {
    let tmp = tempfile::tempdir().unwrap();
    let w = write_checkpoint(&llama_tiny(), 1, tmp.path(), &small_shards()).unwrap();
    // A shard file of several tensors.
    let name = w
        .shards
        .iter()
        .max_by_key(|n| raw(&tmp.path().join(n)).header.len())
        .unwrap()
        .clone();
    let path = tmp.path().join(&name);
    let good = fs::read(&path).unwrap();
    // A header length past the end of the file (but under the format's 100 MB limit), then
    // one past any limit: refused from the 8 length bytes, never allocated.
    for n in [50_000_000u64, u64::MAX] {
        let mut bytes = good.clone();
        bytes[..8].copy_from_slice(&n.to_le_bytes());
        fs::write(&path, &bytes).unwrap();
        let e = open_err(tmp.path());
        assert_eq!(e.kind(), ErrorKind::Config);
        assert_eq!(e.context().range.clone(), Some(0..8), "{e}");
        assert!(
            e.message().contains(&name) && e.message().contains("header length"),
            "{e}"
        );
        assert!(!is_complete(tmp.path()));
    }
    fs::write(&path, &good).unwrap();
    let f = raw(&path);
    let mut names: Vec<(u64, String)> = f
        .header
        .iter()
        .filter(|(t, _)| *t != "__metadata__")
        .map(|(t, i)| (i["data_offsets"][0].as_u64().unwrap(), t.clone()))
        .collect();
    names.sort();
    let (a, b) = (names[0].1.clone(), names[1].1.clone());
    // The second tensor moved over the first one's bytes (its own size kept): the tensors no
    // longer follow each other.
    edit_header(&path, |h| {
        let off = &h[&b]["data_offsets"];
        let len = off[1].as_u64().unwrap() - off[0].as_u64().unwrap();
        h.get_mut(&b).unwrap()["data_offsets"] = serde_json::json!([0, len]);
    });
    let e = open_err(tmp.path());
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.message().contains("contiguous"), "{e}");
    fs::write(&path, &good).unwrap();
    // A shape whose element count overflows u64: named, not multiplied out.
    edit_header(&path, |h| {
        h.get_mut(&a).unwrap()["shape"] = serde_json::json!([1u64 << 40, 1u64 << 40]);
    });
    let e = open_err(tmp.path());
    assert_eq!(e.context().tensor.as_deref(), Some(a.as_str()));
    assert!(e.message().contains("more than u64 bytes"), "{e}");
    fs::write(&path, &good).unwrap();
    // Bytes after the last tensor's data.
    let mut longer = good.clone();
    longer.extend_from_slice(&[0u8; 64]);
    fs::write(&path, &longer).unwrap();
    let e = open_err(tmp.path());
    assert_eq!(e.kind(), ErrorKind::Config);
    let end = good.len() as u64;
    assert_eq!(e.context().range.clone(), Some(end..end + 64), "{e}");
    fs::write(&path, &good).unwrap();
    Checkpoint::open(tmp.path()).unwrap();
}

#[test]
fn an_absurd_layer_count_in_config_json_is_refused_before_anything_is_built() {
    let tmp = tempfile::tempdir().unwrap();
    write_checkpoint(&llama_tiny(), 1, tmp.path(), &small_shards()).unwrap();
    let cfg = tmp.path().join("config.json");
    let mut v: Value = serde_json::from_slice(&fs::read(&cfg).unwrap()).unwrap();
    v["num_hidden_layers"] = 1_000_000_000_000u64.into();
    v["hidden_size"] = 8.into();
    v["num_attention_heads"] = 1.into();
    v["num_key_value_heads"] = 1.into();
    v["head_dim"] = 8.into();
    v["vocab_size"] = 64.into();
    fs::write(&cfg, serde_json::to_vec(&v).unwrap()).unwrap();
    let e = open_err(tmp.path());
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.message().contains("\"num_hidden_layers\""), "{e}");
}

#[test]
fn candidates_list_every_step_folder_and_a_folder_state_sees_any_change() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    for s in [2, 10] {
        write_checkpoint(
            &llama_tiny(),
            s,
            &r.join(format!("step-{s}")),
            &small_shards(),
        )
        .unwrap();
    }
    fs::create_dir(r.join("step-11")).unwrap(); // being written: listed, not complete
    fs::create_dir(r.join("other")).unwrap();
    let steps: Vec<u64> = candidates(r).unwrap().into_iter().map(|c| c.0).collect();
    assert_eq!(steps, vec![11, 10, 2]);
    assert_eq!(newest_complete(r).unwrap().unwrap().0, 10);
    let d = r.join("step-10");
    assert_eq!(candidates(&d).unwrap(), vec![(10, d.clone())]);
    let before = FolderState::read(&d);
    assert_eq!(FolderState::read(&d), before, "nothing changed");
    // The pause puts each change in a later tick of the file system's coarse clock.
    let pause = || std::thread::sleep(std::time::Duration::from_millis(20));
    pause();
    let shard = d.join(candidates_shard(&d));
    let mut bytes = fs::read(&shard).unwrap();
    bytes[100] ^= 1;
    fs::write(&shard, &bytes).unwrap();
    let rewritten = FolderState::read(&d);
    assert_ne!(rewritten, before, "a file rewritten in place, same size");
    pause();
    fs::write(d.join("notes.txt"), b"x").unwrap();
    assert_ne!(FolderState::read(&d), rewritten, "a file added");
}

/// Some shard file of checkpoint `dir`.
fn candidates_shard(dir: &Path) -> String {
    index(dir)["weight_map"]["model.norm.weight"]
        .as_str()
        .unwrap()
        .to_string()
}

/// The README's "nothing panics on a bad file": single-byte changes all over a shard file's
/// header (and a data offset near u64::MAX) give a typed error or a checkpoint that copies every
/// tensor, never a panic (this test would fail on one).
#[test]
fn byte_flips_in_a_shard_header_are_errors_never_panics() {
    let tmp = tempfile::tempdir().unwrap();
    let w = write_checkpoint(&llama_tiny(), 1, tmp.path(), &small_shards()).unwrap();
    let name = w
        .shards
        .iter()
        .max_by_key(|n| raw(&tmp.path().join(n)).header.len())
        .unwrap()
        .clone();
    let path = tmp.path().join(&name);
    let good = fs::read(&path).unwrap();
    let header_end = raw(&path).data_start;
    let end = raw(&path)
        .header
        .values()
        .filter_map(|i| i["data_offsets"][1].as_u64())
        .max()
        .unwrap();
    let mut refused = 0;
    let try_all = |refused: &mut usize| {
        let complete = is_complete(tmp.path());
        match Checkpoint::open(tmp.path()) {
            Err(e) => {
                assert!(matches!(e.kind(), ErrorKind::Config), "{e}");
                *refused += 1;
            }
            Ok(ck) => {
                assert!(complete);
                for s in ck.tensors() {
                    let mut dst = vec![0u8; s.bytes() as usize];
                    ck.copy_box(&s.name, &s.full_box(), &mut dst).unwrap();
                }
            }
        }
    };
    for at in (0..header_end).step_by(3) {
        for x in [0x01u8, 0x80, 0xff] {
            let mut bytes = good.clone();
            bytes[at] ^= x;
            fs::write(&path, &bytes).unwrap();
            try_all(&mut refused);
        }
    }
    assert!(refused > 0);
    // A data offset near u64::MAX: the completeness check must not wrap around.
    let text = String::from_utf8_lossy(&good[8..header_end]).into_owned();
    let huge = text.replace(&format!(",{end}]"), &format!(",{}]", u64::MAX - 4));
    assert_ne!(huge, text);
    let mut bytes = (huge.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(huge.as_bytes());
    bytes.extend_from_slice(&good[header_end..]);
    fs::write(&path, &bytes).unwrap();
    try_all(&mut refused);
    assert!(!is_complete(tmp.path()));
}
