//! Flow control: every model request of the process is admitted here first.
//!
//! One [`Flow`] per process ([`Flow::global`]) knows, per provider key
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
//! its pauses are its own. When a slice's lease ends unrenewed (NATS away)
//! or was never granted, the process falls back to a safe local share: the
//! limit divided by the workers it last knew of, or
//! [`Flow::set_local_fraction`] of it; knowing of none, it waits.
//!
//! A bucket holds one second of its slice, never more: a slice below one
//! request per second sends on its slots of the fleet's request grid
//! ([`leasehold_core::flow::Grid`]), or without one (a local share)
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
//! always wins over the learned one ([`leasehold_core::flow::concurrency_of`]).
//!
//! Tenants are limited the same way: a key `tenant.<name>.jobs` whose
//! concurrency is the tenant's running jobs (admitted by the worker before
//! it takes a job of the tenant), and `tenant.<name>.model` for the model
//! requests of the tenant's jobs ([`with_tenant`] says whose job a request
//! is for). Each tenant's weight (its share under contention) is kept here
//! too ([`Flow::set_weight`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use leasehold_core::flow::{
    concurrency_of, ConcurrencySource, Grid, Learned, Limits, ProviderInfo, Slice,
};
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

/// A provider key: who is limited. The id hashes the credential.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ProviderKey {
    pub id: String,
    pub info: ProviderInfo,
}

impl ProviderKey {
    pub fn new(base_url: &str, model: &str, credential: Option<&str>) -> ProviderKey {
        let (id, info) = leasehold_core::flow::provider_key(base_url, model, credential);
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

/// Cut streams (each with another request waiting) that make a learned
/// concurrency of 1.
pub const LEARN_AFTER: u32 = 2;

/// What one request's end said about how its provider serves requests
/// at once ([`Permit::ended`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Serving {
    /// Nothing to learn from.
    Nothing,
    /// Cut for another request: the `seen`th such cut of [`LEARN_AFTER`].
    Cut { seen: u32 },
    /// This cut made it: the key's concurrency is 1 from now on, for the
    /// fleet.
    Learned,
    /// Cut while the key's concurrency is already 1 (the request was
    /// admitted before that applied).
    Known,
    /// Cut for another request, but a concurrency above 1 is set by hand
    /// (`setting`): nothing is learned.
    SetByHand {
        concurrency: u64,
        setting: &'static str,
    },
}

impl Serving {
    /// The cut was the provider serving one request at a time, and
    /// learning (or what was learned) answers it: not a failure of the
    /// request.
    pub fn interrupted(&self) -> bool {
        matches!(
            self,
            Serving::Cut { .. } | Serving::Learned | Serving::Known
        )
    }
}

/// What a request's end shows ([`sign`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sign {
    Nothing,
    /// Cut while another request waited for its first token.
    Cut,
    /// Completed while another request was generating: the provider serves
    /// two at once.
    Parallel,
}

/// The one rule: request `me` ended (`cut`: the server ended its stream
/// itself, `[DONE]`, before a finish reason; `completed`: it completed;
/// `last`: when its last chunk came, or when it was admitted if none did)
/// while `open` (every request of the key in flight, by number, and when
/// its first token came) were in flight. A server that runs one generation
/// at a time and cuts it for a newcomer leaves exactly this mark: the
/// newcomer is in flight and was not generating while the cut stream still
/// moved (its first token comes after the cut, if it came already). This
/// process reads the two connections in its own order, so "after" allows
/// [`READ_SKEW`]. The newcomer may have been sent before the cut one and
/// reached the server after it. Another request that generated well before
/// this one's last chunk (by more than [`READ_SKEW`]), when this one
/// completed, shows the provider serves two at once. A connection that
/// just stops (no `[DONE]`: a transport failure, a crash), or a cut while
/// no other request waits, shows nothing.
pub fn sign(
    open: &BTreeMap<u64, Option<Instant>>,
    me: u64,
    cut: bool,
    completed: bool,
    last: Instant,
) -> Sign {
    let others = || open.iter().filter(|(n, _)| **n != me).map(|(_, f)| *f);
    if cut {
        if others().any(|first| first.is_none_or(|t| t + READ_SKEW > last)) {
            return Sign::Cut;
        }
    } else if completed && others().any(|first| first.is_some_and(|t| t + READ_SKEW < last)) {
        return Sign::Parallel;
    }
    Sign::Nothing
}

/// How far apart this process may read two responses' chunks that the
/// server sent in the other order (tasks on a busy host).
pub const READ_SKEW: Duration = Duration::from_millis(250);

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
}

/// An admitted request: holds its slot until dropped; [`Permit::reconcile`]
/// corrects the token reservation from the response's usage.
pub struct Permit {
    flow: Arc<Flow>,
    id: String,
    /// Its number among the key's requests, and when it was admitted.
    seq: u64,
    admitted: Instant,
    reserved: u64,
    /// Tokens were reserved against a limit (so they are reconciled).
    limited: bool,
    /// The permit of the tenant's model limits, held with this one.
    tenant: Option<Box<Permit>>,
}

impl Permit {
    /// The response used `tokens` (input + output): the reservation is
    /// corrected by the difference.
    pub fn reconcile(&mut self, tokens: u64) {
        if let Some(t) = self.tenant.as_mut() {
            t.reconcile(tokens);
        }
        if !self.limited {
            return;
        }
        let diff = tokens as f64 - self.reserved as f64;
        self.reserved = tokens;
        if let Some(s) = self.flow.keys.lock().expect("flow lock").get_mut(&self.id) {
            s.tokens.level -= diff;
            s.asked_tokens = s.asked_tokens.saturating_add_signed(diff as i64);
        }
    }
}

impl Permit {
    /// The response's first token (content or a tool call) arrived: the
    /// provider is generating it.
    pub fn first_token(&self) {
        mark_first_token(&self.flow, &self.id, self.seq);
    }

    /// [`Permit::first_token`] as a callback for the client (it is called
    /// while the response streams).
    pub fn first_token_hook(&self) -> Arc<dyn Fn() + Send + Sync> {
        let (flow, id, seq) = (self.flow.clone(), self.id.clone(), self.seq);
        Arc::new(move || mark_first_token(&flow, &id, seq))
    }

    /// The request ended (`cut`: the server ended its stream, `[DONE]`,
    /// before a finish reason; `completed`: it completed; `last_chunk`: when its last
    /// chunk came, if one did); called before the permit is dropped. What
    /// that says of how the provider serves requests at once ([`sign`]); a
    /// repeated cut learns a concurrency of 1 for the key (module docs).
    pub fn ended(&self, cut: bool, completed: bool, last_chunk: Option<Instant>) -> Serving {
        let flow = &self.flow;
        // Read before the key's lock (the order every caller keeps).
        let concurrency = flow.concurrency(&self.id);
        let mut g = flow.keys.lock().expect("flow lock");
        let Some(s) = g.get_mut(&self.id) else {
            return Serving::Nothing;
        };
        let last = last_chunk.unwrap_or(self.admitted);
        match sign(&s.open, self.seq, cut, completed, last) {
            Sign::Nothing => Serving::Nothing,
            Sign::Parallel => {
                s.cuts = 0;
                Serving::Nothing
            }
            Sign::Cut => match concurrency {
                Some((c, src)) if src.by_hand() && c > 1 => Serving::SetByHand {
                    concurrency: c,
                    setting: src.setting(),
                },
                Some(_) => Serving::Known,
                None => {
                    s.cuts += 1;
                    if s.cuts < LEARN_AFTER {
                        return Serving::Cut { seen: s.cuts };
                    }
                    s.cuts = 0;
                    let key = s.key.clone();
                    drop(g);
                    let reason = format!(
                        "{} ended {LEARN_AFTER} streams before their finish reason while another request waited: it serves one request at a time",
                        key.label()
                    );
                    flow.learn(&key, 1, &reason);
                    Serving::Learned
                }
            },
        }
    }
}

fn mark_first_token(flow: &Flow, id: &str, seq: u64) {
    if let Some(s) = flow.keys.lock().expect("flow lock").get_mut(id) {
        if let Some(first) = s.open.get_mut(&seq) {
            first.get_or_insert_with(Instant::now);
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(s) = self.flow.keys.lock().expect("flow lock").get_mut(&self.id) {
            s.in_flight = s.in_flight.saturating_sub(1);
            s.stats.in_flight = s.in_flight;
            s.open.remove(&self.seq);
        }
        self.flow.changed.notify_waiters();
    }
}

/// The refill a bucket holds at most: one second of its rate (so a
/// worker's burst never exceeds its slice of the fleet's second, and the
/// fleet's never exceeds a provider bucket of one second).
const BURST: f64 = 1.0;

/// How late in its grid slot a request may still go (a fraction of the
/// slot): a later one waits for the worker's next slot, so two workers'
/// slots never send closer together than half a slot.
const SLOT_LATENESS: f64 = 0.5;

/// How long a coordinated process waits for its first lease of a key
/// before it uses the local share instead.
const FIRST_LEASE_GRACE: Duration = Duration::from_secs(2);

impl Flow {
    pub fn new() -> Flow {
        Flow {
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

    /// The process's one flow control.
    pub fn global() -> Arc<Flow> {
        static FLOW: OnceLock<Arc<Flow>> = OnceLock::new();
        FLOW.get_or_init(|| Arc::new(Flow::new())).clone()
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

    /// Waits until [`Flow::mark_loaded`], at most `patience`: a worker takes
    /// no job before it knows its tenant's limits.
    pub async fn wait_loaded(&self, patience: Duration) {
        let mut rx = self.loaded.subscribe();
        let _ = tokio::time::timeout(patience, rx.wait_for(|l| *l)).await;
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
        }
        self.changed.notify_waiters();
    }

    /// The coordinator read the lease record but its write did not land:
    /// `workers` live ones are known (the local share's divisor).
    pub fn set_workers(&self, id: &str, workers: u64) {
        if let Some(s) = self.keys.lock().expect("flow lock").get_mut(id) {
            s.workers = Some(workers.max(1));
        }
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
                leasehold_telemetry::observe::flow_pause(
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

    /// What this process may use of `limits` now, and where on the fleet's
    /// grid: its lease's slice while it lasts; otherwise (never granted, or
    /// NATS away) a local share, off the grid: the local fraction, or the
    /// limit over the workers last known, or nothing while none is known
    /// (never the whole limit); without a coordinator, everything.
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
            // Not granted yet: wait for the first lease a moment, not longer.
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
            .map(leasehold_core::flow::tenant_model_key)
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

impl Default for Flow {
    fn default() -> Self {
        Flow::new()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn limits_pauses_and_slots() {
        let f = Arc::new(Flow::new());
        let k = ProviderKey::new("http://x/v1/", "m", Some("sk-secret"));
        assert!(!format!("{k:?}").contains("sk-secret"));
        assert_eq!(k, ProviderKey::new("http://x/v1", "m", Some("sk-secret")));
        assert_ne!(k.id, ProviderKey::new("http://x/v1", "m", Some("other")).id);
        // No limits: everything goes.
        let p = (0..50)
            .map(|_| f.try_admit(&k, 100).ok().unwrap())
            .collect::<Vec<_>>();
        drop(p);
        f.set_limits(
            &k.id,
            Some(Limits {
                rpm: None,
                tpm: None,
                concurrency: Some(2),
            }),
        );
        let a = f.try_admit(&k, 1).ok().unwrap();
        let _b = f.try_admit(&k, 1).ok().unwrap();
        assert!(matches!(
            f.try_admit(&k, 1),
            Err(Wait::Limited {
                limit: "concurrency",
                ..
            })
        ));
        drop(a);
        assert!(f.try_admit(&k, 1).is_ok());
        // A cooldown pauses everything until it ends.
        f.cooldown(&k, SystemTime::now() + Duration::from_secs(30), "429");
        assert!(matches!(f.try_admit(&k, 1), Err(Wait::Paused { .. })));
        f.set_limits(&k.id, None);
    }

    /// Below one request a second nothing is held in hand: off the grid
    /// the requests are `1 / slice` apart; on it, one per own slot.
    #[tokio::test(start_paused = true)]
    async fn a_slice_below_one_request_a_second_holds_no_request_in_hand() {
        let f = Arc::new(Flow::new());
        let _rx = f.outbound();
        let k = ProviderKey::new("http://z/v1", "m", None);
        f.set_limits(
            &k.id,
            Some(Limits {
                rpm: Some(120),
                tpm: None,
                concurrency: None,
            }),
        );
        f.ensure(&k);
        let half = Slice {
            requests_per_sec: 0.5,
            tokens_per_sec: f64::INFINITY,
            concurrency: u64::MAX,
        };
        f.set_slice(
            &k.id,
            half,
            Instant::now() + Duration::from_secs(60),
            4,
            None,
        );
        assert!(f.try_admit(&k, 1).is_ok());
        let Err(Wait::Limited { retry, .. }) = f.try_admit(&k, 1) else {
            panic!("a second request at once: a burst")
        };
        let gap = retry - Instant::now();
        assert!(gap >= Duration::from_millis(1990), "{gap:?}");
        tokio::time::advance(Duration::from_millis(1900)).await;
        assert!(f.try_admit(&k, 1).is_err());
        tokio::time::advance(Duration::from_millis(150)).await;
        assert!(f.try_admit(&k, 1).is_ok());
        // On the grid: one request in an own slot, the next in a later one.
        let grid = Grid {
            rate: 2.0,
            offset: 0.0,
            share: 0.25,
        };
        f.set_slice(
            &k.id,
            half,
            Instant::now() + Duration::from_secs(60),
            4,
            Some(grid),
        );
        let mut sent = None;
        for _ in 0..40 {
            match f.try_admit(&k, 1) {
                Ok(p) => {
                    sent = Some(p);
                    break;
                }
                Err(Wait::Limited { retry, .. }) => {
                    // The wall clock runs on: wait for the slot for real.
                    let left = retry - Instant::now();
                    assert!(left <= Duration::from_secs(30), "{left:?}");
                    std::thread::sleep(left.min(Duration::from_millis(600)));
                }
                Err(w) => panic!("{w:?}"),
            }
        }
        assert!(sent.is_some(), "an own slot came");
        assert!(f.try_admit(&k, 1).is_err(), "one request per slot");
    }

    /// A worker that never got a lease and never read the record waits
    /// past the grace: it never takes the whole limit; once it knows of
    /// two workers, half.
    #[tokio::test(start_paused = true)]
    async fn without_a_lease_a_worker_never_takes_the_whole_limit() {
        let f = Arc::new(Flow::new());
        let _rx = f.outbound();
        let k = ProviderKey::new("http://w/v1", "m", None);
        f.set_limits(
            &k.id,
            Some(Limits {
                rpm: None,
                tpm: None,
                concurrency: Some(4),
            }),
        );
        f.ensure(&k);
        tokio::time::advance(FIRST_LEASE_GRACE + Duration::from_millis(1)).await;
        assert!(f.try_admit(&k, 1).is_err(), "no worker known: it waits");
        f.set_workers(&k.id, 2);
        let p: Vec<_> = (0..2).map(|_| f.try_admit(&k, 1).ok().unwrap()).collect();
        assert!(f.try_admit(&k, 1).is_err(), "half of 4");
        drop(p);
    }

    #[test]
    fn a_cut_while_another_request_waits_is_the_sign_of_one_at_a_time() {
        let t0 = Instant::now();
        let at = |ms: u64| Some(t0 + Duration::from_millis(ms));
        let open = |v: &[(u64, Option<Instant>)]| v.iter().copied().collect::<BTreeMap<_, _>>();
        // The cut stream's last chunk came at 1000 ms.
        let last = t0 + Duration::from_millis(1000);
        // Cut while another request had no first token: the sign, whichever
        // was sent first (the newcomer may have been sent before, and
        // reached the server after).
        assert_eq!(
            sign(&open(&[(1, at(1)), (2, None)]), 1, true, false, last),
            Sign::Cut
        );
        assert_eq!(
            sign(&open(&[(0, None), (1, at(1))]), 1, true, false, last),
            Sign::Cut
        );
        // ... or had it after the cut, or read just before it (this
        // process reads the two streams in its own order).
        assert_eq!(
            sign(&open(&[(1, at(1)), (2, at(1010))]), 1, true, false, last),
            Sign::Cut
        );
        assert_eq!(
            sign(&open(&[(1, at(1)), (2, at(900))]), 1, true, false, last),
            Sign::Cut
        );
        // Cut while the other generated long before: the provider serves
        // both, this cut is something else; alone: nothing to say.
        assert_eq!(
            sign(&open(&[(1, at(1)), (2, at(100))]), 1, true, false, last),
            Sign::Nothing
        );
        assert_eq!(
            sign(&open(&[(1, at(1))]), 1, true, false, last),
            Sign::Nothing
        );
        // Completed while another generated long before its last chunk: two
        // at once.
        assert_eq!(
            sign(&open(&[(0, at(100)), (1, at(1))]), 1, false, true, last),
            Sign::Parallel
        );
        // Completed while another waits, or starts about when it ends (a
        // server that queues): nothing.
        assert_eq!(
            sign(&open(&[(1, at(1)), (2, None)]), 1, false, true, last),
            Sign::Nothing
        );
        assert_eq!(
            sign(&open(&[(1, at(1)), (2, at(900))]), 1, false, true, last),
            Sign::Nothing
        );
        // Failed otherwise: nothing.
        assert_eq!(
            sign(&open(&[(0, at(100)), (1, at(1))]), 1, false, false, last),
            Sign::Nothing
        );
    }

    /// A millisecond of the (paused) clock.
    async fn tick() {
        tokio::time::advance(Duration::from_millis(1)).await;
    }

    fn now() -> Option<Instant> {
        Some(Instant::now())
    }

    /// Three experts on a server that cuts the stream in flight for a
    /// newcomer: A is cut for B, then B for A's retry; the second cut
    /// learns a concurrency of 1, applied here and sent for the fleet; C,
    /// sent before it applied, is cut too: known, nothing new.
    #[tokio::test(start_paused = true)]
    async fn a_repeated_cut_learns_a_concurrency_of_one() {
        let f = Arc::new(Flow::new());
        let mut rx = f.outbound();
        let k = ProviderKey::new("http://one/v1", "m", None);
        let a = f.try_admit(&k, 1).ok().unwrap();
        a.first_token();
        tick().await;
        let b = f.try_admit(&k, 1).ok().unwrap();
        let c = f.try_admit(&k, 1).ok().unwrap();
        tick().await;
        assert_eq!(a.ended(true, false, now()), Serving::Cut { seen: 1 });
        drop(a);
        tick().await;
        b.first_token();
        let a2 = f.try_admit(&k, 1).ok().unwrap();
        tick().await;
        assert_eq!(b.ended(true, false, now()), Serving::Learned);
        drop(b);
        tick().await;
        c.first_token();
        tick().await;
        assert_eq!(c.ended(true, false, now()), Serving::Known);
        drop(c);
        assert_eq!(f.limits(&k.id).unwrap().concurrency, Some(1));
        assert_eq!(f.learned(&k.id).unwrap().concurrency, 1);
        match rx.try_recv() {
            Ok(Outbound::Learned {
                key,
                concurrency,
                reason,
            }) => {
                assert_eq!((key.id, concurrency), (k.id.clone(), 1));
                assert!(reason.contains("one request at a time"), "{reason}");
            }
            o => panic!("{o:?}"),
        }
        assert!(rx.try_recv().is_err(), "learned once");
        // One at a time from now on (and until its lease, none).
        assert!(f.try_admit(&k, 1).is_err());
        drop(a2);
        // Cleared for the fleet: gone here too.
        f.set_learned(&k.id, None);
        assert_eq!(f.limits(&k.id), None);
        assert!(f.try_admit(&k, 1).is_ok());
    }

    /// Two at once in between resets the count: two unrelated cuts of a
    /// server that serves in parallel learn nothing. A concurrency set by
    /// hand is never moved by a cut, and says which setting holds it.
    #[tokio::test(start_paused = true)]
    async fn a_parallel_answer_resets_the_count_and_a_hand_set_concurrency_wins() {
        let f = Arc::new(Flow::new());
        let k = ProviderKey::new("http://two/v1", "m", None);
        let a = f.try_admit(&k, 1).ok().unwrap();
        let b = f.try_admit(&k, 1).ok().unwrap();
        tick().await;
        assert_eq!(a.ended(true, false, now()), Serving::Cut { seen: 1 });
        drop(a);
        let c = f.try_admit(&k, 1).ok().unwrap();
        b.first_token();
        c.first_token();
        // Both generate for a while.
        tokio::time::advance(READ_SKEW * 2).await;
        assert_eq!(
            b.ended(false, true, now()),
            Serving::Nothing,
            "both generated"
        );
        drop(b);
        let d = f.try_admit(&k, 1).ok().unwrap();
        tick().await;
        assert_eq!(
            c.ended(true, false, now()),
            Serving::Cut { seen: 1 },
            "counted afresh"
        );
        drop(c);
        assert_eq!(f.limits(&k.id), None);
        // LH_MODEL_CONCURRENCY=4: a cut is not learned from.
        f.configure(&k, Some(4));
        assert_eq!(f.limits(&k.id).unwrap().concurrency, Some(4));
        let e = f.try_admit(&k, 1).ok().unwrap();
        tick().await;
        assert_eq!(
            d.ended(true, false, now()),
            Serving::SetByHand {
                concurrency: 4,
                setting: "LH_MODEL_CONCURRENCY"
            }
        );
        drop((d, e));
        // A fleet-wide limit wins over both.
        f.set_limits(
            &k.id,
            Some(Limits {
                rpm: Some(60),
                tpm: None,
                concurrency: Some(2),
            }),
        );
        assert_eq!(f.concurrency(&k.id), Some((2, ConcurrencySource::Set)));
        f.configure(&k, None);
        f.set_limits(&k.id, None);
        assert_eq!(f.limits(&k.id), None);
    }

    #[tokio::test]
    async fn a_lapsed_lease_falls_back_to_a_local_share() {
        let f = Arc::new(Flow::new());
        let _rx = f.outbound();
        let k = ProviderKey::new("http://y/v1", "m", None);
        f.set_limits(
            &k.id,
            Some(Limits {
                rpm: None,
                tpm: None,
                concurrency: Some(8),
            }),
        );
        f.ensure(&k);
        let full = Slice {
            requests_per_sec: f64::INFINITY,
            tokens_per_sec: f64::INFINITY,
            concurrency: 8,
        };
        // Granted all 8, then the lease lapses with 4 workers known: 2.
        f.set_slice(
            &k.id,
            full,
            Instant::now() - Duration::from_millis(1),
            4,
            None,
        );
        let p: Vec<_> = (0..2).map(|_| f.try_admit(&k, 1).ok().unwrap()).collect();
        assert!(f.try_admit(&k, 1).is_err(), "not unlimited without NATS");
        drop(p);
        f.set_local_fraction(Some(0.5));
        let p: Vec<_> = (0..4).map(|_| f.try_admit(&k, 1).ok().unwrap()).collect();
        assert!(f.try_admit(&k, 1).is_err());
        drop(p);
    }
}
