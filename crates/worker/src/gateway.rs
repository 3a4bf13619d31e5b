//! The worker's gateway: what no stream answers.
//!
//! - Submissions on `lh.submit.<kind>` (or a lane of it,
//!   `lh.submit.<kind>.<tenant>.<priority>`) for a kind the work stream does not
//!   hold are captured by nobody else: the gateway rejects them (record when
//!   the id is known, raw bytes to `lh.dlq.<kind>`) and replies with the error.
//! - Request/reply submitters of a known kind get the stream's publish ack
//!   first; when the submission is bad, the gateway sends the precise error
//!   as a second reply on the same inbox (`nats req --replies 2`, or
//!   `leasehold submit`, show it). The rejection itself is recorded by the
//!   worker that consumes the ticket.
//! - `lh.cancel.<job_id>` requests are answered with whether the
//!   cancellation was recorded.
//! - `lh.enqueued.<seq>` requests (from `leasehold submit`, after the
//!   stream's publish ack) create the queued record of the ticket at that
//!   sequence, read back from the work stream: the job is visible (and can
//!   be cancelled) before a worker is free to claim it, and a submitter
//!   needs no write permission on `lh_jobs`. Only a stored ticket gets a
//!   record, and exactly the one its claim would create.
//!
//! Every subscription uses a queue group, so one worker of the fleet answers.

use std::time::SystemTime;

use bytes::Bytes;
use futures::StreamExt;
use leasehold_core::machine;
use leasehold_core::spec::{self, Kinds, Submission};
use leasehold_store::dlq::Dlq;
use leasehold_store::events::{self, Events};
use leasehold_store::work::{self, Enqueued, Work};
use leasehold_store::{Conn, Jobs, JobsError};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// The gateway's subscriptions, made before the worker reports started so
/// that no request finds nobody listening.
pub struct Subscriptions {
    /// `lh.submit.*` and `lh.submit.*.*.*` (every lane), merged.
    submit: futures::stream::SelectAll<async_nats::Subscriber>,
    cancel: async_nats::Subscriber,
    enqueued: async_nats::Subscriber,
}

/// Subscribes (queue groups) and waits until the server knows the interest.
pub async fn subscribe(conn: &Conn) -> anyhow::Result<Subscriptions> {
    let l = &conn.layout;
    let mut submit = futures::stream::SelectAll::new();
    for subject in l.gateway_submit_wildcards() {
        submit.push(
            conn.client
                .queue_subscribe(subject, format!("{}-gateway", l.prefix))
                .await?,
        );
    }
    let cancel = conn
        .client
        .queue_subscribe(l.cancel_wildcard(), format!("{}-cancel", l.prefix))
        .await?;
    let enqueued = conn
        .client
        .queue_subscribe(l.enqueued_wildcard(), format!("{}-gateway", l.prefix))
        .await?;
    // A flush only writes the SUBs to the socket; a request on the same
    // connection returns only after the server processed everything before
    // it, so the interest is registered when this returns.
    conn.js.query_account().await?;
    Ok(Subscriptions {
        submit,
        cancel,
        enqueued,
    })
}

/// Serves until `shutdown` fires.
pub async fn run(gw: Gateway, subs: Subscriptions, shutdown: CancellationToken) {
    let Gateway {
        conn, jobs, events, ..
    } = &gw;
    let l = conn.layout.clone();
    let signals = leasehold_store::signals::Signals::new(conn);
    let Subscriptions {
        mut submit,
        mut cancel,
        mut enqueued,
    } = subs;
    // The kinds the work stream captures; anything else is unknown.
    let mut captured = Captured::default();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            Some(m) = submit.next() => {
                // A lane that does not parse still names its kind: the
                // stream stores it when the kind is set up (its consumer
                // rejects it), else the gateway rejects it here.
                let Some(kind) = l.kind_token_of_submit_subject(&m.subject).map(str::to_string) else { continue };
                match captured.has(conn, m.subject.as_str()).await {
                    Ok(stream_has_it) => {
                        let set_up: Vec<String> = captured
                            .subjects
                            .iter()
                            .filter_map(|x| l.kind_of_submit_subject(x).map(str::to_string))
                            .collect();
                        gw.on_submission(&kind, stream_has_it, &set_up, m).await
                    }
                    Err(e) => {
                        // Never reject what the stream may have stored.
                        tracing::warn!(subject = %m.subject, error = %e, "gateway: cannot read the work stream's subjects; not judging this submission");
                        if let Some(reply) = m.reply {
                            let body = json!({"error": {"code": 503, "class": "unavailable", "description": format!("cannot tell whether kind {kind:?} is set up ({e}); if the stream stored it, it runs; otherwise submit again")}});
                            let _ = conn.client.publish(reply, body.to_string().into()).await;
                        }
                    }
                }
            }
            Some(m) = cancel.next() => {
                let id = m.subject.rsplit('.').next().unwrap_or_default().to_string();
                let (reply, owners) = leasehold_store::jobs::cancel(jobs, events, &signals, &id).await;
                // Each owner stops at once when told; if it is not
                // reachable now, its next write sees the request, and a
                // claim, requeue, hand-back or re-offer honours it.
                for (job, w) in owners {
                    let _ = conn
                        .client
                        .publish(l.worker_subject(&w, "cancel"), job.into())
                        .await;
                }
                if let Some(r) = m.reply {
                    let _ = conn.client.publish(r, reply.to_string().into()).await;
                }
            }
            Some(m) = enqueued.next() => {
                let reply = match l.seq_of_enqueued_subject(&m.subject) {
                    Some(seq) => gw.record_ticket(seq).await.answer(Some(seq)),
                    None => Enqueued::Invalid { id: None, error: format!("{} names no ticket sequence", m.subject) }.answer(None),
                };
                if let Some(r) = m.reply {
                    let _ = conn.client.publish(r, reply.to_string().into()).await;
                }
            }
        }
    }
}

/// The subjects the work stream captures, as last read. A subject that is
/// not among them is read again before it is judged unknown (a kind set up
/// while the fleet runs); what is among them is trusted for
/// [`Captured::FRESH_FOR`] (a kind pruned meanwhile).
#[derive(Default)]
pub(crate) struct Captured {
    subjects: Vec<String>,
    read_at: Option<std::time::Instant>,
}

impl Captured {
    const FRESH_FOR: std::time::Duration = std::time::Duration::from_secs(2);
    /// Attempts at reading the stream's subjects before giving up.
    const TRIES: u32 = 3;

    /// Whether the work stream stores `subject`, from a read no older than
    /// [`Captured::FRESH_FOR`] if it says yes, and a fresh one if it says no.
    pub(crate) async fn has(&mut self, conn: &Conn, subject: &str) -> Result<bool, String> {
        let fresh = self.read_at.is_some_and(|t| t.elapsed() < Self::FRESH_FOR);
        if fresh && self.captures(subject) {
            return Ok(true);
        }
        let mut last = String::new();
        let mut backoff = leasehold_core::retry::Backoff::new(
            std::time::Duration::from_millis(200),
            std::time::Duration::from_secs(1),
        );
        for _ in 0..Self::TRIES {
            match Self::read(conn).await {
                Ok(v) => {
                    self.subjects = v;
                    self.read_at = Some(std::time::Instant::now());
                    return Ok(self.captures(subject));
                }
                Err(e) => last = e,
            }
            tokio::time::sleep(backoff.pause()).await;
        }
        Err(last)
    }

    /// Whether one of the stream's subjects (a lane's is a wildcard,
    /// `lh.submit.<kind>.*.*`) captures `subject`.
    fn captures(&self, subject: &str) -> bool {
        self.subjects
            .iter()
            .any(|f| leasehold_store::layout::subject_matches(f, subject))
    }

    async fn read(conn: &Conn) -> Result<Vec<String>, String> {
        let mut s = conn
            .js
            .get_stream(conn.layout.work_stream())
            .await
            .map_err(|e| e.to_string())?;
        s.info()
            .await
            .map(|i| i.config.subjects.clone())
            .map_err(|e| e.to_string())
    }
}

/// What the gateway needs to record rejections.
pub struct Gateway {
    pub conn: Conn,
    pub jobs: Jobs,
    pub events: Events,
    pub dlq: Dlq,
    pub work: Work,
    pub active: leasehold_store::index::Active,
    pub kinds: Kinds,
    /// The largest submission a claim accepts (`--max-submission-bytes`).
    pub max_submission_bytes: usize,
}

impl Gateway {
    /// [`Work::record_ticket`] with this worker's kinds, size limit and
    /// trace choice.
    async fn record_ticket(&self, seq: u64) -> Enqueued {
        self.work
            .record_ticket(
                &self.jobs,
                &self.active,
                seq,
                &self.kinds,
                self.max_submission_bytes,
                |h, id, kind| crate::service::claim::job_traceparent(Some(h), id, kind),
            )
            .await
    }

    async fn on_submission(
        &self,
        kind: &str,
        stream_has_it: bool,
        set_up: &[String],
        m: async_nats::Message,
    ) {
        let Gateway {
            conn,
            jobs,
            events,
            dlq,
            kinds,
            ..
        } = self;
        // A ticket leasehold itself published (a re-offer, a retry, a replay)
        // names its job in Lh-Job-Id; its publisher waits for the stream's
        // ack on that inbox, and an answer from here would race it.
        let ours = m
            .headers
            .as_ref()
            .is_some_and(|h| h.get(work::JOB_ID_HEADER).is_some());
        // A stored ticket is judged by its claim (and by `record_ticket`
        // when a submitter asks): it is decoded here only when a waiting
        // submitter can be told at once.
        if stream_has_it && (ours || m.reply.is_none()) {
            return;
        }
        let hint = work::ticket_job_id(m.headers.as_ref());
        let ct = work::content_type(m.headers.as_ref());
        let sub = Submission {
            kind,
            payload: &m.payload,
            msg_id: hint.as_deref(),
            content_type: ct.as_deref(),
            stream_seq: 0,
            received_at: SystemTime::now(),
        };
        let result = work::decode_ticket(&conn.layout, &m.subject, sub, kinds, usize::MAX);
        if stream_has_it {
            // The ticket is stored; its consumer records any rejection. Only
            // tell a waiting submitter now.
            if let (Err(rej), Some(reply)) = (&result, &m.reply) {
                if !matches!(rej.error, spec::SubmitError::InvalidId(ref s) if s.is_empty()) {
                    // The second reply: sent once the stream holds the
                    // ticket, so it never beats the stream's ack to a
                    // submitter that takes the first reply as its ack.
                    let (work, client) = (self.work.clone(), conn.client.clone());
                    let (reply, body) = (reply.clone(), error_reply(rej.id.as_deref(), &rej.error));
                    let (subject, payload) = (m.subject.to_string(), m.payload.clone());
                    tokio::spawn(async move {
                        work.wait_stored(&subject, &payload, SECOND_REPLY_PATIENCE)
                            .await;
                        let _ = client.publish(reply, body).await;
                    });
                }
            }
            return;
        }
        // Nothing stores this subject: the gateway is the only one who sees it.
        let error = spec::SubmitError::UnknownKind {
            kind: kind.to_string(),
            known: set_up.join(", "),
        };
        let id = match &result {
            Ok(a) => Some(a.id.clone()),
            Err(r) => r.id.clone(),
        };
        let message = error.to_string();
        // A submitter waiting for the answer (`leasehold submit`, a request)
        // is told, and nothing is kept: its bytes are its own, and its id
        // stays free for when the kind is set up.
        if let Some(reply) = &m.reply {
            let _ = conn
                .client
                .publish(reply.clone(), error_reply(id.as_deref(), &error))
                .await;
            return;
        }
        if let Some(id) = &id {
            let rec =
                machine::rejected_record(id, kind, "rejected", &message, 0, SystemTime::now());
            match jobs.create(&rec).await {
                Ok(_) => {
                    let ev = events::event(
                        id,
                        0,
                        "rejected",
                        None,
                        json!({"error": message, "code": error.code(), "kind": kind}),
                    );
                    let _ = events
                        .publish(&ev, Some(&format!("{id}:rejected:unknown-kind")))
                        .await;
                }
                Err(JobsError::Exists(_)) => {}
                Err(e) => tracing::warn!(error = %e, "gateway: cannot record the rejection"),
            }
        }
        let dedupe = format!(
            "rejected:{kind}:{}",
            id.clone()
                .unwrap_or_else(|| uuid::Uuid::new_v4().to_string())
        );
        if let Err(e) = dlq
            .reject(
                kind,
                id.as_deref(),
                error.code(),
                &message,
                m.payload.clone(),
                m.headers.as_ref(),
                &dedupe,
            )
            .await
        {
            tracing::warn!(error = %e, "gateway: cannot dead-letter a submission of an unknown kind");
        }
        if let Some(reply) = m.reply {
            let _ = conn
                .client
                .publish(reply, error_reply(id.as_deref(), &error))
                .await;
        }
    }
}

/// How long the gateway waits for the stream to hold a bad submission
/// before it sends its error anyway (a ticket consumed at once is never
/// seen as the subject's last message).
const SECOND_REPLY_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

fn error_reply(id: Option<&str>, e: &spec::SubmitError) -> Bytes {
    json!({"error": {"code": 400, "class": "rejected", "reason": e.code(), "description": e.to_string()}, "id": id, "status": "rejected"})
        .to_string()
        .into()
}
