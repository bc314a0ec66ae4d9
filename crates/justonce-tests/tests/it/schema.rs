//! Migrations and the checks that keep the unique constraint in place.

use super::on_every_database;
use justonce_sql::{Consumer, Error, Inbox, InboxOptions};
use justonce_tests::{TestBackend, TestDb};

on_every_database!(
    concurrent_migrations_apply_once,
    a_keys_table_without_its_constraint_is_refused,
    a_newer_schema_is_refused,
);

async fn concurrent_migrations_apply_once<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let fresh = format!("{}m_", db.prefix);
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let (url, prefix) = (db.url.clone(), fresh.clone());
            tokio::spawn(async move {
                let options = InboxOptions::default().prefix(prefix);
                let inbox = Inbox::<DB>::connect_with(&url, Consumer::new("m").unwrap(), options)
                    .await
                    .unwrap();
                inbox.migrate().await.unwrap()
            })
        })
        .collect();
    let mut applied = 0;
    for task in tasks {
        applied += task.await.unwrap();
    }
    assert_eq!(
        applied, 9,
        "each of the nine migrations applied by one migrator"
    );
    for table in [
        "keys",
        "outbox",
        "offsets",
        "breakers",
        "replays",
        "duplicates",
        "runs",
        "migrations",
    ] {
        DB::execute(db.inbox.pool(), format!("DROP TABLE {fresh}{table}"))
            .await
            .unwrap();
    }
    db.cleanup().await;
}

async fn a_keys_table_without_its_constraint_is_refused<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let bare = format!("{}b_", db.prefix);
    DB::execute(
        db.inbox.pool(),
        format!(
            "CREATE TABLE {bare}keys (scope VARCHAR(128) NOT NULL, consumer VARCHAR(128) NOT NULL, \
             {key} VARCHAR(255) NOT NULL, fingerprint TEXT, claim_id BIGINT, processed_at BIGINT)",
            key = DB::quoted("key")
        ),
    )
    .await
    .unwrap();
    let inbox = Inbox::<DB>::from_pool(
        db.inbox.pool().clone(),
        Consumer::new("c").unwrap(),
        InboxOptions::default().prefix(&bare),
    )
    .unwrap();
    assert!(matches!(inbox.migrate().await, Err(Error::Schema(_))));
    assert!(matches!(inbox.check().await, Err(Error::Schema(_))));
    for table in [
        "keys",
        "outbox",
        "offsets",
        "breakers",
        "replays",
        "duplicates",
        "runs",
        "migrations",
    ] {
        DB::execute(
            db.inbox.pool(),
            format!("DROP TABLE IF EXISTS {bare}{table}"),
        )
        .await
        .unwrap();
    }
    db.cleanup().await;
}

async fn a_newer_schema_is_refused<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    DB::execute(
        db.inbox.pool(),
        format!(
            "INSERT INTO {}migrations (version, description) VALUES (99, 'from the future')",
            db.prefix
        ),
    )
    .await
    .unwrap();
    let error = db.inbox.migrate().await.unwrap_err();
    assert!(matches!(error, Error::Schema(_)), "{error}");
    assert!(error.to_string().contains("99"), "{error}");
    db.cleanup().await;
}

#[tokio::test]
async fn a_prefix_that_is_not_an_identifier_is_refused() {
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .connect_lazy("sqlite::memory:")
        .unwrap();
    for prefix in ["", "Bad", "drop table;", "1x_"] {
        let error = Inbox::<sqlx::Sqlite>::from_pool(
            pool.clone(),
            Consumer::new("c").unwrap(),
            InboxOptions::default().prefix(prefix),
        )
        .unwrap_err();
        assert!(matches!(error, Error::Config(_)), "{prefix:?}: {error}");
    }
}

/// MySQL commits DDL at once: a migrator that died after adding the events' columns, before
/// recording version 5, leaves the columns without the record (and none of the versions
/// after it). The next migrator records it, and applies the later ones.
#[tokio::test]
async fn mysql_a_migration_cut_off_before_its_record_is_applied_again() {
    let db = TestDb::<sqlx::MySql>::new("mysql_cut_off_migration").await;
    let forget = format!("DELETE FROM {}migrations WHERE version >= 5", db.prefix);
    <sqlx::MySql as TestBackend>::execute(db.inbox.pool(), forget)
        .await
        .unwrap();
    assert_eq!(
        db.inbox.migrate().await.unwrap(),
        5,
        "version 5 recorded again, then versions 6, 7, 8 and 9"
    );
    let (version,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT max(version) FROM {}migrations",
        db.prefix
    )))
    .fetch_one(db.inbox.pool())
    .await
    .unwrap();
    assert_eq!(version, 9);
    let columns = <sqlx::MySql as TestBackend>::count(
        db.inbox.pool(),
        format!(
            "SELECT count(*) FROM information_schema.columns
             WHERE table_schema = DATABASE() AND table_name = '{}outbox'
               AND column_name IN ('history', 'received_at', 'replay_id')",
            db.prefix
        ),
    )
    .await;
    assert_eq!(columns, 3, "each column added once");
    db.cleanup().await;
}
