//! Pictures drawn on the server as SVG text: no script, no build step, no
//! external request. Every string that reaches the picture is escaped here;
//! colours come from classes in `console.css`, so the dark and the light
//! theme are the stylesheet's business alone.
//!
//! A picture is drawn in its own coordinates (`viewBox`) and scales to the
//! width it is given, so one drawing reads at 1280 px and on a phone.

use std::fmt::Write;

use crate::render::esc;

/// One SVG picture being drawn.
#[derive(Debug)]
pub struct Svg {
    w: f64,
    h: f64,
    label: String,
    class: String,
    body: String,
}

impl Svg {
    /// A picture of `w` × `h` units; `label` is what a screen reader says.
    pub fn new(w: f64, h: f64, label: &str, class: &str) -> Svg {
        Svg {
            w,
            h,
            label: label.to_string(),
            class: class.to_string(),
            body: String::new(),
        }
    }

    pub fn width(&self) -> f64 {
        self.w
    }

    pub fn height(&self) -> f64 {
        self.h
    }

    /// A rectangle; `title` (shown on hover) may be empty, `data` is
    /// written as `data-*` attributes (names are ours, values escaped).
    #[allow(clippy::too_many_arguments)]
    pub fn rect(
        &mut self,
        x: f64,
        y: f64,
        w: f64,
        h: f64,
        class: &str,
        title: &str,
        data: &[(&str, &str)],
    ) {
        let _ = write!(
            self.body,
            "<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{:.1}\" class=\"{}\"",
            w.max(0.5),
            h.max(0.5),
            esc(class)
        );
        for (k, v) in data {
            let _ = write!(self.body, " data-{k}=\"{}\"", esc(v));
        }
        if title.is_empty() {
            self.body.push_str("/>");
        } else {
            let _ = write!(self.body, "><title>{}</title></rect>", esc(title));
        }
    }

    pub fn line(&mut self, x1: f64, y1: f64, x2: f64, y2: f64, class: &str) {
        let _ = write!(
            self.body,
            "<line x1=\"{x1:.1}\" y1=\"{y1:.1}\" x2=\"{x2:.1}\" y2=\"{y2:.1}\" class=\"{}\"/>",
            esc(class)
        );
    }

    /// Text at (`x`, `y`); `anchor` is `start`, `middle` or `end`.
    pub fn text(&mut self, x: f64, y: f64, anchor: &str, class: &str, s: &str) {
        let _ = write!(
            self.body,
            "<text x=\"{x:.1}\" y=\"{y:.1}\" text-anchor=\"{anchor}\" class=\"{}\">{}</text>",
            esc(class),
            esc(s)
        );
    }

    /// A line through `points`, with a hover title.
    pub fn polyline(&mut self, points: &[(f64, f64)], class: &str, title: &str) {
        if points.is_empty() {
            return;
        }
        let mut p = String::new();
        for (x, y) in points {
            let _ = write!(p, "{x:.1},{y:.1} ");
        }
        let _ = write!(
            self.body,
            "<polyline points=\"{}\" class=\"{}\"><title>{}</title></polyline>",
            p.trim_end(),
            esc(class),
            esc(title)
        );
    }

    /// A group start (`<g>`) with a class and `data-*` attributes; close it
    /// with [`Svg::end_group`].
    pub fn group(&mut self, class: &str, data: &[(&str, &str)]) {
        let _ = write!(self.body, "<g class=\"{}\"", esc(class));
        for (k, v) in data {
            let _ = write!(self.body, " data-{k}=\"{}\"", esc(v));
        }
        self.body.push('>');
    }

    pub fn end_group(&mut self) {
        self.body.push_str("</g>");
    }

    /// A link start (`<a href>`) around what follows, up to [`Svg::end_link`].
    pub fn link(&mut self, href: &str) {
        let _ = write!(self.body, "<a href=\"{}\">", esc(href));
    }

    pub fn end_link(&mut self) {
        self.body.push_str("</a>");
    }

    /// The picture as SVG text, scaling to its container's width.
    pub fn finish(self) -> String {
        format!(
            "<svg class=\"{}\" viewBox=\"0 0 {:.0} {:.0}\" width=\"100%\" preserveAspectRatio=\"xMinYMin meet\" role=\"img\" aria-label=\"{}\" xmlns=\"http://www.w3.org/2000/svg\">{}</svg>",
            esc(&self.class),
            self.w,
            self.h,
            esc(&self.label),
            self.body
        )
    }
}

/// Round axis ticks from 0 to at least `max`: about `n` steps of 1, 2 or 5
/// times a power of ten. The last tick is the axis's top.
pub fn ticks(max: f64, n: usize) -> Vec<f64> {
    let max = if max.is_finite() && max > 0.0 {
        max
    } else {
        1.0
    };
    let raw = max / n.max(1) as f64;
    let pow = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * pow)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * pow);
    let count = (max / step).ceil() as usize;
    (0..=count).map(|i| i as f64 * step).collect()
}

/// A value for an axis or a label: `1.2k`, `3.4M`, `0.25`, with its unit.
pub fn value(v: f64, unit: &str) -> String {
    let a = v.abs();
    let n = if a >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if a >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else if a >= 10.0 || v == v.trunc() {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    };
    format!("{}{unit}", n.replace(".0k", "k").replace(".0M", "M"))
}

/// A duration in seconds as a person reads it: `850 ms`, `4.2 s`, `3 min 5 s`, `2 h 10 min`.
pub fn duration(secs: f64) -> String {
    if !secs.is_finite() || secs < 0.0 {
        return "-".into();
    }
    if secs < 1.0 {
        format!("{:.0} ms", secs * 1000.0)
    } else if secs < 60.0 {
        format!("{secs:.1} s")
    } else if secs < 3600.0 {
        let s = secs.round() as u64;
        format!("{} min {} s", s / 60, s % 60)
    } else {
        let m = (secs / 60.0).round() as u64;
        format!("{} h {} min", m / 60, m % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_maximum() {
        assert_eq!(ticks(7.0, 4), vec![0.0, 2.0, 4.0, 6.0, 8.0]);
        assert_eq!(ticks(100.0, 4), vec![0.0, 50.0, 100.0]);
        assert_eq!(ticks(0.0, 4), vec![0.0, 0.5, 1.0]);
        assert_eq!(ticks(f64::NAN, 4), vec![0.0, 0.5, 1.0]);
        let t = ticks(0.037, 3);
        assert!(*t.last().unwrap() >= 0.037 && t.len() <= 5, "{t:?}");
    }

    #[test]
    fn values_and_durations_read_as_a_person_writes_them() {
        assert_eq!(value(1200.0, ""), "1.2k");
        assert_eq!(value(25_000.0, " jobs"), "25k jobs");
        assert_eq!(value(3_000_000.0, ""), "3M");
        assert_eq!(value(0.25, " s"), "0.25 s");
        assert_eq!(value(4.0, ""), "4");
        assert_eq!(duration(0.85), "850 ms");
        assert_eq!(duration(4.21), "4.2 s");
        assert_eq!(duration(185.0), "3 min 5 s");
        assert_eq!(duration(7800.0), "2 h 10 min");
        assert_eq!(duration(-1.0), "-");
    }

    #[test]
    fn every_string_in_a_picture_is_escaped() {
        let mut s = Svg::new(100.0, 20.0, "a <b>", "c\"d");
        s.rect(0.0, 0.0, 1.0, 1.0, "x", "<script>", &[("seq", "1\"2")]);
        s.text(0.0, 0.0, "start", "t", "</svg>");
        let out = s.finish();
        assert!(
            !out.contains("<script>") && !out.contains("</svg><"),
            "{out}"
        );
        assert!(out.contains("data-seq=\"1&quot;2\""), "{out}");
    }
}
