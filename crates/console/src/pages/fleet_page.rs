//! The fleet page: workers, queue, reapers, dead letters, parked jobs and
//! charts, read once per period for every tab.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::app::{App, Failure};
use crate::auth::Caller;
use crate::render::{self, esc, url};

use super::{bad, html, only, sse, Q};

/// The fleet: workers, queue, reapers, dead letters, parked jobs, charts;
/// read from the store (one read of each), counted in
/// `leasehold_console_fleet_reads_total`. Pages take it from
/// [`crate::fleet::FleetView`], which reads it once per period for all.
pub async fn fleet_fragment(app: &App) -> Result<String, Failure> {
    app.metrics.fleet_reads.inc();
    let u = |e: leasehold_store::StoreError| Failure::unavailable(e, false);
    let sessions = leasehold_operate::fleet::live_sessions(&app.sessions)
        .await
        .map_err(u)?;
    // The counts come from the console's view of the index, never from a
    // read of the whole index per period; without the view, they are
    // shown as not known.
    let counts = app.feed.counts();
    let unknown = counts.is_none();
    let queue = leasehold_operate::fleet::queue(&app.conn)
        .await
        .map_err(u)?;
    let dead = leasehold_operate::fleet::dead_letters_by_kind(&app.conn)
        .await
        .map_err(u)?;
    let reapers = leasehold_operate::fleet::reaper_metrics(&app.conn, Duration::from_millis(300))
        .await
        .map_err(u)?;
    let crate::feed::Counts { in_flight, by_kind } = counts.unwrap_or_default();
    let known = |n: usize| {
        if unknown {
            "?".to_string()
        } else {
            n.to_string()
        }
    };
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
            known(in_flight.get(&s.worker_id).copied().unwrap_or(0)),
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
        let n = |s: &str| known(c.and_then(|c| c.get(s)).copied().unwrap_or(0) as usize);
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
    b.push_str(&super::view_notice(
        app.feed.view_state(),
        "the jobs in flight and the queued, running and parked counts (marked ?) are not known",
    ));
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
