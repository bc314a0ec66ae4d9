//! `justonce bench`: how fast claims are on this database, beside what the same work costs
//! without justonce, as the key table grows, while a purge runs, and behind the webhook
//! receiver.
//!
//! Everything runs in tables of its own (`justonce_bench_<pid>_*`), dropped at the end. Each
//! throughput result checks, and prints, that effect rows equal distinct keys.
//!
//! The hand-written baselines that send `claim_many`'s statements by hand take their text
//! from `justonce_sql::statements`: one copy, the library's.

use crate::chart::{Chart, Reference, Series};
use anyhow::{Context, Result, anyhow, bail, ensure};
use futures_util::future::BoxFuture;
use justonce_cli_support::database::DatabaseKind;
use justonce_cli_support::pacing::Pacer;
use justonce_cli_support::progress::Progress;
use justonce_cli_support::shutdown_signal;
use justonce_sql::sqlx::{self, AssertSqlSafe, MySql, Postgres, Sqlite};
use justonce_sql::statements::{self, ClaimMany};
use justonce_sql::{
    Backend, Claim, Consumer, Fingerprint, Inbox, InboxOptions, Key, Message, Retention,
};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

mod args;
mod chart;
mod receiver;

pub use args::Args;

/// Serves the receiver's router on the listener as `justonce serve` serves webhooks, so that
/// the service's own caps and timeouts are part of what the receiver section times; runs
/// until dropped.
pub type Serve = fn(tokio::net::TcpListener, axum::Router) -> BoxFuture<'static, ()>;

/// The bench's consumer, in the statements it binds.
const CONSUMER: &str = "bench";

/// What `justonce bench` measures, from its [`Args`].
#[derive(Debug, Clone)]
pub struct Settings {
    messages: usize,
    duplicates: usize,
    /// Batch sizes for claim_many: the throughput section measures each, the latency
    /// section the first.
    batches: Vec<usize>,
    workers: usize,
    /// The throughput section skips the modes that take a message at a time.
    batched_only: bool,
    /// How many times the throughput section runs its modes, alternating; it reports
    /// medians.
    rounds: usize,
    sizes: Vec<u64>,
    samples: usize,
    purge: u64,
    purge_batch: u32,
    purge_pause: f64,
    /// How long the sustained section runs.
    duration: Duration,
    /// Events the receiver section posts under each load.
    requests: usize,
    /// The receiver section's connections posting back to back.
    clients: usize,
    /// The receiver section's events started per second.
    rate: usize,
    sections: Vec<Section>,
    json: bool,
    /// Where to write the charts, if anywhere.
    chart: Option<PathBuf>,
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
}

/// Runs the sections of `settings` on the database at `url`, the receiver's behind `serve`.
pub async fn run(url: &str, settings: &Settings, serve: Serve) -> Result<()> {
    match DatabaseKind::of(url).map_err(|unknown| anyhow!("--database: {unknown}"))? {
        DatabaseKind::Sqlite => bench::<Sqlite>(url, settings, serve).await,
        DatabaseKind::MySql => bench::<MySql>(url, settings, serve).await,
        DatabaseKind::Postgres => bench::<Postgres>(url, settings, serve).await,
    }
}

async fn bench<DB: BenchDb>(url: &str, settings: &Settings, serve: Serve) -> Result<()> {
    let prefix = format!("justonce_bench_{}_", std::process::id());
    // A retry horizon of an hour lets the purge section purge keys a day old.
    let retention = Retention::new(Duration::from_secs(86_400), Duration::from_secs(3_600))?;
    let options = InboxOptions::default().prefix(&prefix).retention(retention);
    let inbox = Inbox::<DB>::connect_with(url, Consumer::new(CONSUMER)?, options.clone())
        .await
        .context("opening the database")?;
    inbox.migrate().await?;
    let bench = Bench {
        tables: BenchTables::new(&prefix, DB::claim_many(&prefix)?),
        inbox,
        options,
        hand_claim_ids: AtomicI64::new(1),
        settings,
        serve,
        report: Report::new(settings.json, DB::LABEL),
    };
    // Interrupted, the bench still drops its tables: a stopped section is not worth a
    // million rows left behind.
    let result = tokio::select! {
        result = bench.sections() => result,
        () = shutdown_signal() => Err(anyhow::anyhow!("interrupted")),
    };
    // A second signal while dropping stops at once, and says what it leaves.
    let dropped = tokio::select! {
        dropped = bench.drop_tables() => dropped,
        () = shutdown_signal() => Err(anyhow::anyhow!(
            "interrupted again: the tables {prefix}* are left"
        )),
    };
    result?;
    dropped?;
    bench.report.memory();
    Ok(())
}

struct Bench<'s, DB: BenchDb> {
    tables: BenchTables,
    inbox: Inbox<DB>,
    /// The inbox's options, for a fresh inbox on the same pool.
    options: InboxOptions,
    /// The claim id of each hand-written batch: what tells its new keys on MySQL, which
    /// has no RETURNING.
    hand_claim_ids: AtomicI64,
    settings: &'s Settings,
    serve: Serve,
    report: Report,
}

impl<DB: BenchDb> Bench<'_, DB> {
    async fn sections(&self) -> Result<()> {
        DB::create_effects(self.inbox.pool(), &self.tables.effects).await?;
        let mut figures = Figures::default();
        for section in &self.settings.sections {
            match section {
                Section::Throughput => self.throughput(&mut figures).await?,
                Section::Latency => self.latency(&mut figures).await?,
                Section::Purge => self.purge().await?,
                Section::Receiver => self.receiver().await?,
                Section::Sustained => self.sustained().await?,
            }
        }
        if let Some(dir) = &self.settings.chart {
            for path in figures.write(dir, DB::LABEL, self.settings)? {
                self.report.chart(&path);
            }
        }
        Ok(())
    }

    /// Each mode on the same generated stream, from empty tables, for the configured rounds;
    /// reports each mode's median, and its ratio to its baseline of the same round.
    async fn throughput(&self, figures: &mut Figures) -> Result<()> {
        let (keys, distinct) = stream(self.settings.messages, self.settings.duplicates);
        let batched = self.settings.batches.iter().flat_map(|&b| {
            [
                Mode::HandWrittenBatched(b),
                Mode::HandWrittenClaimMany(b),
                Mode::ClaimMany(b),
            ]
        });
        let one_by_one = if self.settings.batched_only {
            &[][..]
        } else {
            &Mode::ONE_BY_ONE[..]
        };
        let modes: Vec<Mode> = one_by_one
            .iter()
            .copied()
            .chain(batched)
            .filter(|&mode| mode != Mode::OneStatement || DB::HAS_ONE_STATEMENT)
            .collect();
        let mut rates: Vec<(Mode, Vec<f64>)> = modes
            .iter()
            .flat_map(|&mode| match mode {
                Mode::Run => vec![Mode::Run, Mode::RunAgain],
                _ => vec![mode],
            })
            .map(|mode| (mode, Vec::with_capacity(self.settings.rounds)))
            .collect();
        let mut progress = Progress::new();
        let rounds = self.settings.rounds;
        for round in 1..=rounds {
            let mut order = modes.clone();
            // Baselines run first in odd rounds and last in even ones, so that neither side
            // of a ratio always finds the server warmer.
            if round % 2 == 0 {
                order.reverse();
            }
            for mode in order {
                progress.update(format!(
                    "throughput, round {round} of {rounds}: {}",
                    mode.name()
                ));
                // An earlier mode's run left its keys in the inbox's memory, which would
                // answer this one's from there.
                let bench = self.with_fresh_inbox()?;
                for (mode, per_second) in bench.measure(mode, &keys, distinct).await? {
                    if let Some((_, per_round)) = rates.iter_mut().find(|(m, _)| *m == mode) {
                        per_round.push(per_second);
                    }
                }
            }
        }
        progress.finish();
        for (mode, per_round) in &rates {
            let against = mode.baseline().and_then(|baseline| {
                let (_, base) = rates.iter().find(|(m, _)| *m == baseline)?;
                let ratios: Vec<f64> = per_round.iter().zip(base).map(|(r, b)| r / b).collect();
                Some((baseline, ratios))
            });
            figures.throughput.push((*mode, median(per_round)));
            self.report.throughput(
                *mode,
                self.settings,
                per_round,
                distinct,
                against
                    .as_ref()
                    .map(|(baseline, ratios)| (*baseline, ratios.as_slice())),
            );
        }
        Ok(())
    }

    /// The same bench with an inbox that remembers no keys yet.
    fn with_fresh_inbox(&self) -> Result<Self> {
        let inbox = Inbox::from_pool(
            self.inbox.pool().clone(),
            self.inbox.consumer().clone(),
            self.options.clone(),
        )?;
        Ok(Self {
            tables: self.tables.clone(),
            inbox,
            options: self.options.clone(),
            hand_claim_ids: AtomicI64::new(1),
            settings: self.settings,
            serve: self.serve,
            report: self.report.clone(),
        })
    }

    /// Messages per second of `mode` on `keys` from empty tables, once effect rows are
    /// checked against the `distinct` keys; after `Mode::Run`, of `Mode::RunAgain` too.
    async fn measure(&self, mode: Mode, keys: &[Key], distinct: usize) -> Result<Vec<(Mode, f64)>> {
        self.empty().await?;
        let started = Instant::now();
        self.run_mode(mode, keys).await?;
        let per_second = keys.len() as f64 / started.elapsed().as_secs_f64();
        // A forwarded message's effect is its outbox row.
        let (table, key_column) = if mode.forwards() {
            (&self.tables.outbox, DB::OUTBOX_KEY)
        } else {
            (&self.tables.effects, "effect_key")
        };
        let effects = DB::count(self.inbox.pool(), table).await?;
        let doubled = DB::doubled(self.inbox.pool(), table, key_column).await?;
        ensure!(
            effects == distinct as i64 && doubled == 0,
            "{}: {effects} effect rows ({doubled} doubled) for {distinct} distinct keys",
            mode.name()
        );
        let mut measured = vec![(mode, per_second)];
        if mode == Mode::Run {
            // The same stream again through the same inbox: every message a duplicate.
            let started = Instant::now();
            self.run_all(keys).await?;
            let per_second = keys.len() as f64 / started.elapsed().as_secs_f64();
            let effects = DB::count(self.inbox.pool(), &self.tables.effects).await?;
            ensure!(effects == distinct as i64, "run-again wrote effects");
            measured.push((Mode::RunAgain, per_second));
        }
        Ok(measured)
    }

    /// Runs `mode` over `keys` with the configured workers.
    async fn run_mode(&self, mode: Mode, keys: &[Key]) -> Result<()> {
        let workers = self.settings.workers.max(1);
        let shares: Vec<Vec<Key>> = (0..workers)
            .map(|worker| keys.iter().skip(worker).step_by(workers).cloned().collect())
            .collect();
        let runs = shares.iter().map(|share| async move {
            match mode {
                Mode::HandWritten => self.hand_written(share, false).await,
                Mode::OneStatement => self.one_statement(share).await,
                Mode::Run | Mode::RunAgain => self.run_all(share).await,
                Mode::HandWrittenForward => self.hand_written(share, true).await,
                Mode::RunForward => self.run_forward(share).await,
                Mode::HandWrittenBatched(batch) => {
                    self.hand_written_batches(share, batch, false).await
                }
                Mode::HandWrittenClaimMany(batch) => {
                    self.hand_written_batches(share, batch, true).await
                }
                Mode::ClaimMany(batch) => self.claim_many(share, batch).await,
            }
        });
        for done in futures_util::future::join_all(runs).await {
            done?;
        }
        Ok(())
    }

    async fn run_forward(&self, keys: &[Key]) -> Result<()> {
        for key in keys {
            let message = Message::new("bench", key.as_str());
            // Processed or a duplicate: the outbox rows say which, when the mode ends.
            let _outcome = (self.inbox)
                .run_forward(key, key.as_str().as_bytes(), message)
                .await?;
        }
        Ok(())
    }

    /// BEGIN, the claim as a plain INSERT that skips a duplicate, the effect (`forwarding`:
    /// the row that forwards the message, the statement `Inbox::forward` sends), COMMIT.
    async fn hand_written(&self, keys: &[Key], forwarding: bool) -> Result<()> {
        for key in keys {
            let fingerprint = Fingerprint::of(key.as_str());
            let mut tx = self.inbox.begin().await?;
            let first =
                DB::hand_claim(&mut tx, &self.tables.keys, key.as_str(), &fingerprint).await?;
            if first && forwarding {
                let message = Message::new("bench", key.as_str());
                self.inbox.forward(&mut tx, key, message).await?;
            } else if first {
                DB::insert_effect(&mut tx, &self.tables.effects, key.as_str()).await?;
            }
            tx.commit().await?;
        }
        Ok(())
    }

    /// The claim and the effect in one statement, committed on its own: one round trip.
    async fn one_statement(&self, keys: &[Key]) -> Result<()> {
        for key in keys {
            let fingerprint = Fingerprint::of(key.as_str());
            DB::one_statement(self.inbox.pool(), &self.tables, key.as_str(), &fingerprint).await?;
        }
        Ok(())
    }

    async fn run_all(&self, keys: &[Key]) -> Result<()> {
        let effects = self.tables.effects.as_str();
        for key in keys {
            // Processed or a duplicate: the effect rows say which, when the mode ends.
            let _outcome = self
                .inbox
                .run(key, key.as_str().as_bytes(), |tx| {
                    Box::pin(DB::insert_effect(tx, effects, key.as_str()))
                })
                .await?;
        }
        Ok(())
    }

    async fn claim_many(&self, keys: &[Key], batch: usize) -> Result<()> {
        for batch in keys.chunks(batch.max(1)) {
            self.claim_batch(batch).await?;
        }
        Ok(())
    }

    async fn claim_batch(&self, batch: &[Key]) -> Result<()> {
        let messages: Vec<(Key, &[u8])> = batch
            .iter()
            .map(|key| (key.clone(), key.as_str().as_bytes()))
            .collect();
        let mut tx = self.inbox.begin().await?;
        let claims = self.inbox.claim_many(&mut tx, &messages).await?;
        let first: Vec<&str> = messages
            .iter()
            .zip(claims)
            .filter(|(_, claim)| *claim == Claim::First)
            .map(|((key, _), _)| key.as_str())
            .collect();
        if !first.is_empty() {
            DB::insert_effects(&mut tx, &self.tables.effects, &first).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// What [`Bench::claim_many`] does, by hand: for each batch, BEGIN, the insert of the
    /// batch's keys, the same effect insert, COMMIT. With `read_held`, the insert is
    /// `claim_many`'s own statements, which also read the fingerprint of each key already
    /// held, and those fingerprints are checked as `claim_many` checks them.
    async fn hand_written_batches(
        &self,
        keys: &[Key],
        batch: usize,
        read_held: bool,
    ) -> Result<()> {
        for batch in keys.chunks(batch.max(1)) {
            // Sorted, as claim_many inserts them, so that concurrent batches lock in order.
            let mut distinct: Vec<&str> = batch.iter().map(Key::as_str).collect();
            distinct.sort_unstable();
            distinct.dedup();
            let fingerprints: Vec<Fingerprint> = distinct.iter().map(Fingerprint::of).collect();
            let claim_id = self.hand_claim_ids.fetch_add(1, Ordering::Relaxed);
            let mut tx = self.inbox.begin().await?;
            let tables = &self.tables;
            let first = if read_held {
                let (first, held) = DB::hand_claim_many_reading(
                    &mut tx,
                    tables,
                    &distinct,
                    &fingerprints,
                    claim_id,
                )
                .await?;
                check_held(&distinct, &fingerprints, first.len(), &held)?;
                first
            } else {
                DB::hand_claim_many(&mut tx, tables, &distinct, &fingerprints, claim_id).await?
            };
            if !first.is_empty() {
                let first: Vec<&str> = first.iter().map(String::as_str).collect();
                DB::insert_effects(&mut tx, &self.tables.effects, &first).await?;
            }
            tx.commit().await?;
        }
        Ok(())
    }

    /// At each table size: the latency of one claim with its effect, and batched
    /// throughput, on fresh keys.
    async fn latency(&self, figures: &mut Figures) -> Result<()> {
        self.empty().await?;
        let batch = self.settings.batches.first().copied().unwrap_or(1);
        let mut progress = Progress::new();
        let mut filled = 0;
        for (round, &size) in self.settings.sizes.iter().enumerate() {
            if size > filled {
                self.fill(&mut progress, filled, size, Duration::ZERO)
                    .await?;
                filled = size;
            }
            progress.update(format!("latency at {size} keys: claims"));
            let fresh = |n: usize| Key::new(format!("latency:{round}:{n}")).expect("a valid key");
            let claims: Vec<Key> = (0..self.settings.samples).map(fresh).collect();
            let latencies = self.timed_runs(&claims).await?;
            progress.update(format!("latency at {size} keys: batches"));
            let batched: Vec<Key> = (0..self.settings.samples.max(batch) * 5)
                .map(|n| fresh(self.settings.samples + n))
                .collect();
            let started = Instant::now();
            self.claim_many(&batched, batch).await?;
            let per_second = batched.len() as f64 / started.elapsed().as_secs_f64();
            progress.finish();
            figures
                .latency
                .push((size, percentile(&latencies, 50), percentile(&latencies, 99)));
            self.report.latency(size, &latencies, batch, per_second);
        }
        Ok(())
    }

    /// Keys purged per second, and claim latency without and during the purge.
    async fn purge(&self) -> Result<()> {
        self.empty().await?;
        let mut progress = Progress::new();
        let expired = self.settings.purge;
        self.fill(&mut progress, 0, expired, Duration::from_secs(2 * 86_400))
            .await?;
        let fresh =
            |phase: &str, n: usize| Key::new(format!("purge:{phase}:{n}")).expect("a valid key");
        progress.update("purge: claims without a purge".to_owned());
        let quiet: Vec<Key> = (0..self.settings.samples)
            .map(|n| fresh("quiet", n))
            .collect();
        let without = self.timed_runs(&quiet).await?;
        let purging = async {
            let started = Instant::now();
            let keep = Duration::from_secs(86_400);
            let batch_size = self.settings.purge_batch;
            let mut pacer = Pacer::new(self.settings.purge_pause);
            let mut purged = 0;
            loop {
                let batch = pacer.run(self.inbox.purge_batch(keep, batch_size)).await?;
                purged += batch;
                if batch < u64::from(batch_size) {
                    return Ok::<_, anyhow::Error>((purged, started.elapsed()));
                }
            }
        };
        let claiming = async {
            let mut latencies = Vec::new();
            let mut n = 0;
            // Claims until the purge is over, at least the configured samples.
            while latencies.len() < self.settings.samples {
                latencies.extend(self.timed_runs(&[fresh("during", n)]).await?);
                n += 1;
            }
            Ok::<_, anyhow::Error>(latencies)
        };
        progress.update(format!("purge: {expired} expired keys, claiming meanwhile"));
        let (purged, during) = tokio::join!(purging, claiming);
        let (purged, took) = purged?;
        progress.finish();
        ensure!(
            purged == expired,
            "purged {purged} keys of the {expired} expired"
        );
        self.report.purge(
            (purged, self.settings.purge_batch),
            took,
            &without,
            &during?,
        );
        Ok(())
    }

    /// `Inbox::run` on an endless stream for the configured duration, and the peak resident
    /// memory of each tenth of it: flat, unless something grows with the messages.
    async fn sustained(&self) -> Result<()> {
        self.empty().await?;
        let mut progress = Progress::new();
        let started = Instant::now();
        let (mut messages, mut distinct) = (0, 0);
        let mut peaks = Vec::with_capacity(10);
        for tenth in 1..=10_u32 {
            let end = started + self.settings.duration * tenth / 10;
            let mut peak = status_mib("VmRSS:").unwrap_or(0.0);
            while Instant::now() < end {
                let keys: Vec<Key> = (messages..messages + 100)
                    .map(|n| endless_key(n, self.settings.duplicates, &mut distinct))
                    .collect();
                self.run_all(&keys).await?;
                messages += keys.len();
                peak = peak.max(status_mib("VmRSS:").unwrap_or(0.0));
            }
            peaks.push(peak);
            progress.update(format!("sustained: {tenth} tenths, {messages} messages"));
        }
        let took = started.elapsed();
        progress.finish();
        let effects = DB::count(self.inbox.pool(), &self.tables.effects).await?;
        ensure!(
            effects == distinct as i64,
            "sustained: {effects} effect rows for {distinct} distinct keys"
        );
        self.report.sustained(took, messages, effects, &peaks);
        Ok(())
    }

    /// The duration of each `Inbox::run`, one after the other.
    async fn timed_runs(&self, keys: &[Key]) -> Result<Vec<Duration>> {
        let mut latencies = Vec::with_capacity(keys.len());
        for key in keys {
            let started = Instant::now();
            self.run_all(std::slice::from_ref(key)).await?;
            latencies.push(started.elapsed());
        }
        Ok(latencies)
    }

    /// Adds keys `from..to`, processed `age` ago, in statements of 100,000.
    async fn fill(&self, progress: &mut Progress, from: u64, to: u64, age: Duration) -> Result<()> {
        let mut at = from;
        while at < to {
            let until = (at + 100_000).min(to);
            progress.update(format!("filling the key table: {at} of {to} keys"));
            DB::fill(self.inbox.pool(), &self.tables.keys, at, until, age).await?;
            at = until;
        }
        progress.update(format!("filling the key table: {to} of {to} keys"));
        progress.finish();
        Ok(())
    }

    async fn empty(&self) -> Result<()> {
        for table in [&self.tables.keys, &self.tables.effects, &self.tables.outbox] {
            DB::execute(self.inbox.pool(), format!("{} {table}", DB::EMPTY)).await?;
        }
        Ok(())
    }

    async fn drop_tables(&self) -> Result<()> {
        for table in &self.tables.all {
            DB::execute(self.inbox.pool(), format!("DROP TABLE IF EXISTS {table}")).await?;
        }
        Ok(())
    }
}

/// The generated stream: `messages` keys of which `duplicates` percent repeat an earlier one,
/// and how many are distinct.
fn stream(messages: usize, duplicates: usize) -> (Vec<Key>, usize) {
    let mut keys: Vec<Key> = Vec::with_capacity(messages);
    let mut distinct = 0;
    for n in 0..messages {
        // Spread over the stream without a random source, the same on every run.
        if n > 0 && (n * 7_919) % 100 < duplicates {
            keys.push(keys[(n * 104_729) % n].clone());
        } else {
            keys.push(Key::new(format!("message:{distinct}")).expect("a valid key"));
            distinct += 1;
        }
    }
    (keys, distinct)
}

/// Message `n` of an endless stream in which `duplicates` percent repeat one of the last
/// 1,000 distinct keys, as a redelivery would; counts the distinct keys in `distinct`.
fn endless_key(n: usize, duplicates: usize, distinct: &mut usize) -> Key {
    let id = if *distinct > 0 && (n * 7_919) % 100 < duplicates {
        *distinct - 1 - (n * 104_729) % (*distinct).min(1_000)
    } else {
        *distinct += 1;
        *distinct - 1
    };
    Key::new(format!("endless:{id}")).expect("a valid key")
}

/// A way to process the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    HandWritten,
    OneStatement,
    Run,
    RunAgain,
    /// The claim and a row forwarding the message, as `hand-written` sends them.
    HandWrittenForward,
    /// `Inbox::run_forward`: on PostgreSQL one statement.
    RunForward,
    /// A batch insert of the keys and the effects' insert sent with plain sqlx, in batches
    /// of this many messages, a transaction each.
    HandWrittenBatched(usize),
    /// As `HandWrittenBatched`, with the statements `claim_many` sends to claim the keys and
    /// read the fingerprints of those already held.
    HandWrittenClaimMany(usize),
    /// In batches of this many messages, a transaction each.
    ClaimMany(usize),
}

impl Mode {
    /// The modes that start from empty tables and take a message at a time, baseline first.
    const ONE_BY_ONE: [Mode; 5] = [
        Mode::HandWritten,
        Mode::OneStatement,
        Mode::Run,
        Mode::HandWrittenForward,
        Mode::RunForward,
    ];

    /// The mode this one is compared with, in the same round.
    fn baseline(self) -> Option<Mode> {
        match self {
            Mode::OneStatement | Mode::Run | Mode::RunAgain => Some(Mode::HandWritten),
            Mode::RunForward => Some(Mode::HandWrittenForward),
            Mode::HandWrittenClaimMany(batch) => Some(Mode::HandWrittenBatched(batch)),
            Mode::ClaimMany(batch) => Some(Mode::HandWrittenClaimMany(batch)),
            Mode::HandWritten | Mode::HandWrittenForward | Mode::HandWrittenBatched(_) => None,
        }
    }

    /// Whether the mode's effect is an outbox row rather than an effect row.
    fn forwards(self) -> bool {
        matches!(self, Mode::HandWrittenForward | Mode::RunForward)
    }

    /// Messages per transaction, for the batched modes.
    fn batch(self) -> Option<usize> {
        match self {
            Mode::HandWrittenBatched(batch)
            | Mode::HandWrittenClaimMany(batch)
            | Mode::ClaimMany(batch) => Some(batch),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Mode::HandWritten => "hand-written",
            Mode::OneStatement => "one-statement",
            Mode::Run => "run",
            Mode::RunAgain => "run-again",
            Mode::HandWrittenForward => "hand-written-forward",
            Mode::RunForward => "run_forward",
            Mode::HandWrittenBatched(_) => "hand-written-batched",
            Mode::HandWrittenClaimMany(_) => "hand-written-claim_many",
            Mode::ClaimMany(_) => "claim_many",
        }
    }
}

/// The bench's tables: justonce's, under the bench's prefix, and the effects; and the
/// statements `claim_many` sends to them.
#[derive(Clone)]
struct BenchTables {
    keys: String,
    effects: String,
    outbox: String,
    all: Vec<String>,
    claim_many: ClaimMany,
}

impl BenchTables {
    fn new(prefix: &str, claim_many: ClaimMany) -> Self {
        let all = [
            "effects",
            "outbox",
            "offsets",
            "breakers",
            "keys",
            "migrations",
        ]
        .map(|table| format!("{prefix}{table}"))
        .to_vec();
        Self {
            keys: format!("{prefix}keys"),
            effects: format!("{prefix}effects"),
            outbox: format!("{prefix}outbox"),
            all,
            claim_many,
        }
    }
}

/// What the charts show, gathered as the sections run.
#[derive(Default)]
struct Figures {
    /// Median messages per second of each throughput mode.
    throughput: Vec<(Mode, f64)>,
    /// Claim p50 and p99 at each key table size.
    latency: Vec<(u64, Duration, Duration)>,
}

impl Figures {
    /// Writes into `dir` a chart for each section that ran; returns the files.
    fn write(&self, dir: &Path, database: &str, settings: &Settings) -> Result<Vec<PathBuf>> {
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

/// The colours of the charts, as the status page's: justonce green, and grey for a baseline.
const GREEN: &str = "#2a7";
const GREY: &str = "#999";
const BLUE: &str = "#36c";
const RED: &str = "#c33";
const ORANGE: &str = "#e80";

/// Prints results as a table, or one JSON object per result.
#[derive(Clone)]
struct Report {
    json: bool,
    database: &'static str,
}

impl Report {
    fn new(json: bool, database: &'static str) -> Self {
        Self { json, database }
    }

    /// A mode's messages per second in each round, and its ratio to `against`'s baseline
    /// in each round.
    fn throughput(
        &self,
        mode: Mode,
        settings: &Settings,
        per_round: &[f64],
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
                "batch": batch,
                "messages": settings.messages,
                "duplicates_percent": settings.duplicates,
                "rounds": per_round.len(),
                "messages_per_second": per_second.round(),
                "messages_per_second_per_round": per_round.iter().map(|r| r.round()).collect::<Vec<_>>(),
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
        println!(
            "throughput  {:<9} {mode:<31} {:>2} worker(s) {per_second:>9.0} msg/s  {ratio:<41} effects {effects} = distinct keys, median of {} round(s)",
            self.database,
            settings.workers,
            per_round.len(),
        );
    }

    fn latency(&self, size: u64, latencies: &[Duration], batch: usize, batched: f64) {
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

    fn purge(
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

    fn receiver(
        &self,
        load: receiver::Load,
        requests: usize,
        per_second: f64,
        latencies: &[Duration],
    ) {
        let (p50, p99) = (percentile(latencies, 50), percentile(latencies, 99));
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
                "keys_equal_events": true,
            });
            println!("{result}");
            return;
        }
        println!(
            "receiver    {:<9} {requests} events {:<17} {per_second:>9.0} accepted/s  to 2xx p50 {:.2} ms  p99 {:.2} ms  keys {requests} = events",
            self.database,
            load.described(),
            millis(p50),
            millis(p99),
        );
    }

    fn chart(&self, path: &Path) {
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

    fn sustained(&self, took: Duration, messages: usize, effects: i64, peaks: &[f64]) {
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

    fn memory(&self) {
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
fn median(values: &[f64]) -> f64 {
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
fn percentile(samples: &[Duration], p: usize) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    let index = (sorted.len() * p).div_ceil(100).saturating_sub(1);
    sorted.get(index).copied().unwrap_or_default()
}

fn millis(duration: Duration) -> f64 {
    (duration.as_secs_f64() * 1_000_000.0).round() / 1_000.0
}

/// A memory figure of this process (`VmRSS:` resident now, `VmHWM:` its peak), where the
/// kernel reports it (Linux).
fn status_mib(field: &str) -> Option<f64> {
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

/// The statements the bench writes by hand, per database.
trait BenchDb: Backend {
    const LABEL: &'static str;
    /// The outbox's key column, quoted where `key` is a reserved word.
    const OUTBOX_KEY: &'static str = "key";
    /// Whether the claim and the effect fit in one statement: [`BenchDb::one_statement`].
    const HAS_ONE_STATEMENT: bool = false;
    /// The statement that empties a table, followed by its name. A DELETE would leave the
    /// rows dead but in the table and its indexes until vacuumed (PostgreSQL) or purged
    /// (InnoDB), where the next mode's inserts of the same keys step over them.
    const EMPTY: &'static str = "TRUNCATE TABLE";

    /// The statements `claim_many` sends to the tables under `prefix`.
    fn claim_many(prefix: &str) -> Result<ClaimMany>;

    async fn create_effects(pool: &sqlx::Pool<Self>, table: &str) -> Result<()>;

    /// Send, for the work of [`Inbox::run`].
    fn insert_effect<'a>(
        tx: &'a mut sqlx::Transaction<'_, Self>,
        table: &'a str,
        key: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Inserts the key; false if it was there.
    async fn hand_claim(
        tx: &mut sqlx::Transaction<'_, Self>,
        table: &str,
        key: &str,
        fingerprint: &Fingerprint,
    ) -> Result<bool>;

    /// A batch insert of these sorted, distinct keys, sent by hand in the transaction;
    /// returns the keys it inserted.
    async fn hand_claim_many(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
        fingerprints: &[Fingerprint],
        claim_id: i64,
    ) -> Result<Vec<String>>;

    /// The statements `claim_many` sends to claim these sorted, distinct keys and to read
    /// the keys already held, sent by hand in the transaction; returns the keys inserted,
    /// and each held key's claim id and fingerprint.
    async fn hand_claim_many_reading(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
        fingerprints: &[Fingerprint],
        claim_id: i64,
    ) -> Result<(Vec<String>, Vec<Held>)> {
        let inserted = Self::hand_claim_many(tx, tables, keys, fingerprints, claim_id).await?;
        let rest = not_among(keys, inserted.iter().map(String::as_str));
        // As claim_many, no read when every key was inserted.
        let held = if rest.is_empty() {
            Vec::new()
        } else {
            Self::hand_find_many(tx, tables, &rest).await?
        };
        Ok((inserted, held))
    }

    /// The claim id and fingerprint of each of these keys that is held, read with the
    /// statement `claim_many` reads them with.
    async fn hand_find_many(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
    ) -> Result<Vec<Held>>;

    /// An effect row for each key, in one multi-row INSERT as a batched consumer writes
    /// them (more only past the database's limit on bound parameters).
    async fn insert_effects(
        tx: &mut sqlx::Transaction<'_, Self>,
        table: &str,
        keys: &[&str],
    ) -> Result<()>;

    /// The claim and the effect in one statement, where `HAS_ONE_STATEMENT`.
    async fn one_statement(
        _pool: &sqlx::Pool<Self>,
        _tables: &BenchTables,
        _key: &str,
        _fingerprint: &Fingerprint,
    ) -> Result<()> {
        bail!(
            "{} has no statement that both claims and writes the effect",
            Self::LABEL
        )
    }

    /// Inserts keys `fill:<from>` to `fill:<to - 1>` of the bench's consumer, processed
    /// `age` ago, in one statement.
    async fn fill(
        pool: &sqlx::Pool<Self>,
        table: &str,
        from: u64,
        to: u64,
        age: Duration,
    ) -> Result<()>;

    async fn execute(pool: &sqlx::Pool<Self>, sql: String) -> Result<()>;

    async fn count(pool: &sqlx::Pool<Self>, table: &str) -> Result<i64>;

    /// Rows beyond the first for their key, in `column`.
    async fn doubled(pool: &sqlx::Pool<Self>, table: &str, column: &str) -> Result<i64>;
}

/// A held key, its claim id and its stored fingerprint.
type Held = (String, i64, Vec<u8>);

/// What `claim_many` checks of a batch's sorted, distinct `keys` after its statements:
/// each was either claimed (`claimed` of them) or read back as held, and each held key has
/// the fingerprint this batch sent for it; another one is a reused key.
fn check_held(
    keys: &[&str],
    fingerprints: &[Fingerprint],
    claimed: usize,
    held: &[Held],
) -> Result<()> {
    ensure!(
        claimed + held.len() == keys.len(),
        "{claimed} keys claimed and {} read back of {}",
        held.len(),
        keys.len()
    );
    for (key, _claim_id, stored) in held {
        let Ok(index) = keys.binary_search(&key.as_str()) else {
            bail!("{key} was read back but is not in the batch");
        };
        ensure!(
            fingerprints[index].as_bytes().as_slice() == stored.as_slice(),
            "{key} reused"
        );
    }
    Ok(())
}

/// The keys of `all` that are not among `some`.
fn not_among<'a, 'b>(all: &[&'a str], some: impl IntoIterator<Item = &'b str>) -> Vec<&'a str> {
    let some: std::collections::HashSet<&str> = some.into_iter().collect();
    all.iter()
        .copied()
        .filter(|key| !some.contains(key))
        .collect()
}

/// The batch insert of keys that `claim_many` sends to MariaDB and MySQL, by hand, in as
/// many statements as it splits the batch into.
async fn mysql_insert_keys(
    tx: &mut sqlx::Transaction<'_, MySql>,
    tables: &BenchTables,
    keys: &[&str],
    fingerprints: &[Fingerprint],
    claim_id: i64,
) -> Result<()> {
    let rows = statements::MYSQL_KEYS_PER_STATEMENT;
    for (keys, fingerprints) in keys.chunks(rows).zip(fingerprints.chunks(rows)) {
        let mut insert = sqlx::query(AssertSqlSafe(tables.claim_many.insert_many(keys.len())));
        for (key, fingerprint) in keys.iter().zip(fingerprints) {
            insert = insert
                .bind("")
                .bind(CONSUMER)
                .bind(*key)
                .bind(fingerprint.as_bytes().as_slice())
                .bind(claim_id);
        }
        insert.execute(&mut **tx).await?;
    }
    Ok(())
}

/// What runs the same on every database.
macro_rules! common {
    () => {
        async fn execute(pool: &sqlx::Pool<Self>, sql: String) -> Result<()> {
            sqlx::raw_sql(AssertSqlSafe(sql)).execute(pool).await?;
            Ok(())
        }

        async fn count(pool: &sqlx::Pool<Self>, table: &str) -> Result<i64> {
            let sql = format!("SELECT COUNT(*) FROM {table}");
            Ok(sqlx::query_scalar(AssertSqlSafe(sql))
                .fetch_one(pool)
                .await?)
        }

        async fn doubled(pool: &sqlx::Pool<Self>, table: &str, column: &str) -> Result<i64> {
            let sql = format!("SELECT COUNT(*) - COUNT(DISTINCT {column}) FROM {table}");
            Ok(sqlx::query_scalar(AssertSqlSafe(sql))
                .fetch_one(pool)
                .await?)
        }
    };
}

/// What PostgreSQL and SQLite write the same way, with `$n` parameters.
macro_rules! dollar_parameters {
    () => {
        async fn create_effects(pool: &sqlx::Pool<Self>, table: &str) -> Result<()> {
            Self::execute(
                pool,
                format!("CREATE TABLE {table} (effect_key TEXT NOT NULL)"),
            )
            .await
        }

        async fn insert_effect(
            tx: &mut sqlx::Transaction<'_, Self>,
            table: &str,
            key: &str,
        ) -> Result<(), sqlx::Error> {
            let sql = format!("INSERT INTO {table} (effect_key) VALUES ($1)");
            sqlx::query(AssertSqlSafe(sql))
                .bind(key)
                .execute(&mut **tx)
                .await
                .map(drop)
        }

        async fn hand_claim(
            tx: &mut sqlx::Transaction<'_, Self>,
            table: &str,
            key: &str,
            fingerprint: &Fingerprint,
        ) -> Result<bool> {
            let sql = format!(
                "INSERT INTO {table} (scope, consumer, key, fingerprint, claim_id)
                 VALUES ('', 'bench', $1, $2, 0) ON CONFLICT DO NOTHING"
            );
            let done = sqlx::query(AssertSqlSafe(sql))
                .bind(key)
                .bind(fingerprint.as_bytes().as_slice())
                .execute(&mut **tx)
                .await?;
            Ok(done.rows_affected() == 1)
        }
    };
}

impl BenchDb for Postgres {
    const LABEL: &'static str = "postgres";
    const HAS_ONE_STATEMENT: bool = true;

    fn claim_many(prefix: &str) -> Result<ClaimMany> {
        Ok(statements::postgres(prefix)?)
    }

    common!();

    dollar_parameters!();

    /// A plain insert of the batch, with no read of the keys already held.
    async fn hand_claim_many(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
        fingerprints: &[Fingerprint],
        claim_id: i64,
    ) -> Result<Vec<String>> {
        let sql = format!(
            "INSERT INTO {} (scope, consumer, key, fingerprint, claim_id)
             SELECT '', 'bench', batch.key, batch.fingerprint, $3
             FROM unnest($1::text[], $2::bytea[]) AS batch (key, fingerprint)
             ORDER BY batch.key COLLATE \"C\"
             ON CONFLICT (scope, consumer, key) DO NOTHING
             RETURNING key",
            tables.keys
        );
        let fingerprints: Vec<&[u8]> = fingerprints
            .iter()
            .map(|fingerprint| fingerprint.as_bytes().as_slice())
            .collect();
        Ok(sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(keys)
            .bind(&fingerprints)
            .bind(claim_id)
            .fetch_all(&mut **tx)
            .await?)
    }

    /// One statement, as `claim_many` sends it: the insert, and an index lookup for each key
    /// it did not insert. A key committed by another transaction while the insert waited
    /// is in neither half, and is read after.
    async fn hand_claim_many_reading(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
        fingerprints: &[Fingerprint],
        claim_id: i64,
    ) -> Result<(Vec<String>, Vec<Held>)> {
        let fingerprints: Vec<&[u8]> = fingerprints
            .iter()
            .map(|fingerprint| fingerprint.as_bytes().as_slice())
            .collect();
        let sql = tables.claim_many.insert_many(keys.len());
        let rows: Vec<(String, Option<i64>, Option<Vec<u8>>)> = sqlx::query_as(AssertSqlSafe(sql))
            .bind("")
            .bind(CONSUMER)
            .bind(keys)
            .bind(&fingerprints)
            .bind(claim_id)
            .fetch_all(&mut **tx)
            .await?;
        let (mut inserted, mut held) = (Vec::new(), Vec::new());
        for (key, claim_id, fingerprint) in rows {
            match claim_id.zip(fingerprint) {
                Some((claim_id, fingerprint)) => held.push((key, claim_id, fingerprint)),
                None => inserted.push(key),
            }
        }
        if inserted.len() + held.len() < keys.len() {
            let read = inserted.iter().chain(held.iter().map(|(key, ..)| key));
            let rest = not_among(keys, read.map(String::as_str));
            held.extend(Self::hand_find_many(tx, tables, &rest).await?);
        }
        Ok((inserted, held))
    }

    async fn hand_find_many(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
    ) -> Result<Vec<Held>> {
        let sql = tables.claim_many.find_many(keys.len());
        Ok(sqlx::query_as(AssertSqlSafe(sql))
            .bind("")
            .bind(CONSUMER)
            .bind(keys)
            .fetch_all(&mut **tx)
            .await?)
    }

    /// The keys as one array parameter: PostgreSQL's limit of 65,535 parameters never
    /// applies.
    async fn insert_effects(
        tx: &mut sqlx::Transaction<'_, Self>,
        table: &str,
        keys: &[&str],
    ) -> Result<()> {
        let sql = format!("INSERT INTO {table} (effect_key) SELECT unnest($1::text[])");
        sqlx::query(AssertSqlSafe(sql))
            .bind(keys)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn one_statement(
        pool: &sqlx::Pool<Self>,
        tables: &BenchTables,
        key: &str,
        fingerprint: &Fingerprint,
    ) -> Result<()> {
        let sql = format!(
            "WITH claimed AS (
                 INSERT INTO {} (scope, consumer, key, fingerprint, claim_id)
                 VALUES ('', 'bench', $1, $2, 0) ON CONFLICT DO NOTHING RETURNING key)
             INSERT INTO {} (effect_key) SELECT key FROM claimed",
            tables.keys, tables.effects
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(key)
            .bind(fingerprint.as_bytes().as_slice())
            .execute(pool)
            .await?;
        Ok(())
    }

    async fn fill(
        pool: &sqlx::Pool<Self>,
        table: &str,
        from: u64,
        to: u64,
        age: Duration,
    ) -> Result<()> {
        let sql = format!(
            "INSERT INTO {table} (scope, consumer, key, fingerprint, claim_id, processed_at)
             SELECT '', 'bench', 'fill:' || n, sha256(n::text::bytea), 0,
                    now() - make_interval(secs => $3)
             FROM generate_series($1::bigint, $2::bigint - 1) AS n"
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(i64::try_from(from)?)
            .bind(i64::try_from(to)?)
            .bind(age.as_secs_f64())
            .execute(pool)
            .await?;
        Ok(())
    }
}

impl BenchDb for Sqlite {
    const LABEL: &'static str = "sqlite";
    /// SQLite has no TRUNCATE: a DELETE without WHERE is its truncate, which drops the
    /// table's pages instead of rows one by one.
    const EMPTY: &'static str = "DELETE FROM";

    fn claim_many(prefix: &str) -> Result<ClaimMany> {
        Ok(statements::sqlite(prefix)?)
    }

    common!();

    dollar_parameters!();

    /// The insert `claim_many` sends, which returns the keys it inserted.
    async fn hand_claim_many(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
        fingerprints: &[Fingerprint],
        claim_id: i64,
    ) -> Result<Vec<String>> {
        let pairs: Vec<(&str, String)> = keys
            .iter()
            .zip(fingerprints)
            .map(|(key, fingerprint)| (*key, fingerprint.to_string()))
            .collect();
        let sql = tables.claim_many.insert_many(keys.len());
        Ok(sqlx::query_scalar(AssertSqlSafe(sql))
            .bind("")
            .bind(CONSUMER)
            .bind(claim_id)
            .bind(serde_json::to_string(&pairs)?)
            .fetch_all(&mut **tx)
            .await?)
    }

    async fn hand_find_many(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
    ) -> Result<Vec<Held>> {
        let sql = tables.claim_many.find_many(keys.len());
        Ok(sqlx::query_as(AssertSqlSafe(sql))
            .bind("")
            .bind(CONSUMER)
            .bind(serde_json::to_string(keys)?)
            .fetch_all(&mut **tx)
            .await?)
    }

    /// The keys as one JSON array, as claim_many sends them: SQLite's limit of 32,766
    /// parameters never applies.
    async fn insert_effects(
        tx: &mut sqlx::Transaction<'_, Self>,
        table: &str,
        keys: &[&str],
    ) -> Result<()> {
        let sql = format!("INSERT INTO {table} (effect_key) SELECT value FROM json_each($1)");
        sqlx::query(AssertSqlSafe(sql))
            .bind(serde_json::to_string(keys)?)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn fill(
        pool: &sqlx::Pool<Self>,
        table: &str,
        from: u64,
        to: u64,
        age: Duration,
    ) -> Result<()> {
        let sql = format!(
            "WITH RECURSIVE n(n) AS (SELECT $1 UNION ALL SELECT n + 1 FROM n WHERE n + 1 < $2)
             INSERT INTO {table} (scope, consumer, key, fingerprint, claim_id, processed_at)
             SELECT '', 'bench', 'fill:' || n, randomblob(32), 0,
                    CAST(unixepoch('subsec') * 1000 AS INTEGER) - $3
             FROM n"
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(i64::try_from(from)?)
            .bind(i64::try_from(to)?)
            .bind(i64::try_from(age.as_millis())?)
            .execute(pool)
            .await?;
        Ok(())
    }
}

impl BenchDb for MySql {
    const LABEL: &'static str = "mysql";
    const OUTBOX_KEY: &'static str = "`key`";

    fn claim_many(prefix: &str) -> Result<ClaimMany> {
        Ok(statements::mysql(prefix)?)
    }

    common!();

    async fn create_effects(pool: &sqlx::Pool<Self>, table: &str) -> Result<()> {
        Self::execute(
            pool,
            format!("CREATE TABLE {table} (effect_key VARBINARY(255) NOT NULL) ENGINE=InnoDB"),
        )
        .await
    }

    async fn insert_effect(
        tx: &mut sqlx::Transaction<'_, Self>,
        table: &str,
        key: &str,
    ) -> Result<(), sqlx::Error> {
        let sql = format!("INSERT INTO {table} (effect_key) VALUES (?)");
        sqlx::query(AssertSqlSafe(sql))
            .bind(key)
            .execute(&mut **tx)
            .await
            .map(drop)
    }

    /// A plain INSERT whose duplicate-key error is caught, as justonce's claim is: MySQL
    /// reports an ignored duplicate unreliably through sqlx's found-rows flag.
    async fn hand_claim(
        tx: &mut sqlx::Transaction<'_, Self>,
        table: &str,
        key: &str,
        fingerprint: &Fingerprint,
    ) -> Result<bool> {
        let sql = format!(
            "INSERT INTO {table} (scope, consumer, `key`, fingerprint, claim_id, processed_at)
             VALUES ('', 'bench', ?, ?, 0, UTC_TIMESTAMP(6))"
        );
        let inserted = sqlx::query(AssertSqlSafe(sql))
            .bind(key)
            .bind(fingerprint.as_bytes().as_slice())
            .execute(&mut **tx)
            .await;
        match inserted {
            Ok(_) => Ok(true),
            Err(sqlx::Error::Database(error)) if error.is_unique_violation() => Ok(false),
            Err(error) => Err(error.into()),
        }
    }

    async fn hand_claim_many(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
        fingerprints: &[Fingerprint],
        claim_id: i64,
    ) -> Result<Vec<String>> {
        mysql_insert_keys(tx, tables, keys, fingerprints, claim_id).await?;
        // No RETURNING after ON DUPLICATE KEY: the new keys are those with this batch's
        // claim id, read back as claim_many does.
        let mut inserted = Vec::new();
        for keys in keys.chunks(statements::MYSQL_MAX_PARAMETERS - 1) {
            let list = vec!["?"; keys.len()].join(", ");
            let sql = format!(
                "SELECT CAST(`key` AS CHAR CHARACTER SET utf8mb4) FROM {}
                 WHERE scope = '' AND consumer = 'bench' AND claim_id = ? AND `key` IN ({list})",
                tables.keys
            );
            let mut select = sqlx::query_scalar(AssertSqlSafe(sql)).bind(claim_id);
            for key in keys {
                select = select.bind(*key);
            }
            inserted.extend(select.fetch_all(&mut **tx).await?);
        }
        Ok(inserted)
    }

    /// As `claim_many` does: the insert, then every key's row read back, the inserted ones
    /// told by the batch's claim id.
    async fn hand_claim_many_reading(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
        fingerprints: &[Fingerprint],
        claim_id: i64,
    ) -> Result<(Vec<String>, Vec<Held>)> {
        mysql_insert_keys(tx, tables, keys, fingerprints, claim_id).await?;
        let (inserted, held): (Vec<Held>, Vec<Held>) = Self::hand_find_many(tx, tables, keys)
            .await?
            .into_iter()
            .partition(|(_, claimed_by, _)| *claimed_by == claim_id);
        Ok((inserted.into_iter().map(|(key, ..)| key).collect(), held))
    }

    async fn hand_find_many(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
    ) -> Result<Vec<Held>> {
        let mut found = Vec::with_capacity(keys.len());
        for keys in keys.chunks(statements::MYSQL_KEYS_PER_STATEMENT) {
            let sql = tables.claim_many.find_many(keys.len());
            let mut select = sqlx::query_as(AssertSqlSafe(sql)).bind("").bind(CONSUMER);
            for key in keys {
                select = select.bind(*key);
            }
            found.extend(select.fetch_all(&mut **tx).await?);
        }
        Ok(found)
    }

    async fn insert_effects(
        tx: &mut sqlx::Transaction<'_, Self>,
        table: &str,
        keys: &[&str],
    ) -> Result<()> {
        for keys in keys.chunks(statements::MYSQL_MAX_PARAMETERS) {
            let values = vec!["(?)"; keys.len()].join(", ");
            let sql = format!("INSERT INTO {table} (effect_key) VALUES {values}");
            let mut insert = sqlx::query(AssertSqlSafe(sql));
            for key in keys {
                insert = insert.bind(*key);
            }
            insert.execute(&mut **tx).await?;
        }
        Ok(())
    }

    async fn fill(
        pool: &sqlx::Pool<Self>,
        table: &str,
        from: u64,
        to: u64,
        age: Duration,
    ) -> Result<()> {
        // Numbers from five tables of digits, not a recursive CTE: MariaDB stops one after
        // 1,000 rows by default, and MySQL names that limit differently.
        let digits = "(SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
                      UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL \
                      SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9)";
        let sql = format!(
            "INSERT INTO {table} (scope, consumer, `key`, fingerprint, claim_id, processed_at)
             SELECT '', 'bench', CONCAT('fill:', n), UNHEX(SHA2(n, 256)), 0,
                    UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
             FROM (SELECT ? + a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d AS n
                   FROM {digits} a, {digits} b, {digits} c, {digits} e, {digits} f) numbers
             WHERE n < ?"
        );
        ensure!(to - from <= 100_000, "at most 100,000 keys per statement");
        sqlx::query(AssertSqlSafe(sql))
            .bind(u64::try_from(age.as_micros())?)
            .bind(from)
            .bind(to)
            .execute(pool)
            .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_repeats_the_share_asked_for() {
        let (keys, distinct) = stream(10_000, 20);
        assert_eq!(keys.len(), 10_000);
        let unique: std::collections::HashSet<&str> = keys.iter().map(Key::as_str).collect();
        assert_eq!(unique.len(), distinct);
        assert!((7_900..=8_100).contains(&distinct), "{distinct}");
    }

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
