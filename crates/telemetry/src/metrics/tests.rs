//! Tests of the worker's and the reaper's series as a scrape shows them.

use super::*;
use std::collections::BTreeMap;
use std::time::Duration;

use crate::observe::{EffectOutcome, ModelRequest, Observer, ToolOutcome};

/// The value of the sample line that starts with `prefix` (name and labels).
fn sample(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix) && l[prefix.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn worker_counters_histograms_and_gauges() {
    let m = Metrics::new();
    m.claimed("echo");
    m.claimed("echo");
    m.reclaimed("echo");
    m.rejected("research");
    let t = m.attempt_started("echo");
    let running = m.encode();
    assert_eq!(
        sample(&running, "leasehold_jobs_in_flight{kind=\"echo\"}"),
        Some(1.0)
    );
    t.finish(AttemptOutcome::Completed);
    m.attempt_finished("echo", AttemptOutcome::Retried, Duration::from_millis(70));
    drop(m.attempt_started("sleep")); // a panicked task: gauge back, nothing else
    let text = m.encode();
    assert_eq!(
        sample(&text, "leasehold_jobs_claimed_total{kind=\"echo\"}"),
        Some(2.0)
    );
    assert_eq!(
        sample(&text, "leasehold_jobs_reclaimed_total{kind=\"echo\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "leasehold_jobs_rejected_total{kind=\"research\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "leasehold_jobs_completed_total{kind=\"echo\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "leasehold_jobs_retried_total{kind=\"echo\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "leasehold_jobs_in_flight{kind=\"echo\"}"),
        Some(0.0)
    );
    assert_eq!(
        sample(&text, "leasehold_jobs_in_flight{kind=\"sleep\"}"),
        Some(0.0)
    );
    assert_eq!(
        sample(
            &text,
            "leasehold_attempt_duration_seconds_count{kind=\"echo\",outcome=\"retried\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            "leasehold_attempt_duration_seconds_bucket{le=\"0.1\",kind=\"echo\",outcome=\"retried\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert!(text.contains("# TYPE leasehold_attempt_duration_seconds histogram"));
    assert!(text.contains("leasehold_build_info{service=\"leasehold-worker\""));
    assert!(text.ends_with("# EOF\n"));
}

#[test]
fn session_lag_appears_after_the_first_renewal() {
    let m = Metrics::new();
    assert!(!m.encode().contains("leasehold_session_renewal_lag"));
    m.session_renewal(Renewal::Failed);
    assert!(!m.encode().contains("leasehold_session_renewal_lag"));
    m.session_renewal(Renewal::Ok);
    std::thread::sleep(Duration::from_millis(20));
    let text = m.encode();
    let lag = sample(&text, "leasehold_session_renewal_lag_seconds").expect("lag");
    assert!((0.02..5.0).contains(&lag), "{lag}");
    assert!(text.contains("# TYPE leasehold_session_renewal_lag_seconds gauge"));
    assert_eq!(
        sample(
            &text,
            "leasehold_session_renewals_total{outcome=\"failed\"}"
        ),
        Some(1.0)
    );
}

#[test]
fn observer_events_land_in_the_worker_families() {
    let m = Metrics::new();
    let o: &dyn Observer = &m;
    o.model_request(&ModelRequest {
        model: "sim-1",
        outcome: "ok",
        input_tokens: 120,
        output_tokens: 30,
        elapsed: Duration::from_millis(400),
    });
    o.model_request(&ModelRequest {
        model: "sim-1",
        outcome: "rate_limited",
        input_tokens: 0,
        output_tokens: 0,
        elapsed: Duration::from_millis(5),
    });
    o.model_retry("rate_limited");
    o.tool_call("search", ToolOutcome::Ok);
    o.tool_call("fetch", ToolOutcome::Refused);
    o.effect("publish", EffectOutcome::Replayed);
    o.checkpoint_flush(Duration::from_millis(3), 4);
    o.flow_admission("sim-1", "admitted");
    o.flow_admission("sim-1", "admitted");
    o.flow_admission("sim-1", "waited");
    o.flow_pause("sim-1", "cooldown");
    o.flow_limit("sim-1", "rpm", 600.0, 150.0);
    let text = m.encode();
    for (prefix, v) in [
        (
            "leasehold_model_requests_total{model=\"sim-1\",outcome=\"ok\"}",
            1.0,
        ),
        (
            "leasehold_model_requests_total{model=\"sim-1\",outcome=\"rate_limited\"}",
            1.0,
        ),
        (
            "leasehold_model_tokens_total{model=\"sim-1\",direction=\"input\"}",
            120.0,
        ),
        (
            "leasehold_model_tokens_total{model=\"sim-1\",direction=\"output\"}",
            30.0,
        ),
        ("leasehold_model_retries_total{class=\"rate_limited\"}", 1.0),
        (
            "leasehold_model_request_duration_seconds_count{model=\"sim-1\"}",
            2.0,
        ),
        (
            "leasehold_tool_calls_total{tool=\"search\",outcome=\"ok\"}",
            1.0,
        ),
        (
            "leasehold_tool_calls_total{tool=\"fetch\",outcome=\"refused\"}",
            1.0,
        ),
        (
            "leasehold_effects_total{tool=\"publish\",outcome=\"replayed\"}",
            1.0,
        ),
        ("leasehold_checkpoint_flush_duration_seconds_count", 1.0),
        ("leasehold_checkpoint_events_total", 4.0),
        (
            "leasehold_flow_requests_total{model=\"sim-1\",outcome=\"admitted\"}",
            2.0,
        ),
        (
            "leasehold_flow_requests_total{model=\"sim-1\",outcome=\"waited\"}",
            1.0,
        ),
        (
            "leasehold_flow_pauses_total{model=\"sim-1\",kind=\"cooldown\"}",
            1.0,
        ),
        ("leasehold_flow_limit{model=\"sim-1\",limit=\"rpm\"}", 600.0),
        ("leasehold_flow_slice{model=\"sim-1\",limit=\"rpm\"}", 150.0),
    ] {
        assert_eq!(sample(&text, prefix), Some(v), "{prefix}\n{text}");
    }
}

#[test]
fn reaper_series_carry_the_replica_label() {
    let m = ReaperMetrics::new("r-1");
    m.sweep_finished(Duration::from_millis(12));
    m.recovered(2);
    m.dead_lettered("poison", 1);
    m.advisories(3);
    let mut s = FleetSnapshot {
        jobs: 10,
        queued: Some(4),
        queue_bytes: 2048,
        queue_max_msgs: 1000,
        queue_max_bytes: 1 << 20,
        in_flight: 6,
        parked: 1,
        oldest_in_flight_age: Some(Duration::from_secs(90)),
        dead_letters: BTreeMap::from([("research".into(), 2), ("echo".into(), 1)]),
    };
    m.fleet(&s);
    let text = m.encode();
    for (prefix, v) in [
        ("leasehold_reaper_sweeps_total{replica=\"r-1\"}", 1.0),
        (
            "leasehold_reaper_sweep_duration_seconds_count{replica=\"r-1\"}",
            1.0,
        ),
        ("leasehold_reaper_recoveries_total{replica=\"r-1\"}", 2.0),
        (
            "leasehold_reaper_dead_lettered_total{replica=\"r-1\",class=\"poison\"}",
            1.0,
        ),
        ("leasehold_reaper_advisories_total{replica=\"r-1\"}", 3.0),
        ("leasehold_fleet_jobs{replica=\"r-1\"}", 10.0),
        ("leasehold_fleet_queue_depth{replica=\"r-1\"}", 4.0),
        ("leasehold_fleet_queue_bytes{replica=\"r-1\"}", 2048.0),
        (
            "leasehold_fleet_queue_limit_messages{replica=\"r-1\"}",
            1000.0,
        ),
        (
            "leasehold_fleet_queue_limit_bytes{replica=\"r-1\"}",
            1048576.0,
        ),
        ("leasehold_fleet_jobs_in_flight{replica=\"r-1\"}", 6.0),
        ("leasehold_fleet_jobs_parked{replica=\"r-1\"}", 1.0),
        (
            "leasehold_fleet_oldest_in_flight_age_seconds{replica=\"r-1\"}",
            90.0,
        ),
        (
            "leasehold_fleet_dead_letters{replica=\"r-1\",kind=\"echo\"}",
            1.0,
        ),
    ] {
        assert_eq!(sample(&text, prefix), Some(v), "{prefix}\n{text}");
    }
    // A purged kind goes away; an unknown queue depth is left alone.
    s.dead_letters.remove("echo");
    s.queued = None;
    m.fleet(&s);
    let text = m.encode();
    assert!(!text.contains("kind=\"echo\""), "{text}");
    assert_eq!(
        sample(&text, "leasehold_fleet_queue_depth{replica=\"r-1\"}"),
        Some(4.0)
    );
}
