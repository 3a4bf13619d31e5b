//! Work tickets: the messages of the work-queue stream `LH_WORK`.
//!
//! A submission is the job's ticket until the job is terminal. Tickets that
//! leasehold itself publishes (a re-enqueued stranded job, a DLQ replay, a
//! review resume) carry the job id in `Lh-Job-Id` and the accepted spec as
//! JSON; their `Nats-Msg-Id` is unique per re-enqueue so the stream's dedupe
//! window cannot swallow them.

use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::consumer::pull;
use async_nats::jetstream::{self, consumer::PullConsumer, message::PublishMessage};
use async_nats::HeaderMap;
use bytes::Bytes;
use leasehold_core::lane::Lane;
use leasehold_core::{spec, JobRecord};

use crate::{Conn, Layout, StoreError};

/// How long a lane's consumer stays without a pull before the server
/// removes it (its tickets stay in the stream; the next worker to see
/// them makes the consumer again).
pub const LANE_IDLE: Duration = Duration::from_secs(3600);

/// Header naming the job of a ticket published by leasehold itself.
pub const JOB_ID_HEADER: &str = "Lh-Job-Id";

/// The work-queue stream.
#[derive(Clone)]
pub struct Work {
    js: jetstream::Context,
    layout: Layout,
    /// A ticket lost with the work stream's leader is published again at
    /// its successor's election ([`crate::failover`]).
    elections: crate::failover::Elections,
}

/// A stored ticket.
#[derive(Debug, Clone)]
pub struct Ticket {
    pub seq: u64,
    pub kind: String,
    /// The lane its subject names (the default one for the kind's own
    /// subject).
    pub lane: Lane,
    pub payload: Bytes,
    pub headers: HeaderMap,
    /// When the stream stored it (the server's clock): a submission's
    /// `delay` counts from here.
    pub stored_at: std::time::SystemTime,
}

/// The outcome of publishing a ticket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    pub seq: u64,
    /// The stream's dedupe window recognised the message id.
    pub duplicate: bool,
}

/// The one order of every write that gives a job a new ticket (a retry, a
/// hand-back, a re-offer, a re-ticket, a resume, a replay): the ticket is
/// published first, so a queued record never names a ticket that was not;
/// then `write` writes the record naming it (`None`: the record moved on,
/// nothing was written); then `index` makes the index follow what was
/// written (with whatever its caller orders around it: an owner's end
/// takes its event and its ack there too). A failure at any step leaves
/// what the steps before it made, each safe alone: a ticket no record
/// names is settled at its claim, a record the index does not follow yet
/// is repaired by the sweep, or by its ticket.
pub async fn ticket_first<T, W, E>(
    ticket: impl Future<Output = Result<T, E>>,
    write: impl AsyncFnOnce(T) -> Result<Option<W>, E>,
    index: impl AsyncFnOnce(&W) -> Result<(), E>,
) -> Result<Option<W>, E> {
    let ticket = ticket.await?;
    let Some(written) = write(ticket).await? else {
        return Ok(None);
    };
    index(&written).await?;
    Ok(Some(written))
}

impl Work {
    pub fn new(conn: &Conn) -> Self {
        Work {
            js: conn.js.clone(),
            layout: conn.layout.clone(),
            elections: conn.elections(),
        }
    }

    async fn stream(&self) -> Result<jetstream::stream::Stream<()>, StoreError> {
        let name = self.layout.work_stream();
        self.js
            .get_stream_no_info(&name)
            .await
            .map_err(|e| crate::lookup_error(format!("stream {name}"), &e))
    }

    /// The durable pull consumer of one kind.
    pub async fn consumer(&self, kind: &str) -> Result<PullConsumer, StoreError> {
        let name = self.layout.work_consumer(kind);
        let what = format!("consumer {name} on {}", self.layout.work_stream());
        self.stream()
            .await?
            .get_consumer(&name)
            .await
            .map_err(|e| crate::lookup_error(what, &*e))
    }

    /// The durable pull consumer of one lane of one kind, created when it is
    /// not there yet with the settings of the kind's own consumer (so a
    /// lane's tickets are acked, redelivered and dead-lettered alike) and
    /// removed by the server after [`LANE_IDLE`] without a pull.
    pub async fn lane_consumer(&self, kind: &str, lane: &Lane) -> Result<PullConsumer, StoreError> {
        if lane.is_default() {
            return self.consumer(kind).await;
        }
        let name = self.layout.lane_consumer(kind, lane);
        let stream = self.stream().await?;
        match stream.get_consumer::<pull::Config>(&name).await {
            Ok(c) => return Ok(c),
            Err(e) if !crate::is_not_found(&*e) => {
                return Err(crate::lookup_error(format!("consumer {name}"), &*e))
            }
            Err(_) => {}
        }
        let base = stream
            .consumer_info(self.layout.work_consumer(kind))
            .await
            .map_err(|e| {
                crate::lookup_error(format!("consumer {}", self.layout.work_consumer(kind)), &e)
            })?
            .config;
        let cfg = pull::Config {
            durable_name: Some(name.clone()),
            description: Some(format!(
                "leasehold workers of kind {kind}, tenant {} at priority {}",
                lane.tenant, lane.priority
            )),
            filter_subject: self.layout.lane_subject(kind, lane),
            ack_policy: base.ack_policy,
            ack_wait: base.ack_wait,
            max_deliver: base.max_deliver,
            backoff: base.backoff,
            max_ack_pending: base.max_ack_pending,
            max_waiting: base.max_waiting,
            inactive_threshold: LANE_IDLE,
            ..Default::default()
        };
        stream
            .get_or_create_consumer(&name, cfg)
            .await
            .map_err(|e| StoreError::nats(&format!("create consumer {name}"), e))
    }

    /// The last stream sequence the consumer of `lane` of `kind` delivered;
    /// `None` when that lane has no consumer (none made yet, or removed
    /// after [`LANE_IDLE`]): nothing of the lane is out with a worker. Each
    /// lane is its own consumer, so only its own deliveries say whether one
    /// of its tickets was delivered.
    pub async fn delivered_seq(&self, kind: &str, lane: &Lane) -> Result<Option<u64>, StoreError> {
        let name = if lane.is_default() {
            self.layout.work_consumer(kind)
        } else {
            self.layout.lane_consumer(kind, lane)
        };
        match self.stream().await?.consumer_info(&name).await {
            Ok(i) => Ok(Some(i.delivered.stream_sequence)),
            Err(e) if crate::is_not_found(&e) => Ok(None),
            Err(e) => Err(crate::lookup_error(format!("consumer {name}"), &e)),
        }
    }

    /// The lanes of `kind` other than the default one that hold tickets
    /// now (waiting or held by a worker), with how many: one stream info.
    /// A read, asked again at once when the work stream's leader is
    /// elected while it waits (see [`crate::failover`]).
    pub async fn lanes(&self, kind: &str) -> Result<Vec<(Lane, u64)>, StoreError> {
        self.elections
            .reissue("count the lanes", || self.lanes_once(kind))
            .await
    }

    async fn lanes_once(&self, kind: &str) -> Result<Vec<(Lane, u64)>, StoreError> {
        let stream = self.stream().await?;
        let mut info = stream
            .info_with_subjects(self.layout.lanes_filter(kind))
            .await
            .map_err(|e| StoreError::nats("work stream subjects", e))?;
        let mut out = Vec::new();
        while let Some(x) = futures::StreamExt::next(&mut info).await {
            let (subj, count) = x.map_err(|e| StoreError::nats("work stream subjects", e))?;
            if let Some((k, lane)) = self.layout.lane_of_submit_subject(&subj) {
                if k == kind && count > 0 {
                    out.push((lane, count as u64));
                }
            }
        }
        Ok(out)
    }

    /// Publishes a submission as a client would.
    pub async fn submit(
        &self,
        kind: &str,
        payload: Bytes,
        msg_id: Option<&str>,
        content_type: Option<&str>,
    ) -> Result<Published, StoreError> {
        self.submit_traced(kind, payload, msg_id, content_type, None)
            .await
    }

    /// [`Work::submit`] with the submitter's W3C `traceparent`: every
    /// attempt of the job joins that trace.
    pub async fn submit_traced(
        &self,
        kind: &str,
        payload: Bytes,
        msg_id: Option<&str>,
        content_type: Option<&str>,
        traceparent: Option<&str>,
    ) -> Result<Published, StoreError> {
        let lane = spec::lane_hint(&payload, content_type);
        self.submit_in_lane(kind, &lane, payload, msg_id, content_type, traceparent)
            .await
    }

    /// [`Work::submit_traced`] on the subject of `lane` (the spec's tenant
    /// and priority; see [`leasehold_core::lane`]).
    pub async fn submit_in_lane(
        &self,
        kind: &str,
        lane: &Lane,
        payload: Bytes,
        msg_id: Option<&str>,
        content_type: Option<&str>,
        traceparent: Option<&str>,
    ) -> Result<Published, StoreError> {
        let mut m = PublishMessage::build().payload(payload);
        if let Some(id) = msg_id {
            m = m.message_id(id);
        }
        if let Some(ct) = content_type {
            m = m.header("Content-Type", ct);
        }
        if let Some(tp) = traceparent {
            m = m.header("traceparent", tp);
        }
        let deduped = msg_id.is_some();
        self.publish(self.layout.lane_subject(kind, lane), m, deduped)
            .await
    }

    /// Publishes a fresh ticket for an existing record (re-enqueue, replay,
    /// resume). `reason` and `nonce` make the dedupe id unique per re-enqueue
    /// while repeats of the same re-enqueue collapse.
    pub async fn reissue(
        &self,
        rec: &JobRecord,
        reason: &str,
        nonce: &str,
    ) -> Result<Published, StoreError> {
        let mut spec = rec.spec.clone().unwrap_or_default();
        // The record's `next_run_at` says when the job runs now: a resolved
        // `run_at` already past would be refused by the ticket's decode.
        spec.run_at = None;
        spec.delay = None;
        let payload: Bytes = serde_json::to_vec(&spec).expect("spec serializes").into();
        let mut m = PublishMessage::build()
            .payload(payload)
            .message_id(reissue_id(rec, reason, nonce))
            .header(JOB_ID_HEADER, rec.id.as_str());
        if let Some(tp) = rec.traceparent.as_deref() {
            // A record rebuilt from this ticket (a replay) keeps the trace.
            m = m.header("traceparent", tp);
        }
        let lane = Lane::of(&spec);
        self.publish(self.layout.lane_subject(&rec.kind, &lane), m, true)
            .await
    }

    /// Publishes a ticket and waits for the stream's ack. One with a dedupe
    /// id (`deduped`) is published again when the work stream (or any
    /// leader) is elected while it waits: a second copy of a stored ticket
    /// is acked as a duplicate.
    async fn publish(
        &self,
        subject: String,
        m: PublishMessage,
        deduped: bool,
    ) -> Result<Published, StoreError> {
        let once = || async {
            self.js
                .send_publish(subject.clone(), m.clone())
                .await
                .map_err(|e| StoreError::nats("publish ticket", e))?
                .await
                .map_err(|e| crate::publish_refused(&self.layout.work_stream(), "ticket", e))
        };
        let ack = self
            .elections
            .reissue_if(deduped, "publish a ticket", once)
            .await?;
        Ok(Published {
            seq: ack.sequence,
            duplicate: ack.duplicate,
        })
    }

    /// Waits, at most `patience`, until the work stream's last message on
    /// `subject` is `payload`: once it is, the stream has stored the
    /// submission and sent its publish ack, so a reply published after
    /// this reaches the submitter's inbox after the ack (the gateway's
    /// second reply). Whether it was seen (a ticket already consumed, or
    /// one newer on the subject, is not).
    pub async fn wait_stored(&self, subject: &str, payload: &[u8], patience: Duration) -> bool {
        let end = tokio::time::Instant::now() + patience;
        let mut backoff = leasehold_core::retry::Backoff::new(
            Duration::from_millis(5),
            Duration::from_millis(100),
        );
        while tokio::time::Instant::now() < end {
            if let Ok(stream) = self.stream().await {
                if let Ok(m) = stream.get_last_raw_message_by_subject(subject).await {
                    if m.payload.as_ref() == payload {
                        return true;
                    }
                }
            }
            tokio::time::sleep(backoff.pause()).await;
        }
        false
    }

    /// The ticket at `seq`, if it is still in the stream.
    pub async fn get(&self, seq: u64) -> Result<Option<Ticket>, StoreError> {
        match self.stream().await?.get_raw_message(seq).await {
            Ok(m) => Ok(Some(Ticket {
                seq,
                kind: self
                    .layout
                    .kind_of_submit_subject(&m.subject)
                    .unwrap_or_default()
                    .to_string(),
                lane: self
                    .layout
                    .lane_of_submit_subject(&m.subject)
                    .map(|(_, l)| l)
                    .unwrap_or_default(),
                payload: m.payload,
                headers: m.headers,
                stored_at: m.time.into(),
            })),
            Err(e) if e.kind() == jetstream::stream::RawMessageErrorKind::NoMessageFound => {
                Ok(None)
            }
            Err(e) => Err(StoreError::nats("get ticket", e)),
        }
    }

    /// Removes a ticket (a message past max deliveries otherwise stays for ever).
    pub async fn delete(&self, seq: u64) -> Result<bool, StoreError> {
        match self.stream().await?.delete_message(seq).await {
            Ok(b) => Ok(b),
            // Already gone (or never there) is what we wanted.
            Err(e) if is_gone(&e) => Ok(false),
            // Anything else may have left the ticket in place: say so, so
            // the caller does not take a deletion for done.
            Err(e) => Err(StoreError::nats("delete ticket", e)),
        }
    }
}

/// Whether a refused deletion says the message is not there: the server
/// answers 10037 ("no message found"), or 10057 (deletion failed) naming it.
fn is_gone(e: &async_nats::jetstream::stream::DeleteMessageError) -> bool {
    use async_nats::jetstream::stream::DeleteMessageErrorKind;
    match e.kind() {
        DeleteMessageErrorKind::JetStream(js) => match js.error_code().0 {
            crate::NO_MESSAGE_FOUND => true,
            crate::MSG_DELETE_FAILED => js
                .to_string()
                .to_ascii_lowercase()
                .contains("no message found"),
            _ => false,
        },
        _ => false,
    }
}

/// The job id a ticket names, if its headers say: `Lh-Job-Id`, else `Nats-Msg-Id`.
pub fn ticket_job_id(headers: Option<&HeaderMap>) -> Option<String> {
    let h = headers?;
    h.get(JOB_ID_HEADER)
        .or_else(|| h.get(async_nats::header::NATS_MESSAGE_ID))
        .map(|v| v.as_str().to_string())
        .filter(|s| !s.is_empty())
}

/// Decodes and validates a submission published on `subject`: the spec
/// (see [`spec::decode`]), then its tenant and priority against the lane
/// the subject names (see [`spec::check_lane`]). Every path that judges a
/// submission (a worker's claim, the gateway's answer to a submitter)
/// calls this one.
pub fn decode_ticket(
    layout: &Layout,
    subject: &str,
    sub: spec::Submission<'_>,
    kinds: &spec::Kinds,
    max_bytes: usize,
) -> Result<spec::Accepted, spec::Rejected> {
    let mut a = spec::decode(sub, kinds, max_bytes)?;
    let lane = layout
        .lane_of_submit_subject(subject)
        .map(|(_, l)| l)
        .unwrap_or_default();
    match spec::check_lane(&mut a.spec, &lane, |named| {
        layout.lane_subject(sub.kind, named)
    }) {
        Ok(()) => Ok(a),
        Err(error) => Err(spec::Rejected {
            id: Some(a.id),
            error,
        }),
    }
}

/// The `Content-Type` of a ticket, if set.
pub fn content_type(headers: Option<&HeaderMap>) -> Option<String> {
    headers?.get("Content-Type").map(|v| v.as_str().to_string())
}

/// Resubmission of raw bytes (an operator replaying a rejected submission).
impl Work {
    /// Publishes `payload` byte for byte on the kind's submit subject with
    /// the original headers (without dedupe and expectation headers), the
    /// job id, when known, in `Lh-Job-Id`, and `msg_id` as the dedupe id.
    /// Without a job id, pass no `msg_id`: a worker takes `Nats-Msg-Id` as
    /// the job id when `Lh-Job-Id` is absent.
    pub async fn resubmit_raw(
        &self,
        kind: &str,
        payload: Bytes,
        original: Option<&HeaderMap>,
        job_id: Option<&str>,
        msg_id: Option<&str>,
    ) -> Result<Published, StoreError> {
        let payload_copy = payload.clone();
        let mut m = PublishMessage::build().payload(payload);
        if let Some(id) = msg_id {
            m = m.message_id(id);
        }
        if let Some(h) = original {
            for (name, values) in h.iter() {
                let n = name.to_string();
                let skip = n.eq_ignore_ascii_case("Nats-Msg-Id")
                    || n.starts_with("Nats-Expected")
                    || n.starts_with("Lh-");
                if skip {
                    continue;
                }
                for v in values {
                    m = m.header(n.as_str(), v.as_str());
                }
            }
        }
        if let Some(id) = job_id {
            m = m.header(JOB_ID_HEADER, id);
        }
        let lane = spec::lane_hint(&payload_copy, content_type(original).as_deref());
        self.publish(self.layout.lane_subject(kind, &lane), m, msg_id.is_some())
            .await
    }
}

/// The dedupe id of a re-issued ticket: the same for a re-run of the same
/// step (the same record, reason and nonce), different for another
/// incarnation of the id (a job id reused after retention starts a new
/// record, whose `created_at` differs), so `<id>:retry:1` of a new job is
/// never swallowed as a duplicate of the earlier job's.
pub fn reissue_id(rec: &JobRecord, reason: &str, nonce: &str) -> String {
    let incarnation: String = rec
        .created_at
        .chars()
        .filter(char::is_ascii_digit)
        .collect();
    format!("{}:{reason}:{nonce}:{incarnation}", rec.id)
}

impl Work {
    /// Creates the queued record of the ticket stored at `seq`, as its
    /// claim would (same id, spec and ticket; `traceparent` picks the
    /// trace from the ticket's headers, id and kind); the answer says
    /// whether it did and why not. A ticket already taken, a re-issued one
    /// (its record exists) or one that does not decode (its claim records
    /// the rejection) gets nothing. The gateway answers `lh.enqueued.<seq>`
    /// with it; `leasehold submit` calls it itself when no worker runs. The
    /// record is listed in the index as waiting (the claim removes it), so
    /// `leasehold list` shows a job that waits for a free worker.
    pub async fn record_ticket(
        &self,
        jobs: &crate::Jobs,
        active: &crate::index::Active,
        seq: u64,
        kinds: &leasehold_core::spec::Kinds,
        max_bytes: usize,
        traceparent: impl Fn(&HeaderMap, &str, &str) -> Option<String>,
    ) -> Enqueued {
        let ticket = match self.get(seq).await {
            Ok(Some(t)) => t,
            // Consumed already (its claim made the record), or never stored.
            Ok(None) => return Enqueued::Gone,
            Err(e) => {
                return Enqueued::Error {
                    id: None,
                    error: e.to_string(),
                }
            }
        };
        if let Some(id) = ticket.headers.get(JOB_ID_HEADER) {
            return Enqueued::Reissued {
                id: id.as_str().into(),
            };
        }
        let hint = ticket_job_id(Some(&ticket.headers));
        let ct = content_type(Some(&ticket.headers));
        let sub = spec::Submission {
            kind: &ticket.kind,
            payload: &ticket.payload,
            msg_id: hint.as_deref(),
            content_type: ct.as_deref(),
            stream_seq: seq,
            received_at: ticket.stored_at,
        };
        let subject = self.layout.lane_subject(&ticket.kind, &ticket.lane);
        let accepted = match decode_ticket(&self.layout, &subject, sub, kinds, max_bytes) {
            Ok(a) => a,
            Err(rej) => {
                return Enqueued::Invalid {
                    id: rej.id,
                    error: rej.error.to_string(),
                }
            }
        };
        let tp = traceparent(&ticket.headers, &accepted.id, &ticket.kind);
        let id = accepted.id.clone();
        match create_queued(jobs, active, accepted, &ticket.kind, seq, tp).await {
            Ok(_) => Enqueued::Created { id },
            Err(crate::JobsError::Exists(_)) => Enqueued::Exists { id },
            Err(e) => Enqueued::Error {
                id: Some(id),
                error: e.to_string(),
            },
        }
    }
}

/// The queued record of a stored ticket, created if absent and listed in
/// the index as waiting (the claim removes the entry; an entry that cannot
/// be written is left to the ticket, which covers the job). The one maker
/// of a record from a ticket that is not claimed at once: the gateway's
/// answer to a submitter ([`Work::record_ticket`]) and a claim that finds
/// its job not due yet both call it, so the two records are the same
/// (`traceparent` included).
pub async fn create_queued(
    jobs: &crate::Jobs,
    active: &crate::index::Active,
    accepted: spec::Accepted,
    kind: &str,
    seq: u64,
    traceparent: Option<String>,
) -> Result<JobRecord, crate::JobsError> {
    let mut rec = leasehold_core::machine::new_record(
        &accepted.id,
        kind,
        accepted.spec,
        seq,
        std::time::SystemTime::now(),
    );
    rec.traceparent = traceparent;
    jobs.create(&rec).await?;
    if let Some(key) = crate::index::Key::of(&rec) {
        if let Err(e) = active.put(&key, &rec).await {
            tracing::debug!(job = %rec.id, error = %e, "queued record not indexed; its ticket covers it");
        }
    }
    Ok(rec)
}

/// What [`Work::record_ticket`] did with a stored ticket: the answer on
/// `lh.enqueued.<seq>`, written in one place ([`Enqueued::answer`]) and
/// read in one ([`Enqueued::of_answer`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Enqueued {
    /// The queued record was written (and listed as waiting).
    Created { id: String },
    /// The record exists already (a claim or an earlier answer made it).
    Exists { id: String },
    /// A ticket leasehold re-issued: its record exists.
    Reissued { id: String },
    /// Consumed already (its claim made the record), or never stored.
    Gone,
    /// The ticket does not decode: its claim records the rejection.
    Invalid { id: Option<String>, error: String },
    /// The store did not answer; the claim writes the record.
    Error { id: Option<String>, error: String },
}

impl Enqueued {
    /// The outcome word of an answer that created nothing.
    fn outcome(&self) -> Option<&'static str> {
        match self {
            Enqueued::Created { .. } => None,
            Enqueued::Exists { .. } => Some("exists"),
            Enqueued::Reissued { .. } => Some("reissued"),
            Enqueued::Gone => Some("gone"),
            Enqueued::Invalid { .. } => Some("invalid"),
            Enqueued::Error { .. } => Some("error"),
        }
    }

    /// The answer as JSON: `{"seq", "id", "created": true, "status":
    /// "queued"}`, or `{"seq", "id"?, "created": false, "outcome", "error"?}`.
    ///
    /// ```
    /// use leasehold_store::work::Enqueued;
    /// let a = Enqueued::Exists { id: "j1".into() }.answer(Some(7));
    /// assert_eq!(a["outcome"], "exists");
    /// assert_eq!(Enqueued::of_answer(&a), Enqueued::Exists { id: "j1".into() });
    /// ```
    pub fn answer(&self, seq: Option<u64>) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        if let Some(seq) = seq {
            m.insert("seq".into(), seq.into());
        }
        let (id, error) = match self {
            Enqueued::Created { id } | Enqueued::Exists { id } | Enqueued::Reissued { id } => {
                (Some(id.as_str()), None)
            }
            Enqueued::Gone => (None, None),
            Enqueued::Invalid { id, error } | Enqueued::Error { id, error } => {
                (id.as_deref(), Some(error.as_str()))
            }
        };
        if let Some(id) = id {
            m.insert("id".into(), id.into());
        }
        match self.outcome() {
            None => {
                m.insert("created".into(), true.into());
                m.insert("status".into(), "queued".into());
            }
            Some(o) => {
                m.insert("created".into(), false.into());
                m.insert("outcome".into(), o.into());
            }
        }
        if let Some(e) = error {
            m.insert("error".into(), e.into());
        }
        serde_json::Value::Object(m)
    }

    /// An answer read back; one that says nothing known is an error.
    pub fn of_answer(v: &serde_json::Value) -> Enqueued {
        let id = v["id"].as_str().map(str::to_string);
        let error = v["error"]
            .as_str()
            .unwrap_or("an answer without an outcome")
            .to_string();
        let named = |f: fn(String) -> Enqueued| match &id {
            Some(id) => f(id.clone()),
            None => Enqueued::Error {
                id: None,
                error: format!("an answer without a job id: {v}"),
            },
        };
        if v["created"] == true {
            return named(|id| Enqueued::Created { id });
        }
        match v["outcome"].as_str() {
            Some("exists") => named(|id| Enqueued::Exists { id }),
            Some("reissued") => named(|id| Enqueued::Reissued { id }),
            Some("gone") => Enqueued::Gone,
            Some("invalid") => Enqueued::Invalid { id, error },
            _ => Enqueued::Error { id, error },
        }
    }
}

/// How long after a delivery a consumer with `cfg` redelivers a ticket that
/// was neither acked nor NAKed: its ack wait, or the first step of its
/// backoff when it has one.
pub fn first_redelivery(cfg: &async_nats::jetstream::consumer::Config) -> Duration {
    cfg.backoff.first().copied().unwrap_or(cfg.ack_wait)
}

#[cfg(test)]
mod tests {
    use super::Enqueued;
    use serde_json::json;

    #[test]
    fn every_enqueued_answer_reads_back_as_itself_in_the_documented_shape() {
        let all = [
            Enqueued::Created { id: "a".into() },
            Enqueued::Exists { id: "a".into() },
            Enqueued::Reissued { id: "a".into() },
            Enqueued::Gone,
            Enqueued::Invalid {
                id: Some("a".into()),
                error: "bad".into(),
            },
            Enqueued::Error {
                id: None,
                error: "away".into(),
            },
        ];
        for e in all {
            assert_eq!(Enqueued::of_answer(&e.answer(Some(3))), e);
        }
        assert_eq!(
            Enqueued::Created { id: "a".into() }.answer(Some(3)),
            json!({"seq": 3, "id": "a", "created": true, "status": "queued"})
        );
        assert_eq!(
            Enqueued::Gone.answer(Some(3)),
            json!({"seq": 3, "created": false, "outcome": "gone"})
        );
        // An answer that says nothing known is an error, never a success.
        for bad in [json!({}), json!({"created": true}), json!("text")] {
            assert!(
                matches!(Enqueued::of_answer(&bad), Enqueued::Error { .. }),
                "{bad}"
            );
        }
    }
}
