//! Operators (profile `operators`): what people do to a running fleet,
//! done with the `leasehold` CLI as processes while the faults go on, and
//! what each action must leave behind.
//!
//! Flows, each on its own ids (`soak-<seed>-op-...`), at planned times:
//!
//! - **park, resume**: a `fail` job with class `park` parks for review;
//!   `leasehold review resume` queues it again and it completes (a resume
//!   that fails is run again, as the CLI says it may be).
//! - **park, cancel**: the parked job is cancelled, then a resume is tried
//!   and must be refused: the job ends `cancelled` and no revision after
//!   the cancel says otherwise.
//! - **replay**: bytes that are not JSON become a dead letter; a plain
//!   `leasehold dlq replay` must refuse them and keep the letter; a replay
//!   of a corrected submission (`--spec FILE`) completes under the same id
//!   and only then is the letter gone.
//! - **a kind added live**: [`LIVE_KIND`] is not set up at the start; the
//!   operator adds it with `leasehold setup --kinds ...`, a submission is
//!   made before any worker serves it, then a worker serving only that kind
//!   starts and more jobs follow: none is rejected, each delivers exactly
//!   one effect with its own document.
//! - **reused ids**: the reapers keep [`LIVE_KIND`] jobs for
//!   [`RETENTION`] only and the dedupe window is [`DEDUPE_WINDOW`]; a job
//!   completes, is removed, and its id is submitted again with another
//!   document (retried while the dedupe window still swallows it): the new
//!   job runs fresh and delivers its own document, never the old one's.
//! - **prune**: with the kind's worker stopped and one of its jobs queued,
//!   `setup --prune` must refuse and change nothing; once the job ran,
//!   the prune succeeds and a submission of the kind is refused.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use leasehold_core::JobRecord;
use leasehold_harness::Proc;
use leasehold_store::dlq::Dlq;
use leasehold_store::work::Work;
use leasehold_store::{Conn, Jobs};
use serde::Serialize;
use serde_json::{json, Value};
use tokio::task::JoinSet;

use crate::check::Finding;
use crate::collect::Collected;
use crate::fleet::{worker_env, Incarnation, Settings};
use crate::rng::Rng;

pub mod doors;

/// The kind the operators add to the running fleet and prune again.
pub const LIVE_KIND: &str = "deliver";
/// The reapers' `LH_RETENTION_KIND` in this profile.
pub const RETENTION: &str = "deliver=5s";
/// The work stream's dedupe window in this profile (short, so an id can be
/// reused within the run).
pub const DEDUPE_WINDOW: Duration = Duration::from_secs(20);
/// The slot number the operators' worker is reported under (beyond the
/// fleet's slots: the faults never pick it, slot use does not count it).
pub const OPS_SLOT: usize = 99;
/// How long a flow waits for a state before it reports the job as stuck.
const PATIENCE: Duration = Duration::from_secs(120);
/// Bytes of a large input: above the 16 KiB a record keeps inline.
const LARGE: usize = 20 * 1024;
/// How often a command that failed (a fault in its way) is run again.
const TRIES: u32 = 8;

/// When the operators act (offsets from the start of the run).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OpsPlan {
    pub add_kind_at_ms: u64,
    /// Park flows: when, and whether the job is cancelled (else resumed).
    pub parks: Vec<(u64, bool)>,
    pub replays: Vec<u64>,
    pub deliveries: Vec<u64>,
    pub reuses: Vec<u64>,
    /// Not before every delivery and reuse flow ended.
    pub prune_at_ms: u64,
    /// The doors: SDK and Python kinds, tenants, delays, a schedule.
    pub doors: doors::DoorsPlan,
}

/// The operators' plan for a run of length `run`: a pure function of the seed.
pub fn plan(seed: u64, run: Duration) -> OpsPlan {
    let mut r = Rng::stream(seed, "ops");
    let run_ms = run.as_millis() as u64;
    let window = |r: &mut Rng| r.range(1_000, (run_ms * 7 / 10).max(2_000));
    let mut parks: Vec<(u64, bool)> = (0..4).map(|i| (window(&mut r), i % 2 == 1)).collect();
    parks.sort();
    let mut replays: Vec<u64> = (0..2).map(|_| window(&mut r)).collect();
    replays.sort();
    let add = r.range(1_000, 4_000);
    let mut deliveries: Vec<u64> = (0..3)
        .map(|_| r.range(add + 500, (run_ms * 7 / 10).max(add + 1_000)))
        .collect();
    deliveries.sort();
    let reuses = vec![add + 1_000, add + 3_000];
    OpsPlan {
        add_kind_at_ms: add,
        parks,
        replays,
        deliveries,
        reuses,
        prune_at_ms: run_ms * 3 / 4,
        doors: doors::plan(seed, run),
    }
}

/// One command an operator ran.
#[derive(Debug, Clone, Serialize)]
pub struct Action {
    pub at_ms: u64,
    pub flow: String,
    pub command: String,
    pub took_ms: u64,
    pub exit: Option<i32>,
    pub output: String,
}

/// One flow and what it saw.
#[derive(Debug, Clone, Serialize)]
pub struct Flow {
    pub id: String,
    pub what: &'static str,
    pub at_ms: u64,
    /// Documents delivered by this id, in submission order.
    pub documents: Vec<String>,
    /// What went against the promise, as the flow saw it.
    pub problems: Vec<String>,
    pub done: bool,
    /// The answers the operators gave its parks, in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub answers: Vec<Value>,
}

#[derive(Default)]
struct State {
    actions: Vec<Action>,
    flows: Vec<Flow>,
    incarnations: Vec<Incarnation>,
    /// The destination's creates per business key, read at the end.
    creates: Option<Value>,
    ticks: Option<doors::TickWindow>,
}

/// The operators of a run; clone freely.
#[derive(Clone)]
pub struct Ops {
    conn: Conn,
    jobs: Jobs,
    work: Work,
    seed: u64,
    start: Instant,
    url: String,
    sim_url: String,
    settings: Settings,
    replicas: usize,
    logs: PathBuf,
    state: Arc<Mutex<State>>,
    tasks: Arc<Mutex<JoinSet<()>>>,
    doors: Arc<doors::Doors>,
}

/// The inputs of [`Ops::new`].
pub struct OpsIn<'a> {
    pub conn: &'a Conn,
    pub jobs: Jobs,
    pub seed: u64,
    pub start: Instant,
    pub url: String,
    pub sim_url: String,
    pub settings: Settings,
    /// Replicas the soak set the layout up with.
    pub replicas: usize,
    pub logs: PathBuf,
}

impl Ops {
    pub fn new(i: OpsIn<'_>) -> Self {
        Ops {
            conn: i.conn.clone(),
            work: Work::new(i.conn),
            jobs: i.jobs,
            seed: i.seed,
            start: i.start,
            url: i.url,
            sim_url: i.sim_url,
            settings: i.settings,
            replicas: i.replicas,
            logs: i.logs,
            state: Arc::default(),
            tasks: Arc::default(),
            doors: Arc::new(doors::Doors::new()),
        }
    }

    fn ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn id(&self, what: &str, n: usize) -> String {
        format!("soak-{}-op-{what}-{n:03}", self.seed)
    }

    /// Starts every flow of `plan` at its time and returns at once.
    pub fn start(&self, plan: &OpsPlan) {
        for (n, (at, cancel)) in plan.parks.iter().enumerate() {
            let me = self.clone();
            let (at, cancel) = (*at, *cancel);
            self.spawn(async move {
                me.sleep_until(at).await;
                me.park(n, cancel).await;
            });
        }
        for (n, at) in plan.replays.iter().enumerate() {
            let me = self.clone();
            let at = *at;
            self.spawn(async move {
                me.sleep_until(at).await;
                me.replay(n).await;
            });
        }
        self.start_doors(&plan.doors);
        let me = self.clone();
        let plan = plan.clone();
        self.spawn(async move { me.live_kind(&plan).await });
    }

    fn spawn(&self, f: impl std::future::Future<Output = ()> + Send + 'static) {
        self.tasks.lock().unwrap().spawn(f);
    }

    async fn sleep_until(&self, at_ms: u64) {
        tokio::time::sleep_until((self.start + Duration::from_millis(at_ms)).into()).await;
    }

    /// Waits for every flow (they end on their own patience).
    pub async fn finish(&self) {
        crate::submit::join_all(&self.tasks).await;
        self.stop_doors().await;
    }

    /// The doors' invariants ([`doors::check`]); `down`: when the soak's
    /// faults had the server (or a node) down.
    pub fn check_doors(&self, c: &Collected, down: &[doors::Down]) -> Vec<Finding> {
        let st = self.state.lock().unwrap();
        let mut out = Vec::new();
        doors::check(
            &st.flows,
            c,
            st.creates.as_ref(),
            st.ticks.as_ref(),
            down,
            &mut |job: &str, reason: String| {
                out.push(Finding {
                    job: job.to_string(),
                    reason,
                })
            },
        );
        out
    }

    /// What the doors' destination and schedule left, for the report.
    pub fn doors_seen(&self) -> Value {
        let st = self.state.lock().unwrap();
        json!({"destination_creates": st.creates, "schedule_window": st.ticks})
    }

    fn flow(&self, id: &str, what: &'static str) -> usize {
        let mut st = self.state.lock().unwrap();
        st.flows.push(Flow {
            id: id.to_string(),
            what,
            at_ms: self.ms(),
            documents: Vec::new(),
            problems: Vec::new(),
            done: false,
            answers: Vec::new(),
        });
        st.flows.len() - 1
    }

    fn problem(&self, flow: usize, p: impl Into<String>) {
        self.state.lock().unwrap().flows[flow]
            .problems
            .push(p.into());
    }

    fn document(&self, flow: usize, d: &str) {
        self.state.lock().unwrap().flows[flow]
            .documents
            .push(d.to_string());
    }

    fn done(&self, flow: usize) {
        self.state.lock().unwrap().flows[flow].done = true;
    }

    /// Runs `leasehold ARGS` as an operator does; returns the exit code and
    /// the combined output.
    async fn cli(&self, flow: &str, args: Vec<String>) -> (Option<i32>, String) {
        let at_ms = self.ms();
        let t0 = Instant::now();
        let url = self.url.clone();
        let a = args.clone();
        let (exit, output) = tokio::task::spawn_blocking(move || {
            let refs: Vec<&str> = a.iter().map(String::as_str).collect();
            let mut p = Proc::spawn(
                "leasehold",
                &refs,
                &[("NATS_URL", url), ("RUST_LOG", "warn".into())],
            );
            let st = p.wait_timeout(Duration::from_secs(90));
            (st.and_then(|s| s.code()), p.output())
        })
        .await
        .unwrap_or((None, "the command's task failed".into()));
        self.state.lock().unwrap().actions.push(Action {
            at_ms,
            flow: flow.to_string(),
            command: format!("leasehold {}", args.join(" ")),
            took_ms: t0.elapsed().as_millis() as u64,
            exit,
            output: output.trim().chars().take(400).collect(),
        });
        (exit, output)
    }

    /// Runs a command until it exits 0 or `refused` recognises its answer
    /// as a refusal (not a fault in its way); `Err` after [`TRIES`].
    async fn cli_until(
        &self,
        flow: &str,
        args: Vec<String>,
        refused: impl Fn(&str) -> bool,
    ) -> Result<(i32, String), String> {
        let mut last = String::new();
        for _ in 0..TRIES {
            let (exit, out) = self.cli(flow, args.clone()).await;
            match exit {
                Some(0) => return Ok((0, out)),
                Some(c) if refused(&out) => return Ok((c, out)),
                _ => last = format!("exit {exit:?}: {}", out.trim()),
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        Err(last)
    }

    /// The record, or `None` when there is none; read errors retried.
    async fn record(&self, id: &str) -> Option<JobRecord> {
        for _ in 0..20 {
            match tokio::time::timeout(Duration::from_secs(5), self.jobs.get(id)).await {
                Ok(Ok(v)) => return v.map(|v| v.value),
                _ => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
        None
    }

    /// Polls until the record satisfies `pred` (`None`: no record).
    async fn wait_for(
        &self,
        id: &str,
        pred: impl Fn(Option<&JobRecord>) -> bool,
    ) -> Result<Option<JobRecord>, Option<JobRecord>> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let r = self.record(id).await;
            if pred(r.as_ref()) {
                return Ok(r);
            }
            if Instant::now() > deadline {
                return Err(r);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Publishes a submission as a user does, retried with the same id.
    async fn submit(&self, kind: &str, payload: Vec<u8>, id: &str) -> bool {
        crate::submit::publish_until_acked(&self.work, kind, payload, id, PATIENCE)
            .await
            .0
            .is_some()
    }

    async fn park(&self, n: usize, cancel: bool) {
        let what = if cancel { "park_cancel" } else { "park_resume" };
        let id = self.id(if cancel { "cancel" } else { "park" }, n);
        let f = self.flow(&id, what);
        let spec = json!({"input": {"class": "park"}}).to_string();
        if !self.submit("fail", spec.into_bytes(), &id).await {
            self.problem(f, "the submission was never accepted");
            return;
        }
        if let Err(r) = self
            .wait_for(&id, |r| r.is_some_and(|r| r.status == "parked"))
            .await
        {
            self.problem(f, format!("never parked: {}", status(r.as_ref())));
            return;
        }
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        if cancel {
            match self
                .cli_until(&id, s(&["cancel", &id]), |o| o.contains("\"recorded\""))
                .await
            {
                Ok((0, _)) => {}
                Ok((c, out)) => self.problem(f, format!("cancel exit {c}: {}", out.trim())),
                Err(e) => self.problem(f, format!("cancel never answered: {e}")),
            }
            // A resume of the cancelled job must be refused.
            match self
                .cli_until(&id, s(&["review", "resume", &id]), |o| {
                    o.contains("cancelled") || o.contains("not allowed") || o.contains("parked")
                })
                .await
            {
                Ok((0, out)) => self.problem(
                    f,
                    format!("review resume of a cancelled job exited 0: {}", out.trim()),
                ),
                Ok(_) => {}
                Err(e) => self.problem(f, format!("review resume never answered: {e}")),
            }
            if let Err(r) = self
                .wait_for(&id, |r| r.is_some_and(|r| r.status == "cancelled"))
                .await
            {
                self.problem(f, format!("not cancelled: {}", status(r.as_ref())));
            }
        } else {
            // A job parked again (its earlier park's event lost) is resumed again.
            for round in 0..3 {
                if let Err(e) = self
                    .cli_until(&id, s(&["review", "resume", &id]), |o| {
                        o.contains("allowed:")
                    })
                    .await
                {
                    self.problem(f, format!("review resume never answered: {e}"));
                    return;
                }
                match self
                    .wait_for(&id, |r| {
                        r.is_some_and(|r| r.status == "parked" || is_terminal(r))
                    })
                    .await
                {
                    Ok(Some(r)) if r.status == "completed" => break,
                    Ok(Some(r)) if r.status == "parked" && round < 2 => continue,
                    Ok(r) | Err(r) => {
                        self.problem(f, format!("after resume: {}", status(r.as_ref())));
                        break;
                    }
                }
            }
        }
        self.done(f);
    }

    async fn replay(&self, n: usize) {
        let id = self.id("bad", n);
        let f = self.flow(&id, "replay");
        // Replay 0: a large input (beside the record) refused for its run
        // time, corrected to a small one; the others: bytes that are not
        // JSON, corrected to a large input. Either way the job must run
        // the corrected input.
        let bad = if n == 0 {
            json!({"delay": "soon", "input": {"pad": "p".repeat(LARGE)}})
                .to_string()
                .into_bytes()
        } else {
            b"{\"input\":[1,2".to_vec()
        };
        if !self.submit("echo", bad, &id).await {
            self.problem(f, "the submission was never accepted");
            return;
        }
        let dlq = Dlq::new(&self.conn);
        let Some(seq) = self.letter_of(&dlq, &id, PATIENCE).await else {
            self.problem(f, "no dead letter for the refused bytes");
            return;
        };
        let s = seq.to_string();
        let a = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        match self
            .cli_until(&id, a(&["dlq", "replay", &s]), |o| {
                o.contains("still refused")
            })
            .await
        {
            Ok((0, out)) => self.problem(
                f,
                format!("a replay of bytes still refused exited 0: {}", out.trim()),
            ),
            Ok(_) => {}
            Err(e) => self.problem(f, format!("dlq replay never answered: {e}")),
        }
        if self.letter_of(&dlq, &id, Duration::ZERO).await.is_none() {
            self.problem(f, "the refused replay removed the letter");
            return;
        }
        let file = self.logs.join(format!("{id}.spec.json"));
        let corrected = if n == 0 {
            json!({"fixed": n})
        } else {
            json!({"fixed": n, "pad": "c".repeat(LARGE)})
        };
        let fixed = json!({"input": corrected});
        if let Err(e) = std::fs::write(&file, fixed.to_string()) {
            self.problem(f, format!("writing the corrected spec: {e}"));
            return;
        }
        let path = file.display().to_string();
        // Run again after a failure: the resubmission is recognised.
        let mut replayed = false;
        for _ in 0..TRIES {
            let (exit, _) = self
                .cli(&id, a(&["dlq", "replay", &s, "--spec", &path]))
                .await;
            if exit == Some(0) {
                replayed = true;
                break;
            }
            if self.letter_of(&dlq, &id, Duration::ZERO).await.is_none() {
                // Accepted, the answer lost: the job tells.
                replayed = true;
                break;
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        if !replayed {
            self.problem(f, "dlq replay --spec never succeeded");
        }
        self.ran_corrected_input(f, &id, &corrected).await;
        if self.letter_of(&dlq, &id, Duration::ZERO).await.is_some() {
            self.problem(f, "the letter stayed after its replay completed");
        }
        self.done(f);
    }

    /// The invariant `replayed_ran_corrected_input`: the replayed job
    /// `id` completes with the corrected input (echoed) as its output.
    async fn ran_corrected_input(&self, f: usize, id: &str, corrected: &Value) {
        match self
            .wait_for(id, |r| r.is_some_and(|r| r.status == "completed"))
            .await
        {
            Ok(Some(r)) if output(&r).as_ref() == Some(corrected) => {}
            Ok(r) | Err(r) => self.problem(
                f,
                format!(
                    "replayed_ran_corrected_input: {} with output {}",
                    status(r.as_ref()),
                    r.as_ref()
                        .and_then(output)
                        .map(|o| o.to_string().chars().take(200).collect::<String>())
                        .unwrap_or_default()
                ),
            ),
        }
    }

    /// The sequence of the rejected letter of `id`, waiting up to `wait`.
    async fn letter_of(&self, dlq: &Dlq, id: &str, wait: Duration) -> Option<u64> {
        self.letter(dlq, "echo", "rejected", id, wait).await
    }

    /// The sequence of the letter of `id` of `kind` and `class`, waiting up
    /// to `wait`.
    async fn letter(
        &self,
        dlq: &Dlq,
        kind: &str,
        class: &str,
        id: &str,
        wait: Duration,
    ) -> Option<u64> {
        let deadline = Instant::now() + wait;
        loop {
            if let Ok(Ok((letters, _))) = tokio::time::timeout(
                Duration::from_secs(5),
                dlq.page(Some(kind), Some(class), 0, 10_000),
            )
            .await
            {
                if let Some(l) = letters.iter().find(|l| l.job_id.as_deref() == Some(id)) {
                    return Some(l.seq);
                }
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// `leasehold setup --kinds ...` as an operator types it: only the
    /// kinds (every other setting stays as the soak set it up).
    fn setup_args(&self, with_live: bool, prune: bool) -> Vec<String> {
        let mut kinds = self.settings.kinds.clone();
        kinds.extend(doors::KINDS.map(String::from));
        if with_live {
            kinds.push(LIVE_KIND.into());
        }
        let mut a = vec!["setup".into(), "--kinds".into(), kinds.join(",")];
        if prune {
            a.push("--prune".into());
        }
        a
    }

    /// Starts a worker serving only the live kind; returns its process.
    fn start_worker(&self) -> Proc {
        let mut st = self.state.lock().unwrap();
        let generation = st.incarnations.len() as u32 + 1;
        let id = format!("soak-ops-w1-g{generation}");
        let env = worker_env(
            &self.settings,
            self.url.clone(),
            &self.sim_url,
            &id,
            2,
            LIVE_KIND.into(),
        );
        let log = self.logs.join(format!("worker-ops.{generation}.log"));
        let p = Proc::spawn_logged("leasehold-worker", &[], &env, Some(log.clone()));
        st.incarnations.push(Incarnation {
            slot: OPS_SLOT,
            id,
            generation,
            session: None,
            started: SystemTime::now(),
            ended: None,
            how: None,
            log,
        });
        p
    }

    /// Stops the live kind's worker as a deployment would (SIGTERM).
    async fn stop_worker(&self, mut p: Proc) {
        p.term();
        let p = tokio::task::spawn_blocking(move || {
            if p.wait_timeout(Duration::from_secs(30)).is_none() {
                p.kill9();
            }
            p
        })
        .await;
        drop(p);
        let mut st = self.state.lock().unwrap();
        if let Some(i) = st.incarnations.last_mut() {
            i.ended = Some(SystemTime::now());
            i.how = Some("stopped by the operators (SIGTERM)".into());
        }
    }

    async fn live_kind(&self, plan: &OpsPlan) {
        self.sleep_until(plan.add_kind_at_ms).await;
        let f = self.flow(&format!("kind {LIVE_KIND}"), "kind_lifecycle");
        match self
            .cli_until("kind", self.setup_args(true, false), |_| false)
            .await
        {
            Ok(_) => {}
            Err(e) => {
                self.problem(f, format!("setup adding {LIVE_KIND} never succeeded: {e}"));
                return;
            }
        }
        // Adding a kind changes nothing it was not asked to.
        match leasehold_store::setup::settings_set_up(&self.conn).await {
            Ok(now) => {
                if now.replicas != Some(self.replicas) || now.dedupe_window != Some(DEDUPE_WINDOW) {
                    self.problem(
                        f,
                        format!(
                            "setup --kinds changed the layout: replicas {:?} (was {}), dedupe window {:?} (was {DEDUPE_WINDOW:?})",
                            now.replicas, self.replicas, now.dedupe_window
                        ),
                    );
                }
            }
            Err(e) => self.problem(f, format!("reading the layout's settings: {e}")),
        }
        // Submitted before any worker serves the kind: must wait, not be rejected.
        let mut flows = JoinSet::new();
        let me = self.clone();
        flows.spawn(async move { me.deliver(0, None).await });
        let mut worker = Some(self.start_worker());
        for (n, at) in plan.deliveries.iter().enumerate() {
            let me = self.clone();
            let at = *at;
            flows.spawn(async move {
                me.sleep_until(at).await;
                me.deliver(n + 1, None).await
            });
        }
        for (n, at) in plan.reuses.iter().enumerate() {
            let me = self.clone();
            let at = *at;
            flows.spawn(async move {
                me.sleep_until(at).await;
                me.reuse(n).await
            });
        }
        while flows.join_next().await.is_some() {}
        self.sleep_until(plan.prune_at_ms).await;

        // Prune, refused while a ticket of the kind is queued.
        if let Some(p) = worker.take() {
            self.stop_worker(p).await;
        }
        let held = self.id("held", 0);
        let doc = format!("held back while the kind's workers are stopped ({held})");
        let spec = json!({"input": {"title": "held", "document": doc}}).to_string();
        if !self.submit(LIVE_KIND, spec.into_bytes(), &held).await {
            self.problem(f, "the held job's submission was never accepted");
        }
        self.document(f, &doc);
        match self
            .cli_until("kind", self.setup_args(false, true), |o| {
                o.contains("queued: nothing changed")
            })
            .await
        {
            Ok((0, out)) => self.problem(
                f,
                format!(
                    "prune with a queued ticket of {LIVE_KIND} exited 0: {}",
                    out.trim()
                ),
            ),
            Ok(_) => {}
            Err(e) => self.problem(f, format!("prune never answered: {e}")),
        }
        let p = self.start_worker();
        if let Err(r) = self
            .wait_for(&held, |r| r.is_some_and(|r| r.status == "completed"))
            .await
        {
            self.problem(
                f,
                format!(
                    "the held job after the refused prune: {}",
                    status(r.as_ref())
                ),
            );
        }
        self.stop_worker(p).await;
        match self
            .cli_until("kind", self.setup_args(false, true), |_| false)
            .await
        {
            Ok(_) => {}
            Err(e) => {
                self.problem(f, format!("prune never succeeded: {e}"));
                return;
            }
        }
        // The pruned kind refuses submissions, and makes no record.
        let after = self.id("after-prune", 0);
        let spec = json!({"input": {"title": "late", "document": "after the prune"}}).to_string();
        let (exit, out) = self
            .cli(
                "kind",
                vec![
                    "submit".into(),
                    LIVE_KIND.into(),
                    spec,
                    "--id".into(),
                    after.clone(),
                ],
            )
            .await;
        if exit == Some(0) {
            self.problem(
                f,
                format!("a submission of the pruned kind exited 0: {}", out.trim()),
            );
        }
        self.done(f);
    }

    /// One job of the live kind; `doc` names its document (else one of its own).
    async fn deliver(&self, n: usize, doc: Option<String>) {
        let id = self.id("deliver", n);
        let f = self.flow(&id, "deliver");
        let doc = doc.unwrap_or_else(|| format!("delivery {n} of the live kind ({id})"));
        let spec = json!({"input": {"title": id, "document": doc}}).to_string();
        self.document(f, &doc);
        if !self.submit(LIVE_KIND, spec.into_bytes(), &id).await {
            self.problem(f, "the submission was never accepted");
            return;
        }
        if let Err(r) = self
            .wait_for(&id, |r| r.is_some_and(|r| r.status == "completed"))
            .await
        {
            self.problem(f, format!("not completed: {}", status(r.as_ref())));
        }
        self.done(f);
    }

    /// A job whose id is reused once it is gone.
    async fn reuse(&self, n: usize) {
        let id = self.id("reuse", n);
        let f = self.flow(&id, "reuse");
        let first = format!("first incarnation of {id}");
        let spec = json!({"input": {"title": id, "document": first}}).to_string();
        self.document(f, &first);
        if !self.submit(LIVE_KIND, spec.into_bytes(), &id).await {
            self.problem(f, "the first submission was never accepted");
            return;
        }
        let one = match self
            .wait_for(&id, |r| r.is_some_and(|r| r.status == "completed"))
            .await
        {
            Ok(Some(r)) => r,
            Ok(None) | Err(_) => {
                self.problem(f, "the first incarnation never completed");
                return;
            }
        };
        if let Err(r) = self.wait_for(&id, |r| r.is_none()).await {
            self.problem(
                f,
                format!("retention never removed it: {}", status(r.as_ref())),
            );
            return;
        }
        let second = format!("second incarnation of {id}");
        let spec = json!({"input": {"title": id, "document": second}}).to_string();
        self.document(f, &second);
        // `submit` refuses an id its dedupe window still swallows: retried
        // until the window has passed.
        let deadline = Instant::now() + DEDUPE_WINDOW + PATIENCE;
        let args = vec![
            "submit".into(),
            LIVE_KIND.into(),
            spec,
            "--id".into(),
            id.clone(),
        ];
        loop {
            let (exit, out) = self.cli(&id, args.clone()).await;
            if exit == Some(0) {
                break;
            }
            if Instant::now() > deadline {
                self.problem(
                    f,
                    format!("the reused id was never accepted: {}", out.trim()),
                );
                return;
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        match self
            .wait_for(&id, |r| r.is_some_and(|r| r.status == "completed"))
            .await
        {
            Ok(Some(two)) => {
                if two.created_at == one.created_at {
                    self.problem(f, "the reused id kept the first incarnation's record");
                }
                if output(&two) == output(&one) {
                    self.problem(
                        f,
                        format!(
                            "the second incarnation's result is the first's: {:?}",
                            output(&two)
                        ),
                    );
                }
            }
            Ok(None) | Err(_) => self.problem(f, "the second incarnation never completed"),
        }
        self.done(f);
    }

    /// Every flow, action and worker process of the operators so far.
    pub fn log(&self) -> (Vec<Flow>, Vec<Action>, Vec<Incarnation>) {
        let st = self.state.lock().unwrap();
        (
            st.flows.clone(),
            st.actions.clone(),
            st.incarnations.clone(),
        )
    }
}

fn is_terminal(r: &JobRecord) -> bool {
    r.status
        .parse::<leasehold_core::Status>()
        .is_ok_and(|s| s.is_terminal())
}

fn status(r: Option<&JobRecord>) -> String {
    match r {
        None => "no record".into(),
        Some(r) => format!(
            "{} (epoch {}, {})",
            r.status,
            r.epoch,
            r.error
                .as_ref()
                .map(|e| e.message.clone())
                .unwrap_or_default()
        ),
    }
}

fn output(r: &JobRecord) -> Option<Value> {
    let v = serde_json::to_value(r).ok()?;
    match &v["result"]["output"] {
        Value::Null => None,
        Value::String(s) => serde_json::from_str(s)
            .ok()
            .or(Some(Value::String(s.clone()))),
        o => Some(o.clone()),
    }
}

/// The operators' invariants, from what the flows saw and what was
/// collected afterwards (every record revision, the sink).
pub fn check(flows: &[Flow], c: &Collected) -> Vec<Finding> {
    let mut out = Vec::new();
    let mut bad = |job: &str, reason: String| {
        out.push(Finding {
            job: job.to_string(),
            reason,
        })
    };
    for fl in flows {
        for p in &fl.problems {
            bad(&fl.id, format!("{}: {p}", fl.what));
        }
        if !fl.done && fl.problems.is_empty() {
            bad(&fl.id, format!("{}: the flow never ended", fl.what));
        }
    }
    let revs = |id: &str| -> Vec<Option<JobRecord>> {
        c.audit
            .get(id)
            .map(|v| v.iter().map(|r| r.rec.clone()).collect())
            .unwrap_or_default()
    };
    let effects = |id: &str| -> Vec<String> {
        c.effects
            .iter()
            .filter(|e| e["body"]["job_id"].as_str() == Some(id))
            .map(|e| e["body"]["document"].as_str().unwrap_or("").to_string())
            .collect()
    };
    for fl in flows {
        let id = fl.id.as_str();
        let rv = revs(id);
        match fl.what {
            "park_cancel" => {
                let first = rv
                    .iter()
                    .position(|r| r.as_ref().is_some_and(|r| r.status == "cancelled"));
                if let Some(i) = first {
                    if let Some(r) = rv[i..].iter().flatten().find(|r| r.status != "cancelled") {
                        bad(
                            id,
                            format!(
                                "resurrected: {} (epoch {}) after it was cancelled",
                                r.status, r.epoch
                            ),
                        );
                    }
                }
            }
            "deliver" | "reuse" => {
                if let Some(r) = rv.iter().flatten().find(|r| r.status == "rejected") {
                    bad(id, format!("rejected on a kind added live: {:?}", r.error));
                }
                let got = effects(id);
                if got != fl.documents {
                    bad(
                        id,
                        format!(
                            "the sink holds {:?} for this id; the operators submitted {:?}",
                            got, fl.documents
                        ),
                    );
                }
            }
            _ => {}
        }
    }
    // The held job and the refused submission after the prune.
    for fl in flows.iter().filter(|f| f.what == "kind_lifecycle") {
        let held: Vec<&str> = c
            .audit
            .keys()
            .filter(|k| k.contains("-op-held-"))
            .map(String::as_str)
            .collect();
        for h in held {
            let got = effects(h);
            if got != fl.documents {
                bad(
                    h,
                    format!(
                        "the sink holds {got:?} for the held job; expected {:?}",
                        fl.documents
                    ),
                );
            }
        }
        for k in c.audit.keys().filter(|k| k.contains("-op-after-prune-")) {
            bad(k, "a submission of the pruned kind made a record".into());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collect::Rev;

    #[test]
    fn the_plan_keeps_every_flow_inside_the_run_and_the_prune_last() {
        for seed in 1..50 {
            let run = Duration::from_secs(60);
            let p = plan(seed, run);
            assert_eq!(p, plan(seed, run), "a pure function of the seed");
            let end = run.as_millis() as u64;
            assert!(p.parks.iter().all(|(t, _)| *t < end));
            assert_eq!(p.parks.iter().filter(|(_, c)| *c).count(), 2);
            assert!(p
                .deliveries
                .iter()
                .all(|t| *t > p.add_kind_at_ms && *t < p.prune_at_ms));
            assert!(p.reuses.iter().all(|t| *t > p.add_kind_at_ms));
            assert!(p.prune_at_ms < end);
        }
    }

    fn rec(id: &str, status: &str, epoch: u64) -> JobRecord {
        let mut r = leasehold_core::machine::new_record(
            id,
            "fail",
            Default::default(),
            0,
            SystemTime::now(),
        );
        r.status = status.into();
        r.epoch = epoch;
        r
    }

    fn flow(id: &str, what: &'static str, documents: &[&str]) -> Flow {
        Flow {
            id: id.into(),
            what,
            at_ms: 0,
            documents: documents.iter().map(|d| d.to_string()).collect(),
            problems: Vec::new(),
            done: true,
            answers: Vec::new(),
        }
    }

    #[test]
    fn a_cancelled_job_that_runs_again_is_resurrected() {
        let mut c = Collected::default();
        let revs = ["parked", "cancelled", "queued", "running"]
            .iter()
            .enumerate()
            .map(|(i, s)| Rev {
                seq: i as u64 + 1,
                rec: Some(rec("c", s, 1)),
            })
            .collect();
        c.audit.insert("c".into(), revs);
        let f = check(&[flow("c", "park_cancel", &[])], &c);
        assert_eq!(f.len(), 1, "{f:?}");
        assert!(f[0].reason.contains("resurrected: queued"), "{f:?}");
    }

    #[test]
    fn a_reused_id_must_deliver_each_incarnations_document_once() {
        let mut c = Collected {
            effects: vec![json!({"body": {"job_id": "r", "document": "one"}})],
            ..Default::default()
        };
        let f = check(&[flow("r", "reuse", &["one", "two"])], &c);
        assert_eq!(f.len(), 1, "{f:?}");
        c.effects
            .push(json!({"body": {"job_id": "r", "document": "two"}}));
        assert!(check(&[flow("r", "reuse", &["one", "two"])], &c).is_empty());
        c.effects
            .push(json!({"body": {"job_id": "r", "document": "two"}}));
        assert_eq!(check(&[flow("r", "reuse", &["one", "two"])], &c).len(), 1);
    }

    #[test]
    fn a_flow_that_never_ended_is_a_finding() {
        let mut fl = flow("p", "park_resume", &[]);
        fl.done = false;
        let f = check(&[fl], &Collected::default());
        assert!(f[0].reason.contains("never ended"), "{f:?}");
    }
}
