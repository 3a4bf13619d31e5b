//! The operations endpoints, for Kubernetes probes and Prometheus:
//!
//! - `GET /healthz`: 200 `{"status":"ok"}` whenever the process and its
//!   async runtime answer (a liveness probe: restart when it times out);
//! - `GET /readyz`: 200 `{"ready":true}` when the [`Readiness`] says so,
//!   else 503 `{"ready":false,"reason":"..."}` (not connected, layout not
//!   verified, draining);
//! - `GET /metrics`: the registry in the OpenMetrics text format.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use prometheus_client::registry::Registry;
use tokio::task::JoinHandle;

use crate::Readiness;

/// What the endpoints read.
#[derive(Clone, Debug)]
pub struct HttpState {
    pub readiness: Readiness,
    pub registry: Arc<Registry>,
}

impl HttpState {
    pub fn new(readiness: Readiness, registry: Arc<Registry>) -> Self {
        HttpState {
            readiness,
            registry,
        }
    }
}

/// A running server.
#[derive(Debug)]
pub struct HttpServer {
    /// The bound address (the real port when asked for port 0).
    pub local_addr: SocketAddr,
    /// The serving task; abort it to stop, or let the runtime end it.
    pub join: JoinHandle<()>,
}

/// The routes, for embedding or testing without a socket.
pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// Binds `addr` and serves [`router`] on a task. Binding errors are
/// returned (a taken port must fail the start, not go unnoticed).
pub async fn serve(addr: SocketAddr, state: HttpState) -> std::io::Result<HttpServer> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local_addr = listener.local_addr()?;
    let app = router(state);
    let join = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "HTTP server stopped");
        }
    });
    tracing::info!(addr = %local_addr, "serving /healthz, /readyz, /metrics");
    Ok(HttpServer { local_addr, join })
}

async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
}

async fn readyz(State(s): State<HttpState>) -> Response {
    match s.readiness.reason() {
        None => (StatusCode::OK, Json(serde_json::json!({"ready": true}))).into_response(),
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"ready": false, "reason": reason})),
        )
            .into_response(),
    }
}

async fn metrics(State(s): State<HttpState>) -> Response {
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        crate::metrics::encode(&s.registry),
    )
        .into_response()
}
