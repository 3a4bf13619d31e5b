//! A worker's metrics ([`Metrics`]): the families the worker counts itself
//! (jobs, attempts and their timer, session renewals, tenants, checkpoint
//! flushes) and, registered by the crates that count them on the same
//! registry, the model's ([`ModelMetrics`]), flow control's
//! ([`FlowMetrics`]) and the tools' ([`ToolMetrics`]). The worker hands
//! itself as the [`Observer`] to what reports on its behalf (its flow, its
//! jobs' toolboxes and flushers, each run's generator), and each report
//! goes to the family of the crate that made it. The full list with types,
//! labels and meaning is in docs/reference.md ("Metrics").
//!
//! Label values stay low-cardinality: kinds, outcomes, failure classes,
//! model and tool names. Never a job id.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold_flow::metrics::FlowMetrics;
use leasehold_model::metrics::ModelMetrics;
use leasehold_telemetry::metrics::{build_info, encode};
use leasehold_telemetry::observe::{EffectOutcome, ModelRequest, Observer, ToolOutcome};
use leasehold_tools::metrics::ToolMetrics;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindOutcomeLabels {
    kind: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabel {
    tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantKindLabels {
    kind: String,
    tenant: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// 50 ms to 2 h: attempts range from an echo to a long research job.
fn attempt_buckets() -> Histogram {
    Histogram::new([
        0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
        7200.0,
    ])
}

/// 1 ms to 10 s: one flusher batch (publishes and a gate write).
fn flush_buckets() -> Histogram {
    Histogram::new([
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ])
}

/// What a worker counts, read back as a process total by
/// [`Metrics::total`] (summed over the kinds it counted them for): the
/// Prometheus families are the only counters, so a snapshot and a scrape
/// never disagree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// Claims won (reclaims among them).
    Claimed,
    /// Claims that took a job over from an owner that lost it.
    Reclaimed,
    /// Submissions rejected.
    Rejected,
    /// Attempts (or jobs cancelled before they ran) that ended so.
    Ended(AttemptOutcome),
    /// Session writes that landed (its creation and its renewals).
    Renewals,
}

/// How an attempt ended. Each outcome has its own `leasehold_jobs_*_total`
/// counter and is the `outcome` label of the attempt duration histogram.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttemptOutcome {
    Completed,
    /// A retryable error: the job was re-queued with a backoff.
    Retried,
    Failed,
    Cancelled,
    /// Needs a person (`leasehold review`).
    Parked,
    /// Waits, holding no worker, for a time (a durable timer).
    Waited,
    /// Released at shutdown after the drain timeout.
    HandedBack,
    /// Another owner took over (lease or session lost); the task was stopped.
    OwnershipLost,
}

impl AttemptOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptOutcome::Completed => "completed",
            AttemptOutcome::Retried => "retried",
            AttemptOutcome::Failed => "failed",
            AttemptOutcome::Cancelled => "cancelled",
            AttemptOutcome::Parked => "parked",
            AttemptOutcome::Waited => "waited",
            AttemptOutcome::HandedBack => "handed_back",
            AttemptOutcome::OwnershipLost => "ownership_lost",
        }
    }
}

/// How a session renewal went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Renewal {
    /// Renewed (or created): the lag clock restarts.
    Ok,
    /// A transient failure; the session may still be alive.
    Failed,
    /// The session is gone (expired or taken over).
    Lost,
}

impl Renewal {
    pub fn as_str(self) -> &'static str {
        match self {
            Renewal::Ok => "ok",
            Renewal::Failed => "failed",
            Renewal::Lost => "lost",
        }
    }
}

/// A worker's metrics. Create one per worker, serve [`Metrics::registry`]
/// on `/metrics`, and hand it as the [`Observer`] to what reports on the
/// worker's behalf (its flow, its jobs' toolboxes and flushers).
#[derive(Clone, Debug)]
pub struct Metrics {
    inner: Arc<WorkerInner>,
}

#[derive(Debug)]
struct WorkerInner {
    registry: Arc<Registry>,
    claimed: Family<KindLabel, Counter>,
    reclaimed: Family<KindLabel, Counter>,
    rejected: Family<KindLabel, Counter>,
    completed: Family<KindLabel, Counter>,
    retried: Family<KindLabel, Counter>,
    failed: Family<KindLabel, Counter>,
    cancelled: Family<KindLabel, Counter>,
    parked: Family<KindLabel, Counter>,
    waited: Family<KindLabel, Counter>,
    handed_back: Family<KindLabel, Counter>,
    ownership_lost: Family<KindLabel, Counter>,
    attempt_duration: HistogramFamily<KindOutcomeLabels>,
    in_flight: Family<KindLabel, Gauge>,
    renewals: Family<OutcomeLabel, Counter>,
    last_renewal: Arc<Mutex<Option<Instant>>>,
    flush_duration: Histogram,
    flushed_events: Counter,
    tenant_running: Family<TenantLabel, Gauge>,
    tenant_tickets: Family<TenantKindLabels, Gauge>,
    /// Every kind a per-kind counter was made for, so [`Metrics::total`]
    /// can sum a family (prometheus-client does not list a family's labels).
    kinds: Mutex<std::collections::BTreeSet<String>>,
    /// Registered by the crates that count them.
    model: ModelMetrics,
    flow: FlowMetrics,
    tools: ToolMetrics,
}

impl WorkerInner {
    /// The families of jobs, attempts and the session.
    fn register_jobs(&self, r: &mut Registry) {
        let f = self;
        r.register(
            "leasehold_jobs_claimed",
            "Claims won by this worker (reclaims included), by kind",
            f.claimed.clone(),
        );
        r.register("leasehold_jobs_reclaimed", "Claims of a job whose previous owner lost it (expired lease or session, or this identity's earlier process), by kind", f.reclaimed.clone());
        r.register(
            "leasehold_jobs_rejected",
            "Submissions rejected by this worker (recorded and dead-lettered), by kind",
            f.rejected.clone(),
        );
        r.register(
            "leasehold_jobs_completed",
            "Attempts that completed their job, by kind",
            f.completed.clone(),
        );
        r.register(
            "leasehold_jobs_retried",
            "Attempts that failed retryably and re-queued their job with a backoff, by kind",
            f.retried.clone(),
        );
        r.register(
            "leasehold_jobs_failed",
            "Attempts that failed their job for good, by kind",
            f.failed.clone(),
        );
        r.register(
            "leasehold_jobs_cancelled",
            "Attempts stopped by a cancel request, by kind",
            f.cancelled.clone(),
        );
        r.register(
            "leasehold_jobs_parked",
            "Attempts that parked their job for a person, by kind",
            f.parked.clone(),
        );
        r.register(
            "leasehold_jobs_waited",
            "Attempts that ended to wait, holding no worker, for a time (a durable timer), by kind",
            f.waited.clone(),
        );
        r.register(
            "leasehold_jobs_handed_back",
            "Attempts released at shutdown after the drain timeout, by kind",
            f.handed_back.clone(),
        );
        r.register(
            "leasehold_jobs_ownership_lost",
            "Attempts stopped because another owner took the job over, by kind",
            f.ownership_lost.clone(),
        );
        r.register_with_unit(
            "leasehold_attempt_duration",
            "Duration of attempts from claim to outcome, by kind and outcome",
            Unit::Seconds,
            f.attempt_duration.clone(),
        );
        r.register(
            "leasehold_jobs_in_flight",
            "Attempts running on this worker now, by kind",
            f.in_flight.clone(),
        );
        r.register(
            "leasehold_session_renewals",
            "Session renewals by outcome (ok, failed, lost)",
            f.renewals.clone(),
        );
        r.register_collector(Box::new(SessionLag(f.last_renewal.clone())));
    }

    /// The tenant and checkpoint families (what the worker counts of its
    /// lanes and its flushers).
    fn register_layers(&self, r: &mut Registry) {
        let f = self;
        r.register(
            "leasehold_tenant_jobs_running",
            "Jobs of a tenant running an attempt on this worker",
            f.tenant_running.clone(),
        );
        r.register("leasehold_tenant_tickets", "Tickets of a tenant in a kind's lanes (queued or running), as this worker last counted them; the default tenant at the default priority is the kind's consumer's queue", f.tenant_tickets.clone());
        r.register_with_unit(
            "leasehold_checkpoint_flush_duration",
            "Duration of one checkpoint flush (a batch of events and its progress write)",
            Unit::Seconds,
            f.flush_duration.clone(),
        );
        r.register(
            "leasehold_checkpoint_events",
            "Checkpoint events made durable by flushes",
            f.flushed_events.clone(),
        );
    }
}

impl WorkerInner {
    fn outcome_family(&self, outcome: AttemptOutcome) -> &Family<KindLabel, Counter> {
        match outcome {
            AttemptOutcome::Completed => &self.completed,
            AttemptOutcome::Retried => &self.retried,
            AttemptOutcome::Failed => &self.failed,
            AttemptOutcome::Cancelled => &self.cancelled,
            AttemptOutcome::Parked => &self.parked,
            AttemptOutcome::Waited => &self.waited,
            AttemptOutcome::HandedBack => &self.handed_back,
            AttemptOutcome::OwnershipLost => &self.ownership_lost,
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A worker's metrics on a registry of their own, served by
    /// [`Metrics::registry`]: the build info, the worker's families, and
    /// the model's, flow control's and the tools', each registered by its
    /// crate on that registry.
    pub fn new() -> Self {
        let mut r = Registry::default();
        build_info(&mut r, "leasehold-worker");
        let inner = WorkerInner {
            model: ModelMetrics::register(&mut r),
            flow: FlowMetrics::register(&mut r),
            tools: ToolMetrics::register(&mut r),
            claimed: Family::default(),
            reclaimed: Family::default(),
            rejected: Family::default(),
            completed: Family::default(),
            retried: Family::default(),
            failed: Family::default(),
            cancelled: Family::default(),
            parked: Family::default(),
            waited: Family::default(),
            handed_back: Family::default(),
            ownership_lost: Family::default(),
            attempt_duration: HistogramFamily::<KindOutcomeLabels>::new_with_constructor(
                attempt_buckets,
            ),
            in_flight: Family::default(),
            renewals: Family::default(),
            last_renewal: Arc::new(Mutex::new(None)),
            tenant_running: Family::default(),
            tenant_tickets: Family::default(),
            flush_duration: flush_buckets(),
            flushed_events: Counter::default(),
            kinds: Mutex::default(),
            registry: Arc::default(),
        };
        inner.register_jobs(&mut r);
        inner.register_layers(&mut r);
        let inner = WorkerInner {
            registry: Arc::new(r),
            ..inner
        };
        Metrics {
            inner: Arc::new(inner),
        }
    }

    /// The registry to serve on `/metrics`.
    pub fn registry(&self) -> Arc<Registry> {
        self.inner.registry.clone()
    }

    /// The exposition text (tests, a NATS responder).
    pub fn encode(&self) -> String {
        encode(&self.inner.registry)
    }

    /// The label of `kind`'s counters (noted for [`Metrics::total`]).
    fn kind(&self, kind: &str) -> KindLabel {
        let mut kinds = self.inner.kinds.lock().expect("kinds");
        if !kinds.contains(kind) {
            kinds.insert(kind.to_string());
        }
        KindLabel {
            kind: kind.to_string(),
        }
    }

    /// The process's total of `c` (the families summed over every kind).
    pub fn total(&self, c: Count) -> u64 {
        let i = &self.inner;
        let family = match c {
            Count::Claimed => &i.claimed,
            Count::Reclaimed => &i.reclaimed,
            Count::Rejected => &i.rejected,
            Count::Ended(o) => i.outcome_family(o),
            Count::Renewals => {
                let ok = OutcomeLabel {
                    outcome: Renewal::Ok.as_str().to_string(),
                };
                return i.renewals.get(&ok).map_or(0, |c| c.get());
            }
        };
        let kinds = i.kinds.lock().expect("kinds").clone();
        kinds
            .into_iter()
            .filter_map(|kind| family.get(&KindLabel { kind }).map(|c| c.get()))
            .sum()
    }

    /// A claim won (count a reclaim with [`Metrics::reclaimed`] too).
    pub fn claimed(&self, kind: &str) {
        self.inner.claimed.get_or_create(&self.kind(kind)).inc();
    }

    /// A claim that took the job over from an owner that lost it.
    pub fn reclaimed(&self, kind: &str) {
        self.inner.reclaimed.get_or_create(&self.kind(kind)).inc();
    }

    /// A submission rejected (decoded badly, too large, invalid).
    pub fn rejected(&self, kind: &str) {
        self.inner.rejected.get_or_create(&self.kind(kind)).inc();
    }

    /// Starts timing an attempt and counts it in flight until
    /// [`AttemptTimer::finish`] (or until the timer is dropped, which
    /// records nothing else: a panicked task).
    pub fn attempt_started(&self, kind: &str) -> AttemptTimer {
        self.inner.in_flight.get_or_create(&self.kind(kind)).inc();
        AttemptTimer {
            metrics: self.clone(),
            kind: kind.to_string(),
            started: Instant::now(),
        }
    }

    /// A job of `kind` ended so without an attempt to time (cancelled
    /// before it ran): its outcome counter alone.
    pub fn ended(&self, kind: &str, outcome: AttemptOutcome) {
        self.inner
            .outcome_family(outcome)
            .get_or_create(&self.kind(kind))
            .inc();
    }

    /// An attempt ended: its outcome counter and the duration histogram.
    /// ([`AttemptTimer::finish`] calls this; call it directly only for an
    /// attempt timed elsewhere.)
    pub fn attempt_finished(&self, kind: &str, outcome: AttemptOutcome, duration: Duration) {
        self.ended(kind, outcome);
        self.inner
            .attempt_duration
            .get_or_create(&KindOutcomeLabels {
                kind: kind.to_string(),
                outcome: outcome.as_str().to_string(),
            })
            .observe(duration.as_secs_f64());
    }

    /// A session renewal (or the session's creation, as [`Renewal::Ok`]).
    /// `leasehold_session_renewal_lag_seconds` appears after the first
    /// `Ok` and is the time since the latest one, computed at each scrape.
    pub fn session_renewal(&self, outcome: Renewal) {
        self.inner
            .renewals
            .get_or_create(&OutcomeLabel {
                outcome: outcome.as_str().to_string(),
            })
            .inc();
        if outcome == Renewal::Ok {
            *self.inner.last_renewal.lock().expect("renewal clock") = Some(Instant::now());
        }
    }
}

impl Observer for Metrics {
    fn model_request(&self, r: &ModelRequest<'_>) {
        self.inner.model.request(r);
    }

    fn model_retry(&self, class: &str) {
        self.inner.model.retry(class);
    }

    fn flow_admission(&self, model: &str, outcome: &str) {
        self.inner.flow.admission(model, outcome);
    }

    fn flow_pause(&self, model: &str, kind: &str) {
        self.inner.flow.pause(model, kind);
    }

    fn flow_limit(&self, model: &str, limit: &str, fleet: f64, slice: f64) {
        self.inner.flow.limit(model, limit, fleet, slice);
    }

    fn tool_call(&self, tool: &str, outcome: ToolOutcome) {
        self.inner.tools.call(tool, outcome);
    }

    fn effect(&self, tool: &str, outcome: EffectOutcome) {
        self.inner.tools.effect(tool, outcome);
    }

    fn tenant_running(&self, tenant: &str, delta: i64) {
        self.inner
            .tenant_running
            .get_or_create(&TenantLabel {
                tenant: tenant.to_string(),
            })
            .inc_by(delta);
    }

    fn tenant_tickets(&self, kind: &str, tenant: &str, n: u64) {
        self.inner
            .tenant_tickets
            .get_or_create(&TenantKindLabels {
                kind: kind.to_string(),
                tenant: tenant.to_string(),
            })
            .set(n as i64);
    }

    fn checkpoint_flush(&self, elapsed: Duration, events: usize) {
        self.inner.flush_duration.observe(elapsed.as_secs_f64());
        self.inner.flushed_events.inc_by(events as u64);
    }
}

/// An attempt in flight; see [`Metrics::attempt_started`].
#[derive(Debug)]
#[must_use = "an attempt timer records nothing unless finished"]
pub struct AttemptTimer {
    metrics: Metrics,
    kind: String,
    started: Instant,
}

impl AttemptTimer {
    /// Records the outcome and the duration since the start.
    pub fn finish(self, outcome: AttemptOutcome) {
        self.metrics
            .attempt_finished(&self.kind, outcome, self.started.elapsed());
        // Drop leaves the in-flight gauge.
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

impl Drop for AttemptTimer {
    fn drop(&mut self) {
        self.metrics
            .inner
            .in_flight
            .get_or_create(&self.metrics.kind(&self.kind))
            .dec();
    }
}

/// `leasehold_session_renewal_lag_seconds`, computed at scrape time so a
/// stuck renewal loop shows as a growing lag rather than a frozen value.
#[derive(Debug)]
struct SessionLag(Arc<Mutex<Option<Instant>>>);

impl Collector for SessionLag {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(last) = *self.0.lock().expect("renewal clock") else {
            return Ok(());
        };
        let lag = ConstGauge::new(last.elapsed().as_secs_f64());
        let metric = encoder.encode_descriptor(
            "leasehold_session_renewal_lag",
            "Time since this worker's session was last renewed (liveness lag)",
            Some(&Unit::Seconds),
            lag.metric_type(),
        )?;
        lag.encode(metric)
    }
}

#[cfg(test)]
mod tests {
    //! The worker's series, and those its crates register on its registry,
    //! as a scrape shows them.
    use super::*;
    use leasehold_telemetry::metrics::value_of as sample;

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
    fn totals_are_the_families_summed_over_kinds() {
        let m = Metrics::new();
        assert_eq!(m.total(Count::Claimed), 0);
        m.claimed("echo");
        m.claimed("sleep");
        m.claimed("sleep");
        m.reclaimed("sleep");
        m.rejected("echo");
        m.ended("echo", AttemptOutcome::Cancelled);
        m.attempt_finished("sleep", AttemptOutcome::Cancelled, Duration::ZERO);
        m.session_renewal(Renewal::Ok);
        m.session_renewal(Renewal::Failed);
        assert_eq!(m.total(Count::Claimed), 3);
        assert_eq!(m.total(Count::Reclaimed), 1);
        assert_eq!(m.total(Count::Rejected), 1);
        assert_eq!(m.total(Count::Ended(AttemptOutcome::Cancelled)), 2);
        assert_eq!(m.total(Count::Ended(AttemptOutcome::Completed)), 0);
        assert_eq!(m.total(Count::Renewals), 1);
        // What the snapshot reads is what a scrape shows.
        let text = m.encode();
        assert_eq!(
            sample(&text, "leasehold_jobs_cancelled_total{kind=\"echo\"}"),
            Some(1.0)
        );
        assert_eq!(
            sample(
                &text,
                "leasehold_attempt_duration_seconds_count{kind=\"echo\",outcome=\"cancelled\"}"
            ),
            None,
            "a job cancelled before it ran had no attempt to time"
        );
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
}
