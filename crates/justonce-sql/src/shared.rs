//! What the inbox, the outbox and the relay share: one store's pool and statements, the
//! errors of the store, and small helpers for durations, randomness and batched deletes.

use crate::backend::{Backend, Watcher};
use crate::dashboard::DuplicateCounts;
use crate::effect::CheckedEffects;
use crate::inbox::group::CommitQueue;
use crate::recent::RecentKeys;
use crate::tables::Tables;
use crate::wake::RelayWake;
use justonce_core::{Error, Identity, Retention};
use std::collections::hash_map::RandomState;
use std::future::Future;
use std::hash::BuildHasher;
use std::time::Duration;

/// What every [`Inbox`](crate::Inbox) made from one connection shares.
pub(crate) struct Shared<DB: Backend> {
    pub(crate) pool: sqlx::Pool<DB>,
    pub(crate) tables: Tables,
    pub(crate) sql: DB::Statements,
    pub(crate) retention: Retention,
    pub(crate) max_attempts: u32,
    /// Queues this process's runs on a database that takes one writer at a time: a fair
    /// queue here beats SQLite's busy handler, which polls with sleeps of up to 100 ms.
    pub(crate) writer: tokio::sync::Mutex<()>,
    pub(crate) recent: RecentKeys,
    /// The effects `Inbox::run_effect` has run, checked once each.
    pub(crate) effects: CheckedEffects,
    /// Duplicates answered and not yet added to the store's counts.
    pub(crate) duplicates: DuplicateCounts,
    pub(crate) relays: RelayWake,
    /// Where concurrent forwards wait to share a commit, when they share them.
    pub(crate) commits: Option<CommitQueue>,
    /// The pool's watcher, ended when the last owner of the pool is dropped.
    pub(crate) _watcher: Option<Watcher>,
}

impl<DB: Backend> Shared<DB> {
    /// A place in this process's queue of writers, on a database that takes one writer at a
    /// time; nothing elsewhere.
    pub(crate) async fn queue_writer(&self) -> Option<tokio::sync::MutexGuard<'_, ()>> {
        if DB::ONE_WRITER {
            Some(self.writer.lock().await)
        } else {
            None
        }
    }

    /// After a commit that wrote outbox rows: wakes this process's relays at once, and
    /// the others' by a NOTIFY shared with the commits around it.
    pub(crate) fn wake_relays(&self) {
        self.relays.committed(&self.pool, &self.tables.outbox);
    }

    /// After a replay: [`Shared::wake_relays`], with the NOTIFY sent before it returns.
    pub(crate) async fn wake_relays_now(&self) {
        (self.relays)
            .committed_now(&self.pool, &self.tables.outbox)
            .await;
    }
}

/// 64 random bits: a SipHash keyed from the operating system's randomness (per thread,
/// then stepped per call), which is all claim ids and jitter need.
pub(crate) fn random_u64() -> u64 {
    RandomState::new().hash_one(std::time::Instant::now())
}

/// A duration in milliseconds, at most 100 years: longer ones overflow PostgreSQL's
/// intervals and mean "forever" anyway.
pub(crate) fn millis(duration: Duration) -> i64 {
    const HUNDRED_YEARS_MS: u128 = 100 * 365 * 86_400 * 1_000;
    duration.as_millis().min(HUNDRED_YEARS_MS) as i64
}

/// Runs a bounded delete `limit` rows at a time until one deletes fewer, and returns how
/// many rows went in all.
pub(crate) async fn in_batches<F, Fut>(batch_size: u32, mut delete: F) -> Result<u64, Error>
where
    F: FnMut(i64) -> Fut,
    Fut: Future<Output = Result<u64, Error>>,
{
    let limit = i64::from(batch_size.max(1));
    let mut deleted = 0;
    loop {
        let batch = delete(limit).await?;
        deleted += batch;
        if batch < limit.unsigned_abs() {
            return Ok(deleted);
        }
    }
}

/// Wraps a driver error, noting whether a new transaction may succeed.
pub(crate) fn driver_error<DB: Backend>(error: sqlx::Error) -> Error {
    Error::database(DB::is_retryable(&error), error)
}

/// A key that conflicted on insert but was gone when read back: purged in between. The
/// claim can simply be tried again.
pub(crate) fn vanished(identity: &Identity) -> Error {
    Error::database(
        true,
        format!(
            "key {} conflicted but was gone when read back",
            identity.key
        ),
    )
}
