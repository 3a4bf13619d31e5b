//! An OTLP/gRPC trace collector on a loopback port: worker processes export
//! their spans to it (`OTEL_EXPORTER_OTLP_ENDPOINT`), tests read them back.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
pub use opentelemetry_proto::tonic::trace::v1::Span;
use tokio::sync::Notify;

#[derive(Clone, Default)]
struct Sink {
    spans: Arc<Mutex<Vec<Span>>>,
    arrived: Arc<Notify>,
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans = request
            .into_inner()
            .resource_spans
            .into_iter()
            .flat_map(|r| r.scope_spans)
            .flat_map(|s| s.spans);
        self.spans.lock().unwrap().extend(spans);
        self.arrived.notify_waiters();
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// A running collector; stops when dropped.
pub struct Collector {
    pub endpoint: String,
    sink: Sink,
    server: tokio::task::JoinHandle<()>,
}

impl Collector {
    pub async fn start() -> Collector {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sink = Sink::default();
        let svc = TraceServiceServer::new(sink.clone());
        let server = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await;
        });
        Collector {
            endpoint: format!("http://{addr}"),
            sink,
            server,
        }
    }

    /// The environment that makes a process export here, in small batches.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", self.endpoint.clone()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100".into()),
        ]
    }

    pub fn spans(&self) -> Vec<Span> {
        self.sink.spans.lock().unwrap().clone()
    }

    /// Waits until a span satisfying `pred` arrived.
    pub async fn wait_for(&self, within: Duration, pred: impl Fn(&Span) -> bool) -> Span {
        let fut = async {
            loop {
                let arrived = self.sink.arrived.notified();
                if let Some(s) = self.spans().into_iter().find(|s| pred(s)) {
                    return s;
                }
                arrived.await;
            }
        };
        tokio::time::timeout(within, fut).await.unwrap_or_else(|_| {
            panic!(
                "no such span within {within:?}; got {:?}",
                names(&self.spans())
            )
        })
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.server.abort();
    }
}

pub fn names(spans: &[Span]) -> Vec<String> {
    spans.iter().map(|s| s.name.clone()).collect()
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A string or integer attribute of a span, as text.
pub fn attr(s: &Span, key: &str) -> Option<String> {
    s.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
        .map(|v| match v {
            Value::StringValue(x) => x.clone(),
            Value::IntValue(i) => i.to_string(),
            Value::BoolValue(b) => b.to_string(),
            Value::DoubleValue(d) => d.to_string(),
            other => format!("{other:?}"),
        })
}
