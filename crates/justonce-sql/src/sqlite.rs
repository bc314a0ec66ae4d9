//! SQLite: WAL, `BEGIN IMMEDIATE` for writers, a busy timeout, and JSON for batches.

use crate::backend::{
    Backend, Batch, Change, ClaimRow, Clock, KeyCount, LeaseRow, LeaseState, Migration,
    NewOutboxRow, OffsetRow, OffsetTuple, OutboxRow, OutboxTuple, Sealed, Specific, Statements,
    Stored, StoredOffset, Wakeups, Which, bind_identity, bind_lease, common_queries,
    database_error, pending_migrations, shared_queries, vanished,
};
use crate::tables::Tables;
use justonce_core::{Consumer, Error, Fingerprint, Identity, Offset, Scope};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::{AssertSqlSafe, Sqlite};
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Sealed for Sqlite {}

/// How long a writer waits for another connection's write lock, in this process or another,
/// before SQLite gives up with SQLITE_BUSY.
const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

/// The store's clock, in milliseconds since the Unix epoch.
const NOW_MS: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

const CLOCK: Clock = Clock {
    now: NOW_MS,
    later_by: |millis| format!("({NOW_MS} + {millis})"),
    earlier_by: |millis| format!("({NOW_MS} - {millis})"),
    age_ms: |column| format!("({NOW_MS} - {column})"),
};

// BEGIN IMMEDIATE already holds the database's only write lock.
const MIGRATION_SETUP: &[&str] = &["CREATE TABLE IF NOT EXISTS {prefix}migrations (
    version INTEGER PRIMARY KEY,
    description TEXT NOT NULL,
    applied_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
)"];

const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "keys, outbox and offsets",
        sql: "
CREATE TABLE IF NOT EXISTS {prefix}keys (
    scope TEXT NOT NULL,
    consumer TEXT NOT NULL,
    key TEXT NOT NULL,
    fingerprint BLOB NOT NULL,
    claim_id INTEGER NOT NULL,
    processed_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    PRIMARY KEY (scope, consumer, key)
);
CREATE INDEX IF NOT EXISTS {prefix}keys_purge ON {prefix}keys (consumer, processed_at);
CREATE TABLE IF NOT EXISTS {prefix}outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    destination TEXT NOT NULL,
    payload BLOB NOT NULL,
    headers TEXT NOT NULL DEFAULT '[]',
    created_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    sent_at INTEGER,
    last_error TEXT,
    lease_token INTEGER,
    dead BOOLEAN NOT NULL DEFAULT FALSE
);
CREATE INDEX IF NOT EXISTS {prefix}outbox_due ON {prefix}outbox (next_attempt_at, id)
    WHERE sent_at IS NULL AND NOT dead;
CREATE INDEX IF NOT EXISTS {prefix}outbox_sent ON {prefix}outbox (sent_at)
    WHERE sent_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS {prefix}offsets (
    consumer TEXT NOT NULL,
    stream TEXT NOT NULL,
    partition_id INTEGER NOT NULL,
    position INTEGER NOT NULL,
    sequence INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    PRIMARY KEY (consumer, stream, partition_id)
);
",
    },
    Migration {
        version: 2,
        description: "leases: fencing token, expiry and result on keys",
        sql: "
ALTER TABLE {prefix}keys ADD COLUMN token INTEGER NOT NULL DEFAULT 0;
ALTER TABLE {prefix}keys ADD COLUMN lease_until INTEGER;
ALTER TABLE {prefix}keys ADD COLUMN result BLOB;
",
    },
    Migration {
        version: 3,
        description: "breakers: the destinations a relay backed off",
        sql: "
CREATE TABLE IF NOT EXISTS {prefix}breakers (
    destination TEXT PRIMARY KEY,
    failures INTEGER NOT NULL,
    open_until INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);
",
    },
];

#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
impl Backend for Sqlite {
    // A deferred transaction that upgrades to a write fails with SQLITE_BUSY at once,
    // whatever the busy timeout; an immediate one waits for the write lock.
    const BEGIN: &'static str = "BEGIN IMMEDIATE";
    const ONE_WRITER: bool = true;

    type Statements = Statements;

    fn statements(tables: &Tables) -> Statements {
        let Tables { keys, outbox, .. } = tables;
        let specific = Specific {
            claim: format!(
                "INSERT INTO {keys} (scope, consumer, key, fingerprint, claim_id, processed_at)
                 VALUES ($1, $2, $3, $4, $5, {NOW_MS})
                 ON CONFLICT (scope, consumer, key) DO NOTHING
                 RETURNING claim_id, fingerprint"
            ),
            // One JSON array of [key, hex fingerprint] pairs keeps the statement text fixed
            // whatever the batch size, so it is prepared once.
            insert_many: format!(
                "INSERT INTO {keys} (scope, consumer, key, fingerprint, claim_id, processed_at)
                 SELECT $1, $2, value ->> 0, unhex(value ->> 1), $3, {NOW_MS}
                 FROM json_each($4) WHERE true
                 ON CONFLICT (scope, consumer, key) DO NOTHING
                 RETURNING key"
            ),
            find_many: format!(
                "SELECT key, claim_id, fingerprint FROM {keys}
                 WHERE scope = $1 AND consumer = $2
                   AND key IN (SELECT value FROM json_each($3))"
            ),
            has_unique_constraint: format!(
                "SELECT count(*) FROM pragma_index_list('{keys}') AS list
                 WHERE list.\"unique\" = 1 AND list.partial = 0
                   AND (SELECT group_concat(name, ',') FROM (
                          SELECT name FROM pragma_index_info(list.name) ORDER BY name
                       )) = 'consumer,key,scope'"
            ),
            purge_keys: format!(
                "DELETE FROM {keys} WHERE rowid IN (
                    SELECT rowid FROM {keys}
                    WHERE consumer = $1 AND processed_at < {NOW_MS} - $2
                    LIMIT $3
                 )"
            ),
            enqueue: format!(
                "INSERT INTO {outbox} (scope, key, destination, payload, headers)
                 VALUES ($1, $2, $3, $4, $5)
                 RETURNING id"
            ),
            // A WITH clause cannot insert on SQLite.
            claim_and_forward: None,
            // The single writer already keeps two relays from taking one row.
            skip_locked: "",
            texts_of: |array| format!("SELECT value FROM json_each({array})"),
        };
        Statements::new(tables, &CLOCK, specific)
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
    ) -> Result<sqlx::Pool<Self>, Error> {
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
                connected => return connected.map_err(database_error::<Self>),
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
            .map_err(database_error::<Self>)?;
        Ok(batch.inserted(inserted.into_iter().map(|(key,)| key).collect()))
    }

    async fn find_many<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        scope: &'a Scope,
        consumer: &'a Consumer,
        keys: &'a [&'a str],
    ) -> Result<Vec<(String, Stored)>, Error> {
        let json = format!(
            "[{}]",
            keys.iter()
                .map(|key| json_string(key))
                .collect::<Vec<_>>()
                .join(",")
        );
        let rows: Vec<(String, i64, Vec<u8>)> =
            sqlx::query_as(AssertSqlSafe(sql.find_many.clone()))
                .bind(scope.as_str())
                .bind(consumer.as_str())
                .bind(json)
                .fetch_all(conn)
                .await
                .map_err(database_error::<Self>)?;
        rows.into_iter()
            .map(|(key, claim_id, fingerprint)| Ok((key, Stored::decode(claim_id, fingerprint)?)))
            .collect()
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

    shared_queries!();
    common_queries!();
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

#[cfg(test)]
mod tests {
    use super::json_string;

    #[test]
    fn json_strings_escape_quotes_and_backslashes() {
        assert_eq!(json_string(r#"a"b\c"#), r#""a\"b\\c""#);
        assert_eq!(json_string("café"), "\"café\"");
    }
}
