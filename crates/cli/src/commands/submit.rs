//! `leasehold submit KIND [SPEC]`: publish a job spec on `lh.submit.<KIND>`.
//!
//! SPEC is inline JSON, `@path` to a file, or `-` for stdin; `--input`
//! wraps a bare input object. The spec is validated locally with the same
//! rules a worker applies, so a bad spec is refused before it is sent.
//! Prints the job id on stdout.
//!
//! The submitter does not write the job record while a worker runs (a NATS
//! user with the submitter's permissions may not): after the stream's
//! publish ack it asks
//! the fleet on `lh.enqueued.<seq>` to create the queued record of the
//! stored ticket, so the job is visible and cancellable at once. With no
//! worker running it writes that record itself (the same function), when
//! its NATS user may; otherwise the record appears when a worker claims
//! the ticket.

use std::io::Read;

use anyhow::Context as _;
use leasehold_core::spec::{self, Kinds, Submission};
use leasehold_store::work::{Enqueued, Work};
use leasehold_store::{Conn, NatsArgs};
use prost::Message as _;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The job kind (echo, sleep, fail, crash, research, ...).
    kind: String,
    /// The spec: inline JSON, @FILE, or - for stdin. Example: '{"input":{"topic":"leases"}}'.
    spec: Option<String>,
    /// Just the input object (instead of a whole spec), e.g. --input '{"ms":500}'.
    #[arg(long, conflicts_with = "spec")]
    input: Option<String>,
    /// Job id (sent as Nats-Msg-Id); the same id twice is one job.
    #[arg(long)]
    id: Option<String>,
    /// Send the spec as protobuf (Content-Type: application/protobuf).
    #[arg(long)]
    protobuf: bool,
    /// Wait until the job is terminal, print its record (only that, as one
    /// JSON document: the id is in it), and exit 0 only if it completed.
    #[arg(long)]
    wait: bool,
    /// With --wait: stop waiting after this long (exit 124; the job goes
    /// on), e.g. `30s`, `5m` [default: wait until the job ends].
    #[arg(long, requires = "wait", value_parser = leasehold_core::time::parse_duration)]
    timeout: Option<std::time::Duration>,
    /// The W3C trace context the job joins (sent as the `traceparent`
    /// header), e.g. from a calling script's span. Without it the first
    /// worker to claim the job starts a trace.
    #[arg(long, env = "TRACEPARENT", value_parser = parse_traceparent)]
    traceparent: Option<String>,
    /// Run the job no sooner than this RFC 3339 UTC time (sets the spec's
    /// `run_at`), e.g. 2026-12-01T16:00:00Z.
    #[arg(long, conflicts_with = "delay")]
    run_at: Option<String>,
    /// Run the job no sooner than this long after it is stored (sets the
    /// spec's `delay`), e.g. 90s, 15m, 2h.
    #[arg(long)]
    delay: Option<String>,
    /// Who the job is for (sets the spec's `tenant`): tenants share the
    /// fleet by weight (`leasehold limits set --tenant`).
    #[arg(long)]
    tenant: Option<String>,
    /// Which of its tenant's jobs runs first: 1 (first) to 5 (last), 3 by
    /// default (sets the spec's `priority`).
    #[arg(long, allow_negative_numbers = true)]
    priority: Option<i32>,
    /// Print `{"id", "kind", "ticket_seq", "duplicate"}` instead of the id
    /// (with --wait: the final record, as always).
    #[arg(long)]
    json: bool,
}

/// The spec with `--run-at` / `--delay` set in it (the flag wins over the
/// same field in the spec).
pub(crate) fn with_run_time(
    raw: Vec<u8>,
    run_at: Option<&str>,
    delay: Option<&str>,
) -> anyhow::Result<Vec<u8>> {
    let (field, value) = match (run_at, delay) {
        (Some(t), _) => ("run_at", t),
        (None, Some(d)) => ("delay", d),
        (None, None) => return Ok(raw),
    };
    let mut v: serde_json::Value = serde_json::from_slice(&raw).context("the spec is not JSON")?;
    let obj = v
        .as_object_mut()
        .context("the spec is not a JSON object like {\"input\":{...}}")?;
    obj.insert(field.into(), value.into());
    Ok(serde_json::to_vec(&v)?)
}

/// The spec with `--tenant` / `--priority` set in it (the flag wins).
fn with_lane(raw: Vec<u8>, tenant: Option<&str>, priority: Option<i32>) -> anyhow::Result<Vec<u8>> {
    if tenant.is_none() && priority.is_none() {
        return Ok(raw);
    }
    let mut v: serde_json::Value = serde_json::from_slice(&raw).context("the spec is not JSON")?;
    let obj = v
        .as_object_mut()
        .context("the spec is not a JSON object like {\"input\":{...}}")?;
    if let Some(t) = tenant {
        obj.insert("tenant".into(), t.into());
    }
    if let Some(p) = priority {
        obj.insert("priority".into(), p.into());
    }
    Ok(serde_json::to_vec(&v)?)
}

/// `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`, ids not all zero.
fn parse_traceparent(s: &str) -> Result<String, String> {
    let s = s.trim();
    let parts: Vec<&str> = s.split('-').collect();
    let hex = |p: &str, n: usize| p.len() == n && p.bytes().all(|b| b.is_ascii_hexdigit());
    let zero = |p: &str| p.bytes().all(|b| b == b'0');
    match parts.as_slice() {
        [v, t, p, f]
            if hex(v, 2)
                && *v != "ff"
                && hex(t, 32)
                && hex(p, 16)
                && hex(f, 2)
                && !zero(t)
                && !zero(p) =>
        {
            Ok(s.to_ascii_lowercase())
        }
        _ => Err(format!(
            "{s:?} is not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>)"
        )),
    }
}

fn read_spec(a: &Args) -> anyhow::Result<Vec<u8>> {
    if let Some(input) = &a.input {
        let v: serde_json::Value = serde_json::from_str(input).context("--input is not JSON")?;
        return Ok(serde_json::json!({ "input": v }).to_string().into_bytes());
    }
    match a.spec.as_deref() {
        None | Some("-") => {
            let mut b = Vec::new();
            std::io::stdin()
                .read_to_end(&mut b)
                .context("reading the spec from stdin")?;
            Ok(b)
        }
        Some(s) if s.starts_with('@') => {
            std::fs::read(&s[1..]).with_context(|| format!("reading {}", &s[1..]))
        }
        Some(s) => Ok(s.as_bytes().to_vec()),
    }
}

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    // Unreadable input is bad usage (exit 2), like a spec that is refused.
    let raw = match read_spec(&a)
        .and_then(|r| with_run_time(r, a.run_at.as_deref(), a.delay.as_deref()))
        .and_then(|r| with_lane(r, a.tenant.as_deref(), a.priority))
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e:#} (nothing was submitted)");
            return Ok(2);
        }
    };
    let sub = Submission {
        kind: &a.kind,
        payload: &raw,
        msg_id: a.id.as_deref(),
        content_type: None,
        stream_seq: 0,
        received_at: std::time::SystemTime::now(),
    };
    let accepted = match spec::decode(
        sub,
        &Kinds::default().with_open(&a.kind),
        spec::DEFAULT_MAX_BYTES,
    ) {
        Ok(acc) => Some(acc),
        // No id yet: it will come from the stream sequence.
        Err(r) if matches!(&r.error, spec::SubmitError::InvalidId(s) if s.is_empty()) => None,
        Err(r) => {
            eprintln!("error: {} (nothing was submitted)", r.error);
            return Ok(2);
        }
    };
    let (payload, ct) = if a.protobuf {
        let mut spec: leasehold_proto::JobSpec = serde_json::from_slice(&raw).context("spec")?;
        spec.id = None;
        (spec.encode_to_vec(), Some("application/protobuf"))
    } else {
        (raw, None)
    };
    let msg_id =
        a.id.clone()
            .or_else(|| accepted.as_ref().map(|acc| acc.id.clone()));
    let conn = nats.connect("leasehold-cli submit").await?;
    let work = Work::new(&conn);
    let published = match work
        .submit_traced(
            &a.kind,
            payload.into(),
            msg_id.as_deref(),
            ct,
            a.traceparent.as_deref(),
        )
        .await
    {
        Ok(p) => p,
        Err(leasehold_store::StoreError::QueueFull(why)) => {
            eprintln!(
                "error: the work queue is full ({why}): nothing was submitted; try again when workers have caught up (the limit is `leasehold setup --work-max-msgs/--work-max-bytes`)"
            );
            return Ok(75);
        }
        Err(e) => {
            return Err(anyhow::Error::new(e).context(format!(
                "publishing on {} (is the kind set up? run `leasehold setup --kinds ...`)",
                conn.layout.lane_subject(
                    &a.kind,
                    &leasehold_core::lane::Lane::of(
                        &accepted
                            .as_ref()
                            .map(|x| x.spec.clone())
                            .unwrap_or_default()
                    )
                )
            )))
        }
    };
    let id = msg_id.unwrap_or_else(|| spec::seq_id(published.seq));
    if published.duplicate {
        // The stream recognised the id within its dedupe window. If no
        // record is left, the earlier job with this id is gone (retention
        // shorter than the window): this submission was swallowed.
        // (A duplicate's sequence is the first submission's: a ticket still
        // there is a job still queued.)
        let gone = match super::open_jobs(&conn).await {
            Ok(jobs) => {
                matches!(jobs.get(&id).await, Ok(None))
                    && matches!(Work::new(&conn).get(published.seq).await, Ok(None))
            }
            Err(_) => false,
        };
        if gone {
            eprintln!("error: job id {id} was used within the work stream's dedupe window (`leasehold setup --dedupe-window`) by a job that is gone now (its retention is shorter than the window); nothing was queued: submit under another id, or once the window has passed");
            return Ok(1);
        }
        eprintln!("duplicate: job {id} was already submitted; this is the same job");
    } else {
        if let Some(refused) = announce(&conn, &id, &a.kind, published.seq).await {
            eprintln!(
                "error: the fleet refused job {id}: {refused}; the worker that takes its ticket records the job rejected and keeps its bytes as a dead letter (`leasehold dlq list`)"
            );
            return Ok(2);
        }
    }
    if a.wait {
        // One JSON document on stdout (the record names the id), so the
        // output can be piped to `jq`; the id goes to stderr meanwhile.
        eprintln!("job {id} submitted; waiting for it to end");
    } else if a.json {
        println!(
            "{}",
            serde_json::json!({"id": id, "kind": a.kind, "ticket_seq": published.seq, "duplicate": published.duplicate})
        );
    } else {
        println!("{id}");
    }
    if a.wait {
        let jobs = super::open_jobs(&conn).await?;
        let Some(rec) = super::watch::follow_for(&jobs, &id, false, a.timeout).await? else {
            return Ok(super::watch::TIMED_OUT);
        };
        println!("{}", serde_json::to_string_pretty(&rec)?);
        return Ok(if rec.status == "completed" { 0 } else { 1 });
    }
    Ok(0)
}

/// Asks a worker to create the queued record of the ticket at `seq`; what
/// cannot be done now is done by the ticket's claim. Returns why the fleet
/// refused the submission (a worker's judgement stricter than this
/// command's own: a smaller `--max-submission-bytes`, a lane it refuses),
/// the one answer that fails the submission.
async fn announce(conn: &Conn, id: &str, kind: &str, seq: u64) -> Option<String> {
    let ask = conn
        .client
        .request(conn.layout.enqueued_subject(seq), "".into());
    match tokio::time::timeout(std::time::Duration::from_secs(5), ask).await {
        Ok(Ok(m)) => {
            let answer: serde_json::Value = serde_json::from_slice(&m.payload).unwrap_or_default();
            match Enqueued::of_answer(&answer) {
                Enqueued::Invalid { error, .. } => return Some(error),
                Enqueued::Error { error, .. } => eprintln!(
                    "note: job {id} is queued; its record is not written yet ({error}): it appears when a worker claims the job"
                ),
                // A worker's pull took the ticket first: its claim decided,
                // and a refusal is the record it wrote for this ticket.
                Enqueued::Exists { .. } | Enqueued::Gone => {
                    return rejected_by_its_claim(conn, id, seq).await
                }
                _ => {}
            }
        }
        Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
            // No worker runs: write the record the gateway would have
            // written (a submitter without write permission on the job
            // records cannot; then the claim writes it).
            let made = match (super::open_jobs(conn).await, super::open_active(conn).await) {
                (Ok(jobs), Ok(active)) => {
                    Work::new(conn)
                        .record_ticket(
                            &jobs,
                            &active,
                            seq,
                            &Kinds::default().with_open(kind),
                            spec::DEFAULT_MAX_BYTES,
                            |_, _, _| None,
                        )
                        .await
                }
                (Err(e), _) | (_, Err(e)) => Enqueued::Error {
                    id: None,
                    error: e.to_string(),
                },
            };
            let why = match made {
                Enqueued::Created { .. } | Enqueued::Exists { .. } => None,
                Enqueued::Invalid { error, .. } | Enqueued::Error { error, .. } => Some(error),
                Enqueued::Reissued { .. } => Some("reissued".to_string()),
                Enqueued::Gone => Some("gone".to_string()),
            };
            if let Some(why) = why {
                eprintln!(
                    "note: no worker is running and job {id}'s record could not be written here ({why}): it waits in the queue, and its record appears when a worker claims it"
                );
            }
        }
        Ok(Err(e)) => {
            eprintln!("note: job {id} is queued; no worker confirmed its record ({e}): it appears when a worker claims the job");
        }
        Err(_) => {
            eprintln!("note: job {id} is queued; no worker confirmed its record within 5s: it appears when a worker claims the job");
        }
    }
    None
}

/// Why job `id`'s ticket at `seq` was refused by the worker whose pull
/// took it before the command's `lh.enqueued` question was answered: its
/// record says `rejected` for this very ticket (not an earlier job of the
/// id). The record precedes the ticket's ack, so a ticket already gone has
/// its record; one still being claimed is given a moment.
async fn rejected_by_its_claim(conn: &Conn, id: &str, seq: u64) -> Option<String> {
    let jobs = super::open_jobs(conn).await.ok()?;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        match jobs.get(id).await {
            Ok(Some(v)) if v.value.ticket_seq == seq && v.value.status == "rejected" => {
                return Some(
                    v.value
                        .error
                        .map(|e| e.message)
                        .unwrap_or_else(|| "rejected".into()),
                )
            }
            Ok(Some(_)) => return None,
            _ if tokio::time::Instant::now() >= deadline => return None,
            _ => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_traceparent;

    #[test]
    fn traceparents_are_checked() {
        let ok = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(parse_traceparent(ok).unwrap(), ok);
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-xyz-00f067aa0ba902b7-01",
        ] {
            assert!(parse_traceparent(bad).is_err(), "{bad:?}");
        }
    }
}
