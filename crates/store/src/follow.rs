//! Following a bucket whole: the last value of every key, then each change,
//! applied to a caller's state in memory, so that a periodic look at the
//! bucket costs what changed instead of a read of every key. One follower
//! for every such view (the reaper's index, sessions and schedules): when a
//! view is whole, and when it is read anew, is decided here.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::connect::Link;

/// How long the follower waits before watching again after an error.
const RETRY: Duration = Duration::from_secs(1);

/// What a follower tells its readers.
#[derive(Clone)]
pub struct Followed {
    /// True once the entries present when the watch (re)began were all read.
    pub loaded: watch::Receiver<bool>,
    /// Counts the changes applied (the entries read at a start included).
    pub changes: watch::Receiver<u64>,
}

impl Followed {
    /// Whether the entries present when the watch (re)began were all read.
    pub fn is_loaded(&self) -> bool {
        *self.loaded.borrow()
    }

    /// `read` of the followed `state` once it is whole; `None` while it is
    /// being read (at its start, after an error or a reconnect).
    pub fn read<S, R>(&self, state: &Mutex<S>, read: impl FnOnce(&S) -> R) -> Option<R> {
        self.is_loaded().then(|| read(&state.lock().unwrap()))
    }
}

/// Follows `kv` into a new state until `shutdown`: empties it, applies the
/// last entry of every key, then each change (`apply`). After an error the
/// bucket is watched anew after [`RETRY`]; when the connection comes back
/// (`link`), at once: a server that restarted lost the watch's consumer,
/// which the watch itself notices only after its missed heartbeats. `what`
/// names the bucket's contents in the log ("the index").
pub fn follow<S: Default + Send + 'static>(
    what: &'static str,
    kv: kv::Store,
    link: Link,
    shutdown: CancellationToken,
    apply: fn(&mut S, &kv::Entry),
) -> (Arc<Mutex<S>>, Followed) {
    let state: Arc<Mutex<S>> = Arc::default();
    let shared = state.clone();
    let (loaded_tx, loaded) = watch::channel(false);
    let (changes_tx, changes) = watch::channel(0u64);
    tokio::spawn(async move {
        loop {
            tokio::select! {
                r = follow_once(&kv, &state, apply, &loaded_tx, &changes_tx) => {
                    let e = r.unwrap_err();
                    tracing::warn!(error = %e, "watch of {what} interrupted; reading {what} again");
                    tokio::select! {
                        _ = tokio::time::sleep(RETRY) => {}
                        _ = shutdown.cancelled() => return,
                    }
                },
                _ = link.reconnected() => {
                    tracing::info!("connection back; reading {what} again");
                }
                _ = shutdown.cancelled() => return,
            }
        }
    });
    (shared, Followed { loaded, changes })
}

/// One watch, until it fails.
async fn follow_once<S: Default>(
    kv: &kv::Store,
    state: &Mutex<S>,
    apply: fn(&mut S, &kv::Entry),
    loaded: &watch::Sender<bool>,
    changes: &watch::Sender<u64>,
) -> Result<std::convert::Infallible, String> {
    let mut w = kv
        .watch_with_history(">")
        .await
        .map_err(|e| e.to_string())?;
    *state.lock().unwrap() = S::default();
    let _ = loaded.send(false);
    changes.send_modify(|n| *n += 1);
    // An empty bucket delivers nothing to say it was read.
    let empty = kv.status().await.map_err(|e| e.to_string())?.values() == 0;
    if empty {
        let _ = loaded.send(true);
    }
    while let Some(e) = w.next().await {
        let e = e.map_err(|e| e.to_string())?;
        apply(&mut state.lock().unwrap(), &e);
        changes.send_modify(|n| *n += 1);
        if e.delta == 0 && !*loaded.borrow() {
            let _ = loaded.send(true);
        }
    }
    Err("the watch ended".into())
}
