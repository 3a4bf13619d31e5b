//! `remote`: what a remote kind (a kind served by an HTTP service through
//! the worker protocol) costs, for each SDK (Python, TypeScript), against
//! baselines of the same run:
//!
//! - per step: the gap between two consecutive `step` events of one job
//!   (seen on a core NATS subscription as they are published), through the
//!   SDK's `conformance` kind, against the same empty steps of a Rust kind
//!   measured the same way, and a raw HTTP round trip (an `invoke` the
//!   service answers at once) to the same service;
//! - echo jobs/s with 4 worker processes: the SDK's `echo` kind against the
//!   built-in Rust `echo`.
//!
//! Targets (issues 21, 36): a remote step p50 at most 2 ms above the raw
//! round trip; remote echo at least 50% of the Rust echo's jobs/s. The
//! Python figures are the part's top-level fields (as before); the
//! TypeScript SDK's are under `typescript`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use leasehold::{Ctx, Error, Kind, Options};
use leasehold_harness::{free_port, Proc};
use leasehold_store::setup::SetupOptions;
use leasehold_store::work::Work;
use leasehold_store::{Conn, Jobs};
use serde_json::{json, Value};
use std::future::IntoFuture;
use tokio_util::sync::CancellationToken;

use crate::common::{ms, next_rec, pct, server, summary, terminal, wait_log, worker, Report};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap_or_else(|_| PathBuf::from("."))
}

/// The SDK serving the remote kinds of a measurement.
#[derive(Clone, Copy, Debug)]
enum Sdk {
    Python,
    TypeScript,
}

impl Sdk {
    fn name(self) -> &'static str {
        match self {
            Sdk::Python => "python",
            Sdk::TypeScript => "typescript",
        }
    }

    /// The SDK's invoice example (which serves `conformance` and
    /// `echo-remote`) on `port`.
    async fn service(self, port: u16) -> anyhow::Result<Proc> {
        match self {
            Sdk::Python => python_service(port, 2).await,
            Sdk::TypeScript => typescript_service(port).await,
        }
    }
}

/// The Python SDK serving `examples/invoice-python` on `port` with
/// `processes` processes
/// (`LH_PYTHON`, else `python3` with the checkout's SDK).
async fn python_service(port: u16, processes: usize) -> anyhow::Result<Proc> {
    let root = repo();
    let (python, path) = match std::env::var("LH_PYTHON") {
        Ok(p) => (
            p,
            root.join("examples/invoice-python").display().to_string(),
        ),
        Err(_) => (
            "python3".to_string(),
            format!(
                "{}:{}",
                root.join("sdks/python/src").display(),
                root.join("examples/invoice-python").display()
            ),
        ),
    };
    let p = Proc::spawn_path(
        std::path::Path::new(&python),
        &[
            "-m",
            "leasehold",
            "serve",
            "app:app",
            "--port",
            &port.to_string(),
        ],
        &[
            ("PYTHONPATH", path),
            ("PYTHONUNBUFFERED", "1".into()),
            ("LEASEHOLD_PROCESSES", processes.to_string()),
        ],
        None,
    );
    wait_log(&p, "listening on ", Duration::from_secs(15)).await?;
    Ok(p)
}

/// The TypeScript SDK serving `examples/invoice-typescript` on `port`, one
/// Node process (`LH_TYPESCRIPT_SDK`: the npm prefix `make typescript-sdk`
/// installed it into, else the checkout's; `LH_NODE`, else `node`).
async fn typescript_service(port: u16) -> anyhow::Result<Proc> {
    let root = repo();
    let app = root.join("examples/invoice-typescript/app.js");
    let app = app.to_str().unwrap_or("app.js");
    let port = port.to_string();
    let p = match std::env::var_os("LH_TYPESCRIPT_SDK") {
        Some(prefix) => Proc::spawn_path(
            &PathBuf::from(prefix).join("node_modules/.bin/leasehold"),
            &["serve", app, "--port", &port],
            &[],
            None,
        ),
        None => {
            let node = std::env::var("LH_NODE").unwrap_or_else(|_| "node".into());
            let bin = root.join("sdks/typescript/bin/leasehold.js");
            Proc::spawn_path(
                std::path::Path::new(&node),
                &[bin.to_str().unwrap_or(""), "serve", app, "--port", &port],
                &[],
                None,
            )
        }
    };
    wait_log(&p, "listening on ", Duration::from_secs(15)).await?;
    Ok(p)
}

/// Empty steps (the Rust baseline).
struct Empty(usize);

#[leasehold::async_trait]
impl Kind for Empty {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        for _ in 0..self.0 {
            ctx.step("count", || async { Ok(()) }).await?;
        }
        Ok(json!({}))
    }
}

/// Runs job `id` of `kind` and returns the gaps (ms) between its
/// consecutive step events, as published.
async fn step_gaps(conn: &Conn, kind: &str, id: &str, input: Value) -> anyhow::Result<Vec<f64>> {
    let jobs = Jobs::open(conn).await?;
    let work = Work::new(conn);
    let times = Arc::new(Mutex::new(Vec::new()));
    let mut sub = conn
        .client
        .subscribe(conn.layout.event_subject(id, "step"))
        .await?;
    let t = times.clone();
    let task = tokio::spawn(async move {
        while sub.next().await.is_some() {
            t.lock().unwrap().push(Instant::now());
        }
    });
    let mut w = jobs.watch(id).await?;
    work.submit(
        kind,
        json!({"input": input}).to_string().into(),
        Some(id),
        None,
    )
    .await?;
    let (_, rec) = next_rec(&mut w, id, Duration::from_secs(600), |r| {
        terminal(&r.status)
    })
    .await?;
    anyhow::ensure!(rec.status == "completed", "{kind}: {rec:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    task.abort();
    let t = times.lock().unwrap().clone();
    Ok(t.windows(2).map(|w| ms(w[1] - w[0])).collect())
}

/// Publishes `n` jobs of `kind` and waits until all completed.
async fn batch(conn: &Conn, kind: &str, n: usize, tag: &str) -> anyhow::Result<Duration> {
    let jobs = Jobs::open(conn).await?;
    let mut watch = jobs.watch_all().await?;
    let t0 = Instant::now();
    let subject = conn.layout.submit_subject(kind);
    let mut acks = futures::stream::FuturesUnordered::new();
    for i in 0..n {
        let m = async_nats::jetstream::message::PublishMessage::build()
            .payload(r#"{"input":{"n":1}}"#.into())
            .message_id(format!("{tag}-{i}"));
        acks.push(
            conn.js
                .send_publish(subject.clone(), m)
                .await?
                .into_future(),
        );
        while acks.len() >= 512 {
            acks.next().await.transpose()?;
        }
    }
    while acks.next().await.transpose()?.is_some() {}
    let mut done = std::collections::HashSet::new();
    while done.len() < n {
        let e = tokio::time::timeout(Duration::from_secs(120), watch.next())
            .await
            .map_err(|_| anyhow::anyhow!("{tag}: {} of {n} done after 120 s", done.len()))?
            .ok_or_else(|| anyhow::anyhow!("watch ended"))??;
        if e.key.starts_with(tag)
            && std::str::from_utf8(&e.value).is_ok_and(|v| v.contains("\"status\":\"completed\""))
        {
            done.insert(e.key.clone());
        }
    }
    Ok(t0.elapsed())
}

/// The raw round trip to the service at `url`: an invoke it answers at
/// once, `n` times (ms each).
async fn raw_round_trips(url: &str, n: usize) -> anyhow::Result<Vec<f64>> {
    let http = reqwest::Client::new();
    let call = json!({"protocol": 1, "type": "invoke",
        "job": {"id": "raw", "kind": "conformance", "input": {"steps": 0}, "epoch": 1, "attempt": 1, "deadline": null},
        "journal": {"from": 0, "total": 0, "entries": [], "next_cursor": null}});
    let mut raw = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let v: Value = http
            .post(format!("{url}invoke"))
            .json(&call)
            .send()
            .await?
            .json()
            .await?;
        anyhow::ensure!(v["op"] == "complete", "raw call: {v}");
        raw.push(ms(t.elapsed()));
    }
    Ok(raw)
}

/// Echo jobs/s of `kind` with 4 worker processes (`extra`: their
/// environment besides the concurrency).
async fn echo_rate(
    srv_url: &str,
    conn: &Conn,
    kind: &str,
    name: &str,
    extra: Vec<(&'static str, String)>,
    jobs: usize,
) -> anyhow::Result<f64> {
    let mut extra = extra;
    extra.push(("LH_CONCURRENCY", "64".into()));
    let procs: Vec<Proc> = (0..4).map(|_| worker(srv_url, &extra)).collect();
    batch(conn, kind, 32, &format!("warm-{name}")).await?;
    let took = batch(conn, kind, jobs, &format!("tp-{name}")).await?;
    drop(procs);
    Ok(jobs as f64 / took.as_secs_f64())
}

/// The part: `steps` remote steps per measurement, `jobs` echo jobs per
/// throughput run; each SDK against the Rust baselines.
pub async fn remote(steps: usize, jobs: usize) -> anyhow::Result<Value> {
    let mut setup = SetupOptions::default();
    setup.kinds.extend(
        ["conformance", "bench-rust-steps", "echo-remote"]
            .iter()
            .map(|s| s.to_string()),
    );
    let (srv, conn) = server(setup).await?;

    // The Rust baselines: empty steps in an in-process worker, echo jobs/s.
    let rust_gaps = {
        let mut o = Options::local(&srv.url(), "lh");
        o.kinds = vec!["bench-rust-steps".into()];
        let stop = CancellationToken::new();
        let h = leasehold::Worker::new(o)
            .kind("bench-rust-steps", Empty(steps))
            .start(stop.clone())
            .await?;
        let gaps = step_gaps(&conn, "bench-rust-steps", "rust-steps", json!({})).await?;
        stop.cancel();
        h.wait().await?;
        gaps
    };
    let rust = echo_rate(
        &srv.url(),
        &conn,
        "echo",
        "rust",
        vec![("LH_KINDS", "echo".to_string())],
        jobs,
    )
    .await?;

    let mut out = serde_json::Map::new();
    for sdk in [Sdk::Python, Sdk::TypeScript] {
        let port = free_port();
        let _svc = sdk.service(port).await?;
        let url = format!("http://127.0.0.1:{port}/");
        let raw = raw_round_trips(&url, steps).await?;
        let mut o = Options::local(&srv.url(), "lh");
        o.kinds = vec![];
        o.remote_kinds = vec![format!("conformance={url}")];
        let stop = CancellationToken::new();
        let h = leasehold::Worker::new(o).start(stop.clone()).await?;
        let remote_gaps = step_gaps(
            &conn,
            "conformance",
            &format!("remote-steps-{}", sdk.name()),
            json!({"steps": steps}),
        )
        .await?;
        stop.cancel();
        h.wait().await?;
        let rem = echo_rate(
            &srv.url(),
            &conn,
            "echo-remote",
            &format!("remote-{}", sdk.name()),
            vec![
                ("LH_KINDS", "echo".to_string()),
                ("LH_REMOTE_KINDS", format!("echo-remote={url}")),
            ],
            jobs,
        )
        .await?;
        let (r50, p50) = (pct(&raw, 0.5), pct(&remote_gaps, 0.5));
        let figures = json!({
            "remote_step_ms": summary(&remote_gaps),
            "remote_step_p99_ms": pct(&remote_gaps, 0.99),
            "rust_step_ms": summary(&rust_gaps),
            "rust_step_p99_ms": pct(&rust_gaps, 0.99),
            "raw_http_ms": summary(&raw),
            "raw_http_p99_ms": pct(&raw, 0.99),
            "step_over_raw_p50_ms": ((p50 - r50) * 100.0).round() / 100.0,
            "step_met": p50 - r50 <= 2.0,
            "echo_jobs_per_s": {"rust": rust, "remote": rem},
            "echo_remote_share": (rem / rust * 100.0).round() / 100.0,
            "echo_met": rem >= 0.5 * rust,
        });
        match sdk {
            Sdk::Python => {
                if let Value::Object(m) = figures {
                    out.extend(m);
                }
            }
            Sdk::TypeScript => {
                out.insert("typescript".into(), figures);
            }
        }
    }
    Ok(Value::Object(out))
}

pub fn rows(r: &mut Report, v: &Value) {
    sdk_rows(r, "Python", v);
    sdk_rows(r, "TypeScript", &v["typescript"]);
}

fn sdk_rows(r: &mut Report, sdk: &str, v: &Value) {
    let p =
        |k: &str, k99: &str| format!("{}/{:.2}", v[k]["p50"], v[k99].as_f64().unwrap_or(f64::NAN));
    r.cmp(
        format!("remote step ({sdk} SDK) p50/p99 ms"),
        p("remote_step_ms", "remote_step_p99_ms"),
        format!(
            "raw HTTP {}; Rust step {}",
            p("raw_http_ms", "raw_http_p99_ms"),
            p("rust_step_ms", "rust_step_p99_ms")
        ),
        "p50 <= raw HTTP + 2 ms",
        v["step_met"].as_bool(),
    );
    r.cmp(
        format!("remote echo ({sdk} SDK) jobs/s, 4 workers"),
        format!(
            "{:.0}",
            v["echo_jobs_per_s"]["remote"].as_f64().unwrap_or(f64::NAN)
        ),
        format!(
            "Rust echo {:.0}",
            v["echo_jobs_per_s"]["rust"].as_f64().unwrap_or(f64::NAN)
        ),
        ">= 50% of the Rust echo",
        v["echo_met"].as_bool(),
    );
}
