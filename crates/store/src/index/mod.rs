//! The index of active jobs (`lh_active`): what is not finished, so nothing
//! periodic or operator-facing ever lists the job records themselves.
//!
//! | key | a job that is |
//! |---|---|
//! | `run.<worker>.<job>` | running, owned by that worker (listed by owner for recovery) |
//! | `wait.<job>` | queued: backing off, handed back, re-offered |
//! | `park.<job>` | parked for a person |
//!
//! The record stays the authority; the index is kept beside it by the same
//! code paths and may be briefly behind: every reader that acts on an entry
//! reads the record first, and an entry whose record disagrees is repaired
//! ([`Active::sync`]). Entries are written *before* the record change that
//! depends on them when a crash between the two writes would otherwise hide
//! a job (a claim that is registered, a re-offer), and removed *after* the
//! record became terminal, so the index can hold a stale entry but never
//! miss an active job that needs recovering. A running job younger than the
//! worker's `--index-after` may not be indexed yet: its work ticket, still
//! held, covers it (see the worker's claim path).
//!
//! Removal is a purge whose marker carries a short TTL, so removed keys
//! vanish from the bucket instead of accumulating.

use std::time::{Duration, SystemTime};

pub mod view;

use async_nats::jetstream::{self, consumer, kv};
use leasehold_core::machine::status_of;
use leasehold_core::{JobRecord, Status};
use serde::{Deserialize, Serialize};

use crate::{Conn, Layout, StoreError};

/// How long the marker of a removed entry stays (then the key is gone).
const REMOVED_MARKER_TTL: Duration = Duration::from_secs(60);

/// How often a removal re-judges an entry that changed under it.
const REMOVE_TRIES: usize = 5;

/// What a remover knows of the job whose entry it removes.
#[derive(Debug, Clone, Copy)]
pub enum Remover<'a> {
    /// It read this record: it removes an entry of the same incarnation
    /// (the same `created_at`) at no later epoch, or one of an earlier
    /// incarnation; never a later incarnation's, whatever its epoch (a
    /// reused id starts again at epoch 1).
    Of(&'a JobRecord),
    /// It found no record, only the epoch it was asked about: an entry at
    /// no later epoch.
    Epoch(u64),
    /// Whatever is there.
    Anyone,
}

impl<'a> From<&'a JobRecord> for Remover<'a> {
    fn from(rec: &'a JobRecord) -> Self {
        Remover::Of(rec)
    }
}

/// Whether an entry (its stored bytes) may be removed by `by`. Bytes that
/// are no entry are removable (nothing can depend on them). Incarnations
/// are ordered by their `created_at`: two incarnations of one id are a
/// retention apart, so the clocks that wrote them never decide it.
fn removable(value: &[u8], by: Remover<'_>) -> bool {
    let Ok(e) = serde_json::from_slice::<Entry>(value) else {
        return true;
    };
    match by {
        Remover::Anyone => true,
        Remover::Epoch(epoch) => e.epoch <= epoch,
        Remover::Of(rec) if e.created_at == rec.created_at => e.epoch <= rec.epoch,
        Remover::Of(rec) => {
            let at = leasehold_core::time::parse_rfc3339;
            match (at(&e.created_at), at(&rec.created_at)) {
                (Some(entry), Some(known)) => entry < known,
                // An entry or record without a readable creation time:
                // kept, the sweep's repair reads the record again.
                _ => false,
            }
        }
    }
}

/// One index key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    Run {
        worker: String,
        job: String,
    },
    Wait {
        job: String,
    },
    Park {
        job: String,
    },
    /// A `waiting` job: held by nobody until what it waits for (a time)
    /// comes; its wake-up is the `due.<job>` key beside it.
    Hold {
        job: String,
    },
}

impl Key {
    pub fn as_string(&self) -> String {
        match self {
            Key::Run { worker, job } => format!("run.{worker}.{job}"),
            Key::Wait { job } => format!("wait.{job}"),
            Key::Park { job } => format!("park.{job}"),
            Key::Hold { job } => format!("hold.{job}"),
        }
    }

    /// Parses `run.<w>.<job>`, `wait.<job>`, `park.<job>`, `hold.<job>`.
    pub fn parse(s: &str) -> Option<Key> {
        let mut it = s.splitn(3, '.');
        match (it.next()?, it.next()?, it.next()) {
            ("run", worker, Some(job)) => Some(Key::Run {
                worker: worker.into(),
                job: job.into(),
            }),
            ("wait", job, None) => Some(Key::Wait { job: job.into() }),
            ("park", job, None) => Some(Key::Park { job: job.into() }),
            ("hold", job, None) => Some(Key::Hold { job: job.into() }),
            _ => None,
        }
    }

    pub fn job(&self) -> &str {
        match self {
            Key::Run { job, .. } | Key::Wait { job } | Key::Park { job } | Key::Hold { job } => job,
        }
    }

    /// The key a record should be indexed under (`None`: terminal, or unknown).
    pub fn of(rec: &JobRecord) -> Option<Key> {
        let job = rec.id.clone();
        match status_of(rec)? {
            Status::Running => Some(Key::Run {
                worker: rec.worker_id.clone().unwrap_or_default(),
                job,
            }),
            Status::Queued => Some(Key::Wait { job }),
            Status::Parked => Some(Key::Park { job }),
            Status::Waiting => Some(Key::Hold { job }),
            _ => None,
        }
    }
}

/// What an index entry says (a small summary of the record).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct Entry {
    pub job: String,
    pub kind: String,
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    pub epoch: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_run_at: Option<String>,
    /// A running job's attempt deadline (the record's `lease_expires_at`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parked_reason: Option<String>,
    pub ticket_seq: u64,
    pub created_at: String,
    pub updated_at: String,
}

impl Entry {
    pub fn of(rec: &JobRecord) -> Entry {
        Entry {
            job: rec.id.clone(),
            kind: rec.kind.clone(),
            status: rec.status.clone(),
            worker_id: rec.worker_id.clone(),
            session: rec.session.clone(),
            epoch: rec.epoch,
            next_run_at: rec.next_run_at.clone(),
            deadline: rec.lease_expires_at.clone(),
            parked_reason: rec.parked_reason.clone(),
            ticket_seq: rec.ticket_seq,
            created_at: rec.created_at.clone(),
            updated_at: rec.updated_at.clone(),
        }
    }
}

/// Which entries to list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter<'a> {
    All,
    Running,
    RunningBy(&'a str),
    Waiting,
    Parked,
    /// `waiting` jobs (held by nobody until their time).
    Held,
}

impl Filter<'_> {
    /// Whether `key` is one of these entries'.
    pub fn admits(&self, key: &Key) -> bool {
        crate::layout::subject_matches(&self.pattern(), &key.as_string())
    }

    /// The key pattern of these entries.
    fn pattern(&self) -> String {
        match self {
            Filter::All => ">".to_string(),
            Filter::Running => "run.>".to_string(),
            Filter::RunningBy(w) => format!("run.{w}.*"),
            Filter::Waiting => "wait.*".to_string(),
            Filter::Parked => "park.*".to_string(),
            Filter::Held => "hold.*".to_string(),
        }
    }
}

/// How far ahead of the server's clock the clock of a process creating a
/// job may be (the fleet's `--clock-skew` default): [`Active::newest`]
/// reads this much further back than the creation times it found.
pub const CREATED_SKEW: Duration = Duration::from_secs(2);

/// The index bucket.
#[derive(Clone)]
pub struct Active {
    js: jetstream::Context,
    /// Shared, not copied (a `kv::Store` carries its stream's whole info).
    kv: std::sync::Arc<kv::Store>,
    layout: Layout,
    /// Index writes lost with the bucket's leader are written again at its
    /// successor's election ([`crate::failover`]).
    elections: crate::failover::Elections,
}

impl Active {
    pub async fn open(conn: &Conn) -> Result<Self, StoreError> {
        let kv = crate::open_kv(conn, &conn.layout.active_bucket()).await?;
        Ok(Active {
            js: conn.js.clone(),
            kv: std::sync::Arc::new(kv),
            layout: conn.layout.clone(),
            elections: conn.elections(),
        })
    }

    pub fn kv(&self) -> &kv::Store {
        &self.kv
    }

    /// Writes the entry of `rec` under `key`.
    pub async fn put(&self, key: &Key, rec: &JobRecord) -> Result<(), StoreError> {
        let value: bytes::Bytes = serde_json::to_vec(&Entry::of(rec))
            .expect("entry serializes")
            .into();
        // The same value again: safe to write again at a leader's election.
        let put = || self.kv.put(key.as_string(), value.clone());
        self.elections
            .reissue("index put", put)
            .await
            .map(|_| ())
            .map_err(|e| StoreError::nats("index put", e))
    }

    /// The entry under `k` and its revision, as the bucket's stream leader
    /// has it (`None`: no entry, or a removal marker). A direct get may be
    /// answered by any replica, and one can hold an entry the leader
    /// removed: a node killed after the removal rebuilds its store and may
    /// bring a purged value back once the purge's marker expired
    /// (nats-server issue 8505). A removal judged on such a read is refused
    /// for the revision it names, again and again.
    async fn entry_from_leader(&self, k: &str) -> Result<Option<(u64, bytes::Bytes)>, StoreError> {
        crate::from_leader(&self.kv, k)
            .await
            .map_err(|e| StoreError::nats("index read", e))
    }

    /// Removes `key` (a purge whose marker soon expires) unless its entry
    /// describes a later claim or a later incarnation of the job than the
    /// remover knows ([`Remover`]): a remover that paused between reading
    /// the record and removing (a recoverer, a late owner, a same-id
    /// takeover, a finisher of a job whose id was forgotten and submitted
    /// again) never deletes a newer claim's entry. The purge is conditioned
    /// on the revision it judged, so an entry written meanwhile is judged
    /// again.
    pub async fn remove<'a>(
        &self,
        key: &Key,
        by: impl Into<Remover<'a>>,
    ) -> Result<(), StoreError> {
        let by = by.into();
        let epoch = match by {
            Remover::Of(rec) => rec.epoch,
            Remover::Epoch(e) => e,
            Remover::Anyone => u64::MAX,
        };
        let k = key.as_string();
        for _ in 0..REMOVE_TRIES {
            let Some((revision, value)) = self.entry_from_leader(&k).await? else {
                return Ok(());
            };
            if !removable(&value, by) {
                tracing::debug!(key = %k, epoch, "index entry is a later incarnation's; kept");
                return Ok(());
            }
            match self
                .kv
                .purge_expect_revision_with_ttl(k.clone(), revision, REMOVED_MARKER_TTL)
                .await
            {
                Ok(()) => return Ok(()),
                Err(err) if err.kind() == kv::PurgeErrorKind::WrongLastRevision => continue,
                Err(err) => return Err(StoreError::nats("index remove", err)),
            }
        }
        Err(StoreError::Unavailable(format!(
            "index entry {k} changed {REMOVE_TRIES} times while being removed"
        )))
    }

    /// Makes the index agree with `rec`: its key written (unless terminal),
    /// and `stale` (the key of the record's previous state, if known and
    /// different) removed.
    pub async fn sync(&self, rec: &JobRecord, stale: Option<&Key>) -> Result<(), StoreError> {
        let key = Key::of(rec);
        if let Some(k) = &key {
            self.put(k, rec).await?;
        }
        if let Some(old) = stale.filter(|o| Some(*o) != key.as_ref()) {
            self.remove(old, rec).await?;
        }
        Ok(())
    }

    /// Makes the index agree with `rec` when its previous key is not known
    /// (operators' commands): its key written, every other key of the job
    /// removed. Three small filtered reads; not for hot paths.
    pub async fn reconcile(&self, rec: &JobRecord) -> Result<(), StoreError> {
        let want = Key::of(rec);
        if let Some(k) = &want {
            self.put(k, rec).await?;
        }
        for k in self.keys_of(&rec.id).await? {
            if Some(&k) != want.as_ref() {
                self.remove(&k, rec).await?;
            }
        }
        Ok(())
    }

    /// Every key naming `job` (normally one; more after a crash between
    /// writes), in one read.
    pub async fn keys_of(&self, job: &str) -> Result<Vec<Key>, StoreError> {
        let patterns = [
            format!("run.*.{job}"),
            format!("wait.{job}"),
            format!("park.{job}"),
            format!("hold.{job}"),
        ];
        let patterns: Vec<&str> = patterns.iter().map(String::as_str).collect();
        Ok(self
            .scan_all(&patterns)
            .await?
            .into_iter()
            .map(|(k, _)| k)
            .collect())
    }

    /// The entries matching `filter`, sorted by key (job id within a status).
    pub async fn list(&self, filter: Filter<'_>) -> Result<Vec<(Key, Entry)>, StoreError> {
        let mut v = self.scan(&filter.pattern()).await?;
        v.sort_by(|a, b| a.1.job.cmp(&b.1.job).then(a.0.cmp(&b.0)));
        Ok(v)
    }

    /// The `n` newest entries matching `filter` and `keep`, newest created
    /// first (then by job id), as [`Active::list`] sorted that way would
    /// give them, without reading the whole index: the bucket is read from
    /// its end in windows growing four times each, and the read stops once
    /// every entry not read yet was written (so created, within
    /// [`CREATED_SKEW`]) before the `n`-th newest found. The cost is `n`
    /// plus the entries written since that job was created.
    pub async fn newest(
        &self,
        filter: Filter<'_>,
        n: usize,
        keep: impl Fn(&Entry) -> bool,
    ) -> Result<Vec<(Key, Entry)>, StoreError> {
        let bucket = self.layout.active_bucket();
        // One stream info request: the one `get_stream` makes.
        let stream = self
            .js
            .get_stream(format!("KV_{bucket}"))
            .await
            .map_err(|e| StoreError::nats("index stream", e))?;
        let state = stream.cached_info().state.clone();
        // No subject filter on the server: a filtered consumer's pending
        // count walks every subject the filter matches (each active job's),
        // where an unfiltered one is a subtraction. The window's other keys
        // are skipped here.
        let wanted = format!("$KV.{bucket}.{}", filter.pattern());
        let prefix = format!("$KV.{bucket}.");
        let mut window = (n as u64).saturating_mul(4).max(256);
        loop {
            let lo = state
                .last_sequence
                .saturating_sub(window)
                .max(state.first_sequence)
                .max(1);
            let msgs = crate::read::read_once(
                &stream,
                Vec::new(),
                consumer::DeliverPolicy::ByStartSequence { start_sequence: lo },
                "reading the newest index entries",
            )
            .await?;
            // Every entry not read was written before the first one read.
            let mut written_before = None;
            let mut found: Vec<(Key, Entry)> = Vec::new();
            for m in &msgs {
                if written_before.is_none() {
                    written_before = m.info().ok().map(|i| SystemTime::from(i.published));
                }
                if m.headers.as_ref().is_some_and(crate::is_removal)
                    || !crate::layout::subject_matches(&wanted, &m.subject)
                {
                    continue;
                }
                let Some(key) = m.subject.strip_prefix(&prefix).and_then(Key::parse) else {
                    continue;
                };
                if let Ok(e) = serde_json::from_slice::<Entry>(&m.payload) {
                    if keep(&e) {
                        found.push((key, e));
                    }
                }
            }
            found.sort_by(|a, b| {
                b.1.created_at
                    .cmp(&a.1.created_at)
                    .then(a.1.job.cmp(&b.1.job))
                    .then(a.0.cmp(&b.0))
            });
            found.dedup_by(|x, y| x.1.job == y.1.job);
            let whole = lo <= state.first_sequence.max(1);
            let nth = found
                .get(n.saturating_sub(1))
                .and_then(|(_, e)| leasehold_core::time::parse_rfc3339(&e.created_at));
            let enough = found.len() >= n
                && match (written_before, nth) {
                    (Some(before), Some(nth)) => before + CREATED_SKEW < nth,
                    _ => false,
                };
            tracing::debug!(
                read = msgs.len(),
                from = lo,
                whole,
                enough,
                written_before = ?written_before.map(leasehold_core::time::rfc3339),
                nth_created = ?nth.map(leasehold_core::time::rfc3339),
                "newest index entries"
            );
            if whole || enough {
                found.truncate(n);
                return Ok(found);
            }
            window = window.saturating_mul(4);
        }
    }

    /// The live entries under `pattern` (a key pattern with `*`/`>`).
    async fn scan(&self, pattern: &str) -> Result<Vec<(Key, Entry)>, StoreError> {
        self.scan_all(&[pattern]).await
    }

    /// The live entries under any of `patterns`, read once (the last
    /// message per key; [`crate::read::read_once`]).
    async fn scan_all(&self, patterns: &[&str]) -> Result<Vec<(Key, Entry)>, StoreError> {
        let bucket = self.layout.active_bucket();
        let stream = self
            .js
            .get_stream_no_info(format!("KV_{bucket}"))
            .await
            .map_err(|e| StoreError::nats("index stream", e))?;
        let filters = patterns
            .iter()
            .map(|p| format!("$KV.{bucket}.{p}"))
            .collect();
        let what = format!("scanning the index ({})", patterns.join(", "));
        let msgs = crate::read::read_once(
            &stream,
            filters,
            consumer::DeliverPolicy::LastPerSubject,
            &what,
        )
        .await?;
        let prefix = format!("$KV.{bucket}.");
        let mut out = Vec::new();
        for m in msgs {
            if m.headers.as_ref().is_some_and(crate::is_removal) {
                continue;
            }
            let Some(key) = m.subject.strip_prefix(&prefix).and_then(Key::parse) else {
                continue;
            };
            match serde_json::from_slice::<Entry>(&m.payload) {
                Ok(e) => out.push((key, e)),
                Err(e) => {
                    tracing::warn!(key = %key.as_string(), error = %e, "unreadable index entry; skipped")
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_follow_the_record() {
        for k in [
            Key::Run {
                worker: "w-1".into(),
                job: "j_2".into(),
            },
            Key::Wait { job: "j".into() },
            Key::Park { job: "j".into() },
            Key::Hold { job: "j".into() },
        ] {
            assert_eq!(Key::parse(&k.as_string()), Some(k));
        }
        assert_eq!(Key::parse("done.j"), None);
        let mut r = leasehold_core::machine::new_record(
            "j",
            "echo",
            Default::default(),
            1,
            std::time::SystemTime::now(),
        );
        assert_eq!(Key::of(&r), Some(Key::Wait { job: "j".into() }));
        r.status = "completed".into();
        assert_eq!(Key::of(&r), None);
    }

    #[test]
    fn a_filter_admits_the_keys_its_listing_reads() {
        let run = Key::Run {
            worker: "w-1".into(),
            job: "j".into(),
        };
        let wait = Key::Wait { job: "j".into() };
        assert!(Filter::All.admits(&run) && Filter::All.admits(&wait));
        assert!(Filter::Running.admits(&run) && !Filter::Running.admits(&wait));
        assert!(Filter::RunningBy("w-1").admits(&run));
        assert!(!Filter::RunningBy("w-2").admits(&run));
        assert!(Filter::Waiting.admits(&wait) && !Filter::Waiting.admits(&run));
        assert!(Filter::Parked.admits(&Key::Park { job: "j".into() }));
        assert!(Filter::Held.admits(&Key::Hold { job: "j".into() }));
        assert!(!Filter::Held.admits(&wait));
    }

    #[test]
    fn a_remover_never_removes_a_later_claim_or_a_later_incarnation() {
        let t0 = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        let at = |epoch: u64, created: std::time::SystemTime| {
            let mut r =
                leasehold_core::machine::new_record("j", "echo", Default::default(), 1, created);
            r.epoch = epoch;
            r
        };
        let bytes = |r: &JobRecord| serde_json::to_vec(&Entry::of(r)).unwrap();
        let old = at(5, t0);
        let reused = at(1, std::time::SystemTime::now());
        // Same incarnation: by epoch.
        assert!(removable(&bytes(&at(4, t0)), Remover::Of(&old)));
        assert!(removable(&bytes(&old), Remover::Of(&old)));
        assert!(!removable(&bytes(&at(6, t0)), Remover::Of(&old)));
        // A later incarnation at a lower epoch is kept; an earlier one goes.
        assert!(!removable(&bytes(&reused), Remover::Of(&old)));
        assert!(removable(&bytes(&old), Remover::Of(&reused)));
        assert!(removable(&bytes(&reused), Remover::Anyone));
        assert!(removable(b"not an entry", Remover::Of(&old)));
    }
}
