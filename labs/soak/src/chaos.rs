//! The fault scheduler: runs the plan's faults one after another against the
//! fleet, each injected, held, and restored, and records what it hit.
//!
//! Faults are sequential on purpose: each has a clear start, end and set of
//! affected jobs, so recovery can be measured per fault, and two node
//! faults never overlap (losing a second node of three loses quorum, which
//! is unavailability by design, not a finding). Before a node fault the
//! cluster is given time to be whole again (every stream's replicas
//! current).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use leasehold_store::index::{Active, Filter};
use leasehold_store::sessions::{Ping, Sessions};
use leasehold_store::Conn;
use serde::Serialize;
use serde_json::Value;

use crate::fleet::{wait_for_log, Fleet};
use crate::plan::{Fault, Role, Step};
use crate::submit::Submitter;
use crate::track::Tracker;

/// A job running when a fault was injected, and the epoch it ran at.
#[derive(Debug, Clone, Serialize)]
pub struct Affected {
    pub job: String,
    pub epoch: u64,
}

/// One injected fault.
#[derive(Debug, Clone, Serialize)]
pub struct Injected {
    pub n: usize,
    pub name: &'static str,
    pub fault: Fault,
    /// What it hit: a worker id, a reaper, a node and why.
    pub target: String,
    /// Milliseconds since the start of the run.
    pub at_ms: u64,
    pub restored_ms: u64,
    /// A worker fault that left its process running (pause, partition):
    /// when the process first answered a ping after the fault was lifted.
    pub reachable_ms: Option<u64>,
    /// Wall-clock time of the injection (to read the processes' logs by).
    pub at_utc: String,
    #[serde(skip)]
    pub at: SystemTime,
    #[serde(skip)]
    pub restored_at: SystemTime,
    /// The worker process the fault hit (its generation in the slot).
    #[serde(skip)]
    pub generation: Option<u32>,
    /// Jobs the fault interrupted (a worker fault: the worker's running
    /// jobs; a server fault: every running job).
    pub affected: Vec<Affected>,
    /// The echo job submitted at injection to time the system's recovery.
    pub canary: Option<String>,
    /// Anything notable (a worker that ignored SIGTERM, an unhealthy cluster).
    pub notes: Vec<String>,
}

/// A worker process that exited by itself (a `crash` job aborts it) and
/// was started again.
#[derive(Debug, Clone, Serialize)]
pub struct Crashed {
    pub worker: String,
    pub generation: u32,
    /// When the soak saw it gone (milliseconds since the start of the run).
    pub seen_ms: u64,
    pub status: String,
}

pub struct Chaos<'a> {
    pub fleet: &'a mut Fleet,
    pub conn: &'a Conn,
    pub submitter: &'a Submitter,
    pub tracker: &'a Tracker,
    pub start: Instant,
    pub streams: Vec<String>,
    /// Start again, at once and under the same identity, every worker
    /// whose process exits by itself (as a process supervisor would).
    pub supervise: bool,
    /// What [`Chaos::supervise`] saw and did.
    pub crashed: Vec<Crashed>,
    /// The worker slot a fault holds now (never restarted behind its back).
    held: Option<usize>,
    /// Fault number -> when its worker answered a ping again.
    reachable: Arc<Mutex<BTreeMap<usize, SystemTime>>>,
    sessions: Option<Sessions>,
}

/// How often a supervised run looks for workers that exited by itself.
/// The harness gives no exit to await (it owns the child processes), so
/// this is a poll, like a supervisor's.
const SUPERVISE_EVERY: Duration = Duration::from_millis(200);

impl<'a> Chaos<'a> {
    pub fn new(
        fleet: &'a mut Fleet,
        conn: &'a Conn,
        submitter: &'a Submitter,
        tracker: &'a Tracker,
        start: Instant,
        streams: Vec<String>,
        supervise: bool,
    ) -> Self {
        Chaos {
            fleet,
            conn,
            submitter,
            tracker,
            start,
            streams,
            supervise,
            crashed: Vec::new(),
            held: None,
            reachable: Arc::default(),
            sessions: None,
        }
    }

    fn ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Waits `d`; when supervising, restarts crashed workers meanwhile.
    async fn pause(&mut self, d: Duration) {
        if !self.supervise {
            tokio::time::sleep(d).await;
            return;
        }
        let until = tokio::time::Instant::now() + d;
        loop {
            self.supervise();
            let now = tokio::time::Instant::now();
            if now >= until {
                return;
            }
            tokio::time::sleep((until - now).min(SUPERVISE_EVERY)).await;
        }
    }

    /// Runs `fut` to its end; when supervising, restarts crashed workers
    /// meanwhile.
    pub async fn during<T>(&mut self, fut: impl std::future::Future<Output = T>) -> T {
        tokio::pin!(fut);
        if !self.supervise {
            return fut.await;
        }
        loop {
            self.supervise();
            tokio::select! {
                v = &mut fut => return v,
                _ = tokio::time::sleep(SUPERVISE_EVERY) => {}
            }
        }
    }

    /// Starts again (same identity) every worker that exited by itself,
    /// except one a fault holds. Returns how many.
    pub fn supervise(&mut self) -> usize {
        if !self.supervise {
            return 0;
        }
        let mut n = 0;
        for (slot, st) in self.fleet.exited_workers(self.held) {
            let w = &self.fleet.workers[slot];
            let c = Crashed {
                worker: w.id.clone(),
                generation: w.generation,
                seen_ms: self.ms(),
                status: st.to_string(),
            };
            eprintln!(
                "soak: worker {} (process {}) exited by itself ({}); starting it again",
                c.worker, c.generation, c.status
            );
            self.crashed.push(c);
            self.fleet.spawn_worker(slot, false);
            n += 1;
        }
        n
    }

    /// After the run: when each fault's worker answered again.
    pub fn reachable(&self) -> BTreeMap<usize, SystemTime> {
        self.reachable.lock().unwrap().clone()
    }

    /// Pings worker `id` until it answers (at most a minute), in the
    /// background, and notes when for fault `n`.
    async fn probe_reachable(&mut self, n: usize, id: String) {
        if self.sessions.is_none() {
            self.sessions = Sessions::open(self.conn).await.ok();
        }
        let Some(sessions) = self.sessions.clone() else {
            return;
        };
        let out = self.reachable.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline {
                match sessions.ping(&id, Duration::from_secs(1)).await {
                    Ping::Alive(_) => {
                        out.lock().unwrap().insert(n, SystemTime::now());
                        return;
                    }
                    Ping::Timeout => {}
                    // Nothing to wait on: ask again shortly.
                    _ => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            }
        });
    }

    /// Runs `plan` until `until` (since the start); returns what was injected.
    pub async fn run(&mut self, plan: &[Step], until: Duration) -> Vec<Injected> {
        let mut out = Vec::new();
        for step in plan {
            let gap = Duration::from_millis(step.gap_ms);
            if self.start.elapsed() + gap >= until {
                break;
            }
            self.pause(gap).await;
            let inj = self.inject(out.len(), &step.fault).await;
            eprintln!(
                "soak: fault {:>3} {:<22} {:<28} affected {:>2} restored after {:.1}s{}",
                inj.n,
                inj.name,
                inj.target,
                inj.affected.len(),
                (inj.restored_ms - inj.at_ms) as f64 / 1000.0,
                if inj.notes.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", inj.notes.join("; "))
                }
            );
            out.push(inj);
        }
        out
    }

    /// The running jobs (of `worker`): the index of active jobs as the
    /// product keeps it, plus the live view of the records (jobs younger
    /// than `--index-after` are not indexed yet).
    async fn running(&self, worker: Option<&str>) -> (Vec<Affected>, Option<String>) {
        let (mut v, mut note) = self.indexed(worker).await;
        // An entry of a job that ended is not a running job: a removal not
        // repaired yet, or an entry a killed node brought back (nats-server
        // issue 8505). The product's reaper repairs those; counting them
        // would report as unrecovered a job that finished before the fault.
        let listed = v.len();
        v.retain(|a| !self.tracker.ended(&a.job));
        if v.len() < listed {
            let ended = format!("{} index entries of ended jobs left out", listed - v.len());
            note = Some(match note {
                Some(n) => format!("{n}; {ended}"),
                None => ended,
            });
        }
        for a in self.tracker.running(worker).await {
            if !v.iter().any(|x| x.job == a.job) {
                v.push(a);
            }
        }
        v.sort_by(|a, b| a.job.cmp(&b.job));
        (v, note)
    }

    async fn indexed(&self, worker: Option<&str>) -> (Vec<Affected>, Option<String>) {
        let listing = async {
            let idx = Active::open(self.conn).await?;
            idx.list(match worker {
                Some(w) => Filter::RunningBy(w),
                None => Filter::Running,
            })
            .await
        };
        match tokio::time::timeout(Duration::from_secs(5), listing).await {
            Ok(Ok(v)) => (
                v.into_iter()
                    .map(|(_, e)| Affected {
                        job: e.job,
                        epoch: e.epoch,
                    })
                    .collect(),
                None,
            ),
            Ok(Err(e)) => (Vec::new(), Some(format!("index not read: {e}"))),
            Err(_) => (Vec::new(), Some("index not read in 5s".into())),
        }
    }

    async fn inject(&mut self, n: usize, fault: &Fault) -> Injected {
        let mut notes = Vec::new();
        // Node faults wait for a whole cluster first (bounded).
        if matches!(
            fault,
            Fault::KillNode { .. } | Fault::StepDown { .. } | Fault::RollingRestart { .. }
        ) {
            if let Err(e) =
                wait_cluster_whole(self.conn, &self.streams, Duration::from_secs(90)).await
            {
                notes.push(format!("cluster not whole before the fault: {e}"));
            }
        }
        let worker_id = fault.worker().map(|w| self.fleet.workers[w].id.clone());
        let generation = fault.worker().map(|w| self.fleet.workers[w].generation);
        self.held = fault.worker();
        let (affected, note) = self.running(worker_id.as_deref()).await;
        notes.extend(note);
        let mut target = worker_id.clone().unwrap_or_default();
        let at = SystemTime::now();
        let at_ms = self.ms();
        let canary = Some(self.submitter.canary(n, at));
        match fault.clone() {
            Fault::KillWorker {
                worker,
                same_id,
                down_ms,
            } => {
                if let Some(p) = self.fleet.workers[worker].proc.as_mut() {
                    p.kill9();
                }
                self.fleet.ended(worker, "kill -9 by the soak");
                self.pause(Duration::from_millis(down_ms)).await;
                self.fleet.spawn_worker(worker, !same_id);
                if !same_id {
                    target = format!("{target} -> {}", self.fleet.workers[worker].id);
                }
            }
            Fault::PauseWorker { worker, pause_ms } => {
                let stopped = self.fleet.workers[worker]
                    .proc
                    .as_ref()
                    .map(|p| p.stop())
                    .is_some();
                if stopped {
                    self.pause(Duration::from_millis(pause_ms)).await;
                    if let Some(p) = self.fleet.workers[worker].proc.as_ref() {
                        p.cont();
                    }
                    self.probe_reachable(n, self.fleet.workers[worker].id.clone())
                        .await;
                }
            }
            Fault::TermWorker { worker } => {
                if let Some(mut p) = self.fleet.workers[worker].proc.take() {
                    p.term();
                    let (p, st) = tokio::task::spawn_blocking(move || {
                        let st = p_wait(&mut p, Duration::from_secs(30));
                        (p, st)
                    })
                    .await
                    .expect("wait task");
                    match st {
                        Some(s) if s.success() => {}
                        Some(s) => notes.push(format!("exited {s} after SIGTERM")),
                        None => {
                            notes.push("still running 30s after SIGTERM; killed".into());
                            let mut p = p;
                            p.kill9();
                        }
                    }
                }
                self.fleet.ended(worker, "SIGTERM by the soak");
                self.fleet.spawn_worker(worker, false);
            }
            Fault::FreezeWorker { worker, pause_ms } => {
                for p in &self.fleet.workers[worker].proxies {
                    p.freeze();
                }
                self.pause(Duration::from_millis(pause_ms)).await;
                for p in &self.fleet.workers[worker].proxies {
                    p.thaw();
                }
                self.probe_reachable(n, self.fleet.workers[worker].id.clone())
                    .await;
            }
            Fault::CutWorker { worker, pause_ms } | Fault::BlipWorker { worker, pause_ms } => {
                for p in &self.fleet.workers[worker].proxies {
                    p.refuse_new(true);
                    p.cut();
                }
                self.pause(Duration::from_millis(pause_ms)).await;
                for p in &self.fleet.workers[worker].proxies {
                    p.refuse_new(false);
                }
                self.probe_reachable(n, self.fleet.workers[worker].id.clone())
                    .await;
            }
            Fault::KillReaper { reaper, down_ms } => {
                target = format!("reaper {}", reaper + 1);
                if let Some(p) = self.fleet.reapers[reaper].proc.as_mut() {
                    p.kill9();
                }
                self.pause(Duration::from_millis(down_ms)).await;
                self.fleet.spawn_reaper(reaper);
            }
            Fault::RestartServer { down_ms } => {
                target = "nats-server".into();
                self.fleet.kill_node(0);
                self.pause(Duration::from_millis(down_ms)).await;
                if let Err(e) = self.fleet.restart_node(0).await {
                    notes.push(e.to_string());
                }
            }
            Fault::KillNode {
                stream,
                role,
                down_ms,
            } => {
                let node = match stream_info(self.conn, &stream).await {
                    Ok(info) => pick_node(&info, role),
                    Err(e) => {
                        notes.push(format!("no stream info for {stream}: {e}"));
                        None
                    }
                };
                let node = node.unwrap_or_else(|| {
                    notes.push("no leader known; killing node 0".into());
                    0
                });
                target = format!("node lh-n{node} ({role:?} of {stream})");
                self.fleet.kill_node(node);
                self.pause(Duration::from_millis(down_ms)).await;
                if let Err(e) = self.fleet.restart_node(node).await {
                    notes.push(e.to_string());
                }
            }
            Fault::StepDown { stream } => {
                let before = stream_info(self.conn, &stream)
                    .await
                    .ok()
                    .and_then(|i| i["cluster"]["leader"].as_str().map(str::to_string));
                let subject = format!("$JS.API.STREAM.LEADER.STEPDOWN.{stream}");
                let res = tokio::time::timeout(
                    Duration::from_secs(10),
                    self.conn.client.request(subject, "".into()),
                )
                .await;
                let reply = match res {
                    Ok(Ok(m)) => String::from_utf8_lossy(&m.payload).to_string(),
                    Ok(Err(e)) => format!("request failed: {e}"),
                    Err(_) => "no reply in 10s".into(),
                };
                if !reply.contains("\"success\":true") {
                    notes.push(format!("step-down: {reply}"));
                }
                target = format!("{stream} (leader was {})", before.unwrap_or("?".into()));
            }
            Fault::NatsRestart { graceful, down_ms } => {
                target = "nats-server".into();
                self.stop_server(0, graceful, &mut notes).await;
                self.pause(Duration::from_millis(down_ms)).await;
                if let Err(e) = self.fleet.restart_node(0).await {
                    notes.push(e.to_string());
                }
            }
            Fault::RollingRestart { nodes, down_ms } => {
                target = nodes
                    .iter()
                    .map(|i| format!("lh-n{i}"))
                    .collect::<Vec<_>>()
                    .join(" -> ");
                for node in nodes {
                    let t0 = Instant::now();
                    self.stop_server(node, true, &mut notes).await;
                    self.pause(Duration::from_millis(down_ms)).await;
                    if let Err(e) = self.fleet.restart_node(node).await {
                        notes.push(e.to_string());
                    }
                    // The node has rejoined when every stream has a leader
                    // and every replica (its own too) is current again.
                    let whole = self.wait_whole(Duration::from_secs(120)).await;
                    match whole {
                        Ok(()) => notes.push(format!(
                            "lh-n{node} back and current after {:.1}s",
                            t0.elapsed().as_secs_f64()
                        )),
                        Err(e) => notes.push(format!(
                            "lh-n{node}: cluster not whole 120s after its restart: {e}"
                        )),
                    }
                }
            }
        }
        self.held = None;
        let restored_at = SystemTime::now();
        Injected {
            n,
            name: fault.name(),
            fault: fault.clone(),
            target,
            at_ms,
            restored_ms: self.ms(),
            reachable_ms: None,
            at_utc: leasehold_core::time::rfc3339(at),
            at,
            restored_at,
            generation,
            affected,
            canary,
            notes,
        }
    }

    /// Stops server `node`: SIGTERM and its exit (`graceful`), else SIGKILL.
    async fn stop_server(&mut self, node: usize, graceful: bool, notes: &mut Vec<String>) {
        if !graceful {
            self.fleet.kill_node(node);
            return;
        }
        let name = if self.fleet.is_cluster() {
            format!("lh-n{node}")
        } else {
            "the server".into()
        };
        let stopped = self.fleet.stop_node(node, Duration::from_secs(30)).await;
        match stopped {
            Ok(how) => notes.push(format!("{name} {how}")),
            Err(e) => notes.push(format!("{name}: {e}")),
        }
    }

    /// [`wait_cluster_whole`], restarting crashed workers meanwhile.
    async fn wait_whole(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let (conn, streams) = (self.conn, self.streams.clone());
        self.during(wait_cluster_whole(conn, &streams, timeout))
            .await
    }

    /// After the last fault: every worker and reaper running and reachable,
    /// every server up, and each worker's log showing it started.
    pub async fn restore_all(&mut self) -> Vec<String> {
        let mut notes = Vec::new();
        for i in self.fleet.nodes_down() {
            if let Err(e) = self.fleet.restart_node(i).await {
                notes.push(e.to_string());
            }
        }
        for w in 0..self.fleet.workers.len() {
            for p in &self.fleet.workers[w].proxies {
                p.thaw();
                p.refuse_new(false);
            }
            let alive = match self.fleet.workers[w].proc.as_mut() {
                Some(p) => {
                    p.cont();
                    p.alive()
                }
                None => false,
            };
            if !alive {
                notes.push(format!(
                    "worker {} was not running at the end; started again",
                    self.fleet.workers[w].id
                ));
                self.fleet.ended(w, "found not running after the injection");
                self.fleet.spawn_worker(w, false);
            }
        }
        for r in 0..self.fleet.reapers.len() {
            let alive = self.fleet.reapers[r]
                .proc
                .as_mut()
                .is_some_and(|p| p.alive());
            if !alive {
                notes.push(format!("reaper {} was not running at the end", r + 1));
                self.fleet.spawn_reaper(r);
            }
        }
        for w in &self.fleet.workers {
            if let Some(p) = &w.proc {
                if let Err(e) = wait_for_log(p, "worker starting", Duration::from_secs(150)).await {
                    notes.push(e.to_string());
                }
            }
        }
        notes
    }
}

fn p_wait(p: &mut leasehold_harness::Proc, d: Duration) -> Option<std::process::ExitStatus> {
    p.wait_timeout(d)
}

/// `$JS.API.STREAM.INFO.<stream>` as JSON.
pub async fn stream_info(conn: &Conn, stream: &str) -> anyhow::Result<Value> {
    let m = tokio::time::timeout(
        Duration::from_secs(5),
        conn.client
            .request(format!("$JS.API.STREAM.INFO.{stream}"), "".into()),
    )
    .await
    .map_err(|_| anyhow::anyhow!("no reply in 5s"))??;
    let v: Value = serde_json::from_slice(&m.payload)?;
    if let Some(e) = v.get("error") {
        anyhow::bail!("{e}");
    }
    Ok(v)
}

/// Node index (`lh-n<i>`) of the stream's leader, or of one follower.
fn pick_node(info: &Value, role: Role) -> Option<usize> {
    let node = |name: &str| {
        name.strip_prefix("lh-n")
            .and_then(|i| i.parse::<usize>().ok())
    };
    let c = &info["cluster"];
    match role {
        Role::Leader => c["leader"].as_str().and_then(node),
        Role::Follower => c["replicas"]
            .as_array()?
            .iter()
            .filter_map(|r| r["name"].as_str().and_then(node))
            .next(),
    }
}

/// Waits until every stream has a leader and every replica is current.
pub async fn wait_cluster_whole(
    conn: &Conn,
    streams: &[String],
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let mut why = None;
        for s in streams {
            match stream_info(conn, s).await {
                Ok(i) => {
                    let c = &i["cluster"];
                    let replicas = c["replicas"].as_array().cloned().unwrap_or_default();
                    let whole = c["leader"].as_str().is_some()
                        && replicas.len() == 2
                        && replicas
                            .iter()
                            .all(|r| r["current"] == true && r["offline"] != true);
                    if !whole {
                        why = Some(format!("{s}: {c}"));
                        break;
                    }
                }
                Err(e) => {
                    why = Some(format!("{s}: {e}"));
                    break;
                }
            }
        }
        match why {
            None => return Ok(()),
            Some(w) if tokio::time::Instant::now() >= deadline => anyhow::bail!(w),
            Some(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}
