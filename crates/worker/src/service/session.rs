//! The process's session: one key in `lh_sessions`, renewed every
//! `--session-renew` with a TTL of `--session-timeout`, conditioned on the
//! revision last written (see `leasehold_store::sessions`).
//!
//! - [`begin`]: at start. A key of this worker id held by another process
//!   is taken over only once that process is gone: a ping answered means a
//!   duplicate `--worker-id` (refused with a clear error), "no responders"
//!   means it died (taken over at once), silence means it may be paused
//!   (wait for its key to expire).
//! - [`renew_loop`]: the one periodic liveness write of the process. A
//!   refused renewal means the key moved: gone (expired while NATS or this
//!   process was away, or ended by a reaper that saw the connection drop)
//!   is written again under the same session, and every running job is
//!   re-checked, since any of them may have been re-offered meanwhile;
//!   another process's key means this identity was taken over, and this
//!   process stops.
//! - [`respond`]: answers `lh.workers.<id>.ping` with the session, says
//!   whether it runs a job (`lh.workers.<id>.runs`, "<job> <epoch>": yes/no),
//!   and turns `lh.workers.<id>.cancel` into a stop of that job's attempt.
//! - [`end`]: at a clean shutdown, deletes the key so recovery of anything
//!   left starts at once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::metrics::Renewal;
use futures::StreamExt;
use leasehold_core::time::rfc3339;
use leasehold_store::sessions::{Current, Ping, SessionClock, SessionError, SessionInfo};
use tokio_util::sync::CancellationToken;

use super::{Shared, Stop};

/// The process's session.
pub(crate) struct SessionState {
    pub(crate) id: String,
    pub(crate) info: SessionInfo,
    pub(crate) timeout: Duration,
    pub(crate) renew: Duration,
    pub(crate) clock: SessionClock,
    /// Revision of the key as this process last wrote it.
    revision: AtomicU64,
}

impl SessionState {
    /// Names the process's job slots in its session (the console shows them).
    pub(crate) fn with_slots(mut self, slots: usize) -> Self {
        self.info.slots = slots as u32;
        self
    }

    pub(crate) fn new(
        worker_id: &str,
        session: &str,
        kinds: &[String],
        timeout: Duration,
        renew: Duration,
    ) -> Self {
        let info = SessionInfo {
            worker_id: worker_id.into(),
            session: session.into(),
            started_at: rfc3339(SystemTime::now()),
            host: hostname(),
            pid: std::process::id(),
            kinds: kinds.to_vec(),
            version: env!("CARGO_PKG_VERSION").into(),
            ..Default::default()
        };
        SessionState {
            id: session.into(),
            info,
            timeout,
            renew,
            // Writes are trusted while the last renewal is younger than the
            // timeout less one renewal interval: by then the server may be
            // about to end the key.
            clock: SessionClock::new(timeout.saturating_sub(renew)),
            revision: AtomicU64::new(0),
        }
    }
}

fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Subscribes the responder, then writes the session key (taking it over
/// from a dead earlier process of this identity). Returns the responder's
/// subscription.
pub(crate) async fn begin(shared: &Arc<Shared>) -> anyhow::Result<async_nats::Subscriber> {
    let s = &shared.session;
    let w = &shared.worker_id;
    let deadline = tokio::time::Instant::now() + s.timeout + Duration::from_secs(5);
    // A leader election of the sessions stream (a node restarting) is
    // waited out, not fatal: the worker starts once the stream answers.
    let unavailable_until = tokio::time::Instant::now() + super::START_DEADLINE;
    let mut pause = Backoff::default();
    // Decide the revision to write at before our own responder exists, so
    // a ping of this identity reaches only an earlier process.
    let expected = loop {
        let current = match shared.sessions.current(w).await {
            Ok(c) => c,
            Err(e) => {
                pause
                    .wait("read this identity's session", &e, unavailable_until)
                    .await?;
                continue;
            }
        };
        match current {
            Current::Absent => break 0,
            Current::Ended { revision, .. } => break revision,
            Current::Live { info, revision } => {
                match shared.sessions.ping(w, Duration::from_secs(1)).await {
                    Ping::Alive(other) => anyhow::bail!(
                        "worker id {w:?} is in use by a live process (session {other}, host {:?}, pid {}); give each process its own --worker-id",
                        info.host,
                        info.pid
                    ),
                    Ping::NoResponders => {
                        tracing::info!(worker_id = %w, previous = %info.session, "an earlier process of this identity is gone; taking over its session");
                        break revision;
                    }
                    Ping::Timeout | Ping::Failed(_) => {
                        anyhow::ensure!(
                            tokio::time::Instant::now() < deadline,
                            "worker id {w:?}: an earlier process (session {}) neither answers nor lets its session expire",
                            info.session
                        );
                        tracing::info!(worker_id = %w, previous = %info.session, "an earlier process of this identity does not answer; waiting for its session to expire");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
        }
    };
    let sub = shared
        .conn
        .client
        .subscribe(shared.conn.layout.worker_wildcard(w))
        .await?;
    // The subscription is registered once a round trip completed.
    shared.conn.js.query_account().await?;
    let mut tried = false;
    let rev = loop {
        match shared
            .sessions
            .write(&s.info, s.timeout, expected, true)
            .await
        {
            Ok(rev) => break rev,
            Err(SessionError::Changed) => {
                // A write of ours whose reply was lost may have landed.
                if tried {
                    if let Ok(Current::Live { info, revision }) = shared.sessions.current(w).await {
                        if info.session == s.info.session {
                            break revision;
                        }
                    }
                }
                anyhow::bail!(
                    "worker id {w:?}: another process wrote this identity's session while this one started; give each process its own --worker-id"
                )
            }
            Err(SessionError::Nats(m)) => {
                tried = true;
                pause
                    .wait("open the session", &m, unavailable_until)
                    .await?;
            }
        }
    };
    s.revision.store(rev, Ordering::Relaxed);
    s.clock.confirm();
    shared.metrics.session_renewal(Renewal::Ok);
    Ok(sub)
}

/// The pause between start-up attempts against a sessions stream that does
/// not answer: 100 ms doubling to 1 s, until a deadline.
#[derive(Default)]
struct Backoff(u32);

impl Backoff {
    async fn wait(
        &mut self,
        what: &str,
        e: &dyn std::fmt::Display,
        until: tokio::time::Instant,
    ) -> anyhow::Result<()> {
        let d = Duration::from_millis(100 << self.0.min(3)).min(Duration::from_secs(1));
        anyhow::ensure!(
            tokio::time::Instant::now() + d < until,
            "cannot {what}: {e} (gave up after {:?})",
            super::START_DEADLINE
        );
        tracing::warn!(error = %e, retry_in_ms = d.as_millis() as u64, "cannot {what} yet; retrying");
        self.0 += 1;
        tokio::time::sleep(d).await;
        Ok(())
    }
}

/// Renews the session until `stop`.
pub(crate) async fn renew_loop(shared: Arc<Shared>, stop: CancellationToken) {
    let s = &shared.session;
    let mut every = tokio::time::interval(s.renew);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every.tick().await;
    let link = shared.conn.link.clone();
    loop {
        // Renew at once when the connection comes back: a reconnect is the
        // window in which a prober sees "no responders" for this live
        // process, and a fresh revision makes its conditioned end miss.
        tokio::select! {
            _ = every.tick() => {}
            _ = link.reconnected() => { every.reset(); }
            _ = stop.cancelled() => return
        }
        // A renewal that comes after the session may have ended (this
        // process was paused, or NATS was away) re-checks every job.
        let stale = s.clock.age() >= s.clock_max_age();
        let expected = s.revision.load(Ordering::Relaxed);
        match shared
            .sessions
            .write(&s.info, s.timeout, expected, false)
            .await
        {
            Ok(rev) => {
                s.revision.store(rev, Ordering::Relaxed);
                s.clock.confirm();
                shared.metrics.session_renewal(Renewal::Ok);
                if stale {
                    reverify(&shared).await;
                }
            }
            Err(SessionError::Changed) => {
                shared.metrics.session_renewal(Renewal::Lost);
                restore(&shared).await
            }
            Err(SessionError::Nats(m)) => {
                shared.metrics.session_renewal(Renewal::Failed);
                tracing::warn!(error = %m, age = %leasehold_core::time::human_duration(s.clock.age()), "session renewal failed; retrying");
                // Retry sooner than the interval: the timeout is close.
                tokio::select! { _ = tokio::time::sleep(s.renew / 4) => {}, _ = stop.cancelled() => return }
            }
        }
    }
}

impl SessionState {
    fn clock_max_age(&self) -> Duration {
        self.timeout.saturating_sub(self.renew)
    }
}

/// The key is not where this process left it.
async fn restore(shared: &Arc<Shared>) {
    let s = &shared.session;
    let cur = match shared.sessions.current(&shared.worker_id).await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the session key; retrying at the next renewal");
            return;
        }
    };
    let expected = match cur {
        Current::Live { info, revision } if info.session == s.id => {
            s.revision.store(revision, Ordering::Relaxed);
            return;
        }
        Current::Live { info, .. } => {
            tracing::error!(worker_id = %shared.worker_id, other = %info.session, host = %info.host, pid = info.pid, "another process took over this worker id; stopping every job here and shutting down");
            stop_all(shared, "another process took over this worker identity");
            shared.shutdown.cancel();
            return;
        }
        Current::Ended { revision, .. } => revision,
        Current::Absent => 0,
    };
    tracing::warn!(worker_id = %shared.worker_id, session = %s.id, "the session key was gone (expired or ended while this process was away); writing it again and re-checking every job");
    match shared
        .sessions
        .write(&s.info, s.timeout, expected, false)
        .await
    {
        Ok(rev) => {
            s.revision.store(rev, Ordering::Relaxed);
            s.clock.confirm();
            shared
                .stats
                .session_restored
                .fetch_add(1, Ordering::Relaxed);
            reverify(shared).await;
        }
        Err(e) => {
            tracing::warn!(error = %e, "writing the session again failed; retrying at the next renewal")
        }
    }
}

/// Re-checks every running job's ownership; stops those re-offered.
async fn reverify(shared: &Arc<Shared>) {
    let jobs: Vec<(
        String,
        tokio::sync::mpsc::Sender<Stop>,
        leasehold_store::Gate,
    )> = shared
        .running
        .lock()
        .unwrap()
        .iter()
        .filter_map(|(id, r)| r.gate.clone().map(|g| (id.clone(), r.stop.clone(), g)))
        .collect();
    for (id, stop, gate) in jobs {
        match gate.check().await {
            Ok(_) => {}
            Err(e) if e.is_ownership_lost() => {
                tracing::warn!(job = %id, "re-offered while this process was away: {e}");
                let _ = stop.try_send(Stop::Lost(e.to_string()));
            }
            Err(e) => {
                tracing::debug!(job = %id, error = %e, "re-check failed; the next owner write decides")
            }
        }
    }
}

/// Stops every running attempt as lost.
fn stop_all(shared: &Shared, why: &str) {
    for r in shared.running.lock().unwrap().values() {
        let _ = r.stop.try_send(Stop::Lost(why.to_string()));
    }
}

/// Answers pings and cancel notifications until `stop`.
pub(crate) async fn respond(
    shared: Arc<Shared>,
    mut sub: async_nats::Subscriber,
    stop: CancellationToken,
) {
    loop {
        let m = tokio::select! {
            m = sub.next() => match m { Some(m) => m, None => return },
            _ = stop.cancelled() => break,
        };
        let what = m.subject.rsplit('.').next().unwrap_or_default();
        match what {
            "ping" => {
                if let Some(reply) = m.reply {
                    let _ = shared
                        .conn
                        .client
                        .publish(reply, shared.session.id.clone().into())
                        .await;
                }
            }
            "runs" => {
                let text = String::from_utf8_lossy(&m.payload).to_string();
                let mut it = text.split_whitespace();
                let (job, epoch) = (
                    it.next().unwrap_or_default(),
                    it.next().and_then(|e| e.parse::<u64>().ok()),
                );
                let yes = shared.claiming.lock().unwrap().contains(job)
                    || shared
                        .running
                        .lock()
                        .unwrap()
                        .get(job)
                        .is_some_and(|r| Some(r.epoch) == epoch);
                if let Some(reply) = m.reply {
                    let body = if yes { "yes" } else { "no" };
                    let _ = shared.conn.client.publish(reply, body.into()).await;
                }
            }
            "cancel" => {
                let id = String::from_utf8_lossy(&m.payload).to_string();
                let found = shared
                    .running
                    .lock()
                    .unwrap()
                    .get(&id)
                    .map(|r| r.stop.clone());
                if let Some(tx) = &found {
                    tracing::info!(job = %id, "cancel requested");
                    let _ = tx.try_send(Stop::Cancel);
                }
                if let Some(reply) = m.reply {
                    let body = if found.is_some() {
                        "stopping"
                    } else {
                        "not running here"
                    };
                    let _ = shared.conn.client.publish(reply, body.into()).await;
                }
            }
            _ => {}
        }
    }
    // Stop answering before the key goes, so a ping after `end` finds nobody.
    let _ = sub.unsubscribe().await;
}

/// Deletes the session key at a clean shutdown (if it is still ours).
pub(crate) async fn end(shared: &Shared) {
    let rev = shared.session.revision.load(Ordering::Relaxed);
    match shared.sessions.end_if(&shared.worker_id, rev).await {
        Ok(true) => tracing::info!(session = %shared.session.id, "session ended"),
        Ok(false) => {}
        Err(e) => tracing::debug!(error = %e, "ending the session failed; it expires on its own"),
    }
}
