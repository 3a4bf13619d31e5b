//! `leasehold result ID`: print a completed job's result: the report from the
//! object store for jobs with an artifact, else the result value as JSON.

use anyhow::Context as _;
use leasehold_store::NatsArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The job id.
    id: String,
}

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    let conn = nats.connect("leasehold-cli result").await?;
    let jobs = super::open_jobs(&conn).await?;
    let Some(v) = jobs.get(&a.id).await? else {
        eprintln!("error: no job {:?} (`leasehold list` shows jobs)", a.id);
        return Ok(1);
    };
    let rec = v.value;
    if rec.status != "completed" {
        eprintln!(
            "error: job {} is {}, not completed; follow it with `leasehold watch {}`",
            rec.id, rec.status, rec.id
        );
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
        print!("{}", String::from_utf8_lossy(&bytes));
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
        println!(
            "{}",
            if res.output.is_empty() {
                "null".to_string()
            } else {
                res.output
            }
        );
    }
    Ok(0)
}
