//! Actions: each asks for confirmation (`GET /confirm?action=...` renders
//! what will happen and a form), is done by `POST /actions/{action}` (the
//! CSRF field, the operator's permission), goes through the same function
//! as the CLI's command ([`leasehold_operate`]) on the operator
//! connection, and is recorded as an `action` event naming the caller.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::Form;
use leasehold_operate::{self as operate, Action};
use serde_json::{json, Value};

use crate::app::{App, Failure};
use crate::auth::{Caller, Via};
use crate::pages::{active_jobs, JobFilter};
use crate::render::{self, esc, url};

const ACTIONS: &[(&str, &str)] = &[
    ("cancel", "Cancel job"),
    ("signal", "Send signal to job"),
    ("review-resume", "Resume parked job"),
    ("review-fail", "Fail parked job"),
    ("dlq-replay", "Replay dead letter"),
    ("dlq-delete", "Delete dead letter"),
    ("bulk-cancel", "Cancel every active job matching"),
    ("bulk-replay", "Replay every dead letter matching"),
    ("bulk-purge", "Delete every dead letter matching"),
];

fn forbidden(caller: &Caller) -> Failure {
    Failure {
        status: StatusCode::FORBIDDEN,
        message: format!("{} may read but not act", caller.name),
        json: caller.via == Via::Bearer,
    }
}

fn title(action: &str) -> Option<&'static str> {
    ACTIONS.iter().find(|(a, _)| *a == action).map(|(_, t)| *t)
}

pub async fn confirm(
    State(app): State<Arc<App>>,
    caller: Caller,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, Failure> {
    if !caller.can_act {
        return Err(forbidden(&caller));
    }
    app.may_act(caller.via == Via::Bearer)?;
    if let Some(id) = q.get("id") {
        crate::app::job_id(id.trim(), false)?;
    }
    let action = q.get("action").cloned().unwrap_or_default();
    let Some(t) = title(&action) else {
        return Err(Failure::page(
            StatusCode::BAD_REQUEST,
            format!(
                "unknown action {action:?}; one of {}",
                ACTIONS
                    .iter()
                    .map(|(a, _)| *a)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    };
    let mut what = String::new();
    let mut hidden = String::new();
    for (k, v) in &q {
        if k == "action" || v.is_empty() || (action == "signal" && k == "name") {
            continue;
        }
        let _ = write!(what, "<li>{}: <code>{}</code></li>", esc(k), esc(v));
        let _ = write!(
            hidden,
            "<input type=\"hidden\" name=\"{}\" value=\"{}\">",
            esc(k),
            esc(v)
        );
    }
    let extra = match action.as_str() {
        "signal" => format!(
            "<p><label>signal name (what the job's <code>wait_for</code> names)<br><input name=\"name\" id=\"signal-name\" size=\"40\" required value=\"{}\"></label></p>\
<p><label>data, as JSON (empty: <code>{{}}</code>)<br><textarea name=\"data\" id=\"signal-data\" rows=\"3\" cols=\"60\"></textarea></label></p>",
            esc(q.get("name").map(String::as_str).unwrap_or(""))
        ),
        "review-resume" => "<p><label>answer, as JSON (given to the step that asked, and recorded with the action)<br><textarea name=\"answer\" rows=\"3\" cols=\"60\"></textarea></label></p>".to_string(),
        "review-fail" => "<p><label>reason (required)<br><input name=\"reason\" size=\"60\" required></label></p>".to_string(),
        "dlq-replay" => rejected_form(&app, &q).await?,
        _ => String::new(),
    };
    let count = match action.as_str() {
        "bulk-cancel" => {
            let f = bulk_filter(&app, &q)?;
            let (_, total) = active_jobs(&app, &f).await?;
            format!("<p><b>{total}</b> active job(s) match now.</p>")
        }
        _ => String::new(),
    };
    let body = format!(
        "<h1>{t}?</h1><ul>{what}</ul>{count}<form method=\"post\" action=\"/actions/{a}\">{hidden}{extra}\
<input type=\"hidden\" name=\"csrf\" value=\"{csrf}\"><button id=\"confirm\" class=\"danger\">yes, {t_l}</button> \
<a href=\"javascript:history.back()\">no, go back</a></form>",
        a = esc(&action),
        t_l = esc(&t.to_lowercase()),
        csrf = app.csrf(&caller),
    );
    Ok(Html(render::layout("confirm", &body)).into_response())
}

fn bulk_filter(app: &App, q: &HashMap<String, String>) -> Result<JobFilter, Failure> {
    let mut f: HashMap<String, String> = q
        .iter()
        .filter(|(k, _)| ["kind", "status", "tenant", "prefix"].contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    f.insert("limit".into(), app.args.page_max.to_string());
    JobFilter::parse(&f, app.args.page_max).map_err(|e| Failure::page(StatusCode::BAD_REQUEST, e))
}

/// For the replay of a rejected submission: why it was rejected and its
/// bytes in a textarea, to replay as they are or corrected. Empty for any
/// other letter.
async fn rejected_form(app: &App, q: &HashMap<String, String>) -> Result<String, Failure> {
    let Ok(seq) = seq_of(q) else {
        return Ok(String::new());
    };
    let l = app
        .dlq
        .get(seq)
        .await
        .map_err(|e| Failure::unavailable(e, false))?
        .ok_or_else(|| Failure::page(StatusCode::NOT_FOUND, format!("no dead letter {seq}")))?;
    if l.class != "rejected" {
        return Ok(String::new());
    }
    Ok(format!(
        "<p>A rejected submission of kind <code>{}</code> (job <code>{}</code>), refused because: <span id=\"reason\" class=\"error\">{}</span></p>\
<p><label>the submission to replay: as it came, or corrected (JSON, validated as a worker would before anything is sent)<br>\
<textarea id=\"spec\" name=\"spec\" rows=\"8\" cols=\"80\">{}</textarea></label></p>",
        esc(&l.kind),
        esc(l.job_id.as_deref().unwrap_or("-")),
        esc(&app.clean(&l.reason)),
        esc(&app.clean(&String::from_utf8_lossy(&l.payload))),
    ))
}

/// How long a replayed submission may take to be accepted by a worker
/// before its letter is kept (and the answer says so).
const ACCEPT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Replays a rejected submission ([`operate::replay_rejected`], as `leasehold
/// dlq replay SEQ [--spec FILE]`): its bytes, or `spec` when it differs
/// from them (a corrected submission); refused, nothing sent, when the
/// validation still refuses it. The letter goes once a worker took the job.
async fn replay_submission(
    app: &App,
    caller: &Caller,
    l: &leasehold_store::dlq::Letter,
    spec: Option<&str>,
) -> Result<Done, String> {
    let norm = |t: &str| t.replace("\r\n", "\n").trim().to_string();
    let original = norm(&String::from_utf8_lossy(&l.payload));
    let corrected = spec
        .map(norm)
        .filter(|t| !t.is_empty() && *t != original)
        .map(String::into_bytes);
    let is_corrected = corrected.is_some();
    let p = operate::replay_rejected(&app.op, &app.op_jobs, l, corrected, false)
        .await
        .map_err(|e| e.to_string())?;
    let Some(id) = p.id.clone() else {
        return Ok(Done {
            message: format!(
                "letter {} replayed (ticket {}); it names no job id, so whether a worker accepts it cannot be told: the letter is kept",
                l.seq, p.ticket_seq
            ),
            back: "/dlq".into(),
            detail: json!({"dlq_seq": l.seq, "ticket_seq": p.ticket_seq, "accepted": false}),
        });
    };
    let (accepted, why) =
        match operate::accepted_by_a_worker(&app.op_jobs, &id, p.sent_at, ACCEPT_WAIT).await {
            Ok(a) => (a, None),
            Err(e) => (false, Some(e.to_string())),
        };
    let deleted = accepted && app.op_dlq.delete(l.seq).await.unwrap_or(false);
    let detail = json!({"id": id, "dlq_seq": l.seq, "ticket_seq": p.ticket_seq, "corrected": is_corrected, "accepted": accepted, "letter_deleted": deleted});
    record(app, caller, &id, "dlq_replay", detail.clone()).await;
    let what = if is_corrected {
        "the corrected submission"
    } else {
        "its bytes as they came"
    };
    let message = match (accepted, why) {
        (true, _) => format!(
            "letter {} replayed ({what}): job {id} accepted by a worker; letter deleted",
            l.seq
        ),
        (false, Some(why)) => format!(
            "letter {} replayed ({what}), but job {id} was {why}; the letter is kept",
            l.seq
        ),
        (false, None) => format!(
            "letter {} replayed ({what}); no worker took job {id} within {}s: the letter is kept",
            l.seq,
            ACCEPT_WAIT.as_secs()
        ),
    };
    Ok(Done {
        message,
        back: format!("/jobs/{}", url(&id)),
        detail,
    })
}

/// What one action did: a sentence and where to look.
struct Done {
    message: String,
    back: String,
    detail: Value,
}

pub async fn act(
    State(app): State<Arc<App>>,
    caller: Caller,
    Path(action): Path<String>,
    headers: HeaderMap,
    Form(f): Form<HashMap<String, String>>,
) -> Result<Response, Failure> {
    let as_json = caller.via == Via::Bearer;
    let fail = |status: StatusCode, m: String| Failure {
        status,
        message: m,
        json: as_json,
    };
    if !caller.can_act {
        return Err(forbidden(&caller));
    }
    app.may_act(as_json)?;
    let origin = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok());
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    let csrf = f.get("csrf").map(String::as_str).unwrap_or("");
    if !app.csrf_ok(&caller, origin, host, csrf) {
        return Err(fail(
            StatusCode::FORBIDDEN,
            "this action did not come from the console's own confirmation form (CSRF check); open the page again".into(),
        ));
    }
    if title(&action).is_none() {
        return Err(fail(
            StatusCode::NOT_FOUND,
            format!("unknown action {action:?}"),
        ));
    }
    if let Some(id) = f.get("id") {
        crate::app::job_id(id.trim(), as_json)?;
    }
    if action.starts_with("bulk-") {
        // An operation on its own task: its page answers at once.
        let op = crate::ops::start(&app, &caller, &action, &f)?;
        let to = format!("/ops/{}", op.id);
        if as_json {
            return Ok((
                StatusCode::ACCEPTED,
                [
                    (header::CONTENT_TYPE, "application/json".to_string()),
                    (header::LOCATION, to),
                ],
                op.json().to_string(),
            )
                .into_response());
        }
        return Ok(axum::response::Redirect::to(&to).into_response());
    }
    let done = run(&app, &caller, &action, &f)
        .await
        .map_err(|e| fail(StatusCode::CONFLICT, e))?;
    if as_json {
        return Ok((
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            json!({"action": action, "message": done.message, "detail": done.detail}).to_string(),
        )
            .into_response());
    }
    let body = format!(
        "<h1>Done</h1><p id=\"done\">{}</p><p><a id=\"back\" href=\"{}\">back</a></p>",
        esc(&done.message),
        esc(&done.back)
    );
    Ok(Html(render::layout("done", &app.clean(&body))).into_response())
}

fn field<'a>(f: &'a HashMap<String, String>, k: &str) -> Result<&'a str, String> {
    f.get(k)
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .ok_or_else(|| format!("the form has no {k}"))
}

fn seq_of(f: &HashMap<String, String>) -> Result<u64, String> {
    let s = field(f, "seq")?;
    s.parse()
        .map_err(|_| format!("seq={s:?} is not a dead letter's sequence"))
}

async fn record(app: &App, caller: &Caller, id: &str, action: &str, detail: Value) {
    let epoch = match app.op_jobs.get(id).await {
        Ok(Some(v)) => v.value.epoch,
        _ => 0,
    };
    let a = Action {
        action,
        by: &caller.name,
        via: "console",
        detail,
    };
    let nonce = uuid::Uuid::new_v4().simple().to_string();
    if let Err(e) = operate::record_action(&app.op, id, epoch, a, &nonce).await {
        tracing::warn!(job = id, action, error = %e, "action done, but its event was not recorded");
    }
}

pub(crate) async fn cancel(app: &App, caller: &Caller, id: &str) -> Result<Value, String> {
    let a = operate::request_cancel(&app.op, id)
        .await
        .map_err(|e| e.to_string())?;
    let outcome = a.reply["outcome"].as_str().unwrap_or("").to_string();
    if let Some(why) = a.refused {
        return Err(why);
    }
    if outcome == "not_found" {
        return Err(format!("no job {id:?}"));
    }
    record(app, caller, id, "cancel", json!({"outcome": outcome})).await;
    Ok(a.reply)
}

/// The dead letter `seq`, or why there is none.
async fn letter(app: &App, seq: u64) -> Result<leasehold_store::dlq::Letter, String> {
    app.op_dlq
        .get(seq)
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("no dead letter {seq}"))
}

pub(crate) async fn replay(app: &App, caller: &Caller, seq: u64) -> Result<Value, String> {
    let l = letter(app, seq).await?;
    if l.class == "rejected" {
        return Err(format!(
            "letter {seq} is a rejected submission: replay it on its own (its replay button), as it came or corrected"
        ));
    }
    let out = operate::replay_dead(&app.op, &app.op_jobs, &l, None)
        .await
        .map_err(|e| e.to_string())?;
    let deleted = app.op_dlq.delete(seq).await.unwrap_or(false);
    let id = out["id"].as_str().unwrap_or_default().to_string();
    record(
        app,
        caller,
        &id,
        "dlq_replay",
        json!({"dlq_seq": seq, "ticket_seq": out["ticket_seq"], "letter_deleted": deleted}),
    )
    .await;
    Ok(out)
}

pub(crate) async fn delete(app: &App, caller: &Caller, seq: u64) -> Result<bool, String> {
    let l = app.op_dlq.get(seq).await.map_err(|e| e.to_string())?;
    let deleted = app.op_dlq.delete(seq).await.map_err(|e| e.to_string())?;
    if let Some(id) = l.and_then(|l| l.job_id) {
        record(app, caller, &id, "dlq_delete", json!({"dlq_seq": seq})).await;
    }
    Ok(deleted)
}

async fn run(
    app: &App,
    caller: &Caller,
    action: &str,
    f: &HashMap<String, String>,
) -> Result<Done, String> {
    match action {
        "cancel" => {
            let id = field(f, "id")?;
            let reply = cancel(app, caller, id).await?;
            Ok(Done {
                message: format!(
                    "job {id}: cancel {}",
                    reply["outcome"].as_str().unwrap_or("?")
                ),
                back: format!("/jobs/{}", url(id)),
                detail: reply,
            })
        }
        "signal" => {
            let id = field(f, "id")?;
            let name = field(f, "name")?;
            let data = match f.get("data").map(|s| s.trim()).unwrap_or("") {
                "" => json!({}),
                d => serde_json::from_str::<Value>(d).map_err(|e| {
                    format!("the data must be JSON ({e}), e.g. {{\"confirmed\": true}}")
                })?,
            };
            let sender = format!("{} via console", caller.name);
            let sent =
                operate::send_signal(&app.op, &app.op_jobs, id, name, &data, None, Some(&sender))
                    .await
                    .map_err(|e| e.to_string())?;
            let message = if sent.waited_for {
                format!("signal `{name}` sent to job {id} (seq {}): it was waiting for it and is woken now", sent.seq)
            } else {
                format!("signal `{name}` sent to job {id} (seq {}): the job is {} and not waiting for it; it is kept until a wait takes it", sent.seq, sent.status)
            };
            Ok(Done {
                message,
                back: format!("/jobs/{}", url(id)),
                detail: serde_json::to_value(&sent).unwrap_or_default(),
            })
        }
        "review-resume" => {
            let id = field(f, "id")?;
            let answer = f.get("answer").map(|s| s.trim()).unwrap_or("");
            // The answer goes back to the step that asked (an SDK kind's
            // `ctx.park`), so it must be JSON, as `review resume --answer`.
            let parsed = match answer {
                "" => None,
                a => Some(serde_json::from_str::<Value>(a).map_err(|e| {
                    format!("the answer must be JSON ({e}), e.g. {{\"approve\": true}}")
                })?),
            };
            let sender = format!("{} via console", caller.name);
            let ticket =
                operate::review_resume(&app.op, &app.op_jobs, id, parsed.as_ref(), Some(&sender))
                    .await
                    .map_err(|e| e.to_string())?;
            record(
                app,
                caller,
                id,
                "review_resume",
                json!({"answer": answer, "ticket_seq": ticket}),
            )
            .await;
            Ok(Done {
                message: format!("job {id} queued again (ticket {ticket})"),
                back: format!("/jobs/{}", url(id)),
                detail: json!({"id": id, "status": "queued", "ticket_seq": ticket}),
            })
        }
        "review-fail" => {
            let id = field(f, "id")?;
            let reason = field(f, "reason")?;
            let rec = operate::review_fail(&app.op, &app.op_jobs, id, reason)
                .await
                .map_err(|e| e.to_string())?;
            record(app, caller, id, "review_fail", json!({"reason": reason})).await;
            Ok(Done {
                message: format!("job {id} failed: {reason}"),
                back: format!("/jobs/{}", url(id)),
                detail: json!({"id": id, "status": rec.status}),
            })
        }
        "dlq-replay" => {
            let seq = seq_of(f)?;
            let l = letter(app, seq).await?;
            if l.class == "rejected" {
                return replay_submission(app, caller, &l, f.get("spec").map(String::as_str)).await;
            }
            let out = replay(app, caller, seq).await?;
            let id = out["id"].as_str().unwrap_or_default().to_string();
            Ok(Done {
                message: format!("letter {seq} replayed: job {id} queued again"),
                back: format!("/jobs/{}", url(&id)),
                detail: out,
            })
        }
        "dlq-delete" => {
            let seq = seq_of(f)?;
            let deleted = delete(app, caller, seq).await?;
            Ok(Done {
                message: format!(
                    "letter {seq} {}",
                    if deleted {
                        "deleted"
                    } else {
                        "was gone already"
                    }
                ),
                back: "/dlq".into(),
                detail: json!({"seq": seq, "deleted": deleted}),
            })
        }
        other => Err(format!("unknown action {other:?}")),
    }
}
