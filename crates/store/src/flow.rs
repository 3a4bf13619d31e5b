//! Fleet-wide flow control's buckets.
//!
//! - `lh_limits`: one entry per provider key id (`leasehold limits set`),
//!   its [`LimitEntry`], and per limited tenant (`tenant.<name>.jobs`,
//!   `tenant.<name>.model`); every worker watches it, so a change applies
//!   fleet-wide within a second.
//! - `lh_flow`: `lease.<id>` (the [`LeaseRecord`] splitting the key's limits
//!   between workers, each write conditioned on the revision read),
//!   `cool.<id>` (a cooldown after a 429 or a quota error) and
//!   `breaker.<id>` (an open circuit breaker), each a [`Pause`] that is
//!   only ever extended; `learned.<id>` (a concurrency the key was found to
//!   serve at most, [`Learned`]: only ever lowered, removed by `leasehold
//!   limits clear`); every worker watches the pauses and what was learned.

use std::time::SystemTime;

use async_nats::jetstream::kv;
use futures::{Stream, StreamExt};
use leasehold_flow::{Learned, LeaseRecord, Limits, Pause, ProviderInfo};
use serde::{Deserialize, Serialize};

use crate::{Conn, StoreError};

/// A provider key's limits as stored in `lh_limits`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LimitEntry {
    pub limits: Limits,
    /// Who the key is, when known (set by `--base-url`/`--model`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<ProviderInfo>,
    /// A tenant's weight, on its `tenant.<name>.jobs` entry (1 when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
    pub updated_at: String,
}

/// [`FlowStore::list_limits`]'s answer.
#[derive(Debug, Default)]
pub struct LimitsListing {
    pub entries: Vec<(String, LimitEntry)>,
    /// Keys whose entry is not a limits entry, with the parse error.
    pub unreadable: Vec<(String, String)>,
}

/// What kind of pause an entry of `lh_flow` is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseKind {
    Cooldown,
    Breaker,
}

impl PauseKind {
    fn prefix(self) -> &'static str {
        match self {
            PauseKind::Cooldown => "cool",
            PauseKind::Breaker => "breaker",
        }
    }
}

/// A change seen by a watch.
#[derive(Debug, Clone)]
pub enum FlowChange {
    /// A key's limits, or `None` when cleared.
    Limits(String, Option<LimitEntry>),
    Pause(PauseKind, String, Pause),
    /// What a worker learned of a key, or `None` when it was cleared.
    Learned(String, Option<Learned>),
}

/// A lease write that did not land.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("the lease record changed meanwhile")]
    Conflict,
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The two buckets.
#[derive(Clone)]
pub struct FlowStore {
    limits: kv::Store,
    flow: kv::Store,
}

fn ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Milliseconds since the Unix epoch (this host's clock).
pub fn now_ms() -> u64 {
    ms(SystemTime::now())
}

/// `t` as milliseconds since the Unix epoch.
pub fn to_ms(t: SystemTime) -> u64 {
    ms(t)
}

impl FlowStore {
    /// Opens both buckets (`StoreError::Missing` on a layout set up before
    /// they existed: run `leasehold setup`).
    pub async fn open(conn: &Conn) -> Result<Self, StoreError> {
        Ok(FlowStore {
            limits: crate::open_kv(conn, &conn.layout.limits_bucket()).await?,
            flow: crate::open_kv(conn, &conn.layout.flow_bucket()).await?,
        })
    }

    /// The limits bucket's name (for messages that say how to fix it).
    pub fn limits_bucket(&self) -> &str {
        &self.limits.name
    }

    /// Every key's limits, by id, and the keys whose entry cannot be
    /// parsed (with why): the watch takes such an entry as no limits, the
    /// CLI refuses to list past it. An error here is NATS's.
    pub async fn list_limits(&self) -> Result<LimitsListing, StoreError> {
        let mut out = LimitsListing::default();
        for id in keys(&self.limits, "list limits").await? {
            match self.limits.entry(&id).await {
                Ok(Some(e)) if e.operation == kv::Operation::Put => {
                    match serde_json::from_slice(&e.value) {
                        Ok(v) => out.entries.push((id, v)),
                        Err(err) => out.unreadable.push((id, err.to_string())),
                    }
                }
                Ok(_) => {}
                Err(e) => return Err(StoreError::nats("read limits", e)),
            }
        }
        Ok(out)
    }

    pub async fn get_limits(&self, id: &str) -> Result<Option<LimitEntry>, StoreError> {
        match self.limits.entry(id).await {
            Ok(Some(e)) if e.operation == kv::Operation::Put => serde_json::from_slice(&e.value)
                .map(Some)
                .map_err(|err| StoreError::nats(&format!("limits {id} are unreadable"), err)),
            Ok(_) => Ok(None),
            Err(e) => Err(StoreError::nats("read limits", e)),
        }
    }

    pub async fn set_limits(&self, id: &str, e: &LimitEntry) -> Result<(), StoreError> {
        let v = serde_json::to_vec(e).expect("limits serialize");
        self.limits
            .put(id, v.into())
            .await
            .map(|_| ())
            .map_err(|e| StoreError::nats("write limits", e))
    }

    /// Removes a key's limits; `false` when it had none.
    pub async fn clear_limits(&self, id: &str) -> Result<bool, StoreError> {
        if self.get_limits(id).await?.is_none() {
            return Ok(false);
        }
        self.limits
            .delete(id)
            .await
            .map(|_| true)
            .map_err(|e| StoreError::nats("clear limits", e))
    }

    /// The key's lease record and its revision (0: none yet).
    pub async fn lease(&self, id: &str) -> Result<(LeaseRecord, u64), StoreError> {
        let key = format!("lease.{id}");
        match self.flow.entry(&key).await {
            Ok(Some(e)) if e.operation == kv::Operation::Put => {
                let rec = serde_json::from_slice(&e.value).unwrap_or_default();
                Ok((rec, e.revision))
            }
            Ok(Some(e)) => Ok((LeaseRecord::default(), e.revision)),
            Ok(None) => Ok((LeaseRecord::default(), 0)),
            Err(e) => Err(StoreError::nats("read lease", e)),
        }
    }

    /// Writes the record only if it is still at `revision` (0: absent).
    pub async fn write_lease(
        &self,
        id: &str,
        rec: &LeaseRecord,
        revision: u64,
    ) -> Result<u64, LeaseError> {
        let v = serde_json::to_vec(rec).expect("lease serializes").into();
        self.write_at(&format!("lease.{id}"), v, revision, "write lease")
            .await
    }

    /// Writes `v` at `key` only if the key is still at `revision` (0:
    /// absent, or removed): a lost race is a [`LeaseError::Conflict`],
    /// judged by the error's kind (and the server's code), never its text.
    async fn write_at(
        &self,
        key: &str,
        v: bytes::Bytes,
        revision: u64,
        what: &'static str,
    ) -> Result<u64, LeaseError> {
        if revision == 0 {
            self.flow.create(key, v).await.map_err(|err| {
                if err.kind() == kv::CreateErrorKind::AlreadyExists {
                    LeaseError::Conflict
                } else {
                    LeaseError::Store(StoreError::nats(what, err))
                }
            })
        } else {
            self.flow.update(key, v, revision).await.map_err(|err| {
                if err.kind() == kv::UpdateErrorKind::WrongLastRevision
                    || crate::is_wrong_last_sequence(&err)
                {
                    LeaseError::Conflict
                } else {
                    LeaseError::Store(StoreError::nats(what, err))
                }
            })
        }
    }

    /// Writes `new` at `key` unless the value there `stands` (then
    /// `false`, nothing written), conditioned on the revision read: a
    /// write that lost a race reads again and decides again (five times).
    async fn write_unless<T: Serialize + serde::de::DeserializeOwned>(
        &self,
        key: &str,
        new: &T,
        stands: impl Fn(&T) -> bool,
        what: &'static str,
    ) -> Result<bool, StoreError> {
        let v: bytes::Bytes = serde_json::to_vec(new).expect("value serializes").into();
        for _ in 0..5 {
            let (current, revision) = match self.flow.entry(key).await {
                Ok(Some(e)) if e.operation == kv::Operation::Put => {
                    (serde_json::from_slice::<T>(&e.value).ok(), e.revision)
                }
                Ok(_) => (None, 0),
                Err(e) => return Err(StoreError::nats(what, e)),
            };
            if current.as_ref().is_some_and(&stands) {
                return Ok(false);
            }
            match self.write_at(key, v.clone(), revision, what).await {
                Ok(_) => return Ok(true),
                Err(LeaseError::Conflict) => continue,
                Err(LeaseError::Store(e)) => return Err(e),
            }
        }
        Ok(false)
    }

    /// The pause of a key, if any (expired ones included).
    pub async fn get_pause(
        &self,
        kind: PauseKind,
        id: &str,
    ) -> Result<Option<(Pause, u64)>, StoreError> {
        let key = format!("{}.{id}", kind.prefix());
        match self.flow.entry(&key).await {
            Ok(Some(e)) if e.operation == kv::Operation::Put => {
                Ok(serde_json::from_slice(&e.value)
                    .ok()
                    .map(|p| (p, e.revision)))
            }
            Ok(_) => Ok(None),
            Err(e) => Err(StoreError::nats("read pause", e)),
        }
    }

    /// Pauses a key for the fleet: written unless a pause as long or
    /// longer is already there (conditioned on the revision read, so two
    /// workers' pauses keep the later one). `false`: nothing written.
    pub async fn extend_pause(
        &self,
        kind: PauseKind,
        id: &str,
        p: &Pause,
    ) -> Result<bool, StoreError> {
        let key = format!("{}.{id}", kind.prefix());
        self.write_unless(&key, p, |c: &Pause| c.until_ms >= p.until_ms, "write pause")
            .await
    }

    /// What was learned of a key, if anything.
    pub async fn get_learned(&self, id: &str) -> Result<Option<(Learned, u64)>, StoreError> {
        match self.flow.entry(format!("learned.{id}")).await {
            Ok(Some(e)) if e.operation == kv::Operation::Put => {
                Ok(serde_json::from_slice(&e.value)
                    .ok()
                    .map(|l| (l, e.revision)))
            }
            Ok(_) => Ok(None),
            Err(e) => Err(StoreError::nats("read learned limit", e)),
        }
    }

    /// Records for the fleet what a worker learned of a key: written when
    /// nothing was, or when it is lower than what was (conditioned on the
    /// revision read). `false`: nothing written.
    pub async fn learn(&self, id: &str, l: &Learned) -> Result<bool, StoreError> {
        let key = format!("learned.{id}");
        self.write_unless(
            &key,
            l,
            |c: &Learned| c.concurrency <= l.concurrency,
            "write learned limit",
        )
        .await
    }

    /// Removes what was learned of a key; `false` when nothing was.
    pub async fn forget(&self, id: &str) -> Result<bool, StoreError> {
        if self.get_learned(id).await?.is_none() {
            return Ok(false);
        }
        self.flow
            .delete(format!("learned.{id}"))
            .await
            .map(|_| true)
            .map_err(|e| StoreError::nats("clear learned limit", e))
    }

    /// Everything learned, by id.
    pub async fn learned(&self) -> Result<Vec<(String, Learned)>, StoreError> {
        let mut out = Vec::new();
        for k in keys(&self.flow, "list learned limits").await? {
            if let Some(id) = k.strip_prefix("learned.") {
                if let Some((l, _)) = self.get_learned(id).await? {
                    out.push((id.to_string(), l));
                }
            }
        }
        Ok(out)
    }

    /// Every limit and pause as it is now, then each change.
    pub async fn watch(
        &self,
    ) -> Result<impl Stream<Item = FlowChange> + Send + 'static, StoreError> {
        let limits = self
            .limits
            .watch_with_history(">")
            .await
            .map_err(|e| StoreError::nats("watch limits", e))?;
        let cool = self
            .flow
            .watch_many_with_history(["cool.*", "breaker.*", "learned.*"])
            .await
            .map_err(|e| StoreError::nats("watch pauses", e))?;
        let limits = limits.filter_map(|e| async move {
            let e = e.ok()?;
            Some(match e.operation {
                kv::Operation::Put => {
                    FlowChange::Limits(e.key.clone(), serde_json::from_slice(&e.value).ok())
                }
                _ => FlowChange::Limits(e.key.clone(), None),
            })
        });
        let cool = cool.filter_map(|e| async move {
            let e = e.ok()?;
            let (prefix, id) = e.key.split_once('.')?;
            if prefix == "learned" {
                let l = match e.operation {
                    kv::Operation::Put => Some(serde_json::from_slice(&e.value).ok()?),
                    _ => None,
                };
                return Some(FlowChange::Learned(id.to_string(), l));
            }
            if e.operation != kv::Operation::Put {
                return None;
            }
            let kind = if prefix == "cool" {
                PauseKind::Cooldown
            } else {
                PauseKind::Breaker
            };
            Some(FlowChange::Pause(
                kind,
                id.to_string(),
                serde_json::from_slice(&e.value).ok()?,
            ))
        });
        Ok(futures::stream::select(limits, cool))
    }

    /// Every pause (cooldowns and open breakers) as it is now, then each
    /// new one or extension: what the console's charts follow (its NATS
    /// user may read `lh_flow`, not `lh_limits`).
    pub async fn watch_pauses(
        &self,
    ) -> Result<impl Stream<Item = (PauseKind, String, Pause)> + Send + 'static, StoreError> {
        let w = self
            .flow
            .watch_many_with_history(["cool.*", "breaker.*"])
            .await
            .map_err(|e| StoreError::nats("watch pauses", e))?;
        Ok(w.filter_map(|e| async move {
            let e = e.ok()?;
            if e.operation != kv::Operation::Put {
                return None;
            }
            let kind = match e.key.split_once('.')? {
                ("cool", _) => PauseKind::Cooldown,
                _ => PauseKind::Breaker,
            };
            let id = e.key.split_once('.')?.1.to_string();
            Some((kind, id, serde_json::from_slice(&e.value).ok()?))
        }))
    }

    /// Every lease record, by id (for `leasehold limits list`).
    pub async fn leases(&self) -> Result<Vec<(String, LeaseRecord)>, StoreError> {
        let mut out = Vec::new();
        for k in keys(&self.flow, "list leases").await? {
            if let Some(id) = k.strip_prefix("lease.") {
                out.push((id.to_string(), self.lease(id).await?.0));
            }
        }
        Ok(out)
    }

    /// Every pause, by id.
    pub async fn pauses(&self) -> Result<Vec<(PauseKind, String, Pause)>, StoreError> {
        let mut out = Vec::new();
        for k in keys(&self.flow, "list pauses").await? {
            let (kind, id) = match k.split_once('.') {
                Some(("cool", id)) => (PauseKind::Cooldown, id),
                Some(("breaker", id)) => (PauseKind::Breaker, id),
                _ => continue,
            };
            if let Some((p, _)) = self.get_pause(kind, id).await? {
                out.push((kind, id.to_string(), p));
            }
        }
        Ok(out)
    }
}

async fn keys(kv: &kv::Store, what: &str) -> Result<Vec<String>, StoreError> {
    let mut keys = match kv.keys().await {
        Ok(k) => k,
        Err(e) => return Err(StoreError::nats(what, e)),
    };
    let mut out = Vec::new();
    while let Some(k) = keys.next().await {
        out.push(k.map_err(|e| StoreError::nats(what, e))?);
    }
    out.sort();
    Ok(out)
}
