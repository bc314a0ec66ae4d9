//! What differs between databases, behind one sealed trait.

use crate::tables::Tables;
use justonce_core::{Consumer, Error, Fingerprint, Identity, Scope};
use std::future::Future;
use std::sync::Arc;

/// A database justonce can store keys in: [`sqlx::Postgres`] with the `postgres` feature,
/// [`sqlx::Sqlite`] with the `sqlite` feature.
///
/// The trait is sealed: its methods are justonce's own, and users only name the type, as in
/// `Inbox<Postgres>`.
pub trait Backend: sqlx::Database + Sealed {
    /// The statement that opens a writing transaction.
    #[doc(hidden)]
    const BEGIN: &'static str;

    #[doc(hidden)]
    fn statements(tables: &Tables) -> Statements;

    #[doc(hidden)]
    fn connect(url: &str) -> impl Future<Output = Result<sqlx::Pool<Self>, Error>> + Send;

    /// Inserts the key unless present, returning the row that holds it afterwards.
    #[doc(hidden)]
    fn claim<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        row: ClaimRow<'a>,
    ) -> impl Future<Output = Result<Stored, Error>> + Send + 'a;

    #[doc(hidden)]
    fn find<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        identity: &'a Identity,
    ) -> impl Future<Output = Result<Option<Stored>, Error>> + Send + 'a;

    /// Inserts the keys that are not present in one statement, in key order, and returns
    /// the inserted keys.
    #[doc(hidden)]
    fn insert_many<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        batch: &'a Batch<'a>,
    ) -> impl Future<Output = Result<Vec<String>, Error>> + Send + 'a;

    /// The stored rows of these keys.
    #[doc(hidden)]
    fn find_many<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        scope: &'a Scope,
        consumer: &'a Consumer,
        keys: &'a [&'a str],
    ) -> impl Future<Output = Result<Vec<(String, Stored)>, Error>> + Send + 'a;

    /// Deletes at most `limit` keys of `consumer` processed more than `older_than_ms`
    /// milliseconds ago by the store's clock.
    #[doc(hidden)]
    fn purge_batch<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Statements,
        consumer: &'a Consumer,
        older_than_ms: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, Error>> + Send + 'a;

    #[doc(hidden)]
    fn enqueue<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        row: OutboxRow<'a>,
    ) -> impl Future<Output = Result<i64, Error>> + Send + 'a;

    /// Applies the migrations that are missing, under a lock that serialises concurrent
    /// migrators, and returns how many ran.
    #[doc(hidden)]
    fn migrate<'a>(
        pool: &'a sqlx::Pool<Self>,
        tables: &'a Tables,
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a;

    /// Whether the keys table exists with its unique constraint on (scope, consumer, key).
    #[doc(hidden)]
    fn has_unique_constraint<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Statements,
    ) -> impl Future<Output = Result<bool, Error>> + Send + 'a;

    /// Whether a new transaction may not hit this error again.
    #[doc(hidden)]
    fn is_retryable(error: &sqlx::Error) -> bool;
}

pub(crate) use private::Sealed;
mod private {
    pub trait Sealed {}
}

/// The statements of one table prefix, built once.
#[derive(Debug)]
pub struct Statements {
    pub(crate) claim: Arc<str>,
    pub(crate) find: Arc<str>,
    pub(crate) insert_many: Arc<str>,
    pub(crate) find_many: Arc<str>,
    pub(crate) purge: Arc<str>,
    pub(crate) enqueue: Arc<str>,
    pub(crate) has_unique_constraint: Arc<str>,
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

/// One outbox row to write.
pub struct OutboxRow<'a> {
    pub(crate) scope: &'a str,
    pub(crate) key: &'a str,
    pub(crate) destination: &'a str,
    pub(crate) payload: &'a [u8],
}

/// One schema change, with `{prefix}` in place of the table prefix.
pub struct Migration {
    pub(crate) version: i64,
    pub(crate) description: &'static str,
    pub(crate) sql: &'static str,
}

/// Wraps a driver error, noting whether a new transaction may succeed.
pub(crate) fn database_error<DB: Backend>(error: sqlx::Error) -> Error {
    Error::Database {
        retryable: DB::is_retryable(&error),
        source: Box::new(error),
    }
}

/// Whether the connection broke, so that a COMMIT sent on it may or may not have happened.
pub(crate) fn is_connection_lost(error: &Error) -> bool {
    let Error::Database { source, .. } = error else {
        return false;
    };
    matches!(
        source.downcast_ref::<sqlx::Error>(),
        Some(
            sqlx::Error::Io(_)
                | sqlx::Error::Tls(_)
                | sqlx::Error::Protocol(_)
                | sqlx::Error::WorkerCrashed
        )
    )
}

/// The queries whose text and binds are the same on every database, written once and
/// expanded inside each backend's `impl`.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
macro_rules! shared_queries {
    () => {
        async fn find<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a Statements,
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

        async fn purge_batch<'a>(
            pool: &'a sqlx::Pool<Self>,
            sql: &'a Statements,
            consumer: &'a Consumer,
            older_than_ms: i64,
            limit: i64,
        ) -> Result<u64, Error> {
            let done = sqlx::query(AssertSqlSafe(sql.purge.clone()))
                .bind(consumer.as_str())
                .bind(older_than_ms)
                .bind(limit)
                .execute(pool)
                .await
                .map_err(database_error::<Self>)?;
            Ok(done.rows_affected())
        }

        async fn enqueue<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a Statements,
            row: OutboxRow<'a>,
        ) -> Result<i64, Error> {
            let (id,): (i64,) = sqlx::query_as(AssertSqlSafe(sql.enqueue.clone()))
                .bind(row.scope)
                .bind(row.key)
                .bind(row.destination)
                .bind(row.payload)
                .fetch_one(conn)
                .await
                .map_err(database_error::<Self>)?;
            Ok(id)
        }

        async fn has_unique_constraint<'a>(
            pool: &'a sqlx::Pool<Self>,
            sql: &'a Statements,
        ) -> Result<bool, Error> {
            let (found,): (i64,) = sqlx::query_as(AssertSqlSafe(sql.has_unique_constraint.clone()))
                .fetch_one(pool)
                .await
                .map_err(database_error::<Self>)?;
            Ok(found > 0)
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
            let newest = MIGRATIONS.last().map_or(0, |m| m.version);
            if current > newest {
                return Err(Error::Schema(format!(
                    "table {} is at version {current}, newer than the {newest} this \
                     version of justonce knows: upgrade justonce",
                    tables.migrations
                )));
            }
            let pending: Vec<_> = MIGRATIONS.iter().filter(|m| m.version > current).collect();
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
