//! The simulator's small web: a SearxNG-compatible `/search` and a
//! deterministic set of HTML pages under `/page/...`, for `search` and
//! `fetch` in the offline demo and the tests.
//!
//! Routes:
//! - `GET /search?q=..&format=json`: SearxNG's JSON shape (`results[]` with
//!   `title`, `url`, `content`, `engine`, `score`); result URLs point back at
//!   this server (`http://<Host header>/page/<slug>`). Ranking is by word
//!   overlap with the query, ties broken by `--seed`, so the same query gives
//!   the same answer. Any `format` other than `json` gets 403, as a SearxNG
//!   without the JSON format enabled does.
//! - `GET /page/<slug>`: one page of the web (HTML with links to others); 404
//!   for unknown slugs.
//! - Helpers for `fetch` tests: `/page/redirect?to=URL` (302 to any URL),
//!   `/page/redirect-private` (302 to the cloud metadata address),
//!   `/page/big?kb=N` (an N KiB page, default 512), `/page/slow?ms=N` (answers
//!   after N ms, default 5000), `/page/binary` (`application/octet-stream`),
//!   `/page/plain` (`text/plain`).

use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use sha2::{Digest, Sha256};

/// One page of the simulated web.
struct Page {
    slug: &'static str,
    title: &'static str,
    summary: &'static str,
    paragraphs: &'static [&'static str],
    links: &'static [&'static str],
}

const PAGES: &[Page] = &[
    Page {
        slug: "leases",
        title: "Leases: time-bounded ownership in distributed systems",
        summary: "A lease grants a node ownership of a resource for a bounded time; it must be renewed before it expires or another node may take over.",
        paragraphs: &[
            "A lease is a promise with an expiry. The holder may act as owner until the lease runs out, and must renew it before then.",
            "Because clocks drift and processes pause, a lease alone cannot stop a paused former owner from acting late. Leases are paired with fencing tokens for that reason.",
            "Lease durations trade failover speed against false expiry: short leases recover quickly but expire under load spikes.",
        ],
        links: &["fencing-tokens", "clock-skew", "heartbeats"],
    },
    Page {
        slug: "fencing-tokens",
        title: "Fencing tokens and stale owners",
        summary: "A fencing token is a number that increases with every grant of ownership; storage refuses writes carrying an older token.",
        paragraphs: &[
            "Every time ownership is granted, the token (or epoch) increases by one. The holder sends it with every write.",
            "The storage remembers the highest token it has seen and refuses older ones, so a process that paused through its lease expiry cannot overwrite the new owner's work.",
            "Compare-and-set on a revision number gives the same protection when the storage itself is versioned.",
        ],
        links: &["leases", "compare-and-set", "idempotency-keys"],
    },
    Page {
        slug: "idempotency-keys",
        title: "Idempotency keys for side effects",
        summary: "An idempotency key sent with a write lets the receiver perform it at most once, however often the request is retried.",
        paragraphs: &[
            "A timeout only proves that the caller stopped waiting. The write may or may not have happened.",
            "The receiver stores the first response for each key and replays it to retries; a retry with the same key but different parameters is rejected.",
            "When the receiver cannot deduplicate, reconcile first: look the effect up by a business key before creating it again.",
        ],
        links: &["retries-and-backoff", "fencing-tokens", "checkpointing"],
    },
    Page {
        slug: "retries-and-backoff",
        title: "Retries, exponential backoff and jitter",
        summary: "Retry only transient failures, with capped exponential backoff and full jitter, at a single layer of the stack.",
        paragraphs: &[
            "Exponential backoff gives a struggling dependency room to recover; jitter keeps a fleet of clients from retrying in lockstep.",
            "Retrying at every layer multiplies the load: three layers of three attempts send 27 requests per user action.",
            "Writes are retried only with an idempotency key, after reconciling a timed-out attempt.",
        ],
        links: &["idempotency-keys", "heartbeats"],
    },
    Page {
        slug: "checkpointing",
        title: "Checkpointing long-running work",
        summary: "Persist each step's result before starting the next so that a crash resumes from the last checkpoint instead of starting over.",
        paragraphs: &[
            "Write the log first: record the intent to call a tool before the call, and its result after it.",
            "A resumed run skips completed steps, returning their stored results, and reconciles any step left in flight.",
            "Checkpoints from a superseded owner must be refused, or a stale process can roll the run back.",
        ],
        links: &["fencing-tokens", "idempotency-keys", "leases"],
    },
    Page {
        slug: "heartbeats",
        title: "Heartbeats and failure detection",
        summary: "Heartbeats renew leases and tell the rest of the system that a worker is alive; missing heartbeats start a takeover.",
        paragraphs: &[
            "A failure detector cannot tell a dead process from a slow one; it can only suspect.",
            "Heartbeat intervals are a fraction of the lease so that a few lost heartbeats do not expire it.",
        ],
        links: &["leases", "clock-skew"],
    },
    Page {
        slug: "clock-skew",
        title: "Clock skew and process pauses",
        summary: "Wall clocks drift and processes stop for garbage collection or VM migration; time-based reasoning must leave margins.",
        paragraphs: &[
            "A process can pause for seconds without knowing it, then act on a lease it no longer holds.",
            "Use monotonic clocks for durations and keep lease margins well above expected skew.",
        ],
        links: &["leases", "heartbeats"],
    },
    Page {
        slug: "compare-and-set",
        title: "Compare-and-set on revisions",
        summary: "A conditional write succeeds only when the record still has the revision the writer read, turning races into explicit conflicts.",
        paragraphs: &[
            "Read the record with its revision, compute the new value, and write it only if the revision is unchanged.",
            "A conflict is not an error to hide: re-read and decide again, or give up ownership.",
        ],
        links: &["fencing-tokens", "checkpointing"],
    },
];

#[derive(Clone)]
struct WebState {
    seed: u64,
}

/// The routes of the web part.
pub fn router(args: &crate::Args) -> anyhow::Result<Router> {
    let state = WebState { seed: args.seed };
    Ok(Router::new()
        .route("/search", get(search))
        .route("/page/redirect", get(redirect_any))
        .route("/page/redirect-private", get(redirect_private))
        .route("/page/big", get(big))
        .route("/page/slow", get(slow))
        .route("/page/binary", get(binary))
        .route("/page/plain", get(plain))
        .route("/page/{slug}", get(page))
        .with_state(state))
}

#[derive(Deserialize)]
struct SearchQuery {
    #[serde(default)]
    q: String,
    #[serde(default)]
    format: Option<String>,
}

fn host_of(headers: &HeaderMap) -> String {
    headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("127.0.0.1:8089")
        .to_string()
}

fn words(s: &str) -> Vec<String> {
    s.split(|c: char| !c.is_alphanumeric())
        .filter(|w| w.len() > 2)
        .map(str::to_lowercase)
        .collect()
}

/// A stable tie-breaker from the seed, the query and the slug.
fn tie(seed: u64, q: &str, slug: &str) -> u64 {
    let d = Sha256::digest(format!("{seed}:{q}:{slug}").as_bytes());
    u64::from_be_bytes(d[..8].try_into().expect("8 bytes"))
}

async fn search(
    State(st): State<WebState>,
    headers: HeaderMap,
    Query(sq): Query<SearchQuery>,
) -> Response {
    if sq.format.as_deref() != Some("json") {
        return (
            StatusCode::FORBIDDEN,
            "only format=json is enabled on this instance",
        )
            .into_response();
    }
    let host = host_of(&headers);
    let qwords = words(&sq.q);
    let mut scored: Vec<(usize, u64, &Page)> = PAGES
        .iter()
        .map(|p| {
            // Title words weigh most, then the slug, then the summary, so
            // the page about a topic outranks pages that mention it.
            let (tw, sw, cw) = (words(p.title), words(p.slug), words(p.summary));
            let score: usize = qwords
                .iter()
                .map(|w| {
                    3 * tw.contains(w) as usize
                        + 2 * sw.contains(w) as usize
                        + cw.contains(w) as usize
                })
                .sum();
            (score, tie(st.seed, &sq.q, p.slug), p)
        })
        .collect();
    scored.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    // Like a real engine, answer something even for an odd query, but never
    // the whole web.
    let results: Vec<serde_json::Value> = scored
        .iter()
        .take(5)
        .enumerate()
        .map(|(i, (score, _, p))| {
            json!({
                "url": format!("http://{host}/page/{}", p.slug),
                "title": p.title,
                "content": p.summary,
                "engine": "leasehold-sim",
                "engines": ["leasehold-sim"],
                "score": (*score as f64) + 1.0 / (i as f64 + 1.0),
                "category": "general",
            })
        })
        .collect();
    Json(json!({
        "query": sq.q,
        "number_of_results": results.len(),
        "results": results,
        "answers": [],
        "corrections": [],
        "infoboxes": [],
        "suggestions": [],
        "unresponsive_engines": [],
    }))
    .into_response()
}

fn html_page(title: &str, body: &str) -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        format!("<!doctype html>\n<html><head><title>{title}</title><style>body{{font-family:sans-serif}}</style><script>var tracking = 1;</script></head><body>\n{body}\n</body></html>\n"),
    )
        .into_response()
}

async fn page(Path(slug): Path<String>) -> Response {
    let Some(p) = PAGES.iter().find(|p| p.slug == slug) else {
        return (
            StatusCode::NOT_FOUND,
            [(header::CONTENT_TYPE, "text/html")],
            "<h1>Not found</h1>",
        )
            .into_response();
    };
    let mut body = format!("<h1>{}</h1>\n<p><em>{}</em></p>\n", p.title, p.summary);
    for para in p.paragraphs {
        body.push_str(&format!("<p>{para}</p>\n"));
    }
    body.push_str("<h2>See also</h2>\n<ul>\n");
    for l in p.links {
        let t = PAGES
            .iter()
            .find(|x| x.slug == *l)
            .map(|x| x.title)
            .unwrap_or(l);
        body.push_str(&format!("<li><a href=\"/page/{l}\">{t}</a></li>\n"));
    }
    body.push_str("</ul>\n");
    html_page(p.title, &body)
}

#[derive(Deserialize)]
struct RedirectQuery {
    to: String,
}

async fn redirect_any(Query(q): Query<RedirectQuery>) -> Redirect {
    Redirect::to(&q.to)
}

async fn redirect_private() -> Redirect {
    Redirect::to("http://169.254.169.254/latest/meta-data/")
}

#[derive(Deserialize)]
struct SizeQuery {
    kb: Option<usize>,
}

async fn big(Query(q): Query<SizeQuery>) -> Response {
    let kb = q.kb.unwrap_or(512).min(64 * 1024);
    let line = "<p>Lorem ipsum of a very large page, repeated to test size limits.</p>\n";
    let mut body = String::with_capacity(kb * 1024 + line.len());
    while body.len() < kb * 1024 {
        body.push_str(line);
    }
    html_page("A big page", &body)
}

#[derive(Deserialize)]
struct SlowQuery {
    ms: Option<u64>,
}

async fn slow(Query(q): Query<SlowQuery>) -> Response {
    tokio::time::sleep(Duration::from_millis(q.ms.unwrap_or(5000).min(600_000))).await;
    html_page("A slow page", "<p>This page took its time.</p>")
}

async fn binary() -> Response {
    (
        [(header::CONTENT_TYPE, "application/octet-stream")],
        vec![0u8, 1, 2, 3, 255],
    )
        .into_response()
}

async fn plain() -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        "Plain text page.\nSecond line.\n",
    )
        .into_response()
}
