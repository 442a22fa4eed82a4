#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod checks;
pub mod fixtures;
pub mod remote;
pub mod wrappers;

pub use fixtures::Harness;
pub use reshard_runtime::Publishers as Cluster;

/// Environment variable listing backends (comma-separated) whose absence fails tests instead
/// of skipping them; CI sets it to every backend it installs.
pub const REQUIRE_BACKENDS_ENV: &str = "RESHARD_REQUIRE_BACKENDS";

/// Whether `backend`'s tests can run: `probe` says if its native runtime is usable here. When it
/// is not, this panics if [`REQUIRE_BACKENDS_ENV`] names the backend (so CI cannot skip it
/// silently) and otherwise prints why the test is skipped and returns false.
pub fn backend_available(backend: &str, probe: reshard_core::Result<()>) -> bool {
    match probe {
        Ok(()) => true,
        Err(e) => {
            let required = std::env::var(REQUIRE_BACKENDS_ENV).unwrap_or_default();
            if required.split(',').any(|b| b.trim() == backend) {
                panic!(
                    "backend {backend} is required ({REQUIRE_BACKENDS_ENV}) but unavailable: {e}"
                );
            }
            eprintln!("SKIPPED: backend {backend} unavailable here: {e}");
            false
        }
    }
}

/// Makes one `#[tokio::test]` per conformance check, each with a fresh harness from `$make`.
/// With `requires = $probe` (a `reshard_core::Result<()>`), each test first asks
/// [`backend_available`].
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr, requires = $probe:expr) => {
        $crate::conformance_tests!(@checks $make, $probe);
    };
    ($make:expr) => {
        $crate::conformance_tests!($make, requires = ::std::result::Result::Ok(()));
    };
    (@checks $make:expr, $probe:expr) => {
        $crate::conformance_tests!(@each $make, $probe;
            install_byte_exact_dense_tp4_to_tp2,
            install_byte_exact_dense_tp2_to_tp4,
            install_byte_exact_moe_ep8_dp8_to_tp2,
            install_byte_exact_gqa_kv_heads_below_publisher_tp,
            row_parallel_full_pulls_are_byte_exact,
            executed_reads_equal_the_plan,
            descriptors_are_reused_across_updates,
            successive_steps_install_new_weights,
            missing_coverage_is_typed_and_names_tensor_and_box,
            divergent_replica_digests_fail,
            corrupted_source_bytes_fail_verification,
            corrupted_rows_of_a_partial_read_fail_verification,
            transport_failing_mid_batch_leaves_live_weights,
            read_outside_registered_region_is_typed,
            throughput_ceiling_guard_refuses_install,
            abort_stops_a_posted_batch,
        );
    };
    (@each $make:expr, $probe:expr; $($check:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                let harness = $make;
                if !$crate::backend_available(harness.name(), $probe) {
                    return;
                }
                $crate::checks::$check(&harness).await;
            }
        )*
    };
}

/// Makes the whole suite with every cluster's publishers in a child process, plus a
/// `publisher_process` test that is both the child's entry point and a check of its own.
///
/// `$name` is the backend's scheme, `$endpoint` a function `fn(&str) -> Result<Arc<dyn
/// Transport>>` making an endpoint by agent name (called in both processes), `$probe` as in
/// [`conformance_tests!`]. The test binary re-executes itself with only `publisher_process`
/// selected and [`reshard_runtime::remote::SOCKET_ENV`] set; there that test serves the
/// publishers over a Unix socket until the parent is done. Use it inside a module of the
/// backend's `tests/conformance.rs`:
///
/// ```text
/// mod cross_process {
///     reshard_conformance::cross_process_conformance_tests!(
///         "ucx", super::endpoint, requires = reshard_backend_ucx::probe()
///     );
/// }
/// ```
#[macro_export]
macro_rules! cross_process_conformance_tests {
    ($name:expr, $endpoint:path, requires = $probe:expr) => {
        fn cross_process_harness() -> $crate::Harness {
            $crate::Harness::new($name, $endpoint).with_publisher_process(
                $crate::remote::self_command(module_path!(), "publisher_process"),
            )
        }

        #[test]
        fn publisher_process() {
            if $crate::remote::is_publisher_process() {
                $crate::remote::serve_publishers($endpoint);
                return;
            }
            if !$crate::backend_available($name, $probe) {
                return;
            }
            let command = $crate::remote::self_command(module_path!(), "publisher_process");
            $crate::remote::publisher_process_self_test(&cross_process_harness(), command());
        }

        $crate::conformance_tests!(@checks cross_process_harness(), $probe);
    };
    ($name:expr, $endpoint:path) => {
        $crate::cross_process_conformance_tests!(
            $name, $endpoint, requires = ::std::result::Result::Ok(())
        );
    };
}
