//! Safe deploys (`Worker::journal_check`, `--journal-check KIND`): the
//! recorded journals of a kind's active jobs replayed against a changed
//! build, writing nothing, list the jobs it would park and why.

use std::time::Duration;

use leasehold::{async_trait, Ctx, Error, JournalVerdict, Kind};
use leasehold_testkit::Fleet;
use serde_json::{json, Value};

/// Two steps, then a park for a person: what every build of `booking`
/// below records before it waits.
struct Booking {
    /// The name of its second step in this build.
    second: &'static str,
}

#[async_trait]
impl Kind for Booking {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let a: u64 = ctx.step("lookup", || async { Ok(1) }).await?;
        let b: u64 = ctx.step(self.second, || async { Ok(2) }).await?;
        let answer = ctx.park("approval", "book it?").await?;
        Ok(json!({"sum": a + b, "answer": answer}))
    }
}

fn build(env: &Fleet, second: &'static str) -> leasehold::Worker {
    let mut o = env.opts();
    o.kinds = vec!["booking".into()];
    leasehold::Worker::new(o).kind("booking", Booking { second })
}

#[tokio::test]
async fn a_journal_check_names_the_jobs_a_changed_build_would_park_and_writes_nothing() {
    let env = Fleet::with_kind("booking").await;
    let stop = tokio_util::sync::CancellationToken::new();
    let w = build(&env, "price").start(stop.clone()).await.unwrap();
    for id in ["book-1", "book-2"] {
        env.submit("booking", json!({"input": {}}), id).await;
        env.wait_status(id, "parked", Duration::from_secs(20)).await;
    }
    stop.cancel();
    w.wait().await.unwrap();
    let revisions = || async {
        let mut v = Vec::new();
        for id in ["book-1", "book-2"] {
            let r = env.jobs.get(id).await.unwrap().unwrap().revision;
            v.push((r, env.events_of(id).await.len()));
        }
        v
    };
    let before = revisions().await;

    // The same code: both journals match; each would ask its person next.
    let same = build(&env, "price").journal_check("booking").await.unwrap();
    assert_eq!(same.len(), 2, "{same:?}");
    for c in &same {
        assert_eq!(c.verdict, JournalVerdict::Matches, "{c:?}");
        assert_eq!(c.next.as_deref(), Some("park#0"), "{c:?}");
        assert_eq!((c.steps, c.status.as_str()), (2, "parked"));
    }
    // A build whose second step is named otherwise: both would park.
    let changed = build(&env, "quote").journal_check("booking").await.unwrap();
    assert_eq!(changed.len(), 2, "{changed:?}");
    for c in &changed {
        assert_eq!(c.verdict, JournalVerdict::Mismatch, "{c:?}");
        let why = c.why.as_deref().unwrap();
        assert!(why.contains("price#0") && why.contains("quote#0"), "{why}");
    }
    // A kind the build does not have is a clear error.
    let e = build(&env, "price")
        .journal_check("nosuch")
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("no kind `nosuch`"), "{e}");
    assert_eq!(revisions().await, before, "nothing written");
}
