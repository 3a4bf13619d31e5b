//! The job record and its events as the bucket and the stream hold them,
//! for a test that makes one up (seeded with [`crate::Fleet::seed_record`]
//! or published as a stale writer would).

pub use leasehold_core::machine::new_record;
pub use leasehold_core::time::{parse_rfc3339, rfc3339};
pub use leasehold_core::{JobError, JobRecord, JobSpec};
pub use leasehold_store::events::event;
pub use leasehold_store::jobs::decode;

/// Now, as records write their times.
pub fn now() -> String {
    rfc3339(std::time::SystemTime::now())
}
