//! `fairness`: tenants sharing a busy fleet. Tenant A queues 2,000 sleep
//! jobs, then tenant B 20, equal weights, 4 workers of 4 slots: B's wait
//! from its submission to its claim, p50/p95, against B alone at half the
//! fleet (2 workers) and against the same submissions without tenants
//! (first come, first served: B waits behind all of A), each on a server
//! of its own in the same run.

use std::time::{Duration, SystemTime};

use leasehold_core::lane::Lane;
use leasehold_core::time::parse_rfc3339;
use leasehold_harness::Proc;
use leasehold_store::events::Events;
use leasehold_store::setup::SetupOptions;
use leasehold_store::work::Work;
use serde_json::{json, Value};

use crate::common::{pct, server, worker, Report};

const NOISY: usize = 2000;
const QUIET: usize = 20;
const SLEEP_MS: u64 = 50;

/// One run: `workers` workers; `noisy` jobs of tenant a (when `tenants`,
/// else of no tenant), then the quiet ones (tenant b). B's waits in ms.
async fn run(workers: usize, noisy: usize, tenants: bool) -> anyhow::Result<Vec<f64>> {
    let (srv, conn) = server(SetupOptions {
        kinds: vec!["sleep".into()],
        ..SetupOptions::default()
    })
    .await?;
    let env = [
        ("LH_KINDS", "sleep".to_string()),
        ("LH_CONCURRENCY", "4".into()),
        // The product's default pull lifetime.
        ("LH_PULL_EXPIRES", "1s".into()),
    ];
    let _w: Vec<Proc> = (0..workers).map(|_| worker(&srv.url(), &env)).collect();
    let work = Work::new(&conn);
    let lane = |t: &str| {
        if tenants {
            Lane::from_tokens(t, "3").expect("valid")
        } else {
            Lane::default()
        }
    };
    let spec = |t: &str| {
        let mut s = json!({"input": {"ms": SLEEP_MS}});
        if tenants {
            s["tenant"] = json!(t);
        }
        s.to_string()
    };
    let (a, b) = (lane("a"), lane("b"));
    for i in 0..noisy {
        work.submit_in_lane(
            "sleep",
            &a,
            spec("a").into(),
            Some(&format!("a-{i}")),
            None,
            None,
        )
        .await?;
    }
    let mut submitted = Vec::new();
    for i in 0..QUIET {
        let id = format!("b-{i}");
        submitted.push((id.clone(), SystemTime::now()));
        work.submit_in_lane("sleep", &b, spec("b").into(), Some(&id), None, None)
            .await?;
    }
    let events = Events::new(&conn);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    let mut waits = Vec::new();
    for (id, at) in submitted {
        let claimed = loop {
            let evs = events.read_types(&id, &["claimed"]).await?;
            if let Some((_, e)) = evs.first() {
                break parse_rfc3339(&e.at)
                    .ok_or_else(|| anyhow::anyhow!("{id}: bad event time {}", e.at))?;
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "{id} was not claimed within 300 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        waits.push(
            claimed
                .duration_since(at)
                .unwrap_or(Duration::ZERO)
                .as_secs_f64()
                * 1000.0,
        );
    }
    Ok(waits)
}

pub async fn fairness() -> anyhow::Result<Value> {
    let contended = run(4, NOISY, true).await?;
    let alone = run(2, 0, true).await?;
    let fifo = run(4, NOISY, false).await?;
    let sum =
        |w: &[f64]| json!({"p50_ms": pct(w, 0.5), "p95_ms": pct(w, 0.95), "max_ms": pct(w, 1.0)});
    let ratio = pct(&contended, 0.95) / pct(&alone, 0.95);
    Ok(json!({
        "noisy_jobs": NOISY,
        "quiet_jobs": QUIET,
        "sleep_ms": SLEEP_MS,
        "workers": 4,
        "slots_per_worker": 4,
        "quiet_wait_contended": sum(&contended),
        "quiet_wait_alone_half_fleet": sum(&alone),
        "quiet_wait_without_tenants": sum(&fifo),
        "p95_ratio": ratio,
        "met": ratio <= 2.0,
    }))
}

pub fn rows(r: &mut Report, v: &Value) {
    let f = |k: &str, q: &str| v[k][q].as_f64().unwrap_or(f64::NAN);
    r.cmp(
        "fairness: tenant B's 20 jobs behind tenant A's 2,000, wait to claim p50/p95 ms (4 workers)",
        format!(
            "{:.0}/{:.0} (first come first served: {:.0}/{:.0})",
            f("quiet_wait_contended", "p50_ms"),
            f("quiet_wait_contended", "p95_ms"),
            f("quiet_wait_without_tenants", "p50_ms"),
            f("quiet_wait_without_tenants", "p95_ms")
        ),
        format!(
            "B alone at half the fleet {:.0}/{:.0}",
            f("quiet_wait_alone_half_fleet", "p50_ms"),
            f("quiet_wait_alone_half_fleet", "p95_ms")
        ),
        "p95 <= 2x alone",
        v["met"].as_bool(),
    );
}
