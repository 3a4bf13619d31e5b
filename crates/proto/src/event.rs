//! JSON form of [`JobEvent`]: the envelope fields (`job_id`, `epoch`, `at`,
//! `type`, `worker_id`) with the type-specific `data` object inlined beside them.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use crate::JobEvent;

const ENVELOPE: [&str; 5] = ["job_id", "epoch", "at", "type", "worker_id"];

impl JobEvent {
    /// The type-specific fields as a JSON object (empty when there are none).
    pub fn data_map(&self) -> Map<String, Value> {
        match serde_json::from_str(&self.data) {
            Ok(Value::Object(map)) => map,
            _ => Map::new(),
        }
    }
}

impl Serialize for JobEvent {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = Map::new();
        map.insert("job_id".into(), self.job_id.clone().into());
        map.insert("epoch".into(), self.epoch.into());
        map.insert("at".into(), self.at.clone().into());
        map.insert("type".into(), self.r#type.clone().into());
        if let Some(w) = &self.worker_id {
            map.insert("worker_id".into(), w.clone().into());
        }
        for (k, v) in self.data_map() {
            if !ENVELOPE.contains(&k.as_str()) {
                map.insert(k, v);
            }
        }
        map.serialize(s)
    }
}

impl<'de> Deserialize<'de> for JobEvent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut map = Map::<String, Value>::deserialize(d)?;
        let text = |map: &mut Map<String, Value>, k: &str| match map.remove(k) {
            Some(Value::String(s)) => Ok(Some(s)),
            None | Some(Value::Null) => Ok(None),
            Some(other) => Err(D::Error::custom(format!(
                "{k}: expected a string, got {other}"
            ))),
        };
        let job_id = text(&mut map, "job_id")?.unwrap_or_default();
        let at = text(&mut map, "at")?.unwrap_or_default();
        let r#type = text(&mut map, "type")?.unwrap_or_default();
        let worker_id = text(&mut map, "worker_id")?;
        let epoch = match map.remove("epoch") {
            Some(v) => v
                .as_u64()
                .ok_or_else(|| D::Error::custom("epoch: expected an unsigned integer"))?,
            None => 0,
        };
        let data = if map.is_empty() {
            String::new()
        } else {
            Value::Object(map).to_string()
        };
        Ok(JobEvent {
            job_id,
            epoch,
            at,
            r#type,
            worker_id,
            data,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_json_inlines_data_and_round_trips() {
        let ev = JobEvent {
            job_id: "j1".into(),
            epoch: 3,
            at: "2026-01-01T00:00:00Z".into(),
            r#type: "section".into(),
            worker_id: Some("w".into()),
            data: r#"{"expert":1,"section":2}"#.into(),
        };
        let json = serde_json::to_value(&ev).unwrap();
        assert_eq!(json["expert"], 1);
        assert_eq!(json["epoch"], 3);
        let back: JobEvent = serde_json::from_value(json).unwrap();
        assert_eq!(back.data_map()["section"], 2);
        assert_eq!(back.epoch, 3);
    }

    #[test]
    fn spec_json_embeds_input_and_rejects_unknown_fields() {
        let spec: crate::JobSpec =
            serde_json::from_str(r#"{"input":{"topic":"x"},"budget":{"max_steps":3}}"#).unwrap();
        assert_eq!(spec.input, r#"{"topic":"x"}"#);
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(json["input"]["topic"], "x");
        assert!(serde_json::from_str::<crate::JobSpec>(r#"{"inptu":{}}"#).is_err());
    }
}
