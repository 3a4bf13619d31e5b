//! Job-level retry: capped exponential backoff with full jitter.
//!
//! The ceiling of attempt `n` (0-based) is `min(cap, base * 2^n)`
//! ([`capped_exponential`]); the delay is uniform in `[0, ceiling]`
//! ([`full_jitter`]), so a fleet retrying a shared failure spreads out. The
//! model client's generation retries and the tools' read retries use the
//! same two functions. An operation tried again in place (an owner write,
//! a ticket, a claim marker, a start-up lookup) pauses by [`Backoff`], the
//! same doubling without jitter.

use std::time::Duration;

use rand::Rng;

/// `min(cap, base * 2^attempt)`, saturating: any attempt number, however
/// large, gives at most `cap` and never overflows.
pub fn capped_exponential(base: Duration, cap: Duration, attempt: u32) -> Duration {
    // 2^31 * base already exceeds any sensible cap; past it the doubling
    // would only overflow, so the exponent stops there.
    let factor = 1u32 << attempt.min(31);
    base.saturating_mul(factor).min(cap)
}

/// The pauses between the tries of one operation that is tried again
/// until it succeeds or its caller gives up: `first`, then twice that,
/// and so on, never more than `cap` ([`capped_exponential`]). An endless
/// iterator; the caller sleeps each pause.
///
/// ```
/// use std::time::Duration;
/// use leasehold_core::retry::Backoff;
/// let ms = |n| Duration::from_millis(n);
/// let pauses: Vec<_> = Backoff::new(ms(100), ms(350)).take(4).collect();
/// assert_eq!(pauses, [ms(100), ms(200), ms(350), ms(350)]);
/// ```
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    cap: Duration,
    tries: u32,
}

impl Backoff {
    /// Pauses from `first`, doubling, at most `cap`.
    pub const fn new(first: Duration, cap: Duration) -> Backoff {
        Backoff {
            first,
            cap,
            tries: 0,
        }
    }

    /// The next pause (the first, then each twice the one before).
    pub fn pause(&mut self) -> Duration {
        let d = capped_exponential(self.first, self.cap, self.tries);
        self.tries = self.tries.saturating_add(1);
        d
    }
}

impl Iterator for Backoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        Some(self.pause())
    }
}

/// A delay uniform in `[0, ceiling]` (microsecond resolution).
pub fn full_jitter(ceiling: Duration, rng: &mut impl Rng) -> Duration {
    let micros = u64::try_from(ceiling.as_micros()).unwrap_or(u64::MAX);
    if micros == 0 {
        return Duration::ZERO;
    }
    Duration::from_micros(rng.gen_range(0..=micros))
}

use crate::JobSpec;

/// Job-level retry policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in all (the first included) before the job fails.
    pub max_attempts: u32,
    pub base: Duration,
    pub cap: Duration,
}

/// `5 attempts, backoff 1s..5m` (human durations).
impl std::fmt::Display for RetryPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} attempts, backoff {}..{}",
            self.max_attempts,
            crate::time::human_duration(self.base),
            crate::time::human_duration(self.cap)
        )
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            base: Duration::from_secs(1),
            cap: Duration::from_secs(300),
        }
    }
}

impl RetryPolicy {
    /// This policy with the spec's overrides applied.
    pub fn for_spec(self, spec: Option<&JobSpec>) -> Self {
        let Some(r) = spec.and_then(|s| s.retry.as_ref()) else {
            return self;
        };
        RetryPolicy {
            max_attempts: r.max_attempts.unwrap_or(self.max_attempts),
            base: r.base_ms.map(Duration::from_millis).unwrap_or(self.base),
            cap: r.cap_ms.map(Duration::from_millis).unwrap_or(self.cap),
        }
    }

    /// The capped exponential ceiling of retry number `attempt` (0-based).
    pub fn ceiling(&self, attempt: u32) -> Duration {
        capped_exponential(self.base, self.cap, attempt)
    }

    /// A full-jitter delay for retry number `attempt`.
    pub fn delay(&self, attempt: u32, rng: &mut impl Rng) -> Duration {
        full_jitter(self.ceiling(attempt), rng)
    }

    /// Whether a job that has failed `failed_attempts` times (this one
    /// included) may run again.
    pub fn allows_another(&self, failed_attempts: u32) -> bool {
        failed_attempts < self.max_attempts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceiling_doubles_then_caps_and_jitter_stays_below() {
        let p = RetryPolicy {
            max_attempts: 5,
            base: Duration::from_millis(100),
            cap: Duration::from_millis(500),
        };
        let c: Vec<u128> = (0..5).map(|i| p.ceiling(i).as_millis()).collect();
        assert_eq!(c, vec![100, 200, 400, 500, 500]);
        let mut rng = rand::thread_rng();
        for i in 0..50 {
            assert!(p.delay(i % 6, &mut rng) <= p.ceiling(i % 6));
        }
        assert!(p.allows_another(4) && !p.allows_another(5));
    }

    #[test]
    fn large_attempts_stay_at_the_cap_without_overflow() {
        let p = RetryPolicy {
            max_attempts: u32::MAX,
            base: Duration::from_secs(1),
            cap: Duration::from_secs(300),
        };
        for attempt in [9, 31, 32, 63, 64, 1_000, u32::MAX] {
            assert_eq!(p.ceiling(attempt), p.cap, "attempt {attempt}");
        }
        // A cap beyond what doubling can reach: the ceiling saturates instead
        // of wrapping around to something small.
        let huge = Duration::MAX;
        assert_eq!(
            capped_exponential(Duration::from_secs(u64::MAX / 2), huge, u32::MAX),
            Duration::MAX
        );
        assert_eq!(
            capped_exponential(Duration::from_millis(1), huge, u32::MAX),
            Duration::from_millis(1u64 << 31)
        );
        let mut rng = rand::thread_rng();
        assert!(full_jitter(Duration::MAX, &mut rng) <= Duration::MAX);
        assert_eq!(full_jitter(Duration::ZERO, &mut rng), Duration::ZERO);
        assert_eq!(capped_exponential(Duration::ZERO, huge, 5), Duration::ZERO);
    }
}
