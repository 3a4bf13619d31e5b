//! A worker's metrics ([`Metrics`]): jobs, attempts and their timer, session
//! renewals, and what the model and tool layers report as its [`Observer`].

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::observe::{EffectOutcome, ModelRequest, Observer, ToolOutcome};

use super::{
    attempt_buckets, build_info, encode, flush_buckets, model_buckets, ClassLabel, FlowLimitLabels,
    FlowPauseLabels, HistogramFamily, KindLabel, KindOutcomeLabels, ModelDirectionLabels,
    ModelLabel, ModelOutcomeLabels, OutcomeLabel, TenantKindLabels, TenantLabel, ToolOutcomeLabels,
};

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

    /// The families the model, tool, flow and checkpoint layers report into.
    fn register_layers(&self, r: &mut Registry) {
        let f = self;
        r.register(
            "leasehold_model_requests",
            "Model requests by model and outcome (ok or the failure class)",
            f.model_requests.clone(),
        );
        r.register(
            "leasehold_model_tokens",
            "Tokens by model and direction (input, output)",
            f.model_tokens.clone(),
        );
        r.register(
            "leasehold_model_retries",
            "Generation retry decisions by failure class",
            f.model_retries.clone(),
        );
        r.register("leasehold_flow_requests", "Model requests by flow control's admission: admitted, waited (admitted after waiting), refused (gave up waiting)", f.flow_admissions.clone());
        r.register(
            "leasehold_flow_pauses",
            "Provider keys paused for the fleet, by kind: cooldown (429 or quota) or breaker",
            f.flow_pauses.clone(),
        );
        r.register(
            "leasehold_flow_limit",
            "A provider key's fleet-wide limit (rpm, tpm per minute; concurrency)",
            f.flow_limit.clone(),
        );
        r.register("leasehold_flow_slice", "This worker's leased slice of a provider key's limit (rpm, tpm per minute; concurrency)", f.flow_slice.clone());
        r.register(
            "leasehold_tenant_jobs_running",
            "Jobs of a tenant running an attempt on this worker",
            f.tenant_running.clone(),
        );
        r.register("leasehold_tenant_tickets", "Tickets of a tenant in a kind's lanes (queued or running), as this worker last counted them; the default tenant at the default priority is the kind's consumer's queue", f.tenant_tickets.clone());
        r.register_with_unit(
            "leasehold_model_request_duration",
            "Duration of model requests, by model",
            Unit::Seconds,
            f.model_duration.clone(),
        );
        r.register(
            "leasehold_tool_calls",
            "Tool calls by tool and outcome (ok, error, refused)",
            f.tool_calls.clone(),
        );
        r.register(
            "leasehold_effects",
            "Side effects by tool and outcome (executed, replayed, reconciled, parked)",
            f.effects.clone(),
        );
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

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut inner = WorkerInner {
            registry: Arc::default(),
            claimed: Family::default(),
            reclaimed: Family::default(),
            rejected: Family::default(),
            completed: Family::default(),
            retried: Family::default(),
            failed: Family::default(),
            cancelled: Family::default(),
            parked: Family::default(),
            handed_back: Family::default(),
            ownership_lost: Family::default(),
            attempt_duration: HistogramFamily::<KindOutcomeLabels>::new_with_constructor(
                attempt_buckets,
            ),
            in_flight: Family::default(),
            renewals: Family::default(),
            last_renewal: Arc::new(Mutex::new(None)),
            model_requests: Family::default(),
            model_tokens: Family::default(),
            model_retries: Family::default(),
            flow_admissions: Family::default(),
            flow_pauses: Family::default(),
            flow_limit: Family::default(),
            flow_slice: Family::default(),
            tenant_running: Family::default(),
            tenant_tickets: Family::default(),
            model_duration: HistogramFamily::<ModelLabel>::new_with_constructor(model_buckets),
            tool_calls: Family::default(),
            effects: Family::default(),
            flush_duration: flush_buckets(),
            flushed_events: Counter::default(),
        };
        let mut r = Registry::default();
        build_info(&mut r, "leasehold-worker");
        inner.register_jobs(&mut r);
        inner.register_layers(&mut r);
        inner.registry = Arc::new(r);
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
