//! The deployment path as separate processes (docs/deployment.md): a private etcd
//! (scripts/etcd.sh), `reshard publish` processes serving a safetensors checkpoint folder over
//! UCX restricted to TCP, and `reshard receive` processes that refit every new step and dump
//! what they installed. Each dump is compared with slices cut directly from the checkpoint
//! files by this test's own reading of vLLM's TP layout, not through reshard's planner.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reshard_checkpoint::Checkpoint;

const R: &str = env!("CARGO_BIN_EXE_reshard");

fn scripts() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts")
}

/// Skips loudly where UCX or etcd is missing, unless `RESHARD_REQUIRE_BACKENDS` asks for all.
fn available() -> bool {
    let ucx =
        reshard_conformance::backend_available("ucx", reshard_transports::registry().probe("ucx"));
    if !ucx {
        return false;
    }
    let etcd = Command::new("etcd").arg("--version").output().is_ok();
    assert!(
        etcd || std::env::var_os("RESHARD_REQUIRE_BACKENDS").is_none(),
        "etcd is required here: run scripts/install-deps.sh"
    );
    if !etcd {
        eprintln!("SKIPPED: etcd is not installed (scripts/install-deps.sh installs it)");
    }
    etcd
}

/// Kills its processes and stops etcd when the test ends, whatever happened.
struct Cluster {
    dir: PathBuf,
    children: Vec<Child>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("bash")
            .arg(scripts().join("etcd.sh"))
            .arg("stop")
            .arg(self.dir.join("etcd"))
            .status();
    }
}

fn checkpoint(dir: &Path, step: u64) {
    let out = Command::new(R)
        .args(["checkpoint", "--preset", "qwen3-30b-a3b", "--layers", "1"])
        .args(["--experts", "4", "--vocab", "512", "--max-shard-mib", "16"])
        .args(["--step", &step.to_string(), "--out"])
        .arg(dir.join(format!("step-{step}")))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Bytes of rows `rows` of a row-major 2-D tensor with `cols` columns of `elem` bytes.
fn rows(t: &[u8], cols: usize, elem: usize, rows: std::ops::Range<usize>) -> Vec<u8> {
    t[rows.start * cols * elem..rows.end * cols * elem].to_vec()
}

/// Columns `c` of every row of a row-major 2-D tensor.
fn cols(t: &[u8], ncols: usize, elem: usize, c: std::ops::Range<usize>) -> Vec<u8> {
    t.chunks(ncols * elem)
        .flat_map(|row| row[c.start * elem..c.end * elem].to_vec())
        .collect()
}

/// What TP rank `t` of `tp` holds of each parameter in vLLM's naming, cut from the checkpoint.
fn expected(ckpt: &Checkpoint, name: &str, t: usize, tp: usize) -> Vec<u8> {
    let m = ckpt.model();
    let (h, e) = (m.hidden as usize, 2usize);
    let hd = m.head_dim as usize;
    let (q, kv) = (m.heads as usize * hd, m.kv_heads as usize * hd);
    let get = |n: &str| ckpt.tensor_bytes(n).unwrap().to_vec();
    let part = |len: usize| (t * len / tp)..((t + 1) * len / tp);
    let l = "model.layers.0.";
    match name.strip_prefix(l).unwrap_or(name) {
        "model.embed_tokens.weight" | "lm_head.weight" => {
            rows(&get(name), h, e, part(m.vocab as usize))
        }
        "self_attn.qkv_proj.weight" => [
            rows(&get(&format!("{l}self_attn.q_proj.weight")), h, e, part(q)),
            rows(&get(&format!("{l}self_attn.k_proj.weight")), h, e, part(kv)),
            rows(&get(&format!("{l}self_attn.v_proj.weight")), h, e, part(kv)),
        ]
        .concat(),
        "self_attn.o_proj.weight" => cols(&get(name), q, e, part(q)),
        "mlp.experts.w13_weight" => {
            let i = m.moe.as_ref().unwrap().expert_intermediate as usize;
            (0..m.moe.as_ref().unwrap().experts)
                .flat_map(|x| {
                    let p = |proj: &str| get(&format!("{l}mlp.experts.{x}.{proj}.weight"));
                    [
                        rows(&p("gate_proj"), h, e, part(i)),
                        rows(&p("up_proj"), h, e, part(i)),
                    ]
                    .concat()
                })
                .collect()
        }
        "mlp.experts.w2_weight" => {
            let i = m.moe.as_ref().unwrap().expert_intermediate as usize;
            (0..m.moe.as_ref().unwrap().experts)
                .flat_map(|x| {
                    cols(
                        &get(&format!("{l}mlp.experts.{x}.down_proj.weight")),
                        i,
                        e,
                        part(i),
                    )
                })
                .collect()
        }
        // Norms and the router are replicated: the whole tensor.
        _ => get(name),
    }
}

/// Compares receiver `t`'s dump of `step` with the checkpoint, parameter by parameter.
fn check_dump(dump: &Path, ckpt: &Checkpoint, t: usize, tp: usize) {
    let bytes = std::fs::read(dump).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let names = st.names();
    assert_eq!(names.len(), 12, "{names:?}");
    for name in names {
        let got = st.tensor(name).unwrap();
        let want = expected(ckpt, name, t, tp);
        assert!(
            got.data() == &want[..],
            "receiver {t}: {name} differs from the checkpoint ({} vs {} bytes)",
            got.data().len(),
            want.len()
        );
    }
}

#[test]
fn publishers_and_receivers_meet_through_etcd_and_refit_every_step_byte_exact() {
    if !available() {
        return;
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("deploy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut cluster = Cluster {
        dir: dir.clone(),
        children: Vec::new(),
    };
    let start = Command::new("bash")
        .arg(scripts().join("etcd.sh"))
        .arg("start")
        .arg(dir.join("etcd"))
        .output()
        .unwrap();
    assert!(
        start.status.success(),
        "{}",
        String::from_utf8_lossy(&start.stderr)
    );
    let etcd = String::from_utf8(start.stdout).unwrap().trim().to_string();
    let ckpts = dir.join("ckpts");
    let tp = 2;
    // Receivers first: they wait for the publishers.
    for t in 0..tp {
        let child = Command::new(R)
            .args(["receive", "--rendezvous", &etcd, "--model", "q"])
            .args(["--receivers", "tp=2", "--rank", &t.to_string()])
            .args([
                "--transport",
                "ucx",
                "--steps",
                "3",
                "--json",
                "--timeout-s",
                "60",
            ])
            .arg("--dump")
            .arg(dir.join(format!("dump-{t}")))
            .env("RESHARD_BACKENDS__UCX__TLS", "tcp")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        cluster.children.push(child);
    }
    checkpoint(&ckpts, 1);
    for r in 0..4 {
        let child = Command::new(R)
            .args([
                "publish",
                "--rendezvous",
                &etcd,
                "--model",
                "q",
                "--checkpoint",
            ])
            .arg(&ckpts)
            .args(["--publishers", "ep=2,dp=4", "--rank", &r.to_string()])
            .args([
                "--transport",
                "ucx",
                "--lease-ttl-s",
                "2",
                "--poll-ms",
                "100",
            ])
            .env("RESHARD_BACKENDS__UCX__TLS", "tcp")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        cluster.children.push(child);
    }
    // Each receiver's first step, then two more as the trainer writes them.
    for step in [2u64, 3] {
        let want = dir.join(format!("dump-1/step-{}/model.safetensors", step - 1));
        let deadline = Instant::now() + Duration::from_secs(60);
        while !(want.exists() && dir.join(format!("dump-0/step-{}", step - 1)).exists()) {
            assert!(
                Instant::now() < deadline,
                "step {} was not installed",
                step - 1
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        checkpoint(&ckpts, step);
    }
    for t in 0..tp {
        let child = cluster.children.remove(0);
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "receiver {t}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let steps: Vec<u64> = lines.iter().map(|v| v["step"].as_u64().unwrap()).collect();
        assert_eq!(steps, [1, 2, 3], "receiver {t}");
        for v in &lines {
            for key in [
                "step",
                "verified",
                "reads",
                "wire_bytes",
                "stages_s",
                "e2e_s",
                "attribution",
            ] {
                assert!(v.get(key).is_some(), "receiver {t}: no {key} in {v}");
            }
            assert_eq!(v["verified"], true);
        }
        assert_eq!(lines[1]["plan_rebuilt"], false, "planned once");
        for step in 1..=3 {
            let ckpt = Checkpoint::open(ckpts.join(format!("step-{step}"))).unwrap();
            let dump = dir.join(format!("dump-{t}/step-{step}/model.safetensors"));
            check_dump(&dump, &ckpt, t, tp);
        }
    }
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
}
