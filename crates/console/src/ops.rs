//! Bulk actions as operations: `POST /actions/bulk-*` starts one on its
//! own task and answers at once with its page, `/ops/{id}`, which shows
//! what is done, failed and left (HTML refreshing itself every second, or
//! JSON for a bearer caller). The task is not the request's: a browser
//! that goes away leaves it running to its end. At most `--bulk-max` run
//! at once (another is refused, 429); dead letters are read a page of
//! [`PAGE`] at a time (headers only), never all into memory. The latest
//! [`KEEP`] operations stay readable until the console stops.

use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use futures::StreamExt;
use serde_json::{json, Value};

use crate::actions;
use crate::app::{App, Failure};
use crate::auth::{Caller, Via};
use crate::feed::ViewState;
use crate::metrics::ConsoleMetrics;
use crate::pages::{active_jobs, JobFilter};
use crate::render::{self, esc};

/// Dead letters read at once.
pub const PAGE: usize = 100;
/// Items acted on at once (an unanswered cancel waits 3 s).
pub const PARALLEL: usize = 8;
/// Operations kept readable (the oldest finished go first).
pub const KEEP: usize = 100;
/// Failures kept, each a sentence; the count goes on.
const FAILURES_SHOWN: usize = 50;

/// What an operation has done so far.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Progress {
    /// `running`, `done`, or `failed` (it stopped: `error` says why).
    pub state: &'static str,
    /// Items found so far (every one once `listed` is true).
    pub found: u64,
    pub listed: bool,
    pub done: u64,
    pub failed: u64,
    /// The first failures, each `item: why`.
    pub failures: Vec<String>,
    /// Pages of dead letters read.
    pub pages: u64,
    pub error: Option<String>,
}

impl Progress {
    pub fn remaining(&self) -> u64 {
        self.found.saturating_sub(self.done + self.failed)
    }
}

pub struct Op {
    pub id: String,
    pub action: String,
    pub by: String,
    pub started_at: String,
    pub filter: Vec<(String, String)>,
    progress: Mutex<Progress>,
}

impl Op {
    pub fn progress(&self) -> Progress {
        self.progress.lock().expect("op lock").clone()
    }

    fn update(&self, f: impl FnOnce(&mut Progress)) {
        f(&mut self.progress.lock().expect("op lock"));
    }

    fn outcome(&self, item: &str, r: Result<(), String>) {
        self.update(|p| match r {
            Ok(()) => p.done += 1,
            Err(e) => {
                p.failed += 1;
                if p.failures.len() < FAILURES_SHOWN {
                    p.failures.push(format!("{item}: {e}"));
                }
            }
        });
    }

    pub fn json(&self) -> Value {
        let p = self.progress();
        json!({
            "op": self.id, "url": format!("/ops/{}", self.id), "action": self.action,
            "by": self.by, "started_at": self.started_at,
            "filter": self.filter.iter().cloned().collect::<HashMap<_, _>>(),
            "state": p.state, "found": p.found, "listed": p.listed, "done": p.done,
            "failed": p.failed, "remaining": p.remaining(), "failures": p.failures,
            "pages": p.pages, "page_size": PAGE, "error": p.error,
        })
    }
}

pub struct Ops {
    max: usize,
    metrics: ConsoleMetrics,
    recent: Mutex<VecDeque<Arc<Op>>>,
}

impl Ops {
    pub fn new(max: usize, metrics: ConsoleMetrics) -> Ops {
        Ops {
            max,
            metrics,
            recent: Mutex::new(VecDeque::new()),
        }
    }

    pub fn get(&self, id: &str) -> Option<Arc<Op>> {
        let r = self.recent.lock().expect("ops lock");
        r.iter().find(|o| o.id == id).cloned()
    }

    /// A new operation, or 429 when `--bulk-max` run already.
    fn admit(
        &self,
        action: &str,
        caller: &Caller,
        filter: Vec<(String, String)>,
    ) -> Result<Arc<Op>, String> {
        let mut r = self.recent.lock().expect("ops lock");
        let running: Vec<&Arc<Op>> = r
            .iter()
            .filter(|o| o.progress().state == "running")
            .collect();
        if running.len() >= self.max {
            return Err(format!(
                "{} bulk action(s) are running, the most --bulk-max (LH_CONSOLE_BULK_MAX) allows: wait for one to end ({})",
                running.len(),
                running
                    .iter()
                    .map(|o| format!("/ops/{}", o.id))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        let op = Arc::new(Op {
            id: uuid::Uuid::new_v4().simple().to_string(),
            action: action.to_string(),
            by: caller.name.clone(),
            started_at: leasehold_core::time::rfc3339(std::time::SystemTime::now()),
            filter,
            progress: Mutex::new(Progress {
                state: "running",
                ..Default::default()
            }),
        });
        r.push_back(op.clone());
        while r.len() > KEEP {
            match r.iter().position(|o| o.progress().state != "running") {
                Some(i) => {
                    r.remove(i);
                }
                None => break,
            }
        }
        self.metrics.bulk_running.inc();
        Ok(op)
    }
}

/// Starts the bulk action `action` over what `form` matches, on its own
/// task; the operation, or why not (429: too many running; 400: a bad
/// filter).
pub fn start(
    app: &Arc<App>,
    caller: &Caller,
    action: &str,
    form: &HashMap<String, String>,
) -> Result<Arc<Op>, Failure> {
    let json = caller.via == Via::Bearer;
    let what = Target::parse(app, action, form).map_err(|e| Failure {
        status: StatusCode::BAD_REQUEST,
        message: e,
        json,
    })?;
    let op = app
        .ops
        .admit(action, caller, what.shown())
        .map_err(|e| Failure {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: e,
            json,
        })?;
    let (app, caller, task_op) = (app.clone(), caller.clone(), op.clone());
    tokio::spawn(async move {
        let r = run(&app, &caller, &task_op, what).await;
        task_op.update(|p| match r {
            Ok(()) => p.state = "done",
            Err(e) => {
                p.state = "failed";
                p.error = Some(e);
            }
        });
        app.metrics.bulk_running.dec();
        tracing::info!(op = %task_op.id, action = %task_op.action, progress = ?task_op.progress(), "bulk action ended");
    });
    Ok(op)
}

/// What a bulk action goes over.
enum Target {
    Jobs(JobFilter),
    Letters {
        replay: bool,
        kind: Option<String>,
        class: Option<String>,
    },
}

impl Target {
    fn parse(app: &App, action: &str, f: &HashMap<String, String>) -> Result<Target, String> {
        let get = |k: &str| {
            f.get(k)
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        };
        match action {
            "bulk-cancel" => {
                let mut q: HashMap<String, String> = f
                    .iter()
                    .filter(|(k, _)| ["kind", "status", "tenant", "prefix"].contains(&k.as_str()))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                q.insert("limit".into(), app.args.page_max.to_string());
                Ok(Target::Jobs(JobFilter::parse(&q, app.args.page_max)?))
            }
            "bulk-replay" | "bulk-purge" => {
                let class = get("class");
                if let Some(c) = &class {
                    if !["poison", "max_deliveries", "rejected", "id_conflict"]
                        .contains(&c.as_str())
                    {
                        return Err(format!(
                            "class={c:?} is not a class; use poison, max_deliveries, rejected or id_conflict"
                        ));
                    }
                }
                Ok(Target::Letters {
                    replay: action == "bulk-replay",
                    kind: get("kind"),
                    class,
                })
            }
            other => Err(format!("{other:?} is not a bulk action")),
        }
    }

    fn shown(&self) -> Vec<(String, String)> {
        let mut v = Vec::new();
        let mut put = |k: &str, x: &Option<String>| {
            if let Some(x) = x {
                v.push((k.to_string(), x.clone()));
            }
        };
        match self {
            Target::Jobs(f) => {
                put("kind", &f.kind);
                put("status", &f.status);
                put("tenant", &f.tenant);
                put("prefix", &f.prefix);
            }
            Target::Letters { kind, class, .. } => {
                put("kind", kind);
                put("class", class);
            }
        }
        v
    }
}

async fn run(app: &App, caller: &Caller, op: &Op, what: Target) -> Result<(), String> {
    match what {
        Target::Jobs(filter) => cancel_all(app, caller, op, filter).await,
        Target::Letters {
            replay,
            kind,
            class,
        } => letters(app, caller, op, replay, kind.as_deref(), class.as_deref()).await,
    }
}

/// The page size that reads every match at once (far more than a fleet's
/// active jobs).
const WHOLE: usize = 1 << 30;

/// Cancels every active job `filter` matches now: their ids first (page
/// by page of the index, as the jobs list reads it), then [`PARALLEL`]
/// cancels at a time.
async fn cancel_all(
    app: &App,
    caller: &Caller,
    op: &Op,
    mut filter: JobFilter,
) -> Result<(), String> {
    let mut ids = Vec::new();
    if app.feed.view_state() != ViewState::Live {
        // Without the console's view, a page is read from the index's end
        // back to its own end: one page of everything reads the index
        // once, where page after page would read it again each time.
        filter.limit = filter.limit.max(WHOLE);
    }
    loop {
        let (page, total) = active_jobs(app, &filter).await.map_err(|e| e.message)?;
        ids.extend(page.iter().map(|r| r.id.clone()));
        op.update(|p| p.found = ids.len() as u64);
        filter.offset += filter.limit;
        if filter.offset >= total.n || page.is_empty() {
            break;
        }
    }
    ids.sort();
    ids.dedup();
    op.update(|p| {
        p.found = ids.len() as u64;
        p.listed = true;
    });
    futures::stream::iter(ids)
        .for_each_concurrent(PARALLEL, |id| async move {
            let r = actions::cancel(app, caller, &id).await.map(|_| ());
            op.outcome(&id, r);
        })
        .await;
    Ok(())
}

/// Replays or deletes every dead letter matching `kind` and `class` that
/// was there when the operation started (a replayed job that dies again
/// leaves a later letter, not replayed again by this operation), a page
/// at a time.
async fn letters(
    app: &App,
    caller: &Caller,
    op: &Op,
    replay: bool,
    kind: Option<&str>,
    class: Option<&str>,
) -> Result<(), String> {
    let last = app.op_dlq.last_seq().await.map_err(|e| e.to_string())?;
    let mut after = 0;
    loop {
        let (page, more) = app
            .op_dlq
            .page(kind, class, after, PAGE)
            .await
            .map_err(|e| e.to_string())?;
        app.metrics.bulk_letter_pages.inc();
        let page: Vec<_> = page.into_iter().filter(|l| l.seq <= last).collect();
        let end = !more || page.len() < PAGE;
        after = page.last().map_or(after, |l| l.seq);
        op.update(|p| {
            p.pages += 1;
            p.found += page.len() as u64;
            p.listed = end;
        });
        futures::stream::iter(page)
            .for_each_concurrent(PARALLEL, |l| async move {
                let r = if replay {
                    actions::replay(app, caller, l.seq).await.map(|_| ())
                } else {
                    match actions::delete(app, caller, l.seq).await {
                        Ok(true) => Ok(()),
                        Ok(false) => Err("gone already".to_string()),
                        Err(e) => Err(e),
                    }
                };
                op.outcome(&format!("letter {}", l.seq), r);
            })
            .await;
        if end {
            return Ok(());
        }
    }
}

/// `GET /ops/{id}`: the operation's progress.
pub async fn page(
    State(app): State<Arc<App>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, Failure> {
    let json = caller.via == Via::Bearer;
    let op = app.ops.get(&id).ok_or_else(|| Failure {
        status: StatusCode::NOT_FOUND,
        message: format!(
            "no bulk action {id:?}: a wrong id, or it ended before the latest {KEEP} or the console restarted"
        ),
        json,
    })?;
    if json {
        return Ok((
            [(header::CONTENT_TYPE, "application/json")],
            app.clean(&op.json().to_string()),
        )
            .into_response());
    }
    Ok(Html(render::layout("bulk action", &app.clean(&html(&op)))).into_response())
}

/// The operation's page: while it runs, it reloads itself every second.
pub fn html(op: &Op) -> String {
    let p = op.progress();
    let mut b = String::new();
    let _ = write!(
        b,
        "<h1>{} <small>{}</small></h1><ul>",
        esc(&op.action),
        esc(p.state)
    );
    for (k, v) in &op.filter {
        let _ = write!(b, "<li>{}: <code>{}</code></li>", esc(k), esc(v));
    }
    let _ = write!(
        b,
        "</ul><p>started {} by {}</p><table class=\"summary\" id=\"progress\" data-state=\"{}\" data-listed=\"{}\" data-done=\"{}\" data-failed=\"{}\" data-remaining=\"{}\">\
<tr><th>done</th><td>{}</td></tr><tr><th>failed</th><td>{}</td></tr><tr><th>remaining</th><td>{}{}</td></tr></table>",
        esc(&op.started_at),
        esc(&op.by),
        p.state,
        p.listed,
        p.done,
        p.failed,
        p.remaining(),
        p.done,
        p.failed,
        p.remaining(),
        if p.listed { "" } else { " (more being read)" },
    );
    if let Some(e) = &p.error {
        let _ = write!(b, "<p class=\"error\">stopped: {}</p>", esc(e));
    }
    if !p.failures.is_empty() {
        b.push_str("<h2>Failures</h2><ul>");
        for f in &p.failures {
            let _ = write!(b, "<li>{}</li>", esc(f));
        }
        b.push_str("</ul>");
    }
    if p.state == "running" {
        b.push_str("<p data-refresh=\"1\">This page reloads itself every second until the action ends; it goes on if you leave.</p>");
    }
    let back = if op.action == "bulk-cancel" {
        "/jobs"
    } else {
        "/dlq"
    };
    let _ = write!(b, "<p><a id=\"back\" href=\"{back}\">back</a></p>");
    b
}
