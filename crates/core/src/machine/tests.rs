//! The transitions' unit tests.

use super::*;

fn t(s: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + s)
}

fn claimant<'a>(worker: &'a str, token: &str, now: SystemTime) -> Claimant<'a> {
    Claimant {
        worker_id: worker,
        session: "s1",
        claim_token: token.into(),
        attempt_timeout: Duration::from_secs(100),
        skew: Duration::from_secs(2),
        now,
        ticket_seq: 1,
        max_stale_reclaims: 3,
        owner: OwnerLiveness::Live,
        deliveries: 1,
        signalled: false,
    }
}

fn fresh() -> JobRecord {
    new_record("j", "echo", JobSpec::default(), 1, t(0))
}

fn claim(rec: &JobRecord, c: &Claimant<'_>) -> JobRecord {
    match decide_claim(rec, c) {
        ClaimDecision::Claim { record, .. } => *record,
        other => panic!("expected a claim, got {other:?}"),
    }
}

#[test]
fn every_claim_bumps_epoch_and_mints_a_token() {
    let a = claim(&fresh(), &claimant("w", "t1", t(0)));
    assert_eq!((a.epoch, a.status.as_str()), (1, "running"));
    assert_eq!(a.session.as_deref(), Some("s1"));
    // The same worker reclaiming its own job after its session ended
    // fences its older task.
    let mut c = claimant("w", "t2", t(11));
    c.owner = OwnerLiveness::Dead;
    let b = claim(&a, &c);
    assert_eq!((b.epoch, b.stale_reclaims), (2, 1));
    let old = Owner {
        worker_id: "w".into(),
        claim_token: "t1".into(),
        epoch: 1,
    };
    assert!(matches!(
        touch(&b, &old, t(12)),
        Err(TransitionError::OwnershipLost(_))
    ));
    assert!(touch(&b, &Owner::of(&b).unwrap(), t(12)).is_ok());
}

#[test]
fn cancel_is_final_through_park_failure_effects_and_a_dead_owner() {
    let mut a = claim(&fresh(), &claimant("a", "t1", t(0)));
    a.cancel_requested = true;
    let o = Owner::of(&a).unwrap();
    assert!(matches!(
        touch(&a, &o, t(1)),
        Err(TransitionError::NotAllowed {
            action: "a write effect",
            ..
        })
    ));
    assert_eq!(
        park(&a, &o, t(1), "uncertain_effect", "m").unwrap().status,
        "cancelled"
    );
    let e = JobError {
        class: "terminal".into(),
        message: "m".into(),
        at: rfc3339(t(1)),
    };
    let f = fail(&a, &o, t(1), e).unwrap();
    assert_eq!((f.status.as_str(), f.attempts), ("cancelled", 1));
    // A poison-level job whose owner died: the claim cancels it, as
    // recovery does, instead of dead-lettering it.
    a.stale_reclaims = 9;
    let mut c = claimant("b", "t2", t(2));
    c.owner = OwnerLiveness::Dead;
    assert!(matches!(decide_claim(&a, &c), ClaimDecision::Cancel(_)));
    assert!(matches!(
        reoffer_if(&a, "a", None, None, t(2), 0, 3),
        Reoffer::Cancelled(_)
    ));
}

#[test]
fn a_newer_ticket_of_a_requeueable_job_waits_for_the_requeue_then_goes() {
    let mut dead = fresh();
    dead.status = "dead".into();
    let mut c = claimant("b", "t2", t(4));
    c.ticket_seq = 7;
    assert_eq!(
        decide_claim(&dead, &c),
        ClaimDecision::Wait(NEWER_TICKET_WAIT)
    );
    c.deliveries = NEWER_TICKET_PATIENCE;
    assert!(matches!(decide_claim(&dead, &c), ClaimDecision::Drop(_)));
    // The record's own ticket, or an older one, goes at once; so does
    // any ticket of a completed job (a duplicate submission).
    c.deliveries = 1;
    c.ticket_seq = 1;
    assert!(matches!(decide_claim(&dead, &c), ClaimDecision::Drop(_)));
    let mut done = fresh();
    done.status = "completed".into();
    c.ticket_seq = 7;
    assert!(matches!(decide_claim(&done, &c), ClaimDecision::Drop(_)));
}

#[test]
fn a_live_owner_keeps_its_job_and_the_ticket_is_settled_not_nacked() {
    let a = claim(&fresh(), &claimant("a", "t1", t(0)));
    assert!(matches!(
        decide_claim(&a, &claimant("b", "t2", t(4))),
        ClaimDecision::Settle(_)
    ));
    // Unknown liveness waits; a dead owner's job is reclaimed at once,
    // whatever its attempt deadline says.
    let mut c = claimant("b", "t2", t(4));
    c.owner = OwnerLiveness::Unknown;
    assert!(matches!(decide_claim(&a, &c), ClaimDecision::Wait(_)));
    c.owner = OwnerLiveness::Dead;
    assert!(matches!(
        decide_claim(&a, &c),
        ClaimDecision::Claim { reclaim: true, .. }
    ));
}

#[test]
fn a_newer_ticket_of_a_live_job_waits_for_the_requeue_it_may_precede() {
    let a = claim(&fresh(), &claimant("a", "t1", t(0)));
    let mut c = claimant("b", "t2", t(1));
    c.ticket_seq = 9;
    assert_eq!(decide_claim(&a, &c), ClaimDecision::Wait(NEWER_TICKET_WAIT));
    // A duplicate that keeps coming back is settled, not NAKed for ever.
    c.deliveries = NEWER_TICKET_PATIENCE;
    assert!(matches!(decide_claim(&a, &c), ClaimDecision::Settle(_)));
}

#[test]
fn the_attempt_deadline_is_trusted_only_past_the_skew_allowance() {
    let a = claim(&fresh(), &claimant("a", "t1", t(0)));
    // Deadline t(100); skew 2 s: at t(101) the claim still stands.
    assert!(matches!(
        decide_claim(&a, &claimant("b", "t2", t(101))),
        ClaimDecision::Settle(_)
    ));
    assert!(!deadline_passed(&a, t(102), Duration::from_secs(2)));
    assert!(matches!(
        decide_claim(&a, &claimant("b", "t2", t(103))),
        ClaimDecision::Claim { reclaim: true, .. }
    ));
}

#[test]
fn a_ticket_far_ahead_of_its_due_time_is_released_not_held() {
    let a = claim(&fresh(), &claimant("a", "t1", t(0)));
    let owner = Owner::of(&a).unwrap();
    let q = requeue(
        &a,
        &owner,
        t(5),
        JobError::default(),
        Duration::from_secs(600),
    )
    .unwrap();
    assert_eq!(
        decide_claim(&q, &claimant("b", "t2", t(6))),
        ClaimDecision::Release
    );
    // Within the hold, the ticket waits out the rest itself.
    let left = HOLD_TICKET_AT_MOST.as_secs();
    assert_eq!(
        decide_claim(&q, &claimant("b", "t2", t(605 - left))),
        ClaimDecision::Wait(HOLD_TICKET_AT_MOST)
    );
}

#[test]
fn future_run_time_waits_exactly_the_remaining_time() {
    let a = claim(&fresh(), &claimant("a", "t1", t(0)));
    let owner = Owner::of(&a).unwrap();
    let q = requeue(
        &a,
        &owner,
        t(5),
        JobError::default(),
        Duration::from_secs(30),
    )
    .unwrap();
    assert_eq!((q.attempts, q.session.as_deref()), (1, None));
    assert_eq!(
        decide_claim(&q, &claimant("b", "t2", t(32))),
        ClaimDecision::Wait(Duration::from_secs(3))
    );
    let c = claim(&q, &claimant("b", "t2", t(35)));
    assert_eq!((c.epoch, c.stale_reclaims), (2, 0));
}

#[test]
fn terminal_parked_and_superseded_tickets_are_dropped() {
    let a = claim(&fresh(), &claimant("a", "t1", t(0)));
    let done = complete(&a, &Owner::of(&a).unwrap(), t(1), Default::default()).unwrap();
    assert!(matches!(
        decide_claim(&done, &claimant("b", "t", t(2))),
        ClaimDecision::Drop(_)
    ));
    let mut newer = fresh();
    newer.ticket_seq = 5;
    let mut c = claimant("b", "t", t(2));
    c.ticket_seq = 3;
    assert!(matches!(decide_claim(&newer, &c), ClaimDecision::Drop(m) if m.contains("superseded")));
    // A later ticket of the same job is adopted.
    c.ticket_seq = 9;
    assert_eq!(claim(&newer, &c).ticket_seq, 9);
}

#[test]
fn poison_after_the_stale_reclaim_limit() {
    let mut r = claim(&fresh(), &claimant("a", "t1", t(0)));
    for i in 0..3 {
        let mut c = claimant("b", &format!("x{i}"), t(10 * (i + 1)));
        c.owner = OwnerLiveness::Dead;
        r = claim(&r, &c);
    }
    assert_eq!(r.stale_reclaims, 3);
    let mut c = claimant("c", "y", t(1000));
    c.owner = OwnerLiveness::Dead;
    assert!(matches!(decide_claim(&r, &c), ClaimDecision::Poison(_)));
    assert_eq!(reoffer(&r, "b", None, t(1000), 9, 3), Reoffer::Poison);
}

#[test]
fn reoffer_fences_the_dead_owner_and_queues_the_job() {
    let a = claim(&fresh(), &claimant("a", "t1", t(0)));
    assert!(matches!(
        reoffer(&a, "a", Some("s1"), t(1), 7, 3),
        Reoffer::Nothing(_)
    ));
    assert!(matches!(
        reoffer(&a, "b", None, t(1), 7, 3),
        Reoffer::Nothing(_)
    ));
    // The identity restarted: a new session of "a" does not keep s1's job.
    let Reoffer::Queued(q) = reoffer(&a, "a", Some("s2"), t(1), 7, 3) else {
        panic!("expected a re-offer")
    };
    assert_eq!(
        (q.status.as_str(), q.stale_reclaims, q.ticket_seq, q.epoch),
        ("queued", 1, 7, 1)
    );
    assert!(touch(&q, &Owner::of(&a).unwrap(), t(2)).is_err());
    // The old ticket is superseded by the re-offer's; the new one claims.
    assert!(matches!(
        decide_claim(&q, &claimant("b", "t2", t(2))),
        ClaimDecision::Drop(_)
    ));
    let mut c = claimant("b", "t2", t(2));
    c.ticket_seq = 7;
    assert_eq!(claim(&q, &c).epoch, 2);
}

#[test]
fn cancellation_queued_running_terminal() {
    let q = fresh();
    assert!(
        matches!(request_cancel(&q, t(1)).unwrap(), CancelOutcome::Cancelled(r) if r.status == "cancelled")
    );
    let a = claim(&q, &claimant("a", "t1", t(0)));
    let CancelOutcome::Requested(r) = request_cancel(&a, t(1)).unwrap() else {
        panic!()
    };
    assert!(r.cancel_requested);
    assert_eq!(
        request_cancel(&r, t(1)).unwrap(),
        CancelOutcome::AlreadyRequested
    );
    // The owner is still the owner after a cancel request.
    let c = cancel_owned(&r, &Owner::of(&a).unwrap(), t(2)).unwrap();
    assert_eq!(c.status, "cancelled");
    assert!(matches!(
        request_cancel(&c, t(3)).unwrap(),
        CancelOutcome::Unchanged(_)
    ));
}

#[test]
fn a_cancel_request_survives_requeue_hand_back_reclaim_and_reoffer() {
    let a = claim(&fresh(), &claimant("a", "t1", t(0)));
    let CancelOutcome::Requested(r) = request_cancel(&a, t(1)).unwrap() else {
        panic!()
    };
    let owner = Owner::of(&a).unwrap();
    let e = JobError::default();
    let rq = requeue(&r, &owner, t(2), e, Duration::from_secs(1)).unwrap();
    assert_eq!((rq.status.as_str(), rq.attempts), ("cancelled", 1));
    assert_eq!(hand_back(&r, &owner, t(2)).unwrap().status, "cancelled");
    let mut c = claimant("b", "t2", t(3));
    c.owner = OwnerLiveness::Dead;
    assert!(matches!(decide_claim(&r, &c), ClaimDecision::Cancel(x) if x.status == "cancelled"));
    assert!(matches!(
        reoffer(&r, "a", None, t(3), 2, 3),
        Reoffer::Cancelled(_)
    ));
    // A queued job with a pending request (set by an older binary, or
    // racing a requeue) is cancelled by the claim instead of running.
    let mut q = fresh();
    q.cancel_requested = true;
    assert!(matches!(
        decide_claim(&q, &claimant("b", "t", t(1))),
        ClaimDecision::Cancel(_)
    ));
}

#[test]
fn only_the_owner_can_end_a_job() {
    let a = claim(&fresh(), &claimant("a", "t1", t(0)));
    let stranger = Owner {
        worker_id: "b".into(),
        claim_token: "t1".into(),
        epoch: 1,
    };
    assert!(complete(&a, &stranger, t(1), Default::default()).is_err());
    assert!(fail(&a, &stranger, t(1), JobError::default()).is_err());
    assert!(park(&a, &stranger, t(1), "loop", "x").is_err());
    assert!(hand_back(&a, &stranger, t(1)).is_err());
}

#[test]
fn transient_retries_back_off_with_deliveries_up_to_five_seconds() {
    let d: Vec<u64> = (1..=6)
        .map(|n| transient_retry_delay(n).as_secs())
        .collect();
    assert_eq!(d, vec![1, 2, 4, 5, 5, 5]);
    assert_eq!(transient_retry_delay(0), Duration::from_secs(1));
}

#[test]
fn a_waiting_jobs_ticket_writes_its_wake_up_before_its_time_and_claims_it_after() {
    let a = claim(&fresh(), &claimant("a", "t1", t(0)));
    let owner = Owner::of(&a).unwrap();
    let w = wait(&a, &owner, t(5), &Wait::time("sleep#0", t(600))).unwrap();
    // The owner's kept ticket, before the time: released to the wake-up.
    assert_eq!(
        decide_claim(&w, &claimant("b", "t2", t(6))),
        ClaimDecision::Release
    );
    // At its time, a ticket (its waker's, published before the record
    // names it) is claimed at once, naming that ticket; never released
    // (acked) while the waker is about to point the record at it.
    let mut c = claimant("b", "t2", t(600));
    c.ticket_seq = 77;
    let r = claim(&w, &c);
    assert_eq!(
        (r.status.as_str(), r.ticket_seq, r.epoch),
        ("running", 77, 2)
    );
    assert_eq!(r.waiting_for, None);
    assert_eq!(
        r.waiting_step.as_deref(),
        Some("sleep#0"),
        "the step reads its wait"
    );
}

#[test]
fn a_signal_waits_ticket_is_released_until_its_signal_and_claimed_once_it_came() {
    let a = claim(&fresh(), &claimant("a", "t1", t(0)));
    let owner = Owner::of(&a).unwrap();
    let w = wait(
        &a,
        &owner,
        t(5),
        &Wait::for_signal("wait:go#0", "go", 3, None),
    )
    .unwrap();
    // No signal: released, however late (no time wakes it).
    assert_eq!(
        decide_claim(&w, &claimant("b", "t2", t(1_000_000))),
        ClaimDecision::Release
    );
    // Its signal came (found by the claimer): claimed on this ticket.
    let mut c = claimant("b", "t2", t(6));
    c.signalled = true;
    let r = claim(&w, &c);
    assert_eq!((r.status.as_str(), r.epoch), ("running", 2));
    assert_eq!(r.waiting_step.as_deref(), Some("wait:go#0"));
    // With a timeout: its time claims it without a signal.
    let w = wait(
        &a,
        &owner,
        t(5),
        &Wait::for_signal("wait:go#0", "go", 3, Some(t(60))),
    )
    .unwrap();
    assert_eq!(
        decide_claim(&w, &claimant("b", "t2", t(30))),
        ClaimDecision::Release
    );
    let r = claim(&w, &claimant("b", "t2", t(60)));
    assert_eq!(r.status.as_str(), "running");
}
