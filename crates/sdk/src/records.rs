//! What a kind reads and stores beyond its steps: its own event history
//! ([`EventLog`]), documents in the artifact store ([`ArtifactStore`]), and
//! the document its result points to ([`Report`]).

use std::collections::HashMap;

use leasehold_proto::{JobEvent, JobResult};
use leasehold_store::artifacts::{Artifacts, NewArtifact, Written};
use leasehold_store::events::Events;
use tokio::io::AsyncReadExt;

use crate::Error;

/// The job's own events (every epoch's), read by type: what a kind that
/// checkpoints itself ([`crate::Ctx::checkpoints`]) resumes from.
///
/// ```no_run
/// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
/// let log = ctx.events();
/// let done = log.read(&["section"]).await?;
/// tracing::info!(sections = done.len(), bytes = log.bytes_read(), "resuming");
/// # Ok(()) }
/// ```
pub struct EventLog {
    pub(crate) events: Events,
    pub(crate) job: String,
}

impl EventLog {
    /// Every event of these types, oldest first, with its stream sequence.
    ///
    /// ```no_run
    /// # async fn f(log: &leasehold::EventLog) -> Result<(), leasehold::Error> {
    /// for (seq, ev) in log.read(&["phase", "section"]).await? {
    ///     tracing::debug!(seq, epoch = ev.epoch, ty = %ev.r#type);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn read(&self, types: &[&str]) -> Result<Vec<(u64, JobEvent)>, Error> {
        self.events
            .read_types(&self.job, types)
            .await
            .map_err(|e| Error::retryable(format!("reading the job's events: {e}")))
    }

    /// The events of one type from stream sequence `from` on.
    ///
    /// ```no_run
    /// # async fn f(log: &leasehold::EventLog) -> Result<(), leasehold::Error> {
    /// let recent = log.read_from("journal", 1_000).await?;
    /// # Ok(()) }
    /// ```
    pub async fn read_from(&self, ty: &str, from: u64) -> Result<Vec<(u64, JobEvent)>, Error> {
        self.events
            .read_type_from(&self.job, ty, from)
            .await
            .map_err(|e| Error::retryable(format!("reading the job's {ty} events: {e}")))
    }

    /// Bytes of events this reader fetched so far.
    ///
    /// ```no_run
    /// # fn f(log: &leasehold::EventLog) { assert!(log.bytes_read() < 1 << 30); }
    /// ```
    pub fn bytes_read(&self) -> u64 {
        self.events.bytes_read()
    }
}

/// A document read back from the artifact store.
///
/// ```no_run
/// # async fn f(store: &leasehold::ArtifactStore) -> Result<(), leasehold::Error> {
/// if let Some(doc) = store.get("job-1/report.md").await? {
///     println!("{} bytes, made by {:?}", doc.bytes.len(), doc.metadata.get("made-by"));
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct StoredArtifact {
    /// Its name.
    pub name: String,
    /// Its content.
    pub bytes: Vec<u8>,
    /// The metadata it was stored with.
    pub metadata: HashMap<String, String>,
}

impl StoredArtifact {
    /// The content as text (lossy for bytes that are not UTF-8).
    ///
    /// ```
    /// let a = leasehold::StoredArtifact { name: "n".into(), bytes: b"# Title".to_vec(), metadata: Default::default() };
    /// assert_eq!(a.text(), "# Title");
    /// ```
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }
}

/// What to store: name, description and metadata of a new document.
pub use leasehold_store::artifacts::NewArtifact as NewDocument;

/// The fleet's artifact store (an object store), shared by every job: name
/// your documents under the job's id.
///
/// ```no_run
/// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
/// let store = ctx.artifacts().await?;
/// let name = format!("{}/summary.txt", ctx.id());
/// ctx.prove_owner().await?;
/// let created = store
///     .create(
///         leasehold::NewDocument { name: name.clone(), description: None, metadata: Default::default() },
///         b"all good",
///     )
///     .await?;
/// # Ok(()) }
/// ```
pub struct ArtifactStore(pub(crate) Artifacts);

impl ArtifactStore {
    /// The document `name`, if stored.
    ///
    /// ```no_run
    /// # async fn f(store: &leasehold::ArtifactStore) -> Result<(), leasehold::Error> {
    /// let missing = store.get("no-such/doc").await?.is_none();
    /// # Ok(()) }
    /// ```
    pub async fn get(&self, name: &str) -> Result<Option<StoredArtifact>, Error> {
        let fail = |e: &dyn std::fmt::Display| Error::retryable(format!("artifact {name}: {e}"));
        match self.0.store().get(name).await {
            Ok(mut obj) => {
                let mut bytes = Vec::new();
                obj.read_to_end(&mut bytes).await.map_err(|e| fail(&e))?;
                Ok(Some(StoredArtifact {
                    name: name.to_string(),
                    metadata: obj.info.metadata.clone(),
                    bytes,
                }))
            }
            Err(e) if e.kind() == async_nats::jetstream::object_store::GetErrorKind::NotFound => {
                Ok(None)
            }
            Err(e) => Err(fail(&e)),
        }
    }

    /// Removes the document `name` (nothing happens if there is none).
    ///
    /// ```no_run
    /// # async fn f(store: &leasehold::ArtifactStore) -> Result<(), leasehold::Error> {
    /// store.delete("job-1/draft.md").await?;
    /// # Ok(()) }
    /// ```
    pub async fn delete(&self, name: &str) -> Result<(), Error> {
        match self.0.store().delete(name).await {
            Ok(()) => Ok(()),
            Err(e)
                if e.kind() == async_nats::jetstream::object_store::DeleteErrorKind::NotFound =>
            {
                Ok(())
            }
            Err(e) => Err(Error::retryable(format!("deleting artifact {name}: {e}"))),
        }
    }

    /// Stores a document unless one of that name exists: `true` when this
    /// call stored it, `false` when another writer stored one first (it
    /// stands; read it with [`ArtifactStore::get`]). Two attempts racing
    /// never overwrite each other's document. Prove ownership right before
    /// ([`crate::Ctx::prove_owner`]) when the document is the job's result.
    ///
    /// ```no_run
    /// # async fn f(store: &leasehold::ArtifactStore) -> Result<(), leasehold::Error> {
    /// let doc = leasehold::NewDocument { name: "job-1/out.md".into(), description: None, metadata: Default::default() };
    /// if !store.create(doc, b"# Out").await? {
    ///     tracing::info!("another attempt stored it first");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn create(&self, doc: NewArtifact, bytes: &[u8]) -> Result<bool, Error> {
        let name = doc.name.clone();
        match self.0.create(doc, bytes).await {
            Ok(Written::Created(_)) => Ok(true),
            Ok(Written::Existing(info)) => {
                tracing::debug!(artifact = %name, nuid = %info.nuid, "artifact already stored");
                Ok(false)
            }
            Err(e) => Err(Error::retryable(format!("storing artifact {name}: {e}"))),
        }
    }
}

/// The document a job's result points to (the record's `result.artifact`,
/// `digest`, `partial` and `skipped_sections`, which `leasehold result`
/// reads). Set with [`crate::Ctx::set_report`]; a cancelled or
/// budget-exhausted attempt that set one keeps it as the partial result.
///
/// ```
/// let r = leasehold::Report {
///     artifact: "job-1/report.md".into(),
///     digest: "ab12".into(),
///     partial: false,
///     skipped_sections: vec![],
/// };
/// assert!(!r.partial);
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// Its name in the artifact store.
    pub artifact: String,
    /// The SHA-256 of its content (hex).
    pub digest: String,
    /// Whether parts of it are missing.
    pub partial: bool,
    /// What is missing, in words.
    pub skipped_sections: Vec<String>,
}

impl Report {
    /// The result fields, with this output.
    pub(crate) fn into_result(self, output: String) -> JobResult {
        JobResult {
            output,
            artifact: Some(self.artifact),
            digest: Some(self.digest),
            partial: self.partial,
            skipped_sections: self.skipped_sections,
        }
    }
}
