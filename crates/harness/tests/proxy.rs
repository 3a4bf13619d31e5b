//! The fault proxy against a real nats-server and real async-nats clients:
//! one client connects through the proxy, a second one directly, and the
//! direct one observes what the server actually received.

use std::future::IntoFuture;
use std::time::Duration;

use async_nats::{jetstream, Event};
use futures::StreamExt;
use leasehold_harness::{wait_for_jetstream, Cluster, FaultProxy, NatsServer};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::{timeout, Instant};

const WAIT: Duration = Duration::from_secs(10);

struct Setup {
    server: NatsServer,
    proxy: FaultProxy,
    /// Connected through the proxy.
    proxied: async_nats::Client,
    /// Connected to the server itself.
    direct: async_nats::Client,
}

async fn setup() -> Setup {
    let server = NatsServer::start();
    wait_for_jetstream(&server.url(), WAIT).await;
    let proxy = FaultProxy::start(&server.url()).await;
    let proxied = async_nats::connect(proxy.url()).await.unwrap();
    let direct = async_nats::connect(server.url()).await.unwrap();
    Setup {
        server,
        proxy,
        proxied,
        direct,
    }
}

/// A request answered by the server itself. The server handles a
/// connection's ops in order, so when the answer arrives it has processed
/// everything the client sent before. (async-nats' `flush` only writes the
/// client's buffer to the socket; it is no round trip.)
async fn roundtrip(client: &async_nats::Client, within: Duration) -> bool {
    matches!(
        timeout(within, client.request("$JS.API.INFO", "".into())).await,
        Ok(Ok(_))
    )
}

/// A subscription the server has registered before this returns.
async fn subscribe(client: &async_nats::Client, subject: &str) -> async_nats::Subscriber {
    let sub = client.subscribe(subject.to_string()).await.unwrap();
    assert!(roundtrip(client, WAIT).await, "no round trip");
    sub
}

async fn next(sub: &mut async_nats::Subscriber) -> async_nats::Message {
    timeout(WAIT, sub.next())
        .await
        .expect("no message in time")
        .expect("subscription ended")
}

/// Nothing arrives on `sub` for `d` (the only way to observe an absence).
async fn quiet(sub: &mut async_nats::Subscriber, d: Duration) {
    if let Ok(m) = timeout(d, sub.next()).await {
        panic!("unexpected message: {m:?}");
    }
}

/// Answers every request on `subject` with "pong".
async fn serve(client: &async_nats::Client, subject: &str) {
    let mut sub = subscribe(client, subject).await;
    let c = client.clone();
    tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            if let Some(reply) = m.reply {
                let _ = c.publish(reply, "pong".into()).await;
            }
        }
    });
}

async fn ask(client: &async_nats::Client, subject: &str, within: Duration) -> bool {
    matches!(
        timeout(within, client.request(subject.to_string(), "ping".into())).await,
        Ok(Ok(m)) if &m.payload[..] == b"pong"
    )
}

#[tokio::test]
async fn passes_everything_through() {
    let s = setup().await;
    assert_eq!(s.proxy.connections(), 1);

    // Requests both ways, and a client talking to itself through the proxy.
    serve(&s.direct, "direct.svc").await;
    serve(&s.proxied, "proxied.svc").await;
    assert!(ask(&s.proxied, "direct.svc", WAIT).await);
    assert!(ask(&s.direct, "proxied.svc", WAIT).await);
    assert!(ask(&s.proxied, "proxied.svc", WAIT).await);

    // JetStream through the proxy.
    let js = jetstream::new(s.proxied.clone());
    let kv = js
        .create_key_value(jetstream::kv::Config {
            bucket: "p".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    kv.put("k", "v".into()).await.unwrap();
    assert_eq!(kv.get("k").await.unwrap().as_deref(), Some(&b"v"[..]));

    // Throughput: many small ops in each direction.
    const N: usize = 10_000;
    let mut from_proxied = subscribe(&s.direct, "bulk.up").await;
    let mut to_proxied = subscribe(&s.proxied, "bulk.down").await;
    for i in 0..N {
        s.proxied
            .publish("bulk.up", format!("{i}").into())
            .await
            .unwrap();
        s.direct
            .publish("bulk.down", format!("{i}").into())
            .await
            .unwrap();
    }
    for i in 0..N {
        assert_eq!(next(&mut from_proxied).await.payload, format!("{i}"));
        assert_eq!(next(&mut to_proxied).await.payload, format!("{i}"));
    }
    assert_eq!(s.proxy.published("bulk.>"), N as u64);
    drop(s.server);
}

#[tokio::test]
async fn hold_keeps_the_op_and_everything_after_until_release() {
    let s = setup().await;
    let mut seen = subscribe(&s.direct, "*.*").await;
    let hold = s.proxy.hold("a.>");
    assert!(!hold.is_triggered());

    for subject in ["x.1", "a.1", "x.2"] {
        s.proxied.publish(subject, "m".into()).await.unwrap();
    }
    assert_eq!(next(&mut seen).await.subject.as_str(), "x.1");
    timeout(WAIT, hold.triggered())
        .await
        .expect("hold triggered");
    // Held: neither a.1 nor x.2 (sent after it) reach the server.
    quiet(&mut seen, Duration::from_millis(300)).await;
    // Nor does any later request: the client's side of a round trip is held.
    assert!(!roundtrip(&s.proxied, Duration::from_millis(300)).await);
    assert_eq!(s.proxy.published("a.>"), 1);
    assert_eq!(s.proxy.published("x.*"), 2);

    hold.release();
    assert_eq!(next(&mut seen).await.subject.as_str(), "a.1");
    assert_eq!(next(&mut seen).await.subject.as_str(), "x.2");
    // Released holds are disarmed: later matching publishes flow.
    s.proxied.publish("a.2", "m".into()).await.unwrap();
    assert_eq!(next(&mut seen).await.subject.as_str(), "a.2");
    assert!(roundtrip(&s.proxied, WAIT).await);
}

#[tokio::test]
async fn hold_lets_server_to_client_traffic_through() {
    let s = setup().await;
    let mut to_proxied = subscribe(&s.proxied, "down").await;
    let hold = s.proxy.hold("up");
    s.proxied.publish("up", "m".into()).await.unwrap();
    timeout(WAIT, hold.triggered())
        .await
        .expect("hold triggered");
    s.direct.publish("down", "d".into()).await.unwrap();
    assert_eq!(next(&mut to_proxied).await.payload, "d");
    assert!(hold.is_triggered());
    s.proxy.release_all();
    assert!(roundtrip(&s.proxied, WAIT).await);
}

#[tokio::test]
async fn drop_discards_only_matching_publishes() {
    let s = setup().await;
    let mut seen = subscribe(&s.direct, "*.*").await;
    s.proxy.drop_matching("a.>");
    for subject in ["x.1", "a.1", "x.2"] {
        s.proxied.publish(subject, "m".into()).await.unwrap();
    }
    assert_eq!(next(&mut seen).await.subject.as_str(), "x.1");
    assert_eq!(next(&mut seen).await.subject.as_str(), "x.2");
    assert_eq!(s.proxy.published("a.1"), 1);

    s.proxy.clear();
    s.proxied.publish("a.3", "m".into()).await.unwrap();
    assert_eq!(next(&mut seen).await.subject.as_str(), "a.3");
}

#[tokio::test]
async fn delay_holds_back_the_op_and_what_follows() {
    let s = setup().await;
    let mut seen = subscribe(&s.direct, "*.*").await;
    let d = Duration::from_millis(400);
    s.proxy.delay("d.>", d);

    let t0 = Instant::now();
    s.proxied.publish("d.1", "m".into()).await.unwrap();
    s.proxied.publish("x.1", "m".into()).await.unwrap();
    assert_eq!(next(&mut seen).await.subject.as_str(), "d.1");
    assert!(t0.elapsed() >= d, "arrived after {:?}", t0.elapsed());
    assert_eq!(next(&mut seen).await.subject.as_str(), "x.1");

    // Other subjects are not delayed by the rule itself.
    s.proxied.publish("x.2", "m".into()).await.unwrap();
    assert_eq!(next(&mut seen).await.subject.as_str(), "x.2");
}

#[tokio::test]
async fn freeze_is_a_partition_and_thaw_heals_it() {
    let s = setup().await;
    serve(&s.proxied, "svc").await;
    let direct_js = jetstream::new(s.direct.clone());
    let stream = direct_js
        .create_stream(jetstream::stream::Config {
            name: "S".into(),
            subjects: vec!["s.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    let js = jetstream::new(s.proxied.clone());
    js.publish("s.1", "before".into())
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(ask(&s.direct, "svc", WAIT).await);

    s.proxy.freeze();
    // The server cannot reach the proxied responder...
    assert!(!ask(&s.direct, "svc", Duration::from_millis(500)).await);
    // ...and the proxied client's publish gets no ack.
    let ack = js.publish("s.2", "frozen".into()).await.unwrap();
    assert!(timeout(Duration::from_millis(500), ack.into_future())
        .await
        .is_err());
    assert_eq!(s.proxy.connections(), 1, "a freeze keeps the sockets open");

    s.proxy.thaw();
    assert!(ask(&s.direct, "svc", WAIT).await);
    js.publish("s.3", "after".into())
        .await
        .unwrap()
        .await
        .unwrap();
    // The publish made during the freeze was only late, not lost.
    let mut info = stream.clone();
    assert_eq!(info.info().await.unwrap().state.messages, 3);
}

/// Waits for `want`, skipping other events.
async fn expect_event(events: &mut UnboundedReceiver<Event>, want: Event) {
    let want = want.to_string();
    loop {
        let e = timeout(WAIT, events.recv())
            .await
            .unwrap_or_else(|_| panic!("no {want} event"))
            .expect("events");
        if e.to_string() == want {
            return;
        }
    }
}

#[tokio::test]
async fn cut_and_refuse_new_control_reconnects() {
    let server = NatsServer::start();
    wait_for_jetstream(&server.url(), WAIT).await;
    let proxy = FaultProxy::start(&server.url()).await;
    let (tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let proxied = async_nats::ConnectOptions::new()
        .event_callback(move |e| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(e);
            }
        })
        .connect(proxy.url())
        .await
        .unwrap();
    let direct = async_nats::connect(server.url()).await.unwrap();
    serve(&direct, "svc").await;
    assert!(ask(&proxied, "svc", WAIT).await);

    // A cut alone: the client notices and reconnects through the proxy.
    proxy.cut();
    expect_event(&mut events, Event::Disconnected).await;
    expect_event(&mut events, Event::Connected).await;
    assert!(ask(&proxied, "svc", WAIT).await);
    assert_eq!(proxy.accepted(), 2);

    // Refusing: the client stays disconnected and its requests fail.
    proxy.refuse_new(true);
    proxy.cut();
    expect_event(&mut events, Event::Disconnected).await;
    assert!(!ask(&proxied, "svc", Duration::from_millis(500)).await);
    assert_eq!(proxy.connections(), 0);
    assert_eq!(proxy.accepted(), 2);
    assert_eq!(
        proxied.connection_state(),
        async_nats::connection::State::Disconnected
    );

    // Accepting again: it comes back (after its reconnect backoff).
    proxy.refuse_new(false);
    expect_event(&mut events, Event::Connected).await;
    assert!(ask(&proxied, "svc", WAIT).await);
    assert_eq!(proxy.connections(), 1);
}

#[tokio::test]
async fn payloads_are_framed_by_their_byte_counts() {
    let s = setup().await;
    let mut seen = subscribe(&s.direct, "f.*").await;
    let mut to_proxied = subscribe(&s.proxied, "g.*").await;

    // A payload that looks like protocol ops.
    let tricky = &b"x\r\nPUB fake 3\r\nabc\r\nPING\r\n"[..];
    s.proxy.drop_matching("fake");
    s.proxied
        .publish("f.1", tricky.to_vec().into())
        .await
        .unwrap();
    assert_eq!(&next(&mut seen).await.payload[..], tricky);
    assert_eq!(s.proxy.published("fake"), 0);

    // 1 MiB (the server's default max_payload) both ways, with CRLFs inside.
    let big: Vec<u8> = (0..1024 * 1024)
        .map(|i| {
            if i % 7 == 0 {
                b'\r'
            } else if i % 7 == 1 {
                b'\n'
            } else {
                i as u8
            }
        })
        .collect();
    s.proxied.publish("f.2", big.clone().into()).await.unwrap();
    assert_eq!(next(&mut seen).await.payload, big);
    s.direct.publish("g.2", big.clone().into()).await.unwrap();
    assert_eq!(next(&mut to_proxied).await.payload, big);

    // Headers make async-nats send HPUB.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("X-Test", "1");
    s.proxied
        .publish_with_headers("f.3", headers, tricky.to_vec().into())
        .await
        .unwrap();
    let m = next(&mut seen).await;
    assert_eq!(&m.payload[..], tricky);
    assert_eq!(
        m.headers.unwrap().get("X-Test").map(|v| v.as_str()),
        Some("1")
    );
    // ...and HPUB is subject to the rules like PUB.
    let hold = s.proxy.hold("f.4");
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("X-Test", "2");
    s.proxied
        .publish_with_headers("f.4", headers, "h".into())
        .await
        .unwrap();
    timeout(WAIT, hold.triggered()).await.expect("HPUB held");
    hold.release();
    assert_eq!(next(&mut seen).await.subject.as_str(), "f.4");
    assert_eq!(s.proxy.published("f.*"), 4);
}

#[tokio::test]
async fn a_cluster_client_cannot_bypass_the_proxy() {
    // Cluster members advertise every node in INFO's connect_urls; without
    // the proxy's rewrite, a cut client reconnects to one of them directly.
    let cluster = Cluster::start();
    wait_for_jetstream(&cluster.nodes[0].url(), Duration::from_secs(30)).await;
    let proxy = FaultProxy::start(&cluster.nodes[0].url()).await;
    let (tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let proxied = async_nats::ConnectOptions::new()
        .event_callback(move |e| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(e);
            }
        })
        .connect(proxy.url())
        .await
        .unwrap();
    assert!(roundtrip(&proxied, WAIT).await);

    proxy.refuse_new(true);
    proxy.cut();
    expect_event(&mut events, Event::Disconnected).await;
    // Long enough for several reconnect attempts (0, 2, 4, 8... ms apart).
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        proxied.connection_state(),
        async_nats::connection::State::Disconnected
    );

    proxy.refuse_new(false);
    expect_event(&mut events, Event::Connected).await;
    assert!(roundtrip(&proxied, WAIT).await);
    assert_eq!(proxy.accepted(), 2);
}
