//! HTML: escaped strings, the page layout, job rows, timeline rows, the
//! report and the small charts. Plain strings, no template engine: every
//! value goes through [`esc`].

use std::fmt::Write as _;
use std::time::SystemTime;

use leasehold_core::JobRecord;
use leasehold_proto::JobEvent;
use serde_json::Value;

/// HTML-escaped text.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// A query-string value, percent-encoded.
pub fn url(s: &str) -> String {
    let mut o = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            o.push(b as char);
        } else {
            let _ = write!(o, "%{b:02X}");
        }
    }
    o
}

pub fn layout(title: &str, body: &str) -> String {
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
<title>{t} · leasehold</title><link rel=\"stylesheet\" href=\"/static/console.css\">\
<script src=\"/static/console.js\" defer></script></head><body>\
<nav><b>leasehold</b> <a href=\"/jobs\">jobs</a> <a href=\"/fleet\">fleet</a> \
<a href=\"/dlq\">dead letters</a> <a href=\"/reviews\">reviews</a></nav>\
<main>{body}</main></body></html>",
        t = esc(title)
    )
}

/// How long ago `at` (RFC 3339) was, short: `42s`, `3m`, `2h`, `5d`.
pub fn age(at: &str) -> String {
    leasehold_core::time::parse_rfc3339(at)
        .map(|t| short(SystemTime::now().duration_since(t).unwrap_or_default()))
        .unwrap_or_else(|| "-".into())
}

pub fn short(d: std::time::Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

/// Sections done of the total with a bar, or the phase.
pub fn progress(r: &JobRecord) -> String {
    match &r.progress {
        Some(p) if p.sections_total > 0 => {
            let pct = (p.sections_done as f64 * 100.0 / p.sections_total as f64).min(100.0);
            format!(
                "<span class=\"progress\" data-done=\"{d}\" data-total=\"{t}\"><span class=\"bar\" style=\"width:{pct:.0}%\"></span></span> {d}/{t}{skip} {phase}",
                d = p.sections_done,
                t = p.sections_total,
                skip = if p.skipped > 0 { format!(" ({} skipped)", p.skipped) } else { String::new() },
                phase = esc(&p.phase)
            )
        }
        Some(p) => esc(&p.phase),
        None => "-".into(),
    }
}

/// The tenant of a job: its spec's `tenant` (the lane it waits in), else
/// its `metadata.tenant` (what clients set before tenants were a field).
pub fn tenant(r: &JobRecord) -> Option<String> {
    if let Some(t) = r.spec.as_ref()?.tenant.clone().filter(|t| !t.is_empty()) {
        return Some(t);
    }
    let m = r.spec.as_ref()?.metadata.as_str();
    let v: Value = serde_json::from_str(m).ok()?;
    v.get("tenant")?.as_str().map(str::to_string)
}

pub const JOB_HEAD: &str = "<tr><th>id</th><th>kind</th><th>status</th><th>age</th><th>attempts</th><th>stale reclaims</th><th>epoch</th><th>progress</th><th>worker</th><th>tenant</th></tr>";

/// One job's row (the jobs page, and its live updates).
pub fn job_row(r: &JobRecord) -> String {
    format!(
        "<tr data-id=\"{id}\" class=\"st-{st}\"><td><a href=\"/jobs/{uid}\">{id}</a></td><td>{kind}</td><td class=\"status\">{st}{cancel}</td><td>{age}</td><td>{att}</td><td>{stale}</td><td>{ep}</td><td>{prog}</td><td>{worker}</td><td>{tenant}</td></tr>",
        id = esc(&r.id),
        uid = url(&r.id),
        kind = esc(&r.kind),
        st = esc(&r.status),
        cancel = if r.cancel_requested && r.status == "running" { " (cancel asked)" } else { "" },
        age = age(&r.created_at),
        att = r.attempts,
        stale = r.stale_reclaims,
        ep = r.epoch,
        prog = progress(r),
        worker = esc(r.worker_id.as_deref().unwrap_or("-")),
        tenant = esc(&tenant(r).unwrap_or_default()),
    )
}

fn s<'a>(m: &'a serde_json::Map<String, Value>, k: &str) -> &'a str {
    m.get(k).and_then(Value::as_str).unwrap_or("")
}

fn n(m: &serde_json::Map<String, Value>, k: &str) -> String {
    m.get(k)
        .map(|v| match v {
            Value::String(s) => s.clone(),
            Value::Null => String::new(),
            v => v.to_string(),
        })
        .unwrap_or_default()
}

/// What one event says, in a line (escaped HTML).
pub fn describe(ev: &JobEvent) -> String {
    let d = ev.data_map();
    let who = ev
        .worker_id
        .as_deref()
        .map(|w| format!(" by <b>{}</b>", esc(w)))
        .unwrap_or_default();
    match ev.r#type.as_str() {
        "claimed" => {
            let reclaim = d.get("reclaim").and_then(Value::as_bool).unwrap_or(false);
            format!(
                "{}{who}, epoch {} (attempts {}, stale reclaims {}, ticket {})",
                if reclaim {
                    "<b class=\"warn\">reclaimed</b>"
                } else {
                    "claimed"
                },
                ev.epoch,
                esc(&n(&d, "attempts")),
                esc(&n(&d, "stale_reclaims")),
                esc(&n(&d, "ticket_seq"))
            )
        }
        "heartbeat_lost" => format!("claim lost{who}: {}", esc(s(&d, "reason"))),
        "retry" => describe_retry(&d),
        "phase" => describe_phase(&d),
        "section" => describe_section(&d),
        "journal" => describe_journal(&d),
        "model" => describe_model(&d),
        "tool" => format!(
            "tool <b>{}</b> {} step {} key {}{}{}",
            esc(s(&d, "tool")),
            esc(s(&d, "kind")),
            esc(s(&d, "step_id")),
            esc(&short_key(s(&d, "key"))),
            match d.get("ok").and_then(Value::as_bool) {
                Some(true) => " ok",
                Some(false) => " failed",
                None => "",
            },
            if s(&d, "error").is_empty() {
                String::new()
            } else {
                format!(" ({})", esc(s(&d, "error")))
            }
        ),
        "progress" => describe_progress(&d),
        "action" => format!(
            "<b class=\"act\">{}</b> by <b>{}</b> via {}{}",
            esc(s(&d, "action")),
            esc(s(&d, "by")),
            esc(s(&d, "via")),
            {
                let mut extra = String::new();
                for k in ["outcome", "answer", "reason", "dlq_seq", "ticket_seq"] {
                    if d.contains_key(k) {
                        let _ = write!(extra, ", {k}: {}", esc(&n(&d, k)));
                    }
                }
                extra
            }
        ),
        "completed" => format!("<b class=\"ok\">completed</b>{who}"),
        "failed" => format!(
            "<b class=\"bad\">failed</b>{who}: {} {}",
            esc(s(&d, "class")),
            esc(s(&d, "message"))
        ),
        "cancelled" => format!(
            "<b class=\"bad\">cancelled</b>{who} {}",
            esc(s(&d, "while"))
        ),
        "parked" => format!(
            "<b class=\"warn\">parked</b>{who}: {} {}",
            esc(s(&d, "reason")),
            esc(s(&d, "message"))
        ),
        "waiting" => format!(
            "<b class=\"warn\">waiting</b>{who} {}, held by no worker",
            esc(&waiting_for(&d))
        ),
        "dead" => format!(
            "<b class=\"bad\">dead</b>: {} {}",
            esc(s(&d, "class")),
            esc(s(&d, "reason"))
        ),
        other => format!("{}{who}", esc(other)),
    }
}

/// What a `waiting` event's job waits for, in words, as the record's
/// views say it (`machine::wait_in_words`).
pub(crate) fn waiting_for(d: &serde_json::Map<String, Value>) -> String {
    use leasehold_core::machine::WaitingFor;
    let what = match s(d, "for") {
        "signal" => WaitingFor::Signal(s(d, "name")),
        "children" => WaitingFor::Children(d.get("ends").and_then(Value::as_u64).unwrap_or(0)),
        _ => WaitingFor::Time,
    };
    leasehold_core::machine::wait_in_words(what, Some(s(d, "until")), s(d, "step"))
}

/// The line of a `retry` event.
fn describe_retry(d: &serde_json::Map<String, Value>) -> String {
    let retained = d.get("retained").map(|v| v.to_string()).unwrap_or_default();
    format!(
        "<b class=\"warn\">retry</b> scope <b>{}</b>: {} {}{}{}",
        esc(s(d, "scope")),
        esc(s(d, "reason")),
        if s(d, "class").is_empty() {
            String::new()
        } else {
            format!("[{}] ", esc(s(d, "class")))
        },
        if retained.is_empty() || retained == "null" {
            String::new()
        } else {
            format!("retained: {} ", esc(&retained))
        },
        if n(d, "delay_ms").is_empty() {
            String::new()
        } else {
            format!("after {} ms", esc(&n(d, "delay_ms")))
        },
    )
}

/// The line of a `phase` event.
fn describe_phase(d: &serde_json::Map<String, Value>) -> String {
    let p = d.get("payload").and_then(Value::as_object);
    let extra = match (s(d, "phase"), p) {
        ("final", Some(p)) => {
            format!(" section {} {}", esc(&n(p, "index")), esc(s(p, "title")))
        }
        ("artifact", Some(p)) => format!(" {}", esc(s(p, "name"))),
        ("delivered", Some(p)) => format!(
            " key {} ({})",
            esc(&short_key(s(p, "key"))),
            esc(s(p, "outcome"))
        ),
        ("outline", Some(p)) => format!(" {}", esc(s(p, "title"))),
        _ => String::new(),
    };
    format!("phase <b>{}</b>{extra}", esc(s(d, "phase")))
}

/// The line of a `section` event.
fn describe_section(d: &serde_json::Map<String, Value>) -> String {
    let p = d
        .get("payload")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    format!(
        "section expert {} #{} <b>{}</b>: {}{}",
        esc(&n(&p, "expert")),
        esc(&n(&p, "index")),
        esc(s(&p, "title")),
        esc(s(&p, "status")),
        if s(&p, "content").is_empty() {
            String::new()
        } else {
            format!(" ({} chars)", s(&p, "content").len())
        }
    )
}

/// The line of a `journal` event.
fn describe_journal(d: &serde_json::Map<String, Value>) -> String {
    let entry = d
        .get("entry")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let what = match entry
        .get("message")
        .and_then(|m| m.get("role"))
        .and_then(Value::as_str)
    {
        Some("assistant") => {
            let m = &entry["message"];
            let calls = m
                .get("tool_calls")
                .and_then(Value::as_array)
                .map_or(0, Vec::len);
            let chars = m.get("content").and_then(Value::as_str).map_or(0, str::len);
            if calls > 0 {
                format!("model call: {calls} tool call(s) proposed")
            } else {
                format!("model call: answer, {chars} chars")
            }
        }
        Some("tool") => format!(
            "tool result, {} chars",
            entry["message"]
                .get("content")
                .and_then(Value::as_str)
                .map_or(0, str::len)
        ),
        Some(r) => format!("{r} message"),
        None if entry.contains_key("messages") => format!(
            "thread (re)started, generation {}, {} messages",
            esc(&n(&entry, "generation")),
            entry["messages"].as_array().map_or(0, Vec::len)
        ),
        None => "entry".into(),
    };
    format!(
        "journal expert {} #{}: {what}",
        esc(&n(d, "expert")),
        esc(&n(d, "index"))
    )
}

/// The line of a `model` event.
fn describe_model(d: &serde_json::Map<String, Value>) -> String {
    let at = if d.contains_key("step") {
        format!("step {}", esc(s(d, "step")))
    } else if d.contains_key("phase") {
        match d.get("index").and_then(Value::as_u64) {
            Some(i) => format!("{} #{i}", esc(s(d, "phase"))),
            None => esc(s(d, "phase")),
        }
    } else {
        format!("expert {} #{}", esc(&n(d, "expert")), esc(&n(d, "index")))
    };
    let outcome = s(d, "outcome");
    format!(
        "model <b>{}</b> {at}: <span class=\"tokens\">{} in / {} out tokens{}</span>, <span class=\"duration\">{} ms</span>{}{}{}",
        esc(s(d, "model")),
        esc(&n(d, "tokens_in")),
        esc(&n(d, "tokens_out")),
        if d.get("estimated").and_then(Value::as_bool) == Some(true) {
            " (estimated)"
        } else {
            ""
        },
        esc(&n(d, "duration_ms")),
        match outcome {
            "ok" => String::new(),
            "tool_calls" => format!(", asked for {} tool call(s)", esc(&n(d, "tool_calls"))),
            o => format!(", <b class=\"bad\">{}</b>", esc(o)),
        },
        match d.get("attempts").and_then(Value::as_u64) {
            Some(a) if a > 1 => format!(" after {a} attempts"),
            _ => String::new(),
        },
        if s(d, "fallback").is_empty() {
            String::new()
        } else {
            format!(" (fallback {})", esc(s(d, "fallback")))
        }
    )
}

/// The line of a `progress` event.
fn describe_progress(d: &serde_json::Map<String, Value>) -> String {
    let mut parts = Vec::new();
    for k in [
        "phase",
        "sections_done",
        "sections_total",
        "skipped",
        "ticket_seq",
        "dlq_seq",
    ] {
        if let Some(v) = d.get(k) {
            parts.push(format!("{k} {}", esc(&n(d, k)).trim_matches('"')));
            let _ = v;
        }
    }
    format!("progress {}", parts.join(", "))
}

/// A key shown short: its first 12 characters (not bytes: a kind's key
/// may be any text) when it has more than 16.
fn short_key(k: &str) -> String {
    if k.chars().count() > 16 {
        format!("{}…", k.chars().take(12).collect::<String>())
    } else {
        k.to_string()
    }
}

/// One timeline row; `superseded` marks what a later epoch replaced.
pub fn event_row(seq: u64, ev: &JobEvent, clean: &dyn Fn(&str) -> String) -> String {
    format!(
        "<tr id=\"ev-{seq}\" data-seq=\"{seq}\" class=\"ev ev-{ty}\"><td>{seq}</td><td>{at}</td><td>{ep}</td><td>{ty}</td><td>{what}</td></tr>",
        at = esc(ev.at.get(11..23).unwrap_or(&ev.at)),
        ep = ev.epoch,
        ty = esc(&ev.r#type),
        what = clean(&describe(ev)),
    )
}

/// Follows a job's events and says what each one supersedes of the work
/// shown so far, if anything: a claim of a later epoch (a reclaim after
/// the owner went away, or a retry after a failed attempt), and a warm,
/// cold or job-level retry. Shown in the timeline and sent to clients as a
/// `superseded` event.
#[derive(Debug, Default)]
pub struct Supersedes {
    /// `(attempts, stale_reclaims)` of the last claim seen.
    last: Option<(u64, u64)>,
}

impl Supersedes {
    /// Starts from the last claim a resumed reader already saw.
    pub fn after_claim(claim: &JobEvent) -> Self {
        let mut s = Supersedes::default();
        let _ = s.see(claim);
        s
    }

    pub fn see(&mut self, ev: &JobEvent) -> Option<Value> {
        let d = ev.data_map();
        let num = |k: &str| d.get(k).and_then(Value::as_u64).unwrap_or(0);
        match ev.r#type.as_str() {
            "claimed" => {
                let now = (num("attempts"), num("stale_reclaims"));
                let prev = self.last.replace(now);
                if ev.epoch <= 1 {
                    return None;
                }
                let flagged = d.get("reclaim").and_then(Value::as_bool).unwrap_or(false);
                let reclaim = flagged
                    || match prev {
                        Some((_, stale)) => now.1 > stale,
                        // Resumed mid-way: a claim with stale reclaims and no failed attempt.
                        None => now.1 > 0 && now.0 == 0,
                    };
                Some(serde_json::json!({
                    "epoch": ev.epoch,
                    "reason": if reclaim { "reclaim" } else { "retry" },
                    "drop": "what earlier epochs did after their last checkpoint (journal entries of the section in flight); checkpoints (phase, section) are kept and resumed from",
                }))
            }
            "retry" if matches!(s(&d, "scope"), "warm" | "cold") => Some(serde_json::json!({
                "epoch": ev.epoch,
                "reason": format!("retry:{}", s(&d, "scope")),
                "retained": d.get("retained"),
                "drop": if s(&d, "scope") == "warm" { "the section's last unfinished model response" } else { "the section's journal so far" },
            })),
            _ => None,
        }
    }
}

pub const EVENT_HEAD: &str =
    "<tr><th>seq</th><th>at</th><th>epoch</th><th>type</th><th>what</th></tr>";

/// A Markdown report as HTML: headings, paragraphs, lists, rules and
/// code blocks; everything else as escaped text.
pub fn markdown(md: &str) -> String {
    let mut out = String::new();
    let mut para: Vec<String> = Vec::new();
    let mut in_list = false;
    let mut in_code = false;
    let flush = |out: &mut String, para: &mut Vec<String>| {
        if !para.is_empty() {
            let _ = write!(out, "<p>{}</p>", para.join(" "));
            para.clear();
        }
    };
    for line in md.lines() {
        if line.starts_with("```") {
            flush(&mut out, &mut para);
            out.push_str(if in_code { "</pre>" } else { "<pre>" });
            in_code = !in_code;
            continue;
        }
        if in_code {
            let _ = writeln!(out, "{}", esc(line));
            continue;
        }
        let t = line.trim_end();
        let item = t.strip_prefix("- ").or_else(|| t.strip_prefix("* "));
        if in_list && item.is_none() {
            out.push_str("</ul>");
            in_list = false;
        }
        if t.is_empty() {
            flush(&mut out, &mut para);
        } else if let Some(h) = t.strip_prefix('#') {
            flush(&mut out, &mut para);
            let level = 1 + h.chars().take_while(|c| *c == '#').count();
            let text = h.trim_start_matches('#').trim();
            let level = level.min(6);
            let _ = write!(out, "<h{level}>{}</h{level}>", esc(text));
        } else if let Some(it) = item {
            flush(&mut out, &mut para);
            if !in_list {
                out.push_str("<ul>");
                in_list = true;
            }
            let _ = write!(out, "<li>{}</li>", esc(it));
        } else if t == "---" {
            flush(&mut out, &mut para);
            out.push_str("<hr>");
        } else if let Some(q) = t.strip_prefix("> ") {
            flush(&mut out, &mut para);
            let _ = write!(out, "<blockquote>{}</blockquote>", esc(q));
        } else {
            para.push(esc(t));
        }
    }
    flush(&mut out, &mut para);
    if in_list {
        out.push_str("</ul>");
    }
    if in_code {
        out.push_str("</pre>");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::short_key;

    #[test]
    fn short_key_cuts_by_characters() {
        assert_eq!(short_key("ключ-идемпотентности"), "ключ-идемпот…");
        assert_eq!(short_key("0123456789abcdefXYZ"), "0123456789ab…");
        assert_eq!(short_key("short-κλειδί"), "short-κλειδί");
    }
}
