//! `leasehold-demo --screenshots DIR` (`make screenshots`): the console's
//! pages photographed by headless Chromium once the demo's jobs are done,
//! so the pictures in `docs/` show what a fresh run shows: the job that was
//! killed -9 mid-section (its waterfall marks what the reclaim repeated),
//! the fleet's charts and a search over the finished jobs, at 1280 px and
//! a phone's 390 px, in the light and the dark theme.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context as _};
use leasehold_harness::Proc;

/// One picture: a page of the console, the window it is taken in.
pub struct Shot {
    /// The file's name without `.png`.
    pub name: String,
    /// The page's path and query on the console.
    pub path: String,
    pub width: u32,
    pub height: u32,
    pub dark: bool,
}

impl Shot {
    pub fn new(name: &str, path: &str, width: u32, height: u32, dark: bool) -> Shot {
        Shot {
            name: name.into(),
            path: path.into(),
            width,
            height,
            dark,
        }
    }
}

/// The pictures `docs/` shows: `killed` is the job the demo killed -9
/// mid-section.
pub fn docs_shots(killed: &str) -> Vec<Shot> {
    let job = format!("/jobs/{killed}");
    vec![
        Shot::new("jobs", "/jobs", 1280, 900, false),
        Shot::new("job-waterfall", &job, 1280, 1500, false),
        Shot::new("job-waterfall-dark", &job, 1280, 1500, true),
        Shot::new("job-phone", &job, 390, 1400, false),
        Shot::new("fleet-charts", "/fleet", 1280, 1900, false),
        Shot::new("fleet-charts-dark", "/fleet", 1280, 1900, true),
        Shot::new(
            "search",
            "/history?status=completed&kind=research&from=1h",
            1280,
            900,
            false,
        ),
    ]
}

/// Takes each shot of the console at `base` (e.g. `http://127.0.0.1:8090`)
/// into `dir`, one Chromium process each (a page keeps its live stream
/// open, so loading is stopped after 4 s, then photographed); returns the files.
pub fn take(dir: &Path, base: &str, shots: &[Shot]) -> anyhow::Result<Vec<PathBuf>> {
    let chromium = leasehold_harness::chromium().map_err(anyhow::Error::msg)?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let profile = tempfile::tempdir()?;
    let mut out = Vec::new();
    for s in shots {
        let file = dir.join(format!("{}.png", s.name));
        let _ = std::fs::remove_file(&file);
        let mut args = vec![
            "--headless".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-dev-shm-usage".into(),
            "--hide-scrollbars".into(),
            "--no-first-run".into(),
            format!("--user-data-dir={}", profile.path().display()),
            format!("--window-size={},{}", s.width, s.height),
            // A page keeps its live stream open: stop loading after 4 s.
            "--timeout=4000".into(),
            format!("--screenshot={}", file.display()),
        ];
        if s.dark {
            args.push("--force-dark-mode".into());
        }
        args.push(format!("{base}{}", s.path));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut p = Proc::spawn_path(&chromium, &args, &[], None);
        match p.wait_timeout(Duration::from_secs(60)) {
            Some(st) if st.success() && file.is_file() => out.push(file),
            Some(st) => bail!("chromium could not photograph {} ({st})", s.path),
            None => {
                p.kill9();
                bail!("chromium took over 60 s to photograph {}", s.path)
            }
        }
    }
    Ok(out)
}
