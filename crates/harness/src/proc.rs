//! [`Proc`]: one of the workspace's binaries as a child process a test
//! can SIGKILL, SIGSTOP/SIGCONT or SIGTERM.

use super::*;

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
