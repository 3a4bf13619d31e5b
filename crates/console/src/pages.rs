//! The pages: jobs, one job, the fleet, dead letters, reviews, login; and
//! their live parts (Server-Sent Events of HTML fragments).

use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::Form;
use futures::{Stream, StreamExt};
use leasehold_core::JobRecord;
use leasehold_store::index::Filter;
use serde_json::json;

use crate::app::{App, Failure};
use crate::auth::{Caller, COOKIE};
use crate::feed::TERMINAL;
use crate::render::{self, esc, url};

type Q = Query<HashMap<String, String>>;

const ACTIVE: &[&str] = &["queued", "running", "parked"];

/// The jobs page's filters, checked.
#[derive(Debug, Clone, Default)]
pub struct JobFilter {
    pub kind: Option<String>,
    pub status: Option<String>,
    pub tenant: Option<String>,
    pub prefix: Option<String>,
    pub limit: usize,
    pub offset: usize,
}

/// A number parameter, or a sentence saying what is wrong with it.
pub fn number(q: &HashMap<String, String>, key: &str, default: usize) -> Result<usize, String> {
    match q.get(key).map(|s| s.trim()).filter(|s| !s.is_empty()) {
        None => Ok(default),
        Some(v) => v
            .parse()
            .map_err(|_| format!("{key}={v:?} is not a whole number")),
    }
}

/// The page size asked for, refused over the largest page.
pub fn limit(
    q: &HashMap<String, String>,
    page_max: usize,
    default: usize,
) -> Result<usize, String> {
    let n = number(q, "limit", default)?;
    if n == 0 || n > page_max {
        return Err(format!(
            "limit={n} is outside 1..={page_max} (the largest page, --page-max)"
        ));
    }
    Ok(n)
}

/// Checks the keys of `q` against `allowed`.
pub fn only(q: &HashMap<String, String>, allowed: &[&str]) -> Result<(), String> {
    for k in q.keys() {
        if !allowed.contains(&k.as_str()) {
            return Err(format!(
                "unknown parameter {k:?}; this page takes {}",
                allowed.join(", ")
            ));
        }
    }
    Ok(())
}

impl JobFilter {
    pub fn parse(q: &HashMap<String, String>, page_max: usize) -> Result<JobFilter, String> {
        only(
            q,
            &["kind", "status", "tenant", "prefix", "limit", "offset"],
        )?;
        let get = |k: &str| {
            q.get(k)
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        };
        let status = get("status");
        if let Some(s) = &status {
            if !ACTIVE.contains(&s.as_str()) && !TERMINAL.contains(&s.as_str()) {
                return Err(format!(
                    "status={s:?} is not a status; use one of {}, {}",
                    ACTIVE.join(", "),
                    TERMINAL.join(", ")
                ));
            }
        }
        for (k, v) in [
            ("kind", get("kind")),
            ("prefix", get("prefix")),
            ("tenant", get("tenant")),
        ] {
            if v.as_ref()
                .is_some_and(|v| v.len() > 256 || v.chars().any(char::is_control))
            {
                return Err(format!(
                    "{k} is not a plausible value (at most 256 printable characters)"
                ));
            }
        }
        Ok(JobFilter {
            kind: get("kind"),
            status,
            tenant: get("tenant"),
            prefix: get("prefix"),
            limit: limit(q, page_max, 50)?,
            offset: number(q, "offset", 0)?,
        })
    }

    fn query(&self) -> String {
        let mut parts = Vec::new();
        for (k, v) in [
            ("kind", &self.kind),
            ("status", &self.status),
            ("tenant", &self.tenant),
            ("prefix", &self.prefix),
        ] {
            if let Some(v) = v {
                parts.push(format!("{k}={}", url(v)));
            }
        }
        parts.join("&")
    }

    /// Whether a record passes kind, prefix and tenant (not status).
    pub fn admits(&self, r: &JobRecord) -> bool {
        self.kind.as_ref().is_none_or(|k| *k == r.kind)
            && self
                .prefix
                .as_ref()
                .is_none_or(|p| r.id.starts_with(p.as_str()))
            && self
                .tenant
                .as_ref()
                .is_none_or(|t| render::tenant(r).as_deref() == Some(t.as_str()))
    }
}

fn bad(e: String) -> Failure {
    Failure::page(StatusCode::BAD_REQUEST, e)
}

fn html(body: String) -> Response {
    Html(body).into_response()
}

/// The active jobs matching `f` (index entries, then their records),
/// newest first: the page asked for and how many matched.
pub async fn active_jobs(
    app: &App,
    f: &JobFilter,
) -> Result<(Vec<Arc<JobRecord>>, usize), Failure> {
    let which = match f.status.as_deref() {
        Some("running") => Filter::Running,
        Some("queued") => Filter::Waiting,
        Some("parked") => Filter::Parked,
        _ => Filter::All,
    };
    let keep = |e: &leasehold_store::index::Entry| {
        f.kind.as_ref().is_none_or(|k| *k == e.kind)
            && f.prefix
                .as_ref()
                .is_none_or(|p| e.job.starts_with(p.as_str()))
            && f.status.as_ref().is_none_or(|s| *s == e.status)
    };
    // The index as the console's watch has it (only the page is copied);
    // the index itself until then, or for a tenant (in the records only).
    if f.tenant.is_none() {
        let unfiltered = f.kind.is_none() && f.prefix.is_none() && f.status.is_none();
        if let Some((page, total)) = app.feed.page(keep, unfiltered, f.offset, f.limit) {
            let mut out = Vec::new();
            for e in &page {
                match app.feed.record(&app.jobs, &e.job).await {
                    Ok(Some(r)) => out.push(r),
                    Ok(None) => {}
                    Err(e) => return Err(Failure::unavailable(e, false)),
                }
            }
            return Ok((out, total));
        }
    }
    let all = match app.feed.entries() {
        Some(v) => v,
        None => app
            .active
            .list(which)
            .await
            .map_err(|e| Failure::unavailable(e, false))?
            .into_iter()
            .map(|(_, e)| e)
            .collect(),
    };
    let mut entries: Vec<_> = all.into_iter().filter(|e| keep(e)).collect();
    entries.sort_by(|a, b| b.created_at.cmp(&a.created_at).then(a.job.cmp(&b.job)));
    entries.dedup_by(|a, b| a.job == b.job);
    let mut out = Vec::new();
    if f.tenant.is_some() {
        // The tenant is in the records only: read those of the matches.
        let mut all = Vec::new();
        for e in &entries {
            if let Ok(Some(r)) = app.feed.record(&app.jobs, &e.job).await {
                if f.admits(&r) {
                    all.push(r);
                }
            }
        }
        let total = all.len();
        return Ok((
            all.into_iter().skip(f.offset).take(f.limit).collect(),
            total,
        ));
    }
    let total = entries.len();
    for e in entries.iter().skip(f.offset).take(f.limit) {
        match app.feed.record(&app.jobs, &e.job).await {
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
        f.offset + f.limit
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
        if caller.can_act && total > 0 {
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
        if f.offset + f.limit < total {
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

fn sse<S>(s: S) -> Sse<impl Stream<Item = Result<Event, Infallible>>>
where
    S: Stream<Item = Event> + Send + 'static,
{
    Sse::new(s.map(Ok)).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
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

/// A job's summary block (its live part replaces it as the record changes).
pub fn summary(app: &App, r: &JobRecord, caller: &Caller) -> String {
    let mut b = String::new();
    let row = |b: &mut String, k: &str, v: String| {
        let _ = write!(b, "<tr><th>{}</th><td>{}</td></tr>", esc(k), v);
    };
    b.push_str("<table class=\"summary\">");
    row(
        &mut b,
        "status",
        format!(
            "<b class=\"status st-{0}\">{0}</b>{1}",
            esc(&r.status),
            if r.cancel_requested {
                " (cancel requested)"
            } else {
                ""
            }
        ),
    );
    row(&mut b, "kind", esc(&r.kind));
    row(&mut b, "progress", render::progress(r));
    row(&mut b, "attempts", r.attempts.to_string());
    row(&mut b, "stale reclaims", r.stale_reclaims.to_string());
    row(&mut b, "epoch", r.epoch.to_string());
    row(&mut b, "worker", esc(r.worker_id.as_deref().unwrap_or("-")));
    row(
        &mut b,
        "age",
        format!(
            "{} (created {})",
            render::age(&r.created_at),
            esc(&r.created_at)
        ),
    );
    row(&mut b, "updated", esc(&r.updated_at));
    if let Some(t) = render::tenant(r) {
        row(&mut b, "tenant", esc(&t));
    }
    if let Some(e) = &r.error {
        row(
            &mut b,
            "error",
            format!("{}: {}", esc(&e.class), esc(&e.message)),
        );
    }
    if let Some(p) = &r.parked_reason {
        row(&mut b, "parked", esc(p));
    }
    if let Some(u) = &r.budget_used {
        row(
            &mut b,
            "budget used",
            format!(
                "{} steps, {} tokens, {:.1} s, ${:.4}",
                u.steps, u.tokens, u.wall_s, u.cost_usd
            ),
        );
    }
    b.push_str("</table>");
    if caller.can_act {
        let id = url(&r.id);
        b.push_str("<p class=\"actions\">");
        if ACTIVE.contains(&r.status.as_str()) && !r.cancel_requested {
            let _ = write!(b, "<a class=\"button danger\" id=\"cancel\" href=\"/confirm?action=cancel&id={id}\">cancel…</a> ");
        }
        if r.status == "parked" {
            let _ = write!(b, "<a class=\"button\" href=\"/confirm?action=review-resume&id={id}\">resume…</a> <a class=\"button danger\" href=\"/confirm?action=review-fail&id={id}\">fail…</a>");
        }
        b.push_str("</p>");
    }
    app.gate(app.clean(&b))
}

pub async fn job(
    State(app): State<Arc<App>>,
    caller: Caller,
    Path(id): Path<String>,
    q: Q,
) -> Result<Response, Failure> {
    only(&q, &["after", "limit"]).map_err(bad)?;
    crate::app::job_id(&id, false)?;
    let after = number(&q, "after", 0).map_err(bad)? as u64;
    let lim = limit(&q, app.args.page_max, app.args.page_max).map_err(bad)?;
    let Some(v) = app
        .jobs
        .get(&id)
        .await
        .map_err(|e| Failure::unavailable(e, false))?
    else {
        return Err(Failure::page(
            StatusCode::NOT_FOUND,
            format!("no job {id:?}: it may not have been picked up yet, it was forgotten after its retention, or the id is wrong"),
        ));
    };
    let r = v.value;
    let (events, more) = timeline_page(&app, &id, after, lim).await?;
    let mut b = String::new();
    let _ = write!(
        b,
        "<h1>Job <code>{}</code></h1><div id=\"summary\">{}</div>",
        esc(&id),
        summary(&app, &r, &caller)
    );
    let shown_page = crate::waterfall_page::Shown {
        after,
        limit: lim as u64,
    };
    b.push_str("<h2>Waterfall</h2>");
    b.push_str(&app.clean(&crate::waterfall_page::fragment(&app, &id, shown_page).await?));
    let _ = write!(
        b,
        "<h2>Timeline</h2><table class=\"timeline\"><thead>{}</thead><tbody id=\"timeline\"",
        render::EVENT_HEAD
    );
    let shown: Vec<_> = events.iter().collect();
    let last = shown.last().map_or(after, |(s, _)| *s);
    if !more {
        let _ = write!(b, " data-live=\"/jobs/{}/live?after={last}\"", url(&id));
    }
    b.push('>');
    let clean = |s: &str| app.clean(s);
    let mut tracker = crate::api::supersedes_after(&app, &id, after).await;
    for (seq, ev) in &shown {
        b.push_str(&render::event_row(*seq, ev, &clean));
        if let Some(sup) = tracker.see(ev) {
            b.push_str(&superseded_row(*seq, &sup));
        }
    }
    b.push_str("</tbody></table>");
    if more {
        let _ = write!(
            b,
            "<p><a href=\"/jobs/{}?after={last}&limit={lim}\">later events</a></p>",
            url(&id)
        );
    }
    b.push_str(&report(&app, &r).await);
    let rec = serde_json::to_string_pretty(&r).unwrap_or_default();
    let _ = write!(
        b,
        "<details><summary>record</summary><pre>{}</pre></details>",
        esc(&app.clean(&rec))
    );
    Ok(html(render::layout(&format!("job {id}"), &b)))
}

/// A page of the job's events after `after`: at most `lim`, and whether
/// more follow. What is shown is what is read: `lim + 1` events at most
/// (followed up to the job's last event as it was at the start), never the
/// whole history after `after`.
async fn timeline_page(
    app: &App,
    id: &str,
    after: u64,
    lim: usize,
) -> Result<(Vec<(u64, leasehold_proto::JobEvent)>, bool), Failure> {
    let u = |e: leasehold_store::StoreError| Failure::unavailable(e, false);
    let Some((last, _)) = app.events.last(id).await.map_err(u)? else {
        return Ok((Vec::new(), false));
    };
    if last <= after {
        return Ok((Vec::new(), false));
    }
    let mut f = app.events.follow(id, after).await.map_err(u)?;
    let mut out = Vec::new();
    while out.len() <= lim {
        // Events removed since `last` was read (retention) leave nothing
        // to wait for: the page is what came.
        match tokio::time::timeout(Duration::from_secs(5), f.next()).await {
            Ok(Some(Ok((seq, ev)))) => {
                out.push((seq, ev));
                if seq >= last {
                    break;
                }
            }
            Ok(Some(Err(e))) => return Err(u(e)),
            Ok(None) | Err(_) => break,
        }
    }
    let more = out.len() > lim;
    out.truncate(lim);
    Ok((out, more))
}

pub fn superseded_row(seq: u64, sup: &serde_json::Value) -> String {
    format!(
        "<tr class=\"superseded\" data-after=\"{seq}\"><td></td><td></td><td>{}</td><td>superseded</td><td>{}: drop {}</td></tr>",
        sup["epoch"],
        esc(sup["reason"].as_str().unwrap_or("")),
        esc(sup["drop"].as_str().unwrap_or("")),
    )
}

/// The research report (or partial report) rendered from its artifact.
async fn report(app: &App, r: &JobRecord) -> String {
    let Some(res) = &r.result else {
        return String::new();
    };
    let Some(name) = &res.artifact else {
        if res.output.is_empty() {
            return String::new();
        }
        return format!("<h2>Result</h2><pre>{}</pre>", esc(&app.clean(&res.output)));
    };
    let mut b = format!("<h2>Report <small>{}</small></h2>", esc(name));
    if res.partial || !res.skipped_sections.is_empty() {
        let _ = write!(
            b,
            "<p class=\"warn\">{}skipped sections: {}</p>",
            if res.partial { "partial report; " } else { "" },
            if res.skipped_sections.is_empty() {
                "none".to_string()
            } else {
                esc(&res.skipped_sections.join("; "))
            }
        );
    }
    match app.artifacts.read(name).await {
        Ok(Some((_, data))) => {
            let text = String::from_utf8_lossy(&data);
            let _ = write!(
                b,
                "<article class=\"report\">{}</article>",
                render::markdown(&app.clean(&text))
            );
        }
        Ok(None) => b.push_str("<p>the artifact is gone (retention?)</p>"),
        Err(e) => {
            let _ = write!(
                b,
                "<p class=\"error\">the artifact could not be read: {}</p>",
                esc(&e.to_string())
            );
        }
    }
    b
}

pub async fn job_live(
    State(app): State<Arc<App>>,
    caller: Caller,
    Path(id): Path<String>,
    q: Q,
) -> Result<Response, Failure> {
    only(&q, &["after"]).map_err(bad)?;
    crate::app::job_id(&id, false)?;
    let after = number(&q, "after", 0).map_err(bad)? as u64;
    let slot = app.streams.open(&caller, false)?;
    // The record part follows the console's one record watch (no consumer
    // of its own): subscribed before the current record is read, so no
    // write between the page and this stream is missed.
    let changes = app.feed.records.subscribe();
    let Some(current) = app
        .feed
        .record(&app.jobs, &id)
        .await
        .map_err(|e| Failure::unavailable(e, false))?
    else {
        return Err(Failure::page(
            StatusCode::NOT_FOUND,
            format!("no job {id:?}"),
        ));
    };
    let first = app
        .events
        .follow(&id, after)
        .await
        .map_err(|e| Failure::unavailable(e, false))?;
    let evs = crate::api::follow_events(app.clone(), id.clone(), after, first);
    let a2 = app.clone();
    let tracker = Arc::new(std::sync::Mutex::new(
        crate::api::supersedes_after(&app, &id, after).await,
    ));
    let evs = evs.filter_map(move |x| {
        let app = a2.clone();
        let tracker = tracker.clone();
        async move {
            let (seq, ev) = x;
            let clean = |s: &str| app.clean(s);
            let mut html = render::event_row(seq, &ev, &clean);
            let sup = tracker.lock().expect("tracker").see(&ev);
            if let Some(sup) = sup {
                html.push_str(&superseded_row(seq, &sup));
            }
            Some(
                Event::default()
                    .event("ev")
                    .data(json!({"seq": seq, "html": html}).to_string()),
            )
        }
    });
    let recs = job_records(app.clone(), id, current, changes).map(move |r| {
        Event::default()
            .event("record")
            .data(json!({"status": r.status, "html": summary(&app, &r, &caller)}).to_string())
    });
    Ok(sse(slot.hold(futures::stream::select(evs, recs))).into_response())
}

/// The job's record as it is now, then each write of it, from the feed's
/// record watch; when this follower lagged behind the feed (writes it
/// missed), the record is read again.
fn job_records(
    app: Arc<App>,
    id: String,
    current: Arc<JobRecord>,
    changes: tokio::sync::broadcast::Receiver<Arc<JobRecord>>,
) -> impl Stream<Item = Arc<JobRecord>> + Send {
    use tokio::sync::broadcast::error::RecvError;
    let first = futures::stream::iter([current]);
    let later = futures::stream::unfold((app, id, changes), |(app, id, mut rx)| async move {
        loop {
            match rx.recv().await {
                Ok(r) if r.id == id => return Some((r, (app, id, rx))),
                Ok(_) => continue,
                Err(RecvError::Lagged(_)) => {
                    if let Ok(Some(v)) = app.jobs.get(&id).await {
                        return Some((Arc::new(v.value), (app, id, rx)));
                    }
                }
                Err(RecvError::Closed) => return None,
            }
        }
    });
    first.chain(later)
}

/// The fleet: workers, queue, reapers, dead letters, parked jobs, charts;
/// read from the store (one read of each), counted in
/// `leasehold_console_fleet_reads_total`. Pages take it from
/// [`crate::fleet::FleetView`], which reads it once per period for all.
pub async fn fleet_fragment(app: &App) -> Result<String, Failure> {
    app.metrics.fleet_reads.inc();
    let u = |e: leasehold_store::StoreError| Failure::unavailable(e, false);
    let sessions = leasehold_store::fleet::live_sessions(&app.sessions)
        .await
        .map_err(u)?;
    let counts = match app.feed.counts() {
        Some(c) => c,
        None => {
            let all = app.active.list(Filter::All).await.map_err(u)?;
            crate::feed::count(all.iter().map(|(_, e)| e))
        }
    };
    let queue = leasehold_store::fleet::queue(&app.conn).await.map_err(u)?;
    let dead = leasehold_store::fleet::dead_letters_by_kind(&app.conn)
        .await
        .map_err(u)?;
    let reapers = leasehold_store::fleet::reaper_metrics(&app.conn, Duration::from_millis(300))
        .await
        .map_err(u)?;
    let crate::feed::Counts { in_flight, by_kind } = counts;
    let mut b = String::new();
    let _ = write!(b, "<h2>Workers <small>{}</small></h2><table><thead><tr><th>worker</th><th>session</th><th>host</th><th>pid</th><th>kinds</th><th>jobs in flight</th><th>slots</th><th>started</th><th>renewed</th></tr></thead><tbody>", sessions.len());
    for s in &sessions {
        let _ = write!(
            b,
            "<tr><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&s.worker_id),
            esc(s.session.get(..8).unwrap_or(&s.session)),
            esc(&s.host),
            s.pid,
            esc(&s.kinds.join(", ")),
            in_flight.get(&s.worker_id).copied().unwrap_or(0),
            if s.slots > 0 { s.slots.to_string() } else { "-".into() },
            render::age(&s.started_at),
            render::age(&s.renewed_at),
        );
    }
    b.push_str("</tbody></table>");
    let _ = write!(
        b,
        "<h2>Queue</h2><p>{} tickets ({} bytes) of at most {} ({} bytes)</p><table><thead><tr><th>kind</th><th>tickets</th><th>queued</th><th>running</th><th>parked</th><th>dead letters</th></tr></thead><tbody>",
        queue.messages, queue.bytes, queue.max_messages, queue.max_bytes
    );
    let kinds: std::collections::BTreeSet<&String> = queue
        .tickets_by_kind
        .keys()
        .chain(by_kind.keys())
        .chain(dead.keys())
        .collect();
    for k in kinds {
        let c = by_kind.get(k);
        let n = |s: &str| c.and_then(|c| c.get(s)).copied().unwrap_or(0);
        let _ = write!(
            b,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td><a href=\"/reviews\">{}</a></td><td><a href=\"/dlq?kind={}\">{}</a></td></tr>",
            esc(k),
            queue.tickets_by_kind.get(k).copied().unwrap_or(0),
            n("queued"),
            n("running"),
            n("parked"),
            url(k),
            dead.get(k).copied().unwrap_or(0)
        );
    }
    b.push_str("</tbody></table>");
    let _ = write!(b, "<h2>Reapers <small>{}</small></h2><table><thead><tr><th>reaper</th><th>last sweep</th><th>sweeps</th><th>recoveries</th><th>oldest in flight</th></tr></thead><tbody>", reapers.len());
    for r in &reapers {
        let _ = write!(
            b,
            "<tr><td>{}</td><td>{} ago</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(r["reaper_id"].as_str().unwrap_or("?")),
            render::age(r["at"].as_str().unwrap_or("")),
            r["sweeps"],
            r["recoveries"],
            r["oldest_in_flight_age_s"]
                .as_f64()
                .map(|s| format!("{s:.0} s"))
                .unwrap_or_else(|| "-".into()),
        );
    }
    b.push_str("</tbody></table>");
    // The charts: the sampler's ring (its cost is the window's).
    b.push_str("<h2>Charts</h2>");
    b.push_str(&crate::chartview::html(app));
    Ok(app.clean(&b))
}

pub async fn fleet(
    State(app): State<Arc<App>>,
    _caller: Caller,
    q: Q,
) -> Result<Response, Failure> {
    only(&q, &[]).map_err(bad)?;
    let f = app.fleet.current(&app).await;
    Ok(html(render::layout(
        "fleet",
        &format!("<h1>Fleet</h1><div id=\"fleet\" data-live=\"/fleet/live\">{f}</div>"),
    )))
}

/// The fleet fragment again at each read of the shared view (at most
/// every 2 s when records change, every 5 s for sessions and reapers):
/// however many tabs follow, the store is read once per period.
pub async fn fleet_live(State(app): State<Arc<App>>, caller: Caller) -> Result<Response, Failure> {
    let slot = app.streams.open(&caller, false)?;
    let rx = app.fleet.follow();
    let s = futures::stream::unfold(rx, |mut rx| async move {
        rx.changed().await.ok()?;
        let html = rx.borrow_and_update().as_ref()?.html.clone();
        Some((
            Event::default()
                .event("fleet")
                .data(json!({"html": &*html}).to_string()),
            rx,
        ))
    });
    Ok(sse(slot.hold(s)).into_response())
}

pub async fn dlq(State(app): State<Arc<App>>, caller: Caller, q: Q) -> Result<Response, Failure> {
    only(&q, &["kind", "class", "after", "limit"]).map_err(bad)?;
    let kind = q.get("kind").filter(|s| !s.is_empty()).cloned();
    let class = q.get("class").filter(|s| !s.is_empty()).cloned();
    if let Some(c) = &class {
        if !["poison", "max_deliveries", "rejected", "id_conflict"].contains(&c.as_str()) {
            return Err(bad(format!(
                "class={c:?} is not a class; use poison, max_deliveries, rejected or id_conflict"
            )));
        }
    }
    let after = number(&q, "after", 0).map_err(bad)? as u64;
    let lim = limit(&q, app.args.page_max, 50).map_err(bad)?;
    let (letters, more) = app
        .dlq
        .page(kind.as_deref(), class.as_deref(), after, lim)
        .await
        .map_err(|e| Failure::unavailable(e, false))?;
    let mut b = String::from("<h1>Dead letters</h1>");
    let fq = {
        let mut p = Vec::new();
        if let Some(k) = &kind {
            p.push(format!("kind={}", url(k)));
        }
        if let Some(c) = &class {
            p.push(format!("class={}", url(c)));
        }
        p.join("&")
    };
    let _ = write!(
        b,
        "<form class=\"filters\" method=\"get\" action=\"/dlq\"><input name=\"kind\" placeholder=\"kind\" value=\"{}\"> <input name=\"class\" placeholder=\"class\" value=\"{}\"> <button>filter</button></form>",
        esc(kind.as_deref().unwrap_or("")),
        esc(class.as_deref().unwrap_or(""))
    );
    if caller.can_act && !letters.is_empty() {
        let _ = write!(
            b,
            "<p><a class=\"button\" href=\"/confirm?action=bulk-replay&{0}\">replay all matching…</a> <a class=\"button danger\" href=\"/confirm?action=bulk-purge&{0}\">delete all matching…</a></p>",
            esc(&fq)
        );
    }
    b.push_str("<table><thead><tr><th>seq</th><th>kind</th><th>class</th><th>job</th><th>at</th><th>reason</th><th></th></tr></thead><tbody id=\"letters\">");
    for l in &letters {
        let job = l.job_id.as_deref().unwrap_or("-");
        let acts = if caller.can_act {
            format!(
                "<a class=\"button replay\" href=\"/confirm?action=dlq-replay&seq={0}\">replay…</a> <a class=\"button danger\" href=\"/confirm?action=dlq-delete&seq={0}\">delete…</a>",
                l.seq
            )
        } else {
            String::new()
        };
        let _ = write!(
            b,
            "<tr data-seq=\"{}\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{acts}</td></tr>",
            l.seq,
            l.seq,
            esc(&l.kind),
            esc(&l.class),
            if job == "-" { "-".into() } else { format!("<a href=\"/jobs/{}\">{}</a>", url(job), esc(job)) },
            esc(&l.at),
            esc(&l.reason),
        );
    }
    b.push_str("</tbody></table>");
    if more {
        if let Some(last) = letters.last() {
            let _ = write!(
                b,
                "<a href=\"/dlq?{}&after={}&limit={lim}\">more</a>",
                esc(&fq),
                last.seq
            );
        }
    }
    Ok(html(render::layout(
        "dead letters",
        &app.gate(app.clean(&b)),
    )))
}

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
        include_str!("../static/console.js"),
    )
        .into_response()
}

pub async fn style() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("../static/console.css"),
    )
        .into_response()
}
