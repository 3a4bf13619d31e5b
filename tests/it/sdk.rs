//! The public SDK's durable steps against a real nats-server, with an
//! in-process worker built as a user builds theirs (`leasehold::Worker`):
//! a recorded step never runs again; a resumed attempt whose code asks for
//! other steps, or whose recorded result no longer decodes, parks the job
//! with the reason instead of guessing.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use leasehold::{Ctx, Error, Kind};
use leasehold_testkit::SetupOptions;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use leasehold_testkit::*;

/// What the test kind does in each attempt (the "code" of that attempt).
#[derive(Default)]
struct Script {
    /// Which code the next attempt runs: 0 the first version, 1 the changed one.
    version: AtomicU32,
    /// How often each step's closure ran.
    ran_a: AtomicU32,
    ran_b: AtomicU32,
}

struct Steps(Arc<Script>);

#[leasehold::async_trait]
impl Kind for Steps {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let s = &self.0;
        let v = s.version.load(Ordering::SeqCst);
        let mode = ctx.input_json()["mode"].as_str().unwrap_or("").to_string();
        let a: u64 = ctx
            .step("a", || async {
                s.ran_a.fetch_add(1, Ordering::SeqCst);
                Ok(7)
            })
            .await?;
        if v == 0 {
            let _: String = ctx
                .step("b", || async {
                    s.ran_b.fetch_add(1, Ordering::SeqCst);
                    Ok("b".to_string())
                })
                .await?;
            // The first version stops here, to be retried by a later attempt.
            s.version.store(1, Ordering::SeqCst);
            return Err(Error::retryable("first attempt ends"));
        }
        match mode.as_str() {
            // The changed code asks for another step where `b` was.
            "reorder" => {
                let _: u64 = ctx.step("c", || async { Ok(1) }).await?;
            }
            // The changed code reads `b`'s result as a number.
            "retype" => {
                let _: u64 = ctx.step("b", || async { Ok(1) }).await?;
            }
            _ => {
                let b: String = ctx.step("b", || async { Ok("again".to_string()) }).await?;
                return Ok(json!({"a": a, "b": b}));
            }
        }
        Ok(json!({"a": a}))
    }
}

async fn run(mode: &str) -> (Fleet, Arc<Script>, leasehold::JobRecord) {
    let mut o = SetupOptions {
        ack_wait: ACK_WAIT,
        ..SetupOptions::default()
    };
    o.kinds.push("steps".into());
    let env = Fleet::with(o).await;
    let script = Arc::new(Script::default());
    let mut opts = env.opts();
    opts.kinds = vec!["steps".into()];
    opts.retry_base = Duration::from_millis(10);
    opts.retry_cap = Duration::from_millis(20);
    let stop = CancellationToken::new();
    let _h = leasehold::Worker::new(opts)
        .kind("steps", Steps(script.clone()))
        .start(stop.clone())
        .await
        .unwrap();
    env.submit("steps", json!({"input": {"mode": mode}}), "s-1")
        .await;
    let rec = env
        .wait_for("s-1", Duration::from_secs(20), |r| {
            matches!(r.status.as_str(), "completed" | "failed" | "parked")
        })
        .await;
    stop.cancel();
    (env, script, rec)
}

#[tokio::test]
async fn a_recorded_step_never_runs_again_in_a_later_attempt() {
    let (_env, s, rec) = run("same").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    assert_eq!(rec.attempts, 1, "one failed attempt before");
    assert_eq!(s.ran_a.load(Ordering::SeqCst), 1, "a replayed, not run");
    assert_eq!(s.ran_b.load(Ordering::SeqCst), 1);
    let out: Value = serde_json::from_str(&rec.result.unwrap().output).unwrap();
    // `b` comes from the journal: the second closure never ran.
    assert_eq!(out, json!({"a": 7, "b": "b"}));
}

#[tokio::test]
async fn a_changed_step_order_parks_the_job_with_both_steps_named() {
    let (_env, _s, rec) = run("reorder").await;
    assert_eq!(rec.status, "parked", "{rec:?}");
    assert_eq!(rec.parked_reason.as_deref(), Some("journal_mismatch"));
    let msg = rec.error.map(|e| e.message).unwrap_or_default();
    assert!(msg.contains("`b#0`") && msg.contains("`c#0`"), "{msg}");
}

#[tokio::test]
async fn a_recorded_result_that_no_longer_decodes_parks_the_job() {
    let (_env, _s, rec) = run("retype").await;
    assert_eq!(rec.status, "parked", "{rec:?}");
    assert_eq!(rec.parked_reason.as_deref(), Some("journal_mismatch"));
    let msg = rec.error.map(|e| e.message).unwrap_or_default();
    assert!(msg.contains("no longer decodes"), "{msg}");
}

/// `search` and `fetch` of a user's own, for the sim's planner.
struct Search(String, Arc<AtomicU32>, leasehold::ToolSpec);
struct Fetch(Arc<AtomicU32>, leasehold::ToolSpec);

fn spec(name: &str) -> leasehold::ToolSpec {
    leasehold::ToolSpec {
        name: name.into(),
        description: format!("{name} the web"),
        kind: leasehold::ToolKind::Read,
        schema: json!({"type": "object"}),
        timeout: Duration::from_secs(5),
    }
}

impl leasehold::Tool for Search {
    fn spec(&self) -> &leasehold::ToolSpec {
        &self.2
    }
    fn execute<'a>(
        &'a self,
        _args: &'a Value,
        _ctx: &'a leasehold::ExecCtx,
    ) -> leasehold::BoxFuture<'a, Result<Value, leasehold::ToolError>> {
        self.1.fetch_add(1, Ordering::SeqCst);
        let url = format!("{}/page/leases", self.0);
        Box::pin(async move { Ok(json!({"results": [{"url": url, "title": "Leases"}]})) })
    }
}

impl leasehold::Tool for Fetch {
    fn spec(&self) -> &leasehold::ToolSpec {
        &self.1
    }
    fn execute<'a>(
        &'a self,
        _args: &'a Value,
        _ctx: &'a leasehold::ExecCtx,
    ) -> leasehold::BoxFuture<'a, Result<Value, leasehold::ToolError>> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Box::pin(async { Ok(json!("A lease is a right held for a while.")) })
    }
}

/// One agent call, then a retryable failure the first time.
struct Researcher(Arc<AtomicU32>);

#[leasehold::async_trait]
impl Kind for Researcher {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let out = ctx
            .agent(
                "section",
                &leasehold::Agent::new(
                    "sim",
                    "You research and cite.",
                    "Write one section about leases.",
                )
                .tools(["search", "fetch"]),
            )
            .await?;
        if self.0.fetch_add(1, Ordering::SeqCst) == 0 {
            return Err(Error::retryable("after the agent, once"));
        }
        Ok(json!({"text": out.text, "tool_calls": out.tool_calls}))
    }
}

#[tokio::test]
async fn an_agent_call_runs_the_users_tools_and_is_not_repeated_once_recorded() {
    let mut o = SetupOptions {
        ack_wait: ACK_WAIT,
        ..SetupOptions::default()
    };
    o.kinds.push("researcher".into());
    let env = Fleet::with(o).await;
    let (_sim, sim) = spawn_sim(&[]).await;
    let (searches, fetches) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let mut opts = env.opts();
    opts.kinds = vec!["researcher".into()];
    opts.retry_base = Duration::from_millis(10);
    opts.retry_cap = Duration::from_millis(20);
    let model = leasehold::ModelConfig {
        base_url: format!("{sim}/v1"),
        ..Default::default()
    };
    let stop = CancellationToken::new();
    let _h = leasehold::Worker::new(opts)
        .model("sim", model)
        .tool(Search(sim.clone(), searches.clone(), spec("search")))
        .tool(Fetch(fetches.clone(), spec("fetch")))
        .kind("researcher", Researcher(Arc::new(AtomicU32::new(0))))
        .start(stop.clone())
        .await
        .unwrap();
    env.submit("researcher", json!({"input": {}}), "ag-1").await;
    let rec = env
        .wait_for("ag-1", Duration::from_secs(30), |r| {
            matches!(r.status.as_str(), "completed" | "failed" | "parked")
        })
        .await;
    stop.cancel();
    assert_eq!(rec.status, "completed", "{rec:?}");
    let out: Value = serde_json::from_str(&rec.result.unwrap().output).unwrap();
    assert!(
        out["text"].as_str().unwrap().contains("/page/leases"),
        "{out}"
    );
    assert_eq!(out["tool_calls"], 2);
    // The second attempt got the recorded answer: the tools ran once each.
    assert_eq!(searches.load(Ordering::SeqCst), 1);
    assert_eq!(fetches.load(Ordering::SeqCst), 1);
    let events = env.events_of("ag-1").await;
    let journal = events.iter().filter(|e| e.r#type == "agent").count();
    assert!(
        journal >= 5,
        "the transcript was journaled: {journal} entries"
    );
    // Each model call of the agent is a `model` event of its step, with
    // the tokens the provider reported and its duration.
    let models: Vec<_> = events
        .iter()
        .filter(|e| e.r#type == "model")
        .map(|e| e.data_map())
        .collect();
    assert!(!models.is_empty(), "no model events: {events:?}");
    for m in &models {
        assert!(m["tokens_in"].as_u64().unwrap() > 0, "{m:?}");
        assert!(m["duration_ms"].is_u64(), "{m:?}");
        assert!(m["step"].as_str().is_some_and(|s| !s.is_empty()), "{m:?}");
    }
    let steps: Vec<String> = events
        .iter()
        .filter(|e| e.r#type == "step")
        .map(|e| e.data_map()["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(steps, ["agent:section#0"]);
}

/// An agent whose call may take one step: the sim's planner needs more.
struct OneStep;

#[leasehold::async_trait]
impl Kind for OneStep {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let mut a = leasehold::Agent::new("sim", "You research and cite.", "Write about leases.")
            .tools(["search", "fetch"]);
        a.limits.max_steps = Some(1);
        let out = ctx.agent("section", &a).await?;
        Ok(json!({"text": out.text}))
    }
}

// Issue 31: an exhausted budget ended a job `terminal` through `ctx.agent`
// and `budget_exhausted` through research (research.rs asserts that one);
// one mapping (`Error::of_section`) now serves both.
#[tokio::test]
async fn a_budget_exhausted_agent_ends_budget_exhausted_as_research_does() {
    let mut o = SetupOptions {
        ack_wait: ACK_WAIT,
        ..SetupOptions::default()
    };
    o.kinds.push("onestep".into());
    let env = Fleet::with(o).await;
    let (_sim, sim) = spawn_sim(&[]).await;
    let mut opts = env.opts();
    opts.kinds = vec!["onestep".into()];
    let model = leasehold::ModelConfig {
        base_url: format!("{sim}/v1"),
        ..Default::default()
    };
    let n = Arc::new(AtomicU32::new(0));
    let stop = CancellationToken::new();
    let _h = leasehold::Worker::new(opts)
        .model("sim", model)
        .tool(Search(sim.clone(), n.clone(), spec("search")))
        .tool(Fetch(n.clone(), spec("fetch")))
        .kind("onestep", OneStep)
        .start(stop.clone())
        .await
        .unwrap();
    env.submit("onestep", json!({"input": {}}), "ag-budget")
        .await;
    let rec = env
        .wait_for("ag-budget", Duration::from_secs(30), |r| {
            matches!(
                r.status.as_str(),
                "completed" | "failed" | "parked" | "dead"
            )
        })
        .await;
    stop.cancel();
    assert_eq!(rec.status, "failed", "{rec:?}");
    let err = rec.error.clone().unwrap();
    assert_eq!(err.class, "budget_exhausted", "{rec:?}");
    assert!(err.message.contains("budget exhausted (Steps)"), "{err:?}");
    assert_eq!(rec.attempts, 1, "a budget is never retried: {rec:?}");
}

async fn sim_chat_requests(sim: &str) -> u64 {
    let v: Value = reqwest::get(format!("{sim}/stats"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["chat_requests"].as_u64().unwrap()
}

#[tokio::test]
async fn a_kill_9_during_an_agent_call_repeats_at_most_the_model_call_in_flight() {
    let mut o = SetupOptions {
        ack_wait: ACK_WAIT,
        ..SetupOptions::default()
    };
    o.kinds.push("agent-test".into());
    let env = Fleet::with(o).await;
    // Paced tokens: the section's answer takes a while to stream.
    let (_sim, sim) = spawn_sim(&[("LH_SIM_TOKEN_DELAY_MS", "15".into())]).await;
    let worker = |env: &Fleet| {
        let mut e = env.proc_env();
        e.push(("LH_KINDS", "agent-test".into()));
        e.push(("SIM_URL", sim.clone()));
        leasehold_harness::Proc::spawn("sdk-agent-worker", &[], &e)
    };
    // Journal entries as they are written (a core subscription on the
    // job's `agent` events).
    let mut journal = env
        .conn
        .client
        .subscribe(env.conn.layout.event_subject("ag-kill", "agent"))
        .await
        .unwrap();
    let mut a = worker(&env);
    env.submit("agent-test", json!({"input": {}}), "ag-kill")
        .await;
    // The thread, the search call and its result, the fetch call and its
    // result are durable: the third model call (the section) is in flight.
    for n in 0..5 {
        tokio::time::timeout(
            Duration::from_secs(30),
            futures::StreamExt::next(&mut journal),
        )
        .await
        .unwrap_or_else(|_| panic!("journal entry {n} never came"));
    }
    // The sim gives no signal when a request arrives: poll its counter
    // until the third call (the section, paced) is being answered.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sim_chat_requests(&sim).await < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the third call never came"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    a.kill9();
    assert_eq!(
        sim_chat_requests(&sim).await,
        3,
        "killed during the third call"
    );
    let _b = worker(&env);
    let rec = env
        .wait_for("ag-kill", Duration::from_secs(60), |r| {
            matches!(r.status.as_str(), "completed" | "failed" | "parked")
        })
        .await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    let out: Value = serde_json::from_str(&rec.result.unwrap().output).unwrap();
    assert!(out["text"].as_str().unwrap().contains("/page/"), "{out}");
    // The resumed conversation kept both tool results: one call repeated.
    assert_eq!(
        sim_chat_requests(&sim).await,
        4,
        "3 clean calls + the one in flight"
    );
    assert_eq!(out["model_calls"], 1, "the resumed attempt made one call");
}

/// A kind that checkpoints itself (as the research kind does): chapters as
/// its own fenced events, read back by the next attempt to resume after
/// the last durable one; its document in the artifact store, named by the
/// result; a checkpoint of a type the runtime owns refused.
struct Chapters {
    written: Arc<std::sync::Mutex<Vec<u64>>>,
}

#[leasehold::async_trait]
impl Kind for Chapters {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let done: Vec<u64> = ctx
            .events()
            .read(&["chapter"])
            .await?
            .iter()
            .filter_map(|(_, ev)| ev.data_map().get("n").and_then(Value::as_u64))
            .collect();
        let cp = ctx.checkpoints();
        // Refused: `completed` is the runtime's.
        cp.event("completed", json!({"forged": true}));
        let next = done.iter().max().map_or(0, |n| n + 1);
        for n in next..4 {
            cp.event("chapter", json!({"n": n}));
            cp.progress(leasehold::runtime::ProgressUpdate {
                phase: "chapters".into(),
                sections_done: n as u32 + 1,
                sections_total: 4,
                ..Default::default()
            });
            self.written.lock().unwrap().push(n);
            if n == 1 && ctx.failed_attempts() == 0 {
                cp.barrier().await.map_err(|_| Error::Cancelled)?;
                return Err(Error::retryable("the first attempt stops after chapter 1"));
            }
        }
        let store = ctx.artifacts().await?;
        let name = format!("{}/book.md", ctx.id());
        ctx.prove_owner().await?;
        let doc = b"# Book\n\nfour chapters";
        let fresh = store
            .create(
                leasehold::NewDocument {
                    name: name.clone(),
                    description: None,
                    metadata: [("made-by".to_string(), "chapters".to_string())].into(),
                },
                doc,
            )
            .await?;
        let back = store.get(&name).await?.expect("stored");
        ctx.set_report(leasehold::Report {
            artifact: name,
            digest: "d1".into(),
            partial: false,
            skipped_sections: vec![],
        });
        Ok(
            json!({"fresh": fresh, "text": back.text(), "made_by": back.metadata["made-by"], "resumed_at": next}),
        )
    }
}

#[tokio::test]
async fn a_kind_checkpoints_itself_resumes_from_its_events_and_names_its_document() {
    let mut o = SetupOptions {
        ack_wait: ACK_WAIT,
        ..SetupOptions::default()
    };
    o.kinds.push("chapters".into());
    let env = Fleet::with(o).await;
    let mut opts = env.opts();
    opts.kinds = vec!["chapters".into()];
    opts.retry_base = Duration::from_millis(10);
    opts.retry_cap = Duration::from_millis(20);
    let written = Arc::new(std::sync::Mutex::new(Vec::new()));
    let stop = CancellationToken::new();
    let _h = leasehold::Worker::new(opts)
        .kind(
            "chapters",
            Chapters {
                written: written.clone(),
            },
        )
        .start(stop.clone())
        .await
        .unwrap();
    env.submit("chapters", json!({"input": {}}), "ch-1").await;
    let rec = env
        .wait_for("ch-1", Duration::from_secs(20), |r| {
            matches!(r.status.as_str(), "completed" | "failed" | "parked")
        })
        .await;
    stop.cancel();
    assert_eq!(rec.status, "completed", "{rec:?}");
    assert_eq!(rec.attempts, 1, "one failed attempt before");
    // Chapters 0 and 1 were durable before the first attempt ended: the
    // second wrote only 2 and 3.
    assert_eq!(*written.lock().unwrap(), vec![0, 1, 2, 3]);
    let result = rec.result.clone().unwrap();
    let out: Value = serde_json::from_str(&result.output).unwrap();
    assert_eq!(out["resumed_at"], 2, "{out}");
    assert_eq!(out["fresh"], true);
    assert_eq!(out["made_by"], "chapters");
    assert_eq!(out["text"], "# Book\n\nfour chapters");
    assert_eq!(result.artifact.as_deref(), Some("ch-1/book.md"));
    assert_eq!(result.digest.as_deref(), Some("d1"));
    let p = rec.progress.clone().expect("progress on the record");
    assert_eq!(
        (p.phase.as_str(), p.sections_done, p.sections_total),
        ("chapters", 4, 4)
    );
    env.wait_event("ch-1", "completed", Duration::from_secs(10))
        .await;
    let events = env.events.read("ch-1").await.unwrap();
    let chapters: Vec<(u64, u64)> = events
        .iter()
        .filter(|(_, e)| e.r#type == "chapter")
        .map(|(_, e)| (e.epoch, e.data_map()["n"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        chapters,
        vec![(1, 0), (1, 1), (2, 2), (2, 3)],
        "each chapter once, in order, by its attempt"
    );
    let completed = events
        .iter()
        .filter(|(_, e)| e.r#type == "completed")
        .count();
    assert_eq!(
        completed, 1,
        "the forged `completed` was refused; only the runtime's landed"
    );
    assert!(
        events
            .iter()
            .all(|(_, e)| !e.data_map().contains_key("forged")),
        "no forged event"
    );
}

/// Two approval gates with a step between them.
struct Gates;

#[leasehold::async_trait]
impl Kind for Gates {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let first = ctx.park("approve-1", "First approval?").await?;
        let between: u64 = ctx.step("between", || async { Ok(1) }).await?;
        let second = ctx.park("approve-2", "Second approval?").await?;
        Ok(json!({"first": first, "second": second, "between": between}))
    }
}

/// G2: the answer to the first gate is that gate's only. The second park
/// of the resumed run parks and asks (reason `approve-2`); it never passes
/// with the first answer.
#[tokio::test]
async fn a_second_park_asks_again_and_never_takes_the_first_parks_answer() {
    let mut o = SetupOptions {
        ack_wait: ACK_WAIT,
        ..SetupOptions::default()
    };
    o.kinds.push("gates".into());
    let env = Fleet::with(o).await;
    let mut opts = env.opts();
    opts.kinds = vec!["gates".into()];
    let stop = CancellationToken::new();
    let _h = leasehold::Worker::new(opts)
        .kind("gates", Gates)
        .start(stop.clone())
        .await
        .unwrap();
    env.submit("gates", json!({"input": {}}), "gates-1").await;
    let rec = env
        .wait_status("gates-1", "parked", Duration::from_secs(20))
        .await;
    assert_eq!(rec.parked_reason.as_deref(), Some("approve-1"));
    let resume = |answer: &'static str| {
        let url = env.url();
        async move {
            let (code, _, err) =
                cli(&url, &["review", "resume", "gates-1", "--answer", answer]).await;
            assert_eq!(code, 0, "{err}");
        }
    };
    resume(r#"{"approve": 1}"#).await;
    let rec = env
        .wait_for("gates-1", Duration::from_secs(20), |r| {
            r.status == "completed"
                || (r.status == "parked" && r.parked_reason.as_deref() == Some("approve-2"))
        })
        .await;
    assert_eq!(rec.status, "parked", "the second gate asks: {rec:?}");
    assert_eq!(rec.parked_reason.as_deref(), Some("approve-2"));
    // The record is written before its `parked` event: wait for the event.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let parked: Vec<Value> = loop {
        let parked: Vec<Value> = env
            .events_of("gates-1")
            .await
            .iter()
            .filter(|e| e.r#type == "parked")
            .map(|e| e.data_map()["step"].clone())
            .collect();
        if parked.len() >= 2 || tokio::time::Instant::now() > deadline {
            break parked;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        parked,
        [json!("park#0"), json!("park#1")],
        "each park names its step"
    );
    resume(r#"{"approve": 2}"#).await;
    let rec = env
        .wait_status("gates-1", "completed", Duration::from_secs(20))
        .await;
    let out: Value = serde_json::from_str(&rec.result.unwrap().output).unwrap();
    assert_eq!(
        out,
        json!({"first": {"approve": 1}, "second": {"approve": 2}, "between": 1})
    );
    stop.cancel();
}

/// Three steps, counting how often each one's closure ran.
struct Three(Arc<[AtomicU32; 3]>);

#[leasehold::async_trait]
impl Kind for Three {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let mut out = Vec::new();
        for (i, name) in ["one", "two", "three"].into_iter().enumerate() {
            let n: u64 = ctx
                .step(name, || async {
                    self.0[i].fetch_add(1, Ordering::SeqCst);
                    Ok(i as u64 + 1)
                })
                .await?;
            out.push(n);
        }
        Ok(json!(out))
    }
}

/// G1: the PubAck of the second step's record is lost (it landed; NATS's
/// answer never came, as in a leader election). The job is not failed: the
/// record is tried again with the same message id, the duplicate is
/// recognised, and the step is recorded once and run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_record_whose_puback_is_lost_is_tried_again_not_the_jobs_end() {
    let mut o = SetupOptions {
        ack_wait: ACK_WAIT,
        ..SetupOptions::default()
    };
    o.kinds.push("three".into());
    let env = Fleet::with(o).await;
    let proxy = leasehold_harness::FaultProxy::start(&env.url()).await;
    let step = format!("{}.events.three-1.step", env.prefix);
    proxy.mute_reply_to(&step, 2);
    let mut opts = env.opts();
    opts.nats = leasehold_testkit::doors::layout::NatsArgs::local(proxy.url(), &env.prefix);
    opts.kinds = vec!["three".into()];
    let ran = Arc::new([AtomicU32::new(0), AtomicU32::new(0), AtomicU32::new(0)]);
    let stop = CancellationToken::new();
    let _h = leasehold::Worker::new(opts)
        .kind("three", Three(ran.clone()))
        .start(stop.clone())
        .await
        .unwrap();
    env.submit("three", json!({"input": {}}), "three-1").await;
    let rec = env
        .wait_for("three-1", Duration::from_secs(40), |r| {
            matches!(
                r.status.as_str(),
                "completed" | "failed" | "parked" | "dead"
            )
        })
        .await;
    stop.cancel();
    assert_eq!(rec.status, "completed", "{rec:?}");
    assert!(
        proxy.published(&step) >= 3,
        "the muted record was tried again"
    );
    let ran: Vec<u32> = ran.iter().map(|n| n.load(Ordering::SeqCst)).collect();
    assert_eq!(ran, [1, 1, 1], "each step ran once");
    let ids: Vec<String> = env
        .events_of("three-1")
        .await
        .iter()
        .filter(|e| e.r#type == "step")
        .map(|e| e.data_map()["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        ids,
        ["one#0", "two#0", "three#0"],
        "each step recorded once"
    );
}

/// A step whose closure asks for another step.
struct Nested;

#[leasehold::async_trait]
impl Kind for Nested {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let n: u64 = ctx
            .step("outer", || async {
                let inner: u64 = ctx.step("inner", || async { Ok(1) }).await?;
                Ok(inner + 1)
            })
            .await?;
        Ok(json!(n))
    }
}

/// G18: a step asked for inside another step's closure used to wait for
/// the journal its outer step holds, until the attempt's deadline (6 h by
/// default). It now ends the job at once with a terminal error naming both.
#[tokio::test]
async fn a_step_inside_a_steps_closure_fails_at_once_naming_both() {
    let mut o = SetupOptions {
        ack_wait: ACK_WAIT,
        ..SetupOptions::default()
    };
    o.kinds.push("nested".into());
    let env = Fleet::with(o).await;
    let mut opts = env.opts();
    opts.kinds = vec!["nested".into()];
    let stop = CancellationToken::new();
    let _h = leasehold::Worker::new(opts)
        .kind("nested", Nested)
        .start(stop.clone())
        .await
        .unwrap();
    env.submit("nested", json!({"input": {}}), "nested-1").await;
    let rec = env
        .wait_for("nested-1", Duration::from_secs(20), |r| {
            matches!(r.status.as_str(), "completed" | "failed" | "parked")
        })
        .await;
    stop.cancel();
    assert_eq!(rec.status, "failed", "{rec:?}");
    let msg = rec.error.map(|e| e.message).unwrap_or_default();
    assert!(
        msg.contains("`inner`") && msg.contains("`outer#0`"),
        "{msg}"
    );
}

/// G18: the PubAck of the agent's first journal entry is lost. The
/// conversation's writer used to stop there silently (later entries never
/// written, later model calls not waiting for durability); it now tries
/// again with the same message id: every entry lands, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_journal_entry_whose_puback_is_lost_is_tried_again_and_the_journal_goes_on() {
    let mut o = SetupOptions {
        ack_wait: ACK_WAIT,
        ..SetupOptions::default()
    };
    o.kinds.push("researcher".into());
    let env = Fleet::with(o).await;
    let (_sim, sim) = spawn_sim(&[]).await;
    let proxy = leasehold_harness::FaultProxy::start(&env.url()).await;
    let agent = format!("{}.events.ag-mute.agent", env.prefix);
    proxy.mute_reply_to(&agent, 1);
    let mut opts = env.opts();
    opts.nats = leasehold_testkit::doors::layout::NatsArgs::local(proxy.url(), &env.prefix);
    opts.kinds = vec!["researcher".into()];
    let model = leasehold::ModelConfig {
        base_url: format!("{sim}/v1"),
        ..Default::default()
    };
    let stop = CancellationToken::new();
    let counter = Arc::new(AtomicU32::new(0));
    let _h = leasehold::Worker::new(opts)
        .model("sim", model)
        .tool(Search(sim.clone(), counter.clone(), spec("search")))
        .tool(Fetch(counter.clone(), spec("fetch")))
        // Past its one retryable failure: the first attempt completes.
        .kind("researcher", Researcher(Arc::new(AtomicU32::new(1))))
        .start(stop.clone())
        .await
        .unwrap();
    env.submit("researcher", json!({"input": {}}), "ag-mute")
        .await;
    let rec = env
        .wait_for("ag-mute", Duration::from_secs(40), |r| {
            matches!(r.status.as_str(), "completed" | "failed" | "parked")
        })
        .await;
    stop.cancel();
    assert_eq!(rec.status, "completed", "{rec:?}");
    let events = env.events_of("ag-mute").await;
    let journal: Vec<&str> = events
        .iter()
        .filter(|e| e.r#type == "agent")
        .map(|e| e.data.as_str())
        .collect();
    assert!(journal.len() >= 5, "the journal went on: {journal:?}");
    let mut unique = journal.clone();
    unique.dedup();
    assert_eq!(unique.len(), journal.len(), "no entry twice");
    assert!(
        events.iter().any(|e| e.r#type == "model"),
        "the model calls' events were written"
    );
    assert!(
        proxy.published(&agent) > journal.len() as u64,
        "the muted entry was tried again"
    );
}

/// A kind that checkpoints three notes and waits until they are durable.
struct Notes;

#[leasehold::async_trait]
impl Kind for Notes {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let cp = ctx.checkpoints();
        for n in 0..3 {
            cp.event("note", json!({"n": n}));
        }
        cp.barrier().await.map_err(|_| Error::Cancelled)?;
        Ok(json!({"notes": 3}))
    }
}

/// The value of `family` (its samples summed) in a worker's metrics text.
fn metric_sum(text: &str, family: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(family) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// No process-wide observer: two workers in one process each count what
/// their own jobs report (here the checkpoint flushes of a job only the
/// first serves) in their own metrics, and nothing of the other's.
#[tokio::test]
async fn two_workers_in_one_process_count_their_own_jobs_in_their_own_metrics() {
    let mut o = SetupOptions {
        ack_wait: ACK_WAIT,
        ..SetupOptions::default()
    };
    o.kinds.push("notes".into());
    let env = Fleet::with(o).await;
    let stop = CancellationToken::new();
    let mut opts = env.opts();
    opts.kinds = vec!["notes".into()];
    let a = leasehold::Worker::new(opts)
        .kind("notes", Notes)
        .start(stop.clone())
        .await
        .unwrap();
    // The second serves another kind: the job can only run on the first.
    let mut opts = env.opts();
    opts.kinds = vec!["echo".into()];
    let b = leasehold::Worker::new(opts)
        .start(stop.clone())
        .await
        .unwrap();
    env.submit("notes", json!({"input": {}}), "notes-1").await;
    let rec = env
        .wait_status("notes-1", "completed", Duration::from_secs(20))
        .await;
    assert_eq!(rec.status, "completed");
    let family = "leasehold_checkpoint_events_total";
    let (ta, tb) = (a.metrics.encode(), b.metrics.encode());
    assert!(metric_sum(&ta, family) >= 3.0, "{ta}");
    assert_eq!(metric_sum(&tb, family), 0.0, "{tb}");
    stop.cancel();
}
