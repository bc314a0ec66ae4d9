//! What differs between databases, behind one sealed trait, and what each database's
//! statements do.

use crate::rows::{
    Batch, BreakerTuple, Change, ClaimRow, DestinationCounts, EventBy, EventDetailTuple,
    EventListing, EventTuple, KeyCount, LeaseState, ListedTuple, Listing, NewOutboxRow, NewReplay,
    OffsetRow, OutboxRow, ReplayTuple, Replays, Schema, Stored, StoredOffset, Wakeups, Which,
};
use crate::tables::Tables;
use justonce_core::{Consumer, Error, Fingerprint, Identity, Offset, Scope};
use std::future::Future;
use std::sync::Arc;

/// A database justonce can store keys in: [`sqlx::Postgres`] with the `postgres` feature,
/// [`sqlx::MySql`] (MariaDB or MySQL) with the `mysql` feature, [`sqlx::Sqlite`] with the
/// `sqlite` feature.
///
/// The trait is sealed: its methods are justonce's own, and users only name the type, as in
/// `Inbox<Postgres>`.
pub trait Backend: sqlx::Database<Arguments: Clone + Sync> + Sealed {
    /// The statement that opens a writing transaction.
    #[doc(hidden)]
    const BEGIN: &'static str;

    /// Whether the database takes one writer at a time, so that this process's writers
    /// are better queued here than left to the database's busy handler, which sleeps.
    #[doc(hidden)]
    const ONE_WRITER: bool;

    /// The tables' migrations, and how they are recorded.
    #[doc(hidden)]
    const SCHEMA: Schema;

    /// The statements of one table prefix, built once when an inbox is made.
    #[doc(hidden)]
    type Statements: Queries<Self> + Reads<Self> + std::fmt::Debug + Send + Sync + 'static;

    #[doc(hidden)]
    fn statements(tables: &Tables) -> Self::Statements;

    /// Opens a pool on `url`, with the task that looks after it, if the URL needs one.
    #[doc(hidden)]
    fn connect(
        url: &str,
        pool: sqlx::pool::PoolOptions<Self>,
    ) -> impl Future<Output = Result<(sqlx::Pool<Self>, Option<Watcher>), Error>> + Send;

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
    ) -> Option<OneStatement<'a, ()>> {
        None
    }

    /// [`Backend::claim_and_forward`] for several calls in one statement over arrays,
    /// committed on its own: one round trip for a whole shared commit. Each call is a claim
    /// (all with one claim id, no key twice) and its outbox row. Returns, for each call in
    /// order, the claim id and fingerprint of the row holding its key afterwards, or none
    /// where a holder committed after the statement's snapshot. `None` where the database
    /// cannot do it in one statement.
    #[doc(hidden)]
    fn claim_and_forward_many<'a>(
        _pool: &'a sqlx::Pool<Self>,
        _sql: &'a Self::Statements,
        _calls: &'a [(ClaimRow<'a>, NewOutboxRow<'a>)],
    ) -> Option<GroupStatement<'a>> {
        None
    }

    /// The one statement that claims a key in `tables` and runs an effect's statement
    /// `effect`, which has `binds` parameters. `None` where the database cannot.
    #[doc(hidden)]
    fn claim_with_effect_sql(_tables: &Tables, _effect: &str, _binds: usize) -> Option<String> {
        None
    }

    /// Claims the key and runs an effect with its `arguments` by `statement`, made by
    /// [`Backend::claim_with_effect_sql`], committed on its own, as
    /// [`Backend::claim_and_forward`] does; also returns how many rows the effect changed.
    /// Not boxed, unlike [`OneStatement`]: the run awaits it where it was made, and a box
    /// would copy the large future into it on every run. Where the database has no such
    /// statement, no row: the run's transactions read the key.
    #[doc(hidden)]
    fn claim_with_effect<'a>(
        _pool: &'a sqlx::Pool<Self>,
        _statement: Arc<str>,
        _row: ClaimRow<'a>,
        _arguments: Self::Arguments,
    ) -> impl Future<Output = OneStatementAnswer<Option<u64>>> + Send + 'a {
        async { Ok(None) }
    }

    /// Runs an effect's statement in the caller's transaction; how many rows it changed.
    #[doc(hidden)]
    fn execute_effect<'a>(
        conn: &'a mut Self::Connection,
        sql: String,
        arguments: Self::Arguments,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// Inserts the keys that are not present in one statement, in key order, and returns
    /// the rows it knows of afterwards: at least the inserted ones, which carry the batch's
    /// claim id. A key it returns no row for is read with `find_many`.
    #[doc(hidden)]
    fn insert_many<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Self::Statements,
        batch: &'a Batch<'a>,
    ) -> impl Future<Output = Result<Vec<(String, Stored)>, Error>> + Send + 'a;

    /// [`Backend::insert_many`], with each of `offsets` moved forward in the same
    /// transaction (in the same statement, where the database can), and whether every one
    /// moved; the keys' rows are not all known when one did not.
    #[doc(hidden)]
    fn insert_many_at<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Self::Statements,
        batch: &'a Batch<'a>,
        offsets: &'a [OffsetRow<'a>],
    ) -> impl Future<Output = Result<(Vec<(String, Stored)>, bool), Error>> + Send + 'a {
        async move {
            let rows = Self::insert_many(&mut *conn, sql, batch).await?;
            for at in offsets {
                if !sql.commit_offset(&mut *conn, *at).await? {
                    return Ok((rows, false));
                }
            }
            Ok((rows, true))
        }
    }

    /// Writes outbox rows that forward received messages, in the caller's transaction and
    /// in as few statements as the database takes, without waking the relays: the caller
    /// wakes them after its commit.
    #[doc(hidden)]
    fn forward_many<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Self::Statements,
        rows: &'a [NewOutboxRow<'a>],
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a;

    /// The stored rows of these keys.
    #[doc(hidden)]
    fn find_many<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Self::Statements,
        scope: &'a Scope,
        consumer: &'a Consumer,
        keys: &'a [&'a str],
    ) -> impl Future<Output = Result<Vec<(String, Stored)>, Error>> + Send + 'a;

    /// Counts a first run of each of `keys` (distinct), in one statement committed on its
    /// own, unless one of them has runs counted already; how many it counted: all of them
    /// or none, but for a count another process wrote meanwhile.
    #[doc(hidden)]
    fn record_first_runs<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Self::Statements,
        scope: &'a Scope,
        consumer: &'a Consumer,
        keys: &'a [&'a str],
    ) -> impl Future<Output = Result<u64, Error>> + Send + 'a;

    /// What wakes a waiting relay when another process commits a row: notifications on
    /// PostgreSQL, nothing elsewhere (the relay polls).
    #[doc(hidden)]
    fn outbox_wakeups<'a>(
        pool: &'a sqlx::Pool<Self>,
        tables: &'a Tables,
    ) -> impl Future<Output = Result<Wakeups, Error>> + Send + 'a;

    /// Whether other processes' relays listen for [`Backend::notify_relays`].
    #[doc(hidden)]
    const NOTIFIES: bool = false;

    /// Wakes the relays of other processes that listen on `channel`, in a statement of its
    /// own; nothing where they only poll.
    #[doc(hidden)]
    fn notify_relays<'a>(
        _pool: &'a sqlx::Pool<Self>,
        _channel: &'a str,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a {
        std::future::ready(Ok(()))
    }

    /// Applies the migrations that are missing, under a lock that serialises concurrent
    /// migrators, and returns how many ran.
    #[doc(hidden)]
    fn migrate<'a>(
        pool: &'a sqlx::Pool<Self>,
        tables: &'a Tables,
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a;

    /// How many rows a statement changed.
    #[doc(hidden)]
    fn rows_affected(done: &Self::QueryResult) -> u64;

    /// Whether a new transaction may not hit this error again.
    #[doc(hidden)]
    fn is_retryable(error: &sqlx::Error) -> bool;

    /// Whether the connection broke or the server went away: a failed COMMIT may then have
    /// happened all the same, and a failed ROLLBACK means the connection is lost.
    #[doc(hidden)]
    fn is_commit_unknown(error: &sqlx::Error) -> bool;

    /// Whether the server refused a write because it is read-only, such as a standby.
    #[doc(hidden)]
    fn refuses_writes(_error: &sqlx::Error) -> bool {
        false
    }

    /// Run first in an attempt that follows a COMMIT whose answer was lost, so that its
    /// claim gives up instead of waiting for hours behind a session that is still open.
    #[doc(hidden)]
    fn bound_lock_waits(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<(), Error>> + Send + '_;
}

/// The statements whose text, binds or steps differ between databases beyond their names:
/// PostgreSQL and SQLite share one implementation, MariaDB/MySQL has its own.
pub trait Queries<DB: sqlx::Database> {
    /// Inserts the key unless present, returning the row that holds it afterwards.
    fn claim<'a>(
        &'a self,
        conn: &'a mut DB::Connection,
        row: ClaimRow<'a>,
    ) -> impl Future<Output = Result<Stored, Error>> + Send + 'a;

    /// Takes a lease on the key if it is free or its lease expired with the same payload,
    /// and returns the new token.
    fn lease_claim<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        identity: &'a Identity,
        fingerprint: &'a Fingerprint,
        lease_ms: i64,
    ) -> impl Future<Output = Result<Option<i64>, Error>> + Send + 'a;

    /// Writes an outbox row; announced as `announce` says.
    fn enqueue<'a>(
        &'a self,
        conn: &'a mut DB::Connection,
        row: NewOutboxRow<'a>,
        announce: crate::rows::Announce,
    ) -> impl Future<Output = Result<i64, Error>> + Send + 'a;

    /// Reads outbox rows; taking due rows also hides them for a lease.
    fn outbox_rows<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        which: Which,
    ) -> impl Future<Output = Result<Vec<OutboxRow>, Error>> + Send + 'a;

    /// Moves a stream's offset forward, never back; returns whether it moved.
    fn commit_offset<'a>(
        &'a self,
        conn: &'a mut DB::Connection,
        at: OffsetRow<'a>,
    ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

    /// Adds a run started to the key's count in one statement committed on its own, and
    /// returns the runs started, this one included.
    fn record_run<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        identity: &'a Identity,
    ) -> impl Future<Output = Result<u64, Error>> + Send + 'a;
}

/// The statements every database binds and decodes alike: one implementation for all.
pub trait Reads<DB: sqlx::Database> {
    /// The row that holds a key, if one does.
    fn find<'a>(
        &'a self,
        conn: &'a mut DB::Connection,
        identity: &'a Identity,
    ) -> impl Future<Output = Result<Option<Stored>, Error>> + Send + 'a;

    /// The state of a key's row, for a lease claim that did not take it.
    fn lease_state<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        identity: &'a Identity,
    ) -> impl Future<Output = Result<Option<LeaseState>, Error>> + Send + 'a;

    /// Stores a result with a key claimed in this transaction.
    fn store_result<'a>(
        &'a self,
        conn: &'a mut DB::Connection,
        identity: &'a Identity,
        result: &'a [u8],
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a;

    /// Runs one statement that changes rows, and returns how many it changed.
    fn change<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        change: Change<'a>,
    ) -> impl Future<Output = Result<u64, Error>> + Send + 'a;

    /// A consumer's offsets in one stream, by partition.
    fn load_offsets<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        consumer: &'a str,
        stream: &'a str,
    ) -> impl Future<Output = Result<Vec<(i32, Offset)>, Error>> + Send + 'a;

    /// How many outbox rows are sent, due and dead, and the age of the oldest due one.
    fn outbox_stats<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
    ) -> impl Future<Output = Result<(i64, i64, i64, i64), Error>> + Send + 'a;

    /// The counts of `outbox_stats` for each destination with rows, ordered by
    /// destination.
    fn destination_stats<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
    ) -> impl Future<Output = Result<Vec<DestinationCounts>, Error>> + Send + 'a;

    /// How many keys each consumer has in each scope, and how many of them are leases not
    /// completed, ordered by consumer and scope.
    fn key_counts<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
    ) -> impl Future<Output = Result<Vec<KeyCount>, Error>> + Send + 'a;

    /// Milliseconds since the oldest key of `consumer` was processed; 0 without keys.
    fn oldest_key_age_ms<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        consumer: &'a str,
    ) -> impl Future<Output = Result<i64, Error>> + Send + 'a;

    /// The destinations backed off, by name and scope: failures in a row, milliseconds the
    /// pause has left (negative once a probe may go), milliseconds since it was written.
    fn breakers<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
    ) -> impl Future<Output = Result<Vec<BreakerTuple>, Error>> + Send + 'a;

    /// Every stored offset, ordered by consumer, stream and partition.
    fn all_offsets<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
    ) -> impl Future<Output = Result<Vec<StoredOffset>, Error>> + Send + 'a;

    /// The rows due or dead that `listing` selects, oldest first, without their bodies.
    fn list<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        listing: Listing<'a>,
    ) -> impl Future<Output = Result<Vec<ListedTuple>, Error>> + Send + 'a;

    /// One row's delivery history as stored, a JSON array; `None` for a row without one.
    fn history<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        id: i64,
    ) -> impl Future<Output = Result<Option<String>, Error>> + Send + 'a;

    /// The ids of the rows written with `key`, in order.
    fn ids_by_key<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        key: &'a str,
    ) -> impl Future<Output = Result<Vec<i64>, Error>> + Send + 'a;

    /// The stored events `listing` selects, by time received then id.
    fn events<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        listing: EventListing<'a>,
    ) -> impl Future<Output = Result<Vec<EventTuple>, Error>> + Send + 'a;

    /// Events read whole, with their body, headers and delivery history.
    fn event_details<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        by: EventBy<'a>,
    ) -> impl Future<Output = Result<Vec<EventDetailTuple>, Error>> + Send + 'a;

    /// How many delivered or dead events `replay` would put back.
    fn replayable<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        replay: NewReplay<'a>,
    ) -> impl Future<Output = Result<i64, Error>> + Send + 'a;

    /// Records `replay` and puts its window's delivered and dead events back to due, in one
    /// transaction; how many, or the id of a running replay of an overlapping window, in
    /// which case nothing changed.
    fn replay_window<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        replay: NewReplay<'a>,
    ) -> impl Future<Output = Result<Result<u64, i64>, Error>> + Send + 'a;

    /// Replays as recorded.
    fn replays<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        which: Replays,
    ) -> impl Future<Output = Result<Vec<ReplayTuple>, Error>> + Send + 'a;

    /// Events received and deliveries sent since a time (microseconds since the Unix
    /// epoch), by destination and minute: destination, `accepted` or `sent`, the minute's
    /// first microsecond, count.
    fn dashboard_minutes<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        since_us: i64,
    ) -> impl Future<Output = Result<Vec<(String, String, i64, i64)>, Error>> + Send + 'a;

    /// The destination and delivery history of each row that may hold a failed attempt
    /// made since a time (microseconds since the Unix epoch).
    fn failed_histories<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        since_us: i64,
    ) -> impl Future<Output = Result<Vec<(String, Option<String>)>, Error>> + Send + 'a;

    /// Duplicates by origin and minute since the Unix epoch, from the minute `since` on.
    fn duplicate_minutes<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        since: i64,
    ) -> impl Future<Output = Result<Vec<(String, i64, i64)>, Error>> + Send + 'a;

    /// Adds `duplicates` to the count of `origin` in `minute` (since the Unix epoch).
    fn add_duplicates<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        minute: i64,
        origin: &'a str,
        duplicates: i64,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a;

    /// Whether the keys table exists with its unique constraint on (scope, consumer, key).
    fn has_unique_constraint<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
    ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;
}

/// The statement of [`Backend::claim_and_forward`] or [`Backend::claim_with_effect`],
/// running: the claim id and fingerprint of the row holding the key afterwards, and what
/// the statement's write came to.
#[doc(hidden)]
pub type OneStatement<'a, T> =
    std::pin::Pin<Box<dyn Future<Output = OneStatementAnswer<T>> + Send + 'a>>;

/// What a statement that claims a key and writes came to, as [`OneStatement`] describes.
#[doc(hidden)]
pub type OneStatementAnswer<T> = Result<Option<(i64, Vec<u8>, T)>, ForwardFailed>;

/// The statement of [`Backend::claim_and_forward_many`], running: for each call, the claim
/// id and fingerprint of the row holding its key afterwards, if seen.
#[doc(hidden)]
pub type GroupStatement<'a> = std::pin::Pin<
    Box<dyn Future<Output = Result<Vec<Option<(i64, Vec<u8>)>>, ForwardFailed>> + Send + 'a>,
>;

/// Why a [`OneStatement`] or [`GroupStatement`] gave no answer.
#[doc(hidden)]
pub enum ForwardFailed {
    /// No connection was had: nothing was sent.
    Connect(sqlx::Error),
    /// The statement was sent, and failed or lost its answer.
    Statement(sqlx::Error),
    /// The statement was sent and refused as the caller's fault, with this reason: nothing
    /// was committed.
    Invalid(String),
}

/// A pool's watcher task, held by what owns the pool: dropping it ends the task, which
/// would otherwise keep the pool and a connection open for as long as the process runs.
#[doc(hidden)]
pub struct Watcher(pub(crate) tokio::task::AbortHandle);

impl Drop for Watcher {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub(crate) use private::Sealed;
mod private {
    pub trait Sealed {}
}
