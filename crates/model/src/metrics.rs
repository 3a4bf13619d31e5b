//! The model client's metrics, registered by the crate that counts them:
//! requests by model and outcome, tokens, generation retries and request
//! durations. A worker registers them on its registry
//! ([`ModelMetrics::register`]) and feeds them the generator's
//! [`ModelRequest`] and retry reports, which reach it as its observer.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use leasehold_telemetry::observe::ModelRequest;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelOutcome {
    model: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelDirection {
    model: String,
    direction: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabel {
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabel {
    class: String,
}

/// 100 ms to 10 min: one model request, streaming included.
fn request_buckets() -> Histogram {
    Histogram::new([
        0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    ])
}

/// The model families (cheap to clone: each family is one `Arc`).
#[derive(Clone, Debug)]
pub struct ModelMetrics {
    requests: Family<ModelOutcome, Counter>,
    tokens: Family<ModelDirection, Counter>,
    retries: Family<ClassLabel, Counter>,
    duration: Family<ModelLabel, Histogram, fn() -> Histogram>,
}

impl ModelMetrics {
    /// Registers the model families on `r`.
    pub fn register(r: &mut Registry) -> ModelMetrics {
        let m = ModelMetrics {
            requests: Family::default(),
            tokens: Family::default(),
            retries: Family::default(),
            duration: Family::new_with_constructor(request_buckets),
        };
        r.register(
            "leasehold_model_requests",
            "Model requests by model and outcome (ok or the failure class)",
            m.requests.clone(),
        );
        r.register(
            "leasehold_model_tokens",
            "Tokens by model and direction (input, output)",
            m.tokens.clone(),
        );
        r.register(
            "leasehold_model_retries",
            "Generation retry decisions by failure class",
            m.retries.clone(),
        );
        r.register_with_unit(
            "leasehold_model_request_duration",
            "Duration of model requests, by model",
            Unit::Seconds,
            m.duration.clone(),
        );
        m
    }

    /// One model request (one HTTP exchange).
    pub fn request(&self, r: &ModelRequest<'_>) {
        self.requests
            .get_or_create(&ModelOutcome {
                model: r.model.to_string(),
                outcome: r.outcome.to_string(),
            })
            .inc();
        for (direction, n) in [("input", r.input_tokens), ("output", r.output_tokens)] {
            if n > 0 {
                self.tokens
                    .get_or_create(&ModelDirection {
                        model: r.model.to_string(),
                        direction: direction.to_string(),
                    })
                    .inc_by(n);
            }
        }
        self.duration
            .get_or_create(&ModelLabel {
                model: r.model.to_string(),
            })
            .observe(r.elapsed.as_secs_f64());
    }

    /// A generation retry decided, by failure class.
    pub fn retry(&self, class: &str) {
        self.retries
            .get_or_create(&ClassLabel {
                class: class.to_string(),
            })
            .inc();
    }
}
