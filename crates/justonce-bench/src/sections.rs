//! The sections of the bench: throughput beside the hand-written client, latency as the
//! key table grows, a purge under load, and memory over a long run.

use crate::Serve;
use crate::args::Section;
use crate::bench::Bench;
use crate::db::{BenchDb, check_held};
use crate::modes::Mode;
use crate::report::{Figures, median, percentile, status_mib};
use anyhow::{Result, ensure};
use justonce_cli_support::pacing::Pacer;
use justonce_cli_support::progress::Progress;
use justonce_sql::{Claim, Fingerprint, Key, Message};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

impl<DB: BenchDb> Bench<'_, DB> {
    /// Runs the sections of the settings; the receiver's behind `serve`.
    pub(crate) async fn sections(&self, serve: Serve) -> Result<()> {
        let mut figures = Figures::default();
        for section in &self.settings.sections {
            match section {
                Section::Throughput => self.throughput(&mut figures).await?,
                Section::Latency => self.latency(&mut figures).await?,
                Section::Purge => self.purge().await?,
                Section::Receiver => self.receiver(serve).await?,
                Section::Sustained => self.sustained().await?,
                Section::Capacity => self.capacity().await?,
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
    pub(crate) async fn throughput(&self, figures: &mut Figures) -> Result<()> {
        let (keys, distinct) = stream(self.settings.messages, self.settings.duplicates);
        let (keys, distinct) = match self.settings.share {
            Some(share) => share.of(&keys),
            None => (keys, distinct),
        };
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
            .filter(|mode| {
                let named = &self.settings.modes;
                named.is_empty() || named.iter().any(|name| name == mode.name())
            })
            .collect();
        let mut rates: Vec<(Mode, Vec<f64>, Vec<[u128; 2]>)> = modes
            .iter()
            .flat_map(|&mode| match mode {
                Mode::Run => vec![Mode::Run, Mode::RunAgain],
                _ => vec![mode],
            })
            .map(|mode| (mode, Vec::new(), Vec::new()))
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
                for (mode, per_second, window) in bench.measure(mode, &keys, distinct).await? {
                    if let Some((_, per_round, windows)) =
                        rates.iter_mut().find(|(m, ..)| *m == mode)
                    {
                        per_round.push(per_second);
                        windows.push(window);
                    }
                }
            }
        }
        progress.finish();
        for (mode, per_round, windows) in &rates {
            let against = mode.baseline().and_then(|baseline| {
                let (_, base, _) = rates.iter().find(|(m, ..)| *m == baseline)?;
                let ratios: Vec<f64> = per_round.iter().zip(base).map(|(r, b)| r / b).collect();
                Some((baseline, ratios))
            });
            figures.throughput.push((*mode, median(per_round)));
            self.report.throughput(
                *mode,
                self.settings,
                per_round,
                (keys.len(), windows),
                distinct,
                against
                    .as_ref()
                    .map(|(baseline, ratios)| (*baseline, ratios.as_slice())),
            );
        }
        Ok(())
    }

    /// Messages per second of `mode` on `keys` from empty tables, and the run's start and
    /// end in Unix milliseconds, once effect rows are checked against the `distinct` keys;
    /// after `Mode::Run`, of `Mode::RunAgain` too.
    pub(crate) async fn measure(
        &self,
        mode: Mode,
        keys: &[Key],
        distinct: usize,
    ) -> Result<Vec<(Mode, f64, [u128; 2])>> {
        self.empty().await?;
        let started = Instant::now();
        let started_ms = unix_ms();
        self.run_mode(mode, keys).await?;
        let per_second = keys.len() as f64 / started.elapsed().as_secs_f64();
        let window = [started_ms, unix_ms()];
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
        let mut measured = vec![(mode, per_second, window)];
        if mode == Mode::Run {
            // The same stream again through the same inbox: every message a duplicate.
            let started = Instant::now();
            let started_ms = unix_ms();
            self.run_all(keys).await?;
            let per_second = keys.len() as f64 / started.elapsed().as_secs_f64();
            let window = [started_ms, unix_ms()];
            let effects = DB::count(self.inbox.pool(), &self.tables.effects).await?;
            ensure!(effects == distinct as i64, "run-again wrote effects");
            measured.push((Mode::RunAgain, per_second, window));
        }
        Ok(measured)
    }

    /// Runs `mode` over `keys` with the configured workers.
    pub(crate) async fn run_mode(&self, mode: Mode, keys: &[Key]) -> Result<()> {
        let workers = self.settings.workers.max(1);
        let shares: Vec<Vec<Key>> = (0..workers)
            .map(|worker| keys.iter().skip(worker).step_by(workers).cloned().collect())
            .collect();
        let runs = shares.iter().map(|share| async move {
            match mode {
                Mode::HandWritten => self.hand_written(share, false).await,
                Mode::OneStatement => self.one_statement(share).await,
                Mode::Run | Mode::RunAgain => self.run_all(share).await,
                Mode::RunEffect => self.run_effect(share).await,
                Mode::HandWrittenForward => self.hand_written(share, true).await,
                Mode::RunForward => self.run_forward(share).await,
                Mode::RunWithForward => self.run_with_forward(share).await,
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

    pub(crate) async fn run_effect(&self, keys: &[Key]) -> Result<()> {
        for key in keys {
            let effect = DB::effect(&self.tables.effects, key.as_str());
            // Processed or a duplicate: the effect rows say which, when the mode ends.
            let _outcome = (self.inbox)
                .run_effect(key, key.as_str().as_bytes(), &effect)
                .await?;
        }
        Ok(())
    }

    pub(crate) async fn run_forward(&self, keys: &[Key]) -> Result<()> {
        for key in keys {
            let message = Message::new("bench", key.as_str());
            // Processed or a duplicate: the outbox rows say which, when the mode ends.
            let _outcome = (self.inbox)
                .run_forward(key, key.as_str().as_bytes(), message)
                .await?;
        }
        Ok(())
    }

    /// `Inbox::run` with `Inbox::forward` as its work: the row is announced after the
    /// commit, not by a NOTIFY in it.
    pub(crate) async fn run_with_forward(&self, keys: &[Key]) -> Result<()> {
        for key in keys {
            // Processed or a duplicate: the outbox rows say which, when the mode ends.
            let _outcome = (self.inbox)
                .run(key, key.as_str().as_bytes(), |tx| {
                    let message = Message::new("bench", key.as_str());
                    let forward = self.inbox.forward(tx, key, message);
                    Box::pin(async move { forward.await.map(drop) })
                })
                .await?;
        }
        Ok(())
    }

    /// BEGIN, the claim as a plain INSERT that skips a duplicate, the effect (`forwarding`:
    /// the row that forwards the message, the statement `Inbox::forward` sends), COMMIT.
    pub(crate) async fn hand_written(&self, keys: &[Key], forwarding: bool) -> Result<()> {
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
    pub(crate) async fn one_statement(&self, keys: &[Key]) -> Result<()> {
        for key in keys {
            let fingerprint = Fingerprint::of(key.as_str());
            DB::one_statement(self.inbox.pool(), &self.tables, key.as_str(), &fingerprint).await?;
        }
        Ok(())
    }

    pub(crate) async fn run_all(&self, keys: &[Key]) -> Result<()> {
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

    pub(crate) async fn claim_many(&self, keys: &[Key], batch: usize) -> Result<()> {
        for batch in keys.chunks(batch.max(1)) {
            self.claim_batch(batch).await?;
        }
        Ok(())
    }

    pub(crate) async fn claim_batch(&self, batch: &[Key]) -> Result<()> {
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
    pub(crate) async fn hand_written_batches(
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
    pub(crate) async fn latency(&self, figures: &mut Figures) -> Result<()> {
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
    pub(crate) async fn purge(&self) -> Result<()> {
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
    pub(crate) async fn sustained(&self) -> Result<()> {
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
    pub(crate) async fn timed_runs(&self, keys: &[Key]) -> Result<Vec<Duration>> {
        let mut latencies = Vec::with_capacity(keys.len());
        for key in keys {
            let started = Instant::now();
            self.run_all(std::slice::from_ref(key)).await?;
            latencies.push(started.elapsed());
        }
        Ok(latencies)
    }
}

/// The generated stream: `messages` keys of which `duplicates` percent repeat an earlier one,
/// and how many are distinct.
pub(crate) fn stream(messages: usize, duplicates: usize) -> (Vec<Key>, usize) {
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
pub(crate) fn endless_key(n: usize, duplicates: usize, distinct: &mut usize) -> Key {
    let id = if *distinct > 0 && (n * 7_919) % 100 < duplicates {
        *distinct - 1 - (n * 104_729) % (*distinct).min(1_000)
    } else {
        *distinct += 1;
        *distinct - 1
    };
    Key::new(format!("endless:{id}")).expect("a valid key")
}

/// The wall clock in Unix milliseconds: several bench processes sharing a stream are timed
/// from the earliest start among them to the latest end.
fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis())
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
}
