//! Worker sessions: how a worker process proves it is alive, with one write
//! per period for the whole process.
//!
//! A session is one key of the `lh_sessions` bucket, named by the worker id,
//! whose value names the process incarnation (`session`). The worker rewrites
//! it every `renew` interval with a per-message TTL of the session timeout
//! (`Nats-TTL`) and conditioned on the revision it last wrote; when the
//! renewals stop (kill -9, SIGSTOP, partition, node loss) the *server*
//! removes the key after the timeout and leaves a marker there. No two
//! hosts' clocks are ever compared: the server's TTL timer alone decides.
//!
//! A job record names its owner's worker id and session; the job is alive
//! exactly as long as that session is (see [`crate::liveness`]). The
//! markers of ended sessions are read by a durable consumer shared by every
//! worker and reaper (`crate::recovery`), which re-offers the jobs.
//!
//! A process can lose its key while it is alive (the server was down longer
//! than the timeout, or a reaper saw its connection close): its next renewal
//! is refused (wrong last sequence). It then writes the key again under the
//! *same* incarnation, so jobs nobody re-offered stay its own, and re-checks
//! each job it runs (a re-offered job refuses its next write anyway).
//!
//! Each process also answers `lh.workers.<id>.ping` with its incarnation:
//! "no responders" to that request means the process's connection is gone,
//! which a reaper uses to notice a crash long before the TTL runs out.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, kv, message::PublishMessage};
use leasehold_core::time::rfc3339;
use serde::{Deserialize, Serialize};

use crate::{server_error_code, Conn, Layout, StoreError, WRONG_LAST_SEQUENCE};

/// Header carrying the incarnation on every session write, so a
/// headers-only reader knows whose session a message is.
pub const SESSION_HEADER: &str = "Lh-Session";
/// Header set on the first write of an incarnation.
pub const SESSION_START_HEADER: &str = "Lh-Session-Start";
/// Header on the marker of a session a reaper's crash probe ended (value
/// `probe`): the process's connection was seen gone, which a process that
/// is only reconnecting also shows for a moment.
pub const ENDED_BY_HEADER: &str = "Lh-Ended-By";
/// Header on that marker: the ended session's timeout in milliseconds (a
/// process that is only reconnecting is waited for no longer than its
/// session's TTL would have waited).
pub const ENDED_TIMEOUT_HEADER: &str = "Lh-Session-Timeout-Ms";

/// The value of a session key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct SessionInfo {
    pub worker_id: String,
    /// The process incarnation: unique per process, even under a stable id.
    pub session: String,
    pub started_at: String,
    pub renewed_at: String,
    pub host: String,
    pub pid: u32,
    pub kinds: Vec<String>,
    pub version: String,
    /// Session timeout in milliseconds (the TTL of each renewal).
    pub timeout_ms: u64,
    /// Jobs the process runs at once (`--concurrency`); 0 from a worker of
    /// an earlier release, which did not say.
    #[serde(skip_serializing_if = "is_zero")]
    pub slots: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The current state of one worker id's key.
#[derive(Debug, Clone, PartialEq)]
pub enum Current {
    /// A live session.
    Live { info: SessionInfo, revision: u64 },
    /// The key ended (expired, purged or deleted) at this revision;
    /// `by_probe`: the ended session's timeout, when a reaper's crash probe
    /// ended it ([`Sessions::end_by_probe`]), not its TTL or its process.
    Ended {
        revision: u64,
        by_probe: Option<Duration>,
    },
    /// The key never existed (or its marker expired).
    Absent,
}

/// What a ping of a worker process said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ping {
    /// The process answered, naming its incarnation.
    Alive(String),
    /// No process of that id is connected: the server said "no responders".
    NoResponders,
    /// Nobody answered in time (a paused or partitioned process, or a slow one).
    Timeout,
    /// The request could not be made (our own connection is down).
    Failed(String),
}

/// A refused or failed session write.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The key is not at the revision we wrote last: it expired, was
    /// purged, or another process of this identity wrote it.
    #[error("session key changed under us")]
    Changed,
    #[error("session write: {0}")]
    Nats(String),
}

/// The sessions bucket.
#[derive(Clone)]
pub struct Sessions {
    js: jetstream::Context,
    client: async_nats::Client,
    kv: kv::Store,
    layout: Layout,
}

impl Sessions {
    pub async fn open(conn: &Conn) -> Result<Self, StoreError> {
        let bucket = conn.layout.sessions_bucket();
        let kv = crate::open_kv(conn, &bucket).await?;
        Ok(Sessions {
            js: conn.js.clone(),
            client: conn.client.clone(),
            kv,
            layout: conn.layout.clone(),
        })
    }

    /// Follows the live sessions until `shutdown` (a reaper's): every
    /// session in memory, kept by a watch, so a probe or a count reads no
    /// entry ([`crate::follow::follow`]).
    pub fn follow(
        &self,
        link: crate::connect::Link,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> LiveSessions {
        let (state, followed) =
            crate::follow::follow("the sessions", self.kv.clone(), link, shutdown, Live::apply);
        LiveSessions { state, followed }
    }

    pub fn kv(&self) -> &kv::Store {
        &self.kv
    }

    /// The state of `worker_id`'s key, as the stream's leader has it: a
    /// direct get may be answered by a replica still catching up ("no such
    /// key" for a session written a second ago, or an earlier process's
    /// value), and every reader of this decides something.
    pub async fn current(&self, worker_id: &str) -> Result<Current, StoreError> {
        use async_nats::jetstream::stream::LastRawMessageErrorKind;
        let subject = format!("$KV.{}.{worker_id}", self.layout.sessions_bucket());
        let m = match self
            .kv
            .stream
            .get_last_raw_message_by_subject(&subject)
            .await
        {
            Ok(m) => m,
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => {
                return Ok(Current::Absent)
            }
            Err(e) => return Err(StoreError::nats("read session", e)),
        };
        Ok(if crate::is_removal(&m.headers) {
            Current::Ended {
                revision: m.sequence,
                by_probe: m
                    .headers
                    .get(ENDED_BY_HEADER)
                    .filter(|v| v.as_str() == "probe")
                    .map(|_| {
                        m.headers
                            .get(ENDED_TIMEOUT_HEADER)
                            .and_then(|v| v.as_str().parse().ok())
                            .map_or(Duration::MAX, Duration::from_millis)
                    }),
            }
        } else {
            Current::Live {
                info: serde_json::from_slice(&m.payload).unwrap_or_default(),
                revision: m.sequence,
            }
        })
    }

    /// Writes the session key with a TTL of `timeout`, conditioned on the
    /// key's last revision being `expected` (0: no message at all).
    pub async fn write(
        &self,
        info: &SessionInfo,
        timeout: Duration,
        expected: u64,
        start: bool,
    ) -> Result<u64, SessionError> {
        let mut info = info.clone();
        info.renewed_at = rfc3339(SystemTime::now());
        info.timeout_ms = timeout.as_millis() as u64;
        let payload = serde_json::to_vec(&info).expect("session info serializes");
        let mut m = PublishMessage::build()
            .payload(payload.into())
            .header(async_nats::header::NATS_MESSAGE_TTL, ttl_header(timeout))
            .header(SESSION_HEADER, info.session.as_str())
            .expected_last_subject_sequence(expected);
        if start {
            m = m.header(SESSION_START_HEADER, "1");
        }
        let subject = format!("$KV.{}.{}", self.layout.sessions_bucket(), info.worker_id);
        match crate::publish_acked(&self.js, subject, m).await {
            Ok(seq) => Ok(seq),
            Err(e) if crate::moved_on(&e) => Err(SessionError::Changed),
            Err(e) => Err(SessionError::Nats(e.to_string())),
        }
    }

    /// Ends `worker_id`'s session if its key is still at `revision` (a reaper
    /// that saw the process's connection close). The marker this leaves is
    /// handled like an expiry. `false` when the key moved on meanwhile.
    pub async fn end_if(&self, worker_id: &str, revision: u64) -> Result<bool, StoreError> {
        match self
            .kv
            .purge_expect_revision(worker_id, Some(revision))
            .await
        {
            Ok(()) => Ok(true),
            Err(e) if server_error_code(&e) == Some(WRONG_LAST_SEQUENCE) => Ok(false),
            Err(e) => Err(StoreError::nats("end session", e)),
        }
    }

    /// [`Sessions::end_if`] for a reaper's crash probe: the marker says so
    /// ([`ENDED_BY_HEADER`]), so a judge of the end gives a process that is
    /// only reconnecting a settle time to come back ([`crate::liveness`]).
    pub async fn end_by_probe(
        &self,
        worker_id: &str,
        revision: u64,
        timeout: Duration,
    ) -> Result<bool, StoreError> {
        let m = PublishMessage::build()
            .payload(bytes::Bytes::new())
            .header("KV-Operation", "PURGE")
            .header("Nats-Rollup", "sub")
            .header(ENDED_BY_HEADER, "probe")
            .header(
                ENDED_TIMEOUT_HEADER,
                timeout.as_millis().to_string().as_str(),
            )
            .expected_last_subject_sequence(revision);
        let subject = format!("$KV.{}.{worker_id}", self.layout.sessions_bucket());
        match crate::publish_acked(&self.js, subject, m).await {
            Ok(_) => Ok(true),
            Err(e) if crate::moved_on(&e) => Ok(false),
            Err(e) => Err(StoreError::nats("end session", e)),
        }
    }

    /// Asks the process of `worker_id` which session it runs.
    pub async fn ping(&self, worker_id: &str, timeout: Duration) -> Ping {
        let subject = self.layout.worker_subject(worker_id, "ping");
        let req = async_nats::Request::new().timeout(Some(timeout));
        match self.client.send_request(subject, req).await {
            Ok(m) => Ping::Alive(String::from_utf8_lossy(&m.payload).to_string()),
            Err(e) => match e.kind() {
                async_nats::RequestErrorKind::NoResponders => Ping::NoResponders,
                async_nats::RequestErrorKind::TimedOut => Ping::Timeout,
                _ => Ping::Failed(e.to_string()),
            },
        }
    }
}

/// The owner process's own view of its session: when a renewal was last
/// confirmed by the server, on this process's monotonic clock (which keeps
/// counting while the process is stopped). A session not confirmed for
/// `max_age` may already have ended: before a write effect the owner then
/// waits for its next renewal instead of acting.
#[derive(Clone, Debug)]
pub struct SessionClock {
    last_ok: std::sync::Arc<std::sync::Mutex<std::time::Instant>>,
    max_age: Duration,
}

impl SessionClock {
    pub fn new(max_age: Duration) -> Self {
        SessionClock {
            last_ok: std::sync::Arc::new(std::sync::Mutex::new(std::time::Instant::now())),
            max_age,
        }
    }

    /// A renewal was confirmed now.
    pub fn confirm(&self) {
        *self.last_ok.lock().expect("session clock") = std::time::Instant::now();
    }

    /// Time since the last confirmed renewal.
    pub fn age(&self) -> Duration {
        self.last_ok.lock().expect("session clock").elapsed()
    }

    pub fn is_fresh(&self) -> bool {
        self.age() < self.max_age
    }
}

/// What a worker said about one job it supposedly runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runs {
    /// It runs (or is claiming) the job at that epoch.
    Yes,
    /// It does not: the record names it, but nothing runs there.
    No,
    /// No answer of its own (timeout, no responders, or our own connection is down).
    Unknown,
}

impl Sessions {
    /// Asks the process of `worker_id` whether it runs `job` at `epoch`. A
    /// record can name a live session for a job that process does not run
    /// (its claim's reply was lost, an attempt ended without its write):
    /// only the process itself can tell, so only its own answer is a yes or
    /// a no. "No responders" is [`Runs::Unknown`]: a process that is gone is
    /// its session's to recover, all its jobs at once (see `crate::liveness`).
    pub async fn runs(&self, worker_id: &str, job: &str, epoch: u64, timeout: Duration) -> Runs {
        match self.ask_runs(worker_id, job, epoch, timeout).await {
            Ok(m) if &m.payload[..] == b"yes" => Runs::Yes,
            Ok(_) => Runs::No,
            Err(_) => Runs::Unknown,
        }
    }

    async fn ask_runs(
        &self,
        worker_id: &str,
        job: &str,
        epoch: u64,
        timeout: Duration,
    ) -> Result<async_nats::Message, async_nats::RequestError> {
        let subject = self.layout.worker_subject(worker_id, "runs");
        let req = async_nats::Request::new()
            .payload(format!("{job} {epoch}").into())
            .timeout(Some(timeout));
        self.client.send_request(subject, req).await
    }
}

/// The `Nats-TTL` value of a duration (the server takes `1500ms`; at least 1 s).
pub fn ttl_header(d: Duration) -> String {
    format!("{}ms", d.as_millis().max(1000))
}

/// A live session as the watch shows it.
#[derive(Debug, Clone)]
pub struct LiveSession {
    pub worker: String,
    /// The revision of its last renewal.
    pub revision: u64,
    /// Its session timeout.
    pub timeout: Duration,
}

/// The live sessions, by worker id.
#[derive(Default)]
struct Live(HashMap<String, LiveSession>);

impl Live {
    fn apply(&mut self, e: &kv::Entry) {
        if e.operation != kv::Operation::Put {
            self.0.remove(&e.key);
            return;
        }
        let info: SessionInfo = serde_json::from_slice(&e.value).unwrap_or_default();
        let live = LiveSession {
            worker: e.key.clone(),
            revision: e.revision,
            timeout: Duration::from_millis(info.timeout_ms),
        };
        self.0.insert(e.key.clone(), live);
    }
}

/// A live view of the sessions ([`Sessions::follow`]).
#[derive(Clone)]
pub struct LiveSessions {
    state: Arc<Mutex<Live>>,
    followed: crate::follow::Followed,
}

impl LiveSessions {
    /// Every live session; `None` while the view is being read (at its
    /// start, after an error or a reconnect).
    pub fn live(&self) -> Option<Vec<LiveSession>> {
        self.followed
            .read(&self.state, |l| l.0.values().cloned().collect())
    }

    /// How many sessions are live; `None` while the view is being read.
    pub fn count(&self) -> Option<u64> {
        self.followed.read(&self.state, |l| l.0.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_is_written_in_milliseconds_and_never_below_a_second() {
        assert_eq!(ttl_header(Duration::from_secs(10)), "10000ms");
        assert_eq!(ttl_header(Duration::from_millis(2500)), "2500ms");
        assert_eq!(ttl_header(Duration::from_millis(10)), "1000ms");
    }
}
