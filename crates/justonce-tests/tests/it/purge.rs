//! `Inbox::purge`: expired keys go, in bounded batches; younger keys and other consumers'
//! keys stay.

use super::{key, on_every_database, process};
use justonce_sql::{Error, Outcome};
use justonce_tests::{TestBackend, TestDb};
use std::time::Duration;

on_every_database!(purge_removes_only_keys_older_than_the_cutoff);

const DAY_MS: i64 = 86_400_000;

async fn purge_removes_only_keys_older_than_the_cutoff<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let audit = db.consumer("audit");
    for n in 0..30 {
        let outcome = process(&db, &db.inbox, &key(&format!("k{n}")), b"p").await;
        assert_eq!(outcome, Outcome::Processed(()));
    }
    assert_eq!(
        process(&db, &audit, &key("k0"), b"p").await,
        Outcome::Processed(())
    );
    for n in 0..12 {
        DB::age_key(db.inbox.pool(), &db.prefix, &format!("k{n}"), 8 * DAY_MS).await;
    }
    // Six days old: inside the seven-day cutoff, so kept.
    DB::age_key(db.inbox.pool(), &db.prefix, "k29", 6 * DAY_MS).await;

    let week = Duration::from_secs(7 * 86_400);
    // Eight days old, a day past the cutoff: how far the purge is behind.
    let age = db.inbox.oldest_key_age().await.unwrap();
    let eight_days = Duration::from_millis(8 * DAY_MS as u64);
    assert!(
        age >= eight_days && age < eight_days + Duration::from_secs(60),
        "{age:?}"
    );
    // 12 of this consumer's keys (k0 of audit was aged too, and is not this consumer's).
    assert_eq!(db.inbox.purge(week, 5).await.unwrap(), 12);
    assert_eq!(db.rows("keys").await, 30 - 12 + 1);
    assert_eq!(db.inbox.purge(week, 5).await.unwrap(), 0);
    let age = db.inbox.oldest_key_age().await.unwrap();
    assert!(
        age >= Duration::from_millis(6 * DAY_MS as u64) && age < week,
        "{age:?}"
    );
    assert_eq!(audit.purge(week, 5).await.unwrap(), 1);
    let nobody = db.consumer("nobody");
    assert_eq!(nobody.oldest_key_age().await.unwrap(), Duration::ZERO);

    assert_eq!(
        process(&db, &db.inbox, &key("k0"), b"p").await,
        Outcome::Processed(())
    );
    assert_eq!(
        process(&db, &db.inbox, &key("k12"), b"p").await,
        Outcome::Duplicate
    );
    assert_eq!(
        process(&db, &db.inbox, &key("k29"), b"p").await,
        Outcome::Duplicate
    );

    let too_soon = db
        .inbox
        .purge(Duration::from_secs(3600), 5)
        .await
        .unwrap_err();
    assert!(
        matches!(too_soon, Error::RetentionBelowHorizon { .. }),
        "{too_soon}"
    );
    db.cleanup().await;
}
