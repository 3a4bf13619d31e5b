//! The effects ledger: one KV entry per idempotency key of a write.
//!
//! Values are JSON [`LedgerEntry`]s. Every transition is conditional:
//! `in_flight` is created only if the key is absent (two racing executors
//! cannot both run the effect), and every later write (`done`, a takeover,
//! `void`) names the revision it read. Business keys live in the same bucket
//! as `bk.<sha>` entries pointing at the effect key that owns them.
//!
//! Entries expire with the bucket's `max_age` (the retention, default 7
//! days): long enough for any resume or review, short enough to bound the
//! bucket.

use std::time::SystemTime;

use async_nats::jetstream::kv;
use bytes::Bytes;
use serde_json::Value;

use crate::error::ToolError;

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
    /// SHA-256 of the canonical arguments.
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

/// A business-key entry: which effect key owns this business key.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct BusinessKeyEntry {
    pub effect_key: String,
    pub tool: String,
    pub job_id: String,
    pub at: String,
}

pub(crate) fn now_rfc3339() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

/// The effects ledger over a KV bucket (created by `leasehold setup`).
#[derive(Clone)]
pub struct EffectsLedger {
    kv: kv::Store,
}

impl EffectsLedger {
    pub fn new(kv: kv::Store) -> Self {
        EffectsLedger { kv }
    }

    /// Opens the bucket `bucket`; a missing bucket is a configuration error
    /// that says to run `leasehold setup`.
    pub async fn open(
        js: &async_nats::jetstream::Context,
        bucket: &str,
    ) -> Result<Self, ToolError> {
        js.get_key_value(bucket).await.map(Self::new).map_err(|e| {
            ToolError::Config(format!(
                "effects bucket `{bucket}` is not available; run `leasehold setup` ({e})"
            ))
        })
    }

    /// The underlying store.
    pub fn store(&self) -> &kv::Store {
        &self.kv
    }

    /// The current entry of an effect key and its revision.
    pub async fn get(&self, key: &str) -> Result<Option<(LedgerEntry, u64)>, ToolError> {
        self.get_json(key).await
    }

    pub(crate) async fn get_bk(
        &self,
        key: &str,
    ) -> Result<Option<(BusinessKeyEntry, u64)>, ToolError> {
        self.get_json(key).await
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

    /// Creates `key` if it is absent; `Ok(None)` when someone else holds it.
    pub(crate) async fn create<T: serde::Serialize>(
        &self,
        key: &str,
        v: &T,
    ) -> Result<Option<u64>, ToolError> {
        let body = Bytes::from(serde_json::to_vec(v).expect("ledger value serializes"));
        match self.kv.create(key, body).await {
            Ok(rev) => Ok(Some(rev)),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(None),
            Err(e) => Err(ToolError::Ledger(format!("create {key}: {e}"))),
        }
    }

    /// Writes `key` if its revision is still `rev`; `Ok(None)` on a conflict.
    pub(crate) async fn update<T: serde::Serialize>(
        &self,
        key: &str,
        v: &T,
        rev: u64,
    ) -> Result<Option<u64>, ToolError> {
        let body = Bytes::from(serde_json::to_vec(v).expect("ledger value serializes"));
        let mut attempts = 0;
        loop {
            match self.kv.update(key, body.clone(), rev).await {
                Ok(new) => return Ok(Some(new)),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => return Ok(None),
                Err(e) => {
                    // Clusters sometimes reject a correct expected revision
                    // with 10164 ("in process"), surfacing as `Other`:
                    // re-read, and retry only if nothing changed.
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

    /// Deletes `key` if its revision is still `rev` (withdrawing an
    /// `in_flight` whose request certainly never left).
    pub(crate) async fn withdraw(&self, key: &str, rev: u64) -> Result<(), ToolError> {
        self.kv
            .delete_expect_revision(key, Some(rev))
            .await
            .map_err(|e| ToolError::Ledger(format!("withdraw {key}: {e}")))
    }
}
