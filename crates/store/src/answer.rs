//! What the server answered a failed JetStream request, read from the
//! error's kinds and sources (never its text): the one place the store
//! tells "the server said no, with this code" from "nobody answered".
//!
//! async-nats keeps the server's code in different places: as a
//! `jetstream::Error` in the source chain, or inside an error kind
//! (`CreateStreamErrorKind::JetStream`, `ConsumerErrorKind::JetStream`, ...).
//! [`answer_of`] looks in both.

use async_nats::jetstream::context::{
    ConsumerInfoError, ConsumerInfoErrorKind, CreateKeyValueError, CreateKeyValueErrorKind,
    CreateStreamError, CreateStreamErrorKind, GetStreamError, GetStreamErrorKind, RequestError,
    RequestErrorKind,
};
use async_nats::jetstream::stream::{
    ConsumerError, ConsumerErrorKind, ConsumerUpdateError, ConsumerUpdateErrorKind,
};
use async_nats::jetstream::ErrorCode;

type Dyn = dyn std::error::Error + 'static;

/// What the server answered a request that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// The server answered with this JetStream error code: a definite no.
    Code(u64),
    /// Nobody answered in time (a timeout, no responders: a leader
    /// election, a restarting node): trying again may help.
    NoAnswer,
    /// Neither can be told (a malformed answer, an invalid name, ...).
    Unknown,
}

/// What the server answered the request that failed with `err`.
pub fn answer_of(err: &Dyn) -> Answer {
    let mut cur: Option<&Dyn> = Some(err);
    while let Some(e) = cur {
        if let Some(a) = answer_here(e) {
            return a;
        }
        cur = e.source();
    }
    Answer::Unknown
}

/// Whether the request that failed with `err` was refused as a bad
/// request (status 400: an unknown kind, a malformed submission, as the
/// gateway and the server answer them): trying it again changes nothing.
pub fn bad_request(err: &Dyn) -> bool {
    let mut cur: Option<&Dyn> = Some(err);
    while let Some(e) = cur {
        if let Some(js) = e.downcast_ref::<async_nats::jetstream::Error>() {
            return js.code() == 400;
        }
        cur = e.source();
    }
    false
}

/// The answer `e` itself carries, if any (its source not looked at).
fn answer_here(e: &Dyn) -> Option<Answer> {
    let code = |c: &async_nats::jetstream::Error| Some(Answer::Code(c.error_code().0));
    let none = Some(Answer::NoAnswer);
    if let Some(js) = e.downcast_ref::<async_nats::jetstream::Error>() {
        return code(js);
    }
    if let Some(c) = e.downcast_ref::<CreateStreamError>() {
        return match c.kind() {
            CreateStreamErrorKind::JetStream(js) => code(&js),
            CreateStreamErrorKind::NotFound => Some(Answer::Code(ErrorCode::STREAM_NOT_FOUND.0)),
            CreateStreamErrorKind::TimedOut | CreateStreamErrorKind::JetStreamUnavailable => none,
            _ => None,
        };
    }
    if let Some(g) = e.downcast_ref::<GetStreamError>() {
        return match g.kind() {
            GetStreamErrorKind::JetStream(js) => code(&js),
            _ => None,
        };
    }
    if let Some(c) = e.downcast_ref::<ConsumerInfoError>() {
        return match c.kind() {
            ConsumerInfoErrorKind::NotFound => Some(Answer::Code(ErrorCode::CONSUMER_NOT_FOUND.0)),
            ConsumerInfoErrorKind::StreamNotFound => {
                Some(Answer::Code(ErrorCode::STREAM_NOT_FOUND.0))
            }
            ConsumerInfoErrorKind::JetStream(js) => code(&js),
            ConsumerInfoErrorKind::TimedOut | ConsumerInfoErrorKind::NoResponders => none,
            _ => None,
        };
    }
    if let Some(c) = e.downcast_ref::<ConsumerError>() {
        return match c.kind() {
            ConsumerErrorKind::JetStream(js) => code(&js),
            ConsumerErrorKind::TimedOut => none,
            _ => None,
        };
    }
    if let Some(c) = e.downcast_ref::<ConsumerUpdateError>() {
        return match c.kind() {
            ConsumerUpdateErrorKind::JetStream(js) => code(&js),
            ConsumerUpdateErrorKind::DoesNotExist => {
                Some(Answer::Code(ErrorCode::CONSUMER_NOT_FOUND.0))
            }
            ConsumerUpdateErrorKind::TimedOut => none,
            _ => None,
        };
    }
    if let Some(c) = e.downcast_ref::<CreateKeyValueError>() {
        return match c.kind() {
            CreateKeyValueErrorKind::TimedOut => none,
            _ => None,
        };
    }
    if let Some(r) = e.downcast_ref::<RequestError>() {
        return match r.kind() {
            RequestErrorKind::TimedOut | RequestErrorKind::NoResponders => none,
            _ => None,
        };
    }
    if let Some(r) = e.downcast_ref::<async_nats::RequestError>() {
        return match r.kind() {
            async_nats::RequestErrorKind::TimedOut | async_nats::RequestErrorKind::NoResponders => {
                none
            }
            _ => None,
        };
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_code_inside_a_kind_or_a_source_is_the_servers_answer() {
        let js: async_nats::jetstream::Error = serde_json::from_value(serde_json::json!({
            "code": 500, "err_code": 10047, "description": "insufficient storage resources available"
        }))
        .unwrap();
        let in_kind = CreateStreamError::new(CreateStreamErrorKind::JetStream(js.clone()));
        assert_eq!(answer_of(&in_kind), Answer::Code(10047));
        // A bucket's create keeps the stream's error as its source.
        let in_source =
            CreateKeyValueError::with_source(CreateKeyValueErrorKind::BucketCreate, in_kind);
        assert_eq!(answer_of(&in_source), Answer::Code(10047));
        assert_eq!(answer_of(&js), Answer::Code(10047));
    }

    #[test]
    fn a_timeout_or_no_responders_is_no_answer_and_a_bad_name_unknown() {
        let t = CreateStreamError::new(CreateStreamErrorKind::TimedOut);
        assert_eq!(answer_of(&t), Answer::NoAnswer);
        let n = CreateStreamError::new(CreateStreamErrorKind::JetStreamUnavailable);
        assert_eq!(answer_of(&n), Answer::NoAnswer);
        let r = RequestError::new(RequestErrorKind::NoResponders);
        assert_eq!(answer_of(&r), Answer::NoAnswer);
        let kv = CreateKeyValueError::new(CreateKeyValueErrorKind::TimedOut);
        assert_eq!(answer_of(&kv), Answer::NoAnswer);
        let bad = CreateStreamError::new(CreateStreamErrorKind::InvalidStreamName);
        assert_eq!(answer_of(&bad), Answer::Unknown);
        let nf = ConsumerInfoError::new(ConsumerInfoErrorKind::NotFound);
        assert_eq!(answer_of(&nf), Answer::Code(10014));
    }
}
