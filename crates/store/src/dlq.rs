//! Dead letters on `lh.dlq.<kind>` (stream `LH_DLQ`).
//!
//! Two sorts: a rejected submission keeps its raw bytes byte for byte as the
//! payload (the reason travels in headers), and a dead job (poison, max
//! deliveries) carries a JSON document with its last record, recent events
//! and ticket. Both are published with a `Nats-Msg-Id`, so two reapers or a
//! redelivered ticket produce one dead letter.

use async_nats::jetstream::{self, message::PublishMessage};
use async_nats::HeaderMap;
use bytes::Bytes;
use futures::StreamExt;
use leasehold_core::JobRecord;
use leasehold_proto::JobEvent;
use serde::{Deserialize, Serialize};

use crate::{Conn, Layout, StoreError};

pub const CLASS_HEADER: &str = "Lh-Class";
pub const REASON_HEADER: &str = "Lh-Reason";
pub const KIND_HEADER: &str = "Lh-Kind";

/// The dead-letter stream.
#[derive(Clone)]
pub struct Dlq {
    js: jetstream::Context,
    layout: Layout,
}

/// The JSON body of a dead job's letter.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeadJob {
    pub record: JobRecord,
    pub recent_events: Vec<JobEvent>,
    /// The ticket's payload (UTF-8 text), when it could be loaded.
    pub ticket: Option<String>,
}

/// One dead letter as read back.
#[derive(Debug, Clone, Serialize)]
pub struct Letter {
    pub seq: u64,
    pub kind: String,
    pub job_id: Option<String>,
    pub class: String,
    pub reason: String,
    pub at: String,
    #[serde(skip)]
    pub payload: Bytes,
    #[serde(skip)]
    pub headers: HeaderMap,
}

impl Dlq {
    pub fn new(conn: &Conn) -> Self {
        Dlq {
            js: conn.js.clone(),
            layout: conn.layout.clone(),
        }
    }

    /// Keeps a refused submission: raw bytes as they came, reason in headers.
    #[allow(clippy::too_many_arguments)]
    pub async fn reject(
        &self,
        kind: &str,
        job_id: Option<&str>,
        code: &str,
        message: &str,
        raw: Bytes,
        original: Option<&HeaderMap>,
        dedupe: &str,
    ) -> Result<u64, StoreError> {
        let mut m = PublishMessage::build().payload(raw).message_id(dedupe);
        if let Some(h) = original {
            for (name, values) in h.iter() {
                let n = name.to_string();
                if n.eq_ignore_ascii_case("Nats-Msg-Id") || n.starts_with("Nats-Expected") {
                    continue;
                }
                for v in values {
                    m = m.header(n.as_str(), v.as_str());
                }
            }
        }
        m = m
            .header(CLASS_HEADER, "rejected")
            .header(
                REASON_HEADER,
                single_line(&format!("{code}: {message}")).as_str(),
            )
            .header(KIND_HEADER, kind);
        if let Some(id) = job_id {
            m = m.header(crate::work::JOB_ID_HEADER, id);
        }
        self.publish(self.layout.dlq_subject(&subject_token(kind)), m)
            .await
    }

    /// Dead-letters a job (once per job and epoch, whoever calls).
    pub async fn dead(
        &self,
        rec: &JobRecord,
        class: &str,
        reason: &str,
        recent_events: Vec<JobEvent>,
        ticket: Option<Bytes>,
    ) -> Result<u64, StoreError> {
        let id = format!("{}:dead:{}", rec.id, rec.epoch);
        self.dead_with_id(rec, class, reason, recent_events, ticket, &id)
            .await
    }

    async fn publish(&self, subject: String, m: PublishMessage) -> Result<u64, StoreError> {
        let ack = self
            .js
            .send_publish(subject, m)
            .await
            .map_err(|e| StoreError::nats("publish dead letter", e))?
            .await
            .map_err(|e| StoreError::nats("publish dead letter", e))?;
        Ok(ack.sequence)
    }

    async fn stream(&self) -> Result<jetstream::stream::Stream, StoreError> {
        self.js
            .get_stream(self.layout.dlq_stream())
            .await
            .map_err(|e| StoreError::nats("DLQ stream", e))
    }

    /// One page of dead letters, oldest first, after sequence `after`:
    /// filtered by kind on the server (its subject), read headers only (the
    /// payloads stay on the server), at most `limit`. The second value says
    /// whether more follow.
    pub async fn page(
        &self,
        kind: Option<&str>,
        class: Option<&str>,
        after: u64,
        limit: usize,
    ) -> Result<(Vec<Letter>, bool), StoreError> {
        let stream = self.stream().await?;
        let filter = match kind {
            Some(k) => self.layout.dlq_subject(&subject_token(k)),
            None => self.layout.dlq_wildcard(),
        };
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                filter_subject: filter,
                headers_only: true,
                deliver_policy: jetstream::consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: after + 1,
                },
                ..Default::default()
            })
            .await
            .map_err(|e| StoreError::nats("read DLQ", e))?;
        let mut pending = consumer.cached_info().num_pending;
        let mut out = Vec::new();
        if pending == 0 {
            return Ok((out, false));
        }
        let mut msgs = consumer
            .messages()
            .await
            .map_err(|e| StoreError::nats("read DLQ", e))?;
        while pending > 0 {
            let Ok(Some(Ok(m))) =
                tokio::time::timeout(std::time::Duration::from_secs(10), msgs.next()).await
            else {
                return Err(StoreError::failed("reading the DLQ stalled"));
            };
            let info = m.info().map_err(|e| StoreError::nats("DLQ info", e))?;
            pending = info.pending;
            let at = leasehold_core::time::rfc3339(std::time::SystemTime::from(info.published));
            let l = self.letter(
                info.stream_sequence,
                &m.subject,
                m.headers.clone().unwrap_or_default(),
                Bytes::new(),
                at,
            );
            if class.is_some_and(|c| c != l.class) {
                continue;
            }
            if out.len() == limit {
                return Ok((out, true));
            }
            out.push(l);
        }
        Ok((out, false))
    }

    /// The DLQ stream's last sequence (0 when it never held a letter):
    /// where an operation over "the letters there now" stops.
    pub async fn last_seq(&self) -> Result<u64, StoreError> {
        let mut s = self.stream().await?;
        Ok(s.info()
            .await
            .map_err(|e| StoreError::nats("DLQ info", e))?
            .state
            .last_sequence)
    }

    /// How many dead letters there are.
    pub async fn count(&self) -> Result<u64, StoreError> {
        let mut s = self.stream().await?;
        Ok(s.info()
            .await
            .map_err(|e| StoreError::nats("DLQ info", e))?
            .state
            .messages)
    }

    /// Every dead letter, oldest first, payloads included (tests and small DLQs).
    pub async fn list(&self) -> Result<Vec<Letter>, StoreError> {
        let stream = self.stream().await?;
        let msgs = crate::read::read_once(
            &stream,
            vec![self.layout.dlq_wildcard()],
            jetstream::consumer::DeliverPolicy::All,
            "reading the DLQ",
        )
        .await?;
        let mut out = Vec::with_capacity(msgs.len());
        for m in msgs {
            let info = m.info().map_err(|e| StoreError::nats("DLQ info", e))?;
            let at = leasehold_core::time::rfc3339(std::time::SystemTime::from(info.published));
            out.push(self.letter(
                info.stream_sequence,
                &m.subject,
                m.headers.clone().unwrap_or_default(),
                m.payload.clone(),
                at,
            ));
        }
        Ok(out)
    }

    /// One dead letter by sequence.
    pub async fn get(&self, seq: u64) -> Result<Option<Letter>, StoreError> {
        match self.stream().await?.get_raw_message(seq).await {
            Ok(m) => {
                let at = leasehold_core::time::rfc3339(std::time::SystemTime::from(m.time));
                Ok(Some(self.letter(seq, &m.subject, m.headers, m.payload, at)))
            }
            Err(e) if e.kind() == jetstream::stream::RawMessageErrorKind::NoMessageFound => {
                Ok(None)
            }
            Err(e) => Err(StoreError::nats("get dead letter", e)),
        }
    }

    /// Deletes one dead letter.
    pub async fn delete(&self, seq: u64) -> Result<bool, StoreError> {
        self.stream()
            .await?
            .delete_message(seq)
            .await
            .map_err(|e| StoreError::nats("delete dead letter", e))
    }

    /// Deletes every dead letter; returns how many.
    pub async fn purge(&self) -> Result<u64, StoreError> {
        let r = self
            .stream()
            .await?
            .purge()
            .await
            .map_err(|e| StoreError::nats("purge DLQ", e))?;
        Ok(r.purged)
    }

    fn letter(
        &self,
        seq: u64,
        subject: &str,
        headers: HeaderMap,
        payload: Bytes,
        at: String,
    ) -> Letter {
        let get = |k: &str| headers.get(k).map(|v| v.as_str().to_string());
        let kind = get(KIND_HEADER)
            .unwrap_or_else(|| subject.rsplit('.').next().unwrap_or_default().to_string());
        Letter {
            seq,
            kind,
            job_id: get(crate::work::JOB_ID_HEADER),
            class: get(CLASS_HEADER).unwrap_or_default(),
            reason: get(REASON_HEADER).unwrap_or_default(),
            at,
            payload,
            headers,
        }
    }
}

fn single_line(s: &str) -> String {
    s.replace(['\r', '\n'], " ")
}

/// A kind as a single subject token (an unknown kind may hold anything).
fn subject_token(kind: &str) -> String {
    let t: String = kind
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if t.is_empty() {
        "_".into()
    } else {
        t
    }
}

/// Dead letters with a caller-chosen dedupe id.
impl Dlq {
    /// [`Dlq::dead`] deduplicated by `msg_id` instead of `<job>:dead:<epoch>`:
    /// the reaper names each death (`<job>:dead:<epoch>:<marked_at>`), so a
    /// replayed job that dies again before any claim (same epoch) still gets
    /// its own letter, while replicas finishing the same death publish one.
    pub async fn dead_with_id(
        &self,
        rec: &JobRecord,
        class: &str,
        reason: &str,
        recent_events: Vec<JobEvent>,
        ticket: Option<Bytes>,
        msg_id: &str,
    ) -> Result<u64, StoreError> {
        let body = DeadJob {
            record: rec.clone(),
            recent_events,
            ticket: ticket.and_then(|t| String::from_utf8(t.to_vec()).ok()),
        };
        let m = PublishMessage::build()
            .payload(serde_json::to_vec(&body).expect("serializes").into())
            .message_id(msg_id)
            .header(CLASS_HEADER, class)
            .header(REASON_HEADER, single_line(reason).as_str())
            .header(KIND_HEADER, rec.kind.as_str())
            .header(crate::work::JOB_ID_HEADER, rec.id.as_str())
            .header("Content-Type", "application/json");
        self.publish(self.layout.dlq_subject(&subject_token(&rec.kind)), m)
            .await
    }
}
