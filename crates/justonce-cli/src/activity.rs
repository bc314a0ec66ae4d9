//! The events accepted and the duplicates of the last hour, minute by minute, for the status
//! page's chart: sampled once a minute from the claim counters every webhook and consumer
//! keeps (`justonce_claims_total`).

use metrics_exporter_prometheus::PrometheusHandle;
use std::collections::VecDeque;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

/// How often the counters are sampled: one bar of the chart.
pub const MINUTE: Duration = Duration::from_secs(60);
/// The bars of the chart: an hour.
const MINUTES: usize = 60;

/// Claim counts since the service started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    pub accepted: u64,
    pub duplicates: u64,
}

/// The samples of the last hour.
pub struct Activity {
    prometheus: PrometheusHandle,
    /// The totals at the start of each of the last minutes, oldest first.
    samples: Mutex<VecDeque<Totals>>,
}

impl Activity {
    /// Starts with one sample: the counts before the first minute.
    pub fn new(prometheus: PrometheusHandle) -> Self {
        let activity = Self {
            prometheus,
            samples: Mutex::new(VecDeque::with_capacity(MINUTES + 1)),
        };
        activity.sample();
        activity
    }

    /// Notes the totals now: a minute has passed.
    pub fn sample(&self) {
        let now = self.totals();
        let mut samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        if samples.len() == MINUTES {
            samples.pop_front();
        }
        samples.push_back(now);
    }

    /// The counts of each minute sampled, oldest first, and of the minute in progress.
    pub fn minutes(&self) -> Vec<Totals> {
        let now = self.totals();
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        samples
            .iter()
            .zip(samples.iter().skip(1).chain([&now]))
            .map(|(start, end)| Totals {
                accepted: end.accepted.saturating_sub(start.accepted),
                duplicates: end.duplicates.saturating_sub(start.duplicates),
            })
            .collect()
    }

    fn totals(&self) -> Totals {
        totals(&self.prometheus.render())
    }
}

/// The claim counters in Prometheus text: processed claims are accepted events.
fn totals(rendered: &str) -> Totals {
    let mut totals = Totals::default();
    for line in rendered.lines() {
        let Some(rest) = line.strip_prefix("justonce_claims_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        // Counters are whole numbers, rendered as floats.
        let value = value as u64;
        if labels.contains("outcome=\"processed\"") {
            totals.accepted += value;
        } else if labels.contains("outcome=\"duplicate\"") {
            totals.duplicates += value;
        }
    }
    totals
}

/// A bar chart of `minutes`, oldest left, as inline SVG: accepted and duplicates side by
/// side in each minute, with their sums in the caption.
pub fn chart(minutes: &[Totals]) -> String {
    const WIDTH: usize = 10;
    const HEIGHT: u64 = 100;
    let highest = minutes
        .iter()
        .map(|m| m.accepted.max(m.duplicates))
        .max()
        .unwrap_or(0)
        .max(1);
    let height = |count: u64| count * HEIGHT / highest;
    let mut bars = String::new();
    // The newest minute at the right edge, whatever the number of minutes so far.
    let first = MINUTES.saturating_sub(minutes.len());
    for (slot, minute) in minutes.iter().enumerate() {
        let x = (first + slot) * WIDTH;
        for (offset, count, color) in [
            (0, minute.accepted, "#2a7"),
            (WIDTH / 2, minute.duplicates, "#999"),
        ] {
            let h = height(count);
            let _ = write!(
                bars,
                "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{h}\" fill=\"{color}\"/>",
                x + offset,
                HEIGHT - h,
                WIDTH / 2 - 1,
            );
        }
    }
    let accepted: u64 = minutes.iter().map(|m| m.accepted).sum();
    let duplicates: u64 = minutes.iter().map(|m| m.duplicates).sum();
    format!(
        "<figure><svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{HEIGHT}\" \
         role=\"img\" aria-label=\"events per minute\">{bars}</svg>\
         <figcaption>last hour, a bar a minute: <span style=\"color:#2a7\">accepted {accepted}</span>, \
         <span style=\"color:#999\">duplicates {duplicates}</span></figcaption></figure>",
        MINUTES * WIDTH
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_claim_counters_are_summed_by_outcome() {
        let rendered = "\
# TYPE justonce_claims_total counter
justonce_claims_total{outcome=\"processed\",answered_by=\"database\"} 7
justonce_claims_total{outcome=\"duplicate\",answered_by=\"database\"} 2
justonce_claims_total{outcome=\"duplicate\",answered_by=\"recent\"} 3
justonce_claims_total{outcome=\"key_reused\",answered_by=\"database\"} 1
justonce_webhooks_total{source=\"demo\",outcome=\"accepted\"} 7
";
        assert_eq!(
            totals(rendered),
            Totals {
                accepted: 7,
                duplicates: 5
            }
        );
        assert_eq!(totals(""), Totals::default());
    }

    #[test]
    fn the_chart_has_two_bars_a_minute_and_the_sums() {
        let minutes = [
            Totals {
                accepted: 4,
                duplicates: 0,
            },
            Totals {
                accepted: 2,
                duplicates: 2,
            },
        ];
        let svg = chart(&minutes);
        assert_eq!(svg.matches("<rect ").count(), 4);
        // The busiest minute is full height; the newest is at the right edge.
        assert!(
            svg.contains("<rect x=\"580\" y=\"0\" width=\"4\" height=\"100\""),
            "{svg}"
        );
        assert!(
            svg.contains("<rect x=\"590\" y=\"50\" width=\"4\" height=\"50\""),
            "{svg}"
        );
        assert!(
            svg.contains("accepted 6") && svg.contains("duplicates 2"),
            "{svg}"
        );
    }
}
