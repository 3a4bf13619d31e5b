//! The JetStream side of leasehold.
//!
//! Architecture invariant: this is the only crate that knows NATS subjects,
//! streams, buckets and headers. Everything above it speaks in jobs, records,
//! events and tickets.
//!
//! - [`layout`]: the names, derived from the namespace prefix.
//! - [`connect`]: connecting with credentials and TLS from the environment.
//! - [`setup`]: creating and verifying streams, buckets and consumers.
//! - [`jobs`]: the job KV bucket: revision-conditioned reads and writes, the
//!   read-decide-CAS loop, and [`jobs::Gate`], the one door of owner-side writes.
//! - [`events`]: job events, and [`events::Fence`], server-side fenced publication.
//! - [`work`]: work tickets in the work-queue stream.
//! - [`dlq`]: dead letters.

pub mod connect;
pub mod dlq;
pub mod events;
pub mod jobs;
pub mod layout;
pub mod setup;
pub mod work;

pub use connect::{Conn, NatsArgs};
pub use jobs::{Gate, Jobs, JobsError, Versioned};
pub use layout::Layout;

/// Errors of the store layer outside the job-record path.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("configuration: {0}")]
    Config(String),
    #[error("cannot connect to NATS: {0}")]
    Connect(String),
    #[error("the NATS layout is incomplete, run `leasehold setup`: missing {}", .0.join(", "))]
    Missing(Vec<String>),
    #[error("{0}")]
    Nats(String),
}

impl StoreError {
    pub(crate) fn nats(context: &str, e: impl std::fmt::Display) -> Self {
        StoreError::Nats(format!("{context}: {e}"))
    }
}

/// The JetStream API error code inside `err`'s source chain, if any.
///
/// async-nats maps only some codes to error kinds; 10164 (a spurious
/// wrong-last-sequence in clusters) arrives as a generic error whose code is
/// only visible here.
pub fn server_error_code(err: &(dyn std::error::Error + 'static)) -> Option<u64> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(js) = e.downcast_ref::<async_nats::jetstream::Error>() {
            return Some(js.error_code().0);
        }
        cur = e.source();
    }
    None
}

/// Wrong last sequence: a real conflict (10071).
pub const WRONG_LAST_SEQUENCE: u64 = 10071;
/// Wrong last sequence while an earlier write is in process on a cluster
/// leader: spurious, re-read and retry (10164).
pub const WRONG_LAST_SEQUENCE_CONSTANT: u64 = 10164;
