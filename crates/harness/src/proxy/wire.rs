//! The NATS protocol as the proxy reads it: ops framed at the front of a
//! buffer, which side's ops carry payloads, the INFO the client is shown.

use bytes::BytesMut;

/// Which peer wrote a stream; it decides which ops carry a payload.
#[derive(Clone, Copy, Debug)]
pub(super) enum Side {
    Client,
    Server,
}

/// One protocol op framed at the front of a buffer.
#[derive(Debug, PartialEq)]
pub(super) enum Frame<'a> {
    /// The buffer does not yet hold a whole op.
    Partial,
    /// The first `len` bytes are one op (with its payload, if any).
    Op { len: usize, kind: Kind<'a> },
}

#[derive(Debug, PartialEq)]
pub(super) enum Kind<'a> {
    /// A client's PUB or HPUB, with its subject.
    Publish(&'a [u8]),
    /// A server's INFO line.
    Info,
    Other,
}

/// Frames the op at the front of `buf`, written by `side`.
///
/// Op names are case-insensitive and fields are separated by runs of spaces
/// or tabs, as in the server's parser; a line may end in `\n` alone. Ops with
/// a payload (client PUB and HPUB, server MSG and HMSG) span their control
/// line, the byte count it announces and a closing `\r\n`. A line whose byte
/// counts do not parse is framed as a bare line, for the peer to reject.
pub(super) fn frame(buf: &[u8], side: Side) -> Frame<'_> {
    let Some(nl) = buf.iter().position(|&b| b == b'\n') else {
        return Frame::Partial;
    };
    let line_len = nl + 1;
    let line = &buf[..nl];
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let mut fields: [&[u8]; 6] = [&[]; 6];
    let mut n = 0;
    for f in line
        .split(|&b| b == b' ' || b == b'\t')
        .filter(|f| !f.is_empty())
    {
        if n == fields.len() {
            n += 1;
            break;
        }
        fields[n] = f;
        n += 1;
    }
    let name = fields[0];
    let bare = |kind| Frame::Op {
        len: line_len,
        kind,
    };
    if matches!(side, Side::Server) && name.eq_ignore_ascii_case(b"INFO") {
        return bare(Kind::Info);
    }
    // Fields with the optional reply subject left out, and whether a header
    // size precedes the total size:
    //   PUB <subject> [reply] <#bytes>
    //   HPUB <subject> [reply] <#hdr> <#total>
    //   MSG <subject> <sid> [reply] <#bytes>
    //   HMSG <subject> <sid> [reply] <#hdr> <#total>
    let is = |op: &[u8]| name.eq_ignore_ascii_case(op);
    let (min_fields, headers) = match side {
        Side::Client if is(b"PUB") => (3, false),
        Side::Client if is(b"HPUB") => (4, true),
        Side::Server if is(b"MSG") => (4, false),
        Side::Server if is(b"HMSG") => (5, true),
        _ => return bare(Kind::Other),
    };
    if n != min_fields && n != min_fields + 1 {
        return bare(Kind::Other);
    }
    if headers && parse_len(fields[n - 2]).is_none() {
        return bare(Kind::Other);
    }
    let Some(len) = parse_len(fields[n - 1]).and_then(|p| p.checked_add(line_len + 2)) else {
        return bare(Kind::Other);
    };
    if buf.len() < len {
        return Frame::Partial;
    }
    let kind = match side {
        Side::Client => Kind::Publish(fields[1]),
        Side::Server => Kind::Other,
    };
    Frame::Op { len, kind }
}

/// An INFO line with `connect_urls` and `ws_connect_urls` emptied, or `None`
/// when it has none (or is not JSON) and can pass unchanged.
pub(super) fn rewrite_info(line: &[u8]) -> Option<Vec<u8>> {
    let json = line.get(4..)?.trim_ascii();
    let mut info: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(json).ok()?;
    let mut changed = false;
    for key in ["connect_urls", "ws_connect_urls"] {
        if let Some(serde_json::Value::Array(urls)) = info.get_mut(key) {
            changed |= !urls.is_empty();
            urls.clear();
        }
    }
    if !changed {
        return None;
    }
    let mut out = b"INFO ".to_vec();
    out.extend_from_slice(&serde_json::to_vec(&info).ok()?);
    out.extend_from_slice(b"\r\n");
    Some(out)
}

/// Splits off every whole op at the front of `buf` for the client, with
/// INFO rewritten by [`rewrite_info`]. Without an INFO to rewrite (all but
/// the first read of a connection, usually) nothing is copied.
pub(super) fn server_ops(buf: &mut BytesMut) -> BytesMut {
    let mut out = BytesMut::new();
    loop {
        let mut run = 0;
        let mut info = None;
        while let Frame::Op { len, kind } = frame(&buf[run..], Side::Server) {
            if kind == Kind::Info {
                info = Some(len);
                break;
            }
            run += len;
        }
        out.unsplit(buf.split_to(run));
        let Some(len) = info else {
            return out;
        };
        let line = buf.split_to(len);
        match rewrite_info(&line) {
            Some(new) => out.extend_from_slice(&new),
            None => out.unsplit(line),
        }
    }
}

/// The control line's fields of a whole op (at most 6).
pub(super) fn fields_of(op: &[u8]) -> Vec<&[u8]> {
    let nl = op.iter().position(|&b| b == b'\n').unwrap_or(op.len());
    let line = &op[..nl];
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    line.split(|&b| b == b' ' || b == b'\t')
        .filter(|f| !f.is_empty())
        .take(6)
        .collect()
}

/// The reply subject of a whole client PUB or HPUB op, if it has one.
pub(super) fn reply_of(op: &[u8]) -> Option<&[u8]> {
    let f = fields_of(op);
    let name = f.first()?;
    let with_reply = if name.eq_ignore_ascii_case(b"PUB") {
        4
    } else if name.eq_ignore_ascii_case(b"HPUB") {
        5
    } else {
        return None;
    };
    (f.len() == with_reply).then(|| f[2])
}

pub(super) fn parse_len(field: &[u8]) -> Option<usize> {
    std::str::from_utf8(field).ok()?.parse().ok()
}
