//! What an operator sees of live processes: probes and Prometheus metrics
//! of a worker and two reaper replicas (a draining worker is not ready),
//! and JSON logs with span context and no credentials.

use std::time::Duration;

use leasehold_harness::Proc;
use serde_json::{json, Value};

use leasehold_testkit::{wait_log, Fleet};

/// The address a process's HTTP server bound (`--http-listen 127.0.0.1:0`),
/// from its start-up log line (text or JSON).
async fn http_addr(p: &Proc) -> String {
    wait_log(p, "serving /healthz", Duration::from_secs(20)).await;
    let out = p.output();
    let line = out
        .lines()
        .find(|l| l.contains("serving /healthz"))
        .expect("line");
    let rest = line
        .split_once("\"addr\":\"")
        .or_else(|| line.split_once("addr="))
        .expect("addr")
        .1;
    rest.split(|c: char| c == '"' || c.is_whitespace())
        .next()
        .unwrap()
        .to_string()
}

async fn get(addr: &str, path: &str) -> (u16, String) {
    let r = reqwest::get(format!("http://{addr}{path}")).await.unwrap();
    let status = r.status().as_u16();
    (status, r.text().await.unwrap())
}

/// Polls `/readyz` until the process says it is ready (it serves the
/// probes before it has connected, and answers 503 until then).
async fn ready(addr: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (code, body) = get(addr, "/readyz").await;
        if code == 200 {
            assert_eq!(body, r#"{"ready":true}"#);
            return;
        }
        assert_eq!(code, 503, "{body}");
        assert!(
            tokio::time::Instant::now() < deadline,
            "never ready: {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of the first sample whose line starts with `series`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Scrapes until `series` reaches at least `min` (metrics are exported as
/// things happen; a scrape is the only way to see them from outside).
async fn scrape_until(addr: &str, series: &str, min: f64) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (code, text) = get(addr, "/metrics").await;
        assert_eq!(code, 200);
        if sample(&text, series).is_some_and(|v| v >= min) {
            return text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{series} never reached {min}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_live_worker_serves_probes_and_metrics_and_is_not_ready_while_draining() {
    let env = Fleet::start().await;
    let w = env.worker_proc(
        &["--http-listen", "127.0.0.1:0"],
        &[("LH_DRAIN_TIMEOUT", "30s".into())],
    );
    let addr = http_addr(&w).await;
    assert_eq!(get(&addr, "/healthz").await.0, 200);
    ready(&addr).await;

    env.submit("echo", json!({"input": {"n": 1}}), "obs-echo")
        .await;
    env.wait_status("obs-echo", "completed", Duration::from_secs(10))
        .await;
    let text = scrape_until(&addr, "leasehold_jobs_completed_total{kind=\"echo\"}", 1.0).await;
    for series in [
        "leasehold_jobs_claimed_total{kind=\"echo\"}",
        "leasehold_attempt_duration_seconds_count{kind=\"echo\",outcome=\"completed\"}",
        "leasehold_session_renewals_total{outcome=\"ok\"}",
        "leasehold_build_info{",
    ] {
        assert!(
            sample(&text, series).is_some_and(|v| v >= 1.0),
            "{series}:\n{text}"
        );
    }
    assert!(
        text.contains("leasehold_session_renewal_lag_seconds"),
        "{text}"
    );

    // A long job in flight, then SIGTERM: the worker drains (30 s) and says
    // it is not ready, while it stays alive and keeps the job.
    env.submit("sleep", json!({"input": {"ms": 60000}}), "obs-long")
        .await;
    env.wait_status("obs-long", "running", Duration::from_secs(10))
        .await;
    scrape_until(&addr, "leasehold_jobs_in_flight{kind=\"sleep\"}", 1.0).await;
    w.term();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let body = loop {
        let (code, body) = get(&addr, "/readyz").await;
        if code == 503 {
            break body;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still ready while draining"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["ready"], false);
    assert!(v["reason"].as_str().unwrap().contains("draining"), "{body}");
    assert_eq!(get(&addr, "/healthz").await.0, 200, "alive while draining");
    assert_eq!(
        env.record("obs-long").await.unwrap().status,
        "running",
        "the drain lets the job run"
    );
}

#[tokio::test]
async fn two_reaper_replicas_each_export_their_own_counters_and_the_fleet_view() {
    let env = Fleet::start().await;
    let mut q = leasehold_testkit::record::new_record(
        "obs-parked",
        "echo",
        Default::default(),
        0,
        std::time::SystemTime::now(),
    );
    q.status = "parked".into();
    env.seed_record(&q).await;
    let reaper = |id: &str| {
        Proc::spawn(
            "leasehold-reaper",
            &["--reaper-id", id, "--http-listen", "127.0.0.1:0"],
            &[
                ("NATS_URL", env.url()),
                ("LH_PREFIX", env.prefix.clone()),
                ("LH_INTERVAL", "200ms".into()),
            ],
        )
    };
    let (a, b) = (reaper("r-a"), reaper("r-b"));
    for (p, id) in [(&a, "r-a"), (&b, "r-b")] {
        let addr = http_addr(p).await;
        ready(&addr).await;
        let text = scrape_until(
            &addr,
            &format!("leasehold_reaper_sweeps_total{{replica=\"{id}\"}}"),
            1.0,
        )
        .await;
        // Only its own label: the replicas' counters never mix.
        let other = if id == "r-a" { "r-b" } else { "r-a" };
        assert!(!text.contains(&format!("replica=\"{other}\"")), "{text}");
        for (series, v) in [
            ("leasehold_fleet_jobs_parked", 1.0),
            ("leasehold_fleet_jobs_in_flight", 0.0),
            ("leasehold_fleet_queue_depth", 0.0),
            // The work queue's limit: what "queue full" will be measured by.
            (
                "leasehold_fleet_queue_limit_messages",
                leasehold_testkit::SetupOptions::default().work_max_msgs as f64,
            ),
        ] {
            assert_eq!(
                sample(&text, &format!("{series}{{replica=\"{id}\"}}")),
                Some(v),
                "{series}:\n{text}"
            );
        }
        assert!(
            sample(
                &text,
                &format!("leasehold_reaper_sweep_duration_seconds_count{{replica=\"{id}\"}}")
            )
            .is_some_and(|n| n >= 1.0),
            "{text}"
        );
    }
}

#[tokio::test]
async fn json_logs_carry_span_context_and_never_a_credential() {
    let env = Fleet::start().await;
    // Credentials in every URL the worker logs, and an API key.
    let nats = env.url().replace("nats://", "nats://lh-user:nats-s3cret@");
    let w = env.worker_proc(
        &[],
        &[
            ("NATS_URL", nats),
            ("LH_LOG_FORMAT", "json".into()),
            ("LH_KINDS", "echo,fail".into()),
            (
                "LH_MODEL_BASE_URL",
                "http://model-user:model-s3cret@127.0.0.1:9/v1".into(),
            ),
            ("LH_API_KEY", "sk-very-s3cret".into()),
            ("LH_MAX_ATTEMPTS", "1".into()),
        ],
    );
    wait_log(&w, "worker starting", Duration::from_secs(20)).await;
    env.submit(
        "fail",
        json!({"input": {"class": "retryable", "message": "boom"}}),
        "obs-fail",
    )
    .await;
    env.wait_status("obs-fail", "failed", Duration::from_secs(10))
        .await;
    w.term();
    wait_log(&w, "worker stopped", Duration::from_secs(20)).await;
    let out = w.output();
    assert!(!out.contains('\u{1b}'), "no ANSI codes off a terminal");
    for secret in ["nats-s3cret", "model-s3cret", "sk-very-s3cret"] {
        assert!(!out.contains(secret), "{secret} was logged:\n{out}");
    }
    let lines: Vec<Value> = out
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    for l in &lines {
        for k in ["timestamp", "level", "target", "fields"] {
            assert!(l.get(k).is_some(), "{k} missing: {l}");
        }
    }
    let start = lines
        .iter()
        .find(|l| l["fields"]["message"] == "worker starting")
        .unwrap();
    assert!(
        start["fields"]["nats"].as_str().unwrap().contains("***"),
        "{start}"
    );
    // A line logged inside the attempt names it through its span.
    let in_attempt = lines
        .iter()
        .find(|l| {
            l["spans"]
                .as_array()
                .is_some_and(|s| s.iter().any(|s| s["name"] == "attempt"))
        })
        .unwrap_or_else(|| panic!("no line inside an attempt span:\n{out}"));
    assert_eq!(
        in_attempt["span"]["leasehold.job.id"], "obs-fail",
        "{in_attempt}"
    );
    assert_eq!(in_attempt["fields"]["outcome"], "failed", "{in_attempt}");
    assert!(
        lines
            .iter()
            .any(|l| l["fields"]["message"] == "workload configuration"
                && l["fields"]["api_key"] == "set"),
        "the API key is reported as set, never shown"
    );
}

#[tokio::test]
async fn text_logs_at_info_give_one_warn_per_failed_attempt_with_short_prefixes() {
    let env = Fleet::start().await;
    let w = env.worker_proc(
        &[],
        &[
            ("LH_RETRY_BASE", "100ms".into()),
            ("LH_RETRY_CAP", "200ms".into()),
        ],
    );
    wait_log(&w, "worker starting", Duration::from_secs(20)).await;
    env.submit(
        "fail",
        json!({"input": {"class": "retryable", "times": 2}}),
        "log-fail",
    )
    .await;
    env.wait_status("log-fail", "completed", Duration::from_secs(20))
        .await;
    w.term();
    wait_log(&w, "worker stopped", Duration::from_secs(20)).await;
    let out = w.output();
    let warns: Vec<&str> = out.lines().filter(|l| l.contains(" WARN ")).collect();
    assert_eq!(warns.len(), 2, "one WARN per failed attempt:\n{out}");
    for (i, l) in warns.iter().enumerate() {
        let n = i + 1;
        assert!(
            l.contains(&format!("[log-fail e{n}] "))
                && l.contains("attempt failed; retrying in ")
                && l.contains("class=\"retryable\"")
                && l.contains(&format!("error=\"injected failure {n} of 2\"")),
            "the cause on the attempt's WARN: {l}"
        );
    }
    assert!(
        !out.contains("retry decision"),
        "retry decisions are debug:\n{out}"
    );
    for l in out.lines() {
        // Timestamp, level, context and target: up to the target's `: `.
        let prefix = l.find(": ").map_or(l, |i| &l[..i]);
        assert!(
            prefix.len() <= 200,
            "a {}-character prefix: {l}",
            prefix.len()
        );
        for noise in [
            "otel.",
            "gen_ai.",
            "Some(",
            "AllowList {",
            "21600s",
            "RetryPolicy {",
        ] {
            assert!(!l.contains(noise), "{noise} in {l}");
        }
    }
    let start = out.lines().find(|l| l.contains("worker starting")).unwrap();
    assert!(
        start.contains("attempt_timeout=6h") && start.contains("kinds=echo,sleep,fail,crash"),
        "human units and plain lists: {start}"
    );
}

#[tokio::test]
async fn an_idle_reaper_logs_nothing_at_info_while_it_sweeps() {
    let env = Fleet::start().await;
    let p = Proc::spawn(
        "leasehold-reaper",
        &["--reaper-id", "idle"],
        &[
            ("NATS_URL", env.url()),
            ("LH_PREFIX", env.prefix.clone()),
            ("LH_INTERVAL", "200ms".into()),
            ("RUST_LOG", "info".into()),
        ],
    );
    wait_log(&p, "reaper starting", Duration::from_secs(20)).await;
    let subject = env.conn.layout.reaper_metrics_subject();
    // The reaper's own count of sweeps, asked over NATS.
    let sweeps = || async {
        let m = tokio::time::timeout(
            Duration::from_millis(500),
            env.conn.client.request(subject.clone(), "".into()),
        )
        .await
        .ok()?
        .ok()?;
        serde_json::from_slice::<leasehold_testkit::doors::reaper::Metrics>(&m.payload)
            .ok()
            .map(|m| m.sweeps)
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut first = None;
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the reaper did not sweep:\n{}",
            p.output()
        );
        let n = sweeps().await.unwrap_or(0);
        if n >= 1 && first.is_none() {
            first = Some(p.output().lines().count());
        }
        if n >= 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let out = p.output();
    let later: Vec<&str> = out.lines().skip(first.unwrap()).collect();
    assert!(
        later.is_empty(),
        "an idle reaper logged over 4 sweeps: {later:#?}"
    );
    assert!(
        !out.lines().any(|l| l.contains(" sweep")),
        "no sweep line at info, not even the first:\n{out}"
    );
    let start = out.lines().find(|l| l.contains("reaper starting")).unwrap();
    assert!(
        start.contains("retention=7d") && start.contains("interval=200ms"),
        "{start}"
    );
}
