//! A deterministic JSON instance of a JSON Schema, so that any structured
//! output a caller asks for gets a conforming answer.

use serde_json::{json, Map, Value};

/// An instance of `schema`; `hint` (the topic) seeds the strings so answers
/// differ by topic, and each string is phrased after its property name and
/// item index (a `title`, a `name`, a `focus`, a `goal`...), so outlines and
/// expert lists read like plausible ones. `$ref`s into `$defs`/`definitions`
/// are followed (to a depth limit).
pub fn instance(schema: &Value, root: &Value, hint: &str, depth: usize) -> Value {
    if depth > 8 {
        return Value::Null;
    }
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        let path = r.trim_start_matches('#');
        return match root.pointer(path) {
            Some(target) => instance(target, root, hint, depth + 1),
            None => Value::Null,
        };
    }
    if let Some(c) = schema.get("const") {
        return c.clone();
    }
    if let Some(e) = schema
        .get("enum")
        .and_then(Value::as_array)
        .and_then(|e| e.first())
    {
        return e.clone();
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        if let Some(first) = schema
            .get(key)
            .and_then(Value::as_array)
            .and_then(|a| a.first())
        {
            return instance(first, root, hint, depth + 1);
        }
    }
    let ty = match schema.get("type") {
        Some(Value::String(t)) => t.as_str(),
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null")
            .unwrap_or("null"),
        _ if schema.get("properties").is_some() => "object",
        _ if schema.get("items").is_some() => "array",
        _ => "string",
    };
    match ty {
        "object" => {
            let mut out = Map::new();
            if let Some(props) = schema.get("properties").and_then(Value::as_object) {
                // All properties: strict-mode schemas require every one.
                for (k, v) in props {
                    out.insert(
                        k.clone(),
                        instance(v, root, &format!("{hint}{SEP}{k}"), depth + 1),
                    );
                }
            }
            if let Some(req) = schema.get("required").and_then(Value::as_array) {
                for k in req.iter().filter_map(Value::as_str) {
                    out.entry(k.to_string())
                        .or_insert_with(|| json!(phrase(&format!("{hint}{SEP}{k}"))));
                }
            }
            Value::Object(out)
        }
        "array" => {
            let min = schema.get("minItems").and_then(Value::as_u64);
            let max = schema.get("maxItems").and_then(Value::as_u64);
            let n = min
                .unwrap_or(3)
                .min(max.unwrap_or(u64::MAX))
                .max(min.unwrap_or(0));
            let items = schema
                .get("items")
                .cloned()
                .unwrap_or(json!({"type": "string"}));
            Value::Array(
                (0..n)
                    .map(|i| instance(&items, root, &format!("{hint}{SEP}#{i}"), depth + 1))
                    .collect(),
            )
        }
        "integer" => json!(schema.get("minimum").and_then(Value::as_i64).unwrap_or(1)),
        "number" => json!(schema.get("minimum").and_then(Value::as_f64).unwrap_or(1.0)),
        "boolean" => json!(true),
        "null" => Value::Null,
        _ => {
            let text = phrase(hint);
            let min = schema.get("minLength").and_then(Value::as_u64).unwrap_or(0) as usize;
            let max = schema
                .get("maxLength")
                .and_then(Value::as_u64)
                .map(|m| m as usize);
            let mut s = text;
            while s.len() < min {
                s.push('.');
            }
            if let Some(m) = max {
                s = s.chars().take(m).collect();
            }
            json!(s)
        }
    }
}

/// Separates the topic, property names and `#index` parts of a hint.
const SEP: char = '\u{1f}';

/// A string for the property and item index named at the end of `hint`.
fn phrase(hint: &str) -> String {
    let mut parts = hint.split(SEP);
    let topic = parts.next().unwrap_or_default().trim();
    let topic = if topic.is_empty() {
        "the subject"
    } else {
        topic
    };
    let (mut key, mut idx) = ("", 0usize);
    for p in parts {
        match p.strip_prefix('#') {
            Some(n) => idx = n.parse().unwrap_or(0),
            None => key = p,
        }
    }
    const ASPECTS: [&str; 8] = [
        "Foundations",
        "Failure modes",
        "Design patterns",
        "Operating in production",
        "Testing and verification",
        "Trade-offs",
        "Case studies",
        "Open questions",
    ];
    const EXPERTS: [(&str, &str); 6] = [
        (
            "Dr. Ada Lin, distributed systems researcher",
            "correctness under partial failure",
        ),
        (
            "Sam Okafor, site reliability engineer",
            "operating it at scale and on call",
        ),
        (
            "Priya Raman, security architect",
            "abuse, isolation and blast radius",
        ),
        (
            "Jonas Weber, platform engineer",
            "developer experience and APIs",
        ),
        (
            "Mei Tanaka, performance engineer",
            "latency, throughput and cost",
        ),
        (
            "Luis Ortega, product manager",
            "what users need and will pay for",
        ),
    ];
    let aspect = ASPECTS[idx % ASPECTS.len()];
    let (name, focus) = EXPERTS[idx % EXPERTS.len()];
    match key {
        "title" | "heading" => format!("{aspect} of {topic}"),
        "name" | "expert" => name.to_string(),
        "focus" | "perspective" | "angle" => focus.to_string(),
        "goal" | "description" | "purpose" | "summary" => {
            format!(
                "Explain the {} of {topic}, with concrete examples and sources.",
                aspect.to_lowercase()
            )
        }
        "" => topic.to_string(),
        other => format!("{topic}: {other} {}", idx + 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instance_follows_schema() {
        let schema = json!({
            "type": "object",
            "required": ["title", "sections"],
            "properties": {
                "title": {"type": "string"},
                "sections": {"type": "array", "minItems": 4, "items": {"$ref": "#/$defs/s"}},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                "kind": {"enum": ["a", "b"]},
                "n": {"type": "integer"}
            },
            "$defs": {"s": {"type": "object", "properties": {"heading": {"type": "string"}}, "required": ["heading"]}}
        });
        let v = instance(&schema, &schema, "topic", 0);
        assert_eq!(v["sections"].as_array().unwrap().len(), 4);
        assert_eq!(v["sections"][0]["heading"], "Foundations of topic");
        assert_eq!(v["sections"][1]["heading"], "Failure modes of topic");
        assert_eq!(v["tags"].as_array().unwrap().len(), 2);
        assert_eq!(v["kind"], "a");
        assert_eq!(v["n"], 1);
    }
}
