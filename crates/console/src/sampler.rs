//! The one task that fills the fleet's charts' ring ([`crate::charts`]),
//! always running from the console's start, whoever looks:
//!
//! - every `--chart-interval`, the gauges: tickets per subject of the work
//!   stream (kinds and lanes: one stream-info request), the live worker
//!   sessions and their slots (1 + one read per worker), the index's
//!   counts per status and jobs in flight (kept by the feed's index view,
//!   no pass over it), the provider keys cooling down now;
//! - an ordered consumer of the terminal, `claimed` and `retry` events
//!   from one window ago, then live: completed and failed per interval,
//!   failures by class, 429s, submit->start (a sample: the record's
//!   `created_at`, at most [`RECORD_READS`] reads a second) and run time
//!   (claim to end, for at most [`CLAIMS_MAX`] jobs running at once);
//! - a watch of the pauses in `lh_flow`: cooldowns started per key.
//!
//! What a sample costs the store is counted in
//! `leasehold_console_chart_reads_total`: it depends on the lanes, kinds
//! and workers, never on how many jobs there are.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::{Stream, StreamExt};
use leasehold_proto::JobEvent;
use leasehold_store::flow::{FlowStore, PauseKind};

use crate::app::App;
use crate::charts::{bounded, bump, Gauges, Ring, Sample, SAMPLES};

/// Record reads a second for the submit->start sample.
pub const RECORD_READS: u32 = 20;
/// Jobs whose claim time is remembered for their run time.
pub const CLAIMS_MAX: usize = 20_000;
/// The event types the sampler follows.
const TYPES: &[&str] = &[
    "completed",
    "failed",
    "cancelled",
    "dead",
    "rejected",
    "claimed",
    "retry",
];

/// The ring, shared by the sampler and the pages.
pub struct Charts {
    pub ring: Mutex<Ring>,
}

impl Charts {
    pub fn new(interval: Duration) -> Charts {
        Charts {
            ring: Mutex::new(Ring::new(interval, SAMPLES)),
        }
    }

    /// A copy of the ring (360 samples: what a page or the API reads).
    pub fn snapshot(&self) -> Ring {
        self.ring.lock().expect("charts lock").clone()
    }
}

type Boxed<T> = Pin<Box<dyn Stream<Item = T> + Send>>;

/// What the event flow remembers between events.
#[derive(Default)]
struct Flow {
    last_seq: u64,
    /// Job -> its latest claim's time (for its run time).
    claims: HashMap<String, SystemTime>,
    /// Record reads this second.
    second: Option<tokio::time::Instant>,
    reads: u32,
}

/// Provider key -> the end of its cooldown (ms since the epoch).
type Cooling = BTreeMap<String, u64>;

/// The task: samples every interval, follows the events and the pauses;
/// a source that fails is opened again at the next sample.
pub async fn run(app: Arc<App>) {
    let interval = app.charts.ring.lock().expect("charts lock").interval();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut events: Option<Boxed<(u64, JobEvent)>> = None;
    let mut pauses: Option<Boxed<(PauseKind, String, leasehold_flow::Pause)>> = None;
    let mut flow = Flow::default();
    let mut cooling = Cooling::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if events.is_none() {
                    events = open_events(&app).await;
                }
                if pauses.is_none() {
                    pauses = open_pauses(&app).await;
                }
                sample(&app, &cooling).await;
            }
            x = next(&mut events) => match x {
                Some((seq, ev)) => on_event(&app, &mut flow, seq, &ev).await,
                None => events = None,
            },
            x = next(&mut pauses) => match x {
                Some((PauseKind::Cooldown, id, p)) => on_pause(&app, &mut cooling, &id, p.until_ms),
                Some(_) => {}
                None => pauses = None,
            },
        }
    }
}

/// The next item of `s`, or never while there is no stream.
async fn next<T>(s: &mut Option<Boxed<T>>) -> Option<T> {
    match s {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

/// The ordered consumer of the last window's events, then the live ones.
async fn open_events(app: &App) -> Option<Boxed<(u64, JobEvent)>> {
    let window = {
        let r = app.charts.ring.lock().expect("charts lock");
        r.interval() * r.cap() as u32
    };
    match app
        .events
        .follow_types_since(TYPES, SystemTime::now() - window)
        .await
    {
        Ok(s) => Some(Box::pin(s.filter_map(|x| async move { x.ok() }))),
        Err(e) => {
            tracing::warn!(error = %e, "charts: following the events failed; again at the next sample");
            None
        }
    }
}

/// The watch of the pauses in `lh_flow`.
async fn open_pauses(app: &App) -> Option<Boxed<(PauseKind, String, leasehold_flow::Pause)>> {
    let r = async {
        let f = FlowStore::open(&app.conn).await?;
        f.watch_pauses().await
    };
    match r.await {
        Ok(s) => Some(Box::pin(s)),
        Err(e) => {
            tracing::debug!(error = %e, "charts: watching the pauses failed; again at the next sample");
            None
        }
    }
}

/// Reads the gauges and puts them in the current interval's sample.
async fn sample(app: &App, cooling: &Cooling) {
    let mut reads = 0u64;
    let g = gauges(app, cooling, &mut reads).await;
    app.metrics.chart_samples.inc();
    app.metrics.chart_reads.inc_by(reads);
    let Some(g) = g else { return };
    let mut r = app.charts.ring.lock().expect("charts lock");
    if let Some(s) = r.at(SystemTime::now()) {
        s.gauges = Some(g);
    }
}

/// The gauges as they are now; `None` when NATS did not answer (the
/// interval then shows none). `reads` counts the store requests.
async fn gauges(app: &App, cooling: &Cooling, reads: &mut u64) -> Option<Gauges> {
    let mut g = Gauges::default();
    let (kinds, lanes) = match queue(app, reads).await {
        Ok(q) => q,
        Err(e) => {
            tracing::debug!(error = %e, "charts: the work stream did not answer");
            return None;
        }
    };
    g.queue_by_kind = bounded(kinds);
    g.queue_by_lane = bounded(lanes);
    *reads += 1;
    let sessions = match leasehold_operate::fleet::live_sessions(&app.sessions).await {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(error = %e, "charts: the sessions did not answer");
            return None;
        }
    };
    *reads += sessions.len() as u64;
    g.workers = sessions.len() as u64;
    g.slots_total = sessions.iter().map(|s| s.slots as u64).sum();
    // Known only from the console's view of the index.
    if let Some(counts) = app.feed.counts() {
        g.slots_in_use = Some(
            sessions
                .iter()
                .map(|s| counts.in_flight.get(&s.worker_id).copied().unwrap_or(0) as u64)
                .sum(),
        );
        let mut by_status = BTreeMap::new();
        for per in counts.by_kind.values() {
            for (status, n) in per {
                *by_status.entry(status.clone()).or_default() += n;
            }
        }
        g.index_by_status = Some(by_status);
    }
    let now = leasehold_store::flow::now_ms();
    for (id, until) in cooling {
        if *until > now {
            bump(&mut g.cooling, id, (*until - now).div_ceil(1000));
        }
    }
    Some(g)
}

/// Tickets per kind and per lane: the work stream's per-subject counts
/// (one request, however many tickets).
async fn queue(
    app: &App,
    reads: &mut u64,
) -> Result<(BTreeMap<String, u64>, BTreeMap<String, u64>), String> {
    let l = &app.conn.layout;
    *reads += 1;
    let stream = app
        .conn
        .js
        .get_stream_no_info(l.work_stream())
        .await
        .map_err(|e| e.to_string())?;
    let mut subjects = stream
        .info_with_subjects(l.submit_wildcard())
        .await
        .map_err(|e| e.to_string())?;
    let (mut kinds, mut lanes) = (BTreeMap::new(), BTreeMap::new());
    while let Some(x) = subjects.next().await {
        let (subject, n) = x.map_err(|e| e.to_string())?;
        if let Some((kind, lane)) = l.lane_of_submit_subject(&subject) {
            *kinds.entry(kind.to_string()).or_default() += n as u64;
            let name = if lane.is_default() {
                kind.to_string()
            } else {
                format!("{kind}/{}/{}", lane.tenant, lane.priority)
            };
            *lanes.entry(name).or_default() += n as u64;
        }
    }
    Ok((kinds, lanes))
}

/// One event of the flow, counted in its interval (once: a reopened
/// consumer delivers again what was counted).
async fn on_event(app: &App, flow: &mut Flow, seq: u64, ev: &JobEvent) {
    if seq <= flow.last_seq {
        return;
    }
    flow.last_seq = seq;
    let now = SystemTime::now();
    let at = leasehold_core::time::parse_rfc3339(&ev.at)
        .unwrap_or(now)
        .min(now);
    let mut submit_start = None;
    if ev.r#type == "claimed" {
        if flow.claims.len() < CLAIMS_MAX || flow.claims.contains_key(&ev.job_id) {
            flow.claims.insert(ev.job_id.clone(), at);
        }
        if ev.epoch == 1 {
            submit_start = created_at(app, flow, &ev.job_id)
                .await
                .and_then(|c| at.duration_since(c).ok());
        }
    }
    let run = if crate::feed::TERMINAL.contains(&ev.r#type.as_str()) {
        flow.claims
            .remove(&ev.job_id)
            .and_then(|c| at.duration_since(c).ok())
    } else {
        None
    };
    let mut r = app.charts.ring.lock().expect("charts lock");
    if let Some(s) = r.at(at) {
        count(s, ev, submit_start, run);
    }
}

/// What one event adds to its interval's sample.
pub fn count(s: &mut Sample, ev: &JobEvent, submit_start: Option<Duration>, run: Option<Duration>) {
    let data = ev.data_map();
    let class = data.get("class").and_then(|v| v.as_str());
    match ev.r#type.as_str() {
        "completed" => s.completed += 1,
        "failed" | "dead" | "rejected" | "cancelled" => {
            s.failed += 1;
            if ev.r#type != "cancelled" {
                bump(&mut s.failures, class.unwrap_or(&ev.r#type), 1);
            }
        }
        "retry" if class == Some("rate_limited") => s.rate_limited += 1,
        _ => {}
    }
    if let Some(d) = submit_start {
        s.submit_start.add(d.as_secs_f64());
    }
    if let Some(d) = run {
        s.run_time.add(d.as_secs_f64());
    }
}

/// A job's submission time: from the record cache, else read (at most
/// [`RECORD_READS`] a second; `None` beyond).
async fn created_at(app: &App, flow: &mut Flow, id: &str) -> Option<SystemTime> {
    let cached = app.feed.cache.lock().expect("cache lock").get(id);
    let rec = match cached {
        Some(r) => r,
        None => {
            let now = tokio::time::Instant::now();
            if flow
                .second
                .is_none_or(|s| now - s >= Duration::from_secs(1))
            {
                (flow.second, flow.reads) = (Some(now), 0);
            }
            if flow.reads >= RECORD_READS {
                return None;
            }
            flow.reads += 1;
            app.metrics.chart_record_reads.inc();
            Arc::new(app.jobs.get(id).await.ok()??.value)
        }
    };
    leasehold_core::time::parse_rfc3339(&rec.created_at)
}

/// A pause of key `id` until `until_ms`: a cooldown started when the key
/// was not cooling already.
fn on_pause(app: &App, cooling: &mut Cooling, id: &str, until_ms: u64) {
    let now = leasehold_store::flow::now_ms();
    let was = cooling.get(id).copied().unwrap_or(0);
    if until_ms <= now || until_ms <= was {
        return;
    }
    if cooling.len() < crate::charts::KEYS_MAX || cooling.contains_key(id) {
        cooling.insert(id.to_string(), until_ms);
    }
    if was <= now {
        let mut r = app.charts.ring.lock().expect("charts lock");
        if let Some(s) = r.at(SystemTime::now()) {
            bump(&mut s.cooldowns, id, 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ev(ty: &str, data: serde_json::Value) -> JobEvent {
        JobEvent {
            r#type: ty.into(),
            job_id: "j".into(),
            data: data.to_string(),
            ..Default::default()
        }
    }

    #[test]
    fn each_event_counts_where_it_says() {
        let mut s = Sample::default();
        count(
            &mut s,
            &ev("completed", json!({})),
            None,
            Some(Duration::from_secs(2)),
        );
        count(
            &mut s,
            &ev("failed", json!({"class": "terminal"})),
            None,
            None,
        );
        count(&mut s, &ev("dead", json!({})), None, None);
        count(&mut s, &ev("cancelled", json!({})), None, None);
        count(
            &mut s,
            &ev("retry", json!({"class": "rate_limited"})),
            None,
            None,
        );
        count(
            &mut s,
            &ev("retry", json!({"class": "overloaded"})),
            None,
            None,
        );
        count(
            &mut s,
            &ev("claimed", json!({})),
            Some(Duration::from_millis(250)),
            None,
        );
        assert_eq!((s.completed, s.failed, s.rate_limited), (1, 3, 1));
        assert_eq!(s.failures.get("terminal"), Some(&1));
        assert_eq!(s.failures.get("dead"), Some(&1));
        assert!(!s.failures.contains_key("cancelled"));
        assert_eq!(s.submit_start.quantiles().unwrap().p50, 0.25);
        assert_eq!(s.run_time.quantiles().unwrap().p95, 2.0);
    }
}
