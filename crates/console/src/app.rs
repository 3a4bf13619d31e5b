//! The console's state and routes.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use leasehold_store::artifacts::Artifacts;
use leasehold_store::dlq::Dlq;
use leasehold_store::events::Events;
use leasehold_store::index::Active;
use leasehold_store::sessions::Sessions;
use leasehold_store::{retry_unavailable, Conn, Jobs};

use crate::cache::RecordCache;
use crate::feed::Feed;
use crate::fleet::FleetView;
use crate::metrics::ConsoleMetrics;
use crate::ops::Ops;
use crate::streams::Streams;
use crate::{actions, api, pages, Args};

/// Everything a request needs.
pub struct App {
    pub args: Args,
    pub conn: Conn,
    /// Actions' connection (the operator user), or `conn` (see
    /// [`App::actions_off`]).
    pub op: Conn,
    /// Why actions are refused, when they are: the console reads as a NATS
    /// user and has no operator connection. `None`: actions run on `op`.
    pub actions_off: Option<String>,
    pub jobs: Jobs,
    pub op_jobs: Jobs,
    pub active: Active,
    pub events: Events,
    pub sessions: Sessions,
    pub dlq: Dlq,
    pub op_dlq: Dlq,
    pub artifacts: Artifacts,
    pub feed: Feed,
    pub metrics: ConsoleMetrics,
    /// The live streams each caller holds.
    pub streams: Arc<Streams>,
    /// The fleet view every tab shares.
    pub fleet: FleetView,
    /// Bulk actions, running and recent.
    pub ops: Ops,
    /// The fleet's charts' ring, filled by [`crate::sampler::run`].
    pub charts: crate::sampler::Charts,
    /// Drawn at start: the CSRF fields' key.
    pub secret: String,
    /// Values never shown.
    pub secrets: Vec<String>,
    /// Job waterfalls' models, by job.
    pub waterfalls: crate::waterfall_page::Waterfalls,
}

const OPEN: std::time::Duration = std::time::Duration::from_secs(120);

impl App {
    pub async fn start(args: Args) -> anyhow::Result<App> {
        let conn = args.nats.connect("leasehold-console").await?;
        let has_op = args.operator_nats_user.is_some() || args.operator_nats_creds.is_some();
        let actions_off = actions_off(&args.nats, has_op);
        if let Some(why) = &actions_off {
            tracing::warn!("{why}");
        }
        let op = if has_op {
            let mut n = args.nats.clone();
            n.user = args.operator_nats_user.clone();
            n.password = args.operator_nats_password.clone();
            n.creds = args.operator_nats_creds.clone();
            n.token = None;
            n.inbox_prefix = args.operator_inbox_prefix.clone();
            n.connect("leasehold-console operator").await?
        } else {
            conn.clone()
        };
        let jobs = retry_unavailable("jobs bucket", OPEN, || Jobs::open(&conn)).await?;
        let op_jobs = retry_unavailable("jobs bucket", OPEN, || Jobs::open(&op)).await?;
        let active = retry_unavailable("index", OPEN, || Active::open(&conn)).await?;
        let sessions = retry_unavailable("sessions", OPEN, || Sessions::open(&conn)).await?;
        let artifacts = retry_unavailable("artifacts", OPEN, || Artifacts::open(&conn)).await?;
        let events = Events::new(&conn);
        let metrics = ConsoleMetrics::default();
        let cache = RecordCache::new(args.record_cache_bytes, args.record_cache_records);
        let feed = Feed::start(
            &jobs,
            &events,
            &active,
            cache,
            metrics.clone(),
            args.index_view,
        )
        .await?;
        let mut secrets: Vec<String> = [
            args.read_token.clone(),
            args.operator_token.clone(),
            args.nats.password.clone(),
            args.nats.token.clone(),
            args.operator_nats_password.clone(),
            std::env::var("LH_API_KEY").ok(),
        ]
        .into_iter()
        .flatten()
        .chain(args.redact.iter().cloned())
        .filter(|s| s.len() >= 4)
        .collect();
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        let streams = Streams::new(args.streams_per_caller as usize, metrics.clone());
        let ops = Ops::new(args.bulk_max as usize, metrics.clone());
        let chart_interval = args.chart_interval;
        let args_waterfall = args.waterfall_cache_bytes;
        Ok(App {
            actions_off,
            dlq: Dlq::new(&conn),
            op_dlq: Dlq::new(&op),
            secret: uuid::Uuid::new_v4().simple().to_string(),
            args,
            jobs,
            op_jobs,
            active,
            events,
            sessions,
            artifacts,
            feed,
            streams,
            fleet: FleetView::default(),
            charts: crate::sampler::Charts::new(chart_interval),
            ops,
            metrics,
            secrets,
            waterfalls: crate::waterfall_page::Waterfalls::new(args_waterfall),
            conn,
            op,
        })
    }

    /// `body` as it may be shown: when actions are off, every action
    /// button (a link to `/confirm`) is disabled, saying why, and a note
    /// above says it once.
    pub fn gate(&self, body: String) -> String {
        let Some(why) = &self.actions_off else {
            return body;
        };
        if !body.contains("href=\"/confirm?") {
            return body;
        }
        let why = crate::render::esc(why);
        let off = body
            .replace(
                "<a class=\"button",
                &format!("<a aria-disabled=\"true\" title=\"{why}\" class=\"disabled button"),
            )
            .replace("href=\"/confirm?", "data-action=\"/confirm?");
        format!("<p class=\"error\" id=\"actions-off\">Actions are off: {why}</p>{off}")
    }

    /// Refuses an action when actions are off, with the reason.
    pub fn may_act(&self, json: bool) -> Result<(), Failure> {
        match &self.actions_off {
            None => Ok(()),
            Some(why) => Err(Failure {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: format!("actions are off: {why}"),
                json,
            }),
        }
    }

    /// `s` with every configured secret and every URL's credentials masked.
    pub fn clean(&self, s: &str) -> String {
        let mut out = leasehold_telemetry::redact_text(s);
        for sec in &self.secrets {
            if out.contains(sec.as_str()) {
                out = out.replace(sec.as_str(), "[redacted]");
            }
        }
        out
    }
}

/// Why actions are off, or `None` when they may run: with an operator
/// connection they run there; on a console connected without credentials
/// (a server without auth, where any client may do anything) they run on
/// its own connection; a console reading as a NATS user (`lh-console`,
/// read-only) has no connection that may act.
pub fn actions_off(nats: &leasehold_store::NatsArgs, has_operator: bool) -> Option<String> {
    if has_operator || (nats.user.is_none() && nats.creds.is_none() && nats.token.is_none()) {
        return None;
    }
    let who = match (&nats.user, &nats.creds) {
        (Some(u), _) => format!("NATS user {u}"),
        (None, Some(c)) => format!("the NATS credentials {}", c.display()),
        _ => "a NATS token".to_string(),
    };
    Some(format!(
        "the console reads as {who} and has no operator connection; \
start it with --operator-nats-user and --operator-nats-password \
(LH_CONSOLE_OPERATOR_NATS_USER, LH_CONSOLE_OPERATOR_NATS_PASSWORD) or \
--operator-nats-creds (LH_CONSOLE_OPERATOR_NATS_CREDS), e.g. as lh-operator"
    ))
}

/// A failed request: its status and a sentence; HTML or JSON by the route.
#[derive(Debug)]
pub struct Failure {
    pub status: StatusCode,
    pub message: String,
    pub json: bool,
}

impl Failure {
    pub fn page(status: StatusCode, message: impl Into<String>) -> Self {
        Failure {
            status,
            message: message.into(),
            json: false,
        }
    }
    pub fn api(status: StatusCode, message: impl Into<String>) -> Self {
        Failure {
            status,
            message: message.into(),
            json: true,
        }
    }
    pub fn unavailable(e: impl std::fmt::Display, json: bool) -> Self {
        Failure {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: format!("NATS did not answer ({e}); try again"),
            json,
        }
    }
}

/// A job id the console was given, checked before it names a key or a
/// subject: anything else (`*`, `>`, a `.`) would be a wildcard or another
/// token there, and one read would become a read of every job. 400 saying
/// what an id is.
pub fn job_id(id: &str, json: bool) -> Result<(), Failure> {
    if leasehold_core::spec::valid_job_id(id) {
        return Ok(());
    }
    Err(Failure {
        status: StatusCode::BAD_REQUEST,
        message: leasehold_core::spec::SubmitError::InvalidId(id.to_string()).to_string(),
        json,
    })
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let message = leasehold_telemetry::redact_text(&self.message);
        if self.json {
            (
                self.status,
                [(header::CONTENT_TYPE, "application/json")],
                serde_json::json!({"error": message}).to_string(),
            )
                .into_response()
        } else {
            let body = crate::render::layout(
                &format!("{}", self.status),
                &format!(
                    "<p class=\"error\">{}</p><p><a href=\"/jobs\">jobs</a></p>",
                    crate::render::esc(&message)
                ),
            );
            (
                self.status,
                [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
                body,
            )
                .into_response()
        }
    }
}

/// Every request: refused when its `Host` may not be served (see
/// [`crate::auth::host_refused`]); every answer: never framed by another
/// site (a confirmation clicked through in a hidden frame), never sniffed
/// as another type, and no URL sent to another site.
async fn guard(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| req.uri().authority().map(|a| a.as_str()));
    let mut resp = match crate::auth::host_refused(&app.args, host) {
        Some(why) => Failure {
            status: StatusCode::FORBIDDEN,
            message: why,
            json: req.uri().path().starts_with("/v1/"),
        }
        .into_response(),
        None => next.run(req).await,
    };
    let h = resp.headers_mut();
    for (k, v) in [
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::CONTENT_SECURITY_POLICY, "frame-ancestors 'none'"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "same-origin"),
    ] {
        h.insert(k, header::HeaderValue::from_static(v));
    }
    resp
}

/// The console's metrics (read auth, as every page).
async fn metrics(State(app): State<Arc<App>>, _caller: crate::auth::Caller) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            leasehold_telemetry::metrics::CONTENT_TYPE,
        )],
        leasehold_telemetry::metrics::encode(&app.metrics.registry()),
    )
        .into_response()
}

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/", get(|| async { axum::response::Redirect::to("/jobs") }))
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .route("/ops/{id}", get(crate::ops::page))
        .route("/login", get(pages::login_form).post(pages::login))
        .route("/static/console.js", get(pages::script))
        .route("/static/console.css", get(pages::style))
        .route("/jobs", get(pages::jobs))
        .route("/jobs/live", get(pages::jobs_live))
        .route("/jobs/{id}", get(pages::job))
        .route("/jobs/{id}/live", get(pages::job_live))
        .route("/history", get(crate::search::page))
        .route("/jobs/{id}/waterfall", get(crate::waterfall_page::route))
        .route("/fleet", get(pages::fleet))
        .route("/fleet/live", get(pages::fleet_live))
        .route("/fleet/charts", get(crate::chartview::fragment))
        .route("/v1/fleet/charts", get(crate::chartview::json))
        .route("/dlq", get(pages::dlq))
        .route("/reviews", get(pages::reviews))
        .route("/confirm", get(actions::confirm))
        .route("/actions/{action}", post(actions::act))
        .route("/v1/jobs/{id}", get(api::record))
        .route("/v1/jobs/{id}/result", get(api::result))
        .route("/v1/jobs/{id}/events", get(api::events))
        .layer(axum::middleware::from_fn_with_state(app.clone(), guard))
        .with_state(app)
}
