//! The proxy's pure parts: subject patterns and the protocol's framing.

use super::*;

#[test]
fn subject_patterns() {
    assert!(subject_matches("a", "a"));
    assert!(!subject_matches("a", "b"));
    assert!(!subject_matches("a", "a.b"));
    assert!(!subject_matches("a.b", "a"));
    assert!(subject_matches("a.*", "a.b"));
    assert!(!subject_matches("a.*", "a"));
    assert!(!subject_matches("a.*", "a.b.c"));
    assert!(subject_matches("*.b.*", "a.b.c"));
    assert!(subject_matches("a.>", "a.b"));
    assert!(subject_matches("a.>", "a.b.c.d"));
    assert!(!subject_matches("a.>", "a"));
    assert!(!subject_matches("a.>", "b.c"));
    assert!(subject_matches(">", "a"));
    assert!(subject_matches(">", "a.b"));
    assert!(subject_matches(
        "$O.lh_artifacts.C.>",
        "$O.lh_artifacts.C.abc"
    ));
    assert!(!subject_matches(
        "$O.lh_artifacts.C.>",
        "$O.lh_artifacts.M.abc"
    ));
    // `>` only means "the rest" as the last token.
    assert!(!subject_matches("a.>.c", "a.b.c"));
    assert!(subject_matches("a.b>", "a.b>"));
    assert!(!subject_matches("a.b*", "a.bc"));
}

/// One op's bytes and what it is: `"pub <subject>"`, `"info"` or `""`.
type Op = (&'static [u8], &'static str);

fn describe(kind: Kind<'_>) -> String {
    match kind {
        Kind::Publish(s) => format!("pub {}", String::from_utf8_lossy(s)),
        Kind::Info => "info".into(),
        Kind::Other => String::new(),
    }
}

/// A client→server stream's ops.
fn client_ops() -> Vec<Op> {
    vec![
        (b"CONNECT {\"verbose\":false,\"name\":\"x y\"}\r\n", ""),
        (b"PING\r\n", ""),
        (b"SUB a.> 1\r\n", ""),
        (b"PUB a.b 14\r\nhi\r\nPUB fake 3\r\n", "pub a.b"),
        (b"PUB a.c _INBOX.1 0\r\n\r\n", "pub a.c"),
        (
            b"HPUB h.1 22 27\r\nNATS/1.0\r\nX: \r\nPUB\r\n\r\nhello\r\n",
            "pub h.1",
        ),
        (b"HPUB h.2 _R.1 12 12\r\nNATS/1.0\r\n\r\n\r\n", "pub h.2"),
        (b"pub\tlow  2\r\nok\r\n", "pub low"),
        (b"PUB bad x\r\n", ""),
        // Only a server's INFO is one; a client's is a line to reject.
        (b"INFO {}\r\n", ""),
        (b"MSG a 1 2\r\n", ""),
        (b"UNSUB 1 5\r\n", ""),
        (b"PONG\n", ""),
    ]
}

/// A server→client stream's ops.
fn server_ops_sample() -> Vec<Op> {
    vec![
        (
            b"INFO {\"server_id\":\"x\",\"connect_urls\":[\"a:1\"]}\r\n",
            "info",
        ),
        (b"+OK\r\n", ""),
        (b"MSG a.b 1 14\r\nhi\r\nMSG fake 3\r\n", ""),
        (b"MSG a.c 2 _INBOX.1 0\r\n\r\n", ""),
        (
            b"HMSG h.1 3 23 28\r\nNATS/1.0\r\nX: \r\nINFO\r\n\r\nhello\r\n",
            "",
        ),
        (b"HMSG h.2 4 _R.1 12 12\r\nNATS/1.0\r\n\r\n\r\n", ""),
        (b"PING\r\n", ""),
        (b"info\t{}\r\n", "info"),
        // A server never sends PUB; it is a line.
        (b"PUB a 3\r\n", ""),
        (b"-ERR 'Unknown Protocol Operation'\r\n", ""),
    ]
}

/// Frames `stream` fed in pieces of `step` bytes, as reads would deliver it.
fn frame_in_pieces(stream: &[u8], step: usize, side: Side) -> Vec<(Vec<u8>, String)> {
    let mut buf = Vec::new();
    let mut out = Vec::new();
    for piece in stream.chunks(step) {
        buf.extend_from_slice(piece);
        while let Frame::Op { len, kind } = frame(&buf, side) {
            let kind = describe(kind);
            out.push((buf.drain(..len).collect(), kind));
        }
    }
    assert!(
        buf.is_empty(),
        "left over: {:?}",
        String::from_utf8_lossy(&buf)
    );
    out
}

#[test]
fn frames_ops_split_anywhere() {
    for (ops, side) in [
        (client_ops(), Side::Client),
        (server_ops_sample(), Side::Server),
    ] {
        let stream: Vec<u8> = ops.iter().flat_map(|(b, _)| b.iter().copied()).collect();
        let want: Vec<(Vec<u8>, String)> = ops
            .iter()
            .map(|(b, k)| (b.to_vec(), k.to_string()))
            .collect();
        for step in 1..=stream.len() {
            let got = frame_in_pieces(&stream, step, side);
            assert_eq!(got, want, "{side:?} step {step}");
        }
    }
}

#[test]
fn partial_payload_waits_for_its_bytes() {
    let c = Side::Client;
    assert_eq!(frame(b"PUB a 5\r\nab", c), Frame::Partial);
    assert_eq!(frame(b"PUB a 5\r\nabcde\r", c), Frame::Partial);
    assert_eq!(frame(b"PUB a", c), Frame::Partial);
    assert_eq!(
        frame(b"PUB a 5\r\nabcde\r\nPING\r\n", c),
        Frame::Op {
            len: 16,
            kind: Kind::Publish(b"a")
        }
    );
    assert_eq!(frame(b"MSG a 1 5\r\nabc", Side::Server), Frame::Partial);
    // Absurd sizes are not trusted to frame anything.
    assert_eq!(
        frame(b"PUB a 99999999999999999999999\r\n", c),
        Frame::Op {
            len: 31,
            kind: Kind::Other
        }
    );
}

#[test]
fn info_loses_its_connect_urls_and_nothing_else() {
    let line = br#"INFO {"port":4222,"connect_urls":["10.0.0.1:4222","[::1]:4223"],"ws_connect_urls":["w:1"],"max_payload":1048576}"#;
    let new = rewrite_info(&[&line[..], b"\r\n"].concat()).expect("rewritten");
    assert!(new.starts_with(b"INFO {") && new.ends_with(b"}\r\n"));
    let json: serde_json::Value = serde_json::from_slice(&new[5..]).unwrap();
    assert_eq!(json["connect_urls"], serde_json::json!([]));
    assert_eq!(json["ws_connect_urls"], serde_json::json!([]));
    assert_eq!(json["port"], 4222);
    assert_eq!(json["max_payload"], 1048576);
    // Nothing to remove, or not JSON: forwarded as it is.
    assert_eq!(rewrite_info(b"INFO {\"port\":1}\r\n"), None);
    assert_eq!(rewrite_info(b"INFO {\"connect_urls\":[]}\r\n"), None);
    assert_eq!(rewrite_info(b"INFO garbage\r\n"), None);
}

#[test]
fn server_stream_keeps_its_bytes_but_info() {
    let ops = server_ops_sample();
    let stream: Vec<u8> = ops.iter().flat_map(|(b, _)| b.iter().copied()).collect();
    let mut buf = BytesMut::from(&stream[..stream.len() - 3]);
    let out = server_ops(&mut buf);
    // The INFO lost its URLs; the rest is byte for byte, up to the last
    // whole op.
    let info = br#"INFO {"connect_urls":[],"server_id":"x"}"#;
    assert!(out.starts_with(info), "{:?}", String::from_utf8_lossy(&out));
    let rest = &stream[ops[0].0.len()..];
    let last = ops.last().unwrap().0.len();
    assert_eq!(&out[info.len() + 2..], &rest[..rest.len() - last]);
    assert_eq!(buf.len(), last - 3);
}
