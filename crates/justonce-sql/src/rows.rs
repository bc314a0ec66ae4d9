//! What the databases' statements take and give back: the rows the inbox, the outbox and
//! the relay hand to a [`Backend`](crate::Backend), and how a row read is decoded.

use justonce_core::{Consumer, Error, Fingerprint, Identity, Lease, Offset, Scope};

/// One key to claim, with the attempt's claim id.
#[derive(Clone, Copy)]
pub struct ClaimRow<'a> {
    pub(crate) identity: &'a Identity,
    pub(crate) fingerprint: &'a Fingerprint,
    pub(crate) claim_id: i64,
}

/// Keys to claim together, sorted and without repeats, with one claim id for the batch.
pub struct Batch<'a> {
    pub(crate) scope: &'a Scope,
    pub(crate) consumer: &'a Consumer,
    pub(crate) keys: Vec<&'a str>,
    pub(crate) fingerprints: Vec<&'a Fingerprint>,
    pub(crate) claim_id: i64,
}

impl Batch<'_> {
    /// The rows of keys this batch inserted, from the keys alone.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub(crate) fn inserted(&self, keys: Vec<String>) -> Vec<(String, Stored)> {
        keys.into_iter()
            .filter_map(|key| {
                let index = self.keys.binary_search(&key.as_str()).ok()?;
                let stored = Stored {
                    claim_id: self.claim_id,
                    fingerprint: *self.fingerprints[index],
                };
                Some((key, stored))
            })
            .collect()
    }
}

/// The row that holds a key: which attempt claimed it, with which payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stored {
    pub(crate) claim_id: i64,
    pub(crate) fingerprint: Fingerprint,
}

impl Stored {
    pub(crate) fn decode(claim_id: i64, fingerprint: Vec<u8>) -> Result<Self, Error> {
        let bytes: [u8; 32] = fingerprint.try_into().map_err(|bytes: Vec<u8>| {
            Error::Schema(format!(
                "a stored fingerprint is {} bytes long, not 32",
                bytes.len()
            ))
        })?;
        Ok(Self {
            claim_id,
            fingerprint: Fingerprint::from_bytes(bytes),
        })
    }
}

/// A key's row as a lease claim sees it.
pub struct LeaseState {
    pub(crate) fingerprint: Fingerprint,
    pub(crate) done: bool,
    pub(crate) result: Option<Vec<u8>>,
    /// Milliseconds until the lease runs out, by the store's clock; 0 or less once it has.
    pub(crate) remaining_ms: i64,
}

/// The columns of a `lease_state` statement as sqlx decodes them.
pub(crate) type LeaseRow = (Vec<u8>, bool, Option<Vec<u8>>, i64);

impl LeaseState {
    pub(crate) fn decode(row: LeaseRow) -> Result<Self, Error> {
        let (fingerprint, done, result, remaining_ms) = row;
        Ok(Self {
            fingerprint: Stored::decode(0, fingerprint)?.fingerprint,
            done,
            result,
            remaining_ms,
        })
    }
}

/// The columns of an `all_offsets` statement as sqlx decodes them: consumer, stream,
/// partition, position and sequence.
pub(crate) type OffsetTuple = (String, String, i32, i64, i64);

impl From<OffsetTuple> for StoredOffset {
    fn from((consumer, stream, partition, position, sequence): OffsetTuple) -> Self {
        Self {
            consumer,
            stream,
            partition,
            offset: Offset::new(position, sequence),
        }
    }
}

/// One outbox row to write.
pub struct NewOutboxRow<'a> {
    pub(crate) scope: &'a str,
    pub(crate) key: &'a str,
    pub(crate) destination: &'a str,
    pub(crate) payload: &'a [u8],
    pub(crate) headers: String,
}

/// How the relays learn that an outbox row was committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Announce {
    /// By a NOTIFY sent at the commit of the transaction that wrote it, where relays
    /// listen: the user's own transaction, whose commit justonce does not see.
    AtCommit,
    /// By the run that commits the transaction, after the commit: no NOTIFY in it, which
    /// would make concurrent commits queue for one lock.
    AfterCommit,
}

/// The columns of every outbox read as sqlx decodes them.
pub(crate) type OutboxTuple = (
    i64,
    String,
    String,
    String,
    Vec<u8>,
    String,
    i64,
    Option<String>,
    bool,
    bool,
    i64,
);

/// An outbox row as read.
#[derive(Debug)]
pub struct OutboxRow {
    pub(crate) id: i64,
    pub(crate) scope: String,
    pub(crate) key: String,
    pub(crate) destination: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: String,
    pub(crate) attempts: i64,
    pub(crate) last_error: Option<String>,
    pub(crate) dead: bool,
    pub(crate) sent: bool,
    /// Milliseconds since the row was written, by the store's clock.
    pub(crate) age_ms: i64,
}

impl From<OutboxTuple> for OutboxRow {
    fn from(row: OutboxTuple) -> Self {
        let (
            id,
            scope,
            key,
            destination,
            payload,
            headers,
            attempts,
            last_error,
            dead,
            sent,
            age_ms,
        ) = row;
        Self {
            id,
            scope,
            key,
            destination,
            payload,
            headers,
            attempts,
            last_error,
            dead,
            sent,
            age_ms,
        }
    }
}

/// What one delivery attempt adds to its row's history beside its outcome: how long it
/// took and what the receiver answered, made safe to store. The statement that records
/// the outcome appends it, keeping the row's last [`HISTORY_LENGTH`] attempts.
#[derive(Clone, Copy)]
pub struct Tried<'a> {
    pub(crate) duration_ms: i64,
    pub(crate) status: Option<i64>,
    pub(crate) answer: Option<&'a str>,
}

/// How many attempts a row's history keeps: the last ones.
pub const HISTORY_LENGTH: usize = 25;

/// Rows of a destination written (or last replayed) within a window that ends some
/// milliseconds ago; each part `None` for any.
#[derive(Clone, Copy, Default)]
pub struct Window<'a> {
    pub(crate) destination: Option<&'a str>,
    /// Written at most this many milliseconds ago.
    pub(crate) since_ms: Option<i64>,
    /// Written at least this many milliseconds ago.
    pub(crate) until_ms: Option<i64>,
}

/// Which rows a listing reads: those of one state within a window, with an id above
/// `after` if given, at most `limit`.
pub struct Listing<'a> {
    pub(crate) state: Waiting,
    pub(crate) window: Window<'a>,
    pub(crate) after: Option<i64>,
    pub(crate) limit: i64,
}

/// The rows a listing is about: those waiting for a delivery, or the dead letters.
#[derive(Clone, Copy)]
pub(crate) enum Waiting {
    Due,
    Dead,
}

/// The columns of a listing as sqlx decodes them: id, scope, key, destination, attempts,
/// last error, milliseconds since written, milliseconds until the next attempt.
pub(crate) type ListedTuple = (i64, String, String, String, i64, Option<String>, i64, i64);

/// Which stored events a listing reads, as [`crate::EventFilter`] says, with times in
/// microseconds since the Unix epoch.
pub struct EventListing<'a> {
    pub(crate) origin: Option<&'a str>,
    /// The prefix keys start with, and the least text above every key that does (none
    /// when no text is): the range an index on the key serves.
    pub(crate) key_prefix: Option<(&'a str, Option<String>)>,
    /// A part keys contain anywhere, matched by a scan.
    pub(crate) key_part: Option<&'a str>,
    pub(crate) since_us: Option<i64>,
    pub(crate) until_us: Option<i64>,
    pub(crate) state: Option<&'static str>,
    /// The last event of the previous page: its time and id.
    pub(crate) after: Option<(i64, i64)>,
    pub(crate) limit: i64,
}

/// The columns of an events listing as sqlx decodes them: id, scope, key, origin,
/// microseconds received, state, attempts, last error.
pub(crate) type EventTuple = (
    i64,
    String,
    String,
    String,
    i64,
    String,
    i64,
    Option<String>,
);

/// An event read whole: the columns of [`EventTuple`], then the body, the headers and
/// the delivery history as JSON text.
pub(crate) type EventDetailTuple = (
    i64,
    String,
    String,
    String,
    i64,
    String,
    i64,
    Option<String>,
    Vec<u8>,
    String,
    Option<String>,
);

/// A replay of one origin's events received within a window, in microseconds since the
/// Unix epoch; `until_us` none for up to the store's now.
pub struct NewReplay<'a> {
    pub(crate) id: i64,
    pub(crate) origin: &'a str,
    pub(crate) since_us: i64,
    pub(crate) until_us: Option<i64>,
}

/// Which events to read whole.
pub enum EventBy<'a> {
    Id(i64),
    Key(&'a str),
}

/// Which replays to read.
pub enum Replays {
    Id(i64),
    /// The latest ones, at most this many.
    Latest(i64),
}

/// The columns of a replay read back: id, origin, since, until and start in microseconds
/// since the Unix epoch, events replayed, whether it still runs.
pub(crate) type ReplayTuple = (i64, String, i64, i64, i64, i64, bool);

/// The columns of a `breakers` read as sqlx decodes them: destination, scope, failures,
/// milliseconds the pause has left, milliseconds since it was written.
pub(crate) type BreakerTuple = (String, String, i64, i64, i64);

/// Which outbox rows to read.
pub enum Which {
    /// Due rows, at most `limit`, hidden for `lease_ms` under `token` and counted as one
    /// more attempt; none for the lanes in `held_back`, a JSON array whose elements are
    /// `[destination, scope]` for one lane or `[destination]` for all of a destination's.
    Due {
        lease_ms: i64,
        limit: i64,
        token: i64,
        held_back: String,
    },
    /// One row.
    Id(i64),
    /// Dead letters, oldest first.
    DeadLetters { limit: i64 },
}

/// A statement that changes rows; each database's statements have its text.
pub enum Change<'a> {
    PurgeKeys {
        consumer: &'a str,
        older_than_ms: i64,
        limit: i64,
    },
    /// Deletes at most `limit` counts of runs of `consumer` whose last run started more
    /// than `older_than_ms` ago.
    PurgeRuns {
        consumer: &'a str,
        older_than_ms: i64,
        limit: i64,
    },
    /// Deletes the count of runs of `key` in `scope` of `consumer`.
    ForgetRuns {
        scope: &'a str,
        consumer: &'a str,
        key: &'a str,
    },
    MarkSent {
        id: i64,
        token: i64,
        tried: Tried<'a>,
    },
    MarkRetry {
        id: i64,
        after_ms: i64,
        reason: &'a str,
        token: i64,
        tried: Tried<'a>,
    },
    MarkDead {
        id: i64,
        reason: &'a str,
        token: i64,
        tried: Tried<'a>,
    },
    /// A row taken and not tried: due again after `after_ms`, its attempt given back.
    Untake {
        id: i64,
        after_ms: i64,
        token: i64,
    },
    /// Dead-letters at most `limit` unsent rows of `destination` in `scope` written more
    /// than `older_than_ms` ago, with `reason`.
    Expire {
        destination: &'a str,
        scope: &'a str,
        older_than_ms: i64,
        reason: &'a str,
        limit: i64,
    },
    /// A relay backed `destination` off for the rows of `scope`, for `pause_ms` after
    /// `failures` in a row.
    BreakerOpen {
        destination: &'a str,
        scope: &'a str,
        failures: i64,
        pause_ms: i64,
    },
    /// A relay's breaker for `destination` and `scope` closed: it answers again.
    BreakerClose {
        destination: &'a str,
        scope: &'a str,
    },
    /// The dead letters within `window` when `id` is `None`, at most `limit`, oldest first.
    Replay {
        id: Option<i64>,
        window: Window<'a>,
        limit: i64,
    },
    /// A delivered or dead event put back to due, its attempts counted anew: by id, or
    /// every one written with a key.
    ReplayEvent {
        id: i64,
    },
    ReplayKey {
        key: &'a str,
    },
    /// Every dead letter within `window`.
    PurgeDead {
        window: Window<'a>,
    },
    /// Deletes at most `limit` delivered events of `origin` received more than
    /// `older_than_ms` ago.
    PurgeEvents {
        origin: &'a str,
        older_than_ms: i64,
        limit: i64,
    },
    PurgeSent {
        older_than_ms: i64,
        limit: i64,
    },
    /// Deletes at most `limit` minutes of duplicate counts before `before_minute`.
    PurgeDuplicates {
        before_minute: i64,
        limit: i64,
    },
    LeaseComplete {
        lease: &'a Lease,
        result: &'a [u8],
    },
    LeaseRelease {
        lease: &'a Lease,
    },
    LeaseRenew {
        lease: &'a Lease,
        lease_ms: i64,
    },
    /// An operator frees a key's lease, whoever holds it.
    ForceRelease {
        identity: &'a Identity,
    },
    /// An operator marks a key's lease done, whoever holds it; `None` stores no result.
    ForceComplete {
        identity: &'a Identity,
        result: Option<&'a [u8]>,
    },
}

/// The columns of a `destination_stats` statement as sqlx decodes them: destination, then
/// the counts of `outbox_stats`.
pub(crate) type DestinationCounts = (String, i64, i64, i64, i64);

/// The columns of a `key_counts` statement as sqlx decodes them.
pub(crate) type KeyCountTuple = (String, String, i64, i64);

impl From<KeyCountTuple> for KeyCount {
    fn from((consumer, scope, keys, in_progress): KeyCountTuple) -> Self {
        Self {
            consumer,
            scope,
            keys,
            in_progress,
        }
    }
}

/// The keys of one consumer in one scope.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyCount {
    /// The consumer that claimed them.
    pub consumer: String,
    /// The tenant scope; empty for none.
    pub scope: String,
    /// How many keys are stored.
    pub keys: i64,
    /// How many of them are leases not completed: held, or whose lease ran out or was
    /// released and which wait for the next claim.
    pub in_progress: i64,
}

/// A stream position as stored by [`Inbox::commit_offset`](crate::Inbox::commit_offset).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoredOffset {
    /// The consumer that stored it.
    pub consumer: String,
    /// The stream.
    pub stream: String,
    /// The stream's partition.
    pub partition: i32,
    /// The position.
    pub offset: Offset,
}

/// A stream position to store, if the stored one is below `above` (and, given `at_least`,
/// not below it).
#[derive(Clone, Copy)]
pub struct OffsetRow<'a> {
    pub(crate) consumer: &'a str,
    pub(crate) stream: &'a str,
    pub(crate) partition: i32,
    pub(crate) offset: Offset,
    pub(crate) above: Offset,
    /// Where the batch before, its transaction still open, moves the offset: this one
    /// waits for it, and moves only if it committed. The row exists.
    pub(crate) at_least: Option<Offset>,
}

/// Wakes a waiting relay when an outbox row may have been committed.
pub struct Wakeups {
    /// This process's commits of outbox rows.
    pub(crate) commits: Option<tokio::sync::watch::Receiver<u64>>,
    /// Other processes' commits, notified.
    #[cfg(feature = "postgres")]
    pub(crate) listener: Option<sqlx::postgres::PgListener>,
}

impl Wakeups {
    /// No notifications: the caller polls.
    pub(crate) fn none() -> Self {
        Self {
            commits: None,
            #[cfg(feature = "postgres")]
            listener: None,
        }
    }

    /// Also wakes on this process's commits of outbox rows.
    pub(crate) fn and_commits(mut self, commits: tokio::sync::watch::Receiver<u64>) -> Self {
        self.commits = Some(commits);
        self
    }

    /// Resolves on a commit of this process or a notification; never, where there are
    /// none (the caller polls too).
    pub(crate) async fn wait(&mut self) {
        let commits = &mut self.commits;
        let committed = async move {
            if let Some(commits) = commits
                && commits.changed().await.is_ok()
            {
                return;
            }
            std::future::pending::<()>().await;
        };
        #[cfg(feature = "postgres")]
        let listener = &mut self.listener;
        let notified = async move {
            #[cfg(feature = "postgres")]
            if let Some(listener) = listener {
                // An error drops the connection, which the next call re-establishes; the
                // caller's poll covers what was missed meanwhile.
                if listener.recv().await.is_ok() {
                    return;
                }
            }
            std::future::pending::<()>().await;
        };
        tokio::select! {
            () = committed => {}
            () = notified => {}
        }
    }
}

/// One schema change, with `{prefix}` in place of the table prefix.
pub struct Migration {
    pub(crate) version: i64,
    pub(crate) description: &'static str,
    pub(crate) sql: &'static str,
}

/// One database's migrations, and the statements that keep their record.
pub struct Schema {
    /// What a migration script starts with: its transaction, or a note where there is none.
    pub(crate) script_head: &'static str,
    /// What a migration script ends with.
    pub(crate) script_tail: &'static str,
    /// Run first, in order: what keeps migrators apart and the migrations table.
    pub(crate) setup: &'static [&'static str],
    /// The newest version applied, 0 for none.
    pub(crate) current_version: &'static str,
    /// Records one migration, its version and description as parameters.
    pub(crate) record: &'static str,
    pub(crate) migrations: &'static [Migration],
}
