//! The rendezvous suite against the in-process hub.

mod suite;

use std::sync::Arc;
use std::time::Duration;

use reshard_rendezvous::InProcess;
use suite::Sides;

fn sides() -> Sides {
    let hub = Arc::new(InProcess::new());
    Sides {
        publishers: hub.clone(),
        receivers: hub,
        gone_within: Duration::from_millis(50),
        model: "qwen".into(),
    }
}

macro_rules! suite_tests {
    ($($name:ident $(($arg:expr))?),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            suite::$name(&sides() $(, $arg)?).await;
        }
    )*};
}

suite_tests!(
    a_receiver_started_first_waits_for_every_publisher,
    a_timeout_names_who_was_seen_missing_and_behind,
    an_unready_publisher_holds_discovery_until_it_advances,
    discovery_never_mixes_steps_while_publishers_advance(3_000),
    a_dropped_handle_is_a_publisher_gone_and_wakes_watchers,
    one_holder_per_rank_and_a_restarted_rank_claims_it,
    large_tables_arrive_intact,
    a_live_publisher_outlasts_its_lease,
    a_disagreeing_architecture_is_refused,
    fetch_reports_each_records_readiness,
    a_record_not_ready_at_fetch_sends_discovery_round_again,
    a_world_above_the_limit_is_refused_at_announce,
    a_note_is_shown_with_the_member_and_clears,
    a_member_withdrawn_between_list_and_fetch_is_waited_for,
    an_unreachable_rendezvous_is_waited_through,
    a_broken_watch_is_waited_through,
    a_rendezvous_down_past_the_timeout_is_a_timeout_naming_the_failure,
);
