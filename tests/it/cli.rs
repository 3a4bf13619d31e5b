//! The binaries as a user runs them: setup, verification, configuration
//! errors, and the CLI's submit/status/list/watch/cancel/result.

use std::time::Duration;

use leasehold_harness::{bin_path, wait_for_jetstream, FaultProxy, NatsServer};

use leasehold_testkit::{cli, Fleet};

#[tokio::test]
async fn setup_is_idempotent_and_workers_name_what_is_missing() {
    let s = NatsServer::start();
    wait_for_jetstream(&s.url(), Duration::from_secs(10)).await;
    // A worker on a bare server refuses to start and says what is missing.
    let w = tokio::process::Command::new(bin_path("leasehold-worker"))
        .env("NATS_URL", s.url())
        .output()
        .await
        .unwrap();
    assert!(!w.status.success());
    let err = String::from_utf8_lossy(&w.stderr);
    assert!(
        err.contains("run `leasehold setup`") && err.contains("LH_WORK") && err.contains("lh_jobs"),
        "{err}"
    );
    for _ in 0..2 {
        let (code, out, err) = cli(&s.url(), &["setup", "--ack-wait", "2s"]).await;
        assert_eq!(code, 0, "{err}");
        assert!(
            out.contains("LH_EVENTS") && out.contains("lh_effects") && out.contains("lh_artifacts"),
            "{out}"
        );
    }
}

/// The server makes the event stream but its answer is lost (the
/// client's request times out): setup waits for the server, tries again,
/// finds the stream there and finishes; the stream is asked for once.
// The fault proxy runs in this test's runtime: it needs threads of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_whose_answer_was_lost_finds_what_it_made_and_finishes() {
    let s = NatsServer::start();
    wait_for_jetstream(&s.url(), Duration::from_secs(10)).await;
    let proxy = FaultProxy::start(&s.url()).await;
    let create = "$JS.API.STREAM.CREATE.LH_EVENTS";
    proxy.mute_reply_to(create, 1);
    let (code, out, err) = cli(&proxy.url(), &["setup"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(err.contains("NATS unavailable; retrying"), "{err}");
    assert_eq!(proxy.published(create), 1, "the stream was asked for again");
    let (code, out, err) = cli(&s.url(), &["setup", "--check"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
}

#[tokio::test]
async fn bad_configuration_is_refused_with_what_to_change() {
    let w = tokio::process::Command::new(bin_path("leasehold-worker"))
        .args(["--session-timeout", "2s", "--session-renew", "1500ms"])
        .env("NATS_URL", "nats://127.0.0.1:1")
        .output()
        .await
        .unwrap();
    assert!(!w.status.success());
    let err = String::from_utf8_lossy(&w.stderr);
    assert!(
        err.contains("--session-renew") && err.contains("half of --session-timeout"),
        "{err}"
    );
    let w = tokio::process::Command::new(bin_path("leasehold-worker"))
        .args(["--worker-id", "pod.1"])
        .env("NATS_URL", "nats://127.0.0.1:1")
        .output()
        .await
        .unwrap();
    assert!(
        String::from_utf8_lossy(&w.stderr).contains("--worker-id \"pod.1\""),
        "{}",
        String::from_utf8_lossy(&w.stderr)
    );
    let w = tokio::process::Command::new(bin_path("leasehold-worker"))
        .args(["--session-timeout", "soon"])
        .output()
        .await
        .unwrap();
    assert!(
        String::from_utf8_lossy(&w.stderr).contains("write it like 500ms"),
        "{}",
        String::from_utf8_lossy(&w.stderr)
    );
    let (code, _, err) = cli("nats://127.0.0.1:1", &["status", "x"]).await;
    assert_eq!(code, 1);
    assert!(
        err.contains("NATS_URL") || err.contains("cannot connect"),
        "{err}"
    );
}

/// Runs `leasehold-worker` with only the given environment (no inherited
/// `LH_*`), against a port where nothing listens: a configuration error must
/// stop it before it tries to connect.
async fn worker_with_env(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let out = tokio::process::Command::new(bin_path("leasehold-worker"))
        .args(args)
        .env_clear()
        .env("NATS_URL", "nats://127.0.0.1:1")
        .envs(env.iter().copied())
        .output()
        .await
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout),
    )
}

#[tokio::test]
async fn a_bad_workload_variable_stops_the_worker_at_start() {
    for (k, v) in [
        ("LH_MODEL_BASE_URL", "vllm.models:8000/v1"),
        ("LH_MODEL_IDLE_TIMEOUT", "30"),
        ("LH_MODEL_STREAM", "sometimes"),
        ("LH_FETCH_TIMEOUT", "soon"),
        ("LH_PUBLISH_URL", "hooks/effects"),
        ("LH_RESEARCH_EXPERT_CONCURRENCY", "0"),
    ] {
        let (code, out) = worker_with_env(&[], &[(k, v)]).await;
        assert_eq!(code, 2, "{k}={v}: {out}");
        assert!(out.contains(k), "{k}={v}: the message must name it: {out}");
    }
    // One duration syntax for flags too: a bare number needs its unit.
    let (code, out) = worker_with_env(&["--drain-timeout", "30"], &[]).await;
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("30s"), "{out}");
}

#[tokio::test]
async fn test_kinds_are_served_only_with_the_dev_switch() {
    let (code, out) = worker_with_env(&[], &[("LH_KINDS", "echo,crash")]).await;
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("crash") && out.contains("--dev-kinds"),
        "{out}"
    );
    let (code, out) = worker_with_env(&[], &[("LH_RESEARCH_CRASH_AT", "after_artifact")]).await;
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("LH_RESEARCH_CRASH_AT"), "{out}");
    // Allowed, the worker gets past its configuration and fails to connect.
    let (code, out) =
        worker_with_env(&[], &[("LH_KINDS", "echo,crash"), ("LH_DEV_KINDS", "1")]).await;
    assert_eq!(code, 1, "{out}");
    let (code, out) = worker_with_env(&[], &[("LH_DEV_KINDS", "maybe")]).await;
    assert_eq!(code, 2, "{out}");
}

#[tokio::test]
async fn worker_help_lists_every_variable_it_reads() {
    let (code, help) = worker_with_env(&["--help"], &[]).await;
    assert_eq!(code, 0, "{help}");
    // Issue 24: the log and trace variables were missing.
    let vars = leasehold_testkit::doors::worker_env_vars();
    for k in vars {
        assert!(help.contains(k), "--help does not mention {k}:\n{help}");
    }
    // And the reaper's.
    let out = tokio::process::Command::new(bin_path("leasehold-reaper"))
        .arg("--help")
        .output()
        .await
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for k in leasehold_testkit::doors::telemetry_env_vars() {
        assert!(
            help.contains(k),
            "reaper --help does not mention {k}:\n{help}"
        );
    }
    // And the sim's (issue 24: it pointed at source-code docs instead).
    let out = tokio::process::Command::new(bin_path("leasehold-sim"))
        .arg("--help")
        .output()
        .await
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    let src = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../labs/sim/src/model.rs"
    ))
    .unwrap()
        + &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../labs/sim/src/effects.rs"
        ))
        .unwrap()
        + &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../labs/sim/src/model/faults.rs"
        ))
        .unwrap();
    let mut vars: Vec<&str> = src
        .match_indices("\"LH_SIM_")
        .map(|(i, _)| {
            let rest = &src[i + 1..];
            let end = rest
                .find(|c: char| !(c.is_ascii_uppercase() || c == '_'))
                .unwrap_or(rest.len());
            &rest[..end]
        })
        .collect();
    vars.sort();
    vars.dedup();
    assert!(vars.len() >= 6, "{vars:?}");
    for k in vars {
        assert!(help.contains(k), "sim --help does not mention {k}:\n{help}");
    }
}

#[tokio::test]
async fn cli_submit_wait_status_list_result_cancel() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    let url = env.url();
    let (code, out, err) = cli(
        &url,
        &[
            "submit",
            "echo",
            r#"{"input":{"hi":1}}"#,
            "--id",
            "cli-1",
            "--wait",
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    // One JSON document on stdout (for `| jq`), the id in it.
    let rec: serde_json::Value = serde_json::from_str(&out).expect("stdout is one JSON document");
    assert_eq!(
        (rec["id"].as_str(), rec["status"].as_str()),
        (Some("cli-1"), Some("completed")),
        "{out}"
    );
    let (code, out, _) = cli(&url, &["result", "cli-1"]).await;
    assert_eq!((code, out.trim()), (0, r#"{"hi":1}"#));
    let (code, out, _) = cli(&url, &["status", "cli-1"]).await;
    assert_eq!(code, 0);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&out).unwrap()["status"],
        "completed"
    );
    // Finished jobs are not in the index of active jobs: listing them is
    // an explicit scan of the history.
    let (code, _, err) = cli(&url, &["list", "--status", "completed"]).await;
    assert!(code != 0 && err.contains("--all"), "{err}");
    let (code, out, _) = cli(&url, &["list", "--all", "--status", "completed", "--json"]).await;
    assert_eq!(code, 0);
    assert!(out.lines().any(|l| l.contains("\"cli-1\"")), "{out}");
    // A bad spec is refused locally with the precise error and exit 2.
    let (code, _, err) = cli(&url, &["submit", "sleep", r#"{"input":{"ms":"x"}}"#]).await;
    assert_eq!(code, 2);
    assert!(err.contains("input.ms"), "{err}");
    // Cancel a running job; watch ends at the terminal state.
    let (code, out, _) = cli(
        &url,
        &[
            "submit",
            "sleep",
            "--input",
            r#"{"ms":60000}"#,
            "--id",
            "cli-2",
        ],
    )
    .await;
    assert_eq!((code, out.trim()), (0, "cli-2"));
    env.wait_status("cli-2", "running", Duration::from_secs(10))
        .await;
    env.wait_indexed("cli-2", Duration::from_secs(10)).await;
    let (code, out, _) = cli(&url, &["list", "--status", "running", "--json"]).await;
    assert_eq!(code, 0);
    assert!(out.lines().any(|l| l.contains("\"cli-2\"")), "{out}");
    let (code, _, err) = cli(&url, &["watch", "cli-2", "--timeout", "300ms"]).await;
    assert_eq!(code, 124, "a watch that times out says so: {err}");
    assert!(
        err.contains("still running") && err.contains("leasehold watch cli-2"),
        "{err}"
    );
    let (code, out, _) = cli(&url, &["cancel", "cli-2"]).await;
    assert_eq!(code, 0, "{out}");
    let (code, out, _) = cli(&url, &["watch", "cli-2", "--json"]).await;
    assert_eq!(
        code, 1,
        "watch exits non-zero when the job did not complete"
    );
    assert!(
        out.lines().last().unwrap().contains("\"cancelled\""),
        "{out}"
    );
    let (code, _, err) = cli(&url, &["result", "cli-2"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("cancelled"), "{err}");
    stop.cancel();
    w.wait().await.unwrap();
}

/// Runs the CLI with extra environment and stdin.
async fn cli_with(args: &[&str], env: &[(&str, String)], stdin: &str) -> (i32, String, String) {
    use tokio::io::AsyncWriteExt;
    let mut cmd = tokio::process::Command::new(bin_path("leasehold"));
    cmd.args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.as_bytes()).await.unwrap();
    drop(input);
    let out = child.wait_with_output().await.unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn transcript_repair_exit_codes_say_warm_cold_or_unreadable() {
    // The seed's example: one complete exchange, one call without its result.
    let warm = serde_json::json!([
        {"role": "system", "content": "You write sections."},
        {"role": "user", "content": "Write the reliability section."},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{\"q\":\"worker leases\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "search results"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "fetch", "arguments": "{\"url\":\"https://example.com/article\"}"}}]}
    ]);
    let (code, out, err) = cli_with(&["transcript", "repair"], &[], &warm.to_string()).await;
    assert_eq!(code, 0, "{err}");
    let kept: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(
        kept.len(),
        4,
        "the unresolved call is dropped, the complete exchange kept: {out}"
    );
    assert_eq!(kept[3]["role"], "tool");
    assert!(!err.is_empty(), "a report on stderr");
    // A tool result before any call cannot be repaired into a warm thread.
    let cold = serde_json::json!([
        {"role": "user", "content": "Write it."},
        {"role": "tool", "tool_call_id": "ghost", "content": "orphan"}
    ]);
    let (code, _, _) = cli_with(
        &[
            "transcript",
            "repair",
            "--section-prompt",
            "Not in the transcript",
        ],
        &[],
        &cold.to_string(),
    )
    .await;
    assert_eq!(code, 3, "only a cold retry can continue");
    let (code, _, err) = cli_with(&["transcript", "repair"], &[], "not json").await;
    assert_eq!(code, 2, "{err}");
}

#[tokio::test]
async fn model_check_and_tool_call_through_the_workers_layers() {
    let env = Fleet::start().await;
    let (_sim, base) = leasehold_testkit::spawn_sim(&[]).await;
    let model_env = [("LH_MODEL_BASE_URL", format!("{base}/v1"))];
    let (code, out, err) = cli_with(
        &["model", "check", "--prompt", "Say hello."],
        &model_env,
        "",
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["outcome"], "complete", "{report}");
    // A model that cuts the stream before its terminal event: incomplete, retried.
    let (_bad, bad_base) = leasehold_testkit::spawn_sim(&[
        ("LH_SIM_FAULT_RATE", "1".into()),
        ("LH_SIM_FAULT_KINDS", "cut".into()),
    ])
    .await;
    let (code, out, _) = cli_with(
        &["model", "check", "--attempts", "2"],
        &[("LH_MODEL_BASE_URL", format!("{bad_base}/v1"))],
        "",
    )
    .await;
    assert_ne!(code, 0);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["class"], "incomplete_generation", "{report}");
    // The same tool call twice with a job and step: one effect, then a replay.
    let tool_env = [
        ("NATS_URL", env.url()),
        ("LH_PUBLISH_URL", format!("{base}/effects")),
    ];
    let args = r#"{"title":"t","document":"once"}"#;
    let call = [
        "tool",
        "call",
        "publish",
        "--args",
        args,
        "--job",
        "j1",
        "--step",
        "publish#0",
    ];
    let (code, first, err) = cli_with(&call, &tool_env, "").await;
    assert_eq!(code, 0, "{err}");
    let (code, second, err) = cli_with(&call, &tool_env, "").await;
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = reqwest::get(format!("{base}/effects/count"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["count"], 1, "the repeat replayed the stored result");
    assert_eq!(first, second, "the same result both times");
    let (code, out, _) = cli_with(&["tool", "list"], &tool_env, "").await;
    assert_eq!(code, 0);
    assert!(
        out.contains("publish") && out.contains("fetch") && out.contains("search"),
        "{out}"
    );
}

#[tokio::test]
async fn setup_migrates_an_old_layout_and_check_reports_drift_without_changing_it() {
    use async_nats::jetstream::{kv, stream};
    let s = NatsServer::start();
    wait_for_jetstream(&s.url(), Duration::from_secs(10)).await;
    let js = async_nats::jetstream::new(async_nats::connect(s.url()).await.unwrap());
    // The layout an earlier release made: an unbounded work queue, 64
    // revisions per record, events for 30 days, no sessions or index.
    js.create_stream(stream::Config {
        name: "LH_WORK".into(),
        subjects: vec!["lh.submit.research".into()],
        retention: stream::RetentionPolicy::WorkQueue,
        ..Default::default()
    })
    .await
    .unwrap();
    js.create_key_value(kv::Config {
        bucket: "lh_jobs".into(),
        history: 64,
        ..Default::default()
    })
    .await
    .unwrap();
    js.create_stream(stream::Config {
        name: "LH_EVENTS".into(),
        subjects: vec!["lh.events.>".into()],
        max_age: Duration::from_secs(30 * 86_400),
        ..Default::default()
    })
    .await
    .unwrap();
    // An earlier release's work consumer: the server's default 512 waiting
    // pulls, which cannot be changed in place.
    js.get_stream("LH_WORK")
        .await
        .unwrap()
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("lh_workers_research".into()),
            filter_subject: "lh.submit.research".into(),
            ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
            max_waiting: 512,
            ..Default::default()
        })
        .await
        .unwrap();
    let url = s.url();
    let (code, out, err) = cli(&url, &["setup", "--check"]).await;
    assert_eq!(code, 1, "drift makes --check fail: {err}");
    assert!(
        out.contains("drift    stream LH_WORK: ") && out.contains("max_msgs none -> 1000000"),
        "{out}"
    );
    // Unbounded bytes get a bound; 64 revisions are a choice, kept.
    assert!(
        out.contains("drift    kv lh_jobs: ")
            && out.contains("max_bytes none -> 2147483648")
            && !out.contains("max_msgs_per_subject"),
        "{out}"
    );
    assert!(out.contains("missing  kv lh_sessions"), "{out}");
    // Nothing changed.
    let mut w = js.get_stream("LH_WORK").await.unwrap();
    assert_eq!(w.info().await.unwrap().config.max_messages, -1);
    assert!(js.get_key_value("lh_sessions").await.is_err());

    let (code, out, err) = cli(&url, &["setup"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("updated  stream LH_WORK: "), "{out}");
    // The events' 30 days and the consumer's 512 pulls are settings as set
    // up: a setup not asked to change them keeps them.
    assert!(!out.contains("max_age 30days"), "{out}");
    assert!(!out.contains("max_waiting 512"), "{out}");
    assert!(out.contains("created  kv lh_sessions"), "{out}");
    let (code, out, err) = cli(
        &url,
        &["setup", "--events-max-age", "0s", "--max-waiting", "4096"],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("updated  stream LH_EVENTS: ") && out.contains("max_age 30days -> none"),
        "{out}"
    );
    assert!(
        out.contains("updated  consumer lh_workers_research: ")
            && out.contains("max_waiting 512 -> 4096")
            && out.contains("made again"),
        "{out}"
    );
    let c = w.consumer_info("lh_workers_research").await.unwrap();
    assert_eq!(c.config.max_waiting, 4096);
    assert_eq!(w.info().await.unwrap().config.max_messages, 1_000_000);
    let (code, out, err) = cli(&url, &["setup", "--check"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("no drift"), "{err}");
    // A second setup changes nothing and says so.
    let (code, _, err) = cli(&url, &["setup"]).await;
    assert_eq!(code, 0);
    assert!(err.contains("already as wanted"), "{err}");
}

#[tokio::test]
async fn setup_fits_its_default_bounds_to_a_small_server_and_never_lowers_an_explicit_one() {
    // `nats-server -js` on a machine with little free disk limits JetStream
    // to 75% of it: the default bounds (2 + 10 + 1 GiB) must still set up,
    // lowered and said so, or the product cannot start there at all.
    let s = NatsServer::start_with_file_store("4G"); // 4 * 10^9 bytes
    wait_for_jetstream(&s.url(), Duration::from_secs(10)).await;
    let url = s.url();
    let (code, out, err) = cli(&url, &["setup", "--kinds", "echo"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("created  stream LH_EVENTS (max_bytes 1.2 GiB instead of the default 10 GiB")
            && out.contains("max_file_store"),
        "{out}"
    );
    let js = async_nats::jetstream::new(async_nats::connect(&url).await.unwrap());
    let mut bytes = Vec::new();
    for name in ["LH_WORK", "LH_EVENTS", "LH_DLQ"] {
        let mut st = js.get_stream(name).await.unwrap();
        bytes.push(st.info().await.unwrap().config.max_bytes);
    }
    // Fitted as a whole before anything was made: every default halved
    // together (three times here), none below 64 MiB.
    assert_eq!(
        bytes,
        vec![256 << 20, 10 << 27, 128 << 20],
        "bounds as fitted"
    );
    let mut buckets = Vec::new();
    for name in [
        "KV_lh_jobs",
        "KV_lh_payloads",
        "KV_lh_active",
        "KV_lh_sessions",
        "KV_lh_effects",
        "OBJ_lh_artifacts",
    ] {
        let mut st = js.get_stream(name).await.unwrap();
        buckets.push(st.info().await.unwrap().config.max_bytes);
    }
    assert_eq!(
        buckets,
        vec![
            256 << 20,
            256 << 20,
            64 << 20,
            64 << 20,
            128 << 20,
            512 << 20
        ],
        "every bucket bounded and fitted"
    );
    // Idempotent: a second setup and a check find nothing to change.
    let (code, out, err) = cli(&url, &["setup", "--kinds", "echo"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("already as wanted"), "{out}{err}");
    let (code, out, err) = cli(&url, &["setup", "--kinds", "echo", "--check"]).await;
    assert_eq!(code, 0, "{out}{err}");
    // A bound asked for explicitly is never lowered: a clear error, and the
    // stream keeps what it had.
    let (code, out, err) = cli(
        &url,
        &["setup", "--kinds", "echo", "--events-max-bytes", "8GiB"],
    )
    .await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("max_file_store") && err.contains("--events-max-bytes"),
        "{err}"
    );
    let mut st = js.get_stream("LH_EVENTS").await.unwrap();
    assert_eq!(st.info().await.unwrap().config.max_bytes, 10 << 27);
}

#[tokio::test]
async fn tool_call_of_one_step_with_other_arguments_is_refused() {
    // A write's identity is its job, step and tool: a warm retry whose model
    // re-words the call must not make a second effect.
    let env = Fleet::start().await;
    let (_sim, base) = leasehold_testkit::spawn_sim(&[]).await;
    let tool_env = [
        ("NATS_URL", env.url()),
        ("LH_PUBLISH_URL", format!("{base}/effects")),
    ];
    let call = |args: &'static str| {
        [
            "tool",
            "call",
            "publish",
            "--args",
            args,
            "--job",
            "j-reworded",
            "--step",
            "publish#0",
        ]
    };
    let (code, _, err) = cli_with(
        &call(r#"{"title":"Report","document":"the first wording"}"#),
        &tool_env,
        "",
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = cli_with(
        &call(r#"{"title":"Report","document":"the same report, worded again"}"#),
        &tool_env,
        "",
    )
    .await;
    let count: serde_json::Value = reqwest::get(format!("{base}/effects/count"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        count["count"], 1,
        "no second effect; second call said: {out}{err}"
    );
    assert_ne!(code, 0, "the reuse is refused: {out}{err}");
    assert!(
        err.contains("key_reuse") && err.contains("different arguments"),
        "a clear error: {err}"
    );
}

// Issue 18: after `setup --kinds research,echo,sleep`, a plain `setup` (the
// hint `setup --check` gave) removed echo and sleep with an echo ticket
// queued: echo workers refused to start and echo submissions failed.
#[tokio::test]
async fn setup_never_removes_a_kind_silently_and_prunes_only_an_empty_one() {
    let s = NatsServer::start();
    wait_for_jetstream(&s.url(), Duration::from_secs(10)).await;
    let url = s.url();
    let (code, _, err) = cli(&url, &["setup", "--kinds", "research,echo,sleep"]).await;
    assert_eq!(code, 0, "{err}");
    let js = async_nats::jetstream::new(async_nats::connect(&url).await.unwrap());
    // The kinds' subjects; each comes with its lanes' (`.*.*`), checked here.
    let subjects = |js: async_nats::jetstream::Context| async move {
        let mut st = js.get_stream("LH_WORK").await.unwrap();
        let all = st.info().await.unwrap().config.subjects.clone();
        let mut v: Vec<String> = all
            .iter()
            .filter(|s| !s.ends_with(".*.*"))
            .cloned()
            .collect();
        for k in &v {
            assert!(
                all.contains(&format!("{k}.*.*")),
                "{k} without its lanes: {all:?}"
            );
        }
        assert_eq!(all.len(), 2 * v.len(), "{all:?}");
        v.sort();
        v
    };
    let all = vec!["lh.submit.echo", "lh.submit.research", "lh.submit.sleep"];
    // An echo ticket waits (no worker).
    js.publish("lh.submit.echo", r#"{"input":{}}"#.into())
        .await
        .unwrap()
        .await
        .unwrap();
    // Without --kinds: the kinds set up are what is wanted.
    let (code, out, err) = cli(&url, &["setup", "--check"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = cli(&url, &["setup"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(subjects(js.clone()).await, all);
    // Leaving kinds out is refused without --prune, and changes nothing.
    let (code, out, err) = cli(&url, &["setup", "--kinds", "research"]).await;
    assert_ne!(code, 0, "{out}");
    assert!(
        err.contains("leaves out echo, sleep") && err.contains("--prune"),
        "{err}"
    );
    assert_eq!(subjects(js.clone()).await, all);
    // With --prune, a kind with a queued ticket is refused, with its count.
    let (code, out, err) = cli(&url, &["setup", "--kinds", "research,sleep", "--prune"]).await;
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("kind echo has 1 ticket(s) queued"), "{err}");
    assert_eq!(subjects(js.clone()).await, all);
    // An empty kind goes, subject and consumer.
    let (code, out, err) = cli(&url, &["setup", "--kinds", "research,echo", "--prune"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("removed  kind sleep"), "{out}");
    assert_eq!(
        subjects(js.clone()).await,
        vec!["lh.submit.echo", "lh.submit.research"]
    );
    let w = js.get_stream("LH_WORK").await.unwrap();
    assert!(w.consumer_info("lh_workers_sleep").await.is_err());
    assert!(w.consumer_info("lh_workers_echo").await.is_ok());
    // The echo ticket is still there.
    let mut w = js.get_stream("LH_WORK").await.unwrap();
    assert_eq!(w.info().await.unwrap().state.messages, 1);
}

// Issue 18 (the soak's operators): `setup --kinds ...,deliver` to add a kind
// put every setting not given back to its default: a 20 s dedupe window
// became 1 h, 64 revisions 8, an ack wait of 5 s 10 s (and on a cluster set
// up with --replicas 3, every stream one replica).
#[tokio::test]
async fn adding_a_kind_keeps_every_setting_it_was_not_asked_to_change() {
    let s = NatsServer::start();
    wait_for_jetstream(&s.url(), Duration::from_secs(10)).await;
    let url = s.url();
    let flags = [
        "--dedupe-window",
        "20s",
        "--job-history",
        "64",
        "--ack-wait",
        "5s",
        "--max-deliver",
        "7",
        "--dlq-max-age",
        "2d",
    ];
    let mut first = vec!["setup", "--kinds", "echo"];
    first.extend(flags);
    let (code, _, err) = cli(&url, &first).await;
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = cli(&url, &["setup", "--kinds", "echo,sleep"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        !out.contains("dedupe_window") && !out.contains("max_msgs_per_subject"),
        "changed what it was not asked to: {out}"
    );
    let js = async_nats::jetstream::new(async_nats::connect(&url).await.unwrap());
    let mut w = js.get_stream("LH_WORK").await.unwrap();
    let cfg = w.info().await.unwrap().config.clone();
    assert_eq!(cfg.duplicate_window, Duration::from_secs(20));
    for kind in ["echo", "sleep"] {
        let c = w
            .consumer_info(format!("lh_workers_{kind}"))
            .await
            .unwrap()
            .config;
        assert_eq!(c.ack_wait, Duration::from_secs(5), "{kind}");
        assert_eq!(c.max_deliver, 7, "{kind}");
    }
    let mut jobs = js.get_stream("KV_lh_jobs").await.unwrap();
    assert_eq!(
        jobs.info().await.unwrap().config.max_messages_per_subject,
        64
    );
    let mut dlq = js.get_stream("LH_DLQ").await.unwrap();
    assert_eq!(
        dlq.info().await.unwrap().config.max_age,
        Duration::from_secs(2 * 86_400)
    );
    // Nothing drifts from what is set up; a setting given is applied.
    let (code, out, err) = cli(&url, &["setup", "--check"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = cli(&url, &["setup", "--dedupe-window", "1m"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("dedupe_window"), "{out}");
    let cfg = w.info().await.unwrap().config.clone();
    assert_eq!(cfg.duplicate_window, Duration::from_secs(60));
}

// Issue 18: `submit … --id nw-1` with no worker running: `list` showed 0
// jobs, `status nw-1` said no job, `cancel nw-1` said `not_found`, yet it
// ran once a worker came back.
#[tokio::test]
async fn a_job_submitted_while_no_worker_runs_is_visible_and_cancellable_at_once() {
    let env = Fleet::start().await;
    let url = env.url();
    for id in ["nw-1", "nw-2"] {
        let (code, out, err) = cli(
            &url,
            &["submit", "echo", r#"{"input":{"n":1}}"#, "--id", id],
        )
        .await;
        assert_eq!(code, 0, "{err}");
        assert_eq!(out.trim(), id);
        assert!(!err.contains("could not be written"), "{err}");
    }
    let (code, out, err) = cli(&url, &["status", "nw-1"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&out).unwrap()["status"],
        "queued"
    );
    let (code, out, err) = cli(&url, &["list", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("nw-1") && out.contains("nw-2"), "{out}");
    let (code, out, err) = cli(&url, &["cancel", "nw-1"]).await;
    assert_eq!(code, 0, "{out}{err}");
    env.wait_status("nw-1", "cancelled", Duration::from_secs(5))
        .await;
    // A worker that comes back runs the other one, and not the cancelled one.
    let (w, stop) = env.worker().await;
    let done = env
        .wait_status("nw-2", "completed", Duration::from_secs(10))
        .await;
    assert_eq!(done.epoch, 1, "one claim of the record the submit wrote");
    assert_eq!(env.record("nw-1").await.unwrap().status, "cancelled");
    stop.cancel();
    w.wait().await.unwrap();
}

// Issue 18: on a server whose storage could not hold another layout, setup
// created 3 streams, failed on the 4th (exit 1), and `leasehold submit`
// into that half layout exited 0. Now the whole reservation is worked out
// first: nothing is created, the error gives the numbers, and nothing
// accepts a submission.
#[tokio::test]
async fn setup_that_cannot_reserve_the_layout_creates_nothing_and_says_how_much_it_needs() {
    let s = NatsServer::start_with_file_store("300M");
    wait_for_jetstream(&s.url(), Duration::from_secs(10)).await;
    let url = s.url();
    let (code, out, err) = cli(&url, &["setup", "--kinds", "echo"]).await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("needs at least")
            && err.contains("Nothing was created")
            && err.contains("--jobs-max-bytes"),
        "{err}"
    );
    let js = async_nats::jetstream::new(async_nats::connect(&url).await.unwrap());
    let names: Vec<String> = futures::StreamExt::collect::<Vec<_>>(js.stream_names())
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(names.is_empty(), "nothing created: {names:?}");
    let (code, _, err) = cli(&url, &["submit", "echo", r#"{"input":{}}"#, "--id", "half"]).await;
    assert_ne!(code, 0, "a submission into no layout is refused: {err}");
    // Bounds that fit: it sets up.
    let small = [
        "setup",
        "--kinds",
        "echo",
        "--work-max-bytes",
        "16MiB",
        "--events-max-bytes",
        "16MiB",
        "--dlq-max-bytes",
        "16MiB",
        "--jobs-max-bytes",
        "16MiB",
        "--payloads-max-bytes",
        "16MiB",
        "--active-max-bytes",
        "16MiB",
        "--sessions-max-bytes",
        "16MiB",
        "--effects-max-bytes",
        "16MiB",
        "--artifacts-max-bytes",
        "16MiB",
        "--history-max-bytes",
        "4MiB",
        "--schedules-max-bytes",
        "16MiB",
        "--signals-max-bytes",
        "4MiB",
    ];
    let (code, out, err) = cli(&url, &small).await;
    assert_eq!(code, 0, "{out}{err}");
}

// A full bucket of job records refuses writes, never drops: the jobs that
// find no room wait with their tickets, the worker says why, and once the
// bound is raised every one of them runs.
#[tokio::test]
async fn a_full_job_records_bucket_holds_jobs_back_and_loses_none() {
    let o = leasehold_testkit::SetupOptions {
        jobs_max_bytes: 48 << 10,
        fit: leasehold_testkit::doors::layout::Fit::EXACT,
        ..leasehold_testkit::SetupOptions::default()
    };
    let env = Fleet::with(o.clone()).await;
    let w = env.worker_proc(&[], &[]);
    leasehold_testkit::wait_log(&w, "worker starting", Duration::from_secs(10)).await;
    let n = 80;
    for i in 0..n {
        env.submit(
            "echo",
            serde_json::json!({"input": {"i": i}}),
            &format!("full-{i}"),
        )
        .await;
    }
    leasehold_testkit::wait_log(
        &w,
        "the job records' bucket is full",
        Duration::from_secs(30),
    )
    .await;
    let mut done = 0;
    for i in 0..n {
        if env
            .jobs
            .get(&format!("full-{i}"))
            .await
            .unwrap()
            .is_some_and(|v| v.value.status == "completed")
        {
            done += 1;
        }
    }
    assert!(
        done < n,
        "the bucket filled before every job ran ({done} of {n})"
    );
    leasehold_testkit::doors::layout::ensure(
        &env.conn,
        &leasehold_testkit::SetupOptions {
            jobs_max_bytes: 64 << 20,
            ..o
        },
    )
    .await
    .unwrap();
    for i in 0..n {
        env.wait_status(&format!("full-{i}"), "completed", Duration::from_secs(30))
            .await;
    }
}

// Issue 24: `watch` on a mistyped id waited for ever, silently.
#[tokio::test]
async fn watch_refuses_an_unknown_id_unless_told_to_wait_for_it() {
    let env = Fleet::start().await;
    let url = env.url();
    let (code, out, err) = cli(&url, &["watch", "no-such-job"]).await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("no job no-such-job") && err.contains("--wait-for-id"),
        "{err}"
    );
    let (code, _, err) = cli(
        &url,
        &["watch", "not-yet", "--wait-for-id", "--timeout", "500ms"],
    )
    .await;
    assert_eq!(code, 124, "{err}");
    assert!(err.contains("not picked up yet"), "{err}");
}

// Issue 24: `result` of a failed job sent the user to `watch`; there was no
// `result --wait`.
#[tokio::test]
async fn result_says_what_happened_and_can_wait_for_the_end() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    let url = env.url();
    env.submit(
        "fail",
        serde_json::json!({"input": {"class": "terminal", "times": 1}}),
        "res-failed",
    )
    .await;
    env.wait_status("res-failed", "failed", Duration::from_secs(10))
        .await;
    let (code, out, err) = cli(&url, &["result", "res-failed"]).await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("is failed: ") && err.contains("terminal"),
        "{err}"
    );
    env.submit(
        "sleep",
        serde_json::json!({"input": {"ms": 600}}),
        "res-later",
    )
    .await;
    let (code, out, err) = cli(&url, &["result", "res-later", "--wait", "--timeout", "20s"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(!out.trim().is_empty(), "{out}");
    stop.cancel();
    w.wait().await.unwrap();
}

// Issue 24: `cancel` of an unknown or finished job printed only JSON.
#[tokio::test]
async fn cancel_of_an_unknown_or_finished_job_says_why() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    let url = env.url();
    let (code, out, err) = cli(&url, &["cancel", "never-was"]).await;
    assert_eq!(code, 1, "{out}");
    assert!(err.contains("error: no job never-was"), "{err}");
    env.submit("echo", serde_json::json!({"input": {}}), "done-already")
        .await;
    env.wait_status("done-already", "completed", Duration::from_secs(10))
        .await;
    let (code, _, err) = cli(&url, &["cancel", "done-already"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("is completed: nothing to cancel"), "{err}");
    stop.cancel();
    w.wait().await.unwrap();
}

// Issue 24: a malformed --input exited 1 and an unreadable @file 1, while
// the reference (and a malformed spec) say 2: bad input is bad usage.
#[tokio::test]
async fn unreadable_submissions_exit_2_like_any_bad_input() {
    let env = Fleet::start().await;
    let url = env.url();
    for args in [
        vec!["submit", "echo", "--input", "{not json"],
        vec!["submit", "echo", "@/no/such/file.json"],
        vec!["submit", "echo", "{not json"],
    ] {
        let (code, _, err) = cli(&url, &args).await;
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains("nothing was submitted"), "{args:?}: {err}");
    }
}

// Issue 24: the NATS CLI was the only way to see a job's event history.
#[tokio::test]
async fn events_show_a_jobs_history_and_follow_it_to_its_end() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    let url = env.url();
    let (code, _, err) = cli(&url, &["events", "nobody"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("no job nobody"), "{err}");
    env.submit("sleep", serde_json::json!({"input": {"ms": 800}}), "ev-1")
        .await;
    env.wait_status("ev-1", "running", Duration::from_secs(10))
        .await;
    // Follows from mid-run to the end.
    let (code, out, err) = cli(&url, &["events", "ev-1", "--follow", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    let types: Vec<String> = out
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["type"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(
        types.first().map(String::as_str),
        Some("claimed"),
        "{types:?}"
    );
    assert_eq!(
        types.last().map(String::as_str),
        Some("completed"),
        "{types:?}"
    );
    let (code, out, _) = cli(&url, &["events", "ev-1"]).await;
    assert_eq!(code, 0);
    assert!(out.lines().any(|l| l.contains(" completed ")), "{out}");
    stop.cancel();
    w.wait().await.unwrap();
}

// Issue 24: live workers and fleet counts were only visible with the NATS CLI.
#[tokio::test]
async fn workers_and_stats_show_the_fleet() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    let url = env.url();
    env.submit(
        "sleep",
        serde_json::json!({"input": {"ms": 3000}}),
        "st-run",
    )
    .await;
    env.wait_status("st-run", "running", Duration::from_secs(10))
        .await;
    env.wait_indexed("st-run", Duration::from_secs(10)).await;
    let (code, out, err) = cli(&url, &["workers", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    let rows: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 1, "{out}");
    assert_eq!(rows[0]["worker_id"], w.worker_id.as_str());
    assert_eq!(rows[0]["running"], 1);
    let (code, out, err) = cli(&url, &["stats", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["active_by_kind"]["sleep"]["running"], 1, "{v}");
    assert_eq!(v["oldest_running"]["job"], "st-run", "{v}");
    let (code, out, _) = cli(&url, &["stats"]).await;
    assert_eq!(code, 0);
    assert!(out.lines().any(|l| l.starts_with("sleep")), "{out}");
    stop.cancel();
    w.wait().await.unwrap();
}

// Issue 24: bulk cancel and bulk replay/purge of dead letters by filter,
// each with a dry run that changes nothing, `--yes` to act, and a filter
// matching nothing an error.
#[tokio::test]
async fn bulk_cancel_and_dead_letter_replay_and_purge_by_filter() {
    let env = Fleet::start().await;
    let url = env.url();
    for id in ["bulk-a1", "bulk-a2", "bulk-b1"] {
        let (code, _, err) = cli(&url, &["submit", "echo", r#"{"input":{}}"#, "--id", id]).await;
        assert_eq!(code, 0, "{err}");
    }
    let (code, out, err) = cli(&url, &["cancel", "--id-prefix", "bulk-a", "--dry-run"]).await;
    assert_eq!(code, 0, "{err}");
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(lines.iter().all(|l| l["would"] == "cancel"), "{out}");
    let status = |id: &'static str| {
        let jobs = env.jobs.clone();
        async move { jobs.get(id).await.unwrap().unwrap().value.status }
    };
    assert_eq!(
        status("bulk-a1").await,
        "queued",
        "a dry run changes nothing"
    );
    let (code, _, err) = cli(&url, &["cancel", "--id-prefix", "bulk-a"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("2 active job(s) match") && err.contains("--yes"),
        "{err}"
    );
    let (code, out, err) = cli(&url, &["cancel", "--id-prefix", "bulk-a", "--yes"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(status("bulk-a1").await, "cancelled");
    assert_eq!(status("bulk-a2").await, "cancelled");
    assert_eq!(status("bulk-b1").await, "queued");
    let (code, _, err) = cli(&url, &["cancel", "--id-prefix", "nothing-", "--yes"]).await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no active job matches"), "{err}");
    let (code, out, err) = cli(&url, &["cancel", "--id-prefix", "nothing-", "--dry-run"]).await;
    assert_eq!(
        (code, out.as_str()),
        (0, ""),
        "a dry run listing nothing: {err}"
    );
    let (code, _, err) = cli(&url, &["cancel"]).await;
    assert_eq!(code, 2, "an id or a filter is required: {err}");

    // Two rejected submissions become dead letters once a worker reads them.
    for id in ["bulk-bad-1", "bulk-bad-2"] {
        env.work
            .submit("echo", b"{\"input\":[1,2".to_vec().into(), Some(id), None)
            .await
            .unwrap();
    }
    let (_w, stop) = env.worker().await;
    let dlq = leasehold_testkit::doors::dlq::Dlq::new(&env.conn);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while dlq.count().await.unwrap() < 2 {
        assert!(tokio::time::Instant::now() < deadline, "no dead letters");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (code, out, err) = cli(&url, &["dlq", "replay", "--class", "rejected", "--dry-run"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().count(), 2, "{out}");
    // Their bytes are still refused: each replay says so, the letters stay.
    let (code, _, err) = cli(&url, &["dlq", "replay", "--class", "rejected", "--yes"]).await;
    assert_eq!(code, 1, "{err}");
    assert_eq!(err.matches("still refused").count(), 2, "{err}");
    assert_eq!(dlq.count().await.unwrap(), 2);
    let (code, out, err) = cli(&url, &["dlq", "purge", "--kind", "echo", "--dry-run"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().count(), 2, "{out}");
    assert_eq!(dlq.count().await.unwrap(), 2, "a dry run deletes nothing");
    let (code, _, err) = cli(&url, &["dlq", "purge", "--kind", "sleep", "--yes"]).await;
    assert_eq!(code, 1, "{err}");
    let (code, out, err) = cli(&url, &["dlq", "purge", "--kind", "echo", "--yes"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"purged\":2"), "{out}");
    assert_eq!(dlq.count().await.unwrap(), 0);
    stop.cancel();
}

// Issue 24: `--json` on every command, data on stdout (one document or
// JSON lines) and messages on stderr.
#[tokio::test]
async fn every_command_takes_json_and_prints_only_json_on_stdout() {
    let env = Fleet::start().await;
    let url = env.url();
    let (_w, stop) = env.worker().await;
    let (code, _, err) = cli(
        &url,
        &["submit", "echo", r#"{"input":{"n":7}}"#, "--id", "j-1"],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    env.wait_status("j-1", "completed", Duration::from_secs(10))
        .await;
    let commands: &[(&[&str], i32)] = &[
        (
            &["submit", "echo", r#"{"input":{}}"#, "--id", "j-2", "--json"],
            0,
        ),
        (&["status", "j-1", "--json"], 0),
        (&["result", "j-1", "--json"], 0),
        (&["result", "no-such-job", "--json"], 1),
        (&["cancel", "j-1", "--json"], 1),
        (&["list", "--all", "--json"], 0),
        (&["events", "j-1", "--json"], 0),
        (&["workers", "--json"], 0),
        (&["stats", "--json"], 0),
        (&["review", "list", "--json"], 0),
        (&["dlq", "list", "--json"], 0),
        (&["tool", "list", "--json"], 0),
        (&["setup", "--check", "--json"], 0),
        (&["schedule", "list", "--json"], 0),
        (&["schedule", "pause", "no-such-schedule", "--json"], 1),
    ];
    for (args, want) in commands {
        let (code, out, err) = cli(&url, args).await;
        assert_eq!(code, *want, "{args:?}: {out}{err}");
        // One document (possibly pretty), or JSON lines.
        let docs: Vec<serde_json::Value> = if let Ok(one) = serde_json::from_str(&out) {
            vec![one]
        } else {
            out.lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{args:?}: {e}: {l}")))
                .collect()
        };
        // Empty lists (no parked job, no dead letter) are zero lines.
        let may_be_empty =
            matches!(args[0], "review" | "dlq" | "schedule") || args[1] == "no-such-job";
        if !may_be_empty {
            assert!(!docs.is_empty(), "{args:?} printed nothing: {err}");
        }
    }
    let (_, out, _) = cli(&url, &["result", "j-1", "--json"]).await;
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(doc["output"], serde_json::json!({"n": 7}), "{doc}");
    let (_, out, _) = cli(&url, &["setup", "--check", "--json"]).await;
    assert!(
        out.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .all(|v| v["state"] == "ok"),
        "{out}"
    );
    stop.cancel();
}

// Issue 24: offline commands listed the ten NATS connection options.
#[tokio::test]
async fn help_lists_connection_options_only_where_the_command_connects() {
    let help = |args: &'static [&'static str]| async move {
        let out = tokio::process::Command::new(bin_path("leasehold"))
            .args(args)
            .output()
            .await
            .unwrap();
        assert!(out.status.success(), "{args:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    for offline in [
        &["transcript", "repair", "--help"][..],
        &["model", "check", "--help"],
        &["tool", "list", "--help"],
    ] {
        let h = help(offline).await;
        assert!(!h.contains("--nats-url"), "{offline:?}:\n{h}");
    }
    for online in [
        &["status", "--help"][..],
        &["submit", "--help"],
        &["tool", "call", "--help"],
    ] {
        let h = help(online).await;
        assert!(
            h.contains("NATS connection") && h.contains("--nats-url"),
            "{online:?}:\n{h}"
        );
    }
    // The options are still accepted (and ignored) where they are hidden.
    let out = tokio::process::Command::new(bin_path("leasehold"))
        .args(["tool", "list", "--nats-url", "nats://127.0.0.1:1"])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `list`'s first page, newest first (the default), reads the index from
/// its end only, and gives the rows the whole listing gives: jobs created
/// in three bursts 2.5 s apart (so the read can stop short of the first),
/// and the oldest job's entry written again last (written newest, created
/// oldest: it stays at the end).
#[tokio::test]
async fn list_newest_first_reads_the_end_of_the_index_and_gives_the_whole_listings_rows() {
    use leasehold_testkit::doors::index::Key;
    use leasehold_testkit::doors::owner::machine;
    let env = Fleet::start().await;
    let mut n = 0;
    for burst in 0..3 {
        if burst > 0 {
            // Creation times apart by more than the 2 s allowed for clocks.
            tokio::time::sleep(Duration::from_millis(2500)).await;
        }
        for _ in 0..150 {
            let id = format!("q-{n:04}");
            let r = machine::new_record(
                &id,
                "echo",
                Default::default(),
                0,
                std::time::SystemTime::now(),
            );
            env.seed_record(&r).await;
            n += 1;
        }
    }
    let oldest = env.record("q-0000").await.unwrap();
    env.active()
        .await
        .put(
            &Key::Wait {
                job: "q-0000".into(),
            },
            &oldest,
        )
        .await
        .unwrap();
    let ids = |out: &str| -> Vec<String> {
        out.lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["id"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect()
    };
    let url = env.url();
    let (code, page, err) = leasehold_testkit::cli_with(
        &["list", "--status", "queued", "--limit", "5", "--json"],
        [
            ("NATS_URL", url.as_str()),
            ("RUST_LOG", "leasehold_store::index=debug"),
            ("NO_COLOR", "1"),
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    // It stopped short of the whole index (451 messages).
    assert!(
        err.contains("newest index entries") && err.contains("whole=false enough=true"),
        "{err}"
    );
    let (code, all, _) = cli(
        &url,
        &["list", "--status", "queued", "--limit", "10000", "--json"],
    )
    .await;
    assert_eq!(code, 0);
    let (page, all) = (ids(&page), ids(&all));
    assert_eq!(all.len(), 450);
    assert_eq!(page, all[..5].to_vec());
    assert!(page.iter().all(|id| id.as_str() >= "q-0300"), "{page:?}");
    assert!(
        all[..300].iter().all(|id| id != "q-0000"),
        "the oldest job stays at the end"
    );
    assert!(
        err.contains(&format!("more follow: add --after {}", page[4])),
        "{err}"
    );
    // The next page continues where the first ended.
    let (_, next, _) = cli(
        &url,
        &[
            "list", "--status", "queued", "--limit", "5", "--after", &page[4], "--json",
        ],
    )
    .await;
    assert_eq!(ids(&next), all[5..10].to_vec());
    // A later page reads the index's end too: back to its own last job
    // (here in the newest burst), not the whole index.
    let (code, later, err) = leasehold_testkit::cli_with(
        &[
            "list", "--status", "queued", "--limit", "5", "--after", &all[100], "--json",
        ],
        [
            ("NATS_URL", url.as_str()),
            ("RUST_LOG", "leasehold_store::index=debug"),
            ("NO_COLOR", "1"),
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(ids(&later), all[101..106].to_vec());
    assert!(
        err.contains("whole=false enough=true") && !err.contains("whole=true"),
        "{err}"
    );
    // A page in an older burst, and the last page, as the whole listing.
    for at in [200, 440] {
        let (_, p, _) = cli(
            &url,
            &[
                "list", "--status", "queued", "--limit", "5", "--after", &all[at], "--json",
            ],
        )
        .await;
        assert_eq!(
            ids(&p),
            all[at + 1..(at + 6).min(450)].to_vec(),
            "after {at}"
        );
    }
    // A cursor no longer listed starts from the start, as before.
    let (_, p, _) = cli(
        &url,
        &[
            "list", "--status", "queued", "--limit", "5", "--after", "gone", "--json",
        ],
    )
    .await;
    assert_eq!(ids(&p), all[..5].to_vec());
    // A kind filter on the same path.
    let (_, none, _) = cli(
        &url,
        &["list", "--status", "queued", "--kind", "sleep", "--json"],
    )
    .await;
    assert!(ids(&none).is_empty());
}
