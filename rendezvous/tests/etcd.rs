//! The rendezvous suite against a real etcd, started for this test binary by scripts/etcd.sh on
//! 127.0.0.1 with a temporary data dir. Publishers and receivers use separate connections.

mod suite;

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use reshard_core::rendezvous::Rendezvous;
use reshard_core::ErrorKind;
use reshard_rendezvous::{Etcd, EtcdOptions};
use suite::Sides;

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/etcd.sh")
}

/// The endpoint of this binary's etcd, or `None` (with a loud note) where etcd is not installed
/// and the environment does not require it (`RESHARD_REQUIRE_BACKENDS` set, as in CI).
fn endpoint() -> Option<String> {
    // One etcd per test binary, stopped by scripts/etcd.sh's watcher once the binary exits.
    static SERVER: OnceLock<Option<String>> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            let installed = Command::new("etcd").arg("--version").output().is_ok();
            if !installed {
                assert!(
                    std::env::var_os("RESHARD_REQUIRE_BACKENDS").is_none(),
                    "etcd is required here: run scripts/install-deps.sh"
                );
                eprintln!("SKIPPED: etcd is not installed (scripts/install-deps.sh installs it)");
                return None;
            }
            let dir = std::env::temp_dir().join(format!("reshard-etcd-{}", std::process::id()));
            let out = Command::new("bash")
                .arg(script())
                .args(["start".as_ref(), dir.as_os_str()])
                // A static is never dropped: the script's watcher stops etcd once we exit.
                .env("ETCD_OWNER_PID", std::process::id().to_string())
                .output()
                .expect("run scripts/etcd.sh");
            assert!(
                out.status.success(),
                "scripts/etcd.sh start failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            Some(String::from_utf8(out.stdout).unwrap().trim().to_string())
        })
        .clone()
}

fn options() -> EtcdOptions {
    EtcdOptions {
        lease_ttl: Duration::from_secs(1),
        ..EtcdOptions::default()
    }
}

/// Two connections to the same etcd; every test uses its own model name (prefix), so the tests
/// of this binary run in parallel without seeing each other.
async fn sides(model: &str) -> Option<Sides> {
    let url = endpoint()?;
    let publishers = Etcd::connect(&url, options()).await.expect("connect");
    let receivers = Etcd::connect(&url, options()).await.expect("connect");
    Some(Sides {
        publishers: Arc::new(publishers),
        receivers: Arc::new(receivers),
        gone_within: Duration::from_secs(3),
        model: model.to_string(),
    })
}

macro_rules! suite_tests {
    ($($name:ident $(($arg:expr))?),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let Some(s) = sides(stringify!($name)).await else { return };
            suite::$name(&s $(, $arg)?).await;
        }
    )*};
}

suite_tests!(
    a_receiver_started_first_waits_for_every_publisher,
    a_timeout_names_who_was_seen_missing_and_behind,
    an_unready_publisher_holds_discovery_until_it_advances,
    discovery_never_mixes_steps_while_publishers_advance(60),
    a_dropped_handle_is_a_publisher_gone_and_wakes_watchers,
    a_restarted_rank_replaces_the_old_one,
    large_tables_arrive_intact,
    a_live_publisher_outlasts_its_lease,
    a_disagreeing_architecture_is_refused,
    a_note_is_shown_with_the_member_and_clears,
);

#[tokio::test]
async fn an_unreachable_etcd_is_a_clear_error_naming_it() {
    let mut o = options();
    o.connect_timeout = Duration::from_millis(300);
    o.request_timeout = Duration::from_millis(300);
    let e = Etcd::connect("etcd://127.0.0.1:1", o)
        .await
        .err()
        .expect("refused");
    assert!(
        matches!(e.kind(), ErrorKind::Transport | ErrorKind::Timeout),
        "{e}"
    );
    assert!(e.to_string().contains("etcd://127.0.0.1:1"), "{e}");
    let e = Etcd::connect("http://x", options())
        .await
        .err()
        .expect("not etcd");
    assert_eq!(e.kind(), ErrorKind::Config);
}

#[tokio::test]
async fn models_are_listed_by_their_names() {
    let Some(url) = endpoint() else { return };
    let etcd = Etcd::connect(&url, options()).await.unwrap();
    let mut a = suite::announcement(0, 1, 1);
    a.model = "Qwen/Qwen3-30B-A3B".into();
    let held = etcd.announce(a).await.unwrap();
    assert!(etcd
        .models()
        .await
        .unwrap()
        .contains(&"Qwen/Qwen3-30B-A3B".to_string()));
    held.withdraw().await.unwrap();
}
