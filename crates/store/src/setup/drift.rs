//! Drift: what differs between a stream's config as the server has it and
//! the wanted one, field by field, as `leasehold setup --check` prints it.

use super::*;

pub(super) fn dur(d: Duration) -> String {
    if d.is_zero() {
        "none".into()
    } else {
        leasehold_core::time::format_duration(d)
    }
}

/// A limit as the server shows it; 0 and -1 both mean "none" (the server
/// stores an unset limit as -1).
pub(super) fn num(n: i64) -> String {
    if n <= 0 {
        "none".into()
    } else {
        n.to_string()
    }
}

/// Whether `cur` is what fitting `asked` to a small server gives: `asked`
/// halved one or more times, not below [`FIT_FLOOR`].
pub(super) fn is_fitted(cur: i64, asked: i64) -> bool {
    let mut b = asked;
    while b / 2 >= FIT_FLOOR {
        b /= 2;
        if b == cur {
            return true;
        }
    }
    false
}

/// Bytes for an operator: `2 GiB`, `640 MiB`.
pub(super) fn human_bytes(b: i64) -> String {
    if b >= 1 << 30 && b % (1 << 30) == 0 {
        format!("{} GiB", b >> 30)
    } else if b >= 1 << 30 {
        format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{} MiB", b >> 20)
    }
}

/// The fields of a stream this setup decides, compared.
pub(super) fn stream_drift(
    cur: &stream::Config,
    want: &stream::Config,
) -> Vec<(String, String, String)> {
    let mut d = Vec::new();
    let mut check = |f: &str, a: String, b: String| {
        if a != b {
            d.push((f.to_string(), a, b));
        }
    };
    let mut subj_cur = cur.subjects.clone();
    let mut subj_want = want.subjects.clone();
    subj_cur.sort();
    subj_want.sort();
    check("subjects", subj_cur.join(","), subj_want.join(","));
    check(
        "replicas",
        cur.num_replicas.to_string(),
        want.num_replicas.to_string(),
    );
    check("max_age", dur(cur.max_age), dur(want.max_age));
    check("max_msgs", num(cur.max_messages), num(want.max_messages));
    check("max_bytes", num(cur.max_bytes), num(want.max_bytes));
    check(
        "max_msg_size",
        num(cur.max_message_size as i64),
        num(want.max_message_size as i64),
    );
    check(
        "max_msgs_per_subject",
        num(cur.max_messages_per_subject),
        num(want.max_messages_per_subject),
    );
    check(
        "discard",
        format!("{:?}", cur.discard),
        format!("{:?}", want.discard),
    );
    check(
        "dedupe_window",
        dur(cur.duplicate_window),
        dur(want.duplicate_window),
    );
    check(
        "compression",
        format!(
            "{:?}",
            cur.compression.clone().unwrap_or(stream::Compression::None)
        ),
        format!(
            "{:?}",
            want.compression
                .clone()
                .unwrap_or(stream::Compression::None)
        ),
    );
    check(
        "marker_ttl",
        dur(cur.subject_delete_marker_ttl.unwrap_or_default()),
        dur(want.subject_delete_marker_ttl.unwrap_or_default()),
    );
    // Only wanted on (the history's); other streams leave it as they are.
    if want.allow_message_ttl {
        check(
            "allow_msg_ttl",
            cur.allow_message_ttl.to_string(),
            "true".into(),
        );
    }
    d
}

/// The stream behind a KV bucket as this setup wants it (the fields it decides).
pub(super) fn kv_stream_want(cfg: &kv::Config) -> stream::Config {
    stream::Config {
        subjects: vec![format!("$KV.{}.>", cfg.bucket)],
        num_replicas: cfg.num_replicas.max(1),
        max_age: cfg.max_age,
        max_messages: -1,
        max_bytes: if cfg.max_bytes == 0 {
            -1
        } else {
            cfg.max_bytes
        },
        max_message_size: if cfg.max_value_size == 0 {
            -1
        } else {
            cfg.max_value_size
        },
        max_messages_per_subject: cfg.history,
        discard: stream::DiscardPolicy::New,
        duplicate_window: if cfg.max_age.is_zero() || cfg.max_age > Duration::from_secs(120) {
            Duration::from_secs(120)
        } else {
            cfg.max_age
        },
        subject_delete_marker_ttl: cfg.limit_markers,
        ..Default::default()
    }
}
