//! Tests of the flow control: limits, pauses and slots, slices below one
//! request a second, local shares, and the concurrency learned from cuts.

use std::sync::Arc;

use super::*;

#[tokio::test]
async fn limits_pauses_and_slots() {
    let f = Arc::new(Flow::new());
    let k = ProviderKey::new("http://x/v1/", "m", Some("sk-secret"));
    assert!(!format!("{k:?}").contains("sk-secret"));
    assert_eq!(k, ProviderKey::new("http://x/v1", "m", Some("sk-secret")));
    assert_ne!(k.id, ProviderKey::new("http://x/v1", "m", Some("other")).id);
    // No limits: everything goes.
    let p = (0..50)
        .map(|_| f.try_admit(&k, 100).ok().unwrap())
        .collect::<Vec<_>>();
    drop(p);
    f.set_limits(
        &k.id,
        Some(Limits {
            rpm: None,
            tpm: None,
            concurrency: Some(2),
        }),
    );
    let a = f.try_admit(&k, 1).ok().unwrap();
    let _b = f.try_admit(&k, 1).ok().unwrap();
    assert!(matches!(
        f.try_admit(&k, 1),
        Err(Wait::Limited {
            limit: "concurrency",
            ..
        })
    ));
    drop(a);
    assert!(f.try_admit(&k, 1).is_ok());
    // A cooldown pauses everything until it ends.
    f.cooldown(&k, SystemTime::now() + Duration::from_secs(30), "429");
    assert!(matches!(f.try_admit(&k, 1), Err(Wait::Paused { .. })));
    f.set_limits(&k.id, None);
}

/// Below one request a second nothing is held in hand: off the grid
/// the requests are `1 / slice` apart; on it, one per own slot.
#[tokio::test(start_paused = true)]
async fn a_slice_below_one_request_a_second_holds_no_request_in_hand() {
    let f = Arc::new(Flow::new());
    let _rx = f.outbound();
    let k = ProviderKey::new("http://z/v1", "m", None);
    f.set_limits(
        &k.id,
        Some(Limits {
            rpm: Some(120),
            tpm: None,
            concurrency: None,
        }),
    );
    f.ensure(&k);
    let half = Slice {
        requests_per_sec: 0.5,
        tokens_per_sec: f64::INFINITY,
        concurrency: u64::MAX,
    };
    f.set_slice(
        &k.id,
        half,
        Instant::now() + Duration::from_secs(60),
        4,
        None,
    );
    assert!(f.try_admit(&k, 1).is_ok());
    let Err(Wait::Limited { retry, .. }) = f.try_admit(&k, 1) else {
        panic!("a second request at once: a burst")
    };
    let gap = retry - Instant::now();
    assert!(gap >= Duration::from_millis(1990), "{gap:?}");
    tokio::time::advance(Duration::from_millis(1900)).await;
    assert!(f.try_admit(&k, 1).is_err());
    tokio::time::advance(Duration::from_millis(150)).await;
    assert!(f.try_admit(&k, 1).is_ok());
    // On the grid: one request in an own slot, the next in a later one.
    let grid = Grid {
        rate: 2.0,
        offset: 0.0,
        share: 0.25,
    };
    f.set_slice(
        &k.id,
        half,
        Instant::now() + Duration::from_secs(60),
        4,
        Some(grid),
    );
    let mut sent = None;
    for _ in 0..40 {
        match f.try_admit(&k, 1) {
            Ok(p) => {
                sent = Some(p);
                break;
            }
            Err(Wait::Limited { retry, .. }) => {
                // The wall clock runs on: wait for the slot for real.
                let left = retry - Instant::now();
                assert!(left <= Duration::from_secs(30), "{left:?}");
                std::thread::sleep(left.min(Duration::from_millis(600)));
            }
            Err(w) => panic!("{w:?}"),
        }
    }
    assert!(sent.is_some(), "an own slot came");
    assert!(f.try_admit(&k, 1).is_err(), "one request per slot");
}

/// A worker that never got a lease and never read the record waits
/// past the grace: it never takes the whole limit; once it knows of
/// two workers, half.
#[tokio::test(start_paused = true)]
async fn without_a_lease_a_worker_never_takes_the_whole_limit() {
    let f = Arc::new(Flow::new());
    let _rx = f.outbound();
    let k = ProviderKey::new("http://w/v1", "m", None);
    f.set_limits(
        &k.id,
        Some(Limits {
            rpm: None,
            tpm: None,
            concurrency: Some(4),
        }),
    );
    f.ensure(&k);
    tokio::time::advance(FIRST_LEASE_GRACE + Duration::from_millis(1)).await;
    assert!(
        f.try_admit(&k, 1).is_err(),
        "no renewal failed: it waits for its grant"
    );
    f.lease_failed(&k.id, None);
    assert!(f.try_admit(&k, 1).is_err(), "no worker known: it waits");
    f.lease_failed(&k.id, Some(2));
    let p: Vec<_> = (0..2).map(|_| f.try_admit(&k, 1).ok().unwrap()).collect();
    assert!(f.try_admit(&k, 1).is_err(), "half of 4");
    drop(p);
}

/// Two workers under a limit of one, each with a lease it gave back
/// while idle, long ago: neither takes the one on a share nobody
/// granted (each "at least 1" of 1 / 2 would be two at once). Only a
/// renewal that did not land (NATS away) lets the local share apply.
#[tokio::test(start_paused = true)]
async fn a_lease_given_back_while_idle_waits_for_the_next_grant() {
    let limit = Limits {
        rpm: None,
        tpm: None,
        concurrency: Some(1),
    };
    let k = ProviderKey {
        id: tenant_jobs_key("capped"),
        info: ProviderInfo::default(),
    };
    let workers: Vec<(Arc<Flow>, _)> = (0..2)
        .map(|_| {
            let f = Arc::new(Flow::new());
            let rx = f.outbound();
            f.set_limits(&k.id, Some(limit));
            f.ensure(&k);
            // Granted nothing (the other held the one), then given back
            // idle: the record said two workers.
            f.set_slice(
                &k.id,
                Slice::default(),
                Instant::now() + Duration::from_millis(2800),
                2,
                None,
            );
            (f, rx)
        })
        .collect();
    tokio::time::advance(Duration::from_secs(10)).await;
    for (f, _) in &workers {
        assert!(
            matches!(
                f.try_admit(&k, 0),
                Err(Wait::Limited {
                    limit: "concurrency",
                    ..
                })
            ),
            "a lease given back is no share"
        );
        assert!(f.demand(&k.id).active, "its wait asks for a lease");
    }
    // NATS away from one: its renewal fails, and its local share (1 of 1
    // over 2 workers, rounded up to one slot) applies.
    workers[0].0.lease_failed(&k.id, Some(2));
    assert!(workers[0].0.try_admit(&k, 0).is_ok());
    assert!(workers[1].0.try_admit(&k, 0).is_err());
    // A grant that lands ends the local share.
    workers[0].0.set_slice(
        &k.id,
        Slice::default(),
        Instant::now() + Duration::from_millis(2800),
        2,
        None,
    );
    assert!(workers[0].0.try_admit(&k, 0).is_err());
}

#[test]
fn a_cut_while_another_request_waits_is_the_sign_of_one_at_a_time() {
    let t0 = Instant::now();
    let at = |ms: u64| Some(t0 + Duration::from_millis(ms));
    let open = |v: &[(u64, Option<Instant>)]| v.iter().copied().collect::<BTreeMap<_, _>>();
    // The cut stream's last chunk came at 1000 ms.
    let last = t0 + Duration::from_millis(1000);
    // Cut while another request had no first token: the sign, whichever
    // was sent first (the newcomer may have been sent before, and
    // reached the server after).
    assert_eq!(
        sign(&open(&[(1, at(1)), (2, None)]), 1, true, false, last),
        Sign::Cut
    );
    assert_eq!(
        sign(&open(&[(0, None), (1, at(1))]), 1, true, false, last),
        Sign::Cut
    );
    // ... or had it after the cut, or read just before it (this
    // process reads the two streams in its own order).
    assert_eq!(
        sign(&open(&[(1, at(1)), (2, at(1010))]), 1, true, false, last),
        Sign::Cut
    );
    assert_eq!(
        sign(&open(&[(1, at(1)), (2, at(900))]), 1, true, false, last),
        Sign::Cut
    );
    // Cut while the other generated long before: the provider serves
    // both, this cut is something else; alone: nothing to say.
    assert_eq!(
        sign(&open(&[(1, at(1)), (2, at(100))]), 1, true, false, last),
        Sign::Nothing
    );
    assert_eq!(
        sign(&open(&[(1, at(1))]), 1, true, false, last),
        Sign::Nothing
    );
    // Completed while another generated long before its last chunk: two
    // at once.
    assert_eq!(
        sign(&open(&[(0, at(100)), (1, at(1))]), 1, false, true, last),
        Sign::Parallel
    );
    // Completed while another waits, or starts about when it ends (a
    // server that queues): nothing.
    assert_eq!(
        sign(&open(&[(1, at(1)), (2, None)]), 1, false, true, last),
        Sign::Nothing
    );
    assert_eq!(
        sign(&open(&[(1, at(1)), (2, at(900))]), 1, false, true, last),
        Sign::Nothing
    );
    // Failed otherwise: nothing.
    assert_eq!(
        sign(&open(&[(0, at(100)), (1, at(1))]), 1, false, false, last),
        Sign::Nothing
    );
}

/// A millisecond of the (paused) clock.
async fn tick() {
    tokio::time::advance(Duration::from_millis(1)).await;
}

fn now() -> Option<Instant> {
    Some(Instant::now())
}

/// Three experts on a server that cuts the stream in flight for a
/// newcomer: A is cut for B, then B for A's retry; the second cut
/// learns a concurrency of 1, applied here and sent for the fleet; C,
/// sent before it applied, is cut too: known, nothing new.
#[tokio::test(start_paused = true)]
async fn a_repeated_cut_learns_a_concurrency_of_one() {
    let f = Arc::new(Flow::new());
    let mut rx = f.outbound();
    let k = ProviderKey::new("http://one/v1", "m", None);
    let a = f.try_admit(&k, 1).ok().unwrap();
    a.first_token();
    tick().await;
    let b = f.try_admit(&k, 1).ok().unwrap();
    let c = f.try_admit(&k, 1).ok().unwrap();
    tick().await;
    assert_eq!(a.ended(true, false, now()), Serving::Cut { seen: 1 });
    drop(a);
    tick().await;
    b.first_token();
    let a2 = f.try_admit(&k, 1).ok().unwrap();
    tick().await;
    assert_eq!(b.ended(true, false, now()), Serving::Learned);
    drop(b);
    tick().await;
    c.first_token();
    tick().await;
    assert_eq!(c.ended(true, false, now()), Serving::Known);
    drop(c);
    assert_eq!(f.limits(&k.id).unwrap().concurrency, Some(1));
    assert_eq!(f.learned(&k.id).unwrap().concurrency, 1);
    match rx.try_recv() {
        Ok(Outbound::Learned {
            key,
            concurrency,
            reason,
        }) => {
            assert_eq!((key.id, concurrency), (k.id.clone(), 1));
            assert!(reason.contains("one request at a time"), "{reason}");
        }
        o => panic!("{o:?}"),
    }
    assert!(rx.try_recv().is_err(), "learned once");
    // One at a time from now on (and until its lease, none).
    assert!(f.try_admit(&k, 1).is_err());
    drop(a2);
    // Cleared for the fleet: gone here too.
    f.set_learned(&k.id, None);
    assert_eq!(f.limits(&k.id), None);
    assert!(f.try_admit(&k, 1).is_ok());
}

/// Two at once in between resets the count: two unrelated cuts of a
/// server that serves in parallel learn nothing. A concurrency set by
/// hand is never moved by a cut, and says which setting holds it.
#[tokio::test(start_paused = true)]
async fn a_parallel_answer_resets_the_count_and_a_hand_set_concurrency_wins() {
    let f = Arc::new(Flow::new());
    let k = ProviderKey::new("http://two/v1", "m", None);
    let a = f.try_admit(&k, 1).ok().unwrap();
    let b = f.try_admit(&k, 1).ok().unwrap();
    tick().await;
    assert_eq!(a.ended(true, false, now()), Serving::Cut { seen: 1 });
    drop(a);
    let c = f.try_admit(&k, 1).ok().unwrap();
    b.first_token();
    c.first_token();
    // Both generate for a while.
    tokio::time::advance(READ_SKEW * 2).await;
    assert_eq!(
        b.ended(false, true, now()),
        Serving::Nothing,
        "both generated"
    );
    drop(b);
    let d = f.try_admit(&k, 1).ok().unwrap();
    tick().await;
    assert_eq!(
        c.ended(true, false, now()),
        Serving::Cut { seen: 1 },
        "counted afresh"
    );
    drop(c);
    assert_eq!(f.limits(&k.id), None);
    // LH_MODEL_CONCURRENCY=4: a cut is not learned from.
    f.configure(&k, Some(4));
    assert_eq!(f.limits(&k.id).unwrap().concurrency, Some(4));
    let e = f.try_admit(&k, 1).ok().unwrap();
    tick().await;
    assert_eq!(
        d.ended(true, false, now()),
        Serving::SetByHand {
            concurrency: 4,
            setting: "LH_MODEL_CONCURRENCY"
        }
    );
    drop((d, e));
    // A fleet-wide limit wins over both.
    f.set_limits(
        &k.id,
        Some(Limits {
            rpm: Some(60),
            tpm: None,
            concurrency: Some(2),
        }),
    );
    assert_eq!(f.concurrency(&k.id), Some((2, ConcurrencySource::Set)));
    f.configure(&k, None);
    f.set_limits(&k.id, None);
    assert_eq!(f.limits(&k.id), None);
}

#[tokio::test]
async fn a_lapsed_lease_falls_back_to_a_local_share() {
    let f = Arc::new(Flow::new());
    let _rx = f.outbound();
    let k = ProviderKey::new("http://y/v1", "m", None);
    f.set_limits(
        &k.id,
        Some(Limits {
            rpm: None,
            tpm: None,
            concurrency: Some(8),
        }),
    );
    f.ensure(&k);
    let full = Slice {
        requests_per_sec: f64::INFINITY,
        tokens_per_sec: f64::INFINITY,
        concurrency: 8,
    };
    // Granted all 8, then the lease lapses with 4 workers known while its
    // renewal fails: 2.
    f.set_slice(
        &k.id,
        full,
        Instant::now() - Duration::from_millis(1),
        4,
        None,
    );
    assert!(
        f.try_admit(&k, 1).is_err(),
        "lapsed while renewals land: it waits for the grant"
    );
    f.lease_failed(&k.id, None);
    let p: Vec<_> = (0..2).map(|_| f.try_admit(&k, 1).ok().unwrap()).collect();
    assert!(f.try_admit(&k, 1).is_err(), "not unlimited without NATS");
    drop(p);
    f.set_local_fraction(Some(0.5));
    let p: Vec<_> = (0..4).map(|_| f.try_admit(&k, 1).ok().unwrap()).collect();
    assert!(f.try_admit(&k, 1).is_err());
    drop(p);
}
