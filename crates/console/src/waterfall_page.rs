//! `GET /jobs/{id}/waterfall`: the job's waterfall as an HTML fragment
//! (an SVG picture and its legend), also shown on the job page above the
//! timeline and fetched again by its live part as events land.
//!
//! A job's events are read once, in order to the last one (an ordered
//! consumer, `Events::read_from`); the model built from them is kept in a
//! small cache keyed by job, with the last sequence it has seen, so the
//! next request reads only the events after it. The cache is bounded by
//! bytes (`--waterfall-cache-bytes`, 0: off) and by jobs; beyond either,
//! the least recently used model goes (and is built again when asked).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};

use crate::app::{App, Failure};
use crate::auth::Caller;
use crate::render::{esc, url};
use crate::waterfall::Builder;
use crate::waterfall_svg::{draw, legend, View};

/// At most this many jobs' models are kept.
const MAX_JOBS: usize = 256;

/// The models of recently shown jobs, least recently used out.
#[derive(Default)]
pub struct Waterfalls {
    max_bytes: usize,
    slots: Mutex<HashMap<String, (Builder, u64)>>,
    tick: std::sync::atomic::AtomicU64,
}

impl Waterfalls {
    pub fn new(max_bytes: usize) -> Self {
        Waterfalls {
            max_bytes,
            ..Default::default()
        }
    }

    /// The kept model of `id` (taken out: put it back with [`Waterfalls::put`]).
    fn take(&self, id: &str) -> Option<Builder> {
        let mut m = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        m.remove(id).map(|(b, _)| b)
    }

    /// Keeps `b`, then evicts the least recently used until the bounds hold.
    fn put(&self, id: &str, b: Builder) {
        if self.max_bytes == 0 || b.bytes() > self.max_bytes {
            return;
        }
        let t = self.tick.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut m = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        m.insert(id.to_string(), (b, t));
        loop {
            let bytes: usize = m.values().map(|(b, _)| b.bytes()).sum();
            if bytes <= self.max_bytes && m.len() <= MAX_JOBS {
                break;
            }
            let Some(oldest) = m
                .iter()
                .min_by_key(|(_, (_, t))| *t)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            m.remove(&oldest);
        }
    }
}

/// The job's model, brought up to its last event (reading only the
/// events after what the cache had).
async fn model(app: &App, id: &str) -> Result<Builder, Failure> {
    let mut b = app.waterfalls.take(id).unwrap_or_default();
    let from = match b.waterfall().events {
        0 => 0,
        _ => b.waterfall().last_seq + 1,
    };
    let evs = app
        .events
        .read_from(id, from)
        .await
        .map_err(|e| Failure::unavailable(e, false))?;
    app.metrics.waterfall_events_read.inc_by(evs.len() as u64);
    for (seq, ev) in &evs {
        b.push(*seq, ev);
    }
    Ok(b)
}

/// Which timeline page the job page shows (`after`, `limit`): a bar of an
/// event on it links to its row, any other to the page starting at it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Shown {
    pub after: u64,
    pub limit: u64,
}

/// The fragment: the picture, its caption and its legend.
pub async fn fragment(app: &App, id: &str, shown: Shown) -> Result<String, Failure> {
    let b = model(app, id).await?;
    let w = b.waterfall();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(w.last);
    let until = if w.finished || w.first.is_none() {
        w.last
    } else {
        now.max(w.last)
    };
    let uid = url(id);
    let link = move |seq: u64| {
        if seq > shown.after && (shown.limit == 0 || seq <= shown.after + shown.limit) {
            format!("#ev-{seq}")
        } else {
            format!("/jobs/{uid}?after={}#ev-{seq}", seq.saturating_sub(1))
        }
    };
    let view = View { until, link: &link };
    let mut out = format!(
        "<div id=\"waterfall\" class=\"waterfall\" data-src=\"/jobs/{}/waterfall?after={}&amp;limit={}\" data-finished=\"{}\">",
        url(id),
        shown.after,
        shown.limit,
        w.finished
    );
    if w.events == 0 {
        out.push_str("<p>No events yet.</p></div>");
        app.waterfalls.put(id, b);
        return Ok(out);
    }
    let (svg, drawn) = draw(w, &view);
    let start = w
        .first
        .map(|t| {
            leasehold_core::time::rfc3339(
                std::time::UNIX_EPOCH + std::time::Duration::from_secs_f64(t),
            )
        })
        .unwrap_or_default();
    let _ = write!(
        out,
        "<p class=\"wf-caption\">{} attempts, {} events (last #{}{}), from {} UTC; {} bars drawn. Hover a bar for its event, click it for its row in the timeline.</p><div class=\"wf-scroll\">{svg}</div>{}</div>",
        w.attempts.len(),
        w.events,
        w.last_seq,
        if w.skipped > 0 { format!(", {} without a readable time skipped", w.skipped) } else { String::new() },
        esc(start.get(..19).unwrap_or(&start)),
        drawn,
        legend()
    );
    app.waterfalls.put(id, b);
    Ok(out)
}

/// `GET /jobs/{id}/waterfall[?after=&limit=]`.
pub async fn route(
    State(app): State<Arc<App>>,
    _caller: Caller,
    Path(id): Path<String>,
    q: Query<HashMap<String, String>>,
) -> Result<Response, Failure> {
    crate::pages::only(&q, &["after", "limit"]).map_err(bad)?;
    crate::app::job_id(&id, false)?;
    let after = crate::pages::number(&q, "after", 0).map_err(bad)? as u64;
    let limit = crate::pages::number(&q, "limit", 0).map_err(bad)? as u64;
    let known = app
        .jobs
        .get(&id)
        .await
        .map_err(|e| Failure::unavailable(e, false))?;
    if known.is_none() {
        return Err(Failure::page(
            StatusCode::NOT_FOUND,
            format!("no job {id:?}: it may not have been picked up yet, it was forgotten after its retention, or the id is wrong"),
        ));
    }
    let body = fragment(&app, &id, Shown { after, limit }).await?;
    Ok(Html(app.clean(&body)).into_response())
}

fn bad(m: String) -> Failure {
    Failure::page(StatusCode::BAD_REQUEST, m)
}
