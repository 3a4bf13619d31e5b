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
    // Live sessions as the watch shows them: worker -> (session, revision,
    // session timeout).
    let mut live: HashMap<String, (String, u64, Duration)> = HashMap::new();
    let mut suspects: HashMap<String, (u64, u32)> = HashMap::new();
    let mut watch: Option<kv::Watch> = None;
    let mut tick = tokio::time::interval(inner.opts.probe_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if watch.is_none() {
            match sessions.kv().watch_with_history(">").await {
                Ok(w) => {
                    live.clear();
                    watch = Some(w);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "cannot watch sessions; retrying");
                    tokio::select! { _ = tokio::time::sleep(Duration::from_secs(1)) => continue, _ = shutdown.cancelled() => return }
                }
            }
        }
        let w = watch.as_mut().expect("set above");
        tokio::select! {
            _ = shutdown.cancelled() => return,
            e = w.next() => match e {
                Some(Ok(e)) if e.operation == kv::Operation::Put => {
                    let info: SessionInfo = serde_json::from_slice(&e.value).unwrap_or_default();
                    let timeout = Duration::from_millis(info.timeout_ms);
                    live.insert(e.key.clone(), (info.session, e.revision, timeout));
                }
                Some(Ok(e)) => { live.remove(&e.key); suspects.remove(&e.key); }
                _ => { watch = None; }
            },
            _ = tick.tick() => {
                // Our own view of the server must have settled first: right
                // after a reconnect every worker may still be reconnecting
                // (the one settle rule, `leasehold_store::liveness`).
                if inner.recovery.liveness.settling().is_some() {
                    suspects.clear();
                    continue;
                }
                let timeout = inner.opts.probe_interval.max(Duration::from_millis(200));
                // The workers of this reaper's shards only.
                let shards = inner.shards.borrow().clone();
                let pings = futures::future::join_all(live.iter().filter(|(w, _)| shards.mine(w)).map(|(w, (_, rev, ttl))| {
                    let (s, w, rev, ttl) = (sessions.clone(), w.clone(), *rev, *ttl);
                    async move { (w.clone(), rev, ttl, s.ping(&w, timeout).await) }
                }))
                .await;
                for (worker, rev, ttl, ping) in pings {
                    if ping != Ping::NoResponders {
                        suspects.remove(&worker);
                        continue;
                    }
                    let seen = suspects.entry(worker.clone()).or_insert((rev, 0));
                    if seen.0 != rev {
                        *seen = (rev, 0);
                    }
                    seen.1 += 1;
                    if seen.1 < 2 {
                        continue;
                    }
                    suspects.remove(&worker);
                    // Marked as the probe's: a process that is only
                    // reconnecting gets a settle time before its jobs move.
                    match sessions.end_by_probe(&worker, rev, ttl).await {
                        Ok(true) => {
                            inner.stats.sessions_ended_fast.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(worker, reaper_id = %inner.id, "worker's connection is gone (no responders): ended its session");
                        }
                        Ok(false) => {}
                        Err(e) => tracing::debug!(worker, error = %e, "ending a session failed"),
                    }
                }
            }
        }
    }
}
