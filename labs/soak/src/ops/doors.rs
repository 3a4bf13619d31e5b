//! The doors (profile `operators`): every way into the product besides the
//! built-in kinds, driven during the faults, each with what must hold.
//!
//! - **SDK kind**: `invoice-worker` (examples/invoice, the Rust SDK) serves
//!   `invoice`: steps, a park an operator answers, and a write tool to an
//!   outside destination, a second `leasehold-sim` whose accounting system
//!   journals its books to a file (`LH_SIM_ACCOUNTING_STATE`) and counts
//!   the create requests per business key. The soak makes it commit then
//!   hang past the tool's timeout, or commit then die (kill -9 once it
//!   logged the commit, started again on its journal).
//! - **Python remote kind**: `soak-py` (labs/soak/py/soak_app.py, the
//!   Python SDK behind `LH_REMOTE_KINDS`): a step, an effect to the same
//!   destination, then two parks, each answered by the soak with its own
//!   answer; its service killed -9 after the destination committed the
//!   effect (the request still open), and started again.
//! - **Tenants and priorities**: a tenant limited to [`TENANT_JOBS`]
//!   running job (`leasehold limits set`) with jobs queued in its lanes at
//!   several priorities, long enough for the reapers' stranded-wait check.
//! - **Delayed jobs** (`delay`) and a **schedule** firing every second
//!   (`leasehold schedule add`), finer than the reapers' interval (2 s in
//!   this profile), removed before the end.
//! - **A replay of a poison job's large input**: a Python job with a
//!   20 KiB input (stored beside its record) held in a step while the soak
//!   kills its worker until it is dead as poison, then `dlq replay SEQ
//!   --spec` with a corrected small input.
//!
//! The invariants are in [`check`]: one effect per business key at the
//! destination, no park passed with another park's answer, no lane job
//! re-ticketed while it waits, no delayed job run early, every schedule
//! tick in the window fired exactly once.

use std::path::Path;

use leasehold_harness::free_port;

use super::*;

/// The SDK kind (served by `invoice-worker`).
pub const SDK_KIND: &str = "invoice";
/// The Python remote kind (labs/soak/py/soak_app.py).
pub const PY_KIND: &str = "soak-py";
/// The kinds of the doors, set up at the start next to the fleet's.
pub const KINDS: [&str; 2] = [SDK_KIND, PY_KIND];
/// The tenant with a running-jobs limit.
pub const TENANT: &str = "soak-t1";
/// The kind of its lane jobs.
const LANE_KIND: &str = "fail";
/// Its limit (`leasehold limits set --tenant T --jobs N`).
pub const TENANT_JOBS: u32 = 1;
/// Slot numbers the doors' workers are reported under (beyond the fleet's).
const SDK_SLOT: usize = OPS_SLOT + 1;
const PY_SLOT: usize = OPS_SLOT + 2;

/// What the destination does to one create.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DestFault {
    None,
    /// Commits, then hangs past the tool's timeout.
    CommitThenHang,
    /// Commits, then the process is killed -9 and started again.
    CommitThenDie,
}

/// When the doors are used (offsets from the start of the run).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DoorsPlan {
    /// The tenant's limit set and its lane jobs submitted.
    pub lanes_at_ms: u64,
    /// Lane jobs (`fail`, failing once): priority and how long each attempt takes.
    pub lane_jobs: Vec<(i32, u64)>,
    /// Delayed echo jobs: when submitted, and the delay.
    pub delayed: Vec<(u64, u64)>,
    /// The schedule added, and removed.
    pub schedule: (u64, u64),
    /// SDK jobs, one after another: the destination's fault, whether the
    /// job parks for an approval.
    pub sdk: Vec<(DestFault, bool)>,
    /// Python jobs, one after another: whether its service is killed once
    /// the destination committed its effect.
    pub python: Vec<bool>,
    pub destination_from_ms: u64,
}

/// The doors' plan for a run of length `run`: a pure function of the seed.
pub fn plan(seed: u64, run: Duration) -> DoorsPlan {
    let mut r = Rng::stream(seed, "doors");
    let run_ms = run.as_millis() as u64;
    let lane_jobs = [5, 1, 3, 2, 4, 1]
        .iter()
        .map(|p| (*p, r.range(2_000, 3_000)))
        .collect();
    let mut delayed: Vec<(u64, u64)> = (0..3)
        .map(|_| {
            (
                r.range(1_000, (run_ms / 2).max(2_000)),
                r.range(1_000, 4_000),
            )
        })
        .collect();
    delayed.sort();
    let add = r.range(2_000, 5_000);
    let remove = (run_ms * 3 / 4).max(add + 10_000);
    let mut sdk = vec![
        (DestFault::None, false),
        (DestFault::CommitThenHang, true),
        (DestFault::CommitThenDie, false),
        (DestFault::CommitThenDie, true),
    ];
    r.shuffle(&mut sdk);
    DoorsPlan {
        lanes_at_ms: r.range(1_000, 3_000),
        lane_jobs,
        delayed,
        schedule: (add, remove),
        sdk,
        python: vec![false, true],
        destination_from_ms: r.range(1_000, 3_000),
    }
}

/// The processes of the doors.
#[derive(Default)]
pub struct Doors {
    dest_port: u16,
    py_port: u16,
    dest: tokio::sync::Mutex<Option<Proc>>,
    py: tokio::sync::Mutex<Option<Proc>>,
    workers: Mutex<Vec<Proc>>,
    /// The worker of the Python kind (killed by the poison flow).
    py_worker: Mutex<Option<Proc>>,
    /// Restarts of the destination and of the Python service so far.
    restarts: Mutex<(u32, u32)>,
}

impl Doors {
    pub fn new() -> Self {
        Doors {
            dest_port: free_port(),
            py_port: free_port(),
            ..Default::default()
        }
    }

    fn dest_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.dest_port)
    }
}

/// The schedule's ticks the soak expects: every second from after the add
/// to before the remove.
#[derive(Debug, Clone, Serialize)]
pub struct TickWindow {
    pub name: String,
    /// Unix seconds, both included.
    pub first: u64,
    pub last: u64,
}

/// The Python interpreter: `LH_PYTHON` (a venv with the SDK installed, as
/// the tests take it), else `python3` with the checkout's SDK.
fn python() -> (String, bool) {
    match std::env::var("LH_PYTHON") {
        Ok(p) if !p.is_empty() => (p, true),
        _ => ("python3".into(), false),
    }
}

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

fn unix_s(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Ops {
    /// Starts every door's flows at their times.
    pub(super) fn start_doors(&self, p: &DoorsPlan) {
        let me = self.clone();
        let p2 = p.clone();
        self.spawn(async move { me.lanes(&p2).await });
        for (n, (at, delay)) in p.delayed.iter().enumerate() {
            let me = self.clone();
            let (at, delay) = (*at, *delay);
            self.spawn(async move {
                me.sleep_until(at).await;
                me.delayed(n, delay).await;
            });
        }
        let me = self.clone();
        let (add, remove) = p.schedule;
        self.spawn(async move { me.schedule(add, remove).await });
        let me = self.clone();
        let p2 = p.clone();
        self.spawn(async move { me.destination_flows(&p2).await });
    }

    fn text_args(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    /// Lane jobs of a tenant limited to one running job.
    async fn lanes(&self, p: &DoorsPlan) {
        self.sleep_until(p.lanes_at_ms).await;
        let f = self.flow(&format!("tenant {TENANT}"), "tenant_limit");
        let jobs = TENANT_JOBS.to_string();
        if let Err(e) = self
            .cli_until(
                "tenant",
                Self::text_args(&["limits", "set", "--tenant", TENANT, "--jobs", &jobs]),
                |_| false,
            )
            .await
        {
            self.problem(f, format!("limits set never succeeded: {e}"));
        }
        let mut set = JoinSet::new();
        for (n, (prio, ms)) in p.lane_jobs.iter().enumerate() {
            let me = self.clone();
            let (prio, ms) = (*prio, *ms);
            set.spawn(async move {
                let id = me.id("lane", n);
                let f = me.flow(&id, "lane");
                // Each fails its first attempt, so its retry waits in its
                // lane with a `queued` record (the due time of its backoff)
                // behind the tenant's others: a waiting job the reapers'
                // stranded check sees.
                let spec =
                    json!({"tenant": TENANT, "priority": prio, "input": {"ms": ms, "times": 1, "class": "retryable"}})
                        .to_string();
                if !me.submit(LANE_KIND, spec.into_bytes(), &id).await {
                    me.problem(f, "the submission was never accepted");
                    return;
                }
                // Six jobs one at a time: the last waits about 25 s, more
                // with faults; the patience is per wait.
                match me.wait_for(&id, |r| r.is_some_and(is_terminal)).await {
                    Ok(Some(r)) if r.status == "completed" => {}
                    Ok(r) | Err(r) => me.problem(f, format!("lane job: {}", status(r.as_ref()))),
                }
                me.done(f);
            });
        }
        // Meanwhile the default lane of the kind moves on (its consumer
        // delivers later tickets than the lane's): short jobs every second.
        let filler = {
            let me = self.clone();
            tokio::spawn(async move {
                for n in 0.. {
                    let id = me.id("lanefill", n);
                    let spec = json!({"input": {"times": 0, "class": "retryable"}}).to_string();
                    me.submit(LANE_KIND, spec.into_bytes(), &id).await;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            })
        };
        while set.join_next().await.is_some() {}
        filler.abort();
        self.done(f);
    }

    /// An echo job with a `delay`.
    async fn delayed(&self, n: usize, delay_ms: u64) {
        let id = self.id("delayed", n);
        let f = self.flow(&id, "delayed");
        let spec = json!({"delay": format!("{delay_ms}ms"), "input": {"delayed": n}}).to_string();
        if !self.submit("echo", spec.into_bytes(), &id).await {
            self.problem(f, "the submission was never accepted");
            return;
        }
        match self.wait_for(&id, |r| r.is_some_and(is_terminal)).await {
            Ok(Some(r)) if r.status == "completed" => {}
            Ok(r) | Err(r) => self.problem(f, format!("delayed job: {}", status(r.as_ref()))),
        }
        self.done(f);
    }

    fn schedule_name(&self) -> String {
        format!("soak-{}-op-tick", self.seed)
    }

    /// A schedule every second from `add` to `remove`.
    async fn schedule(&self, add: u64, remove: u64) {
        self.sleep_until(add).await;
        let name = self.schedule_name();
        let f = self.flow(&name, "schedule");
        let spec = json!({"input": {"tick": true}}).to_string();
        let args = Self::text_args(&[
            "schedule",
            "add",
            &name,
            "--cron",
            "* * * * * *",
            "echo",
            &spec,
        ]);
        if let Err(e) = self.cli_until(&name, args, |_| false).await {
            self.problem(f, format!("schedule add never succeeded: {e}"));
            return;
        }
        // Created before the command returned: the first tick counted is
        // the second after.
        let first = unix_s(SystemTime::now()) + 1;
        self.sleep_until(remove).await;
        // A reaper fires a tick within its interval (2 s here) and a
        // sweep: the last tick counted is 4 s before the remove.
        let last = unix_s(SystemTime::now()).saturating_sub(4);
        if let Err(e) = self
            .cli_until(
                &name,
                Self::text_args(&["schedule", "remove", &name]),
                |_| false,
            )
            .await
        {
            self.problem(f, format!("schedule remove never succeeded: {e}"));
        }
        self.state.lock().unwrap().ticks = Some(TickWindow { name, first, last });
        self.done(f);
    }

    /// Starts the destination (on its journal) and waits for it to listen.
    async fn start_destination(&self) -> Result<(), String> {
        let d = &self.doors;
        let n = {
            let mut r = d.restarts.lock().unwrap();
            r.0 += 1;
            r.0
        };
        let p = Proc::spawn_logged(
            "leasehold-sim",
            &["--listen", &format!("127.0.0.1:{}", d.dest_port)],
            &[
                (
                    "LH_SIM_ACCOUNTING_STATE",
                    self.logs.join("destination.jsonl").display().to_string(),
                ),
                // Past the write tools' 3 s timeout.
                ("LH_SIM_EFFECTS_HANG", "8s".into()),
                ("RUST_LOG", "warn".into()),
            ],
            Some(self.logs.join(format!("destination.{n}.log"))),
        );
        p.wait_for_line("listening on ", Duration::from_secs(20))
            .await?;
        *d.dest.lock().await = Some(p);
        Ok(())
    }

    /// Starts the Python service of [`PY_KIND`] and waits for it to listen.
    async fn start_python(&self) -> Result<(), String> {
        let d = &self.doors;
        let n = {
            let mut r = d.restarts.lock().unwrap();
            r.1 += 1;
            r.1
        };
        let (py, installed) = python();
        let here = repo().join("labs/soak/py").display().to_string();
        let path = if installed {
            here
        } else {
            format!("{here}:{}", repo().join("sdks/python/src").display())
        };
        let p = Proc::spawn_path(
            Path::new(&py),
            &["-m", "leasehold", "serve", "soak_app:app"],
            &[
                ("LEASEHOLD_PORT", d.py_port.to_string()),
                ("PYTHONPATH", path),
                ("SOAK_ACCOUNTING_URL", d.dest_url()),
                ("PYTHONUNBUFFERED", "1".into()),
            ],
            Some(self.logs.join(format!("python-service.{n}.log"))),
        );
        p.wait_for_line("listening on ", Duration::from_secs(30))
            .await?;
        *d.py.lock().await = Some(p);
        Ok(())
    }

    /// Starts a worker process of a door (`bin` serving `kinds`).
    fn start_door_worker(
        &self,
        bin: &str,
        slot: usize,
        kinds: &str,
        extra: &[(&'static str, String)],
    ) -> Proc {
        let mut st = self.state.lock().unwrap();
        let generation = st.incarnations.len() as u32 + 1;
        let id = format!("soak-door-{bin}-g{generation}");
        let mut env = worker_env(
            &self.settings,
            self.url.clone(),
            &self.sim_url,
            &id,
            4,
            kinds.into(),
        );
        env.extend(extra.iter().cloned());
        let log = self.logs.join(format!("{bin}.{generation}.log"));
        let p = Proc::spawn_logged(bin, &[], &env, Some(log.clone()));
        st.incarnations.push(Incarnation {
            slot,
            id,
            generation,
            session: None,
            started: SystemTime::now(),
            ended: None,
            how: None,
            log,
        });
        p
    }

    /// Starts the worker of the Python kind.
    fn start_py_worker(&self) {
        let p = self.start_door_worker(
            "leasehold-worker",
            PY_SLOT,
            "echo",
            &[(
                "LH_REMOTE_KINDS",
                format!("{PY_KIND}=http://127.0.0.1:{}/", self.doors.py_port),
            )],
        );
        *self.doors.py_worker.lock().unwrap() = Some(p);
    }

    /// Kills the worker of the Python kind (noted as ended).
    fn kill_py_worker(&self) {
        if let Some(mut p) = self.doors.py_worker.lock().unwrap().take() {
            p.kill9();
        }
        let mut st = self.state.lock().unwrap();
        if let Some(i) = st
            .incarnations
            .iter_mut()
            .rev()
            .find(|i| i.slot == PY_SLOT && i.ended.is_none())
        {
            i.ended = Some(SystemTime::now());
            i.how = Some("killed by the doors' poison flow (SIGKILL)".into());
        }
    }

    /// Arms the destination's next create with `mode`.
    async fn arm(&self, mode: &str) -> Result<(), String> {
        let r = reqwest::Client::new()
            .post(format!("{}/accounting/faults", self.doors.dest_url()))
            .json(&json!({"mode": mode, "times": 1}))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !r.status().is_success() {
            return Err(format!("arming {mode}: {}", r.status()));
        }
        Ok(())
    }

    /// Waits until the destination logged the commit of `number` (its
    /// create hangs now), up to the patience.
    async fn committed(&self, number: &str) -> bool {
        let deadline = Instant::now() + PATIENCE;
        let needle = format!("/{number}; hanging");
        while Instant::now() < deadline {
            if let Some(p) = self.doors.dest.lock().await.as_ref() {
                if p.output().contains(&needle) {
                    return true;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// The SDK and Python jobs, one after another (the destination's armed
    /// fault is the next create's).
    async fn destination_flows(&self, p: &DoorsPlan) {
        self.sleep_until(p.destination_from_ms).await;
        let f = self.flow("destination", "destination");
        if let Err(e) = self.start_destination().await {
            self.problem(f, format!("the destination did not start: {e}"));
            return;
        }
        if let Err(e) = self.start_python().await {
            self.problem(f, format!("the Python service did not start: {e}"));
        }
        let dest = self.doors.dest_url();
        let w = self.start_door_worker(
            "invoice-worker",
            SDK_SLOT,
            SDK_KIND,
            &[("INVOICE_ACCOUNTING_URL", dest.clone())],
        );
        self.doors.workers.lock().unwrap().push(w);
        self.start_py_worker();
        for (n, (fault, park)) in p.sdk.iter().enumerate() {
            self.sdk_job(n, *fault, *park).await;
        }
        for (n, kill) in p.python.iter().enumerate() {
            self.python_job(n, *kill).await;
        }
        self.poison_replay().await;
        self.done(f);
    }

    /// A Python job with a large input, made poison by killing its worker
    /// while it runs, then replayed with a corrected (small) spec: it must
    /// run the corrected input.
    async fn poison_replay(&self) {
        let id = self.id("poison", 0);
        let f = self.flow(&id, "replay");
        // Held long enough to be killed in, short enough that the original
        // input, run again, completes (and its output tells).
        let spec = json!({"input": {"hold_s": 8, "pad": "h".repeat(LARGE)}}).to_string();
        if !self.submit(PY_KIND, spec.into_bytes(), &id).await {
            self.problem(f, "the submission was never accepted");
            return;
        }
        let mut epoch = 0;
        for _ in 0..=(self.settings.max_stale_reclaims + 3) {
            match self
                .wait_for(&id, |r| {
                    r.is_some_and(|r| {
                        r.status == "dead" || (r.status == "running" && r.epoch > epoch)
                    })
                })
                .await
            {
                Ok(Some(r)) if r.status == "running" => {
                    epoch = r.epoch;
                    // In its step (the service holds it), then its worker dies.
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    self.kill_py_worker();
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    self.start_py_worker();
                }
                Ok(_) => break,
                Err(r) => {
                    self.problem(f, format!("never poison: {}", status(r.as_ref())));
                    return;
                }
            }
        }
        let dlq = Dlq::new(&self.conn);
        let Some(seq) = self.letter(&dlq, PY_KIND, "poison", &id, PATIENCE).await else {
            self.problem(f, "no poison letter for the job");
            return;
        };
        let corrected = json!({"fixed": "poison"});
        let file = self.logs.join(format!("{id}.spec.json"));
        let fixed = json!({"input": {"echo": corrected}}).to_string();
        if let Err(e) = std::fs::write(&file, fixed) {
            self.problem(f, format!("writing the corrected spec: {e}"));
            return;
        }
        let (s, path) = (seq.to_string(), file.display().to_string());
        let args = Self::text_args(&["dlq", "replay", &s, "--spec", &path]);
        if let Err(e) = self.cli_until(&id, args, |_| false).await {
            self.problem(f, format!("dlq replay --spec never succeeded: {e}"));
            return;
        }
        self.ran_corrected_input(f, &id, &corrected).await;
        self.done(f);
    }

    /// Answers the park of `id` with `answer` (`review resume --answer`).
    async fn answer(&self, f: usize, id: &str, answer: &Value) -> bool {
        let a = answer.to_string();
        match self
            .cli_until(
                id,
                Self::text_args(&["review", "resume", id, "--answer", &a]),
                |o| o.contains("allowed:"),
            )
            .await
        {
            Ok((0, _)) => true,
            Ok((_, out)) => {
                self.problem(f, format!("review resume refused: {}", out.trim()));
                false
            }
            Err(e) => {
                self.problem(f, format!("review resume never answered: {e}"));
                false
            }
        }
    }

    /// Kills the destination once `number` is committed, starts it again.
    async fn kill_destination_after(&self, f: usize, number: &str) {
        if !self.committed(number).await {
            self.problem(f, format!("the destination never committed {number}"));
            return;
        }
        if let Some(mut p) = self.doors.dest.lock().await.take() {
            p.kill9();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        if let Err(e) = self.start_destination().await {
            self.problem(f, format!("the destination did not start again: {e}"));
        }
    }

    /// One job of the SDK kind.
    async fn sdk_job(&self, n: usize, fault: DestFault, park: bool) {
        let id = self.id("sdk", n);
        let f = self.flow(&id, "sdk");
        let number = format!("R-{}-{n}", self.seed);
        let mut input = json!({"email": {"from": "ap@soak.test", "body": format!("Invoice {number} from Soak Rust: 250.00 EUR")}});
        if park {
            input["approval_over"] = json!(100);
        }
        if fault != DestFault::None {
            if let Err(e) = self.arm("commit_then_timeout").await {
                self.problem(f, e);
            }
        }
        let spec = json!({"input": input}).to_string();
        if !self.submit(SDK_KIND, spec.into_bytes(), &id).await {
            self.problem(f, "the submission was never accepted");
            return;
        }
        if park {
            match self
                .wait_for(&id, |r| {
                    r.is_some_and(|r| r.status == "parked" || is_terminal(r))
                })
                .await
            {
                Ok(Some(r)) if r.status == "parked" => {
                    if !self.answer(f, &id, &json!({"approve": true})).await {
                        return;
                    }
                }
                Ok(r) | Err(r) => {
                    self.problem(
                        f,
                        format!("never parked for approval: {}", status(r.as_ref())),
                    );
                    return;
                }
            }
        }
        if fault == DestFault::CommitThenDie {
            self.kill_destination_after(f, &number).await;
        }
        match self
            .wait_for(&id, |r| {
                r.is_some_and(|r| r.status == "parked" || is_terminal(r))
            })
            .await
        {
            Ok(Some(r)) if r.status == "completed" => {}
            // An uncertain effect the ledger parks for is the SDK keeping
            // its promise; answered as the destination says.
            Ok(r) | Err(r) => self.problem(f, format!("SDK job: {}", status(r.as_ref()))),
        }
        self.done(f);
    }

    /// One job of the Python kind: its effect, then two parks, each
    /// answered with its own answer.
    async fn python_job(&self, n: usize, kill: bool) {
        let id = self.id("py", n);
        let f = self.flow(&id, "python");
        let number = format!("P-{}-{n}", self.seed);
        if kill {
            if let Err(e) = self.arm("commit_then_timeout").await {
                self.problem(f, e);
            }
        }
        let spec = json!({"input": {"number": number, "supplier": "Soak Py"}}).to_string();
        if !self.submit(PY_KIND, spec.into_bytes(), &id).await {
            self.problem(f, "the submission was never accepted");
            return;
        }
        if kill {
            if self.committed(&number).await {
                if let Some(mut p) = self.doors.py.lock().await.take() {
                    p.kill9();
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
                if let Err(e) = self.start_python().await {
                    self.problem(f, format!("the Python service did not start again: {e}"));
                }
            } else {
                self.problem(f, format!("the destination never committed {number}"));
            }
        }
        let mut answered: Vec<Value> = Vec::new();
        loop {
            match self
                .wait_for(&id, |r| {
                    r.is_some_and(|r| r.status == "parked" || is_terminal(r))
                })
                .await
            {
                Ok(Some(r)) if r.status == "parked" && answered.len() < 4 => {
                    let reason = r.parked_reason.clone().unwrap_or_default();
                    let a = json!({"park": reason, "job": id});
                    if !self.answer(f, &id, &a).await {
                        break;
                    }
                    answered.push(a);
                    // The resumed job leaves this park: it is claimed again
                    // (a later epoch) before it can park at the next gate,
                    // which may take less than one look at the record, so
                    // a later park counts as leaving this one.
                    let epoch = r.epoch;
                    let _ = self
                        .wait_for(&id, |r| {
                            r.is_some_and(|r| r.status != "parked" || r.epoch > epoch)
                        })
                        .await;
                }
                Ok(Some(r)) if r.status == "completed" => break,
                Ok(r) | Err(r) => {
                    self.problem(f, format!("Python job: {}", status(r.as_ref())));
                    break;
                }
            }
        }
        self.state.lock().unwrap().flows[f].answers = answered;
        self.done(f);
    }

    /// The destination's count of creates per business key; then every
    /// door's process is stopped.
    pub(super) async fn stop_doors(&self) {
        let url = format!("{}/accounting/creates", self.doors.dest_url());
        let mut got = None;
        if self.doors.dest.lock().await.is_some() {
            for _ in 0..10 {
                let r = reqwest::Client::new()
                    .get(&url)
                    .timeout(Duration::from_secs(5))
                    .send()
                    .await;
                if let Ok(r) = r {
                    if let Ok(v) = r.json::<Value>().await {
                        got = Some(v);
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        let workers = std::mem::take(&mut *self.doors.workers.lock().unwrap());
        drop(workers);
        self.doors.py_worker.lock().unwrap().take();
        self.doors.py.lock().await.take();
        self.doors.dest.lock().await.take();
        let mut st = self.state.lock().unwrap();
        st.creates = got;
        let now = SystemTime::now();
        for i in st
            .incarnations
            .iter_mut()
            .filter(|i| i.slot > OPS_SLOT && i.ended.is_none())
        {
            i.ended = Some(now);
            i.how = Some("stopped at the end of the doors' flows".into());
        }
    }
}

/// Spans when no reaper could fire a tick: a server or node of the soak's
/// faults down (from the injection to `grace` after it was restored).
pub type Down = (SystemTime, SystemTime);

/// The doors' invariants.
pub(super) fn check(
    flows: &[Flow],
    c: &Collected,
    creates: Option<&Value>,
    ticks: Option<&TickWindow>,
    down: &[Down],
    bad: &mut dyn FnMut(&str, String),
) {
    // One effect per business key at the destination.
    let doors_ran = flows.iter().any(|f| f.what == "sdk" || f.what == "python");
    match creates.and_then(Value::as_array) {
        Some(list) => {
            for e in list {
                let n = e["creates"].as_u64().unwrap_or(0);
                if n != 1 {
                    bad(
                        &format!(
                            "{}/{}",
                            e["supplier"].as_str().unwrap_or(""),
                            e["number"].as_str().unwrap_or("")
                        ),
                        format!("one_effect_per_business_key: the write tool ran {n} times for this key at the destination (invoice {})", e["invoice"]),
                    );
                }
            }
        }
        None if doors_ran => bad(
            "destination",
            "one_effect_per_business_key: the destination's creates were never read".into(),
        ),
        None => {}
    }
    for fl in flows {
        let id = fl.id.as_str();
        let rv: Vec<&JobRecord> = c
            .audit
            .get(id)
            .into_iter()
            .flatten()
            .filter_map(|r| r.rec.as_ref())
            .collect();
        match fl.what {
            "python" => {
                // No park passed with another park's answer: each gate got
                // the answer given to it.
                let out = rv
                    .iter()
                    .rev()
                    .find(|r| r.status == "completed")
                    .and_then(|r| output(r));
                if let Some(out) = out {
                    let got = out["answers"].as_array().cloned().unwrap_or_default();
                    for (i, g) in got.iter().enumerate() {
                        let gate = format!("approve-{}", i + 1);
                        if g["park"].as_str() != Some(gate.as_str()) {
                            bad(id, format!("no_park_passed_with_another_answer: gate {gate} passed with the answer {g} (the operators answered {} parks: {:?})", fl.answers.len(), fl.answers));
                        }
                    }
                    if got.len() != 2 {
                        bad(id, format!("no_park_passed_with_another_answer: {} answers for 2 gates: {got:?}", got.len()));
                    }
                }
            }
            "lane" => {
                // No lane job re-ticketed while it waits: the ticket its
                // first queued revision names is the one it is claimed from.
                let mut ticket = 0;
                for r in rv.iter().take_while(|r| r.status == "queued") {
                    if ticket != 0 && r.ticket_seq != 0 && r.ticket_seq != ticket {
                        bad(id, format!("no_lane_job_reticketed: ticket {ticket} replaced by {} while it waited (epoch {})", r.ticket_seq, r.epoch));
                    }
                    if r.ticket_seq != 0 {
                        ticket = r.ticket_seq;
                    }
                }
                for (_, e) in c.events.get(id).into_iter().flatten() {
                    let d: Value = serde_json::from_str(&e.data).unwrap_or_default();
                    if e.r#type == "progress" && d["recovered"] == true && d["reason"] == "stranded"
                    {
                        bad(id, format!("no_lane_job_reticketed: a reaper gave it a fresh ticket ({}) at {}", d["ticket_seq"], e.at));
                    }
                }
            }
            "delayed" => {
                let due = rv
                    .iter()
                    .find_map(|r| r.next_run_at.as_deref())
                    .and_then(leasehold_core::time::parse_rfc3339);
                let ran = rv
                    .iter()
                    .find(|r| r.status == "running")
                    .and_then(|r| leasehold_core::time::parse_rfc3339(&r.updated_at));
                match (due, ran) {
                    (Some(due), Some(ran)) if ran < due => bad(
                        id,
                        format!(
                            "delayed_job_not_early: ran at {} before it was due at {}",
                            rfc3339(ran),
                            rfc3339(due)
                        ),
                    ),
                    (None, _) => bad(
                        id,
                        "delayed_job_not_early: no revision names when it is due".into(),
                    ),
                    _ => {}
                }
            }
            _ => {}
        }
    }
    // Every schedule tick in the window fired exactly once.
    if let Some(w) = ticks {
        let excused = |t: u64| {
            down.iter()
                .any(|(a, b)| unix_s(*a) <= t && t <= unix_s(*b) + 1)
        };
        for t in w.first..=w.last {
            let id = format!("{}-{t}", w.name);
            let revs = c.audit.get(&id);
            let created = revs.map_or(0, |v| {
                let mut n = 0;
                let mut prev_none = true;
                for r in v {
                    if r.rec.is_some() && prev_none {
                        n += 1;
                    }
                    prev_none = r.rec.is_none();
                }
                n
            });
            if created == 1 || (created == 0 && excused(t)) {
                continue;
            }
            bad(
                &id,
                format!(
                    "schedule_tick_fired_once: the tick at {} made {created} jobs",
                    rfc3339(SystemTime::UNIX_EPOCH + Duration::from_secs(t))
                ),
            );
        }
    }
}

use leasehold_core::time::rfc3339;

/// The doors' invariants by name, as their findings begin (the report
/// counts each, zero included).
pub const INVARIANTS: [&str; 6] = [
    "one_effect_per_business_key",
    "no_park_passed_with_another_answer",
    "replayed_ran_corrected_input",
    "schedule_tick_fired_once",
    "no_lane_job_reticketed",
    "delayed_job_not_early",
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collect::Rev;

    fn flow(id: &str, what: &'static str) -> Flow {
        Flow {
            id: id.into(),
            what,
            at_ms: 0,
            documents: Vec::new(),
            problems: Vec::new(),
            done: true,
            answers: Vec::new(),
        }
    }

    fn rec(id: &str, status: &str, ticket: u64) -> JobRecord {
        let mut r = leasehold_core::machine::new_record(
            id,
            "fail",
            Default::default(),
            0,
            SystemTime::now(),
        );
        r.status = status.into();
        r.ticket_seq = ticket;
        r
    }

    fn revs(c: &mut Collected, id: &str, recs: Vec<Option<JobRecord>>) {
        let v = recs
            .into_iter()
            .enumerate()
            .map(|(i, rec)| Rev {
                seq: i as u64 + 1,
                rec,
            })
            .collect();
        c.audit.insert(id.into(), v);
    }

    fn run(
        flows: &[Flow],
        c: &Collected,
        creates: Option<&Value>,
        ticks: Option<&TickWindow>,
    ) -> Vec<String> {
        let mut out = Vec::new();
        check(flows, c, creates, ticks, &[], &mut |j: &str, r: String| {
            out.push(format!("{j}: {r}"))
        });
        out
    }

    #[test]
    fn the_plan_is_a_pure_function_of_the_seed_and_keeps_inside_the_run() {
        let run = Duration::from_secs(60);
        for seed in 1..30 {
            let p = plan(seed, run);
            assert_eq!(p, plan(seed, run));
            assert!(p.schedule.0 < p.schedule.1 && p.schedule.1 < 60_000);
            assert!(p.sdk.iter().any(|(f, _)| *f == DestFault::CommitThenDie));
            assert!(p.sdk.iter().any(|(f, _)| *f == DestFault::CommitThenHang));
            assert!(p.python.contains(&true));
        }
    }

    #[test]
    fn a_key_created_twice_at_the_destination_is_a_finding() {
        let c = Collected::default();
        let flows = [flow("s", "sdk")];
        let one = json!([{"supplier": "A", "number": "1", "creates": 1, "invoice": "inv-1"}]);
        assert!(run(&flows, &c, Some(&one), None).is_empty());
        let two = json!([{"supplier": "A", "number": "1", "creates": 2, "invoice": "inv-1"}]);
        let f = run(&flows, &c, Some(&two), None);
        assert!(f[0].contains("one_effect_per_business_key"), "{f:?}");
        // Never read at all is a finding too, once the doors ran.
        assert_eq!(run(&flows, &c, None, None).len(), 1);
    }

    #[test]
    fn a_second_gate_passed_with_the_first_answer_is_a_finding() {
        let mut c = Collected::default();
        let mut done = rec("p", "completed", 1);
        done.result = Some(leasehold_proto::JobResult {
            output: json!({"answers": [{"park": "approve-1"}, {"park": "approve-1"}]}).to_string(),
            ..Default::default()
        });
        revs(&mut c, "p", vec![Some(done.clone())]);
        let f = run(&[flow("p", "python")], &c, None, None);
        assert!(
            f.iter().any(|x| x.contains("gate approve-2 passed")),
            "{f:?}"
        );
        done.result = Some(leasehold_proto::JobResult {
            output: json!({"answers": [{"park": "approve-1"}, {"park": "approve-2"}]}).to_string(),
            ..Default::default()
        });
        revs(&mut c, "p", vec![Some(done)]);
        let none = json!([]);
        assert!(run(&[flow("p", "python")], &c, Some(&none), None).is_empty());
    }

    #[test]
    fn a_lane_job_given_another_ticket_while_it_waits_is_a_finding() {
        let mut c = Collected::default();
        let waited = vec![
            Some(rec("l", "queued", 7)),
            Some(rec("l", "queued", 7)),
            Some(rec("l", "running", 7)),
            // A retry's fresh ticket after a claim is no re-ticket.
            Some(rec("l", "queued", 40)),
        ];
        revs(&mut c, "l", waited);
        assert!(run(&[flow("l", "lane")], &c, None, None).is_empty());
        revs(
            &mut c,
            "l",
            vec![Some(rec("l", "queued", 7)), Some(rec("l", "queued", 19))],
        );
        let f = run(&[flow("l", "lane")], &c, None, None);
        assert!(f[0].contains("ticket 7 replaced by 19"), "{f:?}");
    }

    #[test]
    fn every_tick_in_the_window_must_make_one_job() {
        let mut c = Collected::default();
        let w = TickWindow {
            name: "t".into(),
            first: 100,
            last: 102,
        };
        for t in [100, 102] {
            revs(
                &mut c,
                &format!("t-{t}"),
                vec![Some(rec("x", "completed", 1))],
            );
        }
        let f = run(&[], &c, None, Some(&w));
        assert_eq!(f.len(), 1, "{f:?}");
        assert!(f[0].starts_with("t-101: schedule_tick_fired_once"), "{f:?}");
        // Fired again after its job was removed: twice.
        revs(
            &mut c,
            "t-101",
            vec![
                Some(rec("x", "completed", 1)),
                None,
                Some(rec("x", "queued", 2)),
            ],
        );
        let f = run(&[], &c, None, Some(&w));
        assert!(f[0].contains("made 2 jobs"), "{f:?}");
    }
}
