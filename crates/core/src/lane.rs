//! Lanes: where a job waits for a worker.
//!
//! A submission's tenant and priority name its *lane*. The default tenant
//! at the default priority waits on the kind's own subject
//! (`lh.submit.<kind>`); every other lane on `lh.submit.<kind>.<tenant>.<priority>`,
//! so the work stream keeps each lane in order and a worker can take the
//! next job of whichever lane is due. Which lane is due is decided by
//! [`Scheduler`]: tenants share the fleet by weight (deficit round robin),
//! and within a tenant the lowest priority number goes first.

use std::collections::BTreeMap;

use crate::JobSpec;

/// The tenant of a submission that names none.
pub const DEFAULT_TENANT: &str = "default";
/// The priority of a submission that names none.
pub const DEFAULT_PRIORITY: i32 = 3;
/// The first (most urgent) priority.
pub const FIRST_PRIORITY: i32 = 1;
/// The last priority.
pub const LAST_PRIORITY: i32 = 5;
/// The longest tenant name.
pub const MAX_TENANT_LEN: usize = 64;
/// The largest tenant weight.
pub const MAX_WEIGHT: u32 = 1000;

/// A tenant and a priority.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Lane {
    pub tenant: String,
    pub priority: i32,
}

impl Default for Lane {
    fn default() -> Self {
        Lane {
            tenant: DEFAULT_TENANT.to_string(),
            priority: DEFAULT_PRIORITY,
        }
    }
}

impl Lane {
    /// The lane a (validated) spec names; unset fields are the defaults.
    pub fn of(spec: &JobSpec) -> Lane {
        Lane {
            tenant: spec
                .tenant
                .clone()
                .filter(|t| !t.is_empty())
                .unwrap_or_else(|| DEFAULT_TENANT.to_string()),
            priority: spec.priority.unwrap_or(DEFAULT_PRIORITY),
        }
    }

    /// Whether this is the kind's own subject's lane.
    pub fn is_default(&self) -> bool {
        self.tenant == DEFAULT_TENANT && self.priority == DEFAULT_PRIORITY
    }

    /// Parses the two subject tokens after the kind (`acme`, `2`).
    pub fn from_tokens(tenant: &str, priority: &str) -> Result<Lane, String> {
        check_tenant(tenant)?;
        let p: i32 = priority
            .parse()
            .map_err(|_| format!("priority {priority:?} is not a whole number"))?;
        check_priority(p)?;
        Ok(Lane {
            tenant: tenant.to_string(),
            priority: p,
        })
    }
}

/// Checks a tenant name: 1-64 letters, digits, `-` or `_` (it is a subject
/// token and part of a consumer name).
pub fn check_tenant(t: &str) -> Result<(), String> {
    if t.is_empty() || t.len() > MAX_TENANT_LEN {
        return Err(format!(
            "tenant {t:?}: use 1-{MAX_TENANT_LEN} letters, digits, '-' or '_'"
        ));
    }
    if !t
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(format!(
            "tenant {t:?}: use only letters, digits, '-' or '_'"
        ));
    }
    Ok(())
}

/// Checks a priority: [`FIRST_PRIORITY`]..=[`LAST_PRIORITY`].
pub fn check_priority(p: i32) -> Result<(), String> {
    if (FIRST_PRIORITY..=LAST_PRIORITY).contains(&p) {
        Ok(())
    } else {
        Err(format!(
            "{p} is out of range {FIRST_PRIORITY}..={LAST_PRIORITY} (1 runs first, {DEFAULT_PRIORITY} is the default)"
        ))
    }
}

/// Checks a tenant's weight: 1..=[`MAX_WEIGHT`].
pub fn check_weight(w: u32) -> Result<(), String> {
    if (1..=MAX_WEIGHT).contains(&w) {
        Ok(())
    } else {
        Err(format!("weight {w} is out of range 1..={MAX_WEIGHT}"))
    }
}

/// Picks the lane whose job a worker takes next: deficit round robin
/// between tenants by weight, the lowest priority number first within a
/// tenant. Pure: the caller says which lanes have jobs waiting and which
/// tenants may start one now (not over a limit).
///
/// Each tenant with waiting jobs earns its weight in credit per round and
/// spends one per job taken; the tenant with the most credit left goes
/// next. So under contention tenants take turns in proportion to their
/// weights, however many jobs each has queued, and a tenant that had
/// nothing waiting does not bank credit for later.
#[derive(Debug, Default)]
pub struct Scheduler {
    credit: BTreeMap<String, i64>,
}

impl Scheduler {
    pub fn new() -> Scheduler {
        Scheduler::default()
    }

    /// Gives back the turn [`Scheduler::next`] just charged `tenant` (its
    /// job could not be taken after all).
    pub fn refund(&mut self, tenant: &str) {
        if let Some(c) = self.credit.get_mut(tenant) {
            *c += 1;
        }
    }

    /// The next lane among `waiting` (lanes with jobs queued), skipping
    /// tenants `blocked` says may not start one; `weight` gives each
    /// tenant's weight. `None` when nothing may be taken.
    pub fn next<'a>(
        &mut self,
        waiting: impl IntoIterator<Item = &'a Lane>,
        weight: impl Fn(&str) -> u32,
        blocked: impl Fn(&str) -> bool,
    ) -> Option<Lane> {
        // The most urgent waiting lane of each eligible tenant.
        let mut best: BTreeMap<&str, &Lane> = BTreeMap::new();
        for l in waiting {
            if blocked(&l.tenant) {
                continue;
            }
            let e = best.entry(l.tenant.as_str()).or_insert(l);
            if l.priority < e.priority {
                *e = l;
            }
        }
        if best.is_empty() {
            return None;
        }
        // Tenants with nothing waiting forget their credit.
        self.credit.retain(|t, _| best.contains_key(t.as_str()));
        loop {
            let pick = best
                .keys()
                .filter(|t| self.credit.get(**t).copied().unwrap_or(0) > 0)
                .max_by_key(|t| (self.credit[**t], std::cmp::Reverse(**t)))
                .copied();
            if let Some(t) = pick {
                *self.credit.get_mut(t).expect("picked") -= 1;
                return Some(best[t].clone());
            }
            for t in best.keys() {
                *self.credit.entry(t.to_string()).or_insert(0) += weight(t).max(1) as i64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(t: &str, p: i32) -> Lane {
        Lane {
            tenant: t.into(),
            priority: p,
        }
    }

    #[test]
    fn tenants_take_turns_whatever_they_queued() {
        let mut s = Scheduler::new();
        let waiting = [lane("a", 3), lane("b", 3)];
        let picks: Vec<String> = (0..6)
            .map(|_| s.next(&waiting, |_| 1, |_| false).unwrap().tenant)
            .collect();
        assert_eq!(picks.iter().filter(|t| *t == "a").count(), 3);
        assert_eq!(picks.iter().filter(|t| *t == "b").count(), 3);
        // Never the same tenant three times running.
        assert!(picks.windows(3).all(|w| !(w[0] == w[1] && w[1] == w[2])));
    }

    #[test]
    fn weights_set_the_shares() {
        let mut s = Scheduler::new();
        let waiting = [lane("a", 3), lane("b", 3)];
        let w = |t: &str| if t == "a" { 3 } else { 1 };
        let a = (0..40)
            .filter(|_| s.next(&waiting, w, |_| false).unwrap().tenant == "a")
            .count();
        assert_eq!(a, 30);
    }

    #[test]
    fn priority_orders_a_tenants_own_jobs_only() {
        let mut s = Scheduler::new();
        let waiting = [lane("a", 5), lane("a", 1), lane("b", 4)];
        let got: Vec<Lane> = (0..2)
            .map(|_| s.next(&waiting, |_| 1, |_| false).unwrap())
            .collect();
        assert!(got.contains(&lane("a", 1)));
        assert!(got.contains(&lane("b", 4)));
    }

    #[test]
    fn a_blocked_tenant_is_skipped_and_an_idle_one_banks_nothing() {
        let mut s = Scheduler::new();
        let ab = [lane("a", 3), lane("b", 3)];
        let only_a = [lane("a", 3)];
        assert_eq!(s.next(&ab, |_| 1, |t| t == "a").unwrap().tenant, "b");
        for _ in 0..10 {
            s.next(&only_a, |_| 1, |_| false);
        }
        // b was idle while a ran alone: b does not get ten turns in a row.
        let picks: Vec<String> = (0..4)
            .map(|_| s.next(&ab, |_| 1, |_| false).unwrap().tenant)
            .collect();
        assert_eq!(picks.iter().filter(|t| *t == "b").count(), 2);
        assert_eq!(s.next(&ab, |_| 1, |_| true), None);
    }

    #[test]
    fn bad_values_say_what_is_allowed() {
        assert!(check_tenant("acme-1_x").is_ok());
        assert!(check_tenant("").is_err());
        assert!(check_tenant("a.b").unwrap_err().contains("letters"));
        assert!(check_tenant(&"x".repeat(65)).is_err());
        assert!(check_priority(0).unwrap_err().contains("1..=5"));
        assert!(check_priority(6).is_err());
        assert!(Lane::from_tokens("acme", "two").is_err());
        assert_eq!(Lane::from_tokens("acme", "2").unwrap(), lane("acme", 2));
        assert!(check_weight(0).is_err());
    }
}
