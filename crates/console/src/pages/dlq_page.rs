//! The dead letters page: a page of letters by kind and class, with their
//! replay and delete actions.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;

use crate::app::{App, Failure};
use crate::auth::Caller;
use crate::render::{self, esc, url};

use super::{bad, html, limit, number, only, Q};

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
