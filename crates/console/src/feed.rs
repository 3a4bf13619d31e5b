//! What the console follows for every page at once: each record change (a
//! KV watch of new writes only, never the bucket's current contents) and
//! the jobs that finished in the last hour (terminal events, read from one
//! hour ago and then live), kept in memory for the recent-jobs table.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use leasehold_core::JobRecord;
use leasehold_store::events::Events;
use leasehold_store::index::{Active, Entry, Key};
use leasehold_store::{jobs, Jobs};
use tokio::sync::broadcast;

use crate::cache::RecordCache;
use crate::metrics::ConsoleMetrics;

/// The cache's size in the metrics.
fn gauges(m: &ConsoleMetrics, c: &RecordCache) {
    m.cache_bytes.set(c.bytes() as i64);
    m.cache_records.set(c.records() as i64);
    let evicted = c.evicted();
    let counted = m.cache_evictions.get();
    if evicted > counted {
        m.cache_evictions.inc_by(evicted - counted);
    }
}

/// What the fleet view counts of the index.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Counts {
    /// Running jobs per worker.
    pub in_flight: BTreeMap<String, usize>,
    /// Entries per kind, then per status.
    pub by_kind: BTreeMap<String, BTreeMap<String, u64>>,
}

/// Counts `entries` (the index's).
pub fn count<'a>(entries: impl Iterator<Item = &'a Entry>) -> Counts {
    let mut c = Counts::default();
    for e in entries {
        if e.status == "running" {
            if let Some(w) = &e.worker_id {
                *c.in_flight.entry(w.clone()).or_default() += 1;
            }
        }
        *c.by_kind
            .entry(e.kind.clone())
            .or_default()
            .entry(e.status.clone())
            .or_default() += 1;
    }
    c
}

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
}

/// The index of active jobs as the watch has it, kept in the order pages
/// show it (newest job first), so a page reads only the entries it shows:
/// no copy, filter or sort of the whole index per request.
#[derive(Debug, Default)]
pub struct IndexView {
    /// Key -> its place in `order`.
    places: HashMap<String, (Reverse<String>, String, String)>,
    /// (created_at newest first, job, key) -> entry.
    order: BTreeMap<(Reverse<String>, String, String), Entry>,
    /// Distinct jobs -> how many keys each has (a job may have two while
    /// it moves from waiting to running).
    jobs: HashMap<String, u32>,
    /// What [`count`] would count of `order`, kept as entries come and
    /// go: the fleet's charts read it every sample without a pass over
    /// the index.
    tally: Counts,
}

/// Adds (`up`) or takes away one entry's share of `c`; a count that
/// reaches zero goes, so the maps hold only kinds and workers there are.
fn tally(c: &mut Counts, e: &Entry, up: bool) {
    fn step(m: &mut BTreeMap<String, u64>, k: &str, up: bool) {
        if up {
            *m.entry(k.to_string()).or_default() += 1;
        } else if let Some(n) = m.get_mut(k) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(k);
            }
        }
    }
    if e.status == "running" {
        if let Some(w) = &e.worker_id {
            if up {
                *c.in_flight.entry(w.clone()).or_default() += 1;
            } else if let Some(n) = c.in_flight.get_mut(w) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    c.in_flight.remove(w);
                }
            }
        }
    }
    let kind = c.by_kind.entry(e.kind.clone()).or_default();
    step(kind, &e.status, up);
    if kind.is_empty() {
        c.by_kind.remove(&e.kind);
    }
}

impl IndexView {
    pub fn insert(&mut self, key: String, e: Entry) {
        self.remove(&key);
        let place = (Reverse(e.created_at.clone()), e.job.clone(), key.clone());
        *self.jobs.entry(e.job.clone()).or_insert(0) += 1;
        tally(&mut self.tally, &e, true);
        self.order.insert(place.clone(), e);
        self.places.insert(key, place);
    }

    pub fn remove(&mut self, key: &str) {
        let Some(place) = self.places.remove(key) else {
            return;
        };
        if let Some(e) = self.order.remove(&place) {
            tally(&mut self.tally, &e, false);
        }
        if let Some(n) = self.jobs.get_mut(&place.1) {
            *n -= 1;
            if *n == 0 {
                self.jobs.remove(&place.1);
            }
        }
    }

    /// How many keys.
    pub fn keys(&self) -> usize {
        self.places.len()
    }

    /// Every entry, newest job first.
    pub fn values(&self) -> impl Iterator<Item = &Entry> {
        self.order.values()
    }

    /// What [`count`] counts of the entries, without a pass over them.
    pub fn counts(&self) -> Counts {
        self.tally.clone()
    }
}

pub struct Feed {
    pub records: broadcast::Sender<Arc<JobRecord>>,
    pub finished: Arc<Mutex<VecDeque<Finished>>>,
    /// The index of active jobs as its KV watch has it (key -> entry);
    /// `None` until the watch delivered the current entries.
    pub index: Arc<std::sync::RwLock<Option<IndexView>>>,
    /// Records of active jobs (and of finished ones read for a page), kept
    /// current by the record watch, bounded by bytes and count.
    pub cache: Arc<Mutex<RecordCache>>,
    metrics: ConsoleMetrics,
}

impl Feed {
    pub async fn start(
        jobs: &Jobs,
        events: &Events,
        active: &Active,
        cache: RecordCache,
        metrics: ConsoleMetrics,
    ) -> anyhow::Result<Feed> {
        let (tx, _) = broadcast::channel(4096);
        let finished = Arc::new(Mutex::new(VecDeque::new()));
        let index: Arc<std::sync::RwLock<Option<IndexView>>> = Default::default();
        let cache = Arc::new(Mutex::new(cache));
        let f = Feed {
            records: tx.clone(),
            finished: finished.clone(),
            index: index.clone(),
            cache: cache.clone(),
            metrics: metrics.clone(),
        };
        tokio::spawn(follow_index(active.kv().clone(), index.clone()));
        tokio::spawn(follow_records(
            jobs.clone(),
            cache.clone(),
            metrics.clone(),
            tx,
        ));
        tokio::spawn(follow_finished(events.clone(), finished.clone()));
        Ok(f)
    }

    /// The index's entries (as `Active::list(Filter::All)` returns them),
    /// when the watch has them.
    pub fn entries(&self) -> Option<Vec<Entry>> {
        let g = self.index.read().expect("index lock");
        g.as_ref().map(|m| m.values().cloned().collect())
    }

    /// One page of the index's entries that `keep` admits, newest first
    /// (one per job), and how many there are; only the page is copied.
    /// `unfiltered` (`keep` admits every entry) stops at the page's end: the
    /// count is the index's own.
    pub fn page(
        &self,
        keep: impl Fn(&Entry) -> bool,
        unfiltered: bool,
        offset: usize,
        limit: usize,
    ) -> Option<(Vec<Entry>, usize)> {
        let g = self.index.read().expect("index lock");
        let m = g.as_ref()?;
        let mut out = Vec::with_capacity(limit.min(m.keys()));
        let (mut n, mut last): (usize, Option<&str>) = (0, None);
        for ((_, job, _), e) in &m.order {
            // A job's keys are next to each other (same created_at and job).
            if last == Some(job.as_str()) || !keep(e) {
                continue;
            }
            last = Some(job.as_str());
            if n >= offset && out.len() < limit {
                out.push(e.clone());
            }
            n += 1;
            if unfiltered && out.len() == limit {
                return Some((out, m.jobs.len()));
            }
        }
        Some((out, n))
    }

    /// The ids of the jobs that finished in the last hour and `keep`
    /// admits, newest first, at most `max`.
    pub fn recent_ids(&self, keep: impl Fn(&Finished) -> bool, max: usize) -> Vec<String> {
        let q = self.finished.lock().expect("finished lock");
        let horizon = SystemTime::now() - WINDOW;
        let mut seen = std::collections::HashSet::new();
        q.iter()
            .rev()
            .filter(|f| f.at >= horizon && keep(f))
            .filter(|f| seen.insert(f.id.as_str()))
            .take(max)
            .map(|f| f.id.clone())
            .collect()
    }

    /// A record from the cache, or read and cached.
    pub async fn record(
        &self,
        jobs: &Jobs,
        id: &str,
    ) -> Result<Option<Arc<JobRecord>>, leasehold_store::JobsError> {
        if let Some(r) = self.cache.lock().expect("cache lock").get(id) {
            return Ok(Some(r));
        }
        let Some(v) = jobs.get(id).await? else {
            return Ok(None);
        };
        let bytes = serde_json::to_vec(&v.value).map_or(0, |b| b.len());
        let r = Arc::new(v.value);
        let mut c = self.cache.lock().expect("cache lock");
        c.put(r.clone(), v.revision, bytes);
        gauges(&self.metrics, &c);
        Ok(Some(r))
    }

    /// Jobs running per worker and entries per kind and status, as the
    /// index view keeps them (no pass over the index), when the watch has it.
    pub fn counts(&self) -> Option<Counts> {
        let g = self.index.read().expect("index lock");
        Some(g.as_ref()?.counts())
    }
}

/// Keeps `idx` the index of active jobs as its KV watch has it (`None`
/// while the watch is down: pages read the index itself then).
async fn follow_index(
    kv: async_nats::jetstream::kv::Store,
    idx: Arc<std::sync::RwLock<Option<IndexView>>>,
) {
    loop {
        // An empty bucket delivers nothing to wait for.
        let empty = match kv.status().await {
            Ok(st) => st.values() == 0,
            Err(_) => false,
        };
        if empty {
            *idx.write().expect("index lock") = Some(IndexView::default());
        }
        match kv.watch_with_history(">").await {
            Ok(mut w) => {
                let mut map = IndexView::default();
                let mut live = empty;
                while let Some(e) = w.next().await {
                    let Ok(e) = e else { break };
                    if Key::parse(&e.key).is_none() {
                        if !live && e.delta == 0 {
                            *idx.write().expect("index lock") = Some(std::mem::take(&mut map));
                            live = true;
                        }
                        continue;
                    }
                    let put = e.operation == async_nats::jetstream::kv::Operation::Put;
                    let entry = put
                        .then(|| serde_json::from_slice::<Entry>(&e.value).ok())
                        .flatten();
                    if live {
                        let mut g = idx.write().expect("index lock");
                        let m = g.get_or_insert_with(IndexView::default);
                        match entry {
                            Some(en) => m.insert(e.key.clone(), en),
                            None => m.remove(&e.key),
                        };
                    } else {
                        match entry {
                            Some(en) => map.insert(e.key.clone(), en),
                            None => map.remove(&e.key),
                        };
                        if e.delta == 0 {
                            *idx.write().expect("index lock") = Some(std::mem::take(&mut map));
                            live = true;
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "index watch failed; again in 1s"),
        }
        // Until the watch is back, pages read the index itself.
        *idx.write().expect("index lock") = None;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Keeps the cache's records current from the record watch and sends
/// each record written to the page streams.
async fn follow_records(
    jobs: Jobs,
    cache2: Arc<Mutex<RecordCache>>,
    metrics: ConsoleMetrics,
    tx: broadcast::Sender<Arc<JobRecord>>,
) {
    loop {
        match jobs.watch_new().await {
            Ok(mut w) => {
                while let Some(e) = w.next().await {
                    let Ok(e) = e else { break };
                    if e.operation != async_nats::jetstream::kv::Operation::Put {
                        continue;
                    }
                    if let Ok(r) = jobs::decode(&e.key, &e.value) {
                        let r = Arc::new(r);
                        let mut c = cache2.lock().expect("cache lock");
                        if c.contains(&r.id) || !TERMINAL.contains(&r.status.as_str()) {
                            c.put(r.clone(), e.revision, e.value.len());
                            gauges(&metrics, &c);
                        }
                        drop(c);
                        let _ = tx.send(r);
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "record watch failed; again in 1s"),
        }
        // Writes missed until the watch is back would leave cached records stale.
        {
            let mut c = cache2.lock().expect("cache lock");
            c.clear();
            gauges(&metrics, &c);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Keeps `finished` the jobs that ended in the last [`WINDOW`] (at most
/// [`KEEP`]), from the terminal events.
async fn follow_finished(events: Events, finished: Arc<Mutex<VecDeque<Finished>>>) {
    let mut last_seq = 0u64;
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
                    let at =
                        leasehold_core::time::parse_rfc3339(&ev.at).unwrap_or_else(SystemTime::now);
                    let mut q = finished.lock().expect("finished lock");
                    q.push_back(Finished {
                        id: ev.job_id.clone(),
                        kind,
                        status: ev.r#type.clone(),
                        at,
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(job: &str, kind: &str, status: &str, worker: Option<&str>) -> Entry {
        Entry {
            job: job.into(),
            kind: kind.into(),
            status: status.into(),
            worker_id: worker.map(String::from),
            created_at: format!("2026-01-01T00:00:0{}Z", job.len() % 10),
            ..Default::default()
        }
    }

    #[test]
    fn the_kept_counts_are_what_a_pass_over_the_index_counts() {
        let mut v = IndexView::default();
        v.insert("a.q".into(), entry("a", "echo", "queued", None));
        v.insert("b.r".into(), entry("b", "echo", "running", Some("w1")));
        v.insert("c.r".into(), entry("c", "sleep", "running", Some("w1")));
        // A key written again replaces its entry's share.
        v.insert("a.q".into(), entry("a", "echo", "running", Some("w2")));
        assert_eq!(v.counts(), count(v.values()));
        assert_eq!(v.counts().in_flight.get("w1"), Some(&2));
        v.remove("c.r");
        v.remove("b.r");
        v.remove("nothing");
        assert_eq!(v.counts(), count(v.values()));
        assert!(!v.counts().by_kind.contains_key("sleep"));
        assert!(!v.counts().in_flight.contains_key("w1"));
    }
}
