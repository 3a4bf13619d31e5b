//! Operators' actions, one function each, shared by the CLI and the
//! console: asking for a cancellation, queueing a parked or dead job again
//! (its ticket first), replaying a rejected submission (its bytes or a
//! corrected one, validated first), ending a parked job, and the `action`
//! event that records who did what.
//!
//! Every error is a sentence saying what to do next ([`OpError`]); callers
//! print it as it is.

use std::time::{Duration, SystemTime};

use leasehold_core::machine::{self, status_of, TransitionError};
use leasehold_core::{JobRecord, JobSpec, Status};
use serde_json::{json, Value};

use leasehold_store::dlq::{DeadJob, Letter};
use leasehold_store::events::{self, Events};
use leasehold_store::index::Active;
use leasehold_store::signals::Signals;
use leasehold_store::work::{ticket_first, Work};
use leasehold_store::{jobs, Conn, Jobs, JobsError, Versioned};

/// A refused or failed action, said so that the operator knows what to do.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct OpError(pub String);

impl OpError {
    fn context(what: impl std::fmt::Display, cause: impl std::fmt::Display) -> Self {
        OpError(format!("{what}: {cause}"))
    }
}

impl From<leasehold_store::StoreError> for OpError {
    fn from(e: leasehold_store::StoreError) -> Self {
        OpError(e.to_string())
    }
}

impl From<JobsError> for OpError {
    fn from(e: JobsError) -> Self {
        OpError(e.to_string())
    }
}

/// A job-record error with what to do about it.
pub fn explain(e: JobsError, id: &str) -> OpError {
    OpError(match e {
        JobsError::NotFound(_) => format!("no job {id}; `leasehold list` shows the jobs"),
        JobsError::Transition(t) => {
            format!("job {id}: {t}; `leasehold status {id}` shows its record")
        }
        JobsError::Conflict(_) => {
            format!("job {id} kept changing while this ran; run the command again")
        }
        other => format!("job {id}: check NATS and run the command again: {other}"),
    })
}

/// Why a cancellation was not recorded although nobody answered on
/// `lh.cancel.<id>`, and the JSON answer either way.
pub struct CancelAnswer {
    /// `{"id", "recorded", "outcome", "status"?, "error"?}`.
    pub reply: Value,
    /// Set when no worker answered and this connection's user may not write
    /// records: what the server refused.
    pub refused: Option<String>,
}

/// Asks for the cancellation of `id` on `lh.cancel.<id>` (a worker records
/// it and tells the owner). When no worker answers within 3 s, records it
/// through the same transition itself, unless NATS refuses this user the
/// write (it only says so on the side: the write itself would time out).
pub async fn request_cancel(conn: &Conn, id: &str) -> Result<CancelAnswer, OpError> {
    let subject = conn.layout.cancel_subject(id);
    let ask = conn.client.request(subject.clone(), "".into());
    let unanswered = match tokio::time::timeout(Duration::from_secs(3), ask).await {
        Ok(Ok(m)) => {
            let reply = serde_json::from_slice(&m.payload)
                .map_err(|e| OpError::context("the cancel answer is not JSON", e))?;
            return Ok(CancelAnswer {
                reply,
                refused: None,
            });
        }
        unanswered => unanswered,
    };
    let why = match unanswered {
        Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
            "no worker is running".to_string()
        }
        Ok(Err(e)) => format!("the request failed: {e}"),
        _ => "no worker answered within 3s".to_string(),
    };
    let jobs = Jobs::open(conn).await?;
    let events = Events::new(conn);
    let signals = Signals::new(conn);
    let records = format!("$KV.{}.", conn.layout.jobs_bucket());
    tokio::select! {
        (reply, _) = jobs::cancel(&jobs, &events, &signals, id) => Ok(CancelAnswer { reply, refused: None }),
        refusal = conn.link.refused(&records) => Ok(CancelAnswer {
            reply: json!({"id": id, "recorded": false, "outcome": "refused", "error": refusal}),
            refused: Some(format!(
                "{why} on {subject}, and this NATS user may not write job records ({refusal}): \
                 nothing was recorded; cancel again once a worker runs, or as a user with the operator's permissions"
            )),
        }),
    }
}

/// Queues the existing job `id` again with a fresh budget, its ticket
/// first: the ticket is published (its id derived from the record's
/// revision, so a re-run after any failure publishes the same one), then
/// the record says `queued` naming it, then the index lists it. `allowed`
/// refuses the states this action does not requeue; `spec` replaces the
/// job's spec. Shared by `dlq replay` and `review resume`.
pub async fn requeue_ticket_first<F>(
    conn: &Conn,
    jobs: &Jobs,
    id: &str,
    allowed: F,
    reason: &str,
    nonce: &str,
    spec: Option<&JobSpec>,
) -> Result<(Versioned<JobRecord>, u64), OpError>
where
    F: Fn(&JobRecord) -> Result<(), TransitionError>,
{
    let cur = jobs
        .get(id)
        .await
        .map_err(|e| explain(e, id))?
        .ok_or_else(|| OpError(format!("no job {id}")))?;
    allowed(&cur.value).map_err(|e| explain(JobsError::Transition(e), id))?;
    let mut base = cur.value.clone();
    if let Some(s) = spec {
        leasehold_store::jobs::replace_spec(&mut base, s);
    }
    if base.input_beside && base.spec.as_ref().is_none_or(|s| s.input.is_empty()) {
        return Err(OpError(format!(
            "job {id}'s input (over 16 KiB, kept beside its record) is gone from the payloads bucket; nothing changed: requeue it with a corrected submission (`dlq replay SEQ --spec FILE`)"
        )));
    }
    let ticket = async {
        Work::new(conn)
            .reissue(&base, reason, &format!("{nonce}-{}", cur.revision))
            .await
            .map(|p| p.seq)
            .map_err(|e| {
                OpError::context(
                    format!("the ticket of job {id} could not be published; nothing changed: run this again"),
                    e,
                )
            })
    };
    let write = async |ticket: u64| {
        jobs.transition(id, |c| {
            allowed(c)?;
            let mut r = machine::requeue_fresh(c, SystemTime::now(), ticket)?;
            if let Some(s) = spec {
                // The record's own flags and key were for the old input.
                leasehold_store::jobs::replace_spec(&mut r, s);
            }
            Ok(Some(r))
        })
        .await
        .map(|v| Some((v, ticket)))
        .map_err(|e| explain(e, id))
    };
    // Waiting again: the index lists it (no longer as parked or dead), so
    // the sweep replaces a ticket a worker dropped before this write.
    let index = async |(v, _): &(Versioned<JobRecord>, u64)| {
        Active::open(conn).await?.reconcile(&v.value).await?;
        Ok(())
    };
    let written = ticket_first(ticket, write, index).await?;
    Ok(written.expect("a requeue writes or fails"))
}

/// Refuses anything but a parked job with a message that says what to do.
pub fn only_parked(rec: &JobRecord, action: &'static str) -> Result<(), TransitionError> {
    if rec.status == Status::Parked.as_str() {
        return Ok(());
    }
    Err(TransitionError::NotAllowed {
        status: rec.status.clone(),
        action,
        allowed: "parked (`leasehold review list` shows the parked jobs)",
    })
}

/// `review resume`: the parked job queued again (fresh attempt budget, its
/// checkpoints kept), with a `progress` event `resumed`. Returns the new
/// ticket's sequence.
///
/// With `answer`, a person's answer is first sent as the job's signal
/// `lh-answer`, from `sender` (`ana via cli`), naming the park it answers
/// (the step and the sequence of the job's last `parked` event), and
/// written as its `answer` event (its timeline), so the attempt the
/// requeue starts finds it (an SDK kind's `ctx.park`, a remote kind's
/// `park` op, at that park only, return it); a requeue that fails leaves
/// the job parked, and resuming again answers again (the last one is the
/// one).
pub async fn review_resume(
    conn: &Conn,
    jobs: &Jobs,
    id: &str,
    answer: Option<&serde_json::Value>,
    sender: Option<&str>,
) -> Result<u64, OpError> {
    if let Some(answer) = answer {
        let cur = jobs
            .get(id)
            .await
            .map_err(|e| explain(e, id))?
            .ok_or_else(|| OpError(format!("no job {id}")))?;
        only_parked(&cur.value, "resume").map_err(|e| explain(e.into(), id))?;
        let (step, parked_seq) = parked_at(conn, id).await?;
        Signals::new(conn)
            .send(
                id,
                leasehold_store::signals::ANSWER,
                &json!({"step": step, "parked_seq": parked_seq, "answer": answer}),
                None,
                sender,
            )
            .await
            .map_err(|e| OpError(format!("sending the answer of job {id}: {e}")))?;
        let ev = events::event(
            id,
            cur.value.epoch,
            "answer",
            None,
            json!({"answer": answer, "step": step}),
        );
        Events::new(conn)
            .publish(&ev, None)
            .await
            .map_err(|e| OpError(format!("recording the answer of job {id}: {e}")))?;
    }
    let (v, ticket) = requeue_ticket_first(
        conn,
        jobs,
        id,
        |cur| only_parked(cur, "resume"),
        "resume",
        "r",
        None,
    )
    .await?;
    let ev = events::event(
        id,
        v.value.epoch,
        "progress",
        None,
        json!({"phase": "resumed", "ticket_seq": ticket}),
    );
    let _ = Events::new(conn)
        .publish(&ev, Some(&format!("{id}:resumed:{ticket}")))
        .await;
    Ok(ticket)
}

/// What [`send_signal`] did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SignalSent {
    pub id: String,
    pub name: String,
    /// The signal's sequence in the signal stream.
    pub seq: u64,
    /// A send with the same dedupe id stored it already (within an hour):
    /// this one stored nothing.
    pub duplicate: bool,
    /// The job's status when it was sent.
    pub status: String,
    /// Whether the job was waiting for this very signal (its waker gives
    /// it a ticket now); otherwise the signal is kept until a wait of the
    /// job takes it.
    pub waited_for: bool,
}

/// Sends signal `name` with `data` to job `id` (`leasehold signal`, the
/// console's form): stored in the signal stream, where the job's next
/// wait for `name` takes it (one sent before the wait is kept for it);
/// a waiting job is woken by the workers' signal waker. `dedupe` makes a
/// send tried again store one signal; `sender` names who sent it (kept
/// with the signal: an `action` event is not written, since a running
/// owner's event fence would take it for a newer owner). Refused, with nothing stored, for a
/// name that is not a signal name, an unknown job, or a finished one
/// (nothing would ever take it).
pub async fn send_signal(
    conn: &Conn,
    jobs: &Jobs,
    id: &str,
    name: &str,
    data: &Value,
    dedupe: Option<&str>,
    sender: Option<&str>,
) -> Result<SignalSent, OpError> {
    if !leasehold_core::spec::valid_job_id(id) {
        return Err(OpError(format!(
            "invalid job id {id:?}: job ids are 1-128 letters, digits, '-', '_' or '='"
        )));
    }
    if !leasehold_core::spec::valid_signal_name(name) {
        return Err(OpError(format!(
            "invalid signal name {name:?}: use {}",
            leasehold_core::spec::SIGNAL_NAME_RULE
        )));
    }
    let cur = jobs
        .get(id)
        .await
        .map_err(|e| explain(e, id))?
        .ok_or_else(|| {
            OpError(format!(
                "no job {id}; `leasehold list` shows the jobs (nothing sent)"
            ))
        })?;
    let rec = cur.value;
    if status_of(&rec).is_some_and(|s| s.is_terminal()) {
        return Err(OpError(format!(
            "job {id} is {}: no wait of it will take a signal (nothing sent)",
            rec.status
        )));
    }
    let sent = Signals::new(conn)
        .send(id, name, data, dedupe, sender)
        .await
        .map_err(|e| OpError(format!("sending signal `{name}` to job {id}: {e}")))?;
    Ok(SignalSent {
        id: id.to_string(),
        name: name.to_string(),
        seq: sent.seq,
        duplicate: sent.duplicate,
        waited_for: machine::signal_of(&rec).is_some_and(|(n, _)| n == name),
        status: rec.status,
    })
}

/// One signal kept for a job, as `leasehold signal ID --list` shows it:
/// the signal and the wait that took it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SignalKept {
    #[serde(flatten)]
    pub signal: leasehold_store::signals::Signal,
    /// The wait step that took it (`wait:go#0`), `null` when none did yet;
    /// absent when the job's steps could not be read (this NATS user may
    /// not read events with a consumer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub taken_by: Option<Value>,
}

/// The signals kept for job `id` (at most `limit`), in the order sent, and
/// which wait step of the job took each.
pub async fn signals_kept(conn: &Conn, id: &str, limit: usize) -> Result<Vec<SignalKept>, OpError> {
    let kept = Signals::new(conn)
        .list(id, limit)
        .await
        .map_err(|e| OpError(format!("reading the signals of job {id}: {e}")))?;
    // seq -> the step that recorded it.
    let taken: Option<std::collections::HashMap<u64, String>> = Events::new(conn)
        .read_types(id, &["step"])
        .await
        .ok()
        .map(|steps| {
            steps
                .iter()
                .map(|(_, ev)| ev.data_map())
                .filter(|d| d["id"].as_str().is_some_and(|s| s.starts_with("wait:")))
                .filter_map(|d| {
                    let seq = d.get("result")?.get("seq")?.as_u64()?;
                    Some((seq, d["id"].as_str()?.to_string()))
                })
                .collect()
        });
    Ok(kept
        .into_iter()
        .map(|signal| SignalKept {
            taken_by: taken
                .as_ref()
                .map(|t| t.get(&signal.seq).map_or(Value::Null, |step| json!(step))),
            signal,
        })
        .collect())
}

/// The step a parked job waits at for an answer: the `step` of its last
/// `parked` event (read from the stream's leader), `None` when no step
/// asked (a park for an uncertain effect, a journal mismatch). An answer
/// names it, and only that step, parked before the answer, takes it.
pub async fn parked_step(conn: &Conn, id: &str) -> Result<Option<String>, OpError> {
    Ok(parked_at(conn, id).await?.0)
}

/// [`parked_step`] and the sequence of that `parked` event (0: none).
async fn parked_at(conn: &Conn, id: &str) -> Result<(Option<String>, u64), OpError> {
    let last = Events::new(conn)
        .last_of_type_from_leader(id, "parked")
        .await
        .map_err(|e| OpError(format!("reading the last park of job {id}: {e}")))?;
    Ok(match last {
        Some((seq, ev)) => (
            ev.data_map()
                .get("step")
                .and_then(Value::as_str)
                .map(str::to_string),
            seq,
        ),
        None => (None, 0),
    })
}

/// `review fail`: the parked job ends `failed` with the reviewer's reason
/// (error class `review`). Returns the record.
pub async fn review_fail(
    conn: &Conn,
    jobs: &Jobs,
    id: &str,
    reason: &str,
) -> Result<JobRecord, OpError> {
    if reason.trim().is_empty() {
        return Err(OpError(
            "--reason must say why the job is failed".to_string(),
        ));
    }
    let v = jobs
        .transition(id, |cur| {
            only_parked(cur, "fail")?;
            machine::fail_parked(cur, SystemTime::now(), reason).map(Some)
        })
        .await
        .map_err(|e| explain(e, id))?;
    // A failed child's end reaches its parent first; a failure here leaves
    // the index entry, whose repair announces it.
    leasehold_store::children::announce_end(jobs, &Signals::new(conn), &v.value).await?;
    Active::open(conn).await?.reconcile(&v.value).await?;
    let ev = events::event(
        id,
        v.value.epoch,
        "failed",
        None,
        json!({"class": "review", "message": reason, "kind": v.value.kind}),
    );
    let _ = Events::new(conn)
        .publish(&ev, Some(&format!("{id}:failed:review:{}", v.revision)))
        .await;
    Ok(v.value)
}

/// Requeues a dead job's letter with a fresh budget (`new_spec` replaces
/// its spec), its ticket first: a failure at any step leaves either the
/// dead job (run this again: the same ticket is recognised) or a queued
/// job with a ticket, never a queued job nobody will run. A record that is
/// gone is recreated from the letter. Publishes the `progress` event
/// `replayed`; returns `{"id", "status", "ticket_seq", "replayed_from"}`.
pub async fn replay_dead(
    conn: &Conn,
    jobs: &Jobs,
    l: &Letter,
    new_spec: Option<JobSpec>,
) -> Result<Value, OpError> {
    let body: DeadJob = serde_json::from_slice(&l.payload).map_err(|e| {
        OpError::context(
            format!(
                "letter {} is not a dead job's letter (class {:?}); `leasehold dlq show {}` shows it",
                l.seq, l.class, l.seq
            ),
            e,
        )
    })?;
    let id = body.record.id.clone();
    let refuse = |rec: &JobRecord| -> Result<(), TransitionError> {
        match status_of(rec) {
            Some(Status::Dead | Status::Failed | Status::Rejected | Status::Cancelled) => Ok(()),
            _ => Err(TransitionError::NotAllowed {
                status: rec.status.clone(),
                action: "replay",
                allowed: "dead, failed, rejected or cancelled",
            }),
        }
    };
    let kept = |e: OpError| OpError(format!("letter {} kept: {e}", l.seq));
    let (queued, ticket) = if jobs.get(&id).await.map_err(|e| explain(e, &id))?.is_some() {
        requeue_ticket_first(
            conn,
            jobs,
            &id,
            refuse,
            "replay",
            &l.seq.to_string(),
            new_spec.as_ref(),
        )
        .await
        .map_err(kept)?
    } else {
        // The record is gone (purged bucket): recreate it from the letter,
        // its ticket first too.
        let mut base = body.record.clone();
        if let Some(spec) = &new_spec {
            leasehold_store::jobs::replace_spec(&mut base, spec);
        }
        if base.input_beside && base.spec.as_ref().is_none_or(|s| s.input.is_empty()) {
            return Err(OpError(format!(
                "job {id}'s record is gone and its input (over 16 KiB) was kept beside it, not in the letter; nothing changed, letter {} kept: replay it with a corrected submission (`--spec FILE`)",
                l.seq
            )));
        }
        let ticket = async {
            Work::new(conn)
                .reissue(&base, "replay", &format!("{}-0", l.seq))
                .await
                .map(|p| p.seq)
                .map_err(|e| OpError::context(format!("the ticket of job {id} could not be published; nothing changed, letter {} kept: run this again", l.seq), e))
        };
        let write = async |ticket: u64| {
            let rec = machine::requeue_fresh(&base, SystemTime::now(), ticket)
                .map_err(|e| explain(JobsError::Transition(e), &id))?;
            let revision = jobs.create(&rec).await.map_err(|e| explain(e, &id))?;
            Ok(Some((
                Versioned {
                    value: rec,
                    revision,
                },
                ticket,
            )))
        };
        let index = async |(v, _): &(Versioned<JobRecord>, u64)| {
            Active::open(conn).await?.reconcile(&v.value).await?;
            Ok(())
        };
        ticket_first(ticket, write, index)
            .await?
            .expect("a replay writes or fails")
    };
    let ev = events::event(
        &id,
        queued.value.epoch,
        "progress",
        None,
        json!({"phase": "replayed", "dlq_seq": l.seq, "ticket_seq": ticket, "corrected": new_spec.is_some()}),
    );
    let _ = Events::new(conn)
        .publish(&ev, Some(&format!("{id}:replayed:{ticket}")))
        .await;
    Ok(json!({"id": id, "status": "queued", "ticket_seq": ticket, "replayed_from": l.seq}))
}

/// The built-in validation of `payload` as a submission of `kind` under
/// `id`, as a worker's gateway would judge it (any kind is taken as known).
pub fn validate_submission(
    kind: &str,
    payload: &[u8],
    id: Option<&str>,
    content_type: Option<&str>,
) -> Result<leasehold_core::spec::Accepted, leasehold_core::spec::Rejected> {
    use leasehold_core::spec::{self, Kinds, Submission};
    let sub = Submission {
        kind,
        payload,
        msg_id: id,
        content_type,
        stream_seq: 0,
        received_at: SystemTime::now(),
    };
    spec::decode(
        sub,
        &Kinds::default().with_open(kind),
        spec::DEFAULT_MAX_BYTES,
    )
}

/// What [`replay_rejected`] sent.
#[derive(Debug, Clone)]
pub struct RejectedReplay {
    /// The job id the letter names, if any.
    pub id: Option<String>,
    /// The work stream's sequence of the resubmission.
    pub ticket_seq: u64,
    /// The stream recognised the resubmission (replayed recently already).
    pub duplicate: bool,
    /// The validation refused the bytes and they were sent anyway (`force`).
    pub forced: Option<String>,
    /// A `rejected` record of the id was queued again first.
    pub requeued_record: bool,
    /// When the resubmission was published (for [`accepted_by_a_worker`]).
    pub sent_at: SystemTime,
}

/// Publishes a rejected submission's raw bytes (`corrected`: a corrected
/// submission, JSON, instead) again. Bytes the built-in validation refuses
/// are not sent unless `force`: the error says why, and nothing changes. A
/// `rejected` record of the same id is queued again first (and indexed),
/// so the worker runs it instead of dropping it. The letter is left alone:
/// delete it once [`accepted_by_a_worker`] says so.
pub async fn replay_rejected(
    conn: &Conn,
    jobs: &Jobs,
    l: &Letter,
    corrected: Option<Vec<u8>>,
    force: bool,
) -> Result<RejectedReplay, OpError> {
    let is_corrected = corrected.is_some();
    let (payload, ct) = match corrected {
        Some(b) => (bytes::Bytes::from(b), Some("application/json".to_string())),
        None => (
            l.payload.clone(),
            leasehold_store::work::content_type(Some(&l.headers)),
        ),
    };
    let verdict = validate_submission(&l.kind, &payload, l.job_id.as_deref(), ct.as_deref());
    let forced = match &verdict {
        Ok(_) => None,
        Err(rej) if !force => {
            return Err(OpError(format!(
                "letter {} kept, nothing sent: {} still refused by the built-in validation ({}); replay a corrected submission",
                l.seq,
                if is_corrected {
                    "the corrected submission is"
                } else {
                    "its bytes are"
                },
                rej.error
            )))
        }
        Err(rej) => Some(rej.error.to_string()),
    };
    let sent_at = SystemTime::now();
    let mut requeued_record = false;
    if let Ok(accepted) = &verdict {
        if jobs
            .get(&accepted.id)
            .await
            .map_err(|e| explain(e, &accepted.id))?
            .is_some_and(|v| v.value.status == Status::Rejected.as_str())
        {
            let v = jobs
                .transition(&accepted.id, |cur| {
                    if cur.status != Status::Rejected.as_str() {
                        return Ok(None);
                    }
                    let mut r = machine::requeue_fresh(cur, SystemTime::now(), 0)?;
                    r.spec = Some(accepted.spec.clone());
                    r.error = None;
                    Ok(Some(r))
                })
                .await
                .map_err(|e| explain(e, &accepted.id))?;
            Active::open(conn).await?.reconcile(&v.value).await?;
            requeued_record = true;
        }
    }
    let digest = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        payload.hash(&mut h);
        h.finish()
    };
    let msg_id = l
        .job_id
        .as_ref()
        .map(|id| format!("{id}:replay:{}:{digest:016x}", l.seq));
    let p = Work::new(conn)
        .resubmit_raw(
            &l.kind,
            payload,
            Some(&l.headers),
            l.job_id.as_deref(),
            msg_id.as_deref(),
        )
        .await
        .map_err(|e| {
            OpError::context(
                format!(
                    "the replay could not be published; letter {} kept: run this again",
                    l.seq
                ),
                e,
            )
        })?;
    Ok(RejectedReplay {
        id: l.job_id.clone(),
        ticket_seq: p.seq,
        duplicate: p.duplicate,
        forced,
        requeued_record,
        sent_at,
    })
}

/// Whether a worker took the replayed submission `id` within `wait`: its
/// record claimed or settled by a worker (anything but queued), `Ok(true)`;
/// rejected again after `since`, `Err` with the reason; neither in time,
/// `Ok(false)`.
pub async fn accepted_by_a_worker(
    jobs: &Jobs,
    id: &str,
    since: SystemTime,
    wait: Duration,
) -> Result<bool, OpError> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        if let Some(v) = jobs.get(id).await.map_err(|e| explain(e, id))? {
            let r = &v.value;
            let after =
                leasehold_core::time::parse_rfc3339(&r.updated_at).is_some_and(|t| t >= since);
            match status_of(r) {
                Some(Status::Queued) | None => {}
                Some(Status::Rejected) if !after => {}
                Some(Status::Rejected) => {
                    return Err(OpError(format!(
                        "rejected again: {}",
                        r.error
                            .as_ref()
                            .map_or("no reason recorded", |e| e.message.as_str())
                    )))
                }
                Some(_) => return Ok(true),
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// An operator's action on one job, as its `action` event says it.
pub struct Action<'a> {
    /// `cancel`, `review_resume`, `review_fail`, `dlq_replay`, `dlq_delete`.
    pub action: &'a str,
    /// Who asked: the console's caller, or the CLI's user.
    pub by: &'a str,
    /// `console` or `cli`.
    pub via: &'a str,
    /// What came of it (an object; its fields are added to the event's).
    pub detail: Value,
}

/// Records `a` on job `id` as an `action` event (`action`, `by`, `via` and
/// the detail's fields). Unfenced, like every event of a non-owner;
/// `nonce` makes a repeat of the same request one event.
pub async fn record_action(
    conn: &Conn,
    id: &str,
    epoch: u64,
    a: Action<'_>,
    nonce: &str,
) -> Result<u64, OpError> {
    let mut data = json!({"action": a.action, "by": a.by, "via": a.via});
    if let (Some(d), Value::Object(extra)) = (data.as_object_mut(), a.detail) {
        d.extend(extra);
    }
    let ev = events::event(id, epoch, "action", None, data);
    Ok(Events::new(conn)
        .publish(&ev, Some(&format!("{id}:action:{}:{nonce}", a.action)))
        .await?)
}
