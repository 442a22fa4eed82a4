//! A publisher's hold on its rank through etcd outages, against a real etcd of each test's own
//! (scripts/etcd.sh; stopped with SIGSTOP or restarted on its data, which would disturb the
//! other tests' etcd): the same lease through a pause shorter than the TTL and through a
//! restart; the same incarnation under a new lease after a pause longer than the TTL; and a
//! process that lost its rank to another never overwrites or deletes the new holder's record.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use etcd_client::Client;
use reshard_core::rendezvous::{discover, Announced, Announcement, Rendezvous, Want};
use reshard_core::ErrorKind;
use reshard_rendezvous::{Etcd, EtcdOptions};

/// An etcd of one test: its folder, client port and process; stopped and removed when dropped.
struct Server {
    dir: PathBuf,
    url: String,
    port: String,
}

impl Server {
    /// Starts one, or `None` (loudly) where etcd is not installed and not required.
    fn start(name: &str) -> Option<Server> {
        if !common::etcd_installed() {
            return None;
        }
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("etcd-outage-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // Made here, not by the script: its watcher removes a folder it made once etcd exits,
        // and a restart must find the data again.
        std::fs::create_dir_all(&dir).unwrap();
        let mut s = Server {
            dir,
            url: String::new(),
            port: String::new(),
        };
        s.url = s.run_start(None);
        s.port = s.url.rsplit(':').next().unwrap().to_string();
        Some(s)
    }

    fn run_start(&self, port: Option<&str>) -> String {
        common::etcd_sh(&["start".as_ref(), self.dir.as_os_str()], port)
    }

    fn pid(&self) -> String {
        std::fs::read_to_string(self.dir.join("pid"))
            .unwrap()
            .trim()
            .to_string()
    }

    fn signal(&self, sig: &str) {
        assert!(Command::new("kill")
            .args([sig, &self.pid()])
            .status()
            .unwrap()
            .success());
    }

    /// Stops etcd (SIGTERM, as an upgrade would), keeps its data, and starts it again on the
    /// same port after `down`.
    fn restart(&self, down: Duration) {
        let pid = self.pid();
        self.signal("-TERM");
        let alive = || Path::new(&format!("/proc/{pid}")).exists();
        let deadline = Instant::now() + Duration::from_secs(10);
        while alive() {
            assert!(Instant::now() < deadline, "etcd did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(down);
        assert_eq!(self.run_start(Some(&self.port)), self.url);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-CONT", &self.pid()]).status();
        let _ = Command::new("bash")
            .arg(common::script())
            .arg("stop")
            .arg(&self.dir)
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Options with `ttl_s` and short request timeouts, so a write into a stopped etcd fails
/// within the test rather than after the default 30 s.
fn options(ttl_s: u64) -> EtcdOptions {
    EtcdOptions {
        lease_ttl: Duration::from_secs(ttl_s),
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(2),
    }
}

fn announcement(model: &str, incarnation: u64) -> Announcement {
    Announcement {
        model: model.into(),
        rank: 0,
        world: 1,
        step: 1,
        transport: "loopback".into(),
        incarnation,
        table: Bytes::from(vec![7u8; 700_000]),
        metadata: Bytes::from_static(b"meta 0"),
        config: Bytes::from_static(br#"{"name":"qwen"}"#),
    }
}

fn want(model: &str) -> Want {
    Want {
        model: model.into(),
        after_step: None,
        timeout: Duration::from_secs(20),
    }
}

/// The lease rank 0's member record of `model` is attached to, with the record's JSON and its
/// modification revision; `None` when there is no record.
async fn record(raw: &mut Client, model: &str) -> Option<(i64, serde_json::Value, i64)> {
    let r = raw
        .get(format!("/reshard/v1/{model}/members/00000000"), None)
        .await
        .unwrap();
    r.kvs().first().map(|kv| {
        (
            kv.lease(),
            serde_json::from_slice(kv.value()).unwrap(),
            kv.mod_revision(),
        )
    })
}

/// Through a SIGSTOP of etcd shorter than the TTL, and through a restart of etcd on its data
/// (which extends every lease), the publisher keeps the same lease; through a SIGSTOP longer
/// than the TTL (etcd expires the lease when it runs again), it announces again under a new
/// lease with the same incarnation, step, readiness, table and metadata, and a receiver's
/// discovery finds it. Writes while etcd is stopped fail as transport errors, never as a lost
/// rank, and succeed once etcd is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_holds_its_rank_through_etcd_pauses_and_restarts() {
    let Some(server) = Server::start("pause") else {
        return;
    };
    let model = "outage";
    let ttl = 4;
    let publisher = Etcd::connect(&server.url, options(ttl)).await.unwrap();
    let receiver = Etcd::connect(&server.url, options(ttl)).await.unwrap();
    let mut raw = Client::connect([server.url.replace("etcd://", "http://")], None)
        .await
        .unwrap();
    let a = announcement(model, 0xabc);
    let held = publisher.announce(a.clone()).await.unwrap();
    let (lease, first, _) = record(&mut raw, model).await.expect("announced");
    assert_eq!(first["incarnation"], 0xabc);

    // Shorter than the TTL but longer than two renewal periods (the stream surely breaks),
    // then twice the TTL: a keep-alive that did not reconnect would have lost the lease.
    server.signal("-STOP");
    tokio::time::sleep(Duration::from_secs(ttl) * 3 / 4).await;
    server.signal("-CONT");
    tokio::time::sleep(Duration::from_secs(2 * ttl)).await;
    held.check_alive().unwrap();
    assert_eq!(record(&mut raw, model).await.unwrap().0, lease);

    // A restart on the same data, down longer than the TTL: etcd extends its leases when it
    // starts, so the lease the keep-alive reconnects to is still the same.
    server.restart(Duration::from_secs(ttl + 2));
    let mut raw = Client::connect([server.url.replace("etcd://", "http://")], None)
        .await
        .unwrap();
    // etcd extends leases by the TTL and an election timeout when it starts: past both.
    tokio::time::sleep(Duration::from_secs(2 * ttl + 2)).await;
    held.check_alive().unwrap();
    assert_eq!(record(&mut raw, model).await.unwrap().0, lease);
    let found = discover(&receiver, &want(model)).await.unwrap();
    assert_eq!(found.announcements, vec![a.clone()]);

    // Longer than the TTL: etcd expires the lease (and the record and blobs) once it runs.
    server.signal("-STOP");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let e = held.unready().await.expect_err("etcd is stopped");
    assert!(
        matches!(e.kind(), ErrorKind::Transport | ErrorKind::Timeout),
        "{e}"
    );
    held.check_alive()
        .expect("a write failed, the rank is not lost");
    tokio::time::sleep(Duration::from_secs(ttl + 2)).await;
    server.signal("-CONT");
    let deadline = Instant::now() + Duration::from_secs(20);
    let (renewed, again) = loop {
        match record(&mut raw, model).await {
            Some((l, r, _)) if l != lease => break (l, r),
            _ => {}
        }
        assert!(Instant::now() < deadline, "never announced again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for field in ["incarnation", "step", "ready", "host", "pid", "transport"] {
        assert_eq!(again[field], first[field], "{field}");
    }
    held.check_alive().unwrap();
    let found = discover(&receiver, &want(model)).await.unwrap();
    assert_eq!(found.announcements, vec![a.clone()]);

    // The handle goes on under the new lease: it advances, and withdrawing removes the record.
    held.advance(2, Bytes::from_static(b"table 2"))
        .await
        .unwrap();
    let (l, r, _) = record(&mut raw, model).await.unwrap();
    assert_eq!((l, r["step"].as_u64()), (renewed, Some(2)));
    held.withdraw().await.unwrap();
    assert!(record(&mut raw, model).await.is_none());
}

/// A write of the rank's record that etcd does not answer is abandoned after one bounded
/// attempt (and tried again while the retry window lasts) instead of waiting out the client's
/// request timeout (30 s by default): the bound is what lets a publisher whose write went to a
/// member forwarding it to a dead leader try again after the election instead of 7 s later.
/// The failed write is retryable, the rank is not lost, and once etcd answers the same write
/// goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_write_is_abandoned_long_before_the_request_timeout() {
    let Some(server) = Server::start("unanswered") else {
        return;
    };
    let options = EtcdOptions {
        lease_ttl: Duration::from_secs(6),
        ..EtcdOptions::default()
    };
    assert_eq!(options.request_timeout, Duration::from_secs(30));
    let publisher = Etcd::connect(&server.url, options).await.unwrap();
    let held = publisher
        .announce(announcement("unanswered", 1))
        .await
        .unwrap();
    server.signal("-STOP");
    let started = Instant::now();
    let e = held.unready().await.expect_err("etcd is stopped");
    let took = started.elapsed();
    server.signal("-CONT");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    // Two attempts of 2 s at most fit the retry window of a 6 s TTL; 15 s leaves room for a
    // loaded machine and is half the request timeout the write waited for before.
    assert!(
        took < Duration::from_secs(15),
        "the unanswered write took {took:?} to fail: {e}"
    );
    held.check_alive()
        .expect("a write failed, the rank is not lost");
    held.unready().await.expect("etcd answers again");
}

/// Rank 0's holder A loses its rank and B claims it: A's lease revoked (as etcd expires a
/// lease whose keep-alive could not reach it: A's keys go with it), or A's record deleted while
/// its lease lives (the key is then B's while A's lease still is valid). A's next writes do not
/// overwrite B's record: A finds B live and fails naming it, for good; A's withdraw leaves B's
/// record; B serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_holder_never_overwrites_or_deletes_the_new_holders_record() {
    let Some(server) = Server::start("takeover") else {
        return;
    };
    for how in ["revoked", "deleted"] {
        lost_to_another(&server, how).await;
    }
}

async fn lost_to_another(server: &Server, how: &str) {
    let model = format!("takeover-{how}");
    let model = model.as_str();
    // A renews only every 10 s: it has not noticed the loss when it writes next.
    let a_side = Etcd::connect(&server.url, options(30)).await.unwrap();
    let b_side = Etcd::connect(&server.url, options(3)).await.unwrap();
    let mut raw = Client::connect([server.url.replace("etcd://", "http://")], None)
        .await
        .unwrap();
    let a: Box<dyn Announced> = a_side.announce(announcement(model, 0xa)).await.unwrap();
    let (a_lease, _, _) = record(&mut raw, model).await.unwrap();
    if how == "revoked" {
        raw.lease_revoke(a_lease).await.unwrap();
    } else {
        raw.delete(format!("/reshard/v1/{model}/members/00000000"), None)
            .await
            .unwrap();
    }
    assert!(record(&mut raw, model).await.is_none(), "{how}");
    let b_announcement = Announcement {
        step: 5,
        ..announcement(model, 0xb)
    };
    let b = b_side.announce(b_announcement.clone()).await.unwrap();
    let (b_lease, b_record, b_revision) = record(&mut raw, model).await.unwrap();

    for attempt in ["advance", "unready", "note"] {
        let e = match attempt {
            "advance" => a.advance(2, Bytes::from_static(b"A's table 2")).await,
            "unready" => a.unready().await,
            _ => a.set_note(Some("A's note".into())).await,
        }
        .expect_err("A lost its rank");
        assert_eq!(
            (e.kind(), e.context().owner),
            (ErrorKind::Config, Some(0)),
            "{how}, {attempt}: {e}"
        );
        let msg = e.to_string();
        for part in [
            "publisher rank 0 ".to_string(),
            format!("incarnation {:016x}", 0xb),
            format!("pid {}", std::process::id()),
        ] {
            assert!(
                msg.contains(&part),
                "{how}, {attempt}: {part:?} not in {msg}"
            );
        }
        assert_eq!(
            record(&mut raw, model).await.unwrap(),
            (b_lease, b_record.clone(), b_revision),
            "{how}, {attempt}: B's record untouched"
        );
    }
    assert_eq!(
        a.check_alive().unwrap_err().kind(),
        ErrorKind::Config,
        "{how}: lost for good"
    );
    a.withdraw().await.unwrap();
    assert_eq!(
        record(&mut raw, model).await.unwrap(),
        (b_lease, b_record, b_revision),
        "{how}: A's withdraw leaves B's record"
    );
    let receiver = Etcd::connect(&server.url, options(3)).await.unwrap();
    let found = discover(&receiver, &want(model)).await.unwrap();
    assert_eq!(found.announcements, vec![b_announcement]);
    b.check_alive().unwrap();
    b.withdraw().await.unwrap();
    assert!(record(&mut raw, model).await.is_none(), "{how}: B withdrew");
}

/// A claim released while etcd does not answer (SIGSTOP, as a stalled leader): the release
/// gives up after its own short bound with a `Transport` error saying the claim is retried in
/// the background, and once etcd answers again the claim is gone within a request or two, long
/// before its 10 s lease could expire, while the receiver's connection lives on (issue 42,
/// item 1: before, the claim stayed under the connection's lease, renewed for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_release_failed_is_revoked_once_etcd_answers() {
    use reshard_core::rendezvous::{wait_released, ReadClaim};

    let Some(server) = Server::start("release") else {
        return;
    };
    let model = "release_failed";
    let mut o = options(10);
    o.request_timeout = Duration::from_secs(10);
    let reader = Etcd::connect(&server.url, o.clone()).await.unwrap();
    let publisher = Etcd::connect(&server.url, o).await.unwrap();
    let held = reader
        .claim_reading(ReadClaim {
            model: model.into(),
            step: 5,
            reader: "receiver rank 0".into(),
            ranks: vec![(0, 300)],
        })
        .await
        .unwrap();
    let (claims, _) = publisher.readers(model).await.unwrap();
    assert_eq!(claims.len(), 1, "{claims:?}");
    server.signal("-STOP");
    let e = held.release().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
    assert!(e.message().contains("retried in the background"), "{e}");
    server.signal("-CONT");
    let back = Instant::now();
    wait_released(&publisher, model, 0, 300, Duration::from_secs(30))
        .await
        .unwrap();
    let gone = back.elapsed();
    assert!(
        gone < Duration::from_secs(5),
        "the claim lasted {gone:?} after etcd answered again (its lease TTL is 10 s)"
    );
    drop(reader);
}
