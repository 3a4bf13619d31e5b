//! `leasehold cancel ID`: ask for cancellation on `lh.cancel.<ID>`.
//! A queued job is cancelled at once; a running job's owner is told and
//! stops at once (or, if it cannot be reached, at its next write; a retry,
//! hand-back or reclaim never undoes the request).
//!
//! A worker records the request. When no worker answers, the CLI records
//! it itself if its NATS user may write job records (an operator's); a
//! submitter's may not, and NATS refuses the write: then nothing was
//! recorded, and the command says so and exits 1.

use std::time::Duration;

use leasehold_store::events::Events;
use leasehold_store::{jobs, NatsArgs};
use serde_json::json;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The job id.
    id: String,
}

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    let conn = nats.connect("leasehold-cli cancel").await?;
    let subject = conn.layout.cancel_subject(&a.id);
    let ask = conn.client.request(subject.clone(), "".into());
    let reply: serde_json::Value = match tokio::time::timeout(Duration::from_secs(3), ask).await {
        Ok(Ok(m)) => serde_json::from_slice(&m.payload)?,
        unanswered => {
            let why = match unanswered {
                Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
                    "no worker is running".to_string()
                }
                Ok(Err(e)) => format!("the request failed: {e}"),
                _ => "no worker answered within 3s".to_string(),
            };
            // Record it ourselves through the same transition, unless NATS
            // refuses this user the write (it only says so on the side: the
            // write itself would just time out).
            let jobs = super::open_jobs(&conn).await?;
            let events = Events::new(&conn);
            let records = format!("$KV.{}.", conn.layout.jobs_bucket());
            tokio::select! {
                (r, _) = jobs::cancel(&jobs, &events, &a.id) => r,
                refusal = conn.link.refused(&records) => {
                    eprintln!(
                        "error: {why} on {subject}, and this NATS user may not write job records ({refusal}): \
                         nothing was recorded; cancel again once a worker runs, or as a user with the operator's permissions"
                    );
                    json!({"id": a.id, "recorded": false, "outcome": "refused", "error": refusal})
                }
            }
        }
    };
    println!("{reply}");
    if reply["recorded"].as_bool() == Some(true) {
        return Ok(0);
    }
    // Nothing recorded: say why on stderr, as every command does.
    let id = &a.id;
    match reply["outcome"].as_str().unwrap_or_default() {
        "not_found" => eprintln!("error: no job {id} (`leasehold list` shows the active jobs)"),
        "unchanged" => eprintln!(
            "error: job {id} is {}: nothing to cancel",
            reply["status"].as_str().unwrap_or("finished")
        ),
        "refused" => {}
        other => eprintln!(
            "error: the cancellation of job {id} was not recorded ({other}: {})",
            reply["error"].as_str().unwrap_or("no reason given")
        ),
    }
    Ok(1)
}
