//! Keys recently seen committed: a duplicate of one is answered without the database,
//! a reuse with another payload still says so, and an inbox told to remember nothing asks
//! the database every time.

use super::{key, on_every_database, process};
use justonce_sql::{Consumer, Fingerprint, Inbox, InboxOptions, Outcome};
use justonce_tests::{TestBackend, TestDb};

on_every_database!(
    a_recent_duplicate_is_answered_without_the_database,
    an_inbox_that_remembers_nothing_asks_the_database,
);

async fn a_recent_duplicate_is_answered_without_the_database<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let outcome = process(&db, &db.inbox, &key("order:1"), b"first").await;
    assert_eq!(outcome, Outcome::Processed(()));
    assert_eq!(db.rows("effects").await, 1);
    let url = db.url.clone();
    let prefix = db.prefix.clone();
    // With the database out of reach, only what the inbox remembers can answer.
    db.inbox.pool().close().await;
    assert_eq!(
        process(&db, &db.inbox, &key("order:1"), b"first").await,
        Outcome::Duplicate
    );
    assert_eq!(
        process(&db, &db.inbox, &key("order:1"), b"other").await,
        Outcome::KeyReused {
            stored: Fingerprint::of(b"first"),
            received: Fingerprint::of(b"other"),
        }
    );
    let unseen = db
        .inbox
        .run(&key("order:2"), b"x", |_tx| {
            Box::pin(async { Ok::<_, sqlx::Error>(()) })
        })
        .await;
    assert!(unseen.is_err(), "a key not seen goes to the database");
    TestDb::<DB>::reopen(&url, &prefix).await.cleanup().await;
}

async fn an_inbox_that_remembers_nothing_asks_the_database<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let forgetful = Inbox::<DB>::from_pool(
        db.inbox.pool().clone(),
        Consumer::new("test").unwrap(),
        InboxOptions::default().prefix(&db.prefix).recent_keys(0),
    )
    .unwrap();
    let outcome = process(&db, &forgetful, &key("order:1"), b"first").await;
    assert_eq!(outcome, Outcome::Processed(()));
    let url = db.url.clone();
    let prefix = db.prefix.clone();
    db.inbox.pool().close().await;
    let again = forgetful
        .run(&key("order:1"), b"first", |_tx| {
            Box::pin(async { Ok::<_, sqlx::Error>(()) })
        })
        .await;
    assert!(
        again.is_err(),
        "the duplicate went to the database, which is closed"
    );
    TestDb::<DB>::reopen(&url, &prefix).await.cleanup().await;
}
