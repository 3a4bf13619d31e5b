//! `leasehold cancel ID`: ask for cancellation on `lh.cancel.<ID>`.
//! A queued job is cancelled at once; a running job's owner is told and
//! stops at once (or, if it cannot be reached, at its next write; a retry,
//! hand-back or reclaim never undoes the request). When no worker answers,
//! the request is recorded directly.

use std::time::Duration;

use leasehold_store::events::Events;
use leasehold_store::{jobs, NatsArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The job id.
    id: String,
}

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    let conn = nats.connect("leasehold-cli cancel").await?;
    let subject = conn.layout.cancel_subject(&a.id);
    let reply: serde_json::Value = match tokio::time::timeout(
        Duration::from_secs(3),
        conn.client.request(subject, "".into()),
    )
    .await
    {
        Ok(Ok(m)) => serde_json::from_slice(&m.payload)?,
        _ => {
            // No worker answered: record it ourselves through the same transition.
            let jobs = super::open_jobs(&conn).await?;
            jobs::cancel(&jobs, &Events::new(&conn), &a.id).await.0
        }
    };
    println!("{reply}");
    Ok(if reply["recorded"].as_bool() == Some(true) {
        0
    } else {
        1
    })
}
