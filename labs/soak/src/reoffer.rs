//! Re-offers of live owners: the invariant that a job is taken from its
//! owner only when that owner is gone.
//!
//! A re-offer is seen from outside in two places:
//! - a recoverer's `progress` event with `"recovered": true` and
//!   `"worker": W` (the `Reoffered` branch of `store::recovery`), written at
//!   the epoch the owner held;
//! - a record revision whose `stale_reclaims` rose (a re-offer writes
//!   `running -> queued` with it, a claim of a job whose owner was judged
//!   gone writes it with the next epoch); the owner is the last `running`
//!   revision before it (its worker and session).
//!
//! Both name the same re-offer by (job, the owner's epoch). Each is then
//! judged against what the soak knows of the owner's process (the
//! [`Incarnation`] whose session the record names) and of the faults it
//! injected:
//! - the process had ended (killed, stopped, crashed), or ended within
//!   [`GRACE`] after: a true re-offer;
//! - a fault of the soak held that process (paused, partitioned, being
//!   stopped) at that moment, or had been lifted less than [`GRACE`] before
//!   (before a paused or partitioned process answered a ping again, the
//!   window stays open): a true re-offer;
//! - otherwise the process was alive, undisturbed and stayed alive: a
//!   **false re-offer**, a failure.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use leasehold_core::time::{parse_rfc3339, rfc3339};
use serde::Serialize;

use crate::chaos::Injected;
use crate::collect::Collected;
use crate::fleet::Incarnation;

/// How long after a fault was lifted (or after a process ended) a re-offer
/// is still that fault's: a recoverer's decision taken while the fault held
/// (a ping that timed out, a session that had ended) lands a moment later,
/// after its writes.
pub const GRACE: Duration = Duration::from_secs(5);

/// One re-offer of an owner's job.
#[derive(Debug, Clone, Serialize)]
pub struct Reoffer {
    pub job: String,
    /// The epoch the owner held.
    pub epoch: u64,
    pub owner: String,
    pub session: Option<String>,
    pub at: String,
    #[serde(skip)]
    pub at_t: Option<SystemTime>,
    /// `event` (a recoverer's `recovered` progress), `record`
    /// (`stale_reclaims` rose), or both.
    pub seen_in: Vec<&'static str>,
    /// The recoverer (`by` of the event), or the claimer of the next epoch.
    pub by: Option<String>,
    /// The claimer's session, when a claim counted the stale reclaim.
    pub claimer_session: Option<String>,
    /// `false`, `owner_gone`, `fault`, `unattributed`.
    pub judged: &'static str,
    pub why: String,
}

/// Every re-offer in the records and events, by (job, epoch), not judged yet.
pub fn find(c: &Collected) -> Vec<Reoffer> {
    let mut out: BTreeMap<(String, u64), Reoffer> = BTreeMap::new();
    for (job, revs) in &c.audit {
        let mut last_running: Option<&leasehold_core::JobRecord> = None;
        let mut prev_stale: Option<u32> = None;
        for rec in revs.iter().filter_map(|r| r.rec.as_ref()) {
            if let (Some(p), Some(owner)) = (prev_stale, last_running) {
                if rec.stale_reclaims > p {
                    let at_t = parse_rfc3339(&rec.updated_at);
                    out.insert(
                        (job.clone(), owner.epoch),
                        Reoffer {
                            job: job.clone(),
                            epoch: owner.epoch,
                            owner: owner.worker_id.clone().unwrap_or_default(),
                            session: owner.session.clone(),
                            at: rec.updated_at.clone(),
                            at_t,
                            seen_in: vec!["record"],
                            by: (rec.status == "running")
                                .then(|| rec.worker_id.clone())
                                .flatten()
                                .map(|w| format!("claim by {w}")),
                            claimer_session: (rec.status == "running")
                                .then(|| rec.session.clone())
                                .flatten(),
                            judged: "",
                            why: String::new(),
                        },
                    );
                }
            }
            prev_stale = Some(rec.stale_reclaims);
            if rec.status == "running" {
                last_running = Some(rec);
            }
        }
    }
    for (job, evs) in &c.events {
        for (_, ev) in evs {
            if ev.r#type != "progress" || ev.worker_id.is_some() {
                continue;
            }
            let d = ev.data_map();
            let (Some(true), Some(w)) = (
                d.get("recovered").and_then(|v| v.as_bool()),
                d.get("worker").and_then(|v| v.as_str()),
            ) else {
                continue;
            };
            let by = d.get("by").and_then(|v| v.as_str()).map(str::to_string);
            let at_t = parse_rfc3339(&ev.at);
            let r = out.entry((job.clone(), ev.epoch)).or_insert_with(|| {
                // The owner's session: its running revision at that epoch.
                let session = c
                    .audit
                    .get(job)
                    .into_iter()
                    .flatten()
                    .filter_map(|r| r.rec.as_ref())
                    .find(|r| {
                        r.status == "running"
                            && r.epoch == ev.epoch
                            && r.worker_id.as_deref() == Some(w)
                    })
                    .and_then(|r| r.session.clone());
                Reoffer {
                    job: job.clone(),
                    epoch: ev.epoch,
                    owner: w.to_string(),
                    session,
                    at: ev.at.clone(),
                    at_t,
                    seen_in: Vec::new(),
                    by: None,
                    claimer_session: None,
                    judged: "",
                    why: String::new(),
                }
            });
            if !r.seen_in.contains(&"event") {
                r.seen_in.push("event");
            }
            if by.is_some() {
                r.by = by;
            }
            // The decision is the earlier of the two times.
            if let (Some(a), Some(b)) = (at_t, r.at_t) {
                if a < b {
                    r.at_t = Some(a);
                    r.at = ev.at.clone();
                }
            }
        }
    }
    out.into_values().collect()
}

/// A span during which the soak held one worker process.
#[derive(Debug, Clone)]
pub struct Disturbance {
    pub slot: usize,
    pub generation: u32,
    pub from: SystemTime,
    /// The fault lifted, and the process reachable again where that is
    /// known (a pause or a partition).
    pub to: SystemTime,
    pub what: String,
}

/// The worker faults of a run as spans over the processes they hit.
pub fn disturbances(injected: &[Injected]) -> Vec<Disturbance> {
    injected
        .iter()
        .filter_map(|f| {
            // A cut well inside the session timeout excuses nothing: the
            // owner must keep its jobs through it.
            if f.name == "partition_blip" {
                return None;
            }
            let slot = f.fault.worker()?;
            let lifted = f.restored_at;
            let to = match f.name {
                // Lifted when the process answers again; a minute at most.
                "sigstop_worker" | "partition_freeze" | "partition_cut" => f
                    .reachable_ms
                    .map(|ms| f.at + Duration::from_millis(ms.saturating_sub(f.at_ms)))
                    .unwrap_or(lifted + Duration::from_secs(60))
                    .max(lifted),
                _ => lifted,
            };
            Some(Disturbance {
                slot,
                generation: f.generation?,
                from: f.at,
                to,
                what: format!("{} (fault {})", f.name, f.n),
            })
        })
        .collect()
}

fn secs(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

/// Judges each re-offer (fills `judged` and `why`).
pub fn judge(reoffers: &mut [Reoffer], procs: &[Incarnation], spans: &[Disturbance]) {
    for r in reoffers.iter_mut() {
        let (judged, why) = judge_one(r, procs, spans);
        r.judged = judged;
        r.why = why;
    }
}

fn judge_one(r: &Reoffer, procs: &[Incarnation], spans: &[Disturbance]) -> (&'static str, String) {
    let Some(t) = r.at_t else {
        return ("unattributed", format!("unreadable time {:?}", r.at));
    };
    let owner = match &r.session {
        Some(s) => procs.iter().find(|p| p.session.as_ref() == Some(s)),
        // No session known: the process of that id running at the time
        // (a session no process logged is never guessed at).
        None => procs
            .iter()
            .rev()
            .find(|p| p.id == r.owner && p.started <= t && p.ended.is_none_or(|e| e + GRACE >= t)),
    };
    let Some(p) = owner else {
        return (
            "unattributed",
            format!(
                "no process of the soak had id {} and session {:?}",
                r.owner, r.session
            ),
        );
    };
    let who = format!(
        "{} (process {} of slot {}, session {})",
        p.id,
        p.generation,
        p.slot + 1,
        p.session.as_deref().unwrap_or("?")
    );
    if let Some(e) = p.ended {
        if e <= t + GRACE {
            let how = p.how.as_deref().unwrap_or("ended");
            let when = match e.duration_since(t) {
                Ok(after) => format!("{} after", secs(after)),
                Err(before) => format!("{} before", secs(before.duration())),
            };
            return ("owner_gone", format!("{who}: {how}, {when} the re-offer"));
        }
    }
    if let Some(d) = spans.iter().find(|d| {
        d.slot == p.slot && d.generation == p.generation && d.from <= t && t <= d.to + GRACE
    }) {
        return ("fault", format!("{who} held by the soak: {}", d.what));
    }
    let life = match p.ended {
        Some(e) => format!(
            "ended {} later ({})",
            secs(e.duration_since(t).unwrap_or_default()),
            p.how.as_deref().unwrap_or("?")
        ),
        None => "still running at the end".into(),
    };
    // Its own process taking the job back (its attempt had ended without
    // its outcome written) is still a live owner losing its job.
    let own = if r.claimer_session.is_some() && r.claimer_session == p.session {
        "; taken back by the same process"
    } else {
        ""
    };
    (
        "false",
        format!(
            "{who} was alive and undisturbed: started {}, {life}{own}",
            rfc3339(p.started)
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collect::Rev;
    use leasehold_core::JobRecord;
    use std::path::PathBuf;

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + s)
    }

    fn rec(status: &str, epoch: u64, worker: &str, session: &str, stale: u32, at: u64) -> Rev {
        Rev {
            seq: 0,
            rec: Some(JobRecord {
                id: "j".into(),
                status: status.into(),
                epoch,
                worker_id: Some(worker.into()),
                session: Some(session.into()),
                stale_reclaims: stale,
                updated_at: rfc3339(t(at)),
                ..Default::default()
            }),
        }
    }

    fn proc(slot: usize, generation: u32, session: &str, life: (u64, Option<u64>)) -> Incarnation {
        Incarnation {
            slot,
            id: format!("w{}", slot + 1),
            generation,
            session: Some(session.into()),
            started: t(life.0),
            ended: life.1.map(t),
            how: life.1.map(|_| "kill -9 by the soak".into()),
            log: PathBuf::new(),
        }
    }

    fn collected(revs: Vec<Rev>, events: Vec<leasehold_proto::JobEvent>) -> Collected {
        let mut c = Collected::default();
        c.audit.insert("j".into(), revs);
        c.events
            .insert("j".into(), events.into_iter().map(|e| (0, e)).collect());
        c
    }

    fn recovered(epoch: u64, worker: &str, at: u64) -> leasehold_proto::JobEvent {
        leasehold_proto::JobEvent {
            job_id: "j".into(),
            epoch,
            r#type: "progress".into(),
            at: rfc3339(t(at)),
            data: serde_json::json!({"recovered": true, "worker": worker, "by": "reaper r1"})
                .to_string(),
            ..Default::default()
        }
    }

    #[test]
    fn one_reoffer_seen_twice_is_one() {
        let c = collected(
            vec![
                rec("running", 1, "w1", "s1", 0, 10),
                rec("running", 1, "w1", "s1", 0, 12),
                rec("queued", 1, "w1", "s1", 1, 20),
                rec("running", 2, "w2", "s2", 1, 21),
            ],
            vec![recovered(1, "w1", 20)],
        );
        let r = find(&c);
        assert_eq!(r.len(), 1, "{r:?}");
        assert_eq!((r[0].epoch, r[0].owner.as_str()), (1, "w1"));
        assert_eq!(r[0].session.as_deref(), Some("s1"));
        assert_eq!(r[0].seen_in, vec!["record", "event"]);
        assert_eq!(r[0].by.as_deref(), Some("reaper r1"));
    }

    #[test]
    fn a_claim_that_counts_a_stale_reclaim_is_a_reoffer_too() {
        let c = collected(
            vec![
                rec("running", 1, "w1", "s1", 0, 10),
                rec("running", 2, "w2", "s2", 1, 30),
                rec("completed", 2, "w2", "s2", 1, 40),
            ],
            vec![],
        );
        let r = find(&c);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].by.as_deref(), Some("claim by w2"));
    }

    #[test]
    fn the_reoffer_of_a_live_undisturbed_owner_is_false() {
        let c = collected(
            vec![
                rec("running", 1, "w1", "s1", 0, 10),
                rec("queued", 1, "w1", "s1", 1, 20),
            ],
            vec![recovered(1, "w1", 20)],
        );
        let procs = [proc(0, 1, "s1", (0, None))];
        let mut r = find(&c);
        judge(&mut r, &procs, &[]);
        assert_eq!(r[0].judged, "false", "{}", r[0].why);

        // Killed two seconds before: the owner was gone.
        let procs = [
            proc(0, 1, "s1", (0, Some(18))),
            proc(0, 2, "s9", (19, None)),
        ];
        judge(&mut r, &procs, &[]);
        assert_eq!(r[0].judged, "owner_gone", "{}", r[0].why);

        // Paused by the soak from 15 s, answering again at 19 s.
        let procs = [proc(0, 1, "s1", (0, None))];
        let spans = [Disturbance {
            slot: 0,
            generation: 1,
            from: t(15),
            to: t(19),
            what: "sigstop_worker (fault 3)".into(),
        }];
        judge(&mut r, &procs, &spans);
        assert_eq!(r[0].judged, "fault", "{}", r[0].why);

        // ... but a pause long over does not excuse it.
        let spans = [Disturbance {
            to: t(12),
            from: t(5),
            ..spans[0].clone()
        }];
        judge(&mut r, &procs, &spans);
        assert_eq!(r[0].judged, "false");

        // A session no process of the soak logged is not guessed at.
        let mut unknown = r.clone();
        unknown[0].session = Some("s7".into());
        judge(&mut unknown, &procs, &[]);
        assert_eq!(unknown[0].judged, "unattributed");

        // A fault on another process of the slot is no excuse either.
        let spans = [Disturbance {
            generation: 2,
            ..spans[0].clone()
        }];
        judge(&mut r, &procs, &spans);
        assert_eq!(r[0].judged, "false");
    }

    #[test]
    fn a_live_process_taking_its_own_job_back_is_named() {
        let c = collected(
            vec![
                rec("running", 1, "w1", "s1", 0, 10),
                rec("running", 2, "w1", "s1", 1, 30),
            ],
            vec![],
        );
        let mut r = find(&c);
        judge(&mut r, &[proc(0, 1, "s1", (0, None))], &[]);
        assert_eq!(r[0].judged, "false");
        assert!(
            r[0].why.ends_with("taken back by the same process"),
            "{}",
            r[0].why
        );
    }

    #[test]
    fn a_process_that_dies_right_after_is_not_a_live_owner() {
        let c = collected(
            vec![
                rec("running", 1, "w1", "s1", 0, 10),
                rec("queued", 1, "w1", "s1", 1, 20),
            ],
            vec![],
        );
        let mut r = find(&c);
        // A crash the soak saw 3 s after the re-offer.
        let procs = [proc(0, 1, "s1", (0, Some(23)))];
        judge(&mut r, &procs, &[]);
        assert_eq!(r[0].judged, "owner_gone");
        // Killed a minute later: it was alive when its job was taken.
        let procs = [proc(0, 1, "s1", (0, Some(80)))];
        judge(&mut r, &procs, &[]);
        assert_eq!(r[0].judged, "false");
    }
}
