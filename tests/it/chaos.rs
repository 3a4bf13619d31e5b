//! Regressions found by `leasehold-soak` (`make soak`): each reproduces,
//! with real processes and the fault proxy at the exact moment, a failure a
//! seeded soak run reported. The seed and the run that found it are named
//! on each test.

use std::time::Duration;

use leasehold_harness::FaultProxy;
use leasehold_reaper::{Options as ReaperOptions, Reaper};
use leasehold_store::setup::SetupOptions;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::support::{wait_log, Env};

async fn start_reaper(env: &Env) -> (leasehold_reaper::Handle, CancellationToken) {
    let mut o = ReaperOptions::local(&env.url(), &env.prefix);
    o.interval = Duration::from_millis(300);
    o.stranded_grace = Duration::from_millis(500);
    let stop = CancellationToken::new();
    let h = Reaper::new(o).start(stop.clone()).await.unwrap();
    (h, stop)
}

/// Found by `leasehold-soak --seed 8 --cluster --seconds 60`: a `fail` job
/// whose attempt failed while a node was being killed stayed `running` for
/// 30 s with its owner alive and nothing running it. A failed attempt
/// publishes the retry's ticket before it writes `queued`; when that
/// publish fails (a node restarting, a leader election), the attempt ends
/// with the record still `running` under a live session, "for the
/// session's end to recover". A session that never ends never recovers
/// it: once the job was indexed its ticket was settled, so no ticket comes
/// back to ask the owner either, and only the attempt deadline (6 h by
/// default) would free it.
#[tokio::test]
async fn a_retry_whose_ticket_cannot_be_published_does_not_leave_the_job_running() {
    let env = Env::with(SetupOptions::default()).await;
    let proxy = FaultProxy::start(&env.url()).await;
    let a = env.worker_proc(&["--worker-id", "retry-a"], &[("NATS_URL", proxy.url())]);
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    // Runs 2 s, so it is indexed (and its ticket settled) before it fails.
    env.submit(
        "fail",
        json!({"input": {"class": "retryable", "times": 1, "ms": 2000}}),
        "retry-lost",
    )
    .await;
    env.wait_indexed("retry-lost", Duration::from_secs(10))
        .await;
    // The retry's fresh ticket never reaches the server.
    proxy.drop_matching(&format!("{}.submit.fail", env.prefix));
    wait_log(
        &a,
        "cannot publish the retry's ticket",
        Duration::from_secs(40),
    )
    .await;
    proxy.clear();
    // Everything a recovery could need is there: the owner (alive and well
    // connected), a second worker, a reaper.
    let r = start_reaper(&env).await;
    let (b, stop) = env.worker().await;
    let done = env
        .wait_status("retry-lost", "completed", Duration::from_secs(60))
        .await;
    assert_eq!(done.attempts, 1, "one failed attempt, then the retry");
    r.1.cancel();
    r.0.wait().await.unwrap();
    stop.cancel();
    b.wait().await.unwrap();
}
