//! Firing recurring schedules, at every sweep of every reaper.
//!
//! For each schedule that is not paused, [`leasehold_core::schedule::due_tick`]
//! says which tick fires now (the latest not yet fired; older missed ticks
//! are skipped). The tick's job is submitted under the id `<name>-<tick
//! unix seconds>` with `Nats-Msg-Id` equal to it, so every reaper firing
//! the same tick submits one job (the work stream's dedupe window, then the
//! record's existence); its queued record is written at once (as the
//! gateway would), then `last_fired` is recorded conditioned on the
//! revision read. A reaper stopped between the submission and that write
//! leaves the tick to the next check, which submits the same id again.

use std::time::SystemTime;

use leasehold_core::schedule::{self, Schedule};
use leasehold_core::spec::{self, Kinds};
use leasehold_core::time::rfc3339;
use leasehold_store::recovery::Recovery;
use leasehold_store::schedules::{ScheduleError, Schedules};
use leasehold_store::{Conn, StoreError};

/// Fires every due tick of every active schedule; returns how many ticks
/// this call submitted (a duplicate of another reaper's counts too).
pub(crate) async fn fire_due(
    conn: &Conn,
    recovery: &Recovery,
    kinds: &Kinds,
    now: SystemTime,
) -> Result<u32, StoreError> {
    let schedules = match Schedules::open(conn).await {
        Ok(s) => s,
        // A layout set up before schedules existed: nothing to fire.
        Err(StoreError::Missing(_)) => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut fired = 0;
    for (entry, revision) in schedules.list().await? {
        if entry.paused {
            continue;
        }
        let cron = match Schedule::parse(&entry.cron, now) {
            Ok(c) => c,
            Err(why) => {
                tracing::warn!(schedule = %entry.name, error = %why, "schedule cannot fire");
                continue;
            }
        };
        let Some(tick) = schedule::due_tick(&cron, entry.last_fired_at(), entry.created(), now)
        else {
            continue;
        };
        let id = schedule::job_id(&entry.name, tick);
        let payload = serde_json::to_vec(&entry.spec).expect("a JSON value serializes");
        // One schedule that cannot submit (its kind not set up, a full
        // queue) never holds the others back: it is tried at the next check.
        let published = match recovery
            .work
            .submit(&entry.kind, payload.into(), Some(&id), None)
            .await
        {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(schedule = %entry.name, job = %id, error = %e, "cannot submit the tick's job; trying again at the next check");
                continue;
            }
        };
        if !published.duplicate {
            // Visible at once, as `leasehold submit` makes it (a worker's
            // claim would write the same record otherwise).
            let _ = recovery
                .work
                .record_ticket(
                    &recovery.jobs,
                    &recovery.active,
                    published.seq,
                    kinds,
                    spec::DEFAULT_MAX_BYTES,
                    |_, _, _| None,
                )
                .await;
        }
        fired += 1;
        let mut next = entry.clone();
        next.last_fired = Some(rfc3339(tick));
        next.last_job = Some(id.clone());
        next.updated_at = rfc3339(SystemTime::now());
        match schedules.update(&next, revision).await {
            Ok(_) => {
                tracing::info!(schedule = %entry.name, job = %id, duplicate = published.duplicate, "schedule fired")
            }
            // Another reaper recorded it (or the schedule changed): the
            // next check reads it again; the job is one job either way.
            Err(ScheduleError::Conflict(_)) => {
                tracing::debug!(schedule = %entry.name, job = %id, "another writer recorded the tick")
            }
            Err(ScheduleError::Store(e)) => return Err(e),
            Err(e) => tracing::debug!(schedule = %entry.name, error = %e, "tick not recorded"),
        }
    }
    Ok(fired)
}
