//! `leasehold result ID [--wait [--timeout D]]`: print a completed job's
//! result: the report from the object store for jobs with an artifact, else
//! the result value as JSON. A job that did not complete: what happened to
//! it and what to do (exit 1).

use anyhow::Context as _;
use leasehold_store::NatsArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The job id.
    id: String,
    /// Wait until the job ends (or is parked) instead of refusing one
    /// that has not ended yet.
    #[arg(long)]
    wait: bool,
    /// With --wait: stop waiting after this long (exit 124; the job goes
    /// on), e.g. `30s`, `5m` [default: wait until the job ends].
    #[arg(long, requires = "wait", value_parser = leasehold_core::time::parse_duration)]
    timeout: Option<std::time::Duration>,
    /// One JSON document on stdout: `id`, `status`, and `output` (the
    /// result value), `report` (an artifact's text), `partial`,
    /// `skipped_sections` when completed; `error` and `hint` when not.
    #[arg(long)]
    json: bool,
}

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    let conn = nats.connect("leasehold-cli result").await?;
    let jobs = super::open_jobs(&conn).await?;
    let Some(v) = jobs.get(&a.id).await? else {
        eprintln!("error: no job {:?} (`leasehold list` shows jobs)", a.id);
        return Ok(1);
    };
    let mut rec = v.value;
    if a.wait {
        let Some(r) = super::watch::follow_for(&jobs, &a.id, false, a.timeout).await? else {
            return Ok(super::watch::TIMED_OUT);
        };
        rec = r;
    }
    if rec.status != "completed" {
        // Say what happened to it, and what to do.
        let why = rec
            .error
            .as_ref()
            .map(|e| format!(": {} ({})", e.message, e.class))
            .unwrap_or_default();
        let next = match rec.status.as_str() {
            "queued" | "running" => format!(
                "it has not ended yet: `leasehold result {} --wait` waits for it",
                rec.id
            ),
            "parked" => "it waits for a person: `leasehold review list`".to_string(),
            "dead" => {
                "`leasehold dlq list` has its dead letter, `dlq replay` runs it again".to_string()
            }
            _ => "it has no result".to_string(),
        };
        // A cancelled or budget-exhausted research job keeps what it wrote.
        let partial = match rec.result.as_ref().filter(|r| r.partial) {
            Some(r) => match &r.artifact {
                Some(name) => leasehold_store::artifacts::Artifacts::open(&conn)
                    .await?
                    .read(name)
                    .await
                    .ok()
                    .flatten()
                    .map(|(_, b)| (name.clone(), String::from_utf8_lossy(&b).into_owned())),
                None => None,
            },
            None => None,
        };
        if let (Some((_, doc)), false) = (&partial, a.json) {
            print!("{doc}");
        }
        let kept = match &partial {
            Some((name, _)) => format!(" (its partial report, {name}, is on stdout)"),
            None => String::new(),
        };
        eprintln!("error: job {} is {}{why}{kept}; {next}", rec.id, rec.status);
        if a.json {
            println!(
                "{}",
                serde_json::json!({"id": rec.id, "status": rec.status, "error": rec.error, "hint": next, "partial_report": partial.map(|p| p.1)})
            );
        }
        return Ok(1);
    }
    let res = rec.result.unwrap_or_default();
    if let Some(name) = &res.artifact {
        // Direct gets, no consumer: a submitter's NATS user may create none.
        let artifacts = leasehold_store::artifacts::Artifacts::open(&conn).await?;
        let Some((_, bytes)) = artifacts
            .read(name)
            .await
            .with_context(|| format!("artifact {name}"))?
        else {
            eprintln!("error: job {} names artifact {name}, which is gone", rec.id);
            return Ok(1);
        };
        if a.json {
            println!(
                "{}",
                serde_json::json!({"id": rec.id, "status": rec.status, "report": String::from_utf8_lossy(&bytes), "artifact": name, "digest": res.digest, "partial": res.partial, "skipped_sections": res.skipped_sections})
            );
        } else {
            print!("{}", String::from_utf8_lossy(&bytes));
        }
        if res.partial {
            eprintln!(
                "note: partial result; skipped sections: {}",
                res.skipped_sections.join(", ")
            );
        }
    } else if res.output.is_empty() && rec.output_beside {
        // Over 16 KiB, it was kept beside the record and is gone: an
        // error, never an empty value.
        eprintln!(
            "error: job {}'s output (over 16 KiB, kept beside its record) is gone from the payloads bucket",
            rec.id
        );
        return Ok(1);
    } else {
        let output = if res.output.is_empty() {
            "null".to_string()
        } else {
            res.output
        };
        if a.json {
            let value: serde_json::Value =
                serde_json::from_str(&output).unwrap_or(serde_json::Value::String(output));
            println!(
                "{}",
                serde_json::json!({"id": rec.id, "status": rec.status, "output": value, "digest": res.digest})
            );
        } else {
            println!("{output}");
        }
    }
    Ok(0)
}
