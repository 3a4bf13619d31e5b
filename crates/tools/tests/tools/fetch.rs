//! `fetch` and `search` against the simulator's web, and `fetch`'s refusals
//! of private destinations (all refused before any connection is made).

use std::time::{Duration, Instant};

use leasehold_tools::{
    AllowList, CallCtx, Disposition, FetchConfig, FetchTool, NoEvents, Outcome, RetryPolicy,
    ToolError, Toolbox,
};
use serde_json::{json, Value};

use crate::support::Sim;

fn fetch_box(allow: &str, tweak: impl FnOnce(&mut FetchConfig)) -> Toolbox {
    let mut config = FetchConfig {
        allow: AllowList::parse(allow).unwrap(),
        ..FetchConfig::default()
    };
    tweak(&mut config);
    let mut tb = Toolbox::new(None, std::sync::Arc::new(NoEvents));
    tb.register(std::sync::Arc::new(FetchTool::new(config)))
        .unwrap();
    // One attempt: these tests are about the fetch, not the retry layer.
    tb.set_retry(RetryPolicy {
        max_attempts: 1,
        ..RetryPolicy::default()
    });
    tb
}

async fn fetch(tb: &Toolbox, url: &str) -> Result<Value, ToolError> {
    tb.call(
        &CallCtx::new("job-f", "s#1", 1),
        "fetch",
        &json!({ "url": url }),
    )
    .await
    .map(|o| o.value)
}

fn assert_refused(r: Result<Value, ToolError>, what: &str) {
    match r {
        Err(e @ ToolError::Refused(_)) => assert_eq!(e.disposition(), Disposition::ReturnToModel),
        other => panic!("{what}: expected a refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn fetch_refuses_private_loopback_and_metadata_addresses() {
    let sim = Sim::start().await;
    let tb = fetch_box("", |_| {});
    let port = sim.addr.port();
    for url in [
        format!("http://127.0.0.1:{port}/page/leases"),
        format!("http://[::1]:{port}/page/leases"),
        "http://10.0.0.1/".to_string(),
        "http://192.168.1.10/".to_string(),
        "http://169.254.169.254/latest/meta-data/".to_string(),
        "http://[fd00:ec2::254]/latest/meta-data/".to_string(),
        "http://[::ffff:127.0.0.1]/".to_string(),
        "http://0.0.0.0/".to_string(),
        // A name that resolves to a loopback address.
        format!("http://localhost:{port}/page/leases"),
    ] {
        let started = Instant::now();
        assert_refused(fetch(&tb, &url).await, &url);
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{url} took too long: refused after connecting?"
        );
    }
    let err = fetch(&tb, "ftp://example.com/x").await.unwrap_err();
    assert_eq!(err.class(), "validation", "the schema only admits http(s)");
}

#[tokio::test]
async fn fetch_refuses_a_redirect_to_a_private_address() {
    let sim = Sim::start().await;
    let tb = fetch_box("127.0.0.1", |_| {});
    assert_refused(
        fetch(&tb, &format!("{}/page/redirect-private", sim.base)).await,
        "metadata redirect",
    );
    assert_refused(
        fetch(
            &tb,
            &format!("{}/page/redirect?to=http://10.0.0.1/admin", sim.base),
        )
        .await,
        "10/8 redirect",
    );
    assert_refused(
        fetch(
            &tb,
            &format!(
                "{}/page/redirect?to=http://[::1]:{}/page/leases",
                sim.base,
                sim.addr.port()
            ),
        )
        .await,
        "::1 redirect",
    );
    // A redirect that stays on the allow-listed host is followed.
    let page = fetch(
        &tb,
        &format!("{}/page/redirect?to=/page/fencing-tokens", sim.base),
    )
    .await
    .unwrap();
    assert_eq!(page["redirects"], 1);
    assert!(page["url"]
        .as_str()
        .unwrap()
        .ends_with("/page/fencing-tokens"));
}

#[tokio::test]
async fn fetch_of_an_allow_listed_simulator_returns_page_text() {
    let sim = Sim::start().await;
    let tb = fetch_box("127.0.0.1", |_| {});
    let page = fetch(&tb, &format!("{}/page/leases", sim.base))
        .await
        .unwrap();
    assert_eq!(page["status"], 200);
    assert_eq!(page["content_type"], "text/html");
    assert_eq!(
        page["title"],
        "Leases: time-bounded ownership in distributed systems"
    );
    let text = page["text"].as_str().unwrap();
    assert!(text.contains("fencing tokens"), "{text}");
    assert!(!text.contains("<p>"), "{text}");
    assert!(
        !text.contains("var tracking"),
        "scripts are not text: {text}"
    );
    assert_eq!(page["truncated"], false);

    let plain = fetch(&tb, &format!("{}/page/plain", sim.base))
        .await
        .unwrap();
    assert!(plain["text"]
        .as_str()
        .unwrap()
        .starts_with("Plain text page."));
    let err = fetch(&tb, &format!("{}/page/binary", sim.base))
        .await
        .unwrap_err();
    assert_eq!(err.class(), "bad_response");
    let err = fetch(&tb, &format!("{}/page/no-such-page", sim.base))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ToolError::Upstream { status: 404, .. }),
        "{err:?}"
    );
    assert_eq!(err.disposition(), Disposition::ReturnToModel);

    // Allow-listing a host name admits it whatever it resolves to.
    let by_name = fetch_box("localhost", |_| {});
    let page = fetch(
        &by_name,
        &format!("http://localhost:{}/page/heartbeats", sim.addr.port()),
    )
    .await
    .unwrap();
    assert!(page["text"].as_str().unwrap().contains("Heartbeat"));
}

#[tokio::test]
async fn fetch_honours_size_and_time_limits() {
    let sim = Sim::start().await;
    let tb = fetch_box("127.0.0.1", |c| {
        c.max_bytes = 10_000;
        c.timeout = Duration::from_millis(400);
    });
    let page = fetch(&tb, &format!("{}/page/big?kb=300", sim.base))
        .await
        .unwrap();
    assert_eq!(page["truncated"], true);
    assert_eq!(page["bytes"], 10_000);

    let started = Instant::now();
    let err = fetch(&tb, &format!("{}/page/slow?ms=5000", sim.base))
        .await
        .unwrap_err();
    assert!(matches!(err, ToolError::Timeout(_)), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn search_results_point_at_fetchable_pages() {
    let sim = Sim::start().await;
    let mut config = leasehold_tools::ToolboxConfig::with_base_url(&sim.base);
    config.fetch.allow = AllowList::parse("127.0.0.1").unwrap();
    let tb = Toolbox::builtin(&config, None, std::sync::Arc::new(NoEvents)).unwrap();
    let ctx = CallCtx::new("job-s", "s#1", 1);
    let out = tb
        .call(
            &ctx,
            "search",
            &json!({"q": "fencing tokens stale owners", "max_results": 3}),
        )
        .await
        .unwrap();
    assert_eq!(out.outcome, Outcome::Executed);
    let results = out.value["results"].as_array().unwrap();
    assert_eq!(results.len(), 3);
    assert_eq!(results[0]["title"], "Fencing tokens and stale owners");
    // Deterministic: the same query gives the same answer.
    let again = tb
        .call(
            &ctx,
            "search",
            &json!({"q": "fencing tokens stale owners", "max_results": 3}),
        )
        .await
        .unwrap();
    assert_eq!(again.value, out.value);
    let url = results[0]["url"].as_str().unwrap();
    let page = tb
        .call(&ctx, "fetch", &json!({ "url": url }))
        .await
        .unwrap();
    assert!(page.value["text"].as_str().unwrap().contains("token"));
    // A SearxNG without JSON enabled answers 403, which is not retried.
    let r = reqwest::get(format!("{}/search?q=x", sim.base))
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
}
