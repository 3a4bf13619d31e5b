//! The processes of a soak: the nats-server (one, or a 3-node cluster),
//! `leasehold-sim`, the workers (some behind fault proxies) and the reapers,
//! each started as a user would, with its log kept under the run's log
//! folder.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use leasehold_harness::{wait_for_jetstream, Cluster, FaultProxy, NatsServer, Proc};
use serde::Serialize;

/// Knobs the processes are started with.
#[derive(Debug, Clone)]
pub struct Settings {
    pub seed: u64,
    pub session_timeout: Duration,
    /// Concurrency of each worker slot (the last value repeats).
    pub concurrency: Vec<usize>,
    /// Kinds every worker serves.
    pub kinds: Vec<String>,
    pub model_fault_rate: f64,
    pub max_stale_reclaims: u32,
    /// `LH_RETENTION_KIND` of the reapers (empty: the default retention).
    pub retention_kind: String,
    /// `LH_INTERVAL` of the reapers.
    pub reaper_interval: String,
}

impl Settings {
    pub fn concurrency_of(&self, slot: usize) -> usize {
        self.concurrency
            .get(slot)
            .or(self.concurrency.last())
            .copied()
            .unwrap_or(1)
    }
}

/// One worker process from its start to its end: what the soak knows of
/// its life, to tell a live owner from a gone one afterwards.
#[derive(Debug, Clone, Serialize)]
pub struct Incarnation {
    pub slot: usize,
    pub id: String,
    pub generation: u32,
    /// The process's session (from its `worker starting` line).
    pub session: Option<String>,
    #[serde(serialize_with = "utc")]
    pub started: SystemTime,
    /// When the soak ended it, or first saw it ended.
    #[serde(serialize_with = "utc_opt")]
    pub ended: Option<SystemTime>,
    /// How it ended: killed or stopped by the soak, or exited by itself.
    pub how: Option<String>,
    #[serde(skip)]
    pub log: PathBuf,
}

fn utc<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&leasehold_core::time::rfc3339(*t))
}

fn utc_opt<S: serde::Serializer>(t: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => utc(t, s),
        None => s.serialize_none(),
    }
}

/// The environment a soak worker is started with: identity `id`, serving
/// `kinds` (comma-separated) with `concurrency` slots, connected to `url`.
pub fn worker_env(
    s: &Settings,
    url: String,
    sim: &str,
    id: &str,
    concurrency: usize,
    kinds: String,
) -> Vec<(&'static str, String)> {
    vec![
        ("NATS_URL", url),
        ("LH_WORKER_ID", id.to_string()),
        (
            "LH_SESSION_TIMEOUT",
            format!("{}ms", s.session_timeout.as_millis()),
        ),
        ("LH_PULL_EXPIRES", "500ms".into()),
        ("LH_DRAIN_TIMEOUT", "2s".into()),
        ("LH_CONCURRENCY", concurrency.to_string()),
        ("LH_KINDS", kinds),
        ("LH_DEV_KINDS", "1".into()),
        ("LH_MAX_ATTEMPTS", crate::plan::MAX_ATTEMPTS.to_string()),
        ("LH_RETRY_BASE", "500ms".into()),
        ("LH_RETRY_CAP", "5s".into()),
        ("LH_MAX_STALE_RECLAIMS", s.max_stale_reclaims.to_string()),
        ("LH_MODEL_BASE_URL", format!("{sim}/v1")),
        ("LH_SEARCH_URL", sim.to_string()),
        ("LH_PUBLISH_URL", format!("{sim}/effects")),
        ("LH_FETCH_ALLOW", "127.0.0.1".into()),
        ("LH_RESEARCH_RETRY_BASE", "200ms".into()),
        ("LH_RESEARCH_RETRY_CAP", "3s".into()),
        ("LH_RESEARCH_BREAKER_COOL_DOWN", "3s".into()),
        // The store's debug lines include every spurious 10164 retried.
        ("RUST_LOG", "info,leasehold_store=debug".into()),
    ]
}

/// The session id in a worker's `worker starting` line.
pub fn session_of(log: &str) -> Option<String> {
    let line = log.lines().find(|l| l.contains("worker starting"))?;
    let rest = line.split(" session=").nth(1)?;
    let id: String = rest
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
        .collect();
    (!id.is_empty()).then_some(id)
}

/// One worker slot: a process, restarted under the same or a new identity.
pub struct WorkerSlot {
    /// The identity of the current process.
    pub id: String,
    /// Processes started in this slot so far.
    pub generation: u32,
    pub proc: Option<Proc>,
    /// One proxy per server (empty: connected directly).
    pub proxies: Vec<FaultProxy>,
}

/// One reaper slot.
pub struct ReaperSlot {
    pub generation: u32,
    pub proc: Option<Proc>,
}

/// The servers: one, or three in a cluster.
pub enum Servers {
    Single(Option<NatsServer>),
    Cluster(Option<Cluster>),
}

pub struct Fleet {
    pub settings: Settings,
    pub logs: PathBuf,
    pub servers: Servers,
    /// Client URL(s) of the servers, fixed for the run (restarts keep ports).
    pub url: String,
    pub sim: Option<Proc>,
    pub sim_url: String,
    pub workers: Vec<WorkerSlot>,
    pub reapers: Vec<ReaperSlot>,
    /// Every worker process started, in order.
    pub incarnations: Vec<Incarnation>,
    /// Each server's log (rewritten at every restart, so copied first).
    server_logs: Vec<(String, PathBuf)>,
    /// Restarts per node so far.
    restarts: Vec<u32>,
}

impl Fleet {
    /// Starts the servers and waits for JetStream.
    pub async fn servers(settings: Settings, logs: &Path, cluster: bool) -> anyhow::Result<Fleet> {
        let servers = if cluster {
            let c = tokio::task::spawn_blocking(Cluster::start).await?;
            Servers::Cluster(Some(c))
        } else {
            let s = tokio::task::spawn_blocking(NatsServer::start).await?;
            Servers::Single(Some(s))
        };
        let (url, server_logs) = match &servers {
            Servers::Single(Some(s)) => (
                s.url(),
                vec![("nats".to_string(), s.store_dir().join("server.log"))],
            ),
            Servers::Cluster(Some(c)) => (
                c.url(),
                c.nodes
                    .iter()
                    .enumerate()
                    .map(|(i, n)| (format!("nats-n{i}"), n.store_dir().join("server.log")))
                    .collect(),
            ),
            _ => unreachable!(),
        };
        let first = url.split(',').next().unwrap_or_default().to_string();
        wait_for_jetstream(&first, Duration::from_secs(60)).await;
        Ok(Fleet {
            settings,
            logs: logs.to_path_buf(),
            servers,
            url,
            sim: None,
            sim_url: String::new(),
            workers: Vec::new(),
            reapers: Vec::new(),
            incarnations: Vec::new(),
            restarts: vec![0; server_logs.len()],
            server_logs,
        })
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self.servers, Servers::Cluster(_))
    }

    /// Each server's client URL.
    pub fn node_urls(&self) -> Vec<String> {
        self.url.split(',').map(str::to_string).collect()
    }

    /// Starts `leasehold-sim` with model faults at the configured rate.
    pub async fn start_sim(&mut self) -> anyhow::Result<()> {
        let p = Proc::spawn_logged(
            "leasehold-sim",
            &["--listen", "127.0.0.1:0"],
            &[
                ("LH_SIM_SEED", self.settings.seed.to_string()),
                (
                    "LH_SIM_FAULT_RATE",
                    self.settings.model_fault_rate.to_string(),
                ),
                // Truncated streams, error events, 429 with Retry-After, 5xx,
                // malformed tool arguments.
                (
                    "LH_SIM_FAULT_KINDS",
                    "cut,error_event,rate_limit,server_error,overloaded,malformed_args".into(),
                ),
                ("LH_SIM_TOKEN_DELAY_MS", "1".into()),
                // Longer than the publish tool's 10 s timeout, so a hang is a timeout.
                ("LH_SIM_EFFECTS_HANG", "11s".into()),
                ("RUST_LOG", "warn".into()),
            ],
            Some(self.logs.join("sim.log")),
        );
        let addr = p
            .wait_for_line("listening on ", Duration::from_secs(20))
            .await
            .map_err(anyhow::Error::msg)?;
        self.sim_url = format!("http://{addr}");
        self.sim = Some(p);
        Ok(())
    }

    /// Adds `n` worker slots; those in `proxied` get one fault proxy per server.
    pub async fn add_workers(&mut self, n: usize, proxied: &[usize]) -> anyhow::Result<()> {
        for slot in 0..n {
            let mut proxies = Vec::new();
            if proxied.contains(&slot) {
                for u in self.node_urls() {
                    proxies.push(FaultProxy::start(&u).await);
                }
            }
            self.workers.push(WorkerSlot {
                id: format!("soak-w{}", slot + 1),
                generation: 0,
                proc: None,
                proxies,
            });
            self.spawn_worker(slot, false);
        }
        Ok(())
    }

    /// Starts the process of a worker slot (the previous one must be gone),
    /// under the slot's identity or, with `new_id`, a new one.
    pub fn spawn_worker(&mut self, slot: usize, new_id: bool) {
        let s = &self.settings;
        let w = &mut self.workers[slot];
        w.generation += 1;
        if new_id {
            w.id = format!("soak-w{}-g{}", slot + 1, w.generation);
        }
        let url = if w.proxies.is_empty() {
            self.url.clone()
        } else {
            w.proxies
                .iter()
                .map(|p| p.url())
                .collect::<Vec<_>>()
                .join(",")
        };
        let kinds = s.kinds.join(",");
        let env = worker_env(s, url, &self.sim_url, &w.id, s.concurrency_of(slot), kinds);
        let log = self
            .logs
            .join(format!("worker{}.{}.log", slot + 1, w.generation));
        w.proc = Some(Proc::spawn_logged(
            "leasehold-worker",
            &[],
            &env,
            Some(log.clone()),
        ));
        self.incarnations.push(Incarnation {
            slot,
            id: w.id.clone(),
            generation: w.generation,
            session: None,
            started: SystemTime::now(),
            ended: None,
            how: None,
            log,
        });
    }

    /// Notes that the current process of worker `slot` ended (`how`), if
    /// it was not noted already.
    pub fn ended(&mut self, slot: usize, how: impl Into<String>) {
        if let Some(i) = self
            .incarnations
            .iter_mut()
            .rev()
            .find(|i| i.slot == slot)
            .filter(|i| i.ended.is_none())
        {
            i.ended = Some(SystemTime::now());
            i.how = Some(how.into());
        }
    }

    /// Worker slots (but `skip`) whose process exited by itself (not
    /// killed or taken out by the soak), with the exit status; each is
    /// noted as ended.
    pub fn exited_workers(&mut self, skip: Option<usize>) -> Vec<(usize, ExitStatus)> {
        let mut out = Vec::new();
        for slot in (0..self.workers.len()).filter(|s| Some(*s) != skip) {
            let st = self.workers[slot]
                .proc
                .as_mut()
                .and_then(|p| p.wait_timeout(Duration::ZERO));
            if let Some(st) = st {
                self.ended(slot, format!("exited by itself ({st})"));
                out.push((slot, st));
            }
        }
        out
    }

    /// Reads every worker's session from its log (once it has one).
    pub fn read_sessions(&mut self) {
        for i in self.incarnations.iter_mut().filter(|i| i.session.is_none()) {
            i.session = std::fs::read_to_string(&i.log)
                .ok()
                .and_then(|l| session_of(&l));
        }
    }

    /// Adds and starts `n` reapers.
    pub fn add_reapers(&mut self, n: usize) {
        for slot in 0..n {
            self.reapers.push(ReaperSlot {
                generation: 0,
                proc: None,
            });
            self.spawn_reaper(slot);
        }
    }

    pub fn spawn_reaper(&mut self, slot: usize) {
        let r = &mut self.reapers[slot];
        r.generation += 1;
        let env: Vec<(&str, String)> = vec![
            ("NATS_URL", self.url.clone()),
            (
                "LH_REAPER_ID",
                format!("soak-r{}-g{}", slot + 1, r.generation),
            ),
            ("LH_INTERVAL", self.settings.reaper_interval.clone()),
            ("LH_STRANDED_GRACE", "10s".into()),
            (
                "LH_MAX_STALE_RECLAIMS",
                self.settings.max_stale_reclaims.to_string(),
            ),
            ("RUST_LOG", "info,leasehold_store=debug".into()),
        ];
        let mut env = env;
        if !self.settings.retention_kind.is_empty() {
            env.push(("LH_RETENTION_KIND", self.settings.retention_kind.clone()));
        }
        let log = self
            .logs
            .join(format!("reaper{}.{}.log", slot + 1, r.generation));
        r.proc = Some(Proc::spawn_logged("leasehold-reaper", &[], &env, Some(log)));
    }

    /// SIGKILLs node `i` of the cluster (or the single server, `i == 0`).
    pub fn kill_node(&mut self, i: usize) {
        match &mut self.servers {
            Servers::Single(Some(s)) => s.kill(),
            Servers::Cluster(Some(c)) => c.nodes[i].kill(),
            _ => {}
        }
    }

    /// The configuration file node `i` (or the single server) runs with.
    fn node_conf(&self, i: usize) -> Option<PathBuf> {
        match &self.servers {
            Servers::Single(Some(s)) => Some(s.store_dir().join("nats.conf")),
            Servers::Cluster(Some(c)) => c.nodes.get(i).map(|n| n.store_dir().join("nats.conf")),
            _ => None,
        }
    }

    /// Stops node `i` as an operator would: SIGTERM, then waits for the
    /// process to exit (the harness only kills, so the process is found by
    /// the configuration file it was started with, which is this run's
    /// own). Falls back to SIGKILL when it does not exit within `timeout`;
    /// says what happened.
    pub async fn stop_node(&mut self, i: usize, timeout: Duration) -> Result<String, String> {
        let conf = self.node_conf(i).ok_or("no such node")?;
        let Some(pid) = pid_running(&conf) else {
            self.kill_node(i);
            return Err(format!(
                "no process runs {}; killed instead",
                conf.display()
            ));
        };
        let t0 = std::time::Instant::now();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .map_err(|e| e.to_string())?;
        if !sent.success() {
            self.kill_node(i);
            return Err(format!("kill -TERM {pid} failed; killed instead"));
        }
        // No exit to await from here: the harness owns the child; its
        // /proc entry says when it is gone (a zombie until reaped).
        while t0.elapsed() < timeout {
            if !process_runs(pid) {
                return Ok(format!(
                    "exited {:.1}s after SIGTERM",
                    t0.elapsed().as_secs_f64()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.kill_node(i);
        Err(format!("still running {timeout:?} after SIGTERM; killed"))
    }

    /// Starts node `i` again on its port and storage (blocking work off the
    /// async threads; a node that does not come up is reported, not a panic).
    pub async fn restart_node(&mut self, i: usize) -> anyhow::Result<()> {
        if let Some((name, path)) = self.server_logs.get(i) {
            self.restarts[i] += 1;
            let _ = std::fs::copy(
                path,
                self.logs
                    .join(format!("{name}.before-restart-{}.log", self.restarts[i])),
            );
        }
        let servers = std::mem::replace(&mut self.servers, Servers::Single(None));
        let (servers, res) = tokio::task::spawn_blocking(move || {
            let mut servers = servers;
            let res =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &mut servers {
                    Servers::Single(Some(s)) => s.restart(),
                    Servers::Cluster(Some(c)) => c.nodes[i].restart(),
                    _ => {}
                }));
            (servers, res)
        })
        .await?;
        self.servers = servers;
        res.map_err(|p| {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            anyhow::anyhow!("nats-server {i} did not restart: {msg}")
        })
    }

    /// Node indices that are down.
    pub fn nodes_down(&self) -> Vec<usize> {
        match &self.servers {
            Servers::Single(Some(s)) if !s.is_running() => vec![0],
            Servers::Cluster(Some(c)) => c
                .nodes
                .iter()
                .enumerate()
                .filter(|(_, n)| !n.is_running())
                .map(|(i, _)| i)
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Copies the servers' logs next to the processes' logs.
    pub fn save_server_logs(&self) {
        for (name, path) in &self.server_logs {
            let _ = std::fs::copy(path, self.logs.join(format!("{name}.log")));
        }
    }

    /// SIGTERM everything started here and wait a little; what remains is
    /// killed when dropped.
    pub async fn stop_all(&mut self) {
        for slot in 0..self.workers.len() {
            self.ended(slot, "stopped at the end of the run");
        }
        for w in &mut self.workers {
            for p in &w.proxies {
                p.thaw();
                p.refuse_new(false);
            }
            if let Some(p) = w.proc.as_mut() {
                p.cont();
                if p.alive() {
                    p.term();
                }
            }
        }
        for r in &mut self.reapers {
            if let Some(p) = r.proc.as_mut() {
                if p.alive() {
                    p.term();
                }
            }
        }
        let mut procs: Vec<Proc> = self
            .workers
            .iter_mut()
            .filter_map(|w| w.proc.take())
            .chain(self.reapers.iter_mut().filter_map(|r| r.proc.take()))
            .collect();
        let _ = tokio::task::spawn_blocking(move || {
            for p in &mut procs {
                if p.wait_timeout(Duration::from_secs(10)).is_none() {
                    p.kill9();
                }
            }
        })
        .await;
        self.sim = None;
        self.save_server_logs();
    }
}

/// The pid of the process (not a zombie) whose command line names `conf`.
fn pid_running(conf: &Path) -> Option<u32> {
    let want = conf.to_string_lossy().to_string();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let names = cmd.split(|b| *b == 0).any(|a| a == want.as_bytes());
        (names && process_runs(pid)).then_some(pid)
    })
}

/// Whether `pid` is a process that has not exited (zombies have).
fn process_runs(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name in parentheses.
        Ok(st) => st
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
            .is_some_and(|c| !matches!(c, 'Z' | 'X')),
        Err(_) => false,
    }
}

/// Waits until a process's log contains `needle`.
pub async fn wait_for_log(p: &Proc, needle: &str, timeout: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    while !p.output().contains(needle) {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{} did not log {needle:?} within {timeout:?}; its log: {}",
            p.name(),
            p.log.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Creates the run's log folder. A replay of the same seed never destroys
/// an earlier run's evidence: an existing folder (and report) is moved
/// aside with the time it was moved.
pub fn log_dir(out: &Path, seed: u64) -> anyhow::Result<PathBuf> {
    let d = out.join(format!("soak-{seed}-logs"));
    let report = out.join(format!("soak-{seed}.json"));
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|t| t.as_secs())
        .unwrap_or(0);
    for p in [&d, &report] {
        if p.exists() {
            let aside = PathBuf::from(format!("{}.before-{stamp}", p.display()));
            std::fs::rename(p, &aside).with_context(|| format!("moving {} aside", p.display()))?;
        }
    }
    std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_is_read_from_the_start_line() {
        let log = "2026-12-01T09:16:11.905662Z  INFO leasehold_worker::service: worker starting \
            worker_id=\"soak-w1\" session=3e8c14c9b00543a79db90ed5cff172b8 kinds=[\"echo\"] concurrency=8\n";
        assert_eq!(
            session_of(log).as_deref(),
            Some("3e8c14c9b00543a79db90ed5cff172b8")
        );
        assert_eq!(session_of("worker stopping session=x\n"), None);
    }
}
