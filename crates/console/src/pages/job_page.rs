//! One job's page: its summary, its timeline of events a page at a time, its
//! report, and their live parts.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use leasehold_core::JobRecord;
use serde_json::json;

use crate::app::{App, Failure};
use crate::auth::Caller;
use crate::render::{self, esc, url};

use super::{bad, html, limit, number, only, sse, ACTIVE, Q};

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
    if let Some(p) = r.spec.as_ref().and_then(|s| s.parent.as_ref()) {
        row(
            &mut b,
            "parent",
            format!(
                "<a id=\"parent\" href=\"/jobs/{}\">{}</a> (its step <code>{}</code>, depth {})",
                url(&p.id),
                esc(&p.id),
                esc(&p.step),
                p.depth
            ),
        );
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
    if r.status == "waiting" {
        row(
            &mut b,
            "waits",
            format!(
                "<span id=\"waits\">{}</span>",
                esc(&leasehold_core::machine::waits_for(r))
            ),
        );
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
            let _ = write!(b, "<a class=\"button\" href=\"/confirm?action=review-resume&id={id}\">resume…</a> <a class=\"button danger\" href=\"/confirm?action=review-fail&id={id}\">fail…</a> ");
        }
        if ACTIVE.contains(&r.status.as_str()) {
            // The signal it waits for, named already.
            let name = r
                .waiting_for
                .as_deref()
                .and_then(|w| w.strip_prefix("signal:"))
                .map(|n| format!("&name={}", url(n)))
                .unwrap_or_default();
            let _ = write!(b, "<a class=\"button\" id=\"signal\" href=\"/confirm?action=signal&id={id}{name}\">send signal…</a>");
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
    b.push_str(&children(&app, &id).await);
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

/// Children shown on a parent's page, at most.
const CHILDREN_SHOWN: usize = 200;

/// The job's children (its recorded spawns), each with its state, linked
/// to its own page (where its children are): the tree, a level a page.
/// Nothing for a job that spawned none.
async fn children(app: &App, id: &str) -> String {
    let (n, shown) =
        match leasehold_store::children::listed(&app.jobs, &app.events, id, CHILDREN_SHOWN).await {
            Ok(l) => l,
            Err(e) => return format!("<p class=\"warn\">children: {}</p>", esc(&e.to_string())),
        };
    if n == 0 {
        return String::new();
    }
    let mut by_status: std::collections::BTreeMap<&str, usize> = Default::default();
    for c in &shown {
        *by_status.entry(c.status()).or_default() += 1;
    }
    let counts: Vec<String> = by_status.iter().map(|(s, n)| format!("{n} {s}")).collect();
    let mut b = format!(
        "<h2>Children <small>{n} ({}{})</small></h2><ul class=\"tree\" id=\"children\">",
        esc(&counts.join(", ")),
        if n > shown.len() {
            format!("; the first {} shown", shown.len())
        } else {
            String::new()
        }
    );
    for c in &shown {
        let _ = write!(
            b,
            "<li><a href=\"/jobs/{}\">{}</a> <b class=\"status st-{2}\">{2}</b> {3}</li>",
            url(&c.id),
            esc(&c.id),
            esc(c.status()),
            esc(&c.kind)
        );
    }
    b.push_str("</ul>");
    app.clean(&b)
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
