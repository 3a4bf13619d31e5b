//! Recurring schedules: the KV bucket `lh_schedules`, one entry per
//! schedule (key = its name), written by `leasehold schedule` and fired by
//! every reaper.
//!
//! Firing is exactly once per tick without a leader: a reaper submits the
//! tick's job under the id [`leasehold_core::schedule::job_id`] with
//! `Nats-Msg-Id` equal to it (the work stream's dedupe window, then the
//! record's existence, make two reapers' submissions one job), and only
//! then records `last_fired` in the entry, conditioned on the revision it
//! read. A reaper that dies between the two leaves the tick to the next
//! check, which submits the same job id again: deduplicated, never lost.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use async_nats::jetstream::kv;
use futures::StreamExt;
use leasehold_core::time::{parse_rfc3339, rfc3339};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::{Conn, StoreError};

/// One schedule as stored (JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct Entry {
    pub name: String,
    /// The cron expression (5 fields, UTC; or 6 with seconds first).
    pub cron: String,
    pub kind: String,
    /// The spec each tick submits, as `leasehold submit` takes it.
    pub spec: serde_json::Value,
    pub paused: bool,
    pub created_at: String,
    /// The tick fired last (RFC 3339), and its job.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_fired: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_job: Option<String>,
    /// The latest tick skipped unfired (RFC 3339): missed by longer than
    /// a check may catch up (see `leasehold_core::schedule::due_ticks`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped_through: Option<String>,
    pub updated_at: String,
}

impl Entry {
    /// When the schedule was added.
    pub fn created(&self) -> SystemTime {
        parse_rfc3339(&self.created_at).unwrap_or(SystemTime::UNIX_EPOCH)
    }

    /// The tick fired last.
    pub fn last_fired_at(&self) -> Option<SystemTime> {
        self.last_fired.as_deref().and_then(parse_rfc3339)
    }

    /// The latest tick handled: fired, or skipped as too old to catch up.
    pub fn handled_through(&self) -> Option<SystemTime> {
        let skipped = self.skipped_through.as_deref().and_then(parse_rfc3339);
        self.last_fired_at().max(skipped)
    }
}

/// Why a schedule write did not land.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    #[error("no schedule named {0:?} (see `leasehold schedule list`)")]
    NotFound(String),
    #[error("a schedule named {0:?} exists already (remove it first)")]
    Exists(String),
    /// Someone else wrote the entry since it was read.
    #[error("schedule {0:?} changed meanwhile")]
    Conflict(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The schedules bucket.
#[derive(Clone)]
pub struct Schedules {
    kv: kv::Store,
}

impl Schedules {
    /// Opens the bucket (`StoreError::Missing` on a layout set up before it existed).
    pub async fn open(conn: &Conn) -> Result<Self, StoreError> {
        Ok(Schedules {
            kv: crate::open_kv(conn, &conn.layout.schedules_bucket()).await?,
        })
    }

    /// The entry and its revision.
    pub async fn get(&self, name: &str) -> Result<Option<(Entry, u64)>, StoreError> {
        match self.kv.entry(name).await {
            Ok(Some(e)) if e.operation == kv::Operation::Put => {
                let entry = serde_json::from_slice(&e.value).map_err(|err| {
                    StoreError::nats(&format!("schedule {name} is unreadable"), err)
                })?;
                Ok(Some((entry, e.revision)))
            }
            Ok(_) => Ok(None),
            Err(e) => Err(StoreError::nats("read schedule", e)),
        }
    }

    /// Follows the bucket until `shutdown` (a reaper's): every schedule
    /// in memory, kept by a watch, so a check reads no entry
    /// ([`crate::follow::follow`]).
    pub fn follow(&self, link: crate::connect::Link, shutdown: CancellationToken) -> ScheduleView {
        let (state, followed) = crate::follow::follow(
            "the schedules",
            self.kv.clone(),
            link,
            shutdown,
            Known::apply,
        );
        ScheduleView { state, followed }
    }

    /// Every schedule, by name.
    pub async fn list(&self) -> Result<Vec<(Entry, u64)>, StoreError> {
        let mut keys = match self.kv.keys().await {
            Ok(k) => k,
            Err(e) => return Err(StoreError::nats("list schedules", e)),
        };
        let mut names = Vec::new();
        while let Some(k) = keys.next().await {
            names.push(k.map_err(|e| StoreError::nats("list schedules", e))?);
        }
        names.sort();
        let mut out = Vec::new();
        for n in names {
            if let Some(e) = self.get(&n).await? {
                out.push(e);
            }
        }
        Ok(out)
    }

    /// Adds a schedule; refused when the name is taken.
    pub async fn create(&self, e: &Entry) -> Result<u64, ScheduleError> {
        let v = serde_json::to_vec(e).expect("entry serializes");
        match self.kv.create(&e.name, v.into()).await {
            Ok(r) => Ok(r),
            Err(err) if err.kind() == kv::CreateErrorKind::AlreadyExists => {
                Err(ScheduleError::Exists(e.name.clone()))
            }
            Err(err) => Err(StoreError::nats("add schedule", err).into()),
        }
    }

    /// Writes `e` only if the entry is still at `revision`.
    pub async fn update(&self, e: &Entry, revision: u64) -> Result<u64, ScheduleError> {
        let v = serde_json::to_vec(e).expect("entry serializes");
        match self.kv.update(&e.name, v.into(), revision).await {
            Ok(r) => Ok(r),
            Err(err) if err.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                Err(ScheduleError::Conflict(e.name.clone()))
            }
            Err(err) if crate::is_wrong_last_sequence(&err) => {
                Err(ScheduleError::Conflict(e.name.clone()))
            }
            Err(err) => Err(StoreError::nats("update schedule", err).into()),
        }
    }

    /// Read, change, write conditioned on the revision read (retried on a
    /// conflict); `NotFound` when there is no such schedule.
    pub async fn modify(
        &self,
        name: &str,
        change: impl Fn(&mut Entry),
    ) -> Result<Entry, ScheduleError> {
        loop {
            let Some((mut e, rev)) = self.get(name).await? else {
                return Err(ScheduleError::NotFound(name.into()));
            };
            change(&mut e);
            e.updated_at = rfc3339(SystemTime::now());
            match self.update(&e, rev).await {
                Ok(_) => return Ok(e),
                Err(ScheduleError::Conflict(_)) => continue,
                Err(other) => return Err(other),
            }
        }
    }

    /// Removes a schedule; `NotFound` when there is none.
    pub async fn remove(&self, name: &str) -> Result<(), ScheduleError> {
        if self.get(name).await?.is_none() {
            return Err(ScheduleError::NotFound(name.into()));
        }
        self.kv
            .purge(name)
            .await
            .map_err(|e| ScheduleError::Store(StoreError::nats("remove schedule", e)))
    }
}

/// The schedules as a watch shows them: name -> (entry, revision); a
/// removed (or unreadable) one is kept as `None` at its revision, so a
/// write of this process's that the removal followed cannot bring it back.
#[derive(Default)]
struct Known(BTreeMap<String, (Option<Entry>, u64)>);

impl Known {
    fn apply(&mut self, e: &kv::Entry) {
        let entry = match e.operation {
            kv::Operation::Put => match serde_json::from_slice::<Entry>(&e.value) {
                Ok(entry) => Some(entry),
                // One unreadable entry holds no other schedule back.
                Err(err) => {
                    tracing::warn!(schedule = %e.key, error = %err, "unreadable schedule; not fired (`leasehold schedule remove` it, or add it again)");
                    None
                }
            },
            _ => None,
        };
        self.0.insert(e.key.clone(), (entry, e.revision));
    }
}

/// A live view of the schedules ([`Schedules::follow`]).
#[derive(Clone)]
pub struct ScheduleView {
    state: Arc<Mutex<Known>>,
    followed: crate::follow::Followed,
}

impl ScheduleView {
    /// Every schedule with its revision, by name; `None` while the view is
    /// being read (at its start, after an error or a reconnect).
    pub fn schedules(&self) -> Option<Vec<(Entry, u64)>> {
        self.followed.read(&self.state, |k| {
            k.0.values()
                .filter_map(|(e, rev)| Some((e.clone()?, *rev)))
                .collect()
        })
    }

    /// Records this process's own write of `entry` at `revision`, so the
    /// next look does not wait for the watch to bring it (a later
    /// revision the watch brought first is kept).
    pub fn wrote(&self, entry: &Entry, revision: u64) {
        let mut st = self.state.lock().unwrap();
        if st.0.get(&entry.name).is_none_or(|(_, r)| *r < revision) {
            st.0.insert(entry.name.clone(), (Some(entry.clone()), revision));
        }
    }

    /// Resolves at the next change of any schedule (or a new read of them).
    pub async fn changed(&mut self) {
        if self.followed.changes.changed().await.is_err() {
            // The follower stopped (shutdown): no change ever comes.
            std::future::pending::<()>().await;
        }
    }
}
