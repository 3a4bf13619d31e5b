//! The README's commands, run as written: every ```sh block, line by line
//! and in order, in one shell against a fresh server, each line exiting 0.
//! One substitution, stated here: the README's `nats-server -js &` line is
//! the harness's server on a free port (`NATS_URL` points at it), so the
//! test never depends on port 4222 being free. `leasehold-sim` keeps the
//! README's 127.0.0.1:8089, which the workers' defaults point at.

use std::time::Duration;

use leasehold_harness::{bin_dir, wait_for_jetstream, NatsServer};

/// The ```sh blocks of `markdown`, each as its lines.
fn sh_blocks(markdown: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut cur: Option<Vec<String>> = None;
    for line in markdown.lines() {
        match (&mut cur, line.trim_end()) {
            (None, "```sh") => cur = Some(Vec::new()),
            (Some(_), "```") => out.push(cur.take().unwrap()),
            (Some(b), l) => b.push(l.to_string()),
            (None, _) => {}
        }
    }
    out
}

/// The shell script of the README: stops at the first failing line, names
/// it, and stops every process it started.
fn script(blocks: &[Vec<String>]) -> String {
    let mut s = String::from(
        "set -u\ntrap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null' EXIT\n\
         run() { echo \"+ $1\" >&2; eval \"$1\" || { rc=$?; echo \"README line failed (exit $rc): $1\" >&2; exit 1; }; }\n",
    );
    for line in blocks.iter().flatten() {
        let l = line.trim();
        if l.is_empty() || l.starts_with('#') || l.starts_with("nats-server ") {
            continue;
        }
        let cmd = l.split(" #").next().unwrap_or(l).trim_end();
        if let Some(bg) = cmd.strip_suffix('&') {
            // A background process: started, and its start given a moment
            // to fail visibly (a missing binary, a bad flag).
            let bg = bg.trim();
            s.push_str(&format!(
                "echo '+ {0} &' >&2\n{0} &\nsleep 1\nkill -0 $! 2>/dev/null || {{ echo 'README background process exited at once: {0}' >&2; exit 1; }}\n",
                bg.replace('\'', "'\\''")
            ));
            continue;
        }
        s.push_str(&format!("run '{}'\n", l.replace('\'', "'\\''")));
    }
    s
}

#[test]
fn the_readme_blocks_are_found_and_background_lines_recognised() {
    let md = "x\n```sh\na &   # bg\nb 'q' # c\n```\n```\nnot run\n```\n";
    let b = sh_blocks(md);
    assert_eq!(
        b,
        vec![vec!["a &   # bg".to_string(), "b 'q' # c".to_string()]]
    );
    let s = script(&b);
    assert!(s.contains("a &\nsleep 1"), "{s}");
    assert!(s.contains("run 'b '\\''q'\\'' # c'"), "{s}");
    assert!(!s.contains("not run"));
}

#[tokio::test]
async fn the_readmes_commands_work_as_written() {
    let server = NatsServer::start();
    wait_for_jetstream(&server.url(), Duration::from_secs(10)).await;
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("README.md");
    let blocks = sh_blocks(&readme);
    assert!(blocks.len() >= 3, "the README's sh blocks: {blocks:?}");
    let dir = tempfile::tempdir().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = tokio::time::timeout(
        Duration::from_secs(600),
        tokio::process::Command::new("bash")
            .arg("-c")
            .arg(script(&blocks))
            .current_dir(dir.path())
            .env("PATH", path)
            .env("NATS_URL", server.url())
            .env("RUST_LOG", "warn")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the README's commands took over 10 minutes")
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the README's commands failed:\n{}\n--- stdout ---\n{}",
        stderr,
        String::from_utf8_lossy(&out.stdout)
    );
    // It ran to the end: every block's last command was run.
    for b in &blocks {
        let last = b.iter().rev().find(|l| !l.trim().is_empty()).unwrap();
        let cmd = last
            .split(" #")
            .next()
            .unwrap()
            .trim_end()
            .trim_end_matches('&')
            .trim();
        assert!(
            stderr.contains(&format!("+ {cmd}")),
            "never ran {cmd:?}:\n{stderr}"
        );
    }
}
