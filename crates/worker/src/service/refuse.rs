//! Tickets that are never run: a bad submission rejected, an id reused by
//! another kind, a poison job's ticket: each dead-lettered, never dropped
//! silently, never crashing the worker.

use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, AckKind};
use leasehold_core::machine;
use leasehold_core::spec;
use leasehold_core::JobRecord;
use leasehold_store::events;
use leasehold_store::JobsError;
use serde_json::json;

use super::Shared;

/// A bad submission: never crashes the worker, never silently dropped.
pub(super) async fn reject(
    shared: &Shared,
    kind: &str,
    seq: u64,
    msg: &jetstream::Message,
    rej: spec::Rejected,
) {
    shared.metrics.rejected(kind);
    let message = rej.error.to_string();
    tracing::info!(kind, seq, id = rej.id.as_deref().unwrap_or("-"), error = %message, "rejected submission");
    if let Some(id) = &rej.id {
        let mut rec =
            machine::rejected_record(id, kind, "rejected", &message, seq, SystemTime::now());
        // A child's refused spec still names its parent, which waits for
        // its end.
        rec.spec = spec::parent_of_raw(&msg.payload).map(|p| leasehold_core::JobSpec {
            parent: Some(p),
            ..Default::default()
        });
        match shared.jobs.create(&rec).await {
            Ok(_) => {
                if let Err(e) = shared.recovery.announce_end(&rec).await {
                    tracing::warn!(job = %id, error = %e, "cannot announce a refused child's end to its parent; retrying the ticket");
                    let _ = msg
                        .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                        .await;
                    return;
                }
                let ev = events::event(
                    id,
                    0,
                    "rejected",
                    Some(&shared.worker_id),
                    json!({"error": message, "code": rej.error.code(), "kind": kind}),
                );
                let _ = shared
                    .events
                    .publish(&ev, Some(&format!("{id}:rejected:{seq}")))
                    .await;
            }
            // An existing job keeps its record: a bad duplicate must not
            // clobber it. But a waiting job whose own ticket this worker
            // refuses (configuration or version skew) would bounce between
            // re-enqueues for ever: it is parked once, with the reason.
            Err(JobsError::Exists(_)) => {
                let code = rej.error.code();
                let parked = shared
                    .jobs
                    .transition(id, |cur| {
                        if cur.status != "queued" || (seq != 0 && cur.ticket_seq > seq) {
                            return Ok(None);
                        }
                        machine::park_waiting(
                            cur,
                            SystemTime::now(),
                            "rejected_ticket",
                            &format!(
                                "its ticket was refused by worker {}: {message}",
                                shared.worker_id
                            ),
                        )
                        .map(Some)
                    })
                    .await;
                match parked {
                    Ok(v) if v.value.status == "parked" => {
                        tracing::warn!(job = %id, code, "a waiting job's ticket was refused here; the job is parked for review");
                        let _ = shared.active.reconcile(&v.value).await;
                        let ev = events::event(
                            id,
                            v.value.epoch,
                            "parked",
                            Some(&shared.worker_id),
                            json!({"reason": "rejected_ticket", "message": message, "code": code}),
                        );
                        let _ = shared
                            .events
                            .publish(&ev, Some(&format!("{id}:parked:rejected:{code}")))
                            .await;
                    }
                    _ => {
                        tracing::info!(job = %id, "a job with this id exists; its record is left alone")
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot record the rejection; retrying the ticket");
                let _ = msg
                    .ack_with(AckKind::Nak(Some(machine::transient_retry_delay(
                        delivered(msg),
                    ))))
                    .await;
                return;
            }
        }
    }
    match shared
        .dlq
        .reject(
            kind,
            rej.id.as_deref(),
            rej.error.code(),
            &message,
            msg.payload.clone(),
            msg.headers.as_ref(),
            // One letter per job and reason, whatever ticket carried it.
            &match &rej.id {
                Some(id) => format!("rejected:{kind}:{id}:{}", rej.error.code()),
                None => format!("rejected:{kind}:{seq}"),
            },
        )
        .await
    {
        Ok(_) => {
            let _ = msg.ack().await;
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot dead-letter the rejected submission; retrying");
            let _ = msg
                .ack_with(AckKind::Nak(Some(machine::transient_retry_delay(
                    delivered(msg),
                ))))
                .await;
        }
    }
}

/// A submission reusing the id of a job of another kind: dead-lettered, the
/// existing job left alone.
pub(super) async fn id_conflict(
    shared: &Shared,
    kind: &str,
    seq: u64,
    msg: &jetstream::Message,
    rec: &JobRecord,
) {
    let message = format!(
        "job id {:?} already names a job of kind {:?}; a submission of kind {kind:?} cannot reuse it",
        rec.id, rec.kind
    );
    tracing::warn!(job = %rec.id, seq, "{message}");
    match shared
        .dlq
        .reject(
            kind,
            Some(&rec.id),
            "id_conflict",
            &message,
            msg.payload.clone(),
            msg.headers.as_ref(),
            &format!("rejected:{kind}:{seq}"),
        )
        .await
    {
        Ok(_) => {
            let _ = msg.ack().await;
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot dead-letter the conflicting submission; retrying");
            let _ = msg
                .ack_with(AckKind::Nak(Some(machine::transient_retry_delay(
                    delivered(msg),
                ))))
                .await;
        }
    }
}

/// A job whose owner is gone after too many stale reclaims: dead-letter it
/// here (the recovery of its owner's session may not know it: it was never
/// indexed).
pub(super) async fn poison(
    shared: &Shared,
    rec: &JobRecord,
    msg: &jetstream::Message,
    retry: Duration,
) {
    let max = shared.opts.max_stale_reclaims;
    let reason = format!(
        "poison: its worker stopped {} times while running it (limit {max}); the job keeps killing or stalling its workers",
        rec.stale_reclaims
    );
    let (epoch, worker) = (rec.epoch, rec.worker_id.clone());
    let killed = shared
        .recovery
        .kill(&rec.id, "poison", &reason, |r| {
            r.status == "running" && r.epoch == epoch && r.worker_id == worker
        })
        .await;
    match killed {
        Ok(_) => {
            let _ = msg.ack().await;
        }
        Err(e) => {
            tracing::warn!(job = %rec.id, error = %e, "cannot dead-letter a poison job yet; retrying");
            let _ = msg.ack_with(AckKind::Nak(Some(retry))).await;
        }
    }
}

/// How often `msg` has been delivered (this delivery included).
pub(super) fn delivered(msg: &jetstream::Message) -> u64 {
    msg.info().map(|i| i.delivered.max(1) as u64).unwrap_or(1)
}
