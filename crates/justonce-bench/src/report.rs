//! What the bench prints and draws: a table or one JSON object per result, and the charts.

use crate::args::Settings;
use crate::capacity::Step;
use crate::chart::{Chart, Reference, Series};
use crate::modes::{Load, Mode};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What the charts show, gathered as the sections run.
#[derive(Default)]
pub(crate) struct Figures {
    /// Median messages per second of each throughput mode.
    pub(crate) throughput: Vec<(Mode, f64)>,
    /// Claim p50 and p99 at each key table size.
    pub(crate) latency: Vec<(u64, Duration, Duration)>,
}

impl Figures {
    /// Writes into `dir` a chart for each section that ran; returns the files.
    pub(crate) fn write(
        &self,
        dir: &Path,
        database: &str,
        settings: &Settings,
    ) -> Result<Vec<PathBuf>> {
        let mut charts = Vec::new();
        if !self.throughput.is_empty() {
            let by_batch = |batched: fn(usize) -> Mode| {
                self.throughput
                    .iter()
                    .filter_map(|&(mode, per_second)| {
                        let batch = mode.batch()?;
                        (mode == batched(batch)).then_some((batch as f64, per_second))
                    })
                    .collect()
            };
            let one_by_one = [
                (Mode::HandWritten, "hand-written, one by one", GREY),
                (Mode::Run, "Inbox::run, one by one", BLUE),
            ];
            let references = one_by_one
                .into_iter()
                .filter_map(|(mode, name, color)| {
                    let &(_, y) = self.throughput.iter().find(|(m, _)| *m == mode)?;
                    Some(Reference { name, color, y })
                })
                .collect();
            let chart = Chart {
                title: format!("{database}: claim_many throughput by batch size"),
                subtitle: format!(
                    "{} messages, {}% repeating a key, {} worker(s), one transaction per batch, \
                     median of {} round(s)",
                    settings.messages, settings.duplicates, settings.workers, settings.rounds
                ),
                x_label: "messages per batch",
                y_label: "messages per second",
                series: vec![
                    Series {
                        name: "claim_many",
                        color: GREEN,
                        points: by_batch(Mode::ClaimMany),
                    },
                    Series {
                        name: "claim_many's statements by hand",
                        color: ORANGE,
                        points: by_batch(Mode::HandWrittenClaimMany),
                    },
                    Series {
                        name: "hand-written batch insert",
                        color: GREY,
                        points: by_batch(Mode::HandWrittenBatched),
                    },
                ],
                references,
            };
            charts.push(("throughput-by-batch.svg", chart));
        }
        if !self.latency.is_empty() {
            let at = |p: fn(&(u64, Duration, Duration)) -> Duration| {
                self.latency
                    .iter()
                    .map(|point| (point.0 as f64, millis(p(point))))
                    .collect()
            };
            let chart = Chart {
                title: format!("{database}: claim latency by key table size"),
                subtitle: format!(
                    "{} claims at each size, each an Inbox::run with its effect on a fresh key",
                    settings.samples
                ),
                x_label: "keys in the table",
                y_label: "milliseconds",
                series: vec![
                    Series {
                        name: "p50",
                        color: GREEN,
                        points: at(|point| point.1),
                    },
                    Series {
                        name: "p99",
                        color: RED,
                        points: at(|point| point.2),
                    },
                ],
                references: Vec::new(),
            };
            charts.push(("latency-by-table-size.svg", chart));
        }
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut written = Vec::new();
        for (name, chart) in charts {
            let path = dir.join(name);
            std::fs::write(&path, chart.svg())
                .with_context(|| format!("writing {}", path.display()))?;
            written.push(path);
        }
        Ok(written)
    }
}

/// The colours of the charts, as the console's: justonce green, and grey for a baseline.
pub(crate) const GREEN: &str = "#2a7";
pub(crate) const GREY: &str = "#999";
pub(crate) const BLUE: &str = "#36c";
pub(crate) const RED: &str = "#c33";
pub(crate) const ORANGE: &str = "#e80";

/// Prints results as a table, or one JSON object per result.
#[derive(Clone)]
pub(crate) struct Report {
    pub(crate) json: bool,
    pub(crate) database: &'static str,
}

impl Report {
    pub(crate) fn new(json: bool, database: &'static str) -> Self {
        Self { json, database }
    }

    /// A mode's messages per second in each round, the messages this process ran and each
    /// round's start and end in Unix milliseconds, and its ratio to `against`'s baseline in
    /// each round.
    pub(crate) fn throughput(
        &self,
        mode: Mode,
        settings: &Settings,
        per_round: &[f64],
        (run_messages, windows): (usize, &[[u128; 2]]),
        effects: usize,
        against: Option<(Mode, &[f64])>,
    ) {
        let batch = mode.batch();
        let per_second = median(per_round);
        let ratio = against.map(|(baseline, ratios)| {
            let (low, high) = ratios
                .iter()
                .fold((f64::INFINITY, 0.0_f64), |(l, h), &r| (l.min(r), h.max(r)));
            (baseline, median(ratios), low, high)
        });
        if self.json {
            let hundredths = |r: f64| (r * 100.0).round() / 100.0;
            let result = serde_json::json!({
                "bench": "throughput",
                "database": self.database,
                "mode": mode.name(),
                "workers": settings.workers,
                "share": settings.share.map(|share| share.to_string()),
                "batch": batch,
                "messages": settings.messages,
                "duplicates_percent": settings.duplicates,
                "rounds": per_round.len(),
                "messages_per_second": per_second.round(),
                "messages_per_second_per_round": per_round.iter().map(|r| r.round()).collect::<Vec<_>>(),
                "run_messages": run_messages,
                "run_unix_ms_per_round": windows,
                "effects": effects,
                "effects_equal_distinct_keys": true,
                "baseline": ratio.map(|(baseline, ..)| baseline.name()),
                "against_baseline": ratio.map(|(_, median, ..)| hundredths(median)),
                "against_baseline_min": ratio.map(|(_, _, low, _)| hundredths(low)),
                "against_baseline_max": ratio.map(|(.., high)| hundredths(high)),
            });
            println!("{result}");
            return;
        }
        let mode = match batch {
            Some(batch) => format!("{} ({batch})", mode.name()),
            None => mode.name().to_owned(),
        };
        let ratio = ratio
            .map(|(baseline, median, low, high)| {
                format!("{median:.2}x {} ({low:.2}-{high:.2})", baseline.name())
            })
            .unwrap_or_default();
        let share = settings
            .share
            .map(|share| format!(", share {share} of the stream"))
            .unwrap_or_default();
        println!(
            "throughput  {:<9} {mode:<31} {:>2} worker(s) {per_second:>9.0} msg/s  {ratio:<41} effects {effects} = distinct keys, median of {} round(s){share}",
            self.database,
            settings.workers,
            per_round.len(),
        );
    }

    pub(crate) fn latency(&self, size: u64, latencies: &[Duration], batch: usize, batched: f64) {
        let (p50, p99) = (percentile(latencies, 50), percentile(latencies, 99));
        if self.json {
            let result = serde_json::json!({
                "bench": "latency",
                "database": self.database,
                "keys": size,
                "claims": latencies.len(),
                "p50_ms": millis(p50),
                "p99_ms": millis(p99),
                "batch": batch,
                "batched_messages_per_second": batched.round(),
            });
            println!("{result}");
            return;
        }
        println!(
            "latency     {:<9} {size:>10} keys  claim p50 {:.2} ms  p99 {:.2} ms  batches of {batch}: {batched:.0} msg/s",
            self.database,
            millis(p50),
            millis(p99),
        );
    }

    pub(crate) fn purge(
        &self,
        (purged, batch): (u64, u32),
        took: Duration,
        without: &[Duration],
        during: &[Duration],
    ) {
        let per_second = purged as f64 / took.as_secs_f64();
        let (quiet, busy) = (percentile(without, 99), percentile(during, 99));
        if self.json {
            let result = serde_json::json!({
                "bench": "purge",
                "database": self.database,
                "purged": purged,
                "batch": batch,
                "seconds": took.as_secs_f64(),
                "keys_per_second": per_second.round(),
                "claim_p99_ms_without": millis(quiet),
                "claim_p99_ms_during": millis(busy),
                "claims_during": during.len(),
            });
            println!("{result}");
            return;
        }
        println!(
            "purge       {:<9} {purged:>10} keys  batches of {batch}: {per_second:.0} keys/s  claim p99 {:.2} ms without, {:.2} ms while purging",
            self.database,
            millis(quiet),
            millis(busy),
        );
    }

    pub(crate) fn receiver(
        &self,
        load: Load,
        requests: usize,
        per_second: f64,
        latencies: &[Duration],
        stored_checked: bool,
    ) {
        let (p50, p99) = (percentile(latencies, 50), percentile(latencies, 99));
        // Another receiver's store is its owner's to check: null, not true.
        let keys_equal_events = stored_checked.then_some(true);
        if self.json {
            let (load_name, load_value) = load.json_field();
            let result = serde_json::json!({
                "bench": "receiver",
                "database": self.database,
                "requests": requests,
                load_name: load_value,
                "accepted_per_second": per_second.round(),
                "p50_ms": millis(p50),
                "p99_ms": millis(p99),
                "keys_equal_events": keys_equal_events,
            });
            println!("{result}");
            return;
        }
        let stored = match keys_equal_events {
            Some(_) => format!("keys {requests} = events"),
            None => "store not checked".to_owned(),
        };
        println!(
            "receiver    {:<9} {requests} events {:<17} {per_second:>9.0} accepted/s  to 2xx p50 {:.2} ms  p99 {:.2} ms  {stored}",
            self.database,
            load.described(),
            millis(p50),
            millis(p99),
        );
    }

    /// One step of the capacity section: its rate, the write-ahead log it wrote, and the
    /// table's bytes after it.
    pub(crate) fn capacity(&self, step: &Step) {
        let rows = step.rows as f64;
        let per_second = rows / step.took.as_secs_f64();
        let log_per_row = step.log_bytes.map(|bytes| bytes as f64 / rows);
        let sizes = &step.sizes;
        if self.json {
            let indexes: serde_json::Map<String, serde_json::Value> = (sizes.indexes.iter())
                .map(|(name, bytes)| (name.clone(), (*bytes).into()))
                .collect();
            let result = serde_json::json!({
                "bench": "capacity",
                "database": self.database,
                "step": step.name,
                "rows": step.rows,
                "batch": step.batch,
                "seconds": step.took.as_secs_f64(),
                "rows_per_second": per_second.round(),
                "log_bytes": step.log_bytes,
                "log_bytes_per_row": log_per_row.map(f64::round),
                "table_bytes": sizes.table,
                "index_bytes": sizes.index_bytes(),
                "total_bytes": sizes.total,
                "indexes": indexes,
            });
            println!("{result}");
            return;
        }
        let mib = |bytes: u64| bytes as f64 / 1_048_576.0;
        let log = log_per_row.map_or_else(|| "no log".to_owned(), |b| format!("log {b:.0} B/row"));
        let indexes: Vec<String> = (sizes.indexes.iter())
            .map(|(name, bytes)| format!("{name} {:.1}", mib(*bytes)))
            .collect();
        println!(
            "capacity    {:<9} {:<16} {:>9} rows {per_second:>9.0} rows/s  {log}  then table {:.1} MiB, indexes {:.1} MiB ({}), total {:.1} MiB",
            self.database,
            step.name,
            step.rows,
            mib(sizes.table),
            mib(sizes.index_bytes()),
            indexes.join(", "),
            mib(sizes.total),
        );
    }

    pub(crate) fn chart(&self, path: &Path) {
        if self.json {
            let result = serde_json::json!({
                "bench": "chart",
                "database": self.database,
                "file": path.display().to_string(),
            });
            println!("{result}");
        } else {
            println!("chart       {:<9} {}", self.database, path.display());
        }
    }

    pub(crate) fn sustained(&self, took: Duration, messages: usize, effects: i64, peaks: &[f64]) {
        let per_second = messages as f64 / took.as_secs_f64();
        let (low, high) = peaks
            .iter()
            .fold((f64::INFINITY, 0.0_f64), |(l, h), &p| (l.min(p), h.max(p)));
        let spread = (high - low) / low * 100.0;
        if self.json {
            let result = serde_json::json!({
                "bench": "sustained",
                "database": self.database,
                "seconds": took.as_secs_f64().round(),
                "messages": messages,
                "messages_per_second": per_second.round(),
                "effects": effects,
                "effects_equal_distinct_keys": true,
                "peak_rss_mib_per_tenth": peaks.iter().map(|p| (p * 10.0).round() / 10.0).collect::<Vec<_>>(),
                "spread_percent": (spread * 10.0).round() / 10.0,
            });
            println!("{result}");
            return;
        }
        let peaks: Vec<String> = peaks.iter().map(|p| format!("{p:.1}")).collect();
        println!(
            "sustained   {:<9} {:.0} s, {messages} messages, {per_second:.0} msg/s  peak RSS per tenth {} MiB: spread {spread:.1} %  effects {effects} = distinct keys",
            self.database,
            took.as_secs_f64(),
            peaks.join(" "),
        );
    }

    pub(crate) fn memory(&self) {
        let Some(rss) = status_mib("VmHWM:") else {
            return;
        };
        if self.json {
            let result = serde_json::json!({
                "bench": "memory",
                "database": self.database,
                "peak_rss_mib": (rss * 10.0).round() / 10.0,
            });
            println!("{result}");
        } else {
            println!("memory      {:<9} peak RSS {rss:.1} MiB", self.database);
        }
    }
}

/// The middle value, or the mean of the two middle ones; 0 for none.
pub(crate) fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let middle = sorted.len() / 2;
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 0 => (sorted[middle - 1] + sorted[middle]) / 2.0,
        _ => sorted[middle],
    }
}

/// The `p`th percentile of `samples`.
pub(crate) fn percentile(samples: &[Duration], p: usize) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    let index = (sorted.len() * p).div_ceil(100).saturating_sub(1);
    sorted.get(index).copied().unwrap_or_default()
}

pub(crate) fn millis(duration: Duration) -> f64 {
    (duration.as_secs_f64() * 1_000_000.0).round() / 1_000.0
}

/// A memory figure of this process (`VmRSS:` resident now, `VmHWM:` its peak), where the
/// kernel reports it (Linux).
pub(crate) fn status_mib(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: f64 = status
        .lines()
        .find_map(|line| line.strip_prefix(field))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_is_the_middle_or_the_mean_of_the_two_middle_values() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[7.0]), 7.0);
        assert_eq!(median(&[]), 0.0);
    }

    #[test]
    fn percentiles_pick_the_sample_at_or_above_the_share() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&samples, 50), Duration::from_millis(50));
        assert_eq!(percentile(&samples, 99), Duration::from_millis(99));
        assert_eq!(percentile(&[], 99), Duration::ZERO);
    }
}
