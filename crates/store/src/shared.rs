//! A durable pull consumer shared by every worker and reaper (the ended
//! sessions, the signals sent): each message handled once, by someone,
//! whoever runs.

use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::Conn;

/// How long a member waits before it looks for its consumer again.
const PAUSE: Duration = Duration::from_secs(1);

/// Pulls the durable consumer `consumer` of `stream` until `shutdown`,
/// handing each message to `on` (which acks or NAKs it; up to `batch`
/// handled side by side, since each is acked on its own), `batch` at a
/// time with short expiries, so a member that stops holds nothing for
/// longer than a pull's expiry plus the consumer's ack wait. A consumer
/// that is missing or unreachable is looked for again every second,
/// saying why (`what` names it).
pub async fn consume<F, Fut>(
    conn: &Conn,
    stream: &str,
    consumer: &str,
    batch: usize,
    what: &str,
    shutdown: &CancellationToken,
    mut on: F,
) where
    F: FnMut(jetstream::Message) -> Fut,
    Fut: Future<Output = ()>,
{
    while !shutdown.is_cancelled() {
        // Every request below may wait out the client's timeout with the
        // server away: none of them holds a stopping member up.
        let found: Result<consumer::PullConsumer, String> = tokio::select! {
            f = async {
                let s = conn
                    .js
                    .get_stream_no_info(stream)
                    .await
                    .map_err(|e| e.to_string())?;
                s.get_consumer(consumer).await.map_err(|e| e.to_string())
            } => f,
            _ = shutdown.cancelled() => return,
        };
        let c = match found {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "{what} consumer {consumer} unavailable (`leasehold setup` makes it); retrying");
                tokio::select! { _ = tokio::time::sleep(PAUSE) => continue, _ = shutdown.cancelled() => return }
            }
        };
        let pulled = tokio::select! {
            p = c
                .stream()
                .expires(Duration::from_secs(1))
                .max_messages_per_batch(batch)
                .heartbeat(Duration::from_millis(400))
                .messages() => p,
            _ = shutdown.cancelled() => return,
        };
        let mut msgs = match pulled {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "cannot pull {what}; retrying");
                tokio::select! { _ = tokio::time::sleep(PAUSE) => continue, _ = shutdown.cancelled() => return }
            }
        };
        let mut handling = futures::stream::FuturesUnordered::new();
        loop {
            let next = tokio::select! {
                m = msgs.next(), if handling.len() < batch => m,
                Some(()) = handling.next(), if !handling.is_empty() => continue,
                _ = shutdown.cancelled() => return,
            };
            match next {
                Some(Ok(m)) => handling.push(on(m)),
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "{what} pull interrupted; pulling again");
                    break;
                }
                None => break,
            }
        }
        // What was taken is handled before the next pull.
        while handling.next().await.is_some() {}
    }
}
