//! What the console follows for every page at once: each record change (a
//! KV watch of new writes only, never the bucket's current contents) and
//! the jobs that finished in the last hour (terminal events, read from one
//! hour ago and then live), kept in memory for the recent-jobs table.

use std::borrow::Cow;
use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use leasehold_core::JobRecord;
use leasehold_store::events::Events;
use leasehold_store::index::{Active, Key};
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

/// What the view keeps of an index entry: what pages filter on and the
/// counts count. A page reads the records of the rows it shows.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub kind: Arc<str>,
    pub status: Arc<str>,
    pub worker: Option<Arc<str>>,
}

/// What the view reads of an index entry ([`leasehold_store::index::Entry`]'s JSON), borrowed
/// from the message where it can be: at a start, a million entries are
/// read and only what a [`Row`] keeps is copied.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
pub struct Seen<'a> {
    #[serde(borrow)]
    pub job: Cow<'a, str>,
    #[serde(borrow)]
    pub kind: Cow<'a, str>,
    #[serde(borrow)]
    pub status: Cow<'a, str>,
    #[serde(borrow)]
    pub worker_id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    pub created_at: Cow<'a, str>,
}

/// Where a key's row is in the order: its job's creation (newest first),
/// the job, the key. The strings are shared with the maps that name them.
type Place = (Reverse<Arc<str>>, Arc<str>, Arc<str>);

/// The index of active jobs as the watch has it, kept in the order pages
/// show it (newest job first), so a page reads only the entries it shows:
/// no copy, filter or sort of the whole index per request. What it keeps
/// of each entry is small ([`Row`]): a key, a job id and a creation time,
/// each stored once, and kinds and statuses shared by every row that
/// names them.
#[derive(Debug, Default)]
pub struct IndexView {
    /// Key -> its place in `order`.
    places: HashMap<Arc<str>, Place>,
    order: BTreeMap<Place, Row>,
    /// Distinct jobs -> how many keys each has (a job may have two while
    /// it moves from waiting to running).
    jobs: HashMap<Arc<str>, u32>,
    /// Kinds and statuses, one copy each.
    names: HashSet<Arc<str>>,
    /// The counts of `order`'s rows, kept as entries come and go: the
    /// fleet's charts read them every sample without a pass over the
    /// index.
    tally: Counts,
}

/// Counts rows in a pass over them: what the kept tally must equal.
#[cfg(test)]
fn count<'a>(rows: impl Iterator<Item = &'a Row>) -> Counts {
    let mut c = Counts::default();
    for r in rows {
        tally(&mut c, r, true);
    }
    c
}

/// Adds (`up`) or takes away one row's share of `c`; a count that
/// reaches zero goes, so the maps hold only kinds and workers there are.
fn tally(c: &mut Counts, r: &Row, up: bool) {
    /// One more or one fewer under `k`; none left, no key.
    fn step<N>(m: &mut BTreeMap<String, N>, k: &str, up: bool)
    where
        N: Copy
            + Default
            + PartialEq
            + From<u8>
            + std::ops::Add<Output = N>
            + std::ops::Sub<Output = N>,
    {
        let (zero, one) = (N::default(), N::from(1));
        if up {
            match m.get_mut(k) {
                Some(n) => *n = *n + one,
                None => {
                    m.insert(k.to_string(), one);
                }
            }
        } else if let Some(n) = m.get_mut(k) {
            if *n != zero {
                *n = *n - one;
            }
            if *n == zero {
                m.remove(k);
            }
        }
    }
    if &*r.status == "running" {
        if let Some(w) = &r.worker {
            step(&mut c.in_flight, w, up);
        }
    }
    if !c.by_kind.contains_key(&*r.kind) {
        c.by_kind.insert(r.kind.to_string(), BTreeMap::new());
    }
    if let Some(kind) = c.by_kind.get_mut(&*r.kind) {
        step(kind, &r.status, up);
        if kind.is_empty() {
            c.by_kind.remove(&*r.kind);
        }
    }
}

impl IndexView {
    /// The one shared copy of a kind or a status.
    fn name(&mut self, s: &str) -> Arc<str> {
        if let Some(n) = self.names.get(s) {
            return n.clone();
        }
        let n: Arc<str> = s.into();
        self.names.insert(n.clone());
        n
    }

    pub fn insert(&mut self, key: &str, e: Seen<'_>) {
        self.remove(key);
        let row = Row {
            kind: self.name(&e.kind),
            status: self.name(&e.status),
            worker: e.worker_id.map(|w| Arc::from(&*w)),
        };
        let key: Arc<str> = key.into();
        let job = match self.jobs.get_key_value(&*e.job) {
            Some((j, _)) => j.clone(),
            None => Arc::from(&*e.job),
        };
        *self.jobs.entry(job.clone()).or_insert(0) += 1;
        tally(&mut self.tally, &row, true);
        let place = (Reverse(Arc::from(&*e.created_at)), job, key.clone());
        self.order.insert(place.clone(), row);
        self.places.insert(key, place);
    }

    pub fn remove(&mut self, key: &str) {
        let Some(place) = self.places.remove(key) else {
            return;
        };
        if let Some(r) = self.order.remove(&place) {
            tally(&mut self.tally, &r, false);
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

    /// Every row with its job, newest job first.
    pub fn rows(&self) -> impl Iterator<Item = (&Arc<str>, &Row)> {
        self.order.iter().map(|((_, job, _), r)| (job, r))
    }

    /// The counts of the rows, without a pass over them.
    pub fn counts(&self) -> Counts {
        self.tally.clone()
    }
}

/// Where the console's view of the index is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ViewState {
    /// Not kept (`--index-view off`): pages read the index's end, and the
    /// counts are not known.
    Off,
    /// The watch is delivering the index: `read` entries so far, about
    /// `left` to go (none known yet: 0).
    Loading { read: u64, left: u64 },
    /// Whole and following every change.
    Live,
}

pub struct Feed {
    pub records: broadcast::Sender<Arc<JobRecord>>,
    pub finished: Arc<Mutex<VecDeque<Finished>>>,
    /// The index of active jobs as its KV watch has it; `None` until the
    /// watch delivered the current entries, and always with the view off.
    pub index: Arc<std::sync::RwLock<Option<IndexView>>>,
    /// How far the view is.
    state: Arc<Mutex<ViewState>>,
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
        view: bool,
    ) -> anyhow::Result<Feed> {
        let (tx, _) = broadcast::channel(4096);
        let finished = Arc::new(Mutex::new(VecDeque::new()));
        let index: Arc<std::sync::RwLock<Option<IndexView>>> = Default::default();
        let cache = Arc::new(Mutex::new(cache));
        let state = Arc::new(Mutex::new(if view {
            ViewState::Loading { read: 0, left: 0 }
        } else {
            ViewState::Off
        }));
        let f = Feed {
            records: tx.clone(),
            finished: finished.clone(),
            index: index.clone(),
            state: state.clone(),
            cache: cache.clone(),
            metrics: metrics.clone(),
        };
        if view {
            tokio::spawn(follow_index(active.kv().clone(), index.clone(), state));
        }
        tokio::spawn(follow_records(
            jobs.clone(),
            cache.clone(),
            metrics.clone(),
            tx,
        ));
        tokio::spawn(follow_finished(events.clone(), finished.clone()));
        Ok(f)
    }

    /// How far the view of the index is.
    pub fn view_state(&self) -> ViewState {
        *self.state.lock().expect("view state lock")
    }

    /// The jobs whose rows `keep` admits, newest first (each once), when
    /// the view has the index.
    pub fn matching(&self, keep: impl Fn(&str, &Row) -> bool) -> Option<Vec<Arc<str>>> {
        let g = self.index.read().expect("index lock");
        let mut out: Vec<Arc<str>> = Vec::new();
        for (job, r) in g.as_ref()?.rows() {
            if out.last() != Some(job) && keep(job, r) {
                out.push(job.clone());
            }
        }
        Some(out)
    }

    /// One page of the jobs whose rows `keep` admits, newest first (each
    /// once), and how many there are; only the page is copied.
    /// `unfiltered` (`keep` admits every row) stops at the page's end: the
    /// count is the index's own.
    pub fn page(
        &self,
        keep: impl Fn(&str, &Row) -> bool,
        unfiltered: bool,
        offset: usize,
        limit: usize,
    ) -> Option<(Vec<Arc<str>>, usize)> {
        let g = self.index.read().expect("index lock");
        let m = g.as_ref()?;
        let mut out = Vec::with_capacity(limit.min(m.keys()));
        let (mut n, mut last): (usize, Option<&str>) = (0, None);
        for (job, r) in m.rows() {
            // A job's keys are next to each other (same created_at and job).
            if last == Some(&**job) || !keep(job, r) {
                continue;
            }
            last = Some(job);
            if n >= offset && out.len() < limit {
                out.push(job.clone());
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

/// How often (in entries) the load's progress is told while the watch
/// delivers the index.
const PROGRESS_EVERY: u64 = 4096;

/// Keeps `idx` the index of active jobs as its KV watch has it (`None`
/// while the watch is down or still delivering: pages read the index's
/// end then), and `state` how far it is.
async fn follow_index(
    kv: async_nats::jetstream::kv::Store,
    idx: Arc<std::sync::RwLock<Option<IndexView>>>,
    state: Arc<Mutex<ViewState>>,
) {
    let tell = |s: ViewState| *state.lock().expect("view state lock") = s;
    loop {
        tell(ViewState::Loading { read: 0, left: 0 });
        // An empty bucket delivers nothing to wait for.
        let empty = match kv.status().await {
            Ok(st) => st.values() == 0,
            Err(_) => false,
        };
        if empty {
            *idx.write().expect("index lock") = Some(IndexView::default());
            tell(ViewState::Live);
        }
        match kv.watch_with_history(">").await {
            Ok(mut w) => {
                let mut map = IndexView::default();
                let mut live = empty;
                let mut read = 0u64;
                while let Some(e) = w.next().await {
                    let Ok(e) = e else { break };
                    read += 1;
                    let entry = Key::parse(&e.key).map(|_| {
                        (e.operation == async_nats::jetstream::kv::Operation::Put)
                            .then(|| serde_json::from_slice::<Seen>(&e.value).ok())
                            .flatten()
                    });
                    if live {
                        let mut g = idx.write().expect("index lock");
                        let m = g.get_or_insert_with(IndexView::default);
                        match entry {
                            Some(Some(en)) => m.insert(&e.key, en),
                            Some(None) => m.remove(&e.key),
                            None => {}
                        };
                        continue;
                    }
                    match entry {
                        Some(Some(en)) => map.insert(&e.key, en),
                        Some(None) => map.remove(&e.key),
                        None => {}
                    };
                    if e.delta == 0 {
                        *idx.write().expect("index lock") = Some(std::mem::take(&mut map));
                        tell(ViewState::Live);
                        live = true;
                    } else if read % PROGRESS_EVERY == 1 {
                        tell(ViewState::Loading {
                            read,
                            left: e.delta,
                        });
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "index watch failed; again in 1s"),
        }
        // Until the watch is back, pages read the index's end.
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
    use leasehold_store::index::Entry;

    fn entry(job: &str, kind: &str, status: &str, worker: Option<&str>) -> Seen<'static> {
        Seen {
            job: job.to_string().into(),
            kind: kind.to_string().into(),
            status: status.to_string().into(),
            worker_id: worker.map(|w| w.to_string().into()),
            created_at: format!("2026-01-01T00:00:0{}Z", job.len() % 10).into(),
        }
    }

    #[test]
    fn an_entry_is_read_as_the_index_writes_it() {
        let mut rec = leasehold_core::machine::new_record(
            "j-1",
            "echo",
            Default::default(),
            1,
            SystemTime::now(),
        );
        rec.status = "running".into();
        rec.worker_id = Some("w \"quoted\"".into());
        let bytes = serde_json::to_vec(&Entry::of(&rec)).unwrap();
        let e: Seen = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(
            (
                &*e.job,
                &*e.kind,
                &*e.status,
                e.worker_id.as_deref(),
                &*e.created_at
            ),
            (
                "j-1",
                "echo",
                "running",
                Some("w \"quoted\""),
                rec.created_at.as_str()
            )
        );
        assert!(
            matches!(e.job, Cow::Borrowed(_)),
            "an unescaped string is not copied"
        );
    }

    #[test]
    fn the_kept_counts_are_what_a_pass_over_the_index_counts() {
        let mut v = IndexView::default();
        v.insert("a.q", entry("a", "echo", "queued", None));
        v.insert("b.r", entry("b", "echo", "running", Some("w1")));
        v.insert("c.r", entry("c", "sleep", "running", Some("w1")));
        // A key written again replaces its entry's share.
        v.insert("a.q", entry("a", "echo", "running", Some("w2")));
        assert_eq!(v.counts(), count(v.rows().map(|(_, r)| r)));
        assert_eq!(v.counts().in_flight.get("w1"), Some(&2));
        v.remove("c.r");
        v.remove("b.r");
        v.remove("nothing");
        assert_eq!(v.counts(), count(v.rows().map(|(_, r)| r)));
        assert!(!v.counts().by_kind.contains_key("sleep"));
        assert!(!v.counts().in_flight.contains_key("w1"));
    }

    #[test]
    fn rows_come_newest_job_first_with_a_jobs_keys_side_by_side_and_names_shared() {
        let mut v = IndexView::default();
        let at = |job: &str, created: &str, status: &str| Seen {
            created_at: created.to_string().into(),
            ..entry(job, "echo", status, None)
        };
        v.insert("wait.old", at("old", "2026-01-01T00:00:01Z", "queued"));
        v.insert("wait.new", at("new", "2026-01-01T00:00:09Z", "queued"));
        v.insert("run.w.new", at("new", "2026-01-01T00:00:09Z", "running"));
        v.insert("wait.mid", at("mid", "2026-01-01T00:00:05Z", "queued"));
        let jobs: Vec<&str> = v.rows().map(|(j, _)| &**j).collect();
        assert_eq!(jobs, ["new", "new", "mid", "old"]);
        assert_eq!((v.keys(), v.jobs.len()), (4, 3));
        // One copy of each kind and status, whatever the rows.
        let kinds: Vec<_> = v.rows().map(|(_, r)| r.kind.clone()).collect();
        assert!(kinds.windows(2).all(|w| Arc::ptr_eq(&w[0], &w[1])));
        assert_eq!(v.names.len(), 3, "echo, queued, running");
        v.remove("wait.new");
        assert_eq!((v.keys(), v.jobs.len()), (3, 3));
        v.remove("run.w.new");
        assert_eq!((v.keys(), v.jobs.len()), (2, 2));
    }
}
