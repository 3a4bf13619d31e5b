//! The console against a real fleet: its pages in a real browser
//! (headless Chromium driven over the DevTools protocol), the clients'
//! event stream with `Last-Event-ID`, auth, secrets and bad input.
//!
//! Chromium is required: these tests fail, not skip, without it (`make
//! setup` installs Debian's `chromium`; `LH_CHROMIUM` names another).

use std::time::Duration;

use futures::StreamExt;
use leasehold::JobRecord;
use leasehold_harness::Proc;
use leasehold_testkit::doors::dlq::Dlq;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use leasehold_testkit::{spawn_sim, wait_log, Fleet};

/// A running console and its base URL.
pub struct Console {
    pub _proc: Proc,
    pub base: String,
}

pub async fn spawn_console(env: &Fleet, extra: &[(&'static str, String)]) -> Console {
    let mut e: Vec<(&'static str, String)> =
        vec![("NATS_URL", env.url()), ("LH_PREFIX", env.prefix.clone())];
    e.extend(extra.iter().cloned());
    let (proc, base) = start_console(&e).await;
    Console { _proc: proc, base }
}

/// Starts `leasehold-console` with this environment (plus a free port and
/// logs); the process and its base URL once it listens.
pub async fn start_console(env: &[(&'static str, String)]) -> (Proc, String) {
    let mut e = env.to_vec();
    e.extend([
        ("LH_CONSOLE_HTTP_LISTEN", "127.0.0.1:0".to_string()),
        ("RUST_LOG", "info".into()),
    ]);
    let proc = Proc::spawn("leasehold-console", &[], &e);
    wait_log(&proc, "console listening on ", Duration::from_secs(20)).await;
    let base = proc
        .output()
        .lines()
        .find_map(|l| l.split("console listening on ").nth(1))
        .expect("console address")
        .trim()
        .to_string();
    (proc, base)
}

/// The research worker's environment against the sim at `sim`.
fn research_env(sim: &str) -> Vec<(&'static str, String)> {
    leasehold_testkit::research_env(sim, &format!("{sim}/v1"), "research,echo,sleep")
}

/// The body of a GET of `url`.
pub(crate) async fn text(c: &reqwest::Client, url: &str) -> String {
    c.get(url).send().await.unwrap().text().await.unwrap()
}

/// The CSRF token of a page's form.
pub(crate) fn csrf_of(page: &str) -> String {
    page.split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .unwrap_or_else(|| panic!("no csrf field in {page}"))
        .to_string()
}

pub(crate) fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

/// A sim whose model streams slowly (`ms` a token), so a research job
/// runs for seconds; its fault file is removed with the returned guard.
async fn slow_sim(tag: &str, ms: u64) -> (Proc, String, tempfile::TempPath) {
    let mut f = tempfile::Builder::new()
        .prefix(&format!("lh-console-{tag}-"))
        .suffix(".json")
        .tempfile()
        .unwrap();
    std::io::Write::write_all(
        &mut f,
        format!(r#"{{"rules": [{{"kind": "slow", "delay_ms": {ms}}}]}}"#).as_bytes(),
    )
    .unwrap();
    let path = f.into_temp_path();
    let (p, url) = spawn_sim(&[("LH_SIM_FAULTS", path.display().to_string())]).await;
    (p, url, path)
}

fn research_spec() -> Value {
    json!({"input": {"topic": "lease-based ownership in distributed systems", "experts": 2, "sections": 3}})
}

// ---------------------------------------------------------------------------
// A minimal DevTools-protocol client: one WebSocket to the browser target,
// one page attached in flat mode.

pub(crate) struct Browser {
    _proc: Proc,
    _dir: tempfile::TempDir,
    ws: tokio::net::TcpStream,
    buf: Vec<u8>,
    partial: Vec<u8>,
    next: u64,
    session: String,
}

fn chromium() -> String {
    leasehold_harness::chromium()
        .unwrap_or_else(|e| panic!("{e}"))
        .display()
        .to_string()
}

impl Browser {
    pub(crate) async fn start() -> Browser {
        let dir = tempfile::tempdir().unwrap();
        let profile = format!("--user-data-dir={}", dir.path().display());
        let proc = Proc::spawn_path(
            std::path::Path::new(&chromium()),
            &[
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-port=0",
                "--remote-debugging-address=127.0.0.1",
                &profile,
                "about:blank",
            ],
            &[],
            None,
        );
        wait_log(
            &proc,
            "DevTools listening on ws://",
            Duration::from_secs(30),
        )
        .await;
        let ws_url = proc
            .output()
            .lines()
            .find_map(|l| l.split("DevTools listening on ").nth(1))
            .unwrap()
            .trim()
            .to_string();
        let rest = ws_url.strip_prefix("ws://").unwrap();
        let (hostport, path) = rest.split_once('/').unwrap();
        let mut ws = tokio::net::TcpStream::connect(hostport).await.unwrap();
        let req = format!(
            "GET /{path} HTTP/1.1\r\nHost: {hostport}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
Sec-WebSocket-Key: bGVhc2Vob2xkLWNvbnNvbGU=\r\nSec-WebSocket-Version: 13\r\n\r\n"
        );
        ws.write_all(req.as_bytes()).await.unwrap();
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let mut b = [0u8; 1];
            ws.read_exact(&mut b).await.unwrap();
            head.push(b[0]);
        }
        assert!(
            String::from_utf8_lossy(&head).starts_with("HTTP/1.1 101"),
            "DevTools handshake: {}",
            String::from_utf8_lossy(&head)
        );
        let mut b = Browser {
            _proc: proc,
            _dir: dir,
            ws,
            buf: Vec::new(),
            partial: Vec::new(),
            next: 0,
            session: String::new(),
        };
        let t = b
            .call("Target.createTarget", json!({"url": "about:blank"}))
            .await;
        let target = t["targetId"].as_str().unwrap().to_string();
        let a = b
            .call(
                "Target.attachToTarget",
                json!({"targetId": target, "flatten": true}),
            )
            .await;
        b.session = a["sessionId"].as_str().unwrap().to_string();
        b
    }

    async fn send(&mut self, text: &str) {
        let p = text.as_bytes();
        let mut frame = vec![0x81u8];
        match p.len() {
            n if n < 126 => frame.push(0x80 | n as u8),
            n if n < 65536 => {
                frame.push(0x80 | 126);
                frame.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                frame.push(0x80 | 127);
                frame.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        let mask = [0x5au8, 0x1e, 0x77, 0x03];
        frame.extend_from_slice(&mask);
        frame.extend(p.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        self.ws.write_all(&frame).await.unwrap();
    }

    /// The next message. Cancel-safe: bytes read stay in `buf` until a
    /// whole frame is there.
    async fn recv(&mut self) -> Value {
        loop {
            while let Some((fin, op, data)) = self.frame() {
                if op == 0x9 || op == 0xA {
                    continue; // ping/pong
                }
                self.partial.extend_from_slice(&data);
                if fin {
                    let msg = std::mem::take(&mut self.partial);
                    return serde_json::from_slice(&msg).unwrap();
                }
            }
            let n = self.ws.read_buf(&mut self.buf).await.unwrap();
            assert!(n > 0, "DevTools closed its socket");
        }
    }

    /// A whole frame off the front of `buf`: (fin, opcode, payload).
    fn frame(&mut self) -> Option<(bool, u8, Vec<u8>)> {
        let b = &self.buf;
        if b.len() < 2 {
            return None;
        }
        let (fin, op) = (b[0] & 0x80 != 0, b[0] & 0x0f);
        let (len, head) = match b[1] & 0x7f {
            126 if b.len() >= 4 => (u16::from_be_bytes([b[2], b[3]]) as usize, 4),
            127 if b.len() >= 10 => (
                u64::from_be_bytes(b[2..10].try_into().unwrap()) as usize,
                10,
            ),
            126 | 127 => return None,
            n => (n as usize, 2),
        };
        if b.len() < head + len {
            return None;
        }
        let data = b[head..head + len].to_vec();
        self.buf.drain(..head + len);
        Some((fin, op, data))
    }

    async fn call(&mut self, method: &str, params: Value) -> Value {
        match self.try_call(method, params).await {
            Ok(v) => v,
            Err(r) => panic!("{method}: {r}"),
        }
    }

    /// [`Self::call`], its error answer returned.
    async fn try_call(&mut self, method: &str, params: Value) -> Result<Value, Value> {
        self.next += 1;
        let id = self.next;
        let mut m = json!({"id": id, "method": method, "params": params});
        if !self.session.is_empty() {
            m["sessionId"] = json!(self.session);
        }
        self.send(&m.to_string()).await;
        loop {
            let r = tokio::time::timeout(Duration::from_secs(30), self.recv())
                .await
                .unwrap_or_else(|_| panic!("DevTools did not answer {method}"));
            if r["id"].as_u64() == Some(id) {
                if r.get("error").is_some() {
                    return Err(r);
                }
                return Ok(r["result"].clone());
            }
        }
    }

    /// Evaluates `js` in the page; its value.
    pub(crate) async fn eval(&mut self, js: &str) -> Value {
        let r = self
            .call(
                "Runtime.evaluate",
                json!({"expression": js, "returnByValue": true, "awaitPromise": true}),
            )
            .await;
        r["result"]["value"].clone()
    }

    /// Opens `url` and waits until its document has loaded. The page shown
    /// before is marked first: until the navigation commits it is still
    /// there, complete, and must not pass for the new one (a CI run clicked
    /// in the old page when the console answered slowly).
    pub(crate) async fn goto(&mut self, url: &str) {
        self.eval("window.__lhLeaving = true").await;
        self.call("Page.navigate", json!({"url": url})).await;
        self.wait(
            "!window.__lhLeaving && document.readyState === 'complete' && location.href !== 'about:blank'",
            Duration::from_secs(20),
            "the page to load",
        )
        .await;
    }

    /// Waits until `js` is true in the page. A page navigating meanwhile
    /// (a form posted, a redirect) answers that its document went: not yet
    /// true, asked again in the next document.
    pub(crate) async fn wait(&mut self, js: &str, timeout: Duration, what: &str) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let r = self
                .try_call(
                    "Runtime.evaluate",
                    json!({"expression": format!("!!({js})"), "returnByValue": true, "awaitPromise": true}),
                )
                .await;
            match r {
                Ok(v) if v["result"]["value"] == json!(true) => return,
                Ok(_) => {}
                Err(e) if navigated(&e) => {}
                Err(e) => panic!("Runtime.evaluate: {e}"),
            }
            if tokio::time::Instant::now() > deadline {
                let dom = self
                    .eval("document.body ? document.body.innerText : ''")
                    .await;
                panic!(
                    "waited {timeout:?} for {what} ({js}); the page says:\n{}",
                    dom.as_str().unwrap_or("")
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Evaluates `js` in the page, or `None` while there is no page to
    /// evaluate it in (a navigation under way).
    async fn try_eval(&mut self, js: &str) -> Option<Value> {
        self.next += 1;
        let id = self.next;
        let m = json!({"id": id, "method": "Runtime.evaluate", "sessionId": self.session,
            "params": {"expression": js, "returnByValue": true, "awaitPromise": true}});
        self.send(&m.to_string()).await;
        // A page that is not there does not answer: asked again later.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        loop {
            let Ok(r) = tokio::time::timeout_at(deadline, self.recv()).await else {
                return None;
            };
            if r["id"].as_u64() == Some(id) {
                if r.get("error").is_some() || r["result"].get("exceptionDetails").is_some() {
                    return None;
                }
                return Some(r["result"]["result"]["value"].clone());
            }
        }
    }

    /// Runs `js` (a click, a step in the history) as navigation number
    /// `step`, and waits at most `bound` until another document has loaded
    /// completely: a new one, or one the back-forward cache kept (it still
    /// has the step it was left at). That document's URL, and whether it
    /// came from the cache.
    async fn navigate(
        &mut self,
        js: &str,
        step: u64,
        bound: Duration,
        what: &str,
    ) -> (String, bool) {
        let from = self
            .try_eval("location.href")
            .await
            .expect("a page to navigate from");
        let ok = self
            .try_eval(&format!(
                "(() => {{ window.__step = {step}; {js}; return true; }})()"
            ))
            .await;
        assert_eq!(
            ok,
            Some(json!(true)),
            "step {step} ({what}) could not start on {from}"
        );
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            let now = self
                .try_eval("document.readyState === 'complete' && window.__step !== undefined ? [location.href, window.__step] : document.readyState === 'complete' ? [location.href, null] : null")
                .await;
            if let Some(Value::Array(v)) = now {
                if v[1] != json!(step) {
                    return (v[0].as_str().unwrap_or("").to_string(), v[1].is_number());
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "step {step} ({what}) from {from}: no page loaded within {bound:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub(crate) async fn click(&mut self, selector: &str) {
        let ok = self
            .eval(&format!(
                "(() => {{ const e = document.querySelector({s}); if (!e) return false; e.click(); return true; }})()",
                s = json!(selector)
            ))
            .await;
        assert_eq!(ok, json!(true), "no element {selector} to click");
    }

    /// Confirms the action whose confirmation the page is asking for, and
    /// waits for its answer (`what` names it in a failure).
    pub(crate) async fn confirm(&mut self, what: &str) {
        self.wait(
            "document.querySelector('#confirm')",
            Duration::from_secs(10),
            "the confirmation",
        )
        .await;
        self.click("#confirm").await;
        self.wait(
            "document.querySelector('#done')",
            Duration::from_secs(15),
            what,
        )
        .await;
    }
}

// ---------------------------------------------------------------------------

#[tokio::test]
async fn console_in_a_browser_shows_a_research_job_progress_live_and_its_reclaim_after_a_kill9() {
    let env = Fleet::start().await;
    let (_sim, sim, _rules) = slow_sim("reclaim", 4).await;
    let renv = research_env(&sim);
    let mut w1 = env.worker_proc(&[], &renv);
    wait_log(&w1, "worker starting", Duration::from_secs(20)).await;
    let console = spawn_console(&env, &[]).await;
    let mut b = Browser::start().await;

    // The jobs page, open before the job exists.
    b.goto(&format!("{}/jobs", console.base)).await;
    b.eval("window.__noReload = 42").await;
    env.submit("research", research_spec(), "r-live").await;
    // The row appears and its sections progress, without a reload.
    b.wait(
        "document.querySelector('tr[data-id=\"r-live\"] .progress') && +document.querySelector('tr[data-id=\"r-live\"] .progress').dataset.done >= 1",
        Duration::from_secs(60),
        "r-live's first section on the jobs page",
    )
    .await;
    assert_eq!(
        b.eval("window.__noReload").await,
        json!(42),
        "the jobs page reloaded"
    );

    // Its timeline; then the worker is killed and another takes the job.
    b.goto(&format!("{}/jobs/r-live", console.base)).await;
    b.eval("window.__noReload = 43").await;
    b.wait(
        "document.querySelector('tr.ev-section')",
        Duration::from_secs(30),
        "a section in the timeline",
    )
    .await;
    w1.kill9();
    let w2 = env.worker_proc(&[], &renv);
    b.wait(
        "Array.from(document.querySelectorAll('tr.superseded')).some(r => r.innerText.includes('reclaim'))",
        Duration::from_secs(60),
        "the reclaim in the timeline",
    )
    .await;
    b.wait(
        "document.querySelectorAll('tr.ev-claimed').length >= 2",
        Duration::from_secs(10),
        "the second claim",
    )
    .await;
    b.wait(
        "document.querySelector('#summary .status') && document.querySelector('#summary .status').innerText === 'completed'",
        Duration::from_secs(120),
        "the job's completion in its summary",
    )
    .await;
    assert_eq!(
        b.eval("window.__noReload").await,
        json!(43),
        "the job page reloaded"
    );
    // Reload: the report is rendered from its artifact.
    b.goto(&format!("{}/jobs/r-live", console.base)).await;
    b.wait(
        "document.querySelector('article.report h1, article.report h2')",
        Duration::from_secs(10),
        "the report",
    )
    .await;
    let text = b
        .eval("document.querySelector('article.report').innerText")
        .await;
    assert!(
        text.as_str().unwrap().contains("Recovery"),
        "the report has its recovery appendix: {text}"
    );
    drop(w2);
}

#[tokio::test]
async fn console_in_a_browser_cancels_a_job_with_its_button_and_replays_a_dead_letter() {
    let env = Fleet::start().await;
    let w = env.worker_proc(&[], &[]);
    wait_log(&w, "worker starting", Duration::from_secs(20)).await;
    let console = spawn_console(&env, &[]).await;
    let mut b = Browser::start().await;

    env.submit("sleep", json!({"input": {"ms": 60000}}), "nap-ui")
        .await;
    env.wait_status("nap-ui", "running", Duration::from_secs(10))
        .await;
    b.goto(&format!("{}/jobs/nap-ui", console.base)).await;
    b.click("#cancel").await;
    b.confirm("the action's answer").await;
    let r = env
        .wait_status("nap-ui", "cancelled", Duration::from_secs(10))
        .await;
    assert_eq!(r.status, "cancelled");
    b.goto(&format!("{}/jobs/nap-ui", console.base)).await;
    b.wait(
        "document.querySelector('#summary .status').innerText === 'cancelled' && Array.from(document.querySelectorAll('tr.ev-action')).some(r => r.innerText.includes('cancel') && r.innerText.includes('local'))",
        Duration::from_secs(10),
        "the cancelled job with its action event naming who",
    )
    .await;

    // A dead job's letter (as a reaper leaves it), replayed from the DLQ page.
    let mut rec = JobRecord {
        id: "dead-ui".into(),
        kind: "echo".into(),
        status: "dead".into(),
        epoch: 4,
        stale_reclaims: 4,
        created_at: leasehold_testkit::record::now(),
        updated_at: leasehold_testkit::record::now(),
        ..Default::default()
    };
    rec.spec = Some(leasehold_testkit::record::JobSpec {
        input: json!({"back": true}).to_string(),
        ..Default::default()
    });
    env.jobs.create(&rec).await.unwrap();
    let seq = Dlq::new(&env.conn)
        .dead(
            &rec,
            "poison",
            "test: its workers stopped too often",
            vec![],
            None,
        )
        .await
        .unwrap();
    b.goto(&format!("{}/dlq", console.base)).await;
    b.click(&format!("tr[data-seq=\"{seq}\"] a.replay")).await;
    b.confirm("the replay's answer").await;
    let done = env
        .wait_status("dead-ui", "completed", Duration::from_secs(20))
        .await;
    assert_eq!(done.status, "completed");
    assert!(
        Dlq::new(&env.conn).get(seq).await.unwrap().is_none(),
        "the replayed letter is gone"
    );
}

/// Issue 30, item 5: every console page keeps a live connection (Server-
/// Sent Events), and a browser keeps 6 HTTP/1.1 connections per host; the
/// pages it left, kept in its back-forward cache, held theirs, so the
/// seventh page stopped loading. Clicked through 30 pages in a default
/// Chromium (its cache on), each page loads within a bound; pages the cache
/// gives back follow their live parts again.
#[tokio::test]
async fn console_in_a_browser_loads_30_pages_with_the_back_forward_cache_on() {
    let env = Fleet::start().await;
    let w = env.worker_proc(&[], &[]);
    wait_log(&w, "worker starting", Duration::from_secs(20)).await;
    let console = spawn_console(&env, &[]).await;
    for i in 0..5 {
        let id = format!("walk-{i}");
        env.submit("echo", json!({"input": {"n": i}}), &id).await;
        env.wait_status(&id, "completed", Duration::from_secs(20))
            .await;
    }
    env.submit("sleep", json!({"input": {"ms": 120000}}), "walk-nap")
        .await;
    env.wait_status("walk-nap", "running", Duration::from_secs(10))
        .await;
    let mut b = Browser::start().await;
    b.goto(&format!("{}/jobs", console.base)).await;

    let bound = Duration::from_secs(10);
    let click = |sel: &str| format!("document.querySelector({}).click()", json!(sel));
    let mut step = 0u64;
    let mut restored = 0;
    for i in 0..5 {
        let job = if i == 4 {
            "walk-nap".to_string()
        } else {
            format!("walk-{i}")
        };
        let other = ["/fleet", "/dlq", "/reviews", "/fleet", "/dlq"][i];
        let walk = [
            (
                click(&format!("tr[data-id=\"{job}\"] a")),
                format!("/jobs/{job}"),
                "a job from the list",
            ),
            (
                click(&format!("nav a[href=\"{other}\"]")),
                other.to_string(),
                "a page of the nav",
            ),
            (
                "history.back()".to_string(),
                format!("/jobs/{job}"),
                "back to the job",
            ),
            (
                "history.back()".to_string(),
                "/jobs".to_string(),
                "back to the list",
            ),
            (
                "history.forward()".to_string(),
                format!("/jobs/{job}"),
                "forward to the job",
            ),
            (
                click("nav a[href=\"/jobs\"]"),
                "/jobs".to_string(),
                "the list from the nav",
            ),
        ];
        for (js, want, what) in walk {
            step += 1;
            let (at, cached) = b.navigate(&js, step, bound, what).await;
            assert_eq!(
                at,
                format!("{}{want}", console.base),
                "step {step} ({what})"
            );
            restored += cached as u32;
        }
    }
    assert_eq!(step, 30);
    assert!(
        restored >= 5,
        "the back-forward cache gave back only {restored} of the 15 pages gone back or forward to: the test did not exercise it"
    );

    // A list the cache gives back follows again: a job submitted while it
    // was away, and one submitted once it is back, both appear.
    step += 1;
    b.navigate(&click("nav a[href=\"/fleet\"]"), step, bound, "the fleet")
        .await;
    env.submit("echo", json!({"input": {}}), "walk-away").await;
    env.wait_status("walk-away", "completed", Duration::from_secs(20))
        .await;
    step += 1;
    let (_, cached) = b
        .navigate("history.back()", step, bound, "back to the list")
        .await;
    assert!(cached, "the list came back from the cache");
    env.submit("echo", json!({"input": {}}), "walk-back").await;
    b.wait(
        "document.querySelector('tr[data-id=\"walk-away\"]') && document.querySelector('tr[data-id=\"walk-back\"].st-completed')",
        Duration::from_secs(20),
        "the jobs submitted while the list was cached and after it came back",
    )
    .await;
}

/// Reads SSE messages from `resp` until `stop` says so: (id, event, data).
pub(crate) async fn sse_until(
    resp: reqwest::Response,
    mut stop: impl FnMut(&(Option<u64>, String, Value)) -> bool,
) -> Vec<(Option<u64>, String, Value)> {
    let mut body = resp.bytes_stream();
    let mut buf = String::new();
    let mut out = Vec::new();
    loop {
        while let Some(i) = buf.find("\n\n") {
            let block: String = buf.drain(..i + 2).collect();
            let (mut id, mut ev, mut data) = (None, "message".to_string(), String::new());
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("id:") {
                    id = v.trim().parse().ok();
                } else if let Some(v) = line.strip_prefix("event:") {
                    ev = v.trim().to_string();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push_str(v.trim_start());
                }
            }
            if data.is_empty() {
                continue; // a keep-alive comment
            }
            let m = (id, ev, serde_json::from_str(&data).unwrap());
            let end = stop(&m);
            out.push(m);
            if end {
                return out;
            }
        }
        let chunk = tokio::time::timeout(Duration::from_secs(60), body.next())
            .await
            .expect("the stream went quiet")
            .expect("the stream ended")
            .unwrap();
        buf.push_str(&String::from_utf8_lossy(&chunk));
    }
}

#[tokio::test]
async fn console_client_stream_resumed_with_last_event_id_gets_exactly_the_events_after_it() {
    let env = Fleet::start().await;
    let (_sim, sim, _rules) = slow_sim("resume", 2).await;
    let w = env.worker_proc(&[], &research_env(&sim));
    wait_log(&w, "worker starting", Duration::from_secs(20)).await;
    let console = spawn_console(&env, &[]).await;
    env.submit("research", research_spec(), "r-sse").await;
    env.wait_status("r-sse", "running", Duration::from_secs(20))
        .await;
    let c = http();
    let url = format!("{}/v1/jobs/r-sse/events", console.base);
    // Read until the first section checkpoint (the middle of the job), then drop.
    let first = sse_until(c.get(&url).send().await.unwrap(), |(_, _, d)| {
        d["type"] == "section"
    })
    .await;
    let last_id = first.iter().rev().find_map(|m| m.0).unwrap();
    let resumed = sse_until(
        c.get(&url)
            .header("Last-Event-ID", last_id.to_string())
            .send()
            .await
            .unwrap(),
        |(_, e, _)| e == "end",
    )
    .await;
    let ids: Vec<u64> = resumed.iter().filter_map(|m| m.0).collect();
    // Everything the stream holds now, for comparison.
    let all: Vec<u64> = env
        .events
        .read("r-sse")
        .await
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    let after: Vec<u64> = all.iter().copied().filter(|s| *s > last_id).collect();
    assert_eq!(
        ids, after,
        "the resumed stream is exactly the events after {last_id}"
    );
    assert!(!ids.is_empty() && ids.windows(2).all(|w| w[0] < w[1]));
    let first_ids: Vec<u64> = first.iter().filter_map(|m| m.0).collect();
    assert_eq!(
        first_ids,
        all.iter()
            .copied()
            .filter(|s| *s <= last_id)
            .collect::<Vec<_>>()
    );
    // Each message's data is the event with its sequence.
    for (id, _, d) in resumed.iter().filter(|m| m.0.is_some()) {
        assert_eq!(d["seq"].as_u64(), *id);
        assert_eq!(d["job_id"], "r-sse");
    }
    assert_eq!(resumed.last().unwrap().2["status"], "completed");
    // The record and the report.
    let rec: Value = c
        .get(format!("{}/v1/jobs/r-sse", console.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(rec["status"], "completed");
    let report = c
        .get(format!("{}/v1/jobs/r-sse/result", console.base))
        .send()
        .await
        .unwrap();
    assert_eq!(report.status(), 200);
    assert!(report.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/markdown"));
    assert!(report.text().await.unwrap().starts_with('#'));
}

#[tokio::test]
async fn console_client_stream_says_when_a_reclaim_supersedes_progress() {
    let env = Fleet::start().await;
    let (_sim, sim, _rules) = slow_sim("supersede", 3).await;
    let renv = research_env(&sim);
    let mut w1 = env.worker_proc(&[], &renv);
    wait_log(&w1, "worker starting", Duration::from_secs(20)).await;
    let console = spawn_console(&env, &[]).await;
    env.submit("research", research_spec(), "r-sup").await;
    // The stream is for a job that exists (an unknown id is a 404): wait for
    // its record, then read its events from the first.
    env.wait_status("r-sup", "running", Duration::from_secs(20))
        .await;
    let c = http();
    let url = format!("{}/v1/jobs/r-sup/events", console.base);
    let resp = c.get(&url).send().await.unwrap();
    let mut killed = false;
    let mut w2 = None;
    let msgs = sse_until(resp, |(_, e, d)| {
        if !killed && d["type"] == "section" {
            w1.kill9();
            w2 = Some(env.worker_proc(&[], &renv));
            killed = true;
        }
        e == "end"
    })
    .await;
    let sup: Vec<&Value> = msgs
        .iter()
        .filter(|m| m.1 == "superseded")
        .map(|m| &m.2)
        .collect();
    assert!(
        sup.iter()
            .any(|s| s["reason"] == "reclaim" && s["epoch"].as_u64() >= Some(2)),
        "a superseded message for the reclaim: {sup:?}"
    );
    // It comes right before the claim of the new epoch.
    let i = msgs.iter().position(|m| m.1 == "superseded").unwrap();
    assert_eq!(msgs[i + 1].2["type"], "claimed");
    assert_eq!(msgs.last().unwrap().2["status"], "completed");
}

const OP: &str = "operator-token-0123456789";
const READ: &str = "reader-token-0123456789";
const KEY: &str = "sk-console-secret-4242424242";

#[tokio::test]
async fn console_auth_refuses_every_action_without_the_token_and_renders_no_secret() {
    let env = Fleet::start().await;
    let w = env.worker_proc(&[], &[("LH_API_KEY", KEY.into())]);
    wait_log(&w, "worker starting", Duration::from_secs(20)).await;
    let console = spawn_console(
        &env,
        &[
            ("LH_CONSOLE_TOKEN", READ.into()),
            ("LH_CONSOLE_OPERATOR_TOKEN", OP.into()),
            ("LH_API_KEY", KEY.into()),
        ],
    )
    .await;
    // A job whose input carries the key and a URL with credentials.
    env.submit(
        "sleep",
        json!({"input": {"ms": 60000, "note": KEY, "hook": format!("https://user:{KEY}@example.com/x")}}),
        "nap-auth",
    )
    .await;
    env.wait_status("nap-auth", "running", Duration::from_secs(10))
        .await;
    let c = http();
    let b = &console.base;
    // Without a token: nothing is served but the login form.
    for path in ["/jobs", "/jobs/nap-auth", "/fleet", "/dlq", "/reviews"] {
        let r = c.get(format!("{b}{path}")).send().await.unwrap();
        assert_eq!(r.status(), 303, "{path} without a token");
        assert_eq!(r.headers()["location"], "/login");
    }
    for path in [
        "/v1/jobs/nap-auth",
        "/v1/jobs/nap-auth/events",
        "/v1/jobs/nap-auth/result",
    ] {
        let r = c.get(format!("{b}{path}")).send().await.unwrap();
        assert_eq!(r.status(), 401, "{path} without a token");
    }
    let actions = [
        ("cancel", vec![("id", "nap-auth")]),
        ("review-resume", vec![("id", "nap-auth")]),
        ("review-fail", vec![("id", "nap-auth"), ("reason", "x")]),
        ("dlq-replay", vec![("seq", "1")]),
        ("dlq-delete", vec![("seq", "1")]),
        ("bulk-cancel", vec![("kind", "sleep")]),
        ("bulk-replay", vec![]),
        ("bulk-purge", vec![]),
    ];
    for (a, form) in &actions {
        let url = format!("{b}/actions/{a}");
        let none = c.post(&url).form(form).send().await.unwrap();
        assert_eq!(none.status(), 303, "{a} without a token: to the login form");
        let read = c
            .post(&url)
            .bearer_auth(READ)
            .form(form)
            .send()
            .await
            .unwrap();
        assert_eq!(read.status(), 403, "{a} with the read-only token");
        let bad = c
            .post(&url)
            .bearer_auth("not-the-token-at-all")
            .form(form)
            .send()
            .await
            .unwrap();
        assert_eq!(bad.status(), 303, "{a} with a wrong token");
        let confirm = c
            .get(format!("{b}/confirm?action={a}"))
            .bearer_auth(READ)
            .send()
            .await
            .unwrap();
        assert_eq!(
            confirm.status(),
            403,
            "{a}'s confirmation with the read-only token"
        );
    }
    // A browser's cookie without the page's CSRF field is refused.
    let cookie = format!("lh_console={OP}");
    let r = c
        .post(format!("{b}/actions/cancel"))
        .header("cookie", &cookie)
        .form(&[("id", "nap-auth")])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403, "a cookie's action without the CSRF field");
    assert_eq!(env.record("nap-auth").await.unwrap().status, "running");
    // No secret in any page, read-only or operator.
    for tok in [READ, OP] {
        for path in [
            "/jobs",
            "/jobs/nap-auth",
            "/fleet",
            "/dlq",
            "/reviews",
            "/v1/jobs/nap-auth",
            "/confirm?action=cancel&id=nap-auth",
        ] {
            if tok == READ && path.starts_with("/confirm") {
                continue; // refused above
            }
            let r = c
                .get(format!("{b}{path}"))
                .bearer_auth(tok)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{path}");
            let body = r.text().await.unwrap();
            assert!(!body.contains(KEY), "{path} shows the API key:\n{body}");
            assert!(
                !body.contains(OP) && !body.contains(READ),
                "{path} shows a console token"
            );
        }
    }
    // The operator token acts, and the action names who.
    let r = c
        .post(format!("{b}/actions/cancel"))
        .bearer_auth(OP)
        .form(&[("id", "nap-auth")])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    env.wait_status("nap-auth", "cancelled", Duration::from_secs(10))
        .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let evs = env.events_of("nap-auth").await;
        if let Some(a) = evs.iter().find(|e| e.r#type == "action") {
            let d = a.data_map();
            assert_eq!(d["action"], "cancel");
            assert_eq!(d["by"], "operator-token");
            assert_eq!(d["via"], "console");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "no action event");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn console_answers_bad_input_with_clear_errors() {
    let env = Fleet::start().await;
    let console = spawn_console(&env, &[("LH_CONSOLE_PAGE_MAX", "100".into())]).await;
    let c = http();
    let b = &console.base;
    let get = |p: &str| c.get(format!("{b}{p}")).send();
    let cases: &[(&str, u16, &str)] = &[
        ("/jobs/no-such-job", 404, "no job"),
        ("/v1/jobs/no-such-job", 404, "no job"),
        ("/v1/jobs/no-such-job/events", 404, "no job"),
        ("/v1/jobs/no-such-job/result", 404, "no job"),
        ("/jobs?status=bogus", 400, "is not a status"),
        ("/jobs?limit=abc", 400, "not a whole number"),
        ("/jobs?limit=100000", 400, "largest page"),
        ("/jobs?limit=0", 400, "outside"),
        ("/jobs?offset=-3", 400, "not a whole number"),
        ("/jobs?colour=red", 400, "unknown parameter"),
        ("/dlq?class=nope", 400, "is not a class"),
        ("/dlq?limit=1000", 400, "largest page"),
        ("/confirm?action=explode", 400, "unknown action"),
    ];
    for (p, status, says) in cases {
        let r = get(p).await.unwrap();
        assert_eq!(r.status().as_u16(), *status, "{p}");
        let body = r.text().await.unwrap();
        assert!(body.contains(says), "{p}: {body}");
    }
    // A bad Last-Event-ID on a job that exists.
    env.submit("echo", json!({"input": {}}), "e-bad").await;
    let mut rec = JobRecord {
        id: "e-bad".into(),
        kind: "echo".into(),
        status: "queued".into(),
        created_at: leasehold_testkit::record::now(),
        ..Default::default()
    };
    rec.updated_at = rec.created_at.clone();
    let _ = env.jobs.create(&rec).await;
    let r = c
        .get(format!("{b}/v1/jobs/e-bad/events"))
        .header("Last-Event-ID", "yesterday")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("Last-Event-ID"));
    let r = c
        .get(format!("{b}/v1/jobs/e-bad/result"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        409,
        "a job that has not ended has no result yet"
    );
}

#[tokio::test]
async fn console_fleet_shows_workers_slots_queue_reapers_and_dead_letters_and_updates_live() {
    let env = Fleet::start().await;
    let w = env.worker_proc(
        &[],
        &[
            ("LH_WORKER_ID", "fleet-w".into()),
            ("LH_CONCURRENCY", "7".into()),
        ],
    );
    wait_log(&w, "worker starting", Duration::from_secs(20)).await;
    let mut renv = env.proc_env();
    renv.push(("LH_REAPER_ID", "fleet-r".into()));
    renv.push(("LH_INTERVAL", "1s".into()));
    let reaper = Proc::spawn("leasehold-reaper", &[], &renv);
    wait_log(&reaper, "reaper starting", Duration::from_secs(20)).await;
    let rec = JobRecord {
        id: "fleet-dead".into(),
        kind: "echo".into(),
        status: "dead".into(),
        ..Default::default()
    };
    Dlq::new(&env.conn)
        .dead(&rec, "poison", "test", vec![], None)
        .await
        .unwrap();
    env.submit("sleep", json!({"input": {"ms": 60000}}), "fleet-nap")
        .await;
    env.wait_status("fleet-nap", "running", Duration::from_secs(10))
        .await;
    let console = spawn_console(&env, &[]).await;
    let c = http();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let body = c
            .get(format!("{}/fleet", console.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let ok = body.contains("<td>fleet-w</td>")
            && body.contains("<td>7</td>")
            && body.contains("fleet-r")
            && body.contains("/dlq?kind=echo\">1</a>")
            && body.contains("data-chart=\"throughput\"");
        if ok {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the fleet page lacks the worker, its slots, the reaper or the letter:\n{body}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // The live part sends the fragment again.
    let r = c
        .get(format!("{}/fleet/live", console.base))
        .send()
        .await
        .unwrap();
    let got = tokio::time::timeout(
        Duration::from_secs(15),
        sse_until(r, |(_, e, _)| e == "fleet"),
    )
    .await
    .expect("no fleet update within 15 s");
    assert!(got.last().unwrap().2["html"]
        .as_str()
        .unwrap()
        .contains("fleet-w"));
    drop(reaper);
}

#[tokio::test]
async fn console_timeline_shows_each_model_call_of_a_research_job_with_its_tokens_and_duration() {
    let env = Fleet::start().await;
    let (_sim, sim) = spawn_sim(&[]).await;
    let w = env.worker_proc(&[], &research_env(&sim));
    wait_log(&w, "worker starting", Duration::from_secs(20)).await;
    let console = spawn_console(&env, &[]).await;
    env.submit("research", research_spec(), "r-model").await;
    env.wait_status("r-model", "completed", Duration::from_secs(60))
        .await;

    // One `model` event per model call, of every phase, each with what the
    // provider reported and how long it took.
    let models: Vec<_> = env
        .events_of("r-model")
        .await
        .into_iter()
        .filter(|e| e.r#type == "model")
        .collect();
    assert!(!models.is_empty(), "no model events");
    for m in &models {
        let d = m.data_map();
        assert!(d["tokens_in"].as_u64().unwrap() > 0, "{d:?}");
        assert!(d["tokens_out"].as_u64().unwrap() > 0, "{d:?}");
        assert!(d["duration_ms"].is_u64(), "{d:?}");
        assert!(!d["model"].as_str().unwrap().is_empty(), "{d:?}");
        assert!(
            ["ok", "tool_calls"].contains(&d["outcome"].as_str().unwrap()),
            "{d:?}"
        );
        assert!(
            (d.get("expert").is_some_and(Value::is_u64)
                && d.get("index").is_some_and(Value::is_u64))
                || ["outline", "perspectives", "final"]
                    .contains(&d.get("phase").and_then(Value::as_str).unwrap_or("")),
            "{d:?}"
        );
        assert_eq!(m.epoch, 1);
    }
    for phase in ["outline", "perspectives", "final"] {
        assert!(
            models
                .iter()
                .any(|m| m.data_map().get("phase").and_then(Value::as_str) == Some(phase)),
            "no model event of the {phase} phase"
        );
    }
    // Sections that searched asked for tools first: both outcomes occur.
    let outcome = |o: &str| {
        models
            .iter()
            .filter(|m| m.data_map()["outcome"] == o)
            .count()
    };
    assert!(outcome("ok") > 0 && outcome("tool_calls") > 0, "{models:?}");

    // The timeline shows each of them with its tokens and duration.
    let first = models[0].data_map();
    let mut b = Browser::start().await;
    b.goto(&format!("{}/jobs/r-model?limit=500", console.base))
        .await;
    let rows = b
        .eval("Array.from(document.querySelectorAll('tr.ev-model')).map(r => r.innerText)")
        .await;
    let rows: Vec<String> = serde_json::from_value(rows).unwrap();
    assert_eq!(rows.len(), models.len(), "{rows:?}");
    let want = format!(
        "{} in / {} out tokens",
        first["tokens_in"], first["tokens_out"]
    );
    assert!(
        rows[0].contains(&want)
            && rows[0].contains(&format!("{} ms", first["duration_ms"]))
            && rows[0].contains(first["model"].as_str().unwrap()),
        "{want}: {rows:?}"
    );
}

#[tokio::test]
async fn console_in_a_browser_replays_a_rejected_submission_corrected_and_refuses_it_unchanged() {
    let env = Fleet::start().await;
    let w = env.worker_proc(&[], &[]);
    wait_log(&w, "worker starting", Duration::from_secs(20)).await;
    let console = spawn_console(&env, &[]).await;
    env.work
        .submit("echo", "{\"input\":[1,2".into(), Some("bad-ui"), None)
        .await
        .unwrap();
    env.wait_status("bad-ui", "rejected", Duration::from_secs(10))
        .await;
    let dlq = Dlq::new(&env.conn);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let seq = loop {
        let l = dlq.list().await.unwrap();
        if let Some(l) = l.iter().find(|l| l.job_id.as_deref() == Some("bad-ui")) {
            break l.seq;
        }
        assert!(tokio::time::Instant::now() < deadline, "no letter: {l:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    // Unchanged: refused with the validation error, nothing sent.
    let mut b = Browser::start().await;
    b.goto(&format!("{}/dlq", console.base)).await;
    b.click(&format!("tr[data-seq=\"{seq}\"] a.replay")).await;
    b.wait(
        "document.querySelector('#confirm') && document.querySelector('#spec')",
        Duration::from_secs(10),
        "the confirmation with the submission",
    )
    .await;
    let shown = b
        .eval("document.querySelector('#spec').value + ' | ' + document.querySelector('#reason').innerText")
        .await;
    let shown = shown.as_str().unwrap().to_string();
    assert!(shown.starts_with("{\"input\":[1,2 | "), "{shown}");
    assert!(
        shown.len() > "{\"input\":[1,2 | ".len(),
        "no reason shown: {shown}"
    );
    b.click("#confirm").await;
    b.wait(
        "document.querySelector('p.error') && document.querySelector('p.error').innerText.includes('still refused by the built-in validation')",
        Duration::from_secs(15),
        "the refusal with the validation error",
    )
    .await;
    assert!(dlq.get(seq).await.unwrap().is_some(), "the letter stays");
    assert_eq!(env.record("bad-ui").await.unwrap().status, "rejected");

    // Corrected in the textarea: replayed, run under the same id, the
    // letter gone, the action recorded.
    b.goto(&format!(
        "{}/confirm?action=dlq-replay&seq={seq}",
        console.base
    ))
    .await;
    b.eval(r#"document.querySelector('#spec').value = '{"input":{"fixed":true}}'"#)
        .await;
    b.click("#confirm").await;
    b.wait(
        "document.querySelector('#done') && document.querySelector('#done').innerText.includes('accepted by a worker')",
        Duration::from_secs(20),
        "the replay's answer",
    )
    .await;
    let done = env
        .wait_status("bad-ui", "completed", Duration::from_secs(20))
        .await;
    assert_eq!(done.result.unwrap().output, r#"{"fixed":true}"#);
    assert!(dlq.get(seq).await.unwrap().is_none(), "the letter is gone");
    let actions: Vec<_> = env
        .events_of("bad-ui")
        .await
        .into_iter()
        .filter(|e| e.r#type == "action")
        .map(|e| e.data_map())
        .collect();
    assert!(
        actions.iter().any(|a| a["action"] == "dlq_replay"
            && a["corrected"] == true
            && a["by"] == "local"
            && a["dlq_seq"] == seq),
        "{actions:?}"
    );
}

/// One HTTP/1.1 request written as it is (any `Host`), its answer: the
/// status, the head (lowercase) and the body.
async fn raw_http(base: &str, req: &str) -> (u16, String, String) {
    let addr = base.strip_prefix("http://").unwrap();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out))
        .await
        .expect("the console answered")
        .unwrap();
    let text = String::from_utf8_lossy(&out).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, head.to_ascii_lowercase(), body.to_string())
}

/// Review G9: a console without auth on loopback, reached by a hostile
/// page through DNS rebinding (`evil.test` resolving to 127.0.0.1: its
/// `Host` and `Origin` agree), neither reads a confirmation's CSRF field
/// nor runs the action; no page may be framed; the login cookie is
/// `Secure` behind TLS.
#[tokio::test]
async fn console_without_auth_refuses_a_rebound_host_and_is_never_framed() {
    let env = Fleet::start().await;
    let w = env.worker_proc(&[], &[]);
    wait_log(&w, "worker starting", Duration::from_secs(20)).await;
    let console = spawn_console(&env, &[]).await;
    env.submit("sleep", json!({"input": {"ms": 60000}}), "nap-rebind")
        .await;
    env.wait_status("nap-rebind", "running", Duration::from_secs(10))
        .await;
    let port = console.base.rsplit(':').next().unwrap().to_string();
    let get = |host: &str| {
        format!(
            "GET /confirm?action=bulk-cancel&kind=sleep HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        )
    };

    // Its own page, on a loopback name: the field, and headers refusing frames.
    let (st, head, body) = raw_http(&console.base, &get(&format!("127.0.0.1:{port}"))).await;
    assert_eq!(st, 200, "{body}");
    assert!(head.contains("x-frame-options: deny"), "{head}");
    assert!(
        head.contains("content-security-policy: frame-ancestors 'none'"),
        "{head}"
    );
    let csrf = csrf_of(&body);
    let (st, _, _) = raw_http(&console.base, &get(&format!("localhost:{port}"))).await;
    assert_eq!(st, 200, "localhost is a loopback name");

    // The rebound name: the page is refused, saying why.
    let evil = format!("evil.test:{port}");
    let (st, head, body) = raw_http(&console.base, &get(&evil)).await;
    assert_eq!(st, 403, "a rebound Host read the confirmation: {body}");
    assert!(body.contains("not a loopback name"), "{body}");
    assert!(head.contains("x-frame-options: deny"), "{head}");
    // And the action, with the field read through a loopback name.
    let form = format!("kind=sleep&csrf={csrf}");
    let post = format!(
        "POST /actions/bulk-cancel HTTP/1.1\r\nHost: {evil}\r\nOrigin: http://{evil}\r\n\
Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
        form.len()
    );
    let (st, _, body) = raw_http(&console.base, &post).await;
    assert_eq!(st, 403, "a rebound page ran bulk-cancel: {body}");
    // The API too (reads leak the jobs to the hostile page).
    let (st, _, body) = raw_http(
        &console.base,
        &format!("GET /v1/jobs/nap-rebind HTTP/1.1\r\nHost: {evil}\r\nConnection: close\r\n\r\n"),
    )
    .await;
    assert_eq!(st, 403, "{body}");
    assert!(body.starts_with('{'), "JSON for /v1/: {body}");
    let r = env.record("nap-rebind").await.unwrap();
    assert_eq!(r.status, "running");
    assert!(!r.cancel_requested, "nothing was cancelled");

    // With auth on, any Host is served (the token decides), and the login
    // cookie is Secure when the browser's page is https.
    let token = "a-read-token-of-16-chars".to_string();
    let authed = spawn_console(&env, &[("LH_CONSOLE_TOKEN", token.clone())]).await;
    let login = |origin: &str| {
        let form = format!("token={token}");
        format!(
            "POST /login HTTP/1.1\r\nHost: console.example\r\nOrigin: {origin}\r\n\
Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
            form.len()
        )
    };
    let (st, head, _) = raw_http(&authed.base, &login("https://console.example")).await;
    assert_eq!(st, 303, "{head}");
    let cookie = head
        .lines()
        .find(|l| l.starts_with("set-cookie:"))
        .unwrap()
        .to_string();
    assert!(cookie.contains("; secure"), "{cookie}");
    let (_, head, _) = raw_http(&authed.base, &login("http://console.example")).await;
    let cookie = head
        .lines()
        .find(|l| l.starts_with("set-cookie:"))
        .unwrap()
        .to_string();
    assert!(!cookie.contains("secure"), "{cookie}");
}

/// Review G14: an id is checked before it names a key or a subject. `*`,
/// `>` or a `.` would be wildcards or other tokens there (`$KV.lh_jobs.*`,
/// `lh.events.*.>`): one read-only GET would read or stream every job.
#[tokio::test]
async fn console_refuses_ids_that_would_be_wildcards_with_400() {
    let env = Fleet::start().await;
    let w = env.worker_proc(&[], &[]);
    wait_log(&w, "worker starting", Duration::from_secs(20)).await;
    let console = spawn_console(&env, &[]).await;
    for id in ["wild-1", "wild-2"] {
        env.submit("echo", json!({"input": {}}), id).await;
        env.wait_status(id, "completed", Duration::from_secs(20))
            .await;
    }
    let c = http();
    let b = &console.base;
    let page = c
        .get(format!("{b}/confirm?action=cancel&id=wild-1"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let csrf = csrf_of(&page);
    for id in ["%2A", "%3E", "wild-1.x", "wild%2B", "%C3%A9"] {
        for path in [
            format!("/jobs/{id}"),
            format!("/jobs/{id}/live"),
            format!("/v1/jobs/{id}"),
            format!("/v1/jobs/{id}/result"),
            format!("/v1/jobs/{id}/events"),
            format!("/confirm?action=cancel&id={id}"),
        ] {
            let r =
                tokio::time::timeout(Duration::from_secs(10), c.get(format!("{b}{path}")).send())
                    .await
                    .unwrap_or_else(|_| panic!("{path}: no answer (a stream of every job?)"))
                    .unwrap();
            let st = r.status();
            let body = tokio::time::timeout(Duration::from_secs(10), r.text())
                .await
                .unwrap_or_else(|_| panic!("{path}: {st}, a body that never ends"))
                .unwrap();
            assert_eq!(st, 400, "{path}: {body}");
            assert!(body.contains("invalid job id"), "{path}: {body}");
            assert!(!body.contains("wild-2"), "{path} shows another job: {body}");
        }
        let r = c
            .post(format!("{b}/actions/cancel"))
            .header("Origin", b.as_str())
            .form(&[
                ("id", id.replace("%2A", "*").replace("%3E", ">")),
                ("csrf", csrf.clone()),
            ])
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "POST /actions/cancel id={id}");
    }
    // A good id still answers.
    let r = c.get(format!("{b}/v1/jobs/wild-1")).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

/// Review G21: `tool` and `phase` events are a kind's own, so their `key`
/// may be any text. A non-ASCII one longer than 16 characters is shown
/// short by characters; sliced by bytes it panicked the job page and its
/// live stream.
#[tokio::test]
async fn console_shows_a_tool_event_with_a_non_ascii_key() {
    let env = Fleet::start().await;
    let w = env.worker_proc(&[], &[]);
    wait_log(&w, "worker starting", Duration::from_secs(20)).await;
    let console = spawn_console(&env, &[]).await;
    env.submit("sleep", json!({"input": {"ms": 60000}}), "key-utf8")
        .await;
    env.wait_status("key-utf8", "running", Duration::from_secs(10))
        .await;
    // As a kind's ctx would publish it: a key of 2-byte characters whose
    // 12th byte falls inside one.
    let key = "ключ-идемпотентности-заказа-42";
    let ev = leasehold_testkit::record::event(
        "key-utf8",
        1,
        "tool",
        Some("w"),
        json!({"tool": "charge", "kind": "effect", "step_id": "s1", "key": key, "ok": true}),
    );
    env.events.publish(&ev, None).await.unwrap();
    let c = http();
    let r = c
        .get(format!("{}/jobs/key-utf8", console.base))
        .send()
        .await
        .expect("the job page answers");
    assert_eq!(r.status(), 200);
    let body = r.text().await.unwrap();
    let short: String = key.chars().take(12).collect();
    assert!(body.contains(&format!("{short}…")), "{body}");
    // Its live stream carries the row too.
    let r = c
        .get(format!("{}/jobs/key-utf8/live", console.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let got = sse_until(r, |(_, ev, d)| {
        ev == "ev" && d["html"].as_str().unwrap_or("").contains(&short)
    })
    .await;
    assert!(!got.is_empty());
}

/// Review G15: an EventSource reconnects on its own after the stream
/// closes; resumed after `end` (`Last-Event-ID` = the terminal event), it
/// gets `end` again and the stream closes, instead of one that never ends
/// and holds a consumer.
#[tokio::test]
async fn console_client_stream_resumed_after_the_end_ends_again() {
    let env = Fleet::start().await;
    let w = env.worker_proc(&[], &[]);
    wait_log(&w, "worker starting", Duration::from_secs(20)).await;
    let console = spawn_console(&env, &[]).await;
    env.submit("echo", json!({"input": {"x": 1}}), "sse-end")
        .await;
    env.wait_status("sse-end", "completed", Duration::from_secs(20))
        .await;
    let c = http();
    let url = format!("{}/v1/jobs/sse-end/events", console.base);
    let all = sse_until(c.get(&url).send().await.unwrap(), |(_, ev, _)| ev == "end").await;
    let last = all
        .iter()
        .rev()
        .find_map(|(id, _, _)| *id)
        .expect("the terminal event's id");
    for resume in [last, last + 1_000] {
        let r = c
            .get(&url)
            .header("Last-Event-ID", resume.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let body = tokio::time::timeout(Duration::from_secs(10), r.text())
            .await
            .unwrap_or_else(|_| {
                panic!("resumed at {resume} after the end, the stream never closed")
            })
            .unwrap();
        assert!(body.contains("event: end"), "{body}");
        assert!(body.contains("\"completed\""), "{body}");
        assert!(!body.contains("id:"), "no event again: {body}");
    }
}

/// Review G15: an event whose data lives beside it (in the payloads
/// bucket) that cannot be read when the stream reaches it (a lagging
/// replica, a write not yet visible) is read again, not skipped: the
/// client gets it, in order, once the data is there.
#[tokio::test]
async fn console_client_stream_reads_again_an_event_whose_data_is_not_there_yet() {
    let env = Fleet::start().await;
    let w = env.worker_proc(&[], &[]);
    wait_log(&w, "worker starting", Duration::from_secs(20)).await;
    let console = spawn_console(&env, &[]).await;
    env.submit("sleep", json!({"input": {"ms": 60000}}), "sse-ref")
        .await;
    env.wait_status("sse-ref", "running", Duration::from_secs(10))
        .await;
    let c = http();
    let r = c
        .get(format!("{}/v1/jobs/sse-ref/events", console.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // The event names data whose chunk is not written yet.
    let ev = leasehold_testkit::record::event(
        "sse-ref",
        1,
        "tool",
        Some("w"),
        json!({"data_ref": "sse-ref-late", "chunks": 1, "bytes": 20}),
    );
    let seq = env.events.publish(&ev, None).await.unwrap();
    let after = leasehold_testkit::record::event(
        "sse-ref",
        1,
        "phase",
        Some("w"),
        json!({"phase": "after"}),
    );
    let next = env.events.publish(&after, None).await.unwrap();
    // The console has met the missing chunk...
    wait_log(
        &console._proc,
        "event data sse-ref-late of job sse-ref is missing chunk 0",
        Duration::from_secs(20),
    )
    .await;
    // ...and the chunk lands.
    let kv = env.conn.js.get_key_value("lh_payloads").await.unwrap();
    kv.put(
        "sse-ref-late.0",
        json!({"tool": "late", "key": "k"}).to_string().into(),
    )
    .await
    .unwrap();
    let got = sse_until(r, |(id, _, _)| *id == Some(next)).await;
    let ids: Vec<u64> = got.iter().filter_map(|(id, _, _)| *id).collect();
    let at = ids
        .iter()
        .position(|s| *s == seq)
        .unwrap_or_else(|| panic!("event {seq} was skipped: {ids:?}"));
    assert_eq!(ids[at + 1], next, "{ids:?}");
    let (_, _, d) = got.iter().find(|(id, _, _)| *id == Some(seq)).unwrap();
    assert_eq!(d["tool"], "late", "its data, resolved: {d}");
}

/// Review G14: a job page shows `limit` events and reads about that many,
/// not its whole history. Through a proxy that counts the console's pull
/// requests: a page of 10 events of a job with 4000 takes a pull or two
/// (the whole history took one per batch).
#[tokio::test]
async fn console_job_page_reads_the_events_it_shows_not_the_whole_history() {
    let env = Fleet::start().await;
    let proxy = leasehold_harness::proxy::FaultProxy::start(&env.url()).await;
    let console =
        start_console(&[("NATS_URL", proxy.url()), ("LH_PREFIX", env.prefix.clone())]).await;
    let base = console.1.clone();
    let rec = JobRecord {
        id: "long-story".into(),
        kind: "echo".into(),
        status: "running".into(),
        epoch: 1,
        created_at: leasehold_testkit::record::now(),
        updated_at: leasehold_testkit::record::now(),
        ..Default::default()
    };
    env.jobs.create(&rec).await.unwrap();
    let evs: Vec<_> = (0..4000)
        .map(|i| {
            leasehold_testkit::record::event(
                "long-story",
                1,
                "phase",
                Some("w"),
                json!({"phase": format!("p{i}")}),
            )
        })
        .collect();
    for ev in &evs {
        env.events.publish(ev, None).await.unwrap();
    }
    let c = http();
    // A first page, so the console's own connections are all set up.
    let r = c
        .get(format!("{base}/jobs/long-story?limit=10"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let pulls = "$JS.API.CONSUMER.MSG.NEXT.>";
    let before = proxy.published(pulls);
    let r = c
        .get(format!("{base}/jobs/long-story?limit=10"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body = r.text().await.unwrap();
    let pulled = proxy.published(pulls) - before;
    assert_eq!(body.matches("class=\"ev ev-phase\"").count(), 10, "{body}");
    assert!(body.contains("<b>p9</b>"), "{body}");
    assert!(!body.contains("<b>p10</b>"), "the 11th event is not shown");
    assert!(body.contains("later events"), "{body}");
    assert!(
        pulled <= 3,
        "a page of 10 events pulled {pulled} batches: the whole history was read"
    );
    // The next page starts after the last one shown.
    let next = body
        .split("later events")
        .next()
        .and_then(|s| s.rsplit("href=\"").next())
        .and_then(|s| s.split('"').next())
        .unwrap()
        .replace("&amp;", "&");
    let r = c.get(format!("{base}{next}")).send().await.unwrap();
    let body = r.text().await.unwrap();
    assert!(body.contains("<b>p10</b>"), "{body}");
    assert!(!body.contains("<b>p9</b>"), "{body}");
}

/// A job page or its live part starting after `after` (a later page, a
/// page given back by the back-forward cache following on after its last
/// row) judges the next claim against the last claim before `after`, as
/// the clients' stream does: a reclaim after a failed attempt is a
/// reclaim, not a retry.
#[tokio::test]
async fn console_job_page_resumed_after_a_claim_names_a_later_reclaim() {
    let env = Fleet::start().await;
    let console = spawn_console(&env, &[]).await;
    let rec = JobRecord {
        id: "resumed-tl".into(),
        kind: "echo".into(),
        status: "running".into(),
        epoch: 2,
        created_at: leasehold_testkit::record::now(),
        updated_at: leasehold_testkit::record::now(),
        ..Default::default()
    };
    env.jobs.create(&rec).await.unwrap();
    let ev = |epoch, ty: &str, data: Value| {
        leasehold_testkit::record::event("resumed-tl", epoch, ty, Some("w"), data)
    };
    let first = env
        .events
        .publish(
            &ev(1, "claimed", json!({"attempts": 0, "stale_reclaims": 0})),
            None,
        )
        .await
        .unwrap();
    env.events
        .publish(&ev(1, "phase", json!({"phase": "outline"})), None)
        .await
        .unwrap();
    // Epoch 2 after one failed attempt and then its owner's loss: a reclaim.
    env.events
        .publish(
            &ev(2, "claimed", json!({"attempts": 1, "stale_reclaims": 1})),
            None,
        )
        .await
        .unwrap();
    let c = http();
    let page = c
        .get(format!("{}/jobs/resumed-tl?after={first}", console.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("reclaim: drop"), "{page}");
    let r = c
        .get(format!(
            "{}/jobs/resumed-tl/live?after={first}",
            console.base
        ))
        .send()
        .await
        .unwrap();
    let got = sse_until(r, |(_, ev, d)| {
        ev == "ev" && d["html"].as_str().unwrap_or("").contains("superseded")
    })
    .await;
    let html = got.last().unwrap().2["html"].as_str().unwrap().to_string();
    assert!(html.contains("reclaim: drop"), "{html}");
}

/// Review G14: a bulk cancel from the browser lands on its operation's
/// page, which follows it to its end by reloading itself (each cancel here
/// waits the 3 s of an unanswered request, so the page first shows it
/// running).
#[tokio::test]
async fn console_in_a_browser_runs_a_bulk_cancel_and_its_page_follows_it_to_the_end() {
    let env = Fleet::start().await;
    let _deaf = env
        .conn
        .client
        .subscribe(env.conn.layout.cancel_subject("*"))
        .await
        .unwrap();
    let now = leasehold_testkit::record::now();
    for i in 0..3 {
        env.seed_record(&JobRecord {
            id: format!("bb-{i}"),
            kind: "echo".into(),
            status: "queued".into(),
            created_at: now.clone(),
            updated_at: now.clone(),
            ..Default::default()
        })
        .await;
    }
    let console = spawn_console(&env, &[]).await;
    let mut b = Browser::start().await;
    b.goto(&format!("{}/jobs?prefix=bb-", console.base)).await;
    b.click("a.button.danger[href*=\"bulk-cancel\"]").await;
    b.wait(
        "document.querySelector('#confirm')",
        Duration::from_secs(10),
        "the confirmation",
    )
    .await;
    b.click("#confirm").await;
    b.wait(
        "location.pathname.startsWith('/ops/') && document.querySelector('#progress')",
        Duration::from_secs(10),
        "the operation's page",
    )
    .await;
    b.wait(
        "document.querySelector('#progress').dataset.state === 'done' && document.querySelector('#progress').dataset.done === '3' && !document.querySelector('[data-refresh]')",
        Duration::from_secs(30),
        "the operation's page showing it done",
    )
    .await;
    for i in 0..3 {
        let r = env.record(&format!("bb-{i}")).await.unwrap();
        assert_eq!(r.status, "cancelled");
    }
}

/// Whether a DevTools error answer says the page's document went (it
/// navigated while it was asked).
fn navigated(answer: &Value) -> bool {
    let m = answer["error"]["message"].as_str().unwrap_or("");
    m.contains("navigated or closed") || m.contains("Execution context was destroyed")
}
