//! Child jobs: what a parent's `spawn` submits, how a child's end reaches
//! its parent, and what the parent's join reads.
//!
//! A child is an ordinary job whose spec names its parent
//! ([`leasehold_proto::Parent`]). Its id is derived from the parent's id,
//! its incarnation (`created_at`) and the spawning step ([`child_id`]), so
//! a parent that spawns again after a crash, or a stale owner that spawns
//! late, names the same children, and the work stream's dedupe and the
//! record's create-if-absent make each of them once.
//!
//! Every path that ends a child (its owner, a cancel, recovery, the
//! reaper's dead-lettering, a review) calls [`announce_end`] before the
//! terminal event, the end's completion marker: one message on the
//! parent's `lh.signal.<parent>.lh-child`, deduplicated by the child's
//! incarnation and epoch. A job that was killed between its terminal write
//! and its event is finished by recovery, which announces it too. So a
//! child's end costs one publish: no write to the parent's record, however
//! many children end at once.
//!
//! A parent that joins reads the announcements ([`announcements`]: their
//! count and the children they name, one read) and, while some of its
//! children are not among them, waits (`waiting_for` `children`) until the
//! count reaches what it read plus the children still to announce: exactly
//! when the last of them ends. The waker of the signals
//! ([`crate::signals::run`]) asks on each child's end ([`announced`]: one
//! stream-info request, whatever the number of children), and only the
//! last one wakes it. A count that runs ahead (a child ended twice after a
//! replay, an end announced twice past the dedupe window) wakes it early;
//! its join reads again and waits again, so an early wake costs an
//! attempt, never a result.

use leasehold_core::{JobRecord, Status};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::events::Events;
use crate::signals::Signals;
use crate::{Jobs, JobsError, StoreError};

/// The signal name of a child's end (leasehold's own: a user's signal
/// name never starts with `lh-`).
pub const ENDED: &str = "lh-child";

/// The id of child `i` of `parent`'s step `step`: `<parent>_<h>_<i>`,
/// where `<h>` is 8 hex digits of a digest of the parent's id, its
/// incarnation and the step; `c<h16>_<i>` when that would pass 128
/// characters. The same arguments give the same id, always.
pub fn child_id(parent: &JobRecord, step: &str, i: usize) -> String {
    let mut d = Sha256::new();
    d.update(parent.id.as_bytes());
    d.update([0]);
    d.update(parent.created_at.as_bytes());
    d.update([0]);
    d.update(step.as_bytes());
    let h: String = d
        .finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect();
    let id = format!("{}_{}_{i}", parent.id, &h[..8]);
    if id.len() <= 128 {
        id
    } else {
        format!("c{h}_{i}")
    }
}

/// A child's end as its parent's join sees it (and records as its step's
/// result, in every language).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// The child's id.
    pub id: String,
    /// Its kind.
    pub kind: String,
    /// How it ended: `completed`, `failed`, `cancelled`, `dead` or
    /// `rejected`.
    pub status: String,
    /// Its result (`completed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// Why it did not complete: its error's class and message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ChildError>,
}

/// Why a child did not complete.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChildError {
    pub class: String,
    pub message: String,
}

impl Outcome {
    /// Whether the child completed.
    pub fn completed(&self) -> bool {
        self.status == Status::Completed.as_str()
    }
}

/// The outcome of a child record that ended (`None` while it has not:
/// it is queued, running, waiting or parked).
pub fn outcome_of(rec: &JobRecord) -> Option<Outcome> {
    let status: Status = rec.status.parse().ok()?;
    if !status.is_terminal() {
        return None;
    }
    let result = rec
        .result
        .as_ref()
        .filter(|_| status == Status::Completed)
        .map(|r| serde_json::from_str(&r.output).unwrap_or(Value::String(r.output.clone())));
    Some(Outcome {
        id: rec.id.clone(),
        kind: rec.kind.clone(),
        status: rec.status.clone(),
        result,
        error: rec
            .error
            .as_ref()
            .filter(|_| status != Status::Completed)
            .map(|e| ChildError {
                class: e.class.clone(),
                message: e.message.clone(),
            }),
    })
}

/// The outcome of child `id` now: `Ok(None)` while it has not ended. A
/// child with no record (its ticket not yet taken by a worker) has not.
pub async fn outcome(jobs: &Jobs, id: &str) -> Result<Option<Outcome>, JobsError> {
    Ok(jobs.get(id).await?.and_then(|v| outcome_of(&v.value)))
}

/// Announces the end of `rec` to its parent, if it is a child whose
/// parent still waits for anything (a parent that ended, or was
/// forgotten, needs no announcement, and gets none: nothing would ever
/// purge it). Called by every path that ends a job, before its terminal
/// event; tried again with the same id, it is stored once.
pub async fn announce_end(
    jobs: &Jobs,
    signals: &Signals,
    rec: &JobRecord,
) -> Result<(), StoreError> {
    announce_end_seen(jobs, signals, &SeenParents::default(), rec).await
}

/// How long a parent seen with a record is taken as still having one.
/// Far shorter than any retention: an end announced to a parent that
/// ended meanwhile is purged with the parent's signals when it is
/// forgotten.
const SEEN_FOR: std::time::Duration = std::time::Duration::from_secs(2);

/// Parents seen with an unfinished record, and when (one process's;
/// clones share it).
#[derive(Default, Clone)]
pub struct SeenParents(
    std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>>,
);

impl SeenParents {
    fn fresh(&self, id: &str) -> bool {
        self.0
            .lock()
            .unwrap()
            .get(id)
            .is_some_and(|t| t.elapsed() < SEEN_FOR)
    }

    fn saw(&self, id: &str) {
        let mut g = self.0.lock().unwrap();
        if g.len() > 10_000 {
            g.retain(|_, t| t.elapsed() < SEEN_FOR);
        }
        g.insert(id.to_string(), std::time::Instant::now());
    }
}

/// [`announce_end`], reading the parent only when `seen` did not see it
/// unfinished a moment ago.
pub async fn announce_end_seen(
    jobs: &Jobs,
    signals: &Signals,
    seen: &SeenParents,
    rec: &JobRecord,
) -> Result<(), StoreError> {
    let Some(parent) = rec.spec.as_ref().and_then(|s| s.parent.as_ref()) else {
        return Ok(());
    };
    if !seen.fresh(&parent.id) {
        if !parent_unfinished(jobs, &parent.id).await? {
            return Ok(());
        }
        seen.saw(&parent.id);
    }
    let mut data = serde_json::json!({"child": rec.id, "status": rec.status});
    // A final end's outcome rides along when small: the join then reads
    // no record for it.
    // (An output kept beside the record is not in `rec`: read there.)
    let carried =
        outcome_of(rec).filter(|o| FINAL.contains(&o.status.as_str()) && !rec.output_beside);
    if let Some(o) = carried {
        let o = serde_json::to_value(o).expect("serializes");
        if o.to_string().len() <= OUTCOME_CARRIED {
            data["outcome"] = o;
        }
    }
    let id = format!("{}:ended:{}:{}", rec.id, rec.epoch, rec.created_at);
    signals
        .send(&parent.id, ENDED, &data, Some(&id), Some("leasehold"))
        .await
        .map(|_| ())
}

/// The ends nothing can undo (a dead or rejected job may be replayed, and
/// run again): an announcement of one carries its outcome.
const FINAL: [&str; 3] = ["completed", "failed", "cancelled"];

/// The largest outcome an announcement carries (its JSON, bytes); a
/// larger one is read from the child's record.
const OUTCOME_CARRIED: usize = 4096;

/// Whether job `id` has a record that has not finished.
async fn parent_unfinished(jobs: &Jobs, id: &str) -> Result<bool, StoreError> {
    Ok(jobs
        .get(id)
        .await
        .map_err(|e| StoreError::failed(format!("read parent {id}: {e}")))?
        .is_some_and(|p| {
            p.value
                .status
                .parse::<Status>()
                .is_ok_and(|s| !s.is_terminal())
        }))
}

/// The child ends announced to `parent`: how many messages in all, and
/// the children they name, each with the outcome its last announcement
/// carried (one bounded read of its `lh-child` subject). What a join
/// waits on: with the count read with the set, a child not in the set is
/// one whose announcement is still to come; one without an outcome is
/// read from its record.
pub async fn announcements(
    signals: &Signals,
    parent: &str,
) -> Result<(u64, std::collections::HashMap<String, Option<Outcome>>), StoreError> {
    let all = signals.all(parent, ENDED).await?;
    let ids = all
        .iter()
        .filter_map(|s| {
            let child = s.data.get("child").and_then(Value::as_str)?;
            let outcome = s
                .data
                .get("outcome")
                .and_then(|o| serde_json::from_value::<Outcome>(o.clone()).ok())
                .filter(|o| o.id == child && FINAL.contains(&o.status.as_str()));
            Some((child.to_string(), outcome))
        })
        .collect();
    Ok((all.len() as u64, ids))
}

/// How many child ends were announced to `parent` in all (one
/// stream-info request).
pub async fn announced(signals: &Signals, parent: &str) -> Result<u64, StoreError> {
    signals.count(parent, ENDED).await
}

/// What a `spawn` step records as its result: the children it spawned,
/// and what a cancel of the parent does to them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Spawned {
    /// The children's ids, in the order of their inputs.
    pub children: Vec<String>,
    /// `cascade` or `detach` (see [`leasehold_proto::Parent::on_cancel`]).
    pub on_cancel: String,
}

/// What a cancel of the parent does to its children, by default.
pub const CASCADE: &str = "cascade";
/// The children run on when their parent is cancelled.
pub const DETACH: &str = "detach";

/// What `parent`'s recorded `spawn` steps started, in their order (read
/// from its `step` events): each spawn's kind, its children and their
/// cancel policy.
pub async fn spawns(events: &Events, parent: &str) -> Result<Vec<(String, Spawned)>, StoreError> {
    let steps = events.read_types(parent, &["step"]).await?;
    Ok(crate::events::coherent(&steps)
        .into_iter()
        .filter_map(|ev| {
            let d = ev.data_map();
            let kind = d
                .get("id")
                .and_then(Value::as_str)?
                .strip_prefix(SPAWN_STEP)?
                .split('#')
                .next()?
                .to_string();
            let s: Spawned = serde_json::from_value(d.get("result")?.clone()).ok()?;
            Some((kind, s))
        })
        .collect())
}

/// One child of a job, as its views show it.
#[derive(Debug, Clone)]
pub struct Listed {
    pub id: String,
    /// The kind its spawn named.
    pub kind: String,
    /// Its record: `None` while no worker took its ticket (queued).
    pub record: Option<JobRecord>,
}

impl Listed {
    /// Its status, `queued` before it has a record.
    pub fn status(&self) -> &str {
        self.record.as_ref().map_or("queued", |r| r.status.as_str())
    }
}

/// The children `parent`'s spawns started, in their order, and how many:
/// the first `limit` with their records (read side by side), for the
/// console's page and `leasehold events --children`.
pub async fn listed(
    jobs: &Jobs,
    events: &Events,
    parent: &str,
    limit: usize,
) -> Result<(usize, Vec<Listed>), StoreError> {
    use futures::StreamExt;
    let all: Vec<(String, String)> = spawns(events, parent)
        .await?
        .into_iter()
        .flat_map(|(kind, s)| s.children.into_iter().map(move |c| (c, kind.clone())))
        .collect();
    let shown = futures::stream::iter(all.iter().take(limit).cloned().map(
        |(id, kind)| async move {
            let record = jobs.get(&id).await?.map(|v| v.value);
            Ok::<_, JobsError>(Listed { id, kind, record })
        },
    ))
    .buffered(32)
    .collect::<Vec<_>>()
    .await
    .into_iter()
    .collect::<Result<Vec<_>, _>>()
    .map_err(|e| StoreError::failed(format!("reading {parent}'s children: {e}")))?;
    Ok((all.len(), shown))
}

/// The children of `parent` that a cancel of it cancels too, with their
/// kind: those of its spawns that did not detach them.
pub async fn cascading(events: &Events, parent: &str) -> Result<Vec<(String, String)>, StoreError> {
    Ok(spawns(events, parent)
        .await?
        .into_iter()
        .filter(|(_, s)| s.on_cancel != DETACH)
        .flat_map(|(kind, s)| s.children.into_iter().map(move |c| (c, kind.clone())))
        .collect())
}

/// Records child `id` (of `kind`, spawned by `parent`), which its
/// parent's cancel found without a record (its ticket not taken yet),
/// `cancelled` from the start ([`cancelled_unborn`]), with its terminal
/// event. `true` when a claim created its record meanwhile: cancel that.
pub async fn cancel_unborn(
    jobs: &Jobs,
    events: &Events,
    id: &str,
    kind: &str,
    parent: &str,
) -> bool {
    let r = cancelled_unborn(id, kind, parent, std::time::SystemTime::now());
    match jobs.create(&r).await {
        Ok(_) => {
            let ev = crate::events::event(
                id,
                0,
                "cancelled",
                None,
                serde_json::json!({"while": "queued", "kind": kind, "parent": parent}),
            );
            let dedupe = crate::events::terminal_event_id(&r, "cancelled");
            let _ = events.publish(&ev, Some(&dedupe)).await;
            false
        }
        Err(JobsError::Exists(_)) => true,
        Err(e) => {
            tracing::warn!(job = %id, error = %e, "cannot record a child cancelled with its parent");
            false
        }
    }
}

/// The record of child `id` (of `kind`, spawned by `parent`) that its
/// parent's cancel found without one (its ticket not taken yet):
/// `cancelled` from the start, so its ticket's claim runs nothing.
pub fn cancelled_unborn(
    id: &str,
    kind: &str,
    parent: &str,
    now: std::time::SystemTime,
) -> JobRecord {
    let mut r = leasehold_core::machine::new_record(
        id,
        kind,
        leasehold_proto::JobSpec {
            id: Some(id.into()),
            parent: Some(leasehold_proto::Parent {
                id: parent.into(),
                on_cancel: CASCADE.into(),
                ..Default::default()
            }),
            ..Default::default()
        },
        0,
        now,
    );
    r.status = Status::Cancelled.as_str().into();
    r.cancel_requested = true;
    r.error = Some(leasehold_proto::JobError {
        class: "cancelled".into(),
        message: format!("cancelled with its parent {parent}, before it ran"),
        at: leasehold_core::time::rfc3339(now),
    });
    r
}

/// The name of a spawn step (`spawn:<kind>#n`) starts with this.
pub const SPAWN_STEP: &str = "spawn:";

#[cfg(test)]
mod tests {
    use super::*;

    fn parent(id: &str, created: &str) -> JobRecord {
        JobRecord {
            id: id.into(),
            created_at: created.into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_childs_id_is_its_parent_incarnation_and_step_and_nothing_else() {
        let p = parent("report", "2026-12-06T10:00:00Z");
        let a = child_id(&p, "spawn:echo#0", 3);
        assert_eq!(a, child_id(&p, "spawn:echo#0", 3));
        assert!(a.starts_with("report_") && a.ends_with("_3"), "{a}");
        assert_ne!(a, child_id(&p, "spawn:echo#1", 3));
        assert_ne!(a, child_id(&p, "spawn:echo#0", 4));
        let again = parent("report", "2026-12-07T10:00:00Z");
        assert_ne!(
            a,
            child_id(&again, "spawn:echo#0", 3),
            "a new incarnation has new children"
        );
        let long = parent(&"x".repeat(128), "t");
        let c = child_id(&long, "spawn:echo#0", 999_999);
        assert!(
            c.len() <= 128 && leasehold_core::spec::valid_job_id(&c),
            "{c}"
        );
        assert!(leasehold_core::spec::valid_job_id(&a));
    }

    #[test]
    fn an_outcome_is_only_of_an_end() {
        let mut r = parent("c", "t");
        r.kind = "echo".into();
        r.status = "running".into();
        assert_eq!(outcome_of(&r), None);
        r.status = "completed".into();
        r.result = Some(leasehold_proto::JobResult {
            output: r#"{"n":1}"#.into(),
            ..Default::default()
        });
        let o = outcome_of(&r).unwrap();
        assert!(o.completed());
        assert_eq!(o.result, Some(serde_json::json!({"n": 1})));
        r.status = "failed".into();
        r.error = Some(leasehold_proto::JobError {
            class: "terminal".into(),
            message: "no".into(),
            at: String::new(),
        });
        let o = outcome_of(&r).unwrap();
        assert_eq!(o.result, None);
        assert_eq!(o.error.unwrap().class, "terminal");
    }
}
