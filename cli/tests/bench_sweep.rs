//! `reshard bench --sweep` and `--transport all` as users run them (issue 29, "how cost
//! grows"): every point measured, every registered backend run, JSON keys a contract.

use std::process::{Command, Output};

use serde_json::Value;

fn reshard(args: &[&str]) -> Output {
    reshard_env(args, &[])
}

fn reshard_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_reshard"));
    c.args(args)
        .env_remove("RESHARD_CONFIG")
        .env_remove("RESHARD_TRANSPORT__KIND")
        .current_dir(env!("CARGO_TARGET_TMPDIR"));
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run reshard")
}

fn json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

/// Asserts the command failed with an error (exit 2) and printed nothing on stdout (nothing
/// was measured); returns stderr.
fn refused(out: &Output) -> String {
    assert_eq!(out.status.code(), Some(2), "expected an error exit");
    assert!(
        out.stdout.is_empty(),
        "printed before refusing: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64()
        .unwrap_or_else(|| panic!("{k} is not a number: {v}"))
}

/// Every arm of a run: verified, its timings measured (nonzero), and the ratio columns
/// computed from the run's own figures.
fn check_run(run: &Value, arms: &[&str]) {
    assert_eq!(run["verified"], true, "{run}");
    // The keys a single `reshard bench --json` has always printed.
    for k in ["transport", "preset", "publishers", "receivers_topology"] {
        assert!(run[k].is_string(), "{k}: {run}");
    }
    assert!(run["publisher_process"].is_boolean(), "{run}");
    assert!(run["layers"].as_u64().is_some(), "{run}");
    let memcpy = f(run, "memcpy_gbytes_per_s");
    assert!(memcpy > 0.0, "{run}");
    let got: Vec<&str> = run["arms"]
        .as_array()
        .expect("arms")
        .iter()
        .filter_map(|a| a["arm"].as_str())
        .collect();
    assert_eq!(got, arms, "{run}");
    for a in run["arms"].as_array().expect("arms") {
        assert_eq!(a["verified"], true, "{a}");
        let wire_bytes = a["wire_bytes"].as_u64().expect("wire_bytes");
        assert!(wire_bytes > 0, "{a}");
        assert!(
            a["checked_bytes"].as_u64().expect("checked_bytes") > 0,
            "{a}"
        );
        for k in [
            "median_wire_s",
            "median_e2e_s",
            "wire_fraction_of_memcpy",
            "e2e_over_wire",
            "memcpy_s",
            "e2e_over_memcpy",
            "wire_s_per_gib",
            "e2e_s_per_gib",
        ] {
            assert!(f(a, k) > 0.0, "{k}: {a}");
        }
        let (wire, e2e) = (f(a, "median_wire_s"), f(a, "median_e2e_s"));
        let gib = wire_bytes as f64 / (1u64 << 30) as f64;
        let close = |got: f64, want: f64, what: &str| {
            assert!(
                (got - want).abs() <= 1e-9 * want.abs().max(1.0),
                "{what}: {got} against {want}: {a}"
            )
        };
        close(f(a, "e2e_over_wire"), e2e / wire, "e2e_over_wire");
        close(f(a, "wire_s_per_gib"), wire / gib, "wire_s_per_gib");
        close(f(a, "e2e_s_per_gib"), e2e / gib, "e2e_s_per_gib");
        let memcpy_s = wire_bytes as f64 / (memcpy * 1e9);
        close(f(a, "memcpy_s"), memcpy_s, "memcpy_s");
        close(f(a, "e2e_over_memcpy"), e2e / memcpy_s, "e2e_over_memcpy");
        // The verify column is the run's measured verify stage.
        close(
            f(a, "median_verify_s"),
            f(&a["median_stages_s"], "verify"),
            "median_verify_s",
        );
        assert!(e2e >= wire, "the wire leg is part of the refit: {a}");
    }
}

#[test]
fn sweep_measures_every_point_and_wire_bytes_grow_with_layers() {
    let v = json(&reshard(&[
        "bench",
        "--sweep",
        "layers=1,2,3",
        "--experts",
        "8",
        "--vocab",
        "4096",
        "--updates",
        "1",
        "--json",
    ]));
    assert_eq!(v["verified"], true);
    assert_eq!(v["sweep"]["key"], "layers");
    assert_eq!(v["sweep"]["values"], serde_json::json!([1, 2, 3]));
    assert_eq!(v["transports"], serde_json::json!(["loopback"]));
    assert_eq!(v["skipped"], serde_json::json!([]));
    let runs = v["runs"].as_array().expect("runs");
    let layers: Vec<u64> = runs.iter().filter_map(|r| r["layers"].as_u64()).collect();
    assert_eq!(layers, vec![1, 2, 3]);
    for r in runs {
        check_run(r, &["baseline", "reshard"]);
        assert_eq!(r["transport"], "loopback");
        assert_eq!(r["experts"], 8);
        assert_eq!(r["publisher_process"], false);
    }
    for arm in 0..2 {
        let bytes: Vec<u64> = runs
            .iter()
            .map(|r| r["arms"][arm]["wire_bytes"].as_u64().expect("wire_bytes"))
            .collect();
        assert!(
            bytes.windows(2).all(|w| w[1] > w[0]),
            "arm {arm}: wire bytes per point {bytes:?} do not grow with layers"
        );
    }
}

#[test]
fn transport_all_runs_every_registered_backend() {
    let v = json(&reshard(&[
        "bench",
        "--transport",
        "all",
        "--layers",
        "1",
        "--experts",
        "8",
        "--vocab",
        "4096",
        "--updates",
        "1",
        "--arms",
        "reshard",
        "--json",
    ]));
    assert_eq!(v["verified"], true);
    assert!(v["sweep"].is_null());
    let registry = reshard::registry();
    // What this machine can run: the suite's rule (a backend RESHARD_REQUIRE_BACKENDS names
    // must be here).
    let (mut here, mut missing) = (Vec::new(), Vec::new());
    for scheme in registry.schemes() {
        if reshard_conformance::backend_available(scheme, registry.probe(scheme)) {
            here.push(scheme);
        } else {
            missing.push(scheme);
        }
    }
    assert!(
        here.len() >= 2,
        "loopback and cma need no runtime: {here:?}"
    );
    assert_eq!(v["transports"], serde_json::json!(here));
    let skipped: Vec<&str> = v["skipped"]
        .as_array()
        .expect("skipped")
        .iter()
        .map(|s| {
            assert!(!s["reason"].as_str().unwrap_or("").is_empty(), "{s}");
            s["transport"].as_str().expect("transport")
        })
        .collect();
    assert_eq!(skipped, missing);
    let runs = v["runs"].as_array().expect("runs");
    let ran: Vec<&str> = runs
        .iter()
        .filter_map(|r| r["transport"].as_str())
        .collect();
    assert_eq!(ran, here);
    for r in runs {
        check_run(r, &["reshard"]);
        let scheme = r["transport"].as_str().expect("transport");
        let crosses = registry
            .create_default(scheme, "bench-sweep-test")
            .expect("endpoint")
            .capabilities()
            .cross_process;
        // As the table was measured: publishers in a child process wherever the
        // backend reaches one.
        assert_eq!(r["publisher_process"], crosses, "{scheme}");
    }
}

#[test]
fn transport_all_names_a_backend_whose_runtime_is_missing_and_runs_the_rest() {
    let schemes = reshard::registry().schemes();
    if !schemes.contains(&"nixl") {
        eprintln!("SKIPPED: this build registers no nixl backend to take away");
        return;
    }
    let nowhere = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("no-nixl-here");
    let v = json(&reshard_env(
        &[
            "bench",
            "--transport",
            "all",
            "--layers",
            "1",
            "--experts",
            "8",
            "--vocab",
            "4096",
            "--updates",
            "1",
            "--arms",
            "reshard",
            "--json",
        ],
        &[("RESHARD_NIXL_HOME", nowhere.to_str().expect("utf-8 path"))],
    ));
    let skipped = v["skipped"].as_array().expect("skipped");
    assert_eq!(skipped.len(), 1, "{v}");
    assert_eq!(skipped[0]["transport"], "nixl");
    let reason = skipped[0]["reason"].as_str().expect("reason");
    assert!(reason.contains("RESHARD_NIXL_HOME"), "{reason}");
    let ran: Vec<&str> = v["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .filter_map(|r| r["transport"].as_str())
        .collect();
    assert!(
        !ran.contains(&"nixl") && ran.contains(&"loopback"),
        "{ran:?}"
    );
    assert_eq!(v["verified"], true);
}

#[test]
fn sweep_prints_each_run_and_the_side_by_side_table() {
    let out = reshard(&[
        "bench",
        "--sweep",
        "layers=1,2",
        "--experts",
        "8",
        "--vocab",
        "4096",
        "--updates",
        "1",
        "--arms",
        "reshard",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert_eq!(text.matches("bench qwen3-30b-a3b").count(), 2, "{text}");
    let table = text.split("side by side").nth(1).expect("summary table");
    for col in [
        "e2e/wire",
        "wire/memcpy",
        "e2e/memcpy",
        "verify ms",
        "wire ms/GiB",
        "e2e ms/GiB",
    ] {
        assert!(table.contains(col), "{col}: {table}");
    }
    let rows: Vec<&str> = table
        .lines()
        .filter(|l| l.starts_with("loopback"))
        .collect();
    assert_eq!(rows.len(), 2, "{table}");
}

#[test]
fn a_single_run_keeps_its_json_shape_and_gains_the_ratio_columns() {
    let v = json(&reshard(&[
        "bench",
        "--layers",
        "1",
        "--experts",
        "8",
        "--vocab",
        "4096",
        "--updates",
        "1",
        "--arms",
        "reshard",
        "--json",
    ]));
    assert!(v.get("runs").is_none(), "{v}");
    check_run(&v, &["reshard"]);
    assert!(v["speedup_e2e"].is_null(), "one arm: {v}");
}

#[test]
fn bad_sweeps_are_refused_before_anything_is_measured() {
    let err = refused(&reshard(&["bench", "--sweep", "heads=1,2"]));
    assert!(err.contains("unknown key \"heads\""), "{err}");
    assert!(err.contains("layers, experts, vocab"), "{err}");
    let err = refused(&reshard(&["bench", "--sweep", "layers=1,x"]));
    assert!(err.contains("\"x\""), "{err}");
    let err = refused(&reshard(&[
        "bench",
        "--sweep",
        "layers=1,2",
        "--layers",
        "2",
    ]));
    assert!(err.contains("--layers 2"), "{err}");
    // The first point is valid; the second is refused before the first one runs.
    let err = refused(&reshard(&[
        "bench",
        "--sweep",
        "layers=1,99",
        "--experts",
        "8",
        "--vocab",
        "4096",
        "--updates",
        "1",
    ]));
    assert!(err.contains("--layers 99"), "{err}");
    let err = refused(&reshard(&[
        "bench",
        "--transport",
        "all",
        "--arms",
        "fastest",
    ]));
    assert!(err.contains("baseline"), "{err}");
}
