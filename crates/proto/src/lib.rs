//! The public data of leasehold, generated from `proto/leasehold.proto`.
//!
//! The generated types are both the protobuf wire form (prost) and the JSON
//! form (serde) of the contract. Fields that hold arbitrary JSON (`input`,
//! `metadata`, `result.output`, an event's `data`) are JSON text inside the
//! Rust types and protobuf, and embedded JSON values in the JSON form.

#[allow(clippy::all, missing_docs)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/leasehold.v1.rs"));
}

pub use generated::*;

mod event;

/// serde adapter: a `String` holding JSON text, (de)serialized as the JSON
/// value itself. The empty string stands for "absent" and is written as `null`.
pub mod json_text {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(text: &str, s: S) -> Result<S::Ok, S::Error> {
        if text.is_empty() {
            return s.serialize_none();
        }
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(serde::ser::Error::custom)?;
        serde::Serialize::serialize(&value, s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
        let value = serde_json::Value::deserialize(d)?;
        Ok(if value.is_null() {
            String::new()
        } else {
            value.to_string()
        })
    }
}
