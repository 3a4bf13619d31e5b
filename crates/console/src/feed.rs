//! What the console follows for every page at once: each record change (a
//! KV watch of new writes only, never the bucket's current contents) and
//! the jobs that finished in the last hour (terminal events, read from one
//! hour ago and then live), kept in memory for the recent-jobs table and
//! the fleet's charts.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use leasehold_core::JobRecord;
use leasehold_store::events::Events;
use leasehold_store::{jobs, Jobs};
use tokio::sync::broadcast;

/// The outcomes the console counts as a job's end.
pub const TERMINAL: &[&str] = &["completed", "failed", "cancelled", "dead", "rejected"];

/// How long finished jobs are remembered, and how many at most.
pub const WINDOW: Duration = Duration::from_secs(3600);
const KEEP: usize = 20_000;

/// One job's end, as its terminal event says.
#[derive(Debug, Clone)]
pub struct Finished {
    pub id: String,
    pub kind: String,
    pub status: String,
    pub at: SystemTime,
    /// Submission to completion, for a sample of completed jobs (each
    /// needs its record's `created_at`: at most [`LATENCY_READS`] a second).
    pub latency: Option<Duration>,
}

/// Record reads a second for the latency sample.
const LATENCY_READS: u32 = 20;

pub struct Feed {
    pub records: broadcast::Sender<Arc<JobRecord>>,
    pub finished: Arc<Mutex<VecDeque<Finished>>>,
}

impl Feed {
    pub async fn start(jobs: &Jobs, events: &Events) -> anyhow::Result<Feed> {
        let (tx, _) = broadcast::channel(4096);
        let finished = Arc::new(Mutex::new(VecDeque::new()));
        let f = Feed {
            records: tx.clone(),
            finished: finished.clone(),
        };
        let f_jobs = jobs.clone();
        let jobs = jobs.clone();
        tokio::spawn(async move {
            loop {
                match jobs.watch_new().await {
                    Ok(mut w) => {
                        while let Some(e) = w.next().await {
                            let Ok(e) = e else { break };
                            if e.operation != async_nats::jetstream::kv::Operation::Put {
                                continue;
                            }
                            if let Ok(r) = jobs::decode(&e.key, &e.value) {
                                let _ = tx.send(Arc::new(r));
                            }
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "record watch failed; again in 1s"),
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        let events = events.clone();
        let jobs = f_jobs;
        tokio::spawn(async move {
            let mut last_seq = 0u64;
            let (mut second, mut reads) = (tokio::time::Instant::now(), 0u32);
            loop {
                let since = SystemTime::now() - WINDOW;
                match events.follow_types_since(TERMINAL, since).await {
                    Ok(mut s) => {
                        while let Some(x) = s.next().await {
                            let Ok((seq, ev)) = x else { break };
                            if seq <= last_seq {
                                continue;
                            }
                            last_seq = seq;
                            let data = ev.data_map();
                            let kind = data
                                .get("kind")
                                .and_then(|v| v.as_str())
                                .unwrap_or("")
                                .to_string();
                            let at = leasehold_core::time::parse_rfc3339(&ev.at)
                                .unwrap_or_else(SystemTime::now);
                            if second.elapsed() >= Duration::from_secs(1) {
                                (second, reads) = (tokio::time::Instant::now(), 0);
                            }
                            let mut latency = None;
                            if ev.r#type == "completed" && reads < LATENCY_READS {
                                reads += 1;
                                if let Ok(Some(v)) = jobs.get(&ev.job_id).await {
                                    latency =
                                        leasehold_core::time::parse_rfc3339(&v.value.created_at)
                                            .and_then(|c| at.duration_since(c).ok());
                                }
                            }
                            let mut q = finished.lock().expect("finished lock");
                            q.push_back(Finished {
                                id: ev.job_id.clone(),
                                kind,
                                status: ev.r#type.clone(),
                                at,
                                latency,
                            });
                            let horizon = SystemTime::now() - WINDOW;
                            while q.len() > KEEP || q.front().is_some_and(|f| f.at < horizon) {
                                q.pop_front();
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "terminal events feed failed; again in 1s")
                    }
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        Ok(f)
    }

    /// The jobs that finished in the last hour, newest first.
    pub fn recent(&self) -> Vec<Finished> {
        let q = self.finished.lock().expect("finished lock");
        let horizon = SystemTime::now() - WINDOW;
        q.iter()
            .rev()
            .filter(|f| f.at >= horizon)
            .cloned()
            .collect()
    }
}
