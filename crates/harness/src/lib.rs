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
mod nats;
mod proc;
pub mod proxy;

pub use nats::*;
pub use proc::Proc;
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
