//! One rule for "is this job's owner there?".
//!
//! Every path that may move a running job away from its recorded owner asks
//! [`Liveness::owner`]: the claim of a ticket, the reaper's sweep, the
//! watcher of ended sessions, max-deliveries advisories, the restart
//! reclaim of a stable identity. The reaper's crash probe asks the same
//! settle question ([`Liveness::settling`]) before it acts on "no
//! responders". The answer is one of three:
//!
//! - [`Verdict::Alive`]: the recorded session is the live one (read from the
//!   sessions stream's leader, never a replica that may lag), and the
//!   process did not say it does not run the job; or the key ended but the
//!   process answers as that very session (it only lost its key while NATS
//!   was away and writes it again itself).
//! - [`Verdict::Gone`]: the key ended (or names another incarnation of the
//!   id) and the process does not answer as the recorded session, or the
//!   live process itself said it does not run the job at that epoch.
//! - [`Verdict::Unknown`]: we cannot tell: our own connection came back
//!   less than the settle time ago (a server restart ends every session at
//!   once and their workers need a moment to reconnect), the key was ended
//!   by a reaper's crash probe less than a settle time ago (in this
//!   process's view) and the process does not answer yet (a worker whose
//!   connection dropped for a moment shows the same "no responders" as a
//!   crashed one until it reconnected), the sessions stream did not
//!   answer, or the request could not be made.
//!
//! `Unknown` never re-offers: the caller waits and asks again. A false
//! "gone" costs a job its work and a stale reclaim, which counts towards
//! poison; a late "gone" costs only time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::connect::Link;
use crate::sessions::{Current, Ping, Runs, Sessions};

/// How long after our own reconnect nobody is judged: every worker that
/// lost the same server needs this long to reconnect and answer.
pub const SETTLE_AFTER_RECONNECT: Duration = Duration::from_secs(4);

/// The answer to "is this job's owner there?".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The recorded session is alive (and, when asked about a job, runs it).
    Alive,
    /// The owner is gone; the reason is for logs and events.
    Gone(String),
    /// Cannot tell now: never act on it, ask again later.
    Unknown(Unsure),
}

/// Why a [`Verdict`] is unknown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unsure {
    /// Our own connection came back this long ago, less than the settle time.
    Settling(Duration),
    /// The session key or the process could not be read (NATS unavailable).
    Unreadable(String),
    /// The key ended, but the process answers as the recorded session: it
    /// lost its key (NATS was away) and is expected to write it again.
    KeyLostButAnswers,
    /// A reaper's crash probe ended the key, first seen here this long ago
    /// (less than the settle time), and the process does not answer yet: it
    /// may be reconnecting.
    ProbeEnded(Duration),
}

impl Verdict {
    pub fn is_alive(&self) -> bool {
        matches!(self, Verdict::Alive)
    }
    pub fn is_gone(&self) -> bool {
        matches!(self, Verdict::Gone(_))
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verdict::Alive => f.write_str("alive"),
            Verdict::Gone(why) => write!(f, "gone: {why}"),
            Verdict::Unknown(Unsure::Settling(up)) => write!(
                f,
                "unknown: our connection came back {} ms ago (settling for {} s)",
                up.as_millis(),
                SETTLE_AFTER_RECONNECT.as_secs()
            ),
            Verdict::Unknown(Unsure::Unreadable(e)) => write!(f, "unknown: {e}"),
            Verdict::Unknown(Unsure::KeyLostButAnswers) => {
                f.write_str("unknown: its session key ended but the process answers")
            }
            Verdict::Unknown(Unsure::ProbeEnded(seen)) => write!(
                f,
                "unknown: a reaper's probe ended its session {} ms ago and it does not answer yet (waiting {} s for a reconnect)",
                seen.as_millis(),
                SETTLE_AFTER_RECONNECT.as_secs()
            ),
        }
    }
}

/// The settle rule, pure: `reconnects` of our connection and how long it has
/// been up now. `Some(up)` while the view has not settled.
pub fn settling(reconnects: u64, up: Duration, settle: Duration) -> Option<Duration> {
    (reconnects > 0 && up < settle).then_some(up)
}

/// What the process and its key say, combined into the verdict (pure).
///
/// `key`: the session key as the leader has it; `runs`: the process's own
/// answer about the job, when asked and the key is live; `ping`: its answer
/// to a ping, when the key is not live; `probe_grace`: how long ago this
/// process first saw the key ended by a reaper's probe, while that is less
/// than the settle time.
pub fn judge(
    recorded: Option<&str>,
    key: &Current,
    runs: Option<Runs>,
    ping: Option<&Ping>,
    probe_grace: Option<Duration>,
) -> Verdict {
    let Some(recorded) = recorded else {
        return Verdict::Gone("the record names no session".into());
    };
    match key {
        Current::Live { info, .. } if info.session == recorded => match runs {
            // Only the process's own "no" moves a job from a live session;
            // silence leaves it to the session's TTL and the crash probe.
            Some(Runs::No) => Verdict::Gone("its live process says it does not run the job".into()),
            _ => Verdict::Alive,
        },
        Current::Live { info, .. } => Verdict::Gone(format!(
            "another process of this worker id holds the session now ({})",
            info.session
        )),
        Current::Ended { .. } | Current::Absent => match ping {
            Some(Ping::Alive(s)) if s == recorded => Verdict::Unknown(Unsure::KeyLostButAnswers),
            Some(Ping::Alive(s)) => Verdict::Gone(format!(
                "its session ended and the id answers as another process ({s})"
            )),
            Some(Ping::NoResponders) | Some(Ping::Timeout) | None => match (key, probe_grace) {
                (
                    Current::Ended {
                        by_probe: Some(_), ..
                    },
                    Some(seen),
                ) => Verdict::Unknown(Unsure::ProbeEnded(seen)),
                _ => Verdict::Gone("its session ended".into()),
            },
            Some(Ping::Failed(e)) => Verdict::Unknown(Unsure::Unreadable(e.clone())),
        },
    }
}

/// Asks the one question, for every caller.
#[derive(Clone)]
pub struct Liveness {
    sessions: Sessions,
    link: Link,
    settle: Duration,
    ping_timeout: Duration,
    /// When this process first saw each probe-ended key (worker, marker
    /// revision), on its monotonic clock: the marker's own time is another
    /// host's clock.
    probe_ends: Arc<Mutex<HashMap<(String, u64), Instant>>>,
}

impl Liveness {
    /// The connection's events this rule follows.
    pub fn link(&self) -> &Link {
        &self.link
    }

    pub fn new(sessions: Sessions, link: Link) -> Self {
        Liveness {
            sessions,
            link,
            settle: SETTLE_AFTER_RECONNECT,
            ping_timeout: Duration::from_millis(500),
            probe_ends: Default::default(),
        }
    }

    /// How long ago this process first saw `worker`'s key ended by a probe
    /// at `revision`, while that is less than the settle time and the
    /// ended session's `timeout` (never longer than its TTL would wait).
    fn probe_grace(&self, worker: &str, revision: u64, timeout: Duration) -> Option<Duration> {
        let mut seen = self.probe_ends.lock().unwrap();
        let keep = self.settle * 4;
        seen.retain(|_, t| t.elapsed() < keep);
        let first = *seen
            .entry((worker.to_string(), revision))
            .or_insert_with(Instant::now);
        let age = first.elapsed();
        (age < self.settle.min(timeout)).then_some(age)
    }

    /// The same rule with another settle time (tests, short sessions).
    pub fn with_settle(mut self, settle: Duration) -> Self {
        self.settle = settle;
        self
    }

    pub fn settle(&self) -> Duration {
        self.settle
    }

    /// `Some(up)` while our own connection came back less than the settle
    /// time ago: nobody is judged then.
    pub fn settling(&self) -> Option<Duration> {
        settling(
            self.link.reconnects(),
            self.link.connected_for(),
            self.settle,
        )
    }

    /// Is the owner `worker` (session `session`, as the record names it)
    /// there? With `job` given, a live process is also asked whether it runs
    /// that job at that epoch.
    pub async fn owner(
        &self,
        worker: &str,
        session: Option<&str>,
        job: Option<(&str, u64)>,
    ) -> Verdict {
        if let Some(up) = self.settling() {
            return Verdict::Unknown(Unsure::Settling(up));
        }
        let key = match self.sessions.current(worker).await {
            Ok(k) => k,
            Err(e) => return Verdict::Unknown(Unsure::Unreadable(e.to_string())),
        };
        let live_as_recorded =
            matches!(&key, Current::Live { info, .. } if Some(info.session.as_str()) == session);
        let runs = match job {
            Some((job, epoch)) if live_as_recorded => Some(
                self.sessions
                    .runs(worker, job, epoch, Duration::from_secs(1))
                    .await,
            ),
            _ => None,
        };
        let ping = if matches!(key, Current::Live { .. }) || session.is_none() {
            None
        } else {
            Some(self.sessions.ping(worker, self.ping_timeout).await)
        };
        let grace = match &key {
            Current::Ended {
                revision,
                by_probe: Some(timeout),
            } => self.probe_grace(worker, *revision, *timeout),
            _ => None,
        };
        judge(session, &key, runs, ping.as_ref(), grace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sessions::SessionInfo;

    fn live(s: &str) -> Current {
        Current::Live {
            info: SessionInfo {
                session: s.into(),
                ..Default::default()
            },
            revision: 7,
        }
    }

    #[test]
    fn a_live_recorded_session_is_alive_unless_its_process_says_no() {
        let k = live("s1");
        assert_eq!(judge(Some("s1"), &k, None, None, None), Verdict::Alive);
        assert_eq!(
            judge(Some("s1"), &k, Some(Runs::Yes), None, None),
            Verdict::Alive
        );
        // Silence (a reconnecting process) is not a "no".
        assert_eq!(
            judge(Some("s1"), &k, Some(Runs::Unknown), None, None),
            Verdict::Alive
        );
        assert!(judge(Some("s1"), &k, Some(Runs::No), None, None).is_gone());
    }

    #[test]
    fn another_incarnation_of_the_id_means_the_recorded_one_is_gone() {
        assert!(judge(Some("s1"), &live("s2"), None, None, None).is_gone());
    }

    #[test]
    fn an_ended_key_is_gone_unless_the_process_answers_as_that_session() {
        let ended = Current::Ended {
            revision: 3,
            by_probe: None,
        };
        assert!(judge(Some("s1"), &ended, None, Some(&Ping::NoResponders), None).is_gone());
        assert!(judge(Some("s1"), &ended, None, Some(&Ping::Timeout), None).is_gone());
        assert!(judge(Some("s1"), &Current::Absent, None, None, None).is_gone());
        assert_eq!(
            judge(
                Some("s1"),
                &ended,
                None,
                Some(&Ping::Alive("s1".into())),
                None
            ),
            Verdict::Unknown(Unsure::KeyLostButAnswers)
        );
        assert!(judge(
            Some("s1"),
            &ended,
            None,
            Some(&Ping::Alive("s2".into())),
            None
        )
        .is_gone());
        assert!(matches!(
            judge(
                Some("s1"),
                &ended,
                None,
                Some(&Ping::Failed("down".into())),
                None
            ),
            Verdict::Unknown(Unsure::Unreadable(_))
        ));
    }

    #[test]
    fn a_key_a_probe_ended_is_unknown_for_a_settle_time_unless_the_process_answers() {
        let probed = Current::Ended {
            revision: 3,
            by_probe: Some(Duration::from_secs(10)),
        };
        let young = Some(Duration::from_millis(600));
        for silent in [Ping::NoResponders, Ping::Timeout] {
            assert_eq!(
                judge(Some("s1"), &probed, None, Some(&silent), young),
                Verdict::Unknown(Unsure::ProbeEnded(Duration::from_millis(600)))
            );
            // Once the settle time passed, silence is gone as for any end.
            assert!(judge(Some("s1"), &probed, None, Some(&silent), None).is_gone());
        }
        // An answer decides at once, either way.
        assert_eq!(
            judge(
                Some("s1"),
                &probed,
                None,
                Some(&Ping::Alive("s1".into())),
                young
            ),
            Verdict::Unknown(Unsure::KeyLostButAnswers)
        );
        assert!(judge(
            Some("s1"),
            &probed,
            None,
            Some(&Ping::Alive("s2".into())),
            young
        )
        .is_gone());
        // An end by its TTL or its process gets no grace.
        let expired = Current::Ended {
            revision: 3,
            by_probe: None,
        };
        assert!(judge(Some("s1"), &expired, None, Some(&Ping::NoResponders), young).is_gone());
    }

    #[test]
    fn a_record_without_a_session_has_no_owner() {
        assert!(judge(None, &live("s1"), None, None, None).is_gone());
    }

    #[test]
    fn nobody_is_judged_right_after_our_own_reconnect() {
        let s = Duration::from_secs(4);
        assert_eq!(settling(0, Duration::ZERO, s), None);
        assert_eq!(
            settling(1, Duration::from_secs(1), s),
            Some(Duration::from_secs(1))
        );
        assert_eq!(settling(1, Duration::from_secs(5), s), None);
    }
}
