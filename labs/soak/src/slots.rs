//! Slot use: how much of the fleet's capacity ran attempts, measured from
//! the record revisions (the audit mirror) after the run.
//!
//! An attempt runs from the revision that claims an epoch (`running` at a
//! new epoch) to the first revision that leaves it (another status or
//! another epoch), or to the end of its owner's process when that comes
//! first (a killed worker's slots run nothing, whatever its records still
//! say). Its slot is its owner's: the process whose session the record
//! names. Slot use is the attempts' time within the window over the
//! fleet's slots (every worker's concurrency) over the window; the share
//! of the live processes' slots is given beside it (a worker being started
//! again has no slots).

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use leasehold_core::time::parse_rfc3339;
use serde::Serialize;

use crate::collect::Collected;
use crate::fleet::Incarnation;

#[derive(Debug, Clone, Serialize)]
pub struct WorkerUse {
    pub slot: usize,
    pub concurrency: usize,
    pub busy_slot_s: f64,
    /// Of this worker's slots over the window.
    pub share: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SlotUse {
    pub window_s: f64,
    pub slots: usize,
    pub busy_slot_s: f64,
    /// Of every slot of the fleet over the window.
    pub share: f64,
    /// Of the slots of the processes that were running.
    pub share_of_live: f64,
    pub target: Option<f64>,
    pub per_worker: Vec<WorkerUse>,
    pub method: &'static str,
}

const METHOD: &str = "from the record revisions: an attempt runs from the revision claiming its epoch to the first revision leaving it, cut at the end of its owner's process; busy slot-seconds within the window over (sum of every worker's concurrency x window); share_of_live uses the slots of the processes that were running instead";

fn overlap(a: (SystemTime, SystemTime), w: (SystemTime, SystemTime)) -> Duration {
    let from = a.0.max(w.0);
    let to = a.1.min(w.1);
    to.duration_since(from).unwrap_or_default()
}

/// Slot use over `window`; `concurrency[i]` is worker slot `i`'s.
pub fn measure(
    c: &Collected,
    procs: &[Incarnation],
    window: (SystemTime, SystemTime),
    concurrency: &[usize],
    target: Option<f64>,
) -> SlotUse {
    let by_session: BTreeMap<&str, &Incarnation> = procs
        .iter()
        .filter_map(|p| p.session.as_deref().map(|s| (s, p)))
        .collect();
    let mut per_slot = vec![Duration::ZERO; concurrency.len()];
    let mut total = Duration::ZERO;
    let mut add = |session: Option<&str>, from: SystemTime, to: SystemTime| {
        let owner = session.and_then(|s| by_session.get(s));
        let to = match owner.and_then(|p| p.ended) {
            Some(e) => to.min(e),
            None => to,
        };
        let d = overlap((from, to), window);
        total += d;
        if let Some(p) = owner {
            if let Some(x) = per_slot.get_mut(p.slot) {
                *x += d;
            }
        }
    };
    for revs in c.audit.values() {
        // (epoch, session, since)
        let mut open: Option<(u64, Option<String>, SystemTime)> = None;
        for rec in revs.iter().filter_map(|r| r.rec.as_ref()) {
            let Some(at) = parse_rfc3339(&rec.updated_at) else {
                continue;
            };
            let same = open.as_ref().is_some_and(|o| o.0 == rec.epoch);
            if rec.status == "running" && same {
                continue;
            }
            if let Some((_, s, since)) = open.take() {
                add(s.as_deref(), since, at);
            }
            if rec.status == "running" {
                open = Some((rec.epoch, rec.session.clone(), at));
            }
        }
        if let Some((_, s, since)) = open {
            add(s.as_deref(), since, window.1);
        }
    }
    let win = window.1.duration_since(window.0).unwrap_or_default();
    let slots: usize = concurrency.iter().sum();
    let live: f64 = procs
        .iter()
        .map(|p| {
            let life = (p.started, p.ended.unwrap_or(window.1));
            overlap(life, window).as_secs_f64()
                * concurrency.get(p.slot).copied().unwrap_or(0) as f64
        })
        .sum();
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    SlotUse {
        window_s: win.as_secs_f64(),
        slots,
        busy_slot_s: total.as_secs_f64(),
        share: ratio(total.as_secs_f64(), slots as f64 * win.as_secs_f64()),
        share_of_live: ratio(total.as_secs_f64(), live),
        target,
        per_worker: per_slot
            .iter()
            .enumerate()
            .map(|(slot, d)| WorkerUse {
                slot,
                concurrency: concurrency[slot],
                busy_slot_s: d.as_secs_f64(),
                share: ratio(
                    d.as_secs_f64(),
                    concurrency[slot] as f64 * win.as_secs_f64(),
                ),
            })
            .collect(),
        method: METHOD,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collect::Rev;
    use leasehold_core::time::rfc3339;
    use leasehold_core::JobRecord;

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + s)
    }

    fn rev(status: &str, epoch: u64, session: &str, at: u64) -> Rev {
        Rev {
            seq: 0,
            rec: Some(JobRecord {
                status: status.into(),
                epoch,
                session: Some(session.into()),
                updated_at: rfc3339(t(at)),
                ..Default::default()
            }),
        }
    }

    fn proc(slot: usize, session: &str, ended: Option<u64>) -> Incarnation {
        Incarnation {
            slot,
            id: format!("w{slot}"),
            generation: 1,
            session: Some(session.into()),
            started: t(0),
            ended: ended.map(t),
            how: None,
            log: Default::default(),
        }
    }

    #[test]
    fn attempts_are_cut_by_the_window_and_by_their_owners_end() {
        let mut c = Collected::default();
        // 10..30 on s1, then a reclaim on s2 from 40 to the end.
        c.audit.insert(
            "a".into(),
            vec![
                rev("queued", 0, "", 5),
                rev("running", 1, "s1", 10),
                rev("running", 1, "s1", 20),
                rev("completed", 1, "s1", 30),
            ],
        );
        // Owner s2 killed at 50, its record still says running.
        c.audit.insert(
            "b".into(),
            vec![rev("running", 1, "s2", 0), rev("running", 2, "s2", 40)],
        );
        let procs = [proc(0, "s1", None), proc(1, "s2", Some(50))];
        let u = measure(&c, &procs, (t(0), t(100)), &[1, 1], Some(0.9));
        // a: 20 s; b: epoch 1 0..40 and epoch 2 40..50.
        assert!((u.busy_slot_s - 70.0).abs() < 1e-6, "{u:?}");
        assert!((u.share - 0.35).abs() < 1e-6);
        assert!((u.per_worker[1].share - 0.5).abs() < 1e-6);
        // Live slots: slot 0 for 100 s, slot 1 for 50 s.
        assert!((u.share_of_live - 70.0 / 150.0).abs() < 1e-6);
    }
}
