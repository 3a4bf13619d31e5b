//! Pulling tickets: never more than free slots.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::AckKind;
use futures::StreamExt;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;

use super::{claim, Shared};

/// Pulls tickets of one kind, never more than free slots.
///
/// An idle kind keeps one slot reserved for one long poll (expiring after
/// `--pull-expires`); once a ticket arrives, the loop tops up with
/// immediate fetches sized to the slots that are free at that moment, until
/// the queue is drained or the slots are full. So a busy kind fills the
/// worker and each idle kind holds at most one slot.
///
/// No pull waits for ever: a pull whose request or answer is lost (with a
/// connection, or a consumer leader moving) gives its slots back after its
/// expiry plus [`LOST_PULL_GRACE`], and the loop asks again.
/// How long past a pull's expiry (a top-up fetch expects its answer at
/// once) the loop waits for the pull to end before it counts it lost.
const LOST_PULL_GRACE: Duration = Duration::from_secs(5);

pub(crate) async fn pull_loop(shared: Arc<Shared>, kind: String, shutdown: CancellationToken) {
    const MAX_BATCH: usize = 64;
    let mut consumer = None;
    let mut backoff = Duration::from_millis(50);
    while !shutdown.is_cancelled() {
        if consumer.is_none() {
            match shared.work.consumer(&kind).await {
                Ok(c) => consumer = Some(c),
                Err(e) => {
                    tracing::warn!(kind, error = %e, "consumer unavailable; retrying");
                    tokio::select! { _ = tokio::time::sleep(Duration::from_secs(1)) => continue, _ = shutdown.cancelled() => break }
                }
            }
        }
        let c = consumer.as_ref().expect("set above");
        // Reserve the slot before asking: backpressure is explicit.
        let first = tokio::select! {
            p = shared.slots.clone().acquire_owned() => p.expect("semaphore open"),
            _ = shutdown.cancelled() => break,
        };
        let mut permits = vec![first];
        let got = match c
            .batch()
            .max_messages(1)
            .expires(shared.opts.pull_expires)
            .messages()
            .await
        {
            Ok(batch) => {
                let idle = shared.opts.pull_expires + LOST_PULL_GRACE;
                let (got, failed) =
                    take(&shared, &kind, batch, &mut permits, &shutdown, idle).await;
                if failed && got == 0 {
                    // A refused pull (409: the consumer's max waiting pulls
                    // reached, a leader moving): back off instead of asking
                    // again at once, doubling up to 2 s.
                    tracing::debug!(kind, ?backoff, "pull refused; backing off");
                    tokio::select! { _ = tokio::time::sleep(backoff) => {}, _ = shutdown.cancelled() => break }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
                backoff = Duration::from_millis(50);
                got
            }
            Err(e) => {
                tracing::warn!(kind, error = %e, "pull failed; retrying");
                consumer = None;
                drop(permits);
                tokio::select! { _ = tokio::time::sleep(Duration::from_millis(500)) => continue, _ = shutdown.cancelled() => break }
            }
        };
        if got == 0 {
            continue;
        }
        // Busy: fetch what is queued, as much as free slots allow.
        while !shutdown.is_cancelled() {
            let mut permits = Vec::new();
            while permits.len() < MAX_BATCH {
                match shared.slots.clone().try_acquire_owned() {
                    Ok(p) => permits.push(p),
                    Err(_) => break,
                }
            }
            let want = permits.len();
            if want == 0 {
                break;
            }
            let Ok(batch) = c.fetch().max_messages(want).messages().await else {
                break;
            };
            let (got, failed) = take(
                &shared,
                &kind,
                batch,
                &mut permits,
                &shutdown,
                LOST_PULL_GRACE,
            )
            .await;
            if failed || got < want {
                break;
            }
        }
    }
}

/// Dispatches the messages of one pull, one reserved slot each; returns how
/// many arrived and whether the pull ended in an error, or went `idle` with
/// neither a message nor its end (its request or answer was lost). After
/// shutdown began, tickets are handed back at once.
async fn take(
    shared: &Arc<Shared>,
    kind: &str,
    mut batch: async_nats::jetstream::consumer::pull::Batch,
    permits: &mut Vec<OwnedSemaphorePermit>,
    shutdown: &CancellationToken,
    idle: Duration,
) -> (usize, bool) {
    let mut n = 0;
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
                return (n, true);
            }
        };
        let Ok(msg) = m else { return (n, true) };
        n += 1;
        if shutdown.is_cancelled() {
            let _ = msg.ack_with(AckKind::Nak(None)).await;
            continue;
        }
        let permit = permits
            .pop()
            .expect("never more messages than reserved slots");
        tokio::spawn(claim::handle_delivery(shared.clone(), msg, permit));
    }
    (n, false)
}
