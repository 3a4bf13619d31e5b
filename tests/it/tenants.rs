//! Tenants and priorities against real worker processes: a quiet tenant is
//! served within its share whatever a noisy one queued, priorities order a
//! tenant's own jobs, a tenant at its running-jobs limit waits while another
//! runs, and malformed tenants, priorities and weights are refused.

use std::time::Duration;

use leasehold_harness::Proc;
use leasehold_testkit::record::parse_rfc3339;
use serde_json::json;

use leasehold_testkit::doors::flow::FlowStore;
use leasehold_testkit::*;

fn sleep_job(tenant: &str, priority: Option<i32>, ms: u64) -> serde_json::Value {
    let mut s = json!({"input": {"ms": ms}, "tenant": tenant});
    if let Some(p) = priority {
        s["priority"] = json!(p);
    }
    s
}

/// When a completed job's record was last written: its completion.
async fn finished_at(env: &Fleet, id: &str) -> std::time::SystemTime {
    let r = env
        .wait_status(id, "completed", Duration::from_secs(60))
        .await;
    parse_rfc3339(&r.updated_at).unwrap()
}

/// The time of a job's first event of type `ty`.
async fn first_at(env: &Fleet, id: &str, ty: &str) -> std::time::SystemTime {
    // A read right after the record's write may not see the events yet.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let evs = env.events_of(id).await;
        if let Some(e) = evs.iter().find(|e| e.r#type == ty) {
            return parse_rfc3339(&e.at).unwrap();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{id} has no {ty} event: {evs:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn workers(env: &Fleet, n: usize, slots: usize) -> Vec<Proc> {
    (0..n)
        .map(|_| env.worker_proc(&[], &[("LH_CONCURRENCY", slots.to_string())]))
        .collect()
}

/// Tenant `noisy` queues 120 jobs, then tenant `quiet` 10: with equal
/// weights the workers alternate between them, so every quiet job is done
/// while most of the noisy backlog still waits (first come, first served
/// would finish all 120 first).
#[tokio::test]
async fn a_quiet_tenant_is_served_within_its_share_whatever_a_noisy_one_queued() {
    let env = Fleet::start().await;
    for i in 0..120 {
        env.submit(
            "sleep",
            sleep_job("noisy", None, 200),
            &format!("noisy-{i}"),
        )
        .await;
    }
    // Four slots for the sleep kind (each idle kind's poll holds one).
    let _w = workers(&env, 1, 7);
    env.wait_status("noisy-0", "completed", Duration::from_secs(30))
        .await;
    for i in 0..10 {
        env.submit(
            "sleep",
            sleep_job("quiet", None, 200),
            &format!("quiet-{i}"),
        )
        .await;
    }
    let mut last_quiet = std::time::UNIX_EPOCH;
    for i in 0..10 {
        let r = env
            .wait_status(&format!("quiet-{i}"), "completed", Duration::from_secs(60))
            .await;
        assert_eq!(r.spec.as_ref().unwrap().tenant.as_deref(), Some("quiet"));
        last_quiet = last_quiet.max(finished_at(&env, &format!("quiet-{i}")).await);
    }
    let mut noisy_before = 0;
    for i in 0..120 {
        let id = format!("noisy-{i}");
        if finished_at(&env, &id).await <= last_quiet {
            noisy_before += 1;
        }
    }
    assert!(
        noisy_before < 80,
        "the quiet tenant's 10 jobs waited for {noisy_before} of the noisy one's 120"
    );
}

/// With the worker stopped, a tenant queues five jobs at priority 5, then
/// one at priority 1: the worker, started with one slot, runs the
/// priority-1 job first.
#[tokio::test]
async fn priority_orders_a_tenants_own_jobs() {
    let env = Fleet::start().await;
    for i in 0..5 {
        env.submit(
            "sleep",
            sleep_job("acme", Some(5), 50),
            &format!("late-{i}"),
        )
        .await;
    }
    env.submit("sleep", sleep_job("acme", Some(1), 50), "urgent")
        .await;
    // One slot for the sleep kind (each idle kind's poll holds one).
    let _w = workers(&env, 1, 4);
    env.wait_status("urgent", "completed", Duration::from_secs(30))
        .await;
    let urgent = first_at(&env, "urgent", "claimed").await;
    for i in 0..5 {
        let id = format!("late-{i}");
        env.wait_status(&id, "completed", Duration::from_secs(30))
            .await;
        assert!(
            first_at(&env, &id, "claimed").await > urgent,
            "{id} (priority 5) ran before the priority-1 job"
        );
    }
}

/// `leasehold limits set --tenant capped --jobs 1`: two workers run one of the capped tenant's jobs at a time, while the
/// other tenant's jobs run beside it.
#[tokio::test]
async fn a_tenant_at_its_running_jobs_limit_waits_while_another_runs() {
    let env = Fleet::start().await;
    cap_at_one_job(&env).await;
    // Each idle kind of the four holds a slot for its poll: 16 leave the
    // sleep kind plenty.
    let _w = workers(&env, 2, 16);
    for i in 0..4 {
        env.submit(
            "sleep",
            sleep_job("capped", None, 400),
            &format!("capped-{i}"),
        )
        .await;
    }
    for i in 0..4 {
        env.submit("sleep", sleep_job("free", None, 400), &format!("free-{i}"))
            .await;
    }
    let capped_ids: Vec<String> = (0..4).map(|i| format!("capped-{i}")).collect();
    let capped = ran_one_at_a_time(&env, &capped_ids).await;
    let mut free = Vec::new();
    for i in 0..4 {
        free.push(finished_at(&env, &format!("free-{i}")).await);
    }
    // The free tenant was not held back by the capped one: its four jobs
    // ran side by side, all within the capped tenant's run.
    let free_end = *free.iter().max().unwrap();
    let capped_end = capped.iter().map(|x| x.1).max().unwrap();
    assert!(free_end < capped_end, "free: {free:?}, capped: {capped:?}");
    let (code, out, _) = cli(&env.url(), &["limits", "list", "--json"]).await;
    assert_eq!(code, 0);
    assert!(
        out.lines()
            .any(|l| l.contains("\"tenant.capped.jobs\"") && l.contains("\"tenant\":\"capped\"")),
        "{out}"
    );
}

/// `leasehold limits set --tenant capped --jobs 1`.
async fn cap_at_one_job(env: &Fleet) {
    let (code, out, err) = cli(
        &env.url(),
        &["limits", "set", "--tenant", "capped", "--jobs", "1"],
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
}

/// Submits `n` jobs of the capped tenant (`{prefix}-{i}`, `ms` each) and
/// asserts they ran one at a time: each claimed after the one before it
/// ended.
async fn capped_one_at_a_time(env: &Fleet, prefix: &str, n: usize, ms: u64) {
    for i in 0..n {
        env.submit(
            "sleep",
            sleep_job("capped", None, ms),
            &format!("{prefix}-{i}"),
        )
        .await;
    }
    let ids: Vec<String> = (0..n).map(|i| format!("{prefix}-{i}")).collect();
    ran_one_at_a_time(env, &ids).await;
}

/// Asserts the jobs ran one at a time: each was claimed after the one
/// before it (by claim) ended. Their (claimed, finished) times, in order.
async fn ran_one_at_a_time(
    env: &Fleet,
    ids: &[String],
) -> Vec<(std::time::SystemTime, std::time::SystemTime)> {
    let mut runs = Vec::new();
    for id in ids {
        runs.push((
            first_at(env, id, "claimed").await,
            finished_at(env, id).await,
        ));
    }
    runs.sort();
    for w in runs.windows(2) {
        assert!(
            w[1].0 >= w[0].1,
            "two of the capped tenant's jobs ran at once: {w:?}"
        );
    }
    runs
}

/// Two workers under `--jobs 1`: after a round of the capped tenant's
/// jobs, both give their leases back while idle and their slices end.
/// When the next round arrives, neither may take the one job on a share
/// nobody granted (each worker's "local share" of 1 over 2 workers is one
/// slot): the next round still runs one at a time.
#[tokio::test]
async fn a_tenants_running_jobs_limit_holds_when_an_idle_fleet_gets_work_again() {
    let env = Fleet::start().await;
    cap_at_one_job(&env).await;
    let _w = workers(&env, 2, 16);
    capped_one_at_a_time(&env, "first", 3, 300).await;
    // Both gave their leases back (idle for a renewal) ...
    let store = FlowStore::open(&env.conn).await.unwrap();
    let id = leasehold_testkit::doors::flow::tenant_jobs_key("capped");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (rec, _) = store.lease(&id).await.unwrap();
        if rec.leases.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the idle workers kept their leases: {rec:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // ... and their slices (3 s from their last write) have ended.
    tokio::time::sleep(Duration::from_secs(3)).await;
    capped_one_at_a_time(&env, "again", 4, 300).await;
}

/// A worker whose flow buckets cannot be opened at its start (the server
/// never answers its lookup of `lh_flow`, dropped by the fault proxy)
/// must not run a tenant's limit on its own: it waits and says so, while
/// a worker that has the buckets runs the capped tenant's jobs one at a
/// time; once its lookup is answered, it joins under the same limit. A
/// worker stopped while it waits stops at once.
#[tokio::test]
async fn a_worker_that_cannot_open_the_flow_buckets_at_its_start_runs_no_limited_job_alone() {
    let env = Fleet::start().await;
    cap_at_one_job(&env).await;
    let proxy = leasehold_harness::FaultProxy::start(&env.url()).await;
    let lookup = format!("$JS.API.STREAM.INFO.KV_{}", env.conn.layout.flow_bucket());
    proxy.drop_matching(&lookup);
    let cut_off = env.worker_proc(
        &["--worker-id", "cut-off"],
        &[
            ("LH_CONCURRENCY", "16".to_string()),
            ("NATS_URL", proxy.url()),
        ],
    );
    let _direct = env.worker_proc(
        &["--worker-id", "direct"],
        &[("LH_CONCURRENCY", "16".to_string())],
    );
    // A third, stopped while it waits for the buckets, stops at once.
    let mut stops = env.worker_proc(&["--worker-id", "stops"], &[("NATS_URL", proxy.url())]);
    // Its lookup went unanswered (the request's timeout).
    wait_log(&cut_off, "flow buckets", Duration::from_secs(30)).await;
    assert!(proxy.published(&lookup) >= 1);
    wait_log(&stops, "flow buckets", Duration::from_secs(30)).await;
    stops.term();
    let exited = tokio::task::spawn_blocking(move || stops.wait_timeout(Duration::from_secs(3)))
        .await
        .unwrap();
    assert!(
        exited.is_some_and(|s| s.success()),
        "a worker waiting for the fleet's limits did not stop within 3 s of SIGTERM: {exited:?}"
    );
    capped_one_at_a_time(&env, "cut", 4, 300).await;
    for i in 0..4 {
        let evs = env.events_of(&format!("cut-{i}")).await;
        let by: Vec<_> = evs
            .iter()
            .filter(|e| e.r#type == "claimed")
            .map(|e| e.worker_id.clone())
            .collect();
        assert_eq!(
            by,
            [Some("direct".to_string())],
            "cut-{i} was claimed by a worker without the fleet's limits"
        );
    }
    // Answered: it opens them, and the two share the limit.
    proxy.clear();
    wait_log(&cut_off, "provider limits", Duration::from_secs(30)).await;
    capped_one_at_a_time(&env, "joined", 4, 300).await;
    drop(cut_off);
}

/// Malformed tenants, priorities and weights are refused with what is
/// allowed, before anything is sent; a raw submission whose spec names
/// another tenant than its subject is a rejected record that says where it
/// belongs.
#[tokio::test]
async fn malformed_tenants_priorities_and_weights_are_refused() {
    let env = Fleet::start().await;
    let url = env.url();
    let input = r#"{"ms":1}"#;
    for (args, needle) in [
        (
            vec!["submit", "sleep", "--input", input, "--tenant", "a b"],
            "tenant",
        ),
        (
            vec!["submit", "sleep", "--input", input, "--tenant", ""],
            "tenant",
        ),
        (
            vec!["submit", "sleep", "--input", input, "--priority", "9"],
            "1..=5",
        ),
        (
            vec!["submit", "sleep", "--input", input, "--priority", "0"],
            "1..=5",
        ),
        (
            vec!["submit", "sleep", r#"{"input":{},"priority":"high"}"#],
            "priority",
        ),
        (
            vec!["limits", "set", "--tenant", "acme", "--weight", "0"],
            "1..=1000",
        ),
        (
            vec!["limits", "set", "--tenant", "acme", "--jobs", "-1"],
            "--jobs",
        ),
        (
            vec!["limits", "set", "--tenant", "a.b", "--jobs", "2"],
            "--tenant",
        ),
        (vec!["limits", "set", "--jobs", "2"], "--tenant"),
    ] {
        let (code, out, err) = cli(&url, &args).await;
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    let (code, _, err) = cli(&url, &["list", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    // A spec naming tenant x, published raw on the default subject.
    let _w = workers(&env, 1, 2);
    env.conn
        .js
        .publish(
            env.conn.layout.submit_subject("sleep"),
            json!({"id": "misplaced", "input": {"ms": 1}, "tenant": "x"})
                .to_string()
                .into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let r = env
        .wait_status("misplaced", "rejected", Duration::from_secs(20))
        .await;
    let e = r.error.unwrap();
    assert!(
        e.message.contains("lh.submit.sleep.x.3"),
        "the rejection names the subject: {e:?}"
    );
}

/// Review G7: tenant `acme` at its running-jobs limit (1) queues three jobs
/// while the kind's default lane keeps delivering later tickets, and a
/// reaper checks stranded waits past a 1 s grace. Each waiting ticket is
/// judged by its own lane's consumer, so none is taken for "delivered but
/// never claimed": no acme job is re-ticketed (no `recovered` event) and
/// they run in the order submitted.
#[tokio::test]
async fn a_tenants_backlog_behind_its_limit_is_never_taken_for_stranded() {
    let env = Fleet::start().await;
    let (code, out, err) = cli(
        &env.url(),
        &["limits", "set", "--tenant", "acme", "--jobs", "1"],
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    // Submitted as `leasehold submit` does: each is a queued record, listed
    // as waiting, at once.
    let ids: Vec<String> = (0..3).map(|i| format!("acme-{i}")).collect();
    for id in &ids {
        let spec = sleep_job("acme", None, 1500).to_string();
        let (code, out, err) = cli(&env.url(), &["submit", "sleep", &spec, "--id", id]).await;
        assert_eq!(code, 0, "{out}{err}");
    }
    let _w = workers(&env, 1, 8);
    let mut o = env.reaper_opts();
    o.stranded_grace = Duration::from_secs(1);
    let (reaper, stop) = env.reaper_with(o).await;
    // The default lane of the same kind delivers tickets later than every
    // acme one, all the while the acme backlog waits. Each takes 20 ms, so
    // the 4.5 s of the acme backlog is a few hundred of them (1 ms jobs ran
    // a thousand, and the thousand-and-first status watch found the
    // server's consumer limit, before the backlog was done).
    let mut n = 0;
    while env.jobs.get(&ids[2]).await.unwrap().map(|v| v.value.status) != Some("completed".into()) {
        let id = env
            .submit("sleep", json!({"input": {"ms": 20}}), &format!("plain-{n}"))
            .await;
        env.wait_status(&id, "completed", Duration::from_secs(10))
            .await;
        n += 1;
    }
    let mut claimed = Vec::new();
    for id in &ids {
        let evs = env.events_of(id).await;
        let recovered: Vec<_> = evs
            .iter()
            .filter(|e| e.r#type == "progress" && e.data_map().get("recovered").is_some())
            .collect();
        assert!(
            recovered.is_empty(),
            "{id} was re-ticketed while it waited behind its lane: {recovered:?}"
        );
        claimed.push(first_at(&env, id, "claimed").await);
    }
    assert!(
        claimed.windows(2).all(|w| w[0] < w[1]),
        "acme jobs ran out of order: {claimed:?}"
    );
    assert!(n > 0);
    stop.cancel();
    reaper.wait().await.unwrap();
}
