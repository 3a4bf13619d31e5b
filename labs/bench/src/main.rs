//! `leasehold-bench`: whole-system figures on fresh nats-servers, each
//! compared with a baseline measured in the same run (the machine is
//! noisy), written to `<out>/bench.json` (with `target` and `met` where a
//! target is given) and printed as a table. `--only` runs some parts.
//!
//! | part | what | baseline | target |
//! |---|---|---|---|
//! | `ceiling` | revision-conditioned KV updates/s (64 writers), one CAS round trip | | |
//! | `throughput` | echo jobs/s through 1, 2, 4 workers; KV writes, index writes, events and acks per job (core subscriptions); submit -> result latency, one job at a time | the ceiling, the CAS round trip | previous release -10% (reference machine) |
//! | `recovery` | kill -9 of the owner -> the job running again elsewhere (epoch bump), `leasehold setup` defaults (ack wait 30 s): (a) session 10 s, (b) + reaper probe, (c) session 2 s, (d) killed before indexing | the session timeout | (a) p95 <= 11 s, (b) <= 1 s, (c) <= 3 s |
//! | `handoff` | SIGTERM of the owner -> running elsewhere | | |
//! | `stop` | SIGSTOP past a 2 s session: re-offer, completion elsewhere; after SIGCONT, writes of the paused owner accepted after the new claim (KV history, events) | | re-offer p95 <= 3 s, 0 writes |
//! | `inflight` | 1,000 sleep jobs on one worker: `$KV` sessions+jobs writes/s in steady state, peak RSS, reclaims | | <= 1 write/s, RSS budget, 0 reclaims |
//! | `history` | reaper sweep, `leasehold list --status running`, worker start with `--worker-id`, with N finished records | the same with none | <= 1.2x |
//! | `scale` | reaper sweep, `leasehold list --status queued --limit 10`, worker start, a second reaper's start to its first sweep, the console's start to its jobs page counting them and that page's time to first byte, RSS of reaper, worker, console and server, with N active jobs (default 1,000,000: half queued in backoff, half waiting on a timer), on one node and on a three-node R3 cluster | the same with 1,000 | <= 1.5x; sweep <= 100 ms |
//! | `search` | first page of history searches (status + tenant + time range, kind, id prefix) over N history entries (default 1,000,000), 50 runs each | | p95 <= 100 ms |
//! | `plateau` | storage under a mixed load for many 3 s retentions | the middle third of the load | last third <= 1.2x |
//! | `research` | sections/s, flush latency, coalescing, rework per crash | the seed's rework | <= 1 call repeated |
//! | `research-cost` | what one research job reads with 0..1,000 other jobs' events present | no background | <= 1.2x |
//! | `queue-full` | refused submission into a full work queue, CLI exit 75, nothing accepted lost | an accepted submission | 10077, 75, 0 lost |
//! | `busy` | kill -9 on a fleet at 92% of its slots: each bystander running again; a poison job's submit -> dead | the session timeout | p95 <= 11 s; <= (max stale reclaims + 1) x 11 s |
//! | `reoffers` | false re-offers with ~100 long jobs in flight: `leasehold-soak` rolling (3 nodes) and nats-restart (down 2-3 session timeouts) runs | | 0 |
//! | `steps` | an empty durable step of the SDK, p50/p99; resume: attempt start -> first new step with 10 / 1,000 / 10,000 recorded steps | one raw JetStream publish ack | step p50 <= 2x; resume linear, <= 100 ms at 1,000 |
//! | `fairness` | tenant B's 20 jobs queued behind tenant A's 2,000 (equal weights, 4 workers): B's wait from submission to claim p50/p95 | B alone at half the fleet; the same submissions without tenants (first come, first served) | p95 <= 2x alone |
//! | `remote` | a remote kind's step through the Python and the TypeScript SDK, p50/p99; remote echo jobs/s, 4 workers, each SDK | the same empty step of a Rust kind and a raw HTTP round trip to the same service; the Rust echo | p50 <= raw + 2 ms; >= 50% |
//! | `real-model` | research job (2 experts x 2 sections, in parallel) wall time, model calls, sections skipped, retries and streams the server cut (it serves one request at a time: the worker learns it) on SmolLM2-135M (llama-cpp-python); the server's tokens/s in the same run; only where `make test-model`'s virtualenv is installed, else skipped | the same job on the simulator with instant answers | |
//! | `charts` | `GET /fleet/charts` and `GET /v1/fleet/charts` p50/p95, and the charts' sampler's store requests per sample, with 100,000 active jobs in the index | the same console with 1,000 | ~1x (O(window)) |
//! | `children` | one parent spawning 1,000 echo children and joining them (submitted -> resumed with every outcome); wake latency after the last child's end, 100 parents of 3, p50/p95; the parent's claims | 1,000 independent echo jobs from a client, same worker | <= 1.5x; p95 <= 50 ms; 2 claims (one wake) |
//! | `timers` | durable timers on 1 worker with 16 slots: slots held, `$KV` writes/s and process RSS with 10,000 jobs asleep for an hour; wake latency after a 2 s sleep's due time, p50/p95 | the same with 1,000 asleep | 0 slots, flat (<= +1 write/s, <= 1.5x RSS); wake p95 <= 50 ms |
//! | `regression` | echo throughput (4 workers) and submit -> result latency, alternating rounds | a previous release's worker (`--baseline-bins`, `make bench-baseline`) | >= 0.9x, <= 1.1x |

mod busy;
mod charts;
mod children;
mod common;
mod console;
mod fairness;
mod flow;
mod history;
mod inflight;
mod plateau;
mod queue;
mod real_model;
mod recovery;
mod remote;
mod reoffers;
mod research;
mod scale;
mod search;
mod steps;
mod throughput;
mod timers;
mod waterfall;

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use common::Report;
use serde_json::{json, Value};

pub const PARTS: &[&str] = &[
    "ceiling",
    "throughput",
    "recovery",
    "handoff",
    "stop",
    "inflight",
    "history",
    "scale",
    "search",
    "plateau",
    "research",
    "research-cost",
    "queue-full",
    "busy",
    "regression",
    "reoffers",
    "steps",
    "waterfall",
    "remote",
    "flow",
    "flow-research",
    "fairness",
    "real-model",
    "console",
    "console-pages",
    "console-live",
    "console-clients",
    "charts",
    "timers",
    "children",
];

#[derive(Parser, Debug)]
#[command(
    name = "leasehold-bench",
    about = "leasehold benchmarks: recovery, liveness cost, history, storage, throughput, research, a full queue; each against a baseline of the same run"
)]
pub struct Args {
    /// Output directory for bench.json.
    #[arg(long, default_value = "bench-results")]
    pub out: PathBuf,
    /// Run only these parts (comma-separated): ceiling, throughput,
    /// recovery, handoff, stop, inflight, timers, children, history, search, plateau, research,
    /// research-cost, queue-full, busy, reoffers, steps, flow, flow-research, regression,
    /// real-model, waterfall, console (or one of its parts: console-pages,
    /// console-live, console-clients), charts. All by default (regression only with --baseline-bins,
    /// real-model only where the model's virtualenv is installed: `make
    /// model-venv`).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Echo jobs per throughput run.
    #[arg(long, default_value_t = 2000)]
    pub jobs: usize,
    /// Echo jobs, one at a time, for the submit -> result latency.
    #[arg(long, default_value_t = 300)]
    pub latency_jobs: usize,
    /// Repetitions of each recovery case and of the SIGTERM handoff.
    #[arg(long, default_value_t = 8)]
    pub reps: usize,
    /// Repetitions of the busy fleet's kill -9 (4 bystanders each) and of
    /// the poison job.
    #[arg(long, default_value_t = 3)]
    pub busy_reps: usize,
    /// Recovery cases to run (a, b, c, d).
    #[arg(long, value_delimiter = ',', default_value = "a,b,c,d")]
    pub cases: Vec<String>,
    /// SIGSTOP repetitions.
    #[arg(long, default_value_t = 3)]
    pub stop_reps: usize,
    /// In-flight sleep jobs on one worker.
    #[arg(long, default_value_t = 1000)]
    pub inflight: usize,
    /// Seconds of steady state in which liveness writes are counted.
    #[arg(long, default_value_t = 20)]
    pub inflight_window: u64,
    /// Jobs asleep at once in the timers part (a tenth of them first).
    #[arg(long, default_value_t = 10_000)]
    pub timers_jobs: usize,
    /// Jobs whose wake latency the timers part measures (and, up to 100,
    /// the parents of the children part).
    #[arg(long, default_value_t = 200)]
    pub timers_wakes: usize,
    /// Children of the children part's fan-out (and independent echo jobs
    /// it is compared with).
    #[arg(long, default_value_t = 1000)]
    pub children: usize,
    /// Finished records seeded for the history part.
    #[arg(long, default_value_t = 100_000)]
    pub history_records: usize,
    /// Samples of each history figure (medians are compared; sweeps: at
    /// least 10).
    #[arg(long, default_value_t = 9)]
    pub history_samples: usize,
    /// Active jobs seeded for the scale part (half queued in backoff, half
    /// waiting on a timer), against 1,000 on the other side.
    #[arg(long, default_value_t = 1_000_000)]
    pub scale_active: usize,
    /// Samples of each scale figure (medians are compared; sweeps: at
    /// least 10).
    #[arg(long, default_value_t = 5)]
    pub scale_samples: usize,
    /// Seconds the scale seeding may take; beyond (projected from the first
    /// 20,000), 200,000 active jobs are seeded instead and the output says
    /// so.
    #[arg(long, default_value_t = 300)]
    pub scale_seed_budget: u64,
    /// Active jobs on a three-node R3 cluster in the scale part, measured
    /// against the same cluster with 1,000 (0: no cluster side).
    #[arg(long, default_value_t = 1_000_000)]
    pub scale_cluster_active: usize,
    /// History entries seeded for the search part.
    #[arg(long, default_value_t = 1_000_000)]
    pub search_entries: usize,
    /// Runs of each search measured.
    #[arg(long, default_value_t = 50)]
    pub search_runs: usize,
    /// Seconds the history seeding may take; beyond (projected from the
    /// first 20,000), 200,000 records are seeded instead and the output
    /// says so.
    #[arg(long, default_value_t = 300)]
    pub history_seed_budget: u64,
    /// Seconds of mixed load in the storage plateau (past the 60 s that
    /// removal markers stay, so the last third shows the steady state).
    #[arg(long, default_value_t = 150)]
    pub plateau_secs: u64,
    /// Jobs submitted per second in the storage plateau.
    #[arg(long, default_value_t = 100)]
    pub plateau_rate: u64,
    /// Seconds between storage samples.
    #[arg(long, default_value_t = 3)]
    pub plateau_sample: u64,
    /// Research jobs in the sections-per-second batch.
    #[arg(long, default_value_t = 8)]
    pub research_jobs: usize,
    /// Crashes of each kind (abort at a checkpoint, kill -9) for rework.
    #[arg(long, default_value_t = 4)]
    pub crash_reps: usize,
    /// kill -9 crashes against a paced model (`--paced-token-ms` per
    /// streamed token), where model calls take real time.
    #[arg(long, default_value_t = 3)]
    pub paced_reps: usize,
    /// The paced model's delay per streamed token (the simulator's default).
    #[arg(long, default_value_t = 2)]
    pub paced_token_ms: u64,
    /// Background research jobs (finished, with their events) beside the
    /// measured one, in increasing order.
    #[arg(long, value_delimiter = ',', default_value = "0,1,100,1000")]
    pub background: Vec<usize>,
    /// `work_max_msgs` of the full-queue part.
    #[arg(long, default_value_t = 1000)]
    pub queue_max: usize,
    /// Refused submissions timed in the full-queue part.
    #[arg(long, default_value_t = 20)]
    pub queue_probes: usize,
    /// A previous release's binaries (a directory holding its
    /// leasehold-worker): the `regression` part compares this build's echo
    /// throughput and latency with it. `make bench-baseline` builds one.
    #[arg(long, env = "BENCH_BASELINE_BINS")]
    pub baseline_bins: Option<PathBuf>,
    /// Seconds of faults in each of the reoffers part's two soak runs.
    #[arg(long, default_value_t = 90)]
    pub reoffer_secs: u64,
    /// Empty durable steps (and raw publishes) timed in the steps part.
    #[arg(long, default_value_t = 1000)]
    pub step_samples: usize,
    /// Recorded steps of the jobs the steps part resumes.
    #[arg(long, value_delimiter = ',', default_value = "10,1000,10000")]
    pub resume_steps: Vec<usize>,
    /// Alternating rounds (baseline, this build) of the regression part.
    #[arg(long, default_value_t = 3)]
    pub baseline_rounds: usize,
    /// Research jobs on each model (real, simulated) in the real-model part.
    #[arg(long, default_value_t = 2)]
    pub real_model_jobs: usize,
    /// Active jobs beside the console's pages in the `console` part.
    #[arg(long, default_value_t = 10_000)]
    pub console_active: usize,
    /// Finished jobs (records and terminal events) beside them.
    #[arg(long, default_value_t = 1_000_000)]
    pub console_finished: usize,
    /// Requests timed per page and fleet.
    #[arg(long, default_value_t = 40)]
    pub console_samples: usize,
    /// SSE clients on one job.
    #[arg(long, default_value_t = 100)]
    pub console_clients: usize,
    /// Echo jobs per throughput round beside the SSE clients.
    #[arg(long, default_value_t = 2000)]
    pub console_jobs: usize,
    /// Research jobs whose section checkpoints are timed to an SSE client.
    #[arg(long, default_value_t = 3)]
    pub console_live_jobs: usize,
}

impl Args {
    fn runs(&self, part: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|p| p == part)
    }

    /// One of the console part's three (`console-pages`, `console-live`,
    /// `console-clients`): run by `console` or by its own name.
    fn runs_console(&self, part: &str) -> bool {
        self.runs("console") || self.only.iter().any(|p| p == part)
    }
}

/// Runs one part; a failing part is reported (and makes the exit code 1)
/// without losing the others' figures.
async fn part<F>(rep: &mut Report, failed: &mut Vec<String>, name: &str, f: F) -> Option<Value>
where
    F: std::future::Future<Output = anyhow::Result<Value>>,
{
    eprintln!("== {name}");
    let t0 = std::time::Instant::now();
    match f.await {
        Ok(v) => {
            eprintln!("== {name}: done in {:.0} s", t0.elapsed().as_secs_f64());
            Some(v)
        }
        Err(e) => {
            eprintln!("== {name}: FAILED: {e:#}");
            rep.json
                .insert(format!("{name}_error"), json!(format!("{e:#}")));
            rep.row(format!("{name}: FAILED"), "see stderr");
            failed.push(name.to_string());
            None
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    for p in &a.only {
        anyhow::ensure!(
            PARTS.contains(&p.as_str()),
            "unknown part {p:?}; parts: {}",
            PARTS.join(", ")
        );
    }
    std::fs::create_dir_all(&a.out)?;
    let mut r = Report::default();
    let mut failed = Vec::new();

    let mut ceiling = None;
    if a.runs("ceiling") || a.runs("throughput") {
        ceiling = part(&mut r, &mut failed, "ceiling", throughput::cas_ceiling()).await;
        if let Some(c) = &ceiling {
            r.json.insert("ceiling".into(), c.clone());
        }
    }
    if a.runs("throughput") {
        let mut tp = Vec::new();
        for workers in [1usize, 2, 4] {
            if let Some(v) = part(
                &mut r,
                &mut failed,
                &format!("throughput-{workers}"),
                throughput::throughput(workers, a.jobs),
            )
            .await
            {
                tp.push(v);
            }
        }
        let lat = part(
            &mut r,
            &mut failed,
            "latency",
            throughput::latency(a.latency_jobs),
        )
        .await;
        throughput::rows(&mut r, ceiling.as_ref(), &tp, lat.as_ref());
        r.json.insert("throughput".into(), Value::Array(tp));
        if let Some(l) = lat {
            r.json.insert("latency".into(), l);
        }
    } else if let Some(c) = &ceiling {
        throughput::rows(&mut r, Some(c), &[], None);
    }

    if a.runs("recovery") {
        let mut all = serde_json::Map::new();
        for c in recovery::CASES {
            if !a.cases.iter().any(|k| k == c.key) {
                continue;
            }
            if let Some(v) = part(
                &mut r,
                &mut failed,
                &format!("recovery-{}", c.key),
                recovery::kill9(c, a.reps),
            )
            .await
            {
                recovery::rows(&mut r, c.key, &v);
                all.insert(c.key.into(), v);
            }
        }
        r.json
            .insert("recovery_after_kill9".into(), Value::Object(all));
    }
    if a.runs("busy") {
        if let Some(v) = part(
            &mut r,
            &mut failed,
            "busy-bystanders",
            busy::bystanders(a.busy_reps),
        )
        .await
        {
            let s = &v["kill_to_running_again_ms"];
            r.cmp(
                "busy fleet (92% of slots), kill -9: each bystander running again p50/p95 ms",
                format!("{}/{} (n={})", s["p50"], s["p95"], s["n"]),
                format!("{} other jobs disturbed", v["other_jobs_disturbed"]),
                "p95 <= session timeout + 1 s (11000 ms), none disturbed",
                v["met"].as_bool(),
            );
            r.json.insert("busy_bystanders".into(), v);
        }
        if let Some(v) = part(
            &mut r,
            &mut failed,
            "busy-poison",
            busy::poison(a.busy_reps),
        )
        .await
        {
            let s = &v["submit_to_dead_ms"];
            r.cmp(
                "poison job: submit -> dead p50/max ms",
                format!("{}/{} (n={})", s["p50"], s["max"], s["n"]),
                "--max-stale-reclaims 3, session 10 s",
                "<= (3 + 1) x (10 s + 1 s) = 44000 ms",
                v["met"].as_bool(),
            );
            r.json.insert("busy_poison".into(), v);
        }
    }
    if a.runs("handoff") {
        if let Some(v) = part(&mut r, &mut failed, "handoff", recovery::handoff(a.reps)).await {
            let s = &v["sigterm_to_running_elsewhere_ms"];
            r.row(
                "handoff after SIGTERM p50/p95 ms",
                format!("{}/{}", s["p50"], s["p95"]),
            );
            r.json.insert("handoff_after_sigterm".into(), v);
        }
    }
    if a.runs("stop") {
        if let Some(v) = part(&mut r, &mut failed, "stop", recovery::sigstop(a.stop_reps)).await {
            let s = &v["stop_to_reoffer_ms"];
            r.cmp(
                "SIGSTOP (session 2 s): stop -> re-offer p50/p95 ms",
                format!("{}/{}", s["p50"], s["p95"]),
                "session 2s",
                "p95 <= 3000 ms",
                v["reoffer_met"].as_bool(),
            );
            let c = &v["stop_to_completed_elsewhere_ms"];
            r.cmp(
                "SIGSTOP: stop -> completed elsewhere p50/p95 ms",
                format!("{}/{}", c["p50"], c["p95"]),
                format!("job {} ms", v["job_ms"]),
                "",
                None,
            );
            r.cmp(
                "SIGSTOP: paused owner's record writes + fenced events after new claim",
                v["stale_writes_accepted"].to_string(),
                "",
                "0",
                v["stale_met"].as_bool(),
            );
            r.cmp(
                "SIGSTOP: old-epoch events after new claim, incl. unfenced notices",
                v["old_epoch_events_after_new_claim_incl_notices"].to_string(),
                "",
                "0",
                v["strict_met"].as_bool(),
            );
            r.json.insert("sigstop".into(), v);
        }
    }
    if a.runs("inflight") {
        if let Some(v) = part(
            &mut r,
            &mut failed,
            "inflight",
            inflight::inflight(a.inflight, Duration::from_secs(a.inflight_window)),
        )
        .await
        {
            inflight::rows(&mut r, &v);
            r.json.insert("inflight".into(), v);
        }
    }
    if a.runs("timers") {
        if let Some(v) = part(
            &mut r,
            &mut failed,
            "timers",
            timers::timers(
                a.timers_jobs,
                a.timers_wakes,
                Duration::from_secs(a.inflight_window.min(10)),
            ),
        )
        .await
        {
            timers::rows(&mut r, &v);
            r.json.insert("timers".into(), v);
        }
    }
    if a.runs("children") {
        if let Some(v) = part(
            &mut r,
            &mut failed,
            "children",
            children::children(a.children, a.timers_wakes.min(100)),
        )
        .await
        {
            children::rows(&mut r, &v);
            r.json.insert("children".into(), v);
        }
    }
    if a.runs("history") {
        let o = history::Opts {
            records: a.history_records,
            samples: a.history_samples,
            seed_budget: Duration::from_secs(a.history_seed_budget),
        };
        if let Some(v) = part(&mut r, &mut failed, "history", history::history(&o)).await {
            history::rows(&mut r, &v);
            r.json.insert("history".into(), v);
        }
    }
    if a.runs("scale") {
        let o = scale::Opts {
            active: a.scale_active,
            samples: a.scale_samples,
            seed_budget: Duration::from_secs(a.scale_seed_budget),
            cluster_active: a.scale_cluster_active,
        };
        if let Some(v) = part(&mut r, &mut failed, "scale", scale::scale(&o)).await {
            scale::rows(&mut r, &v);
            r.json.insert("scale".into(), v);
        }
    }
    if a.runs("search") {
        let o = search::Opts {
            entries: a.search_entries,
            runs: a.search_runs,
        };
        if let Some(v) = part(&mut r, &mut failed, "search", search::search(&o)).await {
            search::rows(&mut r, &v);
            r.json.insert("search".into(), v);
        }
    }
    if a.runs("plateau") {
        let o = plateau::Opts {
            secs: a.plateau_secs,
            rate: a.plateau_rate,
            sample: Duration::from_secs(a.plateau_sample),
        };
        if let Some(v) = part(&mut r, &mut failed, "plateau", plateau::plateau(&o)).await {
            plateau::rows(&mut r, &v);
            r.json.insert("storage_plateau".into(), v);
        }
    }
    if a.runs("research") {
        if let Some(v) = part(&mut r, &mut failed, "research", research::research(&a)).await {
            for (k, x) in research::research_rows(&v) {
                r.row(k, x);
            }
            r.json.insert("research".into(), v);
        }
    }
    if a.runs("research-cost") {
        if let Some(v) = part(
            &mut r,
            &mut failed,
            "research-cost",
            research::research_cost(&a.background),
        )
        .await
        {
            eprintln!(
                "research-cost method: {}",
                v["method"].as_str().unwrap_or("")
            );
            research::cost_rows(&mut r, &v);
            r.json.insert("research_read_cost".into(), v);
        }
    }
    if a.runs("flow") {
        if let Some(v) = part(&mut r, &mut failed, "flow", flow::flow()).await {
            flow::rows(&mut r, &v);
            r.json.insert("flow".into(), v);
        }
    }
    if a.runs("flow-research") {
        if let Some(v) = part(&mut r, &mut failed, "flow-research", flow::research()).await {
            flow::research_rows(&mut r, &v);
            r.json.insert("flow_research".into(), v);
        }
    }
    if a.runs("fairness") {
        if let Some(v) = part(&mut r, &mut failed, "fairness", fairness::fairness()).await {
            fairness::rows(&mut r, &v);
            r.json.insert("fairness".into(), v);
        }
    }
    if a.runs("steps") {
        if let Some(v) = part(
            &mut r,
            &mut failed,
            "steps",
            steps::steps(a.step_samples, &a.resume_steps),
        )
        .await
        {
            steps::rows(&mut r, &v);
            r.json.insert("steps".into(), v);
        }
    }
    if a.runs("waterfall") {
        if let Some(v) = part(&mut r, &mut failed, "waterfall", waterfall::waterfall(50)).await {
            waterfall::rows(&mut r, &v);
            r.json.insert("waterfall".into(), v);
        }
    }
    if a.runs("remote") {
        let jobs = a.jobs.min(1000);
        if let Some(v) = part(
            &mut r,
            &mut failed,
            "remote",
            remote::remote(a.step_samples.min(500), jobs),
        )
        .await
        {
            remote::rows(&mut r, &v);
            r.json.insert("remote".into(), v);
        }
    }
    if a.runs("queue-full") {
        if let Some(v) = part(
            &mut r,
            &mut failed,
            "queue-full",
            queue::queue_full(a.queue_max, a.queue_probes),
        )
        .await
        {
            queue::rows(&mut r, &v);
            r.json.insert("queue_full".into(), v);
        }
    }

    if a.runs("reoffers") {
        if let Some(v) = part(
            &mut r,
            &mut failed,
            "reoffers",
            reoffers::false_reoffers(a.reoffer_secs, 20261201, &a.out),
        )
        .await
        {
            reoffers::rows(&mut r, &v);
            r.json.insert("false_reoffers".into(), v);
        }
    }
    if a.runs("real-model") {
        match real_model::venv() {
            Ok(venv) => {
                if let Some(v) = part(
                    &mut r,
                    &mut failed,
                    "real-model",
                    real_model::real_model(&venv, a.real_model_jobs),
                )
                .await
                {
                    real_model::rows(&mut r, &v);
                    r.json.insert("real_model".into(), v);
                }
            }
            Err(why) => {
                eprintln!("== real-model: skipped: {why}");
                r.row(
                    "real-model: skipped",
                    "no model virtualenv (make model-venv)",
                );
                r.json
                    .insert("real_model".into(), json!({"skipped": true, "why": why}));
            }
        }
    }
    let asked = a.only.iter().any(|p| p == "regression");
    match (&a.baseline_bins, a.runs("regression")) {
        (Some(dir), true) => {
            if let Some(v) = part(
                &mut r,
                &mut failed,
                "regression",
                throughput::against_baseline(dir, a.jobs, a.latency_jobs, a.baseline_rounds),
            )
            .await
            {
                throughput::baseline_rows(&mut r, &v);
                r.json.insert("regression".into(), v);
            }
        }
        (None, true) if asked => {
            anyhow::bail!(
                "--only regression needs --baseline-bins DIR (make bench-baseline builds one)"
            )
        }
        (None, true) => r.row(
            "regression: not run",
            "no --baseline-bins (make bench-baseline builds one)",
        ),
        _ => {}
    }

    if a.runs_console("console-pages")
        || a.runs_console("console-live")
        || a.runs_console("console-clients")
    {
        let mut all = serde_json::Map::new();
        if !a.runs_console("console-pages") {
        } else if let Some(v) = part(
            &mut r,
            &mut failed,
            "console-pages",
            console::pages(a.console_active, a.console_finished, a.console_samples),
        )
        .await
        {
            for (k, label, met) in [
                ("jobs_page_ttfb_ms", "jobs page", "jobs_page_met"),
                ("timeline_ttfb_ms", "a job's timeline", "timeline_met"),
            ] {
                r.cmp(
                    format!(
                        "console: {label} TTFB p50/p95 ms ({} active, {} finished)",
                        a.console_active, a.console_finished
                    ),
                    format!("{}/{}", v["busy"][k]["p50"], v["busy"][k]["p95"]),
                    format!(
                        "empty {}/{}; one page's worth {}/{}",
                        v["empty"][k]["p50"],
                        v["empty"][k]["p95"],
                        v["page"][k]["p50"],
                        v["page"][k]["p95"]
                    ),
                    "<= 1.2x, p95 <= 100 ms",
                    v[met].as_bool(),
                );
            }
            all.insert("pages".into(), v);
        }
        if !a.runs_console("console-live") {
        } else if let Some(v) = part(
            &mut r,
            &mut failed,
            "console-live",
            console::live_latency(a.console_live_jobs),
        )
        .await
        {
            let l = &v["section_to_sse_ms"];
            r.cmp(
                "console: section checkpoint -> SSE client p50/p95 ms",
                format!("{}/{} (n={})", l["p50"], l["p95"], l["n"]),
                "",
                "p95 <= 500 ms",
                v["met"].as_bool(),
            );
            all.insert("live".into(), v);
        }
        if !a.runs_console("console-clients") {
        } else if let Some(v) = part(
            &mut r,
            &mut failed,
            "console-clients",
            console::many_clients(a.console_clients, a.console_jobs),
        )
        .await
        {
            r.cmp(
                format!(
                    "console: echo jobs/s with {} SSE clients on one job",
                    a.console_clients
                ),
                format!("{:.0}", common::f64_of(&v["jobs_per_s_with_clients"])),
                format!(
                    "console idle {:.0}",
                    common::f64_of(&v["jobs_per_s_console_idle"])
                ),
                ">= 0.95x",
                v["met"].as_bool(),
            );
            r.row(
                format!(
                    "console: RSS MiB idle / with {} clients, CPU %",
                    a.console_clients
                ),
                format!(
                    "{:.0}/{:.0}, {:.0}%",
                    common::f64_of(&v["console_rss_mib_idle"]),
                    common::f64_of(&v["console_rss_mib_with_clients"]),
                    common::f64_of(&v["console_cpu_percent_with_clients"])
                ),
            );
            all.insert("clients".into(), v);
        }
        r.json.insert("console".into(), Value::Object(all));
    }

    if a.runs("charts") {
        if let Some(v) = part(
            &mut r,
            &mut failed,
            "charts",
            charts::run(1_000, 100_000, 30),
        )
        .await
        {
            for (k, label) in [
                ("fleet_charts_ms", "/fleet/charts"),
                ("v1_fleet_charts_ms", "/v1/fleet/charts"),
            ] {
                r.cmp(
                    format!("charts: {label} p50/p95 ms (100,000 active jobs)"),
                    format!("{}/{}", v["large"][k]["p50"], v["large"][k]["p95"]),
                    format!(
                        "1,000 active {}/{}",
                        v["small"][k]["p50"], v["small"][k]["p95"]
                    ),
                    "~1x (O(window))",
                    v["met"].as_bool(),
                );
            }
            r.json.insert("charts".into(), v);
        }
    }

    r.json.insert(
        "machine".into(),
        json!({
            "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "loadavg": std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim(),
        }),
    );
    let path = a.out.join("bench.json");
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&Value::Object(r.json.clone()))?,
    )?;
    r.print();
    println!("results: {}", path.display());
    if !failed.is_empty() {
        anyhow::bail!("parts failed: {}", failed.join(", "));
    }
    Ok(())
}
