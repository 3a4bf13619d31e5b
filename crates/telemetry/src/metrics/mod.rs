//! Prometheus plumbing on a `prometheus-client` registry: the exposition
//! ([`encode`], [`CONTENT_TYPE`]) and the build-info series. The families
//! themselves belong to the crates that count them, each registering its
//! own on the registry its process passes in: the worker's
//! (`leasehold_worker::metrics`), the model's, flow control's and the
//! tools' (each crate's `metrics` module), the reaper's and the console's.
//! The full list with types, labels and meaning is in docs/reference.md.
//!
//! Label values must stay low-cardinality: kinds, outcomes, failure classes,
//! model and tool names. Never a job id.

use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

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

/// `leasehold_build_info{service, version}`, constant 1.
pub fn build_info(registry: &mut Registry, service: &str) {
    registry.register(
        "leasehold_build",
        "Constant 1, labelled with the service and its version",
        Info::new(vec![
            ("service".to_string(), service.to_string()),
            ("version".to_string(), env!("CARGO_PKG_VERSION").to_string()),
        ]),
    );
}
