//! Recurring schedules: a cron expression and which of its ticks fires.
//!
//! Expressions are standard 5-field cron (`minute hour day-of-month month
//! day-of-week`) in UTC; a 6-field form with a leading seconds field is
//! accepted too (`*/2 * * * * *`: every two seconds), for schedules finer
//! than a minute. An expression that does not parse, or that never fires,
//! is refused.
//!
//! Which ticks fire ([`due_ticks`]) is one pure function of the expression,
//! the tick fired (or skipped) last, the schedule's creation, `now` and the
//! catch-up allowed: every tick at or before `now` later than both, oldest
//! first. Ticks missed while no reaper ran fire too (a bounded catch-up): at
//! most [`MAX_CATCH_UP`] of them, the newest, and none older than the
//! catch-up window; older ones are skipped, and the latest skipped tick is
//! returned so the skip is recorded, never silent. A fired tick's job id is
//! [`job_id`]`(name, tick)`, so every reaper that fires the same tick
//! submits the same job.

use std::time::{Duration, SystemTime};

use chrono::{DateTime, Utc};
use croner::parser::{CronParser, Seconds, Year};
use croner::Cron;

/// A parsed cron expression (UTC).
#[derive(Debug, Clone)]
pub struct Schedule {
    cron: Cron,
    expr: String,
}

/// The longest schedule name: a job id is `<name>-<unix seconds>`, at most 128 characters.
pub const MAX_NAME_LEN: usize = 64;

/// Whether `name` can name a schedule: 1-64 letters, digits, `-` or `_`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
}

fn utc(t: SystemTime) -> DateTime<Utc> {
    DateTime::<Utc>::from(t)
}

impl Schedule {
    /// Parses a 5-field (or 6-field, seconds first) cron expression, and
    /// refuses one that never fires after `now`. The error is one line.
    pub fn parse(expr: &str, now: SystemTime) -> Result<Schedule, String> {
        let expr = expr.trim();
        let fields = expr.split_whitespace().count();
        if !(5..=6).contains(&fields) {
            return Err(format!(
                "cron {expr:?} has {fields} fields: write 5 (minute hour day-of-month month day-of-week, UTC), or 6 with seconds first"
            ));
        }
        let cron = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build()
            .parse(expr)
            .map_err(|e| format!("cron {expr:?} does not parse: {e}"))?;
        let s = Schedule {
            cron,
            expr: expr.to_string(),
        };
        if s.next_after(now).is_none() {
            return Err(format!("cron {expr:?} never fires"));
        }
        Ok(s)
    }

    /// The expression as given.
    pub fn expr(&self) -> &str {
        &self.expr
    }

    /// The first tick strictly after `t`.
    pub fn next_after(&self, t: SystemTime) -> Option<SystemTime> {
        self.cron
            .find_next_occurrence(&utc(t), false)
            .ok()
            .map(SystemTime::from)
    }

    /// The latest tick at or before `t`.
    pub fn latest_at_or_before(&self, t: SystemTime) -> Option<SystemTime> {
        // Ticks are whole seconds: search from the whole second of `t`.
        let secs = t
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(secs);
        self.cron
            .find_previous_occurrence(&utc(t), true)
            .ok()
            .map(SystemTime::from)
    }
}

/// The most missed ticks of one schedule a check fires (the newest);
/// older ones are skipped and recorded as such.
pub const MAX_CATCH_UP: usize = 100;

/// The ticks of one schedule a check fires, and what it skips.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Due {
    /// The ticks to fire, oldest first.
    pub ticks: Vec<SystemTime>,
    /// The latest tick skipped unfired (missed longer ago than the catch-up
    /// window, or beyond [`MAX_CATCH_UP`]): every tick after the floor up to
    /// and including it is skipped.
    pub skipped_through: Option<SystemTime>,
}

/// The ticks a schedule fires at `now`: every tick at or before `now` later
/// than `floor` (the tick fired or skipped last) and than `created_at` (a
/// schedule never fires for a time before it existed), oldest first, at
/// most the [`MAX_CATCH_UP`] newest, none older than `catch_up`. The
/// missed ticks beyond either bound are skipped ([`Due::skipped_through`]).
pub fn due_ticks(
    s: &Schedule,
    floor: Option<SystemTime>,
    created_at: SystemTime,
    now: SystemTime,
    catch_up: Duration,
) -> Due {
    let floor = floor.map_or(created_at, |l| l.max(created_at));
    let mut due = Due::default();
    let mut at = s.latest_at_or_before(now);
    while let Some(tick) = at.filter(|t| *t > floor) {
        let age = now.duration_since(tick).unwrap_or_default();
        if due.ticks.len() == MAX_CATCH_UP || age > catch_up {
            due.skipped_through = Some(tick);
            break;
        }
        due.ticks.push(tick);
        at = tick
            .checked_sub(Duration::from_secs(1))
            .and_then(|t| s.latest_at_or_before(t));
    }
    due.ticks.reverse();
    due
}

/// The job id of a schedule's tick: `<name>-<tick as unix seconds>`.
pub fn job_id(name: &str, tick: SystemTime) -> String {
    let secs = tick
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!("{name}-{secs}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2027-01-15T10:00:00Z plus `s` seconds (a Friday).
    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_799_992_800 + s)
    }

    fn every_minute() -> Schedule {
        Schedule::parse("* * * * *", t(0)).unwrap()
    }

    #[test]
    fn impossible_expressions_are_refused_in_one_line() {
        for bad in [
            "61 * * * *",
            "* * *",
            "0 0 30 2 *",
            "a b c d e",
            "* * * * * * *",
        ] {
            let e = Schedule::parse(bad, t(0)).unwrap_err();
            assert!(!e.contains('\n') && e.starts_with("cron "), "{bad}: {e}");
        }
        assert!(Schedule::parse("0 0 30 2 *", t(0))
            .unwrap_err()
            .contains("never fires"));
        assert!(Schedule::parse("*/15 9-17 * * 1-5", t(0)).is_ok());
        assert!(Schedule::parse("*/2 * * * * *", t(0)).is_ok());
    }

    const DAY: Duration = Duration::from_secs(86_400);

    fn ticks(s: &Schedule, floor: Option<u64>, created: u64, now: u64) -> Vec<SystemTime> {
        let d = due_ticks(s, floor.map(t), t(created), t(now), DAY);
        assert_eq!(d.skipped_through, None);
        d.ticks
    }

    #[test]
    fn a_tick_fires_once_and_only_after_the_schedule_existed() {
        let s = every_minute();
        // Created mid-minute: nothing until the next tick.
        assert_eq!(ticks(&s, None, 30, 59), vec![]);
        assert_eq!(ticks(&s, None, 30, 60), vec![t(60)]);
        // Fired: not again within the same minute.
        assert_eq!(ticks(&s, Some(60), 30, 119), vec![]);
        assert_eq!(ticks(&s, Some(60), 30, 120), vec![t(120)]);
    }

    #[test]
    fn missed_ticks_fire_oldest_first_within_the_catch_up() {
        let s = every_minute();
        // No reaper ran for ten minutes: each missed tick fires, in order.
        assert_eq!(
            ticks(&s, Some(60), 0, 660 + 5),
            (2..=11).map(|m| t(m * 60)).collect::<Vec<_>>()
        );
        assert_eq!(ticks(&s, Some(660), 0, 660 + 30), vec![]);
        let hourly = Schedule::parse("0 * * * *", t(0)).unwrap();
        assert_eq!(
            ticks(&hourly, Some(0), 0, 3 * 3600 + 1800),
            vec![t(3600), t(7200), t(3 * 3600)]
        );
    }

    #[test]
    fn ticks_past_the_catch_up_are_skipped_and_said_so() {
        let s = every_minute();
        // Missed for ten minutes with five minutes of catch-up: the five
        // newest fire, the older ones are skipped through minute 6.
        let d = due_ticks(&s, Some(t(60)), t(0), t(665), Duration::from_secs(300));
        assert_eq!(d.ticks, (7..=11).map(|m| t(m * 60)).collect::<Vec<_>>());
        assert_eq!(d.skipped_through, Some(t(360)));
        // Nothing within the catch-up: all skipped, none fires.
        let d = due_ticks(&s, Some(t(60)), t(0), t(665), Duration::from_secs(1));
        assert_eq!((d.ticks, d.skipped_through), (vec![], Some(t(660))));
        // A week missed every second: at most MAX_CATCH_UP fire.
        let every_second = Schedule::parse("* * * * * *", t(0)).unwrap();
        let d = due_ticks(&every_second, Some(t(0)), t(0), t(7 * 86_400), DAY);
        assert_eq!(d.ticks.len(), MAX_CATCH_UP);
        assert_eq!(d.ticks.last(), Some(&t(7 * 86_400)));
        assert_eq!(d.skipped_through, Some(t(7 * 86_400 - MAX_CATCH_UP as u64)));
    }

    #[test]
    fn seconds_schedules_and_job_ids() {
        let s = Schedule::parse("*/2 * * * * *", t(0)).unwrap();
        assert_eq!(ticks(&s, Some(2), 0, 3), vec![]);
        assert_eq!(ticks(&s, Some(2), 0, 4), vec![t(4)]);
        assert_eq!(job_id("nightly", t(4)), "nightly-1799992804");
        assert!(crate::spec::valid_job_id(&job_id(
            &"n".repeat(MAX_NAME_LEN),
            t(4)
        )));
        assert!(valid_name("a_b-1") && !valid_name("a.b") && !valid_name(""));
    }
}
