//! The fault scheduler: runs the plan's faults one after another against the
//! fleet, each injected, held, and restored, and records what it hit.
//!
//! Faults are sequential on purpose: each has a clear start, end and set of
//! affected jobs, so recovery can be measured per fault, and two node
//! faults never overlap (losing a second node of three loses quorum, which
//! is unavailability by design, not a finding). Before a node fault the
//! cluster is given time to be whole again (every stream's replicas
//! current).

use std::time::{Duration, Instant, SystemTime};

use leasehold_store::index::{Active, Filter};
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
    /// Wall-clock time of the injection (to read the processes' logs by).
    pub at_utc: String,
    #[serde(skip)]
    pub at: SystemTime,
    /// Jobs the fault interrupted (a worker fault: the worker's running
    /// jobs; a server fault: every running job).
    pub affected: Vec<Affected>,
    /// The echo job submitted at injection to time the system's recovery.
    pub canary: Option<String>,
    /// Anything notable (a worker that ignored SIGTERM, an unhealthy cluster).
    pub notes: Vec<String>,
}

pub struct Chaos<'a> {
    pub fleet: &'a mut Fleet,
    pub conn: &'a Conn,
    pub submitter: &'a Submitter,
    pub tracker: &'a Tracker,
    pub start: Instant,
    pub streams: Vec<String>,
}

impl Chaos<'_> {
    fn ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Runs `plan` until `until` (since the start); returns what was injected.
    pub async fn run(&mut self, plan: &[Step], until: Duration) -> Vec<Injected> {
        let mut out = Vec::new();
        for step in plan {
            let gap = Duration::from_millis(step.gap_ms);
            if self.start.elapsed() + gap >= until {
                break;
            }
            tokio::time::sleep(gap).await;
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
        let (mut v, note) = self.indexed(worker).await;
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
        if matches!(fault, Fault::KillNode { .. } | Fault::StepDown { .. }) {
            if let Err(e) =
                wait_cluster_whole(self.conn, &self.streams, Duration::from_secs(90)).await
            {
                notes.push(format!("cluster not whole before the fault: {e}"));
            }
        }
        let worker_id = fault.worker().map(|w| self.fleet.workers[w].id.clone());
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
                tokio::time::sleep(Duration::from_millis(down_ms)).await;
                self.fleet.spawn_worker(worker, !same_id);
                if !same_id {
                    target = format!("{target} -> {}", self.fleet.workers[worker].id);
                }
            }
            Fault::PauseWorker { worker, pause_ms } => {
                if let Some(p) = self.fleet.workers[worker].proc.as_ref() {
                    p.stop();
                    tokio::time::sleep(Duration::from_millis(pause_ms)).await;
                    p.cont();
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
                self.fleet.spawn_worker(worker, false);
            }
            Fault::FreezeWorker { worker, pause_ms } => {
                for p in &self.fleet.workers[worker].proxies {
                    p.freeze();
                }
                tokio::time::sleep(Duration::from_millis(pause_ms)).await;
                for p in &self.fleet.workers[worker].proxies {
                    p.thaw();
                }
            }
            Fault::CutWorker { worker, pause_ms } => {
                for p in &self.fleet.workers[worker].proxies {
                    p.refuse_new(true);
                    p.cut();
                }
                tokio::time::sleep(Duration::from_millis(pause_ms)).await;
                for p in &self.fleet.workers[worker].proxies {
                    p.refuse_new(false);
                }
            }
            Fault::KillReaper { reaper, down_ms } => {
                target = format!("reaper {}", reaper + 1);
                if let Some(p) = self.fleet.reapers[reaper].proc.as_mut() {
                    p.kill9();
                }
                tokio::time::sleep(Duration::from_millis(down_ms)).await;
                self.fleet.spawn_reaper(reaper);
            }
            Fault::RestartServer { down_ms } => {
                target = "nats-server".into();
                self.fleet.kill_node(0);
                tokio::time::sleep(Duration::from_millis(down_ms)).await;
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
                tokio::time::sleep(Duration::from_millis(down_ms)).await;
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
        }
        Injected {
            n,
            name: fault.name(),
            fault: fault.clone(),
            target,
            at_ms,
            restored_ms: self.ms(),
            at_utc: leasehold_core::time::rfc3339(at),
            at,
            affected,
            canary,
            notes,
        }
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
