//! Requests that outlive a leader.
//!
//! Every JetStream request (a publish awaiting its ack, a KV write, a pull)
//! is answered by the leader of its stream or consumer. When that leader's
//! node dies, the request or its answer goes with it, and the client learns
//! of it only at its timeout (5 s for a request; a pull at its expiry).
//! Meanwhile the other nodes elect a new leader (4-9 s after a kill: the
//! server's Raft election timeout) and announce it
//! ([`Layout::leader_advisories`]). [`Elections`] follows those
//! announcements and the connection's returns, and [`Elections::reissue`]
//! asks again as soon as one comes while a request waits: a request waits
//! for the election, not for the election and then its timeouts.
//!
//! Asking again is safe for every request it wraps: a publish carries its
//! dedupe id (a second copy is answered as a duplicate), an index write
//! writes the same value, and a conditioned write that did land is refused
//! as a conflict, which its callers already resolve by reading the record
//! (the claim and the owner's gate recognise their own write).
//!
//! [`Layout::leader_advisories`]: crate::layout::Layout::leader_advisories

use std::future::Future;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::connect::{Conn, Link};
use crate::layout::Layout;

/// How long a request waits for its answer after an election before it is
/// asked again: an answer already on its way comes within it, and the
/// requests of healthy streams are not sent twice by another stream's
/// election.
pub const ANSWER_GRACE: Duration = Duration::from_millis(200);

/// How many times one request is asked again; the last copy then waits
/// for its own timeout (a node's kill elects a leader for each stream and
/// consumer, a few dozen advisories in all).
pub const MAX_REISSUES: u32 = 16;

/// How often a request no server took is asked again without an election
/// (the advisory may be missed, or come from a leader elected before the
/// request was refused).
pub const UNANSWERED_RETRY: Duration = Duration::from_millis(500);

/// How long a request no server took is asked again: past one election
/// timeout (4-9 s) and a second round. A stream that does not exist at
/// all is reported after it.
pub const UNANSWERED_PATIENCE: Duration = Duration::from_secs(20);

/// Whether an error says no server took the request: the stream (or
/// bucket) has no leader now, or does not exist.
pub fn unanswered(e: &dyn std::fmt::Display) -> bool {
    let s = e.to_string();
    s.contains("no responders") || s.contains("no stream found for given subject")
}

/// The elections of the namespace's stream and consumer leaders and the
/// connection's returns, as counts that grow with each.
#[derive(Clone, Debug)]
pub struct Elections {
    rx: watch::Receiver<Seen>,
}

/// What [`Elections`] counted so far.
#[derive(Clone, Debug, Default)]
struct Seen {
    /// Elections and returns of the connection.
    all: u64,
    reconnects: u64,
    /// Elections per stream (a consumer's counted under its stream).
    per_stream: std::collections::BTreeMap<String, u64>,
}

impl Seen {
    fn mark(&self, stream: &str) -> (u64, u64) {
        let n = self.per_stream.get(stream).copied().unwrap_or(0);
        (self.reconnects, n)
    }
}

impl Elections {
    /// Follows the advisories and the connection of `conn` until every
    /// copy of the returned value is dropped. A refused subscription (a
    /// NATS user without the permission) leaves the connection's returns
    /// alone to count; the requests' own timeouts still bound them.
    pub(crate) fn follow(conn: &Conn) -> Elections {
        let (tx, rx) = watch::channel(Seen::default());
        tokio::spawn(follow(
            conn.client.clone(),
            conn.link.clone(),
            conn.layout.clone(),
            tx,
        ));
        Elections { rx }
    }

    /// Elections that never come (a request is never asked again).
    pub fn none() -> Elections {
        let (tx, rx) = watch::channel(Seen::default());
        drop(tx);
        Elections { rx }
    }

    /// Resolves at the next election of `stream` (or of one of its
    /// consumers) or return of the connection after this call.
    pub async fn next_of(&mut self, stream: &str) {
        let start = self.rx.borrow_and_update().mark(stream);
        loop {
            if self.rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
            if self.rx.borrow_and_update().mark(stream) != start {
                return;
            }
        }
    }

    /// [`Elections::reissue`] when `deduped` (a publish with a dedupe id:
    /// a second copy is a duplicate, never a second message), else `op`
    /// once: a publish without one would be stored twice.
    pub async fn reissue_if<T, E, F, Fut>(
        &self,
        deduped: bool,
        what: &str,
        mut op: F,
    ) -> Result<T, E>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: std::fmt::Display,
    {
        if deduped {
            self.reissue(what, op).await
        } else {
            op().await
        }
    }

    /// Runs `op` (one request) and, when a leader is elected or the
    /// connection comes back while it waits, waits [`ANSWER_GRACE`] more
    /// for its answer and then runs it again, at most [`MAX_REISSUES`]
    /// times. An answer that says no server took the request (no
    /// responders: the stream has no leader during its election) is asked
    /// again at the next election, or after [`UNANSWERED_RETRY`] without
    /// one, for at most [`UNANSWERED_PATIENCE`]. `op` must be safe to run
    /// twice (see the module's doc).
    pub async fn reissue<T, E, F, Fut>(&self, what: &str, mut op: F) -> Result<T, E>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: std::fmt::Display,
    {
        let mut rx = self.rx.clone();
        rx.borrow_and_update();
        let mut asked = 0;
        let first = Instant::now();
        loop {
            let started = Instant::now();
            let fut = op();
            tokio::pin!(fut);
            let may_ask_again = asked < MAX_REISSUES;
            tokio::select! {
                biased;
                r = &mut fut => match r {
                    Err(e) if unanswered(&e) && first.elapsed() < UNANSWERED_PATIENCE => {
                        tracing::debug!(what, error = %e, "no leader took the request; asking again at the next election");
                        tokio::select! {
                            Ok(()) = rx.changed() => {}
                            _ = tokio::time::sleep(UNANSWERED_RETRY) => {}
                        }
                        rx.borrow_and_update();
                        continue;
                    }
                    r => return r,
                },
                Ok(()) = rx.changed(), if may_ask_again => {}
            }
            tokio::select! {
                biased;
                r = &mut fut => return r,
                _ = tokio::time::sleep_until(started + ANSWER_GRACE) => {}
            }
            rx.borrow_and_update();
            asked += 1;
            tracing::debug!(what, asked, waited = ?started.elapsed(), "a leader was elected (or the connection came back) while a request waited; asking again");
        }
    }
}

async fn follow(client: async_nats::Client, link: Link, layout: Layout, tx: watch::Sender<Seen>) {
    let mut sub = match client.subscribe(layout.leader_advisories()).await {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::debug!(error = %e, "no subscription to the leaders' elections; a request lost with a leader waits for its timeout");
            None
        }
    };
    drop(client);
    loop {
        let advisory = async {
            match sub.as_mut() {
                Some(s) => s.next().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tx.closed() => return,
            _ = link.reconnected() => {
                tx.send_modify(|s| {
                    s.all += 1;
                    s.reconnects += 1;
                });
            }
            m = advisory => match m {
                Some(m) => {
                    if let Some(stream) = layout.elected_stream(&m.subject) {
                        tracing::debug!(stream, subject = %m.subject, "a new leader");
                        tx.send_modify(|s| {
                            s.all += 1;
                            *s.per_stream.entry(stream.to_string()).or_default() += 1;
                        });
                    }
                }
                None => sub = None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
    use std::sync::Arc;

    type Run = tokio::task::JoinHandle<Result<u32, String>>;

    /// One request under elections the test drives: its `n`-th copy
    /// answers `answer(n)`. The sender, the count of copies, the run.
    fn counted<F, Fut>(answer: F) -> (watch::Sender<Seen>, Arc<AtomicU32>, Run)
    where
        F: Fn(u32) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<u32, String>> + Send + 'static,
    {
        let (tx, rx) = watch::channel(Seen::default());
        let e = Elections { rx };
        let calls = Arc::new(AtomicU32::new(0));
        let c = calls.clone();
        let run =
            tokio::spawn(async move { e.reissue("test", || answer(c.fetch_add(1, SeqCst))).await });
        (tx, calls, run)
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_no_leader_took_is_asked_again_at_the_election_until_patience_runs_out() {
        let (tx, _, run) = counted(|n| async move {
            if n < 3 {
                Err("publish: no stream found for given subject".to_string())
            } else {
                Ok(n)
            }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        tx.send_modify(|s| s.all += 1);
        assert_eq!(run.await.unwrap(), Ok(3));
        assert!(unanswered(&"no responders available for request"));
        assert!(!unanswered(&"wrong last sequence: 4"));
        // A stream that is not there at all: reported after the patience.
        let t = Instant::now();
        let r = Elections::none()
            .reissue("test", || async {
                Err::<(), _>("no stream found for given subject")
            })
            .await;
        assert!(r.is_err());
        assert!(t.elapsed() >= UNANSWERED_PATIENCE);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_is_asked_again_after_an_election_and_only_then() {
        // Every copy but the third is lost (never answered).
        let (tx, calls, run) = counted(|n| async move {
            if n < 2 {
                std::future::pending().await
            } else {
                Ok(n)
            }
        });
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(calls.load(SeqCst), 1, "no election: asked once");
        tx.send_modify(|s| s.all += 1);
        tokio::time::sleep(ANSWER_GRACE + Duration::from_millis(10)).await;
        assert_eq!(calls.load(SeqCst), 2);
        tx.send_modify(|s| s.all += 1);
        assert_eq!(run.await.unwrap(), Ok(2), "the third copy's answer");
    }

    #[tokio::test(start_paused = true)]
    async fn a_publish_without_a_dedupe_id_is_never_sent_twice() {
        let (tx, rx) = watch::channel(Seen::default());
        let e = Elections { rx };
        let calls = Arc::new(AtomicU32::new(0));
        let c = calls.clone();
        let run = tokio::spawn(async move {
            e.reissue_if(false, "test", || {
                let n = c.fetch_add(1, SeqCst);
                async move {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    Ok::<_, String>(n)
                }
            })
            .await
        });
        tokio::task::yield_now().await;
        tx.send_modify(|s| s.all += 1);
        assert_eq!(run.await.unwrap(), Ok(0), "the one copy's answer");
        assert_eq!(calls.load(SeqCst), 1, "not asked again at the election");
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_within_the_grace_is_taken_and_not_asked_again() {
        let (tx, calls, run) = counted(|_| async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok(7)
        });
        tokio::task::yield_now().await;
        tx.send_modify(|s| s.all += 1);
        assert_eq!(run.await.unwrap(), Ok(7));
        assert_eq!(calls.load(SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn next_of_a_stream_waits_for_that_streams_election_or_a_reconnect() {
        let (tx, rx) = watch::channel(Seen::default());
        let mut e = Elections { rx };
        let elect = |stream: &'static str| {
            move |s: &mut Seen| {
                s.all += 1;
                *s.per_stream.entry(stream.into()).or_default() += 1;
            }
        };
        tx.send_modify(elect("LH_WORK"));
        let mut waiting = Box::pin(e.next_of("LH_WORK"));
        // One before the call does not count; another stream's does not.
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        tx.send_modify(elect("KV_lh_jobs"));
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        tx.send_modify(elect("LH_WORK"));
        assert!(futures::poll!(waiting.as_mut()).is_ready());
        drop(waiting);
        let mut waiting = Box::pin(e.next_of("LH_WORK"));
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        tx.send_modify(|s| {
            s.all += 1;
            s.reconnects += 1;
        });
        assert!(futures::poll!(waiting.as_mut()).is_ready());
    }

    #[tokio::test(start_paused = true)]
    async fn without_elections_a_request_runs_once_to_its_end() {
        let e = Elections::none();
        let calls = std::sync::atomic::AtomicU32::new(0);
        let r = e
            .reissue("test", || {
                calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    Ok::<_, String>(1)
                }
            })
            .await;
        assert_eq!((r, calls.into_inner()), (Ok(1), 1));
    }
}
