//! Flow control's metrics, registered by the crate that counts them: model
//! requests by admission, fleet-wide pauses of a provider key, and each
//! key's fleet limit and this worker's slice of it. A worker registers
//! them on its registry ([`FlowMetrics::register`]) and feeds them what its
//! [`crate::Flow`] reports as its observer.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelOutcome {
    model: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PauseLabels {
    model: String,
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabels {
    model: String,
    limit: String,
}

type Level = Gauge<f64, AtomicU64>;

/// The flow families (cheap to clone).
#[derive(Clone, Debug)]
pub struct FlowMetrics {
    admissions: Family<ModelOutcome, Counter>,
    pauses: Family<PauseLabels, Counter>,
    limit: Family<LimitLabels, Level>,
    slice: Family<LimitLabels, Level>,
}

impl FlowMetrics {
    /// Registers the flow families on `r`.
    pub fn register(r: &mut Registry) -> FlowMetrics {
        let m = FlowMetrics {
            admissions: Family::default(),
            pauses: Family::default(),
            limit: Family::default(),
            slice: Family::default(),
        };
        r.register("leasehold_flow_requests", "Model requests by flow control's admission: admitted, waited (admitted after waiting), refused (gave up waiting)", m.admissions.clone());
        r.register(
            "leasehold_flow_pauses",
            "Provider keys paused for the fleet, by kind: cooldown (429 or quota) or breaker",
            m.pauses.clone(),
        );
        r.register(
            "leasehold_flow_limit",
            "A provider key's fleet-wide limit (rpm, tpm per minute; concurrency)",
            m.limit.clone(),
        );
        r.register("leasehold_flow_slice", "This worker's leased slice of a provider key's limit (rpm, tpm per minute; concurrency)", m.slice.clone());
        m
    }

    /// A model request's admission (`admitted`, `waited`, `refused`).
    pub fn admission(&self, model: &str, outcome: &str) {
        self.admissions
            .get_or_create(&ModelOutcome {
                model: model.to_string(),
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// A provider key paused for the fleet (`cooldown`, `breaker`).
    pub fn pause(&self, model: &str, kind: &str) {
        self.pauses
            .get_or_create(&PauseLabels {
                model: model.to_string(),
                kind: kind.to_string(),
            })
            .inc();
    }

    /// A key's fleet-wide `limit` (rpm, tpm, concurrency) and this worker's slice.
    pub fn limit(&self, model: &str, limit: &str, fleet: f64, slice: f64) {
        let l = LimitLabels {
            model: model.to_string(),
            limit: limit.to_string(),
        };
        self.limit.get_or_create(&l).set(fleet);
        self.slice.get_or_create(&l).set(slice);
    }
}
