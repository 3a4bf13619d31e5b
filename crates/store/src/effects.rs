//! The effects ledger's bucket (`lh_effects`) at the level the KV API does
//! not reach, its key scheme, and the purge of a finished job's entries
//! ([`purge_job`], the retention cleaner's); the ledger's protocol itself
//! (reserve, commit, reconcile) lives in `leasehold-tools`.
//!
//! - Keys of one job share a first token, the job id (`<job_id>.<key>`), so
//!   a job's entries are found and removed by a subject filter.
//! - Entries are written with `Nats-TTL: never`: the bucket's `max_age`
//!   (the retention) does not expire them. A job's entries go only when it
//!   is purged ([`purge_prefix`]), by the retention cleaner once the job is
//!   terminal, so a job parked for weeks or a dead letter replayed late
//!   still finds what its effects did. The bucket allows per-message TTLs
//!   (`allow_msg_ttl`, see `setup::effects_config`).

use async_nats::jetstream::{self, kv, message::PublishMessage};
use bytes::Bytes;
use sha2::{Digest, Sha256};

use crate::{server_error_code, StoreError};

/// The `Nats-TTL` value that exempts a message from the stream's `max_age`.
pub const TTL_NEVER: &str = "never";

/// A refused or failed pinned write.
#[derive(Debug, thiserror::Error)]
pub enum PinnedError {
    /// The key's last revision is not the expected one.
    #[error("the key is not at the expected revision")]
    WrongRevision,
    #[error("{0}")]
    Nats(String),
}

/// Server error: the stream does not allow per-message TTLs.
const MSG_TTL_DISABLED: u64 = 10166;

/// Whether `kv` accepts pinned writes (its stream allows per-message TTLs;
/// `leasehold setup` configures the effects bucket so).
pub fn allows_pinned(kv: &kv::Store) -> bool {
    kv.stream.cached_info().config.allow_message_ttl
}

/// The subject of `key` in `kv`.
fn subject(kv: &kv::Store, key: &str) -> String {
    format!("$KV.{}.{key}", kv.name)
}

/// Writes `key` with `Nats-TTL: never`, conditioned on the key's last
/// revision being `expected` (0: the key has no message at all).
pub async fn write_pinned(
    js: &jetstream::Context,
    kv: &kv::Store,
    key: &str,
    value: Bytes,
    expected: u64,
) -> Result<u64, PinnedError> {
    let m = PublishMessage::build()
        .payload(value)
        .header(async_nats::header::NATS_MESSAGE_TTL, TTL_NEVER)
        .expected_last_subject_sequence(expected);
    match crate::publish_acked(js, subject(kv, key), m).await {
        Ok(seq) => Ok(seq),
        Err(e) if crate::moved_on(&e) => Err(PinnedError::WrongRevision),
        Err(e) if server_error_code(&e) == Some(MSG_TTL_DISABLED) => {
            Err(PinnedError::Nats(format!(
            "write {key}: bucket {} does not allow per-message TTLs; run `leasehold setup` ({e})",
            kv.name
        )))
        }
        Err(e) => Err(PinnedError::Nats(format!("write {key}: {e}"))),
    }
}

async fn stream(
    js: &jetstream::Context,
    kv: &kv::Store,
) -> Result<jetstream::stream::Stream<()>, StoreError> {
    js.get_stream_no_info(format!("KV_{}", kv.name))
        .await
        .map_err(|e| StoreError::nats("effects stream", e))
}

/// The live entries under `<prefix>.`: `(key, value, revision)`, read with
/// one ordered consumer delivering the last message per key. Deleted and
/// purged keys are left out.
pub async fn scan_prefix(
    js: &jetstream::Context,
    kv: &kv::Store,
    prefix: &str,
) -> Result<Vec<(String, Bytes, u64)>, StoreError> {
    // Direct gets, one per message, never a consumer: the retention
    // removes hundreds of jobs a second, most with no entry at all, and a
    // consumer per job ran the server into its consumer limit (10026).
    let stream = stream(js, kv).await?;
    let filter = subject(kv, &format!("{prefix}.>"));
    let strip = subject(kv, "");
    let mut latest: std::collections::BTreeMap<String, (Bytes, u64, bool)> = Default::default();
    let mut from = 1;
    loop {
        let m = match stream
            .direct_get_next_for_subject(&filter, Some(from))
            .await
        {
            Ok(m) => m,
            Err(e) if e.kind() == jetstream::stream::DirectGetErrorKind::NotFound => break,
            Err(e) => return Err(StoreError::nats("effects scan", e)),
        };
        from = m.sequence + 1;
        let removed = crate::is_removal(&m.headers);
        if let Some(key) = m.subject.strip_prefix(strip.as_str()) {
            latest.insert(key.to_string(), (m.payload, m.sequence, removed));
        }
    }
    Ok(latest
        .into_iter()
        .filter(|(_, (_, _, removed))| !removed)
        .map(|(k, (v, rev, _))| (k, v, rev))
        .collect())
}

/// Removes every message of every key under `<prefix>.` (no markers are
/// left); returns how many messages went.
pub async fn purge_prefix(
    js: &jetstream::Context,
    kv: &kv::Store,
    prefix: &str,
) -> Result<u64, StoreError> {
    let r = stream(js, kv)
        .await?
        .purge()
        .filter(subject(kv, &format!("{prefix}.>")))
        .await
        .map_err(|e| StoreError::nats("purge effects", e))?;
    Ok(r.purged)
}

/// Opens the effects bucket `bucket`; a missing bucket, or one made by an
/// earlier `leasehold setup` whose entries would expire, is a
/// configuration error that says to run `leasehold setup`.
pub async fn open(js: &jetstream::Context, bucket: &str) -> Result<kv::Store, StoreError> {
    let kv = js.get_key_value(bucket).await.map_err(|e| {
        StoreError::Config(format!(
            "effects bucket `{bucket}` is not available; run `leasehold setup` ({e})"
        ))
    })?;
    if !allows_pinned(&kv) {
        return Err(StoreError::Config(format!(
            "effects bucket `{bucket}` does not allow per-message TTLs, so its entries would expire with its max age; run `leasehold setup` to upgrade it"
        )));
    }
    Ok(kv)
}

/// Where the ledger keeps the effect `key` of job `job_id`:
/// `<job_id>.<key>`, so every key of a job shares its first token.
pub fn ledger_key(job_id: &str, key: &str) -> String {
    format!("{job_id}.{key}")
}

/// The ledger key of a business key: `bk/<sha256(tool:business_key)>`.
/// Business keys are cross-job; no job id contains `/`, so no job's keys
/// (`<job_id>.…`) share this first token.
pub fn business_key_id(tool: &str, business_key: &str) -> String {
    let digest = Sha256::digest(format!("{tool}:{business_key}").as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("bk/{hex}")
}

/// A job id can prefix ledger keys when it is one subject token of
/// `[A-Za-z0-9_=-]` (what submissions accept).
pub fn check_job_id(job_id: &str) -> Result<(), String> {
    let ok = !job_id.is_empty()
        && job_id.len() <= 128
        && job_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '='));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "job id `{job_id}` cannot key the effects ledger: use 1 to 128 letters, digits, `-`, `_` or `=`"
        ))
    }
}

/// What [`purge_job`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Purged {
    /// Messages of the job's own keys.
    pub entries: u64,
    /// Business keys the job's effects owned.
    pub business_keys: u64,
}

/// The fields of a job's ledger entry the purge reads.
#[derive(serde::Deserialize)]
struct EntryOwns {
    tool: String,
    #[serde(default)]
    business_key: Option<String>,
}

/// The fields of a business key's entry the purge reads: which effect owns it.
#[derive(serde::Deserialize)]
struct BusinessKeyOwner {
    effect_key: String,
    job_id: String,
}

/// Removes every entry of job `job_id` and the business keys its effects
/// own. For the retention cleaner, and only for a job that is terminal:
/// a job that can still run would find no record of its effects and run
/// them again. Idempotent; business keys go first, so an interrupted
/// purge leaves nothing that a later one cannot find.
pub async fn purge_job(
    js: &jetstream::Context,
    kv: &kv::Store,
    job_id: &str,
) -> Result<Purged, StoreError> {
    check_job_id(job_id).map_err(StoreError::Config)?;
    let mut purged = Purged::default();
    for (key, value, _) in scan_prefix(js, kv, job_id).await? {
        let Ok(entry) = serde_json::from_slice::<EntryOwns>(&value) else {
            tracing::warn!(%key, "unreadable ledger entry; purged without its business key");
            continue;
        };
        let Some(bk) = entry.business_key.as_deref() else {
            continue;
        };
        let bk_id = business_key_id(&entry.tool, bk);
        let Some(found) = kv
            .entry(&bk_id)
            .await
            .map_err(|e| StoreError::nats("effects business key", e))?
        else {
            continue;
        };
        if found.operation != kv::Operation::Put {
            continue;
        }
        let owner = serde_json::from_slice::<BusinessKeyOwner>(&found.value)
            .map_err(|e| StoreError::nats(&format!("entry {bk_id} is not a ledger value"), e))?;
        // Only a business key this job's effect owns: another job's
        // (taken over, or its own effect of the same business key) stays.
        if owner.job_id != job_id || ledger_key(job_id, &owner.effect_key) != key {
            continue;
        }
        match kv
            .purge_expect_revision_with_ttl(&bk_id, found.revision, crate::retention::MARKER_TTL)
            .await
        {
            Ok(()) => purged.business_keys += 1,
            // Moved on meanwhile (taken over): no longer this job's.
            Err(e) if server_error_code(&e) == Some(crate::WRONG_LAST_SEQUENCE) => {}
            // Stop before the job's keys go, or this business key would
            // be left with nothing pointing at it.
            Err(e) => return Err(StoreError::nats("purge business key", e)),
        }
    }
    purged.entries = purge_prefix(js, kv, job_id).await?;
    Ok(purged)
}
