//! The rendezvous against a real 3-member etcd cluster on this machine (scripts/etcd.sh
//! start-cluster; docs/deployment.md, "An etcd cluster"): the whole rendezvous suite through the
//! list of all three endpoints, and the leader SIGKILLed mid-run costing no step: publishers stay
//! discoverable, advance, and are discovered at the next step while a new leader is elected and
//! one member is dead; then the member comes back.

mod common;
mod suite;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use bytes::Bytes;
use reshard_core::rendezvous::{discover, Announced, Rendezvous, Want};
use reshard_rendezvous::{Etcd, EtcdOptions};
use suite::Sides;

/// Members of every cluster here: the smallest that survives losing one.
const MEMBERS: usize = 3;

/// Runs scripts/etcd.sh with `args` (every member is stopped by the script's watcher once this
/// binary exits).
fn etcd_sh(args: &[&std::ffi::OsStr]) -> String {
    common::etcd_sh(args, None)
}

/// A private etcd cluster of [`MEMBERS`] members in `dir`, stopped when dropped.
struct Cluster {
    dir: PathBuf,
    /// `etcd://HOST:PORT,...`, member i the i-th.
    url: String,
}

impl Cluster {
    /// Starts a cluster in a fresh temporary folder named after `name`, or `None` where etcd is
    /// not installed.
    fn start(name: &str) -> Option<Cluster> {
        if !common::etcd_installed() {
            return None;
        }
        let dir = std::env::temp_dir().join(format!("reshard-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let url = etcd_sh(&[
            "start-cluster".as_ref(),
            dir.as_os_str(),
            MEMBERS.to_string().as_ref(),
        ]);
        assert_eq!(
            url.matches(',').count() + 1,
            MEMBERS,
            "one endpoint per member: {url}"
        );
        Some(Cluster { dir, url })
    }

    fn run(dir: &Path, cmd: &str, member: Option<usize>) -> String {
        let i = member.map(|i| i.to_string());
        let mut args: Vec<&std::ffi::OsStr> = vec![cmd.as_ref(), dir.as_os_str()];
        args.extend(i.as_deref().map(std::ffi::OsStr::new));
        etcd_sh(&args)
    }

    /// The script, off the runtime's threads (it waits for elections and members): keep-alive
    /// tasks must run meanwhile.
    async fn script(&self, cmd: &'static str, member: Option<usize>) -> String {
        let dir = self.dir.clone();
        tokio::task::spawn_blocking(move || Self::run(&dir, cmd, member))
            .await
            .unwrap()
    }

    /// The index of the current leader (a live member that says it leads).
    async fn leader(&self) -> usize {
        self.script("leader", None).await.parse().unwrap()
    }

    /// SIGKILLs member `i`: a crash, no goodbye to its peers.
    async fn kill(&self, i: usize) {
        self.script("kill-member", Some(i)).await;
    }

    /// Starts member `i` again on its data and waits until it is healthy.
    async fn restart(&self, i: usize) {
        self.script("restart-member", Some(i)).await;
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        Self::run(&self.dir, "stop", None);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The endpoint list of this binary's shared cluster (the suite's), or `None` without etcd.
fn shared() -> Option<String> {
    // One cluster for the suite, stopped by scripts/etcd.sh's watcher once the binary exits.
    static CLUSTER: OnceLock<Option<String>> = OnceLock::new();
    CLUSTER
        .get_or_init(|| {
            let c = Cluster::start("etcd-cluster")?;
            let url = c.url.clone();
            // A static is never dropped: the watcher stops it; forget, or this drop stops it now.
            std::mem::forget(c);
            Some(url)
        })
        .clone()
}

fn options() -> EtcdOptions {
    common::options(1)
}

/// The suite's two sides on the shared cluster, each connection given every member.
async fn sides(model: &str) -> Option<Sides> {
    let (publishers, receivers) = common::two_connections(&shared()?).await;
    Some(Sides {
        publishers,
        receivers,
        gone_within: Duration::from_secs(3),
        model: model.to_string(),
    })
}

suite::suite_tests!(sides, 60);

/// Asks each member of `url` on its own (a connection to that endpoint alone): every one must
/// answer, they must be [`MEMBERS`] distinct members of one cluster, and agree on a leader
/// among them.
async fn every_member_answers(url: &str) {
    let hosts: Vec<&str> = url.trim_start_matches("etcd://").split(',').collect();
    assert_eq!(hosts.len(), MEMBERS, "{url}");
    let mut members = Vec::new();
    for h in &hosts {
        let mut one = etcd_client::Client::connect([format!("http://{h}")], None)
            .await
            .unwrap();
        let list = one
            .member_list()
            .await
            .unwrap_or_else(|e| panic!("member {h}: {e}"));
        assert_eq!(list.members().len(), MEMBERS, "{h}");
        let status = one.status().await.unwrap();
        members.push((status.header().unwrap().member_id(), status.leader()));
    }
    let leaders: Vec<u64> = members.iter().map(|m| m.1).collect();
    assert!(leaders.iter().all(|&l| l == leaders[0]), "{members:?}");
    let mut ids: Vec<u64> = members.iter().map(|m| m.0).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), MEMBERS, "distinct members: {members:?}");
    assert!(ids.contains(&leaders[0]), "{members:?}");
}

/// The shared cluster really is [`MEMBERS`] members with one leader, and every endpoint the
/// script printed answers on its own (a list naming one member would make the failover tests
/// below meaningless).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_member_of_the_cluster_answers_on_its_own() {
    let Some(url) = shared() else { return };
    every_member_answers(&url).await;
}

/// A dead member is left out of a connection given every member, and taken back once it is up:
/// after the leader is SIGKILLed and a new one elected, every request through the connection
/// succeeds (without failover a share of them keeps going to the dead member, "connection
/// refused", for as long as it is down), and still does once the member is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_member_is_left_out_of_the_connection() {
    let Some(cluster) = Cluster::start("etcd-dead-member") else {
        return;
    };
    let etcd = Etcd::connect(&cluster.url, options()).await.unwrap();
    let model = "dead_member";
    let requests = |what: &'static str| {
        let etcd = etcd.clone();
        async move {
            for i in 0..40 {
                etcd.members(model)
                    .await
                    .unwrap_or_else(|e| panic!("{what}, request {i}: {e}"));
            }
        }
    };
    requests("all members up").await;
    let leader = cluster.leader().await;
    cluster.kill(leader).await;
    let new = cluster.leader().await;
    assert_ne!(new, leader);
    // Failover probes the members once a request fails (an idle, healthy connection costs etcd
    // no probes): requests go on until one lands on the dead member and fails, as a caller's
    // retry would; the probe round that failure starts takes the member out, and from then on
    // every request must succeed.
    for _ in 0..100 {
        if etcd.members(model).await.is_err() {
            break;
        }
    }
    let mut ok = false;
    for _ in 0..100 {
        if etcd.members(model).await.is_ok() {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok, "no request succeeded with member {leader} dead");
    // The probe round may still be asking the dead member (up to its 1 s timeout).
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    requests("member dead").await;
    cluster.restart(leader).await;
    every_member_answers(&cluster.url).await;
    requests("member back").await;
}

/// Killing the leader mid-run costs no step. Two publishers announced through the cluster
/// (every endpoint given) stay discoverable while the leader is SIGKILLed and Raft elects
/// another, advance to the next step with one member dead, and a receiver's `discover` finds
/// that step; they outlive their lease TTL several times over (the keep-alive survives the
/// election); the dead member comes back and the next step is found again. Twice, so the
/// connections lose a member they were not using and, most likely, one they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_costs_no_step() {
    let Some(cluster) = Cluster::start("etcd-leader-kill") else {
        return;
    };
    let model = "leader_kill";
    // The suite's short TTL: an election (about a second) and a lost keep-alive both show.
    let ttl = Duration::from_secs(2);
    let o = EtcdOptions {
        lease_ttl: ttl,
        ..options()
    };
    let publishers = Etcd::connect(&cluster.url, o.clone()).await.unwrap();
    let receivers = Etcd::connect(&cluster.url, o).await.unwrap();
    let announce = |rank, step| {
        let mut a = suite::announcement(rank, 2, step);
        a.model = model.into();
        a
    };
    let held: Vec<Box<dyn Announced>> = vec![
        publishers.announce(announce(0, 1)).await.unwrap(),
        publishers.announce(announce(1, 1)).await.unwrap(),
    ];
    let want = |after: Option<u64>| Want {
        model: model.into(),
        after_step: after,
        timeout: Duration::from_secs(20),
    };
    let found = discover(&receivers, &want(None)).await.unwrap();
    assert_eq!(found.step, 1);

    let mut step = 1;
    for round in 0..2 {
        let leader = cluster.leader().await;
        cluster.kill(leader).await;
        let killed = std::time::Instant::now();
        // At once, most likely before a new leader is elected: the announced step is still
        // there for a receiver.
        let found = discover(&receivers, &want(None))
            .await
            .unwrap_or_else(|e| panic!("round {round}, leader {leader} killed: {e}"));
        assert_eq!(found.step, step, "round {round}");
        // Both publishers advance with the leader dead, each write bounded by the publisher's
        // own attempt bound and retried on the new leader, not left to etcd's request timeout
        // (about 7 s for a write forwarded to the dead leader): issue 42 item 6.
        step += 1;
        for (rank, h) in held.iter().enumerate() {
            let began = std::time::Instant::now();
            h.advance(step, Bytes::from(format!("table {rank} {step}")))
                .await
                .unwrap_or_else(|e| panic!("round {round}, rank {rank} advancing: {e}"));
            let took = began.elapsed();
            println!(
                "round {round}: rank {rank} advanced {:.2} s after the leader was killed, its \
                 write took {:.2} s",
                killed.elapsed().as_secs_f64(),
                took.as_secs_f64()
            );
            assert!(
                took < Duration::from_secs(5),
                "round {round}, rank {rank}: a write took {took:?} across the election"
            );
        }
        let found = discover(&receivers, &want(Some(step - 1)))
            .await
            .unwrap_or_else(|e| panic!("round {round}, step {step}: {e}"));
        assert_eq!(found.step, step);
        for (rank, a) in found.announcements.iter().enumerate() {
            assert_eq!(a.table, format!("table {rank} {step}"), "round {round}");
        }
        let new = cluster.leader().await;
        assert_ne!(new, leader, "round {round}: a new leader among the living");
        // The keep-alives went through the election: each lease outlives its TTL.
        tokio::time::sleep(ttl * 3).await;
        for (rank, h) in held.iter().enumerate() {
            h.check_alive()
                .unwrap_or_else(|e| panic!("round {round}, rank {rank}: {e}"));
        }
        let (members, _) = receivers.members(model).await.unwrap();
        assert_eq!(members.len(), 2, "round {round}: {members:?}");
        // The killed member comes back, and the next step is found with all three up.
        cluster.restart(leader).await;
        every_member_answers(&cluster.url).await;
        step += 1;
        for (rank, h) in held.iter().enumerate() {
            h.advance(step, Bytes::from(format!("table {rank} {step}")))
                .await
                .unwrap();
        }
        let found = discover(&receivers, &want(Some(step - 1))).await.unwrap();
        assert_eq!(found.step, step, "round {round}");
    }
    for h in held {
        h.withdraw().await.unwrap();
    }
}

/// Announces `a` on `etcd`, again after each failure time mends (an election under way), as
/// `reshard publish` does; a lasting failure (another live holder: `Config`) is returned.
async fn announce_through(
    etcd: &Etcd,
    a: reshard_core::rendezvous::Announcement,
) -> reshard_core::Result<Box<dyn Announced>> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        match etcd.announce(a.clone()).await {
            Err(e)
                if matches!(
                    e.kind(),
                    reshard_core::ErrorKind::Transport | reshard_core::ErrorKind::Timeout
                ) && std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            r => return r,
        }
    }
}

/// Rank liveness is decided by the holder, not by lease TTLs (issue 42, item 4): an etcd
/// leader change refreshes every lease's TTL, a dead holder's too. A publisher restarted while
/// its dead predecessor's lease still lives, with the leader stopped while it waits (it hands
/// its leadership over), serves its rank once that lease has expired (it was refused before,
/// naming its own dead predecessor as renewed); and a second claimant of a live holder's rank,
/// waiting through the same change, is still refused, the live holder having answered its
/// probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_across_a_leader_change_serves_its_rank() {
    let Some(cluster) = Cluster::start("etcd-restart-election") else {
        return;
    };
    let model = "restart_election";
    let o = EtcdOptions {
        lease_ttl: Duration::from_secs(5),
        ..options()
    };
    let announce = |rank, incarnation| {
        let mut a = suite::announcement(rank, 2, 1);
        a.model = model.into();
        a.incarnation = incarnation;
        a
    };
    // The predecessor of rank 0 announces on a runtime of its own, then dies: its runtime shut
    // down, its handle never dropped, so nothing renews or revokes its lease.
    let url = cluster.url.clone();
    let first = announce(0, 1);
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let etcd = Etcd::connect(&url, o).await.unwrap();
            std::mem::forget(etcd.announce(first).await.unwrap());
            std::mem::forget(etcd);
        });
        rt.shutdown_background();
    })
    .join()
    .unwrap();
    let o = EtcdOptions {
        lease_ttl: Duration::from_secs(5),
        ..options()
    };
    // Rank 1's live holder.
    let live = Etcd::connect(&cluster.url, o.clone()).await.unwrap();
    let holder = live.announce(announce(1, 11)).await.unwrap();

    // The claimants reach etcd through a member that lives on, so their requests wait for the
    // new leader instead of failing (a failed claim starts over and forgets what it saw).
    let leader = cluster.leader().await;
    let hosts: Vec<&str> = cluster.url["etcd://".len()..].split(',').collect();
    let follower = format!("etcd://{}", hosts[(leader + 1) % MEMBERS]);
    let restarted = Etcd::connect(&follower, o.clone()).await.unwrap();
    let second = Etcd::connect(&follower, o).await.unwrap();
    let restart = tokio::spawn(async move { announce_through(&restarted, announce(0, 2)).await });
    let rival = tokio::spawn(async move { announce_through(&second, announce(1, 12)).await });
    // Both have found the key held and are waiting when the leader dies.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(cluster.leader().await, leader, "no election yet");
    // Stopped (SIGTERM): the leader hands its leadership over before it exits, so the
    // claimants' requests wait through the change without failing, and the new leader
    // refreshes every lease's TTL.
    cluster.script("stop-member", Some(leader)).await;
    let started = std::time::Instant::now();
    let restarted = restart
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("the restart across an election was refused its rank: {e}"));
    println!(
        "the restart served its rank {:.1} s after the leader stopped",
        started.elapsed().as_secs_f64()
    );
    restarted.check_alive().unwrap();
    let e = rival
        .await
        .unwrap()
        .err()
        .expect("a live holder's rank is refused");
    assert_eq!(e.kind(), reshard_core::ErrorKind::Config, "{e}");
    assert!(e.message().contains("answered"), "{e}");
    holder.check_alive().unwrap();
    cluster.restart(leader).await;
}

/// What a killed etcd leader costs a publisher's write (issue 42, item 6): publishers advance
/// the moment the leader is SIGKILLed, before a new one is elected. A write forwarded to the
/// dead leader waits for etcd's own request timeout (about 7 s) unless the publisher abandons
/// it (after 2 s) and writes again through the new leader; every write lands within that
/// bound, an election and a retry, in every round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_leader_costs_a_publishers_write_about_two_seconds() {
    let Some(cluster) = Cluster::start("etcd-leader-write") else {
        return;
    };
    let model = "leader_write";
    let o = EtcdOptions {
        // Under 6 s, a third of the TTL is below the 2 s a write is retried for at least: the
        // case where an abandoned first attempt used up the whole window (chaos run: 3 s).
        lease_ttl: Duration::from_secs(3),
        ..options()
    };
    let mut held = Vec::new();
    for rank in 0..4u32 {
        // A connection per publisher, as processes have.
        let etcd = Etcd::connect(&cluster.url, o.clone()).await.unwrap();
        let mut a = suite::announcement(rank, 4, 1);
        a.model = model.into();
        held.push((etcd.announce(a).await.unwrap(), etcd));
    }
    let mut worst = Duration::ZERO;
    for (round, step) in (2u64..5).enumerate() {
        let leader = cluster.leader().await;
        cluster.kill(leader).await;
        let writes = held.iter().enumerate().map(|(rank, (h, _))| async move {
            let began = std::time::Instant::now();
            h.advance(step, Bytes::from(format!("table {rank} {step}")))
                .await
                .unwrap_or_else(|e| panic!("round {round}, rank {rank}: {e}"));
            began.elapsed()
        });
        let took = futures::future::join_all(writes).await;
        println!("round {round}: leader {leader} killed; the writes took {took:.2?}");
        worst = worst.max(took.iter().copied().max().unwrap());
        cluster.restart(leader).await;
        every_member_answers(&cluster.url).await;
    }
    println!("the slowest write across a killed leader took {worst:.2?}");
    // 2 s for the abandoned attempt, about a second of election, and a shared machine's slack;
    // far below etcd's own request timeout, which a write used to wait for.
    assert!(worst < Duration::from_secs(5), "a write took {worst:?}");
}
