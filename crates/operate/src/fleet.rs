//! What an operator's view of the fleet reads, without a scan of history:
//! tickets per kind and the work queue's limits (the work stream's info),
//! dead letters per kind (the DLQ's info), the live worker sessions, and
//! the reapers' own metrics (each answers `lh.reaper.metrics`).

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;

use leasehold_store::sessions::{Current, SessionInfo, Sessions};
use leasehold_store::{Conn, StoreError};

/// The work queue: tickets per kind, totals and limits.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Queue {
    pub tickets_by_kind: BTreeMap<String, u64>,
    pub messages: u64,
    pub bytes: u64,
    pub max_messages: i64,
    pub max_bytes: i64,
}

/// Tickets per kind in `LH_WORK` and the stream's bounds.
pub async fn queue(conn: &Conn) -> Result<Queue, StoreError> {
    let l = &conn.layout;
    let mut stream = conn
        .js
        .get_stream(l.work_stream())
        .await
        .map_err(|e| StoreError::nats("work stream", e))?;
    let info = stream
        .info()
        .await
        .map_err(|e| StoreError::nats("work stream", e))?;
    let mut q = Queue {
        messages: info.state.messages,
        bytes: info.state.bytes,
        max_messages: info.config.max_messages,
        max_bytes: info.config.max_bytes,
        ..Default::default()
    };
    let mut subjects = stream
        .info_with_subjects(l.submit_wildcard())
        .await
        .map_err(|e| StoreError::nats("work stream", e))?;
    while let Some(x) = subjects.next().await {
        let (subject, n) = x.map_err(|e| StoreError::nats("work stream", e))?;
        if let Some(kind) = l.kind_of_submit_subject(&subject) {
            // Every lane of the kind counts.
            *q.tickets_by_kind.entry(kind.to_string()).or_default() += n as u64;
        }
    }
    Ok(q)
}

/// Dead letters per kind (the DLQ's subjects), without reading one.
pub async fn dead_letters_by_kind(conn: &Conn) -> Result<BTreeMap<String, u64>, StoreError> {
    let l = &conn.layout;
    let stream = conn
        .js
        .get_stream_no_info(l.dlq_stream())
        .await
        .map_err(|e| StoreError::nats("DLQ", e))?;
    let mut subjects = stream
        .info_with_subjects(l.dlq_wildcard())
        .await
        .map_err(|e| StoreError::nats("DLQ", e))?;
    let prefix = l.dlq_subject("");
    let mut out = BTreeMap::new();
    while let Some(x) = subjects.next().await {
        let (subject, n) = x.map_err(|e| StoreError::nats("DLQ", e))?;
        if let Some(kind) = subject.strip_prefix(&prefix) {
            out.insert(kind.to_string(), n as u64);
        }
    }
    Ok(out)
}

/// The live worker sessions, by worker id.
pub async fn live_sessions(sessions: &Sessions) -> Result<Vec<SessionInfo>, StoreError> {
    let mut ids: Vec<String> = Vec::new();
    let mut keys = sessions
        .kv()
        .keys()
        .await
        .map_err(|e| StoreError::nats("sessions", e))?;
    while let Some(k) = keys.next().await {
        ids.push(k.map_err(|e| StoreError::nats("sessions", e))?);
    }
    ids.sort();
    let mut out = Vec::new();
    for id in ids {
        if let Current::Live { info, .. } = sessions.current(&id).await? {
            out.push(info);
        }
    }
    Ok(out)
}

/// Every reaper's metrics (JSON), as many as answer within `wait`.
pub async fn reaper_metrics(
    conn: &Conn,
    wait: Duration,
) -> Result<Vec<serde_json::Value>, StoreError> {
    let inbox = conn.client.new_inbox();
    let mut sub = conn
        .client
        .subscribe(inbox.clone())
        .await
        .map_err(|e| StoreError::nats("reaper metrics", e))?;
    conn.client
        .publish_with_reply(conn.layout.reaper_metrics_subject(), inbox, "".into())
        .await
        .map_err(|e| StoreError::nats("reaper metrics", e))?;
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + wait;
    while let Ok(Some(m)) = tokio::time::timeout_at(deadline, sub.next()).await {
        if let Ok(v) = serde_json::from_slice(&m.payload) {
            out.push(v);
        }
    }
    Ok(out)
}
