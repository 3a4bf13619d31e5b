//! How a provider serves requests at once: what one request's end shows
//! ([`sign`], the one rule) and what it taught ([`Serving`]).

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

#[cfg(doc)]
use super::Permit;

/// Cut streams (each with another request waiting) that make a learned
/// concurrency of 1.
pub const LEARN_AFTER: u32 = 2;

/// What one request's end said about how its provider serves requests
/// at once ([`Permit::ended`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Serving {
    /// Nothing to learn from.
    Nothing,
    /// Cut for another request: the `seen`th such cut of [`LEARN_AFTER`].
    Cut { seen: u32 },
    /// This cut made it: the key's concurrency is 1 from now on, for the
    /// fleet.
    Learned,
    /// Cut while the key's concurrency is already 1 (the request was
    /// admitted before that applied).
    Known,
    /// Cut for another request, but a concurrency above 1 is set by hand
    /// (`setting`): nothing is learned.
    SetByHand {
        concurrency: u64,
        setting: &'static str,
    },
}

impl Serving {
    /// The cut was the provider serving one request at a time, and
    /// learning (or what was learned) answers it: not a failure of the
    /// request.
    pub fn interrupted(&self) -> bool {
        matches!(
            self,
            Serving::Cut { .. } | Serving::Learned | Serving::Known
        )
    }
}

/// What a request's end shows ([`sign`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sign {
    Nothing,
    /// Cut while another request waited for its first token.
    Cut,
    /// Completed while another request was generating: the provider serves
    /// two at once.
    Parallel,
}

/// The one rule: request `me` ended (`cut`: the server ended its stream
/// itself, `[DONE]`, before a finish reason; `completed`: it completed;
/// `last`: when its last chunk came, or when it was admitted if none did)
/// while `open` (every request of the key in flight, by number, and when
/// its first token came) were in flight. A server that runs one generation
/// at a time and cuts it for a newcomer leaves exactly this mark: the
/// newcomer is in flight and was not generating while the cut stream still
/// moved (its first token comes after the cut, if it came already). This
/// process reads the two connections in its own order, so "after" allows
/// [`READ_SKEW`]. The newcomer may have been sent before the cut one and
/// reached the server after it. Another request that generated well before
/// this one's last chunk (by more than [`READ_SKEW`]), when this one
/// completed, shows the provider serves two at once. A connection that
/// just stops (no `[DONE]`: a transport failure, a crash), or a cut while
/// no other request waits, shows nothing.
pub fn sign(
    open: &BTreeMap<u64, Option<Instant>>,
    me: u64,
    cut: bool,
    completed: bool,
    last: Instant,
) -> Sign {
    let others = || open.iter().filter(|(n, _)| **n != me).map(|(_, f)| *f);
    if cut {
        if others().any(|first| first.is_none_or(|t| t + READ_SKEW > last)) {
            return Sign::Cut;
        }
    } else if completed && others().any(|first| first.is_some_and(|t| t + READ_SKEW < last)) {
        return Sign::Parallel;
    }
    Sign::Nothing
}

/// How far apart this process may read two responses' chunks that the
/// server sent in the other order (tasks on a busy host).
pub const READ_SKEW: Duration = Duration::from_millis(250);
