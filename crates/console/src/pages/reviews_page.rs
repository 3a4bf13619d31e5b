//! The reviews page: the parked jobs waiting for a person, with their resume
//! and fail actions.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;

use crate::app::{App, Failure};
use crate::auth::Caller;
use crate::render::{self, esc, url};

use super::{active_jobs, bad, html, limit, number, only, JobFilter, Q};

pub async fn reviews(
    State(app): State<Arc<App>>,
    caller: Caller,
    q: Q,
) -> Result<Response, Failure> {
    only(&q, &["limit", "offset"]).map_err(bad)?;
    let f = JobFilter {
        status: Some("parked".into()),
        limit: limit(&q, app.args.page_max, 50).map_err(bad)?,
        offset: number(&q, "offset", 0).map_err(bad)?,
        ..Default::default()
    };
    let (rows, total) = active_jobs(&app, &f).await?;
    let mut b = format!("<h1>Reviews <small>{total} parked</small></h1><table><thead><tr><th>id</th><th>kind</th><th>reason</th><th>message</th><th>progress</th><th></th></tr></thead><tbody>");
    for r in &rows {
        let id = url(&r.id);
        let acts = if caller.can_act {
            format!("<a class=\"button\" href=\"/confirm?action=review-resume&id={id}\">resume…</a> <a class=\"button danger\" href=\"/confirm?action=review-fail&id={id}\">fail…</a>")
        } else {
            String::new()
        };
        let _ = write!(
            b,
            "<tr><td><a href=\"/jobs/{id}\">{}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{acts}</td></tr>",
            esc(&r.id),
            esc(&r.kind),
            esc(r.parked_reason.as_deref().unwrap_or("-")),
            esc(r.error.as_ref().map_or("", |e| e.message.as_str())),
            render::progress(r),
        );
    }
    b.push_str("</tbody></table>");
    Ok(html(render::layout("reviews", &app.gate(app.clean(&b)))))
}
