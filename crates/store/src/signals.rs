//! Signals: named messages sent to a job, which a waiting step takes.
//!
//! A signal `name` for job `id` is one message on `lh.signal.<id>.<name>`
//! in the stream `LH_SIGNALS`, its payload the signal's data (JSON). The
//! stream keeps it whatever the job does meanwhile, so a signal sent before
//! the job waits is there when it does, and two signals of one name are two
//! messages, taken in their order. A job's run takes them by stream
//! sequence: its `n`-th wait for `name` takes the first signal of that name
//! newer than the one its previous wait took (the sequence it recorded).
//! Retention removes a finished job's signals with it.
//!
//! Waking: every worker and reaper shares the durable consumer
//! `lh_signal_wakes`; each new signal is looked at once ([`run`]), and its
//! job woken through [`crate::timers::wake`] (ticket first) if the record
//! waits for it. A signal sent after the job's step looked but before the
//! record said `waiting` finds the job running and is acked; the owner's
//! end looks once more after its write (`Step::Recheck`), and a kept
//! ticket's claim looks too, so no signal is slept through.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, AckKind};
use leasehold_core::machine;
use leasehold_core::JobRecord;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::recovery::Recovery;
use crate::{Conn, Layout, StoreError};

/// One signal, as a waiting step takes it (and records it as its step's
/// result: this is its JSON form, in every language).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Signal {
    /// The signal's name.
    pub name: String,
    /// Its data: the payload as JSON (an empty payload is `{}`; a payload
    /// that is not JSON is its text, as a JSON string).
    pub data: Value,
    /// Its stream sequence: signals of one name are taken in this order,
    /// each once.
    pub seq: u64,
    /// When the stream stored it (RFC 3339, the server's clock).
    pub sent_at: String,
    /// Who sent it, as the sender said (`Lh-Sender`: `ana via console`,
    /// `ana via cli`); `None` for a signal published without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender: Option<String>,
}

/// The signal name of a person's answer to a park (leasehold's own:
/// `review resume --answer` and the console send it, with the person as
/// its sender; data `{"step", "parked_seq", "answer"}`: the park it
/// answers, by its step and its `parked` event's sequence).
pub const ANSWER: &str = "lh-answer";

/// The header naming a signal's sender.
pub const SENDER_HEADER: &str = "Lh-Sender";

/// What [`Signals::send`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sent {
    /// The signal's stream sequence.
    pub seq: u64,
    /// A send with the same dedupe id within the stream's window (an hour)
    /// stored it already: this one stored nothing.
    pub duplicate: bool,
}

/// The signal stream of one layout.
#[derive(Clone)]
pub struct Signals {
    js: jetstream::Context,
    layout: Layout,
}

impl Signals {
    pub fn new(conn: &Conn) -> Signals {
        Signals {
            js: conn.js.clone(),
            layout: conn.layout.clone(),
        }
    }

    /// Stores signal `name` for job `job` with `data`, from `sender`;
    /// `dedupe` (the stream's `Nats-Msg-Id`) makes a send tried again
    /// store it once. A full stream refuses it ([`StoreError::QueueFull`]):
    /// nothing kept.
    pub async fn send(
        &self,
        job: &str,
        name: &str,
        data: &Value,
        dedupe: Option<&str>,
        sender: Option<&str>,
    ) -> Result<Sent, StoreError> {
        let mut m = jetstream::message::PublishMessage::build()
            .payload(serde_json::to_vec(data).expect("JSON serializes").into());
        if let Some(id) = dedupe {
            m = m.message_id(id);
        }
        if let Some(who) = sender {
            m = m.header(SENDER_HEADER, who);
        }
        let ack = self
            .js
            .send_publish(self.layout.signal_subject(job, name), m)
            .await
            .map_err(|e| StoreError::nats("publish signal", e))?
            .await
            .map_err(|e| crate::publish_refused(&self.layout.signals_stream(), "signal", e))?;
        Ok(Sent {
            seq: ack.sequence,
            duplicate: ack.duplicate,
        })
    }

    /// The first signal `name` of job `job` newer than sequence `after`, if
    /// one was sent. Read from the stream's leader: a replica that lags
    /// must not hide a signal sent a moment ago.
    pub async fn next(
        &self,
        job: &str,
        name: &str,
        after: u64,
    ) -> Result<Option<Signal>, StoreError> {
        let stream = self
            .js
            .get_stream_no_info(self.layout.signals_stream())
            .await
            .map_err(|e| StoreError::nats("signal stream", e))?;
        let got = stream
            .raw_message_builder()
            .sequence(after + 1)
            .next_by_subject(self.layout.signal_subject(job, name))
            .send()
            .await;
        match got {
            Ok(m) => Ok(Some(signal_of(&self.layout, &m))),
            Err(e) if e.kind() == jetstream::stream::LastRawMessageErrorKind::NoMessageFound => {
                Ok(None)
            }
            Err(e) => Err(StoreError::nats("read signal", e)),
        }
    }

    /// Every signal sent to job `job` that is still kept, in the order
    /// sent, at most `limit`. One message get per signal, read from the
    /// stream's leader; no consumer.
    pub async fn list(&self, job: &str, limit: usize) -> Result<Vec<Signal>, StoreError> {
        let stream = self
            .js
            .get_stream_no_info(self.layout.signals_stream())
            .await
            .map_err(|e| StoreError::nats("signal stream", e))?;
        let filter = self.layout.job_signals_filter(job);
        let mut out = Vec::new();
        let mut from = 1;
        while out.len() < limit {
            let got = stream
                .raw_message_builder()
                .sequence(from)
                .next_by_subject(filter.clone())
                .send()
                .await;
            let m = match got {
                Ok(m) => m,
                Err(e)
                    if e.kind() == jetstream::stream::LastRawMessageErrorKind::NoMessageFound =>
                {
                    break
                }
                Err(e) => return Err(StoreError::nats("read signals", e)),
            };
            from = m.sequence + 1;
            out.push(signal_of(&self.layout, &m));
        }
        Ok(out)
    }

    /// How many signals `name` job `job` has kept (one stream-info request
    /// with the signal's subject as its filter, answered by the leader).
    pub async fn count(&self, job: &str, name: &str) -> Result<u64, StoreError> {
        use futures::TryStreamExt;
        let stream = self
            .js
            .get_stream_no_info(self.layout.signals_stream())
            .await
            .map_err(|e| StoreError::nats("signal stream", e))?;
        let subject = self.layout.signal_subject(job, name);
        let mut subjects = stream
            .info_with_subjects(&subject)
            .await
            .map_err(|e| StoreError::nats("count signals", e))?;
        let mut n = 0;
        while let Some((s, count)) = subjects
            .try_next()
            .await
            .map_err(|e| StoreError::nats("count signals", e))?
        {
            if s == subject {
                n += count as u64;
            }
        }
        Ok(n)
    }

    /// Every signal `name` job `job` has kept, in the order sent: one
    /// bounded read of the stream (an ephemeral consumer on the subject),
    /// whatever their number.
    pub async fn all(&self, job: &str, name: &str) -> Result<Vec<Signal>, StoreError> {
        let what = format!("signals {name} of {job}");
        self.kept(self.layout.signal_subject(job, name), 0, &what)
            .await
    }

    /// Every signal of any name job `job` has kept past sequence `after`,
    /// in the order sent: one bounded read of the stream.
    pub async fn kept_after(&self, job: &str, after: u64) -> Result<Vec<Signal>, StoreError> {
        let what = format!("signals of {job}");
        self.kept(self.layout.job_signals_filter(job), after, &what)
            .await
    }

    /// The signals kept under `filter` past sequence `after`.
    async fn kept(
        &self,
        filter: String,
        after: u64,
        what: &str,
    ) -> Result<Vec<Signal>, StoreError> {
        let stream = self
            .js
            .get_stream_no_info(self.layout.signals_stream())
            .await
            .map_err(|e| StoreError::nats("signal stream", e))?;
        let msgs = crate::read::read_once(
            &stream,
            vec![filter],
            jetstream::consumer::DeliverPolicy::ByStartSequence {
                start_sequence: after + 1,
            },
            what,
        )
        .await?;
        let name = |m: &jetstream::Message| {
            self.layout
                .of_signal_subject(&m.subject)
                .map_or(String::new(), |(_, n)| n.to_string())
        };
        Ok(msgs.iter().map(|m| consumed(&name(m), m)).collect())
    }

    /// Every signal sent to job `job` (any name, a child's end too), in
    /// the order sent: the kept ones, then new ones as they land (an
    /// ordered consumer: the clients' stream of the job).
    pub async fn follow(
        &self,
        job: &str,
    ) -> Result<futures::stream::BoxStream<'static, Result<Signal, StoreError>>, StoreError> {
        use futures::StreamExt;
        let stream = self
            .js
            .get_stream_no_info(self.layout.signals_stream())
            .await
            .map_err(|e| StoreError::nats("signal stream", e))?;
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                filter_subjects: vec![self.layout.job_signals_filter(job)],
                ..Default::default()
            })
            .await
            .map_err(|e| StoreError::nats("follow signals", e))?;
        let msgs = consumer
            .messages()
            .await
            .map_err(|e| StoreError::nats("follow signals", e))?;
        let layout = self.layout.clone();
        Ok(Box::pin(msgs.map(move |m| {
            let m = m.map_err(|e| StoreError::nats("follow signals", e))?;
            Ok(consumed(
                layout.of_signal_subject(&m.subject).map_or("", |(_, n)| n),
                &m,
            ))
        })))
    }

    /// Whether what `rec` waits for besides a time came: the signal it
    /// waits for, or enough of its children's ends (`false` for a record
    /// that waits for neither). The one look of the claim, the waker and
    /// the owner's end.
    pub async fn arrived(&self, rec: &JobRecord) -> Result<bool, StoreError> {
        if let Some((name, after)) = machine::signal_of(rec) {
            return Ok(self.next(&rec.id, name, after).await?.is_some());
        }
        if let Some(ends) = machine::children_of(rec) {
            return Ok(crate::children::announced(self, &rec.id).await? >= ends);
        }
        Ok(false)
    }
}

/// The signal a stored message is.
fn signal_of(layout: &Layout, m: &jetstream::message::StreamMessage) -> Signal {
    let name = layout
        .of_signal_subject(&m.subject)
        .map(|(_, n)| n.to_string())
        .unwrap_or_default();
    signal(
        &name,
        m.sequence,
        Some(m.time),
        &m.payload,
        Some(&m.headers),
    )
}

/// The signal `name` a consumer delivered.
fn consumed(name: &str, m: &jetstream::Message) -> Signal {
    let info = m.info().ok();
    signal(
        name,
        info.as_ref().map_or(0, |i| i.stream_sequence),
        info.map(|i| i.published),
        &m.payload,
        m.headers.as_ref(),
    )
}

/// A signal from what the stream stored: its name, sequence, time
/// (the server's clock), payload and headers.
fn signal(
    name: &str,
    seq: u64,
    stored: Option<time::OffsetDateTime>,
    payload: &[u8],
    headers: Option<&async_nats::HeaderMap>,
) -> Signal {
    let sent_at = stored
        .map(|t| {
            let nanos = t.unix_timestamp_nanos().max(0) as u64;
            leasehold_core::time::rfc3339(SystemTime::UNIX_EPOCH + Duration::from_nanos(nanos))
        })
        .unwrap_or_default();
    Signal {
        name: name.to_string(),
        seq,
        data: data_of(payload),
        sent_at,
        sender: headers
            .and_then(|h| h.get(SENDER_HEADER))
            .map(|v| v.as_str().to_string()),
    }
}

/// A signal's data from its payload: JSON, `{}` when empty, its text as a
/// JSON string when it is not JSON (sent by hand with `nats pub`).
pub fn data_of(payload: &[u8]) -> Value {
    if payload.iter().all(u8::is_ascii_whitespace) {
        return Value::Object(Default::default());
    }
    serde_json::from_slice(payload)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(payload).into_owned()))
}

/// How long after a look at a job its next one waits, gathering the
/// signals that come: the looks at a parent whose thousand children end
/// over a second are a few hundred at most, not a thousand, and cost it
/// little (measured by `make bench`'s `children` part).
const GATHER: Duration = Duration::from_millis(5);

/// How long a waker waits before it tries a failed look again.
const RETRY: Duration = Duration::from_secs(1);

/// Wakes the jobs that wait for the signals sent, until `shutdown`: one
/// durable consumer shared by every worker and reaper, so each signal is
/// looked at once, and by someone even when no reaper runs.
pub async fn run(conn: Conn, r: Arc<Recovery>, shutdown: CancellationToken) {
    let stream = conn.layout.signals_stream();
    let consumer = conn.layout.signal_wake_consumer();
    let looks = Looks::default();
    crate::shared::consume(&conn, &stream, &consumer, 16, "signals", &shutdown, |m| {
        on_signal(&conn.layout, &r, &looks, m)
    })
    .await
}

/// The looks at a job running now, by job, each with the signals that
/// came while it ran (a thousand children ending at once are a few looks
/// at their parent, not a thousand; [`GATHER`] apart at least). A signal
/// is acked only after a look that started after it came: a waker that
/// stops leaves it unacked, and it comes back.
#[derive(Default)]
struct Looks(
    std::sync::Mutex<HashMap<String, Vec<jetstream::Message>>>,
    /// When each job was last looked at (within [`GATHER`]).
    std::sync::Mutex<HashMap<String, std::time::Instant>>,
);

impl Looks {
    /// How long the next look at `job` is to wait, if it was looked at
    /// less than [`GATHER`] ago.
    fn gather(&self, job: &str) -> Option<Duration> {
        let g = self.1.lock().unwrap();
        let wait = GATHER.checked_sub(g.get(job)?.elapsed())?;
        (!wait.is_zero()).then_some(wait)
    }

    fn looked(&self, job: &str) {
        let mut g = self.1.lock().unwrap();
        if g.len() >= 1024 {
            g.retain(|_, t| t.elapsed() < GATHER);
        }
        g.insert(job.to_string(), std::time::Instant::now());
    }
}

async fn on_signal(layout: &Layout, r: &Recovery, looks: &Looks, m: jetstream::Message) {
    let Some((job, name)) = layout.of_signal_subject(&m.subject) else {
        let _ = m.ack().await;
        return;
    };
    let (job, name) = (job.to_string(), name.to_string());
    {
        let mut g = looks.0.lock().unwrap();
        if let Some(next) = g.get_mut(&job) {
            // The running look may have read before this signal: the next
            // one, when it ends, covers it.
            next.push(m);
            return;
        }
        g.insert(job.clone(), Vec::new());
    }
    let mut batch = vec![m];
    loop {
        // Signals that keep coming (a thousand children ending) gather
        // until GATHER after the job's last look.
        if let Some(wait) = looks.gather(&job) {
            tokio::time::sleep(wait).await;
            batch.extend(
                looks
                    .0
                    .lock()
                    .unwrap()
                    .get_mut(&job)
                    .map(std::mem::take)
                    .unwrap_or_default(),
            );
        }
        let settle = match crate::timers::wake(r, &job).await {
            Ok(w) => {
                tracing::debug!(job, signal = name, signals = batch.len(), woken = ?w, "signal looked at");
                AckKind::Ack
            }
            Err(e) => {
                tracing::info!(job, signal = name, error = %e, "a signal's job not woken yet; looking again");
                AckKind::Nak(Some(RETRY))
            }
        };
        for m in batch {
            let _ = m.ack_with(settle).await;
        }
        looks.looked(&job);
        let mut g = looks.0.lock().unwrap();
        let next = g.get_mut(&job).map(std::mem::take).unwrap_or_default();
        if next.is_empty() {
            g.remove(&job);
            return;
        }
        batch = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_is_json_an_empty_one_an_object_and_text_a_string() {
        assert_eq!(data_of(br#"{"ok":true}"#), serde_json::json!({"ok": true}));
        assert_eq!(data_of(b""), serde_json::json!({}));
        assert_eq!(data_of(b"  \n"), serde_json::json!({}));
        assert_eq!(data_of(b"null"), Value::Null);
        assert_eq!(data_of(b"yes please"), serde_json::json!("yes please"));
    }
}
