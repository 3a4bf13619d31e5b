//! `leasehold-flow`: fleet-wide flow control, in one crate.
//!
//! - [`limits`]: the pure part: provider and tenant limits, the lease record
//!   that splits them between workers, the request grid, fair shares.
//! - [`Flow`]: admission. Every model request of the process, and every job
//!   of a limited tenant, is admitted here first.
//!
//! The fleet's coordination over NATS (the limits bucket, leases, pauses)
//! is the store's adapter (`store::flow::FlowStore`) and the worker's loop;
//! nothing here does I/O.
//!
//! ## Admission
//!
//!
//! One [`Flow`] per worker (made by the worker and handed to every run's
//! `RunContext`: no process global) knows, per provider key
//! (base URL + model + a hash of the credential: [`ProviderKey`]):
//! - a **pause** (a cooldown after a 429 with `Retry-After` or a quota
//!   error, or an open circuit breaker), seen here or by any worker of the
//!   fleet: no request starts before it ends;
//! - its **limits** (RPM, TPM, concurrency) and this process's **slice** of
//!   them (a lease the coordinator renews), enforced locally with two
//!   continuously refilling buckets and a slot count; tokens are reserved
//!   from an estimate and reconciled from the response's `usage`.
//!
//! Nothing here does I/O. The fleet's coordination (the worker's, over
//! NATS) is injected: it feeds limits, slices and remote pauses in
//! ([`Flow::set_limits`], [`Flow::set_slice`], [`Flow::pause`]), takes the
//! demand out ([`Flow::demand`]) and publishes what [`Flow::outbound`]
//! yields. Without a coordinator a process enforces the limits alone and
//! its pauses are its own. A key without a live slice waits for the
//! coordinator's grant (before its first lease, after it gave the lease
//! back when idle, while a renewal is on its way); only when a renewal did
//! not land ([`Flow::lease_failed`]: NATS away) does the process fall back
//! to a safe local share once its slice ended: the limit divided by the
//! workers it last knew of, or [`Flow::set_local_fraction`] of it; knowing
//! of none, it waits.
//!
//! A bucket holds one second of its slice, never more: a slice below one
//! request per second sends on its slots of the fleet's request grid
//! ([`crate::limits::Grid`]), or without one (a local share)
//! spaces its requests `1 / slice` apart, so it never holds a request in
//! hand that it is not owed.
//!
//! **How many requests a provider serves at once** is learned here too. Each
//! request in flight is numbered, and notes its first token
//! ([`Permit::first_token`]); its end ([`Permit::ended`]) is judged by one
//! rule ([`sign`]): a stream the server ended itself (`[DONE]`) before its
//! finish reason while another request of the same key waited for its
//! first token is
//! the mark of a server that runs one generation at a time and cuts the one
//! in flight for a newcomer (llama-cpp-python's server by default). When
//! that repeats ([`LEARN_AFTER`] times with no sign between of two requests
//! generating at once), the key gets a learned concurrency of 1
//! ([`Flow::set_learned`]), published for the fleet through the coordinator
//! ([`Outbound::Learned`]) and then split by the leases like any limit. A
//! concurrency set by hand (`leasehold limits set --concurrency` for the
//! fleet, [`Flow::configure`] from `LH_MODEL_CONCURRENCY` for this process)
//! always wins over the learned one ([`crate::limits::concurrency_of`]).
//!
//! Tenants are limited the same way: a key `tenant.<name>.jobs` whose
//! concurrency is the tenant's running jobs (admitted by the worker before
//! it takes a job of the tenant), and `tenant.<name>.model` for the model
//! requests of the tenant's jobs ([`with_tenant`] says whose job a request
//! is for). Each tenant's weight (its share under contention) is kept here
//! too ([`Flow::set_weight`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use leasehold_telemetry::observe::Observer;

use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

mod admit;
pub mod limits;
pub mod metrics;
mod permit;
mod serving;
#[cfg(test)]
mod tests;

pub use limits::*;
pub use permit::Permit;
pub use serving::{sign, Serving, Sign, LEARN_AFTER, READ_SKEW};

/// A provider key: who is limited. The id hashes the credential.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ProviderKey {
    pub id: String,
    pub info: ProviderInfo,
}

impl ProviderKey {
    pub fn new(base_url: &str, model: &str, credential: Option<&str>) -> ProviderKey {
        let (id, info) = crate::limits::provider_key(base_url, model, credential);
        ProviderKey { id, info }
    }

    /// What logs, events and the CLI call it (never the credential).
    pub fn label(&self) -> String {
        format!(
            "{} {}",
            leasehold_telemetry::redact_url(&self.info.base_url),
            self.info.model
        )
    }
}

/// Something the coordinator publishes for the fleet.
#[derive(Debug, Clone)]
pub enum Outbound {
    /// A 429 or quota error: the key is paused until then.
    Cooldown {
        key: ProviderKey,
        until: SystemTime,
        reason: String,
    },
    /// This process's circuit breaker for the key opened until then.
    BreakerOpen {
        key: ProviderKey,
        until: SystemTime,
        cause: String,
    },
    /// The key was found to serve `concurrency` requests at once.
    Learned {
        key: ProviderKey,
        concurrency: u64,
        reason: String,
    },
}

/// Why a request must wait, and until when.
#[derive(Debug, Clone)]
pub enum Wait {
    /// The key is paused (cooldown or open breaker) until `until`.
    Paused {
        until: SystemTime,
        at: Instant,
        reason: String,
        breaker: bool,
    },
    /// Over the limit (or this worker's slice of it): try again at `retry`.
    Limited { retry: Instant, limit: &'static str },
}

/// What this process asked for since the coordinator last looked.
#[derive(Debug, Clone, Copy, Default)]
pub struct Demand {
    /// Its wish for the next lease period.
    pub want: Slice,
    /// Whether anything is held or asked (no: the lease may be given back).
    pub active: bool,
}

/// Counters for `/metrics` and `leasehold limits list`.
#[derive(Debug, Clone, Default)]
pub struct KeyStats {
    pub admitted: u64,
    pub admitted_tokens: u64,
    pub waited: u64,
    pub refused: u64,
    pub cooldowns: u64,
    pub in_flight: u64,
}

#[derive(Debug)]
struct Bucket {
    level: f64,
    at: Instant,
}

impl Bucket {
    fn refill(&mut self, per_sec: f64, cap: f64, now: Instant) {
        if per_sec.is_finite() {
            self.level =
                (self.level + now.duration_since(self.at).as_secs_f64() * per_sec).min(cap);
        }
        self.at = now;
    }
}

#[derive(Debug)]
struct KeyState {
    key: ProviderKey,
    /// The slice granted, until when, and its place on the fleet's request
    /// grid (`None`: never granted).
    slice: Option<(Slice, Instant, Option<Grid>)>,
    /// Workers known at the last read of the lease record (the local
    /// share's divisor; `None`: never read).
    workers: Option<u64>,
    /// The coordinator's last renewal did not land (NATS away, the write
    /// refused, lost to other workers' writes every time): once the slice
    /// ended, the local share applies. `false` while renewals land, before
    /// the first one, and after the lease was given back: a key without a
    /// live slice then waits for the coordinator's next grant, never uses a
    /// share nobody granted.
    lost: bool,
    /// The last grid slot a request was sent in.
    last_slot: Option<i64>,
    requests: Bucket,
    tokens: Bucket,
    in_flight: u64,
    /// The buckets were filled once (a new key starts with a full second).
    primed: bool,
    /// Requests in flight by number: when each had its first token.
    open: BTreeMap<u64, Option<Instant>>,
    next_request: u64,
    /// Streams cut for another request since the last sign that the
    /// provider generates two at once.
    cuts: u32,
    pause: Option<(Instant, SystemTime, String, bool)>,
    // Demand since the coordinator last looked.
    asked_requests: u64,
    asked_tokens: u64,
    waiting: u64,
    /// The latest time a refused request was told to try again: until
    /// then it still waits (a slot many seconds away is demand, though no
    /// request asks meanwhile).
    retry_at: Option<Instant>,
    peak: u64,
    since: Instant,
    created: Instant,
    stats: KeyStats,
}

tokio::task_local! {
    static TENANT: String;
}

/// Runs `f` as work for `tenant`: the model requests it makes (on its own
/// task) are admitted against the tenant's model limits as well.
pub async fn with_tenant<F: std::future::Future>(tenant: String, f: F) -> F::Output {
    TENANT.scope(tenant, f).await
}

/// The tenant the current task works for, if one was set.
pub fn current_tenant() -> Option<String> {
    TENANT.try_with(|t| t.clone()).ok()
}

/// The process's admission of model requests (module docs).
pub struct Flow {
    /// The fleet's limits were read once (or there are none to read).
    loaded: tokio::sync::watch::Sender<bool>,
    weights: Mutex<HashMap<String, u32>>,
    keys: Mutex<HashMap<String, KeyState>>,
    /// Limits set for the fleet (`lh_limits`), by key id.
    limits: Mutex<HashMap<String, Limits>>,
    /// This process's concurrency per key (`LH_MODEL_CONCURRENCY`).
    configured: Mutex<HashMap<String, u64>>,
    /// What the fleet learned of each key (`lh_flow` `learned.<id>`).
    learned: Mutex<HashMap<String, Learned>>,
    local_fraction: Mutex<Option<f64>>,
    outbound: Mutex<Option<mpsc::UnboundedSender<Outbound>>>,
    changed: Notify,
    /// Where admissions, pauses and (through each run's context) model
    /// requests are counted: the worker's metrics.
    observer: Arc<dyn Observer>,
}

/// The refill a bucket holds at most: one second of its rate (so a
/// worker's burst never exceeds its slice of the fleet's second, and the
/// fleet's never exceeds a provider bucket of one second).
const BURST: f64 = 1.0;

/// How late in its grid slot a request may still go (a fraction of the
/// slot): a later one waits for the worker's next slot, so two workers'
/// slots never send closer together than half a slot.
const SLOT_LATENESS: f64 = 0.5;

/// How long a coordinated process whose first renewal of a key failed
/// waits (for a retry) before it uses the local share instead.
const FIRST_LEASE_GRACE: Duration = Duration::from_secs(2);

impl Flow {
    /// A flow control that counts nothing ([`Flow::observed`] counts).
    pub fn new() -> Flow {
        Flow::observed(leasehold_telemetry::observe::none())
    }

    /// A flow control reporting to `observer` (a worker's metrics).
    pub fn observed(observer: Arc<dyn Observer>) -> Flow {
        Flow {
            observer,
            loaded: tokio::sync::watch::channel(false).0,
            weights: Mutex::new(HashMap::new()),
            keys: Mutex::new(HashMap::new()),
            limits: Mutex::new(HashMap::new()),
            configured: Mutex::new(HashMap::new()),
            learned: Mutex::new(HashMap::new()),
            local_fraction: Mutex::new(None),
            outbound: Mutex::new(None),
            changed: Notify::new(),
        }
    }

    /// What this flow control reports to (the worker's metrics, or nothing).
    pub fn observer(&self) -> &dyn Observer {
        self.observer.as_ref()
    }

    /// Starts handing fleet-wide pauses to a coordinator (the previous one
    /// stops receiving).
    pub fn outbound(&self) -> mpsc::UnboundedReceiver<Outbound> {
        let (tx, rx) = mpsc::unbounded_channel();
        *self.outbound.lock().expect("flow outbound") = Some(tx);
        rx
    }

    /// A coordinator is installed: slices come from leases.
    fn coordinated(&self) -> bool {
        self.outbound
            .lock()
            .expect("flow outbound")
            .as_ref()
            .is_some_and(|t| !t.is_closed())
    }

    /// The local share when a lease ended unrenewed: this fraction of each
    /// limit instead of limit / known workers.
    pub fn set_local_fraction(&self, f: Option<f64>) {
        *self.local_fraction.lock().expect("flow fraction") = f;
    }

    /// Sets (or with `None` clears) a key's limits, by id.
    pub fn set_limits(&self, id: &str, limits: Option<Limits>) {
        {
            let mut l = self.limits.lock().expect("flow limits");
            match limits.filter(|l| !l.is_empty()) {
                Some(v) => l.insert(id.to_string(), v),
                None => l.remove(id),
            };
        }
        self.changed.notify_waiters();
    }

    /// The fleet's limits are known (read once by the coordinator, or there
    /// is no coordination to wait for).
    pub fn mark_loaded(&self) {
        self.loaded.send_replace(true);
    }

    /// Waits until [`Flow::mark_loaded`], at most `patience`: `false` when
    /// the limits are still not known (a worker takes no job before it
    /// knows its tenant's limits, and says why it waits).
    pub async fn wait_loaded(&self, patience: Duration) -> bool {
        let mut rx = self.loaded.subscribe();
        let loaded = tokio::time::timeout(patience, rx.wait_for(|l| *l)).await;
        loaded.is_ok()
    }

    /// Sets (or with `None` clears) a tenant's weight.
    pub fn set_weight(&self, tenant: &str, weight: Option<u32>) {
        let mut w = self.weights.lock().expect("flow weights");
        match weight {
            Some(v) => w.insert(tenant.to_string(), v.max(1)),
            None => w.remove(tenant),
        };
    }

    /// A tenant's weight: 1 unless set.
    pub fn weight(&self, tenant: &str) -> u32 {
        self.weights
            .lock()
            .expect("flow weights")
            .get(tenant)
            .copied()
            .unwrap_or(1)
    }

    /// The limits in force for a key: those set for the fleet, their
    /// concurrency (when they set none) from this process's setting or
    /// else from what was learned.
    pub fn limits(&self, id: &str) -> Option<Limits> {
        let mut l = self
            .limits
            .lock()
            .expect("flow limits")
            .get(id)
            .copied()
            .unwrap_or_default();
        l.concurrency = self.concurrency(id).map(|(c, _)| c);
        (!l.is_empty()).then_some(l)
    }

    /// A key's concurrency and where it comes from (`None`: unlimited).
    pub fn concurrency(&self, id: &str) -> Option<(u64, ConcurrencySource)> {
        let set = self
            .limits
            .lock()
            .expect("flow limits")
            .get(id)
            .and_then(|l| l.concurrency);
        let configured = self
            .configured
            .lock()
            .expect("flow configured")
            .get(id)
            .copied();
        let learned = self
            .learned
            .lock()
            .expect("flow learned")
            .get(id)
            .map(|l| l.concurrency);
        concurrency_of(set, configured, learned)
    }

    /// This process's concurrency for a key (`LH_MODEL_CONCURRENCY`;
    /// `None`: not set). Cheap when unchanged: called before each request.
    pub fn configure(&self, key: &ProviderKey, concurrency: Option<u64>) {
        let changed = {
            let mut c = self.configured.lock().expect("flow configured");
            match concurrency {
                Some(n) => c.insert(key.id.clone(), n) != Some(n),
                None => c.remove(&key.id).is_some(),
            }
        };
        if changed {
            self.changed.notify_waiters();
        }
    }

    /// What the fleet learned of a key (from `lh_flow`), or `None` when it
    /// was cleared.
    pub fn set_learned(&self, id: &str, learned: Option<Learned>) {
        {
            let mut l = self.learned.lock().expect("flow learned");
            match learned {
                Some(v) => l.insert(id.to_string(), v),
                None => l.remove(id),
            };
        }
        self.changed.notify_waiters();
    }

    /// The key's learned concurrency, if any.
    pub fn learned(&self, id: &str) -> Option<Learned> {
        self.learned.lock().expect("flow learned").get(id).cloned()
    }

    /// Learns that `key` serves `concurrency` requests at once: applied
    /// here at once, and for the fleet through the coordinator.
    fn learn(&self, key: &ProviderKey, concurrency: u64, reason: &str) {
        tracing::warn!(provider = %key.label(), concurrency, "{reason}; concurrency {concurrency} from now on (learned; LH_MODEL_CONCURRENCY or `leasehold limits set --concurrency` sets it by hand)");
        self.set_learned(
            &key.id,
            Some(Learned {
                concurrency,
                reason: reason.to_string(),
                by: String::new(),
                at_ms: SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or(0),
                provider: key.info.clone(),
            }),
        );
        self.send(Outbound::Learned {
            key: key.clone(),
            concurrency,
            reason: reason.to_string(),
        });
    }

    /// Every key seen, with its counters.
    pub fn keys(&self) -> Vec<(ProviderKey, KeyStats)> {
        let g = self.keys.lock().expect("flow lock");
        g.values()
            .map(|s| (s.key.clone(), s.stats.clone()))
            .collect()
    }

    /// The coordinator's grant: this process's slice until `until`, out of
    /// `workers` live ones, and its place on the fleet's request grid.
    pub fn set_slice(
        &self,
        id: &str,
        slice: Slice,
        until: Instant,
        workers: u64,
        grid: Option<Grid>,
    ) {
        if let Some(s) = self.keys.lock().expect("flow lock").get_mut(id) {
            s.slice = Some((slice, until, grid));
            s.workers = Some(workers.max(1));
            s.lost = false;
        }
        self.changed.notify_waiters();
    }

    /// The coordinator's renewal did not land (its read or write failed,
    /// took too long, or lost every retry): once the slice ends, this
    /// process uses its local share, out of `workers` live ones when the
    /// record was read (else the count last known).
    pub fn lease_failed(&self, id: &str, workers: Option<u64>) {
        if let Some(s) = self.keys.lock().expect("flow lock").get_mut(id) {
            if let Some(n) = workers {
                s.workers = Some(n.max(1));
            }
            s.lost = true;
        }
        self.changed.notify_waiters();
    }

    /// Pauses the key until `until` (a cooldown seen by another worker, or
    /// its open breaker). A pause never shortens a later one.
    pub fn pause(&self, id: &str, until: SystemTime, reason: &str, breaker: bool) {
        let left = until
            .duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO);
        if left.is_zero() {
            return;
        }
        self.ensure(&ProviderKey {
            id: id.to_string(),
            info: ProviderInfo::default(),
        });
        let mut g = self.keys.lock().expect("flow lock");
        if let Some(s) = g.get_mut(id) {
            if s.pause.as_ref().is_none_or(|p| p.1 < until) {
                s.pause = Some((Instant::now() + left, until, reason.to_string(), breaker));
                s.stats.cooldowns += 1;
                self.observer.flow_pause(
                    &s.key.info.model,
                    if breaker { "breaker" } else { "cooldown" },
                );
            }
        }
    }

    /// A 429 (or quota error) seen here: pauses the key here at once and
    /// for the fleet through the coordinator.
    pub fn cooldown(&self, key: &ProviderKey, until: SystemTime, reason: &str) {
        self.ensure(key);
        self.pause(&key.id, until, reason, false);
        self.send(Outbound::Cooldown {
            key: key.clone(),
            until,
            reason: reason.to_string(),
        });
    }

    /// This process's breaker for the key opened: the fleet's opens too.
    pub fn breaker_opened(&self, key: &ProviderKey, until: SystemTime, cause: &str) {
        self.send(Outbound::BreakerOpen {
            key: key.clone(),
            until,
            cause: cause.to_string(),
        });
    }

    /// The pause in force for a key, if any: (until, reason, breaker).
    pub fn paused(&self, id: &str) -> Option<(Instant, SystemTime, String, bool)> {
        let g = self.keys.lock().expect("flow lock");
        g.get(id)
            .and_then(|s| s.pause.clone())
            .filter(|p| p.0 > Instant::now())
    }

    fn send(&self, o: Outbound) {
        if let Some(tx) = self.outbound.lock().expect("flow outbound").as_ref() {
            let _ = tx.send(o);
        }
    }

    fn ensure(&self, key: &ProviderKey) {
        let mut g = self.keys.lock().expect("flow lock");
        if let Some(s) = g.get_mut(&key.id) {
            // A key first seen in a fleet's pause learns who it is.
            if s.key.info.base_url.is_empty() && !key.info.base_url.is_empty() {
                s.key.info = key.info.clone();
            }
        } else {
            let now = Instant::now();
            g.insert(
                key.id.clone(),
                KeyState {
                    key: key.clone(),
                    slice: None,
                    workers: None,
                    lost: false,
                    last_slot: None,
                    requests: Bucket {
                        level: 0.0,
                        at: now,
                    },
                    tokens: Bucket {
                        level: 0.0,
                        at: now,
                    },
                    in_flight: 0,
                    primed: false,
                    open: BTreeMap::new(),
                    next_request: 0,
                    cuts: 0,
                    pause: None,
                    asked_requests: 0,
                    asked_tokens: 0,
                    waiting: 0,
                    retry_at: None,
                    peak: 0,
                    since: now,
                    created: now,
                    stats: KeyStats::default(),
                },
            );
        }
    }
}

impl Default for Flow {
    fn default() -> Self {
        Flow::new()
    }
}
