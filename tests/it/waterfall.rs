//! A job's waterfall in the console against a real fleet: a research job
//! killed -9 mid-section (the simulator serves the model) and finished by
//! a second worker, seen in Chromium with the repeated model call marked;
//! and a job of 10,000 events drawn small, a refresh reading only what
//! landed since.

use std::time::{Duration, SystemTime};

use leasehold::JobRecord;
use serde_json::json;

use crate::console::{http, spawn_console, Browser};
use crate::research::exited;
use leasehold_testkit::{research_env, spawn_sim, Fleet};

#[tokio::test]
async fn waterfall_in_a_browser_marks_the_model_call_a_kill9_mid_section_repeated() {
    let env = Fleet::start().await;
    let (_sim, sim) = spawn_sim(&[]).await;
    let mut renv = research_env(&sim, &format!("{sim}/v1"), "research");
    // The first journaled response is a tool proposal whose tool never
    // runs: the reclaiming worker drops it and asks again.
    renv.push(("LH_RESEARCH_CRASH_AT", "after_model_response:1".into()));
    renv.push(("LH_RESEARCH_EXPERT_CONCURRENCY", "1".into()));
    let mut a = env.worker_proc(&[], &renv);
    let spec = json!({"input": {"topic": "lease-based ownership in distributed systems", "experts": 2, "sections": 2}});
    env.submit("research", spec, "wf-kill").await;
    exited(&mut a, Duration::from_secs(30)).await;
    assert!(
        a.output().contains("LH_RESEARCH_CRASH_AT reached"),
        "{}",
        a.output()
    );
    let _b = env.worker_proc(&[], &renv);
    let rec = env
        .wait_for("wf-kill", Duration::from_secs(60), |r| {
            matches!(r.status.as_str(), "completed" | "failed" | "dead")
        })
        .await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    assert_eq!(rec.stale_reclaims, 1);
    let console = spawn_console(&env, &[]).await;
    let mut br = Browser::start().await;
    br.goto(&format!("{}/jobs/wf-kill", console.base)).await;
    br.wait(
        "document.querySelector('#waterfall svg')",
        Duration::from_secs(20),
        "the waterfall",
    )
    .await;
    let marked = br
        .eval("Array.from(document.querySelectorAll('#waterfall [data-repeated=true]'), e => [e.getAttribute('class'), e.querySelector('title').textContent, e.closest('a').getAttribute('href')])")
        .await;
    let marked = marked.as_array().cloned().unwrap_or_default();
    assert_eq!(marked.len(), 1, "one repeated model call: {marked:?}");
    assert_eq!(marked[0][0], json!("wf-model repeated"));
    let title = marked[0][1].as_str().unwrap_or("");
    assert!(title.contains("REPEATED: repeats model call #"), "{title}");
    // A click on it goes to its row in the timeline, a model call of epoch 2.
    let href = marked[0][2].as_str().unwrap_or("").to_string();
    assert!(href.starts_with("#ev-"), "{href}");
    let row = br
        .eval(&format!(
            "(() => {{ const r = document.getElementById({}); return r ? [r.className, r.children[2].innerText] : null; }})()",
            json!(&href[1..])
        ))
        .await;
    assert_eq!(row, json!(["ev ev-model", "2"]), "the row of {href}");
    // The attempt bars name both workers.
    let workers = br
        .eval("Array.from(new Set(Array.from(document.querySelectorAll('#waterfall [data-worker]'), e => e.dataset.worker)))")
        .await;
    assert_eq!(workers.as_array().map_or(0, Vec::len), 2, "{workers}");
    let text = br
        .eval("Array.from(document.querySelectorAll('#waterfall .wf-on'), e => e.textContent).join(' | ')")
        .await;
    let text = text.as_str().unwrap_or("");
    assert!(
        text.contains("reclaimed") && text.contains("completed"),
        "{text}"
    );
    // The legend says what the mark means.
    let legend = br
        .eval("document.querySelector('.wf-legend').innerText")
        .await;
    assert!(
        legend.as_str().unwrap_or("").contains("repeated"),
        "{legend}"
    );
}

/// `n` events of a research-like job over an hour: a claim, then model
/// calls and journal entries in 2 experts' sections (as the bench seeds).
fn long_job(id: &str, n: usize, from_ms: u64) -> Vec<leasehold_proto::JobEvent> {
    let t0 = SystemTime::now() - Duration::from_secs(3600);
    (0..n as u64)
        .map(|k| {
            let k = k + from_ms;
            let (ty, data) = match k {
                0 => ("claimed", json!({"attempts": 0, "stale_reclaims": 0})),
                k if k % 2 == 1 => ("model", json!({"model": "sim-1", "tokens_in": 900, "tokens_out": 200, "duration_ms": 300, "first_token_ms": 40, "outcome": "ok", "expert": k % 4 / 2, "index": k / 2000})),
                k => ("journal", json!({"expert": k % 4 / 2, "index": k / 2000, "entry": {"op": "message", "generation": 0, "message": {"role": "assistant", "content": "text"}}})),
            };
            let mut e = leasehold_testkit::record::event(id, 1, ty, Some("w-1"), data);
            e.at = leasehold_testkit::record::rfc3339(t0 + Duration::from_millis(k * 350));
            e
        })
        .collect()
}

async fn events_read(base: &str) -> u64 {
    crate::console_cost::metric(base, None, "leasehold_console_waterfall_events_read_total").await
        as u64
}

#[tokio::test]
async fn waterfall_of_10000_events_is_small_and_a_refresh_reads_only_the_new_ones() {
    let env = Fleet::start().await;
    let now = leasehold_testkit::record::now();
    let rec = JobRecord {
        id: "wf-long".into(),
        kind: "research".into(),
        status: "running".into(),
        epoch: 1,
        created_at: now.clone(),
        updated_at: now,
        ..Default::default()
    };
    env.jobs.create(&rec).await.unwrap();
    // In batches: the client holds a bounded number of unacknowledged publishes.
    for batch in long_job("wf-long", 10_000, 0).chunks(1000) {
        env.events.seed(batch).await.unwrap();
    }
    let console = spawn_console(&env, &[]).await;
    let base = &console.base;
    let c = http();
    let get = |path: String| {
        let c = c.clone();
        async move {
            let r = c.get(path).send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    let (status, body) = get(format!("{base}/jobs/wf-long/waterfall")).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("<svg") && body.contains("10000 events"),
        "{}",
        &body[..body.len().min(2000)]
    );
    assert!(body.len() < 300_000, "{} bytes", body.len());
    assert!(body.contains("data-count="), "tiny calls aggregated");
    assert_eq!(events_read(base).await, 10_000);
    // Ten more events: the next request reads those ten only.
    env.events
        .seed(&long_job("wf-long", 10, 10_000))
        .await
        .unwrap();
    let (status, body) = get(format!("{base}/jobs/wf-long/waterfall")).await;
    assert_eq!(status, 200);
    assert!(
        body.contains("10010 events"),
        "{}",
        &body[..body.len().min(2000)]
    );
    assert_eq!(
        events_read(base).await,
        10_010,
        "the refresh read only the new events"
    );
    // The job page shows the same picture above its timeline.
    let (status, page) = get(format!("{base}/jobs/wf-long?limit=50")).await;
    assert_eq!(status, 200);
    let (wf, tl) = (page.find("id=\"waterfall\""), page.find("<h2>Timeline"));
    assert!(
        wf.is_some() && wf < tl,
        "the waterfall is above the timeline"
    );
    assert!(
        page.contains("id=\"ev-"),
        "timeline rows have ids to link to"
    );
    // Bad input: an unknown job, a bad id, an unknown parameter.
    assert_eq!(get(format!("{base}/jobs/nope/waterfall")).await.0, 404);
    assert_eq!(get(format!("{base}/jobs/a*b/waterfall")).await.0, 400);
    assert_eq!(
        get(format!("{base}/jobs/wf-long/waterfall?x=1")).await.0,
        400
    );
}
