//! The record cache: job records the console read or saw written, kept
//! so the jobs list does not read the store for every row. Bounded by
//! bytes (each record's encoded size plus a fixed overhead) and by count;
//! beyond either, the least recently used records go. A record not in the
//! cache is read from the store, so an eviction costs a read, never a
//! wrong page.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use leasehold_core::JobRecord;

/// Bytes counted for a record besides its encoded size (the map entries,
/// the id twice, the `Arc`).
pub const OVERHEAD: usize = 256;

struct Slot {
    record: Arc<JobRecord>,
    /// The KV revision it is at (a write older than it is ignored).
    revision: u64,
    bytes: usize,
    /// When it was last used: its key in `lru`.
    tick: u64,
}

/// The cache's logic, without locks or metrics (the feed holds it behind
/// a lock).
pub struct RecordCache {
    max_bytes: usize,
    max_records: usize,
    slots: HashMap<String, Slot>,
    /// tick -> id, oldest use first.
    lru: BTreeMap<u64, String>,
    bytes: usize,
    next_tick: u64,
    evicted: u64,
}

impl RecordCache {
    pub fn new(max_bytes: usize, max_records: usize) -> Self {
        RecordCache {
            max_bytes,
            max_records,
            slots: HashMap::new(),
            lru: BTreeMap::new(),
            bytes: 0,
            next_tick: 0,
            evicted: 0,
        }
    }

    fn tick(&mut self) -> u64 {
        self.next_tick += 1;
        self.next_tick
    }

    /// The record of `id`, marked as just used.
    pub fn get(&mut self, id: &str) -> Option<Arc<JobRecord>> {
        let t = self.tick();
        let s = self.slots.get_mut(id)?;
        self.lru.remove(&s.tick);
        s.tick = t;
        self.lru.insert(t, id.to_string());
        Some(s.record.clone())
    }

    pub fn contains(&self, id: &str) -> bool {
        self.slots.contains_key(id)
    }

    /// Keeps `record` at `revision` (`bytes`: its encoded size), unless the
    /// cache has a later revision of it; then evicts the least recently
    /// used records until both bounds hold. A record larger than the whole
    /// byte bound is not kept.
    pub fn put(&mut self, record: Arc<JobRecord>, revision: u64, bytes: usize) {
        let id = record.id.clone();
        if self.slots.get(&id).is_some_and(|s| s.revision > revision) {
            return;
        }
        self.remove(&id);
        let bytes = bytes + OVERHEAD;
        if bytes > self.max_bytes || self.max_records == 0 {
            return;
        }
        let tick = self.tick();
        self.lru.insert(tick, id.clone());
        self.slots.insert(
            id,
            Slot {
                record,
                revision,
                bytes,
                tick,
            },
        );
        self.bytes += bytes;
        while self.bytes > self.max_bytes || self.slots.len() > self.max_records {
            let Some((_, oldest)) = self.lru.pop_first() else {
                break;
            };
            if let Some(s) = self.slots.remove(&oldest) {
                self.bytes -= s.bytes;
                self.evicted += 1;
            }
        }
    }

    pub fn remove(&mut self, id: &str) {
        if let Some(s) = self.slots.remove(id) {
            self.lru.remove(&s.tick);
            self.bytes -= s.bytes;
        }
    }

    pub fn clear(&mut self) {
        self.slots.clear();
        self.lru.clear();
        self.bytes = 0;
    }

    /// Bytes counted for what it holds (at most the byte bound).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Records it holds.
    pub fn records(&self) -> usize {
        self.slots.len()
    }

    /// Records evicted so far (by the bounds, not by `remove` or `clear`).
    pub fn evicted(&self) -> u64 {
        self.evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, note: usize) -> (Arc<JobRecord>, usize) {
        let r = JobRecord {
            id: id.into(),
            kind: "echo".into(),
            status: "running".into(),
            // An inline value of `note` bytes, as a large record has.
            worker_id: Some("x".repeat(note)),
            ..Default::default()
        };
        let n = serde_json::to_vec(&r).unwrap().len();
        (Arc::new(r), n)
    }

    #[test]
    fn filled_past_its_byte_bound_it_stays_within_it_evicting_the_least_recently_used() {
        let max = 64 * 1024;
        let mut c = RecordCache::new(max, 100_000);
        // 16 KiB records, as the largest inline values: 1000 of them would be 16 MiB.
        for i in 0..1000 {
            let (r, n) = rec(&format!("j{i}"), 16 * 1024);
            c.put(r, 1, n);
            assert!(c.bytes() <= max, "{} bytes after {i}", c.bytes());
            if i == 1 {
                // j0 used again: j1 is now the least recently used.
                assert!(c.get("j0").is_some());
            }
            if i == 3 {
                // The fourth did not fit: j1 went, not j0.
                assert!(c.contains("j0") && !c.contains("j1"), "j1 went first");
            }
        }
        assert_eq!(c.records(), 3, "three 16 KiB records fit in 64 KiB");
        assert!(c.contains("j999") && c.contains("j998") && c.contains("j997"));
        assert_eq!(c.evicted(), 997);
    }

    #[test]
    fn filled_past_its_count_bound_it_keeps_that_many() {
        let mut c = RecordCache::new(usize::MAX, 10);
        for i in 0..100 {
            let (r, n) = rec(&format!("j{i}"), 10);
            c.put(r, 1, n);
            assert!(c.records() <= 10);
        }
        assert_eq!(c.records(), 10);
        assert!(c.contains("j99") && !c.contains("j89"));
    }

    #[test]
    fn an_older_revision_never_replaces_a_newer_one_and_sizes_add_up() {
        let mut c = RecordCache::new(1 << 20, 100);
        let (a, n) = rec("a", 100);
        c.put(a.clone(), 5, n);
        let (older, m) = rec("a", 10_000);
        c.put(older, 4, m);
        assert_eq!(c.get("a").unwrap().worker_id, a.worker_id);
        assert_eq!(c.bytes(), n + OVERHEAD);
        let (newer, m) = rec("a", 200);
        c.put(newer, 6, m);
        assert_eq!(c.bytes(), m + OVERHEAD);
        c.remove("a");
        assert_eq!((c.bytes(), c.records()), (0, 0));
        // One record larger than the whole bound is not kept.
        let mut small = RecordCache::new(1000, 100);
        let (big, n) = rec("big", 5000);
        small.put(big, 1, n);
        assert_eq!(small.records(), 0);
    }
}
