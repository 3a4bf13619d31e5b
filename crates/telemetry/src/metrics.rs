//! Prometheus metrics on a `prometheus-client` registry: [`Metrics`] for a
//! worker, [`ReaperMetrics`] for a reaper replica. Both are cheap to clone
//! (one `Arc`) and every method is one line at its call site. The full list
//! with types, labels and meaning is in the crate's README.
//!
//! Label values must stay low-cardinality: kinds, outcomes, failure classes,
//! model and tool names. Never a job id.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};

use crate::observe::{EffectOutcome, ModelRequest, Observer, ToolOutcome};

/// The content type of [`encode`]'s output (OpenMetrics text, which
/// Prometheus scrapes natively).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The registry in the OpenMetrics text format.
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail; an encoder error would be a bug
    // in a metric's implementation, and a partial scrape is better than none.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

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
struct ModelOutcomeLabels {
    model: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelDirectionLabels {
    model: String,
    direction: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabel {
    model: String,
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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FlowLimitLabels {
    model: String,
    limit: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FlowPauseLabels {
    model: String,
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabel {
    class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToolOutcomeLabels {
    tool: String,
    outcome: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// 50 ms to 2 h: attempts range from an echo to a long research job.
fn attempt_buckets() -> Histogram {
    Histogram::new([
        0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
        7200.0,
    ])
}

/// 100 ms to 10 min: one model request, streaming included.
fn model_buckets() -> Histogram {
    Histogram::new([
        0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    ])
}

/// 1 ms to 10 s: one flusher batch (publishes and a gate write).
fn flush_buckets() -> Histogram {
    Histogram::new([
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ])
}

/// 1 ms to 5 min: one reaper sweep over the job records.
fn sweep_buckets() -> Histogram {
    Histogram::new([
        0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0,
    ])
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

/// A worker's metrics. Create one per process, serve
/// [`Metrics::registry`] on `/metrics`, and install it as the process's
/// [`Observer`] so the model and tool layers report into it.
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
    handed_back: Family<KindLabel, Counter>,
    ownership_lost: Family<KindLabel, Counter>,
    attempt_duration: HistogramFamily<KindOutcomeLabels>,
    in_flight: Family<KindLabel, Gauge>,
    renewals: Family<OutcomeLabel, Counter>,
    last_renewal: Arc<Mutex<Option<Instant>>>,
    model_requests: Family<ModelOutcomeLabels, Counter>,
    model_tokens: Family<ModelDirectionLabels, Counter>,
    model_retries: Family<ClassLabel, Counter>,
    model_duration: HistogramFamily<ModelLabel>,
    tool_calls: Family<ToolOutcomeLabels, Counter>,
    effects: Family<ToolOutcomeLabels, Counter>,
    flush_duration: Histogram,
    flushed_events: Counter,
    flow_admissions: Family<ModelOutcomeLabels, Counter>,
    flow_pauses: Family<FlowPauseLabels, Counter>,
    flow_limit: Family<FlowLimitLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    flow_slice: Family<FlowLimitLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    tenant_running: Family<TenantLabel, Gauge>,
    tenant_tickets: Family<TenantKindLabels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn build_info(registry: &mut Registry, service: &str) {
    registry.register(
        "leasehold_build",
        "Constant 1, labelled with the service and its version",
        Info::new(vec![
            ("service".to_string(), service.to_string()),
            ("version".to_string(), env!("CARGO_PKG_VERSION").to_string()),
        ]),
    );
}

impl Metrics {
    pub fn new() -> Self {
        let mut r = Registry::default();
        build_info(&mut r, "leasehold-worker");
        let counter = |r: &mut Registry, name: &str, help: &str| {
            let f = Family::<KindLabel, Counter>::default();
            r.register(name, help, f.clone());
            f
        };
        let claimed = counter(
            &mut r,
            "leasehold_jobs_claimed",
            "Claims won by this worker (reclaims included), by kind",
        );
        let reclaimed = counter(
            &mut r,
            "leasehold_jobs_reclaimed",
            "Claims of a job whose previous owner lost it (expired lease or session, or this identity's earlier process), by kind",
        );
        let rejected = counter(
            &mut r,
            "leasehold_jobs_rejected",
            "Submissions rejected by this worker (recorded and dead-lettered), by kind",
        );
        let completed = counter(
            &mut r,
            "leasehold_jobs_completed",
            "Attempts that completed their job, by kind",
        );
        let retried = counter(
            &mut r,
            "leasehold_jobs_retried",
            "Attempts that failed retryably and re-queued their job with a backoff, by kind",
        );
        let failed = counter(
            &mut r,
            "leasehold_jobs_failed",
            "Attempts that failed their job for good, by kind",
        );
        let cancelled = counter(
            &mut r,
            "leasehold_jobs_cancelled",
            "Attempts stopped by a cancel request, by kind",
        );
        let parked = counter(
            &mut r,
            "leasehold_jobs_parked",
            "Attempts that parked their job for a person, by kind",
        );
        let handed_back = counter(
            &mut r,
            "leasehold_jobs_handed_back",
            "Attempts released at shutdown after the drain timeout, by kind",
        );
        let ownership_lost = counter(
            &mut r,
            "leasehold_jobs_ownership_lost",
            "Attempts stopped because another owner took the job over, by kind",
        );
        let attempt_duration =
            HistogramFamily::<KindOutcomeLabels>::new_with_constructor(attempt_buckets);
        r.register_with_unit(
            "leasehold_attempt_duration",
            "Duration of attempts from claim to outcome, by kind and outcome",
            Unit::Seconds,
            attempt_duration.clone(),
        );
        let in_flight = Family::<KindLabel, Gauge>::default();
        r.register(
            "leasehold_jobs_in_flight",
            "Attempts running on this worker now, by kind",
            in_flight.clone(),
        );
        let renewals = Family::<OutcomeLabel, Counter>::default();
        r.register(
            "leasehold_session_renewals",
            "Session renewals by outcome (ok, failed, lost)",
            renewals.clone(),
        );
        let last_renewal = Arc::new(Mutex::new(None));
        r.register_collector(Box::new(SessionLag(last_renewal.clone())));
        let model_requests = Family::<ModelOutcomeLabels, Counter>::default();
        r.register(
            "leasehold_model_requests",
            "Model requests by model and outcome (ok or the failure class)",
            model_requests.clone(),
        );
        let model_tokens = Family::<ModelDirectionLabels, Counter>::default();
        r.register(
            "leasehold_model_tokens",
            "Tokens by model and direction (input, output)",
            model_tokens.clone(),
        );
        let model_retries = Family::<ClassLabel, Counter>::default();
        r.register(
            "leasehold_model_retries",
            "Generation retry decisions by failure class",
            model_retries.clone(),
        );
        let flow_admissions = Family::<ModelOutcomeLabels, Counter>::default();
        r.register(
            "leasehold_flow_requests",
            "Model requests by flow control's admission: admitted, waited (admitted after waiting), refused (gave up waiting)",
            flow_admissions.clone(),
        );
        let flow_pauses = Family::<FlowPauseLabels, Counter>::default();
        r.register(
            "leasehold_flow_pauses",
            "Provider keys paused for the fleet, by kind: cooldown (429 or quota) or breaker",
            flow_pauses.clone(),
        );
        let flow_limit =
            Family::<FlowLimitLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        r.register(
            "leasehold_flow_limit",
            "A provider key's fleet-wide limit (rpm, tpm per minute; concurrency)",
            flow_limit.clone(),
        );
        let flow_slice =
            Family::<FlowLimitLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        r.register(
            "leasehold_flow_slice",
            "This worker's leased slice of a provider key's limit (rpm, tpm per minute; concurrency)",
            flow_slice.clone(),
        );
        let tenant_running = Family::<TenantLabel, Gauge>::default();
        r.register(
            "leasehold_tenant_jobs_running",
            "Jobs of a tenant running an attempt on this worker",
            tenant_running.clone(),
        );
        let tenant_tickets = Family::<TenantKindLabels, Gauge>::default();
        r.register(
            "leasehold_tenant_tickets",
            "Tickets of a tenant in a kind's lanes (queued or running), as this worker last counted them; the default tenant at the default priority is the kind's consumer's queue",
            tenant_tickets.clone(),
        );
        let model_duration = HistogramFamily::<ModelLabel>::new_with_constructor(model_buckets);
        r.register_with_unit(
            "leasehold_model_request_duration",
            "Duration of model requests, by model",
            Unit::Seconds,
            model_duration.clone(),
        );
        let tool_calls = Family::<ToolOutcomeLabels, Counter>::default();
        r.register(
            "leasehold_tool_calls",
            "Tool calls by tool and outcome (ok, error, refused)",
            tool_calls.clone(),
        );
        let effects = Family::<ToolOutcomeLabels, Counter>::default();
        r.register(
            "leasehold_effects",
            "Side effects by tool and outcome (executed, replayed, reconciled, parked)",
            effects.clone(),
        );
        let flush_duration = flush_buckets();
        r.register_with_unit(
            "leasehold_checkpoint_flush_duration",
            "Duration of one checkpoint flush (a batch of events and its progress write)",
            Unit::Seconds,
            flush_duration.clone(),
        );
        let flushed_events = Counter::default();
        r.register(
            "leasehold_checkpoint_events",
            "Checkpoint events made durable by flushes",
            flushed_events.clone(),
        );
        Metrics {
            inner: Arc::new(WorkerInner {
                registry: Arc::new(r),
                claimed,
                reclaimed,
                rejected,
                completed,
                retried,
                failed,
                cancelled,
                parked,
                handed_back,
                ownership_lost,
                attempt_duration,
                in_flight,
                renewals,
                last_renewal,
                model_requests,
                model_tokens,
                model_retries,
                model_duration,
                tool_calls,
                effects,
                flush_duration,
                flushed_events,
                flow_admissions,
                flow_pauses,
                flow_limit,
                flow_slice,
                tenant_running,
                tenant_tickets,
            }),
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

    fn kind(kind: &str) -> KindLabel {
        KindLabel {
            kind: kind.to_string(),
        }
    }

    /// A claim won (count a reclaim with [`Metrics::reclaimed`] too).
    pub fn claimed(&self, kind: &str) {
        self.inner.claimed.get_or_create(&Self::kind(kind)).inc();
    }

    /// A claim that took the job over from an owner that lost it.
    pub fn reclaimed(&self, kind: &str) {
        self.inner.reclaimed.get_or_create(&Self::kind(kind)).inc();
    }

    /// A submission rejected (decoded badly, too large, invalid).
    pub fn rejected(&self, kind: &str) {
        self.inner.rejected.get_or_create(&Self::kind(kind)).inc();
    }

    /// Starts timing an attempt and counts it in flight until
    /// [`AttemptTimer::finish`] (or until the timer is dropped, which
    /// records nothing else: a panicked task).
    pub fn attempt_started(&self, kind: &str) -> AttemptTimer {
        self.inner.in_flight.get_or_create(&Self::kind(kind)).inc();
        AttemptTimer {
            metrics: self.clone(),
            kind: kind.to_string(),
            started: Instant::now(),
        }
    }

    /// An attempt ended: its outcome counter and the duration histogram.
    /// ([`AttemptTimer::finish`] calls this; call it directly only for an
    /// attempt timed elsewhere.)
    pub fn attempt_finished(&self, kind: &str, outcome: AttemptOutcome, duration: Duration) {
        let i = &self.inner;
        let family = match outcome {
            AttemptOutcome::Completed => &i.completed,
            AttemptOutcome::Retried => &i.retried,
            AttemptOutcome::Failed => &i.failed,
            AttemptOutcome::Cancelled => &i.cancelled,
            AttemptOutcome::Parked => &i.parked,
            AttemptOutcome::HandedBack => &i.handed_back,
            AttemptOutcome::OwnershipLost => &i.ownership_lost,
        };
        family.get_or_create(&Self::kind(kind)).inc();
        i.attempt_duration
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
        let i = &self.inner;
        i.model_requests
            .get_or_create(&ModelOutcomeLabels {
                model: r.model.to_string(),
                outcome: r.outcome.to_string(),
            })
            .inc();
        for (direction, n) in [("input", r.input_tokens), ("output", r.output_tokens)] {
            if n > 0 {
                i.model_tokens
                    .get_or_create(&ModelDirectionLabels {
                        model: r.model.to_string(),
                        direction: direction.to_string(),
                    })
                    .inc_by(n);
            }
        }
        i.model_duration
            .get_or_create(&ModelLabel {
                model: r.model.to_string(),
            })
            .observe(r.elapsed.as_secs_f64());
    }

    fn flow_admission(&self, model: &str, outcome: &str) {
        self.inner
            .flow_admissions
            .get_or_create(&ModelOutcomeLabels {
                model: model.to_string(),
                outcome: outcome.to_string(),
            })
            .inc();
    }

    fn flow_pause(&self, model: &str, kind: &str) {
        self.inner
            .flow_pauses
            .get_or_create(&FlowPauseLabels {
                model: model.to_string(),
                kind: kind.to_string(),
            })
            .inc();
    }

    fn flow_limit(&self, model: &str, limit: &str, fleet: f64, slice: f64) {
        let l = FlowLimitLabels {
            model: model.to_string(),
            limit: limit.to_string(),
        };
        self.inner.flow_limit.get_or_create(&l).set(fleet);
        self.inner.flow_slice.get_or_create(&l).set(slice);
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

    fn model_retry(&self, class: &str) {
        self.inner
            .model_retries
            .get_or_create(&ClassLabel {
                class: class.to_string(),
            })
            .inc();
    }

    fn tool_call(&self, tool: &str, outcome: ToolOutcome) {
        self.inner
            .tool_calls
            .get_or_create(&ToolOutcomeLabels {
                tool: tool.to_string(),
                outcome: outcome.as_str().to_string(),
            })
            .inc();
    }

    fn effect(&self, tool: &str, outcome: EffectOutcome) {
        self.inner
            .effects
            .get_or_create(&ToolOutcomeLabels {
                tool: tool.to_string(),
                outcome: outcome.as_str().to_string(),
            })
            .inc();
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
            .get_or_create(&Metrics::kind(&self.kind))
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

/// What one sweep saw across the whole fleet (every replica sees the same
/// records, so every replica exports the same values within one interval).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FleetSnapshot {
    /// Job records seen.
    pub jobs: u64,
    /// Jobs waiting to run (`queued`), when the sweep can tell them apart
    /// from running ones; `None` leaves the gauge as it was.
    pub queued: Option<u64>,
    /// Bytes held by the work stream, and its limits (0: none): a
    /// submission beyond a limit is refused with "queue full".
    pub queue_bytes: u64,
    pub queue_max_msgs: u64,
    pub queue_max_bytes: u64,
    /// Jobs queued or running.
    pub in_flight: u64,
    pub parked: u64,
    /// Age of the oldest queued or running job (zero when there is none).
    pub oldest_in_flight_age: Option<Duration>,
    /// Dead letters held in the dead-letter stream, by job kind.
    pub dead_letters: BTreeMap<String, u64>,
}

/// A reaper replica's metrics. Every series carries the `replica` label
/// (the reaper id): counters are this replica's own actions, to be summed
/// across replicas; the `leasehold_fleet_*` gauges are the same fleet-wide
/// view from each replica, to be combined with `max without (replica)`.
#[derive(Clone, Debug)]
pub struct ReaperMetrics {
    inner: Arc<ReaperInner>,
}

#[derive(Debug)]
struct ReaperInner {
    registry: Arc<Registry>,
    sweeps: Counter,
    sweep_failures: Counter,
    sweep_duration: Histogram,
    recoveries: Counter,
    dead_lettered: Family<ClassLabel, Counter>,
    advisories: Counter,
    jobs: Gauge,
    queue_depth: Gauge,
    queue_bytes: Gauge,
    queue_max_msgs: Gauge,
    queue_max_bytes: Gauge,
    in_flight: Gauge,
    parked: Gauge,
    oldest_age: Gauge<f64, AtomicU64>,
    dead_letters: Family<KindLabel, Gauge>,
    last_sweep: Gauge<f64, AtomicU64>,
}

fn gauge_of(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl ReaperMetrics {
    pub fn new(replica: &str) -> Self {
        let mut r = Registry::with_labels(std::iter::once((
            Cow::Borrowed("replica"),
            Cow::Owned(replica.to_string()),
        )));
        build_info(&mut r, "leasehold-reaper");
        let sweeps = Counter::default();
        r.register(
            "leasehold_reaper_sweeps",
            "Sweeps this replica completed",
            sweeps.clone(),
        );
        let sweep_failures = Counter::default();
        r.register(
            "leasehold_reaper_sweep_failures",
            "Sweeps this replica could not complete",
            sweep_failures.clone(),
        );
        let sweep_duration = sweep_buckets();
        r.register_with_unit(
            "leasehold_reaper_sweep_duration",
            "Duration of this replica's sweeps",
            Unit::Seconds,
            sweep_duration.clone(),
        );
        let recoveries = Counter::default();
        r.register(
            "leasehold_reaper_recoveries",
            "Stranded jobs this replica re-offered (a new ticket)",
            recoveries.clone(),
        );
        let dead_lettered = Family::<ClassLabel, Counter>::default();
        r.register(
            "leasehold_reaper_dead_lettered",
            "Jobs this replica dead-lettered, by class (poison, max_deliveries)",
            dead_lettered.clone(),
        );
        let advisories = Counter::default();
        r.register(
            "leasehold_reaper_advisories",
            "Max-deliveries advisories this replica processed",
            advisories.clone(),
        );
        let jobs = Gauge::default();
        r.register(
            "leasehold_fleet_jobs",
            "Job records seen by the last sweep",
            jobs.clone(),
        );
        let queue_depth = Gauge::default();
        r.register(
            "leasehold_fleet_queue_depth",
            "Jobs waiting to run (queued)",
            queue_depth.clone(),
        );
        let queue_bytes = Gauge::default();
        r.register_with_unit(
            "leasehold_fleet_queue",
            "Bytes held by the work stream",
            Unit::Bytes,
            queue_bytes.clone(),
        );
        let queue_max_msgs = Gauge::default();
        r.register(
            "leasehold_fleet_queue_limit_messages",
            "The work stream's message limit; submissions beyond are refused (0: none)",
            queue_max_msgs.clone(),
        );
        let queue_max_bytes = Gauge::default();
        r.register_with_unit(
            "leasehold_fleet_queue_limit",
            "The work stream's byte limit; submissions beyond are refused (0: none)",
            Unit::Bytes,
            queue_max_bytes.clone(),
        );
        let in_flight = Gauge::default();
        r.register(
            "leasehold_fleet_jobs_in_flight",
            "Jobs queued or running",
            in_flight.clone(),
        );
        let parked = Gauge::default();
        r.register(
            "leasehold_fleet_jobs_parked",
            "Jobs parked for a person",
            parked.clone(),
        );
        let oldest_age = Gauge::<f64, AtomicU64>::default();
        r.register_with_unit(
            "leasehold_fleet_oldest_in_flight_age",
            "Age of the oldest queued or running job (0 when there is none)",
            Unit::Seconds,
            oldest_age.clone(),
        );
        let dead_letters = Family::<KindLabel, Gauge>::default();
        r.register(
            "leasehold_fleet_dead_letters",
            "Dead letters held in the dead-letter stream, by kind",
            dead_letters.clone(),
        );
        let last_sweep = Gauge::<f64, AtomicU64>::default();
        r.register(
            "leasehold_fleet_last_sweep_timestamp_seconds",
            "Unix time of the sweep the fleet gauges come from",
            last_sweep.clone(),
        );
        ReaperMetrics {
            inner: Arc::new(ReaperInner {
                registry: Arc::new(r),
                sweeps,
                sweep_failures,
                sweep_duration,
                recoveries,
                dead_lettered,
                advisories,
                jobs,
                queue_depth,
                queue_bytes,
                queue_max_msgs,
                queue_max_bytes,
                in_flight,
                parked,
                oldest_age,
                dead_letters,
                last_sweep,
            }),
        }
    }

    pub fn registry(&self) -> Arc<Registry> {
        self.inner.registry.clone()
    }

    pub fn encode(&self) -> String {
        encode(&self.inner.registry)
    }

    /// A sweep completed in `elapsed`.
    pub fn sweep_finished(&self, elapsed: Duration) {
        self.inner.sweeps.inc();
        self.inner.sweep_duration.observe(elapsed.as_secs_f64());
    }

    pub fn sweep_failed(&self) {
        self.inner.sweep_failures.inc();
    }

    /// `n` stranded jobs re-offered by this replica.
    pub fn recovered(&self, n: u64) {
        self.inner.recoveries.inc_by(n);
    }

    /// `n` jobs dead-lettered by this replica with `class`.
    pub fn dead_lettered(&self, class: &str, n: u64) {
        self.inner
            .dead_lettered
            .get_or_create(&ClassLabel {
                class: class.to_string(),
            })
            .inc_by(n);
    }

    /// `n` max-deliveries advisories processed and acked.
    pub fn advisories(&self, n: u64) {
        self.inner.advisories.inc_by(n);
    }

    /// Sets the fleet gauges from one sweep.
    pub fn fleet(&self, s: &FleetSnapshot) {
        let i = &self.inner;
        i.jobs.set(gauge_of(s.jobs));
        if let Some(q) = s.queued {
            i.queue_depth.set(gauge_of(q));
        }
        i.queue_bytes.set(gauge_of(s.queue_bytes));
        i.queue_max_msgs.set(gauge_of(s.queue_max_msgs));
        i.queue_max_bytes.set(gauge_of(s.queue_max_bytes));
        i.in_flight.set(gauge_of(s.in_flight));
        i.parked.set(gauge_of(s.parked));
        i.oldest_age
            .set(s.oldest_in_flight_age.unwrap_or_default().as_secs_f64());
        // Kinds that disappeared (purged) disappear from the export too.
        i.dead_letters.clear();
        for (kind, n) in &s.dead_letters {
            i.dead_letters
                .get_or_create(&KindLabel { kind: kind.clone() })
                .set(gauge_of(*n));
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        i.last_sweep.set(now.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
