//! `leasehold status ID`: print one job's record as JSON.

use leasehold_store::NatsArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The job id.
    id: String,
    #[command(flatten)]
    json: super::AlwaysJson,
}

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    let conn = nats.connect("leasehold-cli status").await?;
    let jobs = super::open_jobs(&conn).await?;
    match jobs.get(&a.id).await? {
        Some(v) => {
            println!("{}", serde_json::to_string_pretty(&v.value)?);
            Ok(0)
        }
        None => {
            eprintln!("error: no job {:?}; it may not have been picked up yet, or the id is wrong (`leasehold list` shows jobs)", a.id);
            Ok(1)
        }
    }
}
