//! The research workload end to end: a real `nats-server`, the real
//! `leasehold-sim` (model, search, pages, effects sink) and real worker
//! processes, killed with `abort()` at exact points (`LH_RESEARCH_CRASH_AT`,
//! armed only while the job has no stale reclaims, so the reclaiming worker
//! runs through). Rework is counted at the simulator (`/stats`) and in the
//! job's events; a clean run of 2 experts x 2 sections makes 16 model calls:
//! outline 1, perspectives 1, 4 sections x (search, fetch, write) 12, final 2.

use std::collections::HashMap;
use std::time::Duration;

use leasehold::JobRecord;
use leasehold_harness::Proc;
use leasehold_proto::JobEvent;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use leasehold_testkit::{wait_log, Fleet};

/// Model calls of one clean run with 2 experts x 2 sections.
const CLEAN_CALLS: u64 = 16;

struct Lab {
    env: Fleet,
    sim: Proc,
    addr: String,
}

impl Lab {
    async fn new(sim_env: &[(&str, String)]) -> Lab {
        Self::on(Fleet::start().await, sim_env).await
    }

    async fn on(env: Fleet, sim_env: &[(&str, String)]) -> Lab {
        let mut e = vec![("LH_SIM_TOKEN_DELAY_MS", "0".to_string())];
        e.extend(sim_env.iter().map(|(k, v)| (*k, v.clone())));
        let sim = Proc::spawn("leasehold-sim", &["--listen", "127.0.0.1:0"], &e);
        wait_log(&sim, "listening on ", Duration::from_secs(10)).await;
        let out = sim.output();
        let addr = out
            .split("listening on ")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .expect("sim address")
            .trim_start_matches("http://")
            .to_string();
        Lab { env, sim, addr }
    }

    fn worker(&self, extra: &[(&'static str, &str)]) -> Proc {
        let mut env: Vec<(&'static str, String)> = vec![
            ("LH_KINDS", "research".into()),
            ("LH_MODEL_BASE_URL", format!("http://{}/v1", self.addr)),
            ("LH_SEARCH_URL", format!("http://{}", self.addr)),
            ("LH_PUBLISH_URL", format!("http://{}/effects", self.addr)),
            ("LH_FETCH_ALLOW", "127.0.0.1".into()),
            ("LH_RESEARCH_RETRY_BASE", "20ms".into()),
            ("LH_RESEARCH_RETRY_CAP", "200ms".into()),
        ];
        env.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
        self.env.worker_proc(&[], &env)
    }

    async fn get(&self, path: &str) -> Value {
        let mut s = tokio::net::TcpStream::connect(&self.addr).await.unwrap();
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {}\r\n\r\n", self.addr).as_bytes())
            .await
            .unwrap();
        let mut buf = String::new();
        s.read_to_string(&mut buf).await.unwrap();
        let body = buf.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        serde_json::from_str(body).unwrap_or_else(|e| panic!("GET {path}: {e}: {buf}"))
    }

    async fn chat_requests(&self) -> u64 {
        self.get("/stats").await["chat_requests"].as_u64().unwrap()
    }

    async fn deliveries(&self) -> usize {
        self.get("/effects").await.as_array().map_or(0, Vec::len)
    }

    async fn submit(&self, id: &str) {
        self.env
            .submit(
                "research",
                json!({"input": {"topic": "lease-based ownership in distributed systems", "experts": 2, "sections": 2}}),
                id,
            )
            .await;
    }

    async fn completed(&self, id: &str) -> JobRecord {
        let r = self
            .env
            .wait_for(id, Duration::from_secs(40), |r| {
                matches!(
                    r.status.as_str(),
                    "completed" | "failed" | "parked" | "dead"
                )
            })
            .await;
        assert_eq!(r.status, "completed", "record: {r:?}");
        r
    }

    async fn artifact(&self, rec: &JobRecord) -> String {
        let res = rec.result.clone().unwrap();
        let store = self
            .env
            .conn
            .js
            .get_object_store(self.env.conn.layout.artifacts_bucket())
            .await
            .unwrap();
        let mut obj = store.get(res.artifact.as_deref().unwrap()).await.unwrap();
        let mut text = String::new();
        obj.read_to_string(&mut text).await.unwrap();
        text
    }
}

fn sha256_hex(s: &str) -> String {
    leasehold_testkit::doors::report_sha256_hex(s)
}

/// Waits until a process has exited (a crash point aborted it).
pub(crate) async fn exited(p: &mut Proc, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    while p.alive() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "worker did not crash:\n{}",
            p.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Reap it, so dropping the handle signals nothing.
    let _ = p.wait_timeout(Duration::ZERO);
}

fn payload(ev: &JobEvent) -> Value {
    ev.data_map().get("payload").cloned().unwrap_or(Value::Null)
}

/// How often each expert section was checkpointed, across all epochs.
fn section_counts(events: &[JobEvent]) -> HashMap<(u64, u64), usize> {
    let mut m = HashMap::new();
    for ev in events.iter().filter(|e| e.r#type == "section") {
        let p = payload(ev);
        *m.entry((p["expert"].as_u64().unwrap(), p["index"].as_u64().unwrap()))
            .or_default() += 1;
    }
    m
}

fn phase_count(events: &[JobEvent], phase: &str) -> usize {
    events
        .iter()
        .filter(|e| e.r#type == "phase" && e.data_map()["phase"] == phase)
        .count()
}

/// A crash run: worker A dies at `point`, worker B (same env: the point is
/// disarmed by the stale reclaim) finishes. Returns the record, the events
/// and the model calls made.
async fn crash_run(
    lab: &Lab,
    id: &str,
    point: &str,
    between: impl std::future::Future<Output = ()>,
) -> (JobRecord, Vec<JobEvent>, u64) {
    let env = [
        ("LH_RESEARCH_CRASH_AT", point),
        ("LH_RESEARCH_EXPERT_CONCURRENCY", "1"),
    ];
    let mut a = lab.worker(&env);
    lab.submit(id).await;
    exited(&mut a, Duration::from_secs(30)).await;
    assert!(
        a.output().contains("LH_RESEARCH_CRASH_AT reached"),
        "A did not stop at {point}:\n{}",
        a.output()
    );
    between.await;
    let _b = lab.worker(&env);
    let rec = lab.completed(id).await;
    assert_eq!(rec.stale_reclaims, 1);
    let events = lab.env.events_of(id).await;
    (rec, events, lab.chat_requests().await)
}

/// Common assertions: one delivery, the artifact's digest, each section once.
async fn assert_clean_finish(lab: &Lab, rec: &JobRecord, events: &[JobEvent]) {
    assert_eq!(lab.deliveries().await, 1, "exactly one delivery");
    let doc = lab.artifact(rec).await;
    assert_eq!(
        rec.result.as_ref().unwrap().digest.as_deref(),
        Some(sha256_hex(&doc).as_str())
    );
    let counts = section_counts(events);
    assert_eq!(counts.len(), 4);
    assert!(
        counts.values().all(|n| *n == 1),
        "a section was redone: {counts:?}"
    );
    assert_eq!(phase_count(events, "final"), 2, "final sections redone");
}

#[tokio::test]
async fn research_completes_end_to_end() {
    let lab = Lab::new(&[]).await;
    let _w = lab.worker(&[]);
    lab.submit("r-e2e").await;
    let rec = lab.completed("r-e2e").await;
    let res = rec.result.clone().unwrap();
    assert_eq!(res.artifact.as_deref(), Some("r-e2e/report.md"));
    assert!(!res.partial);
    let doc = lab.artifact(&rec).await;
    assert!(doc.contains("## Appendix A: Sources") && doc.contains("## Appendix B: Recovery"));
    assert!(doc.contains("/page/"), "sources cited:\n{doc}");
    if std::env::var("LH_PRINT_REPORT").is_ok() {
        eprintln!("{doc}");
    }
    let events = lab.env.events_of("r-e2e").await;
    assert_clean_finish(&lab, &rec, &events).await;
    assert_eq!(lab.chat_requests().await, CLEAN_CALLS);
    let v = rec.versions.clone().unwrap();
    assert_eq!(
        (v.workflow.as_str(), v.model.as_str()),
        ("research/1", "sim-1")
    );
    let p = rec.progress.clone().unwrap();
    assert_eq!((p.sections_done, p.sections_total, p.skipped), (6, 6, 0));
    // The journal recorded every model response and tool result.
    assert!(events.iter().filter(|e| e.r#type == "journal").count() >= 4 * 6);
    let _ = &lab.sim;
}

#[tokio::test]
async fn research_kill_after_phase_checkpoint() {
    let lab = Lab::new(&[]).await;
    let (rec, events, calls) = crash_run(&lab, "r-phase", "after_phase:outline", async {}).await;
    assert_eq!(calls, CLEAN_CALLS, "no model call repeated");
    assert_eq!(phase_count(&events, "outline"), 1, "outline reused");
    assert_clean_finish(&lab, &rec, &events).await;
}

#[tokio::test]
async fn research_kill_mid_expert_after_k_sections() {
    let lab = Lab::new(&[]).await;
    let (rec, events, calls) = crash_run(&lab, "r-mid-expert", "after_section:1", async {}).await;
    assert_eq!(calls, CLEAN_CALLS, "no model call repeated");
    assert_clean_finish(&lab, &rec, &events).await;
    // The partial expert restarted at its second section with its rolling summary.
    let first_of_b = events
        .iter()
        .filter(|e| e.r#type == "section" && e.epoch == 2)
        .map(payload)
        .next()
        .unwrap();
    assert_eq!(
        (first_of_b["expert"].as_u64(), first_of_b["index"].as_u64()),
        (Some(0), Some(1))
    );
    assert!(first_of_b["summary"].as_str().unwrap().lines().count() == 2);
}

#[tokio::test]
async fn research_kill_mid_section_after_recorded_tool_result() {
    let lab = Lab::new(&[]).await;
    let (rec, events, calls) =
        crash_run(&lab, "r-mid-section", "after_tool_result:1", async {}).await;
    // The journal held the search proposal and its result: neither the model
    // call nor the search is repeated.
    assert_eq!(calls, CLEAN_CALLS, "no model call repeated");
    // No tool step ran twice: the recorded result was reused, not re-fetched.
    let mut started: HashMap<String, usize> = HashMap::new();
    for e in events.iter().filter(|e| e.r#type == "tool") {
        let d = e.data_map();
        if d["kind"] == "started" {
            *started
                .entry(d["step_id"].as_str().unwrap().to_string())
                .or_default() += 1;
        }
    }
    assert!(!started.is_empty());
    assert!(
        started.values().all(|n| *n == 1),
        "a tool step ran twice: {started:?}"
    );
    assert_clean_finish(&lab, &rec, &events).await;
}

#[tokio::test]
async fn research_kill_mid_final_document() {
    let lab = Lab::new(&[]).await;
    let (rec, events, calls) = crash_run(&lab, "r-mid-final", "mid_final:1", async {}).await;
    assert_eq!(calls, CLEAN_CALLS, "no model call repeated");
    assert_clean_finish(&lab, &rec, &events).await;
}

#[tokio::test]
async fn research_kill_between_artifact_and_completion() {
    let lab = Lab::new(&[]).await;
    let (rec, events, calls) = crash_run(&lab, "r-artifact", "after_artifact", async {}).await;
    assert_eq!(calls, CLEAN_CALLS);
    assert_clean_finish(&lab, &rec, &events).await;
    let lab2 = Lab::new(&[]).await;
    let (rec, events, calls) = crash_run(&lab2, "r-delivery", "after_delivery", async {}).await;
    assert_eq!(calls, CLEAN_CALLS);
    // Delivered before the crash, replayed from the ledger after it: one effect.
    assert_clean_finish(&lab2, &rec, &events).await;
    let delivered: Vec<_> = events
        .iter()
        .filter(|e| e.r#type == "phase" && e.data_map()["phase"] == "delivered")
        .map(|e| payload(e)["outcome"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(delivered, vec!["replayed".to_string()]);
}

#[tokio::test]
async fn research_corrupted_checkpoint_walks_back() {
    let lab = Lab::new(&[]).await;
    let id = "r-corrupt";
    let corrupt = async {
        // A truncated outline checkpoint of the current epoch lands after
        // the perspectives: nothing built on the outline may be trusted.
        let events = lab.env.events_of(id).await;
        let good = events
            .iter()
            .find(|e| e.r#type == "phase" && e.data_map()["phase"] == "outline")
            .unwrap();
        let fp = good.data_map()["v"].clone();
        let ev = leasehold_testkit::record::event(
            id,
            good.epoch,
            "phase",
            Some("corrupter"),
            json!({"v": fp, "phase": "outline", "payload": {"title": "t", "sections": [{"title": "only one"}]}}),
        );
        lab.env.events.publish(&ev, None).await.unwrap();
    };
    let (rec, events, calls) = crash_run(&lab, id, "after_phase:perspectives", corrupt).await;
    // Outline and perspectives run again: two model calls repeated.
    assert_eq!(calls, CLEAN_CALLS + 2);
    assert_eq!(phase_count(&events, "outline"), 3);
    assert_eq!(phase_count(&events, "perspectives"), 2);
    assert_clean_finish(&lab, &rec, &events).await;
    let doc = lab.artifact(&rec).await;
    assert!(doc.contains("walked back"), "{doc}");
}

#[tokio::test]
async fn research_version_change_does_not_reuse_checkpoints() {
    let lab = Lab::new(&[]).await;
    let id = "r-version";
    let mut a = lab.worker(&[
        ("LH_RESEARCH_CRASH_AT", "after_section:1"),
        ("LH_RESEARCH_EXPERT_CONCURRENCY", "1"),
    ]);
    lab.submit(id).await;
    exited(&mut a, Duration::from_secs(30)).await;
    let before = lab.chat_requests().await;
    assert_eq!(before, 5, "outline, perspectives, one section");
    let _b = lab.worker(&[("LH_MODEL", "sim-2")]);
    let rec = lab.completed(id).await;
    assert_eq!(rec.versions.as_ref().unwrap().model, "sim-2");
    // Everything again under the new model: nothing of sim-1 is trusted.
    assert_eq!(lab.chat_requests().await, before + CLEAN_CALLS);
    let events = lab.env.events_of(id).await;
    assert_eq!(section_counts(&events)[&(0, 0)], 2);
    assert_eq!(lab.deliveries().await, 1);
    let doc = lab.artifact(&rec).await;
    assert!(doc.contains("another version"), "{doc}");
}

#[tokio::test]
async fn research_fault_heavy_run_is_honest() {
    let lab = Lab::new(&[("LH_SIM_FAULT_RATE", "0.1".to_string())]).await;
    let _w = lab.worker(&[]);
    lab.submit("r-faults").await;
    let rec = lab.completed("r-faults").await;
    let events = lab.env.events_of("r-faults").await;
    let stats = lab.get("/stats").await;
    let faults = stats["faults_total"].as_u64().unwrap();
    let retries: Vec<Value> = events
        .iter()
        .filter(|e| e.r#type == "retry")
        .map(|e| serde_json::to_value(e).unwrap())
        .collect();
    // The faulted request numbers are fixed by the simulator's seed.
    assert!(faults > 0, "no faults served: {stats}");
    assert!(!retries.is_empty(), "faults served but no retry reports");
    for r in &retries {
        for k in [
            "scope",
            "reason",
            "eligible",
            "retained",
            "attempt",
            "budget_left",
        ] {
            assert!(r.get(k).is_some(), "retry report without {k}: {r}");
        }
    }
    assert_eq!(lab.deliveries().await, 1);
    let res = rec.result.clone().unwrap();
    let doc = lab.artifact(&rec).await;
    eprintln!(
        "fault-heavy run: {} chat requests, {faults} faults, {} retry reports, skipped {:?}, attempts {}",
        stats["chat_requests"],
        retries.len(),
        res.skipped_sections,
        rec.attempts
    );
    let skipped = section_counts(&events).len()
        - events
            .iter()
            .filter(|e| e.r#type == "section" && payload(e)["status"] == "completed")
            .count();
    assert_eq!(res.partial, skipped > 0);
    assert_eq!(res.skipped_sections.len(), skipped);
    if res.partial {
        assert!(doc.contains("Partial report"), "{doc}");
    }
    assert!(doc.contains("- Retries: "), "{doc}");
}

/// A lab whose simulated model streams slowly (3 ms a token), so a job is
/// mid-expert for a while; `tag` names its fault rules file (returned, for
/// the test to remove).
async fn paced_lab(tag: &str) -> (Lab, std::path::PathBuf) {
    let rules = std::env::temp_dir().join(format!("lh-slow-{tag}-{}.json", std::process::id()));
    std::fs::write(&rules, r#"{"rules": [{"kind": "slow", "delay_ms": 3}]}"#).unwrap();
    let lab = Lab::new(&[("LH_SIM_FAULTS", rules.display().to_string())]).await;
    (lab, rules)
}

/// Waits until job `id` checkpointed its first section.
async fn first_section(lab: &Lab, id: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !lab
        .env
        .events_of(id)
        .await
        .iter()
        .any(|e| e.r#type == "section")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no section checkpoint"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn research_stale_owner_checkpoints_are_refused() {
    // Paced tokens so the job is still mid-expert when its worker freezes.
    let (lab, rules) = paced_lab("stale").await;
    let id = "r-stale";
    let a = lab.worker(&[("LH_RESEARCH_EXPERT_CONCURRENCY", "1")]);
    lab.submit(id).await;
    first_section(&lab, id).await;
    a.stop();
    let _b = lab.worker(&[("LH_RESEARCH_EXPERT_CONCURRENCY", "1")]);
    let rec = lab.completed(id).await;
    assert_eq!(rec.epoch, 2);
    a.cont();
    // A wakes up mid-section: its next checkpoint (or heartbeat) meets the fence.
    wait_log(&a, "ownership lost", Duration::from_secs(15)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let events = lab.env.events_of(id).await;
    let marker = events
        .iter()
        .position(|e| e.r#type == "claimed" && e.epoch == 2)
        .unwrap();
    // The owner's events, that is: a recoverer's notice (no worker) of the
    // re-offer at epoch 1 may land after the new claim's marker.
    let stale: Vec<_> = events[marker..]
        .iter()
        .filter(|e| e.epoch == 1 && e.worker_id.is_some() && e.r#type != "heartbeat_lost")
        .map(|e| e.r#type.clone())
        .collect();
    assert!(stale.is_empty(), "stale owner's events landed: {stale:?}");
    assert_eq!(lab.deliveries().await, 1);
    eprintln!(
        "stale owner: fence refusal logged: {}",
        a.output().contains("checkpoint refused")
    );
    let _ = std::fs::remove_file(rules);
}

#[tokio::test]
async fn research_exhausted_section_is_skipped_honestly() {
    // Every generation of one expert's second section fails (1 try + 2 warm
    // + 2 cold attempts, 3 generations each); the other expert's succeeds.
    let rules = std::env::temp_dir().join(format!("lh-skip-{}.json", std::process::id()));
    std::fs::write(
        &rules,
        r#"{"rules": [{"kind": "server_error", "match": "section 2 of 2 of a report", "times": 15}]}"#,
    )
    .unwrap();
    let lab = Lab::new(&[("LH_SIM_FAULTS", rules.display().to_string())]).await;
    let _w = lab.worker(&[
        ("LH_RESEARCH_EXPERT_CONCURRENCY", "1"),
        ("LH_RESEARCH_BREAKER_MIN_CALLS", "1000"),
    ]);
    lab.submit("r-skip").await;
    let rec = lab.completed("r-skip").await;
    let res = rec.result.clone().unwrap();
    assert!(res.partial);
    assert_eq!(res.skipped_sections.len(), 1, "{:?}", res.skipped_sections);
    assert_eq!(rec.progress.as_ref().unwrap().skipped, 1);
    let events = lab.env.events_of("r-skip").await;
    let scopes: Vec<String> = events
        .iter()
        .filter(|e| e.r#type == "retry")
        .map(|e| e.data_map()["scope"].as_str().unwrap().to_string())
        .collect();
    for s in ["generation", "warm", "cold"] {
        assert!(scopes.iter().any(|x| x == s), "no {s} retry: {scopes:?}");
    }
    let doc = lab.artifact(&rec).await;
    assert!(doc.contains("Partial report"), "{doc}");
    assert!(doc.contains("- Skipped sections:\n  - section 2"), "{doc}");
    // The other expert's content still makes section 2 of the document.
    let finals: Vec<Value> = events
        .iter()
        .filter(|e| e.r#type == "phase" && e.data_map()["phase"] == "final")
        .map(payload)
        .collect();
    assert_eq!(finals.len(), 2);
    assert!(finals.iter().all(|f| f["missing"] == false));
    assert_eq!(lab.deliveries().await, 1);
    let _ = std::fs::remove_file(rules);
}

#[tokio::test]
async fn research_kill_after_journaled_model_responses() {
    // The 3rd journaled response is the first section's answer: the section
    // checkpoint was not written, the journal holds the text, no call repeats.
    let lab = Lab::new(&[]).await;
    let (rec, events, calls) =
        crash_run(&lab, "r-answer", "after_model_response:3", async {}).await;
    assert_eq!(calls, CLEAN_CALLS, "no model call repeated");
    assert_clean_finish(&lab, &rec, &events).await;
    let first = events
        .iter()
        .filter(|e| e.r#type == "section")
        .map(|e| (e.epoch, payload(e)))
        .next()
        .unwrap();
    assert_eq!(first.0, 2, "checkpointed by the reclaiming worker");
    assert_eq!(first.1["model_calls"], 0, "taken from the journal");
    // The 1st is a tool proposal whose call never ran: the repair drops the
    // unanswered proposal and asks again, exactly one model call repeated.
    let lab = Lab::new(&[]).await;
    let (rec, events, calls) =
        crash_run(&lab, "r-proposal", "after_model_response:1", async {}).await;
    assert_eq!(calls, CLEAN_CALLS + 1, "one model call repeated");
    assert_clean_finish(&lab, &rec, &events).await;
}

/// No task of an attempt survives it: the checkpoint flusher ends when its
/// senders are gone, and dropping its handle (an attempt aborted past its
/// stop timeout drops everything) aborts it.
#[tokio::test]
async fn the_checkpoint_flusher_never_outlives_its_attempt() {
    use leasehold_testkit::doors::owner::Flusher;
    use leasehold_testkit::doors::owner::Owner;
    use std::sync::Arc;
    let env = leasehold_testkit::Fleet::start().await;
    let owner = Owner {
        worker_id: "w".into(),
        claim_token: "t".into(),
        epoch: 1,
    };
    let dead_within = |fence: Arc<tokio::sync::Mutex<leasehold_testkit::doors::owner::Fence>>| async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while Arc::strong_count(&fence) > 1 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the flusher task still holds the fence"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    for drop_handle_first in [true, false] {
        let fence = Arc::new(tokio::sync::Mutex::new(
            env.events
                .claim_marker(&format!("fl-{drop_handle_first}"), 1, "w", json!({}))
                .await
                .unwrap(),
        ));
        let gate =
            leasehold_testkit::doors::owner::Gate::new(env.jobs.clone(), "fl", owner.clone());
        let (flusher, handle) = Flusher::start(
            fence.clone(),
            gate,
            tokio_util::sync::CancellationToken::new(),
        );
        flusher.event("section", json!({"n": 1}));
        flusher.barrier().await.unwrap();
        if drop_handle_first {
            // The attempt's future dropped: the task is aborted even while
            // a sender (a hook's clone) lingers.
            let lingering = flusher.clone();
            drop(handle);
            drop(flusher);
            dead_within(fence).await;
            drop(lingering);
        } else {
            // Every sender gone: the task ends by itself.
            drop(flusher);
            dead_within(fence).await;
            drop(handle);
        }
    }
}

#[tokio::test]
async fn research_paused_owner_neither_overwrites_the_artifact_nor_delivers_again() {
    // A stalls (network and process) in the middle of its artifact upload,
    // after its last checkpoint: B finishes the job, then A wakes up.
    let lab = Lab::new(&[]).await;
    let id = "r-paused";
    let bucket = lab.env.conn.layout.artifacts_bucket();
    let proxy = leasehold_harness::FaultProxy::start(&lab.env.url()).await;
    let hold = proxy.hold(&format!("$O.{bucket}.C.>"));
    let a_url = proxy.url();
    let a = lab.worker(&[("NATS_URL", a_url.as_str())]);
    lab.submit(id).await;
    tokio::time::timeout(Duration::from_secs(40), hold.triggered())
        .await
        .unwrap_or_else(|_| panic!("A never uploaded its artifact:\n{}", a.output()));
    a.stop();
    // A's session ends while it is stopped; B's worker recovers the job.
    let _b = lab.worker(&[]);
    let rec = lab.completed(id).await;
    assert_eq!(rec.epoch, 2, "finished by B after a re-offer");
    proxy.release_all();
    a.cont();
    // A's upload goes on, then it meets a newer owner at its next write.
    wait_log(&a, "ownership lost", Duration::from_secs(20)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        lab.deliveries().await,
        1,
        "one delivery; A's log:\n{}",
        a.output()
    );
    let doc = lab.artifact(&rec).await;
    assert_eq!(
        rec.result.as_ref().unwrap().digest.as_deref(),
        Some(sha256_hex(&doc).as_str()),
        "the stored artifact is the one the record names (A did not overwrite it)"
    );
    let now = lab.env.record(id).await.unwrap();
    assert_eq!(now.status, "completed");
    assert_eq!(now.epoch, 2);
    lab.env
        .wait_event(id, "completed", Duration::from_secs(10))
        .await;
    let events = lab.env.events_of(id).await;
    assert_eq!(
        events.iter().filter(|e| e.r#type == "completed").count(),
        1,
        "completed once"
    );
    // Nothing of A's stayed behind in the artifacts bucket: B's chunks and
    // B's meta only.
    let mut s = lab
        .env
        .conn
        .js
        .get_stream(format!("OBJ_{bucket}"))
        .await
        .unwrap();
    let info = s.info().await.unwrap();
    let obj = lab
        .env
        .conn
        .js
        .get_object_store(&bucket)
        .await
        .unwrap()
        .info(format!("{id}/report.md"))
        .await
        .unwrap();
    assert_eq!(
        info.state.messages,
        obj.chunks as u64 + 1,
        "A's orphan chunks were cleaned up"
    );
    // A's other late writes were refused too: none of its events landed
    // after B's claim, and its record writes met the new owner.
    let marker = events
        .iter()
        .position(|e| e.r#type == "claimed" && e.epoch == 2)
        .unwrap();
    // The owner's events, that is: a recoverer's notice (no worker) of the
    // re-offer at epoch 1 may land after the new claim's marker.
    let stale: Vec<_> = events[marker..]
        .iter()
        .filter(|e| e.epoch == 1 && e.worker_id.is_some() && e.r#type != "heartbeat_lost")
        .map(|e| e.r#type.clone())
        .collect();
    assert!(stale.is_empty(), "stale owner's events landed: {stale:?}");
    // Which way A's upload ended depends on what it saw first on waking: the
    // refusal of its meta (it adopts B's artifact) or its chunk's ack timeout.
    eprintln!(
        "paused owner: adopted the stored artifact: {}",
        a.output().contains("adopting the stored one")
    );
}

#[tokio::test]
async fn research_transcripts_can_go_before_the_job() {
    let lab = Lab::new(&[]).await;
    let _w = lab.worker(&[]);
    lab.submit("r-tx").await;
    let rec = lab.completed("r-tx").await;
    let before = lab.env.events_of("r-tx").await;
    let count = |evs: &[JobEvent], ty: &str| evs.iter().filter(|e| e.r#type == ty).count();
    assert!(count(&before, "journal") > 0 && count(&before, "tool") > 0);
    // Full retention off, transcripts dropped as soon as the job finished.
    let mut o = lab
        .env
        .reaper_args(&["--retention", "0s", "--transcript-retention", "0s"]);
    o.interval = Duration::from_millis(200);
    let (reaper, stop) = lab.env.reaper_with(o).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let after = loop {
        let evs = lab.env.events_of("r-tx").await;
        if count(&evs, "journal") == 0 && count(&evs, "tool") == 0 {
            break evs;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "transcripts still there"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // Everything else stays: checkpoints, the terminal event, the record,
    // the artifact, and the job still reads as it did.
    for ty in ["claimed", "phase", "section", "completed"] {
        assert_eq!(count(&after, ty), count(&before, ty), "{ty} events kept");
    }
    assert_eq!(lab.env.record("r-tx").await.unwrap(), rec);
    let doc = lab.artifact(&rec).await;
    assert!(doc.contains("## Appendix A: Sources"));
    stop.cancel();
    reaper.wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn research_trace_is_one_tree_across_a_crash_and_its_reclaim() {
    use crate::otlp::{attr, hex, Collector};
    let collector = Collector::start().await;
    let lab = Lab::new(&[]).await;
    let mut env: Vec<(&'static str, String)> = collector.env();
    env.push(("LH_RESEARCH_EXPERT_CONCURRENCY", "1".into()));
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut e = env.clone();
        e.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
        e
    };
    let worker = |e: Vec<(&'static str, String)>| {
        let refs: Vec<(&'static str, &str)> = e.iter().map(|(k, v)| (*k, v.as_str())).collect();
        lab.worker(&refs)
    };
    // The submitter's span: the job's trace starts there.
    let (trace_id, root) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let traceparent = format!("00-{trace_id}-{root}-01");
    let mut a = worker(with(&[("LH_RESEARCH_CRASH_AT", "after_phase:outline")]));
    lab.env
        .work
        .submit_traced(
            "research",
            json!({"input": {"topic": "lease-based ownership in distributed systems", "experts": 2, "sections": 2}})
                .to_string()
                .into(),
            Some("r-trace"),
            None,
            Some(&traceparent),
        )
        .await
        .unwrap();
    exited(&mut a, Duration::from_secs(30)).await;
    assert!(a.output().contains("LH_RESEARCH_CRASH_AT reached"));
    let b = worker(with(&[]));
    let rec = lab.completed("r-trace").await;
    assert_eq!(rec.traceparent.as_deref(), Some(traceparent.as_str()));
    // A clean stop exports what B has buffered.
    b.term();
    collector
        .wait_for(Duration::from_secs(20), |s| s.name == "attempt research")
        .await;

    let spans = collector.spans();
    let by_id: HashMap<String, &crate::otlp::Span> =
        spans.iter().map(|s| (hex(&s.span_id), s)).collect();
    assert!(
        spans.iter().all(|s| hex(&s.trace_id) == trace_id),
        "every span is in the submitter's trace"
    );
    let parent = |s: &crate::otlp::Span| hex(&s.parent_span_id);
    let named =
        |n: &str| -> Vec<&crate::otlp::Span> { spans.iter().filter(|s| s.name == n).collect() };
    // Attempt 1 died with its process; its span id is in its claim marker,
    // and the phase it finished reached the collector before the abort.
    let events = lab.env.events_of("r-trace").await;
    let claim_span = |epoch: u64| {
        let c = events
            .iter()
            .find(|e| e.r#type == "claimed" && e.epoch == epoch)
            .expect("claim marker");
        let tp = c.data_map()["traceparent"].as_str().unwrap().to_string();
        tp.split('-').nth(2).unwrap().to_string()
    };
    let (first, second) = (claim_span(1), claim_span(2));
    let outline = named("phase outline");
    assert_eq!(
        outline.len(),
        1,
        "outline ran once: {:?}",
        crate::otlp::names(&spans)
    );
    assert_eq!(
        parent(outline[0]),
        first,
        "the outline belongs to attempt 1"
    );
    // Attempt 2: a child of the submitter's span, linked to attempt 1.
    let attempts = named("attempt research");
    assert_eq!(
        attempts.len(),
        1,
        "only the surviving attempt closed its span"
    );
    let b_attempt = attempts[0];
    assert_eq!(hex(&b_attempt.span_id), second);
    assert_eq!(parent(b_attempt), root);
    assert!(
        b_attempt.links.iter().any(|l| hex(&l.span_id) == first),
        "attempt 2 links to attempt 1"
    );
    assert_eq!(
        attr(b_attempt, "leasehold.outcome").as_deref(),
        Some("completed")
    );
    assert_eq!(attr(b_attempt, "leasehold.job.epoch").as_deref(), Some("2"));
    // Its phases, in the tree under it; the outline is not redone.
    for p in ["perspectives", "experts", "final", "artifact", "deliver"] {
        let ps = named(&format!("phase {p}"));
        assert_eq!(ps.len(), 1, "phase {p}");
        assert_eq!(parent(ps[0]), second, "phase {p} under attempt 2");
    }
    let experts = hex(&named("phase experts")[0].span_id);
    let sections: Vec<_> = spans
        .iter()
        .filter(|s| s.name.starts_with("section "))
        .collect();
    assert_eq!(sections.len(), 4, "2 experts x 2 sections");
    assert!(sections.iter().all(|s| parent(s) == experts));
    // Model calls: GenAI attributes, under a section or a phase.
    let chats = named("chat sim-1");
    assert!(
        chats.len() >= CLEAN_CALLS as usize - 1,
        "{} chats",
        chats.len()
    );
    for c in &chats {
        assert_eq!(attr(c, "gen_ai.operation.name").as_deref(), Some("chat"));
        assert!(attr(c, "gen_ai.usage.output_tokens").is_some());
        let up = by_id.get(&parent(c)).expect("a chat's parent was exported");
        assert!(up.name.starts_with("section ") || up.name.starts_with("phase "));
    }
    // Tool calls: searches in sections, the delivery's effect in deliver.
    let tools: Vec<_> = spans
        .iter()
        .filter(|s| s.name.starts_with("execute_tool "))
        .collect();
    assert!(
        tools
            .iter()
            .any(|t| t.name == "execute_tool search"
                && by_id[&parent(t)].name.starts_with("section "))
    );
    let publish = tools
        .iter()
        .find(|t| t.name == "execute_tool publish")
        .expect("the delivery");
    assert_eq!(by_id[&parent(publish)].name, "phase deliver");
    assert_eq!(
        attr(publish, "leasehold.effect").as_deref(),
        Some("executed")
    );
}

// Issue 18: research adopted any stored `<id>/report.md`, so a job id reused
// after an earlier job's document outlived it (retention removed an
// artifact only when the result named it) delivered the earlier document.
#[tokio::test]
async fn research_with_a_reused_id_never_adopts_an_earlier_jobs_document() {
    let lab = Lab::new(&[]).await;
    let store = lab
        .env
        .conn
        .js
        .get_object_store(lab.env.conn.layout.artifacts_bucket())
        .await
        .unwrap();
    let earlier = async_nats::jetstream::object_store::ObjectMetadata {
        name: "r-reused/report.md".into(),
        metadata: [(
            "lh-incarnation".to_string(),
            "2020-01-01T00:00:00.000Z".to_string(),
        )]
        .into(),
        ..Default::default()
    };
    store
        .put(earlier, &mut "THE EARLIER JOB'S DOCUMENT".as_bytes())
        .await
        .unwrap();
    let _w = lab.worker(&[]);
    lab.submit("r-reused").await;
    let rec = lab.completed("r-reused").await;
    let doc = lab.artifact(&rec).await;
    assert!(
        !doc.contains("THE EARLIER JOB'S DOCUMENT") && doc.contains("## Appendix A: Sources"),
        "this job's own document: {doc}"
    );
}

// Issue 18: the flusher retried a refusal that retrying cannot change (the
// event stream full) until the attempt timeout (6 h by default), counting
// the dropped checkpoints as published. Now the attempt stops at once and
// the job is retried from its last checkpoint.
#[tokio::test]
async fn research_checkpoints_refused_by_a_full_event_stream_stop_the_attempt_not_hang_it() {
    let (lab, rules) = paced_lab("full").await;
    let id = "r-full";
    let _w = lab.worker(&[("LH_RESEARCH_EXPERT_CONCURRENCY", "1")]);
    lab.submit(id).await;
    first_section(&lab, id).await;
    // The event stream is full from now on.
    let js = &lab.env.conn.js;
    let name = lab.env.conn.layout.events_stream();
    let mut st = js.get_stream(&name).await.unwrap();
    let info = st.info().await.unwrap().clone();
    let mut full = info.config.clone();
    full.max_bytes = info.state.bytes as i64;
    js.update_stream(full).await.unwrap();
    let retried = lab
        .env
        .wait_for(id, Duration::from_secs(30), |r| {
            r.error
                .as_ref()
                .is_some_and(|e| e.message.contains("refused by the event stream"))
        })
        .await;
    assert_ne!(
        retried.status, "running",
        "the attempt stopped: {retried:?}"
    );
    // Room again: the retry resumes and completes.
    js.update_stream(info.config.clone()).await.unwrap();
    let rec = lab.completed(id).await;
    assert!(rec.attempts >= 1, "{rec:?}");
    let _ = std::fs::remove_file(rules);
}

// Issue 24: a research job whose budget ran out failed with class
// `terminal`, not `budget_exhausted` as the reference says.
#[tokio::test]
async fn research_whose_budget_runs_out_fails_as_budget_exhausted() {
    let lab = Lab::new(&[]).await;
    let _w = lab.worker(&[]);
    lab.env
        .submit(
            "research",
            json!({"input": {"topic": "leases", "experts": 2, "sections": 2}, "budget": {"max_steps": 1}}),
            "r-budget",
        )
        .await;
    let r = lab
        .env
        .wait_for("r-budget", Duration::from_secs(40), |r| {
            matches!(
                r.status.as_str(),
                "completed" | "failed" | "parked" | "dead"
            )
        })
        .await;
    assert_eq!(r.status, "failed", "{r:?}");
    assert_eq!(r.error.as_ref().unwrap().class, "budget_exhausted", "{r:?}");
}

// Issue 24: a cancelled research job kept nothing of what it had written.
// Now its record's result names `<id>/partial.md` (`partial: true`), and
// `leasehold result` prints it (exit 1: the job did not complete).
#[tokio::test]
async fn a_cancelled_research_job_keeps_a_partial_report() {
    let (lab, rules) = paced_lab("partial").await;
    let _w = lab.worker(&[]);
    lab.env
        .submit(
            "research",
            json!({"input": {"topic": "leases", "experts": 2, "sections": 3}}),
            "r-part",
        )
        .await;
    first_section(&lab, "r-part").await;
    let url = lab.env.url();
    let (code, out, err) = leasehold_testkit::cli(&url, &["cancel", "r-part"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let r = lab
        .env
        .wait_for("r-part", Duration::from_secs(30), |r| {
            matches!(r.status.as_str(), "cancelled" | "completed" | "failed")
        })
        .await;
    assert_eq!(r.status, "cancelled", "{r:?}");
    let res = r.result.clone().expect("a partial result");
    assert!(res.partial, "{res:?}");
    assert_eq!(res.artifact.as_deref(), Some("r-part/partial.md"));
    assert!(!res.skipped_sections.is_empty(), "{res:?}");
    let doc = lab.artifact(&r).await;
    assert!(
        doc.contains("Partial report: the job was cancelled"),
        "{doc}"
    );
    let (code, out, err) = leasehold_testkit::cli(&url, &["result", "r-part"]).await;
    assert_eq!(code, 1, "{err}");
    assert!(out.contains("Partial report"), "{out}");
    assert!(
        err.contains("is cancelled") && err.contains("partial report"),
        "{err}"
    );
    let _ = std::fs::remove_file(rules);
}

// Issue 24: the same for a job whose budget runs out after it wrote a
// section: it fails `budget_exhausted` and keeps what it wrote.
#[tokio::test]
async fn a_research_job_out_of_budget_keeps_a_partial_report() {
    let lab = Lab::new(&[]).await;
    let _w = lab.worker(&[]);
    lab.env
        .submit(
            "research",
            json!({"input": {"topic": "leases", "experts": 1, "sections": 3}, "budget": {"max_steps": 8}}),
            "r-budget-part",
        )
        .await;
    let r = lab
        .env
        .wait_for("r-budget-part", Duration::from_secs(40), |r| {
            matches!(
                r.status.as_str(),
                "completed" | "failed" | "parked" | "dead"
            )
        })
        .await;
    assert_eq!(r.status, "failed", "{r:?}");
    assert_eq!(r.error.as_ref().unwrap().class, "budget_exhausted", "{r:?}");
    let evs: Vec<String> = lab
        .env
        .events_of("r-budget-part")
        .await
        .iter()
        .map(|e| e.r#type.clone())
        .collect();
    let res = r
        .result
        .clone()
        .unwrap_or_else(|| panic!("no partial result: {r:?} {evs:?}"));
    assert!(res.partial, "{res:?}");
    let doc = lab.artifact(&r).await;
    assert!(doc.contains("Partial report: its budget ran out"), "{doc}");
}

// Issue 24, item 8: a research run with model faults, as an operator reads
// it at the default level, and as `watch` shows it in a CI log.
#[tokio::test]
async fn research_logs_keep_retry_decisions_at_debug_and_watch_sums_up_the_sections() {
    let lab = Lab::new(&[("LH_SIM_FAULT_RATE", "0.1".to_string())]).await;
    let w = lab.worker(&[]);
    wait_log(&w, "worker starting", Duration::from_secs(20)).await;
    lab.submit("r-logs").await;
    let watch = Proc::spawn(
        "leasehold",
        &["watch", "r-logs", "--wait-for-id"],
        &[("NATS_URL", lab.env.url())],
    );
    let rec = lab.completed("r-logs").await;
    let retries = lab
        .env
        .events_of("r-logs")
        .await
        .iter()
        .filter(|e| e.r#type == "retry")
        .count();
    assert!(retries > 0, "the faults made the runtime retry");
    let out = w.output();
    assert!(
        !out.contains("retry decision"),
        "{retries} retry decisions, none at info:\n{out}"
    );
    for l in out.lines() {
        let prefix = l.find(": ").map_or(l, |i| &l[..i]);
        assert!(
            prefix.len() <= 200,
            "a {}-character prefix: {l}",
            prefix.len()
        );
        assert!(!l.contains("otel.") && !l.contains("gen_ai."), "{l}");
    }
    assert!(
        out.lines()
            .any(|l| l.contains("[r-logs e1]") && l.contains("attempt ended")),
        "the attempt's end names the job and epoch:\n{out}"
    );
    wait_log(&watch, "r-logs completed in ", Duration::from_secs(20)).await;
    let shown = watch.output();
    let p = rec.progress.clone().unwrap();
    let summary = shown.lines().last().unwrap();
    assert!(
        summary.contains(&format!(
            ": {}/{} sections, {} skipped → leasehold result r-logs",
            p.sections_done, p.sections_total, p.skipped
        )),
        "{summary}"
    );
    assert!(shown.contains(" sections"), "{shown}");
}

// Issue 33, item 7: research's experts as child jobs. A lab whose layout
// and workers serve `research-expert` beside `research`.
async fn experts_lab() -> Lab {
    Lab::on(Fleet::with_kind("research-expert").await, &[]).await
}

const BOTH: (&str, &str) = ("LH_KINDS", "research,research-expert");

fn body(doc: &str) -> &str {
    doc.split("## Appendix B").next().unwrap()
}

fn expert_input(topic: &str) -> Value {
    json!({"topic": topic, "experts": 2, "sections": 2, "expert_jobs": true})
}

#[tokio::test]
async fn research_with_experts_as_child_jobs_writes_the_same_report_with_the_same_calls() {
    let lab = experts_lab().await;
    let _w = lab.worker(&[BOTH]);
    lab.submit("r-inproc").await;
    let inproc = lab.completed("r-inproc").await;
    let c0 = lab.chat_requests().await;
    assert_eq!(c0, CLEAN_CALLS);
    lab.env
        .submit(
            "research",
            json!({"input": expert_input("lease-based ownership in distributed systems")}),
            "r-kids",
        )
        .await;
    let rec = lab.completed("r-kids").await;
    // The same model calls: no section asked twice, none asked by the parent.
    assert_eq!(lab.chat_requests().await - c0, CLEAN_CALLS);
    let (a, b) = (lab.artifact(&inproc).await, lab.artifact(&rec).await);
    assert_eq!(body(&a), body(&b), "the same document");
    assert!(
        b.contains("written by a `research-expert` job of its own"),
        "{b}"
    );
    assert_eq!(lab.deliveries().await, 2, "one delivery per report");
    // Each expert a job of its own, once, naming its parent, completed
    // with its sections; the parent slept once (two claims) and its own
    // events hold every section once, as an in-process run's do.
    let kids = lab.env.spawned("r-kids").await;
    assert_eq!(kids.len(), 2);
    for (e, c) in kids.iter().enumerate() {
        let k = lab.env.record(c).await.expect("the expert job exists");
        assert_eq!(
            (k.kind.as_str(), k.status.as_str()),
            ("research-expert", "completed"),
            "{k:?}"
        );
        assert_eq!(
            k.spec.as_ref().unwrap().parent.as_ref().unwrap().id,
            "r-kids"
        );
        let evs = lab.env.events_of(c).await;
        assert_eq!(
            evs.iter().filter(|e| e.r#type == "claimed").count(),
            1,
            "{c}"
        );
        let counts = section_counts(&evs);
        assert_eq!(counts.len(), 2, "{c}: {counts:?}");
        assert!(counts.keys().all(|(x, _)| *x == e as u64), "{counts:?}");
        let p = k.progress.clone().unwrap();
        assert_eq!((p.sections_done, p.sections_total), (2, 2));
    }
    let events = lab.env.events_of("r-kids").await;
    assert_eq!(events.iter().filter(|e| e.r#type == "claimed").count(), 2);
    assert_eq!(
        events.iter().filter(|e| e.r#type == "journal").count(),
        0,
        "the parent asked no section"
    );
    let counts = section_counts(&events);
    assert_eq!(counts.len(), 4);
    assert!(counts.values().all(|n| *n == 1), "{counts:?}");
    let p = rec.progress.clone().unwrap();
    assert_eq!((p.sections_done, p.sections_total, p.skipped), (6, 6, 0));
}

#[tokio::test]
async fn an_expert_job_killed_mid_expert_redoes_at_most_its_section_in_flight() {
    let lab = experts_lab().await;
    // Worker A runs the parent and its expert jobs, one section at a time,
    // and aborts once one expert section is durable; B finishes.
    let env = [
        BOTH,
        ("LH_RESEARCH_CRASH_AT", "after_section:1"),
        ("LH_CONCURRENCY", "1"),
    ];
    let mut a = lab.worker(&env);
    lab.env
        .submit(
            "research",
            json!({"input": expert_input("leases")}),
            "r-kids-kill",
        )
        .await;
    exited(&mut a, Duration::from_secs(30)).await;
    assert!(
        a.output().contains("LH_RESEARCH_CRASH_AT reached"),
        "{}",
        a.output()
    );
    // B without the crash point: it is armed for any job not yet reclaimed,
    // so the other expert's job would stop B too.
    let _b = lab.worker(&[BOTH, ("LH_CONCURRENCY", "1")]);
    let rec = lab.completed("r-kids-kill").await;
    // Only the section in flight may be asked again: one model call.
    let calls = lab.chat_requests().await;
    assert!(
        calls <= CLEAN_CALLS + 1,
        "{calls} model calls for {CLEAN_CALLS}"
    );
    let kids = lab.env.spawned("r-kids-kill").await;
    let mut reclaimed = 0;
    for c in &kids {
        let k = lab.env.record(c).await.unwrap();
        assert_eq!(k.status, "completed", "{k:?}");
        reclaimed += k.stale_reclaims;
        let counts = section_counts(&lab.env.events_of(c).await);
        assert!(
            counts.values().all(|n| *n == 1),
            "{c} redid a section: {counts:?}"
        );
    }
    assert_eq!(reclaimed, 1, "the expert job in flight was reclaimed once");
    let events = lab.env.events_of("r-kids-kill").await;
    assert_clean_finish(&lab, &rec, &events).await;
}

#[tokio::test]
async fn each_expert_job_has_its_share_of_the_budget_and_running_out_is_a_gap_in_the_report() {
    let lab = experts_lab().await;
    let _w = lab.worker(&[BOTH]);
    // 12 steps for 2 experts: 6 each, one section (3 model calls and 2
    // tool calls) and no second. The report's job spends 3 of its own
    // (outline, perspectives, one final section) and completes.
    lab.env
        .submit(
            "research",
            json!({"input": expert_input("leases"), "budget": {"max_steps": 12}}),
            "r-kids-budget",
        )
        .await;
    let rec = lab.completed("r-kids-budget").await;
    let res = rec.result.clone().unwrap();
    assert!(res.partial, "{res:?}");
    assert_eq!(res.skipped_sections.len(), 2, "{res:?}");
    // Each expert job spent its share, and kept the section it wrote.
    for c in lab.env.spawned("r-kids-budget").await {
        let k = lab.env.record(&c).await.unwrap();
        assert_eq!(k.status, "completed", "{k:?}");
        let steps = k.budget_used.unwrap().steps;
        assert!(
            (5..=6).contains(&steps),
            "one section (5 steps) of its 6: {k:?}"
        );
    }
    let doc = lab.artifact(&rec).await;
    assert!(
        doc.contains("this expert's job ran out of its budget"),
        "{doc}"
    );
    assert_eq!(lab.deliveries().await, 1);
}

#[tokio::test]
async fn expert_jobs_refuse_what_does_not_fit_with_the_reason() {
    let lab = experts_lab().await;
    let _w = lab.worker(&[BOTH]);
    let ended = |id: &'static str| {
        let env = &lab.env;
        async move {
            env.wait_for(id, Duration::from_secs(30), |r| {
                matches!(
                    r.status.as_str(),
                    "completed" | "failed" | "parked" | "dead"
                )
            })
            .await
        }
    };
    // An expert job nobody spawned, and a report given an expert's task.
    lab.env
        .submit(
            "research-expert",
            json!({"input": {"topic": "t"}}),
            "rx-alone",
        )
        .await;
    lab.env
        .submit(
            "research",
            json!({"input": {"topic": "t", "experts": 1, "sections": 1, "expert_job": {"expert": 0, "outline": {"title": "t", "sections": [{"title": "a", "goal": "b"}]}, "perspectives": [{"name": "n", "focus": "f"}]}}}),
            "rx-task",
        )
        .await;
    lab.env
        .submit(
            "research",
            json!({"input": {"topic": "t", "expert_jobs": "yes"}}),
            "rx-bad",
        )
        .await;
    for (id, why) in [
        ("rx-alone", "input.expert_job: required"),
        ("rx-task", "only a `research-expert` job has one"),
        ("rx-bad", "input.expert_jobs: expected true or false"),
    ] {
        let r = ended(id).await;
        assert_eq!((r.status.as_str(), r.attempts), ("failed", 1), "{r:?}");
        let e = r.error.unwrap();
        assert!(e.message.contains(why), "{id}: {e:?}");
    }
    let _ = &lab.sim;
}

#[tokio::test]
async fn experts_as_child_jobs_on_a_fleet_without_the_expert_kind_fail_at_once_saying_so() {
    let lab = Lab::new(&[]).await;
    let _w = lab.worker(&[]);
    lab.env
        .submit(
            "research",
            json!({"input": expert_input("leases")}),
            "r-kids-unset",
        )
        .await;
    let r = lab
        .env
        .wait_for("r-kids-unset", Duration::from_secs(40), |r| {
            matches!(
                r.status.as_str(),
                "completed" | "failed" | "parked" | "dead"
            )
        })
        .await;
    assert_eq!((r.status.as_str(), r.attempts), ("failed", 1), "{r:?}");
    let e = r.error.unwrap();
    assert!(e.message.contains("research-expert"), "{e:?}");
}
