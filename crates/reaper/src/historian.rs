//! The historian: one entry in the history of finished jobs
//! (`leasehold_store::history`) for every job that ends, by any path
//! (worker, recovery, dead-lettering, cancel, rejection).
//!
//! It follows the terminal events through the reapers' shared durable
//! consumer; each event is acked only after its entry is stored, so a
//! reaper killed mid-stream leaves the rest to a redelivery, and the
//! entry's message id makes a redelivered or doubled write land once.
//! Off the workers' path: their per-job cost does not change.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use leasehold_store::{history, Conn, Jobs};
use tokio_util::sync::CancellationToken;

use crate::retention::Class;

/// Events handled side by side.
const CONCURRENCY: usize = 32;
/// How long a failed write waits before its event comes back.
const RETRY: Duration = Duration::from_secs(1);

/// How long a kind's entries live: its retention class's (none: as long
/// as the stream's byte bound keeps them).
pub fn ttl_of(classes: &[Class], kind: &str) -> Option<Duration> {
    classes
        .iter()
        .find(|c| c.belongs(kind))
        .map(|c| c.retention)
}

/// Follows the terminal events until `shutdown`.
pub async fn run(conn: Conn, jobs: Jobs, classes: Vec<Class>, shutdown: CancellationToken) {
    let classes = Arc::new(classes);
    while !shutdown.is_cancelled() {
        let consumer = match history::historian_consumer(&conn).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "history: cannot bind the historian's consumer (run `leasehold setup`?); retrying");
                pause(&shutdown, RETRY * 5).await;
                continue;
            }
        };
        let msgs = match consumer.messages().await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "history: cannot pull terminal events; retrying");
                pause(&shutdown, RETRY).await;
                continue;
            }
        };
        let handled = msgs
            .take_until(shutdown.cancelled())
            .take_while(|m| {
                let ok = m.is_ok();
                if let Err(e) = m {
                    tracing::warn!(error = %e, "history: pull interrupted; pulling again");
                }
                futures::future::ready(ok)
            })
            .filter_map(|m| futures::future::ready(m.ok()))
            .for_each_concurrent(CONCURRENCY, |m| {
                let (conn, jobs, classes) = (&conn, &jobs, classes.clone());
                async move { one(conn, jobs, &classes, m).await }
            });
        handled.await;
        pause(&shutdown, RETRY).await;
    }
}

/// Records one end, then acks its event (a failure: it comes back).
async fn one(conn: &Conn, jobs: &Jobs, classes: &[Class], m: jetstream::Message) {
    let kind = serde_json::from_slice::<serde_json::Value>(&m.payload)
        .ok()
        .and_then(|v| v.get("kind").and_then(|k| k.as_str()).map(str::to_string))
        .unwrap_or_default();
    let ttl = ttl_of(classes, &kind);
    match history::note_end(conn, jobs, &m.payload, ttl).await {
        Ok(Some(e)) => {
            tracing::debug!(job = %e.id, status = %e.status, "history: entry recorded");
            if let Err(err) = m.ack().await {
                tracing::warn!(error = %err, job = %e.id, "history: ack lost; the redelivery is deduplicated");
            }
        }
        Ok(None) => {
            tracing::error!("history: a terminal event that does not decode; skipped");
            let _ = m.ack_with(AckKind::Term).await;
        }
        Err(e) => {
            tracing::warn!(error = %e, "history: entry not recorded; retrying");
            let _ = m.ack_with(AckKind::Nak(Some(RETRY))).await;
        }
    }
}

async fn pause(shutdown: &CancellationToken, d: Duration) {
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = shutdown.cancelled() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_live_their_kinds_retention() {
        let classes = vec![
            Class {
                retention: Duration::from_secs(7 * 86_400),
                kinds: None,
                others: vec!["echo".into()],
            },
            Class {
                retention: Duration::from_secs(3600),
                kinds: Some(vec!["echo".into()]),
                others: vec![],
            },
        ];
        assert_eq!(ttl_of(&classes, "echo"), Some(Duration::from_secs(3600)));
        assert_eq!(
            ttl_of(&classes, "research"),
            Some(Duration::from_secs(7 * 86_400))
        );
        assert_eq!(ttl_of(&[], "echo"), None, "retention off: kept by bytes");
    }
}
