//! The plan of a run: which jobs are submitted when, which are cancelled,
//! and which faults are injected in which order. A pure function of the
//! seed and the arguments, so `--seed N` replays the same plan (the
//! interleavings with real processes differ from run to run; the plan does
//! not).

use std::time::Duration;

use serde::Serialize;
use serde_json::{json, Value};

use crate::profile::{Knobs, LongJobs};
use crate::rng::Rng;

/// Attempts a worker gives a job (the workers' `--max-attempts`, set by the soak).
pub const MAX_ATTEMPTS: u64 = 5;

/// What a job must end as, judged from its spec alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Expect {
    /// Must not end `failed` (echo, sleep, a `fail` that recovers in time).
    NotFailed,
    /// Must not end `completed` (a terminal error, or retries that run out).
    NotCompleted,
    /// Anything terminal or parked (deliveries and research under faults).
    Any,
    /// A poison job (`crash`): must end `dead` with class `poison`.
    Poison,
}

/// A planned cancel request.
#[derive(Debug, Clone, Serialize)]
pub struct CancelPlan {
    /// After the submission.
    pub after_ms: u64,
    /// `leasehold cancel ID` as a process, else a request on `lh.cancel.<id>`.
    pub via_cli: bool,
}

/// One planned submission.
#[derive(Debug, Clone, Serialize)]
pub struct JobPlan {
    /// Offset from the start of the run.
    pub at_ms: u64,
    pub id: String,
    pub kind: &'static str,
    pub spec: Value,
    pub cancel: Option<CancelPlan>,
    /// Send the job its signal `go` this long after the submission
    /// (`--signals`): before, during or after its wait.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal_after_ms: Option<u64>,
    pub expect: Expect,
}

/// Kinds the soak submits, as the workers must serve them.
pub const KINDS: [&str; 5] = ["echo", "sleep", "fail", "deliver", "research"];

const TOPICS: [&str; 6] = [
    "lease-based ownership",
    "idempotency keys for webhooks",
    "checkpointing agent workflows",
    "backoff with jitter",
    "work queues on JetStream",
    "repairing tool-calling transcripts",
];

/// Submissions at `rate` per second (exponential gaps) for `run`.
pub fn jobs(seed: u64, run: Duration, rate: f64) -> Vec<JobPlan> {
    let mut r = Rng::stream(seed, "jobs");
    let mut out = Vec::new();
    let mut t = 0.0f64;
    let end = run.as_secs_f64();
    let mean_gap = 1.0 / rate.max(0.01);
    loop {
        // Exponential inter-arrival times: a Poisson stream of users.
        t += -mean_gap * (1.0 - r.unit()).ln();
        if t >= end {
            break;
        }
        let n = out.len();
        // Weights: echo, sleep, fail, deliver, research.
        let kind = KINDS[r.weighted(&[25, 20, 20, 15, 20])];
        let id = format!("soak-{seed}-{n:05}-{kind}");
        let (spec, expect) = match kind {
            "echo" => (json!({"input": {"n": n, "seed": seed}}), Expect::NotFailed),
            "sleep" => (
                json!({"input": {"ms": r.range(500, 10_000)}}),
                Expect::NotFailed,
            ),
            "fail" => {
                let ms = r.range(0, 1500);
                match r.weighted(&[6, 2, 2]) {
                    // Recovers within the attempts it has.
                    0 => (
                        json!({"input": {"class": "retryable", "times": r.range(1, 2), "ms": ms}}),
                        Expect::NotFailed,
                    ),
                    // Runs out of attempts.
                    1 => (
                        json!({"input": {"class": "retryable", "times": MAX_ATTEMPTS + 4, "ms": ms}}),
                        Expect::NotCompleted,
                    ),
                    // Terminal at once: never retried.
                    _ => (
                        json!({"input": {"class": "terminal", "times": 1, "ms": ms}}),
                        Expect::NotCompleted,
                    ),
                }
            }
            "deliver" => (
                json!({"input": {
                    "title": format!("soak delivery {n}"),
                    "document": format!("# Delivery {n} of seed {seed}\n\nOne effect, whatever happens.\n"),
                }}),
                Expect::Any,
            ),
            _ => (
                json!({"input": {
                    "topic": TOPICS[r.range(0, TOPICS.len() as u64 - 1) as usize],
                    "experts": r.range(1, 3),
                    "sections": r.range(1, 3),
                }}),
                Expect::Any,
            ),
        };
        let cancel = r.chance(0.08).then(|| CancelPlan {
            after_ms: r.range(100, 4000),
            via_cli: r.chance(0.3),
        });
        out.push(JobPlan {
            at_ms: (t * 1000.0) as u64,
            id,
            kind,
            spec,
            cancel,
            signal_after_ms: None,
            expect,
        });
    }
    out
}

/// Makes a fraction `p` of the mix's `sleep` jobs durable timers
/// (`"durable": true`: the job waits holding no worker). Drawn from a
/// stream of its own, so a seed's plan is what it was with `p` = 0.
pub fn durable_sleeps(v: &mut [JobPlan], seed: u64, p: f64) {
    if p <= 0.0 {
        return;
    }
    let mut r = Rng::stream(seed, "timers");
    for j in v.iter_mut().filter(|j| j.kind == "sleep") {
        if r.chance(p) {
            j.spec["input"]["durable"] = json!(true);
        }
    }
}

/// Makes a fraction `p` of the mix's `sleep` jobs also wait for the signal
/// `go` (`"signal": "go"`), sent by the soak at a time drawn between the
/// submission and well after the sleep: before the job waits (kept for
/// it), while it runs, or while it waits. Drawn from a stream of its own.
pub fn signals(v: &mut [JobPlan], seed: u64, p: f64) {
    if p <= 0.0 {
        return;
    }
    let mut r = Rng::stream(seed, "signals");
    for j in v.iter_mut().filter(|j| j.kind == "sleep") {
        if r.chance(p) {
            j.spec["input"]["signal"] = json!("go");
            let ms = j.spec["input"]["ms"].as_u64().unwrap_or(0);
            j.signal_after_ms = Some(r.range(0, ms + 3000));
        }
    }
}

/// Makes a fraction `p` of the mix's research jobs run their experts as
/// child jobs (`"expert_jobs": true`). Drawn from a stream of its own.
pub fn expert_jobs(v: &mut [JobPlan], seed: u64, p: f64) {
    if p <= 0.0 {
        return;
    }
    let mut r = Rng::stream(seed, "expert-jobs");
    for j in v.iter_mut().filter(|j| j.kind == "research") {
        if r.chance(p) {
            j.spec["input"]["expert_jobs"] = json!(true);
        }
    }
}

/// Every planned submission of a run with knobs `k`, in time order: the job
/// mix at `k.rate`, then (by profile) long jobs and poison jobs. Each part
/// draws from its own stream of the seed, so the default profile's plan is
/// the mix alone, exactly as before profiles.
pub fn plan_jobs(seed: u64, run: Duration, k: &Knobs) -> Vec<JobPlan> {
    let mut v = jobs(seed, run, k.rate);
    durable_sleeps(&mut v, seed, k.durable_sleeps);
    signals(&mut v, seed, k.signals);
    expert_jobs(&mut v, seed, k.expert_jobs);
    if k.ops {
        // The operators' kind is not set up until they add it.
        v.retain(|j| j.kind != crate::ops::LIVE_KIND);
    }
    if let Some(l) = &k.long {
        v.extend(long_jobs(seed, run, l.lanes(k.slots()), l));
    }
    if k.poison {
        v.extend(poison_jobs(seed, run, k.poison_jobs));
    }
    if k.fanout > 0 {
        v.push(JobPlan {
            at_ms: run.as_millis() as u64 / 5,
            id: format!("soak-{seed}-fanout"),
            kind: "fanout",
            spec: json!({"input": {"n": k.fanout}}),
            cancel: None,
            signal_after_ms: None,
            expect: Expect::NotFailed,
        });
    }
    // Stable: the mix keeps its order among equal times.
    v.sort_by_key(|j| j.at_ms);
    v
}

/// Long `sleep` jobs in `lanes` lanes: every lane's first job within the
/// first second, each next one `lead_ms` before the previous one of its
/// lane is planned to end, for as long as `run` lasts. A job's planned end
/// is at most `tail_ms` after `run` (the last of a lane is cut short, never
/// below the shortest duration), so the run settles soon after.
pub fn long_jobs(seed: u64, run: Duration, lanes: usize, l: &LongJobs) -> Vec<JobPlan> {
    let mut r = Rng::stream(seed, "long");
    let end = run.as_millis() as u64;
    let mut drawn: Vec<(u64, usize, u64)> = Vec::new();
    for lane in 0..lanes {
        let mut t = r.range(0, 1000);
        while t < end {
            let ms = r
                .range(l.ms.0, l.ms.1)
                .min((end + l.tail_ms).saturating_sub(t))
                .max(l.ms.0);
            drawn.push((t, lane, ms));
            t = (t + ms).saturating_sub(l.lead_ms).max(t + 1);
        }
    }
    drawn.sort_unstable();
    drawn
        .into_iter()
        .enumerate()
        .map(|(n, (at_ms, lane, ms))| JobPlan {
            at_ms,
            id: format!("soak-{seed}-L{n:04}-sleep"),
            kind: "sleep",
            spec: json!({"input": {"ms": ms, "lane": lane}}),
            cancel: None,
            signal_after_ms: None,
            expect: Expect::NotFailed,
        })
        .collect()
}

/// `n` poison jobs (`crash`: the attempt aborts its worker), by default 2
/// plus one per two minutes of run (at most 8), submitted between 5 s and
/// half-way.
pub fn poison_jobs(seed: u64, run: Duration, n: Option<usize>) -> Vec<JobPlan> {
    let mut r = Rng::stream(seed, "poison");
    let n = n.unwrap_or((2 + run.as_secs() / 120).min(8) as usize);
    let last = (run.as_millis() as u64 / 2).max(6000);
    let mut at: Vec<u64> = (0..n).map(|_| r.range(5000, last)).collect();
    at.sort_unstable();
    at.into_iter()
        .enumerate()
        .map(|(i, at_ms)| JobPlan {
            at_ms,
            id: format!("soak-{seed}-P{i:02}-crash"),
            kind: "crash",
            spec: json!({"input": {"poison": i}}),
            cancel: None,
            signal_after_ms: None,
            expect: Expect::Poison,
        })
        .collect()
}

/// Which replica of a stream a node fault hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Leader,
    Follower,
}

/// One fault.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fault {
    /// SIGKILL a worker; start it again after `down_ms`, under its identity
    /// (it reclaims its jobs at start) or under a new one.
    KillWorker {
        worker: usize,
        same_id: bool,
        down_ms: u64,
    },
    /// SIGSTOP a worker past its session timeout, then SIGCONT.
    PauseWorker { worker: usize, pause_ms: u64 },
    /// SIGTERM (drain, hand back), wait for the exit, start it again.
    TermWorker { worker: usize },
    /// Partition a proxied worker from NATS: no byte either way, sockets open.
    FreezeWorker { worker: usize, pause_ms: u64 },
    /// Cut a proxied worker's connections and refuse its reconnects.
    CutWorker { worker: usize, pause_ms: u64 },
    /// Cut a proxied worker's connections and refuse its reconnects for
    /// 0.5-2 s, well inside its session timeout: it must keep its jobs.
    BlipWorker { worker: usize, pause_ms: u64 },
    /// SIGKILL one reaper; start it again after `down_ms`.
    KillReaper { reaper: usize, down_ms: u64 },
    /// Single node: SIGKILL the nats-server, restart it on its storage.
    RestartServer { down_ms: u64 },
    /// Cluster: SIGKILL the node holding `role` for `stream`, restart it.
    KillNode {
        stream: String,
        role: Role,
        down_ms: u64,
    },
    /// Cluster: ask the leader of `stream` to step down.
    StepDown { stream: String },
    /// Single node: stop the server (SIGTERM and wait for its exit, or
    /// SIGKILL), keep it down `down_ms` (longer than the session timeout),
    /// start it again on its storage.
    NatsRestart { graceful: bool, down_ms: u64 },
    /// Cluster: restart the nodes one at a time in this order: SIGTERM, wait
    /// for the exit, `down_ms` down, start, wait until every stream has a
    /// leader and every replica is current again; then the next node.
    RollingRestart { nodes: Vec<usize>, down_ms: u64 },
}

impl Fault {
    pub fn name(&self) -> &'static str {
        match self {
            Fault::KillWorker { same_id: true, .. } => "kill9_worker_same_id",
            Fault::KillWorker { .. } => "kill9_worker_new_id",
            Fault::PauseWorker { .. } => "sigstop_worker",
            Fault::TermWorker { .. } => "sigterm_worker",
            Fault::FreezeWorker { .. } => "partition_freeze",
            Fault::CutWorker { .. } => "partition_cut",
            Fault::BlipWorker { .. } => "partition_blip",
            Fault::KillReaper { .. } => "kill9_reaper",
            Fault::RestartServer { .. } => "kill9_server",
            Fault::KillNode {
                role: Role::Leader, ..
            } => "kill9_node_leader",
            Fault::KillNode { .. } => "kill9_node_follower",
            Fault::StepDown { .. } => "leader_stepdown",
            Fault::NatsRestart { graceful: true, .. } => "nats_restart_sigterm",
            Fault::NatsRestart { .. } => "nats_restart_kill9",
            Fault::RollingRestart { .. } => "rolling_restart",
        }
    }

    /// The worker slot this fault hits, if any.
    pub fn worker(&self) -> Option<usize> {
        match self {
            Fault::KillWorker { worker, .. }
            | Fault::PauseWorker { worker, .. }
            | Fault::TermWorker { worker }
            | Fault::FreezeWorker { worker, .. }
            | Fault::CutWorker { worker, .. }
            | Fault::BlipWorker { worker, .. } => Some(*worker),
            _ => None,
        }
    }
}

/// One step of the schedule: wait `gap_ms` after the previous fault was
/// restored, then inject.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    pub gap_ms: u64,
    pub fault: Fault,
}

/// The shape of the fleet the schedule is drawn for.
#[derive(Debug, Clone)]
pub struct Shape {
    pub workers: usize,
    /// Worker slots behind a fault proxy (partitionable).
    pub proxied: Vec<usize>,
    pub reapers: usize,
    /// The workers' session timeout.
    pub session_ms: u64,
    /// Streams whose leaders node faults aim at.
    pub streams: Vec<String>,
    pub gap_ms: (u64, u64),
    /// The deck the kinds are dealt from (names as [`Fault::name`]; a kind
    /// listed twice comes twice as often): the profile's.
    pub kinds: Vec<&'static str>,
    /// Only these fault kinds (names as [`Fault::name`]); all when `None`.
    pub only: Option<Vec<String>>,
}

/// The fault kinds a topology can have, by name.
pub fn fault_kinds(cluster: bool, proxied: bool) -> Vec<&'static str> {
    let mut k = vec![
        "kill9_worker_same_id",
        "kill9_worker_new_id",
        "sigstop_worker",
        "sigterm_worker",
        "kill9_reaper",
    ];
    if proxied {
        k.extend(["partition_freeze", "partition_cut"]);
    }
    if cluster {
        k.extend([
            "kill9_node_leader",
            "kill9_node_follower",
            "leader_stepdown",
        ]);
    } else {
        k.push("kill9_server");
    }
    k
}

/// A schedule long enough for `run` (the executor stops when time is up).
///
/// Fault kinds are dealt from a shuffled deck, reshuffled when empty, so
/// even a short run sees every kind once before any kind twice.
pub fn faults(seed: u64, run: Duration, s: &Shape) -> Vec<Step> {
    let mut r = Rng::stream(seed, "faults");
    let deck_kinds: Vec<&str> = s
        .kinds
        .iter()
        .copied()
        .filter(|k| {
            s.only
                .as_ref()
                .is_none_or(|only| only.iter().any(|o| o == k))
        })
        .collect();
    if deck_kinds.is_empty() {
        return Vec::new();
    }
    let mut deck: Vec<&str> = Vec::new();
    let mut out = Vec::new();
    let mut t = 0u64;
    // Faults take at least a second or two each; this bounds the list.
    while t < run.as_millis() as u64 + 60_000 {
        if deck.is_empty() {
            deck = deck_kinds.clone();
            r.shuffle(&mut deck);
        }
        let k = deck.pop().expect("deck");
        let worker = r.range(0, s.workers as u64 - 1) as usize;
        let proxied = if s.proxied.is_empty() {
            worker
        } else {
            s.proxied[r.range(0, s.proxied.len() as u64 - 1) as usize]
        };
        let beyond = s.session_ms + r.range(500, 3000);
        let stream = s.streams[r.range(0, s.streams.len() as u64 - 1) as usize].clone();
        let fault = match k {
            "kill9_worker_same_id" | "kill9_worker_new_id" => Fault::KillWorker {
                worker,
                same_id: k == "kill9_worker_same_id",
                down_ms: r.range(0, 2000),
            },
            "sigstop_worker" => Fault::PauseWorker {
                worker,
                pause_ms: beyond,
            },
            "sigterm_worker" => Fault::TermWorker { worker },
            "partition_freeze" => Fault::FreezeWorker {
                worker: proxied,
                pause_ms: beyond,
            },
            "partition_cut" => Fault::CutWorker {
                worker: proxied,
                pause_ms: r.range(1000, s.session_ms + 2000),
            },
            "partition_blip" => Fault::BlipWorker {
                worker: proxied,
                pause_ms: r.range(500, 2000),
            },
            "kill9_reaper" => Fault::KillReaper {
                reaper: r.range(0, s.reapers as u64 - 1) as usize,
                down_ms: r.range(200, 3000),
            },
            "kill9_server" => Fault::RestartServer {
                down_ms: r.range(500, 6000),
            },
            "nats_restart_kill9" | "nats_restart_sigterm" => Fault::NatsRestart {
                graceful: k == "nats_restart_sigterm",
                // Past the session timeout: every session key ends while
                // the server is away, and live owners must keep their jobs.
                down_ms: r.range(2 * s.session_ms, 3 * s.session_ms),
            },
            "rolling_restart" => {
                let mut nodes: Vec<usize> = (0..3).collect();
                r.shuffle(&mut nodes);
                Fault::RollingRestart {
                    nodes,
                    down_ms: r.range(500, 3000),
                }
            }
            "kill9_node_leader" | "kill9_node_follower" => Fault::KillNode {
                stream,
                role: if k == "kill9_node_leader" {
                    Role::Leader
                } else {
                    Role::Follower
                },
                down_ms: r.range(1000, 10_000),
            },
            _ => Fault::StepDown { stream },
        };
        let gap_ms = r.range(s.gap_ms.0, s.gap_ms.1);
        t += gap_ms + 2000;
        out.push(Step { gap_ms, fault });
    }
    out
}

/// When to arm a fault at the effects sink, and which.
#[derive(Debug, Clone, Serialize)]
pub struct SinkFault {
    pub at_ms: u64,
    pub mode: &'static str,
}

/// The sink misbehaves for one delivery every 10-30 s: it times out
/// before recording, records then answers 500, or records then hangs past
/// the caller's timeout.
pub fn sink_faults(seed: u64, run: Duration) -> Vec<SinkFault> {
    let mut r = Rng::stream(seed, "sink");
    let modes = [
        "timeout_before_commit",
        "commit_then_5xx",
        "commit_then_timeout",
    ];
    let mut out = Vec::new();
    let mut t = 0;
    loop {
        t += r.range(10_000, 30_000);
        if t >= run.as_millis() as u64 {
            return out;
        }
        out.push(SinkFault {
            at_ms: t,
            mode: modes[r.range(0, 2) as usize],
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(cluster: bool) -> Shape {
        Shape {
            workers: 4,
            proxied: vec![2, 3],
            reapers: 2,
            session_ms: 3000,
            streams: vec!["LH_WORK".into(), "LH_EVENTS".into()],
            gap_ms: (3000, 8000),
            kinds: fault_kinds(cluster, true),
            only: None,
        }
    }

    #[test]
    fn a_seed_replays_the_same_plan() {
        let run = Duration::from_secs(120);
        let a = serde_json::to_string(&jobs(9, run, 1.0)).unwrap();
        let b = serde_json::to_string(&jobs(9, run, 1.0)).unwrap();
        assert_eq!(a, b);
        let a = serde_json::to_string(&faults(9, run, &shape(true))).unwrap();
        let b = serde_json::to_string(&faults(9, run, &shape(true))).unwrap();
        assert_eq!(a, b);
        assert_ne!(
            serde_json::to_string(&jobs(10, run, 1.0)).unwrap(),
            serde_json::to_string(&jobs(9, run, 1.0)).unwrap()
        );
    }

    #[test]
    fn every_fault_kind_comes_before_any_repeats() {
        for cluster in [false, true] {
            let s = shape(cluster);
            let plan = faults(3, Duration::from_secs(600), &s);
            let kinds = if cluster { 10 } else { 8 };
            let first: std::collections::HashSet<&str> =
                plan.iter().take(kinds).map(|st| st.fault.name()).collect();
            assert_eq!(first.len(), kinds, "{first:?}");
            for st in &plan {
                if let Fault::FreezeWorker { worker, .. } | Fault::CutWorker { worker, .. } =
                    st.fault
                {
                    assert!(s.proxied.contains(&worker));
                }
            }
        }
    }

    #[test]
    fn a_fault_filter_deals_only_those_kinds() {
        let mut s = shape(true);
        s.only = Some(vec!["leader_stepdown".into(), "kill9_node_leader".into()]);
        let plan = faults(5, Duration::from_secs(120), &s);
        assert!(!plan.is_empty());
        assert!(plan
            .iter()
            .all(|st| matches!(st.fault.name(), "leader_stepdown" | "kill9_node_leader")));
    }

    #[test]
    fn the_mix_has_every_kind_and_ids_are_subject_tokens() {
        let plan = jobs(1, Duration::from_secs(300), 1.0);
        assert!(plan.len() > 200, "{}", plan.len());
        for k in KINDS {
            assert!(plan.iter().any(|j| j.kind == k), "{k}");
        }
        assert!(plan.iter().any(|j| j.cancel.is_some()));
        for j in &plan {
            assert!(!j.id.contains('.') && !j.id.contains(' '));
        }
        assert!(plan.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
    }
}
