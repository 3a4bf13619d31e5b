//! The simulator's effects sink: a webhook destination that records side
//! effects, deduplicates by `Idempotency-Key`, and misbehaves on request.
//!
//! Routes:
//! - `POST /effects`: records one effect per `Idempotency-Key` and answers
//!   `201` with its result (`{"id","key","seq","status":"delivered","at"}`);
//!   the same key again answers `200` with the first result and the header
//!   `Idempotent-Replayed: true`, recording nothing. Without a key every POST
//!   is a new effect. With `LH_SIM_EFFECTS_DEDUPE=false` the sink plays a
//!   destination that ignores the key: every POST is a new effect (the key
//!   still finds its first one).
//! - `GET /effects/<key>`: the stored result of that key, or `404`.
//! - `GET /effects`: every recorded effect as a JSON array of
//!   `{id, seq, key, body, at}` in order.
//! - `GET /effects/count` (`?key=K` to count one key): `{"count": n}`.
//! - `POST /effects/faults` with `{"mode": M, "times": n}` arms a fault for
//!   the next `n` POSTs; `{"clear": true}` disarms all.
//!
//! Fault modes, by the request header `x-sim-effects-fault: M`, by
//! `POST /effects/faults`, or at start-up by `LH_SIM_EFFECTS_FAULTS`
//! (`mode[:count],...`):
//!
//! | mode | behaviour |
//! |---|---|
//! | `commit_then_timeout` | records the effect, then hangs for `LH_SIM_EFFECTS_HANG` (default 30s) before answering |
//! | `timeout_before_commit` | hangs, then answers 503 without recording |
//! | `empty_success` | records the effect, answers `200` with an empty body |
//! | `commit_twice` | without a key, records the effect twice (a duplicated delivery) |
//! | `error_5xx` | answers `503` without recording |
//! | `commit_then_5xx` | records the effect, answers `500` |
//! | `commit_late` | holds the request for `LH_SIM_EFFECTS_HANG`, then records the effect and answers, even if the caller went away meanwhile (a request stuck on the way that lands later) |

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    CommitThenTimeout,
    TimeoutBeforeCommit,
    EmptySuccess,
    CommitTwice,
    Error5xx,
    CommitThen5xx,
    CommitLate,
}

impl Fault {
    fn parse(s: &str) -> Option<Fault> {
        Some(match s.trim() {
            "commit_then_timeout" | "timeout_after_commit" => Fault::CommitThenTimeout,
            "timeout_before_commit" => Fault::TimeoutBeforeCommit,
            "empty_success" => Fault::EmptySuccess,
            "commit_twice" => Fault::CommitTwice,
            "error_5xx" => Fault::Error5xx,
            "commit_then_5xx" => Fault::CommitThen5xx,
            "commit_late" => Fault::CommitLate,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone)]
struct Effect {
    seq: u64,
    key: Option<String>,
    body: Value,
    result: Value,
    at: String,
}

#[derive(Default)]
struct Inner {
    effects: Vec<Effect>,
    /// Key → index of its first effect.
    by_key: HashMap<String, usize>,
    armed: VecDeque<(Fault, u32)>,
}

#[derive(Clone)]
struct Sink {
    inner: Arc<Mutex<Inner>>,
    hang: Duration,
    /// Whether a key already seen replays instead of recording again.
    dedupe: bool,
}

/// The routes of the effects sink.
pub fn router(_args: &crate::Args) -> anyhow::Result<Router> {
    let mut inner = Inner::default();
    if let Ok(spec) = std::env::var("LH_SIM_EFFECTS_FAULTS") {
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (mode, n) = match part.split_once(':') {
                Some((m, n)) => (
                    m,
                    n.parse::<u32>().map_err(|_| {
                        anyhow::anyhow!("LH_SIM_EFFECTS_FAULTS: bad count in `{part}`")
                    })?,
                ),
                None => (part, 1),
            };
            let f = Fault::parse(mode)
                .ok_or_else(|| anyhow::anyhow!("LH_SIM_EFFECTS_FAULTS: unknown mode `{mode}`"))?;
            inner.armed.push_back((f, n));
        }
    }
    let hang = hang()?;
    let dedupe = match std::env::var("LH_SIM_EFFECTS_DEDUPE") {
        Ok(v) => match v.trim() {
            "1" | "true" | "yes" | "" => true,
            "0" | "false" | "no" => false,
            other => anyhow::bail!("LH_SIM_EFFECTS_DEDUPE: `{other}` is not true/false"),
        },
        Err(_) => true,
    };
    let sink = Sink {
        inner: Arc::new(Mutex::new(inner)),
        hang,
        dedupe,
    };
    Ok(Router::new()
        .route("/effects", post(post_effect).get(list_effects))
        .route("/effects/count", get(count_effects))
        .route("/effects/faults", post(arm_faults))
        .route("/effects/{key}", get(get_effect))
        .with_state(sink))
}

fn now() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

impl Sink {
    fn take_armed(&self) -> Option<Fault> {
        let mut inner = self.inner.lock().expect("sink lock");
        let (f, n) = inner.armed.front_mut()?;
        let f = *f;
        *n -= 1;
        if *n == 0 {
            inner.armed.pop_front();
        }
        Some(f)
    }

    /// Records an effect (or finds the key's first one). Returns the result
    /// and whether it was a replay.
    fn commit(&self, key: Option<&str>, body: Value, twice: bool) -> (Value, bool) {
        let mut inner = self.inner.lock().expect("sink lock");
        if let Some(k) = key {
            if let Some(&i) = inner.by_key.get(k) {
                if self.dedupe {
                    return (inner.effects[i].result.clone(), true);
                }
            }
        }
        let copies = if twice && key.is_none() { 2 } else { 1 };
        let mut result = Value::Null;
        for _ in 0..copies {
            let seq = inner.effects.len() as u64 + 1;
            let at = now();
            result = json!({
                "id": format!("eff-{seq:06}"),
                "seq": seq,
                "key": key,
                "status": "delivered",
                "at": at,
            });
            inner.effects.push(Effect {
                seq,
                key: key.map(str::to_string),
                body: body.clone(),
                result: result.clone(),
                at,
            });
            if let Some(k) = key {
                let idx = inner.effects.len() - 1;
                inner.by_key.entry(k.to_string()).or_insert(idx);
            }
        }
        (result, false)
    }
}

async fn post_effect(State(sink): State<Sink>, headers: HeaderMap, body: Bytes) -> Response {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .filter(|k| !k.is_empty());
    let header_fault = headers
        .get("x-sim-effects-fault")
        .and_then(|v| v.to_str().ok())
        .and_then(Fault::parse);
    let fault = header_fault.or_else(|| sink.take_armed());
    let body: Value = serde_json::from_slice(&body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()));
    match fault {
        Some(Fault::Error5xx) => {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({"error": "injected error_5xx"})),
            )
                .into_response()
        }
        Some(Fault::TimeoutBeforeCommit) => {
            tokio::time::sleep(sink.hang).await;
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({"error": "injected timeout_before_commit"})),
            )
                .into_response();
        }
        Some(Fault::CommitLate) => {
            tracing::warn!(key = ?key, hang = ?sink.hang, "commit_late: holding the request, it lands later");
            // Detached, so a caller that hangs up (or dies) does not stop it.
            let late = sink.clone();
            let landed = tokio::spawn(async move {
                tokio::time::sleep(late.hang).await;
                late.commit(key.as_deref(), body, false)
            });
            return match landed.await {
                Ok((result, _)) => (StatusCode::CREATED, Json(result)).into_response(),
                Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
            };
        }
        _ => {}
    }
    let (result, replayed) = sink.commit(key.as_deref(), body, fault == Some(Fault::CommitTwice));
    match fault {
        Some(Fault::CommitThenTimeout) => {
            // The effect is recorded; the caller's timeout fires long before
            // this answer.
            tokio::time::sleep(sink.hang).await;
        }
        Some(Fault::EmptySuccess) => return StatusCode::OK.into_response(),
        Some(Fault::CommitThen5xx) => {
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                Json(json!({"error": "injected commit_then_5xx"})),
            )
                .into_response()
        }
        _ => {}
    }
    if replayed {
        (
            StatusCode::OK,
            [("idempotent-replayed", "true")],
            Json(result),
        )
            .into_response()
    } else {
        (StatusCode::CREATED, Json(result)).into_response()
    }
}

async fn get_effect(State(sink): State<Sink>, Path(key): Path<String>) -> Response {
    let inner = sink.inner.lock().expect("sink lock");
    match inner.by_key.get(&key) {
        Some(&i) => Json(inner.effects[i].result.clone()).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "no effect with this key"})),
        )
            .into_response(),
    }
}

async fn list_effects(State(sink): State<Sink>) -> Json<Value> {
    let inner = sink.inner.lock().expect("sink lock");
    Json(Value::Array(
        inner
            .effects
            .iter()
            .map(|e| json!({"id": e.result["id"], "seq": e.seq, "key": e.key, "body": e.body, "at": e.at}))
            .collect(),
    ))
}

#[derive(Deserialize)]
struct CountQuery {
    key: Option<String>,
}

async fn count_effects(State(sink): State<Sink>, Query(q): Query<CountQuery>) -> Json<Value> {
    let inner = sink.inner.lock().expect("sink lock");
    let n = match &q.key {
        Some(k) => inner
            .effects
            .iter()
            .filter(|e| e.key.as_deref() == Some(k.as_str()))
            .count(),
        None => inner.effects.len(),
    };
    Json(json!({ "count": n }))
}

#[derive(Deserialize)]
struct ArmRequest {
    mode: Option<String>,
    times: Option<u32>,
    #[serde(default)]
    clear: bool,
}

async fn arm_faults(State(sink): State<Sink>, Json(req): Json<ArmRequest>) -> Response {
    let mut inner = sink.inner.lock().expect("sink lock");
    if req.clear {
        inner.armed.clear();
    }
    if let Some(m) = &req.mode {
        let Some(f) = Fault::parse(m) else {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": format!("unknown fault mode `{m}`")})),
            )
                .into_response();
        };
        let n = req.times.unwrap_or(1);
        if n > 0 {
            inner.armed.push_back((f, n));
        }
    }
    Json(json!({"armed": inner.armed.iter().map(|(f, n)| json!({"mode": format!("{f:?}"), "times": n})).collect::<Vec<_>>()}))
        .into_response()
}

/// How long a hanging fault hangs (`LH_SIM_EFFECTS_HANG`, 30s), for the
/// effects sink and the accounting system alike.
pub(crate) fn hang() -> anyhow::Result<Duration> {
    Ok(match std::env::var("LH_SIM_EFFECTS_HANG") {
        Ok(v) => humantime::parse_duration(v.trim())
            .map_err(|e| anyhow::anyhow!("LH_SIM_EFFECTS_HANG: {e}"))?,
        Err(_) => Duration::from_secs(30),
    })
}
