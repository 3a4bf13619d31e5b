//! The fleet's side of flow control: connects the process's
//! [`leasehold_flow::Flow`] (which admits every model request) to
//! the `lh_limits` and `lh_flow` buckets.
//!
//! - A watch of the limits and of the pauses feeds `Flow` (a limit set by
//!   `leasehold limits set` applies within a second, a cooldown another
//!   worker saw at once).
//! - Pauses this process sees (429s, quota errors, an opened breaker) are
//!   written for the fleet, only ever extending the stored one.
//! - A concurrency this process learned of a key (a server that serves one
//!   request at a time) is written for the fleet (`learned.<id>`, only ever
//!   lowered); every worker applies it like a limit, so the leases below
//!   split it and the whole fleet serialises, not only the worker that
//!   noticed.
//! - For each provider key with limits and demand, the process's lease is
//!   renewed every [`RENEW`] by one revision-conditioned write of the key's
//!   lease record (one write per worker per key per second for all three
//!   limits), valid for [`LEASE`]. A lease that is not renewed (the worker
//!   died, NATS is away) ends by itself: the others take its share at their
//!   next renewal, and this process falls back to a local share. Each
//!   reader judges a lease's age by its own clock, from when it saw the
//!   lease's renewal count change ([`Renewals`]); this process stops using
//!   its slice before its write plus [`LEASE`], so before any reader can
//!   take it, whatever the hosts' wall clocks say.
//! - At shutdown the leases are given back.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use leasehold_core::retry::Backoff;
use leasehold_flow::{Flow, Outbound};
use leasehold_flow::{Learned, Pause, Renewals, Slice};
use leasehold_store::connect::Link;
use leasehold_store::flow::{now_ms, to_ms, FlowChange, FlowStore, LeaseError, PauseKind};
use leasehold_store::{Conn, StoreError};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long a lease is valid: the longest a dead worker's share stays taken.
pub const LEASE: Duration = Duration::from_secs(3);
/// How often a lease in use is renewed.
pub const RENEW: Duration = Duration::from_secs(1);
/// How many times a lease write lost to another worker's is tried again
/// (each after a random pause of up to 10 ms times the tries so far).
const CONFLICT_RETRIES: u32 = 8;
/// How long one renewal (its reads and writes, retries included) may take
/// before it counts as failed: well inside [`LEASE`], so a worker cut off
/// from NATS is on its local share about when its slice ends.
const PATIENCE: Duration = Duration::from_secs(2);
/// How often the coordinator looks for new demand.
const TICK: Duration = Duration::from_millis(100);

/// Starts the coordination; it stops when `shutdown` fires (after giving
/// the leases back). A layout without the flow buckets runs with local
/// limits only, and says so.
pub fn start(
    flow: Arc<Flow>,
    conn: Conn,
    worker_id: String,
    local_fraction: Option<f64>,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    flow.set_local_fraction(local_fraction);
    start_with(flow, conn, worker_id, shutdown)
}

/// [`start`] for a flow control of its own (benchmarks: several
/// "workers" in one process).
pub fn start_with(
    flow: Arc<Flow>,
    conn: Conn,
    worker_id: String,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        // Coordinated from now on: until a lease is granted, a limited key
        // waits (never the whole limit on this worker alone).
        let outbound = flow.outbound();
        // A server that does not answer is asked again, and meanwhile this
        // worker's limited keys wait: a worker that could not read the
        // buckets at its start never runs a fleet's limit alone.
        let store = match until_answered("open the flow buckets", &shutdown, || {
            FlowStore::open(&conn)
        })
        .await
        {
            Some(Ok(s)) => s,
            Some(Err(e)) => {
                // A layout set up before the flow buckets: limits are local.
                tracing::warn!(error = %e, "flow control is local to this worker (run `leasehold setup` for fleet-wide limits and cooldowns)");
                drop(outbound);
                flow.mark_loaded();
                return;
            }
            None => return,
        };
        // The limits as they are, before any job is taken (a tenant's
        // running-jobs limit applies from the first job; the pull loop
        // waits for them); the watch below follows their changes.
        let all = match until_answered("read the fleet's limits", &shutdown, || store.list_limits())
            .await
        {
            Some(Ok(all)) => all,
            Some(Err(e)) => {
                tracing::error!(error = %e, "cannot read the fleet's limits; this worker takes no job");
                return;
            }
            None => return,
        };
        for (id, e) in all.unreadable {
            tracing::warn!(key = %id, error = %e, bucket = store.limits_bucket(), "limits entry unreadable; taken as no limits (`nats kv del` removes it)");
        }
        for (id, e) in all.entries {
            apply(&flow, FlowChange::Limits(id, Some(e)));
        }
        // And what the fleet learned: a server known to serve one request at
        // a time gets one from the first request on.
        match store.learned().await {
            Ok(all) => {
                for (id, l) in all {
                    apply(&flow, FlowChange::Learned(id, Some(l)));
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the fleet's learned limits yet; the watch applies them when it can")
            }
        }
        flow.mark_loaded();
        let watch = tokio::spawn(follow(
            store.clone(),
            flow.clone(),
            conn.link.clone(),
            shutdown.clone(),
        ));
        coordinate(store, flow, worker_id, outbound, shutdown).await;
        let _ = watch.await;
    })
}

/// Runs `op` until NATS answers it: a transient error (no answer, a
/// failed request) is tried again after a pause (100 ms doubling to 2 s,
/// with a warning saying no job waits on it in vain); any other answer is
/// returned; `None` at shutdown.
async fn until_answered<T, F, Fut>(
    what: &str,
    shutdown: &CancellationToken,
    mut op: F,
) -> Option<Result<T, StoreError>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    loop {
        let pause = match op().await {
            Err(e) if e.is_transient() => {
                let pause = backoff.pause();
                tracing::warn!(error = %e, ?pause, "cannot {what} yet; limited tenants and providers wait, and no job is taken before the limits are known");
                pause
            }
            other => return Some(other),
        };
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// Applies every limit and pause as it is and as it changes, watching
/// anew after an error and at once when the connection comes back (a
/// server that restarted lost the watch's consumers, which the watch
/// itself notices only after its missed heartbeats).
async fn follow(store: FlowStore, flow: Arc<Flow>, link: Link, shutdown: CancellationToken) {
    loop {
        let again = match store.watch().await {
            Ok(changes) => {
                tokio::pin!(changes);
                loop {
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = link.reconnected() => {
                            tracing::info!("connection back; reading the limits and pauses again");
                            break Duration::ZERO;
                        }
                        c = changes.next() => match c {
                            Some(c) => apply(&flow, c),
                            None => break Duration::from_secs(1),
                        },
                    }
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "flow watch");
                Duration::from_secs(1)
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(again) => {}
        }
    }
}

fn apply(flow: &Flow, c: FlowChange) {
    match c {
        FlowChange::Limits(id, entry) => {
            tracing::info!(provider = %id, limits = ?entry.as_ref().map(|e| e.limits), "provider limits");
            if let Some((tenant, "jobs")) = leasehold_flow::tenant_of_key(&id) {
                flow.set_weight(tenant, entry.as_ref().and_then(|e| e.weight));
            }
            flow.set_limits(&id, entry.map(|e| e.limits));
        }
        FlowChange::Pause(kind, id, p) => {
            let until = SystemTime::UNIX_EPOCH + Duration::from_millis(p.until_ms);
            flow.pause(&id, until, &p.reason, kind == PauseKind::Breaker);
        }
        FlowChange::Learned(id, l) => {
            match &l {
                Some(l) => {
                    tracing::info!(provider = %id, concurrency = l.concurrency, by = %l.by, reason = %l.reason, "provider concurrency learned")
                }
                None => tracing::info!(provider = %id, "learned provider concurrency cleared"),
            }
            flow.set_learned(&id, l);
        }
    }
}

struct Held {
    last: Instant,
    granted: bool,
    /// The others' renewals as this process saw them.
    seen: Renewals,
}

/// This process's lease writes, counted from a start no earlier
/// incarnation of the same worker id is likely to have reached (a reader
/// sees a lease renewed when its count changes).
struct Counter(u64);

impl Counter {
    fn next(&mut self) -> u64 {
        self.0 += 1;
        self.0
    }
}

/// Milliseconds of this process's monotonic clock (for [`Renewals`]).
fn mono_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

async fn coordinate(
    store: FlowStore,
    flow: Arc<Flow>,
    me: String,
    mut outbound: tokio::sync::mpsc::UnboundedReceiver<Outbound>,
    shutdown: CancellationToken,
) {
    let mut held: HashMap<String, Held> = HashMap::new();
    let mut renewals = Counter(now_ms().saturating_mul(1000));
    let mut paused: HashMap<String, (Instant, u64)> = HashMap::new();
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            o = outbound.recv() => match o {
                Some(Outbound::Learned { key, concurrency, reason }) => {
                    let l = Learned {
                        concurrency,
                        reason,
                        by: me.clone(),
                        at_ms: now_ms(),
                        provider: key.info.clone(),
                    };
                    match store.learn(&key.id, &l).await {
                        Ok(true) => tracing::info!(provider = %key.label(), concurrency, "provider concurrency learned, for the fleet"),
                        Ok(false) => {}
                        Err(e) => tracing::warn!(provider = %key.label(), error = %e, "could not record the learned concurrency for the fleet; this worker keeps it alone"),
                    }
                }
                Some(o) => publish(&store, &me, o, &mut paused).await,
                None => break,
            },
            _ = tick.tick() => {
                for (key, _) in flow.keys() {
                    let Some(limits) = flow.limits(&key.id) else {
                        held.remove(&key.id);
                        continue;
                    };
                    let h = held.entry(key.id.clone()).or_insert(Held { last: Instant::now() - RENEW, granted: false, seen: Renewals::default() });
                    // At most one write per key per second; new demand after
                    // a quiet second is served at once.
                    if h.last.elapsed() < RENEW {
                        continue;
                    }
                    let d = flow.demand(&key.id);
                    if !d.active && !h.granted {
                        continue;
                    }
                    h.last = Instant::now();
                    let want = if d.active { d.want } else { Slice::default() };
                    match renew(&store, &flow, &me, &key, &limits, want, &mut h.seen, &mut renewals).await {
                        Ok(got) => h.granted = d.active && got,
                        Err(e) => tracing::debug!(provider = %key.label(), error = %e, "lease not renewed"),
                    }
                }
            }
        }
    }
    // Give the leases back (bounded: a NATS that is away does not hold up
    // the shutdown; the leases then end by themselves).
    let give_back = async {
        for (key, _) in flow.keys() {
            if let Some(h) = held.get_mut(&key.id).filter(|h| h.granted) {
                if let Some(limits) = flow.limits(&key.id) {
                    let _ = renew(
                        &store,
                        &flow,
                        &me,
                        &key,
                        &limits,
                        Slice::default(),
                        &mut h.seen,
                        &mut renewals,
                    )
                    .await;
                }
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), give_back).await;
}

/// One revision-conditioned write of `me`'s lease (retried on a
/// conflict, after a random pause that grows with each one, so workers
/// renewing at the same moment do not keep colliding): `Ok(true)` when
/// something is held. A renewal that does not land within [`PATIENCE`]
/// (NATS away, the write refused, every retry lost) is reported to the
/// flow control ([`Flow::lease_failed`]): once its slice ends, it uses its
/// local share, out of the workers its last read of the record counted.
#[allow(clippy::too_many_arguments)]
async fn renew(
    store: &FlowStore,
    flow: &Flow,
    me: &str,
    key: &leasehold_flow::ProviderKey,
    limits: &leasehold_flow::Limits,
    want: Slice,
    seen: &mut Renewals,
    renewals: &mut Counter,
) -> Result<bool, StoreError> {
    let mut workers = None;
    // The reads and writes: `Some(slice)` when the write landed (the flow
    // control then has the slice), `None` when every retry lost to another
    // worker's write; `workers` is what the last read counted.
    let attempts = async {
        for attempt in 0..CONFLICT_RETRIES {
            if attempt > 0 {
                let jitter = rand::random::<f64>() * 10.0 * attempt as f64;
                tokio::time::sleep(Duration::from_secs_f64(jitter / 1000.0)).await;
            }
            let (mut rec, rev) = store.lease(&key.id).await?;
            // Before the write: every reader first sees it later than this.
            let written = Instant::now();
            seen.expire(&mut rec, me, mono_ms(), LEASE.as_millis() as u64);
            rec.provider = key.info.clone();
            let got = rec.grant(
                me,
                limits,
                want,
                now_ms() + LEASE.as_millis() as u64,
                renewals.next(),
            );
            workers = Some(rec.workers(me));
            match store.write_lease(&key.id, &rec, rev).await {
                Ok(_) => {
                    // The local view ends a margin before any reader's.
                    flow.set_slice(
                        &key.id,
                        got,
                        written + LEASE - Duration::from_millis(200),
                        rec.workers(me),
                        rec.grid(me, limits),
                    );
                    let total = limits.as_slice();
                    for (name, fleet, slice) in [
                        (
                            "rpm",
                            total.requests_per_sec * 60.0,
                            got.requests_per_sec * 60.0,
                        ),
                        (
                            "tpm",
                            total.tokens_per_sec * 60.0,
                            got.tokens_per_sec * 60.0,
                        ),
                        (
                            "concurrency",
                            total.concurrency as f64,
                            got.concurrency as f64,
                        ),
                    ] {
                        if fleet.is_finite() && fleet < u64::MAX as f64 {
                            flow.observer()
                                .flow_limit(&key.info.model, name, fleet, slice);
                        }
                    }
                    return Ok::<_, StoreError>(Some(got));
                }
                Err(LeaseError::Conflict) => {}
                Err(LeaseError::Store(e)) => return Err(e),
            }
        }
        Ok(None)
    };
    let failed = match tokio::time::timeout(PATIENCE, attempts).await {
        Ok(Ok(Some(got))) => return Ok(got != Slice::default()),
        Ok(Ok(None)) => StoreError::failed(format!(
            "the lease record changed meanwhile, {CONFLICT_RETRIES} times"
        )),
        Ok(Err(e)) => e,
        Err(_) => StoreError::Unavailable(format!("lease renewal unanswered after {PATIENCE:?}")),
    };
    flow.lease_failed(&key.id, workers);
    Err(failed)
}

/// Writes a pause for the fleet; a storm of 429s is one write per key per
/// second (a pause written less than a second ago and ending at most a
/// second before the new one stands for it).
async fn publish(
    store: &FlowStore,
    me: &str,
    o: Outbound,
    written: &mut HashMap<String, (Instant, u64)>,
) {
    let (kind, key, until, reason) = match o {
        Outbound::Cooldown { key, until, reason } => (PauseKind::Cooldown, key, until, reason),
        Outbound::BreakerOpen { key, until, cause } => (PauseKind::Breaker, key, until, cause),
        Outbound::Learned { .. } => return,
    };
    let until_ms = to_ms(until);
    let slot = format!("{kind:?}.{}", key.id);
    if written
        .get(&slot)
        .is_some_and(|(at, w)| at.elapsed() < RENEW && until_ms <= w + 1000)
    {
        return;
    }
    written.insert(slot, (Instant::now(), until_ms));
    let p = Pause {
        until_ms: to_ms(until),
        reason,
        by: me.to_string(),
        provider: key.info.clone(),
    };
    match store.extend_pause(kind, &key.id, &p).await {
        Ok(true) => {
            tracing::info!(provider = %key.label(), until = %leasehold_core::time::rfc3339(until), kind = ?kind, "provider paused for the fleet")
        }
        Ok(false) => {}
        Err(e) => {
            tracing::warn!(provider = %key.label(), error = %e, "could not pause the provider for the fleet; this worker waits alone")
        }
    }
}
