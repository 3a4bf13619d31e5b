//! A small accounting system, the destination of the invoice example's
//! write tool: invoices unique by their business key (supplier + invoice
//! number), looked up by that key, with faults on request.
//!
//! Routes:
//! - `POST /accounting/invoices` `{"supplier", "number", "amount", ...}`:
//!   `201` with the stored invoice (`{"id", "supplier", "number", "amount",
//!   "key", "at"}`; `key` is the request's `Idempotency-Key`); an invoice
//!   with the same supplier and number answers `409` `{"error": {"type":
//!   "duplicate", ...}, "invoice": <the stored one>}` and stores nothing.
//! - `GET /accounting/invoices?supplier=S&number=N`: that invoice, or `404`.
//! - `GET /accounting/invoices`: every invoice, in order; `GET
//!   /accounting/invoices/count`: `{"count": n}`.
//! - `GET /accounting/creates`: every business key a create asked for,
//!   `[{"supplier", "number", "creates": n, "invoice": id}]` in first-asked
//!   order: `creates` counts the create requests that reached the books
//!   (stored, or refused as a duplicate), so a write tool that ran twice
//!   for one key shows 2 although the books hold one invoice.
//! - `GET /accounting/suppliers?name=X`: `{"id": "sup-<x>", "name": X}`.
//! - `POST /accounting/faults` `{"mode": M, "times": n}` arms a fault for
//!   the next `n` requests it applies to; `{"clear": true}` disarms all.
//!
//! | mode | applies to | behaviour |
//! |---|---|---|
//! | `commit_then_timeout` | create | stores the invoice, then hangs for `LH_SIM_EFFECTS_HANG` (30s) before answering |
//! | `commit_then_500` | create | stores the invoice, answers `500` |
//! | `rate_limit` | create | `429` with `Retry-After: 1`, stores nothing |
//! | `lookup_ambiguous` | lookup | `200` `{"status": "ambiguous"}`: two drafts match, nobody can tell which is the invoice |
//!
//! A hanging create prints `accounting: committed <id> <supplier>/<number>;
//! hanging` on stdout once the invoice is stored, so a test can kill the
//! process at that moment. With `LH_SIM_ACCOUNTING_STATE=FILE` the books
//! survive a restart, a kill -9 included: every create that reaches the
//! books is appended to FILE (one JSON line, synced) before it is
//! answered, and FILE is read back at start.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    CommitThenTimeout,
    CommitThen500,
    RateLimit,
    LookupAmbiguous,
}

impl Fault {
    fn parse(s: &str) -> Option<Fault> {
        Some(match s {
            "commit_then_timeout" => Fault::CommitThenTimeout,
            "commit_then_500" => Fault::CommitThen500,
            "rate_limit" => Fault::RateLimit,
            "lookup_ambiguous" => Fault::LookupAmbiguous,
            _ => return None,
        })
    }
    fn on_lookup(self) -> bool {
        self == Fault::LookupAmbiguous
    }
}

#[derive(Default)]
struct Books {
    invoices: Vec<Value>,
    /// (supplier, number, create requests that reached the books).
    creates: Vec<(String, String, u64)>,
    faults: Vec<(Fault, u32)>,
    /// `LH_SIM_ACCOUNTING_STATE`: the journal the books are kept in.
    journal: Option<std::fs::File>,
}

impl Books {
    /// Takes one armed fault that applies (`lookup` or create).
    fn take(&mut self, lookup: bool) -> Option<Fault> {
        let i = self
            .faults
            .iter()
            .position(|(f, n)| *n > 0 && f.on_lookup() == lookup)?;
        self.faults[i].1 -= 1;
        Some(self.faults[i].0)
    }
    /// Counts a create of `supplier`/`number` that reached the books and,
    /// when it stored `stored`, that invoice; journaled (and synced) first
    /// when the books are kept in a file.
    fn record(&mut self, supplier: &str, number: &str, stored: Option<&Value>) {
        if let Some(f) = self.journal.as_mut() {
            let line =
                json!({"create": {"supplier": supplier, "number": number}, "stored": stored});
            let ok = writeln!(f, "{line}").and_then(|_| f.sync_data());
            if let Err(e) = ok {
                eprintln!("accounting: journal write failed: {e}");
            }
        }
        self.count(supplier, number, stored);
    }
    fn count(&mut self, supplier: &str, number: &str, stored: Option<&Value>) {
        match self
            .creates
            .iter_mut()
            .find(|(s, n, _)| s == supplier && n == number)
        {
            Some(c) => c.2 += 1,
            None => self
                .creates
                .push((supplier.to_string(), number.to_string(), 1)),
        }
        if let Some(inv) = stored {
            self.invoices.push(inv.clone());
        }
    }
    /// The books of the journal at `path` (created when missing).
    fn open(path: PathBuf) -> anyhow::Result<Books> {
        let mut b = Books::default();
        let mut cut = false;
        if let Ok(text) = std::fs::read_to_string(&path) {
            cut = !text.is_empty() && !text.ends_with('\n');
            // A line cut short by a kill is the last one: skipped.
            for v in text
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            {
                let (Some(s), Some(n)) = (
                    v["create"]["supplier"].as_str(),
                    v["create"]["number"].as_str(),
                ) else {
                    continue;
                };
                let stored = Some(&v["stored"]).filter(|x| !x.is_null());
                b.count(s, n, stored);
            }
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| anyhow::anyhow!("LH_SIM_ACCOUNTING_STATE={}: {e}", path.display()))?;
        if cut {
            // The next line starts on a line of its own.
            writeln!(f)?;
        }
        b.journal = Some(f);
        Ok(b)
    }
    fn find(&self, supplier: &str, number: &str) -> Option<&Value> {
        self.invoices
            .iter()
            .find(|i| i["supplier"] == supplier && i["number"] == number)
    }
}

struct Accounting {
    books: Mutex<Books>,
    hang: Duration,
}

type Shared = Arc<Accounting>;

/// The accounting routes.
pub fn router(_args: &crate::Args) -> anyhow::Result<Router> {
    let hang = crate::effects::hang()?;
    let books = match std::env::var_os("LH_SIM_ACCOUNTING_STATE") {
        Some(p) if !p.is_empty() => Books::open(PathBuf::from(p))?,
        _ => Books::default(),
    };
    let state = Arc::new(Accounting {
        books: Mutex::new(books),
        hang,
    });
    Ok(Router::new()
        .route("/accounting/invoices", post(create).get(lookup))
        .route("/accounting/invoices/count", get(count))
        .route("/accounting/creates", get(creates))
        .route("/accounting/suppliers", get(supplier))
        .route("/accounting/faults", post(faults))
        .with_state(state))
}

fn error(status: StatusCode, kind: &str, message: &str) -> Response {
    (
        status,
        Json(json!({"error": {"type": kind, "message": message}})),
    )
        .into_response()
}

async fn create(State(a): State<Shared>, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    let Ok(inv) = serde_json::from_slice::<Value>(&body) else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            "the body is not JSON",
        );
    };
    let (Some(supplier), Some(number)) = (inv["supplier"].as_str(), inv["number"].as_str()) else {
        return error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_invoice",
            "an invoice needs `supplier` and `number` (strings)",
        );
    };
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let (fault, stored) = {
        let mut b = a.books.lock().expect("books");
        let fault = b.take(false);
        if fault == Some(Fault::RateLimit) {
            return (
                StatusCode::TOO_MANY_REQUESTS,
                [("retry-after", "1")],
                Json(json!({"error": {"type": "rate_limited", "message": "slow down"}})),
            )
                .into_response();
        }
        if let Some(existing) = b.find(supplier, number).cloned() {
            b.record(supplier, number, None);
            return (
                StatusCode::CONFLICT,
                Json(json!({
                    "error": {"type": "duplicate", "message": format!("invoice {number} of {supplier} exists")},
                    "invoice": existing,
                })),
            )
                .into_response();
        }
        let at = humantime::format_rfc3339_millis(SystemTime::now()).to_string();
        let stored = json!({
            "id": format!("inv-{}", b.invoices.len() + 1),
            "supplier": supplier,
            "number": number,
            "amount": inv["amount"],
            "supplier_id": inv["supplier_id"],
            "key": key,
            "at": at,
        });
        b.record(supplier, number, Some(&stored));
        (fault, stored)
    };
    match fault {
        Some(Fault::CommitThenTimeout) => {
            println!(
                "accounting: committed {} {supplier}/{number}; hanging",
                stored["id"].as_str().unwrap_or("")
            );
            tokio::time::sleep(a.hang).await;
            (StatusCode::CREATED, Json(stored)).into_response()
        }
        Some(Fault::CommitThen500) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "the ledger service failed after writing",
        ),
        _ => (StatusCode::CREATED, Json(stored)).into_response(),
    }
}

#[derive(Deserialize)]
struct Lookup {
    supplier: Option<String>,
    number: Option<String>,
}

async fn lookup(State(a): State<Shared>, Query(q): Query<Lookup>) -> Response {
    let mut b = a.books.lock().expect("books");
    match (q.supplier, q.number) {
        (None, None) => Json(Value::Array(b.invoices.clone())).into_response(),
        (Some(s), Some(n)) => {
            if b.take(true) == Some(Fault::LookupAmbiguous) {
                return Json(json!({"status": "ambiguous", "message": "two drafts match"}))
                    .into_response();
            }
            match b.find(&s, &n) {
                Some(inv) => Json(inv.clone()).into_response(),
                None => error(StatusCode::NOT_FOUND, "not_found", "no such invoice"),
            }
        }
        _ => error(
            StatusCode::BAD_REQUEST,
            "invalid_query",
            "look an invoice up by both `supplier` and `number`",
        ),
    }
}

async fn count(State(a): State<Shared>) -> Json<Value> {
    Json(json!({"count": a.books.lock().expect("books").invoices.len()}))
}

async fn creates(State(a): State<Shared>) -> Json<Value> {
    let b = a.books.lock().expect("books");
    Json(Value::Array(
        b.creates
            .iter()
            .map(|(s, n, c)| {
                json!({
                    "supplier": s,
                    "number": n,
                    "creates": c,
                    "invoice": b.find(s, n).map(|i| i["id"].clone()),
                })
            })
            .collect(),
    ))
}

#[derive(Deserialize)]
struct Name {
    name: Option<String>,
}

async fn supplier(Query(q): Query<Name>) -> Response {
    match q.name.filter(|n| !n.trim().is_empty()) {
        Some(n) => Json(json!({
            "id": format!("sup-{}", n.trim().to_ascii_lowercase().replace(' ', "-")),
            "name": n.trim(),
        }))
        .into_response(),
        None => error(
            StatusCode::BAD_REQUEST,
            "invalid_query",
            "`name` is required",
        ),
    }
}

async fn faults(State(a): State<Shared>, Json(v): Json<Value>) -> Response {
    let mut b = a.books.lock().expect("books");
    if v["clear"] == true {
        b.faults.clear();
        return Json(json!({"armed": 0})).into_response();
    }
    let Some(mode) = v["mode"].as_str().and_then(Fault::parse) else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_fault",
            "`mode` is one of commit_then_timeout, commit_then_500, rate_limit, lookup_ambiguous",
        );
    };
    let times = v["times"].as_u64().unwrap_or(1) as u32;
    b.faults.push((mode, times));
    Json(json!({"armed": b.faults.iter().map(|(_, n)| *n).sum::<u32>()})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_journal_keeps_the_books_and_the_creates_per_key_across_a_restart() {
        let path = std::env::temp_dir().join(format!(
            "lh-sim-accounting-{}-{:?}.jsonl",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_file(&path);
        let inv = json!({"id": "inv-1", "supplier": "A", "number": "1"});
        {
            let mut b = Books::open(path.clone()).unwrap();
            b.record("A", "1", Some(&inv));
            // A duplicate create is counted, not stored.
            b.record("A", "1", None);
            b.record(
                "B",
                "2",
                Some(&json!({"id": "inv-2", "supplier": "B", "number": "2"})),
            );
        }
        // A line cut short by a kill is skipped.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(b"{\"create\": {\"supp"))
            .unwrap();
        let mut b = Books::open(path.clone()).unwrap();
        b.record("C", "3", None);
        let b = Books::open(path.clone()).unwrap();
        assert_eq!(b.invoices.len(), 2);
        assert_eq!(b.find("A", "1"), Some(&inv));
        assert_eq!(
            b.creates,
            vec![
                ("A".into(), "1".into(), 2),
                ("B".into(), "2".into(), 1),
                ("C".into(), "3".into(), 1)
            ]
        );
        let _ = std::fs::remove_file(&path);
    }
}
