//! What a console's dashboard shows, read from the store so that every instance shows one
//! picture and a restart loses nothing: events accepted, duplicates, deliveries sent and
//! failed, minute by minute, and the backlog. Duplicates are stored nowhere else: each
//! process counts its own in memory and adds them to the store's per-minute counts.

use crate::backend::{Backend, Reads};
use crate::outbox::{Attempt, Outbox};
use crate::rows::Change;
use justonce_core::Error;
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

const MINUTE: Duration = Duration::from_secs(60);

/// Counts of one minute, one destination or a whole range.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DashboardTotals {
    /// Events stored, by the time they were received.
    pub accepted: u64,
    /// Events answered as duplicates of one stored before.
    pub duplicates: u64,
    /// Deliveries the destination took, by the time they were sent.
    pub sent: u64,
    /// Delivery attempts that failed, as the rows' histories recorded them.
    pub failed: u64,
}

impl DashboardTotals {
    fn add(&mut self, other: &Self) {
        self.accepted += other.accepted;
        self.duplicates += other.duplicates;
        self.sent += other.sent;
        self.failed += other.failed;
    }
}

/// One minute of a [`Dashboard`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DashboardMinute {
    /// The minute's start.
    pub start: SystemTime,
    /// Its counts, every destination together.
    pub counts: DashboardTotals,
}

/// One destination (a source or consumer) of a [`Dashboard`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DestinationDashboard {
    /// The source's or consumer's name.
    pub name: String,
    /// Its counts over the range.
    pub totals: DashboardTotals,
    /// Its deliveries waiting now.
    pub due: u64,
    /// How long its oldest waiting delivery has waited; `None` when none waits.
    pub oldest_due: Option<Duration>,
}

/// The store's activity over a range of whole minutes ending now, from
/// [`Outbox::dashboard`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Dashboard {
    /// The range's start: the start of its first minute.
    pub since: SystemTime,
    /// Every minute of the range, oldest first, the one in progress last.
    pub minutes: Vec<DashboardMinute>,
    /// The counts of the whole range: the sums of `minutes`.
    pub totals: DashboardTotals,
    /// Deliveries waiting now, every destination together.
    pub due: u64,
    /// How long the oldest waiting delivery has waited; `None` when none waits.
    pub oldest_due: Option<Duration>,
    /// Each destination with rows or duplicates, by name.
    pub destinations: Vec<DestinationDashboard>,
}

/// The minute of `time`, counted from the Unix epoch.
fn minute_of(time: SystemTime) -> i64 {
    let seconds = time
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    i64::try_from(seconds / 60).unwrap_or(i64::MAX)
}

/// The start of a minute counted from the Unix epoch.
fn start_of(minute: i64) -> SystemTime {
    SystemTime::UNIX_EPOCH + MINUTE * u32::try_from(minute.max(0)).unwrap_or(u32::MAX)
}

/// How many minutes of duplicate counts a process keeps until they are added to the store.
const UNFLUSHED_MINUTES: i64 = 24 * 60;

/// Duplicates this process answered, by minute and origin, until they are added to the
/// store.
#[derive(Default)]
pub(crate) struct DuplicateCounts(Mutex<HashMap<(i64, String), u64>>);

impl DuplicateCounts {
    /// Counts `duplicates` answered now for `origin`.
    pub(crate) fn add(&self, origin: &str, duplicates: u64) {
        if duplicates == 0 {
            return;
        }
        let minute = minute_of(SystemTime::now());
        let mut counts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let key = (minute, origin.to_owned());
        if !counts.contains_key(&key) {
            // A process that never flushes (a library user's) keeps a day of them.
            counts.retain(|(counted, _), _| minute - *counted < UNFLUSHED_MINUTES);
        }
        *counts.entry(key).or_default() += duplicates;
    }

    fn take(&self) -> HashMap<(i64, String), u64> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn put_back(&self, unwritten: impl IntoIterator<Item = ((i64, String), u64)>) {
        let mut counts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for (minute_origin, duplicates) in unwritten {
            *counts.entry(minute_origin).or_default() += duplicates;
        }
    }
}

impl<DB: Backend> Outbox<DB> {
    /// Adds the duplicates this process answered since the last call to the store's
    /// per-minute counts, which every process adds to. Those not written when the database
    /// fails are kept for the next call.
    pub async fn flush_duplicates(&self) -> Result<(), Error> {
        let mut pending = self.shared.duplicates.take().into_iter();
        while let Some(((minute, origin), duplicates)) = pending.next() {
            let written = {
                let _writer = self.shared.queue_writer().await;
                let count = i64::try_from(duplicates).unwrap_or(i64::MAX);
                self.shared
                    .sql
                    .add_duplicates(&self.shared.pool, minute, &origin, count)
                    .await
            };
            if let Err(error) = written {
                let unwritten = std::iter::once(((minute, origin), duplicates)).chain(pending);
                self.shared.duplicates.put_back(unwritten);
                return Err(error);
            }
        }
        Ok(())
    }

    /// Deletes at most `batch_size` minutes of duplicate counts that ended more than
    /// `older_than` ago, and returns how many it did; fewer than `batch_size` means none
    /// are left.
    pub async fn purge_duplicate_counts_batch(
        &self,
        older_than: Duration,
        batch_size: u32,
    ) -> Result<u64, Error> {
        let before = SystemTime::now()
            .checked_sub(older_than)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        self.change(Change::PurgeDuplicates {
            before_minute: minute_of(before),
            limit: i64::from(batch_size.max(1)),
        })
        .await
    }

    /// The activity of the whole minutes that began at most `range` ago, the minute in
    /// progress included, and the deliveries waiting now.
    pub async fn dashboard(&self, range: Duration) -> Result<Dashboard, Error> {
        let now = SystemTime::now();
        let first = minute_of(now.checked_sub(range).unwrap_or(SystemTime::UNIX_EPOCH));
        let last = minute_of(now).max(first);
        let since = start_of(first);
        let since_us = first.saturating_mul(60_000_000);
        let (sql, pool) = (&self.shared.sql, &self.shared.pool);

        // Counts by destination, then minute.
        let mut counted: BTreeMap<String, BTreeMap<i64, DashboardTotals>> = BTreeMap::new();
        let mut count = |destination: String, minute: i64, add: &dyn Fn(&mut DashboardTotals)| {
            let totals = counted
                .entry(destination)
                .or_default()
                .entry(minute.clamp(first, last))
                .or_default();
            add(totals);
        };
        for (destination, kind, minute_us, n) in sql.dashboard_minutes(pool, since_us).await? {
            let n = u64::try_from(n).unwrap_or(0);
            let minute = minute_us.div_euclid(60_000_000);
            match kind.as_str() {
                "accepted" => count(destination, minute, &|t| t.accepted += n),
                _ => count(destination, minute, &|t| t.sent += n),
            }
        }
        for (origin, minute, n) in sql.duplicate_minutes(pool, first).await? {
            let n = u64::try_from(n).unwrap_or(0);
            count(origin, minute, &|t| t.duplicates += n);
        }
        // A millisecond early: the histories' times are rounded to milliseconds.
        let failed = sql.failed_histories(pool, since_us - 1_000).await?;
        for (destination, history) in failed {
            let Some(history) = history else { continue };
            for attempt in Attempt::parse_history(&history)? {
                let ended = attempt.started_at + attempt.duration;
                if attempt.error.is_some() && ended >= since {
                    count(destination.clone(), minute_of(ended), &|t| t.failed += 1);
                }
            }
        }

        let waiting = self.stats_by_destination().await?;
        let mut minutes: Vec<DashboardMinute> = (first..=last)
            .map(|minute| DashboardMinute {
                start: start_of(minute),
                counts: DashboardTotals::default(),
            })
            .collect();
        let mut names: Vec<&String> = counted
            .keys()
            .chain(waiting.iter().map(|(n, _)| n))
            .collect();
        names.sort();
        names.dedup();
        let destinations: Vec<DestinationDashboard> = names
            .into_iter()
            .map(|name| {
                let mut totals = DashboardTotals::default();
                for (minute, counts) in counted.get(name).into_iter().flatten() {
                    totals.add(counts);
                    let slot = usize::try_from(minute - first).unwrap_or(0);
                    minutes[slot].counts.add(counts);
                }
                let stats = waiting.iter().find(|(n, _)| n == name).map(|(_, s)| *s);
                let due = stats.map_or(0, |s| u64::try_from(s.due).unwrap_or(0));
                DestinationDashboard {
                    name: name.clone(),
                    totals,
                    due,
                    oldest_due: stats.filter(|_| due > 0).map(|s| s.oldest_due),
                }
            })
            .collect();
        let mut totals = DashboardTotals::default();
        for destination in &destinations {
            totals.add(&destination.totals);
        }
        let due = destinations.iter().map(|d| d.due).sum();
        let oldest_due = destinations.iter().filter_map(|d| d.oldest_due).max();
        Ok(Dashboard {
            since,
            minutes,
            totals,
            due,
            oldest_due,
            destinations,
        })
    }
}
