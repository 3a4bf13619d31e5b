//! `leasehold setup`: create the streams, buckets and consumers (idempotent;
//! run it again after changing an option to update them).

use std::time::Duration;

use leasehold_core::time::parse_duration;
use leasehold_store::setup::{self, SetupOptions};
use leasehold_store::NatsArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Replicas of every stream and bucket (3 on a 3-node cluster).
    #[arg(long, env = "LH_REPLICAS", default_value_t = 1)]
    replicas: usize,
    /// Kinds that get a submit subject and a consumer, comma-separated.
    #[arg(
        long,
        env = "LH_KINDS",
        value_delimiter = ',',
        default_value = "echo,sleep,fail,crash,research,deliver"
    )]
    kinds: Vec<String>,
    /// Ack wait of the work consumers: how long a delivered ticket waits
    /// before redelivery when its worker goes silent.
    #[arg(long, env = "LH_ACK_WAIT", default_value = "30s", value_parser = parse_duration)]
    ack_wait: Duration,
    /// Deliveries of one ticket before the server gives up on it (the reaper dead-letters it).
    #[arg(long, env = "LH_MAX_DELIVER", default_value_t = 20)]
    max_deliver: i64,
    /// Dedupe window of submissions by Nats-Msg-Id.
    #[arg(long, env = "LH_DEDUPE_WINDOW", default_value = "1h", value_parser = parse_duration)]
    dedupe_window: Duration,
    /// The effects bucket's max age. Ledger entries of jobs never expire by it
    /// (written with Nats-TTL: never); they are removed with their job.
    #[arg(long, env = "LH_EFFECTS_RETENTION", default_value = "7d", value_parser = parse_duration)]
    effects_retention: Duration,
    /// How long job events are kept.
    #[arg(long, env = "LH_EVENTS_MAX_AGE", default_value = "30d", value_parser = parse_duration)]
    events_max_age: Duration,
}

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    anyhow::ensure!(a.max_deliver >= 2, "--max-deliver must be at least 2");
    anyhow::ensure!(!a.kinds.is_empty(), "--kinds must name at least one kind");
    let conn = nats.connect("leasehold-cli setup").await?;
    setup::ping(&conn.js).await?;
    let o = SetupOptions {
        replicas: a.replicas,
        kinds: a.kinds,
        ack_wait: a.ack_wait,
        max_deliver: a.max_deliver,
        dedupe_window: a.dedupe_window,
        events_max_age: a.events_max_age,
        effects_retention: a.effects_retention,
        ..SetupOptions::default()
    };
    for line in setup::ensure(&conn, &o).await? {
        println!("ok  {line}");
    }
    Ok(0)
}
