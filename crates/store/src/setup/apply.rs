//! The apply: one way to create or update a stream, a bucket or the object
//! store with a fitted bound ([`apply_fitted`]), and the consumers.

use super::*;

/// A failed write of setup, told by what the server answered: a server
/// whose JetStream storage limit is below the bounds is told what to
/// change; a server that did not answer is [`StoreError::Unavailable`]
/// (setup as a whole is tried again, see [`super::ensure_with`]), and so
/// is one that could not create a stream's store at once (its own log
/// says why; a busy server answers it now and then, and asked again makes
/// the stream).
pub(super) fn setup_error(what: &str, e: &(dyn std::error::Error + 'static)) -> StoreError {
    if e.to_string().contains(STORE_FAILED) {
        return StoreError::Unavailable(format!(
            "setup {what}: the server could not create its store this time ({e}; its log says why)"
        ));
    }
    match crate::answer::answer_of(e) {
        crate::answer::Answer::Code(NO_ROOM) => StoreError::Config(format!(
            "setup {what}: the server's JetStream storage limit (max_file_store) is smaller than the bounds asked for; lower them ({BOUND_FLAGS}) or raise the server's limit ({e})"
        )),
        crate::answer::Answer::NoAnswer => {
            StoreError::Unavailable(format!("setup {what}: {e}"))
        }
        _ => StoreError::nats(&format!("setup {what}"), e.to_string()),
    }
}

/// What the server answers, and only that, when it could not create a
/// stream's (or a consumer's) files.
const STORE_FAILED: &str = "error creating store for";

/// Creates or updates one durable consumer (or, checking, compares it).
pub(super) async fn apply_consumer(
    js: &jetstream::Context,
    stream_name: &str,
    cfg: consumer::pull::Config,
    mode: Mode,
    err: &ErrFn,
) -> Result<Change, StoreError> {
    let name = cfg.durable_name.clone().expect("durable");
    let object = format!("consumer {name}");
    let mut note = None;
    let s = match js.get_stream_no_info(&stream_name).await {
        Ok(s) => s,
        Err(e) => return Err(crate::lookup_error(format!("stream {stream_name}"), &e)),
    };
    let state = match s.consumer_info(&name).await {
        Ok(info) => {
            let c = &info.config;
            let mut d = Vec::new();
            for (f, a, b) in [
                ("ack_wait", dur(c.ack_wait), dur(cfg.ack_wait)),
                ("max_deliver", num(c.max_deliver), num(cfg.max_deliver)),
                (
                    "max_ack_pending",
                    num(c.max_ack_pending),
                    num(cfg.max_ack_pending),
                ),
                ("max_waiting", num(c.max_waiting), num(cfg.max_waiting)),
                (
                    "filter_subject",
                    c.filter_subject.clone(),
                    cfg.filter_subject.clone(),
                ),
            ] {
                if a != b {
                    d.push((f.to_string(), a, b));
                }
            }
            if d.is_empty() {
                ChangeState::Unchanged
            } else {
                if mode == Mode::Apply {
                    match s.update_consumer(cfg.clone()).await {
                        Ok(_) => {}
                        // Some fields (max_waiting) cannot change in
                        // place: the consumer is made again. Its
                        // tickets stay in the work queue; those not yet
                        // acknowledged are delivered again, which a
                        // claim tells apart from new work.
                        Err(e) if e.to_string().contains("can not be updated") => {
                            s.delete_consumer(&name).await.map_err(|e| err(&name, &e))?;
                            s.create_consumer(cfg.clone())
                                .await
                                .map_err(|e| err(&name, &e))?;
                            note = Some(
                                "made again: the server cannot change this in place; unacknowledged tickets are delivered again".to_string(),
                            );
                        }
                        Err(e) => return Err(err(&name, &e)),
                    }
                }
                ChangeState::Updated(d)
            }
        }
        Err(e) if crate::is_not_found(&e) => {
            if mode == Mode::Apply {
                s.create_consumer(cfg.clone())
                    .await
                    .map_err(|e| err(&name, &e))?;
            }
            ChangeState::Created
        }
        Err(e) => return Err(crate::lookup_error(object, &e)),
    };
    Ok(Change {
        object,
        state,
        note,
    })
}

/// The config of stream `name` as the server has it (`None`: not there).
pub(super) async fn current_config(
    js: &jetstream::Context,
    name: &str,
    object: &str,
    err: &ErrFn,
) -> Result<Option<stream::Config>, StoreError> {
    match js.get_stream(name).await {
        Ok(mut s) => Ok(Some(
            s.info().await.map_err(|e| err(name, &e))?.config.clone(),
        )),
        Err(e) if crate::is_not_found(&e) => Ok(None),
        Err(e) => Err(crate::lookup_error(object.to_string(), &e)),
    }
}

/// The byte bound to want: a default bound an earlier setup fitted to this
/// server stays as it is (setup is idempotent; an explicit bound grows it).
pub(super) fn keep_fitted(cur: Option<&stream::Config>, fit: bool, asked: i64, want: i64) -> i64 {
    match cur {
        Some(c) if fit && is_fitted(c.max_bytes, asked) => c.max_bytes,
        _ => want,
    }
}

/// How setup tells a failed write: the message names the object; a server
/// whose storage limit is below the bounds gets what to change.
pub(super) type ErrFn = dyn Fn(&str, &(dyn std::error::Error + 'static)) -> StoreError + Sync;

/// A field that differs: (field, as the server has it, as wanted).
pub(super) type Drift = Vec<(String, String, String)>;

pub(super) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One object setup makes, as [`apply_fitted`] applies it: the stream that
/// holds it, the bytes it wants, how the server's config differs from the
/// wanted one, and how it is written.
pub(super) struct Fitted {
    /// `stream NAME`, `kv NAME`, `object store NAME`: the [`Change`]'s object.
    object: String,
    /// The JetStream stream behind it (`KV_<bucket>`, `OBJ_<bucket>`).
    stream: String,
    /// The name an error gives.
    what: String,
    /// Its `max_bytes` as asked (a default bound may be fitted below it).
    max_bytes: i64,
    /// What differs between the server's config and the wanted one, at
    /// `max_bytes`.
    drift: DriftFn,
    /// Creates it (no config on the server) or updates the server's one,
    /// at `max_bytes`.
    write: WriteFn,
}

/// How a [`Fitted`] object's config differs from the server's, at a bound.
pub(super) type DriftFn = Box<dyn Fn(&stream::Config, i64) -> Drift + Send + Sync>;

/// How a [`Fitted`] object is written, given the server's config (if any)
/// and the bound.
pub(super) type WriteFn = Box<
    dyn Fn(Option<stream::Config>, i64) -> futures::future::BoxFuture<'static, Result<(), BoxError>>
        + Send
        + Sync,
>;

/// The one apply of setup, for streams, buckets and the object store alike:
/// reads the server's config, compares, and (applying) creates or updates;
/// a default byte bound the server cannot hold is halved and tried again
/// (never below [`FIT_FLOOR`]), and one an earlier setup fitted is kept.
pub(super) async fn apply_fitted(
    js: &jetstream::Context,
    l: &crate::Layout,
    bounds: &Bounds,
    t: Fitted,
    mode: Mode,
    err: &ErrFn,
) -> Result<Change, StoreError> {
    let bound = Bound::of_stream(l, &t.stream);
    let fit = bound.is_some_and(|b| bounds.fit(b));
    let asked = bound.map_or(t.max_bytes, |b| bounds.asked(b));
    let cur = current_config(js, &t.stream, &t.object, err).await?;
    let mut bytes = keep_fitted(cur.as_ref(), fit, asked, t.max_bytes);
    let state = loop {
        let state = match &cur {
            Some(c) => match (t.drift)(c, bytes) {
                d if d.is_empty() => ChangeState::Unchanged,
                d => ChangeState::Updated(d),
            },
            None => ChangeState::Created,
        };
        let applied = match (&state, mode) {
            (ChangeState::Unchanged, _) | (_, Mode::Check) => Ok(()),
            (_, Mode::Apply) => (t.write)(cur.clone(), bytes).await,
        };
        match applied {
            Ok(()) => break state,
            // Too big for the server's storage limit: a default bound
            // is halved and tried again.
            Err(e) if fit && bytes / 2 >= FIT_FLOOR && no_room(&*e) => bytes /= 2,
            Err(e) => return Err(err(&t.what, &*e)),
        }
    };
    Ok(Change {
        object: t.object,
        state,
        note: fitted_note(bytes, asked),
    })
}

/// A stream, as [`apply_fitted`] applies it.
pub(super) fn stream_target(js: &jetstream::Context, want: stream::Config) -> Fitted {
    let (js, w) = (js.clone(), want.clone());
    Fitted {
        object: format!("stream {}", want.name),
        stream: want.name.clone(),
        what: want.name.clone(),
        max_bytes: want.max_bytes,
        drift: Box::new(move |c, bytes| {
            stream_drift(
                c,
                &stream::Config {
                    max_bytes: bytes,
                    ..want.clone()
                },
            )
        }),
        write: Box::new(move |cur, bytes| {
            let (js, cfg) = (
                js.clone(),
                stream::Config {
                    max_bytes: bytes,
                    ..w.clone()
                },
            );
            Box::pin(async move {
                match cur {
                    None => js.create_stream(cfg).await.map(drop).map_err(Into::into),
                    Some(_) => js.update_stream(cfg).await.map(drop).map_err(Into::into),
                }
            })
        }),
    }
}

/// A KV bucket, as [`apply_fitted`] applies it (checking compares its stream).
pub(super) fn bucket_target(js: &jetstream::Context, cfg: kv::Config) -> Fitted {
    let (js, w) = (js.clone(), cfg.clone());
    Fitted {
        object: format!("kv {}", cfg.bucket),
        stream: format!("KV_{}", cfg.bucket),
        what: cfg.bucket.clone(),
        max_bytes: cfg.max_bytes,
        drift: Box::new(move |c, bytes| {
            let mut d = stream_drift(
                c,
                &kv_stream_want(&kv::Config {
                    max_bytes: bytes,
                    ..cfg.clone()
                }),
            );
            // The bucket's own subjects and dedupe window are the client's business.
            d.retain(|(f, _, _)| {
                f != "subjects" && f != "dedupe_window" && f != "discard" && f != "max_msg_size"
            });
            d
        }),
        write: Box::new(move |_, bytes| {
            let (js, cfg) = (
                js.clone(),
                kv::Config {
                    max_bytes: bytes,
                    ..w.clone()
                },
            );
            Box::pin(async move {
                js.create_or_update_key_value(cfg)
                    .await
                    .map(drop)
                    .map_err(Into::into)
            })
        }),
    }
}

/// The artifacts' object store, as [`apply_fitted`] applies it: created, or
/// its bound brought to the wanted one.
pub(super) fn object_store_target(
    js: &jetstream::Context,
    l: &crate::Layout,
    o: &SetupOptions,
    bounds: &Bounds,
) -> Fitted {
    let bucket = l.artifacts_bucket();
    let (js, replicas, b) = (js.clone(), o.replicas, bucket.clone());
    Fitted {
        object: format!("object store {bucket}"),
        stream: format!("OBJ_{bucket}"),
        what: "artifacts".into(),
        max_bytes: bounds.get(Bound::Artifacts),
        drift: Box::new(|c, bytes| {
            if c.max_bytes == bytes {
                Vec::new()
            } else {
                vec![("max_bytes".into(), num(c.max_bytes), num(bytes))]
            }
        }),
        write: Box::new(move |cur, bytes| {
            let (js, bucket) = (js.clone(), b.clone());
            Box::pin(async move {
                match cur {
                    None => js
                        .create_object_store(object_store::Config {
                            bucket,
                            description: Some("leasehold artifacts (reports)".into()),
                            storage: stream::StorageType::File,
                            num_replicas: replicas,
                            max_bytes: bytes,
                            ..Default::default()
                        })
                        .await
                        .map(drop)
                        .map_err(Into::into),
                    // Only the bound changes: the rest is the object store's own.
                    Some(c) => js
                        .update_stream(stream::Config {
                            max_bytes: bytes,
                            ..c
                        })
                        .await
                        .map(drop)
                        .map_err(Into::into),
                }
            })
        }),
    }
}

/// The note of a default bound lowered to fit the server.
pub(super) fn fitted_note(got: i64, asked: i64) -> Option<String> {
    (got != asked).then(|| {
        format!(
            "max_bytes {} instead of the default {}: the server's JetStream storage limit (max_file_store) holds no more; raise it, or pass the bound explicitly",
            human_bytes(got),
            human_bytes(asked)
        )
    })
}

#[cfg(test)]
mod tests {
    use async_nats::jetstream::context::{CreateStreamError, CreateStreamErrorKind};

    use super::*;

    fn refused(code: u64) -> CreateStreamError {
        answered(code, "refused")
    }

    fn answered(code: u64, description: &str) -> CreateStreamError {
        let js: async_nats::jetstream::Error = serde_json::from_value(serde_json::json!({
            "code": 500, "err_code": code, "description": description
        }))
        .unwrap();
        CreateStreamError::new(CreateStreamErrorKind::JetStream(js))
    }

    #[test]
    fn a_write_nobody_answered_is_unavailable_and_a_refusal_is_not() {
        let e = setup_error(
            "LH_EVENTS",
            &CreateStreamError::new(CreateStreamErrorKind::TimedOut),
        );
        assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}");
        // Too little storage: what to change.
        let e = setup_error("LH_EVENTS", &refused(NO_ROOM));
        assert!(
            matches!(&e, StoreError::Config(m) if m.contains("max_file_store")),
            "{e:?}"
        );
        assert!(no_room(&refused(NO_ROOM)) && !no_room(&refused(10058)));
        // Any other refusal is the server's definite answer: not retried.
        let e = setup_error("LH_EVENTS", &refused(10058));
        assert!(matches!(e, StoreError::Nats { .. }), "{e:?}");
        assert!(e.to_string().starts_with("setup LH_EVENTS: "), "{e}");
        // A store the server could not create this time: asked again.
        let e = setup_error(
            "LH_EVENTS",
            &answered(10049, "error creating store for stream"),
        );
        assert!(
            matches!(&e, StoreError::Unavailable(m) if m.contains("its log says why")),
            "{e:?}"
        );
    }
}
