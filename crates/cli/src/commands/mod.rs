//! The subcommands, one module per noun.

pub mod cancel;
pub mod dlq;
pub mod list;
pub mod model;
pub mod result;
pub mod review;
pub mod setup;
pub mod status;
pub mod submit;
pub mod tool;
pub mod transcript;
pub mod watch;

use crate::{Cli, Command};

/// Runs one command and returns the process exit code. Errors are printed
/// to stderr here, once.
pub async fn run(cli: Cli) -> i32 {
    let nats = cli.nats;
    let out = match cli.cmd {
        Command::Setup(a) => setup::run(a, &nats).await,
        Command::Submit(a) => submit::run(a, &nats).await,
        Command::Status(a) => status::run(a, &nats).await,
        Command::List(a) => list::run(a, &nats).await,
        Command::Watch(a) => watch::run(a, &nats).await,
        Command::Cancel(a) => cancel::run(a, &nats).await,
        Command::Result(a) => result::run(a, &nats).await,
        Command::Dlq(a) => dlq::run(a, &nats).await,
        Command::Review(a) => review::run(a, &nats).await,
        Command::Transcript(a) => transcript::run(a, &nats).await,
        Command::Model(a) => model::run(a, &nats).await,
        Command::Tool(a) => tool::run(a, &nats).await,
    };
    match out {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}
