//! Recurring schedules: a cron expression and which of its ticks fires.
//!
//! Expressions are standard 5-field cron (`minute hour day-of-month month
//! day-of-week`) in UTC; a 6-field form with a leading seconds field is
//! accepted too (`*/2 * * * * *`: every two seconds), for schedules finer
//! than a minute. An expression that does not parse, or that never fires,
//! is refused.
//!
//! Which tick fires ([`due_tick`]) is one pure function of the expression,
//! the tick fired last, the schedule's creation and `now`: the most recent
//! tick at or before `now` that is later than both. Older ticks missed while
//! no reaper ran are skipped: a schedule that missed many ticks fires once,
//! for the latest one. A fired tick's job id is [`job_id`]`(name, tick)`,
//! so every reaper that fires the same tick submits the same job.

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

/// The tick a schedule fires at `now`, if any: the latest tick at or before
/// `now` later than `last_fired` (the tick fired last) and later than
/// `created_at` (a schedule never fires for a time before it existed).
/// Older missed ticks are skipped.
pub fn due_tick(
    s: &Schedule,
    last_fired: Option<SystemTime>,
    created_at: SystemTime,
    now: SystemTime,
) -> Option<SystemTime> {
    let tick = s.latest_at_or_before(now)?;
    let floor = last_fired.map_or(created_at, |l| l.max(created_at));
    (tick > floor).then_some(tick)
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

    #[test]
    fn a_tick_fires_once_and_only_after_the_schedule_existed() {
        let s = every_minute();
        // Created mid-minute: nothing until the next tick.
        assert_eq!(due_tick(&s, None, t(30), t(59)), None);
        assert_eq!(due_tick(&s, None, t(30), t(60)), Some(t(60)));
        // Fired: not again within the same minute.
        assert_eq!(due_tick(&s, Some(t(60)), t(30), t(119)), None);
        assert_eq!(due_tick(&s, Some(t(60)), t(30), t(120)), Some(t(120)));
    }

    #[test]
    fn missed_ticks_fire_once_for_the_latest_and_older_ones_are_skipped() {
        let s = every_minute();
        // No reaper ran for ten minutes: only the latest tick fires.
        assert_eq!(due_tick(&s, Some(t(60)), t(0), t(660 + 5)), Some(t(660)));
        assert_eq!(due_tick(&s, Some(t(660)), t(0), t(660 + 30)), None);
        let hourly = Schedule::parse("0 * * * *", t(0)).unwrap();
        assert_eq!(
            due_tick(&hourly, Some(t(0)), t(0), t(3 * 3600 + 1800)),
            Some(t(3 * 3600))
        );
    }

    #[test]
    fn seconds_schedules_and_job_ids() {
        let s = Schedule::parse("*/2 * * * * *", t(0)).unwrap();
        assert_eq!(due_tick(&s, Some(t(2)), t(0), t(3)), None);
        assert_eq!(due_tick(&s, Some(t(2)), t(0), t(4)), Some(t(4)));
        assert_eq!(job_id("nightly", t(4)), "nightly-1799992804");
        assert!(crate::spec::valid_job_id(&job_id(
            &"n".repeat(MAX_NAME_LEN),
            t(4)
        )));
        assert!(valid_name("a_b-1") && !valid_name("a.b") && !valid_name(""));
    }
}
