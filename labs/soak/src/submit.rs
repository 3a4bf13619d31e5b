//! Submitting as a user does: JSON published on `lh.submit.<kind>` with the
//! job id as `Nats-Msg-Id`, retried with the same id until the stream acks
//! it (the dedupe window makes a retry of a publish that did land a no-op);
//! cancel requests on `lh.cancel.<id>` or with `leasehold cancel`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use leasehold_harness::Proc;
use leasehold_store::work::{Published, Work};
use leasehold_store::{Conn, Jobs};
use serde::Serialize;
use serde_json::json;
use tokio::task::JoinSet;

use crate::plan::{Expect, JobPlan};

/// How long a submission is retried before the soak gives up on it (and
/// reports it as not accepted: the user was told, nothing was lost).
const SUBMIT_PATIENCE: Duration = Duration::from_secs(90);

/// One submission and what the stream said.
#[derive(Debug, Clone, Serialize)]
pub struct Submission {
    pub id: String,
    pub kind: String,
    pub at_ms: u64,
    pub accepted: bool,
    /// The ticket's stream sequence (from the publish ack).
    pub seq: u64,
    pub duplicate: bool,
    pub tries: u32,
    pub error: Option<String>,
    pub expect: Expect,
    pub canary: bool,
}

/// One cancel request and its answer.
#[derive(Debug, Clone, Serialize)]
pub struct CancelResult {
    pub at_ms: u64,
    pub via: &'static str,
    /// The answer's `recorded`, when there was an answer.
    pub recorded: Option<bool>,
    pub reply: String,
}

/// A canary's timing: injection to completion of a fresh echo job.
#[derive(Debug, Clone, Serialize)]
pub struct Canary {
    pub id: String,
    pub fault: usize,
    pub completed_after_ms: Option<u64>,
}

#[derive(Default)]
struct State {
    submissions: Vec<Submission>,
    cancels: BTreeMap<String, CancelResult>,
    signals: BTreeMap<String, SignalResult>,
    canaries: Vec<Canary>,
}

/// One signal sent to a job (`--signals`), tried until the stream took it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SignalResult {
    pub at_ms: u64,
    /// Its sequence in the signal stream, once stored.
    pub seq: Option<u64>,
    pub tries: u32,
    pub error: Option<String>,
}

/// Submits planned jobs and canaries; clone freely.
#[derive(Clone)]
pub struct Submitter {
    conn: Conn,
    work: Work,
    jobs: Jobs,
    seed: u64,
    start: Instant,
    url: String,
    state: Arc<Mutex<State>>,
    tasks: Arc<Mutex<JoinSet<()>>>,
}

impl Submitter {
    pub fn new(conn: &Conn, jobs: Jobs, seed: u64, start: Instant, url: &str) -> Self {
        Submitter {
            conn: conn.clone(),
            work: Work::new(conn),
            jobs,
            seed,
            start,
            url: url.to_string(),
            state: Arc::default(),
            tasks: Arc::default(),
        }
    }

    fn ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Submits the plan's jobs at their times until `until` (since start).
    pub async fn run(&self, plan: &[JobPlan], until: Duration) {
        for j in plan {
            let at = Duration::from_millis(j.at_ms);
            if at >= until {
                break;
            }
            tokio::time::sleep_until((self.start + at).into()).await;
            let me = self.clone();
            let j = j.clone();
            self.tasks.lock().unwrap().spawn(async move {
                let ok = me
                    .submit(&j.id, j.kind, j.spec.to_string(), j.expect, false)
                    .await;
                let signal = async {
                    if let (true, Some(after)) = (ok, j.signal_after_ms) {
                        tokio::time::sleep(Duration::from_millis(after)).await;
                        me.signal(&j.id).await;
                    }
                };
                let cancel = async {
                    if let (true, Some(c)) = (ok, &j.cancel) {
                        tokio::time::sleep(Duration::from_millis(c.after_ms)).await;
                        me.cancel(&j.id, c.via_cli).await;
                    }
                };
                tokio::join!(signal, cancel);
            });
        }
    }

    /// Waits for every submission, cancel and canary in flight.
    pub async fn finish(&self) {
        join_all(&self.tasks).await
    }

    async fn submit(
        &self,
        id: &str,
        kind: &str,
        payload: String,
        expect: Expect,
        canary: bool,
    ) -> bool {
        let at_ms = self.ms();
        let (result, tries, last_err) =
            publish_until_acked(&self.work, kind, payload.into_bytes(), id, SUBMIT_PATIENCE).await;
        let accepted = result.is_some();
        self.state.lock().unwrap().submissions.push(Submission {
            id: id.to_string(),
            kind: kind.to_string(),
            at_ms,
            accepted,
            seq: result.map_or(0, |p| p.seq),
            duplicate: result.is_some_and(|p| p.duplicate),
            tries,
            error: if accepted { None } else { last_err },
            expect,
            canary,
        });
        accepted
    }

    /// Sends job `id` its signal `go` with `{"token": id}`, under the same
    /// dedupe id on every try (a try whose ack was lost stores one signal),
    /// until the stream takes it or the submissions' patience runs out.
    async fn signal(&self, id: &str) {
        let at_ms = self.ms();
        let signals = leasehold_store::signals::Signals::new(&self.conn);
        let data = json!({"token": id});
        let deadline = Instant::now() + SUBMIT_PATIENCE;
        let dedupe = format!("{id}:go");
        let (mut tries, mut error, mut seq) = (0, None, None);
        while Instant::now() < deadline {
            tries += 1;
            let send = signals.send(id, "go", &data, Some(&dedupe), Some("soak"));
            match tokio::time::timeout(Duration::from_secs(10), send).await {
                Ok(Ok(s)) => {
                    seq = Some(s.seq);
                    error = None;
                    break;
                }
                Ok(Err(e)) => error = Some(e.to_string()),
                Err(_) => error = Some("no answer in 10s".into()),
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        self.state.lock().unwrap().signals.insert(
            id.to_string(),
            SignalResult {
                at_ms,
                seq,
                tries,
                error,
            },
        );
    }

    /// The signals sent, by job.
    pub fn signals(&self) -> BTreeMap<String, SignalResult> {
        self.state.lock().unwrap().signals.clone()
    }

    async fn cancel(&self, id: &str, via_cli: bool) {
        let at_ms = self.ms();
        let (via, reply) = if via_cli {
            let url = self.url.clone();
            let id = id.to_string();
            let out = tokio::task::spawn_blocking(move || {
                let mut p = Proc::spawn(
                    "leasehold",
                    &["cancel", &id],
                    &[("NATS_URL", url), ("RUST_LOG", "warn".into())],
                );
                let st = p.wait_timeout(Duration::from_secs(60));
                format!("{} (exit {st:?})", p.output().trim())
            })
            .await
            .unwrap_or_else(|e| format!("cancel task: {e}"));
            ("cli", out)
        } else {
            let subject = self.conn.layout.cancel_subject(id);
            let req = self.conn.client.request(subject, "".into());
            let out = match tokio::time::timeout(Duration::from_secs(5), req).await {
                Ok(Ok(m)) => String::from_utf8_lossy(&m.payload).to_string(),
                Ok(Err(e)) => format!("request failed: {e}"),
                Err(_) => "no reply in 5s".into(),
            };
            ("request", out)
        };
        let recorded = reply
            .lines()
            .find_map(|l| serde_json::from_str::<serde_json::Value>(l.trim()).ok())
            .and_then(|v| v["recorded"].as_bool());
        self.state.lock().unwrap().cancels.insert(
            id.to_string(),
            CancelResult {
                at_ms,
                via,
                recorded,
                reply: reply.chars().take(300).collect(),
            },
        );
    }

    /// Submits the canary of fault `n` (an echo job) and times it from
    /// `injected` to its completion; returns its id at once.
    pub fn canary(&self, n: usize, injected: SystemTime) -> String {
        let id = format!("soak-{}-canary-{n:03}", self.seed);
        let me = self.clone();
        let cid = id.clone();
        let spawn = async move {
            let spec = json!({"input": {"canary": n}}).to_string();
            let mut done = None;
            if me.submit(&cid, "echo", spec, Expect::NotFailed, true).await {
                let deadline = Instant::now() + Duration::from_secs(180);
                while Instant::now() < deadline {
                    if let Ok(Ok(Some(v))) =
                        tokio::time::timeout(Duration::from_secs(5), me.jobs.get(&cid)).await
                    {
                        if v.value.status == "completed" {
                            let at = leasehold_core::time::parse_rfc3339(&v.value.updated_at);
                            done = at.and_then(|t| t.duration_since(injected).ok());
                            break;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            me.state.lock().unwrap().canaries.push(Canary {
                id: cid,
                fault: n,
                completed_after_ms: done.map(|d| d.as_millis() as u64),
            });
        };
        self.tasks.lock().unwrap().spawn(spawn);
        id
    }

    pub fn submissions(&self) -> Vec<Submission> {
        self.state.lock().unwrap().submissions.clone()
    }

    pub fn cancels(&self) -> BTreeMap<String, CancelResult> {
        self.state.lock().unwrap().cancels.clone()
    }

    pub fn canaries(&self) -> Vec<Canary> {
        self.state.lock().unwrap().canaries.clone()
    }
}

/// Publishes a submission as a user does: retried with the same id (the
/// dedupe window makes a retry of a publish that did land a no-op) until
/// the stream acks it or `patience` passed. Returns the ack, the tries and
/// the last error.
pub async fn publish_until_acked(
    work: &Work,
    kind: &str,
    payload: Vec<u8>,
    id: &str,
    patience: Duration,
) -> (Option<Published>, u32, Option<String>) {
    let deadline = Instant::now() + patience;
    let mut tries = 0;
    let mut last_err = None;
    while Instant::now() < deadline {
        tries += 1;
        let publish = work.submit(kind, payload.clone().into(), Some(id), None);
        match tokio::time::timeout(Duration::from_secs(10), publish).await {
            Ok(Ok(p)) => return (Some(p), tries, None),
            Ok(Err(e)) => last_err = Some(e.to_string()),
            Err(_) => last_err = Some("no publish ack in 10s".into()),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    (None, tries, last_err)
}

/// Waits for every task of `tasks`, those spawned meanwhile included.
pub async fn join_all(tasks: &Mutex<JoinSet<()>>) {
    loop {
        let mut set = std::mem::take(&mut *tasks.lock().unwrap());
        if set.is_empty() {
            return;
        }
        while set.join_next().await.is_some() {}
    }
}
