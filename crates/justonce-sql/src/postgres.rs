//! PostgreSQL: one round trip per claim, `unnest` for batches, an advisory lock for
//! migrations.

use crate::backend::{
    Backend, Batch, Change, ClaimAndForward, ClaimRow, Clock, ForwardFailed, KeyCount, LeaseRow,
    LeaseState, Migration, NewOutboxRow, OffsetRow, OffsetTuple, OutboxRow, OutboxTuple, Sealed,
    Specific, Statements, Stored, StoredOffset, Wakeups, Which, bind_identity, bind_lease,
    common_queries, database_error, pending_migrations, shared_queries, vanished,
};
use crate::tables::Tables;
use crate::tls::{Dialect, Protection, Target, TlsOptions};
use justonce_core::{Consumer, Error, Fingerprint, Identity, Offset, Scope};
use sqlx::postgres::{PgConnectOptions, PgListener, PgSslMode};
use sqlx::{AssertSqlSafe, Postgres};
use std::sync::Arc;

impl Sealed for Postgres {}

/// libpq's names for PostgreSQL's TLS settings, as sqlx reads them.
pub(crate) static TLS: Dialect = Dialect {
    name: "PostgreSQL",
    mode: &["sslmode", "ssl-mode"],
    verify_full: "verify-full",
    disable: "disable",
    ca: &["sslrootcert", "ssl-root-cert", "ssl-ca"],
    client: [&["sslcert", "ssl-cert"], &["sslkey", "ssl-key"]],
    protection: |mode| match mode {
        // sqlx connects in plain text for `allow`.
        "disable" | "allow" => Some(Protection::Plain),
        "prefer" => Some(Protection::Opportunistic),
        "require" => Some(Protection::Unverified),
        "verify-ca" => Some(Protection::CaOnly),
        "verify-full" => Some(Protection::Full),
        _ => None,
    },
    // 28000 invalid_authorization_specification: no pg_hba.conf line lets a connection
    // without encryption in ("no encryption"; "SSL off" before PostgreSQL 14).
    refused_plain_text: |error| {
        error.code().as_deref() == Some("28000")
            && (error.message().contains("no encryption") || error.message().contains("SSL off"))
    },
    wants_client_certificate: |error| {
        error.code().as_deref() == Some("28000")
            && error
                .message()
                .contains("requires a valid client certificate")
    },
};

impl TlsOptions for PgConnectOptions {
    const MODE_VARIABLE: Option<&'static str> = Some("PGSSLMODE");

    fn host(&self) -> &str {
        self.get_host()
    }

    fn is_socket(&self) -> bool {
        self.get_socket().is_some()
    }

    fn verify_full(self) -> Self {
        self.ssl_mode(PgSslMode::VerifyFull)
    }
}

const CLOCK: Clock = Clock {
    now: "now()",
    later_by: |millis| format!("now() + {millis} * interval '1 millisecond'"),
    earlier_by: |millis| format!("now() - {millis} * interval '1 millisecond'"),
    age_ms: |column| format!("(extract(epoch FROM now() - {column}) * 1000)::bigint"),
};

const MIGRATION_SETUP: &[&str] = &[
    // Each `IF NOT EXISTS` that finds its object says so in a notice, at every start.
    "SET LOCAL client_min_messages = warning",
    // Serialises migrators of one prefix across processes until the transaction ends.
    "SELECT pg_advisory_xact_lock(hashtext('justonce:{prefix}'))",
    "CREATE TABLE IF NOT EXISTS {prefix}migrations (
        version bigint PRIMARY KEY,
        description text NOT NULL,
        applied_at timestamptz NOT NULL DEFAULT now()
    )",
];

const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "keys, outbox and offsets",
        // "C" collation: keys compare byte for byte, as documented, and index faster.
        sql: "
CREATE TABLE IF NOT EXISTS {prefix}keys (
    scope text COLLATE \"C\" NOT NULL,
    consumer text COLLATE \"C\" NOT NULL,
    key text COLLATE \"C\" NOT NULL,
    fingerprint bytea NOT NULL,
    claim_id bigint NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, consumer, key)
);
CREATE INDEX IF NOT EXISTS {prefix}keys_purge ON {prefix}keys (consumer, processed_at);
CREATE TABLE IF NOT EXISTS {prefix}outbox (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope text NOT NULL,
    key text NOT NULL,
    destination text NOT NULL,
    payload bytea NOT NULL,
    headers text NOT NULL DEFAULT '[]',
    created_at timestamptz NOT NULL DEFAULT now(),
    attempts bigint NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    sent_at timestamptz,
    last_error text,
    lease_token bigint,
    dead boolean NOT NULL DEFAULT false
);
CREATE INDEX IF NOT EXISTS {prefix}outbox_due ON {prefix}outbox (next_attempt_at, id)
    WHERE sent_at IS NULL AND NOT dead;
CREATE INDEX IF NOT EXISTS {prefix}outbox_sent ON {prefix}outbox (sent_at)
    WHERE sent_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS {prefix}offsets (
    consumer text COLLATE \"C\" NOT NULL,
    stream text COLLATE \"C\" NOT NULL,
    partition_id integer NOT NULL,
    position bigint NOT NULL,
    sequence bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, stream, partition_id)
);
",
    },
    Migration {
        version: 2,
        description: "leases: fencing token, expiry and result on keys",
        sql: "
ALTER TABLE {prefix}keys
    ADD COLUMN token bigint NOT NULL DEFAULT 0,
    ADD COLUMN lease_until timestamptz,
    ADD COLUMN result bytea;
",
    },
    Migration {
        version: 3,
        description: "breakers: the destinations a relay backed off",
        sql: "
CREATE TABLE IF NOT EXISTS {prefix}breakers (
    destination text COLLATE \"C\" PRIMARY KEY,
    failures bigint NOT NULL,
    open_until timestamptz NOT NULL,
    updated_at timestamptz NOT NULL
);
",
    },
];

#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
impl Backend for Postgres {
    const BEGIN: &'static str = "BEGIN";
    const ONE_WRITER: bool = false;

    type Statements = Statements;

    fn statements(tables: &Tables) -> Statements {
        let Tables { keys, outbox, .. } = tables;
        // One index lookup per key of a batch, whatever the planner knows of the table: its
        // generic plan for `key = ANY($3)` can instead test every row of the consumer
        // against every key (40 times slower with 16,000 keys stored, and growing).
        let find_one = format!(
            "SELECT key, claim_id, fingerprint FROM {keys}
             WHERE scope = $1 AND consumer = $2 AND key = batch.key
             LIMIT 1"
        );
        let specific = Specific {
            // The second SELECT reads the holder of a key that was committed before this
            // statement began. A holder that commits while the INSERT waits for it is not
            // in this statement's snapshot: the statement returns no row, and the caller
            // asks again with `find`.
            claim: format!(
                "WITH inserted AS (
                    INSERT INTO {keys} (scope, consumer, key, fingerprint, claim_id)
                    VALUES ($1, $2, $3, $4, $5)
                    ON CONFLICT (scope, consumer, key) DO NOTHING
                    RETURNING claim_id, fingerprint
                 )
                 SELECT claim_id, fingerprint FROM inserted
                 UNION ALL
                 SELECT claim_id, fingerprint FROM {keys}
                 WHERE scope = $1 AND consumer = $2 AND key = $3
                   AND NOT EXISTS (SELECT FROM inserted)"
            ),
            // Rows are inserted, and so locked, in key order: two batches that share keys
            // wait for each other instead of deadlocking. The same statement reads the keys
            // that were not inserted, as held before it began (its snapshot does not see
            // its own inserts); a key committed by another transaction while it ran is in
            // neither half, and is read with find_many.
            insert_many: format!(
                "WITH inserted AS (
                    INSERT INTO {keys} (scope, consumer, key, fingerprint, claim_id)
                    SELECT $1, $2, batch.key, batch.fingerprint, $5
                    FROM unnest($3::text[], $4::bytea[]) AS batch (key, fingerprint)
                    ORDER BY batch.key COLLATE \"C\"
                    ON CONFLICT (scope, consumer, key) DO NOTHING
                    RETURNING key
                 )
                 SELECT key, NULL::bigint, NULL::bytea FROM inserted
                 UNION ALL
                 SELECT held.key, held.claim_id, held.fingerprint
                 FROM unnest($3::text[]) AS batch (key)
                 CROSS JOIN LATERAL ({find_one}) AS held
                 WHERE batch.key NOT IN (SELECT key FROM inserted)"
            ),
            find_many: format!(
                "SELECT held.key, held.claim_id, held.fingerprint
                 FROM unnest($3::text[]) AS batch (key)
                 CROSS JOIN LATERAL ({find_one}) AS held"
            ),
            has_unique_constraint: format!(
                "SELECT count(*) FROM pg_index AS i
                 WHERE i.indrelid = to_regclass('{keys}')
                   AND i.indisunique AND i.indpred IS NULL AND i.indnkeyatts = 3
                   AND (SELECT array_agg(a.attname::text ORDER BY a.attname)
                        FROM pg_attribute AS a
                        WHERE a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey))
                       = ARRAY['consumer', 'key', 'scope']"
            ),
            purge_keys: format!(
                "DELETE FROM {keys} WHERE (scope, consumer, key) IN (
                    SELECT scope, consumer, key FROM {keys}
                    WHERE consumer = $1
                      AND processed_at < now() - $2 * interval '1 millisecond'
                    LIMIT $3
                    FOR UPDATE SKIP LOCKED
                 )"
            ),
            // The claim as above, the outbox row written only when the key was inserted, and
            // the relays woken only then: the scalar subquery makes the notification run.
            claim_and_forward: Some(format!(
                "WITH inserted AS (
                    INSERT INTO {keys} (scope, consumer, key, fingerprint, claim_id)
                    VALUES ($1, $2, $3, $4, $5)
                    ON CONFLICT (scope, consumer, key) DO NOTHING
                    RETURNING claim_id, fingerprint
                 ), queued AS (
                    INSERT INTO {outbox} (scope, key, destination, payload, headers)
                    SELECT $1, $3, $6, $7, $8 FROM inserted
                    RETURNING id
                 ), notified AS (SELECT pg_notify('{outbox}', '') FROM queued)
                 SELECT claim_id, fingerprint FROM inserted
                 WHERE (SELECT count(*) FROM notified) = 1
                 UNION ALL
                 SELECT claim_id, fingerprint FROM {keys}
                 WHERE scope = $1 AND consumer = $2 AND key = $3
                   AND NOT EXISTS (SELECT FROM inserted)"
            )),
            // One notification per channel and transaction, whatever the number of rows:
            // PostgreSQL folds identical ones.
            enqueue: format!(
                "WITH inserted AS (
                    INSERT INTO {outbox} (scope, key, destination, payload, headers)
                    VALUES ($1, $2, $3, $4, $5)
                    RETURNING id
                 ), notified AS (SELECT pg_notify('{outbox}', ''))
                 SELECT id FROM inserted, notified"
            ),
            skip_locked: "FOR UPDATE SKIP LOCKED",
            texts_of: |array| format!("SELECT json_array_elements_text({array}::json)"),
        };
        Statements::new(tables, &CLOCK, specific)
    }

    async fn outbox_wakeups<'a>(
        pool: &'a sqlx::Pool<Self>,
        tables: &'a Tables,
    ) -> Result<Wakeups, Error> {
        let mut listener = PgListener::connect_with(pool)
            .await
            .map_err(database_error::<Self>)?;
        listener
            .listen(&tables.outbox)
            .await
            .map_err(database_error::<Self>)?;
        Ok(Wakeups {
            listener: Some(listener),
        })
    }

    async fn connect(
        url: &str,
        pool: sqlx::pool::PoolOptions<Self>,
    ) -> Result<sqlx::Pool<Self>, Error> {
        let target = Target::<PgConnectOptions>::parse(url, &TLS)?;
        target.connect_pool(pool, database_error::<Self>).await
    }

    fn claim_and_forward<'a>(
        pool: &'a sqlx::Pool<Self>,
        sql: &'a Statements,
        row: ClaimRow<'a>,
        outbox: NewOutboxRow<'a>,
    ) -> Option<ClaimAndForward<'a>> {
        let statement = sql.claim_and_forward.clone()?;
        Some(Box::pin(async move {
            let id = row.identity;
            let mut conn = pool.acquire().await.map_err(ForwardFailed::Connect)?;
            sqlx::query_as(AssertSqlSafe(statement))
                .bind(id.scope.as_str())
                .bind(id.consumer.as_str())
                .bind(id.key.as_str())
                .bind(row.fingerprint.as_bytes().as_slice())
                .bind(row.claim_id)
                .bind(outbox.destination)
                .bind(outbox.payload)
                .bind(outbox.headers)
                .fetch_optional(&mut *conn)
                .await
                .map_err(ForwardFailed::Statement)
        }))
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
                .map_err(database_error::<Self>)?;
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

    async fn find_many<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        scope: &'a Scope,
        consumer: &'a Consumer,
        keys: &'a [&'a str],
    ) -> Result<Vec<(String, Stored)>, Error> {
        let rows: Vec<(String, i64, Vec<u8>)> =
            sqlx::query_as(AssertSqlSafe(sql.find_many.clone()))
                .bind(scope.as_str())
                .bind(consumer.as_str())
                .bind(keys)
                .fetch_all(conn)
                .await
                .map_err(database_error::<Self>)?;
        rows.into_iter()
            .map(|(key, claim_id, fingerprint)| Ok((key, Stored::decode(claim_id, fingerprint)?)))
            .collect()
    }

    fn is_retryable(error: &sqlx::Error) -> bool {
        // 40001 serialization_failure, 40P01 deadlock_detected, 55P03 lock_not_available.
        let code = error.as_database_error().and_then(|e| e.code());
        matches!(code.as_deref(), Some("40001" | "40P01" | "55P03"))
    }

    async fn bound_lock_waits(conn: &mut Self::Connection) -> Result<(), Error> {
        // A lock timeout (55P03) is retried like any transient failure.
        sqlx::raw_sql("SET LOCAL lock_timeout = '10s'")
            .execute(conn)
            .await
            .map(drop)
            .map_err(database_error::<Self>)
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

    shared_queries!();
    common_queries!();
}
