//! The pages: jobs, one job, the fleet, dead letters, reviews, login; and
//! their live parts (Server-Sent Events of HTML fragments).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::Form;
use futures::{Stream, StreamExt};

use crate::app::{App, Failure};
use crate::auth::COOKIE;
use crate::render;

mod dlq_page;
mod filter;
mod fleet_page;
mod job_page;
mod jobs_page;
mod reviews_page;

pub use dlq_page::dlq;
pub use filter::{limit, number, only, JobFilter};
pub use fleet_page::{fleet, fleet_fragment, fleet_live};
pub use job_page::{job, job_live};
// Only the job page uses these; they stay reachable at their old paths.
#[allow(unused_imports)]
pub use job_page::{summary, superseded_row};
pub use jobs_page::{active_jobs, jobs, jobs_live};
pub use reviews_page::reviews;

type Q = Query<HashMap<String, String>>;

const ACTIVE: &[&str] = &["queued", "running", "waiting", "parked"];

fn bad(e: String) -> Failure {
    Failure::page(StatusCode::BAD_REQUEST, e)
}

fn html(body: String) -> Response {
    Html(body).into_response()
}

fn sse<S>(s: S) -> Sse<impl Stream<Item = Result<Event, Infallible>>>
where
    S: Stream<Item = Event> + Send + 'static,
{
    Sse::new(s.map(Ok)).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

/// A broadcast receiver as a stream (lagging receivers skip what they missed).
fn tokio_stream_from<T: Clone + Send + 'static>(
    rx: tokio::sync::broadcast::Receiver<T>,
) -> impl Stream<Item = Option<T>> + Send {
    futures::stream::unfold(rx, |mut rx| async move {
        loop {
            match rx.recv().await {
                Ok(v) => return Some((Some(v), rx)),
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                Err(_) => return None,
            }
        }
    })
}

pub async fn login_form() -> Response {
    html(render::layout(
        "log in",
        "<h1>Log in</h1><form method=\"post\" action=\"/login\"><input type=\"password\" name=\"token\" placeholder=\"token\" autocomplete=\"off\"> <button>log in</button></form>",
    ))
}

pub async fn login(
    State(app): State<Arc<App>>,
    headers: axum::http::HeaderMap,
    Form(f): Form<HashMap<String, String>>,
) -> Response {
    let t = f.get("token").cloned().unwrap_or_default();
    let ok = [&app.args.read_token, &app.args.operator_token]
        .into_iter()
        .flatten()
        .any(|x| crate::auth::same(x, &t));
    if !ok {
        return Failure::page(
            StatusCode::UNAUTHORIZED,
            "that token is not one of this console's",
        )
        .into_response();
    }
    // Behind TLS (the browser's page is https, or the proxy says so) the
    // cookie is never sent over plain HTTP.
    let https = |name: header::HeaderName, prefix: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().to_ascii_lowercase().starts_with(prefix))
    };
    let secure = https(header::ORIGIN, "https://")
        || https(
            header::HeaderName::from_static("x-forwarded-proto"),
            "https",
        );
    (
        [(
            header::SET_COOKIE,
            format!(
                "{COOKIE}={t}; HttpOnly; SameSite=Strict; Path=/{}",
                if secure { "; Secure" } else { "" }
            ),
        )],
        Redirect::to("/jobs"),
    )
        .into_response()
}

pub async fn script() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("../../static/console.js"),
    )
        .into_response()
}

pub async fn style() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("../../static/console.css"),
    )
        .into_response()
}

/// What a page says while the console has no view of the index: why, how
/// far the view is, and `then` (what the page shows instead).
pub fn view_notice(state: crate::feed::ViewState, then: &str) -> String {
    use crate::feed::ViewState;
    let why = match state {
        ViewState::Live => return String::new(),
        ViewState::Off => {
            "The console keeps no view of the index of active jobs (<code>--index-view off</code>)"
                .to_string()
        }
        ViewState::Loading { read: 0, .. } => {
            "The console is starting to read the index of active jobs".to_string()
        }
        ViewState::Loading { read, left } => format!(
            "The console is reading the index of active jobs ({read} entries read, {left} to go)"
        ),
    };
    format!(
        "<p class=\"notice\" id=\"index-view\">{why}: {}.</p>",
        render::esc(then)
    )
}
