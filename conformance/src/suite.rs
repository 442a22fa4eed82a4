//! The suite's one entry point, [`crate::suite!`], and the capability gate of its families: which
//! family a backend's declared [`Capability`] makes inapplicable, checked when each test runs.

use reshard_core::{Capability, Result};

use crate::Harness;

/// A family of tests [`crate::suite!`] emits; its `families = [...]` argument names them by
/// the same words in snake case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `checks`: the conformance checks and the misdirected-read proof, in this process.
    Checks,
    /// `fault`: the fault property over random fault schedules, in this process.
    Fault,
    /// `quiescence`: each way of ending a batch mid-flight (docs/in-flight-safety.md).
    Quiescence,
    /// `counting`: counted completions, the execution log and completion order.
    Counting,
    /// `cross_process`: the checks, the fault property, two receiver processes and a killed
    /// publisher, with the publishers in a child process.
    CrossProcess,
    /// `stall`: the killed and stopped (SIGSTOP) publisher process, with a short no-progress
    /// bound.
    Stall,
}

impl Family {
    /// Why a transport declaring `caps` cannot take part in this family, or `None` when it can.
    /// Only the cross-process families depend on a capability: every other family runs in one
    /// process, and where a check could use the backend's own memory (`allocate_host`) it
    /// falls back to plain host memory when there is none (conformance/README.md, "Gating").
    pub fn inapplicable(self, caps: &Capability) -> Option<&'static str> {
        match self {
            Family::CrossProcess | Family::Stall if !caps.cross_process => Some(
                "the transport declares Capability::cross_process = false: its peers cannot \
                 live in another process",
            ),
            _ => None,
        }
    }

    /// Whether the gate asks the transport at all (costs an endpoint per test).
    fn gated(self) -> bool {
        matches!(self, Family::CrossProcess | Family::Stall)
    }

    /// The [`crate::suite!`] argument that gives this family its endpoints.
    fn argument(self) -> &'static str {
        match self {
            Family::Checks | Family::Fault | Family::Quiescence => "harness",
            Family::Counting => "counting",
            Family::CrossProcess => "cross_process",
            Family::Stall => "stall",
        }
    }
}

/// What `h`'s backend declares, from a fresh endpoint.
fn declared(h: &Harness) -> Capability {
    h.endpoint("capability-probe")
        .unwrap_or_else(|e| panic!("{}: an endpoint to read its capabilities: {e}", h.name()))
        .capabilities()
}

/// Whether test `test` of `family` runs on `h`: the backend must be available (see
/// [`crate::backend_available`]) and, for a gated family, its declared [`Capability`] must not
/// make the family inapplicable. A test that does not run says why on stderr and passes.
pub fn family_runs(h: &Harness, probe: Result<()>, family: Family, test: &str) -> bool {
    if !crate::backend_available(h.name(), probe) {
        return false;
    }
    if !family.gated() {
        return true;
    }
    match family.inapplicable(&declared(h)) {
        None => true,
        Some(reason) => {
            eprintln!(
                "INAPPLICABLE: {test} ({family:?} family) on {}: {reason}",
                h.name()
            );
            false
        }
    }
}

/// The test [`crate::suite!`] emits for a family whose endpoint argument the call leaves out:
/// passes (saying why) when `h`'s declared [`Capability`] makes the family inapplicable, and
/// fails when the backend declares what the family needs, so a backend cannot drop a family it
/// claims by leaving out an argument.
pub fn assert_family_inapplicable(h: &Harness, probe: Result<()>, family: Family) {
    if !crate::backend_available(h.name(), probe) {
        return;
    }
    match family.inapplicable(&declared(h)) {
        Some(reason) => eprintln!(
            "INAPPLICABLE: the {family:?} family on {}: {reason}",
            h.name()
        ),
        None => panic!(
            "{} declares what the {family:?} family needs, but the suite! call gives no `{} = \
             ...`: pass it, so the family runs",
            h.name(),
            family.argument()
        ),
    }
}

/// Every conformance family a backend must pass, from one call in its `tests/conformance.rs`;
/// each family is gated on the [`Capability`] the backend declares (see [`Family::inapplicable`]),
/// checked when the test runs. Named arguments, in any order, each at most once:
///
/// - `harness = <expr>` (a [`Harness`]): the in-process `checks`, `fault` and `quiescence`
///   families, one test per check at the top level of the calling module.
/// - `requires = <expr>` (a `reshard_core::Result<()>`, default `Ok(())`): the availability
///   probe every test asks first ([`crate::backend_available`]).
/// - `counting = <expr>` (a [`crate::counting::Counting`]): the `counting` family, at the top
///   level too.
/// - `cross_process = <path>` (a `fn(&str) -> Result<Arc<dyn Transport>>`, called in both
///   processes): the `cross_process` family in module `cross_process`.
/// - `stall = <path>` (the same, with a short no-progress timeout): the `stall` family (the
///   killed and the stopped publisher process) in module `stall`.
/// - `quiescence_in_child = (<test>, env = [(<key>, <value>), ...])`: test `<test>` reruns this
///   binary's in-process `quiescent_after_*` tests and `abort_stops_a_posted_batch` in a child
///   process with that environment (for a native library that reads its transport choice from
///   the environment at start-up).
/// - `families = [<family>, ...]`: only these families (default: `checks`, `fault`,
///   `quiescence`, `counting`, `cross_process`, `stall`), for a second configuration of a
///   backend rerunning some of them inside its own module.
///
/// A cross-process family without its endpoint argument becomes one test,
/// `<module>::family_inapplicable` ([`assert_family_inapplicable`]), which fails if the backend
/// declares `cross_process`. Expressions and paths are evaluated inside the generated modules
/// too, which `use super::*`.
///
/// ```text
/// reshard_conformance::suite! {
///     harness = harness(),
///     requires = reshard_backend_cma::probe(),
///     counting = counting(),
///     cross_process = endpoint,
///     stall = stall_endpoint,
/// }
/// ```
#[macro_export]
macro_rules! suite {
    // Arguments, one at a time, into seven slots: harness, requires, counting, cross_process,
    // stall, quiescence_in_child, families. A slot filled twice matches no rule.
    (@parse [] $r:tt $c:tt $x:tt $s:tt $i:tt $f:tt harness = $v:expr $(, $($rest:tt)*)?) => {
        $crate::suite!(@parse [$v] $r $c $x $s $i $f $($($rest)*)?);
    };
    (@parse $h:tt [] $c:tt $x:tt $s:tt $i:tt $f:tt requires = $v:expr $(, $($rest:tt)*)?) => {
        $crate::suite!(@parse $h [$v] $c $x $s $i $f $($($rest)*)?);
    };
    (@parse $h:tt $r:tt [] $x:tt $s:tt $i:tt $f:tt counting = $v:expr $(, $($rest:tt)*)?) => {
        $crate::suite!(@parse $h $r [$v] $x $s $i $f $($($rest)*)?);
    };
    (@parse $h:tt $r:tt $c:tt [] $s:tt $i:tt $f:tt cross_process = $v:path
        $(, $($rest:tt)*)?) => {
        $crate::suite!(@parse $h $r $c [$v] $s $i $f $($($rest)*)?);
    };
    (@parse $h:tt $r:tt $c:tt $x:tt [] $i:tt $f:tt stall = $v:path $(, $($rest:tt)*)?) => {
        $crate::suite!(@parse $h $r $c $x [$v] $i $f $($($rest)*)?);
    };
    (@parse $h:tt $r:tt $c:tt $x:tt $s:tt [] $f:tt
        quiescence_in_child = ($test:ident, env = [$($env:tt)*]) $(, $($rest:tt)*)?) => {
        $crate::suite!(@parse $h $r $c $x $s [$test [$($env)*]] $f $($($rest)*)?);
    };
    (@parse $h:tt $r:tt $c:tt $x:tt $s:tt $i:tt []
        families = [$($family:ident),+ $(,)?] $(, $($rest:tt)*)?) => {
        $crate::suite!(@parse $h $r $c $x $s $i [$($family)+] $($($rest)*)?);
    };
    (@parse $h:tt [] $c:tt $x:tt $s:tt $i:tt $f:tt) => {
        $crate::suite!(@parse $h [::std::result::Result::Ok(())] $c $x $s $i $f);
    };
    (@parse $h:tt $r:tt $c:tt $x:tt $s:tt $i:tt []) => {
        $crate::suite!(@parse $h $r $c $x $s $i
            [checks fault quiescence counting cross_process stall]);
    };
    (@parse $h:tt $r:tt $c:tt $x:tt $s:tt $i:tt [$($family:ident)+]) => {
        $(
            $crate::suite!(@family $family $h $r $c $x $s);
        )+
        $crate::suite!(@in_child $h $r $i);
    };
    (@parse $($rest:tt)*) => {
        ::std::compile_error!(::std::concat!(
            "suite!: unknown, repeated or malformed argument at: ",
            ::std::stringify!($($rest)*)
        ));
    };

    (@in_child $h:tt $r:tt []) => {};
    (@in_child [$h:expr] [$r:expr] [$test:ident [$($env:tt)*]]) => {
        $crate::quiescence_tests_in_child!(
            $test,
            &$crate::Harness::name(&$h).to_owned(),
            env = [$($env)*],
            requires = $r
        );
    };
    (@in_child [] $r:tt $i:tt) => {
        ::std::compile_error!("`quiescence_in_child` needs `harness = ...`");
    };

    // Families whose input is missing: a compile error, or for a cross-process family the
    // test that says it is inapplicable.
    (@family counting $h:tt $r:tt [] $x:tt $s:tt) => {
        ::std::compile_error!(
            "the counting family needs `counting = ...` (or leave it out of `families`)"
        );
    };
    (@family checks [] $($rest:tt)*) => {
        ::std::compile_error!("the checks family needs `harness = ...`");
    };
    (@family fault [] $($rest:tt)*) => {
        ::std::compile_error!("the fault family needs `harness = ...`");
    };
    (@family quiescence [] $($rest:tt)*) => {
        ::std::compile_error!("the quiescence family needs `harness = ...`");
    };
    (@family cross_process [] $($rest:tt)*) => {
        ::std::compile_error!("the cross_process family needs `harness = ...`");
    };
    (@family stall [] $($rest:tt)*) => {
        ::std::compile_error!("the stall family needs `harness = ...`");
    };
    (@family cross_process [$h:expr] [$r:expr] $c:tt [] $s:tt) => {
        $crate::suite!(@inapplicable cross_process CrossProcess $h, $r);
    };
    (@family stall [$h:expr] [$r:expr] $c:tt $x:tt []) => {
        $crate::suite!(@inapplicable stall Stall $h, $r);
    };

    (@family checks [$h:expr] [$r:expr] $c:tt $x:tt $s:tt) => {
        $crate::conformance_tests!(@checks $h, $r, Checks);
    };
    (@family fault [$h:expr] [$r:expr] $c:tt $x:tt $s:tt) => {
        $crate::fault_tests!($h, requires = $r);
    };
    (@family quiescence [$h:expr] [$r:expr] $c:tt $x:tt $s:tt) => {
        $crate::quiescence_tests!($h, requires = $r);
    };
    (@family counting $h:tt [$r:expr] [$c:expr] $x:tt $s:tt) => {
        $crate::counting_tests!($c, requires = $r);
    };
    (@family cross_process [$h:expr] [$r:expr] $c:tt [$x:path] $s:tt) => {
        /// The suite with every cluster's publishers in a child process (this test binary
        /// re-executed), so every read crosses a process boundary.
        mod cross_process {
            #[allow(unused_imports)]
            use super::*;

            fn scheme() -> ::std::string::String {
                $crate::Harness::name(&$h).to_owned()
            }

            $crate::cross_process_conformance_tests!(&scheme(), $x, requires = $r);
        }
    };
    (@family stall [$h:expr] [$r:expr] $c:tt $x:tt [$s:path]) => {
        /// The in-flight safety tests that kill or stop the publishers' process, with the
        /// `stall` endpoint's short no-progress bound.
        mod stall {
            #[allow(unused_imports)]
            use super::*;

            fn scheme() -> ::std::string::String {
                $crate::Harness::name(&$h).to_owned()
            }

            $crate::cross_process_quiescence_tests!(&scheme(), $s, requires = $r);
        }
    };
    (@inapplicable $module:ident $family:ident $h:expr, $r:expr) => {
        /// The family this backend's declared capabilities leave out (see
        /// `reshard_conformance::suite::Family::inapplicable`).
        mod $module {
            #[allow(unused_imports)]
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn family_inapplicable() {
                $crate::suite::assert_family_inapplicable(
                    &$h,
                    $r,
                    $crate::suite::Family::$family,
                );
            }
        }
    };
    (@family $($rest:tt)*) => {
        ::std::compile_error!(::std::concat!(
            "suite!: unknown family in `families = [...]`: ",
            ::std::stringify!($($rest)*)
        ));
    };

    // The entry point: named arguments, see the documentation above.
    ($($args:tt)+) => {
        $crate::suite!(@parse [] [] [] [] [] [] [] $($args)+);
    };
}
