//! How reapers split the work: every job id (and every worker id, for the
//! crash probe) falls in one of [`SHARDS`] shards by a stable hash, and each
//! shard is owned by one of the live reapers, chosen by rendezvous hashing
//! (the member whose hash with the shard is highest). Every reaper that
//! sees the same members computes the same owners; when a reaper leaves,
//! only its shards move, spread over the others, and a reaper that joins
//! takes about its share from each.
//!
//! Ownership decides only who *tries* an action: every action stays a
//! revision-conditioned write, so two reapers that briefly disagree on the
//! members do the same work twice, never a wrong write.

/// The number of shards (a constant of the protocol: every reaper of a
/// fleet must agree on it).
pub const SHARDS: u32 = 64;

/// FNV-1a, 64 bits, then MurmurHash3's finalizer (FNV alone barely
/// changes its high bits between names that differ in their last byte):
/// stable across processes, releases and platforms.
fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in *p {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // A separator, so ("ab","c") and ("a","bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// The shard of a job id or a worker id.
pub fn shard_of(id: &str) -> u32 {
    (fnv(&[id.as_bytes()]) % u64::from(SHARDS)) as u32
}

/// The member owning `shard` (`None` without members).
pub fn owner_of(shard: u32, members: &[String]) -> Option<&str> {
    members
        .iter()
        .max_by_key(|m| (fnv(&[m.as_bytes(), &shard.to_be_bytes()]), m.as_str()))
        .map(String::as_str)
}

/// One reaper's share: the members it sees (itself always among them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shards {
    members: Vec<String>,
    mine: Vec<bool>,
}

impl Shards {
    /// `me`'s share among `members` (sorted and deduplicated; `me` added).
    pub fn new(me: &str, members: impl IntoIterator<Item = String>) -> Shards {
        let mut members: Vec<String> = members.into_iter().collect();
        members.push(me.to_string());
        members.sort();
        members.dedup();
        let mine = (0..SHARDS)
            .map(|s| owner_of(s, &members) == Some(me))
            .collect();
        Shards { members, mine }
    }

    /// Whether the job (or worker) `id` is this reaper's to act on.
    pub fn mine(&self, id: &str) -> bool {
        self.mine[shard_of(id) as usize]
    }

    /// How many shards this reaper owns.
    pub fn owned(&self) -> u32 {
        self.mine.iter().filter(|m| **m).count() as u32
    }

    /// The reapers seen, this one included.
    pub fn members(&self) -> &[String] {
        &self.members
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("r-{i:02}")).collect()
    }

    #[test]
    fn the_hash_is_stable_and_spreads_ids() {
        // Fixed values: a change here moves every fleet's shards.
        assert_eq!(shard_of("job-1"), shard_of("job-1"));
        assert_eq!([shard_of("job-1"), shard_of("w-1")], [36, 23]);
        let mut counts = [0u32; SHARDS as usize];
        for i in 0..64_000 {
            counts[shard_of(&format!("job-{i}")) as usize] += 1;
        }
        assert!(counts.iter().all(|c| (700..1300).contains(c)), "{counts:?}");
    }

    #[test]
    fn every_shard_has_one_owner_and_a_leaver_moves_only_its_own() {
        let three = names(3);
        let shares: Vec<Shards> = three
            .iter()
            .map(|m| Shards::new(m, three.clone()))
            .collect();
        for s in 0..SHARDS {
            let owners = shares.iter().filter(|x| x.mine[s as usize]).count();
            assert_eq!(owners, 1, "shard {s}");
        }
        assert_eq!(shares.iter().map(Shards::owned).sum::<u32>(), SHARDS);
        assert!(
            shares.iter().all(|x| x.owned() >= 10),
            "{:?}",
            shares.iter().map(Shards::owned).collect::<Vec<_>>()
        );
        // r-02 leaves: r-00 and r-01 keep what they had and split its shards.
        let two: Vec<String> = three[..2].to_vec();
        for (i, m) in two.iter().enumerate() {
            let after = Shards::new(m, two.clone());
            for s in 0..SHARDS as usize {
                if shares[i].mine[s] {
                    assert!(after.mine[s], "{m} lost shard {s}");
                }
            }
        }
        // Alone, a reaper owns everything; it is always among the members.
        let alone = Shards::new("r-09", Vec::new());
        assert_eq!((alone.owned(), alone.members().len()), (SHARDS, 1));
        assert!(alone.mine("anything"));
    }
}
