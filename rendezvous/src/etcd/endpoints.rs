//! Failover between the members of an etcd cluster given as `etcd://a,b,c`: a task that takes a
//! member that stops answering out of the connection's endpoint set and puts it back once it
//! answers again (docs/deployment.md, "An etcd cluster").
//!
//! Why a task: the client balances requests over every endpoint it was given, and a member that
//! was once connected stays in that set after it dies, so a share of all requests would keep
//! failing with "connection refused" for as long as the member is down (seen with a 3-member
//! cluster and its leader SIGKILLed). Raft elects a new leader among the living in about a
//! second; this makes the requests go to them.
//!
//! The task asks nothing while every member is in the set and requests succeed: a failed request
//! ([`Failover::suspect`], called for every error of the connection) starts a probe round, and
//! members stay probed only while one of them is out. A fleet of thousands of processes thus
//! costs etcd no probes on an ordinary day.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use tokio::sync::Notify;

/// How often each member is asked whether it is up while one is out of the set (or after a
/// failed request): status is answered by the member itself, no Raft round.
const PROBE_EVERY: Duration = Duration::from_millis(250);

/// How long a member may take to answer a probe before it counts as down.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// The failover task of one connection; stops when the last clone of its connection is dropped.
pub(super) struct Failover {
    task: tokio::task::JoinHandle<()>,
    /// Wakes the task for a probe round.
    suspect: Arc<Notify>,
}

impl Failover {
    /// A request of the connection failed: probe the members now.
    pub(super) fn suspect(&self) {
        self.suspect.notify_one();
    }
}

impl Drop for Failover {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts failover for `client`, balanced over `endpoints` (`http://HOST:PORT`, as given to
/// it), or `None` for one endpoint (nothing to fail over to). `endpoint` is the `etcd://` address
/// logs name.
pub(super) fn start(client: Client, endpoints: Vec<String>, endpoint: String) -> Option<Failover> {
    if endpoints.len() < 2 {
        return None;
    }
    let suspect = Arc::new(Notify::new());
    let task = tokio::spawn(run(client, endpoints, endpoint, suspect.clone()));
    Some(Failover { task, suspect })
}

async fn run(client: Client, endpoints: Vec<String>, endpoint: String, suspect: Arc<Notify>) {
    let options = ConnectOptions::new()
        .with_connect_timeout(PROBE_TIMEOUT)
        .with_timeout(PROBE_TIMEOUT);
    // One client per member, so a probe asks that member and no other.
    let mut probes = Vec::with_capacity(endpoints.len());
    for e in &endpoints {
        match Client::connect([e], Some(options.clone())).await {
            Ok(c) => probes.push(c),
            // Only a malformed address fails here (connecting is lazy): nothing to probe.
            Err(err) => {
                tracing::warn!(%endpoint, member = %e, "no failover: {err}");
                return;
            }
        }
    }
    let mut up = vec![true; endpoints.len()];
    loop {
        if up.iter().all(|&u| u) {
            // All in and nothing failed: wait for a failed request.
            suspect.notified().await;
        } else {
            tokio::time::sleep(PROBE_EVERY).await;
        }
        let answers = futures::future::join_all(
            probes
                .iter_mut()
                .map(|p| async move { tokio::time::timeout(PROBE_TIMEOUT, p.status()).await }),
        )
        .await;
        for (i, answer) in answers.into_iter().enumerate() {
            let answers = matches!(answer, Ok(Ok(_)));
            let member = &endpoints[i];
            if up[i] && !answers {
                // The last member stays in: with none, every request would wait instead of
                // failing with the reason.
                if up.iter().filter(|&&u| u).count() < 2 {
                    continue;
                }
                if client.remove_endpoint(member).await.is_ok() {
                    up[i] = false;
                    tracing::warn!(%endpoint, %member, "etcd member does not answer; using the others");
                }
            } else if !up[i] && answers && client.add_endpoint(member).await.is_ok() {
                up[i] = true;
                tracing::info!(%endpoint, %member, "etcd member answers again");
            }
        }
    }
}
