//! The operations endpoints on a real socket, scraped with reqwest.

use std::net::SocketAddr;
use std::time::Duration;

use leasehold_telemetry::http::{serve, HttpState};
use leasehold_telemetry::metrics::{AttemptOutcome, Metrics, ReaperMetrics};
use leasehold_telemetry::Readiness;

async fn get(client: &reqwest::Client, addr: SocketAddr, path: &str) -> (u16, String, String) {
    let r = client
        .get(format!("http://{addr}{path}"))
        .send()
        .await
        .expect("request");
    let status = r.status().as_u16();
    let ctype = r
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    (status, ctype, r.text().await.expect("body"))
}

#[tokio::test]
async fn healthz_readyz_and_metrics() {
    let metrics = Metrics::new();
    let readiness = Readiness::new();
    let server = serve(
        "127.0.0.1:0".parse().expect("addr"),
        HttpState::new(readiness.clone(), metrics.registry()),
    )
    .await
    .expect("bind a free port");
    let addr = server.local_addr;
    assert_ne!(addr.port(), 0);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("client");

    let (status, _, body) = get(&client, addr, "/healthz").await;
    assert_eq!((status, body.as_str()), (200, r#"{"status":"ok"}"#));

    // Not connected yet: 503 with a one-line reason.
    let (status, ctype, body) = get(&client, addr, "/readyz").await;
    assert_eq!(status, 503);
    assert!(ctype.starts_with("application/json"), "{ctype}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["ready"], false);
    assert_eq!(v["reason"], "not connected to NATS");
    assert!(!body.contains('\n'));

    readiness.set_connected(true);
    readiness.set_layout_ok(true);
    let (status, _, body) = get(&client, addr, "/readyz").await;
    assert_eq!((status, body.as_str()), (200, r#"{"ready":true}"#));

    // What a worker records shows up in the next scrape.
    metrics.claimed("echo");
    metrics
        .attempt_started("echo")
        .finish(AttemptOutcome::Completed);
    let (status, ctype, body) = get(&client, addr, "/metrics").await;
    assert_eq!(status, 200);
    assert!(ctype.starts_with("application/openmetrics-text"), "{ctype}");
    assert!(
        body.contains("leasehold_jobs_claimed_total{kind=\"echo\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("leasehold_jobs_completed_total{kind=\"echo\"} 1"),
        "{body}"
    );
    assert!(
        body.contains(
            "leasehold_attempt_duration_seconds_count{kind=\"echo\",outcome=\"completed\"} 1"
        ),
        "{body}"
    );
    assert!(body.ends_with("# EOF\n"));

    // SIGTERM: draining is never ready again, even while still connected.
    readiness.set_draining();
    let (status, _, body) = get(&client, addr, "/readyz").await;
    assert_eq!(status, 503);
    assert_eq!(
        body,
        r#"{"ready":false,"reason":"draining: shutting down"}"#
    );
    let (status, _, _) = get(&client, addr, "/healthz").await;
    assert_eq!(status, 200, "alive while draining");

    let (status, _, _) = get(&client, addr, "/nope").await;
    assert_eq!(status, 404);
    server.join.abort();
}

#[tokio::test]
async fn a_taken_port_is_an_error_and_reaper_metrics_serve_too() {
    let reaper = ReaperMetrics::new("r-a");
    reaper.recovered(1);
    let first = serve(
        "127.0.0.1:0".parse().expect("addr"),
        HttpState::new(Readiness::new(), reaper.registry()),
    )
    .await
    .expect("bind");
    let again = serve(
        first.local_addr,
        HttpState::new(Readiness::new(), reaper.registry()),
    )
    .await;
    assert!(again.is_err(), "the port is taken");
    let client = reqwest::Client::new();
    let (status, _, body) = get(&client, first.local_addr, "/metrics").await;
    assert_eq!(status, 200);
    assert!(
        body.contains("leasehold_reaper_recoveries_total{replica=\"r-a\"} 1"),
        "{body}"
    );
    first.join.abort();
}
