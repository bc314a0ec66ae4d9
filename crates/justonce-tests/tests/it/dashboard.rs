//! The dashboard's figures, read from the store: events accepted and duplicates,
//! deliveries sent and failed, minute by minute, and the backlog. Duplicates of several
//! processes add up in the store.

use super::on_every_database;
use justonce_http::HttpDestination;
use justonce_sql::{Inbox, Key, Message, Outcome, RelayOptions};
use justonce_tests::{Answer, Sink, TestBackend, TestDb};
use std::sync::Arc;
use std::time::Duration;

on_every_database!(
    the_dashboard_counts_what_the_store_holds,
    purge_deletes_the_duplicate_counts_of_minutes_past_the_retention,
    failed_attempts_are_counted_within_the_range_only,
);

/// Stores `key` for `origin` as the service does; whether it was new.
async fn receive<DB: TestBackend>(inbox: &Inbox<DB>, origin: &str, key: &str) -> bool {
    let key = Key::new(format!("{origin}:{key}")).unwrap();
    let outcome = inbox
        .run_forward(&key, b"{}", Message::new(origin, "{}"))
        .await
        .unwrap();
    matches!(outcome, Outcome::Processed(()))
}

async fn the_dashboard_counts_what_the_store_holds<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    // A second process on the same tables: its own pool and its own counts.
    let other = TestDb::<DB>::reopen(&db.url, &db.prefix).await;
    let (shop, other_shop) = (db.consumer("shop"), other.consumer("shop"));
    let audit = db.consumer("audit");
    for key in ["1", "2", "3-flaky", "4-refused"] {
        assert!(receive(&shop, "shop", key).await);
    }
    // Duplicates: two in this process, flushed apart, and one in the other.
    assert!(!receive(&shop, "shop", "1").await);
    db.inbox.outbox().flush_duplicates().await.unwrap();
    assert!(!receive(&shop, "shop", "2").await);
    assert!(!receive(&other_shop, "shop", "1").await);
    db.inbox.outbox().flush_duplicates().await.unwrap();
    other.inbox.outbox().flush_duplicates().await.unwrap();
    // Nothing is left to add: a flush more changes nothing.
    db.inbox.outbox().flush_duplicates().await.unwrap();

    // `3-flaky` fails once then is sent, `4-refused` is refused for good.
    let sink = Sink::scripted(Arc::new(|key: &str, attempt| match key {
        "shop:3-flaky" if attempt == 1 => Answer::status(503),
        "shop:4-refused" => Answer::status(400),
        _ => Answer::status(200),
    }))
    .await;
    let relay = db
        .inbox
        .outbox()
        .relay()
        .options(
            RelayOptions::default()
                .first_backoff(Duration::ZERO)
                .max_backoff(Duration::ZERO),
        )
        .destination("shop", HttpDestination::new(&sink.url()).unwrap());
    let first = relay.relay_once().await.unwrap();
    assert_eq!((first.sent, first.retried, first.dead), (2, 1, 1));
    let second = relay.relay_once().await.unwrap();
    assert_eq!(second.sent, 1);
    // Written after the relay's rounds, `audit`'s event waits.
    assert!(receive(&audit, "audit", "1").await);

    let dashboard = db
        .inbox
        .outbox()
        .dashboard(Duration::from_secs(3_600))
        .await
        .unwrap();
    let totals = dashboard.totals;
    assert_eq!(
        (
            totals.accepted,
            totals.duplicates,
            totals.sent,
            totals.failed
        ),
        (5, 3, 3, 2),
        "{dashboard:#?}"
    );
    assert_eq!(dashboard.due, 1);
    assert!(dashboard.oldest_due.is_some());
    // An hour is 60 whole minutes and the one in progress, and they sum to the totals.
    assert_eq!(dashboard.minutes.len(), 61);
    let summed = |count: fn(&justonce_sql::DashboardTotals) -> u64| -> u64 {
        dashboard.minutes.iter().map(|m| count(&m.counts)).sum()
    };
    assert_eq!(
        (
            summed(|c| c.accepted),
            summed(|c| c.duplicates),
            summed(|c| c.sent),
            summed(|c| c.failed)
        ),
        (5, 3, 3, 2)
    );
    let names: Vec<_> = dashboard.destinations.iter().map(|d| &d.name).collect();
    assert_eq!(names, ["audit", "shop"]);
    let (audit, shop) = (&dashboard.destinations[0], &dashboard.destinations[1]);
    assert_eq!((audit.totals.accepted, audit.due), (1, 1));
    assert_eq!(
        (shop.totals.accepted, shop.totals.duplicates, shop.due),
        (4, 3, 0)
    );
    assert_eq!(shop.oldest_due, None);
    // The store's own counts agree.
    let stats = db.inbox.outbox().stats().await.unwrap();
    assert_eq!((stats.sent, stats.due, stats.dead), (3, 1, 1));
    other.inbox.pool().close().await;
    db.cleanup().await;
}

/// A delivery refused two hours ago and one failing now: the last hour counts one failed
/// attempt, the last three hours both. The rows read are those whose last failure is in
/// the range, found by its index, not every dead letter ever kept.
async fn failed_attempts_are_counted_within_the_range_only<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let shop = db.consumer("shop");
    let sink = Sink::scripted(Arc::new(|key: &str, _| match key {
        "shop:old" => Answer::status(400),
        _ => Answer::status(503),
    }))
    .await;
    let relay = db
        .inbox
        .outbox()
        .relay()
        .options(RelayOptions::default().first_backoff(Duration::from_secs(3_600)))
        .destination("shop", HttpDestination::new(&sink.url()).unwrap());
    assert!(receive(&shop, "shop", "old").await);
    assert_eq!(relay.relay_once().await.unwrap().dead, 1);
    // Its one attempt, refused, moved two hours back: in its history and its row.
    let two_hours = Duration::from_secs(7_200);
    let then_ms = (std::time::SystemTime::now() - two_hours)
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let outbox_table = format!("{}outbox", db.prefix);
    DB::execute(
        db.inbox.pool(),
        format!(
            r#"UPDATE {outbox_table} SET history = '[{{"attempt":1,"at":{then_ms},"ms":5,"status":400,"answer":"no","error":"HTTP 400"}}]'"#
        ),
    )
    .await
    .unwrap();
    DB::age_rows(
        db.inbox.pool(),
        outbox_table,
        "last_failed_at",
        i64::try_from(two_hours.as_millis()).unwrap(),
    )
    .await;
    assert!(receive(&shop, "shop", "new").await);
    assert_eq!(relay.relay_once().await.unwrap().retried, 1);

    let failed = |range: Duration| {
        let outbox = db.inbox.outbox();
        async move {
            let dashboard = outbox.dashboard(range).await.unwrap();
            let shop = dashboard.destinations.iter().find(|d| d.name == "shop");
            let minutes: u64 = dashboard.minutes.iter().map(|m| m.counts.failed).sum();
            assert_eq!(minutes, dashboard.totals.failed);
            (dashboard.totals.failed, shop.map(|d| d.totals.failed))
        }
    };
    assert_eq!(failed(Duration::from_secs(3_600)).await, (1, Some(1)));
    assert_eq!(failed(3 * Duration::from_secs(3_600)).await, (2, Some(2)));
    db.cleanup().await;
}

/// Minutes of duplicate counts older than the retention go; the others stay.
async fn purge_deletes_the_duplicate_counts_of_minutes_past_the_retention<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
        / 60;
    DB::execute(
        db.inbox.pool(),
        format!(
            "INSERT INTO {}duplicates (minute, origin, duplicates) VALUES \
             ({}, 'shop', 1), ({}, 'audit', 2), ({}, 'shop', 3)",
            db.prefix,
            now - 180,
            now - 61,
            now - 5
        ),
    )
    .await
    .unwrap();
    let outbox = db.inbox.outbox();
    let hour = Duration::from_secs(3_600);
    assert_eq!(
        outbox.purge_duplicate_counts_batch(hour, 1).await.unwrap(),
        1
    );
    assert_eq!(
        outbox.purge_duplicate_counts_batch(hour, 10).await.unwrap(),
        1
    );
    assert_eq!(
        outbox.purge_duplicate_counts_batch(hour, 10).await.unwrap(),
        0
    );
    let left = DB::count(
        db.inbox.pool(),
        format!(
            "SELECT count(*) FROM {}duplicates WHERE minute = {}",
            db.prefix,
            now - 5
        ),
    )
    .await;
    assert_eq!((db.rows("duplicates").await, left), (1, 1));
    db.cleanup().await;
}
