//! Spans reach an OTLP/gRPC collector: a fake one on a loopback port,
//! receiving what the batch exporter sends from its own thread.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold_telemetry::{spans, trace};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use tracing_subscriber::layer::SubscriberExt;

#[derive(Default)]
struct Collector(Arc<Mutex<Vec<ExportTraceServiceRequest>>>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.lock().expect("lock").push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_reach_an_otlp_grpc_collector() {
    let received = Arc::new(Mutex::new(Vec::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Collector(received.clone())))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );

    let provider =
        trace::otlp_provider("lh-export-test", Some(&format!("http://{addr}"))).expect("provider");
    let subscriber = tracing_subscriber::registry().with(trace::layer(&provider));
    tracing::subscriber::with_default(subscriber, || {
        let attempt = spans::attempt("j-9", "research", 1, 1, "w-1");
        let _a = attempt.enter();
        let chat = spans::chat("openai", "sim-1");
        spans::record_usage(&chat, 10, 2);
    });
    // The batch processor exports from its own thread; flushing waits for it.
    let p = provider.clone();
    tokio::task::spawn_blocking(move || p.force_flush())
        .await
        .expect("join")
        .expect("flush reaches the collector");

    let requests = received.lock().expect("lock").clone();
    let resource_spans: Vec<_> = requests.iter().flat_map(|r| &r.resource_spans).collect();
    let names: Vec<&str> = resource_spans
        .iter()
        .flat_map(|rs| &rs.scope_spans)
        .flat_map(|ss| &ss.spans)
        .map(|s| s.name.as_str())
        .collect();
    assert!(names.contains(&"chat sim-1"), "{names:?}");
    assert!(names.contains(&"attempt research"), "{names:?}");
    let service = resource_spans[0]
        .resource
        .as_ref()
        .expect("resource")
        .attributes
        .iter()
        .find(|kv| kv.key == "service.name")
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.clone());
    assert_eq!(service, Some(Value::StringValue("lh-export-test".into())));

    let p = provider.clone();
    tokio::task::spawn_blocking(move || p.shutdown_with_timeout(Duration::from_secs(5)))
        .await
        .expect("join")
        .expect("shutdown");
    server.abort();
}
