//! A stop always ends (issue 38): a worker running a job and a reaper,
//! SIGTERMed while their nats-server is down (connections fail) or paused
//! (SIGSTOP: connections hang), exit within their documented bound
//! (docs/reference.md, "Stopping"); the worker says which job it could not
//! hand back, and once NATS is back that job completes exactly once.

use std::time::{Duration, Instant};

use leasehold_harness::Proc;
use serde_json::json;

use leasehold_testkit::{wait_log, Fleet};

const DRAIN: Duration = Duration::from_millis(500);
const HAND_BACK: Duration = Duration::from_secs(2);
const REAPER_DRAIN: Duration = Duration::from_secs(1);

#[derive(Clone, Copy, Debug)]
enum Outage {
    /// SIGKILL: every request fails, the client reconnects in vain.
    Down,
    /// SIGSTOP: every request hangs on an open connection.
    Paused,
}

/// Waits for `p` to exit (at most `patience`); its exit status and how
/// long after `t0` it came.
async fn exit_of(mut p: Proc, t0: Instant, patience: Duration) -> (Proc, Option<i32>, Duration) {
    tokio::task::spawn_blocking(move || {
        let st = p.wait_timeout(patience);
        let took = t0.elapsed();
        (p, st.map(|s| s.code().unwrap_or(-1)), took)
    })
    .await
    .unwrap()
}

async fn stopped_during(outage: Outage) {
    let mut env = Fleet::start().await;
    let worker = env.worker_proc(
        &["--worker-id", "stopping"],
        &[
            ("LH_DRAIN_TIMEOUT", format!("{}ms", DRAIN.as_millis())),
            (
                "LH_HAND_BACK_TIMEOUT",
                format!("{}ms", HAND_BACK.as_millis()),
            ),
        ],
    );
    let reaper = Proc::spawn(
        "leasehold-reaper",
        &[],
        &[
            ("NATS_URL", env.url()),
            ("LH_PREFIX", env.prefix.clone()),
            ("LH_INTERVAL", "500ms".into()),
            (
                "LH_DRAIN_TIMEOUT",
                format!("{}ms", REAPER_DRAIN.as_millis()),
            ),
            ("RUST_LOG", "info".into()),
        ],
    );
    wait_log(&worker, "worker starting", Duration::from_secs(20)).await;
    wait_log(&reaper, "reaper starting", Duration::from_secs(20)).await;
    // A job outliving the drain: the worker must hand it back, and cannot.
    env.submit("sleep", json!({"input": {"ms": 4000}}), "held")
        .await;
    env.wait_status("held", "running", Duration::from_secs(20))
        .await;
    env.wait_indexed("held", Duration::from_secs(10)).await;

    match outage {
        Outage::Down => env.server.kill(),
        Outage::Paused => env.server.pause(),
    }
    let t0 = Instant::now();
    worker.term();
    reaper.term();
    // Documented bounds: the worker's drain + hand-back + 1s, the reaper's drain + 1s.
    let worker_bound = DRAIN + HAND_BACK + Duration::from_secs(1);
    let reaper_bound = REAPER_DRAIN + Duration::from_secs(1);
    let patience = Duration::from_secs(30);
    let ((worker, w_code, w_took), (reaper, r_code, r_took)) =
        tokio::join!(exit_of(worker, t0, patience), exit_of(reaper, t0, patience));
    assert!(
        w_code.is_some() && w_took <= worker_bound,
        "{outage:?}: the worker exited {w_code:?} after {w_took:?} (bound {worker_bound:?}):\n{}",
        worker.output()
    );
    assert!(
        r_code.is_some() && r_took <= reaper_bound,
        "{outage:?}: the reaper exited {r_code:?} after {r_took:?} (bound {reaper_bound:?}):\n{}",
        reaper.output()
    );
    let out = worker.output();
    assert_eq!(w_code, Some(1), "jobs not handed back: non-zero\n{out}");
    let named: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("not handed back, recovered when this session ends"))
        .collect();
    assert!(
        named.len() == 1 && named[0].contains("held"),
        "one line naming the job not handed back: {named:?}\n{out}"
    );

    // NATS returns: the job is recovered (the session's TTL) and done once.
    match outage {
        Outage::Down => env.server.restart(),
        Outage::Paused => env.server.resume(),
    }
    let _b = env.worker_proc(&["--worker-id", "after"], &[]);
    let _r = Proc::spawn(
        "leasehold-reaper",
        &[],
        &[
            ("NATS_URL", env.url()),
            ("LH_PREFIX", env.prefix.clone()),
            ("LH_INTERVAL", "500ms".into()),
        ],
    );
    let done = env
        .wait_status("held", "completed", Duration::from_secs(60))
        .await;
    assert_eq!(
        done.worker_id.as_deref(),
        Some("after"),
        "run again by the new worker"
    );
    // The record flips before its event lands: wait for the event, then
    // count them all.
    env.wait_event("held", "completed", Duration::from_secs(20))
        .await;
    let completed = env
        .events_of("held")
        .await
        .into_iter()
        .filter(|e| e.r#type == "completed")
        .count();
    assert_eq!(completed, 1, "completed exactly once");
}

#[tokio::test]
async fn a_worker_and_a_reaper_stopped_while_nats_is_down_exit_within_their_bound() {
    stopped_during(Outage::Down).await;
}

#[tokio::test]
async fn a_worker_and_a_reaper_stopped_while_nats_hangs_exit_within_their_bound() {
    stopped_during(Outage::Paused).await;
}

/// A second signal does not wait for the first one's drain.
#[tokio::test]
async fn a_second_sigterm_exits_at_once() {
    let env = Fleet::start().await;
    let worker = env.worker_proc(&[], &[("LH_DRAIN_TIMEOUT", "30s".into())]);
    wait_log(&worker, "worker starting", Duration::from_secs(20)).await;
    env.submit("sleep", json!({"input": {"ms": 20000}}), "long")
        .await;
    env.wait_status("long", "running", Duration::from_secs(20))
        .await;
    worker.term();
    wait_log(&worker, "shutdown: stop pulling", Duration::from_secs(10)).await;
    let t0 = Instant::now();
    worker.term();
    let (worker, code, took) = exit_of(worker, t0, Duration::from_secs(20)).await;
    assert!(
        code == Some(143) && took < Duration::from_secs(2),
        "exit {code:?} after {took:?}:\n{}",
        worker.output()
    );
    let out = worker.output();
    assert!(
        out.lines().any(|l| l.contains("a second SIGTERM")
            && l.contains("not handed back")
            && l.contains("long")),
        "the job left is named:\n{out}"
    );
}

/// The processes whose parent is `pid`, with their command names.
fn children_of(pid: u32) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: comm may hold spaces, so after the last ')'.
        let Some((head, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let ppid = rest.split_whitespace().nth(1).and_then(|p| p.parse().ok());
        if ppid == Some(pid) {
            let comm = head
                .split_once('(')
                .map(|(_, c)| c)
                .unwrap_or("")
                .to_string();
            out.push((child, comm));
        }
    }
    out
}

/// Whether `pid` still runs (a zombie waiting for its new parent does not).
fn runs(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, r)| r.split_whitespace().next() != Some("Z"))
        })
        .unwrap_or(false)
}

/// `leasehold-soak` stopped by a signal stops the servers, workers, reapers
/// and sim it started (no destructor runs on a signal).
#[tokio::test]
async fn a_soak_stopped_by_a_signal_leaves_no_process_behind() {
    let out = tempfile::tempdir().unwrap();
    let out_arg = out.path().display().to_string();
    let soak = Proc::spawn(
        "leasehold-soak",
        &[
            "--seconds",
            "300",
            "--workers",
            "2",
            "--seed",
            "38",
            "--out",
            &out_arg,
        ],
        &[("RUST_LOG", "warn".into())],
    );
    wait_log(&soak, "workers (", Duration::from_secs(120)).await;
    let started = children_of(soak.pid());
    let names: Vec<&str> = started.iter().map(|(_, c)| c.as_str()).collect();
    for want in [
        "nats-server",
        "leasehold-work",
        "leasehold-reap",
        "leasehold-sim",
    ] {
        assert!(
            names.iter().any(|n| n.starts_with(want)),
            "the soak runs a {want} before the signal: {started:?}"
        );
    }
    soak.term();
    let (soak, code, _) = exit_of(soak, Instant::now(), Duration::from_secs(20)).await;
    // SIGKILLed: gone at once (reaped by whoever inherited them).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left: Vec<&(u32, String)> = started.iter().filter(|(p, _)| runs(*p)).collect();
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "left running after the soak's exit: {left:?}\n{}",
            soak.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(code, Some(143), "{}", soak.output());
}

/// An open event stream never ends by itself: the console's stop closes it
/// after its drain timeout instead of waiting for it.
#[tokio::test]
async fn a_console_with_an_open_event_stream_stops_within_its_bound() {
    let env = Fleet::start().await;
    let (_w, stop) = env.worker().await;
    env.submit("sleep", json!({"input": {"ms": 60000}}), "watched")
        .await;
    env.wait_status("watched", "running", Duration::from_secs(20))
        .await;
    let (console, base) = crate::console::start_console(&[
        ("NATS_URL", env.url()),
        ("LH_PREFIX", env.prefix.clone()),
        ("LH_CONSOLE_DRAIN_TIMEOUT", "1s".into()),
    ])
    .await;
    let mut stream = reqwest::get(format!("{base}/v1/jobs/watched/events"))
        .await
        .unwrap()
        .bytes_stream();
    // The stream is open and serving (the job's first events).
    assert!(futures::StreamExt::next(&mut stream).await.is_some());
    let t0 = Instant::now();
    console.term();
    let bound = Duration::from_secs(1) + Duration::from_secs(1);
    let (console, code, took) = exit_of(console, t0, Duration::from_secs(20)).await;
    assert!(
        code == Some(0) && took <= bound,
        "the console exited {code:?} after {took:?} (bound {bound:?}):\n{}",
        console.output()
    );
    drop(stream);
    stop.cancel();
}
