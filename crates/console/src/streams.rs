//! The live streams a caller may hold at once (`--streams-per-caller`):
//! every Server-Sent Events stream (`/v1/jobs/{id}/events`, `/jobs/live`,
//! `/jobs/{id}/live`, `/fleet/live`) takes a slot of its caller, given
//! back when the stream ends or its client goes away; beyond the limit,
//! 429 saying so. A caller is its auth identity (the token's name, the
//! proxy's user), or its IP address when auth is off.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use futures::{Stream, StreamExt};

use crate::app::Failure;
use crate::auth::{Caller, Via};
use crate::metrics::ConsoleMetrics;

pub struct Streams {
    per_caller: usize,
    open: Mutex<HashMap<String, usize>>,
    metrics: ConsoleMetrics,
}

/// One stream's slot; dropped with the stream.
pub struct Slot {
    streams: Arc<Streams>,
    who: String,
}

impl Streams {
    pub fn new(per_caller: usize, metrics: ConsoleMetrics) -> Arc<Streams> {
        Arc::new(Streams {
            per_caller,
            open: Mutex::new(HashMap::new()),
            metrics,
        })
    }

    /// Who `caller` counts as.
    pub fn who(caller: &Caller) -> String {
        match (caller.via, caller.peer) {
            (Via::Local, Some(ip)) => ip.to_string(),
            _ => caller.name.clone(),
        }
    }

    /// A slot for one more stream of `caller`, or 429 when it holds the
    /// limit already.
    pub fn open(self: &Arc<Self>, caller: &Caller, json: bool) -> Result<Slot, Failure> {
        let who = Self::who(caller);
        let mut open = self.open.lock().expect("streams lock");
        let n = open.entry(who.clone()).or_insert(0);
        if *n >= self.per_caller {
            drop(open);
            self.metrics.streams_refused.inc();
            return Err(Failure {
                status: StatusCode::TOO_MANY_REQUESTS,
                message: format!(
                    "{who} has {} live streams open, the most one caller may (--streams-per-caller, LH_CONSOLE_STREAMS_PER_CALLER); close a tab or stream, or wait for one to end",
                    self.per_caller
                ),
                json,
            });
        }
        *n += 1;
        self.metrics.live_streams.inc();
        Ok(Slot {
            streams: self.clone(),
            who,
        })
    }

    /// Streams `who` holds.
    #[cfg(test)]
    fn held(&self, who: &str) -> usize {
        self.open
            .lock()
            .expect("streams lock")
            .get(who)
            .copied()
            .unwrap_or(0)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.streams.open.lock().expect("streams lock");
        if let Some(n) = open.get_mut(&self.who) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.who);
            }
        }
        self.streams.metrics.live_streams.dec();
    }
}

impl Slot {
    /// `s`, holding this slot until it ends or is dropped.
    pub fn hold<S: Stream + Send + 'static>(self, s: S) -> impl Stream<Item = S::Item> + Send {
        s.map(move |x| {
            let _held = &self;
            x
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(name: &str, via: Via, peer: &str) -> Caller {
        Caller {
            name: name.into(),
            can_act: false,
            via,
            peer: peer.parse().ok(),
        }
    }

    #[test]
    fn a_caller_holds_at_most_its_limit_and_a_dropped_slot_is_given_back() {
        let s = Streams::new(2, ConsoleMetrics::default());
        let ann = caller("ann", Via::Proxy, "10.0.0.1");
        let bob = caller("bob", Via::Proxy, "10.0.0.1");
        let a1 = s.open(&ann, true).unwrap();
        let _a2 = s.open(&ann, true).unwrap();
        let e = s.open(&ann, true).err().unwrap();
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert!(e.message.contains("--streams-per-caller"), "{}", e.message);
        // Another identity behind the same proxy address is another caller.
        let _b = s.open(&bob, true).unwrap();
        drop(a1);
        assert_eq!(s.held("ann"), 1);
        let _a3 = s.open(&ann, true).unwrap();
        // Without auth, the address is the caller.
        let l1 = caller("local", Via::Local, "127.0.0.1");
        let l2 = caller("local", Via::Local, "127.0.0.2");
        assert_eq!(Streams::who(&l1), "127.0.0.1");
        let _x = s.open(&l1, true).unwrap();
        let _y = s.open(&l1, true).unwrap();
        assert!(s.open(&l1, true).is_err());
        assert!(s.open(&l2, true).is_ok());
    }
}
