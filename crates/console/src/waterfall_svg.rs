//! The waterfall drawn (with `svg.rs`): one block of rows per attempt (its
//! bar, then its lanes: phases, experts, steps, calls, tools, waits), the
//! waits between attempts last, all on one time axis from the job's first
//! event. What is below a pixel is aggregated: neighbouring bars of one
//! kind in one lane closer than a pixel or two become one bar whose title
//! counts them, so 10,000 events draw as a few hundred rectangles. A
//! repeated call is never merged away.

use std::fmt::Write as _;

use crate::render::esc;
use crate::svg::{duration, ticks, value, Svg};
use crate::waterfall::{Attempt, Bar, Kind, Waterfall};

const W: f64 = 1200.0;
/// Where the plot starts (lane names on the left) and ends.
const X0: f64 = 170.0;
const X1: f64 = 1190.0;
const ROW: f64 = 18.0;
const AXIS: f64 = 22.0;
/// Bars closer than this (in units of the 1200-wide picture) merge.
const GAP: f64 = 1.5;
/// A bar narrower than this is "below a pixel or two" and may merge.
const TINY: f64 = 2.0;

/// Bars of one kind in one lane, merged when too small to tell apart.
#[derive(Debug, Clone, PartialEq)]
pub struct Group<'a> {
    pub first: &'a Bar,
    pub start: f64,
    pub end: f64,
    pub count: usize,
    pub last_seq: u64,
    pub tokens: (u64, u64),
}

/// `bars` (sorted by start) grouped at `scale` units a second.
pub fn aggregate<'a>(bars: &[&'a Bar], scale: f64, until: f64) -> Vec<Group<'a>> {
    let mut out: Vec<Group<'a>> = Vec::new();
    for b in bars {
        let end = b.end.unwrap_or(until).max(b.start);
        let merge = out.last().is_some_and(|g| {
            g.first.repeated.is_none()
                && b.repeated.is_none()
                && (b.start - g.end) * scale < GAP
                && ((end - b.start) * scale < TINY || (g.end - g.start) * scale < TINY)
        });
        match out.last_mut() {
            Some(g) if merge => {
                g.end = g.end.max(end);
                g.count += 1;
                g.last_seq = g.last_seq.max(b.seq);
                g.tokens.0 += b.tokens.0;
                g.tokens.1 += b.tokens.1;
            }
            _ => out.push(Group {
                first: b,
                start: b.start,
                end,
                count: 1,
                last_seq: b.seq,
                tokens: b.tokens,
            }),
        }
    }
    out
}

/// What drawing needs besides the model.
pub struct View<'a> {
    /// The axis's end (the last event, or now while the job runs).
    pub until: f64,
    /// The link a bar of event `seq` goes to.
    pub link: &'a dyn Fn(u64) -> String,
}

/// The lanes of one attempt, in the order they are drawn.
fn lanes(a: &Attempt) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for b in &a.bars {
        if !names.contains(&b.lane) {
            names.push(b.lane.clone());
        }
    }
    let rank = |l: &str| match l {
        "phases" => (0, 0),
        l if l.starts_with("expert ") => (1, l[7..].parse::<u64>().unwrap_or(u64::MAX)),
        "steps" => (2, 0),
        "calls" => (3, 0),
        "tools" => (4, 0),
        _ => (5, 0),
    };
    names.sort_by_key(|l| rank(l));
    names
}

fn class_of(ended: &str) -> &'static str {
    match ended.split_whitespace().next().unwrap_or("") {
        "completed" => "wf-attempt wf-ok",
        "failed" | "cancelled" | "dead" | "rejected" => "wf-attempt wf-bad",
        "running" => "wf-attempt wf-run",
        _ => "wf-attempt wf-cut",
    }
}

/// The hover text of a group.
fn title(g: &Group, kind: Kind) -> String {
    let b = g.first;
    let mut t = if g.count == 1 {
        format!("{} (event #{}, epoch {})", b.detail, b.seq, b.epoch)
    } else {
        format!(
            "{} {} calls in {} from event #{} to #{}{}",
            g.count,
            kind.name(),
            duration(g.end - g.start),
            b.seq,
            g.last_seq,
            if g.tokens != (0, 0) {
                format!(
                    ", {} in / {} out tokens",
                    value(g.tokens.0 as f64, ""),
                    value(g.tokens.1 as f64, "")
                )
            } else {
                String::new()
            }
        )
    };
    if let Some(r) = &b.repeated {
        let _ = write!(t, "; REPEATED: {r}");
    }
    t.chars().take(400).collect()
}

struct Pen<'a, 'b> {
    svg: Svg,
    t0: f64,
    scale: f64,
    view: &'a View<'b>,
    y: f64,
    drawn: usize,
}

impl Pen<'_, '_> {
    fn x(&self, t: f64) -> f64 {
        X0 + (t - self.t0) * self.scale
    }

    fn group(&mut self, g: &Group, kind: Kind, tall: bool) {
        let (y, h) = if tall {
            (self.y + 1.0, ROW - 2.0)
        } else {
            (self.y + 4.0, ROW - 8.0)
        };
        let x = self.x(g.start);
        let w = ((g.end - g.start) * self.scale).max(1.0);
        let mut class = format!("wf-{}", kind.name());
        let count = g.count.to_string();
        let seq = g.first.seq.to_string();
        let mut data: Vec<(&str, &str)> = vec![("seq", &seq)];
        if g.count > 1 {
            data.push(("count", &count));
        }
        if g.first.repeated.is_some() {
            class.push_str(" repeated");
            data.push(("repeated", "true"));
        }
        self.svg.link(&(self.view.link)(g.first.seq));
        self.svg.rect(x, y, w, h, &class, &title(g, kind), &data);
        self.svg.end_link();
        self.drawn += 1;
    }

    /// One lane: its name, its tall bars (phases, sections, steps), then
    /// its calls and waits on top.
    fn lane(&mut self, name: &str, bars: &[&Bar]) {
        self.svg
            .text(X0 - 6.0, self.y + ROW - 5.0, "end", "wf-lane", name);
        for kinds in [
            &[Kind::Phase, Kind::Section, Kind::Step][..],
            &[Kind::Model, Kind::Tool, Kind::Wait][..],
        ] {
            for k in kinds {
                let mut of: Vec<&Bar> = bars.iter().copied().filter(|b| b.kind == *k).collect();
                of.sort_by(|a, b| a.start.total_cmp(&b.start));
                let tall = matches!(k, Kind::Phase | Kind::Section | Kind::Step) || name == "waits";
                for g in aggregate(&of, self.scale, self.view.until) {
                    self.group(&g, *k, tall);
                }
            }
        }
        self.y += ROW;
    }

    fn attempt(&mut self, a: &Attempt) {
        let end = a.end.unwrap_or(self.view.until);
        let label = format!("epoch {} · {}", a.epoch, a.worker);
        self.svg
            .text(X0 - 6.0, self.y + ROW - 5.0, "end", "wf-name", &label);
        let x = self.x(a.start);
        let w = ((end - a.start) * self.scale).max(1.0);
        let t = format!(
            "attempt at epoch {} by {}: {} after {} (claimed at event #{})",
            a.epoch,
            a.worker,
            a.ended,
            duration(end - a.start),
            a.seq
        );
        let (seq, epoch) = (a.seq.to_string(), a.epoch.to_string());
        self.svg.link(&(self.view.link)(a.seq));
        self.svg.group(
            class_of(&a.ended),
            &[("worker", &a.worker), ("epoch", &epoch), ("seq", &seq)],
        );
        self.svg
            .rect(x, self.y + 1.0, w, ROW - 2.0, "wf-bar", &t, &[]);
        self.svg.text(
            x + 4.0,
            self.y + ROW - 5.0,
            "start",
            "wf-on",
            &format!("{} · {}", a.worker, a.ended),
        );
        self.svg.end_group();
        self.svg.end_link();
        self.drawn += 1;
        self.y += ROW;
        for lane in lanes(a) {
            let bars: Vec<&Bar> = a.bars.iter().filter(|b| b.lane == lane).collect();
            self.lane(&lane, &bars);
        }
        self.y += 6.0;
    }

    fn axis(&mut self, span: f64, height: f64) {
        for t in ticks(span, 8) {
            if t > span * 1.001 && t > 0.0 {
                break;
            }
            let x = X0 + t * self.scale;
            self.svg.line(x, AXIS - 4.0, x, height, "grid");
            let label = if t == 0.0 {
                "0".to_string()
            } else {
                duration(t)
            };
            self.svg.text(x, AXIS - 8.0, "middle", "wf-tick", &label);
        }
        self.svg.line(X0, AXIS - 4.0, X1, AXIS - 4.0, "axis");
    }
}

/// How tall the picture is: the axis, each attempt's bar and lanes, and
/// the waits between attempts.
fn height(w: &Waterfall) -> f64 {
    let rows: usize = w.attempts.iter().map(|a| 1 + lanes(a).len()).sum();
    AXIS + rows as f64 * ROW
        + w.attempts.len() as f64 * 6.0
        + if w.waits.is_empty() { 0.0 } else { ROW }
        + 4.0
}

/// The waterfall as an SVG picture; also how many rectangles it drew.
pub fn draw(w: &Waterfall, view: &View) -> (String, usize) {
    let t0 = w.first.unwrap_or(view.until);
    let span = (view.until - t0).max(0.001);
    let h = height(w);
    let mut pen = Pen {
        svg: Svg::new(
            W,
            h,
            "the job's waterfall: attempts, phases, sections, calls and waits on one time axis",
            "picture waterfall-svg",
        ),
        t0,
        scale: (X1 - X0) / span,
        view,
        y: AXIS,
        drawn: 0,
    };
    pen.axis(span, h);
    for a in &w.attempts {
        pen.attempt(a);
    }
    if !w.waits.is_empty() {
        let bars: Vec<&Bar> = w.waits.iter().collect();
        pen.lane("waits", &bars);
    }
    let drawn = pen.drawn;
    (pen.svg.finish(), drawn)
}

/// The legend: what each colour and mark means.
pub fn legend() -> String {
    let mut s = String::from("<ul class=\"wf-legend\">");
    for (class, what) in [
        ("wf-attempt wf-ok", "attempt (worker, epoch, how it ended)"),
        ("wf-phase", "phase"),
        ("wf-section", "section of an expert"),
        ("wf-step", "step"),
        ("wf-model", "model call"),
        ("wf-tool", "tool call"),
        (
            "wf-wait",
            "wait: queued, backoff, cooldown, parked, until a reclaim",
        ),
        (
            "wf-model repeated",
            "repeated: redoes what an earlier epoch started and never journaled",
        ),
    ] {
        let _ = write!(
            s,
            "<li><svg viewBox=\"0 0 14 10\" width=\"14\" height=\"10\" aria-hidden=\"true\"><rect width=\"14\" height=\"10\" class=\"{}\"/></svg> {}</li>",
            esc(class),
            esc(what)
        );
    }
    s.push_str("</ul>");
    s
}
