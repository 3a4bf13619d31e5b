//! The schedules loop: wakes at the next tick of any schedule (or when one
//! changes) and fires what is due through [`crate::schedules`].

use super::*;
use leasehold_store::schedules::{ScheduleView, Schedules};

/// How long after a tick the schedules loop wakes for it: ticks are whole
/// seconds, and a timer never fires early, so this only absorbs the
/// difference between the wall clock and the timer's.
const TICK_SLACK: Duration = Duration::from_millis(2);

/// The recurring schedules, on their own clock: wakes at the next tick of
/// any schedule, and at once when a schedule is added or changed, and
/// fires what is due, so a tick fires at its time whatever a sweep costs.
/// The schedules are followed by a watch ([`Schedules::follow`]): a check
/// reads none of them, only while the view is being read does it list the
/// bucket (and looks at least every `--interval`).
pub(super) async fn schedules_loop(inner: Arc<Inner>, shutdown: CancellationToken) {
    let mut dedupe = None;
    let mut followed: Option<(Schedules, ScheduleView)> = None;
    loop {
        if followed.is_none() {
            match Schedules::open(&inner.conn).await {
                Ok(s) => {
                    let view = s.follow(inner.conn.link.clone(), shutdown.child_token());
                    followed = Some((s, view));
                }
                // A layout set up before schedules existed: nothing to fire.
                Err(StoreError::Missing(_)) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "schedules not checked; trying again at the next interval")
                }
            }
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
        let mut next = None;
        if let Some((schedules, view)) = &followed {
            match crate::schedules::fire_due(
                schedules,
                view,
                &inner.recovery,
                &inner.kinds,
                &inner.opts,
                window,
            )
            .await
            {
                Ok(c) => next = c.next,
                Err(e) => {
                    tracing::warn!(error = %e, "schedules not checked; trying again at the next interval")
                }
            }
        }
        let wait = next
            .map(|t| t.duration_since(SystemTime::now()).unwrap_or_default() + TICK_SLACK)
            .unwrap_or(inner.opts.interval)
            .min(inner.opts.interval);
        let changed = async {
            match followed.as_mut().map(|(_, v)| v) {
                Some(v) => v.changed().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = changed => {}
            _ = shutdown.cancelled() => return,
        }
    }
}
