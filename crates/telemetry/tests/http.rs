//! The operations endpoints on a real socket, scraped with reqwest.

use std::net::SocketAddr;
use std::time::Duration;

use leasehold_telemetry::http::{serve, HttpState};
use std::sync::Arc;

use leasehold_telemetry::metrics::build_info;
use leasehold_telemetry::Readiness;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// A registry as a process makes one: the build info, and a family some
/// crate registered on it (the worker's and the reaper's are tested in
/// their crates).
type Claimed = Family<Vec<(String, String)>, Counter>;

fn registry() -> (Arc<Registry>, Claimed) {
    let mut r = Registry::default();
    build_info(&mut r, "leasehold-test");
    let claimed = Claimed::default();
    r.register("leasehold_jobs_claimed", "Claims won", claimed.clone());
    (Arc::new(r), claimed)
}

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
    let (registry, claimed) = registry();
    let readiness = Readiness::new();
    let server = serve(
        "127.0.0.1:0".parse().expect("addr"),
        HttpState::new(readiness.clone(), registry),
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

    // What a process counts shows up in the next scrape.
    claimed
        .get_or_create(&vec![("kind".into(), "echo".into())])
        .inc();
    let (status, ctype, body) = get(&client, addr, "/metrics").await;
    assert_eq!(status, 200);
    assert!(ctype.starts_with("application/openmetrics-text"), "{ctype}");
    assert!(
        body.contains("leasehold_jobs_claimed_total{kind=\"echo\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("leasehold_build_info{service=\"leasehold-test\""),
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
async fn a_taken_port_is_an_error() {
    let (registry, _) = registry();
    let first = serve(
        "127.0.0.1:0".parse().expect("addr"),
        HttpState::new(Readiness::new(), registry.clone()),
    )
    .await
    .expect("bind");
    let again = serve(first.local_addr, HttpState::new(Readiness::new(), registry)).await;
    assert!(again.is_err(), "the port is taken");
    let client = reqwest::Client::new();
    let (status, _, _) = get(&client, first.local_addr, "/metrics").await;
    assert_eq!(status, 200, "the first server still serves");
    first.join.abort();
}
