//! Idempotency keys, argument digests and business-key ids.
//!
//! The key of a call is the SHA-256 (hex) of
//! `"{job_id}:{step_id}:{tool}:{canonical_json(args)}"`, where the step id is
//! stable across retries and resumes of one step (see [`step_id`]). The same
//! step retried derives the same key; the model calling the same tool again in
//! a later step derives a different one, which is what business keys are for.

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

/// The idempotency key of one call (64 hex characters; a valid KV key).
pub fn idempotency_key(job_id: &str, step_id: &str, tool: &str, args: &Value) -> String {
    sha256_hex(&format!(
        "{job_id}:{step_id}:{tool}:{}",
        canonical_json(args)
    ))
}

/// SHA-256 of the canonical arguments: stored with the key so a reuse of the
/// key with other arguments is detected.
pub fn arg_digest(args: &Value) -> String {
    sha256_hex(&canonical_json(args))
}

/// The ledger key of a business key: `bk.<sha256(tool:business_key)>`.
pub fn business_key_id(tool: &str, business_key: &str) -> String {
    format!("bk.{}", sha256_hex(&format!("{tool}:{business_key}")))
}

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
    fn key_ignores_key_order_but_not_values() {
        let k1 = idempotency_key("j", "s#1", "publish", &json!({"a": 1, "b": 2}));
        let k2 = idempotency_key("j", "s#1", "publish", &json!({"b": 2, "a": 1}));
        let k3 = idempotency_key("j", "s#1", "publish", &json!({"a": 1, "b": 3}));
        let k4 = idempotency_key("j", "s#2", "publish", &json!({"a": 1, "b": 2}));
        assert_eq!(k1, k2);
        assert_ne!(k1, k3);
        assert_ne!(k1, k4);
        assert_eq!(k1.len(), 64);
    }

    #[test]
    fn key_matches_the_seed_formula() {
        let want = sha256_hex(
            r#"run-7:step-3:create_invoice:{"number":"INV-1042","supplier":"ACME","total":"1150.00"}"#,
        );
        let got = idempotency_key(
            "run-7",
            "step-3",
            "create_invoice",
            &json!({"supplier": "ACME", "number": "INV-1042", "total": "1150.00"}),
        );
        assert_eq!(got, want);
    }
}
