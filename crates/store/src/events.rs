//! Job events on `lh.events.<job_id>.<type>` (stream `LH_EVENTS`).
//!
//! Fencing: at every claim the new owner publishes a `claimed` marker and
//! keeps its sequence in a [`Fence`]. Every later event of that owner is
//! published conditioned on the last sequence of *all* the job's subjects
//! (`Nats-Expected-Last-Subject-Sequence` scoped with
//! `Nats-Expected-Last-Subject-Sequence-Subject: lh.events.<job_id>.>`), so
//! once another owner's marker lands, every publish of the old owner is
//! refused by the server itself.
//!
//! Events from non-owners (a `heartbeat_lost` of a fenced worker, a reaper's
//! `dead`) are published unconditionally; when one of them moves the job's
//! last sequence, the owner's next publish is refused, reads the job's last
//! event, sees it carries no newer epoch, adopts its sequence and retries.
//! Readers ignore events of an epoch older than the latest `claimed` marker
//! before them ([`coherent`]).

use std::time::SystemTime;

use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, context::PublishErrorKind};
use futures::StreamExt;
use leasehold_core::time::rfc3339;
use leasehold_proto::{JobEvent, JobRecord};
use serde_json::Value;

use crate::{server_error_code, Conn, Layout, StoreError};

/// The header scoping the expected-last-subject-sequence check to a wildcard (nats-server >= 2.11).
const EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT: &str = "Nats-Expected-Last-Subject-Sequence-Subject";

/// Event data larger than this is kept beside the event (in the payloads
/// bucket, in chunks), and the event carries a reference: a transcript
/// journal after a long warm retry can pass the server's message size.
pub const EVENT_INLINE_MAX: usize = 256 * 1024;
/// Size of one chunk of an event's data kept beside it.
const CHUNK: usize = 512 * 1024;

/// The event stream.
#[derive(Clone)]
pub struct Events {
    js: jetstream::Context,
    layout: Layout,
    stream: String,
    /// Bytes of events read through this handle (and its clones).
    read_bytes: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// An event with a dedupe id lost with the stream's leader is published
    /// again at its successor's election ([`crate::failover`]).
    elections: crate::failover::Elections,
}

/// A refused or failed fenced publication.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    /// A newer owner's events are on the job: this owner is fenced off.
    #[error("ownership lost: events of epoch {newer_epoch} follow ours ({ours})")]
    Lost { ours: u64, newer_epoch: u64 },
    /// Transient: NATS did not answer; retry with backoff.
    #[error("publish event: {0}")]
    Nats(String),
    /// The event stream refused it for good (full at its byte or count
    /// bound, or the message too large): retrying now changes nothing.
    #[error("the event stream refused the event: {0}")]
    Refused(String),
}

/// The server's "message size exceeds maximum allowed" (10054).
const MESSAGE_TOO_LARGE: u64 = 10054;

/// Builds an event.
/// The `Nats-Msg-Id` of a job's terminal event (`completed`, `failed`,
/// `cancelled`): one per incarnation (its `created_at`) and epoch, so the
/// owner and a recoverer that publishes it for an owner that died first
/// publish it once, and an id reused within the dedupe window still gets
/// its own.
pub fn terminal_event_id(rec: &JobRecord, ty: &str) -> String {
    format!("{}:{ty}:{}:{}", rec.id, rec.epoch, rec.created_at)
}

pub fn event(job_id: &str, epoch: u64, ty: &str, worker_id: Option<&str>, data: Value) -> JobEvent {
    JobEvent {
        job_id: job_id.into(),
        epoch,
        at: rfc3339(SystemTime::now()),
        r#type: ty.into(),
        worker_id: worker_id.map(str::to_string),
        data: if data.is_null() {
            String::new()
        } else {
            data.to_string()
        },
    }
}

impl Events {
    pub fn new(conn: &Conn) -> Self {
        Events {
            js: conn.js.clone(),
            layout: conn.layout.clone(),
            stream: conn.layout.events_stream(),
            read_bytes: Default::default(),
            elections: conn.elections(),
        }
    }

    fn message(&self, ev: &JobEvent) -> (String, bytes::Bytes) {
        let subject = self.layout.event_subject(&ev.job_id, &ev.r#type);
        (
            subject,
            serde_json::to_vec(ev).expect("event serializes").into(),
        )
    }

    /// The event as published: its data beside it when large (written
    /// first, so a published reference always resolves).
    async fn prepared(&self, ev: &JobEvent) -> Result<(String, bytes::Bytes), StoreError> {
        if ev.data.len() <= EVENT_INLINE_MAX {
            return Ok(self.message(ev));
        }
        let kv = self
            .js
            .get_key_value(self.layout.payloads_bucket())
            .await
            .map_err(|e| StoreError::nats("payloads bucket", e))?;
        let id = format!("{}.ev.{}", ev.job_id, uuid::Uuid::new_v4().simple());
        let bytes = ev.data.as_bytes();
        let chunks = bytes.chunks(CHUNK).count();
        for (i, c) in bytes.chunks(CHUNK).enumerate() {
            kv.put(format!("{id}.{i}"), bytes::Bytes::copy_from_slice(c))
                .await
                .map_err(|e| StoreError::nats("store event data", e))?;
        }
        let mut small = ev.clone();
        small.data =
            serde_json::json!({"data_ref": id, "chunks": chunks, "bytes": bytes.len()}).to_string();
        Ok(self.message(&small))
    }

    /// Resolves an event whose data was kept beside it.
    async fn resolved(&self, mut ev: JobEvent) -> Result<JobEvent, StoreError> {
        let map = ev.data_map();
        let (Some(id), Some(n)) = (
            map.get("data_ref").and_then(|v| v.as_str()),
            map.get("chunks").and_then(|v| v.as_u64()),
        ) else {
            return Ok(ev);
        };
        let kv = self
            .js
            .get_key_value(self.layout.payloads_bucket())
            .await
            .map_err(|e| StoreError::nats("payloads bucket", e))?;
        let mut data = Vec::new();
        for i in 0..n {
            match kv
                .get(format!("{id}.{i}"))
                .await
                .map_err(|e| StoreError::nats("read event data", e))?
            {
                Some(b) => data.extend_from_slice(&b),
                None => {
                    return Err(StoreError::failed(format!(
                        "event data {id} of job {} is missing chunk {i}",
                        ev.job_id
                    )))
                }
            }
        }
        ev.data = String::from_utf8_lossy(&data).into_owned();
        Ok(ev)
    }

    /// Publishes `evs` (each under 256 KiB of data) without a fence, as
    /// asynchronous publishes whose acks are awaited together: only for
    /// seeding a bench's events fast.
    pub async fn seed(&self, evs: &[JobEvent]) -> Result<(), StoreError> {
        let mut acks = Vec::with_capacity(evs.len());
        for ev in evs {
            let (subject, payload) = self.message(ev);
            acks.push(
                self.js
                    .publish(subject, payload)
                    .await
                    .map_err(|e| StoreError::nats("seed events", e))?,
            );
        }
        for a in acks {
            a.await.map_err(|e| StoreError::nats("seed events", e))?;
        }
        Ok(())
    }

    /// Publishes without a fence; `msg_id` deduplicates repeats.
    pub async fn publish(&self, ev: &JobEvent, msg_id: Option<&str>) -> Result<u64, StoreError> {
        let (subject, payload) = self.prepared(ev).await?;
        let mut m = PublishMessage::build().payload(payload);
        if let Some(id) = msg_id {
            m = m.message_id(id);
        }
        let once = || async {
            self.js
                .send_publish(subject.clone(), m.clone())
                .await
                .map_err(|e| StoreError::nats("publish event", e))?
                .await
                .map_err(|e| StoreError::nats("publish event", e))
        };
        let ack = self
            .elections
            .reissue_if(msg_id.is_some(), "publish an event", once)
            .await?;
        Ok(ack.sequence)
    }

    /// Publishes the `claimed` marker of a new owner and returns its fence.
    pub async fn claim_marker(
        &self,
        job_id: &str,
        epoch: u64,
        worker_id: &str,
        data: Value,
    ) -> Result<Fence, FenceError> {
        // The marker is fenced like every later event: an owner paused
        // between its KV claim and this publish must not land a marker after
        // a newer owner's. A first claim expects no events at all (saving two
        // reads per new job); anything already there refuses it and takes the
        // checked path of `publish_event`. A later claim starts from the job's
        // last sequence as read now, after checking no newer marker is there.
        let mut fence = Fence {
            events: self.clone(),
            job_id: job_id.into(),
            epoch,
            worker_id: worker_id.into(),
            last_seq: 0,
            previous_claim: None,
        };
        if epoch > 1 {
            let nats = |e: StoreError| FenceError::Nats(e.to_string());
            let last = self.last_from_leader(job_id).await.map_err(nats)?;
            fence.last_seq = last.map_or(0, |(seq, _)| seq);
            let claimed = self.last_claim_from_leader(job_id).await.map_err(nats)?;
            if let Some((_, c)) = claimed.as_ref().filter(|(_, c)| c.epoch > epoch) {
                return Err(FenceError::Lost {
                    ours: epoch,
                    newer_epoch: c.epoch,
                });
            }
            fence.previous_claim = claimed.map(|(_, c)| c).filter(|c| c.epoch < epoch);
        }
        let ev = event(job_id, epoch, "claimed", Some(worker_id), data);
        fence
            .publish_event(&ev, Some(&format!("{job_id}:claimed:{epoch}")))
            .await?;
        Ok(fence)
    }

    /// The last event of a job and its sequence.
    pub async fn last(&self, job_id: &str) -> Result<Option<(u64, JobEvent)>, StoreError> {
        self.last_on(self.layout.job_events_filter(job_id), false)
            .await
    }

    /// Like [`Events::last`], read from the stream's leader: what decides a
    /// fence must not come from a replica that lags behind (a direct get
    /// may be answered by any replica).
    async fn last_from_leader(&self, job_id: &str) -> Result<Option<(u64, JobEvent)>, StoreError> {
        self.last_on(self.layout.job_events_filter(job_id), true)
            .await
    }

    async fn last_on(
        &self,
        subject: String,
        leader: bool,
    ) -> Result<Option<(u64, JobEvent)>, StoreError> {
        let stream = self
            .js
            .get_stream_no_info(&self.stream)
            .await
            .map_err(|e| StoreError::nats("events stream", e))?;
        if leader {
            return match stream.get_last_raw_message_by_subject(&subject).await {
                Ok(m) => Ok(Some((
                    m.sequence,
                    serde_json::from_slice(&m.payload).unwrap_or_default(),
                ))),
                Err(e)
                    if e.kind() == jetstream::stream::LastRawMessageErrorKind::NoMessageFound =>
                {
                    Ok(None)
                }
                Err(e) => Err(StoreError::nats("last event", e)),
            };
        }
        match stream.direct_get_last_for_subject(subject).await {
            Ok(m) => Ok(Some((
                m.sequence,
                serde_json::from_slice(&m.payload).unwrap_or_default(),
            ))),
            Err(e) if e.kind() == jetstream::stream::DirectGetErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::nats("last event", e)),
        }
    }

    /// The last event of one type of a job.
    pub async fn last_of_type(
        &self,
        job_id: &str,
        ty: &str,
    ) -> Result<Option<(u64, JobEvent)>, StoreError> {
        self.last_on(self.layout.event_subject(job_id, ty), false)
            .await
    }

    /// [`Events::last_of_type`], read from the stream's leader: for a
    /// decision a lagging replica must not make (a park's answer, hidden,
    /// would ask the person again and drop their answer).
    pub async fn last_of_type_from_leader(
        &self,
        job_id: &str,
        ty: &str,
    ) -> Result<Option<(u64, JobEvent)>, StoreError> {
        self.last_on(self.layout.event_subject(job_id, ty), true)
            .await
    }

    async fn last_claim_from_leader(
        &self,
        job_id: &str,
    ) -> Result<Option<(u64, JobEvent)>, StoreError> {
        self.last_on(self.layout.event_subject(job_id, "claimed"), true)
            .await
    }

    /// Every event of one job, in order, with its stream sequence.
    pub async fn read(&self, job_id: &str) -> Result<Vec<(u64, JobEvent)>, StoreError> {
        self.read_filtered(vec![self.layout.job_events_filter(job_id)], 0)
            .await
    }

    /// The job's events from stream sequence `from` on.
    pub async fn read_from(
        &self,
        job_id: &str,
        from: u64,
    ) -> Result<Vec<(u64, JobEvent)>, StoreError> {
        self.read_filtered(vec![self.layout.job_events_filter(job_id)], from)
            .await
    }

    /// The job's events of these types only, in order.
    pub async fn read_types(
        &self,
        job_id: &str,
        types: &[&str],
    ) -> Result<Vec<(u64, JobEvent)>, StoreError> {
        let filters = types
            .iter()
            .map(|t| self.layout.event_subject(job_id, t))
            .collect();
        self.read_filtered(filters, 0).await
    }

    /// The job's events of one type from stream sequence `from` on.
    pub async fn read_type_from(
        &self,
        job_id: &str,
        ty: &str,
        from: u64,
    ) -> Result<Vec<(u64, JobEvent)>, StoreError> {
        self.read_filtered(vec![self.layout.event_subject(job_id, ty)], from)
            .await
    }

    /// The job's events after stream sequence `after` (0: all of them), in
    /// order, then every new one as it lands: an ordered consumer that
    /// never ends by itself (drop the stream to stop). What a live view or
    /// a client's stream reads: resumed from the last sequence it saw, it
    /// misses nothing and repeats nothing.
    pub async fn follow(
        &self,
        job_id: &str,
        after: u64,
    ) -> Result<futures::stream::BoxStream<'static, Result<(u64, JobEvent), StoreError>>, StoreError>
    {
        self.follow_filtered(
            vec![self.layout.job_events_filter(job_id)],
            match after {
                0 => jetstream::consumer::DeliverPolicy::All,
                n => jetstream::consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: n + 1,
                },
            },
        )
        .await
    }

    /// Every job's events of these types published since `since`, then
    /// the new ones as they land (the console's recent outcomes).
    pub async fn follow_types_since(
        &self,
        types: &[&str],
        since: SystemTime,
    ) -> Result<futures::stream::BoxStream<'static, Result<(u64, JobEvent), StoreError>>, StoreError>
    {
        let filters = types
            .iter()
            .map(|t| self.layout.event_subject("*", t))
            .collect();
        let start = since
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        let start = time::OffsetDateTime::from_unix_timestamp_nanos(start.as_nanos() as i128)
            .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
        self.follow_filtered(
            filters,
            jetstream::consumer::DeliverPolicy::ByStartTime { start_time: start },
        )
        .await
    }

    async fn follow_filtered(
        &self,
        filters: Vec<String>,
        deliver_policy: jetstream::consumer::DeliverPolicy,
    ) -> Result<futures::stream::BoxStream<'static, Result<(u64, JobEvent), StoreError>>, StoreError>
    {
        let stream = self
            .js
            .get_stream_no_info(&self.stream)
            .await
            .map_err(|e| StoreError::nats("events stream", e))?;
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                filter_subjects: filters,
                deliver_policy,
                ..Default::default()
            })
            .await
            .map_err(|e| StoreError::nats("follow events", e))?;
        let msgs = consumer
            .messages()
            .await
            .map_err(|e| StoreError::nats("follow events", e))?;
        let me = self.clone();
        let s = msgs.then(move |m| {
            let me = me.clone();
            async move {
                let m = m.map_err(|e| StoreError::nats("follow events", e))?;
                let seq = m
                    .info()
                    .map_err(|e| StoreError::nats("event info", e))?
                    .stream_sequence;
                let ev = serde_json::from_slice::<JobEvent>(&m.payload).unwrap_or_default();
                Ok((seq, me.resolved(ev).await?))
            }
        });
        Ok(Box::pin(s))
    }

    /// Bytes of events read through this handle: what a resume costs.
    pub fn bytes_read(&self) -> u64 {
        self.read_bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    async fn read_filtered(
        &self,
        filters: Vec<String>,
        from: u64,
    ) -> Result<Vec<(u64, JobEvent)>, StoreError> {
        let stream = self
            .js
            .get_stream(&self.stream)
            .await
            .map_err(|e| StoreError::nats("events stream", e))?;
        let deliver = if from > 0 {
            jetstream::consumer::DeliverPolicy::ByStartSequence {
                start_sequence: from,
            }
        } else {
            jetstream::consumer::DeliverPolicy::All
        };
        let what = format!("reading events of {}", filters.join(","));
        let mut out = Vec::new();
        for m in crate::read::read_once(&stream, filters, deliver, &what).await? {
            let seq = m
                .info()
                .map_err(|e| StoreError::nats("event info", e))?
                .stream_sequence;
            self.read_bytes
                .fetch_add(m.payload.len() as u64, std::sync::atomic::Ordering::Relaxed);
            if let Ok(ev) = serde_json::from_slice::<JobEvent>(&m.payload) {
                out.push((seq, self.resolved(ev).await?));
            }
        }
        Ok(out)
    }
}

/// The events of a job that readers may trust: those not older than the
/// latest `claimed` marker before them.
pub fn coherent(events: &[(u64, JobEvent)]) -> Vec<&JobEvent> {
    let mut current = 0;
    let mut out = Vec::new();
    for (_, ev) in events {
        if ev.r#type == "claimed" {
            current = current.max(ev.epoch);
        }
        if ev.epoch >= current {
            out.push(ev);
        }
    }
    out
}

/// One owner's server-side fence on its job's events.
pub struct Fence {
    events: Events,
    pub job_id: String,
    pub epoch: u64,
    pub worker_id: String,
    last_seq: u64,
    previous_claim: Option<JobEvent>,
}

impl Fence {
    /// A fence of no owner, for a run that must write nothing (a journal
    /// check): epoch 0 and no sequence, so a publish through it on a job
    /// with any event is refused by the server, and the event found there
    /// (of a real claim's epoch) says this fence lost.
    pub fn of_nobody(events: Events, job_id: &str) -> Fence {
        Fence {
            events,
            job_id: job_id.into(),
            epoch: 0,
            worker_id: "journal-check".into(),
            last_seq: 0,
            previous_claim: None,
        }
    }

    /// The `claimed` marker of the claim before this one, as read when this
    /// one was published (`None` for a first claim). Its data says which
    /// session, and which trace span, ran the previous attempt.
    pub fn previous_claim(&self) -> Option<&JobEvent> {
        self.previous_claim.as_ref()
    }

    /// The sequence this owner last published (or adopted).
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// Publishes one event of this owner, refused by the server once another
    /// owner has claimed the job.
    pub async fn publish(&mut self, ty: &str, data: Value) -> Result<u64, FenceError> {
        let ev = event(&self.job_id, self.epoch, ty, Some(&self.worker_id), data);
        self.publish_event(&ev, None).await
    }

    /// Publishes a prepared event (its epoch must be this owner's) under the fence.
    pub async fn publish_event(
        &mut self,
        ev: &JobEvent,
        msg_id: Option<&str>,
    ) -> Result<u64, FenceError> {
        let (subject, payload) = self
            .events
            .prepared(ev)
            .await
            .map_err(|e| FenceError::Nats(e.to_string()))?;
        let filter = self.events.layout.job_events_filter(&self.job_id);
        // A few rounds: each refusal either proves a newer owner (stop) or
        // adopts an informational event's sequence (retry at once).
        for _ in 0..16 {
            let mut m = PublishMessage::build()
                .payload(payload.clone())
                .expected_last_subject_sequence(self.last_seq)
                .header(EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT, filter.as_str());
            if let Some(id) = msg_id {
                m = m.message_id(id);
            }
            // With a dedupe id, a copy of a stored event is acked as a
            // duplicate: safe to publish again at a leader's election.
            let once = || async {
                match self
                    .events
                    .js
                    .send_publish(subject.clone(), m.clone())
                    .await
                {
                    Ok(fut) => fut.await,
                    Err(e) => Err(e),
                }
            };
            let res = self
                .events
                .elections
                .reissue_if(msg_id.is_some(), "publish a fenced event", once)
                .await;
            match res {
                Ok(ack) => {
                    self.last_seq = ack.sequence;
                    return Ok(ack.sequence);
                }
                Err(e)
                    if e.kind() == PublishErrorKind::WrongLastSequence
                        || crate::is_wrong_last_sequence(&e) =>
                {
                    // Read the job's last sequence first, then its last
                    // claim marker: a marker landing after the first read
                    // moves the sequence again, so the retry is refused too.
                    let nats = |e: StoreError| FenceError::Nats(e.to_string());
                    let last = self
                        .events
                        .last_from_leader(&self.job_id)
                        .await
                        .map_err(nats)?;
                    let claimed = self
                        .events
                        .last_claim_from_leader(&self.job_id)
                        .await
                        .map_err(nats)?;
                    if let Some((_, c)) = claimed.filter(|(_, c)| c.epoch > self.epoch) {
                        return Err(FenceError::Lost {
                            ours: self.epoch,
                            newer_epoch: c.epoch,
                        });
                    }
                    self.last_seq = last.map_or(0, |(seq, _)| seq);
                }
                Err(e)
                    if matches!(
                        server_error_code(&e),
                        Some(
                            crate::STREAM_FULL_BYTES | crate::STREAM_FULL_MSGS | MESSAGE_TOO_LARGE
                        )
                    ) =>
                {
                    return Err(FenceError::Refused(e.to_string()))
                }
                Err(e) => return Err(FenceError::Nats(e.to_string())),
            }
        }
        Err(FenceError::Nats(format!(
            "events of {} keep moving",
            self.job_id
        )))
    }
}
