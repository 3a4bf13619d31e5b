//! `leasehold result ID`: print a completed job's result: the report from the
//! object store for jobs with an artifact, else the result value as JSON.

use anyhow::Context as _;
use leasehold_store::NatsArgs;
use tokio::io::AsyncReadExt;

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
        let store = conn
            .js
            .get_object_store(conn.layout.artifacts_bucket())
            .await
            .context("artifacts store")?;
        let mut obj = store
            .get(name)
            .await
            .with_context(|| format!("artifact {name}"))?;
        let mut text = String::new();
        obj.read_to_string(&mut text).await?;
        print!("{text}");
        if res.partial {
            eprintln!(
                "note: partial result; skipped sections: {}",
                res.skipped_sections.join(", ")
            );
        }
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
