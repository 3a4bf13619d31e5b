//! `leasehold list --finished`: a page of the history of finished jobs
//! (`leasehold_store::history`), how many matched, and the command of the
//! next page. Reads the page it prints, never the records.

use std::time::SystemTime;

use leasehold_store::history::{self, Entry, Page, Query, QueryText};
use leasehold_store::NatsArgs;

use super::list::Args;

/// The query the flags ask for (every field checked).
fn query(a: &Args, now: SystemTime) -> anyhow::Result<Query> {
    let t = QueryText {
        status: a.status.clone(),
        kind: a.kind.clone(),
        tenant: a.tenant.clone(),
        class: a.class.clone(),
        since: a.since.clone(),
        until: a.until.clone(),
        id_prefix: a.id_prefix.clone(),
        limit: Some(a.limit.to_string()),
        after: a.after.clone(),
    };
    Query::parse(&t, now).map_err(|e| anyhow::anyhow!("list --finished: {e}"))
}

/// Shell-safe: bare when plain, single-quoted otherwise.
fn quoted(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:=/+".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The command that shows the page after `cursor`: the same flags, times
/// as the absolute times this page used (a relative `2h` would move).
pub fn next_command(q: &Query, json: bool, cursor: u64) -> String {
    let mut c = vec!["leasehold list --finished".to_string()];
    let mut flag = |name: &str, v: &Option<String>| {
        if let Some(v) = v {
            c.push(format!("--{name} {}", quoted(v)));
        }
    };
    flag("status", &q.status);
    flag("kind", &q.kind);
    flag("tenant", &q.tenant);
    flag("class", &q.class);
    let time = |t: Option<SystemTime>| t.map(leasehold_core::time::rfc3339);
    flag("since", &time(q.since));
    flag("until", &time(q.until));
    flag("id-prefix", &q.id_prefix);
    c.push(format!("--limit {} --after {cursor}", q.limit));
    if json {
        c.push("--json".into());
    }
    c.join(" ")
}

/// What is said below the page: the count and how to go on.
pub fn summary(q: &Query, p: &Page, json: bool) -> Vec<String> {
    let mut lines = Vec::new();
    let bound = if p.matched_is_upper_bound {
        " at most (the id prefix is checked on the entries read)"
    } else {
        ""
    };
    lines.push(format!(
        "{} matched{bound}; {} shown",
        p.matched,
        p.entries.len()
    ));
    if p.scan_cut {
        lines.push(format!(
            "this page read {} entries, its bound, before filling up: more may match",
            p.scanned
        ));
    }
    if let Some(cursor) = p.next {
        lines.push(format!("next page: {}", next_command(q, json, cursor)));
    }
    lines
}

fn print_table(entries: &[(u64, Entry)]) {
    let w = entries
        .iter()
        .map(|(_, e)| e.id.len())
        .max()
        .unwrap_or(0)
        .max(2);
    println!(
        "{:<w$} {:<10} {:<12} {:<10} {:<16} {:<24} {:>8}  MESSAGE",
        "ID", "KIND", "TENANT", "STATUS", "CLASS", "ENDED", "ATTEMPTS"
    );
    for (_, e) in entries {
        let msg: String = e.message.chars().take(60).collect();
        println!(
            "{:<w$} {:<10} {:<12} {:<10} {:<16} {:<24} {:>8}  {}",
            e.id,
            e.kind,
            e.tenant,
            e.status,
            if e.class.is_empty() { "-" } else { &e.class },
            e.ended_at,
            e.attempts,
            if msg.is_empty() { "-".into() } else { msg }
        );
    }
}

pub async fn run(a: &Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    let q = query(a, SystemTime::now())?;
    let conn = nats.connect("leasehold-cli list --finished").await?;
    let page = history::search(&conn, &q).await?;
    if a.json {
        for (seq, e) in &page.entries {
            let mut v = serde_json::to_value(e)?;
            v["cursor"] = (*seq).into();
            println!("{v}");
        }
    } else {
        print_table(&page.entries);
    }
    for line in summary(&q, &page, a.json) {
        eprintln!("{line}");
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_page_command_repeats_the_query_with_absolute_times() {
        let now = leasehold_core::time::parse_rfc3339("2026-12-08T12:00:00Z").unwrap();
        let q = Query::parse(
            &QueryText {
                status: Some("failed".into()),
                tenant: Some("acme corp".into()),
                since: Some("2h".into()),
                limit: Some("50".into()),
                ..Default::default()
            },
            now,
        )
        .unwrap();
        assert_eq!(
            next_command(&q, false, 42),
            "leasehold list --finished --status failed --tenant 'acme corp' --since 2026-12-08T10:00:00.000Z --limit 50 --after 42"
        );
        let p = Page {
            matched: 120,
            next: Some(42),
            ..Default::default()
        };
        let s = summary(&q, &p, true);
        assert_eq!(s[0], "120 matched; 0 shown");
        assert!(s[1].ends_with("--after 42 --json"), "{s:?}");
    }
}
