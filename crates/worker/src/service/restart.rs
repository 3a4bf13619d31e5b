//! A restart under a stable identity: the jobs an earlier process of this
//! identity held are taken back at once, from the index.

use std::sync::Arc;
use std::time::Duration;

use leasehold_core::machine::{self, ClaimDecision, OwnerLiveness};
use leasehold_core::retry::Backoff;

use super::claim::{index_now, is_suspect, Claiming, SuspectSlot};
use super::{attempt, Shared};

/// At start with a stable identity: take back, at once, the jobs an earlier
/// process of this identity held (listed by the index, never by a scan).
/// Such a takeover writes the session key anew and leaves no end marker for
/// the earlier process, so nobody else would recover its jobs before a
/// reaper's sweep: this retries until every one of them is handled.
pub(crate) async fn restart_reclaim_all(shared: Arc<Shared>) {
    let mut pause = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    loop {
        match restart_reclaim(shared.clone()).await {
            Ok(0) => return,
            Ok(left) => tracing::warn!(left, "restart reclaim: jobs of an earlier process of this identity not handled yet; retrying"),
            Err(e) => tracing::warn!(error = %e, "restart reclaim failed; retrying"),
        }
        tokio::select! {
            _ = tokio::time::sleep(pause.pause()) => {}
            _ = shared.shutdown.cancelled() => return,
        }
    }
}

/// One pass of [`restart_reclaim_all`]: how many jobs are left for the next.
pub(crate) async fn restart_reclaim(shared: Arc<Shared>) -> anyhow::Result<usize> {
    let entries = shared
        .active
        .list(leasehold_store::index::Filter::RunningBy(&shared.worker_id))
        .await?;
    let mut left = 0;
    for (_, entry) in entries {
        if !shared.handlers.contains_key(&entry.kind) {
            continue;
        }
        let cur = match shared.jobs.get(&entry.job).await {
            Ok(Some(c)) => c,
            Ok(None) => continue,
            // One unreadable record never stops the others' reclaim.
            Err(e) => {
                tracing::warn!(job = %entry.job, error = %e, "restart reclaim skips this job for now");
                left += 1;
                continue;
            }
        };
        let rec = cur.value;
        if rec.status != "running"
            || rec.worker_id.as_deref() != Some(shared.worker_id.as_str())
            || rec.session.as_deref() == Some(shared.session.id.as_str())
        {
            continue;
        }
        // A ticket of the job is being claimed here right now: that claim
        // decides (it sees an earlier process's job, as this would).
        let Some(claiming) = Claiming::new(&shared, &rec.id) else {
            continue;
        };
        // A suspect runs here only if no other suspect does; otherwise it
        // is re-offered for another worker.
        // This claim counts the earlier process's loss too.
        let suspect = if is_suspect(rec.stale_reclaims + 1) {
            match SuspectSlot::take(&shared, &rec.id) {
                Some(s) => Some(s),
                None => {
                    drop(claiming);
                    match shared
                        .recovery
                        .recover_job(&shared.worker_id, &rec.id, None)
                        .await
                    {
                        Ok(leasehold_store::recovery::Action::Unsure(_)) | Err(_) => left += 1,
                        Ok(_) => {}
                    }
                    continue;
                }
            }
        } else {
            None
        };
        let permit = shared.slots.clone().acquire_owned().await?;
        let claimant = shared.claimant(0, OwnerLiveness::Dead);
        let token = claimant.claim_token.clone();
        let session = shared.session.id.clone();
        let res = shared
            .jobs
            .transition(&rec.id, |cur| {
                // Still an earlier process's job of this identity?
                if cur.worker_id.as_deref() != Some(shared.worker_id.as_str())
                    || cur.status != "running"
                    || cur.session.as_deref() == Some(session.as_str())
                {
                    return Ok(None);
                }
                match machine::decide_claim(cur, &claimant) {
                    ClaimDecision::Claim { record, .. } => Ok(Some(*record)),
                    _ => Ok(None),
                }
            })
            .await;
        match res {
            // Only our own fresh token proves the claim is ours.
            Ok(v) if v.value.claim_token.as_deref() == Some(token.as_str()) => {
                tracing::info!(job = %rec.id, epoch = v.value.epoch, "reclaimed at start from an earlier process of this identity");
                // No ticket covers it: the index must (run_claimed knows).
                index_now(&shared, &v.value).await;
                shared.count_claim(&v.value.kind, true);
                let s = shared.clone();
                tokio::spawn(async move {
                    let how = attempt::Claimed {
                        reclaim: true,
                        indexed: true,
                    };
                    attempt::run_claimed(s, v, None, permit, how, Some(claiming)).await;
                    drop(suspect);
                });
            }
            Err(e) => {
                tracing::warn!(job = %rec.id, error = %e, "restart reclaim of this job failed; retrying");
                left += 1;
            }
            _ => {}
        }
    }
    Ok(left)
}
