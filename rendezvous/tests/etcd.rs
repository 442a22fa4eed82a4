//! The rendezvous suite against a real etcd, started for this test binary by scripts/etcd.sh on
//! 127.0.0.1 with a temporary data dir. Publishers and receivers use separate connections.

mod common;
mod suite;

use std::sync::OnceLock;
use std::time::Duration;

use reshard_core::rendezvous::Rendezvous;
use reshard_core::ErrorKind;
use reshard_rendezvous::{Etcd, EtcdOptions};
use suite::Sides;

/// The endpoint of this binary's etcd, or `None` (with a loud note) where etcd is not installed
/// and the environment does not require it (`RESHARD_REQUIRE_BACKENDS` set, as in CI).
fn endpoint() -> Option<String> {
    // One etcd per test binary, stopped by scripts/etcd.sh's watcher once the binary exits.
    static SERVER: OnceLock<Option<String>> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            if !common::etcd_installed() {
                return None;
            }
            let dir = std::env::temp_dir().join(format!("reshard-etcd-{}", std::process::id()));
            Some(common::etcd_sh(&["start".as_ref(), dir.as_os_str()], None))
        })
        .clone()
}

fn options() -> EtcdOptions {
    common::options(1)
}

/// Options with a lease far longer than any test here: a test runs for seconds, and a
/// keep-alive starved on a busy machine must not remove a publisher its checks rely on.
fn long_lease() -> EtcdOptions {
    EtcdOptions {
        lease_ttl: Duration::from_secs(30),
        ..options()
    }
}

/// Suite announcement `rank` of `world` at step 1, of `model`.
fn announcement_of(model: &str, rank: u32, world: u32) -> reshard_core::rendezvous::Announcement {
    let mut a = suite::announcement(rank, world, 1);
    a.model = model.into();
    a
}

/// The suite's two sides on this binary's etcd.
async fn sides(model: &str) -> Option<Sides> {
    let (publishers, receivers) = common::two_connections(&endpoint()?).await;
    Some(Sides {
        publishers,
        receivers,
        gone_within: Duration::from_secs(3),
        model: model.to_string(),
    })
}

suite::suite_tests!(sides, 60);

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
    // A model with nothing but a stray key under `members/` (a non-canonical rank, garbage) is
    // not listed: no publisher announced it.
    let mut raw = etcd_client::Client::connect([url.replace("etcd://", "http://")], None)
        .await
        .unwrap();
    for key in ["members/3", "members/not-a-rank"] {
        raw.put(format!("/reshard/v1/stray/{key}"), "{}", None)
            .await
            .unwrap();
    }
    let models = etcd.models().await.unwrap();
    assert!(!models.contains(&"stray".to_string()), "{models:?}");
}

/// The field a refused member record's error names (`field `...``), after checking the error is
/// a `Decode` owned by `rank`.
fn refused_field(e: &reshard_core::Error, rank: u32) -> Option<String> {
    assert_eq!(
        (e.kind(), e.context().owner),
        (ErrorKind::Decode, Some(rank)),
        "{e}"
    );
    let msg = e.message();
    let start = msg.find("field `")? + "field `".len();
    Some(msg[start..start + msg[start..].find('`')?].to_string())
}

/// Member records garbled field by field (counts and sizes far beyond the blobs they describe,
/// another rank's blobs, a world of u32::MAX, not JSON at all), written over a live publisher's
/// record as a buggy or hostile process could: the member list leaves that rank out (the others
/// stay visible), its fetch is a `Decode` error naming the rank and the field before any blob is
/// sized from it, discovery waits for it instead of failing, and it completes once the record is
/// good again. Before these checks a blob size of u64::MAX panicked in `Vec::with_capacity`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_member_records_are_skipped_and_refused_naming_the_field() {
    use etcd_client::{Client, DeleteOptions, GetOptions};
    use reshard_core::rendezvous::{discover, Want};

    let Some(url) = endpoint() else { return };
    let model = "bad_member_records";
    let publishers = Etcd::connect(&url, long_lease()).await.unwrap();
    let receivers = Etcd::connect(&url, long_lease()).await.unwrap();
    let announce = |rank| announcement_of(model, rank, 2);
    let held = [
        publishers.announce(announce(0)).await.unwrap(),
        publishers.announce(announce(1)).await.unwrap(),
    ];
    let mut raw = Client::connect([url.replace("etcd://", "http://")], None)
        .await
        .unwrap();
    let key = |rank: u32| format!("/reshard/v1/{model}/members/{rank:08}");
    let read = |v: &[u8]| serde_json::from_slice::<serde_json::Value>(v).unwrap();
    let r = raw.get(key(1), None).await.unwrap();
    let good = read(r.kvs()[0].value());
    let r = raw.get(key(0), None).await.unwrap();
    let rank0_table = read(r.kvs()[0].value())["table"]["prefix"].clone();
    let want = |timeout_ms| Want {
        model: model.into(),
        after_step: None,
        timeout: Duration::from_millis(timeout_ms),
    };

    let cases: Vec<(Option<&str>, Vec<u8>)> = {
        let mut cases = Vec::new();
        for (field, value) in [
            ("world", serde_json::json!(u32::MAX)),
            ("rank", serde_json::json!(0)),
            ("table.bytes", serde_json::json!(u64::MAX)),
            ("table.chunks", serde_json::json!(u32::MAX)),
            ("metadata.bytes", serde_json::json!(1u64 << 40)),
            ("config.chunks", serde_json::json!(1000)),
            ("table.prefix", rank0_table),
            ("transport", serde_json::json!("x".repeat(100_000))),
        ] {
            let mut v = good.clone();
            let mut at = &mut v;
            for part in field.split('.') {
                at = &mut at[part];
            }
            *at = value;
            cases.push((Some(field), serde_json::to_vec(&v).unwrap()));
        }
        cases.push((None, b"garbage".to_vec()));
        cases.push((None, b"{}".to_vec()));
        cases
    };
    // A key under members/ that names no rank is left out as well.
    let stray = format!("/reshard/v1/{model}/members/stray");
    raw.put(stray.as_str(), "x", None).await.unwrap();
    for (field, value) in cases {
        raw.put(key(1), value, None).await.unwrap();
        let (members, _) = receivers.members(model).await.expect("one bad record");
        let ranks: Vec<u32> = members.iter().map(|m| m.rank).collect();
        assert_eq!(ranks, [0], "{field:?}");
        let e = receivers.fetch(model, &[0, 1]).await.unwrap_err();
        let named = refused_field(&e, 1);
        if field.is_some() {
            assert_eq!(named.as_deref(), field, "{e}");
        }
        let e = discover(&receivers, &want(200)).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout, "{field:?}: {e}");
        assert!(e.to_string().contains("missing ranks 1"), "{e}");
    }
    raw.put(key(1), serde_json::to_vec(&good).unwrap(), None)
        .await
        .unwrap();
    let found = discover(&receivers, &want(5_000)).await.unwrap();
    assert_eq!(found.announcements[1], announce(1));
    for h in held {
        h.withdraw().await.unwrap();
    }
    // The records put here are on no lease: remove them.
    raw.delete(
        format!("/reshard/v1/{model}/"),
        Some(DeleteOptions::new().with_prefix()),
    )
    .await
    .unwrap();
    let left = raw
        .get(
            format!("/reshard/v1/{model}/"),
            Some(GetOptions::new().with_prefix().with_count_only()),
        )
        .await
        .unwrap();
    assert_eq!(left.count(), 0);
}

/// A receiver that dies mid-read (its connection gone without releasing, as a killed process's
/// would be) holds a publisher only until its lease expires; a garbage key under `readers/`
/// never holds one (it is skipped, not an error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_readers_claim_expires_and_garbage_claims_are_skipped() {
    use etcd_client::Client;
    use reshard_core::rendezvous::{wait_released, ReadClaim};

    let Some(url) = endpoint() else { return };
    let model = "dead_reader";
    let mut raw = Client::connect([url.replace("etcd://", "http://")], None)
        .await
        .unwrap();
    raw.put(
        format!("/reshard/v1/{model}/readers/zz-1"),
        "{garbage",
        None,
    )
    .await
    .unwrap();
    let publisher = Etcd::connect(&url, options()).await.unwrap();
    let quick = wait_released(&publisher, model, 0, 100, Duration::from_secs(5)).await;
    assert_eq!(quick.unwrap().readers, Vec::<String>::new());

    // A receiver "process" of its own runtime, which dies holding its claim: no release, no
    // drop of the handle, and nothing of it runs any more (its runtime is shut down), so only
    // the claim's lease running out can end the claim.
    let reader_url = url.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let reader = Etcd::connect(&reader_url, options()).await.unwrap();
            let claim = reader
                .claim_reading(ReadClaim {
                    model: model.into(),
                    step: 2,
                    reader: "receiver rank 0, about to die".into(),
                    ranks: vec![(0, 100)],
                })
                .await
                .unwrap();
            std::mem::forget(claim);
            std::mem::forget(reader);
        });
        rt.shutdown_background();
    })
    .join()
    .unwrap();
    let released = wait_released(&publisher, model, 0, 100, Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(
        released.readers,
        ["receiver rank 0, about to die reading step 2"]
    );
    // The 1 s lease, etcd's half-second expiry tick and slack; far below the 20 s allowed.
    assert!(released.waited < Duration::from_secs(10), "{released:?}");
}

/// A claim's handle dropped where no async runtime runs (as Python's cancel and Ctrl-C drop a
/// refit), by a receiver that lives on: the claim's lease is revoked at once, not left to a
/// lease the living receiver renews for ever (issue 42, item 1). A 10 s TTL, so "at once" and
/// "expired" are told apart.
#[tokio::test]
async fn a_claim_dropped_outside_any_runtime_is_gone_at_once() {
    use reshard_core::rendezvous::{wait_released, ReadClaim};

    let Some(url) = endpoint() else { return };
    let model = "dropped_claim";
    let publisher = Etcd::connect(&url, options()).await.unwrap();
    let reader = Etcd::connect(&url, common::options(10)).await.unwrap();
    for how in ["dropped on a thread without a runtime", "its task aborted"] {
        let claim = ReadClaim {
            model: model.into(),
            step: 3,
            reader: format!("receiver rank 1, {how}"),
            ranks: vec![(1, 200)],
        };
        if how.starts_with("dropped") {
            let held = reader.claim_reading(claim).await.unwrap();
            std::thread::spawn(move || {
                assert!(tokio::runtime::Handle::try_current().is_err());
                drop(held);
            })
            .join()
            .unwrap();
        } else {
            // A refit task cancelled while it holds its claim (its reads aborted).
            let reader = reader.clone();
            let (claimed, took) = tokio::sync::oneshot::channel();
            let task = tokio::spawn(async move {
                let held = reader.claim_reading(claim).await.unwrap();
                claimed.send(()).unwrap();
                std::future::pending::<()>().await;
                drop(held);
            });
            took.await.unwrap();
            task.abort();
            assert!(task.await.unwrap_err().is_cancelled());
        }
        let released = wait_released(&publisher, model, 1, 200, Duration::from_secs(20))
            .await
            .unwrap();
        // Revoked by the claim's keeper: one etcd request, far below the 10 s TTL.
        assert!(
            released.waited < Duration::from_secs(3),
            "{how}: {released:?}"
        );
    }
    // The receiver's connection lives on and claims again as before.
    let again = reader
        .claim_reading(ReadClaim {
            model: model.into(),
            step: 4,
            reader: "receiver rank 1".into(),
            ranks: vec![(1, 200)],
        })
        .await
        .unwrap();
    again.release().await.unwrap();
    let (claims, _) = publisher.readers(model).await.unwrap();
    assert!(claims.is_empty(), "{claims:?}");
}

/// A rank's record also written under another spelling of its key (`members/3` beside
/// `members/00000003`, put directly as a buggy tool or an older writer could): only the 8-digit
/// key is a member, the other is skipped (logged naming the key) and never counts. A `members/3`
/// for a rank that is not announced does not complete the set with rank 3 missing (before, it
/// counted as rank 3 and discovery fetched a rank that did not exist until its timeout); once
/// rank 3 is announced, a copy of its record under `members/3` does not make five records of
/// a world of four (before, discovery never completed). Prints what it measured, for the
/// chaos table's row (docs/deployment.md, section 7).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_spelled_twice_under_members_counts_once() {
    use etcd_client::{Client, DeleteOptions};
    use reshard_core::rendezvous::{discover, Want};

    let Some(url) = endpoint() else { return };
    let model = "rank_spelled_twice";
    let publishers = Etcd::connect(&url, long_lease()).await.unwrap();
    let receivers = Etcd::connect(&url, long_lease()).await.unwrap();
    let announce = |rank| announcement_of(model, rank, 4);
    let mut held = Vec::new();
    for rank in 0..3 {
        held.push(publishers.announce(announce(rank)).await.unwrap());
    }
    let mut raw = Client::connect([url.replace("etcd://", "http://")], None)
        .await
        .unwrap();
    let members = format!("/reshard/v1/{model}/members/");
    let read = |v: &[u8]| serde_json::from_slice::<serde_json::Value>(v).unwrap();
    let want = |timeout_ms| Want {
        model: model.into(),
        after_step: None,
        timeout: Duration::from_millis(timeout_ms),
    };
    let ranks =
        |m: &[reshard_core::rendezvous::Member]| m.iter().map(|m| m.rank).collect::<Vec<_>>();

    // Rank 3 is not announced; a record for it under `members/3` (rank 2's, made rank 3's so
    // that it would pass every check of a record under a canonical key).
    let r = raw.get(format!("{members}00000002"), None).await.unwrap();
    let mut forged = read(r.kvs()[0].value());
    forged["rank"] = 3.into();
    for blob in ["table", "metadata", "config"] {
        let prefix = forged[blob]["prefix"].as_str().unwrap().to_string();
        forged[blob]["prefix"] = prefix.replace("/00000002/", "/00000003/").into();
    }
    raw.put(
        format!("{members}3"),
        serde_json::to_vec(&forged).unwrap(),
        None,
    )
    .await
    .unwrap();
    let (listed, _) = receivers.members(model).await.unwrap();
    assert_eq!(ranks(&listed), [0, 1, 2]);
    let e = discover(&receivers, &want(300)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    let msg = e.to_string();
    for part in ["saw 3 of 4 publishers, 3 ready", "missing ranks 3"] {
        assert!(msg.contains(part), "{part:?} not in {msg}");
    }

    // Rank 3 announced; its record copied under `members/3` and `members/000000003`.
    held.push(publishers.announce(announce(3)).await.unwrap());
    let r = raw.get(format!("{members}00000003"), None).await.unwrap();
    let copy = r.kvs()[0].value().to_vec();
    for spelling in ["3", "000000003"] {
        raw.put(format!("{members}{spelling}"), copy.clone(), None)
            .await
            .unwrap();
    }
    let start = std::time::Instant::now();
    let found = discover(&receivers, &want(5_000)).await.unwrap();
    let took = start.elapsed();
    let found_ranks: Vec<u32> = found.announcements.iter().map(|a| a.rank).collect();
    assert_eq!(found_ranks, [0, 1, 2, 3]);
    assert_eq!(found.announcements[3], announce(3));
    assert!(
        found.waited_through.is_empty(),
        "{:?}",
        found.waited_through
    );
    let (listed, _) = receivers.members(model).await.unwrap();
    assert_eq!(ranks(&listed), [0, 1, 2, 3]);
    eprintln!(
        "a rank spelled twice: discovery found step {} with ranks {found_ranks:?} in {:.3} s \
         beside members/3 and members/000000003 (nothing refused, nothing lost)",
        found.step,
        took.as_secs_f64()
    );

    for h in held {
        h.withdraw().await.unwrap();
    }
    // The keys put here are on no lease: remove them.
    raw.delete(
        format!("/reshard/v1/{model}/"),
        Some(DeleteOptions::new().with_prefix()),
    )
    .await
    .unwrap();
}

/// Blobs are read many chunks to a transaction (issue 42 item 7): tables of several chunks from
/// several ranks come back whole and in rank order; a transaction whose answer is too large to
/// decode (chunks rewritten larger than their record declares) is read again a chunk per
/// request, so the fetch fails as a bad blob naming its rank (`Decode`), never as etcd
/// unreachable.
#[tokio::test]
async fn blobs_of_many_chunks_are_read_whole_and_an_oversized_answer_names_the_rank() {
    use bytes::Bytes;
    use etcd_client::Client;
    use reshard_rendezvous::CHUNK_BYTES;

    let Some(url) = endpoint() else { return };
    let model = "many_chunks";
    let publishers = Etcd::connect(&url, long_lease()).await.unwrap();
    let receivers = Etcd::connect(&url, long_lease()).await.unwrap();
    // Rank r's table: 2 full chunks and a part of a third, every byte telling rank and place.
    let table = |rank: u32| {
        let n = 2 * CHUNK_BYTES + 1000 + rank as usize;
        Bytes::from(
            (0..n)
                .map(|i| (i * 7 + rank as usize) as u8)
                .collect::<Vec<u8>>(),
        )
    };
    let mut held = Vec::new();
    for rank in 0..3 {
        let mut a = suite::announcement(rank, 3, 1);
        a.model = model.into();
        a.table = table(rank);
        held.push(publishers.announce(a).await.unwrap());
    }
    let f = receivers.fetch(model, &[2, 0, 1]).await.unwrap();
    for (rank, f) in f.iter().enumerate() {
        assert_eq!(f.announcement.rank, rank as u32);
        assert!(
            f.announcement.table == table(rank as u32),
            "rank {rank}'s table"
        );
        assert_eq!(f.announcement.metadata, format!("meta {rank}").as_bytes());
    }
    for h in held {
        h.withdraw().await.unwrap();
    }
    // Small tables of 4 ranks, all in one transaction; ranks 1 to 3's rewritten at 1.4 MiB
    // each: that transaction's answer would be above the client's 4 MiB.
    let model = "many_chunks_oversized";
    let mut held = Vec::new();
    for rank in 0..4 {
        let mut a = suite::announcement(rank, 4, 1);
        a.model = model.into();
        held.push(publishers.announce(a).await.unwrap());
    }
    assert_eq!(
        receivers.fetch(model, &[0, 1, 2, 3]).await.unwrap().len(),
        4
    );
    let mut raw = Client::connect([url.replace("etcd://", "http://")], None)
        .await
        .unwrap();
    for rank in 1..4 {
        let r = raw
            .get(format!("/reshard/v1/{model}/members/{rank:08}"), None)
            .await
            .unwrap();
        let record: serde_json::Value = serde_json::from_slice(r.kvs()[0].value()).unwrap();
        let key = format!("{}000000", record["table"]["prefix"].as_str().unwrap());
        raw.put(key, vec![0u8; 1400 * 1024], None).await.unwrap();
    }
    let e = receivers.fetch(model, &[0, 1, 2, 3]).await.unwrap_err();
    assert_eq!(
        (e.kind(), e.context().owner),
        (ErrorKind::Decode, Some(1)),
        "{e}"
    );
    for h in held {
        h.withdraw().await.unwrap();
    }
}

/// Listings are read in pages at one revision (issue 42 item 7): claims whose listing is larger
/// than the client decodes in one answer (a publisher's fence under 128 receivers of 2,048
/// ranks lists 7 MB) are all listed, and so are more member keys than one page holds.
#[tokio::test]
async fn listings_larger_than_one_answer_are_read_in_pages() {
    use etcd_client::Client;

    let Some(url) = endpoint() else { return };
    let model = "listed_in_pages";
    let receivers = Etcd::connect(&url, long_lease()).await.unwrap();
    let mut raw = Client::connect([url.replace("etcd://", "http://")], None)
        .await
        .unwrap();
    // Four claims of about 1.4 MB each, 5.6 MB together: above the client's 4 MiB.
    let ranks: Vec<(u32, u64)> = (0..50_000).map(|r| (r, 1 << 60 | r as u64)).collect();
    for i in 0..4 {
        let claim = serde_json::json!({"step": 1, "reader": format!("big {i}"), "ranks": ranks});
        let value = serde_json::to_vec(&claim).unwrap();
        assert!(value.len() > 1_300_000, "{}", value.len());
        let key = format!("/reshard/v1/{model}/readers/{i:x}-0");
        raw.put(key, value, None).await.unwrap();
    }
    let (claims, _) = receivers.readers(model).await.expect("listed in pages");
    let mut readers: Vec<&str> = claims.iter().map(|c| c.reader.as_str()).collect();
    readers.sort_unstable();
    assert_eq!(readers, ["big 0", "big 1", "big 2", "big 3"]);
    assert!(claims.iter().all(|c| c.names(49_999, 1 << 60 | 49_999)));
    // 1,500 keys under members/ that name no rank, around one announced rank: more than a page.
    let publishers = Etcd::connect(&url, long_lease()).await.unwrap();
    let a = announcement_of(model, 0, 1);
    let held = publishers.announce(a).await.unwrap();
    for i in 0..1_500 {
        let key = format!("/reshard/v1/{model}/members/x{i:05}");
        raw.put(key, "not a record", None).await.unwrap();
    }
    let (members, _) = receivers.members(model).await.unwrap();
    assert_eq!(members.iter().map(|m| m.rank).collect::<Vec<_>>(), [0]);
    let f = receivers.fetch(model, &[0]).await.unwrap();
    assert_eq!(f[0].announcement.rank, 0);
    held.withdraw().await.unwrap();
}
