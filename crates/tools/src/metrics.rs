//! The tool layer's metrics, registered by the crate that counts them: tool
//! calls by tool and outcome, and side effects by what the ledger did with
//! them. A worker registers them on its registry ([`ToolMetrics::register`])
//! and feeds them what its jobs' toolboxes report as its observer.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use leasehold_telemetry::observe::{EffectOutcome, ToolOutcome};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToolOutcomeLabels {
    tool: String,
    outcome: String,
}

/// The tool families (cheap to clone).
#[derive(Clone, Debug)]
pub struct ToolMetrics {
    calls: Family<ToolOutcomeLabels, Counter>,
    effects: Family<ToolOutcomeLabels, Counter>,
}

impl ToolMetrics {
    /// Registers the tool families on `r`.
    pub fn register(r: &mut Registry) -> ToolMetrics {
        let m = ToolMetrics {
            calls: Family::default(),
            effects: Family::default(),
        };
        r.register(
            "leasehold_tool_calls",
            "Tool calls by tool and outcome (ok, error, refused)",
            m.calls.clone(),
        );
        r.register(
            "leasehold_effects",
            "Side effects by tool and outcome (executed, replayed, reconciled, parked)",
            m.effects.clone(),
        );
        m
    }

    /// A tool call ended.
    pub fn call(&self, tool: &str, outcome: ToolOutcome) {
        self.calls
            .get_or_create(&labels(tool, outcome.as_str()))
            .inc();
    }

    /// What the ledger did with a side effect.
    pub fn effect(&self, tool: &str, outcome: EffectOutcome) {
        self.effects
            .get_or_create(&labels(tool, outcome.as_str()))
            .inc();
    }
}

fn labels(tool: &str, outcome: &str) -> ToolOutcomeLabels {
    ToolOutcomeLabels {
        tool: tool.to_string(),
        outcome: outcome.to_string(),
    }
}
