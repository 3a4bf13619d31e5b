//! `leasehold events ID [--json] [--follow]`: a job's history as its events
//! tell it (claims, checkpoints, retries, tool calls, its end), oldest
//! first; `--follow` keeps printing new ones until the job ends.
//! `--children` prints the job's children instead: the tree its spawns
//! started, each child with its kind and state, to `--depth` levels.

use std::time::Duration;

use leasehold_core::JobRecord;
use leasehold_core::Status;
use leasehold_proto::JobEvent;
use leasehold_store::children;
use leasehold_store::events::Events;
use leasehold_store::{Jobs, NatsArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The job id.
    id: String,
    /// One JSON object per event (its data parsed) instead of a line of text.
    #[arg(long)]
    json: bool,
    /// Keep printing new events until the job ends (or is parked).
    #[arg(long)]
    follow: bool,
    /// Print the job's children instead (the jobs its spawns started), as
    /// a tree: each with its kind and state (and its error, or what it
    /// waits for), its own children under it. With `--json`, one object
    /// per child: `id`, `parent`, `depth`, `kind`, `status`, `error`,
    /// `waiting`.
    #[arg(long, conflicts_with = "follow")]
    children: bool,
    /// How many levels of children `--children` shows.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=8), requires = "children")]
    depth: u32,
}

/// Children shown per job by `--children`, at most.
const CHILDREN_SHOWN: usize = 200;

/// How often `--follow` looks for new events.
const FOLLOW_EVERY: Duration = Duration::from_millis(500);

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    let conn = nats.connect("leasehold-cli events").await?;
    let jobs = super::open_jobs(&conn).await?;
    let events = Events::new(&conn);
    if a.children {
        return children(&jobs, &events, &a).await;
    }
    let mut seen = events.read(&a.id).await?;
    if seen.is_empty() && jobs.get(&a.id).await?.is_none() {
        eprintln!(
            "error: no job {} (`leasehold list` shows the active jobs)",
            a.id
        );
        return Ok(1);
    }
    let mut last = 0;
    for (seq, ev) in seen.drain(..) {
        print(&ev, a.json)?;
        last = seq;
    }
    if !a.follow {
        return Ok(0);
    }
    loop {
        let ended = jobs.get(&a.id).await?.is_some_and(|v| {
            v.value
                .status
                .parse::<Status>()
                .is_ok_and(|s| s.is_terminal() || s == Status::Parked)
        });
        for (seq, ev) in events.read_from(&a.id, last + 1).await? {
            print(&ev, a.json)?;
            last = seq;
        }
        tokio::time::sleep(FOLLOW_EVERY).await;
        if ended {
            // The end's event follows the record's last write: one more look.
            for (_, ev) in events.read_from(&a.id, last + 1).await? {
                print(&ev, a.json)?;
            }
            break;
        }
    }
    Ok(0)
}

fn print(ev: &JobEvent, json: bool) -> anyhow::Result<()> {
    if json {
        let data: serde_json::Value =
            serde_json::from_str(&ev.data).unwrap_or(serde_json::Value::String(ev.data.clone()));
        println!(
            "{}",
            serde_json::json!({"at": ev.at, "epoch": ev.epoch, "type": ev.r#type, "worker_id": ev.worker_id, "data": data})
        );
    } else {
        let mut data: String = ev.data.chars().take(160).collect();
        if ev.data.chars().count() > 160 {
            data.push('…');
        }
        println!(
            "{}  e{}  {:<14} {:<16} {}",
            ev.at,
            ev.epoch,
            ev.r#type,
            ev.worker_id.as_deref().unwrap_or("-"),
            data
        );
    }
    Ok(())
}

/// `--children`: the tree of the job's children, depth first.
async fn children(jobs: &Jobs, events: &Events, a: &Args) -> anyhow::Result<i32> {
    let Some(root) = jobs.get(&a.id).await?.map(|v| v.value) else {
        eprintln!(
            "error: no job {} (`leasehold list` shows the active jobs)",
            a.id
        );
        return Ok(1);
    };
    if !a.json {
        println!("{}  {}  {}", root.id, root.kind, state(Some(&root)));
    }
    // (parent, depth, its children's line prefix)
    let mut stack = vec![(root.id.clone(), 1u32, String::new())];
    let mut any = false;
    while let Some((parent, depth, prefix)) = stack.pop() {
        let (n, shown) = children::listed(jobs, events, &parent, CHILDREN_SHOWN).await?;
        any |= n > 0;
        let more = n - shown.len();
        let mut below = Vec::new();
        for (i, c) in shown.iter().enumerate() {
            let last = i + 1 == shown.len() && more == 0;
            if a.json {
                let r = c.record.as_ref();
                println!(
                    "{}",
                    serde_json::json!({
                        "id": c.id, "parent": parent, "depth": depth, "kind": c.kind,
                        "status": c.status(),
                        "error": r.and_then(|r| r.error.as_ref()).map(|e| serde_json::json!({"class": e.class, "message": e.message})),
                        "waiting": r.filter(|r| r.status == "waiting").map(leasehold_core::machine::waits_for),
                    })
                );
            } else {
                println!(
                    "{prefix}{} {}  {}  {}",
                    if last { "└─" } else { "├─" },
                    c.id,
                    c.kind,
                    state(c.record.as_ref())
                );
            }
            if depth < a.depth && c.record.is_some() {
                let p = format!("{prefix}{}", if last { "   " } else { "│  " });
                below.push((c.id.clone(), depth + 1, p));
            }
        }
        if more > 0 && !a.json {
            println!("{prefix}└─ … and {more} more (the console's page of {parent} lists its children by state)");
        }
        // Depth first, in order: the first child's subtree next.
        stack.extend(below.into_iter().rev());
    }
    if !any && !a.json {
        println!("(no children: {} spawned none)", a.id);
    }
    Ok(0)
}

/// A job's state in a line: its status, with its error or what it waits for.
fn state(r: Option<&JobRecord>) -> String {
    let Some(r) = r else {
        return "queued (no worker took it yet)".into();
    };
    match (&r.error, r.status.as_str()) {
        (_, "waiting") => format!("waiting {}", leasehold_core::machine::waits_for(r)),
        (Some(e), s) if s != "completed" => format!("{s}: {}: {}", e.class, e.message),
        (_, s) => s.to_string(),
    }
}
