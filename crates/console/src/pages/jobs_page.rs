//! The jobs page: the active jobs from the index, the finished ones from the
//! feed, and its live rows.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use leasehold_core::JobRecord;
use leasehold_store::index::Filter;
use serde_json::json;

use crate::app::{App, Failure};
use crate::auth::Caller;
use crate::feed::TERMINAL;
use crate::render::{self, esc};

use super::{bad, html, sse, tokio_stream_from, view_notice, JobFilter, ACTIVE, Q};

/// How many active jobs matched: all of them, or (read from the index's
/// end while the console's view of the index is not there) at least so
/// many.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Matched {
    pub n: usize,
    pub more: bool,
}

impl std::fmt::Display for Matched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}", self.n, if self.more { "+" } else { "" })
    }
}

/// The active jobs matching `f` (index entries, then their records),
/// newest first: the page asked for and how many matched.
///
/// From the console's view of the index when it has it (only the page is
/// copied). Without it (`--index-view off`, or while the view loads), from
/// the index's end ([`Active::newest`](leasehold_store::index::Active::newest)):
/// the jobs up to the page's end and one more, so the count is "at least".
/// A tenant is in the records only: then the records of every match are
/// read (from the view, or a read of the status's entries).
pub async fn active_jobs(
    app: &App,
    f: &JobFilter,
) -> Result<(Vec<Arc<JobRecord>>, Matched), Failure> {
    let which = match f.status.as_deref() {
        Some("running") => Filter::Running,
        Some("queued") => Filter::Waiting,
        Some("parked") => Filter::Parked,
        Some("waiting") => Filter::Held,
        _ => Filter::All,
    };
    let admits = |job: &str, kind: &str, status: &str| {
        f.kind.as_ref().is_none_or(|k| k == kind)
            && f.prefix
                .as_ref()
                .is_none_or(|p| job.starts_with(p.as_str()))
            && f.status.as_ref().is_none_or(|s| s == status)
    };
    let of_row = |job: &str, r: &crate::feed::Row| admits(job, &r.kind, &r.status);
    let of_entry = |e: &leasehold_store::index::Entry| admits(&e.job, &e.kind, &e.status);
    let unavailable = |e| Failure::unavailable(e, false);
    if f.tenant.is_some() {
        let ids = match app.feed.matching(of_row) {
            Some(ids) => ids,
            None => {
                let mut entries: Vec<_> = app
                    .active
                    .list(which)
                    .await
                    .map_err(unavailable)?
                    .into_iter()
                    .map(|(_, e)| e)
                    .filter(of_entry)
                    .collect();
                entries.sort_by(|a, b| b.created_at.cmp(&a.created_at).then(a.job.cmp(&b.job)));
                entries.dedup_by(|a, b| a.job == b.job);
                entries.into_iter().map(|e| Arc::from(e.job)).collect()
            }
        };
        let mut all = Vec::new();
        for id in &ids {
            if let Ok(Some(r)) = app.feed.record(&app.jobs, id).await {
                if f.admits(&r) {
                    all.push(r);
                }
            }
        }
        let total = Matched {
            n: all.len(),
            more: false,
        };
        return Ok((
            all.into_iter().skip(f.offset).take(f.limit).collect(),
            total,
        ));
    }
    let unfiltered = f.kind.is_none() && f.prefix.is_none() && f.status.is_none();
    let (ids, total) = match app.feed.page(of_row, unfiltered, f.offset, f.limit) {
        Some((ids, n)) => (ids, Matched { n, more: false }),
        None => {
            let want = f.offset.saturating_add(f.limit).saturating_add(1);
            let found = app
                .active
                .newest(which, want, of_entry)
                .await
                .map_err(unavailable)?;
            let total = Matched {
                n: found.len(),
                more: found.len() == want,
            };
            let ids = found
                .into_iter()
                .skip(f.offset)
                .take(f.limit)
                .map(|(_, e)| Arc::from(e.job))
                .collect();
            (ids, total)
        }
    };
    let mut out = Vec::new();
    for id in &ids {
        match app.feed.record(&app.jobs, id).await {
            Ok(Some(r)) => out.push(r),
            Ok(None) => {}
            Err(e) => return Err(Failure::unavailable(e, false)),
        }
    }
    Ok((out, total))
}

/// The finished jobs (last hour) matching `f`, newest first, a page.
async fn finished_jobs(app: &App, f: &JobFilter) -> Vec<Arc<JobRecord>> {
    let keep = |x: &crate::feed::Finished| {
        f.status.as_ref().is_none_or(|s| *s == x.status)
            && f.kind
                .as_ref()
                .is_none_or(|k| x.kind.is_empty() || *k == x.kind)
            && f.prefix
                .as_ref()
                .is_none_or(|p| x.id.starts_with(p.as_str()))
    };
    let max = if f.tenant.is_some() {
        usize::MAX
    } else {
        f.offset.saturating_add(f.limit)
    };
    let mut out = Vec::new();
    let mut skipped = 0;
    for id in app.feed.recent_ids(keep, max) {
        if out.len() >= f.limit {
            break;
        }
        let Ok(Some(r)) = app.feed.record(&app.jobs, &id).await else {
            continue;
        };
        if !f.admits(&r) || !TERMINAL.contains(&r.status.as_str()) {
            continue;
        }
        if skipped < f.offset {
            skipped += 1;
            continue;
        }
        out.push(r);
    }
    out
}

pub async fn jobs(State(app): State<Arc<App>>, caller: Caller, q: Q) -> Result<Response, Failure> {
    let f = JobFilter::parse(&q, app.args.page_max).map_err(bad)?;
    let mut b = String::new();
    let opt = |sel: &Option<String>, v: &str| {
        format!(
            "<option{}>{}</option>",
            if sel.as_deref() == Some(v) {
                " selected"
            } else {
                ""
            },
            esc(v)
        )
    };
    let statuses: String = std::iter::once("<option value=\"\">any status</option>".to_string())
        .chain(ACTIVE.iter().chain(TERMINAL).map(|s| opt(&f.status, s)))
        .collect();
    let v = |o: &Option<String>| esc(o.as_deref().unwrap_or(""));
    let _ = write!(
        b,
        "<h1>Jobs</h1><form class=\"filters\" method=\"get\" action=\"/jobs\">\
<input name=\"kind\" placeholder=\"kind\" value=\"{}\"> <select name=\"status\">{statuses}</select> \
<input name=\"tenant\" placeholder=\"tenant\" value=\"{}\"> <input name=\"prefix\" placeholder=\"id prefix\" value=\"{}\"> \
<input name=\"limit\" size=\"4\" value=\"{}\"> <button>filter</button></form>",
        v(&f.kind),
        v(&f.tenant),
        v(&f.prefix),
        f.limit
    );
    let want_active = f
        .status
        .as_ref()
        .is_none_or(|s| ACTIVE.contains(&s.as_str()));
    let want_finished = f
        .status
        .as_ref()
        .is_none_or(|s| TERMINAL.contains(&s.as_str()));
    let live = format!("/jobs/live?{}", f.query());
    let t0 = std::time::Instant::now();
    if want_active {
        let (rows, total) = active_jobs(&app, &f).await?;
        tracing::debug!(
            ms = t0.elapsed().as_secs_f64() * 1e3,
            "jobs page: active read"
        );
        let _ = write!(
            b,
            "<h2>Active <small id=\"active-count\">{total} matching</small></h2>"
        );
        b.push_str(&view_notice(
            app.feed.view_state(),
            "this list is read from the index's end, newest first, and its count says how many were read",
        ));
        if caller.can_act && total.n > 0 {
            let _ = write!(
                b,
                "<p><a class=\"button danger\" href=\"/confirm?action=bulk-cancel&{}\">cancel all {total} matching…</a></p>",
                esc(&f.query())
            );
        }
        let _ = write!(
            b,
            "<table class=\"jobs\"><thead>{}</thead><tbody id=\"active\" data-live=\"{}\" data-status=\"{}\" data-first=\"{}\">",
            render::JOB_HEAD,
            esc(&live),
            esc(f.status.as_deref().unwrap_or("")),
            f.offset == 0
        );
        for r in &rows {
            b.push_str(&app.clean(&render::job_row(r)));
        }
        b.push_str("</tbody></table>");
        let base = format!("/jobs?{}&limit={}", f.query(), f.limit);
        if f.offset > 0 {
            let _ = write!(
                b,
                "<a href=\"{}&offset={}\">newer</a> ",
                esc(&base),
                f.offset.saturating_sub(f.limit)
            );
        }
        if f.offset.saturating_add(f.limit) < total.n {
            let _ = write!(
                b,
                "<a href=\"{}&offset={}\">older</a>",
                esc(&base),
                f.offset + f.limit
            );
        }
    }
    if want_finished {
        let t1 = std::time::Instant::now();
        let rows = finished_jobs(&app, &f).await;
        tracing::debug!(
            ms = t1.elapsed().as_secs_f64() * 1e3,
            "jobs page: finished read"
        );
        let _ = write!(
            b,
            "<h2>Finished in the last hour</h2><table class=\"jobs\"><thead>{}</thead><tbody id=\"finished\" data-live=\"{}\">",
            render::JOB_HEAD,
            esc(&live)
        );
        for r in &rows {
            b.push_str(&app.clean(&render::job_row(r)));
        }
        b.push_str("</tbody></table>");
        b.push_str(&crate::search::section(
            &f.kind, &f.status, &f.tenant, &f.prefix,
        ));
    }
    Ok(html(render::layout("jobs", &app.gate(b))))
}

pub async fn jobs_live(
    State(app): State<Arc<App>>,
    caller: Caller,
    q: Q,
) -> Result<Response, Failure> {
    let mut q = q.0;
    q.remove("offset");
    q.remove("limit");
    let f = JobFilter::parse(&q, app.args.page_max).map_err(bad)?;
    let slot = app.streams.open(&caller, false)?;
    let rx = app.feed.records.subscribe();
    let s = tokio_stream_from(rx).filter_map(move |r| {
        let app = app.clone();
        let f = f.clone();
        async move {
            let r = r?;
            if !f.admits(&r) {
                return None;
            }
            let html = app.clean(&render::job_row(&r));
            Some(
                Event::default()
                    .event("row")
                    .data(json!({"id": r.id, "status": r.status, "html": html}).to_string()),
            )
        }
    });
    Ok(sse(slot.hold(s)).into_response())
}
