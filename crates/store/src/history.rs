//! The history of finished jobs: one entry per job end on `LH_HISTORY`,
//! searched a page at a time without reading every record.
//!
//! An entry is written by the reapers' historian after the job's terminal
//! event (`completed`, `failed`, `cancelled`, `dead`, `rejected`), on
//! `lh.history.<status>.<kind>.<tenant>.<class>` (each token made
//! subject-safe by [`token`]; `class` is `none` when the job has no error
//! class), with `Nats-Msg-Id` = job, epoch and status, so a retried or
//! doubled write lands once, and `Nats-TTL` = its job's retention, so the
//! history forgets what retention forgot.
//!
//! A search is a subject filter (the fields not given are wildcards), a
//! start (a sequence cursor, or the start time), a stop time, and a page:
//! - the count comes from the server's pending counts of ordered consumers
//!   for the filter (from the start, minus from `until`), reading no message;
//! - the page reads the filter's messages from the start until `limit`
//!   entries matched, `until` passed, or [`SCAN_MAX`] messages were read
//!   (only an id prefix filters what is read: then the count is an upper
//!   bound, and a page cut by the scan bound says more may match).
//!
//! Entries come in the order they were recorded (oldest first); the time
//! range is the time each entry was recorded, within about a second of the
//! job's end.

use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use leasehold_core::time::{parse_duration, parse_rfc3339, rfc3339};
use leasehold_proto::{JobEvent, JobRecord};
use serde::{Deserialize, Serialize};

use crate::retention::TERMINAL_EVENTS;
use crate::{Conn, Layout, StoreError};

/// A page holds this many entries unless asked otherwise.
pub const DEFAULT_LIMIT: usize = 50;
/// The largest page.
pub const MAX_LIMIT: usize = 1000;
/// Messages one page reads at most when an id prefix filters them.
pub const SCAN_MAX: u64 = 2_000;
/// The longest a search waits for the server.
const SEARCH_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest message an entry keeps.
const MESSAGE_MAX: usize = 200;

/// One finished job as the history keeps it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub id: String,
    pub kind: String,
    pub tenant: String,
    pub status: String,
    /// The error class (empty when none).
    #[serde(default)]
    pub class: String,
    /// The error message, shortened.
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub created_at: String,
    pub ended_at: String,
    #[serde(default)]
    pub attempts: u32,
    #[serde(default)]
    pub epoch: u64,
}

impl Entry {
    /// The entry of the end `ev` (a terminal event), its fields from the
    /// job's record when it is still there, else from the event.
    pub fn of(ev: &JobEvent, rec: Option<&JobRecord>) -> Entry {
        let data: serde_json::Value = serde_json::from_str(&ev.data).unwrap_or_default();
        let text = |k: &str| data.get(k).and_then(|v| v.as_str()).unwrap_or_default();
        let error = rec.and_then(|r| r.error.as_ref());
        let ended_badly = ev.r#type != "completed" && ev.r#type != "cancelled";
        let (class, message) = match error {
            Some(e) if ended_badly => (e.class.clone(), e.message.clone()),
            _ if ended_badly => (
                text("class").to_string(),
                [text("message"), text("reason")].concat(),
            ),
            _ => (String::new(), String::new()),
        };
        Entry {
            id: ev.job_id.clone(),
            kind: rec.map_or_else(|| text("kind").to_string(), |r| r.kind.clone()),
            tenant: rec
                .and_then(|r| r.spec.as_ref())
                .and_then(|s| s.tenant.clone())
                .filter(|t| !t.is_empty())
                .unwrap_or_else(|| leasehold_core::lane::DEFAULT_TENANT.to_string()),
            status: ev.r#type.clone(),
            class,
            message: message.chars().take(MESSAGE_MAX).collect(),
            created_at: rec.map(|r| r.created_at.clone()).unwrap_or_default(),
            ended_at: ev.at.clone(),
            attempts: rec.map_or_else(
                || data.get("attempts").and_then(|v| v.as_u64()).unwrap_or(0) as u32,
                |r| r.attempts,
            ),
            epoch: ev.epoch,
        }
    }

    /// Its subject: `lh.history.<status>.<kind>.<tenant>.<class>`.
    pub fn subject(&self, l: &Layout) -> String {
        l.history_subject(
            &token(&self.status),
            &token(&self.kind),
            &token(&self.tenant),
            &class_token(&self.class),
        )
    }

    /// Written once per end: job, epoch and status.
    pub fn msg_id(&self) -> String {
        format!("{}:{}:{}", self.id, self.epoch, self.status)
    }
}

/// A subject token of `s`: letters, digits, `-`, `_` and `=` kept, anything
/// else `_` (an entry's own fields are compared too, so two values made
/// alike never mix in a search).
pub fn token(s: &str) -> String {
    if s.is_empty() {
        return "_".into();
    }
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '=') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The class token: `none` when there is no class.
pub fn class_token(class: &str) -> String {
    if class.is_empty() {
        "none".into()
    } else {
        token(class)
    }
}

/// A search as typed (the CLI's flags, the console's form): every field
/// optional text, checked by [`Query::parse`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueryText {
    pub status: Option<String>,
    pub kind: Option<String>,
    pub tenant: Option<String>,
    pub class: Option<String>,
    pub since: Option<String>,
    pub until: Option<String>,
    pub id_prefix: Option<String>,
    pub limit: Option<String>,
    pub after: Option<String>,
}

/// A checked search.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    /// One finished status, or any.
    pub status: Option<String>,
    pub kind: Option<String>,
    pub tenant: Option<String>,
    /// An error class; `none`: jobs without one.
    pub class: Option<String>,
    pub since: Option<SystemTime>,
    pub until: Option<SystemTime>,
    pub id_prefix: Option<String>,
    pub limit: usize,
    /// Continue after this history sequence (the previous page's cursor).
    pub after: Option<u64>,
}

impl Default for Query {
    fn default() -> Self {
        Query {
            status: None,
            kind: None,
            tenant: None,
            class: None,
            since: None,
            until: None,
            id_prefix: None,
            limit: DEFAULT_LIMIT,
            after: None,
        }
    }
}

/// Blank text is no value.
fn given(v: &Option<String>) -> Option<String> {
    v.as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
}

/// A time of a search: RFC 3339 (`2026-12-01T10:00:00Z`), a date and
/// time in UTC without zone (`2026-12-01T10:00`, what a browser's
/// date-time field sends), a date (`2026-12-01`, midnight UTC), or a
/// duration ago (`2h`, `7d`).
pub fn parse_time(field: &str, s: &str, now: SystemTime) -> Result<SystemTime, String> {
    let s = s.trim();
    if s.starts_with(|c: char| c.is_ascii_digit()) && !s.contains('-') {
        let ago = parse_duration(s).map_err(|e| format!("{field}: {e}"))?;
        return now
            .checked_sub(ago)
            .ok_or_else(|| format!("{field}: {s} ago is before 1970"));
    }
    let zoned = s.ends_with(['Z', 'z']) || s.get(10..).is_some_and(|t| t.contains('+'));
    let full = match s.len() {
        10 => format!("{s}T00:00:00Z"),
        16 => format!("{s}:00Z"),
        _ if !zoned => format!("{s}Z"),
        _ => s.to_string(),
    };
    parse_rfc3339(&full).ok_or_else(|| {
        format!(
            "{field}: {s:?} is not a time; write 2026-12-01T10:00:00Z, 2026-12-01T10:00 (UTC), 2026-12-01, or a duration ago like 2h or 7d"
        )
    })
}

impl Query {
    /// Checks every field; the error names the field and what it takes.
    pub fn parse(t: &QueryText, now: SystemTime) -> Result<Query, String> {
        let status = given(&t.status).map(|s| s.to_ascii_lowercase());
        if let Some(s) = status.as_deref().filter(|s| !TERMINAL_EVENTS.contains(s)) {
            return Err(format!(
                "status: {s:?} is not a finished status; use one of {}",
                TERMINAL_EVENTS.join(", ")
            ));
        }
        let since = match given(&t.since) {
            Some(s) => Some(parse_time("since", &s, now)?),
            None => None,
        };
        let until = match given(&t.until) {
            Some(s) => Some(parse_time("until", &s, now)?),
            None => None,
        };
        if let (Some(a), Some(b)) = (since, until) {
            if b <= a {
                return Err(format!(
                    "until ({}) must be after since ({})",
                    rfc3339(b),
                    rfc3339(a)
                ));
            }
        }
        let limit = match given(&t.limit) {
            None => DEFAULT_LIMIT,
            Some(l) => match l.parse::<usize>() {
                Ok(n) if (1..=MAX_LIMIT).contains(&n) => n,
                _ => {
                    return Err(format!(
                        "limit: {l:?} is not a number from 1 to {MAX_LIMIT}"
                    ))
                }
            },
        };
        let after = match given(&t.after) {
            None => None,
            Some(a) => Some(a.parse::<u64>().map_err(|_| {
                format!("after: {a:?} is not a cursor (the number a previous page gave)")
            })?),
        };
        Ok(Query {
            status,
            kind: given(&t.kind),
            tenant: given(&t.tenant),
            class: given(&t.class),
            since,
            until,
            id_prefix: given(&t.id_prefix),
            limit,
            after,
        })
    }

    /// The subject filter: the fields given, wildcards for the others.
    pub fn filter(&self, l: &Layout) -> String {
        let t = |v: &Option<String>| v.as_deref().map_or("*".to_string(), token);
        l.history_subject(
            &t(&self.status),
            &t(&self.kind),
            &t(&self.tenant),
            &self.class.as_deref().map_or("*".to_string(), |c| match c {
                "none" => "none".into(),
                c => class_token(c),
            }),
        )
    }

    /// Whether an entry read under the filter is one the query asks for
    /// (its own fields, not their subject tokens, and the id prefix).
    pub fn matches(&self, e: &Entry) -> bool {
        let eq = |q: &Option<String>, v: &str| q.as_deref().is_none_or(|q| q == v);
        eq(&self.status, &e.status)
            && eq(&self.kind, &e.kind)
            && eq(&self.tenant, &e.tenant)
            && self
                .class
                .as_deref()
                .is_none_or(|c| c == e.class || (c == "none" && e.class.is_empty()))
            && self
                .id_prefix
                .as_deref()
                .is_none_or(|p| e.id.starts_with(p))
    }
}

/// One page of a search.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Page {
    /// `(history sequence, entry)`, oldest first.
    pub entries: Vec<(u64, Entry)>,
    /// How many entries the filter and the time range match (from the
    /// server's counts, no message read).
    pub matched: u64,
    /// `matched` counts entries the id prefix may leave out: an upper bound.
    pub matched_is_upper_bound: bool,
    /// Where the next page starts (`--after`), when more may follow.
    pub next: Option<u64>,
    /// Messages this page read.
    pub scanned: u64,
    /// The page stopped at [`SCAN_MAX`] messages read: more may match.
    pub scan_cut: bool,
}

/// The history stream.
async fn stream(conn: &Conn) -> Result<jetstream::stream::Stream<()>, StoreError> {
    let name = conn.layout.history_stream();
    conn.js
        .get_stream_no_info(&name)
        .await
        .map_err(|e| crate::lookup_error(format!("stream {name}"), &e))
}

/// Records `e` (once: the stream dedupes its id) living `ttl` (`None`: as
/// long as the stream's bounds keep it); its sequence.
pub async fn record(conn: &Conn, e: &Entry, ttl: Option<Duration>) -> Result<u64, StoreError> {
    let body = serde_json::to_vec(e).map_err(|x| StoreError::nats("encode history entry", x))?;
    let mut m = jetstream::message::PublishMessage::build()
        .payload(body.into())
        .message_id(e.msg_id());
    if let Some(ttl) = ttl.filter(|t| !t.is_zero()) {
        m = m.header("Nats-TTL", crate::sessions::ttl_header(ttl).as_str());
    }
    crate::publish_acked(&conn.js, e.subject(&conn.layout), m)
        .await
        .map_err(|x| StoreError::nats("record history entry", x))
}

/// The historian's durable consumer of the terminal events on the event
/// stream, shared by every reaper (each end handled by one at a time),
/// created at its first start, from the start of the stream (what
/// retention kept is recorded too).
pub async fn historian_consumer(conn: &Conn) -> Result<consumer::PullConsumer, StoreError> {
    let l = &conn.layout;
    let events = conn
        .js
        .get_stream_no_info(l.events_stream())
        .await
        .map_err(|e| crate::lookup_error(format!("stream {}", l.events_stream()), &e))?;
    let name = l.historian_consumer();
    events
        .get_or_create_consumer(
            &name,
            consumer::pull::Config {
                durable_name: Some(name.clone()),
                description: Some("leasehold reapers: the history of finished jobs".into()),
                filter_subjects: TERMINAL_EVENTS
                    .iter()
                    .map(|t| l.event_subject("*", t))
                    .collect(),
                ack_policy: consumer::AckPolicy::Explicit,
                // Within the history's dedupe window (2 min): a redelivery
                // after a crash lands on the first write.
                ack_wait: Duration::from_secs(10),
                max_ack_pending: 1000,
                deliver_policy: consumer::DeliverPolicy::All,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| StoreError::nats(&format!("consumer {name}"), e))
}

/// Records the end that the terminal event `payload` tells, its fields
/// from the job's record when it still holds that end (same epoch), living
/// `ttl` (the job's retention). Idempotent. `None`: the event does not
/// decode, there is nothing to record.
pub async fn note_end(
    conn: &Conn,
    jobs: &crate::Jobs,
    payload: &[u8],
    ttl: Option<Duration>,
) -> Result<Option<Entry>, StoreError> {
    let Ok(ev) = serde_json::from_slice::<JobEvent>(payload) else {
        return Ok(None);
    };
    let rec = match jobs.get(&ev.job_id).await {
        Ok(v) => v.map(|v| v.value),
        Err(crate::JobsError::Corrupt { .. }) => None,
        Err(e) => return Err(StoreError::nats(&format!("read job {}", ev.job_id), e)),
    };
    // A record that moved on (replayed since) still names the job's kind,
    // tenant and submission; its error is another end's.
    let rec = rec.map(|mut r| {
        if r.epoch != ev.epoch {
            r.error = None;
        }
        r
    });
    let entry = Entry::of(&ev, rec.as_ref());
    record(conn, &entry, ttl).await?;
    Ok(Some(entry))
}

/// The ordered consumer of `filter` from `start`, and its pending count.
async fn reader(
    s: &jetstream::stream::Stream<()>,
    filter: &str,
    start: consumer::DeliverPolicy,
) -> Result<(consumer::Consumer<consumer::pull::OrderedConfig>, u64), StoreError> {
    let c = s
        .create_consumer(consumer::pull::OrderedConfig {
            filter_subject: filter.to_string(),
            deliver_policy: start,
            ..Default::default()
        })
        .await
        .map_err(|e| StoreError::nats("history search", e))?;
    let pending = c.cached_info().num_pending;
    Ok((c, pending))
}

/// Where a count or a page starts.
fn start_of(
    after: Option<u64>,
    since: Option<SystemTime>,
) -> Result<consumer::DeliverPolicy, StoreError> {
    match (after, since) {
        (Some(seq), _) => Ok(consumer::DeliverPolicy::ByStartSequence {
            start_sequence: seq + 1,
        }),
        (None, Some(t)) => Ok(consumer::DeliverPolicy::ByStartTime {
            start_time: offset(t)?,
        }),
        (None, None) => Ok(consumer::DeliverPolicy::All),
    }
}

fn offset(t: SystemTime) -> Result<time::OffsetDateTime, StoreError> {
    let d = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_err(|_| StoreError::Config("a time before 1970".into()))?;
    time::OffsetDateTime::from_unix_timestamp_nanos(d.as_nanos() as i128)
        .map_err(|e| StoreError::Config(format!("time out of range: {e}")))
}

/// Entries the filter holds from `start` recorded before `until`
/// (`pending_from`: the count from `start`, known already).
async fn count(
    s: &jetstream::stream::Stream<()>,
    filter: &str,
    pending_from: u64,
    until: Option<SystemTime>,
) -> Result<u64, StoreError> {
    let Some(until) = until else {
        return Ok(pending_from);
    };
    let (_, after_until) = reader(
        s,
        filter,
        consumer::DeliverPolicy::ByStartTime {
            start_time: offset(until)?,
        },
    )
    .await?;
    Ok(pending_from.saturating_sub(after_until))
}

/// One page of `q`.
pub async fn search(conn: &Conn, q: &Query) -> Result<Page, StoreError> {
    tokio::time::timeout(SEARCH_TIMEOUT, search_inner(conn, q))
        .await
        .map_err(|_| StoreError::Unavailable("history search timed out".into()))?
}

async fn search_inner(conn: &Conn, q: &Query) -> Result<Page, StoreError> {
    let s = stream(conn).await?;
    let filter = q.filter(&conn.layout);
    let (c, pending) = reader(&s, &filter, start_of(q.after, q.since)?).await?;
    // The count covers the whole range, whichever page this is.
    let from_start = match q.after {
        None => pending,
        Some(_) => reader(&s, &filter, start_of(None, q.since)?).await?.1,
    };
    let matched = count(&s, &filter, from_start, q.until).await?;
    let mut page = Page {
        matched,
        matched_is_upper_bound: q.id_prefix.is_some(),
        ..Default::default()
    };
    if pending == 0 || matched == 0 {
        return Ok(page);
    }
    read_page(c, q, &mut page).await?;
    Ok(page)
}

/// Reads the page's entries from the reader `c`.
async fn read_page(
    c: consumer::Consumer<consumer::pull::OrderedConfig>,
    q: &Query,
    page: &mut Page,
) -> Result<(), StoreError> {
    let until = q.until.map(offset).transpose()?;
    let mut msgs = c
        .messages()
        .await
        .map_err(|e| StoreError::nats("history search", e))?;
    while let Some(m) = msgs.next().await {
        let m = m.map_err(|e| StoreError::nats("history search", e))?;
        let info = m
            .info()
            .map_err(|e| StoreError::nats("history message", e))?;
        let (seq, left, at) = (info.stream_sequence, info.pending, info.published);
        if until.is_some_and(|u| at >= u) {
            return Ok(());
        }
        page.scanned += 1;
        if let Ok(e) = serde_json::from_slice::<Entry>(&m.payload) {
            if q.matches(&e) {
                page.entries.push((seq, e));
            }
        }
        if left == 0 {
            return Ok(());
        }
        if page.entries.len() == q.limit {
            page.next = Some(seq);
            return Ok(());
        }
        if q.id_prefix.is_some() && page.scanned >= SCAN_MAX {
            page.next = Some(seq);
            page.scan_cut = true;
            return Ok(());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> SystemTime {
        parse_rfc3339("2026-12-08T12:00:00Z").unwrap()
    }

    #[test]
    fn tokens_are_subject_safe_and_classes_say_none() {
        assert_eq!(token("acme"), "acme");
        assert_eq!(token("a.b c*>"), "a_b_c__");
        assert_eq!(token(""), "_");
        assert_eq!(class_token(""), "none");
        assert_eq!(class_token("model.timeout"), "model_timeout");
    }

    #[test]
    fn queries_become_subject_filters_with_wildcards() {
        let l = Layout::new("lh").unwrap();
        let q = Query::parse(
            &QueryText {
                status: Some("Failed".into()),
                tenant: Some("acme".into()),
                ..Default::default()
            },
            now(),
        )
        .unwrap();
        assert_eq!(q.filter(&l), "lh.history.failed.*.acme.*");
        assert_eq!(Query::default().filter(&l), "lh.history.*.*.*.*");
        let q = Query {
            class: Some("none".into()),
            kind: Some("echo".into()),
            ..Default::default()
        };
        assert_eq!(q.filter(&l), "lh.history.*.echo.*.none");
        let e = Entry {
            id: "j1".into(),
            kind: "echo".into(),
            tenant: "acme".into(),
            status: "failed".into(),
            ..Default::default()
        };
        assert_eq!(e.subject(&l), "lh.history.failed.echo.acme.none");
        assert_eq!(e.msg_id(), "j1:0:failed");
    }

    #[test]
    fn times_are_rfc3339_browser_dates_or_durations_ago() {
        let t = |s| parse_time("since", s, now());
        assert_eq!(t("2h").unwrap(), now() - Duration::from_secs(7200));
        assert_eq!(t("7d").unwrap(), now() - Duration::from_secs(7 * 86_400));
        assert_eq!(
            t("2026-12-01T10:00").unwrap(),
            parse_rfc3339("2026-12-01T10:00:00Z").unwrap()
        );
        assert_eq!(
            t("2026-12-01").unwrap(),
            parse_rfc3339("2026-12-01T00:00:00Z").unwrap()
        );
        assert!(t("2026-12-01T10:00:00.5Z").is_ok());
        assert_eq!(
            t("2026-12-01T10:00:05.250").unwrap(),
            parse_rfc3339("2026-12-01T10:00:05.250Z").unwrap()
        );
        let e = t("last tuesday").unwrap_err();
        assert!(
            e.starts_with("since:") && e.contains("2026-12-01T10:00"),
            "{e}"
        );
        assert!(t("5").unwrap_err().contains("no unit"));
    }

    #[test]
    fn every_field_is_checked_with_a_clear_error() {
        let p = |t: QueryText| Query::parse(&t, now());
        let e = p(QueryText {
            status: Some("running".into()),
            ..Default::default()
        })
        .unwrap_err();
        assert!(
            e.contains("not a finished status") && e.contains("completed"),
            "{e}"
        );
        for l in ["0", "1001", "x"] {
            let e = p(QueryText {
                limit: Some(l.into()),
                ..Default::default()
            })
            .unwrap_err();
            assert!(e.contains("from 1 to 1000"), "{e}");
        }
        let e = p(QueryText {
            since: Some("1h".into()),
            until: Some("2h".into()),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.contains("must be after"), "{e}");
        let e = p(QueryText {
            after: Some("abc".into()),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.contains("cursor"), "{e}");
        let q = p(QueryText {
            kind: Some("  ".into()),
            limit: Some("7".into()),
            after: Some("42".into()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!((q.kind, q.limit, q.after), (None, 7, Some(42)));
    }

    #[test]
    fn entries_match_on_their_own_fields_and_the_id_prefix() {
        let e = Entry {
            id: "inv-2026-1".into(),
            kind: "echo".into(),
            tenant: "a.b".into(),
            status: "failed".into(),
            class: "".into(),
            ..Default::default()
        };
        let q = |f: fn(&mut Query)| {
            let mut q = Query::default();
            f(&mut q);
            q.matches(&e)
        };
        assert!(q(|q| q.tenant = Some("a.b".into())));
        assert!(
            !q(|q| q.tenant = Some("a_b".into())),
            "same token, other tenant"
        );
        assert!(q(|q| q.class = Some("none".into())));
        assert!(q(|q| q.id_prefix = Some("inv-".into())));
        assert!(!q(|q| q.id_prefix = Some("x".into())));
    }

    #[test]
    fn an_entry_takes_the_record_fields_and_the_event_time() {
        let ev = JobEvent {
            job_id: "j".into(),
            epoch: 3,
            at: "2026-12-08T11:00:00.000Z".into(),
            r#type: "failed".into(),
            worker_id: None,
            data: r#"{"class":"bad_input","message":"nope","attempts":2,"kind":"echo"}"#.into(),
        };
        let from_event = Entry::of(&ev, None);
        assert_eq!(
            (
                from_event.kind.as_str(),
                from_event.class.as_str(),
                from_event.attempts
            ),
            ("echo", "bad_input", 2)
        );
        assert_eq!(from_event.tenant, "default");
        let rec = JobRecord {
            id: "j".into(),
            kind: "echo".into(),
            attempts: 3,
            created_at: "2026-12-08T10:00:00.000Z".into(),
            error: Some(leasehold_proto::JobError {
                class: "timeout".into(),
                message: "x".repeat(500),
                ..Default::default()
            }),
            spec: Some(leasehold_proto::JobSpec {
                tenant: Some("acme".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let e = Entry::of(&ev, Some(&rec));
        assert_eq!((e.tenant.as_str(), e.class.as_str()), ("acme", "timeout"));
        assert_eq!((e.attempts, e.epoch), (3, 3));
        assert_eq!(e.message.len(), MESSAGE_MAX);
        assert_eq!(e.ended_at, ev.at);
        assert_eq!(e.created_at, rec.created_at);
    }
}
