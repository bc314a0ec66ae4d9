//! Stored events: listed by origin, key prefix, time and state a page at a time, shown
//! whole, replayed one at a time or by time range with the same key, a replay of a range
//! still running refusing an overlapping one, and purged by their origin's retention.

use super::broker::counted;
use super::on_every_database;
use justonce_http::HttpDestination;
use justonce_sql::{
    Delivered, Delivery, Destination, Error, EventDetail, EventFilter, EventPage, EventState,
    Inbox, KEY_CONTAINS_WINDOW, Key, Message, Outbox, Outcome, Relay, RelayOptions, ReplayRange,
};
use justonce_tests::{Answer, Sink, TestBackend, TestDb};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::Semaphore;

on_every_database!(
    events_are_listed_by_origin_key_prefix_time_and_state_a_page_at_a_time,
    events_are_found_by_any_part_of_their_key_wildcards_taken_as_written,
    a_search_by_part_of_the_key_reads_the_last_day_unless_given_a_start,
    an_event_is_shown_whole_with_its_attempts_by_id_and_by_key,
    a_delivered_event_replayed_reaches_its_target_again_with_the_same_key,
    a_range_replay_delivers_each_event_once_more_and_refuses_an_overlapping_one_meanwhile,
    delivered_events_are_purged_by_their_origins_retention_only,
    a_slow_relays_late_answer_does_not_undo_a_replay,
    a_late_failure_does_not_undo_the_replay_of_a_row_dead_lettered_in_flight,
    a_late_success_is_not_recorded_over_the_replay_of_a_row_dead_lettered_in_flight,
    an_event_written_by_an_earlier_version_is_found_and_replayed_by_time,
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

/// A partner says "order 1042": the operator searches a part of the key, wherever it is in
/// the key. `%`, `_` and `\` are the characters they are, not patterns; a prefix is
/// matched byte for byte, case included.
async fn events_are_found_by_any_part_of_their_key_wildcards_taken_as_written<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let keys = [
        "order:1042:a",
        "x-1042",
        "order:9",
        "100%",
        "a_b",
        "axb",
        "back\\slash",
        "ORDER:7",
    ];
    for key in keys {
        let consumer = db.consumer("shop");
        let message = Message::new("shop", key.as_bytes().to_vec());
        let outcome = consumer
            .run_forward(&Key::new(key).unwrap(), key.as_bytes(), message)
            .await
            .unwrap();
        assert!(matches!(outcome, Outcome::Processed(())), "{key}");
    }
    let outbox = db.inbox.outbox();
    let found = |filter: EventFilter| {
        let outbox = outbox.clone();
        async move {
            let page = outbox.events(&filter).await.unwrap();
            page.events.into_iter().map(|e| e.key).collect::<Vec<_>>()
        }
    };
    let containing = |part: &str| found(EventFilter::default().key_contains(part));
    assert_eq!(containing("1042").await, ["order:1042:a", "x-1042"]);
    assert_eq!(containing("%").await, ["100%"]);
    assert_eq!(containing("_").await, ["a_b"]);
    assert_eq!(containing("\\").await, ["back\\slash"]);
    assert_eq!(containing("0%").await, ["100%"]);
    assert!(containing("%1042").await.is_empty());
    assert!(containing("order:1042:a:longer").await.is_empty());
    assert_eq!(containing("order").await, ["order:1042:a", "order:9"]);

    let starting = |prefix: &str| found(EventFilter::default().key_prefix(prefix));
    assert_eq!(starting("order:").await, ["order:1042:a", "order:9"]);
    assert_eq!(starting("order:1042").await, ["order:1042:a"]);
    assert_eq!(starting("ORDER").await, ["ORDER:7"]);
    assert_eq!(starting("a_").await, ["a_b"]);
    assert_eq!(starting("100%").await, ["100%"]);
    assert!(starting("1042").await.is_empty());
    assert!(
        starting("order:9 ").await.is_empty(),
        "a trailing space is a character"
    );
    assert!(starting("%").await.is_empty());
    // Both at once, and with the other filters.
    assert_eq!(
        found(
            EventFilter::default()
                .origin("shop")
                .key_prefix("order:")
                .key_contains("42")
        )
        .await,
        ["order:1042:a"]
    );
    db.cleanup().await;
}

/// No index serves a search by part of the key, so without a start it reads the events of
/// the last day only, and says so; a prefix needs no window; a start given is kept.
async fn a_search_by_part_of_the_key_reads_the_last_day_unless_given_a_start<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let outbox = db.inbox.outbox();
    receive(&db.inbox, "shop", "order-1042-old").await;
    let day = KEY_CONTAINS_WINDOW.as_millis() as i64;
    let table = format!("{}outbox", db.prefix);
    // Older than the window by two hours, clear of any rounding of stored times.
    DB::age_rows(db.inbox.pool(), table, "received_at", day + 7_200_000).await;
    receive(&db.inbox, "shop", "order-1042-new").await;
    let keys = |page: &EventPage| {
        page.events
            .iter()
            .map(|e| e.key.clone())
            .collect::<Vec<_>>()
    };

    let before = SystemTime::now();
    let page = (outbox.events(&EventFilter::default().key_contains("1042")))
        .await
        .unwrap();
    assert_eq!(keys(&page), ["shop:order-1042-new"]);
    let since = page.searched_since.expect("the window searched is said");
    let window = before.duration_since(since).unwrap();
    assert!(
        window <= KEY_CONTAINS_WINDOW && window > KEY_CONTAINS_WINDOW - Duration::from_secs(60),
        "searched since {window:?} ago"
    );
    // The window ends where the filter ends.
    let until = SystemTime::now() - Duration::from_secs(3_600);
    let filter = EventFilter::default().key_contains("1042").until(until);
    let page = outbox.events(&filter).await.unwrap();
    assert!(page.events.is_empty(), "{:?}", keys(&page));
    assert_eq!(page.searched_since, Some(until - KEY_CONTAINS_WINDOW));

    let two_days = SystemTime::now() - 2 * KEY_CONTAINS_WINDOW;
    let filter = EventFilter::default().key_contains("1042").since(two_days);
    let page = outbox.events(&filter).await.unwrap();
    assert_eq!(keys(&page), ["shop:order-1042-old", "shop:order-1042-new"]);
    assert_eq!(page.searched_since, None, "the start given is the window");
    let page = (outbox.events(&EventFilter::default().key_prefix("shop:order-1042")))
        .await
        .unwrap();
    assert_eq!(keys(&page), ["shop:order-1042-old", "shop:order-1042-new"]);
    assert_eq!(page.searched_since, None);
    db.cleanup().await;
}

/// MariaDB stores every time in UTC, whatever time zone the URL gives the session (sqlx
/// sets the session's zone from `timezone`): an event received now, by the current
/// version and by one before 5 that leaves the time to the column's default, is received
/// now by the UTC clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_stores_utc_times_whatever_the_sessions_time_zone() {
    use sqlx::MySql;
    let url = format!("{}?timezone=%2B05:00", justonce_tests::mysql_url());
    let db = TestDb::<MySql>::at(&url).await;
    let zone = MySql::texts(db.inbox.pool(), "SELECT @@session.time_zone".to_owned()).await;
    assert_eq!(zone.unwrap(), ["+05:00"], "the session is not in UTC");
    receive(&db.inbox, "shop", "order-1").await;
    let table = format!("{}outbox", db.prefix);
    MySql::execute(
        db.inbox.pool(),
        format!(
            "INSERT INTO {table}
                (scope, `key`, destination, payload, headers, created_at, next_attempt_at)
             SELECT scope, 'shop:order-2', destination, payload, headers, created_at,
                    next_attempt_at
             FROM {table}"
        ),
    )
    .await
    .unwrap();
    let now = SystemTime::now();
    let page = db
        .inbox
        .outbox()
        .events(&EventFilter::default())
        .await
        .unwrap();
    assert_eq!(page.events.len(), 2);
    for event in &page.events {
        let off = match now.duration_since(event.received_at) {
            Ok(ago) => ago,
            Err(ahead) => ahead.duration(),
        };
        assert!(
            off < Duration::from_secs(60),
            "{} received {off:?} away from now",
            event.key
        );
    }
    let recent = MySql::count(
        db.inbox.pool(),
        format!(
            "SELECT count(*) FROM {}migrations
             WHERE applied_at BETWEEN UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE AND UTC_TIMESTAMP(6)",
            db.prefix
        ),
    )
    .await;
    assert!(recent > 0, "the migrations were not recorded in UTC");
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

/// Which deliveries a [`Held`] destination answers with a failure that may pass; it takes
/// the others.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Refusing {
    None,
    All,
    AllButHeld,
}

/// A destination that holds the delivery of one key until the test lets it go: a target
/// that answers after the relay's lease ran out.
#[derive(Clone)]
struct Held {
    key: String,
    refusing: Refusing,
    started: Arc<Semaphore>,
    release: Arc<Semaphore>,
}

impl Held {
    fn new(key: &Key, refusing: Refusing) -> Self {
        Self {
            key: key.as_str().to_owned(),
            refusing,
            started: Arc::new(Semaphore::new(0)),
            release: Arc::new(Semaphore::new(0)),
        }
    }
}

impl Destination for Held {
    fn deliver<'a>(
        &'a self,
        delivery: Delivery<'a>,
    ) -> Pin<Box<dyn Future<Output = Delivered> + Send + 'a>> {
        Box::pin(async move {
            let held = delivery.key == self.key;
            if held {
                self.started.add_permits(1);
                self.release.acquire().await.unwrap().forget();
            }
            match (self.refusing, held) {
                (Refusing::All, _) | (Refusing::AllButHeld, false) => Delivered::Retry {
                    after: None,
                    reason: "answered 503".to_owned(),
                },
                _ => Delivered::Sent,
            }
        })
    }
}

/// How an operator replays an event.
#[derive(Debug, Clone, Copy)]
enum ReplayBy {
    Event,
    Key,
    Range,
    DeadLetter,
}

/// A relay takes an event and its target is slow; the relay's lease runs out, another
/// relay delivers the event (or dead-letters it), and the operator replays it. When the
/// slow target answers at last, the first relay's "sent" changes nothing: the replay stays
/// due and is delivered once more, with the same key. Each way of replaying.
async fn a_slow_relays_late_answer_does_not_undo_a_replay<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let outbox = db.inbox.outbox();
    let since = SystemTime::now() - Duration::from_secs(60);
    for by in [
        ReplayBy::Event,
        ReplayBy::Key,
        ReplayBy::Range,
        ReplayBy::DeadLetter,
    ] {
        let origin = format!("{by:?}").to_lowercase();
        let key = receive(&db.inbox, &origin, "order-1").await;
        let id = outbox.events_with_key(key.as_str()).await.unwrap()[0]
            .event
            .id;
        let held = Held::new(&key, Refusing::None);
        let slow = outbox
            .relay()
            .destination(&origin, held.clone())
            .options(RelayOptions::default().lease(Duration::from_secs(2)));
        let late = tokio::spawn(async move { slow.relay_once().await.unwrap() });
        held.started.acquire().await.unwrap().forget();

        // Once the lease has run out, by the store's clock, another relay takes the event.
        let refused = matches!(by, ReplayBy::DeadLetter);
        let sink = Sink::scripted(Arc::new(move |_, attempt| {
            Answer::status(if refused && attempt == 1 { 400 } else { 200 })
        }))
        .await;
        let relay = relay_to(&outbox, &sink, &[origin.as_str()]);
        while relay.relay_once().await.unwrap().taken == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let replayed = match by {
            ReplayBy::Event => u64::from(outbox.replay_event(id).await.unwrap()),
            ReplayBy::Key => outbox.replay_key(key.as_str()).await.unwrap(),
            ReplayBy::Range => {
                let range = ReplayRange::new(&origin, since);
                outbox.replay_range(&range).await.unwrap().events
            }
            ReplayBy::DeadLetter => u64::from(outbox.replay(id).await.unwrap()),
        };
        assert_eq!(replayed, 1, "{by:?}");

        held.release.add_permits(1);
        let round = late.await.unwrap();
        assert_eq!(round.taken, 1, "{by:?}");
        let shown = outbox.event(id).await.unwrap().unwrap();
        assert_eq!(
            shown.event.state,
            EventState::Due,
            "{by:?}: the slow relay's late answer undid the replay"
        );
        relay_all(&relay).await;
        assert_eq!(
            per_key(&sink)[key.as_str()],
            2,
            "{by:?}: the replay was not delivered"
        );
        let shown = outbox.event(id).await.unwrap().unwrap();
        assert_eq!(shown.event.state, EventState::Delivered, "{by:?}");
    }
    db.cleanup().await;
}

/// The origin of the events of [`replay_a_row_dead_lettered_in_flight`]: this test's own,
/// so that the metrics of its destination count this test's deliveries alone.
fn own_shop<DB: TestBackend>(db: &TestDb<DB>) -> String {
    format!("{}shop", db.prefix)
}

/// What `justonce_deliveries_total` counts for `destination` under `outcome`.
fn deliveries(destination: &str, outcome: &str) -> u64 {
    let labels = [("destination", destination), ("outcome", outcome)];
    counted("justonce_deliveries_total", &labels)
}

/// A relay sends `order-1` to a slow target, which refuses as `refusing`, while the
/// destination's breaker, opened by one failure, dead-letters every row past its delivery
/// window, the one in flight too; the operator replays it; then the slow target answers and
/// the relay stops. The replayed event's key and id, and the event as shown then.
async fn replay_a_row_dead_lettered_in_flight<DB: TestBackend>(
    db: &TestDb<DB>,
    refusing: Refusing,
) -> (Key, i64, EventDetail) {
    let outbox = db.inbox.outbox();
    let shop = own_shop(db);
    // Installs the recorder before anything is counted.
    assert_eq!(deliveries(&shop, "superseded"), 0);
    let slow = receive(&db.inbox, &shop, "order-1").await;
    receive(&db.inbox, &shop, "order-2").await;
    let id = outbox.events_with_key(slow.as_str()).await.unwrap()[0]
        .event
        .id;
    let held = Held::new(&slow, refusing);
    // Room for the two deliveries and no more: with room left, the relay takes again while
    // they run, and a take that chose its lanes before the breaker opened, and reached the
    // database after the replay, would take the replayed row back (an attempt counted).
    let options = RelayOptions::default()
        .concurrency(2)
        .deliver_for(Duration::ZERO)
        .breaker_failures(1)
        .breaker_pause(Duration::from_secs(60));
    let relay = outbox
        .relay()
        .destination(&shop, held.clone())
        .options(options);
    let running = justonce_tests::RunningRelay::start(relay);
    held.started.acquire().await.unwrap().forget();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while outbox.event(id).await.unwrap().unwrap().event.state != EventState::Dead {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the breaker did not dead-letter the row in flight"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(outbox.replay_event(id).await.unwrap());
    // The slow target answers at last; at its stop the relay records what is in flight.
    held.release.add_permits(1);
    running.stop().await;
    let shown = outbox.event(id).await.unwrap().unwrap();
    (slow, id, shown)
}

/// The row in flight is dead-lettered, then replayed; the slow target's late failure does
/// not dead-letter the replay again, and is counted as superseded, not as dead.
async fn a_late_failure_does_not_undo_the_replay_of_a_row_dead_lettered_in_flight<
    DB: TestBackend,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let (_, _, shown) = replay_a_row_dead_lettered_in_flight(&db, Refusing::All).await;
    assert_eq!(
        shown.event.state,
        EventState::Due,
        "the late failure dead-lettered the replay"
    );
    assert_eq!(shown.event.attempts, 0, "the replay's attempts count anew");
    let shop = own_shop(&db);
    assert_eq!(deliveries(&shop, "superseded"), 1);
    // The breaker dead-lettered both rows; the late failure is not counted again.
    assert_eq!(deliveries(&shop, "dead"), 2);
    db.cleanup().await;
}

/// The row in flight is dead-lettered, then replayed; then the slow target takes the first
/// delivery at last. The replay took the lease token away, so the relay's "sent" is not
/// recorded, nor counted as sent: the event stays due, its history without that attempt,
/// and the replay delivers it once more with the same key, which the target already has.
async fn a_late_success_is_not_recorded_over_the_replay_of_a_row_dead_lettered_in_flight<
    DB: TestBackend,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let outbox = db.inbox.outbox();
    let (slow, id, shown) = replay_a_row_dead_lettered_in_flight(&db, Refusing::AllButHeld).await;
    assert_eq!(
        (shown.event.state, shown.event.attempts),
        (EventState::Due, 0),
        "the late success was recorded over the replay"
    );
    assert!(
        shown.attempts.iter().all(|attempt| attempt.error.is_some()),
        "the late success is in the history: {:?}",
        shown.attempts
    );
    let shop = own_shop(&db);
    assert_eq!(
        (deliveries(&shop, "sent"), deliveries(&shop, "superseded")),
        (0, 1),
        "the late success was counted as sent"
    );
    let sink = Sink::start().await;
    relay_all(&relay_to(&outbox, &sink, &[shop.as_str()])).await;
    assert_eq!(per_key(&sink)[slow.as_str()], 1, "the replay was delivered");
    let shown = outbox.event(id).await.unwrap().unwrap();
    assert_eq!(shown.event.state, EventState::Delivered);
    assert_eq!(
        deliveries(&shop, "sent"),
        1,
        "the replay's delivery is counted"
    );
    db.cleanup().await;
}

/// A process of a version before stored events writes its outbox row without the time it
/// was received, as it knows no such column. The event is found by time, and replayed by
/// time range, as one the current version writes.
async fn an_event_written_by_an_earlier_version_is_found_and_replayed_by_time<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let outbox = db.inbox.outbox();
    let since = SystemTime::now() - Duration::from_secs(60);
    receive(&db.inbox, "shop", "order-1").await;
    // The earlier version's insert: every column it wrote, taken from the row above.
    let (table, key) = (format!("{}outbox", db.prefix), DB::quoted("key"));
    DB::execute(
        db.inbox.pool(),
        format!(
            "INSERT INTO {table}
                (scope, {key}, destination, payload, headers, created_at, next_attempt_at)
             SELECT scope, 'shop:order-2', destination, payload, headers, created_at,
                    next_attempt_at
             FROM {table}"
        ),
    )
    .await
    .unwrap();
    let found = outbox
        .events(&EventFilter::default().origin("shop").since(since))
        .await
        .unwrap();
    let keys: Vec<&str> = found.events.iter().map(|e| e.key.as_str()).collect();
    assert_eq!(keys, ["shop:order-1", "shop:order-2"]);
    let received = found.events[1].received_at;
    assert!(received >= since, "received at {received:?}");

    let sink = Sink::start().await;
    let relay = relay_to(&outbox, &sink, &["shop"]);
    relay_all(&relay).await;
    let range = ReplayRange::new("shop", since);
    assert_eq!(outbox.replay_range(&range).await.unwrap().events, 2);
    relay_all(&relay).await;
    assert_eq!(per_key(&sink)["shop:order-2"], 2);
    db.cleanup().await;
}
