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

/// The value of `series` (its name and labels, as the exposition writes
/// them: `leasehold_jobs_claimed_total{kind="echo"}`) in an exposition
/// from [`encode`]; `None` when no such sample is there. What a scrape
/// reader does, for tests of the crates that register families.
///
/// ```
/// use leasehold_telemetry::metrics::value_of;
/// let text = "leasehold_x_total{kind=\"echo\"} 3\nleasehold_x_total{kind=\"echo2\"} 5\n";
/// assert_eq!(value_of(text, r#"leasehold_x_total{kind="echo"}"#), Some(3.0));
/// assert_eq!(value_of(text, r#"leasehold_x_total{kind="echo2"}"#), Some(5.0));
/// assert_eq!(value_of(text, "leasehold_x_total"), None, "a whole series, not a prefix");
/// ```
pub fn value_of(exposition: &str, series: &str) -> Option<f64> {
    exposition
        .lines()
        .find(|l| {
            l.strip_prefix(series)
                .is_some_and(|rest| rest.starts_with(' '))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}
