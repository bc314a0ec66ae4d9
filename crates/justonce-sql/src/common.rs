//! What the three databases share: the statements they bind and decode alike (each
//! database writes their text; their parameters come in the order of MariaDB's `?`), and
//! how migrations are applied and written out.

use crate::backend::{Backend, Reads};
use crate::rows::{
    BreakerTuple, Change, DestinationCounts, EventBy, EventDetailTuple, EventListing, EventTuple,
    KeyCount, KeyCountTuple, LeaseRow, LeaseState, ListedTuple, Listing, NewReplay, OffsetTuple,
    ReplayTuple, Replays, Schema, Stored, StoredOffset, Tried, Waiting, Window,
};
use crate::shared::driver_error;
use crate::tables::Tables;
use justonce_core::{Error, Identity, Lease, Offset};
use sqlx::{AssertSqlSafe, Database, Decode, Encode, Executor, IntoArguments, Type};
use std::sync::Arc;

/// A stored event's state, from its outbox row.
pub(crate) const EVENT_STATE: &str =
    "CASE WHEN sent_at IS NOT NULL THEN 'delivered' WHEN dead THEN 'dead' ELSE 'due' END";

/// What a replay sets on an event's outbox row: due, its attempts counted anew. The
/// history stays, and a replay starts a new delivery window (`created_at`). The replay
/// takes the row from any relay still holding it: no relay holds a NULL lease token, so
/// a late relay's sent or failed changes nothing.
pub(crate) const REPLAYED: &str =
    "sent_at = NULL, dead = FALSE, attempts = 0, last_error = NULL, lease_token = NULL";

/// A statement of the database `DB`, ready for its parameters.
pub(crate) type Query<'q, DB> = sqlx::query::Query<'q, DB, <DB as Database>::Arguments>;

/// `text` as a statement.
pub(crate) fn statement<'q, DB: Database>(text: &Arc<str>) -> Query<'q, DB> {
    sqlx::query(AssertSqlSafe(text.clone()))
}

/// The texts of the statements every database binds and decodes alike, for one table
/// prefix. Parameters come in the order [`Reads`] binds them, which is the order in which
/// MariaDB's `?` appear; PostgreSQL and SQLite number theirs to match.
#[derive(Debug)]
pub struct Common {
    /// scope, consumer, key.
    pub(crate) find: Arc<str>,
    /// scope, consumer, key.
    pub(crate) lease_state: Arc<str>,
    /// result, scope, consumer, key.
    pub(crate) store_result: Arc<str>,
    /// consumer.
    pub(crate) oldest_key_age: Arc<str>,
    pub(crate) key_counts: Arc<str>,
    pub(crate) outbox_stats: Arc<str>,
    pub(crate) destination_stats: Arc<str>,
    pub(crate) breakers: Arc<str>,
    /// consumer, stream.
    pub(crate) load_offsets: Arc<str>,
    pub(crate) all_offsets: Arc<str>,
    pub(crate) has_unique_constraint: Arc<str>,
    /// Rows due, oldest first, then dead letters, oldest first: destination twice, since
    /// twice, until twice (a window), the id to list after twice, limit.
    pub(crate) list_due: Arc<str>,
    pub(crate) list_dead: Arc<str>,
    /// One row's history as JSON text: id.
    pub(crate) history: Arc<str>,
    /// The ids of the rows with one key: key.
    pub(crate) ids_by_key: Arc<str>,
    /// Stored events, by time then id: origin twice; key prefix twice, the least text above
    /// it twice, the prefix again; key part twice; since twice, until twice, state twice,
    /// the previous page's last time three times and its id, limit.
    pub(crate) events: Arc<str>,
    /// [`Common::events`] with a key prefix and a text above it, both given: the key's
    /// range stands alone in the statement, where a planner that does not look at the
    /// parameters (SQLite's) sees that the key's index serves it.
    pub(crate) events_in_key_range: Arc<str>,
    /// One event whole: id.
    pub(crate) event_by_id: Arc<str>,
    /// Every event written with a key, whole: key.
    pub(crate) events_by_key: Arc<str>,
    /// How many events a replay of a window would put back: origin, since, until.
    pub(crate) replayable: Arc<str>,
    /// Run first in a replay's transaction, where replays need more than the transaction
    /// to keep them apart.
    pub(crate) replay_lock: Option<Arc<str>>,
    /// A running replay of an overlapping window: origin, until, since.
    pub(crate) running_replay: Arc<str>,
    /// id, origin, since, until.
    pub(crate) insert_replay: Arc<str>,
    /// Puts a window's delivered and dead events back to due: id, origin, since, id.
    pub(crate) replay_window: Arc<str>,
    /// events, id.
    pub(crate) count_replay: Arc<str>,
    /// One replay: id.
    pub(crate) replay_by_id: Arc<str>,
    /// The latest replays, newest first: limit.
    pub(crate) replays: Arc<str>,
    /// Events received and deliveries sent, by destination and minute (its first
    /// microsecond since the Unix epoch), `'accepted'` or `'sent'`: since, since, both in
    /// microseconds since the Unix epoch.
    pub(crate) dashboard_minutes: Arc<str>,
    /// The destination and history of each row that may hold a failed attempt made since:
    /// since, in microseconds since the Unix epoch.
    pub(crate) failed_histories: Arc<str>,
    /// Duplicates by origin and minute (since the Unix epoch): the first minute.
    pub(crate) duplicate_minutes: Arc<str>,
    /// Adds duplicates to a minute's count: minute, origin, duplicates.
    pub(crate) add_duplicates: Arc<str>,
    /// The statement of each [`Change`], bound as [`Common::change`] says.
    pub(crate) purge_keys: Arc<str>,
    pub(crate) purge_runs: Arc<str>,
    pub(crate) forget_runs: Arc<str>,
    pub(crate) mark_sent: Arc<str>,
    pub(crate) mark_retry: Arc<str>,
    pub(crate) mark_dead: Arc<str>,
    pub(crate) untake: Arc<str>,
    pub(crate) expire: Arc<str>,
    pub(crate) breaker_open: Arc<str>,
    pub(crate) breaker_close: Arc<str>,
    pub(crate) replay: Arc<str>,
    pub(crate) replay_event: Arc<str>,
    pub(crate) replay_key: Arc<str>,
    pub(crate) purge_dead: Arc<str>,
    pub(crate) purge_events: Arc<str>,
    pub(crate) purge_sent: Arc<str>,
    pub(crate) purge_duplicates: Arc<str>,
    pub(crate) lease_complete: Arc<str>,
    pub(crate) lease_release: Arc<str>,
    pub(crate) lease_renew: Arc<str>,
    pub(crate) force_release: Arc<str>,
    pub(crate) force_complete: Arc<str>,
}

impl Common {
    /// The statement of `change` with its parameters bound: the one place their order is
    /// written.
    fn change<'q, DB>(&self, change: Change<'q>) -> Query<'q, DB>
    where
        DB: Database,
        &'q str: Encode<'q, DB> + Type<DB>,
        Option<&'q str>: Encode<'q, DB> + Type<DB>,
        &'q [u8]: Encode<'q, DB> + Type<DB>,
        Option<&'q [u8]>: Encode<'q, DB> + Type<DB>,
        i64: Encode<'q, DB> + Type<DB>,
        Option<i64>: Encode<'q, DB> + Type<DB>,
    {
        match change {
            Change::PurgeKeys {
                consumer,
                older_than_ms,
                limit,
            } => statement(&self.purge_keys)
                .bind(consumer)
                .bind(older_than_ms)
                .bind(limit),
            Change::PurgeRuns {
                consumer,
                older_than_ms,
                limit,
            } => statement(&self.purge_runs)
                .bind(consumer)
                .bind(older_than_ms)
                .bind(limit),
            Change::ForgetRuns {
                scope,
                consumer,
                key,
            } => statement(&self.forget_runs)
                .bind(scope)
                .bind(consumer)
                .bind(key),
            // The attempt appended to the history comes first in each: its duration,
            // status, answer and, for a failure, reason.
            Change::MarkSent { id, token, tried } => bind_tried(statement(&self.mark_sent), tried)
                .bind(id)
                .bind(token),
            Change::MarkRetry {
                id,
                after_ms,
                reason,
                token,
                tried,
            } => bind_tried(statement(&self.mark_retry), tried)
                .bind(reason)
                .bind(after_ms)
                .bind(reason)
                .bind(id)
                .bind(token),
            Change::MarkDead {
                id,
                reason,
                token,
                tried,
            } => bind_tried(statement(&self.mark_dead), tried)
                .bind(reason)
                .bind(reason)
                .bind(id)
                .bind(token),
            Change::Untake {
                id,
                after_ms,
                token,
            } => statement(&self.untake).bind(after_ms).bind(id).bind(token),
            Change::Expire {
                destination,
                scope,
                older_than_ms,
                reason,
                limit,
            } => statement(&self.expire)
                .bind(reason)
                .bind(destination)
                .bind(scope)
                .bind(older_than_ms)
                .bind(limit),
            Change::BreakerOpen {
                destination,
                scope,
                failures,
                pause_ms,
            } => statement(&self.breaker_open)
                .bind(destination)
                .bind(scope)
                .bind(failures)
                .bind(pause_ms),
            Change::BreakerClose { destination, scope } => {
                statement(&self.breaker_close).bind(destination).bind(scope)
            }
            // Every dead letter when `id` is none: it is bound twice for MariaDB's `?`.
            Change::Replay { id, window, limit } => {
                bind_window(statement(&self.replay).bind(id).bind(id), window).bind(limit)
            }
            Change::ReplayEvent { id } => statement(&self.replay_event).bind(id),
            Change::ReplayKey { key } => statement(&self.replay_key).bind(key),
            Change::PurgeDead { window } => bind_window(statement(&self.purge_dead), window),
            Change::PurgeEvents {
                origin,
                older_than_ms,
                limit,
            } => statement(&self.purge_events)
                .bind(origin)
                .bind(older_than_ms)
                .bind(limit),
            Change::PurgeSent {
                older_than_ms,
                limit,
            } => statement(&self.purge_sent).bind(older_than_ms).bind(limit),
            Change::PurgeDuplicates {
                before_minute,
                limit,
            } => statement(&self.purge_duplicates)
                .bind(before_minute)
                .bind(limit),
            Change::LeaseComplete { lease, result } => {
                bind_lease(statement(&self.lease_complete).bind(result), lease)
            }
            Change::LeaseRelease { lease } => bind_lease(statement(&self.lease_release), lease),
            Change::LeaseRenew { lease, lease_ms } => {
                bind_lease(statement(&self.lease_renew).bind(lease_ms), lease)
            }
            Change::ForceRelease { identity } => {
                bind_identity(statement(&self.force_release), identity)
            }
            Change::ForceComplete { identity, result } => {
                bind_identity(statement(&self.force_complete).bind(result), identity)
            }
        }
    }
}

/// Binds what one attempt adds to its row's history: duration, status, answer.
fn bind_tried<'q, DB>(query: Query<'q, DB>, tried: Tried<'q>) -> Query<'q, DB>
where
    DB: Database,
    Option<&'q str>: Encode<'q, DB> + Type<DB>,
    i64: Encode<'q, DB> + Type<DB>,
    Option<i64>: Encode<'q, DB> + Type<DB>,
{
    query
        .bind(tried.duration_ms)
        .bind(tried.status)
        .bind(tried.answer)
}

/// Binds a window of outbox rows: destination, then the milliseconds since and until.
/// Each is bound twice for MariaDB's `?`: once to test for none.
fn bind_window<'q, DB>(query: Query<'q, DB>, window: Window<'q>) -> Query<'q, DB>
where
    DB: Database,
    Option<&'q str>: Encode<'q, DB> + Type<DB>,
    Option<i64>: Encode<'q, DB> + Type<DB>,
{
    query
        .bind(window.destination)
        .bind(window.destination)
        .bind(window.since_ms)
        .bind(window.since_ms)
        .bind(window.until_ms)
        .bind(window.until_ms)
}

/// Binds the identity every statement about one key names: scope, consumer, key.
pub(crate) fn bind_identity<'q, DB>(query: Query<'q, DB>, identity: &'q Identity) -> Query<'q, DB>
where
    DB: Database,
    &'q str: Encode<'q, DB> + Type<DB>,
{
    query
        .bind(identity.scope.as_str())
        .bind(identity.consumer.as_str())
        .bind(identity.key.as_str())
}

/// Binds the identity and token every change to a lease names.
fn bind_lease<'q, DB>(query: Query<'q, DB>, lease: &'q Lease) -> Query<'q, DB>
where
    DB: Database,
    &'q str: Encode<'q, DB> + Type<DB>,
    i64: Encode<'q, DB> + Type<DB>,
{
    bind_identity(query, &lease.identity).bind(lease.token)
}

impl<DB, S> Reads<DB> for S
where
    DB: Backend,
    S: AsRef<Common> + Sync,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q str>: Encode<'q, DB> + Type<DB>,
    for<'q> &'q [u8]: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q [u8]>: Encode<'q, DB> + Type<DB>,
    for<'q> Option<i64>: Encode<'q, DB> + Type<DB>,
    for<'q, 'r> i64: Encode<'q, DB> + Decode<'r, DB> + Type<DB>,
    for<'r> i32: Decode<'r, DB> + Type<DB>,
    for<'r> bool: Decode<'r, DB> + Type<DB>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    for<'r> Option<String>: Decode<'r, DB> + Type<DB>,
    for<'r> Vec<u8>: Decode<'r, DB> + Type<DB>,
    for<'r> ListedTuple: sqlx::FromRow<'r, DB::Row>,
    for<'r> EventTuple: sqlx::FromRow<'r, DB::Row>,
    for<'r> EventDetailTuple: sqlx::FromRow<'r, DB::Row>,
    for<'r> ReplayTuple: sqlx::FromRow<'r, DB::Row>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    async fn find<'a>(
        &'a self,
        conn: &'a mut DB::Connection,
        identity: &'a Identity,
    ) -> Result<Option<Stored>, Error> {
        let find = sqlx::query_as(AssertSqlSafe(self.as_ref().find.clone()));
        let row: Option<(i64, Vec<u8>)> = bind_identity_as(find, identity)
            .fetch_optional(conn)
            .await
            .map_err(driver_error::<DB>)?;
        row.map(|(claim_id, fingerprint)| Stored::decode(claim_id, fingerprint))
            .transpose()
    }

    async fn lease_state<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        identity: &'a Identity,
    ) -> Result<Option<LeaseState>, Error> {
        let read = sqlx::query_as(AssertSqlSafe(self.as_ref().lease_state.clone()));
        let row: Option<LeaseRow> = bind_identity_as(read, identity)
            .fetch_optional(pool)
            .await
            .map_err(driver_error::<DB>)?;
        row.map(LeaseState::decode).transpose()
    }

    async fn store_result<'a>(
        &'a self,
        conn: &'a mut DB::Connection,
        identity: &'a Identity,
        result: &'a [u8],
    ) -> Result<(), Error> {
        bind_identity(
            statement(&self.as_ref().store_result).bind(result),
            identity,
        )
        .execute(conn)
        .await
        .map(drop)
        .map_err(driver_error::<DB>)
    }

    async fn change<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        change: Change<'a>,
    ) -> Result<u64, Error> {
        let done = self
            .as_ref()
            .change(change)
            .execute(pool)
            .await
            .map_err(driver_error::<DB>)?;
        Ok(DB::rows_affected(&done))
    }

    async fn load_offsets<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        consumer: &'a str,
        stream: &'a str,
    ) -> Result<Vec<(i32, Offset)>, Error> {
        let rows: Vec<(i32, i64, i64)> =
            sqlx::query_as(AssertSqlSafe(self.as_ref().load_offsets.clone()))
                .bind(consumer)
                .bind(stream)
                .fetch_all(pool)
                .await
                .map_err(driver_error::<DB>)?;
        Ok(rows
            .into_iter()
            .map(|(partition, position, sequence)| (partition, Offset::new(position, sequence)))
            .collect())
    }

    async fn outbox_stats<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
    ) -> Result<(i64, i64, i64, i64), Error> {
        sqlx::query_as(AssertSqlSafe(self.as_ref().outbox_stats.clone()))
            .fetch_one(pool)
            .await
            .map_err(driver_error::<DB>)
    }

    async fn destination_stats<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
    ) -> Result<Vec<DestinationCounts>, Error> {
        fetch_all(pool, &self.as_ref().destination_stats).await
    }

    async fn key_counts<'a>(&'a self, pool: &'a sqlx::Pool<DB>) -> Result<Vec<KeyCount>, Error> {
        let rows: Vec<KeyCountTuple> = fetch_all(pool, &self.as_ref().key_counts).await?;
        Ok(rows.into_iter().map(KeyCount::from).collect())
    }

    async fn oldest_key_age_ms<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        consumer: &'a str,
    ) -> Result<i64, Error> {
        sqlx::query_scalar(AssertSqlSafe(self.as_ref().oldest_key_age.clone()))
            .bind(consumer)
            .fetch_one(pool)
            .await
            .map_err(driver_error::<DB>)
    }

    async fn breakers<'a>(&'a self, pool: &'a sqlx::Pool<DB>) -> Result<Vec<BreakerTuple>, Error> {
        fetch_all(pool, &self.as_ref().breakers).await
    }

    async fn all_offsets<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
    ) -> Result<Vec<StoredOffset>, Error> {
        let rows: Vec<OffsetTuple> = fetch_all(pool, &self.as_ref().all_offsets).await?;
        Ok(rows.into_iter().map(StoredOffset::from).collect())
    }

    async fn list<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        listing: Listing<'a>,
    ) -> Result<Vec<ListedTuple>, Error> {
        let text = match listing.state {
            Waiting::Due => &self.as_ref().list_due,
            Waiting::Dead => &self.as_ref().list_dead,
        };
        // Each filter is bound twice, for MariaDB's `?`: once to test for none.
        let window = listing.window;
        sqlx::query_as(AssertSqlSafe(text.clone()))
            .bind(window.destination)
            .bind(window.destination)
            .bind(window.since_ms)
            .bind(window.since_ms)
            .bind(window.until_ms)
            .bind(window.until_ms)
            .bind(listing.after)
            .bind(listing.after)
            .bind(listing.limit)
            .fetch_all(pool)
            .await
            .map_err(driver_error::<DB>)
    }

    async fn dashboard_minutes<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        since_us: i64,
    ) -> Result<Vec<(String, String, i64, i64)>, Error> {
        sqlx::query_as(AssertSqlSafe(self.as_ref().dashboard_minutes.clone()))
            .bind(since_us)
            .bind(since_us)
            .fetch_all(pool)
            .await
            .map_err(driver_error::<DB>)
    }

    async fn failed_histories<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        since_us: i64,
    ) -> Result<Vec<(String, Option<String>)>, Error> {
        sqlx::query_as(AssertSqlSafe(self.as_ref().failed_histories.clone()))
            .bind(since_us)
            .fetch_all(pool)
            .await
            .map_err(driver_error::<DB>)
    }

    async fn duplicate_minutes<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        since: i64,
    ) -> Result<Vec<(String, i64, i64)>, Error> {
        sqlx::query_as(AssertSqlSafe(self.as_ref().duplicate_minutes.clone()))
            .bind(since)
            .fetch_all(pool)
            .await
            .map_err(driver_error::<DB>)
    }

    async fn add_duplicates<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        minute: i64,
        origin: &'a str,
        duplicates: i64,
    ) -> Result<(), Error> {
        statement(&self.as_ref().add_duplicates)
            .bind(minute)
            .bind(origin)
            .bind(duplicates)
            .execute(pool)
            .await
            .map(drop)
            .map_err(driver_error::<DB>)
    }

    async fn history<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        id: i64,
    ) -> Result<Option<String>, Error> {
        let found: Option<Option<String>> =
            sqlx::query_scalar(AssertSqlSafe(self.as_ref().history.clone()))
                .bind(id)
                .fetch_optional(pool)
                .await
                .map_err(driver_error::<DB>)?;
        Ok(found.flatten())
    }

    async fn ids_by_key<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        key: &'a str,
    ) -> Result<Vec<i64>, Error> {
        sqlx::query_scalar(AssertSqlSafe(self.as_ref().ids_by_key.clone()))
            .bind(key)
            .fetch_all(pool)
            .await
            .map_err(driver_error::<DB>)
    }

    async fn events<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        listing: EventListing<'a>,
    ) -> Result<Vec<EventTuple>, Error> {
        let (after_us, after_id) = listing.after.unzip();
        let (prefix, above) = listing.key_prefix.unzip();
        let above = above.flatten();
        let listing_sql = match above {
            Some(_) => &self.as_ref().events_in_key_range,
            None => &self.as_ref().events,
        };
        // Each filter is bound once more to test for none, for MariaDB's `?`.
        sqlx::query_as(AssertSqlSafe(listing_sql.clone()))
            .bind(listing.origin)
            .bind(listing.origin)
            .bind(prefix)
            .bind(prefix)
            .bind(above.as_deref())
            .bind(above.as_deref())
            .bind(prefix)
            .bind(listing.key_part)
            .bind(listing.key_part)
            .bind(listing.since_us)
            .bind(listing.since_us)
            .bind(listing.until_us)
            .bind(listing.until_us)
            .bind(listing.state)
            .bind(listing.state)
            .bind(after_us)
            .bind(after_us)
            .bind(after_us)
            .bind(after_id)
            .bind(listing.limit)
            .fetch_all(pool)
            .await
            .map_err(driver_error::<DB>)
    }

    async fn event_details<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        by: EventBy<'a>,
    ) -> Result<Vec<EventDetailTuple>, Error> {
        let common = self.as_ref();
        let read = match by {
            EventBy::Id(id) => sqlx::query_as(AssertSqlSafe(common.event_by_id.clone())).bind(id),
            EventBy::Key(key) => {
                sqlx::query_as(AssertSqlSafe(common.events_by_key.clone())).bind(key)
            }
        };
        read.fetch_all(pool).await.map_err(driver_error::<DB>)
    }

    async fn replayable<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        replay: NewReplay<'a>,
    ) -> Result<i64, Error> {
        sqlx::query_scalar(AssertSqlSafe(self.as_ref().replayable.clone()))
            .bind(replay.origin)
            .bind(replay.since_us)
            .bind(replay.until_us)
            .fetch_one(pool)
            .await
            .map_err(driver_error::<DB>)
    }

    async fn replay_window<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        replay: NewReplay<'a>,
    ) -> Result<Result<u64, i64>, Error> {
        let common = self.as_ref();
        let failed = driver_error::<DB>;
        let mut tx = crate::pool::begin(pool).await.map_err(failed)?;
        if let Some(lock) = &common.replay_lock {
            statement(lock).execute(&mut *tx).await.map_err(failed)?;
        }
        // Under the lock, two replays of one window cannot both find none running.
        let running: Option<i64> = sqlx::query_scalar(AssertSqlSafe(common.running_replay.clone()))
            .bind(replay.origin)
            .bind(replay.until_us)
            .bind(replay.since_us)
            .fetch_optional(&mut *tx)
            .await
            .map_err(failed)?;
        if let Some(window) = running {
            tx.rollback().await.map_err(failed)?;
            return Ok(Err(window));
        }
        statement(&common.insert_replay)
            .bind(replay.id)
            .bind(replay.origin)
            .bind(replay.since_us)
            .bind(replay.until_us)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
        let replayed = statement(&common.replay_window)
            .bind(replay.id)
            .bind(replay.origin)
            .bind(replay.since_us)
            .bind(replay.id)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
        let replayed = DB::rows_affected(&replayed);
        statement(&common.count_replay)
            .bind(i64::try_from(replayed).unwrap_or(i64::MAX))
            .bind(replay.id)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
        tx.commit().await.map_err(failed)?;
        Ok(Ok(replayed))
    }

    async fn replays<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        which: Replays,
    ) -> Result<Vec<ReplayTuple>, Error> {
        let common = self.as_ref();
        let read = match which {
            Replays::Id(id) => sqlx::query_as(AssertSqlSafe(common.replay_by_id.clone())).bind(id),
            Replays::Latest(limit) => {
                sqlx::query_as(AssertSqlSafe(common.replays.clone())).bind(limit)
            }
        };
        read.fetch_all(pool).await.map_err(driver_error::<DB>)
    }

    async fn has_unique_constraint<'a>(&'a self, pool: &'a sqlx::Pool<DB>) -> Result<bool, Error> {
        let found: i64 =
            sqlx::query_scalar(AssertSqlSafe(self.as_ref().has_unique_constraint.clone()))
                .fetch_one(pool)
                .await
                .map_err(driver_error::<DB>)?;
        Ok(found > 0)
    }
}

/// Binds what a claim inserts: the identity, the fingerprint and the claim id.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) fn bind_claim<'q, DB, O>(
    query: sqlx::query::QueryAs<'q, DB, O, DB::Arguments>,
    row: crate::rows::ClaimRow<'q>,
) -> sqlx::query::QueryAs<'q, DB, O, DB::Arguments>
where
    DB: Database,
    &'q str: Encode<'q, DB> + Type<DB>,
    &'q [u8]: Encode<'q, DB> + Type<DB>,
    i64: Encode<'q, DB> + Type<DB>,
{
    bind_identity_as(query, row.identity)
        .bind(row.fingerprint.as_bytes().as_slice())
        .bind(row.claim_id)
}

/// [`bind_identity`] for a statement that reads rows.
pub(crate) fn bind_identity_as<'q, DB, O>(
    query: sqlx::query::QueryAs<'q, DB, O, DB::Arguments>,
    identity: &'q Identity,
) -> sqlx::query::QueryAs<'q, DB, O, DB::Arguments>
where
    DB: Database,
    &'q str: Encode<'q, DB> + Type<DB>,
{
    query
        .bind(identity.scope.as_str())
        .bind(identity.consumer.as_str())
        .bind(identity.key.as_str())
}

/// Every row of a statement without parameters.
async fn fetch_all<DB, O>(pool: &sqlx::Pool<DB>, text: &Arc<str>) -> Result<Vec<O>, Error>
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    O: for<'r> sqlx::FromRow<'r, DB::Row> + Send + Unpin,
{
    sqlx::query_as(AssertSqlSafe(text.clone()))
        .fetch_all(pool)
        .await
        .map_err(driver_error::<DB>)
}

/// Applies the migrations newer than the record on `conn`, and records them; returns how
/// many ran. The caller holds what keeps other migrators out.
pub(crate) async fn apply_migrations<DB>(
    conn: &mut DB::Connection,
    tables: &Tables,
) -> Result<usize, Error>
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q, 'r> i64: Encode<'q, DB> + Decode<'r, DB> + Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    let schema = &DB::SCHEMA;
    for setup in schema.setup {
        sqlx::raw_sql(AssertSqlSafe(tables.render(setup)))
            .execute(&mut *conn)
            .await
            .map_err(driver_error::<DB>)?;
    }
    let current: i64 = sqlx::query_scalar(AssertSqlSafe(tables.render(schema.current_version)))
        .fetch_one(&mut *conn)
        .await
        .map_err(driver_error::<DB>)?;
    let newest = schema.migrations.last().map_or(0, |m| m.version);
    if current > newest {
        return Err(Error::Schema(format!(
            "table {} is at version {current}, newer than the {newest} this version of \
             justonce knows: upgrade justonce",
            tables.migrations
        )));
    }
    let pending: Vec<_> = schema
        .migrations
        .iter()
        .filter(|m| m.version > current)
        .collect();
    for migration in &pending {
        if !migration.sql.trim().is_empty() {
            sqlx::raw_sql(AssertSqlSafe(tables.render(migration.sql)))
                .execute(&mut *conn)
                .await
                .map_err(driver_error::<DB>)?;
        }
        sqlx::query(AssertSqlSafe(tables.render(schema.record)))
            .bind(migration.version)
            .bind(migration.description)
            .execute(&mut *conn)
            .await
            .map_err(driver_error::<DB>)?;
    }
    Ok(pending.len())
}

/// The migrations after version `since` as one script, for those who apply them by hand.
pub(crate) fn migration_script(schema: &Schema, tables: &Tables, since: i64) -> String {
    let mut script = schema.script_head.to_owned();
    for statement in schema.setup {
        script.push_str(&tables.render(statement));
        script.push_str(";\n");
    }
    for migration in schema.migrations.iter().filter(|m| m.version > since) {
        script.push_str(&format!(
            "\n-- {}: {}\n",
            migration.version, migration.description
        ));
        let body = tables.render(migration.sql);
        if !body.trim().is_empty() {
            script.push_str(body.trim());
            script.push('\n');
        }
        script.push_str(&tables.render(&format!(
            "INSERT INTO {{prefix}}migrations (version, description) VALUES ({}, '{}');\n",
            migration.version,
            migration.description.replace('\'', "''")
        )));
    }
    script.push_str(schema.script_tail);
    script
}

/// The microseconds in a minute: a time's minute is its microseconds less their remainder.
const MINUTE_US: i64 = 60_000_000;

/// The statement of [`Common::dashboard_minutes`]: `micros_of` reads a time column as
/// microseconds since the Unix epoch, `since_accepted` and `since_sent` are the times of
/// the two parameters.
pub(crate) fn dashboard_minutes(
    outbox: &str,
    micros_of: fn(&str) -> String,
    since_accepted: &str,
    since_sent: &str,
) -> String {
    let counted = |kind: &str, column: &str, since: &str| {
        format!(
            "SELECT destination, '{kind}' AS kind, us - us % {MINUTE_US} AS minute_us, count(*)
             FROM (SELECT destination, {} AS us FROM {outbox} WHERE {column} >= {since}) AS t
             GROUP BY 1, 3",
            micros_of(column)
        )
    };
    format!(
        "{} UNION ALL {}",
        counted("accepted", "received_at", since_accepted),
        counted("sent", "sent_at", since_sent)
    )
}

/// The statement of [`Common::failed_histories`]: the rows whose last failed attempt
/// ended at or after `since`, found by the index on that time. A row whose last failure is
/// older holds none in the range, however long ago it was written or dead-lettered.
pub(crate) fn failed_histories(outbox: &str, history_text: &str, since: &str) -> String {
    format!("SELECT destination, {history_text} FROM {outbox} WHERE last_failed_at >= {since}")
}
