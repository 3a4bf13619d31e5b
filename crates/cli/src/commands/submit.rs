//! `leasehold submit KIND [SPEC]`: publish a job spec on `lh.submit.<KIND>`.
//!
//! SPEC is inline JSON, `@path` to a file, or `-` for stdin; `--input`
//! wraps a bare input object. The spec is validated locally with the same
//! rules a worker applies, so a bad spec is refused before it is sent.
//! Prints the job id on stdout.

use std::io::Read;

use anyhow::Context as _;
use leasehold_core::spec::{self, Kinds, Submission};
use leasehold_store::work::Work;
use leasehold_store::{JobsError, NatsArgs};
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
    /// Wait until the job is terminal, print its record, and exit 0 only if it completed.
    #[arg(long)]
    wait: bool,
    /// With --wait: stop waiting after this long (exit 124; the job goes on).
    #[arg(long, requires = "wait", value_parser = leasehold_core::time::parse_duration)]
    timeout: Option<std::time::Duration>,
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
    let raw = read_spec(&a)?;
    let sub = Submission {
        kind: &a.kind,
        payload: &raw,
        msg_id: a.id.as_deref(),
        content_type: None,
        stream_seq: 0,
    };
    let accepted = match spec::decode(sub, &Kinds::default(), spec::DEFAULT_MAX_BYTES) {
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
    let published = work
        .submit(&a.kind, payload.into(), msg_id.as_deref(), ct)
        .await
        .with_context(|| {
            format!(
                "publishing on {} (is the kind set up? run `leasehold setup --kinds ...`)",
                conn.layout.submit_subject(&a.kind)
            )
        })?;
    let id = msg_id.unwrap_or_else(|| spec::seq_id(published.seq));
    let jobs = super::open_jobs(&conn).await?;
    if published.duplicate {
        eprintln!("duplicate: job {id} was already submitted; this is the same job");
    } else if let Some(acc) = accepted {
        // Make the job visible as queued at once; a worker may already have
        // created the record, which is fine.
        let rec = leasehold_core::machine::new_record(
            &id,
            &a.kind,
            acc.spec,
            published.seq,
            std::time::SystemTime::now(),
        );
        match jobs.create(&rec).await {
            Ok(_) | Err(JobsError::Exists(_)) => {}
            Err(e) => {
                eprintln!("warning: the job is queued but its record could not be created yet: {e}")
            }
        }
    }
    println!("{id}");
    if a.wait {
        let Some(rec) = super::watch::follow_for(&jobs, &id, false, true, a.timeout).await? else {
            return Ok(super::watch::TIMED_OUT);
        };
        println!("{}", serde_json::to_string_pretty(&rec)?);
        return Ok(if rec.status == "completed" { 0 } else { 1 });
    }
    Ok(0)
}
