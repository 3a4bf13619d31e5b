//! Provider rate limits, enforced the way a real provider does: requests
//! per minute, tokens per minute (prompt + completion) and concurrent
//! requests, per model, each over a token bucket that refills continuously
//! (`limit / 60` per second) up to `burst` seconds' worth (default the
//! whole minute). A request over a limit gets 429 with `Retry-After`: the
//! time until the bucket holds enough again, as seconds (rounded up) or as
//! an HTTP date (`--retry-after-form`).
//!
//! Set from `--limit [MODEL:]rpm=N,tpm=N,concurrency=N[,burst=SECS]`
//! (repeatable; no model = every model) or at run time with
//! `POST /limits {"model": "sim-1", "rpm": N, "tpm": N, "concurrency": N,
//! "burst": SECS, "retry_after_form": "seconds"|"http_date"}` (a missing
//! field is no limit; `GET /limits` lists them with their use).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};

/// How `Retry-After` is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum RetryAfterForm {
    /// Whole seconds, rounded up (`Retry-After: 3`).
    #[default]
    Seconds,
    /// An HTTP date (`Retry-After: Tue, 01 Dec 2026 21:00:03 GMT`).
    HttpDate,
}

/// One model's limits (`None` = unlimited).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSpec {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub rpm: Option<u64>,
    #[serde(default)]
    pub tpm: Option<u64>,
    #[serde(default)]
    pub concurrency: Option<u64>,
    /// Seconds of refill the buckets hold at most (default 60: a minute).
    #[serde(default)]
    pub burst: Option<f64>,
    #[serde(default)]
    pub retry_after_form: Option<RetryAfterForm>,
}

impl LimitSpec {
    /// Parses `[MODEL:]rpm=N,tpm=N,concurrency=N[,burst=SECS]`.
    pub fn parse(s: &str) -> Result<LimitSpec, String> {
        let (model, rest) = match s.split_once(':') {
            Some((m, r)) if !m.contains('=') => (Some(m.trim().to_string()), r),
            _ => (None, s),
        };
        let mut spec = LimitSpec {
            model,
            ..Default::default()
        };
        for part in rest.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| {
                format!("{part:?}: expected NAME=VALUE (rpm, tpm, concurrency, burst)")
            })?;
            let n = || {
                v.trim()
                    .parse::<u64>()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| format!("{k}={v:?}: expected a whole number above 0"))
            };
            match k.trim() {
                "rpm" => spec.rpm = Some(n()?),
                "tpm" => spec.tpm = Some(n()?),
                "concurrency" => spec.concurrency = Some(n()?),
                "burst" => {
                    spec.burst = Some(
                        v.trim()
                            .parse::<f64>()
                            .ok()
                            .filter(|b| b.is_finite() && *b > 0.0)
                            .ok_or_else(|| format!("burst={v:?}: expected seconds above 0"))?,
                    )
                }
                other => {
                    return Err(format!(
                        "{other:?}: unknown limit (expected rpm, tpm, concurrency or burst)"
                    ))
                }
            }
        }
        spec.check()?;
        Ok(spec)
    }

    pub fn check(&self) -> Result<(), String> {
        for (name, v) in [
            ("rpm", self.rpm),
            ("tpm", self.tpm),
            ("concurrency", self.concurrency),
        ] {
            if v == Some(0) {
                return Err(format!("{name}: 0 is no limit; leave it out instead"));
            }
        }
        if self.burst.is_some_and(|b| !(b.is_finite() && b > 0.0)) {
            return Err("burst: expected seconds above 0".into());
        }
        Ok(())
    }
}

/// A continuously refilling bucket.
#[derive(Debug)]
struct Bucket {
    per_sec: f64,
    cap: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    fn new(per_minute: u64, burst: f64) -> Bucket {
        let per_sec = per_minute as f64 / 60.0;
        let cap = (per_sec * burst).max(1.0);
        Bucket {
            per_sec,
            cap,
            level: cap,
            at: Instant::now(),
        }
    }
    fn refill(&mut self, now: Instant) {
        self.level =
            (self.level + now.duration_since(self.at).as_secs_f64() * self.per_sec).min(self.cap);
        self.at = now;
    }
    /// How long until `n` fit (zero: now).
    fn wait_for(&self, n: f64) -> Duration {
        let need = n.min(self.cap) - self.level;
        if need <= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(need / self.per_sec)
        }
    }
}

#[derive(Debug)]
struct ModelLimits {
    spec: LimitSpec,
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    in_flight: u64,
}

impl ModelLimits {
    fn new(spec: LimitSpec) -> ModelLimits {
        let burst = spec.burst.unwrap_or(60.0);
        ModelLimits {
            requests: spec.rpm.map(|r| Bucket::new(r, burst)),
            tokens: spec.tpm.map(|t| Bucket::new(t, burst)),
            in_flight: 0,
            spec,
        }
    }
}

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exceeded {
    Requests,
    Tokens,
    Concurrency,
}

impl Exceeded {
    pub fn name(self) -> &'static str {
        match self {
            Exceeded::Requests => "requests",
            Exceeded::Tokens => "tokens",
            Exceeded::Concurrency => "concurrency",
        }
    }
}

/// A refusal: which limit, and the `Retry-After` value to send.
#[derive(Debug)]
pub struct Refusal {
    pub exceeded: Exceeded,
    pub retry_after: String,
}

/// The limits of every model; `"*"` is the default of models not named.
#[derive(Default)]
pub struct Limits {
    inner: Mutex<HashMap<String, ModelLimits>>,
    form: Mutex<RetryAfterForm>,
    /// When the current `Retry-After` window began (its first 429) and
    /// until when the 429s given asked clients to wait.
    told_until: Mutex<Option<(Instant, Instant)>>,
    /// Requests that arrived while a `Retry-After` given was still running,
    /// more than [`SEEN_AFTER`] after the window's first 429 (a fleet that
    /// honours it sends none: the rest were under way before it could know).
    early: std::sync::atomic::AtomicU64,
}

/// How long after a 429 a client's requests may still be ones it sent
/// before it saw it (and before the fleet heard of it).
pub const SEEN_AFTER: Duration = Duration::from_millis(100);

/// Holds a concurrency slot and the token reservation until dropped (the
/// response's body finished or was dropped).
pub struct Admitted {
    limits: Arc<Limits>,
    model: String,
    counted: bool,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        if self.counted {
            let mut g = self.limits.inner.lock().expect("limits lock");
            if let Some(m) = g.get_mut(&self.model) {
                m.in_flight = m.in_flight.saturating_sub(1);
            }
        }
    }
}

impl Limits {
    pub fn new(specs: &[LimitSpec], form: RetryAfterForm) -> Limits {
        let l = Limits {
            inner: Mutex::new(HashMap::new()),
            form: Mutex::new(form),
            told_until: Mutex::new(None),
            early: Default::default(),
        };
        for s in specs {
            l.set(s.clone());
        }
        l
    }

    /// Requests that arrived while a `Retry-After` given was running.
    pub fn early(&self) -> u64 {
        self.early.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets (replaces) one model's limits; all `None` removes them.
    pub fn set(&self, spec: LimitSpec) {
        if let Some(f) = spec.retry_after_form {
            *self.form.lock().expect("form lock") = f;
        }
        let key = spec.model.clone().unwrap_or_else(|| "*".into());
        let mut g = self.inner.lock().expect("limits lock");
        if spec.rpm.is_none() && spec.tpm.is_none() && spec.concurrency.is_none() {
            g.remove(&key);
        } else {
            g.insert(key, ModelLimits::new(spec));
        }
    }

    /// The limits and their use, for `GET /limits`.
    pub fn list(&self) -> serde_json::Value {
        let mut g = self.inner.lock().expect("limits lock");
        let now = Instant::now();
        let mut out = serde_json::Map::new();
        for (k, m) in g.iter_mut() {
            for b in [&mut m.requests, &mut m.tokens].into_iter().flatten() {
                b.refill(now);
            }
            out.insert(
                k.clone(),
                serde_json::json!({
                    "rpm": m.spec.rpm, "tpm": m.spec.tpm, "concurrency": m.spec.concurrency,
                    "burst": m.spec.burst.unwrap_or(60.0),
                    "in_flight": m.in_flight,
                    "requests_available": m.requests.as_ref().map(|b| b.level.floor()),
                    "tokens_available": m.tokens.as_ref().map(|b| b.level.floor()),
                }),
            );
        }
        serde_json::json!({
            "retry_after_form": *self.form.lock().expect("form lock"),
            "models": out,
        })
    }

    /// Admits one request of `model` needing `prompt_tokens` now and
    /// `completion_tokens` once answered (both are charged at once: the
    /// sim knows its answer before it streams it).
    pub fn admit(
        self: &Arc<Self>,
        model: &str,
        prompt_tokens: u64,
        completion_tokens: u64,
    ) -> Result<Admitted, Refusal> {
        let now = Instant::now();
        if self
            .told_until
            .lock()
            .expect("told lock")
            .is_some_and(|(from, until)| now > from + SEEN_AFTER && now < until)
        {
            self.early
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let mut g = self.inner.lock().expect("limits lock");
        let key = if g.contains_key(model) { model } else { "*" };
        let Some(m) = g.get_mut(key) else {
            return Ok(Admitted {
                limits: self.clone(),
                model: String::new(),
                counted: false,
            });
        };
        let mut refusal: Option<(Exceeded, Duration)> = None;
        if let Some(c) = m.spec.concurrency {
            if m.in_flight >= c {
                refusal = Some((Exceeded::Concurrency, Duration::from_secs(1)));
            }
        }
        if refusal.is_none() {
            if let Some(b) = m.requests.as_mut() {
                b.refill(now);
                let w = b.wait_for(1.0);
                if !w.is_zero() {
                    refusal = Some((Exceeded::Requests, w));
                }
            }
        }
        if refusal.is_none() {
            if let Some(b) = m.tokens.as_mut() {
                b.refill(now);
                // The prompt must fit now; the completion may overdraw.
                let w = b.wait_for(prompt_tokens as f64);
                if !w.is_zero() {
                    refusal = Some((Exceeded::Tokens, w));
                }
            }
        }
        if let Some((exceeded, wait)) = refusal {
            let form = *self.form.lock().expect("form lock");
            // What the client is told, rounded up to whole seconds.
            let told = now + Duration::from_secs(wait.as_secs_f64().ceil().max(1.0) as u64);
            let mut t = self.told_until.lock().expect("told lock");
            *t = Some(match *t {
                Some((from, until)) if now < until => (from, until.max(told)),
                _ => (now, told),
            });
            return Err(Refusal {
                exceeded,
                retry_after: retry_after_value(form, wait),
            });
        }
        if let Some(b) = m.requests.as_mut() {
            b.level -= 1.0;
        }
        if let Some(b) = m.tokens.as_mut() {
            b.level -= (prompt_tokens + completion_tokens) as f64;
        }
        m.in_flight += 1;
        Ok(Admitted {
            limits: self.clone(),
            model: key.to_string(),
            counted: true,
        })
    }
}

/// `Retry-After` for a wait: whole seconds rounded up (at least 1), or the
/// HTTP date of the second after it ends.
pub fn retry_after_value(form: RetryAfterForm, wait: Duration) -> String {
    let secs = wait.as_secs_f64().ceil().max(1.0) as u64;
    match form {
        RetryAfterForm::Seconds => secs.to_string(),
        // The date has whole seconds: one more so it is never early.
        RetryAfterForm::HttpDate => {
            httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(secs + 1))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        let s = LimitSpec::parse("sim-1:rpm=60,tpm=1000,concurrency=2,burst=1").unwrap();
        assert_eq!(s.model.as_deref(), Some("sim-1"));
        assert_eq!(
            (s.rpm, s.tpm, s.concurrency),
            (Some(60), Some(1000), Some(2))
        );
        assert_eq!(LimitSpec::parse("rpm=5").unwrap().model, None);
        assert!(LimitSpec::parse("rpm=0").unwrap_err().contains("above 0"));
        assert!(LimitSpec::parse("rpm=x")
            .unwrap_err()
            .contains("whole number"));
        assert!(LimitSpec::parse("rps=3")
            .unwrap_err()
            .contains("unknown limit"));
        assert!(LimitSpec::parse("burst=-1").unwrap_err().contains("burst"));
    }

    #[test]
    fn refuses_over_each_limit_and_says_when() {
        let l = Arc::new(Limits::new(
            &[LimitSpec::parse("rpm=60,burst=2").unwrap()],
            RetryAfterForm::Seconds,
        ));
        let _a = l.admit("m", 1, 1).unwrap();
        let _b = l.admit("m", 1, 1).unwrap();
        let r = l.admit("m", 1, 1).err().unwrap();
        assert_eq!(r.exceeded, Exceeded::Requests);
        assert_eq!(r.retry_after, "1");

        let l = Arc::new(Limits::new(
            &[LimitSpec::parse("m:concurrency=1").unwrap()],
            RetryAfterForm::HttpDate,
        ));
        let a = l.admit("m", 1, 1).unwrap();
        let r = l.admit("m", 1, 1).err().unwrap();
        assert_eq!(r.exceeded, Exceeded::Concurrency);
        assert!(httpdate::parse_http_date(&r.retry_after).is_ok());
        drop(a);
        assert!(l.admit("m", 1, 1).is_ok());
        // Another model has no limits.
        assert!(l.admit("other", 1, 1).is_ok());

        let l = Arc::new(Limits::new(
            &[LimitSpec::parse("tpm=600,burst=1").unwrap()],
            RetryAfterForm::Seconds,
        ));
        assert!(l.admit("m", 8, 2).is_ok());
        assert_eq!(l.admit("m", 8, 2).err().unwrap().exceeded, Exceeded::Tokens);
    }
}
