//! The schedules loop: wakes at the next tick of any schedule (or when one
//! changes) and fires what is due through [`crate::schedules`].

use super::*;

/// How long after a tick the schedules loop wakes for it: ticks are whole
/// seconds, and a timer never fires early, so this only absorbs the
/// difference between the wall clock and the timer's.
const TICK_SLACK: Duration = Duration::from_millis(2);

/// The recurring schedules, on their own clock: wakes at the next tick of
/// any schedule, and at once when a schedule is added or changed (at least
/// every `--interval` while the schedules cannot be watched), and fires
/// what is due, so a tick fires at its time whatever a sweep costs.
pub(super) async fn schedules_loop(inner: Arc<Inner>, shutdown: CancellationToken) {
    let mut dedupe = None;
    let mut changes = None;
    loop {
        if changes.is_none() {
            changes = crate::schedules::watch(&inner.conn).await;
        }
        let window = match dedupe {
            Some(d) => d,
            None => {
                let d = crate::schedules::dedupe_window(&inner.conn).await;
                if !d.is_zero() {
                    dedupe = Some(d);
                }
                d
            }
        };
        let next = match crate::schedules::fire_due(
            &inner.conn,
            &inner.recovery,
            &inner.kinds,
            &inner.opts,
            window,
        )
        .await
        {
            Ok(c) => c.next,
            Err(e) => {
                tracing::warn!(error = %e, "schedules not checked; trying again at the next interval");
                None
            }
        };
        let wait = next
            .map(|t| t.duration_since(SystemTime::now()).unwrap_or_default() + TICK_SLACK)
            .unwrap_or(inner.opts.interval)
            .min(inner.opts.interval);
        let changed = async {
            match changes.as_mut() {
                Some(w) => w.next().await.map(|c| c.is_ok()).unwrap_or(false),
                None => std::future::pending().await,
            }
        };
        let watching = tokio::select! {
            _ = tokio::time::sleep(wait) => true,
            ok = changed => ok,
            _ = shutdown.cancelled() => return,
        };
        if !watching {
            // The watch ended (a reconnect, a leader change): watch anew.
            changes = None;
        }
    }
}
