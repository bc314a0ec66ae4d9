//! Line charts as self-contained SVG files, for `justonce bench --chart`: a logarithmic x axis
//! (batch sizes, table sizes) ticked at each measured value, and a linear y axis from zero.

use std::fmt::Write;

/// A chart to draw.
pub struct Chart<'a> {
    pub title: String,
    /// What was measured, under the title.
    pub subtitle: String,
    pub x_label: &'a str,
    pub y_label: &'a str,
    /// Measured points, joined by a line and marked by a circle each.
    pub series: Vec<Series<'a>>,
    /// Values that do not depend on x, drawn as dashed lines across.
    pub references: Vec<Reference<'a>>,
}

pub struct Series<'a> {
    pub name: &'a str,
    pub color: &'a str,
    pub points: Vec<(f64, f64)>,
}

pub struct Reference<'a> {
    pub name: &'a str,
    pub color: &'a str,
    pub y: f64,
}

const WIDTH: f64 = 640.0;
const HEIGHT: f64 = 360.0;
const LEFT: f64 = 72.0;
const RIGHT: f64 = 36.0;
/// Room for the title, the subtitle and one row of the legend above the plot.
const TOP: f64 = 64.0;
/// The height of each further row of the legend.
const LEGEND_ROW: f64 = 18.0;
/// Space between the axis and the first or last point.
const INSET: f64 = 20.0;
const BOTTOM: f64 = 52.0;
/// Horizontal lines across the plot, about.
const Y_TICKS: f64 = 5.0;

impl Chart<'_> {
    /// The chart as an SVG document.
    pub fn svg(&self) -> String {
        let points = self.series.iter().flat_map(|s| s.points.iter());
        let xs: Vec<f64> = points.clone().map(|&(x, _)| x).collect();
        let highest = points
            .map(|&(_, y)| y)
            .chain(self.references.iter().map(|r| r.y))
            .fold(0.0, f64::max);
        let step = nice_step(highest / Y_TICKS);
        let top = (highest / step).ceil().max(1.0) * step;
        let legend = self.legend();
        let rows = legend.last().map_or(1, |entry| entry.row + 1);
        let plot_top = TOP + LEGEND_ROW * (rows - 1) as f64;
        let (plot_width, plot_height) = (WIDTH - LEFT - RIGHT, HEIGHT - plot_top - BOTTOM);
        let log = |x: f64| x.max(1.0).log10();
        let (low, high) = xs
            .iter()
            .map(|&x| log(x))
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), x| {
                (l.min(x), h.max(x))
            });
        // A single x value (or none) sits in the middle.
        let px = |x: f64| {
            if high > low {
                LEFT + INSET + (log(x) - low) / (high - low) * (plot_width - 2.0 * INSET)
            } else {
                LEFT + plot_width / 2.0
            }
        };
        let py = |y: f64| plot_top + plot_height - y / top * plot_height;

        let mut svg = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{HEIGHT}\" \
             viewBox=\"0 0 {WIDTH} {HEIGHT}\" font-family=\"sans-serif\" font-size=\"12\">\n\
             <rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\n\
             <text x=\"{LEFT}\" y=\"20\" font-size=\"14\" font-weight=\"bold\">{}</text>\n\
             <text x=\"{LEFT}\" y=\"36\" fill=\"#555\">{}</text>\n",
            escape(&self.title),
            escape(&self.subtitle)
        );
        let mut tick = 0.0;
        while tick <= top + step / 2.0 {
            let y = py(tick);
            let _ = writeln!(
                svg,
                "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
                WIDTH - RIGHT,
                LEFT - 6.0,
                y + 4.0,
                number(tick, step)
            );
            tick += step;
        }
        let mut ticked: Vec<f64> = xs.clone();
        ticked.sort_by(f64::total_cmp);
        ticked.dedup();
        for x in ticked {
            let _ = writeln!(
                svg,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                px(x),
                plot_top + plot_height + 18.0,
                number(x, x)
            );
        }
        let _ = writeln!(
            svg,
            "<line x1=\"{LEFT}\" y1=\"{0:.1}\" x2=\"{1:.1}\" y2=\"{0:.1}\" stroke=\"#333\"/>\
             <line x1=\"{LEFT}\" y1=\"{7:.1}\" x2=\"{LEFT}\" y2=\"{0:.1}\" stroke=\"#333\"/>\n\
             <text x=\"{2:.1}\" y=\"{3:.1}\" text-anchor=\"middle\">{4}</text>\n\
             <text transform=\"translate(16 {5:.1}) rotate(-90)\" text-anchor=\"middle\">{6}</text>",
            plot_top + plot_height,
            WIDTH - RIGHT,
            LEFT + plot_width / 2.0,
            HEIGHT - 12.0,
            escape(self.x_label),
            plot_top + plot_height / 2.0,
            escape(self.y_label),
            plot_top,
        );
        for reference in &self.references {
            let y = py(reference.y);
            let _ = writeln!(
                svg,
                "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"{}\" \
                 stroke-dasharray=\"6 4\"/>",
                WIDTH - RIGHT,
                reference.color
            );
        }
        for series in &self.series {
            // Joined from left to right, whatever order they were measured in.
            let mut points = series.points.clone();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            let line: Vec<String> = points
                .iter()
                .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
                .collect();
            let _ = writeln!(
                svg,
                "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"/>",
                line.join(" "),
                series.color
            );
            for &(x, y) in &series.points {
                let _ = writeln!(
                    svg,
                    "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"4\" fill=\"{}\">\
                     <title>{}: {}</title></circle>",
                    px(x),
                    py(y),
                    series.color,
                    number(x, x),
                    number(y, step / 100.0)
                );
            }
        }
        // The legend, between the subtitle and the plot, where no point can hide it.
        for LegendEntry {
            name,
            color,
            dash,
            x,
            row,
        } in legend
        {
            let y = TOP - 10.0 + LEGEND_ROW * row as f64;
            let _ = writeln!(
                svg,
                "<line x1=\"{x}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"{color}\" \
                 stroke-width=\"2\"{dash}/><text x=\"{:.1}\" y=\"{y:.1}\">{}</text>",
                y - 4.0,
                x + 24.0,
                y - 4.0,
                x + 30.0,
                escape(name)
            );
        }
        svg.push_str("</svg>\n");
        svg
    }

    /// The legend's entries, series then references, in rows that wrap before the right
    /// edge.
    fn legend(&self) -> Vec<LegendEntry<'_>> {
        let names = self.series.iter().map(|s| (s.name, s.color, "")).chain(
            self.references
                .iter()
                .map(|r| (r.name, r.color, " stroke-dasharray=\"6 4\"")),
        );
        let (mut x, mut row) = (LEFT, 0);
        let mut entries = Vec::new();
        for (name, color, dash) in names {
            let width = legend_width(name);
            if x > LEFT && x + width > WIDTH - RIGHT {
                (x, row) = (LEFT, row + 1);
            }
            entries.push(LegendEntry {
                name,
                color,
                dash,
                x,
                row,
            });
            x += width + 24.0;
        }
        entries
    }
}

/// How wide a legend entry named `name` is: a 24-pixel line, a gap, and about 7 pixels a
/// character at this size.
fn legend_width(name: &str) -> f64 {
    30.0 + 7.0 * name.chars().count() as f64
}

/// A line and a name in the legend, at `x` in its `row`.
struct LegendEntry<'a> {
    name: &'a str,
    color: &'a str,
    /// The line's dash attribute: empty for a series, dashed for a reference.
    dash: &'static str,
    x: f64,
    row: usize,
}

/// 1, 2 or 5 times a power of ten, at least `rough`.
fn nice_step(rough: f64) -> f64 {
    if rough <= 0.0 || !rough.is_finite() {
        return 1.0;
    }
    let power = 10f64.powf(rough.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|&step| step >= rough)
        .unwrap_or(10.0 * power)
}

/// `value` for a label, to `precision` (the smallest difference worth showing): 1k, 250k or
/// 10M where that is precise enough, else with as many decimals as it needs.
fn number(value: f64, precision: f64) -> String {
    for (unit, suffix) in [(1e6, "M"), (1e3, "k")] {
        if value >= unit && precision >= unit / 10.0 {
            let scaled = value / unit;
            return if scaled.fract() == 0.0 {
                format!("{scaled}{suffix}")
            } else {
                format!("{scaled:.1}{suffix}")
            };
        }
    }
    let decimals = (-precision.log10().floor()).clamp(0.0, 6.0) as usize;
    format!("{value:.decimals$}")
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_one_two_or_five_times_a_power_of_ten() {
        assert_eq!(nice_step(0.13), 0.2);
        assert_eq!(nice_step(3.0), 5.0);
        assert_eq!(nice_step(4_000.0), 5_000.0);
        assert_eq!(nice_step(0.0), 1.0);
    }

    #[test]
    fn labels_are_short() {
        assert_eq!(number(1_000.0, 1_000.0), "1k");
        assert_eq!(number(10_000_000.0, 10_000_000.0), "10M");
        assert_eq!(number(18_877.0, 50.0), "18877");
        assert_eq!(number(250.0, 1.0), "250");
        assert_eq!(number(0.25, 0.05), "0.25");
        assert_eq!(number(20_000.0, 5_000.0), "20k");
    }

    #[test]
    fn every_point_is_a_circle_inside_the_plot() {
        let chart = Chart {
            title: "a <b>".to_owned(),
            subtitle: String::new(),
            x_label: "x",
            y_label: "y",
            series: vec![Series {
                name: "s",
                color: "#2a7",
                points: vec![(10.0, 1.0), (1_000.0, 2.0), (100.0, 3.0)],
            }],
            references: vec![Reference {
                name: "r",
                color: "#999",
                y: 4.0,
            }],
        };
        let svg = chart.svg();
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.contains("a &lt;b&gt;"), "{svg}");
        assert_eq!(svg.matches("<circle ").count(), 3);
        // The smallest x nearest the left, the largest nearest the right, a log scale between.
        assert!(svg.contains("<circle cx=\"92.0\""), "{svg}");
        assert!(svg.contains("<circle cx=\"338.0\""), "{svg}");
        assert!(svg.contains("<circle cx=\"584.0\""), "{svg}");
        assert!(svg.contains("points=\"92.0,"), "{svg}");
        assert!(svg.contains(" 338.0,") && svg.contains(" 584.0,"), "{svg}");
        let line = svg.split("points=\"").nth(1).unwrap();
        assert!(line.find(" 338.0,") < line.find(" 584.0,"), "{line}");
    }

    #[test]
    fn a_long_legend_wraps_inside_the_chart_and_moves_the_plot_down() {
        let series = |name| Series {
            name,
            color: "#2a7",
            points: vec![(1.0, 1.0)],
        };
        let chart = Chart {
            title: String::new(),
            subtitle: String::new(),
            x_label: "x",
            y_label: "y",
            series: vec![
                series("claim_many"),
                series("claim_many's statements by hand"),
                series("hand-written batch insert"),
            ],
            references: vec![Reference {
                name: "hand-written, one by one",
                color: "#999",
                y: 1.0,
            }],
        };
        let legend = chart.legend();
        assert_eq!(
            legend.iter().map(|entry| entry.row).collect::<Vec<_>>(),
            [0, 0, 1, 1]
        );
        for entry in &legend {
            let end = entry.x + legend_width(entry.name);
            assert!(end <= WIDTH - RIGHT, "{} ends at {end}", entry.name);
        }
        // The y axis starts below the second row.
        let svg = chart.svg();
        let axis_top = TOP + LEGEND_ROW;
        assert!(
            svg.contains(&format!("y1=\"{axis_top:.1}\" x2=\"{LEFT}\"")),
            "{svg}"
        );
    }
}
