//! Real research jobs against providers that differ (the sim's provider
//! modes) and against endpoints that are misconfigured: the runtime adapts
//! where it can, and ends a job at once with its cause where it cannot.

use std::time::{Duration, Instant};

use leasehold::JobRecord;
use serde_json::{json, Value};
use tokio::io::AsyncReadExt;

use leasehold_testkit::*;

async fn sim_json_stats(sim: &str) -> Value {
    sim_json(sim, "GET", "/stats", None).await
}

async fn submit_research(env: &Fleet, id: &str, topic: &str) {
    env.submit(
        "research",
        json!({"input": {"topic": topic, "experts": 2, "sections": 2}}),
        id,
    )
    .await;
}

async fn ended(env: &Fleet, id: &str, within: Duration) -> JobRecord {
    env.wait_for(id, within, |r| {
        matches!(
            r.status.as_str(),
            "completed" | "failed" | "parked" | "dead" | "rejected"
        )
    })
    .await
}

async fn artifact(env: &Fleet, rec: &JobRecord) -> String {
    let name = rec.result.clone().unwrap().artifact.unwrap();
    let store = env
        .conn
        .js
        .get_object_store(env.conn.layout.artifacts_bucket())
        .await
        .unwrap();
    let mut obj = store.get(&name).await.unwrap();
    let mut text = String::new();
    obj.read_to_string(&mut text).await.unwrap();
    text
}

fn retry_reasons(events: &[leasehold_proto::JobEvent]) -> Vec<String> {
    events
        .iter()
        .filter(|e| e.r#type == "retry")
        .map(|e| e.data_map()["reason"].as_str().unwrap_or("").to_string())
        .collect()
}

#[tokio::test]
async fn research_on_a_server_that_refuses_json_schema_uses_json_object_from_its_first_refusal() {
    let env = Fleet::start().await;
    let (_sim, sim) = spawn_sim(&[("LH_SIM_PROVIDER", "llama-cpp".into())]).await;
    let _w = research_worker(&env, &sim, &format!("{sim}/v1"), &[]);
    submit_research(&env, "r-llama", "lease-based ownership").await;
    let rec = ended(&env, "r-llama", Duration::from_secs(60)).await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    // This server ignores native tools: the report says its sections had none.
    let doc = artifact(&env, &rec).await;
    assert!(
        doc.contains("- Sections written without tools (no search or fetch): 4 of 4"),
        "{doc}"
    );
    let stats = sim_json_stats(&sim).await;
    // One refusal for the worker process, then the form it takes.
    assert_eq!(stats["response_formats"]["json_schema"], 1, "{stats}");
    assert!(
        stats["response_formats"]["json_object_schema"]
            .as_u64()
            .unwrap()
            >= 2
    );
    let events = env.events_of("r-llama").await;
    let reasons = retry_reasons(&events);
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("json_schema refused; json_object from now on")),
        "{reasons:?}"
    );
    // Every outline and perspectives payload validates.
    for e in events.iter().filter(|e| e.r#type == "phase") {
        let d = e.data_map();
        match d["phase"].as_str() {
            Some("outline") => assert_eq!(
                d["payload"]["sections"].as_array().map(Vec::len),
                Some(2),
                "{d:?}"
            ),
            Some("perspectives") => {
                assert_eq!(d["payload"].as_array().map(Vec::len), Some(2), "{d:?}")
            }
            _ => {}
        }
    }
}

#[tokio::test]
async fn research_on_a_server_without_tool_calling_runs_its_tools_through_the_text_protocol() {
    let env = Fleet::start().await;
    let (_sim, sim) = spawn_sim(&[("LH_SIM_PROVIDER", "llama-cpp".into())]).await;
    let _w = research_worker(
        &env,
        &sim,
        &format!("{sim}/v1"),
        &[("LH_MODEL_TOOLS", "text")],
    );
    submit_research(&env, "r-text", "lease-based ownership").await;
    let rec = ended(&env, "r-text", Duration::from_secs(60)).await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    let stats = sim_json_stats(&sim).await;
    assert_eq!(stats["tools_offered"], 0, "no native tools sent: {stats}");
    // Each of the 4 expert sections searched and fetched through the protocol.
    assert!(stats["text_tool_calls"].as_u64().unwrap() >= 8, "{stats}");
    let tools = env
        .events_of("r-text")
        .await
        .into_iter()
        .filter(|e| e.r#type == "tool")
        .count();
    assert!(tools >= 8, "tool events: {tools}");
}

#[tokio::test]
async fn a_forced_form_and_bad_mode_values_are_clear_errors() {
    let env = Fleet::start().await;
    let (_sim, sim) = spawn_sim(&[("LH_SIM_PROVIDER", "llama-cpp".into())]).await;
    // Bad values stop the worker at start, naming the variable.
    for (k, v) in [
        ("LH_MODEL_STRUCTURED", "json"),
        ("LH_MODEL_TOOLS", "yes"),
        ("LH_MODEL_MAX_TOKENS", "0"),
    ] {
        let mut w = research_worker(&env, &sim, &format!("{sim}/v1"), &[(k, v)]);
        let st = w.wait_timeout(Duration::from_secs(10));
        assert_eq!(
            st.and_then(|s| s.code()),
            Some(2),
            "{k}={v}: {}",
            w.output()
        );
        assert!(w.output().contains(k), "{}", w.output());
    }
    // A form the provider refuses, forced: the job fails at once with the setting.
    let _w = research_worker(
        &env,
        &sim,
        &format!("{sim}/v1"),
        &[("LH_MODEL_STRUCTURED", "json_schema")],
    );
    let started = Instant::now();
    submit_research(&env, "r-forced", "t").await;
    let rec = ended(&env, "r-forced", Duration::from_secs(20)).await;
    assert_eq!(rec.status, "failed", "{rec:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    let error = rec
        .error
        .as_ref()
        .map(|e| e.message.clone())
        .unwrap_or_default();
    assert!(error.contains("LH_MODEL_STRUCTURED"), "{error}");
    assert_eq!(
        sim_json_stats(&sim).await["response_formats"]["json_schema"],
        1,
        "never retried"
    );
}

/// A job against a misconfigured endpoint ends within 10 s, failed, with
/// the cause and the setting to change.
async fn ends_with_its_cause(env: &Fleet, sim: &str, model_base: &str, id: &str, cause: &[&str]) {
    let mut w = research_worker(env, sim, model_base, &[]);
    let started = Instant::now();
    submit_research(env, id, "t").await;
    let rec = ended(env, id, Duration::from_secs(30)).await;
    let took = started.elapsed();
    assert_eq!(rec.status, "failed", "{id}: {rec:?}");
    assert!(took < Duration::from_secs(10), "{id} took {took:?}");
    let error = rec
        .error
        .as_ref()
        .map(|e| e.message.clone())
        .unwrap_or_default();
    for c in cause {
        assert!(error.contains(c), "{id}: {c:?} not in {error:?}");
    }
    assert!(!error.contains("circuit"), "{error}");
    assert_eq!(rec.attempts, 1, "{id}: not retried at job level");
    w.kill9();
}

#[tokio::test]
async fn misconfigured_model_endpoints_end_the_job_within_seconds_with_their_cause() {
    let env = Fleet::start().await;
    let (_sim, sim) = spawn_sim(&[]).await;
    // Nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let refused = format!("http://127.0.0.1:{port}/v1");
    let mut w = research_worker(&env, &sim, &refused, &[]);
    wait_log(&w, "model endpoint check at start", Duration::from_secs(10)).await;
    w.kill9();
    ends_with_its_cause(
        &env,
        &sim,
        &refused,
        "r-refused",
        &["cannot reach the model endpoint", "LH_MODEL_BASE_URL"],
    )
    .await;
    // A web server, not the API; a wrong path; a wrong key.
    for (fault, id, cause) in [
        ("html", "r-html", &["text/html", "LH_MODEL_BASE_URL"][..]),
        ("not_found", "r-404", &["HTTP 404", "LH_MODEL_BASE_URL"]),
        ("unauthorized", "r-401", &["HTTP 401", "LH_API_KEY"]),
    ] {
        let rules = std::env::temp_dir().join(format!("lh-{fault}-{}.json", std::process::id()));
        std::fs::write(&rules, json!({"rules": [{"kind": fault}]}).to_string()).unwrap();
        let (_bad, bad) = spawn_sim(&[("LH_SIM_FAULTS", rules.display().to_string())]).await;
        ends_with_its_cause(&env, &sim, &format!("{bad}/v1"), id, cause).await;
        let _ = std::fs::remove_file(rules);
    }
}

#[tokio::test]
async fn one_prompt_that_always_fails_neither_opens_the_breaker_nor_slows_the_other_jobs() {
    let env = Fleet::start().await;
    let rules = std::env::temp_dir().join(format!("lh-poison-{}.json", std::process::id()));
    std::fs::write(
        &rules,
        json!({"rules": [{"kind": "server_error", "match": "of a report on \"poison\""}]})
            .to_string(),
    )
    .unwrap();
    let (_sim, sim) = spawn_sim(&[("LH_SIM_FAULTS", rules.display().to_string())]).await;
    // The default breaker (10 calls, 50%) on one worker serving both jobs.
    let _w = research_worker(&env, &sim, &format!("{sim}/v1"), &[]);
    submit_research(&env, "r-poison", "poison").await;
    submit_research(&env, "r-healthy", "healthy").await;
    let healthy = ended(&env, "r-healthy", Duration::from_secs(60)).await;
    assert_eq!(healthy.status, "completed", "{healthy:?}");
    let reasons = retry_reasons(&env.events_of("r-healthy").await);
    assert!(
        reasons.is_empty(),
        "the healthy job never waited or retried: {reasons:?}"
    );
    let poison = ended(&env, "r-poison", Duration::from_secs(120)).await;
    let reasons = retry_reasons(&env.events_of("r-poison").await);
    assert!(
        !reasons.iter().any(|r| r.starts_with("circuit_open")),
        "one failing request is not a storm: {reasons:?}"
    );
    assert!(
        matches!(poison.status.as_str(), "completed" | "failed"),
        "{poison:?}"
    );
    let _ = std::fs::remove_file(rules);
}

#[tokio::test]
async fn model_check_probes_each_provider_mode_and_says_what_to_set() {
    let check = |base: String, extra: Vec<(&'static str, &'static str)>| async move {
        let mut cmd = tokio::process::Command::new(leasehold_harness::bin_path("leasehold"));
        cmd.args(["model", "check", "--context-probe-chars", "20000"])
            .env("LH_MODEL_BASE_URL", format!("{base}/v1"));
        for (k, v) in extra {
            cmd.env(k, v);
        }
        let out = cmd.output().await.unwrap();
        let report: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
        (
            out.status.code(),
            report,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let status = |r: &Value, path: &str| {
        r.pointer(path)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    let ctx = ("LH_SIM_CONTEXT_CHARS", "10000".to_string());
    // openai
    let (_s, base) = spawn_sim(std::slice::from_ref(&ctx)).await;
    let (code, r, err) = check(base, vec![]).await;
    assert_eq!(code, Some(0), "{err}\n{r}");
    assert_eq!(
        status(&r, "/capabilities/structured/json_schema/status"),
        "supported"
    );
    assert_eq!(
        status(&r, "/capabilities/streaming_usage/status"),
        "supported"
    );
    assert_eq!(
        status(&r, "/capabilities/tools/native/status"),
        "supported",
        "{r}"
    );
    assert_eq!(
        status(&r, "/capabilities/context_error/status"),
        "supported"
    );
    assert_eq!(r["workload"]["structured_form"], "json_schema");
    // llama-cpp: json_schema refused, json_object with a schema works, no tools.
    let (_s, base) = spawn_sim(&[("LH_SIM_PROVIDER", "llama-cpp".into()), ctx.clone()]).await;
    let (code, r, err) = check(base.clone(), vec![]).await;
    assert_eq!(code, Some(0), "{err}\n{r}");
    assert_eq!(
        status(&r, "/capabilities/structured/json_schema/status"),
        "unsupported"
    );
    assert_eq!(
        status(&r, "/capabilities/structured/json_object/status"),
        "supported"
    );
    assert_eq!(
        status(&r, "/capabilities/tools/native/status"),
        "unsupported"
    );
    assert_eq!(
        status(&r, "/capabilities/tools/text/status"),
        "supported",
        "{r}"
    );
    assert_eq!(r["workload"]["structured_form"], "json_object");
    assert_eq!(r["workload"]["runs"], true);
    // The same server with json_schema forced: cannot run, and what to set.
    let (code, r, err) = check(base, vec![("LH_MODEL_STRUCTURED", "json_schema")]).await;
    assert_eq!(code, Some(1), "{r}");
    assert_eq!(r["workload"]["runs"], false);
    assert!(err.contains("LH_MODEL_STRUCTURED=json_object"), "{err}");
    // vllm: its top-level error object is read as a context error.
    let (_s, base) = spawn_sim(&[("LH_SIM_PROVIDER", "vllm".into()), ctx.clone()]).await;
    let (code, r, _) = check(base, vec![]).await;
    assert_eq!(code, Some(0));
    assert_eq!(
        status(&r, "/capabilities/context_error/status"),
        "supported",
        "{r}"
    );
    // ollama: no usage chunk, a silent truncation.
    let (_s, base) = spawn_sim(&[("LH_SIM_PROVIDER", "ollama".into()), ctx]).await;
    let (code, r, _) = check(base, vec![]).await;
    assert_eq!(code, Some(0));
    assert_eq!(
        status(&r, "/capabilities/streaming_usage/status"),
        "unsupported"
    );
    assert_eq!(
        status(&r, "/capabilities/context_error/status"),
        "unsupported"
    );
    assert_eq!(
        status(&r, "/capabilities/tools/native/status"),
        "supported",
        "{r}"
    );
}
