//! A fleet for one test: a server, the layout, workers and reapers, and
//! waiting on records.

use std::time::Duration;

use futures::StreamExt;
use leasehold_core::JobRecord;
use leasehold_harness::{wait_for_jetstream, NatsServer, Proc};
use leasehold_reaper::Reaper;
use leasehold_store::dlq::{Dlq, Letter};
use leasehold_store::events::Events;
use leasehold_store::index::Active;
use leasehold_store::setup::{self, SetupOptions};
use leasehold_store::work::Work;
use leasehold_store::{jobs, Conn, Jobs, NatsArgs};
use leasehold_worker::{Handle, Options};
use tokio_util::sync::CancellationToken;

/// Test timings: short sessions so faults resolve in seconds.
pub const ACK_WAIT: Duration = Duration::from_secs(1);
pub const SESSION: Duration = Duration::from_secs(2);
/// Jobs are indexed (and their tickets settled) this long after the claim.
pub const INDEX_AFTER: Duration = Duration::from_millis(300);

/// One test's fleet: a real `nats-server` with leasehold's layout, and
/// the handles a test reads it through.
pub struct Fleet {
    pub server: NatsServer,
    pub prefix: String,
    pub conn: Conn,
    pub jobs: Jobs,
    pub events: Events,
    pub work: Work,
}

impl Fleet {
    /// A server and the layout with the test timings.
    pub async fn start() -> Fleet {
        Self::with(SetupOptions {
            ack_wait: ACK_WAIT,
            ..SetupOptions::default()
        })
        .await
    }

    /// [`Fleet::start`] with one more kind set up (a test kind of the
    /// tests' own workers: `nap`, `hark`).
    pub async fn with_kind(kind: &str) -> Fleet {
        let mut o = SetupOptions {
            ack_wait: ACK_WAIT,
            ..SetupOptions::default()
        };
        o.kinds.push(kind.into());
        Self::with(o).await
    }

    /// A server and the layout made with `o`.
    pub async fn with(o: SetupOptions) -> Fleet {
        // In-process workers and reapers log to the test's output when
        // RUST_LOG is set (shown for failing tests).
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_test_writer()
                .try_init();
        }
        let server = NatsServer::start();
        wait_for_jetstream(&server.url(), Duration::from_secs(10)).await;
        let prefix = "lh".to_string();
        let conn = NatsArgs::local(server.url(), &prefix)
            .connect("test")
            .await
            .unwrap();
        // Setup waits out what the server could not do at once; what it
        // still refuses, the server's log says why.
        if let Err(e) = setup::ensure(&conn, &o).await {
            let log = server.log();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            panic!(
                "setup: {e}; the server's last lines (newest first):\n{}",
                tail.join("\n")
            );
        }
        Fleet {
            jobs: Jobs::open(&conn).await.unwrap(),
            events: Events::new(&conn),
            work: Work::new(&conn),
            conn,
            server,
            prefix,
        }
    }

    pub fn url(&self) -> String {
        self.server.url()
    }

    pub fn opts(&self) -> Options {
        let mut o = Options::local(&self.url(), &self.prefix);
        o.session_timeout = SESSION;
        o.index_after = INDEX_AFTER;
        o.pull_expires = Duration::from_millis(250);
        o.drain_timeout = Duration::from_millis(200);
        o.retry_base = Duration::from_millis(100);
        o.retry_cap = Duration::from_millis(400);
        o.kinds = vec![
            "echo".into(),
            "sleep".into(),
            "fail".into(),
            "crash".into(),
            "fanout".into(),
        ];
        o
    }

    pub async fn worker(&self) -> (Handle, CancellationToken) {
        self.worker_with(self.opts()).await
    }

    pub async fn worker_with(&self, o: Options) -> (Handle, CancellationToken) {
        let stop = CancellationToken::new();
        let h = leasehold::Worker::new(o).start(stop.clone()).await.unwrap();
        (h, stop)
    }

    /// An in-process worker with one slot serving `echo` and the test kind
    /// `kind` (code `k`): a job of `kind` that holds its slot shows at once
    /// in whether an echo job still runs.
    pub async fn one_slot_worker(
        &self,
        kind: &str,
        k: impl leasehold::Kind + 'static,
    ) -> (Handle, CancellationToken) {
        let mut o = self.opts();
        o.kinds = vec![kind.into(), "echo".into()];
        o.concurrency = 1;
        let stop = CancellationToken::new();
        let h = leasehold::Worker::new(o)
            .kind(kind, k)
            .start(stop.clone())
            .await
            .unwrap();
        (h, stop)
    }

    /// The environment of a worker process with the test timings.
    pub fn proc_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("NATS_URL", self.url()),
            ("LH_PREFIX", self.prefix.clone()),
            ("LH_SESSION_TIMEOUT", format!("{}ms", SESSION.as_millis())),
            ("LH_INDEX_AFTER", format!("{}ms", INDEX_AFTER.as_millis())),
            ("LH_PULL_EXPIRES", "250ms".into()),
            ("LH_DRAIN_TIMEOUT", "200ms".into()),
            ("LH_KINDS", "echo,sleep,fail,crash".into()),
            // The test kinds (and LH_RESEARCH_CRASH_AT) need the dev switch.
            ("LH_DEV_KINDS", "1".into()),
            ("RUST_LOG", "info".into()),
        ]
    }

    pub fn worker_proc(&self, args: &[&str], extra: &[(&'static str, String)]) -> Proc {
        let mut env = self.proc_env();
        env.extend(extra.iter().cloned());
        Proc::spawn("leasehold-worker", args, &env)
    }

    /// The tests' own SDK worker (`sdk-agent-worker`: `nap`, `hark`, ...)
    /// serving `kind` as worker `name`, connected at `url` (the fleet's, or
    /// a fault proxy's in front of it).
    pub fn sdk_worker(&self, url: &str, name: &str, kind: &str) -> Proc {
        let mut e = self.proc_env();
        e.push(("LH_KINDS", kind.into()));
        e.push(("NATS_URL", url.to_string()));
        Proc::spawn("sdk-agent-worker", &["--worker-id", name], &e)
    }

    /// How many times step `step` of job `id` was recorded (its `step`
    /// events naming it).
    pub async fn steps_recorded(&self, id: &str, step: &str) -> usize {
        self.events_of(id)
            .await
            .iter()
            .filter(|e| e.r#type == "step" && e.data_map()["id"] == step)
            .count()
    }

    /// Publishes a raw submission as any NATS client would.
    pub async fn submit(&self, kind: &str, spec: serde_json::Value, id: &str) -> String {
        let p = self
            .work
            .submit(kind, spec.to_string().into(), Some(id), None)
            .await
            .unwrap();
        assert!(!p.duplicate);
        id.to_string()
    }

    /// Publishes a job's ticket as any NATS client would, and nothing else
    /// (a test makes up the record); its sequence in the work stream.
    pub async fn ticket(&self, kind: &str, spec: serde_json::Value, id: &str) -> u64 {
        self.ticket_bytes(kind, spec.to_string().into_bytes(), id)
            .await
    }

    /// [`Fleet::ticket`] with any bytes as the spec (a malformed one, say).
    pub async fn ticket_bytes(&self, kind: &str, spec: Vec<u8>, id: &str) -> u64 {
        self.work
            .submit(kind, spec.into(), Some(id), None)
            .await
            .unwrap()
            .seq
    }

    /// Waits (on a KV watch, not by polling) until `pred` holds for the record.
    pub async fn wait_for(
        &self,
        id: &str,
        timeout: Duration,
        pred: impl Fn(&JobRecord) -> bool,
    ) -> JobRecord {
        let mut w = self.jobs.watch(id).await.unwrap();
        let fut = async {
            while let Some(e) = w.next().await {
                let e = e.unwrap();
                if e.operation != async_nats::jetstream::kv::Operation::Put {
                    continue;
                }
                let r = jobs::decode(id, &e.value).unwrap();
                if pred(&r) {
                    return r;
                }
            }
            panic!("watch ended");
        };
        match tokio::time::timeout(timeout, fut).await {
            Ok(r) => r,
            Err(_) => {
                let cur = self.jobs.get(id).await.unwrap().map(|v| v.value);
                panic!(
                    "job {id}: condition not met within {timeout:?}; record now: {}",
                    serde_json::to_string_pretty(&cur).unwrap()
                )
            }
        }
    }

    /// The job's record now, if it has one.
    pub async fn record(&self, id: &str) -> Option<JobRecord> {
        self.jobs.get(id).await.unwrap().map(|v| v.value)
    }

    /// A second connection to this fleet's server (or to `url`, another
    /// node or a proxy in front of it), named `name`.
    pub async fn connect(&self, url: &str, name: &str) -> leasehold_store::Conn {
        NatsArgs::local(url.to_string(), &self.prefix)
            .connect(name)
            .await
            .unwrap()
    }

    /// A node's view of fleet-wide flow control, as a worker process named
    /// `name` keeps it, connected at `url` (this fleet's server, or a proxy
    /// in front of it) until `stop` is cancelled.
    pub async fn flow_node(
        &self,
        url: &str,
        name: &str,
        stop: CancellationToken,
    ) -> std::sync::Arc<leasehold_flow::Flow> {
        let flow = std::sync::Arc::new(leasehold_flow::Flow::new());
        let conn = self.connect(url, name).await;
        leasehold_worker::flow::start_with(flow.clone(), conn, name.to_string(), stop);
        flow
    }

    /// The index of active jobs.
    pub async fn active(&self) -> Active {
        Active::open(&self.conn).await.unwrap()
    }

    /// Waits (on a watch of the index, not by polling) until job `id` has
    /// no index entry: a finished job's entries go after its terminal
    /// event, a moment after its record says it ended.
    pub async fn wait_unindexed(&self, id: &str, timeout: Duration) {
        let active = self.active().await;
        let mut w = active.kv().watch_all().await.unwrap();
        let gone = async {
            loop {
                if active.keys_of(id).await.unwrap().is_empty() {
                    return;
                }
                w.next().await;
            }
        };
        if tokio::time::timeout(timeout, gone).await.is_err() {
            panic!(
                "job {id} still indexed after {timeout:?}: {:?}",
                active.keys_of(id).await.unwrap()
            );
        }
    }

    /// The dead letters of one job.
    pub async fn letters_of(&self, id: &str) -> Vec<Letter> {
        Dlq::new(&self.conn)
            .list()
            .await
            .unwrap()
            .into_iter()
            .filter(|l| l.job_id.as_deref() == Some(id))
            .collect()
    }

    /// A reaper's options with the test timings: a sweep every 300 ms, a
    /// stranded job re-offered after 500 ms.
    pub fn reaper_opts(&self) -> leasehold_reaper::Options {
        let mut o = leasehold_reaper::Options::local(&self.url(), &self.prefix);
        o.interval = Duration::from_millis(300);
        o.stranded_grace = Duration::from_millis(500);
        o
    }

    /// A reaper's options parsed from its command line (`args`, as
    /// `leasehold-reaper` takes them), pointed at this fleet, with a sweep
    /// every 300 ms.
    pub fn reaper_args(&self, args: &[&str]) -> leasehold_reaper::Options {
        use clap::Parser;
        let mut o = leasehold_reaper::Options::parse_from(
            std::iter::once("leasehold-reaper").chain(args.iter().copied()),
        );
        o.nats = NatsArgs::local(self.url(), &self.prefix);
        o.interval = Duration::from_millis(300);
        o
    }

    /// A reaper with the test timings, running in this process.
    pub async fn reaper(&self) -> (leasehold_reaper::Handle, CancellationToken) {
        self.reaper_with(self.reaper_opts()).await
    }

    /// A reaper with `o`, running in this process until the token is
    /// cancelled.
    pub async fn reaper_with(
        &self,
        o: leasehold_reaper::Options,
    ) -> (leasehold_reaper::Handle, CancellationToken) {
        let stop = CancellationToken::new();
        let h = Reaper::new(o).start(stop.clone()).await.unwrap();
        (h, stop)
    }

    /// Writes a record as the product leaves it: the record, then its entry
    /// in the index of active jobs (for records made up by a test).
    pub async fn seed_record(&self, rec: &JobRecord) {
        self.jobs.create(rec).await.unwrap();
        self.active().await.reconcile(rec).await.unwrap();
    }

    /// Waits until the index of active jobs lists `id` as running.
    pub async fn wait_indexed(&self, id: &str, timeout: Duration) {
        use leasehold_store::index::Key;
        self.wait_listed(id, "running", timeout, |k| matches!(k, Key::Run { .. }))
            .await
    }

    /// Waits until the index of active jobs lists `id` under a key `pred`
    /// accepts (`what` names it in the failure).
    pub async fn wait_listed(
        &self,
        id: &str,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&leasehold_store::index::Key) -> bool,
    ) {
        let active = self.active().await;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let keys = active.keys_of(id).await.unwrap();
            if keys.iter().any(&pred) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "job {id} never indexed as {what}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn wait_status(&self, id: &str, status: &str, timeout: Duration) -> JobRecord {
        self.wait_for(id, timeout, |r| r.status == status).await
    }

    /// Waits (following the job's events, not polling) until one of type
    /// `ty` has landed; the job's events up to and including it. A record
    /// is written before its event (a terminal status, then `completed`),
    /// so a test that saw the record waits here before counting events.
    pub async fn wait_event(
        &self,
        id: &str,
        ty: &str,
        timeout: Duration,
    ) -> Vec<leasehold_proto::JobEvent> {
        self.wait_event_where(id, ty, |e| e.r#type == ty, timeout)
            .await
    }

    /// Like [`Fleet::wait_event`], until an event that `is` accepts has
    /// landed (`ty` names it in the failure).
    pub async fn wait_event_where(
        &self,
        id: &str,
        ty: &str,
        is: impl Fn(&leasehold_proto::JobEvent) -> bool,
        timeout: Duration,
    ) -> Vec<leasehold_proto::JobEvent> {
        let fut = async {
            let mut seen = Vec::new();
            let mut s = self.events.follow(id, 0).await.unwrap();
            while let Some(e) = s.next().await {
                let (_, e) = e.unwrap();
                let done = is(&e);
                seen.push(e);
                if done {
                    return seen;
                }
            }
            panic!("the events of {id} ended");
        };
        match tokio::time::timeout(timeout, fut).await {
            Ok(evs) => evs,
            Err(_) => panic!(
                "job {id}: no `{ty}` event within {timeout:?}; events now: {:?}",
                self.events_of(id)
                    .await
                    .iter()
                    .map(|e| e.r#type.clone())
                    .collect::<Vec<_>>()
            ),
        }
    }

    /// Events of one job, as published.
    pub async fn events_of(&self, id: &str) -> Vec<leasehold_proto::JobEvent> {
        self.events
            .read(id)
            .await
            .unwrap()
            .into_iter()
            .map(|(_, e)| e)
            .collect()
    }

    /// The children `parent`'s first recorded spawn step started, in order.
    pub async fn spawned(&self, parent: &str) -> Vec<String> {
        let evs = self.events_of(parent).await;
        let step = evs
            .iter()
            .filter(|e| e.r#type == "step")
            .map(|e| e.data_map())
            .find(|d| {
                d.get("id")
                    .and_then(serde_json::Value::as_str)
                    .is_some_and(|id| id.starts_with("spawn:"))
            })
            .unwrap_or_else(|| panic!("{parent} recorded no spawn"));
        step["result"]["children"]
            .as_array()
            .expect("a spawn's children")
            .iter()
            .map(|c| c.as_str().expect("a child's id").to_string())
            .collect()
    }
}

/// Polls a process's log for a line (processes give no other signal).
pub async fn wait_log(p: &Proc, needle: &str, timeout: Duration) {
    let deadline = tokio::time::Instant::now() + timeout;
    while !p.output().contains(needle) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} never logged {needle:?}:\n{}",
            p.name(),
            p.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Starts `leasehold-sim` on a free port; returns it and its base URL.
pub async fn spawn_sim(extra: &[(&'static str, String)]) -> (Proc, String) {
    let mut env: Vec<(&'static str, String)> = vec![
        ("LH_SIM_TOKEN_DELAY_MS", "0".into()),
        ("RUST_LOG", "warn".into()),
    ];
    env.extend(extra.iter().cloned());
    let p = Proc::spawn("leasehold-sim", &["--listen", "127.0.0.1:0"], &env);
    wait_log(&p, "listening on ", Duration::from_secs(10)).await;
    let out = p.output();
    let addr = out
        .lines()
        .find_map(|l| l.strip_prefix("listening on "))
        .expect("address")
        .trim()
        .to_string();
    (p, format!("http://{addr}"))
}

/// Runs the `leasehold` CLI against `url` without blocking the test's
/// runtime; returns the exit code, stdout and stderr.
pub async fn cli(url: &str, args: &[&str]) -> (i32, String, String) {
    cli_with(args, [("NATS_URL", url)]).await
}

/// [`cli`] with these environment variables (a NATS user's credentials,
/// say) instead of `NATS_URL` alone.
pub async fn cli_with<K, V>(
    args: &[&str],
    env: impl IntoIterator<Item = (K, V)>,
) -> (i32, String, String)
where
    K: AsRef<std::ffi::OsStr>,
    V: AsRef<std::ffi::OsStr>,
{
    let out = tokio::process::Command::new(leasehold_harness::bin_path("leasehold"))
        .args(args)
        .envs(env)
        .output()
        .await
        .expect("run leasehold");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The environment of a worker process serving `kinds` (research among
/// them) against the sim at `sim` (web and effects), its model at
/// `model_base`, with short generation retries.
pub fn research_env(sim: &str, model_base: &str, kinds: &str) -> Vec<(&'static str, String)> {
    vec![
        ("LH_KINDS", kinds.into()),
        ("LH_MODEL_BASE_URL", model_base.to_string()),
        ("LH_SEARCH_URL", sim.to_string()),
        ("LH_PUBLISH_URL", format!("{sim}/effects")),
        ("LH_FETCH_ALLOW", "127.0.0.1".into()),
        ("LH_RESEARCH_RETRY_BASE", "20ms".into()),
        ("LH_RESEARCH_RETRY_CAP", "200ms".into()),
    ]
}

/// A worker process serving `research` against `model_base` (the sim
/// serves the web and the effects sink either way), with `extra` variables.
pub fn research_worker(
    env: &Fleet,
    sim: &str,
    model_base: &str,
    extra: &[(&'static str, &str)],
) -> Proc {
    let mut e = research_env(sim, model_base, "research");
    e.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    env.worker_proc(&[], &e)
}

/// One HTTP/1.0 request to the sim; the JSON body of its answer (null
/// when it has none).
pub async fn sim_json(
    sim: &str,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> serde_json::Value {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = sim.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    s.write_all(
        format!(
            "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.unwrap();
    serde_json::from_str(buf.split_once("\r\n\r\n").unwrap().1).unwrap_or(serde_json::Value::Null)
}
