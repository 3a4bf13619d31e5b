//! The effects ledger: one KV entry per effect of a write tool.
//!
//! Values are JSON [`LedgerEntry`]s. Every transition is conditional:
//! `in_flight` is created only if the key is absent (two racing executors
//! cannot both run the effect), and every later write (`done`, a takeover,
//! `void`) names the revision it read.
//!
//! Keys:
//! - `<job_id>.<idempotency key>`: the effect of one step of one job (see
//!   [`crate::idempotency_key`]); every key of a job shares its first token,
//!   the job id, so [`EffectsLedger::purge_job`] removes them by subject.
//! - `bk/<sha256(tool:business key)>`: a business key, pointing at the effect
//!   key that owns it ([`crate::business_key_id`]). Business keys are
//!   cross-job, so their first token is one no job id can be (job ids have
//!   no `/`), and no job's purge matches them by subject.
//!
//! Retention: entries are written with `Nats-TTL: never`, so the bucket's
//! `max_age` never expires them: a job parked for review, or dead-lettered
//! and replayed weeks later, still finds what its effects did and
//! reconciles instead of running them again. They go only with their job:
//! [`EffectsLedger::purge_job`] (the retention cleaner, once the job is
//! terminal) removes the job's keys and the business keys its effects own.
//! A business key is kept exactly as long as the effect it points at: one
//! whose effect entry is gone could not replay a result anyway.

use std::time::SystemTime;

use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use leasehold_store::effects::{self as raw, PinnedError};
use serde_json::Value;

use crate::error::ToolError;
use crate::key::ledger_key;

/// The state of one effect key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EffectState {
    /// Recorded before the effect runs; still there means the outcome is unknown.
    InFlight,
    /// The effect happened; `result` is what the destination said.
    Done,
    /// The key was retired without ever running (its business key was taken
    /// over by another step); an executor finding it must stop.
    Void,
}

/// One ledger value.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LedgerEntry {
    pub state: EffectState,
    pub tool: String,
    /// SHA-256 of the canonical arguments the effect was first asked with:
    /// the same step asking with other arguments is refused.
    pub arg_digest: String,
    pub job_id: String,
    pub step_id: String,
    /// The epoch (claim) of the executor that wrote this state.
    pub epoch: u64,
    /// RFC 3339 UTC.
    pub at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub business_key: Option<String>,
    /// How `done` was reached: `executed`, `reconciled`, `business_key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via: Option<String>,
}

/// A business-key entry: which effect key (of which job) owns this business key.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct BusinessKeyEntry {
    /// The idempotency key of the owning effect (its ledger key is
    /// `<job_id>.<effect_key>`).
    pub effect_key: String,
    pub tool: String,
    pub job_id: String,
    pub at: String,
}

pub(crate) fn now_rfc3339() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

/// What [`EffectsLedger::purge_job`] removed.
pub use leasehold_store::effects::Purged;

/// The effects ledger over a KV bucket (created by `leasehold setup`).
#[derive(Clone)]
pub struct EffectsLedger {
    js: jetstream::Context,
    kv: kv::Store,
}

impl EffectsLedger {
    pub fn new(js: jetstream::Context, kv: kv::Store) -> Self {
        EffectsLedger { js, kv }
    }

    /// Opens the bucket `bucket`; a missing bucket, or one made by an
    /// earlier `leasehold setup` whose entries would expire, is a
    /// configuration error that says to run `leasehold setup`.
    pub async fn open(js: &jetstream::Context, bucket: &str) -> Result<Self, ToolError> {
        let kv = raw::open(js, bucket).await.map_err(|e| match e {
            leasehold_store::StoreError::Config(m) => ToolError::Config(m),
            e => ToolError::Config(e.to_string()),
        })?;
        Ok(Self::new(js.clone(), kv))
    }

    /// The underlying store.
    pub fn store(&self) -> &kv::Store {
        &self.kv
    }

    /// The current entry of the effect `key` of job `job_id`, and its revision.
    pub async fn get(
        &self,
        job_id: &str,
        key: &str,
    ) -> Result<Option<(LedgerEntry, u64)>, ToolError> {
        self.get_json(&ledger_key(job_id, key)).await
    }

    pub(crate) async fn get_bk(
        &self,
        bk_id: &str,
    ) -> Result<Option<(BusinessKeyEntry, u64)>, ToolError> {
        self.get_json(bk_id).await
    }

    async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Option<(T, u64)>, ToolError> {
        let entry = self
            .kv
            .entry(key)
            .await
            .map_err(|e| ToolError::Ledger(format!("read {key}: {e}")))?;
        match entry {
            Some(e) if e.operation == kv::Operation::Put => {
                let v: T = serde_json::from_slice(&e.value).map_err(|err| {
                    ToolError::Ledger(format!("entry {key} is not a ledger value: {err}"))
                })?;
                Ok(Some((v, e.revision)))
            }
            // Deleted or purged: the key is free again.
            _ => Ok(None),
        }
    }

    async fn write(&self, key: &str, body: Bytes, rev: u64) -> Result<Option<u64>, PinnedError> {
        match raw::write_pinned(&self.js, &self.kv, key, body, rev).await {
            Ok(new) => Ok(Some(new)),
            Err(PinnedError::WrongRevision) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Creates the effect `key` of `job_id` if it is absent; `Ok(None)`
    /// when someone else holds it.
    pub(crate) async fn create(
        &self,
        job_id: &str,
        key: &str,
        v: &LedgerEntry,
    ) -> Result<Option<u64>, ToolError> {
        self.create_at(&ledger_key(job_id, key), v).await
    }

    /// Writes the effect `key` of `job_id` if its revision is still `rev`;
    /// `Ok(None)` on a conflict.
    pub(crate) async fn update(
        &self,
        job_id: &str,
        key: &str,
        v: &LedgerEntry,
        rev: u64,
    ) -> Result<Option<u64>, ToolError> {
        self.update_at(&ledger_key(job_id, key), v, rev).await
    }

    /// Deletes the effect `key` of `job_id` if its revision is still `rev`
    /// (withdrawing an `in_flight` whose request certainly never left).
    pub(crate) async fn withdraw(
        &self,
        job_id: &str,
        key: &str,
        rev: u64,
    ) -> Result<(), ToolError> {
        let key = ledger_key(job_id, key);
        self.kv
            .delete_expect_revision(&key, Some(rev))
            .await
            .map_err(|e| ToolError::Ledger(format!("withdraw {key}: {e}")))
    }

    pub(crate) async fn create_bk(
        &self,
        bk_id: &str,
        v: &BusinessKeyEntry,
    ) -> Result<Option<u64>, ToolError> {
        self.create_at(bk_id, v).await
    }

    pub(crate) async fn update_bk(
        &self,
        bk_id: &str,
        v: &BusinessKeyEntry,
        rev: u64,
    ) -> Result<Option<u64>, ToolError> {
        self.update_at(bk_id, v, rev).await
    }

    /// Creates `key` if it is absent (or deleted); `Ok(None)` when someone
    /// else holds it.
    async fn create_at<T: serde::Serialize>(
        &self,
        key: &str,
        v: &T,
    ) -> Result<Option<u64>, ToolError> {
        let body = Bytes::from(serde_json::to_vec(v).expect("ledger value serializes"));
        let err = |e: &dyn std::fmt::Display| ToolError::Ledger(format!("create {key}: {e}"));
        if let Some(rev) = self
            .write(key, body.clone(), 0)
            .await
            .map_err(|e| err(&e))?
        {
            return Ok(Some(rev));
        }
        // The key has a message: a live value, or the marker of a withdrawn
        // (deleted) one, which may be written over at its revision.
        match self.kv.entry(key).await.map_err(|e| err(&e))? {
            Some(e) if e.operation != kv::Operation::Put => {
                self.write(key, body, e.revision).await.map_err(|e| err(&e))
            }
            _ => Ok(None),
        }
    }

    /// Writes `key` if its revision is still `rev`; `Ok(None)` on a conflict.
    async fn update_at<T: serde::Serialize>(
        &self,
        key: &str,
        v: &T,
        rev: u64,
    ) -> Result<Option<u64>, ToolError> {
        let body = Bytes::from(serde_json::to_vec(v).expect("ledger value serializes"));
        let mut attempts = 0;
        loop {
            match self.write(key, body.clone(), rev).await {
                Ok(r) => return Ok(r),
                Err(e) => {
                    // Clusters sometimes reject a correct expected revision
                    // with 10164 ("in process"): re-read, and retry only if
                    // nothing changed.
                    attempts += 1;
                    let current = self.kv.entry(key).await.map_err(|e2| {
                        ToolError::Ledger(format!("update {key}: {e}; re-read: {e2}"))
                    })?;
                    match current {
                        Some(c) if c.revision == rev && attempts < 3 => continue,
                        Some(c) if c.revision != rev => return Ok(None),
                        _ => return Err(ToolError::Ledger(format!("update {key}: {e}"))),
                    }
                }
            }
        }
    }

    /// Removes every entry of job `job_id` and the business keys its effects
    /// own. For the retention cleaner, and only for a job that is terminal:
    /// a job that can still run would find no record of its effects and run
    /// them again. Idempotent; business keys go first, so an interrupted
    /// purge leaves nothing that a later one cannot find.
    pub async fn purge_job(&self, job_id: &str) -> Result<Purged, ToolError> {
        raw::purge_job(&self.js, &self.kv, job_id)
            .await
            .map_err(|e| match e {
                leasehold_store::StoreError::Config(m) => ToolError::Config(m),
                e => ToolError::Ledger(format!("purge job {job_id}: {e}")),
            })
    }
}
