//! Admission: what this process may use of a key's limits now, one request
//! admitted or told how long to wait, and the demand the coordinator reads.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::limits::{Grid, Limits, ProviderInfo, Slice};
use tokio::time::Instant;

use super::{
    Demand, Flow, KeyState, Permit, ProviderKey, Wait, BURST, FIRST_LEASE_GRACE, SLOT_LATENESS,
};

impl Flow {
    /// What this process may use of `limits` now, and where on the fleet's
    /// grid: its lease's slice while it lasts; without one, nothing until
    /// the coordinator grants one, unless its last renewal did not land
    /// (NATS away): then a local share, off the grid: the local fraction,
    /// or the limit over the workers last known, or nothing while none is
    /// known (never the whole limit); without a coordinator, everything.
    ///
    /// A lease given back while idle is not a failure: a worker whose
    /// share ended that way waits for its next grant, so two workers that
    /// were idle together never both take a limit of one (each a local
    /// share of "at least 1").
    fn allowance(&self, s: &KeyState, limits: &Limits, now: Instant) -> (Slice, Option<Grid>) {
        let total = limits.as_slice();
        match s.slice {
            Some((slice, until, grid)) if until > now => (
                Slice {
                    requests_per_sec: slice.requests_per_sec.min(total.requests_per_sec),
                    tokens_per_sec: slice.tokens_per_sec.min(total.tokens_per_sec),
                    concurrency: slice.concurrency.min(total.concurrency),
                },
                grid,
            ),
            _ if !self.coordinated() => (total, None),
            // No renewal failed: the coordinator grants one at its next tick.
            _ if !s.lost => (Slice::default(), None),
            // The first lease failed: wait a moment for a retry, not longer.
            None if now.duration_since(s.created) < FIRST_LEASE_GRACE => (Slice::default(), None),
            _ => match (
                *self.local_fraction.lock().expect("flow fraction"),
                s.workers,
            ) {
                (Some(f), _) => (total.fraction(f), None),
                (None, Some(n)) => (total.share(n), None),
                (None, None) => (Slice::default(), None),
            },
        }
    }

    /// Admits one request of `key` estimated at `tokens`, or says why and
    /// how long it must wait. Never blocks.
    pub fn try_admit(self: &Arc<Self>, key: &ProviderKey, tokens: u64) -> Result<Permit, Wait> {
        self.ensure(key);
        let limits = self.limits(&key.id);
        let mut g = self.keys.lock().expect("flow lock");
        let s = g.get_mut(&key.id).expect("key ensured");
        let now = Instant::now();
        if let Some((at, until, reason, breaker)) = s.pause.clone() {
            if at > now {
                // Its waiters keep the lease: they send after the pause.
                s.retry_at = s.retry_at.max(Some(at));
                return Err(Wait::Paused {
                    until,
                    at,
                    reason,
                    breaker,
                });
            }
            s.pause = None;
        }
        let Some(limits) = limits else {
            s.in_flight += 1;
            s.stats.in_flight = s.in_flight;
            s.stats.admitted += 1;
            s.stats.admitted_tokens += tokens;
            return Ok(Permit {
                flow: self.clone(),
                id: key.id.clone(),
                seq: open_request(s),
                admitted: Instant::now(),
                reserved: 0,
                limited: false,
                tenant: None,
            });
        };
        let (a, grid) = self.allowance(s, &limits, now);
        // A bucket holds one second of its slice (a fraction of a request
        // when the slice is below one a second: the request then waits
        // until that fraction is full, `1 / slice` after the last).
        let cap = a.requests_per_sec * BURST;
        if !s.primed && a.concurrency > 0 {
            s.primed = true;
            s.requests.level = cap;
            s.tokens.level = a.tokens_per_sec * BURST;
        }
        s.requests.refill(a.requests_per_sec, cap, now);
        s.tokens
            .refill(a.tokens_per_sec, a.tokens_per_sec * BURST, now);
        // Below one request a second, on the fleet's grid: this worker's
        // slots only, one request each.
        let on_grid = grid.filter(|_| a.requests_per_sec.is_finite() && cap < 1.0);
        let slot = on_grid.map(|g| next_slot(&g, s.last_slot, now));
        let refusal = if s.in_flight >= a.concurrency {
            Some(("concurrency", now + Duration::from_millis(200)))
        } else if let Some(Err(retry)) = slot {
            Some(("rpm", retry))
        } else if on_grid.is_none()
            && a.requests_per_sec.is_finite()
            && s.requests.level < cap.min(1.0)
        {
            let need = cap.min(1.0) - s.requests.level;
            Some(("rpm", now + wait_for(need, a.requests_per_sec)))
        } else if a.tokens_per_sec.is_finite()
            && s.tokens.level < (tokens as f64).min(a.tokens_per_sec * BURST)
        {
            let need = (tokens as f64).min(a.tokens_per_sec * BURST) - s.tokens.level;
            Some(("tpm", now + wait_for(need, a.tokens_per_sec)))
        } else {
            None
        };
        if let Some((limit, retry)) = refusal {
            s.waiting += 1;
            s.retry_at = s.retry_at.max(Some(retry));
            return Err(Wait::Limited { retry, limit });
        }
        if let Some(Ok(k)) = slot {
            s.last_slot = Some(k);
        } else if a.requests_per_sec.is_finite() {
            s.requests.level -= 1.0;
        }
        if a.tokens_per_sec.is_finite() {
            s.tokens.level -= tokens as f64;
        }
        s.in_flight += 1;
        s.peak = s.peak.max(s.in_flight);
        s.asked_requests += 1;
        s.asked_tokens += tokens;
        s.stats.in_flight = s.in_flight;
        s.stats.admitted += 1;
        s.stats.admitted_tokens += tokens;
        Ok(Permit {
            flow: self.clone(),
            id: key.id.clone(),
            seq: open_request(s),
            admitted: Instant::now(),
            reserved: tokens,
            limited: a.tokens_per_sec.is_finite(),
            tenant: None,
        })
    }

    /// Admits one request of `key` for `tenant` (when the tenant has model
    /// limits, against those first, then the provider's): one permit
    /// holding both, or why it must wait. Never blocks.
    pub fn try_admit_for(
        self: &Arc<Self>,
        key: &ProviderKey,
        tenant: Option<&str>,
        tokens: u64,
    ) -> Result<Permit, Wait> {
        let tkey = tenant
            .map(crate::limits::tenant_model_key)
            .filter(|id| self.limits(id).is_some())
            .map(|id| ProviderKey {
                id,
                info: ProviderInfo::default(),
            });
        let held = match &tkey {
            Some(k) => Some(self.try_admit(k, tokens)?),
            None => None,
        };
        match self.try_admit(key, tokens) {
            Ok(mut p) => {
                p.tenant = held.map(Box::new);
                Ok(p)
            }
            Err(w) => {
                // The tenant's reservation goes back: nothing was sent.
                if let Some(mut h) = held {
                    h.reconcile(0);
                }
                Err(w)
            }
        }
    }

    /// A request that waited (once per request), or gave up waiting.
    pub fn count(&self, id: &str, waited: bool, refused: bool) {
        if let Some(s) = self.keys.lock().expect("flow lock").get_mut(id) {
            s.stats.waited += u64::from(waited);
            s.stats.refused += u64::from(refused);
        }
    }

    /// Resolves when a slot, a slice or a limit changed.
    pub async fn changed(&self) {
        self.changed.notified().await
    }

    /// What the key's users asked for since the last call (the
    /// coordinator's want for the next lease): the measured rates with
    /// headroom, and when requests waited, the whole limit.
    pub fn demand(&self, id: &str) -> Demand {
        let limits = self.limits(id).unwrap_or_default();
        let mut g = self.keys.lock().expect("flow lock");
        let Some(s) = g.get_mut(id) else {
            return Demand::default();
        };
        let now = Instant::now();
        let secs = now.duration_since(s.since).as_secs_f64().max(0.25);
        let held = s.slice.map(|x| x.0).unwrap_or_default();
        let total = limits.as_slice();
        let pending = s.retry_at.is_some_and(|t| t > now);
        let grow = s.waiting > 0 || pending;
        // Requests waited: ask for the whole limit (the lease record's
        // water filling splits it between those who want it), so a fleet
        // short of its limit reaches it at the next renewal.
        let pick = |measured: f64, _held: f64, limit: f64| {
            if grow {
                limit
            } else {
                (measured * 1.25).min(limit)
            }
        };
        let want = Slice {
            requests_per_sec: pick(
                s.asked_requests as f64 / secs,
                held.requests_per_sec,
                total.requests_per_sec,
            ),
            tokens_per_sec: pick(
                s.asked_tokens as f64 / secs,
                held.tokens_per_sec,
                total.tokens_per_sec,
            ),
            concurrency: (s.peak.max(s.in_flight) + s.waiting.min(64) + u64::from(grow))
                .min(total.concurrency),
        };
        let active = s.in_flight > 0 || s.asked_requests > 0 || grow;
        s.asked_requests = 0;
        s.asked_tokens = 0;
        s.waiting = 0;
        s.peak = s.in_flight;
        s.since = now;
        Demand { want, active }
    }
}

/// Numbers a request admitted for `s`'s key, in flight from now on.
fn open_request(s: &mut KeyState) -> u64 {
    let n = s.next_request;
    s.next_request += 1;
    s.open.insert(n, None);
    n
}

/// This worker's grid slot to send in now (`Ok`), or when its next one
/// starts (`Err`): the current slot if it is ours, unused and not more
/// than [`SLOT_LATENESS`] gone.
fn next_slot(g: &Grid, last: Option<i64>, now: Instant) -> Result<i64, Instant> {
    let wall = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    let k = g.slot_at(wall);
    let into = wall - g.start_of(k);
    if g.owns(k) && last != Some(k) && into <= SLOT_LATENESS / g.rate {
        return Ok(k);
    }
    match g.next_from(k + 1) {
        Some(next) => Err(now + Duration::from_secs_f64((g.start_of(next) - wall).max(0.001))),
        None => Err(now + Duration::from_secs(1)),
    }
}

fn wait_for(need: f64, per_sec: f64) -> Duration {
    if per_sec <= 0.0 {
        Duration::from_millis(250)
    } else {
        Duration::from_secs_f64((need / per_sec).clamp(0.001, 5.0))
    }
}
