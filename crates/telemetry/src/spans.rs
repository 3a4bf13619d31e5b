//! Span constructors for the job tree, with every field declared up front
//! (a `tracing` span can only record fields it was created with):
//!
//! ```text
//! job {kind}                       the submitter's span (its traceparent is kept in the record)
//! └─ attempt {kind}                one per claim; links to the previous attempt's span
//!    └─ phase {name}               research: outline, perspectives, experts, final, artifact, deliver
//!       └─ section {index}         one expert section (tool loop)
//!          ├─ chat {model}         one model request (GenAI semantic conventions)
//!          └─ execute_tool {name}  one tool call (after, not inside, the chat that proposed it)
//! ```
//!
//! Call sites enter them (`let _g = span.enter()` in synchronous code,
//! `fut.instrument(span)` across awaits) and record results with the
//! `record_*` helpers. With the OpenTelemetry layer installed
//! ([`crate::trace::init`]) they are exported; either way they give JSON
//! log lines their context.
//!
//! Integers are recorded as `i64`: `tracing-opentelemetry` exports `u64`
//! fields as strings.

use tracing::field::Empty;
use tracing::Span;

/// The job as a whole, for whoever submits it (the CLI, a client). Workers
/// parent their attempts to the traceparent stored with the job instead of
/// creating this span themselves.
pub fn job(job_id: &str, kind: &str) -> Span {
    tracing::info_span!(
        "job",
        otel.name = %format_args!("job {kind}"),
        otel.kind = "producer",
        leasehold.job.id = %job_id,
        leasehold.job.kind = %kind,
    )
}

/// A new root `job` span, for a job whose submitter sent no trace context:
/// the worker that first claims it starts the job's trace here.
pub fn job_root(job_id: &str, kind: &str) -> Span {
    tracing::info_span!(
        parent: None,
        "job",
        otel.name = %format_args!("job {kind}"),
        otel.kind = "producer",
        leasehold.job.id = %job_id,
        leasehold.job.kind = %kind,
    )
}

/// One attempt: from a claim to its outcome. Parent it to the job with
/// [`crate::trace::set_parent_from_traceparent`] and link the previous
/// attempt with [`crate::trace::link_to_traceparent`] (both before the span
/// is first entered). Record the outcome with [`record_outcome`].
pub fn attempt(job_id: &str, kind: &str, epoch: u64, attempt: u32, worker_id: &str) -> Span {
    tracing::info_span!(
        "attempt",
        otel.name = %format_args!("attempt {kind}"),
        otel.kind = "consumer",
        leasehold.job.id = %job_id,
        leasehold.job.kind = %kind,
        leasehold.job.epoch = i64_of(epoch),
        leasehold.job.attempt = i64::from(attempt),
        leasehold.worker.id = %worker_id,
        leasehold.outcome = Empty,
        error.type = Empty,
        otel.status_code = Empty,
    )
}

/// A phase of a workflow (`outline`, `perspectives`, `experts`, `final`,
/// `artifact`, `deliver`).
pub fn phase(name: &str) -> Span {
    tracing::info_span!(
        "phase",
        otel.name = %format_args!("phase {name}"),
        leasehold.phase = %name,
        error.type = Empty,
        otel.status_code = Empty,
    )
}

/// One section of the report, written by one expert.
pub fn section(index: usize, expert: &str) -> Span {
    tracing::info_span!(
        "section",
        otel.name = %format_args!("section {index}"),
        leasehold.section.index = i64_of(index as u64),
        leasehold.section.expert = %expert,
        leasehold.outcome = Empty,
        error.type = Empty,
        otel.status_code = Empty,
    )
}

/// One model request, following the OpenTelemetry GenAI semantic
/// conventions: name `chat {model}`, kind client, `gen_ai.operation.name`
/// `chat`, `gen_ai.provider.name` (e.g. `openai` for any OpenAI-compatible
/// server), `gen_ai.request.model`. Afterwards: [`record_usage`],
/// [`record_response_model`], [`record_finish_reasons`], or [`record_error`].
pub fn chat(provider: &str, model: &str) -> Span {
    tracing::info_span!(
        "chat",
        otel.name = %format_args!("chat {model}"),
        otel.kind = "client",
        gen_ai.operation.name = "chat",
        gen_ai.provider.name = %provider,
        gen_ai.request.model = %model,
        gen_ai.response.model = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        error.type = Empty,
        otel.status_code = Empty,
    )
}

/// One tool call (GenAI conventions): name `execute_tool {name}`,
/// `gen_ai.operation.name` `execute_tool`, `gen_ai.tool.name`, and the
/// model's call id when there is one.
pub fn execute_tool(name: &str, call_id: Option<&str>) -> Span {
    let span = tracing::info_span!(
        "execute_tool",
        otel.name = %format_args!("execute_tool {name}"),
        otel.kind = "internal",
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = %name,
        gen_ai.tool.call.id = Empty,
        leasehold.effect = Empty,
        error.type = Empty,
        otel.status_code = Empty,
    );
    if let Some(id) = call_id {
        span.record("gen_ai.tool.call.id", id);
    }
    span
}

/// Token usage of a `chat` span.
pub fn record_usage(span: &Span, input_tokens: u64, output_tokens: u64) {
    span.record("gen_ai.usage.input_tokens", i64_of(input_tokens));
    span.record("gen_ai.usage.output_tokens", i64_of(output_tokens));
}

/// The model that answered (may differ from the requested one).
pub fn record_response_model(span: &Span, model: &str) {
    span.record("gen_ai.response.model", model);
}

/// `gen_ai.response.finish_reasons` (a string array). Only exported as an
/// OpenTelemetry attribute (a `tracing` field cannot hold an array): with
/// the `otel` feature off this does nothing.
pub fn record_finish_reasons(span: &Span, reasons: &[&str]) {
    #[cfg(feature = "otel")]
    {
        use opentelemetry::{Array, StringValue, Value};
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let values: Vec<StringValue> = reasons.iter().map(|r| r.to_string().into()).collect();
        span.set_attribute(
            "gen_ai.response.finish_reasons",
            Value::Array(Array::String(values)),
        );
    }
    #[cfg(not(feature = "otel"))]
    let _ = (span, reasons);
}

/// Marks the span failed: `error.type` (a low-cardinality class such as
/// `rate_limited`, `timeout`, `ownership_lost`) and status ERROR.
pub fn record_error(span: &Span, error_type: &str) {
    span.record("error.type", error_type);
    span.record("otel.status_code", "error");
}

/// How an `attempt` or `section` ended (`completed`, `retried`, `failed`,
/// `cancelled`, `parked`, `handed_back`, `ownership_lost`, `skipped`).
pub fn record_outcome(span: &Span, outcome: &str) {
    span.record("leasehold.outcome", outcome);
}

/// How an `execute_tool` span's effect was obtained (`executed`,
/// `replayed`, `reconciled`, `parked`).
pub fn record_effect(span: &Span, effect: &str) {
    span.record("leasehold.effect", effect);
}

fn i64_of(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
