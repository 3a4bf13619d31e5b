//! `leasehold list`: the jobs that are not finished, from the index of
//! active jobs (the cost follows the active jobs, not the history; a page
//! newest first reads only the index's end, so it costs its rows and what
//! changed since they were created); `--all`
//! scans every record instead; `--finished` searches the history of
//! finished jobs a page at a time (`finished.rs`).

use anyhow::bail;
use leasehold_core::{JobRecord, Status};
use leasehold_store::index::Filter;
use leasehold_store::NatsArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Only jobs in this status. `queued`, `running`, `parked` and
    /// `waiting` (a durable timer or a signal: what it waits for, until
    /// when, and its step, are shown) are
    /// read from the index of active jobs; a finished status needs `--finished`
    /// (the history) or `--all`.
    #[arg(long)]
    pub(crate) status: Option<String>,
    /// Only jobs of this kind.
    #[arg(long)]
    pub(crate) kind: Option<String>,
    /// Only running jobs of this worker.
    #[arg(long, conflicts_with = "finished")]
    worker: Option<String>,
    /// At most this many jobs (with `--finished`: 1 to 1000); `--after`
    /// continues.
    #[arg(long, default_value_t = 100)]
    pub(crate) limit: usize,
    /// Start after this job (the last id of the previous page, in the
    /// same `--sort` order); with `--finished`, the cursor the previous
    /// page printed.
    #[arg(long)]
    pub(crate) after: Option<String>,
    /// Order: `newest` (submitted last first), `oldest`, or `id`.
    #[arg(long, value_enum, default_value_t = Sort::Newest)]
    sort: Sort,
    /// Every record ever kept, finished ones too (a scan of the whole
    /// bucket: slow on a long history).
    #[arg(long, conflicts_with = "finished")]
    all: bool,
    /// Search the history of finished jobs (completed, failed, cancelled,
    /// dead, rejected) instead of the active ones, without reading the
    /// records: by --status, --kind, --tenant, --class, --since, --until
    /// and --id-prefix, oldest end first, a page of --limit at a time.
    /// Prints how many matched and the command of the next page. E.g.
    /// last Tuesday's failed jobs of tenant acme: `leasehold list
    /// --finished --status failed --tenant acme --since 2026-12-01
    /// --until 2026-12-02`.
    #[arg(long)]
    pub(crate) finished: bool,
    /// With --finished: only jobs of this tenant (`default` for jobs
    /// submitted without one).
    #[arg(long, requires = "finished")]
    pub(crate) tenant: Option<String>,
    /// With --finished: only jobs whose error has this class (`none`:
    /// jobs without an error).
    #[arg(long, requires = "finished")]
    pub(crate) class: Option<String>,
    /// With --finished: jobs that ended at or after this time: RFC 3339
    /// (`2026-12-01T10:00:00Z`), a UTC date or date and time
    /// (`2026-12-01`, `2026-12-01T10:00`), or a duration ago (`2h`, `7d`).
    #[arg(long, requires = "finished")]
    pub(crate) since: Option<String>,
    /// With --finished: jobs that ended before this time (same forms as
    /// --since).
    #[arg(long, requires = "finished")]
    pub(crate) until: Option<String>,
    /// With --finished: only jobs whose id starts with this (read from the
    /// entries: the count is then an upper bound, and a page reads at most
    /// 2,000 entries).
    #[arg(long, requires = "finished")]
    pub(crate) id_prefix: Option<String>,
    /// With `--all`: list the records that cannot be read instead.
    #[arg(long, requires = "all")]
    corrupt: bool,
    /// One JSON record per line instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

/// The order `list` shows jobs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Sort {
    Newest,
    Oldest,
    Id,
}

/// Sorts `(job id, created_at)` items in `sort` order and keeps those after
/// `after` (an id no longer listed: from the start).
fn order<T>(items: &mut Vec<T>, sort: Sort, after: Option<&str>, key: impl Fn(&T) -> (&str, &str)) {
    items.sort_by(|x, y| {
        let ((ix, cx), (iy, cy)) = (key(x), key(y));
        match sort {
            Sort::Id => ix.cmp(iy),
            Sort::Oldest => cx.cmp(cy).then(ix.cmp(iy)),
            Sort::Newest => cy.cmp(cx).then(ix.cmp(iy)),
        }
    });
    if let Some(after) = after {
        if let Some(i) = items.iter().position(|x| key(x).0 == after) {
            items.drain(..=i);
        } else if sort == Sort::Id {
            items.retain(|x| key(x).0 > after);
        }
    }
}

/// Where the job `id` is in a newest-first listing of `filter`'s entries
/// that `of_kind` admits: its creation time and id, when it is listed
/// there (`None`: not listed, and the listing starts from the start).
async fn place_of(
    active: &leasehold_store::index::Active,
    jobs: &leasehold_store::Jobs,
    id: &str,
    filter: Filter<'_>,
    of_kind: &impl Fn(&leasehold_store::index::Entry) -> bool,
) -> anyhow::Result<Option<(String, String)>> {
    let listed = active.keys_of(id).await?.iter().any(|k| filter.admits(k));
    if !listed {
        return Ok(None);
    }
    let Some(rec) = jobs.get(id).await? else {
        return Ok(None);
    };
    let e = leasehold_store::index::Entry::of(&rec.value);
    Ok(of_kind(&e).then_some((e.created_at, e.job)))
}

/// The records of `entries` in their order, up to `limit` that `keep`
/// accepts and are not finished (the index may be a moment behind: the
/// record decides); whether an entry was left past the limit.
async fn records_of(
    jobs: &leasehold_store::Jobs,
    entries: Vec<(leasehold_store::index::Key, leasehold_store::index::Entry)>,
    limit: usize,
    keep: &impl Fn(&JobRecord) -> bool,
) -> anyhow::Result<(Rows, bool)> {
    let mut rows = Rows::default();
    for (_, e) in entries {
        if rows.recs.len() == limit {
            return Ok((rows, true));
        }
        match jobs.get(&e.job).await? {
            Some(v)
                if keep(&v.value)
                    && !Status::is_terminal(
                        v.value.status.parse().unwrap_or(Status::Completed),
                    ) =>
            {
                rows.recs.push(v.value)
            }
            _ => rows.dropped += 1,
        }
    }
    Ok((rows, false))
}

/// A page's records, and how many listed entries were skipped.
#[derive(Default)]
struct Rows {
    recs: Vec<JobRecord>,
    dropped: usize,
}

/// "3m", "2h", "5d": how long ago an RFC 3339 time was.
fn age(at: &str) -> String {
    let Some(t) = leasehold_core::time::parse_rfc3339(at) else {
        return "-".into();
    };
    short(
        std::time::SystemTime::now()
            .duration_since(t)
            .unwrap_or_default()
            .as_secs(),
    )
}

/// Seconds in the largest whole unit: "42s", "3m", "2h", "5d".
fn short(s: u64) -> String {
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m", s / 60),
        3600..=86_399 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

/// How long a job took: submission to its end when finished; the time its
/// attempts ran so far otherwise (`-` before any).
fn duration(r: &JobRecord) -> String {
    let finished = r.status.parse::<Status>().is_ok_and(|s| s.is_terminal());
    if finished {
        let t = |x: &str| leasehold_core::time::parse_rfc3339(x);
        if let (Some(a), Some(b)) = (t(&r.created_at), t(&r.updated_at)) {
            return short(b.duration_since(a).unwrap_or_default().as_secs());
        }
    }
    match r.budget_used.as_ref().map(|b| b.wall_s) {
        Some(w) if w > 0.0 => short(w as u64),
        _ => "-".into(),
    }
}

/// Sections done of the total (research), or the phase, or `-`.
fn progress(r: &JobRecord) -> String {
    match &r.progress {
        Some(p) if p.sections_total > 0 => {
            let skipped = if p.skipped > 0 {
                format!(" ({} skipped)", p.skipped)
            } else {
                String::new()
            };
            format!("{}/{}{skipped}", p.sections_done, p.sections_total)
        }
        Some(p) if !p.phase.is_empty() => p.phase.clone(),
        _ => "-".into(),
    }
}

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    if a.finished {
        return super::finished::run(&a, nats).await;
    }
    let status = match &a.status {
        Some(s) => Some(s.parse::<Status>().map_err(anyhow::Error::msg)?),
        None => None,
    };
    if let Some(s) = status.filter(|s| s.is_terminal() && !a.all) {
        bail!("finished jobs ({s}) are not in the index of active jobs; add --finished to search their history (or --all to scan every record)");
    }
    let conn = nats.connect("leasehold-cli list").await?;
    let jobs = super::open_jobs(&conn).await?;
    let keep = |r: &JobRecord| {
        status.is_none_or(|s| r.status == s.as_str())
            && a.kind.as_ref().is_none_or(|k| &r.kind == k)
            && a.worker
                .as_ref()
                .is_none_or(|w| r.worker_id.as_deref() == Some(w.as_str()))
    };
    let mut recs: Vec<JobRecord>;
    let mut more = false;
    if a.all {
        let listing = jobs.all().await?;
        if a.corrupt {
            for (id, err) in &listing.corrupt {
                println!("{id}\t{err}");
            }
            eprintln!("{} unreadable record(s)", listing.corrupt.len());
            return Ok(if listing.corrupt.is_empty() { 0 } else { 1 });
        }
        if !listing.corrupt.is_empty() {
            eprintln!(
                "{} unreadable record(s) skipped (`leasehold list --all --corrupt` lists them)",
                listing.corrupt.len()
            );
        }
        recs = listing
            .records
            .into_iter()
            .map(|v| v.value)
            .filter(|r| keep(r))
            .collect();
        order(&mut recs, a.sort, a.after.as_deref(), |r| {
            (r.id.as_str(), r.created_at.as_str())
        });
        if recs.len() > a.limit {
            recs.truncate(a.limit);
            more = true;
        }
    } else {
        let active = super::open_active(&conn).await?;
        let filter = match (status, &a.worker) {
            (_, Some(w)) => Filter::RunningBy(w),
            (Some(Status::Running), None) => Filter::Running,
            (Some(Status::Queued), None) => Filter::Waiting,
            (Some(Status::Parked), None) => Filter::Parked,
            (Some(Status::Waiting), None) => Filter::Held,
            _ => Filter::All,
        };
        let of_kind =
            |e: &leasehold_store::index::Entry| a.kind.as_ref().is_none_or(|k| &e.kind == k);
        // Newest first (the default), a page reads the index from its end
        // only (`Active::newest`): back to the page's last job, and for a
        // later page (`--after`) the jobs after the cursor's place. A row
        // the index lists but whose record moved on, or a cursor no longer
        // listed, sends it to the whole listing, which fills the page.
        let mut page = None;
        if a.sort == Sort::Newest {
            let cursor = match a.after.as_deref() {
                None => Some(None),
                Some(id) => place_of(&active, &jobs, id, filter, &of_kind)
                    .await?
                    .map(Some),
            };
            if let Some(cursor) = cursor {
                let after = |e: &leasehold_store::index::Entry| {
                    of_kind(e)
                        && cursor.as_ref().is_none_or(|(created, job)| {
                            e.created_at < *created || (e.created_at == *created && e.job > *job)
                        })
                };
                let newest = active.newest(filter, a.limit + 1, after).await?;
                let (rows, extra) = records_of(&jobs, newest, a.limit, &keep).await?;
                if rows.dropped == 0 {
                    page = Some((rows.recs, extra));
                }
            }
        }
        (recs, more) = match page {
            Some(p) => p,
            None => {
                let mut entries = active.list(filter).await?;
                entries.retain(|(_, e)| of_kind(e));
                entries.dedup_by(|x, y| x.1.job == y.1.job);
                order(&mut entries, a.sort, a.after.as_deref(), |(_, e)| {
                    (e.job.as_str(), e.created_at.as_str())
                });
                let (rows, extra) = records_of(&jobs, entries, a.limit, &keep).await?;
                (rows.recs, extra)
            }
        };
    }
    if a.json {
        for r in &recs {
            println!("{}", serde_json::to_string(r)?);
        }
    } else {
        // The id column is as wide as the longest id shown: long ids
        // never break the table.
        let w = recs.iter().map(|r| r.id.len()).max().unwrap_or(0).max(2);
        println!(
            "{:<w$} {:<10} {:<10} {:>5} {:>8} {:<14} {:>8} {:>6} {:>7}  {:<16} LAST ERROR",
            "ID",
            "KIND",
            "STATUS",
            "AGE",
            "DURATION",
            "PROGRESS",
            "ATTEMPTS",
            "EPOCH",
            "RECLAIM",
            "WORKER"
        );
        for r in &recs {
            let err = match (r.status == Status::Waiting.as_str(), &r.error) {
                (true, _) => format!("waits {}", leasehold_core::machine::waits_for(r)),
                (false, Some(e)) => {
                    let m: String = e.message.chars().take(60).collect();
                    format!("{}: {m}", e.class)
                }
                (false, None) => "-".to_string(),
            };
            println!(
                "{:<w$} {:<10} {:<10} {:>5} {:>8} {:<14} {:>8} {:>6} {:>7}  {:<16} {}",
                r.id,
                r.kind,
                r.status,
                age(&r.created_at),
                duration(r),
                progress(r),
                r.attempts,
                r.epoch,
                r.stale_reclaims,
                if r.status == Status::Waiting.as_str() {
                    "-"
                } else {
                    r.worker_id.as_deref().unwrap_or("-")
                },
                err
            );
        }
    }
    match (more, recs.last()) {
        (true, Some(last)) => eprintln!(
            "{} job(s) shown; more follow: add --after {}",
            recs.len(),
            last.id
        ),
        _ => eprintln!("{} job(s)", recs.len()),
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::{duration, order, progress, short, Sort};
    use leasehold_core::JobRecord;

    #[test]
    fn durations_and_progress_read_as_a_person_would() {
        assert_eq!(short(42), "42s");
        assert_eq!(short(3 * 3600 + 5), "3h");
        let mut r = JobRecord {
            status: "completed".into(),
            created_at: "2026-12-01T10:00:00Z".into(),
            updated_at: "2026-12-01T10:02:30Z".into(),
            ..Default::default()
        };
        assert_eq!(duration(&r), "2m");
        assert_eq!(progress(&r), "-");
        r.status = "running".into();
        assert_eq!(duration(&r), "-", "no attempt time recorded yet");
        r.progress = Some(leasehold_proto::Progress {
            phase: "sections".into(),
            sections_done: 3,
            sections_total: 16,
            skipped: 1,
        });
        assert_eq!(progress(&r), "3/16 (1 skipped)");
    }

    #[test]
    fn newest_first_by_default_and_after_continues_in_that_order() {
        let items = vec![("seq-10", "t2"), ("seq-2", "t1"), ("seq-11", "t3")];
        fn key<'a>(x: &'a (&'static str, &'static str)) -> (&'a str, &'a str) {
            (x.0, x.1)
        }
        let mut v = items.clone();
        order(&mut v, Sort::Newest, None, key);
        assert_eq!(v, vec![("seq-11", "t3"), ("seq-10", "t2"), ("seq-2", "t1")]);
        let mut v = items.clone();
        order(&mut v, Sort::Newest, Some("seq-11"), key);
        assert_eq!(v, vec![("seq-10", "t2"), ("seq-2", "t1")]);
        let mut v = items.clone();
        order(&mut v, Sort::Oldest, None, key);
        assert_eq!(v[0], ("seq-2", "t1"));
        let mut v = items;
        order(&mut v, Sort::Id, Some("seq-10"), key);
        assert_eq!(v, vec![("seq-11", "t3"), ("seq-2", "t1")]);
    }
}
