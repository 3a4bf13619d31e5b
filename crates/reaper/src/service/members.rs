//! The reapers' roll call: every reaper whose view of the index is read
//! answers `<prefix>.reaper.roll` with its id, and every [`ROLL_EVERY`]
//! asks it and takes the answers that came within [`ROLL_WINDOW`] as the
//! live reapers. From them it computes its share of the shards
//! ([`leasehold_core::shard`]): the sweep and the crash probe act only on
//! the jobs and workers of its shards. A reaper still reading its view
//! counts itself but answers nobody: the others keep the shards it would
//! take until it can sweep them.
//!
//! A reaper that died (kill -9), is paused or cut off stops answering, so
//! the others take its shards over at their next roll, within about a
//! second and well within any session timeout. A reaper that cannot ask
//! (its connection is down) keeps its last share; one that hears nobody,
//! itself included, owns every shard. Owning decides only who tries: every
//! action stays a conditioned write, so a moment of disagreement costs
//! repeated work, never a wrong write.

use leasehold_core::shard::{Shards, SHARDS};

use super::*;

/// How often a reaper calls the roll.
pub(super) const ROLL_EVERY: Duration = Duration::from_secs(1);
/// How long a roll call waits for answers.
pub(super) const ROLL_WINDOW: Duration = Duration::from_millis(250);

/// Answers the roll call with this reaper's id while its view of the
/// index is read whole: a reaper still reading it (at its start, or after
/// its watch was interrupted; seconds at a million active jobs) could not
/// sweep the shards it would take, so it takes none and the others keep
/// them.
pub(super) async fn answer_roll(
    inner: Arc<Inner>,
    sub: async_nats::Subscriber,
    shutdown: CancellationToken,
) {
    let answering = std::sync::atomic::AtomicBool::new(false);
    answer_requests(inner, sub, shutdown, "roll call", |i| {
        let loaded = i.view.is_loaded();
        if answering.swap(loaded, Ordering::Relaxed) != loaded {
            if loaded {
                tracing::info!(reaper_id = %i.id, "view of the index read; answering the roll call");
            } else {
                tracing::info!(reaper_id = %i.id, "reading the index again; not answering the roll call until it is read");
            }
        }
        loaded.then(|| i.id.clone().into())
    })
    .await
}

/// Calls the roll every [`ROLL_EVERY`] and keeps this reaper's share.
pub(super) async fn roll_loop(inner: Arc<Inner>, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(ROLL_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.cancelled() => return,
        }
        let Some(members) = roll(&inner).await else {
            continue;
        };
        let share = Shards::new(&inner.id, members);
        let changed = *inner.shards.borrow() != share;
        if changed {
            tracing::info!(
                reaper_id = %inner.id,
                shards = share.owned(),
                of = SHARDS,
                reapers = share.members().len(),
                "reaper shards"
            );
            inner.shards.send_replace(share);
        }
    }
}

/// The ids that answered one roll call (`None`: it could not be asked).
async fn roll(inner: &Inner) -> Option<Vec<String>> {
    let client = &inner.conn.client;
    let inbox = client.new_inbox();
    let mut answers = match client.subscribe(inbox.clone()).await {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(error = %e, "roll call: cannot subscribe");
            return None;
        }
    };
    let subject = inner.conn.layout.reaper_roll_subject();
    if let Err(e) = client
        .publish_with_reply(subject, inbox, bytes::Bytes::new())
        .await
    {
        tracing::debug!(error = %e, "roll call: cannot ask");
        return None;
    }
    let mut ids = Vec::new();
    let deadline = tokio::time::Instant::now() + ROLL_WINDOW;
    loop {
        tokio::select! {
            m = answers.next() => match m {
                Some(m) => ids.push(String::from_utf8_lossy(&m.payload).into_owned()),
                None => break,
            },
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    let _ = answers.unsubscribe().await;
    Some(ids)
}
