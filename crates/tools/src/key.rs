//! Idempotency keys, argument digests, ledger keys and business-key ids.
//!
//! - A write's idempotency key ([`incarnation_key`]) is the SHA-256 (hex) of
//!   `"{job_id}@{incarnation}:{step_id}:{tool}"`, the incarnation being the
//!   record's `created_at` (an id reused after retention is another job
//!   and never shares a key with the earlier one); a call without a record
//!   (`leasehold tool call`) and an effect begun before keys named the
//!   incarnation use [`idempotency_key`], `"{job_id}:{step_id}:{tool}"`.
//!   The identity of the effect is the job's step, not what the call says. The step id is stable across retries and
//!   resumes of one step (see [`step_id`]), so a retry whose model re-words
//!   the call derives the same key; the digest of its canonical arguments
//!   ([`arg_digest`]) is stored beside the key, and a reuse with another
//!   digest is refused ([`crate::ToolError::KeyReuse`]), never sent. The
//!   model calling the same tool again in a later step derives a different
//!   key, which is what business keys are for.
//! - A read has no ledger entry; its key ([`read_key`]) also hashes the
//!   canonical arguments and only labels the call's events.
//! - The ledger stores a write under `<job_id>.<key>` ([`ledger_key`]) and a
//!   business key under `bk/<sha256(tool:business_key)>` ([`business_key_id`]).

use serde_json::Value;
use sha2::{Digest, Sha256};

/// JSON with object keys sorted (by Unicode code point, recursively) and no
/// insignificant whitespace, so equal values always hash equal whatever order
/// a model wrote the keys in.
pub fn canonical_json(v: &Value) -> String {
    let mut out = String::new();
    write_canonical(v, &mut out);
    out
}

fn write_canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            // Sorted here rather than relying on serde_json's map type, which
            // keeps insertion order when any crate enables `preserve_order`.
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (k, val)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(val, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

fn sha256_hex(s: &str) -> String {
    hex::encode(Sha256::digest(s.as_bytes()))
}

/// The idempotency key of a write: the job, the step and the tool, never
/// the arguments (64 hex characters; sent to the destination).
pub fn idempotency_key(job_id: &str, step_id: &str, tool: &str) -> String {
    sha256_hex(&format!("{job_id}:{step_id}:{tool}"))
}

/// The idempotency key of a write of the job incarnation `incarnation`
/// (its record's `created_at`): the job, its incarnation, the step and the
/// tool, never the arguments.
pub fn incarnation_key(job_id: &str, incarnation: &str, step_id: &str, tool: &str) -> String {
    sha256_hex(&format!("{job_id}@{incarnation}:{step_id}:{tool}"))
}

/// The key of a read call: the job, the step, the tool and the canonical
/// arguments (reads are repeatable; the key only labels events).
pub fn read_key(job_id: &str, step_id: &str, tool: &str, args: &Value) -> String {
    sha256_hex(&format!(
        "{job_id}:{step_id}:{tool}:{}",
        canonical_json(args)
    ))
}

/// SHA-256 of the canonical arguments: stored with a write's key, so a
/// reuse of the key with other arguments is detected.
pub fn arg_digest(args: &Value) -> String {
    sha256_hex(&canonical_json(args))
}

pub use leasehold_store::effects::{business_key_id, check_job_id, ledger_key};

/// A step id that is stable across retries and resumes: the section the call
/// belongs to plus the ordinal of the call within it.
pub fn step_id(section: &str, call_ordinal: u32) -> String {
    format!("{section}#{call_ordinal}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn canonical_json_sorts_keys_recursively_without_spaces() {
        let a = json!({"b": 1, "a": {"z": [1, {"y": 2, "x": "s"}], "c": null}});
        assert_eq!(
            canonical_json(&a),
            r#"{"a":{"c":null,"z":[1,{"x":"s","y":2}]},"b":1}"#
        );
    }

    #[test]
    fn a_write_key_is_the_step_not_the_arguments() {
        let k1 = idempotency_key("j", "s#1", "publish");
        let k2 = idempotency_key("j", "s#2", "publish");
        let k3 = idempotency_key("j", "s#1", "notify");
        let k4 = idempotency_key("k", "s#1", "publish");
        assert_eq!(k1, sha256_hex("j:s#1:publish"));
        assert_eq!(k1.len(), 64);
        for other in [k2, k3, k4] {
            assert_ne!(k1, other);
        }
        // What the arguments say is in their digest, kept beside the key.
        let d1 = arg_digest(&json!({"a": 1, "b": 2}));
        assert_eq!(d1, arg_digest(&json!({"b": 2, "a": 1})));
        assert_ne!(d1, arg_digest(&json!({"a": 1, "b": 3})));
    }

    #[test]
    fn read_keys_ignore_key_order_but_not_values() {
        let k1 = read_key("j", "s#1", "search", &json!({"a": 1, "b": 2}));
        let k2 = read_key("j", "s#1", "search", &json!({"b": 2, "a": 1}));
        let k3 = read_key("j", "s#1", "search", &json!({"a": 1, "b": 3}));
        assert_eq!(k1, k2);
        assert_ne!(k1, k3);
        let want = sha256_hex(
            r#"run-7:step-3:create_invoice:{"number":"INV-1042","supplier":"ACME","total":"1150.00"}"#,
        );
        let got = read_key(
            "run-7",
            "step-3",
            "create_invoice",
            &json!({"supplier": "ACME", "number": "INV-1042", "total": "1150.00"}),
        );
        assert_eq!(got, want);
    }

    #[test]
    fn incarnations_of_one_id_never_share_a_key() {
        let a = incarnation_key("j", "2026-12-01T10:00:00Z", "publish#0", "publish");
        let b = incarnation_key("j", "2026-12-01T11:00:00Z", "publish#0", "publish");
        assert_ne!(a, b);
        assert_ne!(a, idempotency_key("j", "publish#0", "publish"));
        assert_eq!(
            a,
            incarnation_key("j", "2026-12-01T10:00:00Z", "publish#0", "publish")
        );
    }

    #[test]
    fn ledger_keys_of_a_job_share_its_token_and_business_keys_share_none() {
        let k = idempotency_key("job-1", "publish#0", "publish");
        assert_eq!(ledger_key("job-1", &k), format!("job-1.{k}"));
        let bk = business_key_id("publish", "job-1:abc");
        assert!(bk.starts_with("bk/") && !bk.contains('.'), "{bk}");
        assert!(check_job_id("bk").is_ok());
        assert_ne!(bk.split('.').next(), Some("bk"));
        for bad in ["", "a.b", "a b", "bk/x", "a>b", "*"] {
            assert!(check_job_id(bad).is_err(), "{bad:?}");
        }
        assert!(check_job_id("Job_1=-x").is_ok());
    }
}
