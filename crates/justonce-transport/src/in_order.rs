//! What the readers that keep their position share (the single readers of NATS and Redis,
//! and the Kafka reader, one partition at a time): a stream read in order, its position
//! stored as an offset in the same transaction as each entry's work.
//!
//! The broker keeps no acknowledgement state for such a reader: the database does. An entry
//! whose transaction committed is never read again, because the reader starts after the
//! stored offset; an entry whose transaction did not commit is read again. The key is still
//! claimed, because a publisher may have sent the same key twice at two positions.

use crate::{ConsumerStats, Incoming, Ran};
use justonce_sql::{Backend, Inbox, Offset, OffsetCommit, Outcome, RunError, WorkFuture, sqlx};
use std::future::Future;
use std::time::Duration;

/// The partition a single reader keeps its offset in: a NATS or Redis stream read in order
/// has one.
#[cfg(any(feature = "nats", feature = "redis"))]
pub(crate) const PARTITION: i32 = 0;

/// Why the transaction of an entry read in order did not commit.
#[derive(Debug, thiserror::Error)]
enum InOrderError<E> {
    #[error("the work failed")]
    Work(#[source] E),
    /// A reader that died after sending its COMMIT committed this entry after this reader
    /// loaded the offset.
    #[error("the entry was processed before")]
    AlreadyProcessed,
    /// A source, so that [`Inbox::run`] sees a retryable database error through it.
    #[error("storing the offset")]
    Offset(#[source] justonce_sql::Error),
}

/// How long a reader waits without a new entry before it stores the offset of the duplicates
/// it read last.
#[cfg(any(feature = "nats", feature = "kafka"))]
pub(crate) const IDLE: Duration = Duration::from_secs(1);

/// Runs `work` for `incoming`, at `offset` of `stream`'s `partition`, in one transaction with its key and
/// the offset (see [`Inbox::run`]). A duplicate key commits nothing, so that a burst of
/// duplicates costs no writes: the offset moves with the next processed entry or when the
/// reader is idle ([`Unstored`]), and a reader restarted before then reads those duplicates
/// again, as duplicates.
pub(crate) async fn run_at<DB, F, E>(
    inbox: &Inbox<DB>,
    stream: &str,
    partition: i32,
    offset: Offset,
    incoming: &Incoming,
    work: &F,
) -> Ran<E>
where
    DB: Backend,
    F: for<'e, 't> Fn(&'t mut sqlx::Transaction<'e, DB>, &'t Incoming) -> WorkFuture<'t, (), E>
        + Sync,
    E: std::error::Error + Send + Sync + 'static,
{
    let run = inbox
        .run(&incoming.key, &incoming.body, |tx| {
            Box::pin(async move {
                work(tx, incoming).await.map_err(InOrderError::Work)?;
                match inbox
                    .commit_offset(tx, stream, partition, offset)
                    .await
                    .map_err(InOrderError::Offset)?
                {
                    OffsetCommit::Moved => Ok(()),
                    OffsetCommit::AlreadyProcessed => Err(InOrderError::AlreadyProcessed),
                }
            })
        })
        .await;
    match run {
        Ok(outcome) => Ran::Outcome(outcome),
        Err(RunError::Work(InOrderError::Work(error))) => Ran::Work(error),
        Err(RunError::Work(InOrderError::AlreadyProcessed)) => Ran::Outcome(Outcome::Duplicate),
        Err(RunError::Work(InOrderError::Offset(error)) | RunError::Store(error)) => {
            Ran::Store(error)
        }
        Err(error) => Ran::Store(justonce_sql::Error::Config(format!(
            "the run failed in a way this reader does not know: {error}"
        ))),
    }
}

/// Runs an entry's work until it commits, its key was processed before, the database fails,
/// or it has failed `max_attempts` times, pausing a growing delay between failures. A failing
/// entry holds up the entries after it: that is the price of reading in order.
pub(crate) async fn run_with_retries<DB, F, E>(
    inbox: &Inbox<DB>,
    stream: &str,
    partition: i32,
    offset: Offset,
    incoming: &mut Incoming,
    work: &F,
    max_attempts: u32,
    stats: &mut ConsumerStats,
) -> Ran<E>
where
    DB: Backend,
    F: for<'e, 't> Fn(&'t mut sqlx::Transaction<'e, DB>, &'t Incoming) -> WorkFuture<'t, (), E>
        + Sync,
    E: std::error::Error + Send + Sync + 'static,
{
    loop {
        match run_at(inbox, stream, partition, offset, incoming, work).await {
            Ran::Work(error) if incoming.attempt < max_attempts => {
                tracing::debug!(attempt = incoming.attempt, %error, "work failed: retrying");
                stats.retried += 1;
                tokio::time::sleep(retry_delay(incoming.attempt)).await;
                incoming.attempt += 1;
                incoming.redelivered = true;
            }
            ran => return ran,
        }
    }
}

/// Runs the work of the entry at `offset` of `stream`'s `partition` with its retries, then
/// counts it, or gives it up: `dead_letter` publishes it with the attempt and the reason,
/// and the offset moves past it. `incoming` is what the work sees, or why the entry has no
/// key (given up at once). False when the database failed and the entry must be run again.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn process<DB, F, E, D, Published>(
    inbox: &Inbox<DB>,
    (stream, partition, offset): (&str, i32, Offset),
    incoming: Result<Incoming, String>,
    work: &F,
    max_attempts: u32,
    stats: &mut ConsumerStats,
    unstored: &mut Unstored,
    dead_letter: D,
) -> Result<bool, crate::Error>
where
    DB: Backend,
    F: for<'e, 't> Fn(&'t mut sqlx::Transaction<'e, DB>, &'t Incoming) -> WorkFuture<'t, (), E>
        + Sync,
    E: std::error::Error + Send + Sync + 'static,
    D: FnOnce(u32, String) -> Published,
    Published: Future<Output = Result<(), crate::Error>>,
{
    let (attempt, reason) = match incoming {
        Err(reason) => (1, reason),
        Ok(mut incoming) => {
            let ran = run_with_retries(
                inbox,
                stream,
                partition,
                offset,
                &mut incoming,
                work,
                max_attempts,
                stats,
            )
            .await;
            match ran {
                Ran::Outcome(outcome) => {
                    crate::count(&outcome, stats);
                    unstored.after(&outcome, partition, offset);
                    return Ok(true);
                }
                Ran::Work(error) => (
                    incoming.attempt,
                    format!("attempt {}: {error}", incoming.attempt),
                ),
                Ran::NoKey(reason) => (1, reason),
                Ran::Store(error) => {
                    tracing::warn!(%error, "database failed: the entry runs again");
                    stats.returned += 1;
                    return Ok(false);
                }
            }
        }
    };
    tracing::warn!(%reason, partition, %offset, "dead-lettered");
    dead_letter(attempt, reason).await?;
    stats.dead_lettered += 1;
    match skip(inbox, stream, partition, offset).await {
        Ok(()) => Ok(true),
        Err(error) => {
            tracing::warn!(%error, "database failed: the offset did not move past a dead letter");
            Ok(false)
        }
    }
}

/// The offset of the last entry read in each partition, when its transaction did not store
/// it (a duplicate).
#[derive(Debug, Default)]
pub(crate) struct Unstored(std::collections::BTreeMap<i32, Offset>);

impl Unstored {
    /// Notes what running the entry at `offset` of `partition` came to.
    pub(crate) fn after(&mut self, outcome: &Outcome<()>, partition: i32, offset: Offset) {
        match outcome {
            Outcome::Processed(()) => self.0.remove(&partition),
            Outcome::Duplicate | Outcome::KeyReused { .. } => self.0.insert(partition, offset),
        };
    }

    pub(crate) fn is_some(&self) -> bool {
        !self.0.is_empty()
    }

    /// Stores the offsets in a transaction of their own each. A failure leaves them for the
    /// next time: until then, a restarted reader reads those duplicates again.
    pub(crate) async fn store<DB: Backend>(&mut self, inbox: &Inbox<DB>, stream: &str) {
        let unstored = std::mem::take(&mut self.0);
        for (partition, offset) in unstored {
            if let Err(error) = skip(inbox, stream, partition, offset).await {
                tracing::warn!(%error, partition, "storing the offset of duplicates failed");
                self.0.insert(partition, offset);
            }
        }
    }
}

/// Moves the offset past an entry given up (dead-lettered) in a transaction of its own.
pub(crate) async fn skip<DB: Backend>(
    inbox: &Inbox<DB>,
    stream: &str,
    partition: i32,
    offset: Offset,
) -> Result<(), justonce_sql::Error> {
    inbox.move_offset(stream, partition, offset).await.map(drop)
}

/// Where a reader starts: after the stored offset of `stream`, if any.
#[cfg(any(feature = "nats", feature = "redis"))]
pub(crate) async fn stored_offset<DB: Backend>(
    inbox: &Inbox<DB>,
    stream: &str,
) -> Result<Option<Offset>, justonce_sql::Error> {
    Ok(inbox
        .load_offsets(stream)
        .await?
        .into_iter()
        .find(|(partition, _)| *partition == PARTITION)
        .map(|(_, offset)| offset))
}

/// 1 s after the first failure, doubling to at most a minute.
pub(crate) fn retry_delay(attempt: u32) -> Duration {
    Duration::from_secs(1 << attempt.saturating_sub(1).min(6)).min(Duration::from_secs(60))
}
