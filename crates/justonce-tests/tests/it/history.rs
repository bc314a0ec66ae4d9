//! Each delivery's history: every attempt the relay makes is recorded with its row, in the
//! statement that records its outcome, bounded to the last 25 and purged with the row; and
//! the listings an operator reads to find what is waiting.

use super::on_every_database;
use justonce_http::HttpDestination;
use justonce_sql::{Inbox, Key, Message, RelayOptions, RowFilter};
use justonce_tests::{Answer, Sink};
use justonce_tests::{TestBackend, TestDb};
use std::sync::Arc;
use std::time::Duration;

on_every_database!(
    a_target_failing_twice_then_answering_200_leaves_three_attempts_in_order,
    a_connection_error_is_recorded_without_a_status,
    the_history_keeps_the_last_25_attempts,
    purging_a_row_removes_its_history,
    a_replay_keeps_the_history_and_counts_attempts_anew,
    waiting_rows_are_listed_oldest_first_with_their_last_error,
    dead_letters_are_listed_by_destination_and_time,
);

/// Options under which a failed row is due again at once.
fn eager() -> RelayOptions {
    RelayOptions::default()
        .first_backoff(Duration::ZERO)
        .max_backoff(Duration::ZERO)
}

/// Writes one row for `destination` under `key`, committed on its own; returns its id.
async fn enqueue<DB: TestBackend>(inbox: &Inbox<DB>, key: &str, destination: &str) -> i64 {
    let key = Key::new(key).unwrap();
    let mut tx = inbox.begin().await.unwrap();
    let id = inbox
        .enqueue(&mut tx, &key, "notify", Message::new(destination, "{}"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    id
}

/// A sink answering each key's attempts in turn from `answers`, then 200.
async fn answering(answers: Vec<Answer>) -> Sink {
    Sink::scripted(Arc::new(move |_, attempt| {
        answers
            .get(attempt - 1)
            .cloned()
            .unwrap_or_else(|| Answer::status(200))
    }))
    .await
}

fn with_body(status: u16, body: impl Into<Vec<u8>>) -> Answer {
    Answer {
        body: body.into(),
        ..Answer::status(status)
    }
}

async fn a_target_failing_twice_then_answering_200_leaves_three_attempts_in_order<
    DB: TestBackend,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let id = enqueue(&db.inbox, "order:1042", "partner").await;
    // A NUL and bytes that are not UTF-8, then a body longer than what is kept.
    let sink = answering(vec![
        with_body(503, b"busy\0\xff now".to_vec()),
        with_body(500, "é".repeat(1_000)),
        with_body(200, "{\"received\":true}"),
    ])
    .await;
    let relay = db
        .inbox
        .outbox()
        .relay()
        .options(eager())
        .destination("partner", HttpDestination::new(&sink.url()).unwrap());
    for _ in 0..3 {
        assert_eq!(relay.relay_once().await.unwrap().taken, 1);
    }
    assert_eq!(sink.requests(), 3);

    let attempts = db.inbox.outbox().attempts(id).await.unwrap();
    let numbers: Vec<u32> = attempts.iter().map(|a| a.attempt).collect();
    let statuses: Vec<Option<u16>> = attempts.iter().map(|a| a.status).collect();
    assert_eq!(numbers, [1, 2, 3]);
    assert_eq!(statuses, [Some(503), Some(500), Some(200)]);
    assert_eq!(
        attempts[0].answer.as_deref(),
        Some("busy\u{FFFD}\u{FFFD} now")
    );
    assert!(attempts[0].error.as_deref().unwrap().contains("503"));
    let long = attempts[1].answer.as_deref().unwrap();
    assert!(
        long.len() <= 512 && long.len() >= 510,
        "{} bytes",
        long.len()
    );
    assert!(long.chars().all(|c| c == 'é'), "{long}");
    assert!(attempts[1].error.as_deref().unwrap().contains("500"));
    assert_eq!(attempts[2].answer.as_deref(), Some("{\"received\":true}"));
    assert_eq!(attempts[2].error, None);
    assert!(
        attempts
            .windows(2)
            .all(|w| w[0].started_at <= w[1].started_at),
        "{attempts:?}"
    );
    let row = db.inbox.outbox().get(id).await.unwrap().unwrap();
    assert!(row.sent && row.last_error.is_none());
    db.cleanup().await;
}

async fn a_connection_error_is_recorded_without_a_status<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let id = enqueue(&db.inbox, "order:7", "gone").await;
    // A port nothing listens on: the connection is refused.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/hooks", closed.local_addr().unwrap());
    drop(closed);
    let relay = db
        .inbox
        .outbox()
        .relay()
        .options(eager())
        .destination("gone", HttpDestination::new(&url).unwrap());
    assert_eq!(relay.relay_once().await.unwrap().retried, 1);

    let attempts = db.inbox.outbox().attempts(id).await.unwrap();
    assert_eq!(attempts.len(), 1, "{attempts:?}");
    assert_eq!((attempts[0].attempt, attempts[0].status), (1, None));
    assert_eq!(attempts[0].answer, None);
    let error = attempts[0].error.as_deref().unwrap();
    assert!(error.starts_with("POST http://127.0.0.1:"), "{error}");
    db.cleanup().await;
}

async fn the_history_keeps_the_last_25_attempts<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let id = enqueue(&db.inbox, "order:9", "down").await;
    let sink = Sink::scripted(Arc::new(|_, attempt| {
        with_body(503, format!("attempt {attempt}"))
    }))
    .await;
    let relay = db
        .inbox
        .outbox()
        .relay()
        .options(eager())
        .destination("down", HttpDestination::new(&sink.url()).unwrap());
    for _ in 0..30 {
        assert_eq!(relay.relay_once().await.unwrap().retried, 1);
    }

    let attempts = db.inbox.outbox().attempts(id).await.unwrap();
    let numbers: Vec<u32> = attempts.iter().map(|a| a.attempt).collect();
    assert_eq!(numbers, (6..=30).collect::<Vec<u32>>());
    let answers: Vec<String> = attempts.iter().filter_map(|a| a.answer.clone()).collect();
    assert_eq!(
        answers,
        (6..=30).map(|n| format!("attempt {n}")).collect::<Vec<_>>()
    );
    assert_eq!(
        db.inbox.outbox().get(id).await.unwrap().unwrap().attempts,
        30
    );
    db.cleanup().await;
}

async fn purging_a_row_removes_its_history<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let dead = enqueue(&db.inbox, "order:1", "refusing").await;
    let sent = enqueue(&db.inbox, "order:2", "taking").await;
    let refusing = Sink::scripted(Arc::new(|_, _| Answer::status(400))).await;
    let taking = Sink::start().await;
    let outbox = db.inbox.outbox();
    let relay = outbox
        .relay()
        .destination("refusing", HttpDestination::new(&refusing.url()).unwrap())
        .destination("taking", HttpDestination::new(&taking.url()).unwrap());
    let round = relay.relay_once().await.unwrap();
    assert_eq!((round.sent, round.dead), (1, 1));
    assert_eq!(outbox.attempts(dead).await.unwrap().len(), 1);
    assert_eq!(outbox.attempts(sent).await.unwrap().len(), 1);

    assert_eq!(outbox.purge_dead_letters().await.unwrap(), 1);
    assert_eq!(outbox.purge_sent(Duration::ZERO, 100).await.unwrap(), 1);
    assert_eq!(db.rows("outbox").await, 0, "no row, and with it no history");
    assert!(outbox.attempts(dead).await.unwrap().is_empty());
    assert!(outbox.attempts(sent).await.unwrap().is_empty());
    db.cleanup().await;
}

async fn a_replay_keeps_the_history_and_counts_attempts_anew<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let id = enqueue(&db.inbox, "order:5", "partner").await;
    let sink = answering(vec![Answer::status(422)]).await;
    let outbox = db.inbox.outbox();
    let relay = outbox
        .relay()
        .destination("partner", HttpDestination::new(&sink.url()).unwrap());
    assert_eq!(relay.relay_once().await.unwrap().dead, 1);
    assert!(outbox.replay(id).await.unwrap());
    assert_eq!(relay.relay_once().await.unwrap().sent, 1);

    let attempts = outbox.attempts(id).await.unwrap();
    let seen: Vec<(u32, Option<u16>, bool)> = attempts
        .iter()
        .map(|a| (a.attempt, a.status, a.error.is_some()))
        .collect();
    assert_eq!(seen, [(1, Some(422), true), (1, Some(200), false)]);
    db.cleanup().await;
}

async fn waiting_rows_are_listed_oldest_first_with_their_last_error<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let first = enqueue(&db.inbox, "order:1", "partner").await;
    let second = enqueue(&db.inbox, "order:2", "partner").await;
    let other = enqueue(&db.inbox, "order:3", "audit").await;
    let outbox = db.inbox.outbox();
    // The partner's first row fails once and waits an hour for its retry.
    let sink = answering(vec![with_body(503, "down for maintenance")]).await;
    let options = RelayOptions::default()
        .batch_size(1)
        .first_backoff(Duration::from_secs(3_600));
    let relay = outbox
        .relay()
        .options(options)
        .destination("partner", HttpDestination::new(&sink.url()).unwrap());
    assert_eq!(relay.relay_once().await.unwrap().retried, 1);

    let due = outbox.list_due(&RowFilter::default()).await.unwrap();
    let ids: Vec<i64> = due.iter().map(|row| row.id).collect();
    assert_eq!(ids, [first, second, other]);
    assert_eq!(due[0].attempts, 1);
    let error = due[0].last_error.as_deref().unwrap();
    assert!(
        error.contains("503") && error.contains("down for maintenance"),
        "{error}"
    );
    assert!(
        due[0].next_attempt_in > Duration::from_secs(3_000),
        "{:?}",
        due[0]
    );
    assert_eq!((due[1].attempts, due[1].last_error.as_deref()), (0, None));
    assert_eq!(due[1].next_attempt_in, Duration::ZERO);

    let audit = RowFilter::default().destination("audit");
    let ids: Vec<i64> = outbox
        .list_due(&audit)
        .await
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(ids, [other]);
    let one = outbox
        .list_due(&RowFilter::default().limit(1))
        .await
        .unwrap();
    assert_eq!(one.len(), 1);
    assert!(
        outbox
            .list_dead(&RowFilter::default())
            .await
            .unwrap()
            .is_empty()
    );
    db.cleanup().await;
}

async fn dead_letters_are_listed_by_destination_and_time<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let partner = enqueue(&db.inbox, "order:1", "partner").await;
    let audit = enqueue(&db.inbox, "order:2", "audit").await;
    let refusing = Sink::scripted(Arc::new(|_, _| Answer::status(400))).await;
    let outbox = db.inbox.outbox();
    let relay = outbox
        .relay()
        .destination("partner", HttpDestination::new(&refusing.url()).unwrap())
        .destination("audit", HttpDestination::new(&refusing.url()).unwrap());
    assert_eq!(relay.relay_once().await.unwrap().dead, 2);

    let ids = |rows: Vec<justonce_sql::RowSummary>| rows.iter().map(|r| r.id).collect::<Vec<_>>();
    let all = RowFilter::default();
    assert_eq!(ids(outbox.list_dead(&all).await.unwrap()), [partner, audit]);
    let by_destination = RowFilter::default().destination("audit");
    assert_eq!(
        ids(outbox.list_dead(&by_destination).await.unwrap()),
        [audit]
    );
    // Written within the last hour, and not an hour ago or more.
    let recent = RowFilter::default().since(Duration::from_secs(3_600));
    assert_eq!(
        ids(outbox.list_dead(&recent).await.unwrap()),
        [partner, audit]
    );
    let older = RowFilter::default().until(Duration::from_secs(3_600));
    assert!(outbox.list_dead(&older).await.unwrap().is_empty());
    let window = RowFilter::default()
        .since(Duration::from_secs(3_600))
        .until(Duration::ZERO)
        .destination("partner");
    assert_eq!(ids(outbox.list_dead(&window).await.unwrap()), [partner]);
    db.cleanup().await;
}
