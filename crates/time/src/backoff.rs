//! Backoff: capped exponential ceilings, full jitter, and the pauses of
//! an operation tried again in place.
//!
//! The ceiling of attempt `n` (0-based) is `min(cap, base * 2^n)`
//! ([`capped_exponential`]); a delay drawn under it is uniform in
//! `[0, ceiling]` ([`full_jitter`]), so a fleet retrying a shared failure
//! spreads out. Job-level retries (`leasehold_core::retry::RetryPolicy`), the
//! model client's generation retries and the tools' read retries use these
//! two functions. An operation tried again in place (an owner write, a
//! ticket, a claim marker, a start-up lookup) pauses by [`Backoff`], the
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
/// use leasehold_time::backoff::Backoff;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_attempts_saturate_instead_of_overflowing() {
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
