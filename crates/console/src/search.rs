//! Search over the history of finished jobs (`leasehold_store::history`):
//! the form the jobs page shows, and `/history`, one page of entries with
//! how many matched and a link to the next page. The one page that reads
//! history, and it reads only the page it shows (the count is the server's).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::SystemTime;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use leasehold_store::history::{self, Entry, Page, QueryText};

use crate::app::{App, Failure};
use crate::auth::Caller;
use crate::feed::TERMINAL;
use crate::pages::only;
use crate::render::{self, esc, url};

/// The parameters `/history` takes.
const PARAMS: &[&str] = &[
    "kind", "status", "tenant", "class", "from", "to", "prefix", "limit", "after",
];

/// The query text of the page's parameters (the form's names).
fn text(q: &HashMap<String, String>) -> Result<QueryText, String> {
    only(q, PARAMS)?;
    for (k, v) in q {
        if v.len() > 256 || v.chars().any(char::is_control) {
            return Err(format!(
                "{k} is not a plausible value (at most 256 printable characters)"
            ));
        }
    }
    let get = |k: &str| q.get(k).cloned();
    Ok(QueryText {
        status: get("status"),
        kind: get("kind"),
        tenant: get("tenant"),
        class: get("class"),
        since: get("from"),
        until: get("to"),
        id_prefix: get("prefix"),
        limit: get("limit"),
        after: get("after"),
    })
}

/// The search form, its fields filled with `t` (the jobs page passes its
/// own filters).
pub fn form(t: &QueryText) -> String {
    let v = |o: &Option<String>| esc(o.as_deref().unwrap_or(""));
    let statuses: String =
        std::iter::once("<option value=\"\">any finished status</option>".to_string())
            .chain(TERMINAL.iter().map(|s| {
                let sel = if t.status.as_deref() == Some(*s) {
                    " selected"
                } else {
                    ""
                };
                format!("<option{sel}>{}</option>", esc(s))
            }))
            .collect();
    format!(
        "<form class=\"filters search\" method=\"get\" action=\"/history\" id=\"history-search\">\
<input name=\"kind\" placeholder=\"kind\" value=\"{}\"> <select name=\"status\">{statuses}</select> \
<input name=\"tenant\" placeholder=\"tenant\" value=\"{}\"> <input name=\"class\" placeholder=\"error class\" value=\"{}\"> \
<label>from <input type=\"datetime-local\" step=\"1\" name=\"from\" value=\"{}\"></label> \
<label>to <input type=\"datetime-local\" step=\"1\" name=\"to\" value=\"{}\"></label> \
<input name=\"prefix\" placeholder=\"id prefix\" value=\"{}\"> <button>search history</button> \
<small>times in UTC</small></form>",
        v(&t.kind),
        v(&t.tenant),
        v(&t.class),
        v(&t.since),
        v(&t.until),
        v(&t.id_prefix),
    )
}

/// The jobs page's section: the form, prefilled from its filters (a status
/// only when it is a finished one).
pub fn section(
    kind: &Option<String>,
    status: &Option<String>,
    tenant: &Option<String>,
    prefix: &Option<String>,
) -> String {
    let t = QueryText {
        kind: kind.clone(),
        status: status.clone().filter(|s| TERMINAL.contains(&s.as_str())),
        tenant: tenant.clone(),
        id_prefix: prefix.clone(),
        ..Default::default()
    };
    format!("<h2>Search the history of finished jobs</h2>{}", form(&t))
}

const HEAD: &str = "<tr><th>id</th><th>kind</th><th>tenant</th><th>status</th><th>class</th><th>ended</th><th>attempts</th><th>message</th></tr>";

fn row(e: &Entry) -> String {
    format!(
        "<tr data-id=\"{id}\" class=\"st-{st}\"><td><a href=\"/jobs/{uid}\">{id}</a></td><td>{kind}</td><td>{tenant}</td><td class=\"status\">{st}</td><td>{class}</td><td>{ended}</td><td>{att}</td><td class=\"message\">{msg}</td></tr>",
        id = esc(&e.id),
        uid = url(&e.id),
        kind = esc(&e.kind),
        tenant = esc(&e.tenant),
        st = esc(&e.status),
        class = esc(if e.class.is_empty() { "-" } else { &e.class }),
        ended = esc(&e.ended_at),
        att = e.attempts,
        msg = esc(&e.message),
    )
}

/// "N matched" as the page says it.
fn matched(p: &Page) -> String {
    let n = p.matched;
    if p.matched_is_upper_bound {
        format!("at most {n} matched")
    } else {
        format!("{n} matched")
    }
}

/// The link to the next page: the same parameters, `after` the cursor.
fn next_link(q: &HashMap<String, String>, cursor: u64) -> String {
    let mut keys: Vec<&String> = q.keys().filter(|k| *k != "after").collect();
    keys.sort();
    let mut parts: Vec<String> = keys
        .into_iter()
        .filter(|k| !q[*k].trim().is_empty())
        .map(|k| format!("{k}={}", url(&q[k])))
        .collect();
    parts.push(format!("after={cursor}"));
    format!("/history?{}", parts.join("&"))
}

/// The results: count, rows, next page.
fn results(app: &App, q: &HashMap<String, String>, p: &Page) -> String {
    let mut b = String::new();
    let _ = write!(
        b,
        "<h2>Finished jobs <small id=\"history-count\">{}</small></h2>",
        matched(p)
    );
    if p.scan_cut {
        let _ = write!(
            b,
            "<p class=\"warn\">This page read {} entries, its bound, before it filled up: more may match on the next pages.</p>",
            p.scanned
        );
    }
    let _ = write!(
        b,
        "<table class=\"jobs history\"><thead>{HEAD}</thead><tbody id=\"history\">"
    );
    for (_, e) in &p.entries {
        b.push_str(&app.clean(&row(e)));
    }
    b.push_str("</tbody></table>");
    if let Some(cursor) = p.next {
        let _ = write!(
            b,
            "<p><a id=\"history-next\" href=\"{}\">next page</a></p>",
            esc(&next_link(q, cursor))
        );
    }
    b
}

/// `GET /history`.
pub async fn page(
    State(app): State<Arc<App>>,
    _caller: Caller,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, Failure> {
    let bad = |e: String| Failure::page(StatusCode::BAD_REQUEST, e);
    let t = text(&q).map_err(bad)?;
    let query = history::Query::parse(&t, SystemTime::now()).map_err(bad)?;
    let t0 = std::time::Instant::now();
    let p = history::search(&app.conn, &query)
        .await
        .map_err(|e| match e {
            leasehold_store::StoreError::Missing(_) => Failure::page(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("{e}: the history of finished jobs is not set up"),
            ),
            e => Failure::unavailable(e, false),
        })?;
    tracing::debug!(
        ms = t0.elapsed().as_secs_f64() * 1e3,
        matched = p.matched,
        "history page: search"
    );
    let mut b = String::from("<h1>History</h1>");
    b.push_str(&form(&t));
    b.push_str(&results(&app, &q, &p));
    Ok(Html(render::layout("history", &b)).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn the_form_names_map_to_the_query_and_unknown_ones_are_refused() {
        let t = text(&q(&[("from", "2026-12-01T10:00"), ("prefix", "inv-")])).unwrap();
        assert_eq!(t.since.as_deref(), Some("2026-12-01T10:00"));
        assert_eq!(t.id_prefix.as_deref(), Some("inv-"));
        let e = text(&q(&[("since", "2h")])).unwrap_err();
        assert!(e.contains("unknown parameter") && e.contains("from"), "{e}");
        assert!(text(&q(&[("kind", "a\u{7}")])).is_err());
    }

    #[test]
    fn the_next_link_keeps_the_query_and_moves_the_cursor() {
        let l = next_link(
            &q(&[("tenant", "acme co"), ("after", "3"), ("kind", "")]),
            99,
        );
        assert_eq!(l, "/history?tenant=acme%20co&after=99");
    }

    #[test]
    fn rows_and_the_form_are_escaped() {
        let e = Entry {
            id: "<j>".into(),
            message: "<script>".into(),
            status: "failed".into(),
            ..Default::default()
        };
        let r = row(&e);
        assert!(!r.contains("<script>") && r.contains("&lt;j&gt;"), "{r}");
        let f = form(&QueryText {
            kind: Some("\"><x".into()),
            status: Some("dead".into()),
            ..Default::default()
        });
        assert!(
            !f.contains("\"><x") && f.contains("<option selected>dead</option>"),
            "{f}"
        );
    }
}
