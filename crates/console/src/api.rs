//! The clients' API: a job's record, its result, and its events as
//! Server-Sent Events.
//!
//! `GET /v1/jobs/{id}/events`: every event of the job in order, each as
//! one SSE message whose `id:` is the event's stream sequence and whose
//! data is the event's JSON (its fields inlined, plus `seq`). A client
//! reconnecting with `Last-Event-ID: N` (or `?after=N`) gets exactly the
//! events after N: the stream is read from sequence N + 1 by an ordered
//! consumer, then follows new ones. Before an event that supersedes work
//! shown so far (a claim of a later epoch: a reclaim or a retry; a warm,
//! cold or job retry) comes an `event: superseded` message without an id
//! saying what to drop. After the job's terminal event comes `event: end`,
//! and the stream closes.
//!
//! Beside the events come the signals sent to the job, without an id (a
//! reconnect sends the kept ones again; each names its `seq`): a child's
//! end as `event: child` (`{"child", "status", "seq", "at"}`), any other
//! signal as `event: signal` (the signal's JSON: `name`, `data`, `seq`,
//! `sent_at`, `sender`). Every one kept comes before the terminal event
//! (the stream reads the rest of them then), so a parent's stream has
//! each child's end before its own.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{json, Value};

use leasehold_store::children;
use leasehold_store::signals::{Signal, Signals};

use crate::app::{App, Failure};
use crate::auth::Caller;
use crate::feed::TERMINAL;
use crate::pages::{number, only};

type Q = Query<HashMap<String, String>>;

fn bad(e: String) -> Failure {
    Failure::api(StatusCode::BAD_REQUEST, e)
}

fn missing(id: &str) -> Failure {
    Failure::api(
        StatusCode::NOT_FOUND,
        format!("no job {id:?}: not picked up yet, forgotten after its retention, or a wrong id"),
    )
}

fn json_response(status: StatusCode, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

pub async fn record(
    State(app): State<Arc<App>>,
    _caller: Caller,
    Path(id): Path<String>,
    q: Q,
) -> Result<Response, Failure> {
    only(&q, &[]).map_err(bad)?;
    crate::app::job_id(&id, true)?;
    let v = app
        .jobs
        .get(&id)
        .await
        .map_err(|e| Failure::unavailable(e, true))?
        .ok_or_else(|| missing(&id))?;
    let body = serde_json::to_string(&v.value).unwrap_or_default();
    Ok(json_response(StatusCode::OK, app.clean(&body)))
}

pub async fn result(
    State(app): State<Arc<App>>,
    _caller: Caller,
    Path(id): Path<String>,
    q: Q,
) -> Result<Response, Failure> {
    only(&q, &[]).map_err(bad)?;
    crate::app::job_id(&id, true)?;
    let r = app
        .jobs
        .get(&id)
        .await
        .map_err(|e| Failure::unavailable(e, true))?
        .ok_or_else(|| missing(&id))?
        .value;
    if r.status != "completed" {
        let body = json!({
            "id": id, "status": r.status, "error": r.error,
            "partial": r.result.as_ref().map(|x| x.partial),
            "hint": if TERMINAL.contains(&r.status.as_str()) { "the job ended without a result" } else { "the job has not ended; follow /v1/jobs/{id}/events" },
        });
        return Ok(json_response(
            StatusCode::CONFLICT,
            app.clean(&body.to_string()),
        ));
    }
    let res = r.result.clone().unwrap_or_default();
    match res.artifact {
        Some(name) => match app.artifacts.read(&name).await {
            Ok(Some((_, data))) => Ok((
                StatusCode::OK,
                [
                    (
                        header::CONTENT_TYPE,
                        "text/markdown; charset=utf-8".to_string(),
                    ),
                    (
                        header::HeaderName::from_static("lh-digest"),
                        res.digest.unwrap_or_default(),
                    ),
                ],
                app.clean(&String::from_utf8_lossy(&data)),
            )
                .into_response()),
            Ok(None) => Err(Failure::api(
                StatusCode::GONE,
                format!("job {id}'s artifact {name} is gone"),
            )),
            Err(e) => Err(Failure::unavailable(e, true)),
        },
        // Over 16 KiB, it was kept beside the record and is not there: an
        // error (as `leasehold result` says), never an empty output.
        None if res.output.is_empty() && r.output_beside => Err(Failure::api(
            StatusCode::GONE,
            format!("job {id}'s output (over 16 KiB, kept beside its record) is gone from the payloads bucket"),
        )),
        None => {
            let output: Value =
                serde_json::from_str(&res.output).unwrap_or(Value::String(res.output));
            Ok(json_response(
                StatusCode::OK,
                app.clean(&json!({"id": id, "status": "completed", "output": output}).to_string()),
            ))
        }
    }
}

/// A signal as the clients' stream sends it: `event: child` for a child's
/// end, else `event: signal`.
fn signal_event(app: &App, s: &Signal) -> Event {
    let (name, data) = if s.name == children::ENDED {
        let d = &s.data;
        (
            "child",
            json!({"child": d["child"], "status": d["status"], "seq": s.seq, "at": s.sent_at}),
        )
    } else {
        ("signal", serde_json::to_value(s).unwrap_or_default())
    };
    Event::default()
        .event(name)
        .data(app.clean(&data.to_string()))
}

pub async fn events(
    State(app): State<Arc<App>>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
    q: Q,
) -> Result<Response, Failure> {
    only(&q, &["after"]).map_err(bad)?;
    crate::app::job_id(&id, true)?;
    let after = match headers
        .get("last-event-id")
        .map(|v| v.to_str().map(str::trim))
    {
        Some(Ok(v)) if !v.is_empty() => v.parse::<u64>().map_err(|_| {
            bad(format!(
                "Last-Event-ID {v:?} is not an event's sequence (a whole number)"
            ))
        })?,
        Some(Err(_)) => return Err(bad("Last-Event-ID is not text".into())),
        _ => number(&q, "after", 0).map_err(bad)? as u64,
    };
    let rec = app
        .jobs
        .get(&id)
        .await
        .map_err(|e| Failure::unavailable(e, true))?
        .ok_or_else(|| missing(&id))?
        .value;
    // An EventSource reconnects after `end` on its own: a job that ended at
    // or before `after` is told so again, and the stream closes.
    if after > 0 && TERMINAL.contains(&rec.status.as_str()) {
        if let Some((seq, ty)) = terminal_event(&app, &id).await? {
            if seq <= after {
                let end = Event::default()
                    .event("end")
                    .data(json!({"status": ty}).to_string());
                return Ok(
                    Sse::new(futures::stream::iter([Ok::<_, Infallible>(end)])).into_response()
                );
            }
        }
    }
    let slot = app.streams.open(&caller, true)?;
    let first = app
        .events
        .follow(&id, after)
        .await
        .map_err(|e| Failure::unavailable(e, true))?;
    let follow = follow_events(app.clone(), id.clone(), after, first).map(Msg::Event);
    let signals = Signals::new(&app.conn)
        .follow(&id)
        .await
        .map_err(|e| Failure::unavailable(e, true))?
        .filter_map({
            let id = id.clone();
            move |s| {
                let s = s
                    .map_err(|e| tracing::warn!(job = %id, error = %e, "event stream: following its signals failed"))
                    .ok();
                async move { s.map(Msg::Signal) }
            }
        });
    let follow = futures::stream::select(follow, signals).boxed();
    let tracker = supersedes_after(&app, &id, after).await;
    enum Msg {
        Event((u64, leasehold_proto::JobEvent)),
        Signal(Signal),
    }
    struct St {
        follow: futures::stream::BoxStream<'static, Msg>,
        id: String,
        /// The last signal sent (by its sequence).
        signals_sent: u64,
        app: Arc<App>,
        done: bool,
        tracker: crate::render::Supersedes,
    }
    let st = St {
        follow,
        id: id.clone(),
        signals_sent: 0,
        app,
        done: false,
        tracker,
    };
    let s = futures::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let (app, tracker) = (&st.app, &mut st.tracker);
        let (seq, ev) = match st.follow.next().await? {
            Msg::Event(e) => e,
            Msg::Signal(s) => {
                let mut out = Vec::new();
                if s.seq > st.signals_sent {
                    st.signals_sent = s.seq;
                    out.push(signal_event(app, &s));
                }
                return Some((futures::stream::iter(out), st));
            }
        };
        let mut out: Vec<Event> = Vec::new();
        let end = TERMINAL.contains(&ev.r#type.as_str());
        if end {
            // The signals not sent yet, before the end: a parent's
            // children ended before it did.
            match Signals::new(&app.conn).kept_after(&st.id, st.signals_sent).await {
                Ok(rest) => out.extend(rest.iter().map(|s| signal_event(app, s))),
                Err(e) => tracing::warn!(job = %st.id, error = %e, "event stream: reading its last signals failed"),
            }
        }
        if let Some(mut sup) = tracker.see(&ev) {
            sup["seq"] = json!(seq);
            out.push(Event::default().event("superseded").data(sup.to_string()));
        }
        let mut v = serde_json::to_value(&ev).unwrap_or_default();
        v["seq"] = json!(seq);
        out.push(
            Event::default()
                .id(seq.to_string())
                .data(app.clean(&v.to_string())),
        );
        if end {
            out.push(
                Event::default()
                    .event("end")
                    .data(json!({"status": ev.r#type}).to_string()),
            );
        }
        st.done = end;
        Some((futures::stream::iter(out), st))
    })
    .flatten()
    .map(Ok::<_, Infallible>);
    Ok(Sse::new(slot.hold(s))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// What a view of the job's events starting after `after` judges the next
/// claim against: the last claim before it (a resumed stream, a page
/// after the first), or nothing for a view from the start. The clients'
/// stream, the job page and its live part all start here.
pub async fn supersedes_after(app: &App, id: &str, after: u64) -> crate::render::Supersedes {
    if after == 0 {
        return crate::render::Supersedes::default();
    }
    // The job's claims (one per attempt or reclaim: few), the last at or
    // before `after`; the latest claim alone may be after it.
    match app.events.read_type_from(id, "claimed", 0).await {
        Ok(claims) => match claims.iter().rev().find(|(seq, _)| *seq <= after) {
            Some((_, claim)) => crate::render::Supersedes::after_claim(claim),
            None => crate::render::Supersedes::default(),
        },
        Err(e) => {
            tracing::warn!(job = %id, error = %e, "claims before a resumed view");
            crate::render::Supersedes::default()
        }
    }
}

/// The sequence and type of the job's latest terminal event, if any.
async fn terminal_event(app: &App, id: &str) -> Result<Option<(u64, String)>, Failure> {
    let mut last: Option<(u64, String)> = None;
    for ty in TERMINAL {
        let found = app
            .events
            .last_of_type(id, ty)
            .await
            .map_err(|e| Failure::unavailable(e, true))?;
        if let Some((seq, _)) = found {
            if last.as_ref().is_none_or(|(s, _)| seq > *s) {
                last = Some((seq, ty.to_string()));
            }
        }
    }
    Ok(last)
}

/// A job's events after `after` in order, each once, then new ones as they
/// land, starting with `first` (that follow, already open). What the
/// clients' stream and the job page's live timeline read: on an error (the
/// ordered consumer's, or an event whose data beside it cannot be read
/// yet, as a lagging replica's) or an end, it follows again from the last
/// event given, so the event is read again, never skipped.
pub fn follow_events(
    app: Arc<App>,
    id: String,
    after: u64,
    first: futures::stream::BoxStream<
        'static,
        Result<(u64, leasehold_proto::JobEvent), leasehold_store::StoreError>,
    >,
) -> futures::stream::BoxStream<'static, (u64, leasehold_proto::JobEvent)> {
    let st = (Some(first), after, app, id);
    futures::stream::unfold(st, |(mut follow, mut last, app, id)| async move {
        loop {
            let Some(f) = follow.as_mut() else {
                tokio::time::sleep(Duration::from_millis(200)).await;
                match app.events.follow(&id, last).await {
                    Ok(f) => follow = Some(f),
                    Err(e) => tracing::warn!(job = %id, error = %e, "event stream: following again failed"),
                }
                continue;
            };
            match f.next().await {
                Some(Ok((seq, _))) if seq <= last => continue,
                Some(Ok((seq, ev))) => {
                    last = seq;
                    return Some(((seq, ev), (follow, last, app, id)));
                }
                Some(Err(e)) => {
                    tracing::warn!(job = %id, after = last, error = %e, "event stream: reading again after the last event sent");
                    follow = None;
                }
                None => follow = None,
            }
        }
    })
    .boxed()
}
