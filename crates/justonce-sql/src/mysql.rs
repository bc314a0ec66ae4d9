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

use crate::backend::{
    Backend, Batch, Change, ClaimRow, KeyCount, LeaseRow, LeaseState, Migration, NewOutboxRow,
    OffsetRow, OffsetTuple, OutboxRow, OutboxTuple, Sealed, Stored, StoredOffset, Wakeups, Which,
    common_queries, database_error, pending_migrations, vanished,
};
use crate::tables::Tables;
use crate::tls::{Dialect, Protection, Target, TlsOptions};
use justonce_core::{Consumer, Error, Fingerprint, Identity, Offset, Scope};
use sqlx::mysql::{MySqlConnectOptions, MySqlDatabaseError, MySqlSslMode};
use sqlx::{AssertSqlSafe, MySql};

impl Sealed for MySql {}

/// The store's clock. UTC whatever the session's time zone, since DATETIME holds none.
const NOW: &str = "UTC_TIMESTAMP(6)";

/// `NOW` moved forward by the milliseconds of the next parameter.
const LATER: &str = "(UTC_TIMESTAMP(6) + INTERVAL (? * 1000) MICROSECOND)";

/// `NOW` moved back by the milliseconds of the next parameter.
const EARLIER: &str = "(UTC_TIMESTAMP(6) - INTERVAL (? * 1000) MICROSECOND)";

/// Milliseconds from a time column to now.
fn age_ms(column: &str) -> String {
    format!("CAST(TIMESTAMPDIFF(MICROSECOND, {column}, {NOW}) DIV 1000 AS SIGNED)")
}

/// Error numbers of the server.
const DUPLICATE_KEY: u16 = 1062;
const LOCK_WAIT_TIMEOUT: u16 = 1205;
const DEADLOCK: u16 = 1213;
const SERVER_SHUTDOWN: u16 = 1053;
const CONNECTION_KILLED: u16 = 1927;

/// How long a migrator waits for another one to finish, in seconds.
const MIGRATION_LOCK_SECONDS: u32 = 60;

const MIGRATION_TABLE: &str = "CREATE TABLE IF NOT EXISTS {prefix}migrations (
    version BIGINT NOT NULL PRIMARY KEY,
    description TEXT NOT NULL,
    applied_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4";

// Keys, scopes, consumers and streams are VARBINARY: they compare byte for byte, as
// documented, and without the trailing-space padding of MariaDB's `_bin` collations, under
// which `a` and `a ` would be one key. Every time is set by the statements from the store's
// clock, in UTC, never by a column default in the session's time zone.
const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "keys, outbox and offsets",
        // The lease columns of version 2 come with the table: MySQL's DDL commits at once,
        // and has no `ADD COLUMN IF NOT EXISTS` with which to repeat a half-applied step.
        sql: "
CREATE TABLE IF NOT EXISTS {prefix}keys (
    scope VARBINARY(128) NOT NULL,
    consumer VARBINARY(128) NOT NULL,
    `key` VARBINARY(255) NOT NULL,
    fingerprint BINARY(32) NOT NULL,
    claim_id BIGINT NOT NULL,
    processed_at DATETIME(6) NOT NULL,
    token BIGINT NOT NULL DEFAULT 0,
    lease_until DATETIME(6) NULL,
    result LONGBLOB NULL,
    PRIMARY KEY (scope, consumer, `key`),
    KEY keys_purge (consumer, processed_at)
) ENGINE=InnoDB;
CREATE TABLE IF NOT EXISTS {prefix}outbox (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    scope TEXT NOT NULL,
    `key` TEXT NOT NULL,
    destination TEXT NOT NULL,
    payload LONGBLOB NOT NULL,
    headers MEDIUMTEXT NOT NULL,
    created_at DATETIME(6) NOT NULL,
    attempts BIGINT NOT NULL DEFAULT 0,
    next_attempt_at DATETIME(6) NOT NULL,
    sent_at DATETIME(6) NULL,
    last_error TEXT NULL,
    lease_token BIGINT NULL,
    dead BOOLEAN NOT NULL DEFAULT FALSE,
    KEY outbox_due (dead, sent_at, next_attempt_at, id),
    KEY outbox_sent (sent_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
CREATE TABLE IF NOT EXISTS {prefix}offsets (
    consumer VARBINARY(128) NOT NULL,
    stream VARBINARY(1024) NOT NULL,
    partition_id INT NOT NULL,
    position BIGINT NOT NULL,
    sequence BIGINT NOT NULL,
    updated_at DATETIME(6) NOT NULL,
    PRIMARY KEY (consumer, stream, partition_id)
) ENGINE=InnoDB;
",
    },
    Migration {
        version: 2,
        description: "leases: fencing token, expiry and result on keys",
        sql: "",
    },
    Migration {
        version: 3,
        description: "breakers: the destinations a relay backed off",
        sql: "
CREATE TABLE IF NOT EXISTS {prefix}breakers (
    destination VARCHAR(255) NOT NULL PRIMARY KEY,
    failures BIGINT NOT NULL,
    open_until DATETIME(6) NOT NULL,
    updated_at DATETIME(6) NOT NULL
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
",
    },
];

/// The statements of one table prefix on MariaDB or MySQL, built once. Those that take a
/// list have `{list}` where its placeholders go.
#[derive(Debug)]
pub struct MySqlStatements {
    claim: String,
    find: String,
    pub(crate) insert_many: String,
    pub(crate) find_many: String,
    has_unique_constraint: String,
    purge_keys: String,
    enqueue: String,
    due_ids: String,
    take_ids: String,
    rows_by_id: String,
    outbox_row: String,
    dead_letters: String,
    mark_sent: String,
    mark_retry: String,
    mark_dead: String,
    untake: String,
    expire: String,
    breaker_open: String,
    breaker_close: String,
    breakers: String,
    replay: String,
    purge_dead: String,
    purge_sent: String,
    ensure_offset: String,
    move_offset: String,
    load_offsets: String,
    all_offsets: String,
    outbox_stats: String,
    key_counts: String,
    oldest_key_age: String,
    ensure_lease: String,
    lease_take_over: String,
    lease_token: String,
    lease_state: String,
    lease_complete: String,
    lease_release: String,
    lease_renew: String,
    force_release: String,
    force_complete: String,
    store_result: String,
}

impl MySqlStatements {
    fn new(tables: &Tables) -> Self {
        let Tables {
            keys,
            outbox,
            offsets,
            breakers,
            ..
        } = tables;
        let columns = format!(
            "id, scope, `key`, destination, payload, headers, attempts, last_error, dead, \
             sent_at IS NOT NULL AS sent, {} AS age_ms",
            age_ms("created_at")
        );
        let this_key = "scope = ? AND consumer = ? AND `key` = ?";
        let due = "sent_at IS NULL AND dead = FALSE";
        Self {
            claim: format!(
                "INSERT INTO {keys} (scope, consumer, `key`, fingerprint, claim_id, processed_at)
                 VALUES (?, ?, ?, ?, ?, {NOW})"
            ),
            // A locking read sees the latest committed row, where a plain one would see the
            // transaction's snapshot, which may predate the holder's commit.
            find: format!(
                "SELECT claim_id, fingerprint FROM {keys} WHERE {this_key} LOCK IN SHARE MODE"
            ),
            // The no-op update locks a present key as the insert locks a new one, in key
            // order; which keys were new is read back by the batch's claim id.
            insert_many: format!(
                "INSERT INTO {keys} (scope, consumer, `key`, fingerprint, claim_id, processed_at)
                 VALUES {{list}}
                 ON DUPLICATE KEY UPDATE claim_id = claim_id"
            ),
            find_many: format!(
                "SELECT {}, claim_id, fingerprint FROM {keys}
                 WHERE scope = ? AND consumer = ? AND `key` IN ({{list}})
                 LOCK IN SHARE MODE",
                text("`key`")
            ),
            has_unique_constraint: format!(
                "SELECT count(*) FROM (
                    SELECT index_name FROM information_schema.statistics
                    WHERE table_schema = DATABASE() AND table_name = '{keys}'
                      AND non_unique = 0
                    GROUP BY index_name
                    HAVING group_concat(column_name ORDER BY column_name) = 'consumer,key,scope'
                 ) AS found"
            ),
            purge_keys: format!(
                "DELETE FROM {keys} WHERE consumer = ? AND processed_at < {EARLIER} LIMIT ?"
            ),
            enqueue: format!(
                "INSERT INTO {outbox}
                    (scope, `key`, destination, payload, headers, created_at, next_attempt_at)
                 VALUES (?, ?, ?, ?, ?, {NOW}, {NOW})"
            ),
            // Taking due rows is three statements in one short transaction: MariaDB's UPDATE
            // returns no rows. No lock is held while the rows are sent.
            due_ids: format!(
                "SELECT id FROM {outbox}
                 WHERE {due} AND next_attempt_at <= {NOW}
                   AND NOT JSON_CONTAINS(?, JSON_QUOTE(destination))
                 ORDER BY next_attempt_at, id
                 LIMIT ?
                 FOR UPDATE SKIP LOCKED"
            ),
            take_ids: format!(
                "UPDATE {outbox}
                 SET next_attempt_at = {LATER}, attempts = attempts + 1, lease_token = ?
                 WHERE id IN ({{list}})"
            ),
            rows_by_id: format!("SELECT {columns} FROM {outbox} WHERE id IN ({{list}}) ORDER BY id"),
            outbox_row: format!("SELECT {columns} FROM {outbox} WHERE id = ?"),
            dead_letters: format!("SELECT {columns} FROM {outbox} WHERE dead ORDER BY id LIMIT ?"),
            mark_sent: format!(
                "UPDATE {outbox} SET sent_at = {NOW}, dead = FALSE, last_error = NULL WHERE id = ?"
            ),
            mark_retry: format!(
                "UPDATE {outbox} SET next_attempt_at = {LATER}, last_error = ?
                 WHERE id = ? AND lease_token = ? AND {due}"
            ),
            mark_dead: format!(
                "UPDATE {outbox} SET dead = TRUE, last_error = ?
                 WHERE id = ? AND lease_token = ? AND {due}"
            ),
            untake: format!(
                "UPDATE {outbox} SET next_attempt_at = {LATER}, attempts = attempts - 1
                 WHERE id = ? AND lease_token = ? AND {due}"
            ),
            breaker_open: format!(
                "INSERT INTO {breakers} (destination, failures, open_until, updated_at)
                 VALUES (?, ?, {LATER}, {NOW})
                 ON DUPLICATE KEY UPDATE failures = VALUES(failures),
                    open_until = VALUES(open_until), updated_at = VALUES(updated_at)"
            ),
            breaker_close: format!("DELETE FROM {breakers} WHERE destination = ?"),
            breakers: format!(
                "SELECT destination, failures, -{}, {} FROM {breakers} ORDER BY destination",
                age_ms("open_until"),
                age_ms("updated_at")
            ),
            // Leased rows too: should one be sent meanwhile, `mark_sent` outranks this.
            expire: format!(
                "UPDATE {outbox} SET dead = TRUE, last_error = ?
                 WHERE {due} AND destination = ? AND created_at <= {EARLIER}
                 ORDER BY id LIMIT ?"
            ),
            replay: format!(
                "UPDATE {outbox}
                 SET dead = FALSE, attempts = 0, next_attempt_at = {NOW}, created_at = {NOW},
                     last_error = NULL
                 WHERE dead AND sent_at IS NULL AND (? IS NULL OR id = ?)
                 ORDER BY id LIMIT ?"
            ),
            purge_dead: format!("DELETE FROM {outbox} WHERE dead"),
            purge_sent: format!("DELETE FROM {outbox} WHERE sent_at < {EARLIER} LIMIT ?"),
            // A stream's first offset starts below any real one, in this transaction only.
            ensure_offset: format!(
                "INSERT INTO {offsets}
                    (consumer, stream, partition_id, position, sequence, updated_at)
                 VALUES (?, ?, ?, {MIN}, {MIN}, {NOW})
                 ON DUPLICATE KEY UPDATE position = position",
                MIN = i64::MIN
            ),
            // The WHERE makes an older offset a no-op, whatever order commits come in.
            move_offset: format!(
                "UPDATE {offsets} SET position = ?, sequence = ?, updated_at = {NOW}
                 WHERE consumer = ? AND stream = ? AND partition_id = ?
                   AND (position, sequence) < (?, ?)"
            ),
            load_offsets: format!(
                "SELECT partition_id, position, sequence FROM {offsets}
                 WHERE consumer = ? AND stream = ? ORDER BY partition_id"
            ),
            all_offsets: format!(
                "SELECT {}, {}, partition_id, position, sequence FROM {offsets}
                 ORDER BY consumer, stream, partition_id",
                text("consumer"),
                text("stream")
            ),
            outbox_stats: format!(
                "SELECT
                    count(CASE WHEN sent_at IS NOT NULL THEN 1 END),
                    count(CASE WHEN {due} THEN 1 END),
                    count(CASE WHEN dead THEN 1 END),
                    CAST(coalesce(max(CASE WHEN {due} THEN {} END), 0) AS SIGNED)
                 FROM {outbox}",
                age_ms("created_at")
            ),
            // A new key starts as an expired lease that nobody held, in this transaction only.
            ensure_lease: format!(
                "INSERT INTO {keys}
                    (scope, consumer, `key`, fingerprint, claim_id, processed_at, token, lease_until)
                 VALUES (?, ?, ?, ?, 0, {NOW}, 0, '1970-01-01')
                 ON DUPLICATE KEY UPDATE token = token"
            ),
            // An expired lease with the same payload is taken, with a larger token than the
            // last holder's, by the store's clock; a key in any other state changes nothing.
            lease_take_over: format!(
                "UPDATE {keys}
                 SET token = token + 1, lease_until = {LATER}, processed_at = {NOW}
                 WHERE {this_key} AND fingerprint = ?
                   AND lease_until IS NOT NULL AND lease_until <= {NOW}"
            ),
            lease_token: format!("SELECT token FROM {keys} WHERE {this_key}"),
            lease_state: format!(
                "SELECT fingerprint, lease_until IS NULL AS done, result,
                        CASE WHEN lease_until IS NULL THEN 0 ELSE -{} END AS remaining_ms
                 FROM {keys} WHERE {this_key}",
                age_ms("lease_until")
            ),
            // Each change to a lease names its token: a holder whose lease was taken over
            // changes nothing.
            lease_complete: format!(
                "UPDATE {keys} SET lease_until = NULL, result = ?, processed_at = {NOW}
                 WHERE {this_key} AND token = ? AND lease_until IS NOT NULL"
            ),
            lease_release: format!(
                "UPDATE {keys} SET lease_until = {NOW}
                 WHERE {this_key} AND token = ? AND lease_until IS NOT NULL"
            ),
            lease_renew: format!(
                "UPDATE {keys} SET lease_until = {LATER}
                 WHERE {this_key} AND token = ? AND lease_until IS NOT NULL"
            ),
            // An operator's release is the lease running out now: the holder keeps its
            // token until the next claim takes the key over with a larger one.
            force_release: format!(
                "UPDATE {keys} SET lease_until = {NOW}
                 WHERE {this_key} AND lease_until IS NOT NULL"
            ),
            // An operator's completion takes the key from its holder: the new token refuses
            // the holder's late complete, renew or release.
            force_complete: format!(
                "UPDATE {keys}
                 SET lease_until = NULL, result = ?, token = token + 1, processed_at = {NOW}
                 WHERE {this_key} AND lease_until IS NOT NULL"
            ),
            store_result: format!("UPDATE {keys} SET result = ? WHERE {this_key}"),
            oldest_key_age: format!(
                "SELECT CAST(coalesce({}, 0) AS SIGNED) FROM {keys} WHERE consumer = ?",
                age_ms("min(processed_at)")
            ),
            key_counts: format!(
                "SELECT {}, {}, count(*), count(lease_until) FROM {keys}
                 GROUP BY consumer, scope ORDER BY consumer, scope",
                text("consumer"),
                text("scope")
            ),
        }
    }
}

/// A VARBINARY column read as text: the bytes were UTF-8 when they were written, and sqlx
/// decodes only text columns as strings.
fn text(column: &str) -> String {
    format!("CAST({column} AS CHAR CHARACTER SET utf8mb4)")
}

/// The most placeholders MariaDB and MySQL take in one statement.
pub(crate) const MAX_PARAMETERS: usize = 65_535;

/// The most keys one statement carries: a batch insert binds five per key, within
/// [`MAX_PARAMETERS`].
pub(crate) const KEYS_PER_STATEMENT: usize = 10_000;

/// One key's row in the list of the batch insert.
pub(crate) fn insert_many_row() -> String {
    format!("(?, ?, ?, ?, ?, {NOW})")
}

/// `template` with `{list}` replaced by `count` copies of `item`, comma separated.
fn with_list(template: &str, item: &str, count: usize) -> String {
    template.replace("{list}", &vec![item; count].join(", "))
}

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

type Query<'q> = sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments>;

fn statement(text: &str) -> Query<'static> {
    sqlx::query(AssertSqlSafe(text.to_owned()))
}

fn bind_identity<'q>(query: Query<'q>, identity: &'q Identity) -> Query<'q> {
    query
        .bind(identity.scope.as_str())
        .bind(identity.consumer.as_str())
        .bind(identity.key.as_str())
}

/// MySQL's names for its TLS settings, as sqlx reads them.
pub(crate) static TLS: Dialect = Dialect {
    name: "MariaDB/MySQL",
    mode: &["ssl-mode", "sslmode"],
    verify_full: "VERIFY_IDENTITY",
    disable: "DISABLED",
    ca: &["ssl-ca", "sslca"],
    client: [&["ssl-cert", "sslcert"], &["ssl-key", "sslkey"]],
    protection: |mode| match mode {
        "disabled" => Some(Protection::Plain),
        "preferred" => Some(Protection::Opportunistic),
        "required" => Some(Protection::Unverified),
        "verify_ca" => Some(Protection::CaOnly),
        "verify_identity" => Some(Protection::Full),
        _ => None,
    },
    // require_secure_transport=ON: MySQL's 3159 says "insecure transport"; MariaDB 10.11
    // answers a plain-text connection with 1045 "Access denied", as for a bad password.
    refused_plain_text: |error| {
        error.message().contains("insecure transport")
            || error.message().starts_with("Access denied")
    },
    // A user created `REQUIRE X509` is denied access like any other without a certificate.
    wants_client_certificate: |_| false,
};

impl TlsOptions for MySqlConnectOptions {
    const MODE_VARIABLE: Option<&'static str> = None;

    fn host(&self) -> &str {
        self.get_host()
    }

    fn is_socket(&self) -> bool {
        self.get_socket().is_some()
    }

    fn verify_full(self) -> Self {
        self.ssl_mode(MySqlSslMode::VerifyIdentity)
    }
}

#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
impl Backend for MySql {
    const BEGIN: &'static str = "BEGIN";
    const ONE_WRITER: bool = false;

    type Statements = MySqlStatements;

    fn statements(tables: &Tables) -> MySqlStatements {
        MySqlStatements::new(tables)
    }

    async fn connect(
        url: &str,
        pool: sqlx::pool::PoolOptions<Self>,
    ) -> Result<sqlx::Pool<Self>, Error> {
        let target = Target::<MySqlConnectOptions>::parse(url, &TLS)?;
        target.connect_pool(pool, database_error::<Self>).await
    }

    async fn claim<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a MySqlStatements,
        row: ClaimRow<'a>,
    ) -> Result<Stored, Error> {
        let id = row.identity;
        let inserted = bind_identity(statement(&sql.claim), id)
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
            Err(error) if is_duplicate(&error) => {
                Self::find(conn, sql, id).await?.ok_or_else(|| vanished(id))
            }
            Err(error) => Err(database_error::<Self>(error)),
        }
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
                .map_err(database_error::<Self>)?;
        }
        // No RETURNING: every key's row is read back, the inserted ones by the batch's
        // claim id, and the caller needs no second read for the others.
        Self::find_many(conn, sql, batch.scope, batch.consumer, &batch.keys).await
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
            let text = with_list(&sql.find_many, "?", chunk.len());
            let mut query = sqlx::query_as(AssertSqlSafe(text))
                .bind(scope.as_str())
                .bind(consumer.as_str());
            for key in chunk {
                query = query.bind(*key);
            }
            let rows: Vec<(String, i64, Vec<u8>)> = query
                .fetch_all(&mut *conn)
                .await
                .map_err(database_error::<Self>)?;
            for (key, claim_id, fingerprint) in rows {
                found.push((key, Stored::decode(claim_id, fingerprint)?));
            }
        }
        Ok(found)
    }

    async fn lease_claim<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a MySqlStatements,
        identity: &'a Identity,
        fingerprint: &'a Fingerprint,
        lease_ms: i64,
    ) -> Result<Option<i64>, Error> {
        // One transaction, so that the token read back is the one this claim set.
        let mut tx = pool.begin().await.map_err(database_error::<Self>)?;
        bind_identity(statement(&sql.ensure_lease), identity)
            .bind(fingerprint.as_bytes().as_slice())
            .execute(&mut *tx)
            .await
            .map_err(database_error::<Self>)?;
        let taken = statement(&sql.lease_take_over)
            .bind(lease_ms)
            .bind(identity.scope.as_str())
            .bind(identity.consumer.as_str())
            .bind(identity.key.as_str())
            .bind(fingerprint.as_bytes().as_slice())
            .execute(&mut *tx)
            .await
            .map_err(database_error::<Self>)?;
        if taken.rows_affected() == 0 {
            return Ok(None);
        }
        let (token,): (i64,) = sqlx::query_as(AssertSqlSafe(sql.lease_token.clone()))
            .bind(identity.scope.as_str())
            .bind(identity.consumer.as_str())
            .bind(identity.key.as_str())
            .fetch_one(&mut *tx)
            .await
            .map_err(database_error::<Self>)?;
        tx.commit().await.map_err(database_error::<Self>)?;
        Ok(Some(token))
    }

    async fn store_result<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a MySqlStatements,
        identity: &'a Identity,
        result: &'a [u8],
    ) -> Result<(), Error> {
        bind_identity(statement(&sql.store_result).bind(result), identity)
            .execute(conn)
            .await
            .map(drop)
            .map_err(database_error::<Self>)
    }

    async fn change<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a MySqlStatements,
        change: Change<'a>,
    ) -> Result<u64, Error> {
        // Parameters are bound in the order their `?` appear.
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
                .bind(after_ms)
                .bind(reason)
                .bind(id)
                .bind(token),
            Change::MarkDead { id, reason, token } => {
                statement(&sql.mark_dead).bind(reason).bind(id).bind(token)
            }
            Change::Untake {
                id,
                after_ms,
                token,
            } => statement(&sql.untake).bind(after_ms).bind(id).bind(token),
            Change::Expire {
                destination,
                older_than_ms,
                reason,
                limit,
            } => statement(&sql.expire)
                .bind(reason)
                .bind(destination)
                .bind(older_than_ms)
                .bind(limit),
            Change::BreakerOpen {
                destination,
                failures,
                pause_ms,
            } => statement(&sql.breaker_open)
                .bind(destination)
                .bind(failures)
                .bind(pause_ms),
            Change::BreakerClose { destination } => statement(&sql.breaker_close).bind(destination),
            Change::Replay { id, limit } => statement(&sql.replay).bind(id).bind(id).bind(limit),
            Change::PurgeDead => statement(&sql.purge_dead),
            Change::PurgeSent {
                older_than_ms,
                limit,
            } => statement(&sql.purge_sent).bind(older_than_ms).bind(limit),
            Change::LeaseComplete { lease, result } => {
                bind_identity(statement(&sql.lease_complete).bind(result), &lease.identity)
                    .bind(lease.token)
            }
            Change::LeaseRelease { lease } => {
                bind_identity(statement(&sql.lease_release), &lease.identity).bind(lease.token)
            }
            Change::LeaseRenew { lease, lease_ms } => {
                bind_identity(statement(&sql.lease_renew).bind(lease_ms), &lease.identity)
                    .bind(lease.token)
            }
            Change::ForceRelease { identity } => {
                bind_identity(statement(&sql.force_release), identity)
            }
            Change::ForceComplete { identity, result } => {
                bind_identity(statement(&sql.force_complete).bind(result), identity)
            }
        };
        let done = query.execute(pool).await.map_err(database_error::<Self>)?;
        Ok(done.rows_affected())
    }

    async fn enqueue<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a MySqlStatements,
        row: NewOutboxRow<'a>,
    ) -> Result<i64, Error> {
        let done = statement(&sql.enqueue)
            .bind(row.scope)
            .bind(row.key)
            .bind(row.destination)
            .bind(row.payload)
            .bind(row.headers)
            .execute(conn)
            .await
            .map_err(database_error::<Self>)?;
        i64::try_from(done.last_insert_id())
            .map_err(|_| Error::Schema("an outbox id beyond the range of BIGINT".to_owned()))
    }

    async fn outbox_rows<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a MySqlStatements,
        which: Which,
    ) -> Result<Vec<OutboxRow>, Error> {
        let rows: Vec<OutboxTuple> = match which {
            Which::Due {
                lease_ms,
                limit,
                token,
                held_back,
            } => {
                let mut tx = pool.begin().await.map_err(database_error::<Self>)?;
                let ids: Vec<(i64,)> = sqlx::query_as(AssertSqlSafe(sql.due_ids.clone()))
                    .bind(held_back)
                    .bind(limit)
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(database_error::<Self>)?;
                if ids.is_empty() {
                    // The locking read holds what it scanned, the rows of the destinations
                    // held back among them, until the transaction ends: end it now, not
                    // when the connection is next used.
                    tx.rollback().await.map_err(database_error::<Self>)?;
                    return Ok(Vec::new());
                }
                let mut take = sqlx::query(AssertSqlSafe(with_list(&sql.take_ids, "?", ids.len())))
                    .bind(lease_ms)
                    .bind(token);
                let mut read =
                    sqlx::query_as(AssertSqlSafe(with_list(&sql.rows_by_id, "?", ids.len())));
                for (id,) in &ids {
                    take = take.bind(*id);
                    read = read.bind(*id);
                }
                take.execute(&mut *tx)
                    .await
                    .map_err(database_error::<Self>)?;
                let rows = read
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(database_error::<Self>)?;
                tx.commit().await.map_err(database_error::<Self>)?;
                rows
            }
            Which::Id(id) => sqlx::query_as(AssertSqlSafe(sql.outbox_row.clone()))
                .bind(id)
                .fetch_all(pool)
                .await
                .map_err(database_error::<Self>)?,
            Which::DeadLetters { limit } => sqlx::query_as(AssertSqlSafe(sql.dead_letters.clone()))
                .bind(limit)
                .fetch_all(pool)
                .await
                .map_err(database_error::<Self>)?,
        };
        Ok(rows.into_iter().map(OutboxRow::from).collect())
    }

    async fn commit_offset<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a MySqlStatements,
        at: OffsetRow<'a>,
    ) -> Result<bool, Error> {
        let Offset { position, sequence } = at.offset;
        statement(&sql.ensure_offset)
            .bind(at.consumer)
            .bind(at.stream)
            .bind(at.partition)
            .execute(&mut *conn)
            .await
            .map_err(database_error::<Self>)?;
        let moved = statement(&sql.move_offset)
            .bind(position)
            .bind(sequence)
            .bind(at.consumer)
            .bind(at.stream)
            .bind(at.partition)
            .bind(position)
            .bind(sequence)
            .execute(&mut *conn)
            .await
            .map_err(database_error::<Self>)?;
        Ok(moved.rows_affected() > 0)
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
        let mut conn = pool.acquire().await.map_err(database_error::<Self>)?;
        let lock_name = format!("justonce:{}", tables.prefix);
        let (locked,): (Option<i64>,) = sqlx::query_as("SELECT GET_LOCK(?, ?)")
            .bind(&lock_name)
            .bind(MIGRATION_LOCK_SECONDS)
            .fetch_one(&mut *conn)
            .await
            .map_err(database_error::<Self>)?;
        if locked != Some(1) {
            return Err(Error::Database {
                retryable: true,
                source: format!(
                    "another migrator held lock {lock_name:?} for {MIGRATION_LOCK_SECONDS} s"
                )
                .into(),
            });
        }
        let applied = apply_migrations(&mut conn, tables).await;
        let released = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&lock_name)
            .execute(&mut *conn)
            .await;
        if released.is_err() {
            drop(conn.detach());
        }
        applied
    }

    fn migration_script(tables: &Tables, since: i64) -> String {
        let mut script = String::from(
            "-- MariaDB and MySQL commit each CREATE TABLE at once: apply this script whole.\n",
        );
        script.push_str(&tables.render(MIGRATION_TABLE));
        script.push_str(";\n");
        for migration in MIGRATIONS.iter().filter(|m| m.version > since) {
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
        script
    }

    common_queries!();

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

/// Applies the migrations that are missing, holding the migration lock.
async fn apply_migrations(
    conn: &mut sqlx::mysql::MySqlConnection,
    tables: &Tables,
) -> Result<usize, Error> {
    sqlx::raw_sql(AssertSqlSafe(tables.render(MIGRATION_TABLE)))
        .execute(&mut *conn)
        .await
        .map_err(database_error::<MySql>)?;
    let (current,): (i64,) = sqlx::query_as(AssertSqlSafe(
        tables.render("SELECT CAST(coalesce(max(version), 0) AS SIGNED) FROM {prefix}migrations"),
    ))
    .fetch_one(&mut *conn)
    .await
    .map_err(database_error::<MySql>)?;
    let pending = pending_migrations(MIGRATIONS, current, tables)?;
    for migration in &pending {
        if !migration.sql.trim().is_empty() {
            sqlx::raw_sql(AssertSqlSafe(tables.render(migration.sql)))
                .execute(&mut *conn)
                .await
                .map_err(database_error::<MySql>)?;
        }
        sqlx::query(AssertSqlSafe(tables.render(
            "INSERT INTO {prefix}migrations (version, description) VALUES (?, ?)",
        )))
        .bind(migration.version)
        .bind(migration.description)
        .execute(&mut *conn)
        .await
        .map_err(database_error::<MySql>)?;
    }
    Ok(pending.len())
}
