//! A TCP proxy between one NATS client and a real `nats-server` that injects
//! network faults on command.
//!
//! Killing or SIGSTOPping a worker process tests what happens when a worker
//! dies; it cannot test what happens when the *network* misbehaves while the
//! worker keeps running: a publish that is stuck in flight, arrives late, is
//! lost, a connection that breaks, or a partition. [`FaultProxy`] produces
//! exactly those, and at exactly the protocol op a test chooses.
//!
//! Start one proxy per client (typically a worker process started with
//! `NATS_URL=<proxy.url()>`); every rule then applies to all current and
//! future connections of that proxy, which gives per-worker control.
//!
//! - [`FaultProxy::hold`] buffers the client's publish (PUB or HPUB) whose
//!   subject matches a pattern **and everything the client sends after it**,
//!   in order, until [`Hold::release`]. [`Hold::triggered`] resolves at the
//!   moment the proxy reads that publish, so a test can SIGSTOP the worker
//!   with the publish provably sent but not delivered.
//! - [`FaultProxy::delay`] sends a matching publish no earlier than a
//!   duration after the proxy read it; what follows it stays behind it.
//! - [`FaultProxy::drop_matching`] discards matching publishes and nothing
//!   else.
//! - [`FaultProxy::mute_reply_to`] lets the `n`th matching publish through
//!   and discards the server's reply to it (its reply subject's message):
//!   a JetStream publish that landed, whose PubAck is lost.
//! - [`FaultProxy::cut`] closes every live connection (both sockets);
//!   [`FaultProxy::refuse_new`] makes the proxy close new connections at once,
//!   so the client cannot reconnect until told otherwise.
//! - [`FaultProxy::freeze`] / [`FaultProxy::thaw`]: a partition. No byte
//!   flows either way while the sockets stay open.
//!
//! Both streams are framed by protocol op (a control line ending in `\r\n`;
//! PUB, HPUB, MSG and HMSG are followed by a payload framed by its byte
//! count, which may itself contain `\r\n`), so rules act on whole ops and
//! bytes are forwarded untouched. Rules apply to the client's publishes only:
//! the server→client direction is stopped by nothing but a freeze or a cut,
//! so a held client still receives PINGs and MSGs (and its PONGs are then
//! held too: they come after the held op).
//!
//! One rewrite: the server's INFO loses its `connect_urls` (and
//! `ws_connect_urls`). A cluster member advertises every node there, itself
//! included, and async-nats adds them to its server pool, so after a
//! [`FaultProxy::cut`] a proxied client of a cluster would reconnect to a real
//! node directly and leave the proxy behind. A single server advertises none;
//! its INFO passes unchanged.
//!
//! Timing, from async-nats 0.51's source and nats-server's defaults (useful
//! when choosing fault lengths): the client pings after 60 s without server
//! traffic and disconnects itself when more than two pings are outstanding;
//! the server pings every 2 min and closes after two unanswered. A hold or
//! freeze of seconds therefore goes unnoticed by both ends. After a cut,
//! async-nats reconnects at once, then with a backoff doubling from 2 ms up
//! to 4 s between attempts, so a test must allow a few seconds after
//! `refuse_new(false)` for the client to come back.
//!
//! To know that the server has processed what a client sent, make a request
//! (to `$JS.API.INFO`, say): async-nats' `flush()` only empties the client's
//! write buffer into its socket, that is into the proxy, and proves nothing.
//!
//! The proxy's tasks run on the caller's tokio runtime: a test that blocks
//! its thread (`std::thread::sleep`, `Proc::wait_timeout`) stalls the proxy
//! too on a current-thread runtime; such tests use
//! `#[tokio::test(flavor = "multi_thread")]`.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

mod wire;
use wire::*;

/// Bytes read from a socket at a time; big enough that pass-through costs a
/// few syscalls per batch of client ops, not one per op.
const READ_CHUNK: usize = 64 * 1024;

/// Whether a NATS subject matches a subscription-style pattern.
///
/// Tokens are separated by `.`; `*` matches exactly one token and `>` (only
/// as the last pattern token) matches one or more trailing tokens.
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut pat = pattern.split('.');
    let mut sub = subject.split('.');
    loop {
        match (pat.next(), sub.next()) {
            (Some(">"), Some(_)) => return pat.next().is_none(),
            (Some("*"), Some(_)) => {}
            (Some(p), Some(s)) if p == s => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// A proxy listening on a free loopback port, forwarding each accepted
/// connection to its own connection to the upstream server.
///
/// When several rules match a publish, the first one armed wins. Commands
/// take effect on the connections' tasks promptly but not synchronously
/// (bytes already handed to a socket are delivered). Dropping the proxy
/// stops accepting and closes every connection.
pub struct FaultProxy {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept: JoinHandle<()>,
}

/// A hold armed by [`FaultProxy::hold`]. Cloning gives another handle on the
/// same hold; dropping a handle does not release it (so a forgotten handle
/// cannot silently end a fault), [`Hold::release`] or
/// [`FaultProxy::release_all`] / [`FaultProxy::clear`] do.
#[derive(Clone)]
pub struct Hold {
    inner: Arc<HoldInner>,
}

struct HoldInner {
    pattern: String,
    triggered: watch::Sender<bool>,
    released: watch::Sender<bool>,
}

struct Shared {
    upstream: String,
    rules: Mutex<Vec<Rule>>,
    /// Client publishes seen, by subject (held, delayed and dropped ones too).
    published: Mutex<HashMap<String, u64>>,
    frozen: watch::Sender<bool>,
    /// While true, nothing flows from the server to the client (replies,
    /// messages, PINGs wait in the proxy): what the client sent still
    /// reaches the server, but it hears nothing back.
    muted: watch::Sender<bool>,
    /// Bumped by every cut; each connection watches it.
    cut: watch::Sender<u64>,
    refuse: AtomicBool,
    live: AtomicUsize,
    accepted: AtomicU64,
    /// Reply subjects whose next server message is discarded
    /// ([`FaultProxy::mute_reply_to`]).
    muted_replies: Mutex<std::collections::HashSet<Vec<u8>>>,
}

struct Rule {
    pattern: String,
    action: Action,
}

enum Action {
    Hold(Arc<HoldInner>),
    Delay(Duration),
    Drop,
    /// The `nth` match (1-based) passes; the server's reply to it is
    /// discarded. `seen` counts matches.
    MuteReply {
        nth: u64,
        seen: AtomicU64,
    },
}

/// What to do with one client op.
enum Verdict {
    Pass,
    Drop,
    Delay(Duration),
    Hold(Arc<HoldInner>),
}

impl FaultProxy {
    /// Starts a proxy to `upstream` (`nats://host:port` or `host:port`): one
    /// server; for a cluster, proxy one node (see the module docs on INFO).
    ///
    /// The upstream connection is opened per accepted client, so a proxy can
    /// be started before the server and outlives server restarts (a client
    /// connecting while the server is down is closed, as it would be by the
    /// server itself).
    pub async fn start(upstream: &str) -> FaultProxy {
        let upstream = upstream
            .trim()
            .trim_start_matches("nats://")
            .trim_end_matches('/')
            .to_string();
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind proxy listener");
        let addr = listener.local_addr().expect("proxy address");
        let shared = Arc::new(Shared {
            upstream,
            rules: Mutex::new(Vec::new()),
            published: Mutex::new(HashMap::new()),
            frozen: watch::Sender::new(false),
            muted: watch::Sender::new(false),
            cut: watch::Sender::new(0),
            refuse: AtomicBool::new(false),
            live: AtomicUsize::new(0),
            accepted: AtomicU64::new(0),
            muted_replies: Mutex::new(Default::default()),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        FaultProxy {
            shared,
            addr,
            accept,
        }
    }

    /// `nats://127.0.0.1:<listen port>`: give this to the client.
    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Arms a hold: the first client publish matching `pattern` on a
    /// connection, and everything that client sends after it, is buffered
    /// until the hold is released. It applies to every connection, current
    /// and future, until released.
    pub fn hold(&self, pattern: &str) -> Hold {
        let inner = Arc::new(HoldInner {
            pattern: pattern.to_string(),
            triggered: watch::Sender::new(false),
            released: watch::Sender::new(false),
        });
        self.add_rule(pattern, Action::Hold(inner.clone()));
        Hold { inner }
    }

    /// Releases every hold (their buffered ops flow on, in order).
    pub fn release_all(&self) {
        let rules = self.shared.rules.lock().unwrap();
        for r in rules.iter() {
            if let Action::Hold(h) = &r.action {
                h.release();
            }
        }
    }

    /// Sends each matching publish no earlier than `d` after the proxy read
    /// it; ops after it wait behind it, since order is kept.
    pub fn delay(&self, pattern: &str, d: Duration) {
        self.add_rule(pattern, Action::Delay(d));
    }

    /// Discards matching publishes (the whole op); everything else flows.
    pub fn drop_matching(&self, pattern: &str) {
        self.add_rule(pattern, Action::Drop);
    }

    /// Lets the `nth` (1-based, counted from now) client publish matching
    /// `pattern` reach the server, and discards the server's reply to it
    /// (the message on its reply subject): for a JetStream publish, the
    /// message is stored but its PubAck never arrives. Other publishes and
    /// replies flow.
    pub fn mute_reply_to(&self, pattern: &str, nth: u64) {
        self.add_rule(
            pattern,
            Action::MuteReply {
                nth,
                seen: AtomicU64::new(0),
            },
        );
    }

    /// Removes every rule, releasing holds. Ops already delayed keep their
    /// delay.
    pub fn clear(&self) {
        self.release_all();
        self.shared.rules.lock().unwrap().clear();
    }

    /// Closes every live connection now (both sockets). Held or delayed ops
    /// of those connections are lost, as bytes in a broken connection are.
    pub fn cut(&self) {
        self.shared.cut.send_modify(|g| *g += 1);
    }

    /// While `yes`, new connections are closed as soon as they are accepted,
    /// before the server's INFO, so the client's reconnects fail.
    pub fn refuse_new(&self, yes: bool) {
        self.shared.refuse.store(yes, Ordering::SeqCst);
    }

    /// A partition: no byte flows in either direction until [`thaw`],
    /// sockets stay open. Whatever either side sends meanwhile waits in the
    /// proxy or in the kernel's socket buffers and is delivered on thaw.
    ///
    /// [`thaw`]: FaultProxy::thaw
    pub fn freeze(&self) {
        self.shared.frozen.send_replace(true);
    }

    /// Ends a [`FaultProxy::freeze`].
    pub fn thaw(&self) {
        self.shared.frozen.send_replace(false);
    }

    /// One direction only: while muted, the client's ops still reach the
    /// server but nothing comes back (a request whose reply is lost). What
    /// the server sends meanwhile is delivered when unmuted.
    pub fn mute_replies(&self, yes: bool) {
        self.shared.muted.send_replace(yes);
    }

    /// Connections accepted and not yet closed.
    pub fn connections(&self) -> usize {
        self.shared.live.load(Ordering::SeqCst)
    }

    /// Connections accepted (and not refused) since start; a reconnect adds one.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// How many client publishes with a subject matching `pattern` the proxy
    /// has read, whether they were passed, held, delayed or dropped.
    pub fn published(&self, pattern: &str) -> u64 {
        let seen = self.shared.published.lock().unwrap();
        seen.iter()
            .filter(|(s, _)| subject_matches(pattern, s))
            .map(|(_, n)| n)
            .sum()
    }

    fn add_rule(&self, pattern: &str, action: Action) {
        let mut rules = self.shared.rules.lock().unwrap();
        rules.retain(|r| !matches!(&r.action, Action::Hold(h) if h.is_released()));
        rules.push(Rule {
            pattern: pattern.to_string(),
            action,
        });
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.shared.refuse.store(true, Ordering::SeqCst);
        self.cut();
    }
}

impl Hold {
    /// Resolves once a matching publish has been read and held (at once if
    /// that already happened). Wrap it in `tokio::time::timeout`.
    pub async fn triggered(&self) {
        let mut rx = self.inner.triggered.subscribe();
        let _ = rx.wait_for(|t| *t).await;
    }

    pub fn is_triggered(&self) -> bool {
        *self.inner.triggered.borrow()
    }

    /// Lets the held ops flow on, in order, and disarms the hold.
    pub fn release(&self) {
        self.inner.release();
    }

    pub fn pattern(&self) -> &str {
        &self.inner.pattern
    }
}

impl HoldInner {
    fn release(&self) {
        self.released.send_replace(true);
    }

    fn is_released(&self) -> bool {
        *self.released.borrow()
    }
}

impl Shared {
    /// Counts a client publish and decides its fate: the first armed rule
    /// (in arming order) whose pattern matches wins.
    fn judge(&self, subject: &[u8], reply: Option<&[u8]>) -> Verdict {
        let subject = String::from_utf8_lossy(subject);
        {
            let mut seen = self.published.lock().unwrap();
            match seen.get_mut(subject.as_ref()) {
                Some(n) => *n += 1,
                None => {
                    seen.insert(subject.to_string(), 1);
                }
            }
        }
        let rules = self.rules.lock().unwrap();
        for r in rules.iter() {
            if !subject_matches(&r.pattern, &subject) {
                continue;
            }
            match &r.action {
                Action::Hold(h) if h.is_released() => continue,
                Action::Hold(h) => {
                    h.triggered.send_replace(true);
                    return Verdict::Hold(h.clone());
                }
                Action::Delay(d) => return Verdict::Delay(*d),
                Action::Drop => return Verdict::Drop,
                Action::MuteReply { nth, seen } => {
                    if seen.fetch_add(1, Ordering::SeqCst) + 1 == *nth {
                        if let Some(reply) = reply {
                            self.muted_replies.lock().unwrap().insert(reply.to_vec());
                        }
                    }
                    return Verdict::Pass;
                }
            }
        }
        Verdict::Pass
    }
}

/// Decrements the live count when a connection task ends, however it ends.
struct LiveGuard(Arc<Shared>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let client = match listener.accept().await {
            Ok((s, _)) => s,
            Err(_) => {
                // Out of descriptors or similar: back off instead of spinning.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if shared.refuse.load(Ordering::SeqCst) {
            drop(client);
            continue;
        }
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        shared.live.fetch_add(1, Ordering::SeqCst);
        // Subscribe now: a cut after the accept must reach this connection.
        let cut = shared.cut.subscribe();
        let guard = LiveGuard(shared.clone());
        tokio::spawn(async move {
            serve(&guard.0, client, cut).await;
            drop(guard);
        });
    }
}

/// How the server→client direction ended.
enum DownEnd {
    /// The server closed or failed: the connection is over.
    ServerGone,
    /// Writing to the client failed: the client is gone, but what it sent
    /// before is still delivered by the other direction.
    ClientGone,
}

async fn serve(shared: &Shared, client: TcpStream, mut cut: watch::Receiver<u64>) {
    let run = async {
        let Ok(server) = TcpStream::connect(&shared.upstream).await else {
            return;
        };
        // Ops are small and latency matters more than packet count here.
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let (client_rd, client_wr) = client.into_split();
        let (server_rd, server_wr) = server.into_split();
        let up = client_to_server(shared, client_rd, server_wr);
        let down = async {
            if let DownEnd::ClientGone = server_to_client(shared, server_rd, client_wr).await {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            _ = up => {}
            _ = down => {}
        }
    };
    tokio::select! {
        _ = run => {}
        _ = cut.changed() => {}
    }
    // Dropping the halves closes both sockets.
}

/// A run of client ops waiting to be written to the server.
struct Chunk {
    data: Bytes,
    not_before: Option<Instant>,
    hold: Option<Arc<HoldInner>>,
}

impl Chunk {
    fn ready(&self, now: Instant) -> bool {
        self.not_before.is_none_or(|t| t <= now)
            && self.hold.as_ref().is_none_or(|h| h.is_released())
    }
}

/// The client→server direction: read, frame into ops, apply rules, write in
/// order. A blocked head of the queue (held, delayed) blocks what follows it;
/// reading goes on meanwhile so the client is not stalled by TCP and the
/// proxy sees (and counts) what it sends.
async fn client_to_server(
    shared: &Shared,
    mut client: OwnedReadHalf,
    mut server: OwnedWriteHalf,
) -> std::io::Result<()> {
    let mut frozen = shared.frozen.subscribe();
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let mut queue: VecDeque<Chunk> = VecDeque::new();
    let mut eof = false;
    loop {
        let is_frozen = *frozen.borrow_and_update();
        if !is_frozen {
            while queue.front().is_some_and(|c| c.ready(Instant::now())) {
                let chunk = queue.pop_front().expect("front checked");
                server.write_all(&chunk.data).await?;
                if *frozen.borrow() {
                    break;
                }
            }
        }
        if eof && queue.is_empty() {
            return Ok(());
        }
        let head = queue.front();
        let deadline = head.and_then(|c| c.not_before);
        let hold = head.and_then(|c| c.hold.clone());
        if buf.capacity() - buf.len() < READ_CHUNK / 4 {
            buf.reserve(READ_CHUNK);
        }
        tokio::select! {
            r = client.read_buf(&mut buf), if !is_frozen && !eof => {
                if !matches!(r, Ok(n) if n > 0) {
                    eof = true;
                }
                ingest(shared, &mut buf, &mut queue, eof);
            }
            _ = sleep_until_opt(deadline), if !is_frozen && deadline.is_some() => {}
            _ = released(hold.as_deref()), if !is_frozen && hold.is_some() => {}
            _ = frozen.changed() => {}
        }
    }
}

async fn sleep_until_opt(t: Option<Instant>) {
    if let Some(t) = t {
        tokio::time::sleep_until(t).await;
    }
}

async fn released(h: Option<&HoldInner>) {
    if let Some(h) = h {
        let _ = h.released.subscribe().wait_for(|r| *r).await;
    }
}

/// Moves every whole op at the front of `buf` into `queue` as the rules say.
/// Consecutive passing ops become one chunk (one write). At end of stream a
/// trailing partial op is forwarded as it is.
fn ingest(shared: &Shared, buf: &mut BytesMut, queue: &mut VecDeque<Chunk>, eof: bool) {
    fn push_run(buf: &mut BytesMut, run: &mut usize, queue: &mut VecDeque<Chunk>) {
        if *run > 0 {
            queue.push_back(Chunk {
                data: buf.split_to(*run).freeze(),
                not_before: None,
                hold: None,
            });
            *run = 0;
        }
    }
    let mut run = 0;
    loop {
        let (len, verdict) = match frame(&buf[run..], Side::Client) {
            Frame::Partial => break,
            Frame::Op {
                len,
                kind: Kind::Publish(subject),
            } => (len, shared.judge(subject, reply_of(&buf[run..run + len]))),
            Frame::Op { len, .. } => (len, Verdict::Pass),
        };
        if let Verdict::Pass = verdict {
            run += len;
            continue;
        }
        push_run(buf, &mut run, queue);
        let op = buf.split_to(len).freeze();
        let (not_before, hold) = match verdict {
            Verdict::Pass | Verdict::Drop => continue,
            Verdict::Delay(d) => (Some(Instant::now() + d), None),
            Verdict::Hold(h) => (None, Some(h)),
        };
        queue.push_back(Chunk {
            data: op,
            not_before,
            hold,
        });
    }
    if eof {
        run = buf.len();
    }
    push_run(buf, &mut run, queue);
}

/// The server→client direction: ops forwarded as they are, but for INFO
/// (see [`rewrite_info`]); stopped only by a freeze.
async fn server_to_client(
    shared: &Shared,
    mut server: OwnedReadHalf,
    mut client: OwnedWriteHalf,
) -> DownEnd {
    let mut frozen = shared.frozen.subscribe();
    let mut muted = shared.muted.subscribe();
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    loop {
        let _ = frozen.wait_for(|f| !*f).await;
        let _ = muted.wait_for(|m| !*m).await;
        if buf.capacity() - buf.len() < READ_CHUNK / 4 {
            buf.reserve(READ_CHUNK);
        }
        match server.read_buf(&mut buf).await {
            Ok(0) | Err(_) => return DownEnd::ServerGone,
            Ok(_) => {}
        }
        let mut out = server_ops(&mut buf);
        drop_muted_replies(shared, &mut out);
        // A freeze (or a mute) may have begun while the read was pending.
        let _ = frozen.wait_for(|f| !*f).await;
        let _ = muted.wait_for(|m| !*m).await;
        if client.write_all(&out).await.is_err() {
            return DownEnd::ClientGone;
        }
    }
}

/// Discards, from whole server ops, each MSG or HMSG on a muted reply
/// subject (once per muting).
fn drop_muted_replies(shared: &Shared, out: &mut BytesMut) {
    let mut muted = shared.muted_replies.lock().unwrap();
    if muted.is_empty() {
        return;
    }
    let mut kept = BytesMut::with_capacity(out.len());
    let mut rest = out.split();
    while let Frame::Op { len, .. } = frame(&rest, Side::Server) {
        let op = rest.split_to(len);
        let f = fields_of(&op);
        let is_msg = f
            .first()
            .is_some_and(|n| n.eq_ignore_ascii_case(b"MSG") || n.eq_ignore_ascii_case(b"HMSG"));
        if is_msg && f.len() > 1 && muted.remove(f[1]) {
            continue;
        }
        kept.unsplit(op);
    }
    kept.unsplit(rest);
    *out = kept;
}

#[cfg(test)]
mod tests;
