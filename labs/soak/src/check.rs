//! The invariants, computed from what [`crate::collect`] read, and the
//! recovery figures.
//!
//! - **lost**: an accepted submission without a record; a record that is
//!   neither terminal nor parked for a stated reason once the run is quiet;
//!   a completed `deliver`/`research` job whose delivery never reached the
//!   sink.
//! - **duplicate effects**: more than one effect at the sink for one
//!   idempotency key, for one job and step, or for one `deliver`/`research`
//!   job at all.
//! - **stale writes**, in the order the server accepted them (KV revisions
//!   from the audit mirror; events by stream sequence):
//!   - a record revision whose epoch is below one already written;
//!   - a `running` revision at an epoch whose claim had already ended (the
//!     record was released, requeued, parked or finished at that epoch:
//!     only a new claim, with a new epoch, may make it run again);
//!   - two owners (worker id, claim token) writing `running` at one epoch;
//!   - any revision after a terminal one, or a deleted record;
//!   - a `claimed` marker not newer than an earlier marker, or newer than
//!     any claim the record ever had;
//!   - an owner's event whose epoch is below the newest `claimed` marker
//!     before it;
//!   - a second `completed` event.
//!
//!   Non-owner events are informational and exempt: `heartbeat_lost` (a
//!   worker saying it found its claim gone: by definition from an older
//!   epoch) and events without a `worker_id` (a recoverer's `progress`
//!   with `recovered`, a reaper's `dead`, a `cancelled` recorded by the
//!   CLI or a recoverer). They are written unfenced at the record's epoch
//!   as the writer read it, so one may land after a newer claim; they are
//!   counted, not judged. Every event carrying a `worker_id` is an owner's
//!   and must respect the fence.
//! - **stuck**: a job not settled at the end with no live owner and no
//!   ticket in the work stream. An owner is live when its record's worker
//!   has a session key naming the record's incarnation *and* that process,
//!   asked on `lh.workers.<id>.runs`, says it runs the job at that epoch (a
//!   live process that does not run the job is no owner).
//! - **wrong outcome**: an `echo`, `sleep` or recovering `fail` job that
//!   ended `failed`, or a terminal `fail` (or one with more failures than
//!   attempts) that ended `completed`.
//! - **false re-offer** (every profile): a job taken from an owner whose
//!   process was alive and not held by a fault of the soak (see
//!   [`crate::reoffer`]).
//! - **unexpected dead** (every profile but `default`, whose faults may
//!   legitimately poison a job): a job ended `dead` that is not a planned
//!   poison job.
//! - **poison not dead**: a planned poison job (`crash`) that did not end
//!   `dead` with class `poison` by the end of the quiesce.
//! - **operators** (profile `operators`): an operator's action that was not
//!   refused when it must be, or left a job lost, resurrected, rejected or
//!   with another job's effect (see [`crate::ops`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::SystemTime;

use leasehold_core::JobRecord;
use leasehold_store::sessions::{Current, Runs};
use serde::Serialize;
use serde_json::{json, Value};

use crate::chaos::Injected;
use crate::collect::{settled, Collected};
use crate::plan::Expect;
use crate::submit::{Canary, Submission};

/// One violation: the job and a one-line reason.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    pub job: String,
    pub reason: String,
}

fn f(job: &str, reason: impl Into<String>) -> Finding {
    Finding {
        job: job.to_string(),
        reason: reason.into(),
    }
}

#[derive(Debug, Default, Serialize)]
pub struct Verdict {
    pub lost: Vec<Finding>,
    pub duplicate_effects: Vec<Finding>,
    pub stale_writes: Vec<Finding>,
    pub stuck: Vec<Finding>,
    pub wrong_outcomes: Vec<Finding>,
    pub false_reoffers: Vec<Finding>,
    pub unexpected_dead: Vec<Finding>,
    pub poison_not_dead: Vec<Finding>,
    /// What an operator's action left against the promise (profile
    /// `operators`, see [`crate::ops`]).
    pub operators: Vec<Finding>,
    /// Counts that inform but do not fail the run.
    pub info: BTreeMap<String, u64>,
}

impl Verdict {
    pub fn passed(&self) -> bool {
        self.lost.is_empty()
            && self.duplicate_effects.is_empty()
            && self.stale_writes.is_empty()
            && self.stuck.is_empty()
            && self.wrong_outcomes.is_empty()
            && self.false_reoffers.is_empty()
            && self.unexpected_dead.is_empty()
            && self.poison_not_dead.is_empty()
            && self.operators.is_empty()
    }

    /// Every list of findings, by the name the report gives it.
    pub fn lists(&self) -> [(&'static str, &Vec<Finding>); 9] {
        [
            ("lost", &self.lost),
            ("duplicate effect", &self.duplicate_effects),
            ("stale write", &self.stale_writes),
            ("stuck", &self.stuck),
            ("wrong outcome", &self.wrong_outcomes),
            ("false re-offer", &self.false_reoffers),
            ("unexpected dead", &self.unexpected_dead),
            ("poison not dead", &self.poison_not_dead),
            ("operators", &self.operators),
        ]
    }
}

/// Which of the profile-dependent invariants hold for a run.
#[derive(Debug, Clone, Default)]
pub struct Rules {
    /// A `dead` job that is not a planned poison job is a failure.
    pub dead_fails: bool,
    /// Ids the operators reused after retention: each incarnation makes its
    /// own effect for a step, judged by [`crate::ops::check`].
    pub reused: HashSet<String>,
}

const TERMINAL: [&str; 5] = ["completed", "failed", "cancelled", "rejected", "dead"];

fn one_effect_kind(kind: &str) -> bool {
    matches!(kind, "deliver" | "research")
}

pub fn verdict(subs: &[Submission], c: &Collected, rules: Rules) -> Verdict {
    let mut v = Verdict::default();
    for s in subs
        .iter()
        .filter(|s| s.expect == Expect::Poison && !s.accepted)
    {
        v.poison_not_dead.push(f(
            &s.id,
            format!("never accepted: {}", s.error.as_deref().unwrap_or("?")),
        ));
    }
    let accepted: Vec<&Submission> = subs.iter().filter(|s| s.accepted).collect();
    let kinds: HashMap<&str, &str> = subs
        .iter()
        .map(|s| (s.id.as_str(), s.kind.as_str()))
        .collect();
    *v.info.entry("not_accepted".into()).or_default() +=
        subs.iter().filter(|s| !s.accepted).count() as u64;

    // Effects at the sink.
    let mut by_key: HashMap<String, u64> = HashMap::new();
    let mut by_step: HashMap<(String, String), u64> = HashMap::new();
    let mut by_job: HashMap<String, u64> = HashMap::new();
    for e in &c.effects {
        let job = e["body"]["job_id"].as_str().unwrap_or_default().to_string();
        let step = e["body"]["step_id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        match e["key"].as_str() {
            Some(k) => *by_key.entry(k.to_string()).or_default() += 1,
            None => *v.info.entry("effects_without_key".into()).or_default() += 1,
        }
        *by_step.entry((job.clone(), step)).or_default() += 1;
        *by_job.entry(job).or_default() += 1;
    }
    for (k, n) in &by_key {
        if *n > 1 {
            v.duplicate_effects
                .push(f("?", format!("{n} effects at the sink under one key {k}")));
        }
    }
    for ((job, step), n) in &by_step {
        if *n > 1 && !rules.reused.contains(job) {
            v.duplicate_effects
                .push(f(job, format!("{n} effects at the sink for step {step}")));
        }
    }
    for (job, n) in &by_job {
        if *n > 1 && kinds.get(job.as_str()).is_some_and(|k| one_effect_kind(k)) {
            v.duplicate_effects
                .push(f(job, format!("{n} effects at the sink for one job")));
        }
    }

    for s in &accepted {
        let id = s.id.as_str();
        let Some(rec) = c.records.get(id).and_then(|r| r.as_ref()) else {
            let ticket = c.tickets.get(&s.seq).copied().unwrap_or(false);
            v.lost.push(f(
                id,
                format!(
                    "accepted (ticket seq {}) but no record; ticket {}",
                    s.seq,
                    if ticket { "still there" } else { "gone" }
                ),
            ));
            if !ticket {
                v.stuck.push(f(id, "no record and no ticket"));
            }
            continue;
        };
        outcome(&mut v, s, rec, by_job.get(id).copied().unwrap_or(0));
        durable_sleep(&mut v, rec, c);
        signal_wait(&mut v, rec, c);
        fan_out(&mut v, rec, c);
        expert_jobs(&mut v, rec, c);
        deaths(&mut v, s, rec, &rules);
        if !settled(rec) {
            stuck(&mut v, rec, c);
        }
        if let Some(revs) = c.audit.get(id) {
            records_in_order(&mut v, id, revs);
        }
        let max_record_epoch = c
            .audit
            .get(id)
            .and_then(|revs| {
                revs.iter()
                    .filter_map(|r| r.rec.as_ref())
                    .map(|r| r.epoch)
                    .max()
            })
            .unwrap_or(rec.epoch)
            .max(rec.epoch);
        if let Some(evs) = c.events.get(id) {
            events_in_order(&mut v, id, evs, max_record_epoch, c.audit_state.complete);
        }
    }
    v
}

/// A job that waited for its signal (`sleep` with `signal`: `--signals`)
/// and completed took its own signal (`{"token": <its id>}`), once: its
/// `wait:go#0` step recorded exactly once, whenever the signal came
/// (before the wait, while it ran, while it waited) and whatever the
/// faults did to its owners.
fn signal_wait(v: &mut Verdict, rec: &JobRecord, c: &Collected) {
    let input: Value = rec
        .spec
        .as_ref()
        .and_then(|s| serde_json::from_str(&s.input).ok())
        .unwrap_or_default();
    if rec.kind != "sleep" || input["signal"] != "go" || rec.status != "completed" {
        return;
    }
    *v.info.entry("signal_waits_completed".into()).or_default() += 1;
    let out: Value = rec
        .result
        .as_ref()
        .and_then(|r| serde_json::from_str(&r.output).ok())
        .unwrap_or_default();
    if out["signal"] != serde_json::json!({"token": rec.id}) {
        v.wrong_outcomes.push(f(
            &rec.id,
            format!("completed with signal {}, not its own", out["signal"]),
        ));
    }
    let steps = c.events.get(&rec.id).map_or(0, |evs| {
        evs.iter()
            .filter(|(_, e)| e.r#type == "step" && e.data_map()["id"] == "wait:go#0")
            .count()
    });
    if steps != 1 {
        v.wrong_outcomes.push(f(
            &rec.id,
            format!("its signal wait recorded its wait:go#0 step {steps} times"),
        ));
    }
}

/// The ids of a research job's expert jobs, if it ran its experts as
/// child jobs (`"expert_jobs": true`): one per expert, derived from its
/// record as the spawn derives them.
pub fn expert_job_ids(rec: &JobRecord) -> Vec<String> {
    if rec.kind != "research" {
        return vec![];
    }
    let input: Value = rec
        .spec
        .as_ref()
        .and_then(|s| serde_json::from_str(&s.input).ok())
        .unwrap_or_default();
    if input["expert_jobs"] != Value::Bool(true) {
        return vec![];
    }
    let n = input["experts"].as_u64().unwrap_or(3) as usize;
    (0..n)
        .map(|i| leasehold_store::children::child_id(rec, EXPERT_SPAWN, i))
        .collect()
}

/// The spawn step of a research job's expert jobs.
const EXPERT_SPAWN: &str = "spawn:research-expert#0";

/// A research job run with its experts as child jobs (`--expert-jobs`)
/// that completed spawned them once, one per expert, each with a record
/// naming it and ended, and was claimed at most once per wait, reclaim
/// and failed attempt beyond its first.
fn expert_jobs(v: &mut Verdict, rec: &JobRecord, c: &Collected) {
    let kids = expert_job_ids(rec);
    if kids.is_empty() || rec.status != "completed" {
        return;
    }
    *v.info
        .entry("expert_job_reports_completed".into())
        .or_default() += 1;
    let evs = spawned_once(v, rec, c, EXPERT_SPAWN);
    let count = |t: &str| evs.iter().filter(|(_, e)| e.r#type == t).count() as u64;
    let (claims, waits) = (count("claimed"), count("waiting"));
    let again = u64::from(rec.stale_reclaims) + u64::from(rec.attempts);
    if waits > 1 + again || claims > 1 + waits + again {
        v.wrong_outcomes.push(f(
            &rec.id,
            format!(
                "claimed {claims} times, waited {waits} times, with {} stale reclaims and {} failed attempts: woken more than once per wait",
                rec.stale_reclaims, rec.attempts
            ),
        ));
    }
    let kids: Vec<&str> = kids.iter().map(String::as_str).collect();
    children_ended(v, rec, c, &kids, "expert_jobs_checked");
}

/// The parent's events, after checking that its only spawn step is `step`.
fn spawned_once<'c>(
    v: &mut Verdict,
    rec: &JobRecord,
    c: &'c Collected,
    step: &str,
) -> &'c [(u64, leasehold_proto::JobEvent)] {
    let evs = c.events.get(&rec.id).map(Vec::as_slice).unwrap_or_default();
    let spawns: Vec<String> = evs
        .iter()
        .filter(|(_, e)| e.r#type == "step")
        .filter_map(|(_, e)| e.data_map()["id"].as_str().map(String::from))
        .filter(|id| id.starts_with("spawn:"))
        .collect();
    if spawns != [step] {
        v.wrong_outcomes.push(f(
            &rec.id,
            format!("its spawn steps: {spawns:?}, not one {step}"),
        ));
    }
    evs
}

/// Each of `kids` has a record naming `rec` as its parent (lost if none),
/// and has ended (stuck if not); counted under `info`.
fn children_ended(v: &mut Verdict, rec: &JobRecord, c: &Collected, kids: &[&str], info: &str) {
    for &k in kids {
        match c.children.get(k).and_then(|r| r.as_ref()) {
            Some(child) => {
                *v.info.entry(info.into()).or_default() += 1;
                let parent = child.spec.as_ref().and_then(|s| s.parent.as_ref());
                if parent.map(|p| p.id.as_str()) != Some(rec.id.as_str()) {
                    v.wrong_outcomes.push(f(
                        k,
                        format!("a child of {} naming parent {parent:?}", rec.id),
                    ));
                }
                if !settled(child) {
                    v.stuck.push(f(
                        k,
                        format!("a child of {}, still {}", rec.id, child.status),
                    ));
                }
            }
            None => v
                .lost
                .push(f(k, format!("a child of {}, with no record", rec.id))),
        }
    }
}

/// A `fanout` parent (`--fanout`) that completed spawned once and was
/// woken once per wait: one `spawn:echo#0` step and no other spawn, as
/// many distinct children as it asked for, each with a record naming it as
/// its parent and ended, and at most 2 claims plus one per stale reclaim
/// (a parent woken per child would have hundreds).
fn fan_out(v: &mut Verdict, rec: &JobRecord, c: &Collected) {
    if rec.kind != "fanout" || rec.status != "completed" {
        return;
    }
    let input: Value = rec
        .spec
        .as_ref()
        .and_then(|s| serde_json::from_str(&s.input).ok())
        .unwrap_or_default();
    let out: Value = rec
        .result
        .as_ref()
        .and_then(|r| serde_json::from_str(&r.output).ok())
        .unwrap_or_default();
    let kids: Vec<&str> = out["children"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let distinct: std::collections::BTreeSet<&&str> = kids.iter().collect();
    let asked = input["n"].as_u64().unwrap_or(3) as usize;
    if kids.len() != asked || distinct.len() != asked {
        v.wrong_outcomes.push(f(
            &rec.id,
            format!(
                "asked for {asked} children, lists {} ({} distinct)",
                kids.len(),
                distinct.len()
            ),
        ));
    }
    let evs = spawned_once(v, rec, c, "spawn:echo#0");
    let claims = evs.iter().filter(|(_, e)| e.r#type == "claimed").count() as u64;
    *v.info.entry("fanout_parent_claims".into()).or_default() += claims;
    if claims > 2 + u64::from(rec.stale_reclaims) {
        v.wrong_outcomes.push(f(
            &rec.id,
            format!(
                "claimed {claims} times with {} stale reclaims: woken more than once per wait",
                rec.stale_reclaims
            ),
        ));
    }
    children_ended(v, rec, c, &kids, "fanout_children_checked");
}

/// A durable timer (`sleep` with `durable`) that completed slept once: its
/// `sleep#0` step recorded exactly once, and not before its time (the
/// step's result: the time its wait named; a later wait of the job, for a
/// signal, names its own in the record).
fn durable_sleep(v: &mut Verdict, rec: &JobRecord, c: &Collected) {
    let input: Value = rec
        .spec
        .as_ref()
        .and_then(|s| serde_json::from_str(&s.input).ok())
        .unwrap_or_default();
    if rec.kind != "sleep" || input["durable"] != true || rec.status != "completed" {
        return;
    }
    *v.info.entry("durable_sleeps_completed".into()).or_default() += 1;
    let recorded: Vec<Value> = c.events.get(&rec.id).map_or(Vec::new(), |evs| {
        evs.iter()
            .map(|(_, e)| (e.r#type.as_str(), e.data_map()))
            .filter(|(ty, d)| *ty == "step" && d["id"] == "sleep#0")
            .map(|(_, d)| d.get("result").cloned().unwrap_or_default())
            .collect()
    });
    if recorded.len() != 1 {
        v.wrong_outcomes.push(f(
            &rec.id,
            format!(
                "a durable sleep recorded its sleep#0 step {} times",
                recorded.len()
            ),
        ));
    }
    let until = recorded.first().and_then(Value::as_str).map(str::to_string);
    let at = |t: Option<&str>| t.and_then(leasehold_core::time::parse_rfc3339);
    match (at(until.as_deref()), at(Some(&rec.updated_at))) {
        (Some(t), Some(done)) if done < t => v.wrong_outcomes.push(f(
            &rec.id,
            format!(
                "a durable sleep completed at {} before its time {}",
                rec.updated_at,
                until.as_deref().unwrap_or("?")
            ),
        )),
        (None, _) => v.wrong_outcomes.push(f(
            &rec.id,
            "a durable sleep completed without a recorded wait",
        )),
        _ => {}
    }
}

fn outcome(v: &mut Verdict, s: &Submission, rec: &JobRecord, effects: u64) {
    let id = &s.id;
    *v.info
        .entry(format!("outcome.{}.{}", s.kind, rec.status))
        .or_default() += 1;
    if !settled(rec) {
        v.lost.push(f(
            id,
            format!(
                "ended {} (epoch {}, worker {:?}): not terminal, not parked",
                rec.status, rec.epoch, rec.worker_id
            ),
        ));
    }
    if rec.status == "parked" && rec.parked_reason.as_deref().unwrap_or("").is_empty() {
        v.lost.push(f(id, "parked without a stated reason"));
    }
    if rec.status == "completed" && one_effect_kind(&s.kind) && effects == 0 {
        v.lost
            .push(f(id, "completed, but its delivery never reached the sink"));
    }
    match (s.expect, rec.status.as_str()) {
        (Expect::NotFailed, "failed") => v.wrong_outcomes.push(f(
            id,
            format!(
                "{} job ended failed: {:?}",
                s.kind,
                rec.error
                    .as_ref()
                    .map(|e| format!("{}: {}", e.class, e.message))
            ),
        )),
        (Expect::NotCompleted, "completed") => v.wrong_outcomes.push(f(
            id,
            format!(
                "a fail job meant to fail ended completed after {} failed attempts",
                rec.attempts
            ),
        )),
        _ => {}
    }
}

fn deaths(v: &mut Verdict, s: &Submission, rec: &JobRecord, rules: &Rules) {
    let class = rec.error.as_ref().map_or("", |e| e.class.as_str());
    let why = || {
        format!(
            "{} ({class}: {}) after {} stale reclaims and {} attempts",
            rec.status,
            rec.error.as_ref().map_or("", |e| e.message.as_str()),
            rec.stale_reclaims,
            rec.attempts
        )
    };
    if s.expect == Expect::Poison {
        if rec.status != "dead" || class != "poison" {
            v.poison_not_dead
                .push(f(&s.id, format!("a poison job ended {}", why())));
        }
    } else if rec.status == "dead" && rules.dead_fails {
        v.unexpected_dead
            .push(f(&s.id, format!("not a poison job, ended {}", why())));
    }
}

fn stuck(v: &mut Verdict, rec: &JobRecord, c: &Collected) {
    let session_live = rec.status == "running"
        && rec.worker_id.as_ref().is_some_and(|w| {
            matches!(c.sessions.get(w), Some(Current::Live { info, .. })
                if Some(info.session.as_str()) == rec.session.as_deref())
        });
    let runs = c.owner_runs.get(&rec.id).copied();
    let owner_live = session_live && runs != Some(Runs::No);
    let ticket = c.tickets.get(&rec.ticket_seq).copied().unwrap_or(false);
    let indexed: Vec<String> = c
        .index
        .iter()
        .filter(|(k, _)| k.job() == rec.id)
        .map(|(k, _)| k.as_string())
        .collect();
    if !owner_live && !ticket {
        v.stuck.push(f(
            &rec.id,
            format!(
                "{} at epoch {} with no live owner (worker {:?}, session {:?}, session live: {session_live}, runs it: {runs:?}) and no ticket (seq {}); index {:?}",
                rec.status, rec.epoch, rec.worker_id, rec.session, rec.ticket_seq, indexed
            ),
        ));
    }
}

fn records_in_order(v: &mut Verdict, id: &str, revs: &[crate::collect::Rev]) {
    let mut max_epoch = 0;
    let mut ended: HashMap<u64, String> = HashMap::new();
    let mut owners: HashMap<u64, (String, String)> = HashMap::new();
    let mut terminal: Option<(u64, String)> = None;
    for r in revs {
        let Some(rec) = &r.rec else {
            v.stale_writes
                .push(f(id, format!("record deleted at revision {}", r.seq)));
            continue;
        };
        let (e, st) = (rec.epoch, rec.status.as_str());
        if let Some((tseq, t)) = &terminal {
            v.stale_writes.push(f(
                id,
                format!(
                    "revision {} ({st}, epoch {e}, worker {:?}) after the terminal {t} at revision {tseq}",
                    r.seq, rec.worker_id
                ),
            ));
        }
        if e < max_epoch {
            v.stale_writes.push(f(
                id,
                format!(
                    "revision {} of epoch {e} ({st}, worker {:?}) after epoch {max_epoch}",
                    r.seq, rec.worker_id
                ),
            ));
        }
        if st == "running" {
            if let Some(how) = ended.get(&e) {
                v.stale_writes.push(f(
                    id,
                    format!(
                        "revision {} runs epoch {e} (worker {:?}) after that claim ended ({how})",
                        r.seq, rec.worker_id
                    ),
                ));
            }
            let owner = (
                rec.worker_id.clone().unwrap_or_default(),
                rec.claim_token.clone().unwrap_or_default(),
            );
            match owners.get(&e) {
                Some(o) if *o != owner => v.stale_writes.push(f(
                    id,
                    format!(
                        "two owners of epoch {e}: {} then {} (revision {})",
                        o.0, owner.0, r.seq
                    ),
                )),
                Some(_) => {}
                None => {
                    owners.insert(e, owner);
                }
            }
        } else {
            ended
                .entry(e)
                .or_insert_with(|| format!("{st} at revision {}", r.seq));
        }
        if TERMINAL.contains(&st) && terminal.is_none() {
            terminal = Some((r.seq, st.to_string()));
        }
        max_epoch = max_epoch.max(e);
    }
}

fn events_in_order(
    v: &mut Verdict,
    id: &str,
    evs: &[(u64, leasehold_proto::JobEvent)],
    max_record_epoch: u64,
    audit_complete: bool,
) {
    let mut max_claim = 0;
    let mut completed = 0;
    for (seq, ev) in evs {
        let e = ev.epoch;
        match ev.r#type.as_str() {
            "claimed" => {
                if e <= max_claim {
                    v.stale_writes.push(f(
                        id,
                        format!(
                            "claimed marker of epoch {e} (worker {:?}, seq {seq}) after epoch {max_claim}'s",
                            ev.worker_id
                        ),
                    ));
                }
                if audit_complete && e > max_record_epoch {
                    v.stale_writes.push(f(
                        id,
                        format!(
                            "claimed marker of epoch {e} (seq {seq}) but the record never reached epoch {e}"
                        ),
                    ));
                }
                max_claim = max_claim.max(e);
            }
            "heartbeat_lost" => {
                *v.info.entry("events.heartbeat_lost".into()).or_default() += 1;
            }
            t if ev.worker_id.is_none() => {
                *v.info.entry(format!("events.non_owner.{t}")).or_default() += 1;
                if e < max_claim {
                    *v.info
                        .entry("events.non_owner_behind_a_newer_claim".into())
                        .or_default() += 1;
                }
            }
            t => {
                if e < max_claim {
                    v.stale_writes.push(f(
                        id,
                        format!(
                            "{t} event of epoch {e} (worker {:?}, seq {seq}) after epoch {max_claim} claimed",
                            ev.worker_id
                        ),
                    ));
                }
                if t == "completed" {
                    completed += 1;
                    if completed == 2 {
                        v.stale_writes
                            .push(f(id, format!("a second completed event (seq {seq})")));
                    }
                }
            }
        }
    }
}

/// Recovery of one fault's affected jobs.
#[derive(Debug, Default, Serialize)]
pub struct FaultRecovery {
    pub n: usize,
    pub name: String,
    pub affected: usize,
    /// Time from injection to each affected job's next claim.
    pub reclaimed_ms: Vec<u64>,
    /// Time from injection to the next event of each affected research job
    /// (server faults: the job's work resumed).
    pub progress_ms: Vec<u64>,
    /// Finished by their owner without a new claim (a drain, a short cut).
    pub kept: usize,
    pub unrecovered: Vec<String>,
    /// Affected jobs that took longer than [`SLOW_MS`] to be claimed again
    /// (their timelines are saved with the logs).
    pub slow: Vec<(String, u64)>,
    pub canary_ms: Option<u64>,
}

/// A recovery slower than this gets its job's timeline saved.
pub const SLOW_MS: u64 = 20_000;

fn since(t: &str, at: SystemTime) -> Option<u64> {
    leasehold_core::time::parse_rfc3339(t)
        .and_then(|x| x.duration_since(at).ok())
        .map(|d| d.as_millis() as u64)
}

fn worker_fault(name: &str) -> bool {
    !matches!(
        name,
        "kill9_reaper"
            | "kill9_server"
            | "kill9_node_leader"
            | "kill9_node_follower"
            | "leader_stepdown"
            | "nats_restart_kill9"
            | "nats_restart_sigterm"
            | "rolling_restart"
    )
}

pub fn recovery(faults: &[Injected], c: &Collected, canaries: &[Canary]) -> Vec<FaultRecovery> {
    let canary: HashMap<usize, Option<u64>> = canaries
        .iter()
        .map(|k| (k.fault, k.completed_after_ms))
        .collect();
    let mut out = Vec::new();
    for inj in faults {
        let mut r = FaultRecovery {
            n: inj.n,
            name: inj.name.to_string(),
            affected: inj.affected.len(),
            canary_ms: canary.get(&inj.n).copied().flatten(),
            ..Default::default()
        };
        let mut seen = HashSet::new();
        for a in &inj.affected {
            if !seen.insert(a.job.clone()) {
                continue;
            }
            let evs = c.events.get(&a.job).map(Vec::as_slice).unwrap_or_default();
            if worker_fault(inj.name) {
                let claim = evs.iter().find_map(|(_, e)| {
                    (e.r#type == "claimed" && e.epoch > a.epoch)
                        .then(|| since(&e.at, inj.at))
                        .flatten()
                });
                if let Some(ms) = claim {
                    r.reclaimed_ms.push(ms);
                    if ms > SLOW_MS {
                        r.slow.push((a.job.clone(), ms));
                    }
                    continue;
                }
                let kept = c
                    .audit
                    .get(&a.job)
                    .into_iter()
                    .flatten()
                    .filter_map(|rev| rev.rec.as_ref())
                    .any(|rec| rec.epoch == a.epoch && settled(rec));
                if kept {
                    r.kept += 1;
                } else {
                    r.unrecovered.push(a.job.clone());
                }
            } else if a.job.ends_with("-research") {
                match evs.iter().find_map(|(_, e)| since(&e.at, inj.at)) {
                    Some(ms) => r.progress_ms.push(ms),
                    None => r.unrecovered.push(a.job.clone()),
                }
            }
        }
        out.push(r);
    }
    out
}

/// Nearest-rank percentile of `v` (milliseconds); `None` when empty.
pub fn pct(v: &[u64], p: f64) -> Option<u64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_unstable();
    let rank = ((p / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    Some(s[rank.min(s.len()) - 1])
}

/// What one kind of fault did, summed over its injections.
#[derive(Default)]
struct KindTotals {
    faults: usize,
    affected: usize,
    reclaimed: Vec<u64>,
    progress: Vec<u64>,
    kept: usize,
    unrecovered: usize,
    canary: Vec<u64>,
}

/// p50/p95 and counts of recoveries grouped by fault kind, and overall.
pub fn recovery_summary(r: &[FaultRecovery]) -> Value {
    let mut by: BTreeMap<String, KindTotals> = BTreeMap::new();
    for x in r {
        let e = by.entry(x.name.clone()).or_default();
        e.faults += 1;
        e.affected += x.affected;
        e.reclaimed.extend(&x.reclaimed_ms);
        e.progress.extend(&x.progress_ms);
        e.kept += x.kept;
        e.unrecovered += x.unrecovered.len();
        e.canary.extend(x.canary_ms);
    }
    let mut kinds = serde_json::Map::new();
    let (mut all_reclaim, mut all_progress, mut all_canary) = (Vec::new(), Vec::new(), Vec::new());
    for (k, t) in by {
        kinds.insert(
            k,
            json!({
                "faults": t.faults,
                "affected_jobs": t.affected,
                "reclaimed": t.reclaimed.len(),
                "reclaim_p50_ms": pct(&t.reclaimed, 50.0),
                "reclaim_p95_ms": pct(&t.reclaimed, 95.0),
                "research_progress_p50_ms": pct(&t.progress, 50.0),
                "research_progress_p95_ms": pct(&t.progress, 95.0),
                "kept_by_owner": t.kept,
                "unrecovered": t.unrecovered,
                "canary_p50_ms": pct(&t.canary, 50.0),
                "canary_p95_ms": pct(&t.canary, 95.0),
            }),
        );
        all_reclaim.extend(t.reclaimed);
        all_progress.extend(t.progress);
        all_canary.extend(t.canary);
    }
    json!({
        "worker_faults_reclaim": {"n": all_reclaim.len(), "p50_ms": pct(&all_reclaim, 50.0), "p95_ms": pct(&all_reclaim, 95.0)},
        "server_faults_research_progress": {"n": all_progress.len(), "p50_ms": pct(&all_progress, 50.0), "p95_ms": pct(&all_progress, 95.0)},
        "canary": {"n": all_canary.len(), "p50_ms": pct(&all_canary, 50.0), "p95_ms": pct(&all_canary, 95.0)},
        "by_fault": kinds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collect::Rev;

    fn rec(status: &str, epoch: u64, worker: &str, token: &str) -> Option<JobRecord> {
        Some(JobRecord {
            id: "j".into(),
            status: status.into(),
            epoch,
            worker_id: Some(worker.into()),
            claim_token: Some(token.into()),
            ..Default::default()
        })
    }

    fn revs(v: Vec<Option<JobRecord>>) -> Vec<Rev> {
        v.into_iter()
            .enumerate()
            .map(|(i, rec)| Rev {
                seq: i as u64 + 1,
                rec,
            })
            .collect()
    }

    fn ev(ty: &str, epoch: u64, worker: Option<&str>) -> leasehold_proto::JobEvent {
        leasehold_proto::JobEvent {
            job_id: "j".into(),
            epoch,
            r#type: ty.into(),
            worker_id: worker.map(str::to_string),
            ..Default::default()
        }
    }

    #[test]
    fn a_clean_history_with_a_reclaim_passes() {
        let mut v = Verdict::default();
        records_in_order(
            &mut v,
            "j",
            &revs(vec![
                rec("running", 1, "a", "t1"),
                rec("running", 1, "a", "t1"),
                rec("queued", 1, "a", "t1"),
                rec("running", 2, "b", "t2"),
                rec("completed", 2, "b", "t2"),
            ]),
        );
        let evs: Vec<_> = [
            ev("claimed", 1, Some("a")),
            ev("progress", 1, None),
            ev("claimed", 2, Some("b")),
            ev("heartbeat_lost", 1, Some("a")),
            ev("progress", 1, None),
            ev("completed", 2, Some("b")),
        ]
        .into_iter()
        .enumerate()
        .map(|(i, e)| (i as u64, e))
        .collect();
        events_in_order(&mut v, "j", &evs, 2, true);
        assert!(v.passed(), "{v:?}");
        assert_eq!(v.info["events.non_owner_behind_a_newer_claim"], 1);
    }

    #[test]
    fn stale_owner_writes_are_caught() {
        let mut v = Verdict::default();
        records_in_order(
            &mut v,
            "j",
            &revs(vec![
                rec("running", 1, "a", "t1"),
                rec("queued", 1, "a", "t1"),
                // The paused owner of epoch 1 writes again.
                rec("running", 1, "a", "t1"),
                rec("running", 2, "b", "t2"),
                rec("completed", 1, "a", "t1"),
                rec("completed", 2, "b", "t2"),
            ]),
        );
        let reasons: Vec<&str> = v.stale_writes.iter().map(|x| x.reason.as_str()).collect();
        assert!(
            reasons.iter().any(|r| r.contains("after that claim ended")),
            "{reasons:?}"
        );
        assert!(
            reasons.iter().any(|r| r.contains("after epoch 2")),
            "{reasons:?}"
        );
        assert!(
            reasons.iter().any(|r| r.contains("after the terminal")),
            "{reasons:?}"
        );

        let mut v = Verdict::default();
        let evs: Vec<_> = [
            ev("claimed", 1, Some("a")),
            ev("claimed", 2, Some("b")),
            ev("section", 1, Some("a")),
            ev("claimed", 1, Some("a")),
            ev("completed", 2, Some("b")),
            ev("completed", 2, Some("b")),
        ]
        .into_iter()
        .enumerate()
        .map(|(i, e)| (i as u64, e))
        .collect();
        events_in_order(&mut v, "j", &evs, 2, true);
        assert_eq!(v.stale_writes.len(), 3, "{:?}", v.stale_writes);
    }

    #[test]
    fn two_owners_of_one_epoch_are_caught() {
        let mut v = Verdict::default();
        records_in_order(
            &mut v,
            "j",
            &revs(vec![
                rec("running", 3, "a", "t1"),
                rec("running", 3, "b", "t9"),
            ]),
        );
        assert_eq!(v.stale_writes.len(), 1);
    }

    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(pct(&v, 50.0), Some(50));
        assert_eq!(pct(&v, 95.0), Some(95));
        assert_eq!(pct(&[7], 95.0), Some(7));
        assert_eq!(pct(&[], 50.0), None);
    }
}
