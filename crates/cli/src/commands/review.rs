//! `leasehold review` (placeholder).

use leasehold_store::NatsArgs;

#[derive(clap::Args, Debug)]
pub struct Args {}

pub async fn run(_args: Args, _nats: &NatsArgs) -> anyhow::Result<i32> {
    anyhow::bail!("`leasehold review` is not built yet")
}
