//! Log output, the same in every binary: everything to stderr, filtered by
//! `RUST_LOG` (default `info`, or what the binary passes), formatted by
//! `LH_LOG_FORMAT`:
//!
//! - `text` (default): human-readable lines, coloured only when stderr is a
//!   terminal and `NO_COLOR` is unset or empty. Each line is `timestamp
//!   LEVEL [context] target: message fields`, where the context is compact:
//!   the job id, `e<epoch>`, the phase, `s<section>` and the tool of the
//!   spans the line is logged in ([`ContextFields`]), never every span
//!   field (those go to JSON logs and traces);
//! - `json`: one JSON object per line with `timestamp`, `level`, `target`,
//!   `fields`, the current span (`span`, with its fields) and the list of
//!   entered spans (`spans`), never coloured.
//!
//! Log credentials through [`crate::redact_url`] / [`crate::Secret`].

use std::fmt;
use std::io::IsTerminal;

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::{DefaultFields, FormatEvent, FormatFields, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormattedFields, MakeWriter};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// `LH_LOG_FORMAT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

impl LogFormat {
    /// `text` or `json` (case-insensitive); `None` for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "text" | "" => Some(LogFormat::Text),
            "json" => Some(LogFormat::Json),
            _ => None,
        }
    }

    /// From `LH_LOG_FORMAT`; text when unset. An unknown value gives text
    /// and is returned as the error's second half so the caller can warn
    /// once logging works.
    pub fn from_env() -> Result<Self, (Self, String)> {
        match std::env::var("LH_LOG_FORMAT") {
            Err(_) => Ok(LogFormat::Text),
            Ok(v) => LogFormat::parse(&v).ok_or((LogFormat::Text, v)),
        }
    }
}

/// Whether text logs get ANSI colours: stderr is a terminal and `NO_COLOR`
/// is unset or empty (<https://no-color.org>).
pub fn ansi() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// `RUST_LOG`, or `default` when it is unset or invalid.
pub fn env_filter(default: &str) -> EnvFilter {
    EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default))
}

/// The JSON formatter as the binaries use it, writing to `writer`.
pub fn json_layer<S, W>(writer: W) -> Box<dyn Layer<S> + Send + Sync>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    tracing_subscriber::fmt::layer()
        .json()
        .with_current_span(true)
        .with_span_list(true)
        .with_ansi(false)
        .with_writer(writer)
        .boxed()
}

/// The text formatter as the binaries use it, writing to `writer`.
pub fn text_layer<S, W>(writer: W, ansi: bool) -> Box<dyn Layer<S> + Send + Sync>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    tracing_subscriber::fmt::layer()
        .fmt_fields(ContextFields)
        .event_format(CompactText)
        .with_ansi(ansi)
        .with_writer(writer)
        .boxed()
}

/// How text logs keep a span's fields: only what tells a reader where a
/// line comes from (job id, `e<epoch>`, phase, `s<section>`, tool), not
/// the trace attributes (`otel.*`, `gen_ai.*`, outcome, worker id) that
/// would repeat on every line. A field of a span outside leasehold's
/// namespaces is kept as `name=value`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ContextFields;

/// The context fields of one span, as [`ContextFields`] keeps them.
#[derive(Default)]
struct ContextVisitor {
    parts: Vec<String>,
}

impl ContextVisitor {
    fn keep(&mut self, name: &str, value: String) {
        let part = match name {
            "leasehold.job.id" | "leasehold.phase" | "gen_ai.tool.name" => value,
            "leasehold.job.epoch" => format!("e{value}"),
            "leasehold.section.index" => format!("s{value}"),
            n if n.starts_with("leasehold.")
                || n.starts_with("otel.")
                || n.starts_with("gen_ai.")
                || n.starts_with("error.")
                || n == "message" =>
            {
                return
            }
            n => format!("{n}={value}"),
        };
        self.parts.push(part);
    }
}

impl Visit for ContextVisitor {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.keep(field.name(), value.to_string());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.keep(field.name(), value.to_string());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.keep(field.name(), value.to_string());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.keep(field.name(), format!("{value:?}"));
    }
}

impl<'w> FormatFields<'w> for ContextFields {
    fn format_fields<R: RecordFields>(&self, mut writer: Writer<'w>, fields: R) -> fmt::Result {
        let mut v = ContextVisitor::default();
        fields.record(&mut v);
        writer.write_str(&v.parts.join(" "))
    }

    fn add_fields(
        &self,
        current: &'w mut FormattedFields<Self>,
        fields: &tracing::span::Record<'_>,
    ) -> fmt::Result {
        let mut v = ContextVisitor::default();
        fields.record(&mut v);
        for p in v.parts {
            if !current.fields.is_empty() {
                current.fields.push(' ');
            }
            current.fields.push_str(&p);
        }
        Ok(())
    }
}

/// The text line: `timestamp LEVEL [context] target: message fields`, the
/// context being the [`ContextFields`] of the spans the event is in, root
/// first, each value once.
#[derive(Debug, Clone, Copy, Default)]
pub struct CompactText;

impl<S, N> FormatEvent<S, N> for CompactText
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut w: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let ansi = w.has_ansi_escapes();
        SystemTime.format_time(&mut w)?;
        let level = *event.metadata().level();
        let colour = match level {
            Level::ERROR => "31",
            Level::WARN => "33",
            Level::INFO => "32",
            Level::DEBUG => "34",
            Level::TRACE => "35",
        };
        if ansi {
            write!(w, " \x1b[{colour}m{level:>5}\x1b[0m ")?;
        } else {
            write!(w, " {level:>5} ")?;
        }
        let mut context: Vec<String> = Vec::new();
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                let ext = span.extensions();
                let Some(f) = ext.get::<FormattedFields<N>>() else {
                    continue;
                };
                for part in f.fields.split(' ').filter(|p| !p.is_empty()) {
                    if !context.iter().any(|c| c == part) {
                        context.push(part.to_string());
                    }
                }
            }
        }
        if !context.is_empty() {
            write!(w, "[{}] ", context.join(" "))?;
        }
        write!(w, "{}: ", event.metadata().target())?;
        DefaultFields::new().format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

/// The formatting layer for `format`, writing to stderr.
pub fn stderr_layer<S>(format: LogFormat) -> Box<dyn Layer<S> + Send + Sync>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    match format {
        LogFormat::Json => json_layer(std::io::stderr),
        LogFormat::Text => text_layer(std::io::stderr, ansi()),
    }
}

/// Installs logging only (no trace export) as the global subscriber, with
/// `default_filter` when `RUST_LOG` is unset (`"info"` for services,
/// `"warn"` for the CLI). Does nothing if a subscriber is already set.
/// Services use [`crate::trace::init`] instead, which adds trace export.
pub fn init(default_filter: &str) {
    let (format, bad) = match LogFormat::from_env() {
        Ok(f) => (f, None),
        Err((f, v)) => (f, Some(v)),
    };
    let installed = tracing_subscriber::registry()
        .with(env_filter(default_filter))
        .with(stderr_layer(format))
        .try_init()
        .is_ok();
    if let (true, Some(v)) = (installed, bad) {
        tracing::warn!(value = %v, "LH_LOG_FORMAT must be `text` or `json`; using text");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    /// A `MakeWriter` into a shared buffer.
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("buf").extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Buf {
        type Writer = Buf;
        fn make_writer(&'a self) -> Buf {
            self.clone()
        }
    }

    #[test]
    fn json_lines_carry_the_span_fields() {
        let _serial = crate::span_test_lock();
        let buf = Buf::default();
        let subscriber = tracing_subscriber::registry()
            .with(EnvFilter::new("info"))
            .with(json_layer(buf.clone()));
        tracing::subscriber::with_default(subscriber, || {
            let job = tracing::info_span!("job", job_id = "j-1", kind = "echo");
            let _j = job.enter();
            let attempt = tracing::info_span!("attempt", epoch = 3);
            let _a = attempt.enter();
            tracing::info!(slot = 2, "claimed");
            tracing::debug!("filtered out");
            tracing::warn!(url = %crate::redact_url("nats://u:pw@h:4222"), "connecting");
        });
        let out = String::from_utf8(buf.0.lock().expect("buf").clone()).expect("utf-8");
        let lines: Vec<serde_json::Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).expect("each line is one JSON object"))
            .collect();
        assert_eq!(lines.len(), 2, "{out}");
        let first = &lines[0];
        assert_eq!(first["level"], "INFO");
        assert_eq!(first["fields"]["message"], "claimed");
        assert_eq!(first["fields"]["slot"], 2);
        assert_eq!(first["span"]["name"], "attempt");
        assert_eq!(first["span"]["epoch"], 3);
        let spans = first["spans"].as_array().expect("span list");
        assert_eq!(spans[0]["name"], "job");
        assert_eq!(spans[0]["job_id"], "j-1");
        assert_eq!(spans[0]["kind"], "echo");
        assert_eq!(lines[1]["fields"]["url"], "nats://u:***@h:4222");
        assert!(!out.contains('\u{1b}'), "no ANSI escapes in JSON");
    }

    #[test]
    fn text_without_ansi_has_no_escapes() {
        let _serial = crate::span_test_lock();
        let buf = Buf::default();
        let subscriber = tracing_subscriber::registry().with(text_layer(buf.clone(), false));
        tracing::subscriber::with_default(subscriber, || {
            let s = tracing::info_span!("attempt", epoch = 1);
            let _g = s.enter();
            tracing::error!("boom");
        });
        let out = String::from_utf8(buf.0.lock().expect("buf").clone()).expect("utf-8");
        assert!(out.contains("[epoch=1] "), "{out}");
        assert!(!out.contains('\u{1b}'), "{out}");
    }

    #[test]
    fn text_lines_name_the_job_and_epoch_not_every_span_field() {
        let _serial = crate::span_test_lock();
        let buf = Buf::default();
        let subscriber = tracing_subscriber::registry()
            .with(EnvFilter::new("info"))
            .with(text_layer(buf.clone(), false));
        tracing::subscriber::with_default(subscriber, || {
            let attempt = crate::spans::attempt("j-1", "research", 3, 2, "worker-abcdef");
            let _a = attempt.enter();
            let phase = crate::spans::phase("outline");
            let _p = phase.enter();
            crate::spans::record_outcome(&attempt, "failed");
            tracing::warn!(class = "retryable", "attempt failed");
        });
        let out = String::from_utf8(buf.0.lock().expect("buf").clone()).expect("utf-8");
        let line = out.lines().next().expect("one line");
        assert!(
            line.contains(" WARN [j-1 e3 outline] leasehold_telemetry::logs::tests: attempt failed class=\"retryable\""),
            "{line}"
        );
        for noise in ["otel", "gen_ai", "worker-abcdef", "leasehold.", "failed}"] {
            assert!(!line.contains(noise), "{noise} in {line}");
        }
    }

    #[test]
    fn formats_parse() {
        assert_eq!(LogFormat::parse("JSON"), Some(LogFormat::Json));
        assert_eq!(LogFormat::parse("text"), Some(LogFormat::Text));
        assert_eq!(LogFormat::parse("yaml"), None);
    }
}
