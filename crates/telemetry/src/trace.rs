//! OpenTelemetry traces, opt-in: with `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) set, spans go to that collector over
//! OTLP/gRPC; unset, nothing is exported and nothing else changes. The
//! standard variables apply (`OTEL_SERVICE_NAME` overrides the binary's
//! name, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_EXPORTER_OTLP_HEADERS`,
//! `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`; `OTEL_SDK_DISABLED=true` turns export
//! off).
//!
//! Context crosses processes as a W3C `traceparent`: in NATS message headers
//! ([`inject`], [`extract`]) and as a string kept with the job record
//! ([`traceparent_of_current_span`], [`set_parent_from_traceparent`],
//! [`link_to_traceparent`]), so a re-enqueued or reclaimed job's attempts
//! stay in the submitter's trace and link to each other.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::HeaderMap;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{SpanContext, TraceContextExt, TracerProvider as _};
use opentelemetry::Context;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use tracing::{Span, Subscriber};
use tracing_opentelemetry::{OpenTelemetryLayer, OpenTelemetrySpanExt};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

use crate::logs::{self, LogFormat};

/// The W3C header carrying the trace context.
pub const TRACEPARENT: &str = "traceparent";

/// Flushes and stops trace export when dropped (or at [`Guard::shutdown`]).
/// Keep it alive in `main` for the life of the process.
#[derive(Debug)]
#[must_use = "dropping the guard stops trace export"]
pub struct Guard {
    provider: Option<SdkTracerProvider>,
}

impl Guard {
    /// Whether spans are being exported.
    pub fn is_exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports what is buffered and stops; for paths that leave with
    /// `std::process::exit`, which runs no destructors.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let Some(p) = self.provider.take() else {
            return;
        };
        let run = || {
            if let Err(e) = p.shutdown_with_timeout(Duration::from_secs(5)) {
                tracing::warn!(error = %e, "trace export did not shut down cleanly");
            }
        };
        // The batch processor's thread exports through tonic's channel, whose
        // connection task runs on the Tokio runtime: on a runtime worker, let
        // the runtime move that task elsewhere while this thread waits.
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(run),
            _ => run(),
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether the environment asks for trace export.
pub fn export_requested() -> bool {
    let set = |k: &str| std::env::var(k).is_ok_and(|v| !v.trim().is_empty());
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.trim() == "true");
    !disabled && (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}

/// Installs the process's subscriber: the `RUST_LOG` filter (default
/// `info`), the `LH_LOG_FORMAT` log layer on stderr, and, when
/// [`export_requested`], the OpenTelemetry layer exporting over OTLP/gRPC
/// as `service` (unless `OTEL_SERVICE_NAME` says otherwise). Also installs
/// the W3C propagator globally. Must run inside the Tokio runtime. Does
/// nothing (and exports nothing) if a subscriber is already set.
pub fn init(service: &str) -> Guard {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let (format, bad_format) = match LogFormat::from_env() {
        Ok(f) => (f, None),
        Err((f, v)) => (f, Some(v)),
    };
    let (provider, export_error) = if export_requested() {
        match otlp_provider(service, None) {
            Ok(p) => (Some(p), None),
            Err(e) => (None, Some(e)),
        }
    } else {
        (None, None)
    };
    let otel = provider.as_ref().map(layer);
    let installed = tracing_subscriber::registry()
        .with(logs::env_filter("info"))
        .with(logs::stderr_layer(format))
        .with(otel)
        .try_init()
        .is_ok();
    if let Some(v) = bad_format {
        tracing::warn!(value = %v, "LH_LOG_FORMAT must be `text` or `json`; using text");
    }
    if let Some(e) = export_error {
        tracing::warn!(error = %e, "OTLP trace export is configured but could not start; continuing without it");
    }
    if !installed {
        if let Some(p) = provider {
            let _ = p.shutdown();
        }
        return Guard { provider: None };
    }
    if let Some(p) = &provider {
        tracing::info!(service, "exporting traces over OTLP/gRPC");
        let p = p.clone();
        crate::observe::set_flush(Box::new(move || {
            let run = || {
                let _ = p.force_flush();
            };
            match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
                Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(run),
                _ => run(),
            }
        }));
    }
    Guard { provider }
}

/// A tracer provider exporting over OTLP/gRPC in batches, to `endpoint`
/// or, when `None`, to the endpoint the environment names.
pub fn otlp_provider(service: &str, endpoint: Option<&str>) -> Result<SdkTracerProvider, String> {
    use opentelemetry_otlp::WithExportConfig;
    let mut builder = opentelemetry_otlp::SpanExporter::builder().with_tonic();
    if let Some(e) = endpoint {
        builder = builder.with_endpoint(e);
    }
    // tonic's channel spawns its connection task on the current runtime.
    tokio::runtime::Handle::try_current()
        .map_err(|_| "trace export needs a Tokio runtime".to_string())?;
    let exporter = builder.build().map_err(|e| e.to_string())?;
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource(service))
        .build())
}

/// `service.name` (unless `OTEL_SERVICE_NAME` is set; the SDK reads it, and
/// `OTEL_RESOURCE_ATTRIBUTES`) and `service.version`.
pub fn resource(service: &str) -> Resource {
    let mut b = Resource::builder().with_attribute(opentelemetry::KeyValue::new(
        "service.version",
        env!("CARGO_PKG_VERSION"),
    ));
    if std::env::var("OTEL_SERVICE_NAME").map_or(true, |v| v.trim().is_empty()) {
        b = b.with_service_name(service.to_string());
    }
    b.build()
}

/// The `tracing` layer that turns spans into OpenTelemetry spans of
/// `provider`.
pub fn layer<S>(provider: &SdkTracerProvider) -> OpenTelemetryLayer<S, SdkTracer>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    tracing_opentelemetry::layer().with_tracer(provider.tracer("leasehold"))
}

/// async-nats headers as an OpenTelemetry carrier.
struct NatsHeaders<'a>(&'a mut HeaderMap);

impl Injector for NatsHeaders<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key, value);
    }
}

struct NatsHeadersRef<'a>(&'a HeaderMap);

impl Extractor for NatsHeadersRef<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(|v| v.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| k.as_ref()).collect()
    }
}

/// Adds the current span's `traceparent` (and `tracestate`) to `headers`.
/// Nothing is added when there is no exported span.
pub fn inject(headers: &mut HeaderMap) {
    inject_context(&Span::current().context(), headers)
}

/// Adds `cx`'s trace context to `headers`.
pub fn inject_context(cx: &Context, headers: &mut HeaderMap) {
    if cx.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(cx, &mut NatsHeaders(headers));
    }
}

/// The trace context carried by `headers` (an empty context when none).
pub fn extract(headers: &HeaderMap) -> Context {
    // Not `extract`: it falls back to the *current* context, which would
    // make a message without a traceparent look like it carried ours.
    TraceContextPropagator::new().extract_with_context(&Context::new(), &NatsHeadersRef(headers))
}

/// Makes the trace context in `headers` the parent of `span` (before it is
/// first entered). Returns whether there was a valid context.
pub fn set_parent_from_headers(span: &Span, headers: &HeaderMap) -> bool {
    set_parent(span, extract(headers))
}

/// The current span's W3C `traceparent`, to keep with a job record.
pub fn traceparent_of_current_span() -> Option<String> {
    traceparent_of(&Span::current())
}

/// `span`'s W3C `traceparent` (`00-<trace id>-<span id>-<flags>`), or `None`
/// when it is not exported (no OpenTelemetry layer, or disabled).
pub fn traceparent_of(span: &Span) -> Option<String> {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove(TRACEPARENT)
}

/// The remote context a stored `traceparent` names, or `None` when it is
/// not a valid one.
pub fn context_from_traceparent(traceparent: &str) -> Option<Context> {
    let carrier = HashMap::from([(TRACEPARENT.to_string(), traceparent.trim().to_string())]);
    let cx = TraceContextPropagator::new().extract_with_context(&Context::new(), &carrier);
    cx.span().span_context().is_valid().then_some(cx)
}

/// The span context a stored `traceparent` names.
pub fn span_context_from_traceparent(traceparent: &str) -> Option<SpanContext> {
    context_from_traceparent(traceparent).map(|cx| cx.span().span_context().clone())
}

/// Makes the span a stored `traceparent` names the parent of `span`
/// (before `span` is first entered). Returns whether it was valid.
pub fn set_parent_from_traceparent(span: &Span, traceparent: &str) -> bool {
    match context_from_traceparent(traceparent) {
        Some(cx) => set_parent(span, cx),
        None => false,
    }
}

/// Links `span` to the span a stored `traceparent` names (an attempt to
/// the attempt before it). Returns whether it was valid.
pub fn link_to_traceparent(span: &Span, traceparent: &str) -> bool {
    match span_context_from_traceparent(traceparent) {
        Some(sc) => {
            span.add_link(sc);
            true
        }
        None => false,
    }
}

fn set_parent(span: &Span, cx: Context) -> bool {
    cx.span().span_context().is_valid() && span.set_parent(cx).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spans;
    use opentelemetry::trace::{SpanId, TraceId};
    use opentelemetry::Value;
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SpanData};
    use tracing::Instrument;

    fn attr<'a>(s: &'a SpanData, key: &str) -> Option<&'a Value> {
        s.attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| &kv.value)
    }

    fn provider() -> (SdkTracerProvider, InMemorySpanExporter) {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        (provider, exporter)
    }

    #[test]
    fn attempt_links_the_previous_one_and_parents_a_chat_span() {
        let _serial = crate::span_test_lock();
        let (provider, exporter) = provider();
        let subscriber = tracing_subscriber::registry().with(layer(&provider));
        let (previous_tp, job_tp) = tracing::subscriber::with_default(subscriber, || {
            // What an earlier process left in the record: its attempt's traceparent.
            let previous = spans::attempt("j-1", "research", 1, 1, "w-old");
            let previous_tp = traceparent_of(&previous).expect("previous attempt exported");
            drop(previous);

            let job = spans::job("j-1", "research");
            let job_tp = traceparent_of(&job).expect("job exported");
            let _j = job.enter();
            let attempt = spans::attempt("j-1", "research", 2, 2, "w-new");
            assert!(link_to_traceparent(&attempt, &previous_tp));
            assert!(!link_to_traceparent(&attempt, "garbage"));
            {
                let _a = attempt.enter();
                let chat = spans::chat("openai", "sim-1");
                {
                    let _c = chat.enter();
                    assert_eq!(
                        traceparent_of_current_span().as_deref().map(|t| &t[..35]),
                        Some(&job_tp[..35]),
                        "same trace"
                    );
                }
                spans::record_usage(&chat, 1200, 345);
                spans::record_response_model(&chat, "sim-1-2024");
                spans::record_finish_reasons(&chat, &["tool_calls"]);
                let tool = spans::execute_tool("search", Some("call_1"));
                spans::record_error(&tool, "timeout");
                drop(tool);
                drop(chat);
                spans::record_outcome(&attempt, "completed");
            }
            (previous_tp, job_tp)
        });
        provider.force_flush().expect("flush");
        let finished = exporter.get_finished_spans().expect("spans");
        let by_name = |n: &str| {
            finished.iter().find(|s| s.name == n).unwrap_or_else(|| {
                panic!(
                    "no span {n}: {:?}",
                    finished.iter().map(|s| &s.name).collect::<Vec<_>>()
                )
            })
        };
        let job = by_name("job research");
        let attempts: Vec<&SpanData> = finished
            .iter()
            .filter(|s| s.name == "attempt research")
            .collect();
        assert_eq!(attempts.len(), 2);
        let previous = attempts
            .iter()
            .find(|s| attr(s, "leasehold.worker.id") == Some(&Value::from("w-old")))
            .expect("previous attempt");
        let attempt = attempts
            .iter()
            .find(|s| attr(s, "leasehold.worker.id") == Some(&Value::from("w-new")))
            .expect("new attempt");
        let chat = by_name("chat sim-1");
        let tool = by_name("execute_tool search");

        // The tree: job -> attempt -> {chat, execute_tool}, one trace. (A
        // tool runs after the response that proposed it: a sibling of chat.)
        assert_eq!(job.parent_span_id, SpanId::INVALID);
        assert_eq!(attempt.parent_span_id, job.span_context.span_id());
        assert_eq!(chat.parent_span_id, attempt.span_context.span_id());
        assert_eq!(tool.parent_span_id, attempt.span_context.span_id());
        let trace = job.span_context.trace_id();
        assert_ne!(trace, TraceId::INVALID);
        for s in [*attempt, chat, tool] {
            assert_eq!(s.span_context.trace_id(), trace);
        }
        assert_eq!(
            job_tp,
            format!("00-{}-{}-01", trace, job.span_context.span_id())
        );

        // The link to the previous attempt, from its stored traceparent.
        assert_eq!(attempt.links.links.len(), 1);
        let link = &attempt.links.links[0].span_context;
        assert_eq!(link.span_id(), previous.span_context.span_id());
        assert_eq!(link.trace_id(), previous.span_context.trace_id());
        assert_eq!(
            previous_tp,
            format!("00-{}-{}-01", link.trace_id(), link.span_id())
        );

        // GenAI attributes.
        assert_eq!(
            attr(chat, "gen_ai.operation.name"),
            Some(&Value::from("chat"))
        );
        assert_eq!(
            attr(chat, "gen_ai.provider.name"),
            Some(&Value::from("openai"))
        );
        assert_eq!(
            attr(chat, "gen_ai.request.model"),
            Some(&Value::from("sim-1"))
        );
        assert_eq!(
            attr(chat, "gen_ai.response.model"),
            Some(&Value::from("sim-1-2024"))
        );
        assert_eq!(
            attr(chat, "gen_ai.usage.input_tokens"),
            Some(&Value::I64(1200))
        );
        assert_eq!(
            attr(chat, "gen_ai.usage.output_tokens"),
            Some(&Value::I64(345))
        );
        assert_eq!(
            attr(chat, "gen_ai.response.finish_reasons"),
            Some(&Value::Array(opentelemetry::Array::String(vec![
                "tool_calls".into()
            ])))
        );
        assert_eq!(chat.span_kind, opentelemetry::trace::SpanKind::Client);
        assert_eq!(attr(tool, "gen_ai.tool.name"), Some(&Value::from("search")));
        assert_eq!(
            attr(tool, "gen_ai.tool.call.id"),
            Some(&Value::from("call_1"))
        );
        assert_eq!(attr(tool, "error.type"), Some(&Value::from("timeout")));
        assert!(matches!(
            tool.status,
            opentelemetry::trace::Status::Error { .. }
        ));
        assert_eq!(attr(attempt, "leasehold.job.epoch"), Some(&Value::I64(2)));
        assert_eq!(
            attr(attempt, "leasehold.outcome"),
            Some(&Value::from("completed"))
        );
    }

    #[test]
    fn traceparent_round_trips_through_nats_headers() {
        let _serial = crate::span_test_lock();
        let (provider, exporter) = provider();
        let subscriber = tracing_subscriber::registry().with(layer(&provider));
        let _default = tracing::subscriber::set_default(subscriber);

        let submit = spans::job("j-2", "echo");
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", "j-2");
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(
                async {
                    inject(&mut headers);
                }
                .instrument(submit.clone()),
            );
        let sent = headers
            .get(TRACEPARENT)
            .expect("traceparent header")
            .to_string();
        assert_eq!(Some(sent.clone()), traceparent_of(&submit));
        assert_eq!(headers.get("Nats-Msg-Id").map(|v| v.as_str()), Some("j-2"));

        // The receiving side: extract, parent a span to it.
        let cx = extract(&headers);
        assert_eq!(
            cx.span().span_context().span_id(),
            span_context_from_traceparent(&sent)
                .expect("valid")
                .span_id()
        );
        let received = spans::attempt("j-2", "echo", 1, 1, "w");
        assert!(set_parent_from_headers(&received, &headers));
        let tp = traceparent_of(&received).expect("exported");
        assert_eq!(&tp[..35], &sent[..35], "same trace id");
        drop(received);
        drop(submit);
        provider.force_flush().expect("flush");
        let spans = exporter.get_finished_spans().expect("spans");
        let job = spans.iter().find(|s| s.name == "job echo").expect("job");
        let attempt = spans
            .iter()
            .find(|s| s.name == "attempt echo")
            .expect("attempt");
        assert_eq!(attempt.parent_span_id, job.span_context.span_id());

        // No context: nothing injected, nothing extracted.
        let mut empty = HeaderMap::new();
        inject_context(&Context::new(), &mut empty);
        assert!(empty.get(TRACEPARENT).is_none());
        assert!(!extract(&empty).span().span_context().is_valid());
        assert!(context_from_traceparent("00-bad").is_none());
    }

    #[test]
    fn nothing_is_exported_without_the_layer() {
        let _serial = crate::span_test_lock();
        let span = spans::job("j-3", "echo");
        assert_eq!(traceparent_of(&span), None);
        assert!(!link_to_traceparent(&span, "garbage"));
    }
}
