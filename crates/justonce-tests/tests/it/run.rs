//! `Inbox::run`: the claim, the work and its writes commit together, once per key.

use super::{closed_port, key, on_every_database, process};
use justonce_sql::{
    Claim, Consumer, Fingerprint, Inbox, InboxOptions, Key, Message, Outcome, RunError,
};
use justonce_tests::{TestBackend, TestDb};

on_every_database!(
    the_second_run_changes_nothing,
    racing_tasks_make_one_effect,
    consumers_sharing_a_store_each_act_once,
    a_reused_key_has_no_effect,
    nfc_and_nfd_spellings_are_two_keys,
    keys_that_differ_by_a_trailing_space_are_two_keys,
    failed_work_leaves_the_key_unclaimed,
    tenants_are_kept_apart,
);

/// The failures of the test job: its own SQL, or justonce's.
#[derive(Debug, thiserror::Error)]
enum JobError {
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    #[error(transparent)]
    Store(#[from] justonce_sql::Error),
}

/// An effect row and an outbox row, in the claim's transaction.
async fn invoice_job<DB: TestBackend>(db: &TestDb<DB>, key: &Key) -> Outcome<()> {
    db.inbox
        .run(key, b"job", |tx| {
            Box::pin(async move {
                DB::insert_effect(tx, &db.prefix, "test", key.as_str()).await?;
                db.inbox
                    .enqueue(tx, key, "invoice-email", Message::new("mail", "body"))
                    .await?;
                Ok::<_, JobError>(())
            })
        })
        .await
        .expect("run")
}

async fn the_second_run_changes_nothing<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let keys: Vec<_> = (0..20)
        .map(|n| key(&format!("invoice:2026-10:cust_{n}")))
        .collect();
    for key in &keys {
        assert_eq!(invoice_job(&db, key).await, Outcome::Processed(()));
    }
    let counts = (
        db.rows("keys").await,
        db.rows("effects").await,
        db.rows("outbox").await,
    );
    assert_eq!(counts, (20, 20, 20));

    for key in &keys {
        assert_eq!(invoice_job(&db, key).await, Outcome::Duplicate);
    }
    let again = (
        db.rows("keys").await,
        db.rows("effects").await,
        db.rows("outbox").await,
    );
    assert_eq!(again, counts, "the second run changed rows");
    db.cleanup().await;
}

async fn racing_tasks_make_one_effect<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (inbox, prefix) = (db.inbox.clone(), db.prefix.clone());
            tokio::spawn(async move {
                let key = key("order:1");
                inbox
                    .run(&key, b"same", |tx| {
                        Box::pin(DB::insert_effect(tx, &prefix, "test", key.as_str()))
                    })
                    .await
                    .expect("run")
            })
        })
        .collect();
    let mut processed = 0;
    for task in tasks {
        match task.await.unwrap() {
            Outcome::Processed(()) => processed += 1,
            Outcome::Duplicate => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(processed, 1);
    assert_eq!(db.rows("effects").await, 1);
    db.cleanup().await;
}

async fn consumers_sharing_a_store_each_act_once<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let (billing, audit) = (db.consumer("billing"), db.consumer("audit"));
    let id = key("msg-1");
    for inbox in [&billing, &audit] {
        assert_eq!(process(&db, inbox, &id, b"m").await, Outcome::Processed(()));
    }
    for inbox in [&billing, &audit] {
        assert_eq!(process(&db, inbox, &id, b"m").await, Outcome::Duplicate);
    }
    let per_consumer = DB::count(
        db.inbox.pool(),
        format!(
            "SELECT count(DISTINCT consumer) FROM {}effects WHERE msg_key = 'msg-1'",
            db.prefix
        ),
    )
    .await;
    assert_eq!((db.rows("effects").await, per_consumer), (2, 2));
    db.cleanup().await;
}

async fn a_reused_key_has_no_effect<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let id = key("evt_1");
    assert_eq!(
        process(&db, &db.inbox, &id, b"first").await,
        Outcome::Processed(())
    );
    assert_eq!(
        process(&db, &db.inbox, &id, b"second").await,
        Outcome::KeyReused {
            stored: Fingerprint::of(b"first"),
            received: Fingerprint::of(b"second"),
        }
    );
    assert_eq!(db.effects_of(&id).await, 1);
    db.cleanup().await;
}

async fn nfc_and_nfd_spellings_are_two_keys<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let (nfc, nfd) = (key("caf\u{e9}"), key("cafe\u{301}"));
    assert_eq!(
        process(&db, &db.inbox, &nfc, b"p").await,
        Outcome::Processed(())
    );
    assert_eq!(
        process(&db, &db.inbox, &nfd, b"p").await,
        Outcome::Processed(())
    );
    assert_eq!(
        (db.effects_of(&nfc).await, db.effects_of(&nfd).await),
        (1, 1)
    );
    db.cleanup().await;
}

/// Keys compare byte for byte: a collation that pads with spaces (MariaDB's `_bin` ones)
/// would make these one key.
async fn keys_that_differ_by_a_trailing_space_are_two_keys<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let (bare, spaced) = (key("order 1"), key("order 1 "));
    for key in [&bare, &spaced] {
        assert_eq!(
            process(&db, &db.inbox, key, b"p").await,
            Outcome::Processed(())
        );
    }
    assert_eq!(db.rows("keys").await, 2);
    assert_eq!(db.rows("effects").await, 2);
    // Through the batch claim too, which reads the stored keys back by value.
    let mut tx = db.inbox.begin().await.unwrap();
    let claims = db
        .inbox
        .claim_many(
            &mut tx,
            &[(spaced.clone(), &b"p"[..]), (key("order 1  "), &b"p"[..])],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(claims, vec![Claim::Duplicate, Claim::First]);
    assert_eq!(db.rows("keys").await, 3);
    db.cleanup().await;
}

#[derive(Debug, thiserror::Error)]
#[error("the card was declined")]
struct Declined;

async fn failed_work_leaves_the_key_unclaimed<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let id = key("charge:1");
    let mut calls = 0;
    let failed = db
        .inbox
        .run(&id, b"p", |tx| {
            calls += 1;
            Box::pin(async {
                DB::insert_effect(tx, &db.prefix, "test", id.as_str())
                    .await
                    .expect("effect");
                Err::<(), _>(Declined)
            })
        })
        .await;
    assert!(matches!(failed, Err(RunError::Work(Declined))));
    assert_eq!(calls, 1, "a failure of the work's own logic is not retried");
    assert_eq!((db.rows("keys").await, db.rows("effects").await), (0, 0));
    assert_eq!(
        process(&db, &db.inbox, &id, b"p").await,
        Outcome::Processed(())
    );
    db.cleanup().await;
}

/// PostgreSQL raises serialization failures and deadlocks; `run` starts over on each.
#[tokio::test]
async fn transient_failures_are_retried_on_postgres() {
    let db = TestDb::<sqlx::Postgres>::new("transient").await;
    let (id, prefix) = (key("retry:1"), db.prefix.as_str());
    let mut calls = 0;
    let outcome = db
        .inbox
        .run(&id, b"p", |tx| {
            calls += 1;
            let code = match calls {
                1 => Some("40001"),
                2 => Some("40P01"),
                _ => None,
            };
            Box::pin(async move {
                <sqlx::Postgres as TestBackend>::insert_effect(tx, prefix, "test", "retry:1")
                    .await?;
                if let Some(code) = code {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        "DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '{code}'; END $$"
                    )))
                    .execute(&mut **tx)
                    .await?;
                }
                Ok::<_, sqlx::Error>(calls)
            })
        })
        .await
        .expect("run");
    assert_eq!(outcome, Outcome::Processed(3));
    assert_eq!(db.effects_of(&id).await, 1);
    db.cleanup().await;
}

async fn tenants_are_kept_apart<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let tenant = |name: &str| db.inbox.with_scope(justonce_sql::Scope::new(name).unwrap());
    let (acme, globex) = (tenant("acme"), tenant("globex"));
    let id = key("order:1");
    for inbox in [&acme, &globex, &db.inbox] {
        assert_eq!(process(&db, inbox, &id, b"p").await, Outcome::Processed(()));
        assert_eq!(process(&db, inbox, &id, b"p").await, Outcome::Duplicate);
    }
    assert_ne!(
        acme.identity(&id).derive("s"),
        globex.identity(&id).derive("s")
    );
    assert_eq!((db.rows("keys").await, db.effects_of(&id).await), (3, 3));
    db.cleanup().await;
}

/// The work kills the run's own connection: the database's failure, not the work's. It is
/// tried again, then returned as the store's error, with nothing committed. SQLite runs in
/// this process and has no connection to lose.
async fn a_killed_connection_of_the_run_is_the_stores_failure<DB: TestBackend>(
    test: &str,
    kill_own_connection: &'static str,
) where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let db = TestDb::<DB>::new(test).await;
    let inbox = Inbox::<DB>::connect_with(
        &db.url,
        Consumer::new("test").unwrap(),
        InboxOptions::default().prefix(&db.prefix).max_attempts(2),
    )
    .await
    .unwrap();
    let id = key("charge:killed");
    let mut calls = 0;
    let failed = inbox
        .run(&id, b"p", |tx| {
            calls += 1;
            Box::pin(async {
                DB::insert_effect(tx, &db.prefix, "test", id.as_str()).await?;
                sqlx::raw_sql(sqlx::AssertSqlSafe(kill_own_connection))
                    .execute(&mut **tx)
                    .await
                    .map(drop)
            })
        })
        .await;
    assert!(matches!(failed, Err(RunError::Store(_))), "{failed:?}");
    assert_eq!(calls, 2, "the database's failure is tried again");
    assert_eq!((db.rows("keys").await, db.rows("effects").await), (0, 0));
    assert_eq!(
        process(&db, &db.inbox, &id, b"p").await,
        Outcome::Processed(())
    );
    db.cleanup().await;
}

/// The work's own connection to another database is refused: the work's failure, not
/// the store's, though it is a broken connection too.
async fn another_databases_lost_connection_is_the_works_failure<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    // The store's URL with a port nothing listens on.
    let (user, rest) = db.url.split_once('@').expect("a URL with a user");
    let path = &rest[rest.find('/').expect("a URL with a database")..];
    let elsewhere = format!("{user}@127.0.0.1:{}{path}", closed_port());
    let id = key("charge:elsewhere");
    let (key, prefix, elsewhere) = (&id, db.prefix.as_str(), elsewhere.as_str());
    let mut calls = 0;
    let failed = db
        .inbox
        .run(key, b"p", |tx| {
            calls += 1;
            Box::pin(async move {
                DB::insert_effect(tx, prefix, "test", key.as_str()).await?;
                <DB::Connection as sqlx::Connection>::connect(elsewhere)
                    .await
                    .map(drop)
            })
        })
        .await;
    assert!(
        matches!(failed, Err(RunError::Work(sqlx::Error::Io(_)))),
        "{failed:?}"
    );
    assert_eq!(calls, 1, "a failure of the work's own is not retried");
    assert_eq!((db.rows("keys").await, db.rows("effects").await), (0, 0));
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_connection_of_the_run_is_the_stores_failure_on_postgres() {
    a_killed_connection_of_the_run_is_the_stores_failure::<sqlx::Postgres>(
        "killed_connection",
        "SELECT pg_terminate_backend(pg_backend_pid())",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_connection_of_the_run_is_the_stores_failure_on_mysql() {
    a_killed_connection_of_the_run_is_the_stores_failure::<sqlx::MySql>(
        "killed_connection",
        "KILL CONNECTION_ID()",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_databases_lost_connection_is_the_works_failure_on_postgres() {
    another_databases_lost_connection_is_the_works_failure::<sqlx::Postgres>("elsewhere").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_databases_lost_connection_is_the_works_failure_on_mysql() {
    another_databases_lost_connection_is_the_works_failure::<sqlx::MySql>("elsewhere").await;
}
