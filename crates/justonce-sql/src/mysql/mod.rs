//! MariaDB and MySQL: a plain INSERT whose duplicate-key error is the answer, locking reads
//! for what other transactions committed, and `GET_LOCK` around migrations.
//!
//! There is no `RETURNING` on MySQL and none on MariaDB's UPDATE, and sqlx connects with
//! `CLIENT_FOUND_ROWS`, which makes `ON DUPLICATE KEY UPDATE` report a duplicate as a
//! changed row. So a claim inserts, and a duplicate is recognised by its error (1062),
//! never by a row count. A conditional change (taking a lease over, moving an offset) first
//! makes sure the row exists with a no-op `ON DUPLICATE KEY UPDATE`, which locks it
//! exclusively at once, then updates it `WHERE` the condition holds: the rows it matched say
//! whether it did. Upgrading the shared lock that a failed INSERT leaves to an exclusive
//! one instead deadlocks as soon as two transactions wait for the same key.

mod migrations;
mod sql;
mod tls;

use sql::forward_many_row;
pub(crate) use sql::{KEYS_PER_STATEMENT, MAX_PARAMETERS, insert_many_row, with_keys};

use crate::backend::{Backend, Queries, Reads, Sealed, Watcher};
use crate::common::{apply_migrations, bind_identity, statement};
use crate::rows::{
    Announce, Batch, ClaimRow, NewOutboxRow, OffsetRow, OutboxRow, OutboxTuple, Schema, Stored,
    Wakeups, Which,
};
use crate::shared::{driver_error, vanished};
use crate::tables::Tables;
use crate::tls::Target;
use justonce_core::{Consumer, Error, Fingerprint, Identity, Offset, Scope};
use migrations::MIGRATION_LOCK_SECONDS;
use sql::{MySqlStatements, with_list};
use sqlx::mysql::{MySqlConnectOptions, MySqlDatabaseError};
use sqlx::{AssertSqlSafe, MySql};

impl Sealed for MySql {}

/// Error numbers of the server.
const DUPLICATE_KEY: u16 = 1062;
const LOCK_WAIT_TIMEOUT: u16 = 1205;
const DEADLOCK: u16 = 1213;
const SERVER_SHUTDOWN: u16 = 1053;
const CONNECTION_KILLED: u16 = 1927;

/// The server's error number, for an error the server sent.
fn error_number(error: &sqlx::Error) -> Option<u16> {
    error
        .as_database_error()
        .and_then(|e| e.try_downcast_ref::<MySqlDatabaseError>())
        .map(MySqlDatabaseError::number)
}

fn is_duplicate(error: &sqlx::Error) -> bool {
    error_number(error) == Some(DUPLICATE_KEY)
}
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
impl Backend for MySql {
    const BEGIN: &'static str = "BEGIN";
    const ONE_WRITER: bool = false;
    const SCHEMA: Schema = migrations::SCHEMA;

    type Statements = MySqlStatements;

    fn statements(tables: &Tables) -> MySqlStatements {
        MySqlStatements::new(tables)
    }

    async fn connect(
        url: &str,
        pool: sqlx::pool::PoolOptions<Self>,
    ) -> Result<(sqlx::Pool<Self>, Option<Watcher>), Error> {
        let target = Target::<MySqlConnectOptions>::parse(url, &tls::TLS)?;
        let pool = target.connect_pool(pool, driver_error::<Self>).await?;
        Ok((pool, None))
    }

    async fn insert_many<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a MySqlStatements,
        batch: &'a Batch<'a>,
    ) -> Result<Vec<(String, Stored)>, Error> {
        // The chunks go in the batch's sorted order, so concurrent batches still take their
        // row locks in one order and cannot deadlock.
        for (keys, fingerprints) in batch
            .keys
            .chunks(KEYS_PER_STATEMENT)
            .zip(batch.fingerprints.chunks(KEYS_PER_STATEMENT))
        {
            let text = with_list(&sql.insert_many, &insert_many_row(), keys.len());
            let mut insert = sqlx::query(AssertSqlSafe(text));
            for (key, fingerprint) in keys.iter().zip(fingerprints) {
                insert = insert
                    .bind(batch.scope.as_str())
                    .bind(batch.consumer.as_str())
                    .bind(*key)
                    .bind(fingerprint.as_bytes().as_slice())
                    .bind(batch.claim_id);
            }
            insert
                .execute(&mut *conn)
                .await
                .map_err(driver_error::<Self>)?;
        }
        // No RETURNING: every key's row is read back, the inserted ones by the batch's
        // claim id, and the caller needs no second read for the others.
        Self::find_many(conn, sql, batch.scope, batch.consumer, &batch.keys).await
    }

    async fn forward_many<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a MySqlStatements,
        rows: &'a [NewOutboxRow<'a>],
    ) -> Result<(), Error> {
        // Five parameters a row, within MAX_PARAMETERS.
        for chunk in rows.chunks(KEYS_PER_STATEMENT) {
            let text = with_list(&sql.forward_many, &forward_many_row(), chunk.len());
            let mut insert = sqlx::query(AssertSqlSafe(text));
            for row in chunk {
                insert = insert
                    .bind(row.scope)
                    .bind(row.key)
                    .bind(row.destination)
                    .bind(row.payload)
                    .bind(row.headers.as_str());
            }
            insert
                .execute(&mut *conn)
                .await
                .map_err(driver_error::<Self>)?;
        }
        Ok(())
    }

    async fn find_many<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a MySqlStatements,
        scope: &'a Scope,
        consumer: &'a Consumer,
        keys: &'a [&'a str],
    ) -> Result<Vec<(String, Stored)>, Error> {
        let mut found = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(KEYS_PER_STATEMENT) {
            let text = with_keys(&sql.find_many, chunk.len());
            let mut query = sqlx::query_as(AssertSqlSafe(text));
            for key in chunk {
                query = query.bind(*key);
            }
            let rows: Vec<(String, i64, Vec<u8>)> = query
                .bind(scope.as_str())
                .bind(consumer.as_str())
                .fetch_all(&mut *conn)
                .await
                .map_err(driver_error::<Self>)?;
            for (key, claim_id, fingerprint) in rows {
                found.push((key, Stored::decode(claim_id, fingerprint)?));
            }
        }
        Ok(found)
    }

    async fn record_first_runs<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a MySqlStatements,
        scope: &'a Scope,
        consumer: &'a Consumer,
        keys: &'a [&'a str],
    ) -> Result<u64, Error> {
        // Each key twice, in one statement: more than it holds are not counted, and run
        // one by one.
        if keys.len() * 2 + 4 > MAX_PARAMETERS {
            return Ok(0);
        }
        let rows = vec!["SELECT ? AS `key`"; keys.len()].join(" UNION ALL ");
        let text = with_list(&sql.record_first_runs, "?", keys.len()).replace("{rows}", &rows);
        let mut insert = sqlx::query(AssertSqlSafe(text))
            .bind(scope.as_str())
            .bind(consumer.as_str());
        for key in keys {
            insert = insert.bind(*key);
        }
        insert = insert.bind(scope.as_str()).bind(consumer.as_str());
        for key in keys {
            insert = insert.bind(*key);
        }
        let done = insert.execute(pool).await.map_err(driver_error::<Self>)?;
        Ok(done.rows_affected())
    }

    async fn outbox_wakeups<'a>(
        _pool: &'a sqlx::Pool<Self>,
        _tables: &'a Tables,
    ) -> Result<Wakeups, Error> {
        Ok(Wakeups::none())
    }

    async fn migrate<'a>(pool: &'a sqlx::Pool<Self>, tables: &'a Tables) -> Result<usize, Error> {
        // DDL commits at once on MySQL, so migrators are kept apart by a named lock, which
        // belongs to the session: the connection is closed, not returned, if releasing fails.
        let mut conn = pool.acquire().await.map_err(driver_error::<Self>)?;
        let lock_name = format!("justonce:{}", tables.prefix);
        let (locked,): (Option<i64>,) = sqlx::query_as("SELECT GET_LOCK(?, ?)")
            .bind(&lock_name)
            .bind(MIGRATION_LOCK_SECONDS)
            .fetch_one(&mut *conn)
            .await
            .map_err(driver_error::<Self>)?;
        if locked != Some(1) {
            return Err(Error::database(
                true,
                format!("another migrator held lock {lock_name:?} for {MIGRATION_LOCK_SECONDS} s"),
            ));
        }
        let applied = apply_migrations::<MySql>(&mut conn, tables).await;
        let released = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&lock_name)
            .execute(&mut *conn)
            .await;
        if released.is_err() {
            drop(conn.detach());
        }
        applied
    }

    async fn execute_effect(
        conn: &mut Self::Connection,
        sql: String,
        arguments: sqlx::mysql::MySqlArguments,
    ) -> Result<u64, sqlx::Error> {
        crate::effect::execute::<Self>(conn, sql, arguments).await
    }

    fn rows_affected(done: &Self::QueryResult) -> u64 {
        done.rows_affected()
    }

    fn is_retryable(error: &sqlx::Error) -> bool {
        matches!(error_number(error), Some(DEADLOCK | LOCK_WAIT_TIMEOUT))
    }

    fn is_commit_unknown(error: &sqlx::Error) -> bool {
        match error {
            sqlx::Error::Database(_) => matches!(
                error_number(error),
                Some(SERVER_SHUTDOWN | CONNECTION_KILLED)
            ),
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::WorkerCrashed => true,
            _ => false,
        }
    }

    async fn bound_lock_waits(_conn: &mut Self::Connection) -> Result<(), Error> {
        // innodb_lock_wait_timeout (50 s by default) already bounds every wait, and its
        // error (1205) is retried.
        Ok(())
    }
}

impl Queries<MySql> for MySqlStatements {
    async fn claim<'a>(
        &'a self,
        conn: &'a mut sqlx::mysql::MySqlConnection,
        row: ClaimRow<'a>,
    ) -> Result<Stored, Error> {
        let id = row.identity;
        let inserted = bind_identity(statement(&self.claim), id)
            .bind(row.fingerprint.as_bytes().as_slice())
            .bind(row.claim_id)
            .execute(&mut *conn)
            .await;
        match inserted {
            Ok(_) => Ok(Stored {
                claim_id: row.claim_id,
                fingerprint: *row.fingerprint,
            }),
            // The statement was undone, not the transaction: read the holder.
            Err(error) if is_duplicate(&error) => Reads::<MySql>::find(self, conn, id)
                .await?
                .ok_or_else(|| vanished(id)),
            Err(error) => Err(driver_error::<MySql>(error)),
        }
    }

    async fn lease_claim<'a>(
        &'a self,
        pool: &'a sqlx::Pool<MySql>,
        identity: &'a Identity,
        fingerprint: &'a Fingerprint,
        lease_ms: i64,
    ) -> Result<Option<i64>, Error> {
        // One transaction, so that the token read back is the one this claim set.
        let mut tx = crate::pool::begin(pool)
            .await
            .map_err(driver_error::<MySql>)?;
        bind_identity(statement(&self.ensure_lease), identity)
            .bind(fingerprint.as_bytes().as_slice())
            .execute(&mut *tx)
            .await
            .map_err(driver_error::<MySql>)?;
        let taken = statement(&self.lease_take_over)
            .bind(lease_ms)
            .bind(identity.scope.as_str())
            .bind(identity.consumer.as_str())
            .bind(identity.key.as_str())
            .bind(fingerprint.as_bytes().as_slice())
            .execute(&mut *tx)
            .await
            .map_err(driver_error::<MySql>)?;
        if taken.rows_affected() == 0 {
            return Ok(None);
        }
        let (token,): (i64,) = sqlx::query_as(AssertSqlSafe(self.lease_token.clone()))
            .bind(identity.scope.as_str())
            .bind(identity.consumer.as_str())
            .bind(identity.key.as_str())
            .fetch_one(&mut *tx)
            .await
            .map_err(driver_error::<MySql>)?;
        tx.commit().await.map_err(driver_error::<MySql>)?;
        Ok(Some(token))
    }

    async fn enqueue<'a>(
        &'a self,
        conn: &'a mut sqlx::mysql::MySqlConnection,
        row: NewOutboxRow<'a>,
        // No relay listens: they poll, and this process's are woken after a run's commit.
        _announce: Announce,
    ) -> Result<i64, Error> {
        let done = statement(&self.enqueue)
            .bind(row.scope)
            .bind(row.key)
            .bind(row.destination)
            .bind(row.payload)
            .bind(row.headers)
            .execute(conn)
            .await
            .map_err(driver_error::<MySql>)?;
        i64::try_from(done.last_insert_id())
            .map_err(|_| Error::Schema("an outbox id beyond the range of BIGINT".to_owned()))
    }

    async fn outbox_rows<'a>(
        &'a self,
        pool: &'a sqlx::Pool<MySql>,
        which: Which,
    ) -> Result<Vec<OutboxRow>, Error> {
        let rows: Vec<OutboxTuple> = match which {
            Which::Due {
                lease_ms,
                limit,
                token,
                held_back,
            } => {
                let mut tx = crate::pool::begin(pool)
                    .await
                    .map_err(driver_error::<MySql>)?;
                let ids: Vec<(i64,)> = sqlx::query_as(AssertSqlSafe(self.due_ids.clone()))
                    .bind(held_back)
                    .bind(limit)
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(driver_error::<MySql>)?;
                if ids.is_empty() {
                    // The locking read holds what it scanned, the rows of the destinations
                    // held back among them, until the transaction ends: end it now, not
                    // when the connection is next used.
                    tx.rollback().await.map_err(driver_error::<MySql>)?;
                    return Ok(Vec::new());
                }
                let mut take =
                    sqlx::query(AssertSqlSafe(with_list(&self.take_ids, "?", ids.len())))
                        .bind(lease_ms)
                        .bind(token);
                let mut read =
                    sqlx::query_as(AssertSqlSafe(with_list(&self.rows_by_id, "?", ids.len())));
                for (id,) in &ids {
                    take = take.bind(*id);
                    read = read.bind(*id);
                }
                take.execute(&mut *tx)
                    .await
                    .map_err(driver_error::<MySql>)?;
                let rows = read
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(driver_error::<MySql>)?;
                tx.commit().await.map_err(driver_error::<MySql>)?;
                rows
            }
            Which::Id(id) => sqlx::query_as(AssertSqlSafe(self.outbox_row.clone()))
                .bind(id)
                .fetch_all(pool)
                .await
                .map_err(driver_error::<MySql>)?,
            Which::DeadLetters { limit } => {
                sqlx::query_as(AssertSqlSafe(self.dead_letters.clone()))
                    .bind(limit)
                    .fetch_all(pool)
                    .await
                    .map_err(driver_error::<MySql>)?
            }
        };
        Ok(rows.into_iter().map(OutboxRow::from).collect())
    }

    async fn commit_offset<'a>(
        &'a self,
        conn: &'a mut sqlx::mysql::MySqlConnection,
        at: OffsetRow<'a>,
    ) -> Result<bool, Error> {
        let Offset { position, sequence } = at.offset;
        let at_least = at.at_least.unwrap_or(Offset::new(i64::MIN, i64::MIN));
        statement(&self.ensure_offset)
            .bind(at.consumer)
            .bind(at.stream)
            .bind(at.partition)
            .execute(&mut *conn)
            .await
            .map_err(driver_error::<MySql>)?;
        let moved = statement(&self.move_offset)
            .bind(position)
            .bind(sequence)
            .bind(at.consumer)
            .bind(at.stream)
            .bind(at.partition)
            .bind(at.above.position)
            .bind(at.above.sequence)
            .bind(at_least.position)
            .bind(at_least.sequence)
            .execute(&mut *conn)
            .await
            .map_err(driver_error::<MySql>)?;
        Ok(moved.rows_affected() > 0)
    }

    async fn record_run<'a>(
        &'a self,
        pool: &'a sqlx::Pool<MySql>,
        identity: &'a Identity,
    ) -> Result<u64, Error> {
        let done = bind_identity(statement(&self.record_run), identity)
            .execute(pool)
            .await
            .map_err(driver_error::<MySql>)?;
        Ok(done.last_insert_id().max(1))
    }
}
