//! Least privilege on NATS: the users and permissions shipped in
//! `deploy/nats/permissions.conf`, loaded as shipped into a real server.
//! Every binary runs under its role's user and does its job; what a role
//! must not do is refused by the server; the `nsc` recipe grants the same.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use futures::StreamExt;
use leasehold::JobRecord;
use leasehold_harness::{bin_path, NatsServer, Proc};
use leasehold_testkit::doors::layout::{Conn, Jobs, NatsArgs};

use leasehold_testkit::wait_log;

const ROLES: [&str; 5] = ["submitter", "worker", "reaper", "operator", "console"];

fn deploy_nats() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/nats")
}

fn password(role: &str) -> String {
    format!("test-{role}-secret")
}

/// A server running the shipped permissions, passwords from its environment.
struct Secured {
    server: NatsServer,
}

impl Secured {
    fn start() -> Secured {
        let env: Vec<(&str, String)> = vec![
            ("LH_SUBMITTER_PASSWORD", password("submitter")),
            ("LH_WORKER_PASSWORD", password("worker")),
            ("LH_REAPER_PASSWORD", password("reaper")),
            ("LH_OPERATOR_PASSWORD", password("operator")),
            ("LH_CONSOLE_PASSWORD", password("console")),
        ];
        let server = NatsServer::start_including(&deploy_nats().join("permissions.conf"), &env);
        Secured { server }
    }

    /// The connection settings of a role: its user and its inbox prefix.
    fn env(&self, role: &str) -> Vec<(&'static str, String)> {
        vec![
            ("NATS_URL", self.server.url()),
            ("NATS_USER", format!("lh-{role}")),
            ("NATS_PASSWORD", password(role)),
            ("LH_INBOX_PREFIX", format!("_INBOX_{role}")),
            ("LH_PREFIX", "lh".into()),
        ]
    }

    async fn connect(&self, role: &str) -> Conn {
        NatsArgs {
            user: Some(format!("lh-{role}")),
            password: Some(password(role)),
            inbox_prefix: format!("_INBOX_{role}"),
            ..NatsArgs::local(self.server.url(), "lh")
        }
        .connect(&format!("perms test {role}"))
        .await
        .unwrap()
    }

    /// Runs the `leasehold` CLI as `role`.
    async fn cli(&self, role: &str, args: &[&str]) -> (i32, String, String) {
        leasehold_testkit::cli_with(args, self.env(role)).await
    }

    fn worker(&self) -> Proc {
        let mut env = self.env("worker");
        env.extend([
            ("LH_KINDS", "echo,sleep,fanout".to_string()),
            ("LH_DEV_KINDS", "1".into()),
            ("LH_SESSION_TIMEOUT", "2s".into()),
            ("LH_INDEX_AFTER", "300ms".into()),
            ("LH_PULL_EXPIRES", "250ms".into()),
            ("LH_DRAIN_TIMEOUT", "200ms".into()),
            ("RUST_LOG", "info".into()),
        ]);
        Proc::spawn("leasehold-worker", &[], &env)
    }

    /// Permission errors in the server's log: (user, subject).
    fn violations(&self) -> Vec<(String, String)> {
        self.server
            .log()
            .lines()
            .filter(|l| l.contains(" Violation - Subject \""))
            .map(|l| {
                let user = l
                    .split("/user:")
                    .nth(1)
                    .and_then(|r| r.split('"').next())
                    .unwrap_or_default();
                let subject = l
                    .split("Subject \"")
                    .nth(1)
                    .and_then(|r| r.split('"').next())
                    .unwrap_or_default();
                (user.to_string(), subject.to_string())
            })
            .collect()
    }
}

/// A console under `lh-console`, with `extra` settings; its base URL.
async fn console(s: &Secured, extra: &[(&'static str, String)]) -> (Proc, String) {
    let mut env = s.env("console");
    env.extend(extra.iter().cloned());
    crate::console::start_console(&env).await
}

/// Runs `op` as `conn`'s user and returns the server's refusal of a subject
/// starting with `subject`. An answer of any kind, or none within 10s,
/// fails: the server must refuse, not merely fail the operation.
async fn refused<T>(conn: &Conn, subject: &str, op: impl Future<Output = T>) -> String {
    tokio::select! {
        why = conn.link.refused(subject) => why,
        _ = op => panic!("{subject}: answered instead of refused"),
        _ = tokio::time::sleep(Duration::from_secs(10)) => panic!("{subject}: no refusal within 10s"),
    }
}

/// Asserts that `conn`'s user may not purge `stream`.
async fn refused_purge(conn: &Conn, stream: &str) {
    let subject = format!("$JS.API.STREAM.PURGE.{stream}");
    refused(conn, &subject, async {
        conn.js
            .get_stream_no_info(stream)
            .await
            .unwrap()
            .purge()
            .await
    })
    .await;
}

/// A stream outside leasehold's layout, which no role may create.
fn rogue_stream() -> async_nats::jetstream::stream::Config {
    async_nats::jetstream::stream::Config {
        name: "ROGUE".into(),
        subjects: vec!["rogue.>".into()],
        ..Default::default()
    }
}

/// Waits (on a KV watch) until `pred` holds for the record.
async fn wait_record(
    jobs: &Jobs,
    id: &str,
    what: &str,
    pred: impl Fn(&JobRecord) -> bool,
) -> JobRecord {
    let mut w = jobs.watch(id).await.unwrap();
    let found = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(e) = w.next().await {
            let e = e.unwrap();
            if e.operation == async_nats::jetstream::kv::Operation::Put {
                let r = leasehold_testkit::record::decode(id, &e.value).unwrap();
                if pred(&r) {
                    return r;
                }
            }
        }
        panic!("watch of {id} ended")
    })
    .await;
    match found {
        Ok(r) => r,
        Err(_) => panic!(
            "job {id}: not {what} within 20s; record: {:?}",
            jobs.get(id).await.unwrap().map(|v| v.value)
        ),
    }
}

/// Waits until a worker's gateway answers on `lh.enqueued.*` (the worker
/// is started and subscribed).
async fn wait_gateway(op: &Conn) {
    for _ in 0..200 {
        let ask = op.client.request(op.layout.enqueued_subject(0), "".into());
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(1), ask).await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no worker gateway answered");
}

fn status_of(out: &str) -> String {
    serde_json::from_str::<serde_json::Value>(out).unwrap()["status"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_binary_does_its_job_under_its_roles_user() {
    let s = Secured::start();
    let op = s.connect("operator").await;

    // The operator sets up the layout.
    let (code, out, err) = s
        .cli(
            "operator",
            &["setup", "--kinds", "echo,sleep,fanout", "--ack-wait", "1s"],
        )
        .await;
    assert_eq!(code, 0, "setup as lh-operator: {out}{err}");
    let jobs = Jobs::open(&op).await.unwrap();

    // A worker and a reaper, each under its own user.
    let mut worker = s.worker();
    let mut renv = s.env("reaper");
    renv.extend([
        ("LH_INTERVAL", "500ms".to_string()),
        ("LH_PROBE_INTERVAL", "200ms".into()),
        ("RUST_LOG", "info".into()),
    ]);
    let reaper = Proc::spawn("leasehold-reaper", &[], &renv);
    wait_gateway(&op).await;

    // A submitter submits and follows a job to its result.
    let (code, out, err) = s
        .cli(
            "submitter",
            &[
                "submit",
                "echo",
                r#"{"input":{"hi":1}}"#,
                "--id",
                "p-1",
                "--wait",
                "--timeout",
                "20s",
            ],
        )
        .await;
    assert_eq!(code, 0, "submit --wait as lh-submitter: {out}{err}");
    assert_eq!(status_of(&out), "completed", "{out}");
    let (code, out, err) = s.cli("submitter", &["status", "p-1"]).await;
    assert_eq!((code, status_of(&out).as_str()), (0, "completed"), "{err}");
    let (code, out, err) = s.cli("submitter", &["result", "p-1"]).await;
    assert_eq!((code, out.trim()), (0, r#"{"hi":1}"#), "{err}");
    let (code, out, err) = s.cli("submitter", &["watch", "p-1"]).await;
    assert_eq!(code, 0, "{err}");
    let summary = out.lines().last().unwrap_or_default();
    assert!(summary.starts_with("p-1 completed in "), "{out}{err}");

    // A parent spawns its children, is told of their ends and joins them,
    // all under the worker's user.
    let (code, out, err) = s
        .cli(
            "submitter",
            &[
                "submit",
                "fanout",
                r#"{"input":{"n":2}}"#,
                "--id",
                "p-fan",
                "--wait",
                "--timeout",
                "30s",
            ],
        )
        .await;
    assert_eq!(code, 0, "a fan-out under lh-worker: {out}{err}");
    let (code, out, err) = s.cli("submitter", &["result", "p-fan"]).await;
    let fan: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_default();
    assert_eq!(
        (code, &fan["completed"]),
        (0, &serde_json::json!(2)),
        "{out}{err}"
    );

    // An operator's schedule is fired by the reaper under its user.
    let added = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let (code, out, err) = s
        .cli(
            "operator",
            &[
                "schedule",
                "add",
                "perm",
                "--cron",
                "* * * * * *",
                "echo",
                r#"{"input":{}}"#,
            ],
        )
        .await;
    assert_eq!(code, 0, "schedule add as lh-operator: {out}{err}");
    let fired = async {
        loop {
            for t in added + 1..added + 30 {
                if let Ok(Some(_)) = jobs.get(&format!("perm-{t}")).await {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), fired)
        .await
        .unwrap_or_else(|_| panic!("no tick fired under lh-reaper:\n{}", reaper.output()));
    let (code, out, err) = s.cli("operator", &["schedule", "remove", "perm"]).await;
    assert_eq!(code, 0, "schedule remove as lh-operator: {out}{err}");
    assert!(
        !reaper.output().contains("schedules not checked"),
        "{}",
        reaper.output()
    );

    // The record of a job no worker has claimed yet is written by a worker
    // on the submitter's request: status answers at once.
    let (code, out, err) = s
        .cli(
            "submitter",
            &[
                "submit",
                "sleep",
                "--input",
                r#"{"ms":60000}"#,
                "--id",
                "p-2",
            ],
        )
        .await;
    assert_eq!((code, out.trim()), (0, "p-2"), "{err}");
    assert!(!err.contains("note:"), "a worker wrote the record: {err}");
    let (code, out, err) = s.cli("submitter", &["status", "p-2"]).await;
    assert_eq!(code, 0, "the record exists right after submit: {err}");
    assert!(
        ["queued", "running"].contains(&status_of(&out).as_str()),
        "{out}"
    );
    wait_record(&jobs, "p-2", "running", |r| r.status == "running").await;
    let (code, out, err) = s.cli("submitter", &["cancel", "p-2"]).await;
    assert_eq!(code, 0, "cancel as lh-submitter: {out}{err}");
    let (code, out, _) = s
        .cli("submitter", &["watch", "p-2", "--timeout", "20s"])
        .await;
    assert_eq!(code, 1, "{out}");
    let summary = out.lines().last().unwrap_or_default();
    assert!(summary.starts_with("p-2 cancelled in "), "{out}");

    // A killed worker's job is recovered by the reaper under its user.
    let (code, _, err) = s
        .cli(
            "submitter",
            &[
                "submit",
                "sleep",
                "--input",
                r#"{"ms":60000}"#,
                "--id",
                "p-3",
            ],
        )
        .await;
    assert_eq!(code, 0, "{err}");
    let running = wait_record(&jobs, "p-3", "running", |r| r.status == "running").await;
    let active = leasehold_testkit::doors::index::Active::open(&op)
        .await
        .unwrap();
    for _ in 0..100 {
        if !active.keys_of("p-3").await.unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    worker.kill9();
    let reoffered = wait_record(&jobs, "p-3", "re-offered", |r| {
        r.status == "queued" && r.stale_reclaims == 1
    })
    .await;
    assert_eq!(reoffered.epoch, running.epoch);
    wait_log(&reaper, "sweep", Duration::from_secs(10)).await;

    // With no worker running, a submitter's cancel cannot be recorded: its
    // user may not write records, and the CLI says so at once.
    let (code, out, err) = s.cli("submitter", &["cancel", "p-3"]).await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("may not write job records") && err.contains("nothing was recorded"),
        "{err}"
    );
    assert!(
        !jobs
            .get("p-3")
            .await
            .unwrap()
            .unwrap()
            .value
            .cancel_requested
    );

    // A new worker claims the recovered job; the submitter cancels it.
    let worker2 = s.worker();
    wait_record(&jobs, "p-3", "claimed again", |r| {
        r.status == "running" && r.epoch > running.epoch
    })
    .await;
    let (code, out, err) = s.cli("submitter", &["cancel", "p-3"]).await;
    assert_eq!(code, 0, "{out}{err}");
    wait_record(&jobs, "p-3", "cancelled", |r| r.status == "cancelled").await;

    // The operator inspects.
    let (code, out, err) = s.cli("operator", &["list", "--all", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    // (besides the schedule's jobs, and the fan-out's parent and children)
    let listed = out
        .lines()
        .filter(|l| !l.contains(r#""id":"perm-"#) && !l.contains(r#""id":"p-fan"#))
        .count();
    assert_eq!(listed, 3, "{out}");
    let (code, _, err) = s.cli("operator", &["dlq", "list"]).await;
    assert_eq!(code, 0, "{err}");
    // The reaper's historian recorded the ends under its user; the
    // operator searches them (the historian lags by about a second).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (code, out, err) = s
            .cli("operator", &["list", "--finished", "--status", "cancelled"])
            .await;
        assert_eq!(code, 0, "list --finished as lh-operator: {err}");
        if out.contains("p-2") && out.contains("p-3") {
            assert!(err.contains("2 matched"), "{err}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no history under lh-reaper: {out}{err}\n{}",
            reaper.output()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let (code, _, err) = s
        .cli(
            "operator",
            &[
                "setup",
                "--check",
                "--kinds",
                "echo,sleep,fanout",
                "--ack-wait",
                "1s",
            ],
        )
        .await;
    assert_eq!(code, 0, "{err}");

    // Nothing the binaries did was refused but the one refusal asked for.
    let unexpected: Vec<_> = s
        .violations()
        .into_iter()
        .filter(|v| *v != ("lh-submitter".to_string(), "$KV.lh_jobs.p-3".to_string()))
        .collect();
    assert!(unexpected.is_empty(), "refused: {unexpected:?}");
    for p in [&reaper, &worker2] {
        assert!(
            !p.output().contains("refused an operation"),
            "{}: {}",
            p.name(),
            p.output()
        );
    }
}

/// Submits an echo job as the submitter and waits for its end.
async fn submit_echo(s: &Secured) -> (i32, String, String) {
    let args = [
        "submit",
        "echo",
        r#"{"input":{}}"#,
        "--wait",
        "--timeout",
        "30s",
    ];
    s.cli("submitter", &args).await
}

/// After the server restarts, every long-running binary makes its watches
/// anew (the client library deletes each ordered consumer it replaces) and
/// carries on under its role's user: the server refuses nothing, and no
/// binary warns of a missing permission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_binary_makes_its_watches_anew_after_a_server_restart_unrefused() {
    let mut s = Secured::start();
    let op = s.connect("operator").await;
    let (code, out, err) = s
        .cli(
            "operator",
            &["setup", "--kinds", "echo,sleep,fanout", "--ack-wait", "1s"],
        )
        .await;
    assert_eq!(code, 0, "{out}{err}");
    let worker = s.worker();
    let mut renv = s.env("reaper");
    renv.extend([
        ("LH_INTERVAL", "500ms".to_string()),
        ("RUST_LOG", "info".into()),
    ]);
    let reaper = Proc::spawn("leasehold-reaper", &[], &renv);
    wait_gateway(&op).await;
    wait_log(&reaper, "answering the roll call", Duration::from_secs(20)).await;
    // A job run shows the worker's limits read and watched.
    let (code, out, err) = submit_echo(&s).await;
    assert_eq!(code, 0, "a job before the restart: {out}{err}");
    let (console, base) = console(&s, &[]).await;
    let before = reaper.output().matches("connection back").count();

    s.server.restart();

    // Each one's watches are made anew: the reaper reads the index again, the
    // worker the limits (at once, not after missed heartbeats); a job
    // started after the restart shows on the console's jobs page (its watch
    // of the index); a limit set after the restart reaches the worker.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while reaper.output().matches("connection back").count() == before {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the reaper did not read the index again after the restart:\n{}",
            reaper.output()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    wait_log(
        &worker,
        "reading the limits and pauses again",
        Duration::from_secs(30),
    )
    .await;
    let nap = [
        "submit",
        "sleep",
        "--input",
        r#"{"ms":60000}"#,
        "--id",
        "back-nap",
    ];
    let (code, out, err) = s.cli("submitter", &nap).await;
    assert_eq!(code, 0, "a job after the restart: {out}{err}");
    let http = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let page = crate::console::text(&http, &format!("{base}/jobs")).await;
        if page.contains("/jobs/back-nap") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the console does not list back-nap after the restart:\n{page}\n{}",
            console.output()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (code, out, err) = s
        .cli(
            "operator",
            &["limits", "set", "--tenant", "after-restart", "--jobs", "2"],
        )
        .await;
    assert_eq!(code, 0, "limits set after the restart: {out}{err}");
    wait_log(&worker, "after-restart", Duration::from_secs(30)).await;
    // ... and the fleet runs jobs again.
    let (code, out, err) = submit_echo(&s).await;
    assert_eq!(code, 0, "a job after the restart: {out}{err}");

    assert_eq!(s.violations(), vec![], "the server refused these");
    for p in [&worker, &reaper, &console] {
        assert!(
            !p.output().contains("refused an operation"),
            "{}: {}",
            p.name(),
            p.output()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_role_must_not_do_is_refused_by_the_server() {
    let s = Secured::start();
    let op = s.connect("operator").await;
    let (code, _, err) = s.cli("operator", &["setup", "--kinds", "echo"]).await;
    assert_eq!(code, 0, "{err}");
    let jobs = Jobs::open(&op).await.unwrap();
    let rec = leasehold_testkit::record::new_record(
        "x-1",
        "echo",
        Default::default(),
        0,
        std::time::SystemTime::now(),
    );
    jobs.create(&rec).await.unwrap();
    // A finished job with an artifact (over one chunk), for `result`.
    let doc: String = (0..40_000).map(|i| format!("line {i}\n")).collect();
    finished_with_report(&op, &jobs, "x-3", &doc).await;
    let events = leasehold_testkit::doors::layout::Events::new(&op);
    let ev = leasehold_testkit::record::event("x-1", 0, "claimed", None, serde_json::json!({}));
    events.publish(&ev, None).await.unwrap();

    // A submitter reads records but may not write one.
    let sub = s.connect("submitter").await;
    let sub_jobs = Jobs::open(&sub).await.unwrap();
    assert_eq!(
        sub_jobs.get("x-1").await.unwrap().unwrap().value.status,
        "queued"
    );
    let kv = sub.js.get_key_value("lh_jobs").await.unwrap();
    let why = refused(&sub, "$KV.lh_jobs.x-1", kv.put("x-1", "{}".into())).await;
    assert!(why.contains("Permissions Violation for Publish"), "{why}");
    refused(&sub, "$KV.lh_jobs.x-2", kv.create("x-2", "{}".into())).await;
    // It may send a signal to a job (x-1 is queued): stored, with its ack.
    let sent = leasehold_testkit::doors::signals::Signals::new(&sub)
        .send("x-1", "go", &serde_json::json!({"ok": true}), None, None)
        .await
        .unwrap();
    assert!(sent.seq > 0 && !sent.duplicate);
    // ... nor forge the history of finished jobs.
    refused(&sub, "lh.history.completed.echo.default.none", async {
        if let Ok(ack) = sub
            .js
            .publish("lh.history.completed.echo.default.none", "{}".into())
            .await
        {
            // Refused: no stream ever answers it.
            let _ = ack.await;
            std::future::pending::<()>().await;
        }
    })
    .await;
    // ... nor delete a stream, purge one, or take tickets from the work queue.
    refused(
        &sub,
        "$JS.API.STREAM.DELETE.LH_WORK",
        sub.js.delete_stream("LH_WORK"),
    )
    .await;
    refused_purge(&sub, "LH_EVENTS").await;
    refused(&sub, "$JS.API.CONSUMER.CREATE.LH_WORK", async {
        sub.js
            .get_stream_no_info("LH_WORK")
            .await
            .unwrap()
            .create_consumer(async_nats::jetstream::consumer::pull::Config::default())
            .await
    })
    .await;
    // ... nor create any consumer: the server would deliver for it where it
    // may not publish (here, the records as forged events of job x-1).
    let _interest = sub
        .client
        .subscribe("lh.events.x-1.completed")
        .await
        .unwrap();
    refused(&sub, "$JS.API.CONSUMER.CREATE.KV_lh_jobs", async {
        sub.js
            .get_stream_no_info("KV_lh_jobs")
            .await
            .unwrap()
            .create_consumer(async_nats::jetstream::consumer::push::Config {
                deliver_subject: "lh.events.x-1.completed".into(),
                ..Default::default()
            })
            .await
    })
    .await;
    // ... nor listen to another role's replies.
    refused(&sub, "_INBOX_worker.", async {
        let mut inbox = sub.client.subscribe("_INBOX_worker.>").await.unwrap();
        inbox.next().await
    })
    .await;

    // A worker may not purge the events or the work queue, nor create or
    // delete a stream.
    let w = s.connect("worker").await;
    refused_purge(&w, "LH_EVENTS").await;
    refused_purge(&w, "LH_WORK").await;
    refused(
        &w,
        "$JS.API.STREAM.CREATE.",
        w.js.create_stream(rogue_stream()),
    )
    .await;
    refused(
        &w,
        "$JS.API.STREAM.DELETE.LH_EVENTS",
        w.js.delete_stream("LH_EVENTS"),
    )
    .await;

    // Deleting the ordered consumers of their own watches (which the client
    // library makes anew), no worker, reaper or console deletes a shared
    // consumer.
    let r = s.connect("reaper").await;
    let c = s.connect("console").await;
    for (who, stream, consumer) in [
        (&w, "LH_WORK", "lh_workers_echo"),
        (&w, "LH_EVENTS", "lh_historian"),
        (&w, "LH_SIGNALS", "lh_signal_wakes"),
        (&r, "LH_EVENTS", "lh_historian"),
        (&r, "KV_lh_sessions", "lh_session_ends"),
        (&c, "KV_lh_sessions", "lh_session_ends"),
        (&c, "LH_SIGNALS", "lh_signal_wakes"),
    ] {
        let subject = format!("$JS.API.CONSUMER.DELETE.{stream}.{consumer}");
        refused(
            who,
            &subject,
            who.js.delete_consumer_from_stream(consumer, stream),
        )
        .await;
    }

    // A reaper purges by retention but may not delete a stream or purge the
    // work queue.
    refused(
        &r,
        "$JS.API.STREAM.DELETE.LH_DLQ",
        r.js.delete_stream("LH_DLQ"),
    )
    .await;
    refused_purge(&r, "LH_WORK").await;

    // Nothing was changed: the record, the events and the streams are there.
    assert_eq!(
        jobs.get("x-1").await.unwrap().unwrap().value.status,
        "queued"
    );
    assert!(jobs.get("x-2").await.unwrap().is_none());
    assert_eq!(events.read("x-1").await.unwrap().len(), 1);
    for stream in ["LH_WORK", "LH_EVENTS", "LH_DLQ"] {
        op.js.get_stream(stream).await.unwrap();
    }
    let names: Vec<String> = op.js.stream_names().map(Result::unwrap).collect().await;
    assert!(!names.iter().any(|n| n == "ROGUE"), "{names:?}");

    // The operator administers leasehold's layout and nothing else.
    refused(
        &op,
        "$JS.API.STREAM.CREATE.ROGUE",
        op.js.create_stream(rogue_stream()),
    )
    .await;

    // A submitter reads a report of several chunks, and follows a record,
    // without a consumer.
    let (code, out, err) = s.cli("submitter", &["result", "x-3"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out == doc, "{} bytes of {}", out.len(), doc.len());
    let (code, out, err) = s.cli("submitter", &["watch", "x-3", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().count(), 1, "{out}");

    // A client without its role's inbox prefix gets no answer at all, and
    // is told why instead of only timing out.
    let mut env = s.env("submitter");
    env.retain(|(k, _)| *k != "LH_INBOX_PREFIX");
    let out = tokio::process::Command::new(bin_path("leasehold"))
        .args(["status", "x-1"])
        .envs(env)
        .output()
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("Subscription to \"_INBOX.") && err.contains("LH_INBOX_PREFIX"),
        "{err}"
    );
}

/// The subjects of each role's lists in permissions.conf: (role, list) ->
/// subjects, lists `pub-allow`, `pub-deny`, `sub-allow`, `sub-deny`, and
/// `responses` when allow_responses is true.
fn conf_permissions(text: &str) -> BTreeMap<(String, String), BTreeSet<String>> {
    let mut out: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    let (mut role, mut dir, mut list) = (None::<String>, "", None::<String>);
    for raw in text.lines() {
        let line = raw.split('#').next().unwrap_or_default().trim();
        if let Some(name) = line
            .strip_suffix("_PERMISSIONS = {")
            .and_then(|l| l.strip_prefix("LH_"))
        {
            role = Some(name.to_ascii_lowercase());
            continue;
        }
        let Some(r) = role.clone() else { continue };
        match line {
            "publish = {" => dir = "pub",
            "subscribe = {" => dir = "sub",
            "allow = [" => list = Some(format!("{dir}-allow")),
            "deny = [" => list = Some(format!("{dir}-deny")),
            "]" => list = None,
            "allow_responses = true" => {
                out.entry((r, "responses".into())).or_default();
            }
            _ if line.starts_with("accounts") => role = None,
            _ => {
                if let Some(l) = &list {
                    let set = out.entry((r, l.clone())).or_default();
                    for (i, part) in line.split('"').enumerate() {
                        if i % 2 == 1 {
                            set.insert(part.to_string());
                        }
                    }
                }
            }
        }
    }
    out
}

#[test]
fn the_nsc_recipe_grants_what_the_server_config_grants() {
    let dir = deploy_nats();
    let conf = std::fs::read_to_string(dir.join("permissions.conf")).unwrap();
    let want = conf_permissions(&conf);
    for role in ROLES {
        assert!(
            want.contains_key(&(role.to_string(), "pub-allow".to_string())),
            "{role} has no publish permissions in permissions.conf"
        );
        assert!(
            conf.contains(&format!(
                "{{ user = \"lh-{role}\", password = $LH_{}_PASSWORD, permissions = $LH_{}_PERMISSIONS }}",
                role.to_ascii_uppercase(),
                role.to_ascii_uppercase()
            )),
            "the user lh-{role} is not defined with its role's permissions"
        );
        // Each role may subscribe to its own inbox prefix and no other.
        let subs = &want[&(role.to_string(), "sub-allow".to_string())];
        assert!(
            subs.contains(&format!("_INBOX_{role}.>")),
            "{role}: {subs:?}"
        );
        assert!(
            !subs
                .iter()
                .any(|s| s.starts_with("_INBOX") && *s != format!("_INBOX_{role}.>")),
            "{role}: {subs:?}"
        );
    }

    let out = std::process::Command::new("bash")
        .arg(dir.join("nsc.sh"))
        .arg("--dry-run")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    let mut got: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    let mut users = 0;
    for line in printed
        .lines()
        .filter(|l| l.starts_with("nsc 'add' 'user'"))
    {
        users += 1;
        // nsc 'add' 'user' '--account' 'A' '--name' 'lh-ROLE' '--allow-pub' 'a,b' ...
        let args: Vec<&str> = line
            .split('\'')
            .enumerate()
            .filter(|(i, _)| i % 2 == 1)
            .map(|(_, a)| a)
            .collect();
        let name = args[args.iter().position(|a| *a == "--name").unwrap() + 1];
        let role = name.strip_prefix("lh-").unwrap().to_string();
        let mut i = 0;
        while i < args.len() {
            let list = match args[i] {
                "--allow-pub" => Some("pub-allow"),
                "--deny-pub" => Some("pub-deny"),
                "--allow-sub" => Some("sub-allow"),
                "--deny-sub" => Some("sub-deny"),
                "--allow-pub-response" => {
                    got.entry((role.clone(), "responses".into())).or_default();
                    None
                }
                _ => None,
            };
            if let Some(l) = list {
                i += 1;
                got.entry((role.clone(), l.to_string()))
                    .or_default()
                    .extend(args[i].split(',').map(str::to_string));
            }
            i += 1;
        }
    }
    assert_eq!(users, ROLES.len(), "{printed}");
    assert_eq!(got, want, "nsc.sh and permissions.conf disagree");
    assert!(
        printed.contains("'generate' 'creds'") && printed.contains("'--js-disk-storage'"),
        "{printed}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_reads_as_lh_console_and_acts_only_through_an_operator_connection() {
    let s = Secured::start();
    let op = s.connect("operator").await;
    let (code, _, err) = s
        .cli("operator", &["setup", "--kinds", "echo,sleep,fanout"])
        .await;
    assert_eq!(code, 0, "{err}");
    let jobs = Jobs::open(&op).await.unwrap();
    let _worker = s.worker();
    wait_gateway(&op).await;
    let (code, out, err) = s
        .cli(
            "submitter",
            &[
                "submit",
                "echo",
                r#"{"input":{"hi":1}}"#,
                "--id",
                "c-done",
                "--wait",
                "--timeout",
                "20s",
            ],
        )
        .await;
    assert_eq!(
        (code, status_of(&out).as_str()),
        (0, "completed"),
        "{out}{err}"
    );
    let (code, _, err) = s
        .cli(
            "submitter",
            &[
                "submit",
                "sleep",
                r#"{"input":{"ms":60000}}"#,
                "--id",
                "c-nap",
            ],
        )
        .await;
    assert_eq!(code, 0, "{err}");
    wait_record(&jobs, "c-nap", "running", |r| r.status == "running").await;

    // Read-only: the jobs page, a job's page and its SSE stream to the end.
    let (ro, base) = console(&s, &[]).await;
    let http = reqwest::Client::new();
    // The running job is listed once it is indexed (after --index-after),
    // and the console's watch of the index follows within moments.
    let index = leasehold_testkit::doors::index::Active::open(&op)
        .await
        .unwrap();
    let mut w = index.kv().watch_with_history(">").await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(e) = w.next().await {
            if e.unwrap().key.ends_with(".c-nap") {
                return;
            }
        }
    })
    .await
    .expect("c-nap indexed");
    let mut page = String::new();
    for _ in 0..50 {
        let p = http.get(format!("{base}/jobs")).send().await.unwrap();
        assert_eq!(p.status(), 200);
        page = p.text().await.unwrap();
        if page.contains("/jobs/c-nap") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        page.contains("/jobs/c-done") && page.contains("/jobs/c-nap"),
        "{page}\n{}\n{:?}",
        ro.output(),
        s.violations()
    );
    let job = http.get(format!("{base}/jobs/c-nap")).send().await.unwrap();
    assert_eq!(job.status(), 200);
    let job = job.text().await.unwrap();
    assert!(
        job.contains("id=\"actions-off\""),
        "no note that actions are off: {job}"
    );
    assert!(
        job.contains("class=\"disabled button danger\" id=\"cancel\"")
            && !job.contains("href=\"/confirm?"),
        "the cancel button is not disabled: {job}"
    );
    let sse = http
        .get(format!("{base}/v1/jobs/c-done/events"))
        .send()
        .await
        .unwrap();
    assert_eq!(sse.status(), 200);
    let body = tokio::time::timeout(Duration::from_secs(20), sse.text())
        .await
        .expect("the stream of a finished job ends")
        .unwrap();
    assert!(
        body.contains("\"type\":\"claimed\"")
            && body.contains("\"type\":\"completed\"")
            && body.contains("event: end"),
        "{body}"
    );

    // ... and the other pages: the fleet, dead letters, reviews, and a
    // report read from its artifact.
    let doc = "# A report\n\nread by the console as lh-console\n";
    finished_with_report(&op, &jobs, "c-art", doc).await;
    for path in [
        "/fleet",
        "/dlq",
        "/reviews",
        "/jobs/c-art",
        "/history?status=completed",
    ] {
        let r = http.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}: {}", r.text().await.unwrap());
    }
    let r = http
        .get(format!("{base}/v1/jobs/c-art/result"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), doc);

    // An action is refused, saying why, and nothing is changed.
    let c = http
        .get(format!("{base}/confirm?action=cancel&id=c-nap"))
        .send()
        .await
        .unwrap();
    assert_eq!(c.status(), 503);
    let why = c.text().await.unwrap();
    assert!(
        why.contains("actions are off")
            && why.contains("lh-console")
            && why.contains("--operator-nats-user"),
        "{why}"
    );
    let a = http
        .post(format!("{base}/actions/cancel"))
        .form(&[("id", "c-nap")])
        .send()
        .await
        .unwrap();
    assert_eq!(a.status(), 503);
    assert!(a.text().await.unwrap().contains("actions are off"));
    assert_eq!(
        jobs.get("c-nap").await.unwrap().unwrap().value.status,
        "running"
    );
    assert!(
        !jobs
            .get("c-nap")
            .await
            .unwrap()
            .unwrap()
            .value
            .cancel_requested
    );
    drop(ro);

    // With an operator connection the same console cancels it.
    let token = "operator-token-0123456789".to_string();
    let (_rw, base) = console(
        &s,
        &[
            ("LH_CONSOLE_OPERATOR_NATS_USER", "lh-operator".into()),
            ("LH_CONSOLE_OPERATOR_NATS_PASSWORD", password("operator")),
            ("LH_CONSOLE_OPERATOR_TOKEN", token.clone()),
        ],
    )
    .await;
    let a = http
        .post(format!("{base}/actions/cancel"))
        .bearer_auth(&token)
        .form(&[("id", "c-nap")])
        .send()
        .await
        .unwrap();
    let status = a.status();
    let answer = a.text().await.unwrap();
    assert_eq!(status, 200, "{answer}");
    assert!(answer.contains("c-nap: cancel"), "{answer}");
    wait_record(&jobs, "c-nap", "cancelled", |r| r.status == "cancelled").await;

    // lh-console itself may not submit nor write a record.
    let con = s.connect("console").await;
    refused(&con, "lh.submit.echo", async {
        con.js
            .publish("lh.submit.echo", "{}".into())
            .await
            .unwrap()
            .await
    })
    .await;
    let kv = con.js.get_key_value("lh_jobs").await.unwrap();
    let why = refused(&con, "$KV.lh_jobs.c-done", kv.put("c-done", "{}".into())).await;
    assert!(why.contains("Permissions Violation for Publish"), "{why}");
    refused(
        &con,
        "lh.cancel.c-done",
        con.client.request("lh.cancel.c-done", "".into()),
    )
    .await;
    assert_eq!(
        jobs.get("c-done").await.unwrap().unwrap().value.status,
        "completed"
    );

    // The consoles' reads needed nothing the user lacks: the only refusals
    // of lh-console are the three above. The server writes each to its log
    // as it refuses it; the harness reads the log a moment later.
    let console_denied = || -> Vec<String> {
        s.violations()
            .into_iter()
            .filter(|(u, _)| u == "lh-console")
            .map(|(_, subj)| subj)
            .collect()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while console_denied().len() < 3 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let denied = console_denied();
    assert_eq!(
        denied,
        ["lh.submit.echo", "$KV.lh_jobs.c-done", "lh.cancel.c-done"],
        "{denied:?}"
    );
}

/// A completed job `id` whose result is the document `doc`, stored as
/// `<id>/report.md` (written by the operator's connection `op`).
async fn finished_with_report(
    op: &leasehold_testkit::doors::layout::Conn,
    jobs: &leasehold_testkit::doors::layout::Jobs,
    id: &str,
    doc: &str,
) {
    let name = format!("{id}/report.md");
    leasehold_testkit::doors::artifacts::Artifacts::open(op)
        .await
        .unwrap()
        .create(
            leasehold_testkit::doors::artifacts::NewArtifact {
                name: name.clone(),
                ..Default::default()
            },
            doc.as_bytes(),
        )
        .await
        .unwrap();
    let mut done = leasehold_testkit::record::new_record(
        id,
        "echo",
        Default::default(),
        0,
        std::time::SystemTime::now(),
    );
    done.status = "completed".into();
    done.result = Some(leasehold_proto::JobResult {
        artifact: Some(name),
        ..Default::default()
    });
    jobs.create(&done).await.unwrap();
}
