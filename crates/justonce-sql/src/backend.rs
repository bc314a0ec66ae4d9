//! What differs between databases, behind one sealed trait.

use crate::tables::Tables;
use justonce_core::{Consumer, Error, Fingerprint, Identity, Lease, Offset, Scope};
use std::future::Future;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
use std::sync::Arc;

/// A database justonce can store keys in: [`sqlx::Postgres`] with the `postgres` feature,
/// [`sqlx::MySql`] (MariaDB or MySQL) with the `mysql` feature, [`sqlx::Sqlite`] with the
/// `sqlite` feature.
///
/// The trait is sealed: its methods are justonce's own, and users only name the type, as in
/// `Inbox<Postgres>`.
pub trait Backend: sqlx::Database + Sealed {
    /// The statement that opens a writing transaction.
    #[doc(hidden)]
    const BEGIN: &'static str;

    /// Whether the database takes one writer at a time, so that this process's writers
    /// are better queued here than left to the database's busy handler, which sleeps.
    #[doc(hidden)]
    const ONE_WRITER: bool;

    /// The statements of one table prefix, built once when an inbox is made.
    #[doc(hidden)]
    type Statements: std::fmt::Debug + Send + Sync + 'static;

    #[doc(hidden)]
    fn statements(tables: &Tables) -> Self::Statements;

    #[doc(hidden)]
    fn connect(
        url: &str,
        pool: sqlx::pool::PoolOptions<Self>,
    ) -> impl Future<Output = Result<sqlx::Pool<Self>, Error>> + Send;

    /// Claims the key and writes its forwarding outbox row in one statement, committed on
    /// its own: one round trip. Returns the claim id and fingerprint of the row that holds
    /// the key afterwards, or no row when a holder committed after the statement's
    /// snapshot. `None` where the database cannot do it in one statement.
    #[doc(hidden)]
    fn claim_and_forward<'a>(
        _pool: &'a sqlx::Pool<Self>,
        _sql: &'a Self::Statements,
        _row: ClaimRow<'a>,
        _outbox: NewOutboxRow<'a>,
    ) -> Option<ClaimAndForward<'a>> {
        None
    }

    /// Inserts the key unless present, returning the row that holds it afterwards.
    #[doc(hidden)]
    fn claim<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Self::Statements,
        row: ClaimRow<'a>,
    ) -> impl Future<Output = Result<Stored, Error>> + Send + 'a;

    #[doc(hidden)]
    fn find<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Self::Statements,
        identity: &'a Identity,
    ) -> impl Future<Output = Result<Option<Stored>, Error>> + Send + 'a;

    /// Inserts the keys that are not present in one statement, in key order, and returns
    /// the rows it knows of afterwards: at least the inserted ones, which carry the batch's
    /// claim id. A key it returns no row for is read with `find_many`.
    #[doc(hidden)]
    fn insert_many<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Self::Statements,
        batch: &'a Batch<'a>,
    ) -> impl Future<Output = Result<Vec<(String, Stored)>, Error>> + Send + 'a;

    /// The stored rows of these keys.
    #[doc(hidden)]
    fn find_many<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Self::Statements,
        scope: &'a Scope,
        consumer: &'a Consumer,
        keys: &'a [&'a str],
    ) -> impl Future<Output = Result<Vec<(String, Stored)>, Error>> + Send + 'a;

    /// Takes a lease on the key if it is free or its lease expired with the same payload,
    /// and returns the new token.
    #[doc(hidden)]
    fn lease_claim<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Self::Statements,
        identity: &'a Identity,
        fingerprint: &'a Fingerprint,
        lease_ms: i64,
    ) -> impl Future<Output = Result<Option<i64>, Error>> + Send + 'a;

    /// The state of a key's row, for a lease claim that did not take it.
    #[doc(hidden)]
    fn lease_state<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Self::Statements,
        identity: &'a Identity,
    ) -> impl Future<Output = Result<Option<LeaseState>, Error>> + Send + 'a;

    /// Stores a result with a key claimed in this transaction.
    #[doc(hidden)]
    fn store_result<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Self::Statements,
        identity: &'a Identity,
        result: &'a [u8],
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a;

    /// Runs one statement that changes rows, and returns how many it changed.
    #[doc(hidden)]
    fn change<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Self::Statements,
        change: Change<'a>,
    ) -> impl Future<Output = Result<u64, Error>> + Send + 'a;

    /// Writes an outbox row and, on PostgreSQL, notifies the relays at commit.
    #[doc(hidden)]
    fn enqueue<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Self::Statements,
        row: NewOutboxRow<'a>,
    ) -> impl Future<Output = Result<i64, Error>> + Send + 'a;

    /// Reads outbox rows; taking due rows also hides them for a lease.
    #[doc(hidden)]
    fn outbox_rows<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Self::Statements,
        which: Which,
    ) -> impl Future<Output = Result<Vec<OutboxRow>, Error>> + Send + 'a;

    /// Moves a stream's offset forward, never back; returns whether it moved.
    #[doc(hidden)]
    fn commit_offset<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Self::Statements,
        at: OffsetRow<'a>,
    ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

    /// A consumer's offsets in one stream, by partition.
    #[doc(hidden)]
    fn load_offsets<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Self::Statements,
        consumer: &'a str,
        stream: &'a str,
    ) -> impl Future<Output = Result<Vec<(i32, Offset)>, Error>> + Send + 'a;

    /// How many outbox rows are sent, due and dead, and the age of the oldest due one.
    #[doc(hidden)]
    fn outbox_stats<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Self::Statements,
    ) -> impl Future<Output = Result<(i64, i64, i64, i64), Error>> + Send + 'a;

    /// How many keys each consumer has in each scope, and how many of them are leases not
    /// completed, ordered by consumer and scope.
    #[doc(hidden)]
    fn key_counts<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Self::Statements,
    ) -> impl Future<Output = Result<Vec<KeyCount>, Error>> + Send + 'a;

    /// Milliseconds since the oldest key of `consumer` was processed; 0 without keys.
    #[doc(hidden)]
    fn oldest_key_age_ms<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Self::Statements,
        consumer: &'a str,
    ) -> impl Future<Output = Result<i64, Error>> + Send + 'a;

    /// The destinations backed off, by name: failures in a row, milliseconds the pause
    /// has left (negative once a probe may go), milliseconds since it was written.
    #[doc(hidden)]
    fn breakers<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Self::Statements,
    ) -> impl Future<Output = Result<Vec<(String, i64, i64, i64)>, Error>> + Send + 'a;

    /// Every stored offset, ordered by consumer, stream and partition.
    #[doc(hidden)]
    fn all_offsets<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Self::Statements,
    ) -> impl Future<Output = Result<Vec<StoredOffset>, Error>> + Send + 'a;

    /// What wakes a waiting relay when a row is committed: notifications on PostgreSQL,
    /// nothing on SQLite (the relay polls).
    #[doc(hidden)]
    fn outbox_wakeups<'a>(
        pool: &'a sqlx::Pool<Self>,
        tables: &'a Tables,
    ) -> impl Future<Output = Result<Wakeups, Error>> + Send + 'a;

    /// Applies the migrations that are missing, under a lock that serialises concurrent
    /// migrators, and returns how many ran.
    #[doc(hidden)]
    fn migrate<'a>(
        pool: &'a sqlx::Pool<Self>,
        tables: &'a Tables,
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a;

    /// The migrations after version `since` as one script, for those who apply them by
    /// hand.
    #[doc(hidden)]
    fn migration_script(tables: &Tables, since: i64) -> String;

    /// Whether the keys table exists with its unique constraint on (scope, consumer, key).
    #[doc(hidden)]
    fn has_unique_constraint<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Self::Statements,
    ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

    /// Whether a new transaction may not hit this error again.
    #[doc(hidden)]
    fn is_retryable(error: &sqlx::Error) -> bool;

    /// Whether a failed COMMIT may have happened all the same: the connection broke or the
    /// server went away before its answer arrived.
    #[doc(hidden)]
    fn is_commit_unknown(error: &sqlx::Error) -> bool;

    /// Run first in an attempt that follows a COMMIT whose answer was lost, so that its
    /// claim gives up instead of waiting for hours behind a session that is still open.
    #[doc(hidden)]
    fn bound_lock_waits(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<(), Error>> + Send + '_;
}

/// The statement of [`Backend::claim_and_forward`], running.
#[doc(hidden)]
pub type ClaimAndForward<'a> = std::pin::Pin<
    Box<dyn Future<Output = Result<Option<(i64, Vec<u8>)>, ForwardFailed>> + Send + 'a>,
>;

/// Why the statement of [`Backend::claim_and_forward`] gave no answer.
#[doc(hidden)]
pub enum ForwardFailed {
    /// No connection was had: nothing was sent.
    Connect(sqlx::Error),
    /// The statement was sent, and failed or lost its answer.
    Statement(sqlx::Error),
}

pub(crate) use private::Sealed;
mod private {
    pub trait Sealed {}
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
/// The statements of one table prefix on PostgreSQL or SQLite, built once.
#[derive(Debug)]
pub struct Statements {
    pub(crate) claim: Arc<str>,
    pub(crate) claim_and_forward: Option<Arc<str>>,
    pub(crate) find: Arc<str>,
    pub(crate) insert_many: Arc<str>,
    pub(crate) find_many: Arc<str>,
    pub(crate) has_unique_constraint: Arc<str>,
    pub(crate) purge_keys: Arc<str>,
    pub(crate) enqueue: Arc<str>,
    pub(crate) take_due: Arc<str>,
    pub(crate) outbox_row: Arc<str>,
    pub(crate) dead_letters: Arc<str>,
    pub(crate) mark_sent: Arc<str>,
    pub(crate) mark_retry: Arc<str>,
    pub(crate) mark_dead: Arc<str>,
    pub(crate) untake: Arc<str>,
    pub(crate) expire: Arc<str>,
    pub(crate) breaker_open: Arc<str>,
    pub(crate) breaker_close: Arc<str>,
    pub(crate) breakers: Arc<str>,
    pub(crate) replay: Arc<str>,
    pub(crate) purge_dead: Arc<str>,
    pub(crate) purge_sent: Arc<str>,
    pub(crate) commit_offset: Arc<str>,
    pub(crate) load_offsets: Arc<str>,
    pub(crate) all_offsets: Arc<str>,
    pub(crate) outbox_stats: Arc<str>,
    pub(crate) key_counts: Arc<str>,
    pub(crate) oldest_key_age: Arc<str>,
    pub(crate) lease_claim: Arc<str>,
    pub(crate) lease_state: Arc<str>,
    pub(crate) lease_complete: Arc<str>,
    pub(crate) lease_release: Arc<str>,
    pub(crate) lease_renew: Arc<str>,
    pub(crate) force_release: Arc<str>,
    pub(crate) force_complete: Arc<str>,
    pub(crate) store_result: Arc<str>,
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
/// The statements whose text differs between databases beyond the clock.
pub(crate) struct Specific {
    pub(crate) claim: String,
    /// The claim and a forwarding outbox row in one statement, where the database can.
    pub(crate) claim_and_forward: Option<String>,
    pub(crate) insert_many: String,
    pub(crate) find_many: String,
    pub(crate) has_unique_constraint: String,
    pub(crate) purge_keys: String,
    pub(crate) enqueue: String,
    /// What makes concurrent relays skip each other's rows: `FOR UPDATE SKIP LOCKED`.
    pub(crate) skip_locked: &'static str,
    /// A query of the texts in a JSON array given as the parameter named.
    pub(crate) texts_of: fn(&str) -> String,
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
/// The store's clock in a database's SQL: times are compared there, never in the worker.
pub(crate) struct Clock {
    pub(crate) now: &'static str,
    /// `now` moved by a number of milliseconds given as a parameter, such as `$2`.
    pub(crate) later_by: fn(&str) -> String,
    pub(crate) earlier_by: fn(&str) -> String,
    /// Milliseconds from a time column to now.
    pub(crate) age_ms: fn(&str) -> String,
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
impl Statements {
    pub(crate) fn new(tables: &Tables, clock: &Clock, specific: Specific) -> Self {
        let Tables {
            keys,
            outbox,
            offsets,
            breakers,
            ..
        } = tables;
        let now = clock.now;
        // Every outbox read returns these columns, decoded as an `OutboxTuple`.
        let columns = format!(
            "id, scope, key, destination, payload, headers, attempts, last_error, dead, \
             sent_at IS NOT NULL AS sent, {} AS age_ms",
            (clock.age_ms)("created_at")
        );
        let skip_locked = specific.skip_locked;
        let text = |sql: String| Arc::<str>::from(sql);
        Self {
            claim: text(specific.claim),
            claim_and_forward: specific.claim_and_forward.map(text),
            find: text(format!(
                "SELECT claim_id, fingerprint FROM {keys}
                 WHERE scope = $1 AND consumer = $2 AND key = $3"
            )),
            insert_many: text(specific.insert_many),
            find_many: text(specific.find_many),
            has_unique_constraint: text(specific.has_unique_constraint),
            purge_keys: text(specific.purge_keys),
            enqueue: text(specific.enqueue),
            // Taking a row hides it until the lease ends, in one short statement: no lock
            // is held while it is sent, and a relay that dies leaves it due again. Rows are
            // chosen by due time, never by a cursor over ids, so a row committed after a
            // higher-numbered one is not skipped. Destinations the relay holds back ($4, a
            // JSON array) are left out, so that their rows do not crowd out the others'.
            take_due: text(format!(
                "UPDATE {outbox}
                 SET next_attempt_at = {}, attempts = attempts + 1, lease_token = $3
                 WHERE id IN (
                    SELECT id FROM {outbox}
                    WHERE sent_at IS NULL AND NOT dead AND next_attempt_at <= {now}
                      AND destination NOT IN ({})
                    ORDER BY next_attempt_at, id
                    LIMIT $2
                    {skip_locked}
                 )
                 RETURNING {columns}",
                (clock.later_by)("$1"),
                (specific.texts_of)("$4")
            )),
            outbox_row: text(format!("SELECT {columns} FROM {outbox} WHERE id = $1")),
            dead_letters: text(format!(
                "SELECT {columns} FROM {outbox} WHERE dead ORDER BY id LIMIT $1"
            )),
            // A receiver took the row: that is true whoever holds the lease now, and it
            // outranks another relay's dead-lettering.
            mark_sent: text(format!(
                "UPDATE {outbox} SET sent_at = {now}, dead = FALSE, last_error = NULL
                 WHERE id = $1"
            )),
            // Failures are recorded only by the relay that holds the lease: one whose lease
            // ran out must not cut short the new holder's attempt.
            mark_retry: text(format!(
                "UPDATE {outbox} SET next_attempt_at = {}, last_error = $3
                 WHERE id = $1 AND lease_token = $4 AND sent_at IS NULL AND NOT dead",
                (clock.later_by)("$2")
            )),
            mark_dead: text(format!(
                "UPDATE {outbox} SET dead = TRUE, last_error = $2
                 WHERE id = $1 AND lease_token = $3 AND sent_at IS NULL AND NOT dead"
            )),
            untake: text(format!(
                "UPDATE {outbox} SET next_attempt_at = {}, attempts = attempts - 1
                 WHERE id = $1 AND lease_token = $3 AND sent_at IS NULL AND NOT dead",
                (clock.later_by)("$2")
            )),
            breaker_open: text(format!(
                "INSERT INTO {breakers} (destination, failures, open_until, updated_at)
                 VALUES ($1, $2, {}, {now})
                 ON CONFLICT (destination) DO UPDATE SET failures = excluded.failures,
                    open_until = excluded.open_until, updated_at = excluded.updated_at",
                (clock.later_by)("$3")
            )),
            breaker_close: text(format!("DELETE FROM {breakers} WHERE destination = $1")),
            breakers: text(format!(
                "SELECT destination, failures, -{}, {} FROM {breakers} ORDER BY destination",
                (clock.age_ms)("open_until"),
                (clock.age_ms)("updated_at")
            )),
            // Leased rows too: should one be sent meanwhile, `mark_sent` outranks this.
            expire: text(format!(
                "UPDATE {outbox} SET dead = TRUE, last_error = $3
                 WHERE id IN (
                    SELECT id FROM {outbox}
                    WHERE sent_at IS NULL AND NOT dead AND destination = $1
                      AND created_at <= {}
                    ORDER BY id LIMIT $4
                 )",
                (clock.earlier_by)("$2")
            )),
            // A replay starts a new delivery window.
            replay: text(format!(
                "UPDATE {outbox}
                 SET dead = FALSE, attempts = 0, next_attempt_at = {now}, created_at = {now},
                     last_error = NULL
                 WHERE id IN (
                    SELECT id FROM {outbox}
                    WHERE dead AND sent_at IS NULL AND ($1 IS NULL OR id = $1)
                    ORDER BY id LIMIT $2
                 )"
            )),
            purge_dead: text(format!("DELETE FROM {outbox} WHERE dead")),
            purge_sent: text(format!(
                "DELETE FROM {outbox} WHERE id IN (
                    SELECT id FROM {outbox} WHERE sent_at < {} LIMIT $2
                 )",
                (clock.earlier_by)("$1")
            )),
            // The WHERE makes an older offset a no-op in SQL, whatever order commits come in.
            commit_offset: text(format!(
                "INSERT INTO {offsets} (consumer, stream, partition_id, position, sequence, updated_at)
                 VALUES ($1, $2, $3, $4, $5, {now})
                 ON CONFLICT (consumer, stream, partition_id) DO UPDATE
                 SET position = excluded.position, sequence = excluded.sequence,
                     updated_at = excluded.updated_at
                 WHERE ({offsets}.position, {offsets}.sequence)
                     < (excluded.position, excluded.sequence)"
            )),
            load_offsets: text(format!(
                "SELECT partition_id, position, sequence FROM {offsets}
                 WHERE consumer = $1 AND stream = $2 ORDER BY partition_id"
            )),
            all_offsets: text(format!(
                "SELECT consumer, stream, partition_id, position, sequence FROM {offsets}
                 ORDER BY consumer, stream, partition_id"
            )),
            // Takes a free key, or an expired lease on it with the same payload, with a
            // larger token than the last holder's. A key in any other state returns no
            // row, and `lease_state` says which.
            lease_claim: text(format!(
                "INSERT INTO {keys}
                    (scope, consumer, key, fingerprint, claim_id, processed_at, token, lease_until)
                 VALUES ($1, $2, $3, $4, 0, {now}, 1, {later})
                 ON CONFLICT (scope, consumer, key) DO UPDATE
                 SET token = {keys}.token + 1, lease_until = excluded.lease_until,
                     processed_at = excluded.processed_at
                 WHERE {keys}.lease_until IS NOT NULL AND {keys}.lease_until <= {now}
                   AND {keys}.fingerprint = excluded.fingerprint
                 RETURNING token",
                later = (clock.later_by)("$5")
            )),
            lease_state: text(format!(
                "SELECT fingerprint, lease_until IS NULL AS done, result,
                        CASE WHEN lease_until IS NULL THEN 0 ELSE -{} END AS remaining_ms
                 FROM {keys} WHERE scope = $1 AND consumer = $2 AND key = $3",
                (clock.age_ms)("lease_until")
            )),
            // Each change to a lease names its token: a holder whose lease was taken over
            // changes nothing.
            lease_complete: text(format!(
                "UPDATE {keys} SET lease_until = NULL, result = $5, processed_at = {now}
                 WHERE scope = $1 AND consumer = $2 AND key = $3 AND token = $4
                   AND lease_until IS NOT NULL"
            )),
            // A released key keeps its row, expired, so that the next holder's token is
            // still larger than this one's.
            lease_release: text(format!(
                "UPDATE {keys} SET lease_until = {now}
                 WHERE scope = $1 AND consumer = $2 AND key = $3 AND token = $4
                   AND lease_until IS NOT NULL"
            )),
            lease_renew: text(format!(
                "UPDATE {keys} SET lease_until = {}
                 WHERE scope = $1 AND consumer = $2 AND key = $3 AND token = $4
                   AND lease_until IS NOT NULL",
                (clock.later_by)("$5")
            )),
            // An operator's release is the lease running out now: the holder keeps its
            // token until the next claim takes the key over with a larger one.
            force_release: text(format!(
                "UPDATE {keys} SET lease_until = {now}
                 WHERE scope = $1 AND consumer = $2 AND key = $3 AND lease_until IS NOT NULL"
            )),
            // An operator's completion takes the key from its holder: the new token refuses
            // the holder's late complete, renew or release.
            force_complete: text(format!(
                "UPDATE {keys}
                 SET lease_until = NULL, result = $4, token = token + 1, processed_at = {now}
                 WHERE scope = $1 AND consumer = $2 AND key = $3 AND lease_until IS NOT NULL"
            )),
            store_result: text(format!(
                "UPDATE {keys} SET result = $4
                 WHERE scope = $1 AND consumer = $2 AND key = $3"
            )),
            // The minimum, not the greatest age: the purge index finds it at once.
            oldest_key_age: text(format!(
                "SELECT coalesce({}, 0) FROM {keys} WHERE consumer = $1",
                (clock.age_ms)("min(processed_at)")
            )),
            key_counts: text(format!(
                "SELECT consumer, scope, count(*), count(lease_until) FROM {keys}
                 GROUP BY consumer, scope ORDER BY consumer, scope"
            )),
            outbox_stats: text(format!(
                "SELECT
                    count(CASE WHEN sent_at IS NOT NULL THEN 1 END),
                    count(CASE WHEN sent_at IS NULL AND NOT dead THEN 1 END),
                    count(CASE WHEN dead THEN 1 END),
                    coalesce(max(CASE WHEN sent_at IS NULL AND NOT dead THEN {} END), 0)
                 FROM {outbox}",
                (clock.age_ms)("created_at")
            )),
        }
    }
}

/// One key to claim, with the attempt's claim id.
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
/// partition, position and sequence, with the names as `Name` (bytes on MySQL).
pub(crate) type OffsetTuple<Name> = (Name, Name, i32, i64, i64);

/// One outbox row to write.
pub struct NewOutboxRow<'a> {
    pub(crate) scope: &'a str,
    pub(crate) key: &'a str,
    pub(crate) destination: &'a str,
    pub(crate) payload: &'a [u8],
    pub(crate) headers: String,
}

/// The columns of [`OUTBOX_COLUMNS`] as sqlx decodes them.
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

/// Which outbox rows to read.
pub enum Which {
    /// Due rows, at most `limit`, hidden for `lease_ms` under `token` and counted as one
    /// more attempt; none for the destinations in `held_back`, a JSON array of names.
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

/// A statement that changes rows; its text is in [`Statements`].
pub enum Change<'a> {
    PurgeKeys {
        consumer: &'a str,
        older_than_ms: i64,
        limit: i64,
    },
    MarkSent {
        id: i64,
    },
    MarkRetry {
        id: i64,
        after_ms: i64,
        reason: &'a str,
        token: i64,
    },
    MarkDead {
        id: i64,
        reason: &'a str,
        token: i64,
    },
    /// A row taken and not tried: due again after `after_ms`, its attempt given back.
    Untake {
        id: i64,
        after_ms: i64,
        token: i64,
    },
    /// Dead-letters at most `limit` unsent rows of `destination` written more than
    /// `older_than_ms` ago, with `reason`.
    Expire {
        destination: &'a str,
        older_than_ms: i64,
        reason: &'a str,
        limit: i64,
    },
    /// A relay backed `destination` off for `pause_ms` after `failures` in a row.
    BreakerOpen {
        destination: &'a str,
        failures: i64,
        pause_ms: i64,
    },
    /// A relay's breaker for `destination` closed: it answers again.
    BreakerClose {
        destination: &'a str,
    },
    /// Every dead letter when `id` is `None`, at most `limit`.
    Replay {
        id: Option<i64>,
        limit: i64,
    },
    PurgeDead,
    PurgeSent {
        older_than_ms: i64,
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

/// A stream position to store.
pub struct OffsetRow<'a> {
    pub(crate) consumer: &'a str,
    pub(crate) stream: &'a str,
    pub(crate) partition: i32,
    pub(crate) offset: Offset,
}

/// Wakes a waiting relay when an outbox row may have been committed.
pub struct Wakeups {
    #[cfg(feature = "postgres")]
    pub(crate) listener: Option<sqlx::postgres::PgListener>,
}

impl Wakeups {
    /// No notifications: the caller polls.
    pub(crate) fn none() -> Self {
        Self {
            #[cfg(feature = "postgres")]
            listener: None,
        }
    }

    /// Resolves on a notification; never, where there are none (the caller polls too).
    pub(crate) async fn wait(&mut self) {
        #[cfg(feature = "postgres")]
        if let Some(listener) = &mut self.listener {
            // An error drops the connection, which the next call re-establishes; the
            // caller's poll covers what was missed meanwhile.
            if listener.recv().await.is_ok() {
                return;
            }
        }
        std::future::pending::<()>().await
    }
}

/// One schema change, with `{prefix}` in place of the table prefix.
pub struct Migration {
    pub(crate) version: i64,
    pub(crate) description: &'static str,
    pub(crate) sql: &'static str,
}

/// The migrations after version `current`, or an error if the tables are newer than any
/// this version knows.
pub(crate) fn pending_migrations<'m>(
    migrations: &'m [Migration],
    current: i64,
    tables: &Tables,
) -> Result<Vec<&'m Migration>, Error> {
    let newest = migrations.last().map_or(0, |m| m.version);
    if current > newest {
        return Err(Error::Schema(format!(
            "table {} is at version {current}, newer than the {newest} this version of \
             justonce knows: upgrade justonce",
            tables.migrations
        )));
    }
    Ok(migrations.iter().filter(|m| m.version > current).collect())
}

/// Wraps a driver error, noting whether a new transaction may succeed.
pub(crate) fn database_error<DB: Backend>(error: sqlx::Error) -> Error {
    Error::Database {
        retryable: DB::is_retryable(&error),
        source: Box::new(error),
    }
}

/// A key that conflicted on insert but was gone when read back: purged in between. The
/// claim can simply be tried again.
pub(crate) fn vanished(identity: &Identity) -> Error {
    Error::Database {
        retryable: true,
        source: format!(
            "key {} conflicted but was gone when read back",
            identity.key
        )
        .into(),
    }
}

/// Binds the identity that every change to a key names, as `$1` to `$3`.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) fn bind_identity<'q, DB>(
    query: sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments>,
    identity: &'q Identity,
) -> sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments>
where
    DB: sqlx::Database,
    &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    query
        .bind(identity.scope.as_str())
        .bind(identity.consumer.as_str())
        .bind(identity.key.as_str())
}

/// Binds the identity and token that every change to a lease names, as `$1` to `$4`.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) fn bind_lease<'q, DB>(
    query: sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments>,
    lease: &'q Lease,
) -> sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments>
where
    DB: sqlx::Database,
    &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    bind_identity(query, &lease.identity).bind(lease.token)
}

/// The queries whose binds are the same on every database, written once and expanded
/// inside each backend's `impl`: each statements type has a field of the same name for
/// each, with its parameters in the same order.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
macro_rules! common_queries {
    () => {
        async fn oldest_key_age_ms<'a>(
            pool: &'a sqlx::Pool<Self>,
            sql: &'a Self::Statements,
            consumer: &'a str,
        ) -> Result<i64, Error> {
            sqlx::query_scalar(AssertSqlSafe(sql.oldest_key_age.clone()))
                .bind(consumer)
                .fetch_one(pool)
                .await
                .map_err(database_error::<Self>)
        }
        async fn find<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a Self::Statements,
            identity: &'a Identity,
        ) -> Result<Option<Stored>, Error> {
            let row: Option<(i64, Vec<u8>)> = sqlx::query_as(AssertSqlSafe(sql.find.clone()))
                .bind(identity.scope.as_str())
                .bind(identity.consumer.as_str())
                .bind(identity.key.as_str())
                .fetch_optional(conn)
                .await
                .map_err(database_error::<Self>)?;
            row.map(|(claim_id, fingerprint)| Stored::decode(claim_id, fingerprint))
                .transpose()
        }
        async fn lease_state<'a>(
            pool: &'a sqlx::Pool<Self>,
            sql: &'a Self::Statements,
            identity: &'a Identity,
        ) -> Result<Option<LeaseState>, Error> {
            let row: Option<LeaseRow> = sqlx::query_as(AssertSqlSafe(sql.lease_state.clone()))
                .bind(identity.scope.as_str())
                .bind(identity.consumer.as_str())
                .bind(identity.key.as_str())
                .fetch_optional(pool)
                .await
                .map_err(database_error::<Self>)?;
            row.map(LeaseState::decode).transpose()
        }
        async fn outbox_stats<'a>(
            pool: &'a sqlx::Pool<Self>,
            sql: &'a Self::Statements,
        ) -> Result<(i64, i64, i64, i64), Error> {
            sqlx::query_as(AssertSqlSafe(sql.outbox_stats.clone()))
                .fetch_one(pool)
                .await
                .map_err(database_error::<Self>)
        }
        async fn key_counts<'a>(
            pool: &'a sqlx::Pool<Self>,
            sql: &'a Self::Statements,
        ) -> Result<Vec<KeyCount>, Error> {
            let rows: Vec<(String, String, i64, i64)> =
                sqlx::query_as(AssertSqlSafe(sql.key_counts.clone()))
                    .fetch_all(pool)
                    .await
                    .map_err(database_error::<Self>)?;
            Ok(rows
                .into_iter()
                .map(|(consumer, scope, keys, in_progress)| KeyCount {
                    consumer,
                    scope,
                    keys,
                    in_progress,
                })
                .collect())
        }
        async fn all_offsets<'a>(
            pool: &'a sqlx::Pool<Self>,
            sql: &'a Self::Statements,
        ) -> Result<Vec<StoredOffset>, Error> {
            let rows: Vec<OffsetTuple<String>> =
                sqlx::query_as(AssertSqlSafe(sql.all_offsets.clone()))
                    .fetch_all(pool)
                    .await
                    .map_err(database_error::<Self>)?;
            Ok(rows
                .into_iter()
                .map(
                    |(consumer, stream, partition, position, sequence)| StoredOffset {
                        consumer,
                        stream,
                        partition,
                        offset: Offset::new(position, sequence),
                    },
                )
                .collect())
        }
        async fn breakers<'a>(
            pool: &'a sqlx::Pool<Self>,
            sql: &'a Self::Statements,
        ) -> Result<Vec<(String, i64, i64, i64)>, Error> {
            sqlx::query_as(AssertSqlSafe(sql.breakers.clone()))
                .fetch_all(pool)
                .await
                .map_err(database_error::<Self>)
        }
        async fn load_offsets<'a>(
            pool: &'a sqlx::Pool<Self>,
            sql: &'a Self::Statements,
            consumer: &'a str,
            stream: &'a str,
        ) -> Result<Vec<(i32, Offset)>, Error> {
            let rows: Vec<(i32, i64, i64)> =
                sqlx::query_as(AssertSqlSafe(sql.load_offsets.clone()))
                    .bind(consumer)
                    .bind(stream)
                    .fetch_all(pool)
                    .await
                    .map_err(database_error::<Self>)?;
            Ok(rows
                .into_iter()
                .map(|(partition, position, sequence)| (partition, Offset::new(position, sequence)))
                .collect())
        }
        async fn has_unique_constraint<'a>(
            pool: &'a sqlx::Pool<Self>,
            sql: &'a Self::Statements,
        ) -> Result<bool, Error> {
            let (found,): (i64,) = sqlx::query_as(AssertSqlSafe(sql.has_unique_constraint.clone()))
                .fetch_one(pool)
                .await
                .map_err(database_error::<Self>)?;
            Ok(found > 0)
        }
    };
}
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) use common_queries;

/// The queries whose text and binds are the same on PostgreSQL and SQLite, which number
/// their parameters, written once and expanded inside each backend's `impl`.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
macro_rules! shared_queries {
    () => {
        async fn claim<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a Statements,
            row: ClaimRow<'a>,
        ) -> Result<Stored, Error> {
            let id = row.identity;
            let holder: Option<(i64, Vec<u8>)> = sqlx::query_as(AssertSqlSafe(sql.claim.clone()))
                .bind(id.scope.as_str())
                .bind(id.consumer.as_str())
                .bind(id.key.as_str())
                .bind(row.fingerprint.as_bytes().as_slice())
                .bind(row.claim_id)
                .fetch_optional(&mut *conn)
                .await
                .map_err(database_error::<Self>)?;
            match holder {
                Some((claim_id, fingerprint)) => Stored::decode(claim_id, fingerprint),
                // No row: a holder committed after the statement's snapshot was taken
                // (PostgreSQL), or the insert found the key taken (SQLite, whose write lock
                // keeps the holder in place). Read it now.
                None => Self::find(conn, sql, id).await?.ok_or_else(|| vanished(id)),
            }
        }

        async fn lease_claim<'a>(
            pool: &'a sqlx::Pool<Self>,
            sql: &'a Statements,
            identity: &'a Identity,
            fingerprint: &'a Fingerprint,
            lease_ms: i64,
        ) -> Result<Option<i64>, Error> {
            let token: Option<(i64,)> = sqlx::query_as(AssertSqlSafe(sql.lease_claim.clone()))
                .bind(identity.scope.as_str())
                .bind(identity.consumer.as_str())
                .bind(identity.key.as_str())
                .bind(fingerprint.as_bytes().as_slice())
                .bind(lease_ms)
                .fetch_optional(pool)
                .await
                .map_err(database_error::<Self>)?;
            Ok(token.map(|(token,)| token))
        }

        async fn store_result<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a Statements,
            identity: &'a Identity,
            result: &'a [u8],
        ) -> Result<(), Error> {
            sqlx::query(AssertSqlSafe(sql.store_result.clone()))
                .bind(identity.scope.as_str())
                .bind(identity.consumer.as_str())
                .bind(identity.key.as_str())
                .bind(result)
                .execute(conn)
                .await
                .map(drop)
                .map_err(database_error::<Self>)
        }

        async fn change<'a>(
            pool: &'a sqlx::Pool<Self>,
            sql: &'a Statements,
            change: Change<'a>,
        ) -> Result<u64, Error> {
            let statement = |text: &Arc<str>| sqlx::query(AssertSqlSafe(text.clone()));
            let query = match change {
                Change::PurgeKeys {
                    consumer,
                    older_than_ms,
                    limit,
                } => statement(&sql.purge_keys)
                    .bind(consumer)
                    .bind(older_than_ms)
                    .bind(limit),
                Change::MarkSent { id } => statement(&sql.mark_sent).bind(id),
                Change::MarkRetry {
                    id,
                    after_ms,
                    reason,
                    token,
                } => statement(&sql.mark_retry)
                    .bind(id)
                    .bind(after_ms)
                    .bind(reason)
                    .bind(token),
                Change::MarkDead { id, reason, token } => {
                    statement(&sql.mark_dead).bind(id).bind(reason).bind(token)
                }
                Change::Untake {
                    id,
                    after_ms,
                    token,
                } => statement(&sql.untake).bind(id).bind(after_ms).bind(token),
                Change::Expire {
                    destination,
                    older_than_ms,
                    reason,
                    limit,
                } => statement(&sql.expire)
                    .bind(destination)
                    .bind(older_than_ms)
                    .bind(reason)
                    .bind(limit),
                Change::BreakerOpen {
                    destination,
                    failures,
                    pause_ms,
                } => statement(&sql.breaker_open)
                    .bind(destination)
                    .bind(failures)
                    .bind(pause_ms),
                Change::BreakerClose { destination } => {
                    statement(&sql.breaker_close).bind(destination)
                }
                Change::Replay { id, limit } => statement(&sql.replay).bind(id).bind(limit),
                Change::PurgeDead => statement(&sql.purge_dead),
                Change::PurgeSent {
                    older_than_ms,
                    limit,
                } => statement(&sql.purge_sent).bind(older_than_ms).bind(limit),
                Change::LeaseComplete { lease, result } => {
                    bind_lease(statement(&sql.lease_complete), lease).bind(result)
                }
                Change::LeaseRelease { lease } => bind_lease(statement(&sql.lease_release), lease),
                Change::LeaseRenew { lease, lease_ms } => {
                    bind_lease(statement(&sql.lease_renew), lease).bind(lease_ms)
                }
                Change::ForceRelease { identity } => {
                    bind_identity(statement(&sql.force_release), identity)
                }
                Change::ForceComplete { identity, result } => {
                    bind_identity(statement(&sql.force_complete), identity).bind(result)
                }
            };
            let done = query.execute(pool).await.map_err(database_error::<Self>)?;
            Ok(done.rows_affected())
        }

        async fn enqueue<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a Statements,
            row: NewOutboxRow<'a>,
        ) -> Result<i64, Error> {
            let (id,): (i64,) = sqlx::query_as(AssertSqlSafe(sql.enqueue.clone()))
                .bind(row.scope)
                .bind(row.key)
                .bind(row.destination)
                .bind(row.payload)
                .bind(row.headers)
                .fetch_one(conn)
                .await
                .map_err(database_error::<Self>)?;
            Ok(id)
        }

        async fn outbox_rows<'a>(
            pool: &'a sqlx::Pool<Self>,
            sql: &'a Statements,
            which: Which,
        ) -> Result<Vec<OutboxRow>, Error> {
            let query = match which {
                Which::Due {
                    lease_ms,
                    limit,
                    token,
                    held_back,
                } => sqlx::query_as(AssertSqlSafe(sql.take_due.clone()))
                    .bind(lease_ms)
                    .bind(limit)
                    .bind(token)
                    .bind(held_back),
                Which::Id(id) => sqlx::query_as(AssertSqlSafe(sql.outbox_row.clone())).bind(id),
                Which::DeadLetters { limit } => {
                    sqlx::query_as(AssertSqlSafe(sql.dead_letters.clone())).bind(limit)
                }
            };
            let rows: Vec<OutboxTuple> = query
                .fetch_all(pool)
                .await
                .map_err(database_error::<Self>)?;
            Ok(rows.into_iter().map(OutboxRow::from).collect())
        }

        async fn commit_offset<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a Statements,
            at: OffsetRow<'a>,
        ) -> Result<bool, Error> {
            let done = sqlx::query(AssertSqlSafe(sql.commit_offset.clone()))
                .bind(at.consumer)
                .bind(at.stream)
                .bind(at.partition)
                .bind(at.offset.position)
                .bind(at.offset.sequence)
                .execute(conn)
                .await
                .map_err(database_error::<Self>)?;
            Ok(done.rows_affected() > 0)
        }

        fn migration_script(tables: &Tables, since: i64) -> String {
            let mut script = format!("{};\n", Self::BEGIN);
            for statement in MIGRATION_SETUP {
                script.push_str(&tables.render(statement));
                script.push_str(";\n");
            }
            for migration in MIGRATIONS.iter().filter(|m| m.version > since) {
                script.push_str(&format!(
                    "\n-- {}: {}\n{}\n",
                    migration.version,
                    migration.description,
                    tables.render(migration.sql).trim()
                ));
                script.push_str(&tables.render(&format!(
                    "INSERT INTO {{prefix}}migrations (version, description) VALUES ({}, '{}');\n",
                    migration.version,
                    migration.description.replace('\'', "''")
                )));
            }
            script.push_str("COMMIT;\n");
            script
        }

        async fn migrate<'a>(
            pool: &'a sqlx::Pool<Self>,
            tables: &'a Tables,
        ) -> Result<usize, Error> {
            let mut tx = pool
                .begin_with(Self::BEGIN)
                .await
                .map_err(database_error::<Self>)?;
            for statement in MIGRATION_SETUP {
                sqlx::query(AssertSqlSafe(tables.render(statement)))
                    .execute(&mut *tx)
                    .await
                    .map_err(database_error::<Self>)?;
            }
            let (current,): (i64,) = sqlx::query_as(AssertSqlSafe(
                tables.render("SELECT coalesce(max(version), 0) FROM {prefix}migrations"),
            ))
            .fetch_one(&mut *tx)
            .await
            .map_err(database_error::<Self>)?;
            let pending = pending_migrations(MIGRATIONS, current, tables)?;
            for migration in &pending {
                sqlx::raw_sql(AssertSqlSafe(tables.render(migration.sql)))
                    .execute(&mut *tx)
                    .await
                    .map_err(database_error::<Self>)?;
                sqlx::query(AssertSqlSafe(tables.render(
                    "INSERT INTO {prefix}migrations (version, description) VALUES ($1, $2)",
                )))
                .bind(migration.version)
                .bind(migration.description)
                .execute(&mut *tx)
                .await
                .map_err(database_error::<Self>)?;
            }
            tx.commit().await.map_err(database_error::<Self>)?;
            Ok(pending.len())
        }
    };
}
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) use shared_queries;
