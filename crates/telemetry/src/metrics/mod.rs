//! Prometheus metrics on a `prometheus-client` registry: [`Metrics`] for a
//! worker, [`ReaperMetrics`] for a reaper replica. Both are cheap to clone
//! (one `Arc`) and every method is one line at its call site. The full list
//! with types, labels and meaning is in the crate's README.
//!
//! Label values must stay low-cardinality: kinds, outcomes, failure classes,
//! model and tool names. Never a job id.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

mod reaper;
#[cfg(test)]
mod tests;
mod worker;

pub use reaper::{FleetSnapshot, ReaperMetrics};
pub use worker::{AttemptOutcome, AttemptTimer, Metrics, Renewal};

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
