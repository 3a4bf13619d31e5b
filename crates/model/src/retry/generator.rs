//! The generation retry loop: [`Generator::generate`] asks one model for
//! one complete response, retrying at this one layer (see the parent
//! module for the rule), through the fleet's flow control and the model's
//! circuit breaker.

use std::sync::Arc;
use std::time::Duration;

use leasehold_telemetry::{observe, spans};
use leasehold_transcript::Message;
use tokio::time::Instant;
use tracing::Instrument;

use super::*;
use crate::breaker::CircuitBreaker;
use crate::client::{AttemptState, Completion, ModelClient};
use crate::error::{FailureClass, ModelError};
use crate::wire::ChatRequest;
use leasehold_flow::{Flow, ProviderKey, Serving, Wait, LEARN_AFTER};

/// The generation retry loop around one client and its breakers.
pub struct Generator {
    pub client: ModelClient,
    pub breaker: Arc<CircuitBreaker>,
    pub fallback_breaker: Arc<CircuitBreaker>,
    pub policy: GenerationPolicy,
}

impl Generator {
    pub fn new(
        client: ModelClient,
        policy: GenerationPolicy,
        breaker_cfg: crate::breaker::BreakerConfig,
    ) -> Self {
        let primary = client.config().model.clone();
        let fallback = client
            .config()
            .fallback_model
            .clone()
            .unwrap_or_else(|| "fallback".into());
        Generator {
            breaker: Arc::new(CircuitBreaker::new(
                format!("model:{primary}"),
                breaker_cfg.clone(),
            )),
            fallback_breaker: Arc::new(CircuitBreaker::new(
                format!("model:{fallback}"),
                breaker_cfg,
            )),
            client,
            policy,
        }
    }

    /// Generates one complete response for `req`, retrying at this one
    /// layer. Reports go to `ctx.reporter` and into `reports`.
    ///
    /// Each round: the run's own stops (cancel, budget, deadline), then one
    /// request ([`Generator::send`]: admission, breaker, the call); on a
    /// failure, first whether it was an attempt at all
    /// ([`Generator::not_an_attempt`]), then what the failed attempt leads
    /// to ([`Generator::after_attempt`]).
    pub async fn generate(
        &self,
        req: &ChatRequest,
        ctx: &RunContext,
        reports: &mut Vec<RetryReport>,
    ) -> Result<Generated, GenerationFailure> {
        let mut t = Tries {
            model: self.client.config().model.clone(),
            ..Tries::default()
        };
        let flow = ctx.flow.clone();
        loop {
            t.attempt += 1;
            t.total += 1;
            let deadline = match run_stops(ctx) {
                Ok(d) => d,
                Err(e) => return Err(t.failure(e, None)),
            };
            let sent = match self.send(req, &t, &flow, ctx, deadline, reports).await {
                Ok(s) => s,
                Err(stop) => return Err(t.failure(stop, None)),
            };
            let provider = self.client.provider(&t.model);
            let e = match sent.result {
                Ok(completion) => {
                    provider.mark_answered();
                    ctx.budget
                        .lock()
                        .expect("budget lock")
                        .charge(&t.model, &completion.usage);
                    return Ok(Generated {
                        completion,
                        attempts: t.total,
                        fallback_used: t.fallback_used,
                    });
                }
                Err(ref e) => e.clone(),
            };
            let next = match self
                .not_an_attempt(req, ctx, &mut t, &sent, &e, &provider, &flow, reports)
            {
                Some(n) => n,
                None => self.after_attempt(req, ctx, &t, &sent, e, &provider, deadline, reports),
            };
            match next {
                Next::Free => t.attempt -= 1,
                Next::After(delay) => {
                    if let Err(stop) = ctx.wait(delay).await {
                        return Err(t.failure(stop, None));
                    }
                }
                Next::Fallback(fb) => {
                    t.model.clone_from(&fb);
                    t.fallback_used = Some(fb);
                    t.attempt = 0;
                }
                Next::Fail(e, ineligible) => return Err(t.failure(e, ineligible)),
            }
        }
    }

    /// One request of the generation: admitted by the fleet's flow control
    /// (waiting for a pause or a limit is not an attempt), through the
    /// model's circuit breaker, bounded by the cancel and the deadline; the
    /// breaker and the flow control told how it went. `Err`: the admission
    /// stopped the generation.
    async fn send(
        &self,
        req: &ChatRequest,
        t: &Tries,
        flow: &Arc<Flow>,
        ctx: &RunContext,
        deadline: Option<Instant>,
        reports: &mut Vec<RetryReport>,
    ) -> Result<Sent, ModelError> {
        let model = &t.model;
        let breaker = if t.fallback_used.is_some() {
            &self.fallback_breaker
        } else {
            &self.breaker
        };
        let cfg = self.client.config();
        let pkey = ProviderKey::new(&cfg.base_url, model, cfg.api_key.as_deref());
        flow.configure(&pkey, cfg.concurrency);
        let mut permit = admit(
            flow,
            &pkey,
            estimate_tokens(req),
            ctx,
            deadline,
            t.total,
            reports,
        )
        .await?;
        let mut state = AttemptState {
            watcher: ctx.watcher.clone(),
            on_first_token: Some(permit.first_token_hook()),
            ..Default::default()
        };
        let mut serving = Serving::Nothing;
        let was_open = breaker.state() == crate::breaker::BreakerState::Open;
        let result = match breaker.try_acquire() {
            Err(retry_after) => Err(ModelError::CircuitOpen {
                dependency: breaker.name().to_string(),
                retry_after,
                cause: breaker.cause(),
            }),
            Ok(()) => {
                // One model request: its span and its metrics.
                let span = spans::chat("openai", model);
                let sent = Instant::now();
                let fut = self
                    .client
                    .generate_once(req, model, &mut state)
                    .instrument(span.clone());
                let r = tokio::select! {
                    biased;
                    _ = ctx.cancel.cancelled() => Err(ModelError::Cancelled),
                    r = async {
                        match deadline {
                            Some(d) => tokio::time::timeout_at(d, fut).await.unwrap_or(Err(ModelError::Deadline)),
                            None => fut.await,
                        }
                    } => r,
                };
                record_request(ctx.flow.observer(), &span, model, sent.elapsed(), &r);
                serving = permit.ended(state.cut_short, r.is_ok(), state.last_chunk);
                match &r {
                    Ok(_) => breaker.record(true),
                    // The provider serving one request at a time is
                    // not its failure.
                    Err(_) if serving.interrupted() => breaker.release(),
                    Err(e) => match e.class() {
                        FailureClass::Cancelled | FailureClass::DeadlineExceeded => {
                            breaker.release()
                        }
                        c if c.counts_against_dependency() => {
                            let cause = format!("{c}: {e}");
                            breaker.record_failure(request_digest(req), &cause);
                            if !was_open && breaker.state() == crate::breaker::BreakerState::Open {
                                flow.breaker_opened(
                                    &pkey,
                                    std::time::SystemTime::now() + breaker.cool_down(),
                                    &cause,
                                );
                            }
                        }
                        _ => breaker.record(true),
                    },
                }
                r
            }
        };
        if let Ok(c) = &result {
            permit.reconcile(c.usage.prompt_tokens + c.usage.completion_tokens);
        }
        drop(permit);
        Ok(Sent {
            result,
            state,
            serving,
            pkey,
        })
    }

    /// A failed request that was no attempt of the generation: the provider
    /// cut the stream for another of ours (it serves one at a time), it
    /// refuses the request's form (the next form goes at once), or a 429
    /// said when to come back (the fleet waits it out). `Some(Next::Free)`
    /// then, `Some(Next::Fail)` when a form forced by hand can never work;
    /// `None`: an attempt failed. A quota error pauses its provider key
    /// for the fleet either way.
    #[allow(clippy::too_many_arguments)]
    fn not_an_attempt(
        &self,
        req: &ChatRequest,
        ctx: &RunContext,
        t: &mut Tries,
        sent: &Sent,
        e: &ModelError,
        provider: &crate::adapt::Provider,
        flow: &Flow,
        reports: &mut Vec<RetryReport>,
    ) -> Option<Next> {
        let (class, pkey, next_attempt) = (e.class(), &sent.pkey, t.total + 1);
        let eligible = || eligibility(&sent.state, ctx.cancel.is_cancelled()).is_ok();
        let at_once = |reason: String| {
            RetryReport::generation(
                reason,
                true,
                retained_input(&req.messages),
                next_attempt,
                ctx.budget_left(),
                class,
            )
            .at_once()
        };
        if class == FailureClass::IncompleteGeneration
            && sent.serving.interrupted()
            && t.cuts < MAX_CUTS
            && eligible()
        {
            // The provider cut this stream for another request of
            // ours: it serves one at a time. Learning that is not an
            // attempt; the request goes again at once (it waits for
            // the slot once the concurrency of 1 applies).
            t.cuts += 1;
            ctx.flow.observer().model_retry(&class.as_str());
            ctx.emit(at_once(cut_reason(&sent.serving, pkey, e)), reports);
            return Some(Next::Free);
        }
        if class == FailureClass::BadRequest && refuses_shape(e) {
            let forms = sent.state.sent_forms.unwrap_or(provider.forms());
            let message = e.to_string();
            match provider.downgrade(req, forms, &message) {
                Some(d) if t.downgrades < 3 => {
                    // The provider will never take this shape: the same
                    // request in the next form, at once, and not an
                    // attempt of the generation.
                    t.downgrades += 1;
                    tracing::warn!(provider = %provider.key(), "{d}: {message}");
                    ctx.emit(at_once(format!("{class}: {d}: {message}")), reports);
                    return Some(Next::Free);
                }
                Some(_) => {}
                None => {
                    if let Some(hint) = provider.forced_hint(req, forms) {
                        let e = ModelError::Config(format!("{message}; {hint}"));
                        return Some(Next::Fail(e, None));
                    }
                }
            }
        }
        if class == FailureClass::QuotaExhausted {
            // Every worker of the fleet stops asking for a while.
            let pause = e.retry_after().unwrap_or(QUOTA_PAUSE);
            flow.cooldown(
                pkey,
                std::time::SystemTime::now() + pause,
                &format!("{class}: {e}"),
            );
        }
        if class == FailureClass::RateLimited && t.pauses < MAX_PAUSES {
            let said = e
                .retry_after()
                .filter(|ra| !ra.is_zero() && *ra <= self.policy.max_server_delay);
            if let Some(ra) = said.filter(|_| eligible()) {
                // The provider said when: the fleet waits for it, and
                // this call is not an attempt.
                t.pauses += 1;
                flow.cooldown(
                    pkey,
                    std::time::SystemTime::now() + ra,
                    &format!("{class}: {e}"),
                );
                ctx.flow.observer().model_retry(&class.as_str());
                return Some(Next::Free);
            }
        }
        None
    }

    /// What a failed attempt leads to: a retry after the policy's backoff
    /// (or the server's `Retry-After`), the fallback model once the
    /// attempts on this one ran out, or the generation's failure (not
    /// retryable, not eligible to repeat, out of attempts, or past the
    /// deadline). Every retry considered is reported.
    #[allow(clippy::too_many_arguments)]
    fn after_attempt(
        &self,
        req: &ChatRequest,
        ctx: &RunContext,
        t: &Tries,
        sent: &Sent,
        e: ModelError,
        provider: &crate::adapt::Provider,
        deadline: Option<Instant>,
        reports: &mut Vec<RetryReport>,
    ) -> Next {
        let (class, attempt, model) = (e.class(), t.attempt, &t.model);
        if !class.is_retryable() {
            return Next::Fail(e, None);
        }
        // A cut the learning would answer, were the concurrency not
        // set by hand: the report says which setting to change.
        let set_by_hand = match &sent.serving {
            Serving::SetByHand {
                concurrency,
                setting,
            } => format!(
                "; {} cut it for another request (it serves one request at a time), but {setting} sets a concurrency of {concurrency}: set 1",
                sent.pkey.label()
            ),
            _ => String::new(),
        };
        ctx.flow.observer().model_retry(&class.as_str());
        let mut report = RetryReport::generation(
            format!("{class}: {e}{set_by_hand}"),
            false,
            retained_input(&req.messages),
            t.total + 1,
            ctx.budget_left(),
            class,
        );
        if let Err(why) = eligibility(&sent.state, ctx.cancel.is_cancelled()) {
            report.reason = format!("{class}: refused: {why}");
            report.retained = "nothing: the generation is not repeated".into();
            ctx.emit(report, reports);
            return Next::Fail(e, Some(why));
        }
        if attempt >= self.policy.max_attempts {
            return match self.client.config().fallback_model.clone() {
                Some(fb) if t.fallback_used.is_none() && fb != *model => {
                    report.reason = format!(
                        "{class}: {attempt} attempts on {model} failed; switching to fallback {fb}"
                    );
                    report.eligible = true;
                    report.fallback_model = Some(fb.clone());
                    ctx.emit(report, reports);
                    Next::Fallback(fb)
                }
                _ => {
                    report.reason = format!(
                        "{class}: generation attempts exhausted ({attempt} of {})",
                        self.policy.max_attempts
                    );
                    ctx.emit(report, reports);
                    Next::Fail(
                        unreachable_is_config(e, provider, self.client.config()),
                        None,
                    )
                }
            };
        }
        let mut delay = self.policy.backoff(attempt);
        if let Some(ra) = e.retry_after() {
            if ra > self.policy.max_server_delay {
                report.reason = format!(
                    "{class}: server asks to wait {}, longer than allowed",
                    humantime::format_duration(ra)
                );
                ctx.emit(report, reports);
                return Next::Fail(e, None);
            }
            delay = delay.max(ra);
        }
        if deadline.is_some_and(|d| Instant::now() + delay > d) {
            report.reason = format!("{class}: the deadline comes before the next attempt");
            ctx.emit(report, reports);
            return Next::Fail(ModelError::Deadline, None);
        }
        report.eligible = true;
        report.delay_ms = Some(delay.as_millis() as u64);
        ctx.emit(report, reports);
        Next::After(delay)
    }
}

/// A generation's counts across its requests.
#[derive(Default)]
struct Tries {
    /// The model asked: the configured one, then the fallback.
    model: String,
    fallback_used: Option<String>,
    /// Attempts on the current model (what `max_attempts` bounds).
    attempt: u32,
    /// Requests made: the generation's `attempts`.
    total: u32,
    /// Forms the provider refused, each answered by the next at once.
    downgrades: u32,
    /// 429s answered by a pause rather than an attempt (bounded, so a
    /// provider that never stops refusing still ends the generation).
    pauses: u32,
    /// Streams the provider cut for another request while it was learned
    /// to serve one at a time: not attempts either (bounded).
    cuts: u32,
}

impl Tries {
    fn failure(&self, error: ModelError, ineligible: Option<Ineligible>) -> GenerationFailure {
        GenerationFailure {
            error,
            attempts: self.total,
            ineligible,
        }
    }
}

/// One request's answer, and what was learned sending it.
struct Sent {
    result: Result<Completion, ModelError>,
    state: AttemptState,
    serving: Serving,
    pkey: ProviderKey,
}

/// What follows a failed request.
enum Next {
    /// Ask again at once: the request was no attempt.
    Free,
    /// Ask again after this delay.
    After(Duration),
    /// Ask the fallback model (its attempts start at one).
    Fallback(String),
    /// The generation fails.
    Fail(ModelError, Option<Ineligible>),
}

/// The run's own stops, checked before each request: cancelled, out of
/// budget, past the deadline. The deadline, when there is one.
fn run_stops(ctx: &RunContext) -> Result<Option<Instant>, ModelError> {
    if ctx.cancel.is_cancelled() {
        return Err(ModelError::Cancelled);
    }
    if let Err(kind) = ctx.budget.lock().expect("budget lock").check() {
        return Err(ModelError::Budget(kind));
    }
    let deadline = ctx.effective_deadline();
    if deadline.is_some_and(|d| Instant::now() >= d) {
        return Err(ModelError::Deadline);
    }
    Ok(deadline)
}

/// How long a quota error (`insufficient_quota`) pauses its provider key
/// for the fleet when the provider says nothing.
const QUOTA_PAUSE: Duration = Duration::from_secs(60);

/// 429s with `Retry-After` one generation waits out as pauses before they
/// count as attempts again.
const MAX_PAUSES: u32 = 50;

/// Streams one generation may have cut for another request, while the
/// provider is learned to serve one at a time, before they count as
/// attempts again.
const MAX_CUTS: u32 = 8;

/// The `retry` report's reason for a stream the provider cut for another
/// request (`serving`: what that taught flow control).
fn cut_reason(serving: &Serving, key: &ProviderKey, e: &ModelError) -> String {
    let class = FailureClass::IncompleteGeneration;
    let label = key.label();
    match serving {
        Serving::Cut { seen } => format!(
            "{class}: {e} while another request to {label} waited ({seen} of {LEARN_AFTER}: a server that serves one request at a time cuts the one in flight); not an attempt"
        ),
        Serving::Learned => format!(
            "{class}: {e} while another request waited, {LEARN_AFTER} times: {label} serves one request at a time; concurrency 1 from now on, for the fleet (learned; LH_MODEL_CONCURRENCY or `leasehold limits set --concurrency` sets it by hand); not an attempt"
        ),
        _ => format!(
            "{class}: {e}: {label} serves one request at a time (concurrency 1), and this request was sent before that applied; not an attempt"
        ),
    }
}

/// A request's tokens before it is sent: its JSON's characters / 4 (the
/// sim's and a usual English ratio) plus its `max_tokens` (or 256).
fn estimate_tokens(req: &ChatRequest) -> u64 {
    let chars = serde_json::to_string(&(&req.messages, &req.tools))
        .map(|s| s.len())
        .unwrap_or(0);
    (chars as u64).div_ceil(4) + u64::from(req.max_tokens.unwrap_or(256))
}

/// Waits until `flow` admits a request of `key`: a pause (reported once
/// per pause, as a `retry` report saying "waiting for provider X until
/// T") or the limits. Cancellation and the deadline end the wait.
async fn admit(
    flow: &Arc<Flow>,
    key: &ProviderKey,
    estimate: u64,
    ctx: &RunContext,
    deadline: Option<Instant>,
    total: u32,
    reports: &mut Vec<RetryReport>,
) -> Result<leasehold_flow::Permit, ModelError> {
    let mut waited = false;
    let mut reported: Option<std::time::SystemTime> = None;
    let tenant = leasehold_flow::current_tenant();
    loop {
        let wake = match flow.try_admit_for(key, tenant.as_deref(), estimate) {
            Ok(p) => {
                if waited {
                    flow.count(&key.id, true, false);
                    flow.observer().flow_admission(&key.info.model, "waited");
                }
                flow.observer().flow_admission(&key.info.model, "admitted");
                return Ok(p);
            }
            Err(Wait::Paused {
                until,
                at,
                reason,
                breaker,
            }) => {
                if reported != Some(until) {
                    reported = Some(until);
                    let what = if breaker {
                        "open circuit breaker"
                    } else {
                        "cooldown"
                    };
                    let reason = format!(
                        "waiting for provider {} until {} ({what}: {reason})",
                        key.label(),
                        leasehold_time::rfc3339(until)
                    );
                    tracing::info!(provider = %key.label(), "{reason}");
                    ctx.emit(
                        RetryReport {
                            delay_ms: Some(
                                at.saturating_duration_since(Instant::now())
                                    .as_micros()
                                    .div_ceil(1000) as u64,
                            ),
                            ..RetryReport::generation(
                                reason,
                                true,
                                "the request waits; not an attempt".into(),
                                total,
                                ctx.budget_left(),
                                FailureClass::RateLimited,
                            )
                        },
                        reports,
                    );
                }
                // The fleet's waiters do not all start again at once: each
                // at a random point of a tenth of the pause after its end
                // (at most 250 ms).
                let pause = at.saturating_duration_since(Instant::now());
                let spread = (pause / 10).min(Duration::from_millis(250));
                at + spread.mul_f64(rand::random::<f64>())
            }
            Err(Wait::Limited { retry, .. }) => retry,
        };
        waited = true;
        if deadline.is_some_and(|d| wake > d) {
            flow.count(&key.id, false, true);
            flow.observer().flow_admission(&key.info.model, "refused");
            return Err(ModelError::Deadline);
        }
        tokio::select! {
            biased;
            _ = ctx.cancel.cancelled() => {
                flow.count(&key.id, false, true);
                return Err(ModelError::Cancelled);
            }
            _ = tokio::time::sleep_until(wake) => {}
            _ = flow.changed() => {}
        }
    }
}

/// A model request's outcome on its `chat` span and in the metrics.
fn record_request(
    observer: &dyn observe::Observer,
    span: &tracing::Span,
    model: &str,
    elapsed: Duration,
    r: &Result<Completion, ModelError>,
) {
    match r {
        Ok(c) => {
            let (input, output) = (c.usage.prompt_tokens, c.usage.completion_tokens);
            spans::record_usage(span, input, output);
            spans::record_response_model(span, &c.model);
            spans::record_finish_reasons(span, &[c.finish_reason.as_str()]);
            observer.model_request(&observe::ModelRequest {
                model,
                outcome: "ok",
                input_tokens: input,
                output_tokens: output,
                elapsed,
            });
        }
        Err(e) => {
            let class = e.class().as_str();
            spans::record_error(span, &class);
            observer.model_request(&observe::ModelRequest {
                model,
                outcome: &class,
                input_tokens: 0,
                output_tokens: 0,
                elapsed,
            });
        }
    }
}

/// A bad request that may be about the request's shape (what it asks the
/// provider to do), not about where it was sent or who sent it: 400 and
/// 422, a 5xx whose body says the request is invalid, an error in a stream.
fn refuses_shape(e: &ModelError) -> bool {
    match e {
        ModelError::Http { status, .. } => matches!(status, 400 | 422) || *status >= 500,
        ModelError::StreamError { .. } => true,
        _ => false,
    }
}

/// A provider this process never reached, still unreachable after the
/// generation's attempts, is a configuration error with its cause, not a
/// transient one: the job ends within seconds and says what to set,
/// instead of retrying for minutes. One that answered before keeps the
/// ordinary retries (an outage, a restart).
fn unreachable_is_config(
    e: ModelError,
    provider: &crate::adapt::Provider,
    cfg: &crate::config::ModelConfig,
) -> ModelError {
    match &e {
        ModelError::Connect(cause) if !provider.has_answered() => ModelError::Config(format!(
            "cannot reach the model endpoint {}: {cause}; check LH_MODEL_BASE_URL",
            leasehold_telemetry::redact_url(&cfg.base_url)
        )),
        _ => e,
    }
}

/// One digest per distinct request (its messages, tools and format), so
/// the breaker counts a request that keeps failing once.
fn request_digest(req: &ChatRequest) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_string(&(&req.messages, &req.tools, &req.response_format))
        .unwrap_or_default()
        .hash(&mut h);
    h.finish()
}

fn retained_input(messages: &[Message]) -> String {
    let results = messages
        .iter()
        .filter(|m| matches!(m, Message::Tool { .. }))
        .count();
    format!(
        "same input: {} messages, {} tool results",
        messages.len(),
        results
    )
}
