//! The phased stop of a process on SIGTERM or SIGINT, one function for
//! every binary: the first signal fires a graceful token (the process
//! drains, hands back, finishes what it was doing); a second signal, or the
//! stop's bound passing, ends the process at once, non-zero, whatever NATS
//! or a connection does.

use std::fmt;
use std::time::Duration;

use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio_util::sync::CancellationToken;

/// Why a stop was cut short.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overrun {
    /// A second SIGTERM or SIGINT (`"SIGTERM"` / `"SIGINT"`).
    Signal(&'static str),
    /// The bound passed since the first signal.
    Bound(Duration),
}

impl Overrun {
    /// The process's exit code: 128 + the signal's number for a second
    /// signal (as a shell reports a process killed by it), 1 for the bound.
    pub fn exit_code(&self) -> i32 {
        match self {
            Overrun::Signal("SIGINT") => 130,
            Overrun::Signal(_) => 143,
            Overrun::Bound(_) => 1,
        }
    }
}

impl fmt::Display for Overrun {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Overrun::Signal(s) => write!(f, "a second {s}"),
            Overrun::Bound(b) => write!(f, "the stop's bound ({}ms) passed", b.as_millis()),
        }
    }
}

/// Installs the SIGTERM and SIGINT handlers (at once, so no signal after
/// this call is missed) and returns the graceful token the first signal
/// fires. After it, a second signal or `bound` passing calls `overrun`
/// (to log what is left undone) and exits the process with
/// [`Overrun::exit_code`]. A process that stops by itself before then just
/// returns from `main`. Must be called inside a Tokio runtime.
pub fn phased<F>(bound: Duration, overrun: F) -> CancellationToken
where
    F: FnOnce(Overrun) + Send + 'static,
{
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    let graceful = CancellationToken::new();
    let token = graceful.clone();
    tokio::spawn(async move {
        let first = next(&mut term, &mut int).await;
        tracing::info!(
            bound_ms = bound.as_millis() as u64,
            "{first}: shutting down (a second signal exits at once)"
        );
        token.cancel();
        let why = tokio::select! {
            s = next(&mut term, &mut int) => Overrun::Signal(s),
            _ = tokio::time::sleep(bound) => Overrun::Bound(bound),
        };
        overrun(why);
        std::process::exit(why.exit_code());
    });
    graceful
}

async fn next(term: &mut Signal, int: &mut Signal) -> &'static str {
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_say_what_ended_the_stop() {
        assert_eq!(Overrun::Signal("SIGINT").exit_code(), 130);
        assert_eq!(Overrun::Signal("SIGTERM").exit_code(), 143);
        assert_eq!(Overrun::Bound(Duration::from_secs(1)).exit_code(), 1);
        assert_eq!(
            Overrun::Bound(Duration::from_millis(1500)).to_string(),
            "the stop's bound (1500ms) passed"
        );
    }
}
