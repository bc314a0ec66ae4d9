//! PostgreSQL: one round trip per claim, `unnest` for batches, an advisory lock for
//! migrations.

mod failover;
mod migrations;
mod sql;
mod tls;

use crate::backend::{
    Backend, ForwardFailed, GroupStatement, OneStatement, OneStatementAnswer, Sealed, Watcher,
};
use crate::common::bind_claim;
use crate::effect;
use crate::numbered::{self, Statements, migrate_in_transaction};
use crate::rows::{Batch, ClaimRow, NewOutboxRow, OffsetRow, Schema, Stored, Wakeups};
use crate::shared::driver_error;
use crate::tables::Tables;
use crate::tls::Target;
use justonce_core::{Consumer, Error, Scope};
use sqlx::postgres::{PgArguments, PgConnectOptions, PgListener};
use sqlx::{AssertSqlSafe, Postgres};
use std::sync::Arc;

/// Checks the host list and `target_session_attrs` of a PostgreSQL URL without connecting
/// or reading any file: an empty entry in the list, or a `target_session_attrs` that would
/// choose a server refusing writes, is an [`Error::Config`] that says why.
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub fn check_postgres_hosts(url: &str) -> Result<(), Error> {
    failover::split(url).map(drop)
}

impl Sealed for Postgres {}

/// A row of the claim that moves offsets: a key, with its holder's claim id and
/// fingerprint unless this batch inserted it; or, with no key, the offsets moved.
type ClaimedAtOffsets = (Option<String>, Option<i64>, Option<Vec<u8>>, Option<i64>);

#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
impl Backend for Postgres {
    const BEGIN: &'static str = "BEGIN";
    const ONE_WRITER: bool = false;
    const NOTIFIES: bool = true;

    const SCHEMA: Schema = migrations::SCHEMA;

    type Statements = Statements;

    fn statements(tables: &Tables) -> Statements {
        sql::statements(tables)
    }

    async fn outbox_wakeups<'a>(
        pool: &'a sqlx::Pool<Self>,
        tables: &'a Tables,
    ) -> Result<Wakeups, Error> {
        let mut listener = PgListener::connect_with(pool)
            .await
            .map_err(driver_error::<Self>)?;
        listener
            .listen(&tables.outbox)
            .await
            .map_err(driver_error::<Self>)?;
        Ok(Wakeups {
            listener: Some(listener),
            ..Wakeups::none()
        })
    }

    async fn notify_relays<'a>(pool: &'a sqlx::Pool<Self>, channel: &'a str) -> Result<(), Error> {
        sqlx::query("SELECT pg_notify($1, '')")
            .bind(channel)
            .execute(pool)
            .await
            .map(drop)
            .map_err(driver_error::<Self>)
    }

    async fn connect(
        url: &str,
        pool: sqlx::pool::PoolOptions<Self>,
    ) -> Result<(sqlx::Pool<Self>, Option<Watcher>), Error> {
        if let Some(hosts) = failover::Hosts::parse(url)? {
            let (pool, watcher) = failover::connect(hosts, pool).await?;
            return Ok((pool, Some(watcher)));
        }
        let target = Target::<PgConnectOptions>::parse(url, &tls::TLS)?;
        let pool = target.connect_pool(pool, driver_error::<Self>).await?;
        Ok((pool, None))
    }

    fn claim_and_forward<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Statements,
        row: ClaimRow<'a>,
        outbox: NewOutboxRow<'a>,
    ) -> Option<OneStatement<'a, ()>> {
        let statement = sql.claim_and_forward.clone()?;
        Some(Box::pin(async move {
            let mut conn = pool.acquire().await.map_err(ForwardFailed::Connect)?;
            let (_, claim_id, fingerprint): Held =
                bind_claim(sqlx::query_as(AssertSqlSafe(statement)), row)
                    .bind(outbox.destination)
                    .bind(outbox.payload)
                    .bind(outbox.headers)
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(ForwardFailed::Statement)?;
            Ok(claim_id
                .zip(fingerprint)
                .map(|(claim_id, fingerprint)| (claim_id, fingerprint, ())))
        }))
    }

    fn claim_and_forward_many<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Statements,
        calls: &'a [(ClaimRow<'a>, NewOutboxRow<'a>)],
    ) -> Option<GroupStatement<'a>> {
        let statement = sql.claim_and_forward_many.clone()?;
        let claim_id = calls.first()?.0.claim_id;
        Some(Box::pin(async move {
            let column = |of: fn(&'a (ClaimRow<'a>, NewOutboxRow<'a>)) -> &'a str| -> Vec<&'a str> {
                calls.iter().map(of).collect()
            };
            let fingerprints: Vec<&[u8]> = calls
                .iter()
                .map(|(claim, _)| claim.fingerprint.as_bytes().as_slice())
                .collect();
            let payloads: Vec<&[u8]> = calls.iter().map(|(_, row)| row.payload).collect();
            let mut conn = pool.acquire().await.map_err(ForwardFailed::Connect)?;
            let rows: Vec<Held> = sqlx::query_as(AssertSqlSafe(statement))
                .bind(column(|(claim, _)| claim.identity.scope.as_str()))
                .bind(column(|(claim, _)| claim.identity.consumer.as_str()))
                .bind(column(|(claim, _)| claim.identity.key.as_str()))
                .bind(fingerprints)
                .bind(column(|(_, row)| row.destination))
                .bind(payloads)
                .bind(column(|(_, row)| row.headers.as_str()))
                .bind(claim_id)
                .fetch_all(&mut *conn)
                .await
                .map_err(ForwardFailed::Statement)?;
            let mut held = vec![None; calls.len()];
            for (place, claim_id, fingerprint) in rows {
                let index = usize::try_from(place - 1).ok();
                if let Some(slot) = index.and_then(|index| held.get_mut(index)) {
                    *slot = claim_id.zip(fingerprint);
                }
            }
            Ok(held)
        }))
    }

    fn claim_with_effect_sql(tables: &Tables, effect: &str, binds: usize) -> Option<String> {
        // The effect's own binds come first: the claim's are numbered after them.
        Some(sql::claim_with_effect(&tables.keys, effect, binds))
    }

    async fn claim_with_effect<'a>(
        pool: &'a sqlx::Pool<Self>,
        statement: Arc<str>,
        row: ClaimRow<'a>,
        arguments: PgArguments,
    ) -> OneStatementAnswer<Option<u64>> {
        let mut conn = pool.acquire().await.map_err(ForwardFailed::Connect)?;
        let claim = sqlx::query_as_with(AssertSqlSafe(statement), arguments);
        let stored: Option<(Option<i64>, Option<Vec<u8>>, i64)> = bind_claim(claim, row)
            .fetch_optional(&mut *conn)
            .await
            .map_err(unclaimed_effect)?;
        Ok(stored.and_then(|(claim_id, fingerprint, changed)| {
            Some((claim_id?, fingerprint?, Some(changed.unsigned_abs())))
        }))
    }

    async fn execute_effect(
        conn: &mut Self::Connection,
        sql: String,
        arguments: PgArguments,
    ) -> Result<u64, sqlx::Error> {
        effect::execute::<Self>(conn, sql, arguments).await
    }

    async fn insert_many<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        batch: &'a Batch<'a>,
    ) -> Result<Vec<(String, Stored)>, Error> {
        let fingerprints: Vec<&[u8]> = batch
            .fingerprints
            .iter()
            .map(|fingerprint| fingerprint.as_bytes().as_slice())
            .collect();
        // An inserted key comes back without its row: the batch knows it.
        let rows: Vec<(String, Option<i64>, Option<Vec<u8>>)> =
            sqlx::query_as(AssertSqlSafe(sql.insert_many.clone()))
                .bind(batch.scope.as_str())
                .bind(batch.consumer.as_str())
                .bind(&batch.keys)
                .bind(&fingerprints)
                .bind(batch.claim_id)
                .fetch_all(conn)
                .await
                .map_err(driver_error::<Self>)?;
        let mut inserted = Vec::new();
        let mut known = Vec::with_capacity(rows.len());
        for (key, claim_id, fingerprint) in rows {
            match claim_id.zip(fingerprint) {
                Some((claim_id, fingerprint)) => {
                    known.push((key, Stored::decode(claim_id, fingerprint)?));
                }
                None => inserted.push(key),
            }
        }
        known.extend(batch.inserted(inserted));
        Ok(known)
    }

    async fn insert_many_at<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        batch: &'a Batch<'a>,
        offsets: &'a [OffsetRow<'a>],
    ) -> Result<(Vec<(String, Stored)>, bool), Error> {
        let Some(statement) = sql
            .insert_many_at_offsets
            .clone()
            .filter(|_| !offsets.is_empty())
        else {
            return Ok((Self::insert_many(conn, sql, batch).await?, true));
        };
        let fingerprints: Vec<&[u8]> = batch
            .fingerprints
            .iter()
            .map(|fingerprint| fingerprint.as_bytes().as_slice())
            .collect();
        let column = |of: fn(&OffsetRow<'a>) -> i64| offsets.iter().map(of).collect::<Vec<_>>();
        // The row with no key counts the offsets moved; an inserted key comes back
        // without its row, as from `insert_many`.
        let rows: Vec<ClaimedAtOffsets> = sqlx::query_as(AssertSqlSafe(statement))
            .bind(batch.scope.as_str())
            .bind(batch.consumer.as_str())
            .bind(&batch.keys)
            .bind(&fingerprints)
            .bind(batch.claim_id)
            .bind(offsets.iter().map(|at| at.stream).collect::<Vec<_>>())
            .bind(offsets.iter().map(|at| at.partition).collect::<Vec<_>>())
            .bind(column(|at| at.offset.position))
            .bind(column(|at| at.offset.sequence))
            .bind(column(|at| at.above.position))
            .bind(column(|at| at.above.sequence))
            .fetch_all(conn)
            .await
            .map_err(driver_error::<Self>)?;
        let mut moved = 0;
        let mut inserted = Vec::new();
        let mut known = Vec::with_capacity(rows.len());
        for (key, claim_id, fingerprint, moves) in rows {
            match (key, claim_id.zip(fingerprint)) {
                (None, _) => moved = moves.unwrap_or_default(),
                (Some(key), Some((claim_id, fingerprint))) => {
                    known.push((key, Stored::decode(claim_id, fingerprint)?));
                }
                (Some(key), None) => inserted.push(key),
            }
        }
        known.extend(batch.inserted(inserted));
        Ok((known, moved == offsets.len() as i64))
    }

    async fn forward_many<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        rows: &'a [NewOutboxRow<'a>],
    ) -> Result<(), Error> {
        let scopes: Vec<&str> = rows.iter().map(|row| row.scope).collect();
        let keys: Vec<&str> = rows.iter().map(|row| row.key).collect();
        let destinations: Vec<&str> = rows.iter().map(|row| row.destination).collect();
        let payloads: Vec<&[u8]> = rows.iter().map(|row| row.payload).collect();
        let headers: Vec<&str> = rows.iter().map(|row| row.headers.as_str()).collect();
        sqlx::query(AssertSqlSafe(sql.forward_many.clone()))
            .bind(scopes)
            .bind(keys)
            .bind(destinations)
            .bind(payloads)
            .bind(headers)
            .execute(conn)
            .await
            .map(drop)
            .map_err(driver_error::<Self>)
    }

    async fn find_many<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        scope: &'a Scope,
        consumer: &'a Consumer,
        keys: &'a [&'a str],
    ) -> Result<Vec<(String, Stored)>, Error> {
        numbered::find_many::<Self, _>(conn, sql, scope, consumer, keys).await
    }

    async fn record_first_runs<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Statements,
        scope: &'a Scope,
        consumer: &'a Consumer,
        keys: &'a [&'a str],
    ) -> Result<u64, Error> {
        numbered::record_first_runs::<Self, _>(pool, sql, scope, consumer, keys).await
    }

    fn rows_affected(done: &Self::QueryResult) -> u64 {
        done.rows_affected()
    }

    fn is_retryable(error: &sqlx::Error) -> bool {
        // 40001 serialization_failure, 40P01 deadlock_detected, 55P03 lock_not_available.
        // A read-only server is a standby now: a new transaction goes to the primary once
        // the pool has found it.
        let code = error.as_database_error().and_then(|e| e.code());
        matches!(code.as_deref(), Some("40001" | "40P01" | "55P03")) || Self::refuses_writes(error)
    }

    fn refuses_writes(error: &sqlx::Error) -> bool {
        // 25006 read_only_sql_transaction.
        let code = error.as_database_error().and_then(|e| e.code());
        code.as_deref() == Some("25006")
    }

    async fn bound_lock_waits(conn: &mut Self::Connection) -> Result<(), Error> {
        // A lock timeout (55P03) is retried like any transient failure.
        sqlx::raw_sql("SET LOCAL lock_timeout = '10s'")
            .execute(conn)
            .await
            .map(drop)
            .map_err(driver_error::<Self>)
    }

    fn is_commit_unknown(error: &sqlx::Error) -> bool {
        match error {
            // 08: connection exception; 57P01-57P03: the server is shutting down or
            // restarting. Either may come after the commit was made durable.
            sqlx::Error::Database(error) => error
                .code()
                .is_some_and(|code| code.starts_with("08") || code.starts_with("57P")),
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::WorkerCrashed => true,
            _ => false,
        }
    }

    async fn migrate<'a>(pool: &'a sqlx::Pool<Self>, tables: &'a Tables) -> Result<usize, Error> {
        migrate_in_transaction(pool, tables).await
    }
}

/// A row of a claim-and-forward statement: the call's place (from 1), and the claim id and
/// fingerprint of the row holding its key, NULL where that row was not seen.
type Held = (i64, Option<i64>, Option<Vec<u8>>);

/// A failure of [`sql::claim_with_effect`]'s guard as the caller's statement's fault; any
/// other failure as it is.
fn unclaimed_effect(error: sqlx::Error) -> ForwardFailed {
    let guard = error
        .as_database_error()
        .is_some_and(|error| error.message().contains(sql::UNCLAIMED_EFFECT));
    if guard {
        return ForwardFailed::Invalid(
            "it changed rows for a key it did not claim, so it does not read `claimed` as a \
             relation: name it after FROM or JOIN"
                .to_owned(),
        );
    }
    ForwardFailed::Statement(error)
}
