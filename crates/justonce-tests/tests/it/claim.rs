//! `Inbox::claim` and `Inbox::claim_many` inside the caller's own transaction.

use super::{key, on_every_database, process};
use justonce_sql::{Claim, Fingerprint, Key, Outcome};
use justonce_tests::{TestBackend, TestDb};
use std::time::Duration;

on_every_database!(
    a_claim_commits_or_rolls_back_with_the_transaction,
    a_second_claim_waits_for_the_first_transaction,
    a_batch_reports_each_key_in_order,
    racing_batches_claim_each_key_once,
    a_batch_sees_keys_committed_while_it_waited,
    a_batch_larger_than_one_statement_claims_every_key,
);

async fn a_claim_commits_or_rolls_back_with_the_transaction<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let id = key("k1");

    let mut tx = db.inbox.begin().await.unwrap();
    assert_eq!(
        db.inbox.claim(&mut tx, &id, b"p").await.unwrap(),
        Claim::First
    );
    tx.rollback().await.unwrap();
    assert_eq!(
        db.rows("keys").await,
        0,
        "a rolled-back claim leaves no key"
    );

    let mut tx = db.inbox.begin().await.unwrap();
    assert_eq!(
        db.inbox.claim(&mut tx, &id, b"p").await.unwrap(),
        Claim::First
    );
    DB::insert_effect(&mut tx, &db.prefix, "test", "k1")
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let mut tx = db.inbox.begin().await.unwrap();
    assert_eq!(
        db.inbox.claim(&mut tx, &id, b"p").await.unwrap(),
        Claim::Duplicate
    );
    assert_eq!(
        db.inbox.claim(&mut tx, &id, b"other").await.unwrap(),
        Claim::KeyReused {
            stored: Fingerprint::of(b"p"),
            received: Fingerprint::of(b"other"),
        }
    );
    tx.rollback().await.unwrap();
    assert_eq!((db.rows("keys").await, db.effects_of(&id).await), (1, 1));
    db.cleanup().await;
}

async fn a_second_claim_waits_for_the_first_transaction<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let id = key("k1");
    let mut first = db.inbox.begin().await.unwrap();
    assert_eq!(
        db.inbox.claim(&mut first, &id, b"p").await.unwrap(),
        Claim::First
    );

    let inbox = db.inbox.clone();
    let second = tokio::spawn(async move {
        let mut tx = inbox.begin().await.unwrap();
        let claim = inbox.claim(&mut tx, &key("k1"), b"p").await.unwrap();
        tx.rollback().await.unwrap();
        claim
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!second.is_finished(), "the second claim did not wait");
    first.commit().await.unwrap();
    assert_eq!(second.await.unwrap(), Claim::Duplicate);
    db.cleanup().await;
}

async fn a_batch_reports_each_key_in_order<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let (a, b, c, d) = (key("a"), key("b"), key("c"), key("d"));
    assert_eq!(
        process(&db, &db.inbox, &a, b"pa").await,
        Outcome::Processed(())
    );

    let batch: Vec<(Key, &[u8])> = vec![
        (c.clone(), b"p"),
        (a.clone(), b"pa"),
        (b.clone(), b"p"),
        (a.clone(), b"pa"),
        (d.clone(), b"p"),
        (d.clone(), b"q"),
        (a.clone(), b"other"),
    ];
    let mut tx = db.inbox.begin().await.unwrap();
    let claims = db.inbox.claim_many(&mut tx, &batch).await.unwrap();
    tx.commit().await.unwrap();
    let reused = |stored: &[u8], received: &[u8]| Claim::KeyReused {
        stored: Fingerprint::of(stored),
        received: Fingerprint::of(received),
    };
    assert_eq!(
        claims,
        vec![
            Claim::First,
            Claim::Duplicate,
            Claim::First,
            Claim::Duplicate,
            Claim::First,
            reused(b"p", b"q"),
            reused(b"pa", b"other"),
        ]
    );
    assert_eq!(db.rows("keys").await, 4);

    let mut tx = db.inbox.begin().await.unwrap();
    let again = db.inbox.claim_many(&mut tx, &batch[..3]).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(again, vec![Claim::Duplicate; 3]);

    // An empty batch claims nothing and leaves the transaction usable.
    let mut tx = db.inbox.begin().await.unwrap();
    let none = db.inbox.claim_many(&mut tx, &batch[..0]).await.unwrap();
    tx.commit().await.unwrap();
    assert!(none.is_empty());
    assert_eq!(db.rows("keys").await, 4);
    db.cleanup().await;
}

/// A batch held up by another transaction's key sees that key as held once it commits, with
/// the payload it was committed with, beside a key held before and a new one.
async fn a_batch_sees_keys_committed_while_it_waited<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    assert_eq!(
        process(&db, &db.inbox, &key("before"), b"p").await,
        Outcome::Processed(())
    );
    let mut other = db.inbox.begin().await.unwrap();
    assert_eq!(
        db.inbox
            .claim(&mut other, &key("meanwhile"), b"p")
            .await
            .unwrap(),
        Claim::First
    );

    let inbox = db.inbox.clone();
    let batch = tokio::spawn(async move {
        let messages: Vec<(Key, &[u8])> = vec![
            (key("new"), b"p"),
            (key("meanwhile"), b"q"),
            (key("before"), b"p"),
        ];
        let mut tx = inbox.begin().await.unwrap();
        let claims = inbox.claim_many(&mut tx, &messages).await.unwrap();
        tx.commit().await.unwrap();
        claims
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!batch.is_finished(), "the batch did not wait");
    other.commit().await.unwrap();
    assert_eq!(
        batch.await.unwrap(),
        vec![
            Claim::First,
            Claim::KeyReused {
                stored: Fingerprint::of(b"p"),
                received: Fingerprint::of(b"q"),
            },
            Claim::Duplicate,
        ]
    );
    assert_eq!(db.rows("keys").await, 3);
    db.cleanup().await;
}

async fn racing_batches_claim_each_key_once<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    const KEYS: usize = 300;
    let tasks: Vec<_> = (0..8)
        .map(|task| {
            let (inbox, prefix) = (db.inbox.clone(), db.prefix.clone());
            tokio::spawn(async move {
                // Each task sends the keys in another order.
                let batch: Vec<(Key, &[u8])> = (0..KEYS)
                    .map(|n| (key(&format!("k{}", (n * 7 + task * 37) % KEYS)), &b"p"[..]))
                    .collect();
                let mut tx = inbox.begin().await.unwrap();
                let claims = inbox.claim_many(&mut tx, &batch).await.unwrap();
                let mut first = 0;
                for ((key, _), claim) in batch.iter().zip(&claims) {
                    if *claim == Claim::First {
                        DB::insert_effect(&mut tx, &prefix, "test", key.as_str())
                            .await
                            .unwrap();
                        first += 1;
                    }
                }
                tx.commit().await.unwrap();
                first
            })
        })
        .collect();
    let mut first = 0;
    for task in tasks {
        first += task.await.unwrap();
    }
    assert_eq!(first, KEYS);
    let distinct = DB::count(
        db.inbox.pool(),
        format!("SELECT count(DISTINCT msg_key) FROM {}effects", db.prefix),
    )
    .await;
    assert_eq!(
        (db.rows("effects").await, distinct),
        (KEYS as i64, KEYS as i64)
    );
    db.cleanup().await;
}

/// More keys than MariaDB takes placeholders in one statement (65,535), in the insert and in
/// the read back: the batch is split, and each key is still judged once.
async fn a_batch_larger_than_one_statement_claims_every_key<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    // Not a multiple of the statements' 10,000 keys: the last one is short.
    const KEYS: usize = 70_003;
    let claimed_before = key("k7");
    assert_eq!(
        process(&db, &db.inbox, &claimed_before, b"p").await,
        Outcome::Processed(())
    );
    let batch: Vec<(Key, &[u8])> = (0..KEYS)
        .map(|n| (key(&format!("k{n}")), &b"p"[..]))
        .collect();

    let mut tx = db.inbox.begin().await.unwrap();
    let claims = db.inbox.claim_many(&mut tx, &batch).await.unwrap();
    tx.commit().await.unwrap();
    let first = claims.iter().filter(|c| **c == Claim::First).count();
    assert_eq!((claims.len(), first), (KEYS, KEYS - 1));
    assert_eq!(
        claims[7],
        Claim::Duplicate,
        "k7 was claimed before the batch"
    );
    assert_eq!(db.rows("keys").await, KEYS as i64);

    let mut tx = db.inbox.begin().await.unwrap();
    let again = db.inbox.claim_many(&mut tx, &batch).await.unwrap();
    tx.rollback().await.unwrap();
    assert!(again.iter().all(|c| *c == Claim::Duplicate));
    assert_eq!(again.len(), KEYS);
    db.cleanup().await;
}
