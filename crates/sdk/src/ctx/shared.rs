//! What a Rust kind's [`Ctx`] and a remote kind's ops both do to the job: a
//! fenced event written once, a step recorded, a park's answer read, a tool called.

use std::time::Duration;

use leasehold_store::events::{self, Events, FenceError};
use leasehold_tools::{CallCtx, CollectEvents, Disposition, OwnerGuard, Toolbox};
use leasehold_worker::JobCtx;
use serde_json::Value;

use crate::journal::Recorded;
use crate::Error;

/// Waits between tries of a step record NATS did not answer (1.5 s in
/// all, each try bounded by the JetStream request timeout).
const RECORD_RETRY: [Duration; 4] = [
    Duration::from_millis(100),
    Duration::from_millis(200),
    Duration::from_millis(400),
    Duration::from_millis(800),
];

/// Publishes one fenced event of this attempt with a message id: tried
/// again with the same id, an event that landed is answered as a
/// duplicate (with its sequence), never written twice.
pub(crate) async fn emit_once(
    job: &JobCtx,
    ty: &str,
    data: Value,
    msg_id: &str,
) -> Result<u64, FenceError> {
    let mut f = job.fence.lock().await;
    let ev = events::event(&f.job_id, f.epoch, ty, Some(f.worker_id.as_str()), data);
    f.publish_event(&ev, Some(msg_id)).await
}

/// Records step `rec` as this attempt's fenced `step` event: how every
/// step lands (a Rust kind's, a remote kind's op). What a failure means,
/// by its kind:
/// - NATS did not answer (a timeout, a PubAck lost in a leader election):
///   tried again, with the same message id, so a record that did land is
///   answered as a duplicate, never written twice; after the last try the
///   attempt is retryable (the next one replays what landed);
/// - the stream refused it (full): retryable, from the last recorded step;
/// - a newer owner's events follow ours: the attempt stops, writing nothing.
pub(crate) async fn record_step(job: &JobCtx, rec: &Recorded) -> Result<(), Error> {
    let r = &job.record;
    let msg_id = format!("{}:{}:{}:step:{}", r.id, r.created_at, r.epoch, rec.index);
    let mut waits = RECORD_RETRY.iter();
    loop {
        let res = emit_once(job, "step", rec.data(), &msg_id).await;
        let why = match res {
            Ok(_) => return Ok(()),
            Err(e @ FenceError::Lost { .. }) => {
                return Err(Error::stopped(format!("recording step `{}`: {e}", rec.id)))
            }
            Err(FenceError::Refused(why)) => {
                return Err(Error::retryable(format!(
                    "recording step `{}`: the event stream refused it ({why}); the job is retried from its last recorded step",
                    rec.id
                )))
            }
            Err(FenceError::Nats(why)) => why,
        };
        let Some(wait) = waits.next() else {
            return Err(Error::retryable(format!(
                "recording step `{}`: NATS did not answer ({why}); the job is retried from its last recorded step",
                rec.id
            )));
        };
        tracing::warn!(job = %r.id, step = %rec.id, error = %why, "a step record was not answered; trying again with the same message id");
        tokio::select! {
            _ = tokio::time::sleep(*wait) => {}
            _ = job.cancel.cancelled() => return Err(Error::Cancelled),
        }
    }
}

/// The answer a person gave to the park at step `step`, if they did: the
/// job's last `parked` event is this step's, and the last `lh-answer`
/// signal naming that very park (its step and its event's sequence) is
/// the answer. An answer given before answers were signals: its last
/// `answer` event names this step and came after the park (read from the
/// stream's leader: a lagging replica must not hide an answer). The one
/// rule of [`Ctx::park`] and of a remote kind's `park` op.
pub(crate) async fn answer_for(job: &JobCtx, step: &str) -> Result<Option<Value>, Error> {
    let events = Events::new(&job.conn);
    let read = |ty: &'static str| {
        let events = &events;
        async move {
            events
                .last_of_type_from_leader(&job.record.id, ty)
                .await
                .map(|o| o.map(|(seq, ev)| (seq, ev.data_map())))
                .map_err(|e| Error::retryable(format!("reading the job's {ty} events: {e}")))
        }
    };
    let parked = read("parked").await?;
    if let Some((seq, p)) = &parked {
        if p.get("step").and_then(Value::as_str) == Some(step) {
            let signals = leasehold_store::signals::Signals::new(&job.conn)
                .all(&job.record.id, leasehold_store::signals::ANSWER)
                .await
                .map_err(|e| Error::retryable(format!("reading the job's answers: {e}")))?;
            if let Some(a) = signal_answer(step, *seq, &signals) {
                return Ok(Some(a));
            }
        }
    }
    let answer = read("answer").await?;
    Ok(answer_of(step, parked, answer))
}

/// The answer among `signals` (`lh-answer`, in the order sent) to the park
/// of step `step` whose `parked` event is at `parked_seq`: the last one
/// naming both.
pub(super) fn signal_answer(
    step: &str,
    parked_seq: u64,
    signals: &[leasehold_store::signals::Signal],
) -> Option<Value> {
    signals
        .iter()
        .rev()
        .find(|s| {
            s.data.get("step").and_then(Value::as_str) == Some(step)
                && s.data.get("parked_seq").and_then(Value::as_u64) == Some(parked_seq)
        })
        .map(|s| s.data.get("answer").cloned().unwrap_or(Value::Null))
}

/// The one rule of a durable timer's step `step` (Rust's `ctx.sleep`, a
/// remote kind's `sleep` op): its time is the one its recorded wait named,
/// or `due(now)` the first time. `Ok(time)` once it has passed (the step's
/// result, RFC 3339), else [`Error::Wait`]: the attempt ends until then.
pub(crate) fn timer(
    rec: &leasehold_core::JobRecord,
    step: &str,
    due: impl FnOnce(std::time::SystemTime) -> std::time::SystemTime,
) -> Result<String, Error> {
    let now = std::time::SystemTime::now();
    let until = waited_until(rec, step).unwrap_or_else(|| due(now));
    if until <= now {
        return Ok(leasehold_core::time::rfc3339(until));
    }
    Err(Error::Wait(crate::Wait::time(step, until)))
}

/// The step name of a wait for signal `name` (`wait:<name>`; its steps are
/// `wait:<name>#0`, `wait:<name>#1`, ...).
pub(crate) fn signal_step(name: &str) -> Result<String, Error> {
    if !leasehold_core::spec::valid_signal_name(name) {
        return Err(Error::terminal(format!(
            "invalid signal name {name:?}: use {}",
            leasehold_core::spec::SIGNAL_NAME_RULE
        )));
    }
    Ok(format!("wait:{name}"))
}

/// The sequence of the last signal `name` that the run's recorded steps
/// took (0: none): a new wait for `name` takes the first signal after it.
pub(crate) fn signal_taken<'a>(steps: impl IntoIterator<Item = &'a Recorded>, name: &str) -> u64 {
    let prefix = format!("wait:{name}#");
    steps
        .into_iter()
        .filter(|r| r.id.starts_with(&prefix))
        .filter_map(|r| r.result.get("seq").and_then(Value::as_u64))
        .max()
        .unwrap_or(0)
}

/// The one rule of a wait for a signal, step `step` (Rust's
/// `ctx.wait_for`, a remote kind's `wait_for` op): the first signal `name`
/// newer than `after` (the last one the run took), read from the stream's
/// leader, is the step's result; none, and its timeout (counted from the
/// first time the step waited, as the record keeps it) passed: `null`;
/// else [`Error::Wait`], and the attempt ends until the signal or the
/// timeout comes.
pub(crate) async fn signal_wait(
    job: &JobCtx,
    step: &str,
    name: &str,
    after: u64,
    timeout: Option<Duration>,
) -> Result<Value, Error> {
    let signals = leasehold_store::signals::Signals::new(&job.conn);
    let got = signals
        .next(&job.record.id, name, after)
        .await
        .map_err(|e| Error::retryable(format!("reading signal `{name}`: {e}")))?;
    if let Some(s) = got {
        return Ok(serde_json::to_value(s).expect("a signal serializes"));
    }
    let now = std::time::SystemTime::now();
    let until = waited_until(&job.record, step).or_else(|| timeout.map(|t| now + t));
    if until.is_some_and(|u| u <= now) {
        return Ok(Value::Null);
    }
    Err(Error::Wait(crate::Wait::for_signal(
        step, name, after, until,
    )))
}

/// The time the wait of step `step` named, if this step waited: the
/// record this attempt claimed names the step that waited last and its
/// time (`waiting_step`, `waiting_until`, kept when its wake-up queued the
/// job). The record, not an event: a wait whose event was never
/// published (its owner died after the write) still counts. The one rule
/// of [`Ctx::sleep`] and of a remote kind's `sleep` op.
pub(crate) fn waited_until(
    rec: &leasehold_core::JobRecord,
    step: &str,
) -> Option<std::time::SystemTime> {
    if rec.waiting_step.as_deref() != Some(step) {
        return None;
    }
    rec.waiting_until
        .as_deref()
        .and_then(leasehold_core::time::parse_rfc3339)
}

/// [`answer_for`]'s decision, from the last `parked` and `answer` events
/// (stream sequence, data).
pub(super) fn answer_of(
    step: &str,
    parked: Option<(u64, serde_json::Map<String, Value>)>,
    answer: Option<(u64, serde_json::Map<String, Value>)>,
) -> Option<Value> {
    let names =
        |m: &serde_json::Map<String, Value>| m.get("step").and_then(Value::as_str) == Some(step);
    match (parked, answer) {
        (Some((p, pm)), Some((a, am))) if a > p && names(&pm) && names(&am) => {
            Some(am.get("answer").cloned().unwrap_or(Value::Null))
        }
        _ => None,
    }
}

/// One tool call of step `step_id` through the toolbox (the ledger, the
/// owner's proof before a write effect): its `tool` events are emitted for
/// the job, and a failure becomes the error its disposition says. Rust
/// kinds' `Ctx::call` and remote kinds' `effect` ops both call it.
pub(crate) async fn call_tool(
    job: &JobCtx,
    tb: &Toolbox,
    step_id: &str,
    tool: &str,
    args: &Value,
) -> Result<Value, Error> {
    let call = CallCtx::new(&job.record.id, step_id, job.record.epoch)
        .of_incarnation(&job.record.created_at)
        .guarded(OwnerGuard::shared(job.gate.clone()));
    let events = CollectEvents::new();
    let r = tb.call_with(&call, tool, args, &events).await;
    for ev in events.events() {
        let _ = job
            .emit("tool", serde_json::to_value(&ev).unwrap_or_default())
            .await;
    }
    match r {
        Ok(out) => Ok(out.value),
        Err(e) => Err(match e.disposition() {
            Disposition::Park => Error::park(e.class(), e.to_string()),
            Disposition::Stop => Error::Cancelled,
            Disposition::Retry => Error::retryable(e.to_string()),
            _ => Error::terminal(e.to_string()),
        }),
    }
}
