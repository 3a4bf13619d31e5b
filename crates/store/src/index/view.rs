//! A live view of the index, kept in memory by a watch of `lh_active`
//! (the last entry of every key, then each change), so that a periodic
//! look costs what changed and what is due, not a read of every active
//! job: the sessions running jobs are one group each, running jobs are
//! ordered by their attempt's deadline, queued jobs by the time they
//! should have run, and the counts are kept as entries come and go.
//!
//! The view may be a moment behind the bucket, like any reader of the
//! index: every action taken on what it says reads the record first.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_nats::jetstream::kv;
use leasehold_core::time::parse_rfc3339;
use serde::Deserialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{Active, Entry, Key};
use crate::connect::Link;

/// The owner a running entry names: its worker and the session recorded.
pub type Owner = (Arc<str>, Option<Arc<str>>);

/// What the view keeps of one entry (a running entry's owner is kept in
/// [`State::runs`]: most active jobs are not running).
#[derive(Debug, Clone)]
struct Slim {
    created: SystemTime,
    /// A running job's deadline; a queued job's time to look at it (when it
    /// should have run, or when a look was put off to).
    at: Option<SystemTime>,
    epoch: u64,
}

/// What the view reads of an entry ([`Entry`]'s JSON), borrowed from the
/// message where it can be: at a start, every active job's entry is read,
/// and only what [`Slim`] keeps is taken. Lenient as [`Entry`] is (a field
/// missing is its default), so an entry unreadable as one is unreadable
/// here too.
#[derive(Default, Deserialize)]
#[serde(default)]
struct Read<'a> {
    #[serde(borrow)]
    session: Option<Cow<'a, str>>,
    epoch: u64,
    #[serde(borrow)]
    next_run_at: Option<Cow<'a, str>>,
    #[serde(borrow)]
    deadline: Option<Cow<'a, str>>,
    #[serde(borrow)]
    created_at: Cow<'a, str>,
    #[serde(borrow)]
    updated_at: Cow<'a, str>,
}

impl<'a> From<&'a Entry> for Read<'a> {
    fn from(e: &'a Entry) -> Self {
        let b = |s: &'a Option<String>| s.as_deref().map(Cow::Borrowed);
        Read {
            session: b(&e.session),
            epoch: e.epoch,
            next_run_at: b(&e.next_run_at),
            deadline: b(&e.deadline),
            created_at: Cow::Borrowed(&e.created_at),
            updated_at: Cow::Borrowed(&e.updated_at),
        }
    }
}

/// The entries, their groups and orders.
#[derive(Default)]
struct State {
    entries: HashMap<Arc<Key>, Slim>,
    /// Running entries, by key (worker, then job), with their owners.
    runs: BTreeMap<Arc<Key>, Owner>,
    /// How many running entries name each owner.
    owners: HashMap<Owner, usize>,
    deadlines: BTreeSet<(SystemTime, Arc<Key>)>,
    /// Queued entries by the time to look at them.
    waits: BTreeSet<(SystemTime, Arc<Key>)>,
    /// Running and queued entries by creation (the oldest in flight).
    ages: BTreeSet<(SystemTime, Arc<Key>)>,
    parked: u64,
    held: u64,
}

/// The counts of a look.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counts {
    pub jobs: u64,
    pub running: u64,
    /// Running and queued.
    pub in_flight: u64,
    pub parked: u64,
    /// `waiting` (held by nobody).
    pub held: u64,
    /// The oldest running or queued job and when it was created.
    pub oldest_in_flight: Option<(String, SystemTime)>,
}

/// When a queued entry should have run: its due time, or its last write.
pub fn wait_due(e: &Entry) -> Option<SystemTime> {
    due(e.next_run_at.as_deref(), &e.updated_at)
}

fn due(next_run_at: Option<&str>, updated_at: &str) -> Option<SystemTime> {
    parse_rfc3339(next_run_at.unwrap_or(updated_at))
}

impl State {
    fn remove(&mut self, key: &Key) {
        let Some((k, s)) = self.entries.remove_entry(key) else {
            return;
        };
        match &*k {
            Key::Run { .. } => {
                if let Some(o) = self.runs.remove(&k) {
                    if let Some(n) = self.owners.get_mut(&o) {
                        *n -= 1;
                        if *n == 0 {
                            self.owners.remove(&o);
                        }
                    }
                }
                if let Some(at) = s.at {
                    self.deadlines.remove(&(at, k.clone()));
                }
                self.ages.remove(&(s.created, k.clone()));
            }
            Key::Wait { .. } => {
                if let Some(at) = s.at {
                    self.waits.remove(&(at, k.clone()));
                }
                self.ages.remove(&(s.created, k.clone()));
            }
            Key::Park { .. } => self.parked -= 1,
            Key::Hold { .. } => self.held -= 1,
        }
    }

    fn insert(&mut self, key: Key, e: &Read<'_>) {
        self.remove(&key);
        let k = Arc::new(key);
        let created = parse_rfc3339(&e.created_at).unwrap_or(SystemTime::UNIX_EPOCH);
        let mut s = Slim {
            created,
            at: None,
            epoch: e.epoch,
        };
        match &*k {
            Key::Run { worker, .. } => {
                let owner: Owner = (worker.as_str().into(), e.session.as_deref().map(Arc::from));
                *self.owners.entry(owner.clone()).or_default() += 1;
                s.at = e.deadline.as_deref().and_then(parse_rfc3339);
                if let Some(at) = s.at {
                    self.deadlines.insert((at, k.clone()));
                }
                self.runs.insert(k.clone(), owner);
                self.ages.insert((created, k.clone()));
            }
            Key::Wait { .. } => {
                s.at = Some(due(e.next_run_at.as_deref(), &e.updated_at).unwrap_or(created));
                self.waits.insert((s.at.unwrap_or(created), k.clone()));
                self.ages.insert((created, k.clone()));
            }
            Key::Park { .. } => self.parked += 1,
            Key::Hold { .. } => self.held += 1,
        }
        self.entries.insert(k, s);
    }
}

/// The view, shared by its follower and its readers.
#[derive(Clone)]
pub struct View {
    state: Arc<Mutex<State>>,
    /// True once the entries present when the watch began were all read.
    loaded: watch::Receiver<bool>,
}

impl View {
    /// Starts following `active` until `shutdown` (read again after an
    /// error or a reconnect: [`crate::follow::follow`]); the view fills as
    /// the entries arrive ([`View::loaded`]).
    pub fn follow(active: Active, link: Link, shutdown: CancellationToken) -> View {
        let (state, followed) =
            crate::follow::follow("the index", active.kv().clone(), link, shutdown, apply);
        View {
            state,
            loaded: followed.loaded,
        }
    }

    /// Waits until the entries present at the start were read (at most
    /// `within`); whether they were.
    pub async fn loaded(&self, within: Duration) -> bool {
        let mut rx = self.loaded.clone();
        tokio::time::timeout(within, rx.wait_for(|l| *l))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Whether the entries present when the watch (re)began were all read.
    pub fn is_loaded(&self) -> bool {
        *self.loaded.borrow()
    }

    /// Every owner named by a running entry.
    pub fn owners(&self) -> Vec<Owner> {
        self.state.lock().unwrap().owners.keys().cloned().collect()
    }

    /// The running keys naming `owner`.
    pub fn runs_of(&self, owner: &Owner) -> Vec<Key> {
        let st = self.state.lock().unwrap();
        let from = Key::Run {
            worker: owner.0.to_string(),
            job: String::new(),
        };
        st.runs
            .range::<Key, _>(&from..)
            .take_while(|(k, _)| matches!(&***k, Key::Run { worker, .. } if **worker == *owner.0))
            .filter(|(_, o)| *o == owner)
            .map(|(k, _)| (**k).clone())
            .collect()
    }

    /// Running entries whose deadline is at or before `by`, with their
    /// owner and deadline.
    pub fn deadlines_by(&self, by: SystemTime) -> Vec<(Key, Owner, SystemTime)> {
        let st = self.state.lock().unwrap();
        st.deadlines
            .iter()
            .take_while(|(at, _)| *at <= by)
            .filter_map(|(at, k)| Some(((**k).clone(), st.runs.get(k)?.clone(), *at)))
            .collect()
    }

    /// Queued entries to look at by `by`.
    pub fn waits_by(&self, by: SystemTime) -> Vec<Key> {
        let st = self.state.lock().unwrap();
        st.waits
            .iter()
            .take_while(|(at, _)| *at <= by)
            .map(|(_, k)| (**k).clone())
            .collect()
    }

    /// Puts off the next look at queued entry `key` to `until` (until its
    /// entry changes).
    pub fn put_off(&self, key: &Key, until: SystemTime) {
        let mut guard = self.state.lock().unwrap();
        let st = &mut *guard;
        let Some((k, s)) = st.entries.get_key_value(key) else {
            return;
        };
        if !matches!(**k, Key::Wait { .. }) {
            return;
        }
        let k = k.clone();
        if let Some(at) = s.at {
            st.waits.remove(&(at, k.clone()));
        }
        st.waits.insert((until, k.clone()));
        if let Some(s) = st.entries.get_mut(&k) {
            s.at = Some(until);
        }
    }

    /// Up to `n` running keys after `cursor` in key order, from the start
    /// again past the end (a rotating window), with their owners.
    pub fn runs_after(&self, cursor: Option<&Key>, n: usize) -> Vec<(Key, Owner)> {
        use std::ops::Bound::{Excluded, Unbounded};
        let st = self.state.lock().unwrap();
        let mut runs: Vec<(&Arc<Key>, &Owner)> = match cursor {
            Some(c) => st
                .runs
                .range::<Key, _>((Excluded(c), Unbounded))
                .take(n)
                .collect(),
            None => Vec::new(),
        };
        let wrap = n.saturating_sub(runs.len());
        runs.extend(
            st.runs
                .iter()
                .take_while(|(k, _)| cursor.is_none_or(|c| &***k <= c))
                .take(wrap),
        );
        runs.into_iter()
            .map(|(k, o)| ((**k).clone(), o.clone()))
            .collect()
    }

    /// Drops `key` from the view when its entry is of epoch `epoch` or an
    /// earlier one: the job's record moved on from it. The bucket's own
    /// removal comes through the watch; this covers an entry the view read
    /// from a replica that still had it after the leader removed it (a
    /// killed node's store may bring a purged entry back, nats-server issue
    /// 8505), which no change of the bucket would ever remove.
    pub fn forget(&self, key: &Key, epoch: u64) {
        let mut st = self.state.lock().unwrap();
        if st.entries.get(key).is_some_and(|s| s.epoch <= epoch) {
            st.remove(key);
        }
    }

    /// The counts now.
    pub fn counts(&self) -> Counts {
        let st = self.state.lock().unwrap();
        let running = st.runs.len() as u64;
        let in_flight = st.ages.len() as u64;
        Counts {
            jobs: in_flight + st.parked + st.held,
            running,
            in_flight,
            parked: st.parked,
            held: st.held,
            oldest_in_flight: st.ages.first().map(|(at, k)| (k.job().to_string(), *at)),
        }
    }
}

/// Applies one change of the bucket.
fn apply(st: &mut State, e: &kv::Entry) {
    let Some(key) = Key::parse(&e.key) else {
        return;
    };
    if e.operation != kv::Operation::Put {
        st.remove(&key);
        return;
    }
    match serde_json::from_slice::<Read>(&e.value) {
        Ok(entry) => st.insert(key, &entry),
        Err(err) => {
            tracing::warn!(key = %e.key, error = %err, "unreadable index entry; skipped");
            st.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use leasehold_core::time::rfc3339;

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + s)
    }

    fn view() -> View {
        let (_tx, rx) = watch::channel(true);
        View {
            state: Arc::default(),
            loaded: rx,
        }
    }

    fn entry(job: &str, session: &str, created: u64, at: Option<u64>) -> Entry {
        Entry {
            job: job.into(),
            session: Some(session.into()),
            created_at: rfc3339(t(created)),
            updated_at: rfc3339(t(created)),
            deadline: at.map(|a| rfc3339(t(a))),
            next_run_at: at.map(|a| rfc3339(t(a))),
            ..Default::default()
        }
    }

    fn run(w: &str, j: &str) -> Key {
        Key::Run {
            worker: w.into(),
            job: j.into(),
        }
    }

    fn wait(j: &str) -> Key {
        Key::Wait { job: j.into() }
    }

    fn owner(w: &str, s: &str) -> Owner {
        (w.into(), Some(s.into()))
    }

    /// The view reads an entry borrowed where it can (an escaped string is
    /// copied), and refuses what [`Entry`] refuses.
    #[test]
    fn the_view_reads_an_entry_as_the_index_writes_it() {
        let e = Entry {
            job: "a".into(),
            kind: "k".into(),
            status: "running".into(),
            session: Some("s\"1".into()),
            ..entry("a", "s", 1, Some(5))
        };
        let json = serde_json::to_vec(&e).unwrap();
        let r: Read = serde_json::from_slice(&json).unwrap();
        assert_eq!(r.session.as_deref(), Some("s\"1"));
        assert!(matches!(r.created_at, Cow::Borrowed(_)));
        assert_eq!(r.deadline.as_deref(), e.deadline.as_deref());
        for bad in [
            &br#"{"epoch":"two"}"#[..],
            br#"[1]"#,
            b"not json",
            br#"{"created_at":5}"#,
        ] {
            assert!(serde_json::from_slice::<Entry>(bad).is_err());
            assert!(serde_json::from_slice::<Read>(bad).is_err());
        }
        // A field missing is its default, for both.
        let r: Read = serde_json::from_slice(br#"{"epoch":3}"#).unwrap();
        assert_eq!((r.epoch, r.created_at.as_ref()), (3, ""));
    }

    #[test]
    fn owners_deadlines_and_due_waits_follow_the_entries() {
        let v = view();
        {
            let mut st = v.state.lock().unwrap();
            st.insert(run("w1", "a"), &Read::from(&entry("a", "s1", 1, Some(100))));
            st.insert(run("w1", "b"), &Read::from(&entry("b", "s1", 2, Some(50))));
            st.insert(run("w2", "c"), &Read::from(&entry("c", "s9", 3, None)));
            st.insert(wait("d"), &Read::from(&entry("d", "", 0, Some(10))));
            st.insert(wait("e"), &Read::from(&entry("e", "", 4, Some(500))));
            st.insert(
                Key::Park { job: "f".into() },
                &Read::from(&entry("f", "", 5, None)),
            );
            st.insert(
                Key::Hold { job: "g".into() },
                &Read::from(&entry("g", "", 6, None)),
            );
        }
        let mut owners = v.owners();
        owners.sort();
        assert_eq!(owners, vec![owner("w1", "s1"), owner("w2", "s9")]);
        assert_eq!(
            v.runs_of(&owner("w1", "s1")),
            vec![run("w1", "a"), run("w1", "b")]
        );
        assert!(v.runs_of(&owner("w1", "s2")).is_empty());
        let due: Vec<Key> = v.deadlines_by(t(60)).into_iter().map(|d| d.0).collect();
        assert_eq!(due, vec![run("w1", "b")]);
        assert_eq!(v.waits_by(t(10)), vec![wait("d")]);
        let c = v.counts();
        assert_eq!(
            (c.jobs, c.running, c.in_flight, c.parked, c.held),
            (7, 3, 5, 1, 1)
        );
        assert_eq!(c.oldest_in_flight, Some(("d".to_string(), t(0))));

        // A claim moves b to another session; a's entry is removed.
        {
            let mut st = v.state.lock().unwrap();
            st.insert(run("w1", "b"), &Read::from(&entry("b", "s2", 2, Some(70))));
            st.remove(&run("w1", "a"));
            st.remove(&run("w1", "a"));
        }
        let mut owners = v.owners();
        owners.sort();
        assert_eq!(owners, vec![owner("w1", "s2"), owner("w2", "s9")]);
        assert!(v.deadlines_by(t(60)).is_empty());
        assert_eq!(v.counts().running, 2);
    }

    #[test]
    fn a_look_put_off_comes_back_at_its_time_or_when_the_entry_changes() {
        let v = view();
        v.state
            .lock()
            .unwrap()
            .insert(wait("d"), &Read::from(&entry("d", "", 0, Some(10))));
        v.put_off(&wait("d"), t(100));
        assert!(v.waits_by(t(99)).is_empty());
        assert_eq!(v.waits_by(t(100)), vec![wait("d")]);
        v.state
            .lock()
            .unwrap()
            .insert(wait("d"), &Read::from(&entry("d", "", 0, Some(20))));
        assert_eq!(v.waits_by(t(20)), vec![wait("d")]);
        // Putting off what is not a queued entry does nothing.
        v.put_off(&wait("zz"), t(5));
        assert_eq!(v.counts().in_flight, 1);
    }

    #[test]
    fn forgetting_drops_an_entry_of_the_epoch_judged_and_never_a_later_claims() {
        let v = view();
        let mut e1 = entry("a", "s1", 1, Some(100));
        e1.epoch = 1;
        v.state
            .lock()
            .unwrap()
            .insert(run("w1", "a"), &Read::from(&e1));
        // The record (epoch 1) moved on, but meanwhile the same worker
        // claimed the job again (epoch 2): that entry stays.
        let mut e2 = e1.clone();
        e2.epoch = 2;
        v.state
            .lock()
            .unwrap()
            .insert(run("w1", "a"), &Read::from(&e2));
        v.forget(&run("w1", "a"), 1);
        assert_eq!(v.counts().running, 1);
        assert_eq!(v.runs_of(&owner("w1", "s1")), vec![run("w1", "a")]);
        v.forget(&run("w1", "a"), 2);
        assert_eq!(v.counts().running, 0);
        assert!(v.owners().is_empty() && v.deadlines_by(t(1000)).is_empty());
        v.forget(&run("w1", "zz"), u64::MAX);
    }

    #[test]
    fn the_verify_window_rotates_through_every_running_entry() {
        let v = view();
        for j in ["a", "b", "c", "d", "e"] {
            v.state
                .lock()
                .unwrap()
                .insert(run("w", j), &Read::from(&entry(j, "s", 0, None)));
        }
        let jobs = |w: Vec<(Key, Owner)>| -> String {
            w.iter().map(|(k, _)| k.job().to_string()).collect()
        };
        assert_eq!(jobs(v.runs_after(None, 2)), "ab");
        assert_eq!(jobs(v.runs_after(Some(&run("w", "b")), 2)), "cd");
        assert_eq!(jobs(v.runs_after(Some(&run("w", "d")), 3)), "eab");
        assert_eq!(jobs(v.runs_after(Some(&run("w", "c")), 9)), "deabc");
    }
}
