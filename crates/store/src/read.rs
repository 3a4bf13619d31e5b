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

/// How long a read waits, in all, for room under the server's consumer
/// limit (10026) before it fails: each reader's consumer goes
/// [`READER_IDLE`] after its read, so room comes back within about that.
const BUSY_FOR: Duration = Duration::from_secs(30);

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
    let busy_until = tokio::time::Instant::now() + BUSY_FOR;
    let mut pauses =
        leasehold_core::retry::Backoff::new(Duration::from_millis(50), Duration::from_millis(500));
    let mut stalled = false;
    loop {
        match read(stream, filters.clone(), deliver, what).await {
            Err(Stalled) if !stalled => {
                tracing::debug!(
                    read = what,
                    "a read stalled; reading again with a new consumer"
                );
                stalled = true;
            }
            // Many reads at once (a fleet's timers waking, a burst of
            // attempts replaying their steps) can fill the server's
            // consumer limit for a moment: wait for room in place, rather
            // than fail the read and spend a retry of the job on it.
            Err(Busy(e)) if tokio::time::Instant::now() < busy_until => {
                let pause = pauses.pause();
                tracing::debug!(read = what, error = %e, ?pause, "the server's consumer limit is reached; reading again shortly");
                tokio::time::sleep(pause).await;
            }
            r => {
                return r.map_err(|e| match e {
                    Stalled => StoreError::failed(format!("{what} stalled")),
                    Failed(e) | Busy(e) => e,
                })
            }
        }
    }
}

enum ReadError {
    Stalled,
    /// The server's consumer limit is reached (10026).
    Busy(StoreError),
    Failed(StoreError),
}
use ReadError::{Busy, Failed, Stalled};

/// The server's code for "maximum consumers limit reached".
const CONSUMER_LIMIT: u64 = 10026;

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
        .map_err(|e| {
            if crate::answer::answer_of(&e) == crate::answer::Answer::Code(CONSUMER_LIMIT) {
                Busy(StoreError::Unavailable(format!(
                    "{what}: the server's consumer limit is reached: {e}"
                )))
            } else {
                Failed(StoreError::nats(what, e))
            }
        })?;
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
