//! Review G14/G15 (issue 30): what the console's views cost does not grow
//! with what is open. Against a real nats-server and the real console
//! binary over HTTP: the fleet view is read once per period however many
//! tabs follow it; a job page's live part costs one server consumer; a
//! caller's live streams are capped; the record cache stays within its
//! byte bound; bulk actions run on their own task, in pages, to their end.

use std::time::{Duration, Instant};

use leasehold::JobRecord;
use leasehold_testkit::doors::dlq::Dlq;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::console::{csrf_of, http, spawn_console, sse_until, start_console, text};
use leasehold_testkit::Fleet;

/// A metric's value from the console's `/metrics` (0 when absent).
pub(crate) async fn metric(base: &str, auth: Option<&str>, name: &str) -> f64 {
    let mut r = http().get(format!("{base}/metrics"));
    if let Some(t) = auth {
        r = r.bearer_auth(t);
    }
    let body = r.send().await.unwrap().text().await.unwrap();
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0.0)
}

fn now() -> String {
    leasehold_testkit::record::now()
}

fn record(id: &str, status: &str) -> JobRecord {
    JobRecord {
        id: id.into(),
        kind: "echo".into(),
        status: status.into(),
        worker_id: (status == "running").then(|| "w-1".to_string()),
        epoch: 1,
        created_at: now(),
        updated_at: now(),
        ..Default::default()
    }
}

/// G14: N tabs following `/fleet/live` cost one read of the fleet per
/// refresh period (2-5 s), not N; and none while no tab follows. Reads
/// counted two ways: the reaper-metrics requests the console publishes
/// through a counting proxy (one per read), and the console's
/// `leasehold_console_fleet_reads_total`.
#[tokio::test]
async fn console_fleet_live_reads_the_store_once_a_period_however_many_tabs_follow() {
    const TABS: usize = 12;
    let env = Fleet::start().await;
    let proxy = leasehold_harness::proxy::FaultProxy::start(&env.url()).await;
    let (_proc, base) = start_console(&[
        ("NATS_URL", proxy.url()),
        ("LH_PREFIX", env.prefix.clone()),
        ("LH_CONSOLE_STREAMS_PER_CALLER", "64".into()),
    ])
    .await;
    let reads = env.conn.layout.reaper_metrics_subject();
    let c = http();
    let before = (
        proxy.published(&reads),
        metric(&base, None, "leasehold_console_fleet_reads_total").await,
    );
    let t0 = Instant::now();
    let mut tabs = Vec::new();
    for _ in 0..TABS {
        let r = c.get(format!("{base}/fleet/live")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        tabs.push(tokio::spawn(sse_until(r, {
            let mut n = 0;
            move |(_, e, _)| {
                n += (e == "fleet") as u32;
                n == 2
            }
        })));
    }
    let mut htmls = Vec::new();
    for t in tabs {
        let got = tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("every tab gets two fleet updates within 30 s")
            .unwrap();
        htmls.push(got.last().unwrap().2["html"].as_str().unwrap().to_string());
    }
    let took = t0.elapsed();
    let by_proxy = proxy.published(&reads) - before.0;
    let by_metric = metric(&base, None, "leasehold_console_fleet_reads_total").await - before.1;
    let bound = (took.as_secs_f64() / 2.0).floor() as u64 + 2;
    eprintln!("{TABS} tabs, two updates each, in {took:?}: {by_proxy} fleet reads through the proxy, {by_metric} counted");
    assert!(
        by_proxy <= bound,
        "{TABS} tabs cost {by_proxy} fleet reads in {took:?}: one per tab, not one per period (at most {bound})"
    );
    assert_eq!(by_metric as u64, by_proxy, "the metric counts each read");
    assert!(htmls.iter().all(|h| h.contains("<h2>Workers")), "{htmls:?}");
    // With no tab left, nothing is read. Absence can only be waited out:
    // two periods with no follower.
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&base, None, "leasehold_console_live_streams").await > 0.0 {
        assert!(
            Instant::now() < deadline,
            "the closed tabs' streams stay open"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let idle = proxy.published(&reads);
    tokio::time::sleep(2 * Duration::from_secs(5)).await;
    assert_eq!(
        proxy.published(&reads),
        idle,
        "the fleet was read with nobody following it"
    );
}

/// G15: `/jobs/{id}/live` costs one server consumer per tab (its
/// events'), the record part following the console's own record watch:
/// K tabs add K consumers over the events stream and the records' KV
/// stream together, not 2K. Each tab still gets the record's changes.
#[tokio::test]
async fn console_job_page_tabs_cost_one_consumer_each() {
    const TABS: usize = 5;
    let env = Fleet::start().await;
    let console = spawn_console(&env, &[]).await;
    let rec = record("tabbed", "running");
    env.seed_record(&rec).await;
    let layout = env.conn.layout.clone();
    let consumers = || {
        let js = env.conn.js.clone();
        let names = [
            layout.events_stream(),
            format!("KV_{}", layout.jobs_bucket()),
        ];
        async move {
            let mut n = 0;
            for name in names {
                n += js
                    .get_stream(name)
                    .await
                    .unwrap()
                    .info()
                    .await
                    .unwrap()
                    .state
                    .consumer_count;
            }
            n
        }
    };
    let c = http();
    // The console's own (feeds) are there before any tab.
    let page = c
        .get(format!("{}/jobs/tabbed", console.base))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    let base_count = consumers().await;
    let mut tabs = Vec::new();
    for _ in 0..TABS {
        let r = c
            .get(format!("{}/jobs/tabbed/live", console.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        tabs.push(r);
    }
    let with_tabs = consumers().await;
    eprintln!(
        "{TABS} job-page tabs: {} consumers more",
        with_tabs - base_count
    );
    assert_eq!(
        with_tabs - base_count,
        TABS,
        "{TABS} tabs took {} server consumers",
        with_tabs - base_count
    );
    // A write of the record reaches a tab as its summary.
    let v = env.jobs.get("tabbed").await.unwrap().unwrap();
    let mut next = v.value.clone();
    next.status = "parked".into();
    env.jobs.update(&next, v.revision).await.unwrap();
    let got = tokio::time::timeout(
        Duration::from_secs(15),
        sse_until(tabs.pop().unwrap(), |(_, e, d)| {
            e == "record" && d["status"] == "parked"
        }),
    )
    .await
    .expect("the record's change within 15 s");
    assert!(got.last().unwrap().2["html"]
        .as_str()
        .unwrap()
        .contains("parked"));
}

/// G15: one caller holds at most `--streams-per-caller` live streams,
/// whatever they follow; the next is refused 429 saying why; another
/// caller is not; a stream whose client went away gives its slot back.
#[tokio::test]
async fn console_caps_each_callers_live_streams_and_frees_a_slot_when_its_client_goes() {
    let env = Fleet::start().await;
    let console = spawn_console(
        &env,
        &[
            ("LH_CONSOLE_TRUSTED_HEADER", "X-User".into()),
            ("LH_CONSOLE_STREAMS_PER_CALLER", "3".into()),
        ],
    )
    .await;
    env.seed_record(&record("capped", "running")).await;
    let c = http();
    let open = |user: &'static str, path: &'static str| {
        c.get(format!("{}{path}", console.base))
            .header("X-User", user)
            .send()
    };
    let a1 = open("ann", "/v1/jobs/capped/events").await.unwrap();
    let a2 = open("ann", "/jobs/capped/live").await.unwrap();
    let a3 = open("ann", "/fleet/live").await.unwrap();
    for r in [&a1, &a2, &a3] {
        assert_eq!(r.status(), 200);
    }
    for path in ["/jobs/live", "/v1/jobs/capped/events"] {
        let r = open("ann", path).await.unwrap();
        assert_eq!(r.status(), 429, "{path}: a fourth stream");
        let body = r.text().await.unwrap();
        assert!(
            body.contains("ann has 3 live streams open") && body.contains("--streams-per-caller"),
            "{body}"
        );
    }
    let b = open("bob", "/jobs/live").await.unwrap();
    assert_eq!(b.status(), 200, "another caller has its own slots");
    // Ann's browser drops one stream: its slot comes back.
    drop(a2);
    let deadline = Instant::now() + Duration::from_secs(30);
    let again = loop {
        let r = open("ann", "/jobs/capped/live").await.unwrap();
        if r.status() == 200 {
            break r;
        }
        assert_eq!(r.status(), 429);
        assert!(
            Instant::now() < deadline,
            "the dropped stream's slot never came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    drop((a1, a3, b, again));
}

/// G14: the record cache stays within `--record-cache-bytes` however many
/// records pass through it, evicting the least recently used, and a job
/// whose record was evicted is still shown (read from the store).
#[tokio::test]
async fn console_record_cache_stays_within_its_byte_bound_and_shows_evicted_jobs() {
    const BOUND: usize = 16 * 1024;
    let env = Fleet::start().await;
    let console = spawn_console(&env, &[("LH_CONSOLE_RECORD_CACHE_BYTES", "16KiB".into())]).await;
    // 40 running jobs of about 2 KiB each: 80 KiB of records.
    for i in 0..40 {
        let mut r = record(&format!("big-{i:02}"), "running");
        r.worker_id = Some(format!("w-{}", "x".repeat(2000)));
        env.seed_record(&r).await;
    }
    let c = http();
    for round in 0..2 {
        let body = c
            .get(format!("{}/jobs?limit=100", console.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        for i in 0..40 {
            assert!(
                body.contains(&format!("data-id=\"big-{i:02}\"")),
                "round {round}: big-{i:02} is missing from the list"
            );
        }
        let bytes = metric(&console.base, None, "leasehold_console_record_cache_bytes").await;
        assert!(
            bytes > 0.0 && bytes <= BOUND as f64,
            "the cache holds {bytes} bytes, over its bound of {BOUND}"
        );
    }
    assert!(
        metric(
            &console.base,
            None,
            "leasehold_console_record_cache_evictions_total"
        )
        .await
            > 0.0
    );
    let r = c
        .get(format!("{}/jobs/big-00", console.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("big-00"));
}

/// The ids of the active jobs' rows of a jobs page, in their order.
fn active_ids(page: &str) -> Vec<String> {
    let table = page
        .split("<tbody id=\"active\"")
        .nth(1)
        .and_then(|s| s.split("</tbody>").next())
        .unwrap_or_else(|| panic!("no active table in {page}"));
    table
        .split("data-id=\"")
        .skip(1)
        .filter_map(|s| s.split('"').next())
        .map(String::from)
        .collect()
}

/// Issue 34: a console that keeps no view of the index of active jobs
/// (`--index-view off`, the path a console also takes while its view
/// loads: seconds at a million active jobs) reads a jobs page from the
/// index's end, never the whole index. It shows the rows a console with
/// its view shows, in the same order, for a first page, a later page and
/// a filter; it says "N+ matching" when the read stopped before the
/// index's start, the exact count otherwise, and why on the page; the
/// fleet page marks the counts it does not know; and a bulk cancel still
/// finds every job it matches.
#[tokio::test]
async fn console_without_its_index_view_pages_from_the_index_end_and_counts_at_least() {
    let env = Fleet::start().await;
    for i in 0..30 {
        env.seed_record(&record(&format!("q-{i:02}"), "queued"))
            .await;
    }
    for i in 0..5 {
        env.seed_record(&record(&format!("r-{i}"), "running")).await;
    }
    let off = spawn_console(&env, &[("LH_CONSOLE_INDEX_VIEW", "off".into())]).await;
    let on = spawn_console(&env, &[]).await;
    let c = http();
    let get = async |base: &str, q: &str| text(&c, &format!("{base}/jobs?{q}")).await;
    // The console with its view counts them all once its view is loaded.
    page_until(
        &c,
        &format!("{}/jobs?limit=50", on.base),
        Duration::from_secs(20),
        "the console's view never counted the 35 jobs",
        |p| p.contains("35 matching</small>"),
    )
    .await;
    for (q, off_count) in [
        ("status=queued&limit=10", "11+ matching"),
        ("status=queued&limit=10&offset=20", "30 matching"),
        ("limit=50", "35 matching"),
        ("kind=echo&prefix=r-&limit=3", "4+ matching"),
    ] {
        let (a, b) = (get(&off.base, q).await, get(&on.base, q).await);
        assert!(
            a.contains(&format!(">{off_count}</small>")),
            "{q}: the console without its view should say {off_count}: {a}"
        );
        assert!(
            a.contains("id=\"index-view\"") && a.contains("--index-view off"),
            "{q}: the page does not say why its count is partial: {a}"
        );
        assert!(!b.contains("id=\"index-view\""), "{q}: {b}");
        let rows = active_ids(&a);
        assert!(!rows.is_empty(), "{q}: {a}");
        assert_eq!(
            rows,
            active_ids(&b),
            "{q}: the two consoles list different rows"
        );
    }
    assert_eq!(
        active_ids(&get(&off.base, "status=queued&limit=10&offset=20").await).len(),
        10
    );
    // An offset past every job: an empty page and the count, on both.
    for base in [&off.base, &on.base] {
        let r = c
            .get(format!("{base}/jobs?offset={}", usize::MAX))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let page = r.text().await.unwrap();
        assert!(page.contains(">35 matching</small>"), "{page}");
        assert!(active_ids(&page).is_empty());
    }
    let fleet = text(&c, &format!("{}/fleet", off.base)).await;
    let notice = fleet
        .split("id=\"index-view\">")
        .nth(1)
        .and_then(|s| s.split("</p>").next())
        .expect("the fleet page without the view says its counts are not known");
    assert!(
        notice.contains("--index-view off") && notice.contains("not known"),
        "{notice}"
    );
    // A bulk cancel of q-10..q-19 without the view: all ten, no other.
    let confirm = text(
        &c,
        &format!("{}/confirm?action=bulk-cancel&prefix=q-1", off.base),
    )
    .await;
    assert!(
        confirm.contains("<b>10</b> active job(s) match"),
        "{confirm}"
    );
    let csrf = csrf_of(&confirm);
    let r = c
        .post(format!("{}/actions/bulk-cancel", off.base))
        .header("Origin", &off.base)
        .form(&[("prefix", "q-1"), ("csrf", &csrf)])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303);
    for i in 10..20 {
        env.wait_status(&format!("q-{i}"), "cancelled", Duration::from_secs(30))
            .await;
    }
    for id in ["q-09", "q-20", "r-0"] {
        let r = env.record(id).await.unwrap();
        assert_ne!(r.status, "cancelled", "{id} was not matched");
    }
}

/// Sends one request, reads the answer's head (or `None` if none came
/// within `wait`), and closes the connection: a browser that went away.
async fn post_and_leave(base: &str, path: &str, form: &str, wait: Duration) -> Option<String> {
    let host = base.strip_prefix("http://").unwrap();
    let mut s = tokio::net::TcpStream::connect(host).await.unwrap();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{form}",
        form.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    let read = async {
        while !head.ends_with(b"\r\n\r\n") {
            let mut b = [0u8; 1];
            if s.read(&mut b).await.unwrap() == 0 {
                break;
            }
            head.push(b[0]);
        }
    };
    let got = tokio::time::timeout(wait, read).await.is_ok();
    drop(s);
    got.then(|| String::from_utf8_lossy(&head).to_string())
}

/// One `data-NAME="..."` of the progress table.
fn data<'a>(page: &'a str, name: &str) -> &'a str {
    let at = format!("data-{name}=\"");
    page.split(&at)
        .nth(1)
        .and_then(|s| s.split('"').next())
        .unwrap_or_else(|| panic!("no {at} in {page}"))
}

/// G14: a bulk cancel is an operation of its own: the form's POST is
/// answered at once with its page (303), the browser leaves, and it goes
/// on to the end; its page shows what is done, failed and left. Every
/// cancel here waits the 3 s of an unanswered request (a worker that
/// hears but does not answer). A second bulk action beyond `--bulk-max`
/// is refused (429).
#[tokio::test]
async fn console_bulk_cancel_goes_on_after_the_browser_leaves_and_shows_its_progress() {
    const JOBS: usize = 16;
    let env = Fleet::start().await;
    // Hears every cancel, answers none.
    let _deaf = env
        .conn
        .client
        .subscribe(env.conn.layout.cancel_subject("*"))
        .await
        .unwrap();
    for i in 0..JOBS {
        env.seed_record(&record(&format!("bc-{i:02}"), "queued"))
            .await;
    }
    env.seed_record(&record("other-1", "queued")).await;
    let console = spawn_console(&env, &[("LH_CONSOLE_BULK_MAX", "1".into())]).await;
    let c = http();
    let confirm = c
        .get(format!(
            "{}/confirm?action=bulk-cancel&prefix=bc-",
            console.base
        ))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        confirm.contains(&format!("<b>{JOBS}</b> active job(s) match")),
        "{confirm}"
    );
    let csrf = csrf_of(&confirm);
    let form = format!("prefix=bc-&csrf={csrf}");
    let head = post_and_leave(
        &console.base,
        "/actions/bulk-cancel",
        &form,
        Duration::from_secs(2),
    )
    .await
    .expect("the bulk cancel was not answered within 2 s: it ran inside the request");
    assert!(head.starts_with("HTTP/1.1 303"), "{head}");
    let op = head
        .lines()
        .find_map(|l| {
            l.strip_prefix("location: ")
                .or_else(|| l.strip_prefix("Location: "))
        })
        .expect("a Location")
        .trim()
        .to_string();
    assert!(op.starts_with("/ops/"), "{op}");
    // Under way: once the matching jobs are listed (at once), its page
    // shows what is done and left while the cancels wait their 3 s.
    let url = format!("{}{op}", console.base);
    let page = page_until(
        &c,
        &url,
        Duration::from_secs(10),
        "the jobs were never listed",
        |p| data(p, "listed") == "true",
    )
    .await;
    assert_eq!(data(&page, "state"), "running", "{page}");
    let (done, failed, left) = (
        data(&page, "done").parse::<usize>().unwrap(),
        data(&page, "failed").parse::<usize>().unwrap(),
        data(&page, "remaining").parse::<usize>().unwrap(),
    );
    assert!(left > 0 && done + failed + left == JOBS, "{page}");
    assert!(
        page.contains("data-refresh"),
        "a running action's page reloads itself"
    );
    // A second one while it runs: refused.
    let second = c
        .post(format!("{}/actions/bulk-cancel", console.base))
        .header("Origin", &console.base)
        .form(&[("prefix", "other-"), ("csrf", &csrf)])
        .send()
        .await
        .unwrap();
    assert_eq!(second.status(), 429);
    let why = second.text().await.unwrap();
    assert!(why.contains("--bulk-max") && why.contains(&op), "{why}");
    // Every job ends cancelled, with nobody's browser there.
    for i in 0..JOBS {
        env.wait_status(&format!("bc-{i:02}"), "cancelled", Duration::from_secs(60))
            .await;
    }
    let page = page_until(
        &c,
        &url,
        Duration::from_secs(20),
        "the operation never ended",
        |p| data(p, "state") != "running",
    )
    .await;
    assert_eq!(data(&page, "state"), "done", "{page}");
    assert_eq!(data(&page, "done"), JOBS.to_string(), "{page}");
    assert_eq!(data(&page, "remaining"), "0", "{page}");
    assert!(
        !page.contains("data-refresh"),
        "an ended action's page stays"
    );
    let other = env.record("other-1").await.unwrap();
    assert_eq!(other.status, "queued", "a job the filter did not match");
}

/// G14: a bulk replay reads dead letters a page (100) at a time, never
/// all into memory, and replays every one that was there when it began.
/// A bearer caller gets 202 and the operation's JSON.
#[tokio::test]
async fn console_bulk_replay_reads_dead_letters_a_page_at_a_time() {
    const LETTERS: usize = 250;
    let env = Fleet::start().await;
    let dlq = Dlq::new(&env.conn);
    for i in 0..LETTERS {
        let mut rec = record(&format!("dl-{i:03}"), "dead");
        rec.spec = Some(leasehold_testkit::record::JobSpec {
            input: json!({"i": i}).to_string(),
            ..Default::default()
        });
        env.jobs.create(&rec).await.unwrap();
        dlq.dead(&rec, "poison", "test", vec![], None)
            .await
            .unwrap();
    }
    let token = "operator-token-0123456789";
    let console = spawn_console(&env, &[("LH_CONSOLE_OPERATOR_TOKEN", token.into())]).await;
    let c = http();
    let r = c
        .post(format!("{}/actions/bulk-replay", console.base))
        .bearer_auth(token)
        .form(&[("kind", "echo")])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let started: Value = r.json().await.unwrap();
    let url = started["url"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(60);
    let op: Value = loop {
        let op: Value = c
            .get(format!("{}{url}", console.base))
            .bearer_auth(token)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if op["state"] != "running" {
            break op;
        }
        assert!(Instant::now() < deadline, "the replay never ended: {op}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(op["state"], "done", "{op}");
    assert_eq!(op["done"], LETTERS, "{op}");
    assert_eq!(op["failed"], 0, "{op}");
    assert_eq!(op["page_size"], 100, "{op}");
    assert_eq!(op["pages"], 3, "250 letters, 100 a page: {op}");
    assert_eq!(
        metric(
            &console.base,
            Some(token),
            "leasehold_console_bulk_letter_pages_total"
        )
        .await,
        3.0
    );
    assert_eq!(dlq.count().await.unwrap(), 0, "every letter replayed");
    let r = env.record("dl-249").await.unwrap();
    assert_eq!(r.status, "queued");
}

/// Polls the page at `url` until `pred` holds for its body (panics with
/// `what` and the last body after `within`): a server-rendered page has
/// no event to wait on.
async fn page_until(
    c: &reqwest::Client,
    url: &str,
    within: Duration,
    what: &str,
    pred: impl Fn(&str) -> bool,
) -> String {
    let deadline = Instant::now() + within;
    loop {
        let page = c.get(url).send().await.unwrap().text().await.unwrap();
        if pred(&page) {
            return page;
        }
        assert!(Instant::now() < deadline, "{what}: {page}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
