//! A live view of every record (a KV watch of the job bucket, re-opened
//! whenever it breaks), so a fault knows which jobs it interrupts even
//! when they are younger than the index of active jobs (a job enters it
//! only after `--index-after`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::kv::Operation;
use futures::StreamExt;
use leasehold_core::JobRecord;
use leasehold_store::{jobs, Jobs};

use crate::chaos::Affected;

#[derive(Clone, Default)]
pub struct Tracker {
    recs: Arc<Mutex<HashMap<String, JobRecord>>>,
}

impl Tracker {
    /// Starts following every record (until the process ends).
    pub fn start(jobs: Jobs) -> Tracker {
        let t = Tracker::default();
        let recs = t.recs.clone();
        tokio::spawn(async move {
            loop {
                if let Ok(mut w) = jobs.kv().watch_with_history(">").await {
                    while let Some(Ok(e)) = w.next().await {
                        if e.operation != Operation::Put {
                            continue;
                        }
                        if let Ok(r) = jobs::decode(&e.key, &e.value) {
                            recs.lock().unwrap().insert(e.key.clone(), r);
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
        t
    }

    /// Jobs running now as far as the watch knows (on `worker`, if given).
    pub fn running(&self, worker: Option<&str>) -> Vec<Affected> {
        self.recs
            .lock()
            .unwrap()
            .values()
            .filter(|r| {
                r.status == "running" && worker.is_none_or(|w| r.worker_id.as_deref() == Some(w))
            })
            .map(|r| Affected {
                job: r.id.clone(),
                epoch: r.epoch,
            })
            .collect()
    }
}
