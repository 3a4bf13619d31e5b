//! The prober: every `--probe-interval`, a ping to every live worker
//! session of this reaper's shards; "no responders" twice in a row ends the
//! session at once.

use super::*;

/// Pings every live session; ends those whose process's connection is gone.
pub(super) async fn probe_loop(inner: Arc<Inner>, shutdown: CancellationToken) {
    if inner.opts.probe_interval.is_zero() {
        return;
    }
    let sessions = inner.recovery.sessions.clone();
    // Workers that gave no answer: (the revision of their session then,
    // how many probes in a row).
    let mut suspects: HashMap<String, (u64, u32)> = HashMap::new();
    let mut tick = tokio::time::interval(inner.opts.probe_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        // Our own view of the server must have settled first: right after
        // a reconnect every worker may still be reconnecting (the one
        // settle rule, `leasehold_store::liveness`); and the live sessions
        // must have been read.
        let live = match inner.live.live() {
            Some(l) if inner.recovery.liveness.settling().is_none() => l,
            _ => {
                suspects.clear();
                continue;
            }
        };
        suspects.retain(|w, _| live.iter().any(|s| s.worker == *w));
        let timeout = inner.opts.probe_interval.max(Duration::from_millis(200));
        // The workers of this reaper's shards only.
        let shards = inner.shards.borrow().clone();
        let pings =
            futures::future::join_all(live.into_iter().filter(|s| shards.mine(&s.worker)).map(
                |s| {
                    let sessions = sessions.clone();
                    async move {
                        let ping = sessions.ping(&s.worker, timeout).await;
                        (s, ping)
                    }
                },
            ))
            .await;
        for (s, ping) in pings {
            if ping != Ping::NoResponders {
                suspects.remove(&s.worker);
                continue;
            }
            let seen = suspects.entry(s.worker.clone()).or_insert((s.revision, 0));
            if seen.0 != s.revision {
                *seen = (s.revision, 0);
            }
            seen.1 += 1;
            if seen.1 < 2 {
                continue;
            }
            suspects.remove(&s.worker);
            // Marked as the probe's: a process that is only reconnecting
            // gets a settle time before its jobs move.
            match sessions
                .end_by_probe(&s.worker, s.revision, s.timeout)
                .await
            {
                Ok(true) => {
                    inner
                        .stats
                        .sessions_ended_fast
                        .fetch_add(1, Ordering::Relaxed);
                    let worker = &s.worker;
                    tracing::warn!(worker, reaper_id = %inner.id, "worker's connection is gone (no responders): ended its session");
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::debug!(worker = %s.worker, error = %e, "ending a session failed")
                }
            }
        }
    }
}
