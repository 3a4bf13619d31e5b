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

/// A free TCP port on 127.0.0.1 for a server a test starts, never handed
/// out twice by this process, and below the kernel's ephemeral range.
///
/// Why not `bind(":0")`: a killed server is restarted on its own port (a
/// cluster node's peers and clients know it), and while it is down an
/// ephemeral port is anyone's: the next `bind(":0")` of another test, or
/// the local end of any outgoing connection, may take it, and the restart
/// fails with "address in use". Ports below the ephemeral range are never
/// chosen by the kernel, and the ones this process has handed out are
/// skipped; a port another process holds is found taken and skipped too.
pub fn free_port() -> u16 {
    static NEXT: Mutex<Option<u16>> = Mutex::new(None);
    let (low, high) = own_port_range();
    let span = high - low;
    let mut next = NEXT.lock().unwrap();
    // Start at a place of this process's own, so two test processes at
    // once (a soak beside a suite) seldom walk the same ports.
    let mut p = next.unwrap_or(low + (std::process::id() % u32::from(span)) as u16);
    for _ in 0..span {
        let port = p;
        p = if p + 1 >= high { low } else { p + 1 };
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            *next = Some(p);
            return port;
        }
    }
    panic!("no free loopback port in {low}..{high}")
}

/// The ports [`free_port`] hands out: the 16,384 below the kernel's
/// ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`; 32768 when
/// it cannot be read), never below 1024.
fn own_port_range() -> (u16, u16) {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let high = ephemeral_low.max(2048);
    (high.saturating_sub(16_384).max(1024), high)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The ports handed out are distinct, bindable, and never the kernel's
    /// own (so no `bind(":0")` and no outgoing connection takes a stopped
    /// server's port before its restart).
    #[test]
    fn free_ports_are_distinct_and_below_the_ephemeral_range() {
        let (low, high) = own_port_range();
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        let distinct: BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "a port handed out twice");
        for p in &ports {
            assert!((low..high).contains(p), "{p} outside {low}..{high}");
        }
        let ephemeral = TcpListener::bind("127.0.0.1:0").unwrap();
        assert!(ephemeral.local_addr().unwrap().port() >= high);
    }
}
