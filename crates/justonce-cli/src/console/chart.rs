//! Bar charts as inline SVG, drawn on the server: two series side by side, a pair of bars
//! per step of time, the newest at the right.

use std::fmt::Write;

/// The most pairs of bars a chart draws: longer series are summed over several minutes.
const MAX_BARS: usize = 120;
const WIDTH: usize = 600;
const HEIGHT: u64 = 100;

/// One series: its name, its CSS class and a value per minute, oldest first.
pub struct Series<'a> {
    pub name: &'a str,
    pub class: &'a str,
    pub values: Vec<u64>,
}

/// A chart of `first` and `second`, which have a value for each of the same minutes, with
/// `label` for screen readers and a caption naming each series with its sum.
pub fn bars(label: &str, first: &Series, second: &Series) -> String {
    let minutes = first.values.len().max(1);
    let per_bar = minutes.div_ceil(MAX_BARS);
    let sum_by_bar = |values: &[u64]| -> Vec<u64> {
        values
            .chunks(per_bar)
            .map(|chunk| chunk.iter().sum())
            .collect()
    };
    let (a, b) = (sum_by_bar(&first.values), sum_by_bar(&second.values));
    let highest = a.iter().chain(&b).copied().max().unwrap_or(0).max(1);
    let slot = WIDTH / a.len().max(1);
    let bar = (slot / 2).saturating_sub(1).max(1);
    let mut svg = String::new();
    for (index, pair) in a.iter().zip(&b).enumerate() {
        for (offset, value, class) in [(0, *pair.0, first.class), (slot / 2, *pair.1, second.class)]
        {
            if value == 0 {
                continue;
            }
            let height = (value * HEIGHT).div_ceil(highest);
            let _ = write!(
                svg,
                "<rect class=\"{class}\" x=\"{}\" y=\"{}\" width=\"{bar}\" height=\"{height}\"/>",
                index * slot + offset,
                HEIGHT - height,
            );
        }
    }
    let step = match per_bar {
        1 => "a minute".to_owned(),
        n => format!("{n} minutes"),
    };
    format!(
        "<figure><svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {WIDTH} {HEIGHT}\" \
         preserveAspectRatio=\"none\" role=\"img\" aria-label=\"{label}\">{svg}</svg>\
         <figcaption>a pair of bars for {step}, the newest at the right: \
         <span class=\"{}\">{} {}</span>, <span class=\"{}\">{} {}</span>; highest {highest}\
         </figcaption></figure>",
        first.class,
        first.name,
        first.values.iter().sum::<u64>(),
        second.class,
        second.name,
        second.values.iter().sum::<u64>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_series_are_summed_into_at_most_the_bars_that_fit() {
        let series = |name, values| Series {
            name,
            class: name,
            values,
        };
        let day = bars(
            "events",
            &series("accepted", vec![1; 1_440]),
            &series("duplicates", vec![0; 1_440]),
        );
        // 1,440 minutes, 12 a bar: 120 bars of 12, none for the empty series.
        assert_eq!(day.matches("<rect ").count(), 120);
        assert!(day.contains("accepted 1440"), "{day}");
        assert!(day.contains("12 minutes"), "{day}");
        let hour = bars(
            "events",
            &series("accepted", vec![4, 0, 2]),
            &series("duplicates", vec![0, 0, 2]),
        );
        // The busiest minute is full height.
        assert!(
            hour.contains("x=\"0\" y=\"0\" width=\"99\" height=\"100\""),
            "{hour}"
        );
        assert!(
            hour.contains("y=\"50\" width=\"99\" height=\"50\""),
            "{hour}"
        );
    }
}
