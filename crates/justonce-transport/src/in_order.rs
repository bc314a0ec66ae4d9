//! What the single readers of NATS and Redis share: a stream read in order, its position
//! stored as an offset in the same transaction as each entry's work.
//!
//! The broker keeps no acknowledgement state for such a reader: the database does. An entry
//! whose transaction committed is never read again, because the reader starts after the
//! stored offset; an entry whose transaction did not commit is read again. The key is still
//! claimed, because a publisher may have sent the same key twice at two positions.

use crate::{ConsumerStats, Incoming, Ran};
use justonce_sql::{Backend, Inbox, Offset, OffsetCommit, Outcome, RunError, WorkFuture, sqlx};
use std::time::Duration;

/// The partition a single reader keeps its offset in: a stream read in order has one.
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
#[cfg(feature = "nats")]
pub(crate) const IDLE: Duration = Duration::from_secs(1);

/// Runs `work` for `incoming`, at `offset` of `stream`, in one transaction with its key and
/// the offset (see [`Inbox::run`]). A duplicate key commits nothing, so that a burst of
/// duplicates costs no writes: the offset moves with the next processed entry or when the
/// reader is idle ([`Unstored`]), and a reader restarted before then reads those duplicates
/// again, as duplicates.
pub(crate) async fn run_at<DB, F, E>(
    inbox: &Inbox<DB>,
    stream: &str,
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
                    .commit_offset(tx, stream, PARTITION, offset)
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
        match run_at(inbox, stream, offset, incoming, work).await {
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

/// The offset of the last entry read, when its transaction did not store it (a duplicate).
#[derive(Debug, Default)]
pub(crate) struct Unstored(Option<Offset>);

impl Unstored {
    /// Notes what running the entry at `offset` came to.
    pub(crate) fn after(&mut self, outcome: &Outcome<()>, offset: Offset) {
        self.0 = match outcome {
            Outcome::Processed(()) => None,
            Outcome::Duplicate | Outcome::KeyReused { .. } => Some(offset),
        };
    }

    pub(crate) fn is_some(&self) -> bool {
        self.0.is_some()
    }

    /// Stores the offset in a transaction of its own. A failure leaves it for the next time:
    /// until then, a restarted reader reads those duplicates again.
    pub(crate) async fn store<DB: Backend>(&mut self, inbox: &Inbox<DB>, stream: &str) {
        let Some(offset) = self.0 else { return };
        match skip(inbox, stream, offset).await {
            Ok(()) => self.0 = None,
            Err(error) => tracing::warn!(%error, "storing the offset of duplicates failed"),
        }
    }
}

/// Moves the offset past an entry given up (dead-lettered) in a transaction of its own.
pub(crate) async fn skip<DB: Backend>(
    inbox: &Inbox<DB>,
    stream: &str,
    offset: Offset,
) -> Result<(), justonce_sql::Error> {
    inbox.move_offset(stream, PARTITION, offset).await.map(drop)
}

/// Where a reader starts: after the stored offset of `stream`, if any.
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
