//! Stored events: listed by origin, key prefix, time and state a page at a time, shown
//! whole, replayed one at a time or by time range with the same key, a replay of a range
//! still running refusing an overlapping one, and purged by their origin's retention.

use super::on_every_database;
use justonce_http::HttpDestination;
use justonce_sql::{
    Error, EventFilter, EventState, Inbox, Key, Message, Outbox, Outcome, Relay, ReplayRange,
};
use justonce_tests::{Answer, Sink, TestBackend, TestDb};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

on_every_database!(
    events_are_listed_by_origin_key_prefix_time_and_state_a_page_at_a_time,
    an_event_is_shown_whole_with_its_attempts_by_id_and_by_key,
    a_delivered_event_replayed_reaches_its_target_again_with_the_same_key,
    a_range_replay_delivers_each_event_once_more_and_refuses_an_overlapping_one_meanwhile,
    delivered_events_are_purged_by_their_origins_retention_only,
);

/// Stores one event of `origin` under `<origin>:<id>`, as the service's receiver does.
async fn receive<DB: TestBackend>(inbox: &Inbox<DB>, origin: &str, id: &str) -> Key {
    let key = Key::new(format!("{origin}:{id}")).unwrap();
    let body = format!(r#"{{"id":"{id}"}}"#);
    let message = Message::new(origin, body.clone().into_bytes()).header("content-type", "json");
    let consumer = inbox.with_consumer(justonce_sql::Consumer::new(origin).unwrap());
    let outcome = consumer
        .run_forward(&key, body.as_bytes(), message)
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Processed(())), "{key}");
    key
}

/// A relay that delivers every origin named to `sink`.
fn relay_to<DB: TestBackend>(outbox: &Outbox<DB>, sink: &Sink, origins: &[&str]) -> Relay<DB> {
    let mut relay = outbox.relay();
    for origin in origins {
        relay = relay.destination(*origin, HttpDestination::new(&sink.url()).unwrap());
    }
    relay
}

/// Relays until nothing is due.
async fn relay_all<DB: TestBackend>(relay: &Relay<DB>) {
    while relay.relay_once().await.unwrap().taken > 0 {}
}

/// How many requests `sink` received for each Idempotency-Key.
fn per_key(sink: &Sink) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for request in sink.received() {
        *counts.entry(request.key.unwrap_or_default()).or_default() += 1;
    }
    counts
}

async fn events_are_listed_by_origin_key_prefix_time_and_state_a_page_at_a_time<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let outbox = db.inbox.outbox();
    let before = SystemTime::now() - Duration::from_secs(60);
    for n in 0..5 {
        receive(&db.inbox, "shop", &format!("order-{n}")).await;
    }
    receive(&db.inbox, "shop", "refund-1").await;
    receive(&db.inbox, "crm", "lead-1").await;
    // The shop's refund is refused for good; the crm's lead is never relayed.
    let sink = Sink::scripted(Arc::new(|key, _| {
        Answer::status(if key.contains("refund") { 400 } else { 200 })
    }))
    .await;
    relay_all(&relay_to(&outbox, &sink, &["shop"])).await;

    let keys = |filter: EventFilter| {
        let outbox = outbox.clone();
        async move {
            let page = outbox.events(&filter).await.unwrap();
            page.events.into_iter().map(|e| e.key).collect::<Vec<_>>()
        }
    };
    let all = keys(EventFilter::default()).await;
    assert_eq!(all.len(), 7, "{all:?}");
    assert_eq!(all[0], "shop:order-0", "oldest first");
    let crm = outbox
        .events(&EventFilter::default().origin("crm"))
        .await
        .unwrap();
    assert_eq!(crm.events.len(), 1);
    assert_eq!(crm.events[0].state, EventState::Due);
    assert_eq!(crm.events[0].origin, "crm");
    assert!(crm.next.is_none());
    assert_eq!(
        keys(EventFilter::default().key_prefix("shop:order-")).await,
        (0..5)
            .map(|n| format!("shop:order-{n}"))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        keys(EventFilter::default().state(EventState::Dead)).await,
        ["shop:refund-1"]
    );
    assert_eq!(
        keys(EventFilter::default().state(EventState::Delivered))
            .await
            .len(),
        5
    );
    assert_eq!(keys(EventFilter::default().since(before)).await.len(), 7);
    assert!(keys(EventFilter::default().until(before)).await.is_empty());
    let later = SystemTime::now() + Duration::from_secs(60);
    assert!(keys(EventFilter::default().since(later)).await.is_empty());

    // Pages of two, each after the cursor of the one before: every event once, in order.
    let mut paged = Vec::new();
    let mut filter = EventFilter::default().limit(2);
    loop {
        let page = outbox.events(&filter).await.unwrap();
        assert!(page.events.len() <= 2);
        paged.extend(page.events.into_iter().map(|e| e.key));
        match page.next {
            Some(cursor) => filter = EventFilter::default().limit(2).after(&cursor).unwrap(),
            None => break,
        }
    }
    assert_eq!(paged, all);
    assert!(matches!(
        EventFilter::default().after("not a cursor"),
        Err(Error::InvalidCursor(_))
    ));
    db.cleanup().await;
}

async fn an_event_is_shown_whole_with_its_attempts_by_id_and_by_key<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let outbox = db.inbox.outbox();
    let key = receive(&db.inbox, "shop", "order-1").await;
    let sink = Sink::scripted(Arc::new(|_, attempt| {
        Answer::status(if attempt == 1 { 503 } else { 200 })
    }))
    .await;
    let relay = relay_to(&outbox, &sink, &["shop"]).options(
        justonce_sql::RelayOptions::default()
            .first_backoff(Duration::ZERO)
            .max_backoff(Duration::ZERO),
    );
    relay_all(&relay).await;

    let by_key = outbox.events_with_key(key.as_str()).await.unwrap();
    assert_eq!(by_key.len(), 1);
    let shown = outbox.event(by_key[0].event.id).await.unwrap().unwrap();
    assert_eq!(shown, by_key[0]);
    assert_eq!(shown.event.key, "shop:order-1");
    assert_eq!(shown.event.state, EventState::Delivered);
    assert_eq!(shown.payload, br#"{"id":"order-1"}"#);
    assert!(
        shown
            .headers
            .contains(&("content-type".to_owned(), "json".to_owned()))
    );
    let statuses: Vec<Option<u16>> = shown.attempts.iter().map(|a| a.status).collect();
    assert_eq!(statuses, [Some(503), Some(200)]);
    assert!(
        outbox
            .event(shown.event.id + 1_000)
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        outbox
            .events_with_key("shop:none")
            .await
            .unwrap()
            .is_empty()
    );
    db.cleanup().await;
}

async fn a_delivered_event_replayed_reaches_its_target_again_with_the_same_key<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let outbox = db.inbox.outbox();
    let key = receive(&db.inbox, "shop", "order-1").await;
    let sink = Sink::start().await;
    let relay = relay_to(&outbox, &sink, &["shop"]);
    let id = outbox.events_with_key(key.as_str()).await.unwrap()[0]
        .event
        .id;
    // Not delivered yet: it waits already, and a replay changes nothing.
    assert!(!outbox.replay_event(id).await.unwrap());
    relay_all(&relay).await;
    assert_eq!(sink.requests(), 1);

    assert!(outbox.replay_event(id).await.unwrap());
    assert_eq!(
        outbox.event(id).await.unwrap().unwrap().event.state,
        EventState::Due
    );
    assert!(
        !outbox.replay_event(id).await.unwrap(),
        "a replay waiting is not doubled"
    );
    relay_all(&relay).await;
    let received = sink.received();
    assert_eq!(received.len(), 2);
    assert!(
        received
            .iter()
            .all(|r| r.key.as_deref() == Some("shop:order-1"))
    );
    assert_eq!(received[0].body, received[1].body);
    let shown = outbox.event(id).await.unwrap().unwrap();
    assert_eq!(shown.event.state, EventState::Delivered);
    let numbers: Vec<u32> = shown.attempts.iter().map(|a| a.attempt).collect();
    assert_eq!(numbers, [1, 1], "the replay's attempts count from 1 again");

    // By key: the same, once more.
    assert_eq!(outbox.replay_key(key.as_str()).await.unwrap(), 1);
    assert_eq!(outbox.replay_key(key.as_str()).await.unwrap(), 0);
    relay_all(&relay).await;
    assert_eq!(per_key(&sink)["shop:order-1"], 3);
    db.cleanup().await;
}

async fn a_range_replay_delivers_each_event_once_more_and_refuses_an_overlapping_one_meanwhile<
    DB: TestBackend,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let outbox = db.inbox.outbox();
    let since = SystemTime::now() - Duration::from_secs(60);
    for n in 0..20 {
        receive(&db.inbox, "shop", &format!("order-{n}")).await;
    }
    receive(&db.inbox, "crm", "lead-1").await;
    let sink = Sink::start().await;
    let relay = relay_to(&outbox, &sink, &["shop", "crm"]);
    relay_all(&relay).await;
    assert_eq!(sink.requests(), 21);

    let range = ReplayRange::new("shop", since);
    assert_eq!(outbox.replayable(&range).await.unwrap(), 20);
    let window = outbox.replay_range(&range).await.unwrap();
    assert_eq!((window.events, window.running), (20, true));
    assert_eq!(window.origin, "shop");
    assert_eq!(outbox.replayable(&range).await.unwrap(), 0);

    // Overlapping the running one: refused, nothing changed.
    let overlapping = ReplayRange::new("shop", since + Duration::from_secs(30));
    match outbox.replay_range(&overlapping).await {
        Err(Error::ReplayRunning { origin, window: id }) => {
            assert_eq!((origin.as_str(), id), ("shop", window.id));
        }
        other => panic!("an overlapping replay ran: {other:?}"),
    }
    // Another origin's range, and a range that ended before this one began, run.
    let crm = outbox
        .replay_range(&ReplayRange::new("crm", since))
        .await
        .unwrap();
    assert_eq!(crm.events, 1);
    let before = ReplayRange::new("shop", since - Duration::from_secs(3_600))
        .until(since - Duration::from_secs(1_800));
    assert_eq!(outbox.replay_range(&before).await.unwrap().events, 0);

    relay_all(&relay).await;
    let counts = per_key(&sink);
    assert_eq!(counts.len(), 21);
    assert!(counts.values().all(|&n| n == 2), "{counts:?}");
    let done = outbox.replay_window(window.id).await.unwrap().unwrap();
    assert!(!done.running);
    assert_eq!(done.events, 20);
    let latest = outbox.replay_windows(10).await.unwrap();
    assert_eq!(latest.len(), 3);
    assert!(latest.iter().any(|w| w.id == window.id));

    // Once delivered, the same range may be replayed again.
    assert_eq!(outbox.replay_range(&range).await.unwrap().events, 20);
    db.cleanup().await;
}

async fn delivered_events_are_purged_by_their_origins_retention_only<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let outbox = db.inbox.outbox();
    let old = receive(&db.inbox, "shop", "old").await;
    receive(&db.inbox, "crm", "old").await;
    let sink = Sink::start().await;
    relay_all(&relay_to(&outbox, &sink, &["shop", "crm"])).await;
    // Both received two hours ago; then one more of the shop's, not delivered yet.
    DB::age_rows(
        db.inbox.pool(),
        format!("{}outbox", db.prefix),
        "received_at",
        2 * 3_600_000,
    )
    .await;
    let waiting = receive(&db.inbox, "shop", "new").await;

    let hour = Duration::from_secs(3_600);
    assert_eq!(outbox.purge_events("shop", 3 * hour, 10).await.unwrap(), 0);
    assert_eq!(outbox.purge_events("shop", hour, 1).await.unwrap(), 1);
    assert!(
        outbox
            .events_with_key(old.as_str())
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        outbox
            .events_with_key(waiting.as_str())
            .await
            .unwrap()
            .len(),
        1,
        "an event waiting for its delivery stays"
    );
    let crm = outbox.events(&EventFilter::default().origin("crm")).await;
    assert_eq!(crm.unwrap().events.len(), 1, "another origin's event stays");
    db.cleanup().await;
}
