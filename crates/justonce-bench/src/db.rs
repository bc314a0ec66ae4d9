//! The statements the bench writes by hand, per database, beside the library's.

use anyhow::{Result, bail, ensure};
use justonce_sql::sqlx::{self, AssertSqlSafe, MySql, Postgres, Sqlite};
use justonce_sql::statements::{self, ClaimMany};
use justonce_sql::{Backend, Effect, Fingerprint};
use std::future::Future;
use std::time::Duration;

/// The bench's consumer, in the statements it binds.
pub(crate) const CONSUMER: &str = "bench";

/// The bench's tables: justonce's, under the bench's prefix, and the effects; and the
/// statements `claim_many` sends to them.
#[derive(Clone)]
pub(crate) struct BenchTables {
    pub(crate) keys: String,
    pub(crate) effects: String,
    pub(crate) outbox: String,
    pub(crate) all: Vec<String>,
    pub(crate) claim_many: ClaimMany,
}

impl BenchTables {
    pub(crate) fn new(prefix: &str, claim_many: ClaimMany) -> Self {
        let all = [
            "effects",
            "outbox",
            "offsets",
            "breakers",
            "replays",
            "duplicates",
            "runs",
            "keys",
            "migrations",
        ]
        .map(|table| format!("{prefix}{table}"))
        .to_vec();
        Self {
            keys: format!("{prefix}keys"),
            effects: format!("{prefix}effects"),
            outbox: format!("{prefix}outbox"),
            all,
            claim_many,
        }
    }
}

/// The statements the bench writes by hand, per database.
pub(crate) trait BenchDb: Backend {
    const LABEL: &'static str;
    /// The outbox's key column, quoted where `key` is a reserved word.
    const OUTBOX_KEY: &'static str = "key";
    /// Whether the claim and the effect fit in one statement: [`BenchDb::one_statement`].
    const HAS_ONE_STATEMENT: bool = false;
    /// The statement that empties a table, followed by its name. A DELETE would leave the
    /// rows dead but in the table and its indexes until vacuumed (PostgreSQL) or purged
    /// (InnoDB), where the next mode's inserts of the same keys step over them.
    const EMPTY: &'static str = "TRUNCATE TABLE";

    /// The statements `claim_many` sends to the tables under `prefix`.
    fn claim_many(prefix: &str) -> Result<ClaimMany>;

    async fn create_effects(pool: &sqlx::Pool<Self>, table: &str) -> Result<()>;

    /// Send, for the work of [`Inbox::run`].
    fn insert_effect<'a>(
        tx: &'a mut sqlx::Transaction<'_, Self>,
        table: &'a str,
        key: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// The same effect row as [`Inbox::run_effect`] takes it: written only when `claimed`
    /// has its row.
    fn effect(table: &str, key: &str) -> Effect<Self>;

    /// Inserts the key; false if it was there.
    async fn hand_claim(
        tx: &mut sqlx::Transaction<'_, Self>,
        table: &str,
        key: &str,
        fingerprint: &Fingerprint,
    ) -> Result<bool>;

    /// A batch insert of these sorted, distinct keys, sent by hand in the transaction;
    /// returns the keys it inserted.
    async fn hand_claim_many(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
        fingerprints: &[Fingerprint],
        claim_id: i64,
    ) -> Result<Vec<String>>;

    /// The statements `claim_many` sends to claim these sorted, distinct keys and to read
    /// the keys already held, sent by hand in the transaction; returns the keys inserted,
    /// and each held key's claim id and fingerprint.
    async fn hand_claim_many_reading(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
        fingerprints: &[Fingerprint],
        claim_id: i64,
    ) -> Result<(Vec<String>, Vec<Held>)> {
        let inserted = Self::hand_claim_many(tx, tables, keys, fingerprints, claim_id).await?;
        let rest = not_among(keys, inserted.iter().map(String::as_str));
        // As claim_many, no read when every key was inserted.
        let held = if rest.is_empty() {
            Vec::new()
        } else {
            Self::hand_find_many(tx, tables, &rest).await?
        };
        Ok((inserted, held))
    }

    /// The claim id and fingerprint of each of these keys that is held, read with the
    /// statement `claim_many` reads them with.
    async fn hand_find_many(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
    ) -> Result<Vec<Held>>;

    /// An effect row for each key, in one multi-row INSERT as a batched consumer writes
    /// them (more only past the database's limit on bound parameters).
    async fn insert_effects(
        tx: &mut sqlx::Transaction<'_, Self>,
        table: &str,
        keys: &[&str],
    ) -> Result<()>;

    /// The claim and the effect in one statement, where `HAS_ONE_STATEMENT`.
    async fn one_statement(
        _pool: &sqlx::Pool<Self>,
        _tables: &BenchTables,
        _key: &str,
        _fingerprint: &Fingerprint,
    ) -> Result<()> {
        bail!(
            "{} has no statement that both claims and writes the effect",
            Self::LABEL
        )
    }

    /// Inserts keys `fill:<from>` to `fill:<to - 1>` of the bench's consumer, processed
    /// `age` ago, in one statement.
    async fn fill(
        pool: &sqlx::Pool<Self>,
        table: &str,
        from: u64,
        to: u64,
        age: Duration,
    ) -> Result<()>;

    async fn execute(pool: &sqlx::Pool<Self>, sql: String) -> Result<()>;

    /// How far the server's write-ahead log (PostgreSQL's WAL, InnoDB's redo log) has come,
    /// in bytes: what every session of the server wrote, not only the bench's. `None` where
    /// there is no such position to read (SQLite).
    async fn log_position(pool: &sqlx::Pool<Self>) -> Result<Option<u64>>;

    /// What `table` and its indexes take on disk now, as the database counts it.
    async fn sizes(pool: &sqlx::Pool<Self>, table: &str) -> Result<Sizes>;

    async fn count(pool: &sqlx::Pool<Self>, table: &str) -> Result<i64>;

    /// Rows beyond the first for their key, in `column`.
    async fn doubled(pool: &sqlx::Pool<Self>, table: &str, column: &str) -> Result<i64>;
}

/// What a table takes on disk, in bytes.
pub(crate) struct Sizes {
    /// The rows: PostgreSQL's heap, InnoDB's clustered index (the primary key), SQLite's
    /// table b-tree.
    pub(crate) table: u64,
    /// Each index besides the rows, by name.
    pub(crate) indexes: Vec<(String, u64)>,
    /// The rows, the indexes, and on PostgreSQL the TOAST table and the free space and
    /// visibility maps.
    pub(crate) total: u64,
}

impl Sizes {
    /// The bytes of every index besides the rows.
    pub(crate) fn index_bytes(&self) -> u64 {
        self.indexes.iter().map(|(_, bytes)| bytes).sum()
    }
}

/// Sizes from the database's signed counts, which are never negative.
fn bytes(count: i64) -> Result<u64> {
    Ok(u64::try_from(count)?)
}

/// A held key, its claim id and its stored fingerprint.
pub(crate) type Held = (String, i64, Vec<u8>);

/// What `claim_many` checks of a batch's sorted, distinct `keys` after its statements:
/// each was either claimed (`claimed` of them) or read back as held, and each held key has
/// the fingerprint this batch sent for it; another one is a reused key.
pub(crate) fn check_held(
    keys: &[&str],
    fingerprints: &[Fingerprint],
    claimed: usize,
    held: &[Held],
) -> Result<()> {
    ensure!(
        claimed + held.len() == keys.len(),
        "{claimed} keys claimed and {} read back of {}",
        held.len(),
        keys.len()
    );
    for (key, _claim_id, stored) in held {
        let Ok(index) = keys.binary_search(&key.as_str()) else {
            bail!("{key} was read back but is not in the batch");
        };
        ensure!(
            fingerprints[index].as_bytes().as_slice() == stored.as_slice(),
            "{key} reused"
        );
    }
    Ok(())
}

/// The keys of `all` that are not among `some`.
pub(crate) fn not_among<'a, 'b>(
    all: &[&'a str],
    some: impl IntoIterator<Item = &'b str>,
) -> Vec<&'a str> {
    let some: std::collections::HashSet<&str> = some.into_iter().collect();
    all.iter()
        .copied()
        .filter(|key| !some.contains(key))
        .collect()
}

/// The batch insert of keys that `claim_many` sends to MariaDB and MySQL, by hand, in as
/// many statements as it splits the batch into.
pub(crate) async fn mysql_insert_keys(
    tx: &mut sqlx::Transaction<'_, MySql>,
    tables: &BenchTables,
    keys: &[&str],
    fingerprints: &[Fingerprint],
    claim_id: i64,
) -> Result<()> {
    let rows = statements::MYSQL_KEYS_PER_STATEMENT;
    for (keys, fingerprints) in keys.chunks(rows).zip(fingerprints.chunks(rows)) {
        let mut insert = sqlx::query(AssertSqlSafe(tables.claim_many.insert_many(keys.len())));
        for (key, fingerprint) in keys.iter().zip(fingerprints) {
            insert = insert
                .bind("")
                .bind(CONSUMER)
                .bind(*key)
                .bind(fingerprint.as_bytes().as_slice())
                .bind(claim_id);
        }
        insert.execute(&mut **tx).await?;
    }
    Ok(())
}

/// What runs the same on every database.
macro_rules! common {
    () => {
        async fn execute(pool: &sqlx::Pool<Self>, sql: String) -> Result<()> {
            sqlx::raw_sql(AssertSqlSafe(sql)).execute(pool).await?;
            Ok(())
        }

        async fn count(pool: &sqlx::Pool<Self>, table: &str) -> Result<i64> {
            let sql = format!("SELECT COUNT(*) FROM {table}");
            Ok(sqlx::query_scalar(AssertSqlSafe(sql))
                .fetch_one(pool)
                .await?)
        }

        async fn doubled(pool: &sqlx::Pool<Self>, table: &str, column: &str) -> Result<i64> {
            let sql = format!("SELECT COUNT(*) - COUNT(DISTINCT {column}) FROM {table}");
            Ok(sqlx::query_scalar(AssertSqlSafe(sql))
                .fetch_one(pool)
                .await?)
        }
    };
}

/// What PostgreSQL and SQLite write the same way, with `$n` parameters.
macro_rules! dollar_parameters {
    () => {
        async fn create_effects(pool: &sqlx::Pool<Self>, table: &str) -> Result<()> {
            Self::execute(
                pool,
                format!("CREATE TABLE {table} (effect_key TEXT NOT NULL)"),
            )
            .await
        }

        async fn insert_effect(
            tx: &mut sqlx::Transaction<'_, Self>,
            table: &str,
            key: &str,
        ) -> Result<(), sqlx::Error> {
            let sql = format!("INSERT INTO {table} (effect_key) VALUES ($1)");
            sqlx::query(AssertSqlSafe(sql))
                .bind(key)
                .execute(&mut **tx)
                .await
                .map(drop)
        }

        fn effect(table: &str, key: &str) -> Effect<Self> {
            Effect::new(format!(
                "INSERT INTO {table} (effect_key) SELECT $1 FROM claimed"
            ))
            .bind(key.to_owned())
        }

        async fn hand_claim(
            tx: &mut sqlx::Transaction<'_, Self>,
            table: &str,
            key: &str,
            fingerprint: &Fingerprint,
        ) -> Result<bool> {
            let sql = format!(
                "INSERT INTO {table} (scope, consumer, key, fingerprint, claim_id)
                 VALUES ('', 'bench', $1, $2, 0) ON CONFLICT DO NOTHING"
            );
            let done = sqlx::query(AssertSqlSafe(sql))
                .bind(key)
                .bind(fingerprint.as_bytes().as_slice())
                .execute(&mut **tx)
                .await?;
            Ok(done.rows_affected() == 1)
        }
    };
}

impl BenchDb for Postgres {
    const LABEL: &'static str = "postgres";
    const HAS_ONE_STATEMENT: bool = true;

    fn claim_many(prefix: &str) -> Result<ClaimMany> {
        Ok(statements::postgres(prefix)?)
    }

    common!();

    dollar_parameters!();

    /// A plain insert of the batch, with no read of the keys already held.
    async fn hand_claim_many(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
        fingerprints: &[Fingerprint],
        claim_id: i64,
    ) -> Result<Vec<String>> {
        let sql = format!(
            "INSERT INTO {} (scope, consumer, key, fingerprint, claim_id)
             SELECT '', 'bench', batch.key, batch.fingerprint, $3
             FROM unnest($1::text[], $2::bytea[]) AS batch (key, fingerprint)
             ORDER BY batch.key COLLATE \"C\"
             ON CONFLICT (scope, consumer, key) DO NOTHING
             RETURNING key",
            tables.keys
        );
        let fingerprints: Vec<&[u8]> = fingerprints
            .iter()
            .map(|fingerprint| fingerprint.as_bytes().as_slice())
            .collect();
        Ok(sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(keys)
            .bind(&fingerprints)
            .bind(claim_id)
            .fetch_all(&mut **tx)
            .await?)
    }

    /// One statement, as `claim_many` sends it: the insert, and an index lookup for each key
    /// it did not insert. A key committed by another transaction while the insert waited
    /// is in neither half, and is read after.
    async fn hand_claim_many_reading(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
        fingerprints: &[Fingerprint],
        claim_id: i64,
    ) -> Result<(Vec<String>, Vec<Held>)> {
        let fingerprints: Vec<&[u8]> = fingerprints
            .iter()
            .map(|fingerprint| fingerprint.as_bytes().as_slice())
            .collect();
        let sql = tables.claim_many.insert_many(keys.len());
        let rows: Vec<(String, Option<i64>, Option<Vec<u8>>)> = sqlx::query_as(AssertSqlSafe(sql))
            .bind("")
            .bind(CONSUMER)
            .bind(keys)
            .bind(&fingerprints)
            .bind(claim_id)
            .fetch_all(&mut **tx)
            .await?;
        let (mut inserted, mut held) = (Vec::new(), Vec::new());
        for (key, claim_id, fingerprint) in rows {
            match claim_id.zip(fingerprint) {
                Some((claim_id, fingerprint)) => held.push((key, claim_id, fingerprint)),
                None => inserted.push(key),
            }
        }
        if inserted.len() + held.len() < keys.len() {
            let read = inserted.iter().chain(held.iter().map(|(key, ..)| key));
            let rest = not_among(keys, read.map(String::as_str));
            held.extend(Self::hand_find_many(tx, tables, &rest).await?);
        }
        Ok((inserted, held))
    }

    async fn hand_find_many(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
    ) -> Result<Vec<Held>> {
        let sql = tables.claim_many.find_many(keys.len());
        Ok(sqlx::query_as(AssertSqlSafe(sql))
            .bind("")
            .bind(CONSUMER)
            .bind(keys)
            .fetch_all(&mut **tx)
            .await?)
    }

    /// The keys as one array parameter: PostgreSQL's limit of 65,535 parameters never
    /// applies.
    async fn insert_effects(
        tx: &mut sqlx::Transaction<'_, Self>,
        table: &str,
        keys: &[&str],
    ) -> Result<()> {
        let sql = format!("INSERT INTO {table} (effect_key) SELECT unnest($1::text[])");
        sqlx::query(AssertSqlSafe(sql))
            .bind(keys)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn one_statement(
        pool: &sqlx::Pool<Self>,
        tables: &BenchTables,
        key: &str,
        fingerprint: &Fingerprint,
    ) -> Result<()> {
        let sql = format!(
            "WITH claimed AS (
                 INSERT INTO {} (scope, consumer, key, fingerprint, claim_id)
                 VALUES ('', 'bench', $1, $2, 0) ON CONFLICT DO NOTHING RETURNING key)
             INSERT INTO {} (effect_key) SELECT key FROM claimed",
            tables.keys, tables.effects
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(key)
            .bind(fingerprint.as_bytes().as_slice())
            .execute(pool)
            .await?;
        Ok(())
    }

    /// The position at which the next WAL record goes in, written out or not.
    async fn log_position(pool: &sqlx::Pool<Self>) -> Result<Option<u64>> {
        let lsn: i64 =
            sqlx::query_scalar("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint")
                .fetch_one(pool)
                .await?;
        Ok(Some(bytes(lsn)?))
    }

    async fn sizes(pool: &sqlx::Pool<Self>, table: &str) -> Result<Sizes> {
        let (heap, total): (i64, i64) = sqlx::query_as(
            "SELECT pg_relation_size($1::regclass), pg_total_relation_size($1::regclass)",
        )
        .bind(table)
        .fetch_one(pool)
        .await?;
        let indexes: Vec<(String, i64)> = sqlx::query_as(
            "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid)
             FROM pg_index WHERE indrelid = $1::regclass ORDER BY 1",
        )
        .bind(table)
        .fetch_all(pool)
        .await?;
        Ok(Sizes {
            table: bytes(heap)?,
            indexes: indexes
                .into_iter()
                .map(|(name, size)| Ok((name, bytes(size)?)))
                .collect::<Result<_>>()?,
            total: bytes(total)?,
        })
    }

    async fn fill(
        pool: &sqlx::Pool<Self>,
        table: &str,
        from: u64,
        to: u64,
        age: Duration,
    ) -> Result<()> {
        let sql = format!(
            "INSERT INTO {table} (scope, consumer, key, fingerprint, claim_id, processed_at)
             SELECT '', 'bench', 'fill:' || n, sha256(n::text::bytea), 0,
                    now() - make_interval(secs => $3)
             FROM generate_series($1::bigint, $2::bigint - 1) AS n"
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(i64::try_from(from)?)
            .bind(i64::try_from(to)?)
            .bind(age.as_secs_f64())
            .execute(pool)
            .await?;
        Ok(())
    }
}

impl BenchDb for Sqlite {
    const LABEL: &'static str = "sqlite";
    /// SQLite has no TRUNCATE: a DELETE without WHERE is its truncate, which drops the
    /// table's pages instead of rows one by one.
    const EMPTY: &'static str = "DELETE FROM";

    fn claim_many(prefix: &str) -> Result<ClaimMany> {
        Ok(statements::sqlite(prefix)?)
    }

    common!();

    dollar_parameters!();

    /// The insert `claim_many` sends, which returns the keys it inserted.
    async fn hand_claim_many(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
        fingerprints: &[Fingerprint],
        claim_id: i64,
    ) -> Result<Vec<String>> {
        let pairs: Vec<(&str, String)> = keys
            .iter()
            .zip(fingerprints)
            .map(|(key, fingerprint)| (*key, fingerprint.to_string()))
            .collect();
        let sql = tables.claim_many.insert_many(keys.len());
        Ok(sqlx::query_scalar(AssertSqlSafe(sql))
            .bind("")
            .bind(CONSUMER)
            .bind(claim_id)
            .bind(serde_json::to_string(&pairs)?)
            .fetch_all(&mut **tx)
            .await?)
    }

    async fn hand_find_many(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
    ) -> Result<Vec<Held>> {
        let sql = tables.claim_many.find_many(keys.len());
        Ok(sqlx::query_as(AssertSqlSafe(sql))
            .bind("")
            .bind(CONSUMER)
            .bind(serde_json::to_string(keys)?)
            .fetch_all(&mut **tx)
            .await?)
    }

    /// The keys as one JSON array, as claim_many sends them: SQLite's limit of 32,766
    /// parameters never applies.
    async fn insert_effects(
        tx: &mut sqlx::Transaction<'_, Self>,
        table: &str,
        keys: &[&str],
    ) -> Result<()> {
        let sql = format!("INSERT INTO {table} (effect_key) SELECT value FROM json_each($1)");
        sqlx::query(AssertSqlSafe(sql))
            .bind(serde_json::to_string(keys)?)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn log_position(_pool: &sqlx::Pool<Self>) -> Result<Option<u64>> {
        Ok(None)
    }

    /// The pages of each b-tree, from the `dbstat` table SQLite is built with.
    async fn sizes(pool: &sqlx::Pool<Self>, table: &str) -> Result<Sizes> {
        let rows: i64 =
            sqlx::query_scalar("SELECT coalesce(sum(pgsize), 0) FROM dbstat WHERE name = $1")
                .bind(table)
                .fetch_one(pool)
                .await?;
        let indexes: Vec<(String, i64)> = sqlx::query_as(
            "SELECT d.name, sum(d.pgsize) FROM dbstat d
             JOIN sqlite_master m ON m.name = d.name AND m.type = 'index'
             WHERE m.tbl_name = $1 GROUP BY d.name ORDER BY d.name",
        )
        .bind(table)
        .fetch_all(pool)
        .await?;
        let indexes: Vec<(String, u64)> = indexes
            .into_iter()
            .map(|(name, size)| Ok((name, bytes(size)?)))
            .collect::<Result<_>>()?;
        let table = bytes(rows)?;
        let total = table + indexes.iter().map(|(_, size)| size).sum::<u64>();
        Ok(Sizes {
            table,
            indexes,
            total,
        })
    }

    async fn fill(
        pool: &sqlx::Pool<Self>,
        table: &str,
        from: u64,
        to: u64,
        age: Duration,
    ) -> Result<()> {
        let sql = format!(
            "WITH RECURSIVE n(n) AS (SELECT $1 UNION ALL SELECT n + 1 FROM n WHERE n + 1 < $2)
             INSERT INTO {table} (scope, consumer, key, fingerprint, claim_id, processed_at)
             SELECT '', 'bench', 'fill:' || n, randomblob(32), 0,
                    CAST(unixepoch('subsec') * 1000 AS INTEGER) - $3
             FROM n"
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(i64::try_from(from)?)
            .bind(i64::try_from(to)?)
            .bind(i64::try_from(age.as_millis())?)
            .execute(pool)
            .await?;
        Ok(())
    }
}

impl BenchDb for MySql {
    const LABEL: &'static str = "mysql";
    const OUTBOX_KEY: &'static str = "`key`";

    fn claim_many(prefix: &str) -> Result<ClaimMany> {
        Ok(statements::mysql(prefix)?)
    }

    common!();

    async fn create_effects(pool: &sqlx::Pool<Self>, table: &str) -> Result<()> {
        Self::execute(
            pool,
            format!("CREATE TABLE {table} (effect_key VARBINARY(255) NOT NULL) ENGINE=InnoDB"),
        )
        .await
    }

    async fn insert_effect(
        tx: &mut sqlx::Transaction<'_, Self>,
        table: &str,
        key: &str,
    ) -> Result<(), sqlx::Error> {
        let sql = format!("INSERT INTO {table} (effect_key) VALUES (?)");
        sqlx::query(AssertSqlSafe(sql))
            .bind(key)
            .execute(&mut **tx)
            .await
            .map(drop)
    }

    fn effect(table: &str, key: &str) -> Effect<Self> {
        Effect::new(format!(
            "INSERT INTO {table} (effect_key) SELECT ? FROM claimed"
        ))
        .bind(key.to_owned())
    }

    /// A plain INSERT whose duplicate-key error is caught, as justonce's claim is: MySQL
    /// reports an ignored duplicate unreliably through sqlx's found-rows flag.
    async fn hand_claim(
        tx: &mut sqlx::Transaction<'_, Self>,
        table: &str,
        key: &str,
        fingerprint: &Fingerprint,
    ) -> Result<bool> {
        let sql = format!(
            "INSERT INTO {table} (scope, consumer, `key`, fingerprint, claim_id, processed_at)
             VALUES ('', 'bench', ?, ?, 0, UTC_TIMESTAMP(6))"
        );
        let inserted = sqlx::query(AssertSqlSafe(sql))
            .bind(key)
            .bind(fingerprint.as_bytes().as_slice())
            .execute(&mut **tx)
            .await;
        match inserted {
            Ok(_) => Ok(true),
            Err(sqlx::Error::Database(error)) if error.is_unique_violation() => Ok(false),
            Err(error) => Err(error.into()),
        }
    }

    async fn hand_claim_many(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
        fingerprints: &[Fingerprint],
        claim_id: i64,
    ) -> Result<Vec<String>> {
        mysql_insert_keys(tx, tables, keys, fingerprints, claim_id).await?;
        // No RETURNING after ON DUPLICATE KEY: the new keys are those with this batch's
        // claim id, read back as claim_many does.
        let mut inserted = Vec::new();
        for keys in keys.chunks(statements::MYSQL_MAX_PARAMETERS - 1) {
            let list = vec!["?"; keys.len()].join(", ");
            let sql = format!(
                "SELECT CAST(`key` AS CHAR CHARACTER SET utf8mb4) FROM {}
                 WHERE scope = '' AND consumer = 'bench' AND claim_id = ? AND `key` IN ({list})",
                tables.keys
            );
            let mut select = sqlx::query_scalar(AssertSqlSafe(sql)).bind(claim_id);
            for key in keys {
                select = select.bind(*key);
            }
            inserted.extend(select.fetch_all(&mut **tx).await?);
        }
        Ok(inserted)
    }

    /// As `claim_many` does: the insert, then every key's row read back, the inserted ones
    /// told by the batch's claim id.
    async fn hand_claim_many_reading(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
        fingerprints: &[Fingerprint],
        claim_id: i64,
    ) -> Result<(Vec<String>, Vec<Held>)> {
        mysql_insert_keys(tx, tables, keys, fingerprints, claim_id).await?;
        let (inserted, held): (Vec<Held>, Vec<Held>) = Self::hand_find_many(tx, tables, keys)
            .await?
            .into_iter()
            .partition(|(_, claimed_by, _)| *claimed_by == claim_id);
        Ok((inserted.into_iter().map(|(key, ..)| key).collect(), held))
    }

    async fn hand_find_many(
        tx: &mut sqlx::Transaction<'_, Self>,
        tables: &BenchTables,
        keys: &[&str],
    ) -> Result<Vec<Held>> {
        let mut found = Vec::with_capacity(keys.len());
        for keys in keys.chunks(statements::MYSQL_KEYS_PER_STATEMENT) {
            let sql = tables.claim_many.find_many(keys.len());
            let mut select = sqlx::query_as(AssertSqlSafe(sql));
            for key in keys {
                select = select.bind(*key);
            }
            found.extend(select.bind("").bind(CONSUMER).fetch_all(&mut **tx).await?);
        }
        Ok(found)
    }

    async fn insert_effects(
        tx: &mut sqlx::Transaction<'_, Self>,
        table: &str,
        keys: &[&str],
    ) -> Result<()> {
        for keys in keys.chunks(statements::MYSQL_MAX_PARAMETERS) {
            let values = vec!["(?)"; keys.len()].join(", ");
            let sql = format!("INSERT INTO {table} (effect_key) VALUES {values}");
            let mut insert = sqlx::query(AssertSqlSafe(sql));
            for key in keys {
                insert = insert.bind(*key);
            }
            insert.execute(&mut **tx).await?;
        }
        Ok(())
    }

    /// InnoDB's log sequence number: the bytes written to its redo log.
    async fn log_position(pool: &sqlx::Pool<Self>) -> Result<Option<u64>> {
        let status = sqlx::raw_sql("SHOW GLOBAL STATUS LIKE 'Innodb_lsn_current'")
            .fetch_one(pool)
            .await?;
        let lsn: String = sqlx::Row::try_get(&status, 1)?;
        Ok(Some(lsn.parse()?))
    }

    /// InnoDB's persistent statistics, made fresh first: the pages of the clustered index
    /// (the rows, by primary key) and of each secondary index.
    async fn sizes(pool: &sqlx::Pool<Self>, table: &str) -> Result<Sizes> {
        Self::execute(pool, format!("ANALYZE TABLE {table}")).await?;
        let (rows, secondary): (u64, u64) = sqlx::query_as(
            "SELECT DATA_LENGTH, INDEX_LENGTH FROM information_schema.TABLES
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
        )
        .bind(table)
        .fetch_one(pool)
        .await?;
        let indexes: Vec<(String, u64)> = sqlx::query_as(
            "SELECT CAST(index_name AS CHAR), CAST(stat_value * @@innodb_page_size AS UNSIGNED)
             FROM mysql.innodb_index_stats
             WHERE database_name = DATABASE() AND table_name = ? AND stat_name = 'size'
               AND index_name <> 'PRIMARY'
             ORDER BY index_name",
        )
        .bind(table)
        .fetch_all(pool)
        .await?;
        Ok(Sizes {
            table: rows,
            indexes,
            total: rows + secondary,
        })
    }

    async fn fill(
        pool: &sqlx::Pool<Self>,
        table: &str,
        from: u64,
        to: u64,
        age: Duration,
    ) -> Result<()> {
        // Numbers from five tables of digits, not a recursive CTE: MariaDB stops one after
        // 1,000 rows by default, and MySQL names that limit differently.
        let digits = "(SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
                      UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL \
                      SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9)";
        let sql = format!(
            "INSERT INTO {table} (scope, consumer, `key`, fingerprint, claim_id, processed_at)
             SELECT '', 'bench', CONCAT('fill:', n), UNHEX(SHA2(n, 256)), 0,
                    UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
             FROM (SELECT ? + a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d AS n
                   FROM {digits} a, {digits} b, {digits} c, {digits} e, {digits} f) numbers
             WHERE n < ?"
        );
        ensure!(to - from <= 100_000, "at most 100,000 keys per statement");
        sqlx::query(AssertSqlSafe(sql))
            .bind(u64::try_from(age.as_micros())?)
            .bind(from)
            .bind(to)
            .execute(pool)
            .await?;
        Ok(())
    }
}
