//! One bounded read of a stream: every message under some subjects that is
//! there when the read starts, in order, then done.
//!
//! Reads like these are on hot paths (each attempt reads its journal; an
//! operator's bulk action scans the index for each job). They use an
//! ephemeral pull consumer that the server drops [`READER_IDLE`] after the
//! read, not an ordered consumer: async-nats gives those a 30 s inactive
//! threshold, and one per read piled up past the server's consumer limit
//! (10026) when many attempts started at once (a fleet's worth of timers
//! waking) or a bulk replay scanned the index per job. Deleting the
//! consumer instead would need a permission the read-only users (the
//! console's `lh-console`) do not have.

use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;

use crate::StoreError;

/// How long the server keeps a reader's consumer after its last pull:
/// short, so that hundreds of reads a second (a fleet's timers waking)
/// stay under the server's consumer limit; a consumer dropped before a
/// loaded machine's first pull makes its read stall, and the read is
/// tried again with a new one.
pub const READER_IDLE: Duration = Duration::from_secs(1);

/// How long a read may wait for its next message before it is called stalled.
const STALL: Duration = Duration::from_secs(10);

/// Every message of `stream` under `filters` from `deliver` on that is
/// there now, in stream order. `what` names the read in errors. A read
/// that stalls (its consumer gone under a loaded server, a leader moving)
/// is started once more with a new consumer.
pub(crate) async fn read_once<I>(
    stream: &jetstream::stream::Stream<I>,
    filters: Vec<String>,
    deliver: consumer::DeliverPolicy,
    what: &str,
) -> Result<Vec<jetstream::Message>, StoreError> {
    match read(stream, filters.clone(), deliver, what).await {
        Err(Stalled) => {
            tracing::debug!(
                read = what,
                "a read stalled; reading again with a new consumer"
            );
            read(stream, filters, deliver, what).await
        }
        r => r,
    }
    .map_err(|e| match e {
        Stalled => StoreError::failed(format!("{what} stalled")),
        Failed(e) => e,
    })
}

enum ReadError {
    Stalled,
    Failed(StoreError),
}
use ReadError::{Failed, Stalled};

async fn read<I>(
    stream: &jetstream::stream::Stream<I>,
    filters: Vec<String>,
    deliver: consumer::DeliverPolicy,
    what: &str,
) -> Result<Vec<jetstream::Message>, ReadError> {
    let consumer = stream
        .create_consumer(consumer::pull::Config {
            filter_subjects: filters,
            deliver_policy: deliver,
            ack_policy: consumer::AckPolicy::None,
            inactive_threshold: READER_IDLE,
            memory_storage: true,
            num_replicas: 1,
            ..Default::default()
        })
        .await
        .map_err(|e| Failed(StoreError::nats(what, e)))?;
    let mut pending = consumer.cached_info().num_pending;
    let mut out = Vec::new();
    if pending == 0 {
        return Ok(out);
    }
    let mut msgs = consumer
        .messages()
        .await
        .map_err(|e| Failed(StoreError::nats(what, e)))?;
    while pending > 0 {
        let Ok(Some(Ok(m))) = tokio::time::timeout(STALL, msgs.next()).await else {
            return Err(Stalled);
        };
        pending = m
            .info()
            .map_err(|e| Failed(StoreError::nats(what, e)))?
            .pending;
        out.push(m);
    }
    Ok(out)
}
