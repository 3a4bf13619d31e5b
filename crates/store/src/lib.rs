//! The JetStream side of leasehold.
//!
//! Architecture invariant: this is the only crate that knows NATS subjects,
//! streams, buckets and headers. Everything above it speaks in jobs, records,
//! events and tickets.
//!
//! - [`layout`]: the names, derived from the namespace prefix.
//! - [`connect`]: connecting with credentials and TLS from the environment.
//! - [`setup`]: creating and verifying streams, buckets and consumers.
//! - [`jobs`]: the job KV bucket: revision-conditioned reads and writes, the
//!   read-decide-CAS loop, and [`jobs::Gate`], the one door of owner-side writes.
//! - [`events`]: job events, and [`events::Fence`], server-side fenced publication.
//! - [`work`]: work tickets in the work-queue stream.
//! - [`dlq`]: dead letters.
//! - [`sessions`]: worker sessions (liveness with one write per period per process).
//! - [`index`]: the index of active jobs (running by owner, waiting, parked).
//! - [`recovery`]: re-offering the jobs of ended sessions, dead-lettering,
//!   shared by workers and reapers.
//! - [`retention`]: forgetting finished jobs after their retention.
//! - [`history`]: the history of finished jobs, searched a page at a time.
//! - [`effects`]: the effects ledger's bucket below the KV API: writes that
//!   never expire, and a job's keys found and purged by subject.
//! - [`artifacts`]: artifacts created if absent, never overwritten.
//! - [`operate`]: operators' actions shared by the CLI and the console.
//! - [`fleet`]: queue, dead letters, sessions and reapers as the console shows them.
//!
//! Lookups tell *missing* from *unavailable*: a stream, bucket or consumer
//! the server says does not exist is [`StoreError::Missing`] (run `leasehold
//! setup`); any other failure is [`StoreError::Unavailable`] (a leader
//! election, a restarting node), retried at start by [`retry_unavailable`].

pub mod answer;
pub mod artifacts;
pub mod children;
pub mod connect;
pub mod dlq;
pub mod effects;
pub mod events;
pub mod failover;
pub mod flow;
pub mod follow;
pub mod history;
pub mod index;
pub mod jobs;
pub mod layout;
pub mod liveness;
pub mod read;
pub mod recovery;
pub mod retention;
pub mod schedules;
pub mod sessions;
pub mod setup;
pub mod shared;
pub mod signals;
pub mod timers;
pub mod work;

pub use connect::{Conn, NatsArgs};
pub use jobs::{Gate, Jobs, JobsError, Versioned};
pub use layout::Layout;

/// Errors of the store layer outside the job-record path.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("configuration: {0}")]
    Config(String),
    #[error("cannot connect to NATS: {0}")]
    Connect(String),
    #[error("the NATS layout is incomplete, run `leasehold setup`: missing {}", .0.join(", "))]
    Missing(Vec<String>),
    /// The server did not answer a lookup (a leader election, a node
    /// restarting): not a missing layout; try again.
    #[error("NATS JetStream is unavailable ({0}); retrying may help")]
    Unavailable(String),
    /// A bounded stream refused a message at its limit (the work queue is
    /// full): nothing was stored; try again later.
    #[error("the stream is full: {0}")]
    QueueFull(String),
    /// A NATS request failed: what was being done, and the client's or the
    /// server's error as it came (`source`, kept for its kind and code;
    /// none when the store itself found the failure).
    #[error("{context}{}", .source.as_ref().map(|s| format!(": {s}")).unwrap_or_default())]
    Nats {
        context: String,
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
}

impl StoreError {
    /// A failed NATS request while doing `context`, its error kept as the source.
    pub fn nats(context: &str, e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        StoreError::Nats {
            context: context.to_string(),
            source: Some(e.into()),
        }
    }

    /// A job-record error outside the record path: a NATS failure keeps its
    /// source; anything else (a corrupt record) is told in words.
    pub(crate) fn from_jobs(e: JobsError) -> Self {
        match e {
            JobsError::Nats { context, source } => StoreError::Nats {
                context,
                source: Some(source),
            },
            other => StoreError::failed(other.to_string()),
        }
    }

    /// A failure the store found itself (no client error behind it).
    pub fn failed(what: impl Into<String>) -> Self {
        StoreError::Nats {
            context: what.into(),
            source: None,
        }
    }

    /// Worth trying again (the server did not answer, or failed, or a
    /// bounded stream is full for now).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            StoreError::Unavailable(_) | StoreError::Nats { .. } | StoreError::QueueFull(_)
        )
    }
}

/// Whether `err` says a stream, consumer or bucket does not exist (the
/// server's definite answer), as opposed to a failure to answer.
pub fn is_not_found(err: &(dyn std::error::Error + 'static)) -> bool {
    use async_nats::jetstream::ErrorCode;
    matches!(
        answer::answer_of(err),
        answer::Answer::Code(c) if c == ErrorCode::STREAM_NOT_FOUND.0 || c == ErrorCode::CONSUMER_NOT_FOUND.0
    )
}

/// Maps a lookup error of `what` to `Missing` or `Unavailable`.
pub fn lookup_error(what: String, e: &(dyn std::error::Error + 'static)) -> StoreError {
    if is_not_found(e) {
        StoreError::Missing(vec![what])
    } else {
        StoreError::Unavailable(format!("{what}: {e}"))
    }
}

/// Opens a KV bucket, telling a missing bucket from an unavailable server.
pub async fn open_kv(
    conn: &Conn,
    bucket: &str,
) -> Result<async_nats::jetstream::kv::Store, StoreError> {
    conn.js
        .get_key_value(bucket)
        .await
        .map_err(|e| lookup_error(format!("KV bucket {bucket}"), &e))
}

/// Runs `op` until it succeeds, fails with anything but
/// [`StoreError::Unavailable`], or `deadline` passes (then the last
/// error is returned). For start-up lookups during a NATS rolling restart:
/// an unavailable server is waited for, a missing layout stops at once.
pub async fn retry_unavailable<T, F, Fut>(
    what: &str,
    deadline: std::time::Duration,
    mut op: F,
) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let end = tokio::time::Instant::now() + deadline;
    let mut backoff = leasehold_core::retry::Backoff::new(
        std::time::Duration::from_millis(100),
        std::time::Duration::from_secs(2),
    );
    loop {
        let pause = backoff.pause();
        match op().await {
            Err(StoreError::Unavailable(m)) if tokio::time::Instant::now() + pause < end => {
                tracing::warn!(what, error = %m, "NATS unavailable; retrying in {pause:?}");
                tokio::time::sleep(pause).await;
            }
            other => return other,
        }
    }
}

/// The JetStream API error code inside `err`'s source chain, if any.
///
/// async-nats maps only some codes to error kinds; 10164 (a spurious
/// wrong-last-sequence in clusters) arrives as a generic error whose code is
/// only visible here.
pub fn server_error_code(err: &(dyn std::error::Error + 'static)) -> Option<u64> {
    match answer::answer_of(err) {
        answer::Answer::Code(c) => Some(c),
        _ => None,
    }
}

/// A stream at its message limit (discard new): 10077; at its byte limit: 10078.
pub const STREAM_FULL_MSGS: u64 = 10077;
pub const STREAM_FULL_BYTES: u64 = 10078;

/// A publish's ack error as the store says it: a full stream (discard new)
/// is [`StoreError::QueueFull`] (`stream refused the <what>: ...`), nothing
/// kept; anything else the NATS error of `publish <what>`.
pub(crate) fn publish_refused(
    stream: &str,
    what: &str,
    e: async_nats::jetstream::context::PublishError,
) -> StoreError {
    if matches!(
        server_error_code(&e),
        Some(STREAM_FULL_MSGS | STREAM_FULL_BYTES)
    ) {
        StoreError::QueueFull(format!("{stream} refused the {what}: {e}"))
    } else {
        StoreError::nats(&format!("publish {what}"), e)
    }
}

/// No message at that sequence (10037): a deletion of what is gone already.
pub const NO_MESSAGE_FOUND: u64 = 10037;
/// A message deletion the server refused (10057); its description says why.
pub const MSG_DELETE_FAILED: u64 = 10057;

/// Wrong last sequence: a real conflict (10071).
pub const WRONG_LAST_SEQUENCE: u64 = 10071;
/// Wrong last sequence while an earlier write is in process on a cluster
/// leader: spurious, re-read and retry (10164).
pub const WRONG_LAST_SEQUENCE_CONSTANT: u64 = 10164;

/// Whether `err` carries a wrong-last-sequence code, the real one (10071) or
/// the spurious one (10164): a conditioned write that lost to another, or
/// raced one still in process; either way re-read and decide again.
pub fn is_wrong_last_sequence(err: &(dyn std::error::Error + 'static)) -> bool {
    matches!(
        server_error_code(err),
        Some(WRONG_LAST_SEQUENCE | WRONG_LAST_SEQUENCE_CONSTANT)
    )
}

/// The value under `key` of `kv` and its revision, as the bucket's stream
/// leader has it (`None`: no value, or a removal marker). A direct get may
/// be answered by any replica: one still catching up after a restart, or
/// one whose store brought a purged value back (nats-server issue 8505).
/// Every read that decides reads here.
pub(crate) async fn from_leader(
    kv: &async_nats::jetstream::kv::Store,
    key: &str,
) -> Result<Option<(u64, bytes::Bytes)>, async_nats::jetstream::stream::LastRawMessageError> {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    let subject = format!("$KV.{}.{key}", kv.name);
    match kv.stream.get_last_raw_message_by_subject(&subject).await {
        Ok(m) if is_removal(&m.headers) => Ok(None),
        Ok(m) => Ok(Some((m.sequence, m.payload))),
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Whether a KV message's headers mark its key removed: a delete or purge
/// (`KV-Operation`), or a marker the server wrote (`Nats-Marker-Reason`: a
/// per-message TTL ran out, a purge left a marker).
pub(crate) fn is_removal(h: &async_nats::HeaderMap) -> bool {
    h.get("Nats-Marker-Reason").is_some()
        || h.get("KV-Operation")
            .is_some_and(|op| matches!(op.as_str(), "DEL" | "PURGE"))
}

/// Publishes `m` on `subject` and waits for the stream's ack; its sequence.
pub(crate) async fn publish_acked(
    js: &async_nats::jetstream::Context,
    subject: String,
    m: async_nats::jetstream::message::PublishMessage,
) -> Result<u64, async_nats::jetstream::context::PublishError> {
    Ok(js.send_publish(subject, m).await?.await?.sequence)
}

/// Whether a conditioned publish was refused because its subject moved on
/// (the expected last sequence was not the subject's).
pub(crate) fn moved_on(e: &async_nats::jetstream::context::PublishError) -> bool {
    e.kind() == async_nats::jetstream::context::PublishErrorKind::WrongLastSequence
        || server_error_code(e) == Some(WRONG_LAST_SEQUENCE)
}

#[cfg(test)]
mod tests {
    use super::{is_removal, is_wrong_last_sequence};
    use async_nats::HeaderMap;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, *v);
        }
        h
    }

    #[test]
    fn deletes_purges_and_server_markers_are_removals() {
        assert!(is_removal(&headers(&[("KV-Operation", "DEL")])));
        assert!(is_removal(&headers(&[("KV-Operation", "PURGE")])));
        assert!(is_removal(&headers(&[("Nats-Marker-Reason", "MaxAge")])));
        assert!(!is_removal(&headers(&[])));
        assert!(!is_removal(&headers(&[("Nats-TTL", "never")])));
    }

    fn api_error(code: u64) -> async_nats::jetstream::Error {
        serde_json::from_value(serde_json::json!({
            "code": 400,
            "err_code": code,
            "description": "wrong last sequence",
        }))
        .expect("an API error deserializes")
    }

    #[test]
    fn both_wrong_last_sequence_codes_and_only_they_are_conflicts() {
        // 10071 | 10164 is 10231 as a number: a bitwise OR in the pattern
        // would let 10164 through as a plain store error.
        assert!(is_wrong_last_sequence(&api_error(10071)));
        assert!(is_wrong_last_sequence(&api_error(10164)));
        assert!(!is_wrong_last_sequence(&api_error(10071 | 10164)));
        assert!(!is_wrong_last_sequence(&api_error(10077)));
        let io = std::io::Error::other("no code");
        assert!(!is_wrong_last_sequence(&io));
    }
}
