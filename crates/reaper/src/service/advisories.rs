//! The advisory loop: the server's max-deliveries advisories, captured
//! durably in `LH_ADVISORIES` and read by the replicas' shared durable
//! consumer. A ticket past max deliveries whose job a live owner holds is
//! only deleted; a running job with a gone owner is recovered; a waiting
//! one becomes `dead` (class `max_deliveries`).

use super::*;

/// [`advisory_consumer`] at start: the layout was verified, so a failure
/// now is the advisory stream electing a leader (a node restarting), waited
/// out up to [`START_DEADLINE`].
pub(super) async fn advisory_consumer_at_start(
    conn: &Conn,
) -> Result<consumer::PullConsumer, ReaperError> {
    let end = tokio::time::Instant::now() + START_DEADLINE;
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
    loop {
        let pause = backoff.pause();
        match advisory_consumer(conn).await {
            Err(e) if tokio::time::Instant::now() + pause < end => {
                tracing::warn!(error = %e, retry_in_ms = pause.as_millis() as u64, "advisory consumer not available yet; retrying");
                tokio::time::sleep(pause).await;
            }
            other => return other,
        }
    }
}

/// Creates (or binds to) the replicas' shared durable consumer of advisories.
pub(super) async fn advisory_consumer(conn: &Conn) -> Result<consumer::PullConsumer, ReaperError> {
    let l = &conn.layout;
    let fail = |e: &dyn std::fmt::Display| ReaperError::Advisories {
        stream: l.advisory_stream(),
        message: e.to_string(),
    };
    let stream = conn
        .js
        .get_stream(l.advisory_stream())
        .await
        .map_err(|e| fail(&e))?;
    let name = l.reaper_consumer();
    stream
        .get_or_create_consumer(
            &name,
            consumer::pull::Config {
                durable_name: Some(name.clone()),
                description: Some(
                    "leasehold reapers: max-deliveries advisories of the work consumers".into(),
                ),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(60),
                deliver_policy: consumer::DeliverPolicy::All,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| fail(&e))
}

/// The advisory payload fields the reaper uses.
#[derive(Debug, Deserialize)]
pub struct MaxDeliveries {
    pub stream: String,
    #[serde(default)]
    pub consumer: String,
    pub stream_seq: u64,
    #[serde(default)]
    pub deliveries: u64,
}

pub(super) async fn advisory_loop(
    inner: Arc<Inner>,
    mut consumer: consumer::PullConsumer,
    shutdown: CancellationToken,
) {
    let pause = Duration::from_secs(1);
    while !shutdown.is_cancelled() {
        let mut msgs = match consumer.messages().await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "cannot pull advisories; retrying");
                tokio::select! { _ = tokio::time::sleep(pause) => {}, _ = shutdown.cancelled() => return }
                // The consumer may have been deleted: bind to it (or create it) again.
                match advisory_consumer(&inner.conn).await {
                    Ok(c) => consumer = c,
                    Err(e) => tracing::warn!(error = %e, "advisory consumer unavailable"),
                }
                continue;
            }
        };
        loop {
            let next = tokio::select! {
                m = msgs.next() => m,
                _ = shutdown.cancelled() => return,
            };
            match next {
                Some(Ok(msg)) => inner.on_advisory(msg).await,
                Some(Err(e)) => {
                    // Missed heartbeats, a restarted server: pull anew after a pause.
                    tracing::warn!(error = %e, "advisory pull interrupted; pulling again");
                    tokio::select! { _ = tokio::time::sleep(pause) => {}, _ = shutdown.cancelled() => return }
                    break;
                }
                None => break,
            }
        }
    }
}

impl Inner {
    /// Handles one captured advisory; acks it once handled, NAKs it on a
    /// transient failure, and acks (with a warning) what it cannot parse.
    pub(super) async fn on_advisory(&self, msg: jetstream::Message) {
        let adv: MaxDeliveries = match serde_json::from_slice(&msg.payload) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(subject = %msg.subject, error = %e, "unreadable advisory; dropping it");
                let _ = msg.ack().await;
                return;
            }
        };
        if adv.stream != self.conn.layout.work_stream() {
            let _ = msg.ack().await;
            return;
        }
        match self.max_deliveries(&adv).await {
            Ok(()) => {
                self.stats.advisories.fetch_add(1, Ordering::Relaxed);
                let _ = msg.ack().await;
            }
            Err(e) => {
                tracing::warn!(seq = adv.stream_seq, error = %e, "max-deliveries advisory not handled yet; retrying in 1s");
                let _ = msg
                    .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                    .await;
            }
        }
    }

    /// A ticket reached max deliveries. A live job is never killed for it:
    /// a running job with a live owner needs no ticket (it is only
    /// deleted), one whose owner is gone is recovered; a waiting job becomes
    /// `dead` (class `max_deliveries`) with the ticket's payload.
    pub(super) async fn max_deliveries(&self, adv: &MaxDeliveries) -> Result<(), ReaperError> {
        let r = &self.recovery;
        let seq = adv.stream_seq;
        let Some(ticket) = r.work.get(seq).await? else {
            tracing::debug!(seq, "ticket already gone; nothing to do");
            return Ok(());
        };
        let Some(id) = self.job_of(&ticket) else {
            // Nothing names a job: keep the raw bytes, as for a rejection.
            tracing::warn!(
                seq,
                "a ticket past max deliveries names no job; dead-lettering its raw bytes"
            );
            let message = format!(
                "{} deliveries to consumer {} without an ack",
                adv.deliveries, adv.consumer
            );
            r.dlq
                .reject(
                    &ticket.kind,
                    None,
                    "max_deliveries",
                    &message,
                    ticket.payload.clone(),
                    Some(&ticket.headers),
                    &format!("max_deliveries:{seq}"),
                )
                .await?;
            r.work.delete(seq).await?;
            return Ok(());
        };
        let reason = format!(
            "max deliveries: ticket {seq} was delivered {} times to {} without an ack",
            adv.deliveries, adv.consumer
        );
        let Some(cur) = r.jobs.get(&id).await? else {
            // The ticket was never claimed: record the job as dead so it
            // is visible and replayable like any other.
            if let Some(rec) = self
                .dead_record_for_unclaimed(&id, &ticket, &reason)
                .await?
            {
                self.stats.max_deliveries.fetch_add(1, Ordering::Relaxed);
                r.finish(&rec, Some(&ticket), Some(seq)).await?;
            }
            return Ok(());
        };
        let rec = cur.value;
        if rec.ticket_seq > seq {
            tracing::info!(job = %id, seq, current = rec.ticket_seq, "superseded ticket past max deliveries; deleting it");
            r.work.delete(seq).await?;
            return Ok(());
        }
        match status_of(&rec) {
            Some(Status::Running) => {
                let worker = rec.worker_id.clone().unwrap_or_default();
                let a = r.recover_job(&worker, &id, None).await?;
                if let Action::Unsure(why) = &a {
                    return Err(ReaperError::Store(StoreError::failed(format!(
                        "job {id}: {why}"
                    ))));
                }
                if matches!(a, Action::Nothing(_)) {
                    // The ticket may be the job's only cover (not indexed
                    // yet): index it under its owner before the ticket goes.
                    if let Some(now) = r.jobs.get(&id).await? {
                        r.active.sync(&now.value, None).await?;
                    }
                    tracing::info!(job = %id, seq, worker, "ticket past max deliveries of a job its live owner runs: indexed under its owner and deleted, the job goes on");
                }
                self.stats.count(&a);
                r.work.delete(seq).await?;
                Ok(())
            }
            // A waiting job is never dead-lettered for its deliveries (they
            // count refusals and transient errors, not what the job did):
            // it gets a fresh ticket instead.
            Some(Status::Queued) => {
                if rec.cancel_requested {
                    self.cancel_waiting(&id, None).await?;
                    r.work.delete(seq).await?;
                    return Ok(());
                }
                tracing::info!(job = %id, seq, deliveries = adv.deliveries, "waiting job's ticket past max deliveries; giving it a fresh one");
                self.replace_ticket(
                    &rec,
                    cur.revision,
                    seq,
                    true,
                    "its ticket reached max deliveries",
                )
                .await
            }
            Some(Status::Dead) => {
                r.finish(&rec, Some(&ticket), Some(seq)).await?;
                Ok(())
            }
            // Terminal or parked: the ticket has nothing left to do.
            _ => r.work.delete(seq).await.map(|_| ()).map_err(Into::into),
        }
    }

    /// Creates a dead record for a ticket whose job was never recorded;
    /// `None` when a record appeared meanwhile.
    pub(super) async fn dead_record_for_unclaimed(
        &self,
        id: &str,
        ticket: &Ticket,
        reason: &str,
    ) -> Result<Option<JobRecord>, ReaperError> {
        let now = SystemTime::now();
        let ct = work::content_type(Some(&ticket.headers));
        let sub = Submission {
            kind: &ticket.kind,
            payload: &ticket.payload,
            msg_id: Some(id),
            content_type: ct.as_deref(),
            stream_seq: ticket.seq,
            received_at: ticket.stored_at,
        };
        let spec = spec::decode(sub, &self.kinds, usize::MAX)
            .map(|a| a.spec)
            .unwrap_or_default();
        let fresh = machine::new_record(id, &ticket.kind, spec, ticket.seq, now);
        let dead = machine::mark_dead(&fresh, now, "max_deliveries", reason)
            .expect("a queued record can die");
        match self.recovery.jobs.create(&dead).await {
            Ok(_) => Ok(Some(dead)),
            Err(JobsError::Exists(_) | JobsError::Conflict(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The job a ticket belongs to: its `Lh-Job-Id` or `Nats-Msg-Id`
    /// header, else the id its payload gives (spec `id`, else `seq-<n>`).
    pub(super) fn job_of(&self, ticket: &Ticket) -> Option<String> {
        if let Some(id) = work::ticket_job_id(Some(&ticket.headers)) {
            return Some(id);
        }
        let ct = work::content_type(Some(&ticket.headers));
        let sub = Submission {
            kind: &ticket.kind,
            payload: &ticket.payload,
            msg_id: None,
            content_type: ct.as_deref(),
            stream_seq: ticket.seq,
            received_at: ticket.stored_at,
        };
        match spec::decode(sub, &self.kinds, usize::MAX) {
            Ok(a) => Some(a.id),
            Err(r) => r.id,
        }
    }
}
