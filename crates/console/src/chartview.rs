//! The fleet's charts drawn from the ring ([`crate::charts`]) with
//! [`crate::svg`]: throughput, queue depth per kind (and a table per lane),
//! submit->start and run time percentiles, failures by class, 429s and
//! cooldowns per provider key, workers and slots. Each has a y axis with
//! values and unit, a time axis (minutes ago), a legend, the current value
//! in its caption and a hover title per column.
//!
//! `GET /fleet/charts` is the HTML fragment (also part of the fleet page,
//! refreshed with it), `GET /v1/fleet/charts` the ring as JSON. Both read
//! only the ring: their cost is the window's, not the fleet's.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use crate::app::App;
use crate::auth::Caller;
use crate::charts::{Reservoir, Ring, Sample};
use crate::render::esc;
use crate::svg::{self, Svg};

/// Columns a chart draws (samples are grouped into them).
pub const COLUMNS: usize = 60;
/// Series a chart of a map draws; further keys are summed as `other`.
const SERIES_MAX: usize = 6;

/// What a chart's values are.
#[derive(Debug, Clone, Copy)]
enum Unit {
    Count,
    Secs,
}

fn fmt(u: Unit, v: f64) -> String {
    match u {
        Unit::Count => svg::value(v, ""),
        Unit::Secs => svg::duration(v),
    }
}

/// One line of a chart: a value per column (`None`: nothing known).
#[derive(Debug, Clone)]
struct Series {
    name: String,
    /// Its colour (a `fc-s<n>` class).
    colour: usize,
    values: Vec<Option<f64>>,
}

/// The ring's samples grouped into [`COLUMNS`] columns ending now.
struct Columns<'a> {
    cols: Vec<Vec<&'a Sample>>,
    /// Seconds a column spans, and when the last one ends.
    span: u64,
    end: SystemTime,
    window: u64,
}

fn columns(ring: &Ring, now: SystemTime) -> Columns<'_> {
    let interval = ring.interval().as_secs().max(1);
    let cap = ring.cap() as u64;
    let per = cap.div_ceil(COLUMNS as u64).max(1);
    let n = cap.div_ceil(per) as usize;
    let last = ring.slot_of(now);
    let first = (last + 1).saturating_sub(n as u64 * per);
    let mut cols: Vec<Vec<&Sample>> = vec![Vec::new(); n];
    for s in ring.samples() {
        if s.slot >= first && s.slot <= last {
            cols[((s.slot - first) / per) as usize].push(s);
        }
    }
    Columns {
        cols,
        span: per * interval,
        end: ring.start_of(last + 1),
        window: n as u64 * per * interval,
    }
}

impl Columns<'_> {
    /// Per column: the sum of `f` over its samples.
    fn sum(&self, f: impl Fn(&Sample) -> u64) -> Vec<Option<f64>> {
        self.cols
            .iter()
            .map(|c| (!c.is_empty()).then(|| c.iter().map(|s| f(s)).sum::<u64>() as f64))
            .collect()
    }

    /// Per column: the last sampled gauge `f` reads.
    /// A gauge the sampler could not know (`None`) leaves no point.
    fn gauge(&self, f: impl Fn(&crate::charts::Gauges) -> Option<f64>) -> Vec<Option<f64>> {
        self.cols
            .iter()
            .map(|c| c.iter().rev().find_map(|s| s.gauges.as_ref().and_then(&f)))
            .collect()
    }

    /// Per column: quantile `p` (0.5 or 0.95) of the reservoirs `f` picks.
    fn quantile(&self, f: impl Fn(&Sample) -> &Reservoir, p95: bool) -> Vec<Option<f64>> {
        self.cols
            .iter()
            .map(|c| {
                let mut r = Reservoir::default();
                for s in c {
                    r.merge(f(s));
                }
                r.quantiles().map(|q| if p95 { q.p95 } else { q.p50 })
            })
            .collect()
    }

    /// One series per key of the maps `f` reads (counters summed, gauges
    /// the last), the [`SERIES_MAX`] largest over the window, the rest as
    /// `other`.
    fn keyed(
        &self,
        f: impl Fn(&Sample) -> Option<&BTreeMap<String, u64>>,
        gauge: bool,
    ) -> Vec<Series> {
        let mut total: BTreeMap<&str, u64> = BTreeMap::new();
        for s in self.cols.iter().flatten() {
            for (k, n) in f(s).into_iter().flatten() {
                *total.entry(k.as_str()).or_default() += n;
            }
        }
        let mut keys: Vec<(&str, u64)> = total.into_iter().collect();
        keys.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        let shown: Vec<&str> = keys.iter().take(SERIES_MAX - 1).map(|k| k.0).collect();
        let rest = keys.len() > SERIES_MAX - 1;
        let value = |c: &Vec<&Sample>, pick: &dyn Fn(&str) -> bool| -> Option<f64> {
            let maps: Vec<&BTreeMap<String, u64>> = c.iter().filter_map(|s| f(s)).collect();
            let of = |m: &BTreeMap<String, u64>| -> u64 {
                m.iter().filter(|(k, _)| pick(k)).map(|(_, n)| n).sum()
            };
            if gauge {
                maps.last().map(|m| of(m) as f64)
            } else {
                (!c.is_empty()).then(|| maps.iter().map(|m| of(m)).sum::<u64>() as f64)
            }
        };
        let mut out: Vec<Series> = shown
            .iter()
            .enumerate()
            .map(|(i, k)| Series {
                name: k.to_string(),
                colour: i,
                values: self.cols.iter().map(|c| value(c, &|x| x == *k)).collect(),
            })
            .collect();
        if rest {
            out.push(Series {
                name: "other".into(),
                colour: SERIES_MAX - 1,
                values: self
                    .cols
                    .iter()
                    .map(|c| value(c, &|x| !shown.contains(&x)))
                    .collect(),
            });
        }
        out
    }

    /// "1 min" or "10 s": what a column spans.
    fn per(&self) -> String {
        if self.span.is_multiple_of(60) {
            format!("{} min", self.span / 60)
        } else {
            format!("{} s", self.span)
        }
    }

    /// When column `i` starts, as a clock (UTC).
    fn clock(&self, i: usize) -> String {
        let back = self.span * (self.cols.len() - i) as u64;
        let t = self.end - Duration::from_secs(back);
        let s = leasehold_core::time::rfc3339(t);
        s.get(11..19).unwrap_or(&s).to_string()
    }
}

const W: f64 = 600.0;
const H: f64 = 180.0;
const LEFT: f64 = 56.0;
const RIGHT: f64 = 10.0;
const TOP: f64 = 10.0;
const BOTTOM: f64 = 24.0;

/// One chart: a figure with its caption (title and current values), the
/// picture and its legend. `id` names it (`data-chart`).
fn chart(id: &str, title: &str, unit: Unit, cols: &Columns, series: &[Series]) -> String {
    let max = series
        .iter()
        .flat_map(|s| s.values.iter().flatten())
        .fold(0.0f64, |a, b| a.max(*b));
    let ticks = svg::ticks(max, 4);
    let top = ticks.last().copied().unwrap_or(1.0).max(f64::MIN_POSITIVE);
    let n = cols.cols.len().max(1);
    let mut p = Svg::new(W, H, title, "picture fc-pic");
    let (pw, ph) = (p.width() - LEFT - RIGHT, p.height() - TOP - BOTTOM);
    let x = |i: usize| LEFT + (i as f64 + 0.5) * pw / n as f64;
    let y = |v: f64| TOP + ph * (1.0 - v / top);
    axes(&mut p, unit, &ticks, y, cols);
    for s in series {
        p.group("fc-series", &[("series", &s.name)]);
        lines(&mut p, s, x, y);
        p.end_group();
    }
    for i in 0..n {
        let what: Vec<String> = series
            .iter()
            .filter_map(|s| s.values[i].map(|v| format!("{} {}", s.name, fmt(unit, v))))
            .collect();
        let what = if what.is_empty() {
            "no data".into()
        } else {
            what.join(", ")
        };
        let t = format!("{} UTC ({}): {what}", cols.clock(i), cols.per());
        p.rect(
            LEFT + i as f64 * pw / n as f64,
            TOP,
            pw / n as f64,
            ph,
            "fc-hit",
            &t,
            &[],
        );
    }
    let now: Vec<String> = series
        .iter()
        .map(|s| {
            let v = s.values.iter().rev().find_map(|v| *v);
            format!(
                "{} <b>{}</b>",
                esc(&s.name),
                v.map_or("-".into(), |v| esc(&fmt(unit, v)))
            )
        })
        .collect();
    let sum: f64 = series.iter().flat_map(|s| s.values.iter().flatten()).sum();
    let mut out = format!(
        "<figure class=\"fc\" data-chart=\"{id}\" data-sum=\"{sum}\"><figcaption><b>{}</b> <span class=\"fc-now\">now: {}</span></figcaption>",
        esc(title),
        if now.is_empty() { "-".into() } else { now.join(" · ") }
    );
    out.push_str(&p.finish());
    out.push_str("<ul class=\"fc-legend\">");
    for s in series {
        let _ = write!(
            out,
            "<li><i class=\"fc-key fc-s{}\"></i>{}</li>",
            s.colour,
            esc(&s.name)
        );
    }
    out.push_str("</ul></figure>");
    out
}

/// The y axis (ticks with values) and the time axis (minutes ago).
fn axes(p: &mut Svg, unit: Unit, ticks: &[f64], y: impl Fn(f64) -> f64, cols: &Columns) {
    for t in ticks {
        p.line(LEFT, y(*t), W - RIGHT, y(*t), "grid");
        p.text(LEFT - 4.0, y(*t) + 4.0, "end", "fc-tick", &fmt(unit, *t));
    }
    p.line(LEFT, TOP, LEFT, H - BOTTOM, "axis");
    p.line(LEFT, H - BOTTOM, W - RIGHT, H - BOTTOM, "axis");
    let minutes = cols.window as f64 / 60.0;
    for q in 0..=4 {
        let f = q as f64 / 4.0;
        let xq = LEFT + f * (W - LEFT - RIGHT);
        let ago = minutes * (1.0 - f);
        let label = if q == 4 {
            "now".to_string()
        } else if ago >= 1.0 {
            format!("{} min ago", svg::value(ago, ""))
        } else {
            format!("{:.0} s ago", ago * 60.0)
        };
        let anchor = match q {
            0 => "start",
            4 => "end",
            _ => "middle",
        };
        p.line(xq, H - BOTTOM, xq, H - BOTTOM + 4.0, "axis");
        p.text(xq, H - 6.0, anchor, "fc-tick", &label);
    }
}

/// A series as lines through its known values (a gap where none is
/// known; a lone value as a dot).
fn lines(p: &mut Svg, s: &Series, x: impl Fn(usize) -> f64, y: impl Fn(f64) -> f64) {
    let class = format!("fc-line fc-s{}", s.colour);
    let mut run: Vec<(f64, f64)> = Vec::new();
    let flush = |p: &mut Svg, run: &mut Vec<(f64, f64)>| {
        match run.len() {
            0 => {}
            1 => p.rect(
                run[0].0 - 1.5,
                run[0].1 - 1.5,
                3.0,
                3.0,
                &format!("fc-dot fc-s{}", s.colour),
                "",
                &[],
            ),
            _ => p.polyline(run, &class, &s.name),
        }
        run.clear();
    };
    for (i, v) in s.values.iter().enumerate() {
        match v {
            Some(v) => run.push((x(i), y(*v))),
            None => flush(p, &mut run),
        }
    }
    flush(p, &mut run);
}

fn series(name: &str, colour: usize, values: Vec<Option<f64>>) -> Series {
    Series {
        name: name.into(),
        colour,
        values,
    }
}

/// Every chart, and the tables of the lanes and of keys cooling now.
pub fn render(ring: &Ring, now: SystemTime) -> String {
    let c = columns(ring, now);
    let per = c.per();
    let mut b = String::from("<div class=\"fc-grid\" id=\"charts\">");
    b.push_str(&chart(
        "throughput",
        &format!("Jobs ended per {per}"),
        Unit::Count,
        &c,
        &[
            series("completed", 2, c.sum(|s| s.completed)),
            series("failed", 1, c.sum(|s| s.failed)),
        ],
    ));
    b.push_str(&chart(
        "queue",
        "Queue depth per kind (tickets)",
        Unit::Count,
        &c,
        &c.keyed(|s| s.gauges.as_ref().map(|g| &g.queue_by_kind), true),
    ));
    b.push_str(&chart(
        "submit_to_start",
        "Submit to start (sampled)",
        Unit::Secs,
        &c,
        &[
            series("p50", 0, c.quantile(|s| &s.submit_start, false)),
            series("p95", 4, c.quantile(|s| &s.submit_start, true)),
        ],
    ));
    b.push_str(&chart(
        "run_time",
        "Run time (claim to end)",
        Unit::Secs,
        &c,
        &[
            series("p50", 0, c.quantile(|s| &s.run_time, false)),
            series("p95", 4, c.quantile(|s| &s.run_time, true)),
        ],
    ));
    b.push_str(&chart(
        "failures",
        &format!("Failures by class per {per}"),
        Unit::Count,
        &c,
        &c.keyed(|s| Some(&s.failures), false),
    ));
    let mut limited = vec![series("429s", 1, c.sum(|s| s.rate_limited))];
    for mut s in c.keyed(|s| Some(&s.cooldowns), false) {
        s.name = format!("cooldowns {}", s.name);
        s.colour = (s.colour + 2) % SERIES_MAX;
        limited.push(s);
    }
    b.push_str(&chart(
        "rate_limits",
        &format!("429s and cooldowns per provider key per {per}"),
        Unit::Count,
        &c,
        &limited,
    ));
    b.push_str(&chart(
        "workers",
        "Workers and slots",
        Unit::Count,
        &c,
        &[
            series("workers", 0, c.gauge(|g| Some(g.workers as f64))),
            series(
                "slots in use",
                2,
                c.gauge(|g| g.slots_in_use.map(|n| n as f64)),
            ),
            series("slots", 5, c.gauge(|g| Some(g.slots_total as f64))),
        ],
    ));
    b.push_str(&tables(ring));
    b.push_str("</div>");
    b
}

/// The latest sample's lanes, statuses and cooling keys, as tables.
fn tables(ring: &Ring) -> String {
    let g = ring.samples().rev().find_map(|s| s.gauges.as_ref());
    let mut b = String::from("<div class=\"fc-tables\">");
    // `Err`: the sampler could not know.
    let table = |b: &mut String,
                 head: &str,
                 unit: &str,
                 m: Result<Option<&BTreeMap<String, u64>>, ()>| {
        let _ = write!(b, "<table class=\"fc-table\"><thead><tr><th>{head}</th><th>{unit}</th></tr></thead><tbody>");
        match m.map(|m| m.filter(|m| !m.is_empty())) {
            Err(()) => b.push_str("<tr><td colspan=\"2\">not known</td></tr>"),
            Ok(None) => b.push_str("<tr><td colspan=\"2\">none</td></tr>"),
            Ok(Some(m)) => {
                for (k, n) in m {
                    let _ = write!(b, "<tr><td>{}</td><td>{n}</td></tr>", esc(k));
                }
            }
        }
        b.push_str("</tbody></table>");
    };
    table(
        &mut b,
        "lane (kind/tenant/priority)",
        "tickets",
        Ok(g.map(|g| &g.queue_by_lane)),
    );
    table(
        &mut b,
        "index status",
        "jobs",
        match g {
            Some(g) => g.index_by_status.as_ref().map(Some).ok_or(()),
            None => Ok(None),
        },
    );
    table(
        &mut b,
        "provider key cooling",
        "seconds left",
        Ok(g.map(|g| &g.cooling)),
    );
    b.push_str("</div>");
    b
}

/// The charts of `app`'s ring as they are now.
pub fn html(app: &App) -> String {
    let ring = app.charts.snapshot();
    render(&ring, SystemTime::now())
}

/// `GET /fleet/charts`: the charts, an HTML fragment.
pub async fn fragment(State(app): State<Arc<App>>, _caller: Caller) -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        app.clean(&html(&app)),
    )
        .into_response()
}

/// `GET /v1/fleet/charts`: the ring as JSON (see docs/reference.md).
pub async fn json(State(app): State<Arc<App>>, _caller: Caller) -> Response {
    let body = app.charts.snapshot().json().to_string();
    (
        [(header::CONTENT_TYPE, "application/json")],
        app.clean(&body),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::charts::Gauges;

    fn ring() -> (Ring, SystemTime) {
        let mut r = Ring::new(Duration::from_secs(10), 360);
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        for i in (0..30u64).rev() {
            let s = r.at(now - Duration::from_secs(10 * i)).unwrap();
            s.completed = i;
            s.failures.insert("terminal".into(), 1);
            s.run_time.add(i as f64);
            s.gauges = Some(Gauges {
                queue_by_kind: [("echo".to_string(), 3)].into(),
                workers: 2,
                slots_total: 8,
                slots_in_use: Some(1),
                ..Default::default()
            });
        }
        (r, now)
    }

    #[test]
    fn an_hour_of_ten_second_samples_is_sixty_one_minute_columns() {
        let (r, now) = ring();
        let c = columns(&r, now);
        assert_eq!((c.cols.len(), c.span, c.window), (60, 60, 3600));
        let sums = c.sum(|s| s.completed);
        // The last five minutes hold samples 0..29, newest last.
        assert_eq!(sums[59], Some(15.0), "samples 0..=5 in the last minute");
        assert!(
            sums[..55].iter().all(|v| *v == Some(0.0)),
            "nothing before: {sums:?}"
        );
        let g = c.gauge(|g| Some(g.workers as f64));
        assert!(
            g[..55].iter().all(Option::is_none),
            "no gauge before the first sample"
        );
        assert_eq!(g[59], Some(2.0));
        let total: f64 = sums.iter().flatten().sum();
        assert_eq!(total, (0..30).sum::<u64>() as f64);
    }

    #[test]
    fn counts_the_sampler_could_not_know_are_said_so_not_drawn_as_zero() {
        let (mut r, now) = ring();
        r.at(now).unwrap().gauges = Some(Gauges {
            workers: 2,
            slots_total: 8,
            slots_in_use: None,
            index_by_status: None,
            ..Default::default()
        });
        let c = columns(&r, now);
        let used = c.gauge(|g| g.slots_in_use.map(|n| n as f64));
        assert_eq!(used[59], Some(1.0), "the last known value, not 0");
        let out = render(&r, now);
        assert!(
            out.contains("<th>index status</th><th>jobs</th></tr></thead><tbody><tr><td colspan=\"2\">not known</td>"),
            "{out}"
        );
    }

    #[test]
    fn a_chart_has_axes_a_legend_its_current_value_and_hover_titles() {
        let (r, now) = ring();
        let out = render(&r, now);
        assert_eq!(out.matches("<figure class=\"fc\"").count(), 7, "{out}");
        assert!(out.contains("data-chart=\"throughput\""));
        assert!(out.contains("min ago</text>") && out.contains(">now</text>"));
        assert!(out.contains("class=\"fc-legend\"><li><i class=\"fc-key fc-s2\"></i>completed"));
        assert!(
            out.contains("workers <b>2</b> · slots in use <b>1</b> · slots <b>8</b>"),
            "{out}"
        );
        assert!(out.contains("<title>") && out.contains("UTC (1 min): completed"));
        assert!(out.contains("<td>echo</td>") || out.contains("echo"));
        assert!(out.contains("Jobs ended per 1 min"));
        // Durations read as durations on the run time's axis.
        assert!(out.contains(" s</text>"), "{out}");
    }

    #[test]
    fn an_empty_ring_draws_empty_charts() {
        let r = Ring::new(Duration::from_secs(1), 360);
        let out = render(&r, SystemTime::now());
        assert_eq!(out.matches("<figure class=\"fc\"").count(), 7);
        assert!(out.contains("no data") && out.contains("none"));
    }
}
