//! Decoding and validating submissions.
//!
//! A submission is the raw bytes published on `lh.submit.<kind>`, JSON by
//! default or protobuf (`Content-Type: application/protobuf`). [`decode`]
//! either accepts it as a normalised [`JobSpec`] with its job id, or rejects
//! it with a precise [`SubmitError`] and, when it can be determined, the id.
//!
//! Job id: the `Nats-Msg-Id` header if present, else the spec's `id`, else
//! `seq-<stream sequence>`.

use std::time::{Duration, SystemTime};

use prost::Message as _;
use serde_json::Value;

use crate::time::{format_duration, parse_duration, parse_rfc3339, rfc3339};
use crate::JobSpec;

/// Default size limit of a submission: 1 MiB.
pub const DEFAULT_MAX_BYTES: usize = 1024 * 1024;

/// Checks one kind's input object; the error names the field.
pub type InputCheck = fn(&serde_json::Map<String, Value>) -> Result<(), String>;

/// The kinds this deployment accepts and how each validates its input.
#[derive(Clone)]
pub struct Kinds {
    kinds: Vec<(String, InputCheck)>,
}

impl Default for Kinds {
    /// The built-in kinds: `echo`, `sleep`, `fail`, `crash`, `research`,
    /// `deliver`, `fanout`.
    fn default() -> Self {
        let mut k = Kinds { kinds: Vec::new() };
        k.add("echo", |_| Ok(()));
        k.add("sleep", validate_sleep);
        k.add("fail", validate_fail);
        k.add("crash", |_| Ok(()));
        k.add("research", validate_research);
        k.add("deliver", validate_deliver);
        k.add("fanout", validate_fanout);
        k
    }
}

impl Kinds {
    pub fn add(&mut self, name: &str, v: InputCheck) {
        self.kinds.retain(|(n, _)| n != name);
        self.kinds.push((name.to_string(), v));
    }

    /// The same registry, also accepting `name` with any input object when
    /// it is not a built-in kind: a user's kind (served by a worker built
    /// with the SDK), whose handler validates its own input.
    pub fn with_open(mut self, name: &str) -> Kinds {
        if !self.contains(name) {
            self.add(name, |_| Ok(()));
        }
        self
    }

    pub fn names(&self) -> Vec<&str> {
        self.kinds.iter().map(|(n, _)| n.as_str()).collect()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.kinds.iter().any(|(n, _)| n == name)
    }

    fn validator(&self, name: &str) -> Option<InputCheck> {
        self.kinds.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }
}

fn get_u64(input: &serde_json::Map<String, Value>, field: &str) -> Result<Option<u64>, String> {
    match input.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("input.{field}: expected a non-negative integer, got {v}")),
    }
}

fn validate_sleep(input: &serde_json::Map<String, Value>) -> Result<(), String> {
    match get_u64(input, "ms")? {
        None => Err("input.ms: required (milliseconds to sleep, e.g. {\"ms\": 1000})".into()),
        Some(ms) if ms > 86_400_000 => {
            Err(format!("input.ms: {ms} is over the 24 h limit (86400000)"))
        }
        Some(_) => Ok(()),
    }
}

fn validate_fanout(input: &serde_json::Map<String, Value>) -> Result<(), String> {
    get_u64(input, "n")?;
    get_u64(input, "nest")?;
    get_u64(input, "pause_ms")?;
    match input.get("inputs") {
        None => {}
        Some(Value::Array(l)) if l.iter().all(Value::is_object) => {}
        Some(_) => return Err("input.inputs: a list of JSON objects, one per child".into()),
    }
    match input.get("kind") {
        None | Some(Value::String(_)) => Ok(()),
        Some(_) => Err("input.kind: the children's kind, a string".into()),
    }
}

fn validate_fail(input: &serde_json::Map<String, Value>) -> Result<(), String> {
    match input.get("class").and_then(Value::as_str) {
        Some("retryable" | "terminal" | "park") => {}
        _ => {
            return Err(format!(
                "input.class: expected \"retryable\", \"terminal\" or \"park\", got {}",
                input
                    .get("class")
                    .map_or("nothing".to_string(), |v| v.to_string())
            ))
        }
    }
    get_u64(input, "times")?;
    get_u64(input, "ms")?;
    Ok(())
}

fn validate_deliver(input: &serde_json::Map<String, Value>) -> Result<(), String> {
    match input.get("document") {
        Some(Value::String(d)) if !d.is_empty() => Ok(()),
        Some(v) => Err(format!(
            "input.document: expected a non-empty string, got {v}"
        )),
        None => Err("input.document: required (the text to deliver)".into()),
    }
}

fn validate_research(input: &serde_json::Map<String, Value>) -> Result<(), String> {
    match input.get("topic") {
        Some(Value::String(t)) if !t.trim().is_empty() && t.len() <= 1000 => {}
        Some(Value::String(t)) if t.len() > 1000 => {
            return Err(format!(
                "input.topic: {} characters, over the limit of 1000",
                t.len()
            ))
        }
        Some(v) => return Err(format!("input.topic: expected a non-empty string, got {v}")),
        None => return Err("input.topic: required (what the report is about)".into()),
    }
    if let Some(n) = get_u64(input, "experts")? {
        if !(1..=8).contains(&n) {
            return Err(format!("input.experts: {n} is out of range 1..=8"));
        }
    }
    if let Some(n) = get_u64(input, "sections")? {
        if !(1..=12).contains(&n) {
            return Err(format!("input.sections: {n} is out of range 1..=12"));
        }
    }
    match input.get("audience") {
        None | Some(Value::Null) | Some(Value::String(_)) => Ok(()),
        Some(v) => Err(format!("input.audience: expected a string, got {v}")),
    }
}

/// One submission as it arrived.
#[derive(Debug, Clone, Copy)]
pub struct Submission<'a> {
    pub kind: &'a str,
    pub payload: &'a [u8],
    pub msg_id: Option<&'a str>,
    pub content_type: Option<&'a str>,
    /// Stream sequence of the ticket (0 when not stored, e.g. before publishing).
    pub stream_seq: u64,
    /// When the submission was made: its ticket's stream timestamp once
    /// stored, else the submitter's clock now. `delay` counts from it and
    /// `run_at` is judged against it, so a ticket that waited for a worker
    /// is never refused for that wait.
    pub received_at: SystemTime,
}

/// How far in the past a `run_at` may be: a time up to this much earlier
/// than the submission runs at once; an earlier one is refused (a clock or
/// a script is wrong).
pub const RUN_AT_PAST_TOLERANCE: Duration = Duration::from_secs(5 * 60);

/// The longest a job may be delayed (`run_at` or `delay`): 366 days.
pub const MAX_DELAY: Duration = Duration::from_secs(366 * 86_400);

/// Why a submission was refused. Each message names the field and what to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    #[error("empty submission: publish a JSON spec like {{\"input\":{{...}}}}")]
    Empty,
    #[error("submission is {size} bytes, over the limit of {limit} bytes (LH_MAX_SUBMISSION_BYTES); put large inputs in the object store and pass a reference")]
    TooLarge { size: usize, limit: usize },
    #[error("submission is not valid UTF-8 (invalid byte at offset {offset}); JSON must be UTF-8")]
    NotUtf8 { offset: usize },
    #[error("submission is not JSON: {0}")]
    NotJson(String),
    #[error("submission has the wrong shape: {0}")]
    WrongShape(String),
    #[error("{path}: {message}")]
    Field { path: String, message: String },
    #[error("unknown kind {kind:?}: this deployment runs {known}")]
    UnknownKind { kind: String, known: String },
    #[error("{0}")]
    InvalidInput(String),
    #[error("invalid job id {0:?}: use 1-128 letters, digits, '-', '_' or '='")]
    InvalidId(String),
    #[error("invalid protobuf JobSpec: {0}")]
    Protobuf(String),
    #[error("the spec names tenant {spec_tenant:?} at priority {spec_priority} but was published on the subject of tenant {subject_tenant:?} at priority {subject_priority}: publish on {subject_hint} (`leasehold submit` picks it)")]
    WrongLane {
        spec_tenant: String,
        spec_priority: i32,
        subject_tenant: String,
        subject_priority: i32,
        subject_hint: String,
    },
}

impl SubmitError {
    /// A short stable name of the error, for the record's `error.class` detail and the DLQ header.
    pub fn code(&self) -> &'static str {
        match self {
            SubmitError::Empty => "empty",
            SubmitError::TooLarge { .. } => "too_large",
            SubmitError::NotUtf8 { .. } => "not_utf8",
            SubmitError::NotJson(_) => "not_json",
            SubmitError::WrongShape(_) => "wrong_shape",
            SubmitError::Field { .. } => "field",
            SubmitError::UnknownKind { .. } => "unknown_kind",
            SubmitError::InvalidInput(_) => "invalid_input",
            SubmitError::InvalidId(_) => "invalid_id",
            SubmitError::Protobuf(_) => "protobuf",
            SubmitError::WrongLane { .. } => "wrong_lane",
        }
    }
}

/// An accepted submission.
#[derive(Debug, Clone, PartialEq)]
pub struct Accepted {
    pub id: String,
    pub spec: JobSpec,
}

/// A refused submission; `id` when it could be determined.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejected {
    pub id: Option<String>,
    pub error: SubmitError,
}

/// Whether `id` can be a job id (a KV key and a single subject token).
pub fn valid_job_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '='))
}

/// How deep child jobs may nest: a child of a job without a parent is at
/// depth 1; a spawn that would make depth 9 fails its job.
pub const MAX_CHILD_DEPTH: u32 = 8;
/// How many children one spawn step may start.
pub const MAX_CHILDREN: usize = 10_000;

/// What a signal's name may be, as every refusal says it.
pub const SIGNAL_NAME_RULE: &str =
    "1-64 letters, digits, '-' or '_', not starting with 'lh-' (leasehold's own signals)";

/// Whether `name` can name a signal (`ctx.wait_for(name)`,
/// `leasehold signal ID NAME`): a single subject token of letters, digits,
/// `-` and `_`, at most 64, not one of leasehold's own (`lh-child`, the
/// end of a child job).
pub fn valid_signal_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with("lh-")
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
}

/// The parent a raw submission names (`"parent": {"id": ...}`), read
/// leniently from bytes that may not decode as a spec: a refused child's
/// record still names the parent that waits for it.
pub fn parent_of_raw(payload: &[u8]) -> Option<leasehold_proto::Parent> {
    let v: serde_json::Value = serde_json::from_slice(payload).ok()?;
    let p: leasehold_proto::Parent = serde_json::from_value(v.get("parent")?.clone()).ok()?;
    valid_job_id(&p.id).then_some(p)
}

/// The id derived from a ticket's stream sequence when nothing names one.
pub fn seq_id(seq: u64) -> String {
    format!("seq-{seq}")
}

/// Decodes and validates one submission.
pub fn decode(sub: Submission<'_>, kinds: &Kinds, max_bytes: usize) -> Result<Accepted, Rejected> {
    // The header id is known before anything is parsed, so even a payload
    // that is garbage can be recorded as rejected under it.
    let header_id = sub.msg_id.filter(|s| !s.is_empty());
    let mut id = header_id.map(str::to_string);
    let reject = |id: Option<String>, error| Rejected {
        id: id.filter(|i| valid_job_id(i)),
        error,
    };
    if let Some(h) = header_id {
        if !valid_job_id(h) {
            return Err(reject(None, SubmitError::InvalidId(h.into())));
        }
    }
    if sub.payload.len() > max_bytes {
        return Err(reject(
            id,
            SubmitError::TooLarge {
                size: sub.payload.len(),
                limit: max_bytes,
            },
        ));
    }
    if sub.payload.iter().all(u8::is_ascii_whitespace) {
        return Err(reject(
            id.or_else(|| seq_opt(sub.stream_seq)),
            SubmitError::Empty,
        ));
    }
    let protobuf = sub.content_type.is_some_and(|c| {
        c.eq_ignore_ascii_case("application/protobuf")
            || c.eq_ignore_ascii_case("application/x-protobuf")
    });
    let parsed = if protobuf {
        decode_protobuf(sub.payload)
    } else {
        decode_json(sub.payload)
    };
    let mut spec = match parsed {
        Ok(s) => s,
        Err(e) => return Err(reject(id.or_else(|| seq_opt(sub.stream_seq)), e)),
    };
    if id.is_none() {
        if let Some(sid) = spec.id.as_deref().filter(|s| !s.is_empty()) {
            if !valid_job_id(sid) {
                return Err(reject(None, SubmitError::InvalidId(sid.into())));
            }
            id = Some(sid.to_string());
        }
    }
    let id = id.or_else(|| seq_opt(sub.stream_seq));
    if !kinds.contains(sub.kind) {
        return Err(reject(
            id,
            SubmitError::UnknownKind {
                kind: sub.kind.into(),
                known: kinds.names().join(", "),
            },
        ));
    }
    if let Err(e) = validate(&spec, kinds.validator(sub.kind).expect("checked")) {
        return Err(reject(id, e));
    }
    match due_at(&spec, sub.received_at) {
        Ok(due) => {
            // The accepted spec names the resolved due time alone, so the
            // record (and `status`) says when the job runs, whichever field
            // was given.
            spec.run_at = due.map(rfc3339);
            spec.delay = None;
        }
        Err(e) => return Err(reject(id, e)),
    }
    let Some(id) = id else {
        // Only possible before the ticket is stored (stream_seq 0): the
        // caller learns the sequence from the publish ack.
        return Err(Rejected {
            id: None,
            error: SubmitError::InvalidId(String::new()),
        });
    };
    spec.id = Some(id.clone());
    Ok(Accepted { id, spec })
}

/// The lane a submission's bytes name, as far as they can be read: its
/// tenant and priority when they are valid, else the default lane (a
/// submission that cannot be read is rejected by the worker that takes it,
/// wherever it waits).
pub fn lane_hint(payload: &[u8], content_type: Option<&str>) -> crate::lane::Lane {
    let protobuf = content_type.is_some_and(|c| {
        c.eq_ignore_ascii_case("application/protobuf")
            || c.eq_ignore_ascii_case("application/x-protobuf")
    });
    let (tenant, priority) = if protobuf {
        match JobSpec::decode(payload) {
            Ok(s) => (s.tenant, s.priority),
            Err(_) => (None, None),
        }
    } else {
        #[derive(serde::Deserialize)]
        struct Named {
            tenant: Option<Value>,
            priority: Option<Value>,
        }
        match serde_json::from_slice::<Named>(payload) {
            Ok(n) => (
                n.tenant.and_then(|v| v.as_str().map(str::to_string)),
                n.priority
                    .and_then(|v| v.as_i64())
                    .and_then(|p| i32::try_from(p).ok()),
            ),
            Err(_) => (None, None),
        }
    };
    let lane = crate::lane::Lane {
        tenant: tenant.unwrap_or_else(|| crate::lane::DEFAULT_TENANT.to_string()),
        priority: priority.unwrap_or(crate::lane::DEFAULT_PRIORITY),
    };
    if crate::lane::check_tenant(&lane.tenant).is_ok()
        && crate::lane::check_priority(lane.priority).is_ok()
    {
        lane
    } else {
        crate::lane::Lane::default()
    }
}

/// Checks an accepted spec against the lane of the subject it was published
/// on (the subject decides where it waits, so the two must agree) and
/// names that lane in the spec when it is not the default one, so the
/// record says who the job is for. `subject_hint` is the subject the spec
/// belongs on, for the error.
pub fn check_lane(
    spec: &mut JobSpec,
    subject: &crate::lane::Lane,
    subject_hint: impl FnOnce(&crate::lane::Lane) -> String,
) -> Result<(), SubmitError> {
    // What the spec names must agree; what it leaves out is the subject's.
    let named = crate::lane::Lane {
        tenant: spec
            .tenant
            .clone()
            .unwrap_or_else(|| subject.tenant.clone()),
        priority: spec.priority.unwrap_or(subject.priority),
    };
    if &named != subject {
        return Err(SubmitError::WrongLane {
            subject_hint: subject_hint(&named),
            spec_tenant: named.tenant,
            spec_priority: named.priority,
            subject_tenant: subject.tenant.clone(),
            subject_priority: subject.priority,
        });
    }
    if !subject.is_default() {
        spec.tenant = Some(subject.tenant.clone());
        spec.priority = Some(subject.priority);
    }
    Ok(())
}

/// When a spec's job may run first: its `run_at`, or `delay` after
/// `received_at`; `None` when it names neither (it runs at once). Refuses a
/// malformed value, both fields, a `run_at` more than
/// [`RUN_AT_PAST_TOLERANCE`] before `received_at`, and a due time more than
/// [`MAX_DELAY`] after it.
pub fn due_at(spec: &JobSpec, received_at: SystemTime) -> Result<Option<SystemTime>, SubmitError> {
    let run_at = spec.run_at.as_deref().filter(|s| !s.trim().is_empty());
    let delay = spec.delay.as_deref().filter(|s| !s.trim().is_empty());
    let too_late = |path: &str, ahead: Duration| {
        field(
            path,
            format!(
                "{} ahead is beyond the maximum delay of 366 days",
                format_duration(Duration::from_secs(ahead.as_secs()))
            ),
        )
    };
    match (run_at, delay) {
        (None, None) => Ok(None),
        (Some(_), Some(_)) => Err(field("run_at", "give either run_at or delay, not both")),
        (Some(t), None) => {
            let at = parse_rfc3339(t.trim()).ok_or_else(|| {
                field(
                    "run_at",
                    format!("{t:?} is not an RFC 3339 UTC time like 2026-12-01T16:00:00Z"),
                )
            })?;
            if let Ok(past) = received_at.duration_since(at) {
                if past > RUN_AT_PAST_TOLERANCE {
                    return Err(field(
                        "run_at",
                        format!(
                            "{t} is {} in the past (at most 5m is tolerated, and runs at once)",
                            format_duration(Duration::from_secs(past.as_secs()))
                        ),
                    ));
                }
            }
            match at.duration_since(received_at) {
                Ok(ahead) if ahead > MAX_DELAY => Err(too_late("run_at", ahead)),
                _ => Ok(Some(at)),
            }
        }
        (None, Some(d)) => {
            let d = parse_duration(d).map_err(|e| field("delay", e))?;
            if d > MAX_DELAY {
                return Err(too_late("delay", d));
            }
            Ok(Some(received_at + d))
        }
    }
}

fn seq_opt(seq: u64) -> Option<String> {
    (seq > 0).then(|| seq_id(seq))
}

fn decode_json(payload: &[u8]) -> Result<JobSpec, SubmitError> {
    let text = std::str::from_utf8(payload).map_err(|e| SubmitError::NotUtf8 {
        offset: e.valid_up_to(),
    })?;
    let value: Value =
        serde_json::from_str(text).map_err(|e| SubmitError::NotJson(e.to_string()))?;
    match &value {
        Value::Object(_) => {}
        other => {
            return Err(SubmitError::WrongShape(format!(
                "expected a JSON object like {{\"input\":{{...}}}}, got {}",
                json_type(other)
            )))
        }
    }
    serde_path_to_error::deserialize::<_, JobSpec>(value).map_err(|e| {
        let path = e.path().to_string();
        let message = e.into_inner().to_string();
        if path == "." || path.is_empty() {
            SubmitError::WrongShape(message)
        } else {
            SubmitError::Field { path, message }
        }
    })
}

fn decode_protobuf(payload: &[u8]) -> Result<JobSpec, SubmitError> {
    let spec = JobSpec::decode(payload).map_err(|e| SubmitError::Protobuf(e.to_string()))?;
    for (field, text) in [("input", &spec.input), ("metadata", &spec.metadata)] {
        if !text.is_empty() && serde_json::from_str::<Value>(text).is_err() {
            return Err(SubmitError::Field {
                path: field.into(),
                message: "protobuf field must hold JSON text".into(),
            });
        }
    }
    Ok(spec)
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn field(path: &str, message: impl Into<String>) -> SubmitError {
    SubmitError::Field {
        path: path.into(),
        message: message.into(),
    }
}

fn validate(spec: &JobSpec, kind_check: InputCheck) -> Result<(), SubmitError> {
    let input: Value = if spec.input.is_empty() {
        return Err(field(
            "input",
            "required: a JSON object with the job's input",
        ));
    } else {
        serde_json::from_str(&spec.input).map_err(|e| field("input", e.to_string()))?
    };
    let Value::Object(map) = &input else {
        return Err(field(
            "input",
            format!("expected a JSON object, got {}", json_type(&input)),
        ));
    };
    kind_check(map).map_err(SubmitError::InvalidInput)?;
    if let Some(t) = spec.tenant.as_deref() {
        crate::lane::check_tenant(t).map_err(|m| field("tenant", m))?;
    }
    if let Some(p) = spec.priority {
        crate::lane::check_priority(p).map_err(|m| field("priority", m))?;
    }
    if !spec.metadata.is_empty() {
        let m: Value =
            serde_json::from_str(&spec.metadata).map_err(|e| field("metadata", e.to_string()))?;
        if !m.is_object() {
            return Err(field(
                "metadata",
                format!("expected a JSON object, got {}", json_type(&m)),
            ));
        }
    }
    if let Some(b) = &spec.budget {
        if let Some(s) = b.max_steps {
            if !(1..=100_000).contains(&s) {
                return Err(field(
                    "budget.max_steps",
                    format!("{s} is out of range 1..=100000"),
                ));
            }
        }
        if let Some(t) = b.max_tokens {
            if !(1..=100_000_000).contains(&t) {
                return Err(field(
                    "budget.max_tokens",
                    format!("{t} is out of range 1..=100000000"),
                ));
            }
        }
        if let Some(w) = b.max_wall_s {
            if !(w > 0.0 && w <= 7.0 * 86_400.0) {
                return Err(field(
                    "budget.max_wall_s",
                    format!("{w} is out of range (0, 604800] seconds"),
                ));
            }
        }
        if let Some(c) = b.max_cost_usd {
            if !(c > 0.0 && c <= 10_000.0) {
                return Err(field(
                    "budget.max_cost_usd",
                    format!("{c} is out of range (0, 10000] USD"),
                ));
            }
        }
    }
    if let Some(r) = &spec.retry {
        if let Some(m) = r.max_attempts {
            if !(1..=100).contains(&m) {
                return Err(field(
                    "retry.max_attempts",
                    format!("{m} is out of range 1..=100"),
                ));
            }
        }
        if let (Some(b), Some(c)) = (r.base_ms, r.cap_ms) {
            if b > c {
                return Err(field(
                    "retry.base_ms",
                    format!("{b} is greater than retry.cap_ms {c}"),
                ));
            }
        }
        if let Some(c) = r.cap_ms {
            if c > 86_400_000 {
                return Err(field("retry.cap_ms", format!("{c} is over 24 h")));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
