//! Reading what the system left behind, from outside: every record, every
//! revision of every record (from the soak's audit mirror of the records'
//! stream), every event, every effect at the sink, the index of active
//! jobs, sessions and tickets, and the processes' logs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt;
use leasehold_core::JobRecord;
use leasehold_proto::JobEvent;
use leasehold_store::index::{Active, Entry, Filter, Key};
use leasehold_store::sessions::{Current, Runs, Sessions};
use leasehold_store::work::Work;
use leasehold_store::{jobs, Conn, Jobs};
use serde::Serialize;
use serde_json::Value;

/// The soak's copy of every record revision: a mirror of the job bucket's
/// stream, which keeps only the last 64 revisions of a key itself.
pub const AUDIT_STREAM: &str = "SOAK_AUDIT_JOBS";

/// Creates the audit mirror (before anything is submitted).
pub async fn create_audit(conn: &Conn, replicas: usize) -> anyhow::Result<()> {
    conn.js
        .create_stream(stream::Config {
            name: AUDIT_STREAM.into(),
            description: Some(
                "leasehold-soak: every revision of every job record, for the stale-write check"
                    .into(),
            ),
            mirror: Some(stream::Source {
                name: format!("KV_{}", conn.layout.jobs_bucket()),
                ..Default::default()
            }),
            storage: stream::StorageType::File,
            num_replicas: replicas,
            ..Default::default()
        })
        .await
        .map_err(|e| anyhow::anyhow!("creating the audit mirror: {e}"))?;
    Ok(())
}

/// One revision of a record.
#[derive(Debug, Clone)]
pub struct Rev {
    pub seq: u64,
    /// `None`: a delete or purge of the key.
    pub rec: Option<JobRecord>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct AuditState {
    pub messages: u64,
    pub first_seq: u64,
    pub last_seq: u64,
    pub num_deleted: u64,
    pub origin_last_seq: u64,
    /// Every revision the bucket ever held is in the mirror.
    pub complete: bool,
}

#[derive(Default)]
pub struct Collected {
    pub records: BTreeMap<String, Option<JobRecord>>,
    /// The records of the children a completed `fanout` parent lists.
    pub children: BTreeMap<String, Option<JobRecord>>,
    pub audit: BTreeMap<String, Vec<Rev>>,
    pub audit_state: AuditState,
    pub events: BTreeMap<String, Vec<(u64, JobEvent)>>,
    pub effects: Vec<Value>,
    pub index: Vec<(Key, Entry)>,
    /// Session key state per worker id (for every id a record names).
    pub sessions: BTreeMap<String, Current>,
    /// For a job left `running` under a live session: whether that process
    /// says it runs the job at the record's epoch.
    pub owner_runs: BTreeMap<String, Runs>,
    /// Whether the ticket at each sequence asked about is still in the stream.
    pub tickets: BTreeMap<u64, bool>,
    /// Records whose get (any replica) disagreed with the last audited revision.
    pub stale_reads: u64,
    /// `spurious 10164` lines per log file.
    pub spurious_10164: BTreeMap<String, u64>,
}

/// A stream message read back.
pub struct Raw {
    pub seq: u64,
    pub subject: String,
    pub headers: Option<async_nats::HeaderMap>,
    pub payload: bytes::Bytes,
}

/// Every message of `stream` matching `filter`, in order.
pub async fn read_stream(
    js: &jetstream::Context,
    stream: &str,
    filter: &str,
) -> anyhow::Result<Vec<Raw>> {
    let s = js
        .get_stream_no_info(stream)
        .await
        .map_err(|e| anyhow::anyhow!("stream {stream}: {e}"))?;
    let c = s
        .create_consumer(consumer::pull::OrderedConfig {
            filter_subject: filter.to_string(),
            deliver_policy: consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .map_err(|e| anyhow::anyhow!("reading {stream}: {e}"))?;
    let mut pending = c.cached_info().num_pending;
    let mut out = Vec::new();
    if pending == 0 {
        return Ok(out);
    }
    let mut msgs = c
        .messages()
        .await
        .map_err(|e| anyhow::anyhow!("reading {stream}: {e}"))?;
    while pending > 0 {
        let m = match tokio::time::timeout(Duration::from_secs(20), msgs.next()).await {
            Ok(Some(Ok(m))) => m,
            Ok(Some(Err(e))) => anyhow::bail!("reading {stream}: {e}"),
            _ => anyhow::bail!("reading {stream} stalled with {pending} messages to go"),
        };
        let info = m.info().map_err(|e| anyhow::anyhow!("message info: {e}"))?;
        pending = info.pending;
        out.push(Raw {
            seq: info.stream_sequence,
            subject: m.subject.to_string(),
            headers: m.headers.clone(),
            payload: m.payload.clone(),
        });
    }
    Ok(out)
}

async fn stream_state(conn: &Conn, stream: &str) -> anyhow::Result<Value> {
    Ok(crate::chaos::stream_info(conn, stream).await?["state"].clone())
}

/// Retries a read a few times (a leader election may be in progress).
async fn retry<T, F, Fut>(what: &str, mut f: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let mut last = None;
    let mut backoff =
        leasehold_core::retry::Backoff::new(Duration::from_millis(250), Duration::from_secs(4));
    for _ in 0..8u32 {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) => {
                last = Some(e);
                tokio::time::sleep(backoff.pause()).await;
            }
        }
    }
    Err(anyhow::anyhow!("{what}: {}", last.expect("an error")))
}

pub async fn collect(
    conn: &Conn,
    jobs_bucket: &Jobs,
    ids: &[(String, u64)],
    sim_url: &str,
    logs: &Path,
) -> anyhow::Result<Collected> {
    let mut c = Collected::default();
    let jb = conn.layout.jobs_bucket();

    // Records.
    let got: Vec<(String, anyhow::Result<Option<JobRecord>>)> =
        futures::stream::iter(ids.iter().map(|(id, _)| async move {
            let r = retry(&format!("record {id}"), || async {
                Ok(jobs_bucket
                    .get(id)
                    .await
                    .map_err(|e| anyhow::anyhow!("{e}"))?
                    .map(|v| v.value))
            })
            .await;
            (id.clone(), r)
        }))
        .buffer_unordered(32)
        .collect()
        .await;
    for (id, r) in got {
        c.records.insert(id, r?);
    }
    let mut kids: Vec<String> = c
        .records
        .values()
        .flatten()
        .filter(|r| r.kind == "fanout" && r.status == "completed")
        .filter_map(|r| serde_json::from_str::<serde_json::Value>(&r.result.as_ref()?.output).ok())
        .flat_map(|out| {
            out["children"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c.as_str().map(String::from))
                .collect::<Vec<_>>()
        })
        .collect();
    // A research job's expert jobs: their ids follow from its record.
    kids.extend(
        c.records
            .values()
            .flatten()
            .flat_map(crate::check::expert_job_ids),
    );
    let got: Vec<(String, anyhow::Result<Option<JobRecord>>)> =
        futures::stream::iter(kids.into_iter().map(|id| async move {
            let r = retry(&format!("child {id}"), || async {
                Ok(jobs_bucket
                    .get(&id)
                    .await
                    .map_err(|e| anyhow::anyhow!("{e}"))?
                    .map(|v| v.value))
            })
            .await;
            (id, r)
        }))
        .buffer_unordered(32)
        .collect()
        .await;
    for (id, r) in got {
        c.children.insert(id, r?);
    }

    // Every revision, once the mirror has caught up with the bucket.
    let origin = format!("KV_{jb}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let o = retry("bucket state", || stream_state(conn, &origin)).await?;
        let m = retry("audit state", || stream_state(conn, AUDIT_STREAM)).await?;
        let (ol, ml) = (
            o["last_seq"].as_u64().unwrap_or(0),
            m["last_seq"].as_u64().unwrap_or(0),
        );
        if ml >= ol || tokio::time::Instant::now() > deadline {
            c.audit_state = AuditState {
                messages: m["messages"].as_u64().unwrap_or(0),
                first_seq: m["first_seq"].as_u64().unwrap_or(0),
                last_seq: ml,
                num_deleted: m["num_deleted"].as_u64().unwrap_or(0),
                origin_last_seq: ol,
                complete: ml >= ol
                    && m["first_seq"].as_u64() == Some(1)
                    && m["num_deleted"].as_u64().unwrap_or(0) == 0,
            };
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let prefix = format!("$KV.{jb}.");
    let raws = retry("audit", || read_stream(&conn.js, AUDIT_STREAM, ">")).await?;
    for m in raws {
        let Some(id) = m.subject.strip_prefix(&prefix) else {
            continue;
        };
        let removed = m
            .headers
            .as_ref()
            .is_some_and(|h| h.get("KV-Operation").is_some());
        let rec = if removed {
            None
        } else {
            jobs::decode(id, &m.payload).ok()
        };
        c.audit
            .entry(id.to_string())
            .or_default()
            .push(Rev { seq: m.seq, rec });
    }

    // The record as the last revision the stream's leader served (a get
    // may be answered by a replica that is behind); a get that disagrees
    // is counted, not trusted.
    let caught_up = c.audit_state.last_seq >= c.audit_state.origin_last_seq;
    for (id, revs) in c.audit.iter().filter(|_| caught_up) {
        let Some(last) = revs.last() else { continue };
        if let Some(slot) = c.records.get_mut(id) {
            // A get reads a large input or output back from beside the
            // record; the stream's revision holds the record without it.
            let stored = slot.as_ref().map(|r| {
                let mut r = r.clone();
                if r.input_beside {
                    if let Some(s) = r.spec.as_mut() {
                        s.input.clear();
                    }
                }
                if r.output_beside {
                    if let Some(res) = r.result.as_mut() {
                        res.output.clear();
                    }
                }
                r
            });
            if stored.as_ref() != last.rec.as_ref() {
                c.stale_reads += 1;
                *slot = last.rec.clone();
            }
        }
    }

    // Events.
    let es = conn.layout.events_stream();
    let ew = conn.layout.events_wildcard();
    let raws = retry("events", || read_stream(&conn.js, &es, &ew)).await?;
    for m in raws {
        let Some(job) = m.subject.split('.').nth(2) else {
            continue;
        };
        if let Ok(ev) = serde_json::from_slice::<JobEvent>(&m.payload) {
            c.events
                .entry(job.to_string())
                .or_default()
                .push((m.seq, ev));
        }
    }

    // The sink.
    c.effects = reqwest::get(format!("{sim_url}/effects"))
        .await?
        .json::<Value>()
        .await?
        .as_array()
        .cloned()
        .unwrap_or_default();

    // The index, sessions and tickets of what is not finished.
    let idx = Active::open(conn).await?;
    c.index = retry("index", || async {
        idx.list(Filter::All)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))
    })
    .await?;
    let sessions = Sessions::open(conn).await?;
    let work = Work::new(conn);
    let mut workers = BTreeSet::new();
    let mut seqs = BTreeSet::new();
    for (id, seq) in ids {
        match c.records.get(id).and_then(|r| r.as_ref()) {
            Some(r) => {
                if !settled(r) {
                    if let Some(w) = &r.worker_id {
                        workers.insert(w.clone());
                    }
                    seqs.insert(r.ticket_seq);
                }
            }
            None => {
                seqs.insert(*seq);
            }
        }
    }
    for w in workers {
        let cur = retry("session", || async {
            sessions
                .current(&w)
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))
        })
        .await?;
        c.sessions.insert(w, cur);
    }
    for (id, _) in ids {
        let Some(r) = c.records.get(id).and_then(|r| r.as_ref()) else {
            continue;
        };
        let live = r.worker_id.as_ref().and_then(|w| c.sessions.get(w)).is_some_and(|s| {
            matches!(s, Current::Live { info, .. } if Some(info.session.as_str()) == r.session.as_deref())
        });
        if r.status == "running" && live {
            let w = r.worker_id.clone().unwrap_or_default();
            let runs = sessions.runs(&w, id, r.epoch, Duration::from_secs(2)).await;
            c.owner_runs.insert(id.clone(), runs);
        }
    }
    for s in seqs.into_iter().filter(|s| *s > 0) {
        let present = retry("ticket", || async {
            work.get(s).await.map_err(|e| anyhow::anyhow!("{e}"))
        })
        .await?
        .is_some();
        c.tickets.insert(s, present);
    }

    // Spurious 10164s the store retried (logged at debug by every worker
    // and reaper, which the soak runs with leasehold_store=debug).
    for e in std::fs::read_dir(logs)?.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if !(name.starts_with("worker") || name.starts_with("reaper")) {
            continue;
        }
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        let n = text.matches("spurious 10164").count() as u64;
        if n > 0 {
            c.spurious_10164.insert(name, n);
        }
    }
    Ok(c)
}

/// Terminal, or parked (waiting for a person, which is a settled state).
pub fn settled(r: &JobRecord) -> bool {
    r.status
        .parse::<leasehold_core::Status>()
        .is_ok_and(|s| s.is_terminal() || s == leasehold_core::Status::Parked)
}
