//! Job statuses as the contract names them.

use std::fmt;
use std::str::FromStr;

/// Where a job is in its life. Terminal statuses never change again, except
/// `failed`/`dead`/`rejected` replayed from the DLQ by an operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    Queued,
    Running,
    Completed,
    Failed,
    Cancelled,
    Rejected,
    Parked,
    Dead,
    /// Waiting for a time (a durable timer, `ctx.sleep`): no worker holds
    /// it; its wake-up gives it a ticket when the time comes.
    Waiting,
}

impl Status {
    pub const ALL: [Status; 9] = [
        Status::Queued,
        Status::Running,
        Status::Completed,
        Status::Failed,
        Status::Cancelled,
        Status::Rejected,
        Status::Parked,
        Status::Dead,
        Status::Waiting,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Status::Queued => "queued",
            Status::Running => "running",
            Status::Completed => "completed",
            Status::Failed => "failed",
            Status::Cancelled => "cancelled",
            Status::Rejected => "rejected",
            Status::Parked => "parked",
            Status::Dead => "dead",
            Status::Waiting => "waiting",
        }
    }

    /// No worker will ever run the job again in this status.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Status::Completed
                | Status::Failed
                | Status::Cancelled
                | Status::Rejected
                | Status::Dead
        )
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Status {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Status::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown status {s:?}; expected one of: {}",
                    Status::ALL.map(|s| s.as_str()).join(", ")
                )
            })
    }
}
