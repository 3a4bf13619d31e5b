//! The binaries as a user runs them: setup, verification, configuration
//! errors, and the CLI's submit/status/list/watch/cancel/result.

use std::time::Duration;

use leasehold_harness::{bin_path, wait_for_jetstream, NatsServer};

use crate::support::Env;

/// Runs the CLI without blocking the test's runtime (in-process workers share it).
async fn cli(url: &str, args: &[&str]) -> (i32, String, String) {
    let out = tokio::process::Command::new(bin_path("leasehold"))
        .args(args)
        .env("NATS_URL", url)
        .output()
        .await
        .expect("run leasehold");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

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

#[tokio::test]
async fn bad_configuration_is_refused_with_what_to_change() {
    let w = tokio::process::Command::new(bin_path("leasehold-worker"))
        .args(["--lease", "1s", "--heartbeat", "2s"])
        .env("NATS_URL", "nats://127.0.0.1:1")
        .output()
        .await
        .unwrap();
    assert!(!w.status.success());
    let err = String::from_utf8_lossy(&w.stderr);
    assert!(
        err.contains("--heartbeat") && err.contains("shorter than --lease"),
        "{err}"
    );
    let w = tokio::process::Command::new(bin_path("leasehold-worker"))
        .args(["--lease", "soon"])
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

#[tokio::test]
async fn cli_submit_wait_status_list_result_cancel() {
    let env = Env::new().await;
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
    assert!(
        out.starts_with("cli-1\n") && out.contains("\"completed\""),
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
    let (code, out, _) = cli(&url, &["list", "--status", "completed", "--json"]).await;
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
