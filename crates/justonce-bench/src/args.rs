//! `justonce bench`'s arguments, and the settings they ask for.

use crate::modes::Mode;
use anyhow::{Context, Result};
use justonce_cli_support::pacing;
use justonce_sql::Key;
use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

/// `justonce bench`'s arguments, as given: [`Settings`] is what they ask for, checked.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The database to measure; the configured one by default.
    #[arg(long)]
    database: Option<String>,
    /// Messages in the generated stream. By default their distinct keys fit in the
    /// recent keys an inbox remembers (10,000), as the second run through them assumes.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    messages: u64,
    /// The share of messages, in percent, that repeat an earlier key.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u8).range(0..100))]
    duplicates: u8,
    /// Messages per transaction for claim_many, comma-separated: the throughput section
    /// measures each, the latency section the first.
    #[arg(long, value_delimiter = ',', default_value = "1000",
          value_parser = clap::value_parser!(u64).range(1..))]
    batch: Vec<u64>,
    /// Concurrent workers, each with its share of the stream.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    workers: u64,
    /// The throughput section runs only this share of the stream, as worker INDEX of COUNT
    /// takes it: 1/2 the first, third, fifth message…, 2/2 the second, fourth…. So that
    /// COUNT bench processes on one database run the stream between them, each in tables
    /// of its own, with its `--workers`.
    #[arg(long, value_name = "INDEX/COUNT", value_parser = share)]
    share: Option<Share>,
    /// The throughput section measures only the batched modes (hand-written-batched,
    /// hand-written-claim_many and claim_many), so that a stream long enough to time them
    /// well does not also go through the one-by-one modes, a hundred times slower.
    #[arg(long)]
    batched_only: bool,
    /// Only these modes of the throughput section, comma-separated; `run` brings
    /// `run-again`. A mode whose baseline is left out prints no ratio.
    #[arg(long, value_delimiter = ',',
          value_parser = clap::builder::PossibleValuesParser::new(Mode::NAMES))]
    modes: Vec<String>,
    /// How many times the throughput section runs its modes, alternating, each round on
    /// fresh tables: it prints each mode's median, and the median, lowest and highest of
    /// its ratios to its baseline in the same round. 1 runs each mode once.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=1_000))]
    rounds: u64,
    /// Key table sizes at which to measure claim latency, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "100000,1000000")]
    sizes: Vec<u64>,
    /// Claims timed at each size, and before and during the purge.
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(1..))]
    samples: u64,
    /// Expired keys to purge.
    #[arg(long, default_value_t = 1_000_000)]
    purge: u64,
    /// Keys deleted per statement while purging, as `justonce purge --batch-size`.
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(1..))]
    purge_batch: u32,
    /// Before each purge statement, a pause this many times as long as the last one took,
    /// as `justonce purge --pause`: 1 lets the purge take about half of the database's
    /// time, 0 purges flat out.
    #[arg(long, default_value_t = pacing::DEFAULT_RATIO, value_parser = pacing::pause_ratio)]
    purge_pause: f64,
    /// How long the sustained section runs, such as 90s or 10m.
    #[arg(long, default_value = "1m", value_parser = run_length)]
    duration: std::time::Duration,
    /// Events the receiver section posts under each of its two loads.
    #[arg(long, default_value_t = 5_000, value_parser = clap::value_parser!(u64).range(1..))]
    requests: u64,
    /// Connections of the receiver section's closed loop, each posting its next event when
    /// the last is answered.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1_000))]
    clients: u64,
    /// Events per second the receiver section's open loop starts, whatever the answers do.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    rate: u64,
    /// The receiver section posts its events, unsigned, to this URL instead of to the
    /// receiver it serves: another receiver, under the same loads. Given more than once,
    /// the events are spread over the URLs in turn: several processes on one database.
    /// What they store is for whoever runs it to check.
    #[arg(long, value_name = "URL")]
    receiver_url: Vec<String>,
    /// Whether concurrent `run_forward` calls share commits, as `server.share_commits`
    /// has the receiver's: `false` measures a commit per event.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    share_commits: bool,
    /// Keys the capacity section claims, measures and purges.
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    capacity_keys: u64,
    /// Outbox rows, each with a 1 KiB body, the capacity section writes, delivers,
    /// measures and purges.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    capacity_outbox: u64,
    /// Only these sections, comma-separated; all but sustained and capacity by default.
    #[arg(long, value_delimiter = ',', value_enum)]
    only: Vec<Section>,
    /// One JSON object per result, for scripts.
    #[arg(long)]
    json: bool,
    /// Write SVG charts into this folder (created if missing): throughput by batch size
    /// (throughput-by-batch.svg) and claim latency by key table size
    /// (latency-by-table-size.svg), for the sections that run.
    #[arg(long, value_name = "DIR")]
    chart: Option<PathBuf>,
}

impl Args {
    /// The database named with `--database`, if any.
    pub fn database(&self) -> Option<&str> {
        self.database.as_deref()
    }
}

impl TryFrom<Args> for Settings {
    type Error = anyhow::Error;

    fn try_from(args: Args) -> Result<Self> {
        let sections = if args.only.is_empty() {
            vec![
                Section::Throughput,
                Section::Latency,
                Section::Purge,
                Section::Receiver,
            ]
        } else {
            args.only
        };
        let count = |n: u64| usize::try_from(n).context("a count beyond this machine's memory");
        Ok(Settings {
            messages: count(args.messages)?,
            duplicates: usize::from(args.duplicates),
            batches: args.batch.into_iter().map(count).collect::<Result<_>>()?,
            workers: count(args.workers)?,
            share: args.share,
            batched_only: args.batched_only,
            modes: args.modes,
            rounds: count(args.rounds)?,
            sizes: args.sizes,
            samples: count(args.samples)?,
            purge: args.purge,
            purge_batch: args.purge_batch,
            purge_pause: args.purge_pause,
            duration: args.duration,
            requests: count(args.requests)?,
            capacity_keys: count(args.capacity_keys)?,
            capacity_outbox: count(args.capacity_outbox)?,
            clients: count(args.clients)?,
            rate: count(args.rate)?,
            receiver_urls: args.receiver_url,
            share_commits: args.share_commits,
            sections,
            json: args.json,
            chart: args.chart,
        })
    }
}

/// One worker's share of a stream: every `count`th message from the `index`th (from 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Share {
    index: usize,
    count: usize,
}

impl Share {
    /// This share of `keys`, and how many distinct keys it holds.
    pub(crate) fn of(self, keys: &[Key]) -> (Vec<Key>, usize) {
        let share: Vec<Key> = keys
            .iter()
            .skip(self.index)
            .step_by(self.count)
            .cloned()
            .collect();
        let distinct = share.iter().map(Key::as_str).collect::<HashSet<_>>().len();
        (share, distinct)
    }
}

impl std::fmt::Display for Share {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index + 1, self.count)
    }
}

/// `INDEX/COUNT`, with INDEX from 1 to COUNT.
pub(crate) fn share(text: &str) -> Result<Share, String> {
    let expected =
        || format!("expected INDEX/COUNT with INDEX from 1 to COUNT, such as 1/2, not {text:?}");
    let (index, count) = text.split_once('/').ok_or_else(expected)?;
    let (Ok(index), Ok(count)) = (index.parse::<usize>(), count.parse::<usize>()) else {
        return Err(expected());
    };
    if index == 0 || index > count {
        return Err(expected());
    }
    Ok(Share {
        index: index - 1,
        count,
    })
}

/// A duration of at least a second.
fn run_length(text: &str) -> Result<std::time::Duration, String> {
    match justonce_cli_support::parse_duration(text) {
        Ok(duration) if duration.as_secs() >= 1 => Ok(duration),
        Ok(_) => Err("expected at least 1s".to_owned()),
        Err(error) => Err(error.to_string()),
    }
}

/// What `justonce bench` measures, from its [`Args`].
#[derive(Debug, Clone)]
pub struct Settings {
    pub(crate) messages: usize,
    pub(crate) duplicates: usize,
    /// Batch sizes for claim_many: the throughput section measures each, the latency
    /// section the first.
    pub(crate) batches: Vec<usize>,
    pub(crate) workers: usize,
    /// The throughput section's share of the stream; all of it when none.
    pub(crate) share: Option<Share>,
    /// The throughput section skips the modes that take a message at a time.
    pub(crate) batched_only: bool,
    /// The throughput section's modes by name; all when empty.
    pub(crate) modes: Vec<String>,
    /// How many times the throughput section runs its modes, alternating; it reports
    /// medians.
    pub(crate) rounds: usize,
    pub(crate) sizes: Vec<u64>,
    pub(crate) samples: usize,
    pub(crate) purge: u64,
    pub(crate) purge_batch: u32,
    pub(crate) purge_pause: f64,
    /// How long the sustained section runs.
    pub(crate) duration: Duration,
    /// Events the receiver section posts under each load.
    pub(crate) requests: usize,
    /// Keys the capacity section claims and purges.
    pub(crate) capacity_keys: usize,
    /// Outbox rows the capacity section writes, delivers and purges.
    pub(crate) capacity_outbox: usize,
    /// The receiver section's connections posting back to back.
    pub(crate) clients: usize,
    /// The receiver section's events started per second.
    pub(crate) rate: usize,
    /// Where the receiver section posts instead of to its own receiver, in turn.
    pub(crate) receiver_urls: Vec<String>,
    /// Whether concurrent `run_forward` calls share commits.
    pub(crate) share_commits: bool,
    pub(crate) sections: Vec<Section>,
    pub(crate) json: bool,
    /// Where to write the charts, if anywhere.
    pub(crate) chart: Option<PathBuf>,
}

/// A part of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Section {
    /// Messages per second, beside the hand-written client and the one-statement limit.
    Throughput,
    /// Claim latency and batched throughput as the key table grows.
    Latency,
    /// Keys purged per second, and claim latency while the purge runs.
    Purge,
    /// Webhooks accepted per second and the time to 2xx, for the receiver `justonce serve`
    /// runs, with a load generator on loopback.
    Receiver,
    /// Resident memory over a long run (--duration): `Inbox::run` on an endless stream, the
    /// peak RSS of each tenth of the run. Only when asked for.
    Sustained,
    /// What keys and outbox rows cost the database: claims per second, table and index
    /// bytes, write-ahead log bytes, and the purge (--capacity-keys, --capacity-outbox).
    /// Only when asked for.
    Capacity,
}

impl Settings {
    /// The throughput section's `claim_many` alone, at one batch size, in one round; every
    /// other setting is `justonce bench`'s default.
    pub(crate) fn claim_many_once(
        messages: usize,
        duplicates: usize,
        batch: usize,
    ) -> Result<Self> {
        #[derive(clap::Parser)]
        struct Bench {
            #[command(flatten)]
            args: Args,
        }
        let args = [
            "bench".to_owned(),
            "--only=throughput".to_owned(),
            "--batched-only".to_owned(),
            "--rounds=1".to_owned(),
            format!("--messages={messages}"),
            format!("--duplicates={duplicates}"),
            format!("--batch={batch}"),
        ];
        let bench = <Bench as clap::Parser>::try_parse_from(args)?;
        Self::try_from(bench.args)
    }
}
