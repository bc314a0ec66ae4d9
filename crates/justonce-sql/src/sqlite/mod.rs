//! SQLite: WAL, `BEGIN IMMEDIATE` for writers, a busy timeout, and JSON for batches.

mod migrations;
mod sql;

use crate::backend::{Backend, Sealed, Watcher};
use crate::numbered::{self, Statements, migrate_in_transaction};
use crate::rows::{Batch, NewOutboxRow, Schema, Stored, Wakeups};
use crate::shared::driver_error;
use crate::tables::Tables;
use justonce_core::{Consumer, Error, Scope};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::{AssertSqlSafe, Sqlite};
use std::str::FromStr;
use std::time::{Duration, Instant};

impl Sealed for Sqlite {}

/// How long a writer waits for another connection's write lock, in this process or another,
/// before SQLite gives up with SQLITE_BUSY.
const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
impl Backend for Sqlite {
    // A deferred transaction that upgrades to a write fails with SQLITE_BUSY at once,
    // whatever the busy timeout; an immediate one waits for the write lock.
    const BEGIN: &'static str = "BEGIN IMMEDIATE";
    const ONE_WRITER: bool = true;

    const SCHEMA: Schema = migrations::SCHEMA;

    type Statements = Statements;

    fn statements(tables: &Tables) -> Statements {
        sql::statements(tables)
    }

    async fn outbox_wakeups<'a>(
        _pool: &'a sqlx::Pool<Self>,
        _tables: &'a Tables,
    ) -> Result<Wakeups, Error> {
        Ok(Wakeups::none())
    }

    async fn connect(
        url: &str,
        pool: sqlx::pool::PoolOptions<Self>,
    ) -> Result<(sqlx::Pool<Self>, Option<Watcher>), Error> {
        let options = SqliteConnectOptions::from_str(url)
            .map_err(|e| Error::Config(format!("database URL {url:?}: {e}")))?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(BUSY_TIMEOUT);
        // Turning a new file to WAL takes an exclusive lock without calling the busy
        // handler, so processes opening one new file at once can get SQLITE_BUSY here.
        // Try again for as long as the busy timeout would have waited.
        let started = Instant::now();
        loop {
            match pool.clone().connect_with(options.clone()).await {
                Err(error) if Self::is_retryable(&error) && started.elapsed() < BUSY_TIMEOUT => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                connected => {
                    return connected
                        .map(|pool| (pool, None))
                        .map_err(driver_error::<Self>);
                }
            }
        }
    }

    async fn insert_many<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        batch: &'a Batch<'a>,
    ) -> Result<Vec<(String, Stored)>, Error> {
        let pairs = batch
            .keys
            .iter()
            .zip(&batch.fingerprints)
            .map(|(key, fingerprint)| format!("[{},\"{fingerprint}\"]", json_string(key)));
        let json = format!("[{}]", pairs.collect::<Vec<_>>().join(","));
        let inserted: Vec<(String,)> = sqlx::query_as(AssertSqlSafe(sql.insert_many.clone()))
            .bind(batch.scope.as_str())
            .bind(batch.consumer.as_str())
            .bind(batch.claim_id)
            .bind(json)
            .fetch_all(conn)
            .await
            .map_err(driver_error::<Self>)?;
        Ok(batch.inserted(inserted.into_iter().map(|(key,)| key).collect()))
    }

    async fn forward_many<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        rows: &'a [NewOutboxRow<'a>],
    ) -> Result<(), Error> {
        for row in rows {
            sqlx::query(AssertSqlSafe(sql.forward_many.clone()))
                .bind(row.scope)
                .bind(row.key)
                .bind(row.destination)
                .bind(row.payload)
                .bind(row.headers.as_str())
                .execute(&mut *conn)
                .await
                .map_err(driver_error::<Self>)?;
        }
        Ok(())
    }

    async fn find_many<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        scope: &'a Scope,
        consumer: &'a Consumer,
        keys: &'a [&'a str],
    ) -> Result<Vec<(String, Stored)>, Error> {
        numbered::find_many::<Self, _>(conn, sql, scope, consumer, json_array(keys)).await
    }

    async fn record_first_runs<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Statements,
        scope: &'a Scope,
        consumer: &'a Consumer,
        keys: &'a [&'a str],
    ) -> Result<u64, Error> {
        let keys = json_array(keys);
        numbered::record_first_runs::<Self, _>(pool, sql, scope, consumer, keys).await
    }

    async fn execute_effect(
        conn: &mut Self::Connection,
        sql: String,
        arguments: sqlx::sqlite::SqliteArguments,
    ) -> Result<u64, sqlx::Error> {
        crate::effect::execute::<Self>(conn, sql, arguments).await
    }

    fn rows_affected(done: &Self::QueryResult) -> u64 {
        done.rows_affected()
    }

    fn is_retryable(error: &sqlx::Error) -> bool {
        // The primary result code is the low byte of the extended one:
        // 5 SQLITE_BUSY (and BUSY_SNAPSHOT, BUSY_RECOVERY), 6 SQLITE_LOCKED.
        let code = error.as_database_error().and_then(|e| e.code());
        let primary = code
            .and_then(|code| code.parse::<i32>().ok())
            .map(|code| code & 0xff);
        matches!(primary, Some(5 | 6))
    }

    async fn bound_lock_waits(_conn: &mut Self::Connection) -> Result<(), Error> {
        // Nothing to wait behind: a COMMIT in this process always gets its answer.
        Ok(())
    }

    fn is_commit_unknown(_error: &sqlx::Error) -> bool {
        // SQLite runs in this process: a COMMIT that returns an error did not commit.
        false
    }

    async fn migrate<'a>(pool: &'a sqlx::Pool<Self>, tables: &'a Tables) -> Result<usize, Error> {
        migrate_in_transaction(pool, tables).await
    }
}

/// `text` as a JSON string. Keys, scopes and consumer names hold no control characters
/// (they are validated when built), so only the quote and the backslash need escaping.
fn json_string(text: &str) -> String {
    let mut json = String::with_capacity(text.len() + 2);
    json.push('"');
    for c in text.chars() {
        if matches!(c, '"' | '\\') {
            json.push('\\');
        }
        json.push(c);
    }
    json.push('"');
    json
}

/// Keys as one JSON array of strings, which SQLite reads with `json_each`.
fn json_array(keys: &[&str]) -> String {
    let items: Vec<String> = keys.iter().map(|key| json_string(key)).collect();
    format!("[{}]", items.join(","))
}

#[cfg(test)]
mod tests {
    use super::json_string;

    #[test]
    fn json_strings_escape_quotes_and_backslashes() {
        assert_eq!(json_string(r#"a"b\c"#), r#""a\"b\\c""#);
        assert_eq!(json_string("café"), "\"café\"");
    }
}
