//! A live view of every record (a KV watch of the job bucket), so a fault
//! knows which jobs it interrupts even when they are younger than the
//! index of active jobs (a job enters it only after `--index-after`).
//!
//! A watch can go quiet without ending when a cluster node dies under it,
//! so after two seconds without news it is opened again from the revision
//! after the last one seen (cheap when nothing changed); and at a fault the
//! view's candidates are read again, so a stale view adds no job that no
//! longer runs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::kv::Operation;
use futures::StreamExt;
use leasehold_core::JobRecord;
use leasehold_store::{jobs, Jobs};

use crate::chaos::Affected;

#[derive(Clone)]
pub struct Tracker {
    jobs: Jobs,
    recs: Arc<Mutex<HashMap<String, JobRecord>>>,
}

impl Tracker {
    /// Starts following every record (until the process ends).
    pub fn start(jobs: Jobs) -> Tracker {
        let t = Tracker {
            jobs: jobs.clone(),
            recs: Arc::default(),
        };
        let recs = t.recs.clone();
        tokio::spawn(async move {
            let mut last = 0u64;
            loop {
                let w = if last == 0 {
                    jobs.kv().watch_with_history(">").await
                } else {
                    jobs.kv().watch_all_from_revision(last + 1).await
                };
                if let Ok(mut w) = w {
                    while let Ok(Some(Ok(e))) =
                        tokio::time::timeout(Duration::from_secs(2), w.next()).await
                    {
                        last = last.max(e.revision);
                        if e.operation != Operation::Put {
                            continue;
                        }
                        if let Ok(r) = jobs::decode(&e.key, &e.value) {
                            recs.lock().unwrap().insert(e.key.clone(), r);
                        }
                    }
                } else {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        });
        t
    }

    /// Whether the live view has `job` ended for good (a terminal status).
    pub fn ended(&self, job: &str) -> bool {
        self.recs.lock().unwrap().get(job).is_some_and(|r| {
            r.status
                .parse::<leasehold_core::Status>()
                .is_ok_and(|s| s.is_terminal())
        })
    }

    /// Jobs running now (on `worker`, if given): the view's candidates,
    /// each read again (bounded to a few seconds in all).
    pub async fn running(&self, worker: Option<&str>) -> Vec<Affected> {
        let running = |r: &JobRecord| {
            r.status == "running" && worker.is_none_or(|w| r.worker_id.as_deref() == Some(w))
        };
        let candidates: Vec<String> = self
            .recs
            .lock()
            .unwrap()
            .values()
            .filter(|r| running(r))
            .map(|r| r.id.clone())
            .collect();
        let reads = futures::stream::iter(candidates.into_iter().map(|id| async move {
            let fresh = tokio::time::timeout(Duration::from_secs(3), self.jobs.get(&id)).await;
            match fresh {
                Ok(Ok(Some(v))) => Some(v.value),
                _ => None,
            }
        }))
        .buffer_unordered(16)
        .collect::<Vec<_>>();
        let fresh = tokio::time::timeout(Duration::from_secs(4), reads)
            .await
            .unwrap_or_default();
        fresh
            .into_iter()
            .flatten()
            .filter(|r| running(r))
            .map(|r| Affected {
                job: r.id.clone(),
                epoch: r.epoch,
            })
            .collect()
    }
}
