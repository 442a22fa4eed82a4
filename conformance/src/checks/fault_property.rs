//! The fault-schedule property: random schedules of transport faults never expose bad weights.

use super::*;

/// Asserts a failed update's error is typed and points at an injected fault: its owner is one a
/// fault hit, and its byte range overlaps the read that fault hit.
fn assert_names_a_fault(e: &reshard_core::Error, fired: &[Fired], ctx: &str) {
    let owner = wire_failure_owner(
        e,
        &[
            ErrorKind::Transport,
            ErrorKind::PeerUnknown,
            ErrorKind::Verification,
        ],
        ctx,
    );
    let range = e
        .context()
        .range
        .clone()
        .unwrap_or_else(|| panic!("{ctx}: error names no byte range: {e}"));
    assert!(
        fired
            .iter()
            .any(|f| f.owner == owner && f.range.start < range.end && range.start < f.range.end),
        "{ctx}: error names owner {owner} bytes {range:?}, which no fired fault hit ({fired:?}): {e}"
    );
    if e.kind() != ErrorKind::PeerUnknown {
        assert!(e.context().tensor.is_some(), "{ctx}: names no tensor: {e}");
    }
    if e.kind() == ErrorKind::Transport {
        assert!(
            e.is_retryable(),
            "{ctx}: an injected wire fault is retryable: {e}"
        );
    }
}

/// Fault property: over `cases` random [`crate::faults::FaultSchedule`]s (seed
/// [`crate::fault_seed`]) on one MoE cluster (EP8 x DP8 publishers, TP2 receiver rank 1)
/// reached through a [`FaultyTransport`], each case publishes a new step and refits under the
/// schedule. Then either the refit succeeded, no fault that must fail fired, and the live
/// weights are byte-exact for the new step; or it failed with a typed error naming the owner
/// and byte range of a fault that fired, and the live weights and step are exactly the previous
/// ones (a dropped peer keeps failing with `PeerUnknown` until it is back). Nothing posted is
/// left in flight or abandoned, the next refit with the faults cleared is byte-exact, the
/// wrapper's registrations and prepared batches stay at their steady count, and dropping the
/// receiver releases all of them.
pub async fn fault_schedules_never_expose_bad_weights(h: &Harness, cases: u32) {
    use proptest::strategy::{Strategy, ValueTree};
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    let started = std::time::Instant::now();
    let mut cluster = h.cluster(tiny_moe(), "ep=8,dp=8").await;
    let faulty = Arc::new(FaultyTransport::new(
        h.endpoint("receiver-faulty").expect("endpoint"),
    ));
    let mut rx = h
        .receiver_on(&cluster, faulty.clone(), 2, 1, ReceiverOptions::default())
        .await;
    rx.update(&cluster.tables()).await.expect("clean refit");
    let mut previous = cluster.expected_params(rx.layout()).expect("reference");
    assert_live(&rx, &previous, "warm-up");
    let registrations = faulty.live_registrations();
    let prepared = faulty.live_prepared();
    assert!(
        registrations > 0 && prepared > 0,
        "the wrapper sees the receiver's handles"
    );

    let seed = crate::fault_seed();
    eprintln!(
        "{}: fault schedules from seed {seed} (replay with {}={seed})",
        h.name(),
        crate::FAULT_SEED_ENV
    );
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes),
    );
    let strategy = schedule_strategy();
    let (mut failed, mut silent, mut silent_caught, mut no_op) = (0u32, 0u32, 0u32, 0u32);
    for case in 0..cases {
        let schedule = strategy
            .new_tree(&mut runner)
            .expect("a schedule")
            .current();
        let ctx = format!(
            "{} fault case {case} ({}={seed}): {schedule:?}",
            h.name(),
            crate::FAULT_SEED_ENV
        );
        let live_step = cluster.step();
        let step = live_step + 1;
        cluster.publish_step(step).expect("publish step");
        let tables = cluster.tables();
        let want = cluster.expected_params(rx.layout()).expect("reference");

        faulty.set_schedule(schedule);
        let result = rx.update(&tables).await;
        let fired = faulty.fired();
        let is_silent = |f: &Fired| {
            matches!(
                f.kind,
                FaultKind::Corrupt { .. }
                    | FaultKind::Truncate {
                        report_error: false,
                        ..
                    }
            )
        };
        if is_no_op(&fired) {
            no_op += 1;
        }
        let only_silent = !fired.is_empty() && fired.iter().all(is_silent);
        if only_silent {
            silent += 1;
        }
        match result {
            Ok(_) => {
                assert!(
                    !fired.iter().any(|f| f.kind.must_fail()),
                    "{ctx}: the refit succeeded although {fired:?} fired"
                );
                assert_live(&rx, &want, &ctx);
                assert_eq!(rx.live_step(), Some(step), "{ctx}");
            }
            Err(e) => {
                failed += 1;
                if only_silent {
                    silent_caught += 1;
                    assert_eq!(e.kind(), ErrorKind::Verification, "{ctx}: {e}");
                }
                assert_names_a_fault(&e, &fired, &ctx);
                assert_live(&rx, &previous, &ctx);
                assert_eq!(rx.live_step(), Some(live_step), "{ctx}");
                let dropped = faulty.dropped_peers();
                if !dropped.is_empty() {
                    let e = rx
                        .update(&tables)
                        .await
                        .expect_err("a dropped peer stays unreachable");
                    assert_eq!(e.kind(), ErrorKind::PeerUnknown, "{ctx}: {e}");
                    let owner = e.context().owner.expect("names the peer");
                    assert!(dropped.contains(&owner), "{ctx}: {e}");
                    assert_live(&rx, &previous, &ctx);
                    assert_eq!(rx.live_step(), Some(live_step), "{ctx}");
                }
            }
        }
        assert_eq!(
            faulty.in_flight(),
            0,
            "{ctx}: a posted batch is still in flight"
        );
        assert_eq!(
            faulty.abandoned(),
            0,
            "{ctx}: a posted batch was dropped unawaited"
        );

        faulty.clear();
        rx.update(&tables)
            .await
            .unwrap_or_else(|e| panic!("{ctx}: the refit after clearing the faults failed: {e}"));
        assert_live(&rx, &want, &format!("{ctx} (faults cleared)"));
        assert_eq!(rx.live_step(), Some(step), "{ctx}");
        assert_eq!(
            faulty.live_registrations(),
            registrations,
            "{ctx}: registrations leak"
        );
        assert_eq!(
            faulty.live_prepared(),
            prepared,
            "{ctx}: prepared batches leak"
        );
        assert_eq!(faulty.in_flight(), 0, "{ctx}");
        previous = want;
    }
    if cases >= 200 {
        assert!(failed > 0, "schedules fail refits");
        // A case whose faults never fired (or only delayed the batch) tests nothing.
        assert!(
            no_op * 50 < cases,
            "{no_op} of {cases} fault cases injected nothing ({}={seed})",
            crate::FAULT_SEED_ENV
        );
        // A misdirected byte or a short tail can coincide with the bytes already there (about
        // 1 in 256); anything well below all of them caught means verification is blind.
        assert!(
            silent_caught * 10 >= silent * 9 && silent >= 20,
            "silent faults caught: {silent_caught} of {silent}"
        );
    }
    assert_eq!(rx.plan_builds(), 1, "faults never change the plan");
    drop(rx);
    assert_eq!(
        faulty.live_registrations(),
        0,
        "the receiver released its registrations"
    );
    assert_eq!(
        faulty.live_prepared(),
        0,
        "the receiver released its prepared batches"
    );
    eprintln!(
        "{}: {cases} fault schedules (seed {seed}) in {:.1} s ({failed} refits failed as they \
         should; {no_op} injected nothing; silent faults caught by verification: {silent_caught} \
         of {silent})",
        h.name(),
        started.elapsed().as_secs_f64()
    );
}

// ---- The bad-input catalogue's transport rows (docs/bad-input.md, runtime/tests/bad_input.rs),
// ---- on every backend.
