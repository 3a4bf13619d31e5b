//! Artifacts (`lh_artifacts`, an object store) written once: created if
//! absent, never overwritten.
//!
//! The object store's `put` is unconditional: two attempts of one job (a
//! paused owner and its successor) would each replace the other's document.
//! [`Artifacts::create`] uploads the chunks under a fresh id, then publishes
//! the object's meta message (`$O.<bucket>.M.<base64url(name)>`, which names
//! the chunks) only if that subject has no message yet
//! (`Nats-Expected-Last-Subject-Sequence: 0`), with the `Nats-Rollup: sub`
//! header the object store uses, so [`ObjectStore::get`] reads it as any
//! other object. When the meta already exists the stored object is the
//! artifact: this writer's chunks are purged and the stored one is returned
//! ([`Written::Existing`]) for the caller to adopt.

use std::collections::HashMap;

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::object_store::{ObjectInfo, ObjectOptions, ObjectStore};
use async_nats::jetstream::{self, stream};
use base64::engine::general_purpose::URL_SAFE;
use base64::Engine;
use sha2::{Digest, Sha256};

use crate::{server_error_code, Conn, StoreError, WRONG_LAST_SEQUENCE};

/// Chunk size of uploads (the object store's default).
const CHUNK: usize = 128 * 1024;

/// What to store besides the bytes.
#[derive(Debug, Clone, Default)]
pub struct NewArtifact {
    pub name: String,
    pub description: Option<String>,
    pub metadata: HashMap<String, String>,
}

/// The outcome of a create.
#[derive(Debug, Clone)]
pub enum Written {
    /// This call stored it.
    Created(ObjectInfo),
    /// Another writer stored an artifact under this name first; it stands.
    Existing(ObjectInfo),
}

/// The artifacts object store.
#[derive(Clone)]
pub struct Artifacts {
    js: jetstream::Context,
    bucket: String,
    store: ObjectStore,
}

impl Artifacts {
    pub async fn open(conn: &Conn) -> Result<Self, StoreError> {
        let bucket = conn.layout.artifacts_bucket();
        let store = conn
            .js
            .get_object_store(&bucket)
            .await
            .map_err(|e| crate::lookup_error(format!("object store {bucket}"), &e))?;
        Ok(Artifacts {
            js: conn.js.clone(),
            bucket,
            store,
        })
    }

    /// The object store, for reads.
    pub fn store(&self) -> &ObjectStore {
        &self.store
    }

    fn meta_subject(&self, name: &str) -> String {
        format!("$O.{}.M.{}", self.bucket, URL_SAFE.encode(name))
    }

    fn chunk_subject(&self, nuid: &str) -> String {
        format!("$O.{}.C.{nuid}", self.bucket)
    }

    /// Stores `data` under `a.name` unless an artifact of that name exists.
    pub async fn create(&self, a: NewArtifact, data: &[u8]) -> Result<Written, StoreError> {
        let nuid = uuid::Uuid::new_v4().simple().to_string();
        let chunks = self.chunk_subject(&nuid);
        let mut n = 0;
        for chunk in data.chunks(CHUNK) {
            let sent = match self
                .js
                .publish(chunks.clone(), bytes::Bytes::copy_from_slice(chunk))
                .await
            {
                Ok(ack) => ack.await.map(|_| ()),
                Err(e) => Err(e),
            };
            if let Err(e) = sent {
                self.purge_chunks(&nuid).await;
                return Err(StoreError::nats("artifact chunk", e));
            }
            n += 1;
        }
        let info = ObjectInfo {
            name: a.name.clone(),
            description: a.description,
            metadata: a.metadata,
            headers: None,
            options: Some(ObjectOptions {
                link: None,
                max_chunk_size: Some(CHUNK),
            }),
            bucket: self.bucket.clone(),
            nuid: nuid.clone(),
            size: data.len(),
            chunks: n,
            modified: Some(async_nats::datetime::now()),
            digest: Some(format!("SHA-256={}", URL_SAFE.encode(Sha256::digest(data)))),
            deleted: false,
        };
        let body = bytes::Bytes::from(serde_json::to_vec(&info).expect("object info serializes"));
        let subject = self.meta_subject(&a.name);
        // Conditioned on the meta subject being empty; a deleted object's
        // meta is replaced conditioned on its sequence.
        let mut expected = 0;
        for _ in 0..4 {
            let m = PublishMessage::build()
                .payload(body.clone())
                .header(async_nats::header::NATS_ROLLUP, "sub")
                .expected_last_subject_sequence(expected);
            let res = match self.js.send_publish(subject.clone(), m).await {
                Ok(f) => f.await.map(|_| ()),
                Err(e) => Err(e),
            };
            let refused = match &res {
                Ok(()) => return Ok(Written::Created(info)),
                Err(e) => {
                    e.kind() == PublishErrorKind::WrongLastSequence
                        || server_error_code(e) == Some(WRONG_LAST_SEQUENCE)
                }
            };
            // Refused, or no answer (the meta may or may not have landed):
            // the stored meta says which.
            match self.last_meta(&subject).await? {
                Some((_, cur)) if cur.nuid == nuid => return Ok(Written::Created(cur)),
                Some((seq, cur)) if cur.deleted => expected = seq,
                Some((_, cur)) => {
                    self.purge_chunks(&nuid).await;
                    return Ok(Written::Existing(cur));
                }
                None if refused => continue,
                None => {
                    // No answer and nothing stored yet: the meta may still
                    // land, so its chunks stay (at worst an orphan, never a
                    // meta naming purged chunks).
                    let e = res.expect_err("a failed publish");
                    return Err(StoreError::nats("artifact meta", e));
                }
            }
        }
        // The last try may still be on the way: its chunks stay.
        Err(StoreError::failed(format!(
            "artifact {}: its meta kept changing",
            a.name
        )))
    }

    /// Artifact `name` and its bytes, read with direct gets of its meta and
    /// its chunks, so no consumer is created: a user allowed only to read
    /// (a submitter may create no consumer at all) can fetch it. `None`
    /// when there is no such artifact; a wrong size or digest is an error.
    pub async fn read(&self, name: &str) -> Result<Option<(ObjectInfo, Vec<u8>)>, StoreError> {
        let Some((_, info)) = self.last_meta(&self.meta_subject(name)).await? else {
            return Ok(None);
        };
        if info.deleted {
            return Ok(None);
        }
        let s = self
            .js
            .get_stream_no_info(format!("OBJ_{}", self.bucket))
            .await
            .map_err(|e| StoreError::nats("artifacts stream", e))?;
        let subject = self.chunk_subject(&info.nuid);
        let mut data = Vec::with_capacity(info.size);
        let mut from = 1;
        for _ in 0..info.chunks {
            let m = s
                .direct_get_next_for_subject(&subject, Some(from))
                .await
                .map_err(|e| StoreError::nats(&format!("artifact {name}: chunk"), e))?;
            from = m.sequence + 1;
            data.extend_from_slice(&m.payload);
        }
        let digest = format!("SHA-256={}", URL_SAFE.encode(Sha256::digest(&data)));
        if data.len() != info.size || info.digest.as_ref().is_some_and(|d| *d != digest) {
            return Err(StoreError::failed(format!(
                "artifact {name}: read {} bytes ({digest}), its meta says {} ({:?})",
                data.len(),
                info.size,
                info.digest
            )));
        }
        Ok(Some((info, data)))
    }

    /// The last meta message of an object and its sequence.
    async fn last_meta(&self, subject: &str) -> Result<Option<(u64, ObjectInfo)>, StoreError> {
        let s = self
            .js
            .get_stream_no_info(format!("OBJ_{}", self.bucket))
            .await
            .map_err(|e| StoreError::nats("artifacts stream", e))?;
        match s.get_last_raw_message_by_subject(subject).await {
            Ok(m) => {
                let info: ObjectInfo = serde_json::from_slice(&m.payload)
                    .map_err(|e| StoreError::nats("artifact meta", e))?;
                Ok(Some((m.sequence, info)))
            }
            Err(e) if e.kind() == stream::LastRawMessageErrorKind::NoMessageFound => Ok(None),
            Err(e) => Err(StoreError::nats("artifact meta", e)),
        }
    }

    /// Removes this writer's chunks once no meta can name them: before its
    /// meta was sent, or after the meta subject moved past this writer's
    /// condition (so its meta, even if it is still on the way, is refused).
    /// Best effort: an orphan chunk costs space, never correctness.
    async fn purge_chunks(&self, nuid: &str) {
        let res = match self
            .js
            .get_stream_no_info(format!("OBJ_{}", self.bucket))
            .await
        {
            Ok(s) => s
                .purge()
                .filter(self.chunk_subject(nuid))
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = res {
            tracing::warn!(nuid, error = %e, "could not purge orphan artifact chunks");
        }
    }
}
