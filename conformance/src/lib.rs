#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod checks;
pub mod counting;
pub mod faults;
pub mod fixtures;
pub mod proofs;
pub mod quiescence;
pub mod remote;
pub mod suite;
pub mod wrappers;

pub use fixtures::Harness;
pub use reshard_testkit::Publishers as Cluster;
pub use suite::Family;

/// Environment variable listing backends (comma-separated, or `all`) whose absence fails tests
/// instead of skipping them; CI sets it to `all`, so a registered backend cannot be skipped.
pub const REQUIRE_BACKENDS_ENV: &str = "RESHARD_REQUIRE_BACKENDS";

/// Environment variable: how many random fault schedules the fault property test runs per
/// backend (default [`DEFAULT_FAULT_CASES`]).
pub const FAULT_CASES_ENV: &str = "RESHARD_FAULT_CASES";

/// Fault schedules per backend when [`FAULT_CASES_ENV`] is unset.
pub const DEFAULT_FAULT_CASES: u32 = 1000;

/// Environment variable: seed (a `u64`) of the fault schedules, to replay a reported failure.
pub const FAULT_SEED_ENV: &str = "RESHARD_FAULT_SEED";

/// Fault schedules to run: [`FAULT_CASES_ENV`] or [`DEFAULT_FAULT_CASES`]; a value that is not
/// a number panics, so a typo cannot silently shrink the test.
pub fn fault_cases() -> u32 {
    env_number(FAULT_CASES_ENV).map_or(DEFAULT_FAULT_CASES, |v| v as u32)
}

/// Fault schedules of the cross-process fault property when [`FAULT_CASES_ENV`] is unset: each
/// case goes through the publisher process (publish a step), so fewer of them.
pub const DEFAULT_CROSS_PROCESS_FAULT_CASES: u32 = 100;

/// Fault schedules to run cross-process: [`FAULT_CASES_ENV`] or
/// [`DEFAULT_CROSS_PROCESS_FAULT_CASES`].
pub fn cross_process_fault_cases() -> u32 {
    env_number(FAULT_CASES_ENV).map_or(DEFAULT_CROSS_PROCESS_FAULT_CASES, |v| v as u32)
}

/// Seed of the fault schedules: [`FAULT_SEED_ENV`] when set (to replay a reported failure),
/// otherwise a fresh one per run, so runs explore different schedules. The fault property
/// prints it, and every failure message names it.
pub fn fault_seed() -> u64 {
    env_number(FAULT_SEED_ENV).unwrap_or_else(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.write_u32(std::process::id());
        h.finish()
    })
}

fn env_number(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a non-negative integer")),
    )
}

/// Runs check `name` (the future `check`) on harness `h`. When `h` marks it as a known defect,
/// the check must fail (its panic is caught and reported with the reason), and passing fails
/// the test so the mark is removed once the defect is fixed.
pub async fn run_check(h: &Harness, name: &str, check: impl std::future::Future<Output = ()>) {
    use futures::FutureExt;
    let Some(reason) = h.known_defect(name) else {
        return check.await;
    };
    match std::panic::AssertUnwindSafe(check).catch_unwind().await {
        Err(_) => eprintln!(
            "KNOWN DEFECT: {name} fails on {} as expected: {reason}",
            h.name()
        ),
        Ok(()) => panic!(
            "{name} now passes on {} although it is marked as a known defect ({reason}): remove \
             the mark",
            h.name()
        ),
    }
}

/// Whether `backend`'s tests can run: `probe` says if its native runtime is usable here. When it
/// is not, this panics if [`REQUIRE_BACKENDS_ENV`] names the backend or says `all` (so CI cannot
/// skip it silently) and otherwise prints why the test is skipped and returns false.
pub fn backend_available(backend: &str, probe: reshard_core::Result<()>) -> bool {
    match probe {
        Ok(()) => true,
        Err(e) => {
            let required = std::env::var(REQUIRE_BACKENDS_ENV).unwrap_or_default();
            if required
                .split(',')
                .any(|b| b.trim() == backend || b.trim() == "all")
            {
                panic!(
                    "backend {backend} is required ({REQUIRE_BACKENDS_ENV}) but unavailable: {e}"
                );
            }
            eprintln!("SKIPPED: backend {backend} unavailable here: {e}");
            false
        }
    }
}

// The family macros below are the building blocks of `suite!` (src/suite.rs), hidden from the
// documentation: a backend calls `suite!` once and never these directly, so every family is
// emitted and gated in one place.

/// Makes one `#[tokio::test]` per conformance check, each with a fresh harness from `$make`.
/// With `requires = $probe` (a `reshard_core::Result<()>`), each test first asks
/// [`backend_available`].
#[doc(hidden)]
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr, requires = $probe:expr) => {
        $crate::conformance_tests!(@checks $make, $probe, Checks);
    };
    ($make:expr) => {
        $crate::conformance_tests!($make, requires = ::std::result::Result::Ok(()));
    };
    // `$family`: the [`Family`] whose capability gate each test asks.
    (@checks $make:expr, $probe:expr, $family:ident) => {
        $crate::conformance_tests!(@each $make, $probe, $family;
            install_byte_exact_dense_tp4_to_tp2,
            install_byte_exact_dense_tp2_to_tp4,
            install_byte_exact_moe_ep8_dp8_to_tp2,
            install_byte_exact_gqa_kv_heads_below_publisher_tp,
            row_parallel_full_pulls_are_byte_exact,
            row_parallel_gathers_are_byte_exact_and_checked,
            executed_reads_equal_the_plan,
            descriptors_are_reused_across_updates,
            successive_steps_install_new_weights,
            missing_coverage_is_typed_and_names_tensor_and_box,
            divergent_replica_digests_fail,
            corrupted_source_bytes_fail_verification,
            corrupted_rows_of_a_partial_read_fail_verification,
            rewritten_during_the_wire_leg_is_refused,
            transport_failing_mid_batch_leaves_live_weights,
            read_outside_registered_region_is_typed,
            throughput_ceiling_guard_refuses_install,
            abort_stops_a_posted_batch,
            offer_outside_the_registered_region,
            publisher_whose_metadata_was_never_loaded,
            peer_metadata_changed_for_the_same_name,
            peer_metadata_from_another_agent_for_the_same_rank,
            two_receivers_refit_concurrently,
        );
        $crate::conformance_tests!(@proof $make, $probe, $family;
            wrong_owner_or_offset_is_caught);
    };
    (@proof $make:expr, $probe:expr, $family:ident; $($check:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                let harness = $make;
                if !$crate::suite::family_runs(
                    &harness, $probe, $crate::Family::$family, stringify!($check),
                ) {
                    return;
                }
                $crate::proofs::$check(&harness).await;
            }
        )*
    };
    (@each $make:expr, $probe:expr, $family:ident; $($check:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                let harness = $make;
                if !$crate::suite::family_runs(
                    &harness, $probe, $crate::Family::$family, stringify!($check),
                ) {
                    return;
                }
                $crate::run_check(
                    &harness,
                    stringify!($check),
                    $crate::checks::$check(&harness),
                )
                .await;
            }
        )*
    };
}

/// Makes the counted-completion tests of [`counting`] over `$make`, an expression giving a
/// fresh [`counting::Counting`] per test (the backend's harness, endpoints with a hook to its
/// dev-only `inject_skip_read`, when it applies the skip, and its regions and batch):
/// `wait_counts_completed_reads_and_a_skipped_read_is_missing`,
/// `a_lost_read_fails_the_update_without_verification_and_keeps_live_weights`,
/// `the_execution_log_holds_the_reads_posted_with_region_ids_per_endpoint`,
/// `unknown_peer_names_owner_range_and_backend`,
/// `overlapping_destinations_are_refused_and_land_in_order_as_waves` and
/// `reads_are_reported_once_each_only_after_their_bytes_landed` (the completion contract) and
/// `copy_hashes_are_the_landed_bytes_and_stored_before_the_report` (hashing while copying) and
/// `gather_reads_land_their_rows_in_order_and_hash_what_landed` (gather reads). With `requires = $probe`, each first asks
/// [`backend_available`]. A building block of [`suite!`] (its `counting =` argument);
/// backends call [`suite!`], not this.
#[doc(hidden)]
#[macro_export]
macro_rules! counting_tests {
    ($make:expr, requires = $probe:expr) => {
        $crate::counting_tests!(@each $make, $probe;
            wait_counts_completed_reads_and_a_skipped_read_is_missing,
            a_lost_read_fails_the_update_without_verification_and_keeps_live_weights,
            the_execution_log_holds_the_reads_posted_with_region_ids_per_endpoint,
            unknown_peer_names_owner_range_and_backend,
            overlapping_destinations_are_refused_and_land_in_order_as_waves,
            reads_are_reported_once_each_only_after_their_bytes_landed,
            copy_hashes_are_the_landed_bytes_and_stored_before_the_report,
            gather_reads_land_their_rows_in_order_and_hash_what_landed,
        );
    };
    ($make:expr) => {
        $crate::counting_tests!($make, requires = ::std::result::Result::Ok(()));
    };
    (@each $make:expr, $probe:expr; $($check:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                let counting: $crate::counting::Counting = $make;
                if !$crate::suite::family_runs(
                    &counting.harness, $probe, $crate::Family::Counting, stringify!($check),
                ) {
                    return;
                }
                $crate::counting::$check(&counting).await;
            }
        )*
    };
}

/// Makes the in-flight safety tests (docs/in-flight-safety.md), one per way of ending a batch:
/// `quiescent_after_abort`, `quiescent_after_dropped_wait_future`,
/// `quiescent_after_dropped_handle`, `quiescent_after_dropped_registration_batch_and_transport`
/// and `quiescent_after_wait_on_a_dropped_transport` (see [`quiescence::quiescent_after`]). With `requires = $probe`, each first asks
/// [`backend_available`].
#[doc(hidden)]
#[macro_export]
macro_rules! quiescence_tests {
    ($make:expr, requires = $probe:expr) => {
        $crate::quiescence_tests!(@each $make, $probe;
            quiescent_after_abort => Abort,
            quiescent_after_dropped_wait_future => DroppedWaitFuture,
            quiescent_after_dropped_handle => DroppedHandle,
            quiescent_after_dropped_registration_batch_and_transport => DroppedEverything,
            quiescent_after_wait_on_a_dropped_transport => WaitAfterDroppedTransport,
        );
    };
    ($make:expr) => {
        $crate::quiescence_tests!($make, requires = ::std::result::Result::Ok(()));
    };
    (@each $make:expr, $probe:expr; $($name:ident => $ending:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let harness = $make;
                if !$crate::suite::family_runs(
                    &harness, $probe, $crate::Family::Quiescence, stringify!($name),
                ) {
                    return;
                }
                $crate::quiescence::quiescent_after(
                    &harness,
                    $crate::quiescence::Ending::$ending,
                )
                .await;
            }
        )*
    };
}

/// Makes the in-flight safety tests that need publishers in a child process reached over a
/// transport whose reads need the publisher's help (UCX over TCP): `quiescent_after_publisher_killed`
/// and `quiescent_after_publisher_stalled`, plus `publisher_process` (the child's entry point
/// and a self-test). `$endpoint` should give endpoints a short no-progress timeout. The
/// `stall` family of [`suite!`] (its `stall =` argument), which puts it in module `stall`.
#[doc(hidden)]
#[macro_export]
macro_rules! cross_process_quiescence_tests {
    ($name:expr, $endpoint:path, requires = $probe:expr) => {
        $crate::cross_process_conformance_tests!(@process $name, $endpoint, $probe, Stall, []);

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn quiescent_after_publisher_stalled() {
            if !$crate::suite::family_runs(
                &cross_process_harness(),
                $probe,
                $crate::Family::Stall,
                "quiescent_after_publisher_stalled",
            ) {
                return;
            }
            $crate::quiescence::quiescent_after_publisher_stalled(&cross_process_harness()).await;
        }
    };
}

/// Set in the child process of [`quiescence_tests_in_child!`].
pub const QUIESCENCE_CHILD_ENV: &str = "RESHARD_QUIESCENCE_CHILD";

/// Makes test `$test`, which runs this test binary's in-process `quiescent_after_*` tests (those
/// of [`quiescence_tests!`]) and `abort_stops_a_posted_batch` again in a child process with
/// extra environment: for a backend
/// whose native library reads its transport choice from the environment at start-up (NIXL's
/// UCX with `UCX_TLS=tcp`), so that its reads stay in flight long enough to be ended part-way.
/// `$name` is the backend's scheme, `$probe` as in [`conformance_tests!`].
#[doc(hidden)]
#[macro_export]
macro_rules! quiescence_tests_in_child {
    ($test:ident, $name:expr, env = [$(($k:expr, $v:expr)),* $(,)?], requires = $probe:expr) => {
        #[test]
        fn $test() {
            if ::std::env::var_os($crate::QUIESCENCE_CHILD_ENV).is_some()
                || !$crate::backend_available($name, $probe)
            {
                return;
            }
            let out = ::std::process::Command::new(
                ::std::env::current_exe().expect("the test binary"),
            )
            .args([
                "quiescent_after_",
                "abort_stops_a_posted_batch",
                "--skip",
                "cross_process",
                "--test-threads=2",
            ])
            .env($crate::QUIESCENCE_CHILD_ENV, "1")
            $(.env($k, $v))*
            .output()
            .expect("run the child");
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success()
                    && stdout.contains("test result: ok.")
                    && !stdout.contains(" 0 passed"),
                "quiescence tests with {:?} failed ({:?}):\n{stdout}\n{}",
                [$(($k, $v)),*],
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
    };
}

/// Makes the fault property test, `fault_schedules_never_expose_bad_weights`, over a harness
/// from `$make`: [`fault_cases`] random [`faults::FaultSchedule`]s through a
/// [`faults::FaultyTransport`] (see [`checks::fault_schedules_never_expose_bad_weights`]). With
/// `requires = $probe`, it first asks [`backend_available`].
#[doc(hidden)]
#[macro_export]
macro_rules! fault_tests {
    ($make:expr, requires = $probe:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn fault_schedules_never_expose_bad_weights() {
            let harness = $make;
            if !$crate::suite::family_runs(
                &harness,
                $probe,
                $crate::Family::Fault,
                "fault_schedules_never_expose_bad_weights",
            ) {
                return;
            }
            $crate::checks::fault_schedules_never_expose_bad_weights(
                &harness,
                $crate::fault_cases(),
            )
            .await;
        }
    };
    ($make:expr) => {
        $crate::fault_tests!($make, requires = ::std::result::Result::Ok(()));
    };
}

/// Makes the whole suite with every cluster's publishers in a child process, plus a
/// `publisher_process` test that is both the child's entry point and a check of its own.
///
/// `$name` is the backend's scheme, `$endpoint` a function `fn(&str) -> Result<Arc<dyn
/// Transport>>` making an endpoint by agent name (called in both processes), `$probe` as in
/// [`conformance_tests!`]. The test binary re-executes itself with only `publisher_process`
/// selected and [`reshard_testkit::remote::SOCKET_ENV`] set; there that test serves the
/// publishers over a Unix socket until the parent is done. The `cross_process` family of
/// [`suite!`] (its `cross_process =` argument), which puts it in module `cross_process`; every
/// test first asks [`suite::family_runs`], so it runs only where the backend declares
/// `Capability::cross_process`.
#[doc(hidden)]
#[macro_export]
macro_rules! cross_process_conformance_tests {
    ($name:expr, $endpoint:path, requires = $probe:expr) => {
        $crate::cross_process_conformance_tests!(
            $name, $endpoint, requires = $probe, known_defects = []
        );
    };
    // `known_defects = [(check, reason), ...]`: see [`Harness::with_known_defect`].
    (
        $name:expr, $endpoint:path, requires = $probe:expr,
        known_defects = [$(($check:expr, $reason:expr)),* $(,)?]
    ) => {
        $crate::cross_process_conformance_tests!(
            @process $name, $endpoint, $probe, CrossProcess, [$(($check, $reason)),*]
        );
        $crate::conformance_tests!(@checks cross_process_harness(), $probe, CrossProcess);

        /// Entry point of the receiver processes of `two_receiver_processes` (a no-op in a
        /// normal run).
        #[test]
        fn receiver_process() {
            if $crate::checks::is_receiver_process() {
                $crate::checks::serve_receiver($endpoint);
            }
        }

        /// Two receiver processes refit at once from publishers in a third process.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn two_receiver_processes() {
            if $crate::checks::is_receiver_process()
                || !$crate::suite::family_runs(
                    &cross_process_harness(),
                    $probe,
                    $crate::Family::CrossProcess,
                    "two_receiver_processes",
                )
            {
                return;
            }
            $crate::checks::two_receiver_processes(
                &cross_process_harness(),
                $crate::remote::self_command(module_path!(), "receiver_process"),
            )
            .await;
        }

        /// The fault property with the publishers in the child process
        /// ([`cross_process_fault_cases`] schedules).
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn fault_schedules_never_expose_bad_weights() {
            if !$crate::suite::family_runs(
                &cross_process_harness(),
                $probe,
                $crate::Family::CrossProcess,
                "fault_schedules_never_expose_bad_weights",
            ) {
                return;
            }
            $crate::checks::fault_schedules_never_expose_bad_weights(
                &cross_process_harness(),
                $crate::cross_process_fault_cases(),
            )
            .await;
        }
    };
    // The child's entry point and the harness that starts it, shared with
    // `cross_process_quiescence_tests!`, plus the check that kills the child mid-refit
    // (docs/in-flight-safety.md).
    (@process $name:expr, $endpoint:path, $probe:expr, $family:ident,
        [$(($check:expr, $reason:expr)),*]) => {
        fn cross_process_harness() -> $crate::Harness {
            $crate::Harness::new($name, $endpoint)
                .with_publisher_process($crate::remote::self_command(
                    module_path!(),
                    "publisher_process",
                ))
                $(.with_known_defect($check, $reason))*
        }

        #[test]
        fn publisher_process() {
            if $crate::remote::is_publisher_process() {
                $crate::remote::serve_publishers($endpoint);
                return;
            }
            if !$crate::suite::family_runs(
                &cross_process_harness(),
                $probe,
                $crate::Family::$family,
                "publisher_process",
            ) {
                return;
            }
            let command = $crate::remote::self_command(module_path!(), "publisher_process");
            $crate::remote::publisher_process_self_test(&cross_process_harness(), command());
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn quiescent_after_publisher_killed() {
            if !$crate::suite::family_runs(
                &cross_process_harness(),
                $probe,
                $crate::Family::$family,
                "quiescent_after_publisher_killed",
            ) {
                return;
            }
            $crate::quiescence::quiescent_after_publisher_killed(&cross_process_harness()).await;
        }
    };
    ($name:expr, $endpoint:path) => {
        $crate::cross_process_conformance_tests!(
            $name, $endpoint, requires = ::std::result::Result::Ok(())
        );
    };
}

#[cfg(test)]
mod tests {
    /// The suite's own `RESHARD_*` variables are not configuration keys: with one of them set
    /// (replaying a fault seed, say), loading the configuration must still work.
    #[test]
    fn suite_variables_are_not_config_keys() {
        use reshard_core::config::{ENV_PREFIX, NOT_CONFIG_ENV};
        for var in [
            super::REQUIRE_BACKENDS_ENV,
            super::FAULT_CASES_ENV,
            super::FAULT_SEED_ENV,
            super::QUIESCENCE_CHILD_ENV,
        ] {
            let key = var.strip_prefix(ENV_PREFIX).expect("RESHARD_ prefix");
            assert!(
                NOT_CONFIG_ENV.contains(&key),
                "{var} would be read as a config key"
            );
        }
    }
}
