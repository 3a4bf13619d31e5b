//! The effects ledger's bucket (`lh_effects`) at the level the KV API does
//! not reach; the ledger's protocol itself lives in `leasehold-tools`.
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
