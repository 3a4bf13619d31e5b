//! Pulling tickets: never more than free slots, each from the lane that is
//! due.
//!
//! A kind's tickets wait in lanes (see [`leasehold_core::lane`]): the
//! kind's own subject for the default tenant at the default priority, and
//! one subject per other tenant and priority. The loop reserves the free
//! slots first, then hands each to the lane the [`Scheduler`] names among
//! those with tickets waiting (tenants by weight, priorities within a
//! tenant), skipping a tenant at its running-jobs limit, and fetches from
//! each lane what it was given. With nothing waiting anywhere it long-polls
//! the kind's own consumer with one slot, so each idle kind holds at most
//! one slot. The lanes with tickets are counted from the stream at most
//! once per [`LANE_SCAN`]; what each fetch leaves pending says whether its
//! lane has more; and a subscription to the lanes' subjects says at once
//! that a ticket arrived in one (an idle poll of the kind's own consumer
//! is then given up: the server drops a pull whose requester is gone).
//!
//! No pull waits for ever: a pull whose request or answer is lost (with a
//! connection, or a consumer leader moving) gives its slots back after its
//! expiry plus [`LOST_PULL_GRACE`], and the loop asks again. A pull is
//! asked again at once when the connection comes back or a leader of the
//! work stream or one of its consumers is elected
//! ([`leasehold_store::failover`]): a pull waiting at a consumer leader that
//! died is gone, and a job submitted after a node's
//! kill starts as soon as its consumer has a leader again, not after the
//! pull's expiry and grace.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::AckKind;
use futures::StreamExt;
use leasehold_core::lane::{Lane, Scheduler};
use leasehold_core::retry::Backoff;
use leasehold_flow::tenant_jobs_key;
use leasehold_flow::{Flow, Permit, ProviderKey};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{claim, Shared};

/// How long past a pull's expiry (a top-up fetch expects its answer at
/// once) the loop waits for the pull to end before it counts it lost.
const LOST_PULL_GRACE: Duration = Duration::from_secs(5);

/// How often the lanes holding tickets are counted from the stream.
const LANE_SCAN: Duration = Duration::from_secs(1);

const MAX_BATCH: usize = 64;

/// What the loop knows of its kind's lanes.
struct Lanes {
    /// Consumers of the lanes other than the default one.
    consumers: HashMap<Lane, PullConsumer>,
    /// Lanes that may have tickets waiting (the default lane included).
    waiting: HashSet<Lane>,
    scanned: Option<Instant>,
    /// Whether the stream had tickets in other lanes at the last count.
    any: bool,
    sched: Scheduler,
}

impl Lanes {
    fn new() -> Lanes {
        Lanes {
            consumers: HashMap::new(),
            waiting: HashSet::from([Lane::default()]),
            scanned: None,
            any: false,
            sched: Scheduler::new(),
        }
    }

    /// Counts the lanes with tickets, at most once per [`LANE_SCAN`]; every
    /// lane counted (and the default one) may have tickets waiting again.
    async fn scan(&mut self, shared: &Shared, kind: &str) {
        if self.scanned.is_some_and(|t| t.elapsed() < LANE_SCAN) {
            return;
        }
        self.scanned = Some(Instant::now());
        self.waiting.insert(Lane::default());
        match shared.work.lanes(kind).await {
            Ok(lanes) => {
                self.any = !lanes.is_empty();
                let mut per_tenant: BTreeMap<&str, u64> = BTreeMap::new();
                for (lane, n) in &lanes {
                    *per_tenant.entry(lane.tenant.as_str()).or_default() += n;
                    self.waiting.insert(lane.clone());
                }
                for (t, n) in per_tenant {
                    leasehold_telemetry::observe::Observer::tenant_tickets(
                        &shared.metrics,
                        kind,
                        t,
                        n,
                    );
                }
            }
            Err(e) => {
                tracing::debug!(kind, error = %e, "cannot count the lanes; the next scan tries again")
            }
        }
    }

    /// Hands `n` slots to the lanes due, with the tenants' running-jobs
    /// permits: per lane, one entry per slot (`None` where the tenant has
    /// no limit).
    fn plan(&mut self, flow: &Arc<Flow>, n: usize) -> Vec<(Lane, Vec<Option<Permit>>)> {
        let mut out: Vec<(Lane, Vec<Option<Permit>>)> = Vec::new();
        if self.waiting.len() == 1 && self.waiting.contains(&Lane::default()) {
            // The common case, no tenants or priorities: no admission.
            if flow
                .limits(&tenant_jobs_key(&Lane::default().tenant))
                .is_none()
            {
                return vec![(Lane::default(), (0..n).map(|_| None).collect())];
            }
        }
        let mut blocked: HashSet<String> = HashSet::new();
        for _ in 0..n {
            let waiting = self.waiting.iter().collect::<Vec<_>>();
            let Some(lane) = self
                .sched
                .next(waiting, |t| flow.weight(t), |t| blocked.contains(t))
            else {
                break;
            };
            let id = tenant_jobs_key(&lane.tenant);
            let permit = if flow.limits(&id).is_some() {
                let key = ProviderKey {
                    id,
                    info: Default::default(),
                };
                match flow.try_admit(&key, 0) {
                    Ok(p) => Some(p),
                    Err(_) => {
                        self.sched.refund(&lane.tenant);
                        blocked.insert(lane.tenant.clone());
                        continue;
                    }
                }
            } else {
                None
            };
            match out.iter_mut().find(|(l, _)| *l == lane) {
                Some((_, ps)) => ps.push(permit),
                None => out.push((lane, vec![permit])),
            }
        }
        out
    }

    /// A ticket was published on `subject` (one of the lanes').
    fn arrived(&mut self, shared: &Shared, kind: &str, subject: &str) {
        if let Some((k, lane)) = shared.conn.layout.lane_of_submit_subject(subject) {
            if k == kind {
                self.any = true;
                self.waiting.insert(lane);
            }
        }
    }

    /// Takes in what the subscription saw since the last look.
    fn note_arrivals(
        &mut self,
        shared: &Shared,
        kind: &str,
        sub: &mut Option<async_nats::Subscriber>,
    ) {
        let Some(s) = sub.as_mut() else { return };
        let waker = futures::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        while let std::task::Poll::Ready(m) = s.poll_next_unpin(&mut cx) {
            match m {
                Some(m) => self.arrived(shared, kind, &m.subject),
                None => {
                    *sub = None;
                    return;
                }
            }
        }
    }

    /// A fetch from `lane` asked for `asked` and got `got`, the last one
    /// saying `pending` more wait.
    fn fetched(&mut self, lane: &Lane, asked: usize, got: usize, pending: u64) {
        if got < asked || pending == 0 {
            self.waiting.remove(lane);
        }
    }

    async fn consumer(
        &mut self,
        shared: &Shared,
        kind: &str,
        lane: &Lane,
    ) -> Result<PullConsumer, leasehold_store::StoreError> {
        if let Some(c) = self.consumers.get(lane) {
            return Ok(c.clone());
        }
        let c = shared.work.lane_consumer(kind, lane).await?;
        self.consumers.insert(lane.clone(), c.clone());
        Ok(c)
    }
}

/// Lanes named by new tickets, as the subscription to their subjects sees
/// them (no tickets are taken from it: it only wakes the loop).
async fn arrivals(shared: &Shared, kind: &str) -> Option<async_nats::Subscriber> {
    match shared
        .conn
        .client
        .subscribe(shared.conn.layout.lanes_filter(kind))
        .await
    {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::debug!(kind, error = %e, "no subscription to the lanes; counting them each second instead");
            None
        }
    }
}

pub(crate) async fn pull_loop(shared: Arc<Shared>, kind: String, shutdown: CancellationToken) {
    let flow = shared.flow.clone();
    let mut arrived = arrivals(&shared, &kind).await;
    // Tenants' limits apply from the first job: none is taken before
    // they are known (the flow coordination reads them, or finds the
    // layout has none).
    loop {
        tokio::select! {
            loaded = flow.wait_loaded(Duration::from_secs(5)) => if loaded {
                break;
            },
            _ = shutdown.cancelled() => return,
        }
        tracing::warn!(
            kind,
            "waiting for the fleet's limits (lh_limits) before taking jobs"
        );
    }
    let mut lanes = Lanes::new();
    let mut elected = shared.conn.elections();
    let work_stream = shared.conn.layout.work_stream();
    let refused = || Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    let mut backoff = refused();
    while !shutdown.is_cancelled() {
        if let std::collections::hash_map::Entry::Vacant(v) = lanes.consumers.entry(Lane::default())
        {
            match shared.work.consumer(&kind).await {
                Ok(c) => {
                    let first = leasehold_store::work::first_redelivery(&c.cached_info().config);
                    shared.ack_waits.lock().unwrap().insert(kind.clone(), first);
                    v.insert(c);
                }
                Err(e) => {
                    tracing::warn!(kind, error = %e, "consumer unavailable; retrying");
                    tokio::select! { _ = tokio::time::sleep(Duration::from_secs(1)) => continue, _ = shutdown.cancelled() => break }
                }
            }
        }
        // Reserve the slots before asking: backpressure is explicit.
        let first = tokio::select! {
            p = shared.slots.clone().acquire_owned() => p.expect("semaphore open"),
            _ = shutdown.cancelled() => break,
        };
        let mut permits = vec![first];
        while permits.len() < MAX_BATCH {
            match shared.slots.clone().try_acquire_owned() {
                Ok(p) => permits.push(p),
                Err(_) => break,
            }
        }
        lanes.scan(&shared, &kind).await;
        lanes.note_arrivals(&shared, &kind, &mut arrived);
        let plan = lanes.plan(&flow, permits.len());
        if plan.is_empty() {
            // Nothing waits (or only tenants at their limit): one long
            // poll of the kind's own consumer, with one slot.
            permits.truncate(1);
            let mut tenants = Vec::new();
            let id = tenant_jobs_key(&Lane::default().tenant);
            if flow.limits(&id).is_some() {
                let key = ProviderKey {
                    id,
                    info: Default::default(),
                };
                match flow.try_admit(&key, 0) {
                    Ok(p) => tenants.push(Some(p)),
                    Err(_) => {
                        // Every tenant with tickets is at its limit: wait
                        // for a job to end (or a limit to change).
                        drop(permits);
                        tokio::select! {
                            _ = flow.changed() => {}
                            _ = tokio::time::sleep(LANE_SCAN) => {}
                            _ = shutdown.cancelled() => break,
                        }
                        continue;
                    }
                }
            }
            let c = lanes.consumers[&Lane::default()].clone();
            // While other lanes have tickets, the poll is short, so the
            // next count comes soon.
            let expires = if lanes.any {
                shared.opts.pull_expires.min(LANE_SCAN)
            } else {
                shared.opts.pull_expires
            };
            let poll = c.batch().max_messages(1).expires(expires).messages();
            let poll = match arrived.as_mut() {
                Some(sub) => {
                    let first = tokio::select! {
                        p = poll => Some(p),
                        m = sub.next() => {
                            // A ticket arrived in a lane: give the poll up
                            // and take it.
                            if let Some(m) = m {
                                lanes.arrived(&shared, &kind, &m.subject);
                            }
                            None
                        }
                    };
                    match first {
                        Some(p) => p,
                        None => continue,
                    }
                }
                None => poll.await,
            };
            match poll {
                Ok(batch) => {
                    // A pull waiting at a leader that is gone: ask again.
                    let batch = batch.take_until(Box::pin(elected.next_of(&work_stream)));
                    let idle = expires + LOST_PULL_GRACE;
                    let (got, failed, _) = take(
                        &shared,
                        &kind,
                        batch,
                        &mut permits,
                        &mut tenants,
                        &shutdown,
                        idle,
                    )
                    .await;
                    if failed && got == 0 {
                        // A refused pull (409: the consumer's max waiting
                        // pulls reached, a leader moving): back off instead
                        // of asking again at once, doubling up to 2 s.
                        let pause = backoff.pause();
                        tracing::debug!(kind, ?pause, "pull refused; backing off");
                        tokio::select! { _ = tokio::time::sleep(pause) => {}, _ = shutdown.cancelled() => break }
                        continue;
                    }
                    backoff = refused();
                    if got > 0 {
                        lanes.waiting.insert(Lane::default());
                    }
                }
                Err(e) => {
                    tracing::warn!(kind, error = %e, "pull failed; retrying");
                    lanes.consumers.remove(&Lane::default());
                    drop(permits);
                    tokio::select! { _ = tokio::time::sleep(Duration::from_millis(500)) => continue, _ = shutdown.cancelled() => break }
                }
            }
            continue;
        }
        // Busy: fetch from each lane what it was given.
        tracing::debug!(kind, plan = ?plan.iter().map(|(l, t)| (l.tenant.as_str(), l.priority, t.len())).collect::<Vec<_>>(), "pull plan");
        fetch_lanes(&shared, &kind, &mut lanes, plan, permits, &shutdown).await;
    }
}

/// Fetches from each lane of `plan` the tickets it was given slots (and
/// tenant permits) for; a lane whose consumer or fetch fails is counted
/// again at the next scan.
async fn fetch_lanes(
    shared: &Arc<Shared>,
    kind: &str,
    lanes: &mut Lanes,
    plan: Vec<(Lane, Vec<Option<Permit>>)>,
    mut permits: Vec<OwnedSemaphorePermit>,
    shutdown: &CancellationToken,
) {
    for (lane, mut tenants) in plan {
        let want = tenants.len();
        let mut mine: Vec<OwnedSemaphorePermit> = permits.drain(..want).collect();
        let c = match lanes.consumer(shared, kind, &lane).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(kind, tenant = %lane.tenant, priority = lane.priority, error = %e, "lane consumer unavailable; the next count tries again");
                lanes.waiting.remove(&lane);
                lanes.consumers.remove(&lane);
                continue;
            }
        };
        let Ok(batch) = c.fetch().max_messages(want).messages().await else {
            lanes.waiting.remove(&lane);
            lanes.consumers.remove(&lane);
            continue;
        };
        let mut elected = shared.conn.elections();
        let work_stream = shared.conn.layout.work_stream();
        let batch = batch.take_until(Box::pin(async move { elected.next_of(&work_stream).await }));
        let (got, failed, pending) = take(
            shared,
            kind,
            batch,
            &mut mine,
            &mut tenants,
            shutdown,
            LOST_PULL_GRACE,
        )
        .await;
        tracing::debug!(kind, tenant = %lane.tenant, want, got, pending, failed, "lane fetched");
        if failed {
            lanes.waiting.remove(&lane);
        } else {
            lanes.fetched(&lane, want, got, pending);
        }
    }
}

/// Dispatches the messages of one pull, one reserved slot (and tenant
/// permit, when its tenant is limited) each; returns how many arrived,
/// whether the pull ended in an error, or went `idle` with neither a
/// message nor its end (its request or answer was lost), and how many the
/// last message said were still pending. After shutdown began, tickets are
/// handed back at once.
async fn take<E>(
    shared: &Arc<Shared>,
    kind: &str,
    mut batch: impl futures::Stream<Item = Result<async_nats::jetstream::Message, E>> + Unpin,
    permits: &mut Vec<OwnedSemaphorePermit>,
    tenants: &mut Vec<Option<Permit>>,
    shutdown: &CancellationToken,
    idle: Duration,
) -> (usize, bool, u64) {
    let mut n = 0;
    let mut pending = 0;
    loop {
        let m = match tokio::time::timeout(idle, batch.next()).await {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(_) => {
                tracing::warn!(
                    kind,
                    ?idle,
                    "a pull got neither tickets nor its end (lost with a connection?); pulling again"
                );
                return (n, true, pending);
            }
        };
        let Ok(msg) = m else {
            return (n, true, pending);
        };
        n += 1;
        pending = msg.info().map(|i| i.pending).unwrap_or(0);
        if shutdown.is_cancelled() {
            let _ = msg.ack_with(AckKind::Nak(None)).await;
            continue;
        }
        let permit = permits
            .pop()
            .expect("never more messages than reserved slots");
        let tenant = tenants.pop().flatten();
        let shared = shared.clone();
        // Boxed: the claim's and the attempt's state is large, and a task
        // moves its future by value several times on the way in.
        tokio::spawn(Box::pin(async move {
            // The tenant's running-jobs permit is held for the whole claim
            // and attempt.
            let _tenant = tenant;
            claim::handle_delivery(shared, msg, permit).await
        }));
    }
    (n, false, pending)
}
