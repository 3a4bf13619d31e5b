//! Firing recurring schedules: every reaper's schedules loop wakes at the
//! next tick of any schedule and when a schedule changes (it follows the
//! bucket with a watch: a check reads no entry), independently of the
//! sweep.
//!
//! For each schedule that is not paused, [`leasehold_core::schedule::due_ticks`]
//! says which ticks fire now: every tick later than the one handled last,
//! oldest first, within a bounded catch-up (see [`catch_up`]); older
//! missed ticks are skipped and the skip recorded in the entry
//! (`skipped_through`, and a warning). Each tick's job is submitted under
//! the id `<name>-<tick unix seconds>` with `Nats-Msg-Id` equal to it, so
//! every reaper firing the same tick submits one job (the work stream's
//! dedupe window, then the record's existence); its queued record is
//! written at once (as the gateway would), then `last_fired` is recorded
//! conditioned on the revision read. A reaper stopped between the
//! submission and that write leaves the tick to the next check, which
//! submits the same id again.

use std::time::{Duration, SystemTime};

use leasehold_core::schedule::{self, Schedule};
use leasehold_core::spec::{self, Kinds};
use leasehold_core::time::rfc3339;
use leasehold_store::recovery::Recovery;
use leasehold_store::schedules::{ScheduleError, ScheduleView, Schedules};
use leasehold_store::{Conn, StoreError};

use crate::Options;

/// What one check did, and when the next tick of any schedule is.
#[derive(Debug, Default)]
pub(crate) struct Check {
    /// Ticks this check submitted (a duplicate of another reaper's counts too).
    pub fired: u32,
    /// The earliest tick still to come of the schedules not paused.
    pub next: Option<SystemTime>,
}

/// How old a missed tick of `kind` may be and still fire: as long as its
/// job, had another reaper fired it already, is still known, so firing it
/// again makes no second job. That is the work stream's dedupe window
/// (`dedupe`), or the kind's retention (its record is kept at least that
/// long after the tick), whichever is longer; retention 0 keeps records
/// for ever.
pub(crate) fn catch_up(opts: &Options, kind: &str, dedupe: Duration) -> Duration {
    let retention = opts
        .retention_kind
        .iter()
        .find(|(k, _)| k == kind)
        .map_or(opts.retention, |(_, d)| *d);
    if retention.is_zero() {
        return Duration::MAX;
    }
    retention.max(dedupe)
}

/// The work stream's dedupe window (zero when it cannot be read: only the
/// retention then bounds the catch-up).
pub(crate) async fn dedupe_window(conn: &Conn) -> Duration {
    match conn.js.get_stream(conn.layout.work_stream()).await {
        Ok(mut s) => s
            .info()
            .await
            .map(|i| i.config.duplicate_window)
            .unwrap_or_default(),
        Err(_) => Duration::ZERO,
    }
}

/// Fires every due tick of every active schedule: those `view` shows, or,
/// while it is being read, those read from the bucket.
pub(crate) async fn fire_due(
    schedules: &Schedules,
    view: &ScheduleView,
    recovery: &Recovery,
    kinds: &Kinds,
    opts: &Options,
    dedupe: Duration,
) -> Result<Check, StoreError> {
    let entries = match view.schedules() {
        Some(e) => e,
        None => schedules.list().await?,
    };
    let mut check = Check::default();
    for (entry, revision) in entries {
        if entry.paused {
            continue;
        }
        let now = SystemTime::now();
        let cron = match Schedule::parse(&entry.cron, now) {
            Ok(c) => c,
            Err(why) => {
                tracing::warn!(schedule = %entry.name, error = %why, "schedule cannot fire");
                continue;
            }
        };
        if let Some(n) = cron.next_after(now) {
            check.next = Some(check.next.map_or(n, |m| m.min(n)));
        }
        let window = catch_up(opts, &entry.kind, dedupe);
        let due = schedule::due_ticks(&cron, entry.handled_through(), entry.created(), now, window);
        let mut skipped = due.skipped_through;
        let mut fired: Option<(SystemTime, String)> = None;
        for tick in due.ticks {
            // Judged again right before the submission: a reaper paused
            // since it read the entry may find the tick past its window,
            // and another reaper's job for it forgotten.
            let age = SystemTime::now().duration_since(tick).unwrap_or_default();
            if age > window {
                skipped = Some(tick);
                continue;
            }
            let id = schedule::job_id(&entry.name, tick);
            let payload = serde_json::to_vec(&entry.spec).expect("a JSON value serializes");
            // One schedule that cannot submit (its kind not set up, a full
            // queue) never holds the others back; its later ticks wait for
            // this one (ticks fire in order), at the next check.
            let published = match recovery
                .work
                .submit(&entry.kind, payload.into(), Some(&id), None)
                .await
            {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(schedule = %entry.name, job = %id, error = %e, "cannot submit the tick's job; trying again at the next check");
                    break;
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
            tracing::info!(schedule = %entry.name, job = %id, duplicate = published.duplicate, "schedule fired");
            check.fired += 1;
            fired = Some((tick, id));
        }
        if fired.is_none() && skipped.is_none() {
            continue;
        }
        let mut next = entry.clone();
        if let Some(s) = skipped {
            next.skipped_through = Some(rfc3339(s));
            tracing::warn!(schedule = %entry.name, through = %rfc3339(s), catch_up = ?window, "missed ticks older than the catch-up allows were skipped");
        }
        if let Some((tick, id)) = &fired {
            next.last_fired = Some(rfc3339(*tick));
            next.last_job = Some(id.clone());
        }
        next.updated_at = rfc3339(SystemTime::now());
        match schedules.update(&next, revision).await {
            Ok(written) => view.wrote(&next, written),
            // Another reaper recorded it (or the schedule changed): the
            // next check reads it again; the jobs are one job each either way.
            Err(ScheduleError::Conflict(_)) => {
                tracing::debug!(schedule = %entry.name, "another writer recorded the ticks")
            }
            Err(ScheduleError::Store(e)) => return Err(e),
            Err(e) => tracing::debug!(schedule = %entry.name, error = %e, "ticks not recorded"),
        }
    }
    Ok(check)
}
