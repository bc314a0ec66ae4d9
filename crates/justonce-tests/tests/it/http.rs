//! The relay's HTTP destination against a real receiver on loopback.

use super::{key, on_every_database};
use justonce_core::Scope;
use justonce_http::HttpDestination;
use justonce_sql::{Inbox, Message, RelayOptions, TraceContext};
use justonce_tests::{Answer, RunningRelay, Sink, TestBackend, TestDb};
use std::sync::Arc;
use std::time::Duration;

on_every_database!(
    rows_are_posted_with_their_key_body_and_headers,
    server_errors_are_retried_and_client_errors_dead_lettered,
    retry_after_is_honoured,
    unreachable_and_slow_receivers_are_retried,
    poisoned_answers_are_recorded_and_dead_lettered_after_one_request,
    a_key_outside_visible_ascii_travels_percent_encoded,
    a_target_that_never_answers_holds_back_no_other_and_is_backed_off,
    a_scope_a_target_hangs_on_holds_back_no_other_scope,
    rows_of_a_backed_off_target_past_their_window_are_dead_lettered_together,
    a_rows_trace_context_reaches_the_target,
);

fn eager() -> RelayOptions {
    RelayOptions::default()
        .first_backoff(Duration::ZERO)
        .max_backoff(Duration::ZERO)
}

async fn enqueue<DB: TestBackend>(inbox: &Inbox<DB>, id: &str, body: &str) -> i64 {
    let id = key(id);
    let outcome = inbox
        .run(&id, body.as_bytes(), |tx| {
            let message = Message::new("hooks", body).header("content-type", "application/json");
            Box::pin(inbox.enqueue(tx, &id, "notify", message))
        })
        .await
        .expect("run");
    outcome.processed().expect("a new key")
}

async fn rows_are_posted_with_their_key_body_and_headers<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let sink = Sink::start().await;
    for n in 0..3 {
        enqueue(&db.inbox, &format!("evt_{n}"), &format!("{{\"n\":{n}}}")).await;
    }
    let relay = db
        .inbox
        .outbox()
        .relay()
        .destination("hooks", HttpDestination::new(&sink.url()).unwrap());
    assert_eq!(relay.relay_once().await.unwrap().sent, 3);
    let received = sink.received();
    assert_eq!(received.len(), 3);
    for n in 0..3 {
        let expected = db
            .inbox
            .identity(&key(&format!("evt_{n}")))
            .derive("notify");
        let request = received
            .iter()
            .find(|request| request.key.as_deref() == Some(expected.as_str()))
            .expect("a request with the row's derived key");
        assert_eq!(request.body, format!("{{\"n\":{n}}}").into_bytes());
        assert_eq!(request.headers["content-type"], "application/json");
    }
    db.cleanup().await;
}

async fn server_errors_are_retried_and_client_errors_dead_lettered<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let flaky_key = db
        .inbox
        .identity(&key("flaky"))
        .derive("notify")
        .to_string();
    let replayed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let accepting = Arc::clone(&replayed);
    let sink = Sink::scripted(Arc::new(move |key, attempt| {
        if key == flaky_key {
            Answer::status(if attempt == 1 { 500 } else { 200 })
        } else if accepting.load(std::sync::atomic::Ordering::SeqCst) {
            Answer::status(200)
        } else {
            Answer {
                body: b"unknown customer cust_9".to_vec(),
                ..Answer::status(400)
            }
        }
    }))
    .await;
    let flaky = enqueue(&db.inbox, "flaky", "a").await;
    let refused = enqueue(&db.inbox, "refused", "b").await;
    let outbox = db.inbox.outbox();
    let relay = outbox
        .relay()
        .options(eager())
        .destination("hooks", HttpDestination::new(&sink.url()).unwrap());

    let round = relay.relay_once().await.unwrap();
    assert_eq!((round.retried, round.dead), (1, 1));
    assert_eq!(relay.relay_once().await.unwrap().sent, 1);
    assert!(outbox.get(flaky).await.unwrap().unwrap().sent);
    let dead = outbox.get(refused).await.unwrap().unwrap();
    let reason = dead.last_error.unwrap();
    assert!(dead.dead && reason.contains("400") && reason.contains("unknown customer cust_9"));

    replayed.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(outbox.replay(refused).await.unwrap());
    assert_eq!(relay.relay_once().await.unwrap().sent, 1);
    // Two rows, each sent twice, each time with its own key.
    let mut per_key = std::collections::HashMap::<String, usize>::new();
    for request in sink.received() {
        *per_key.entry(request.key.unwrap()).or_default() += 1;
    }
    assert_eq!(per_key.len(), 2, "a retry or a replay sent another key");
    assert!(per_key.values().all(|count| *count == 2));
    db.cleanup().await;
}

async fn retry_after_is_honoured<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let sink = Sink::scripted(Arc::new(|_, attempt| match attempt {
        1 => Answer {
            headers: vec![("retry-after", "30".to_owned())],
            ..Answer::status(429)
        },
        _ => Answer::status(200),
    }))
    .await;
    let id = enqueue(&db.inbox, "evt", "x").await;
    let relay = db
        .inbox
        .outbox()
        .relay()
        .options(RelayOptions::default().first_backoff(Duration::ZERO))
        .destination("hooks", HttpDestination::new(&sink.url()).unwrap());
    assert_eq!(relay.relay_once().await.unwrap().retried, 1);
    // Without a backoff of its own, only Retry-After keeps the row from being due at once.
    assert_eq!(relay.relay_once().await.unwrap().taken, 0);
    let row = db.inbox.outbox().get(id).await.unwrap().unwrap();
    assert!(row.last_error.unwrap().contains("429"));
    db.cleanup().await;
}

async fn unreachable_and_slow_receivers_are_retried<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    // A port that was just free: nothing listens there.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let slow = Sink::scripted(Arc::new(|_, _| Answer {
        delay: Duration::from_secs(5),
        ..Answer::status(200)
    }))
    .await;
    let down = enqueue(&db.inbox, "down", "x").await;
    let relay = db.inbox.outbox().relay().options(eager()).destination(
        "hooks",
        HttpDestination::new(&format!("http://{closed}/hook")).unwrap(),
    );
    assert_eq!(relay.relay_once().await.unwrap().retried, 1);
    let reason = db
        .inbox
        .outbox()
        .get(down)
        .await
        .unwrap()
        .unwrap()
        .last_error
        .unwrap();
    assert!(reason.contains("POST"), "{reason}");

    let relay = db.inbox.outbox().relay().options(eager()).destination(
        "hooks",
        HttpDestination::with_timeout(&slow.url(), Duration::from_millis(200)).unwrap(),
    );
    assert_eq!(relay.relay_once().await.unwrap().retried, 1);
    assert_eq!(slow.received().len(), 1);
    db.cleanup().await;
}

#[test]
fn destination_urls_are_checked() {
    for bad in ["", "not a url", "ftp://example.com/x"] {
        let error = HttpDestination::new(bad).unwrap_err();
        assert!(
            matches!(error, justonce_sql::Error::Config(_)),
            "{bad:?}: {error}"
        );
    }
}

/// Deliveries signed with a target secret verify as Standard Webhooks, with the row's key
/// as the webhook id.
#[tokio::test]
async fn signed_deliveries_verify_as_standard_webhooks() {
    use base64::Engine;
    let db = TestDb::<sqlx::Sqlite>::new("signed").await;
    let secret = format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(b"target key")
    );
    let sink = Sink::start().await;
    enqueue(&db.inbox, "evt_1", r#"{"a":1}"#).await;
    let destination = HttpDestination::new(&sink.url())
        .unwrap()
        .signed_with(&secret)
        .unwrap();
    let relay = db.inbox.outbox().relay().destination("hooks", destination);
    assert_eq!(relay.relay_once().await.unwrap().sent, 1);
    let request = &sink.received()[0];
    let mut headers = axum::http::HeaderMap::new();
    for (name, value) in &request.headers {
        headers.insert(
            axum::http::HeaderName::try_from(name.as_str()).unwrap(),
            value.parse().unwrap(),
        );
    }
    assert_eq!(headers["webhook-id"], request.key.clone().unwrap().as_str());
    let scheme =
        justonce_http::receiver::Scheme::standard_webhooks(&[secret], Duration::from_secs(60))
            .unwrap();
    assert_eq!(scheme.verify(&headers, &request.body), Ok(()));
    let wrong = justonce_http::receiver::Scheme::standard_webhooks(
        &["whsec_d3Jvbmc=".to_owned()],
        Duration::from_secs(60),
    )
    .unwrap();
    assert!(wrong.verify(&headers, &request.body).is_err());
    assert!(
        HttpDestination::new(&sink.url())
            .unwrap()
            .signed_with("whsec_!")
            .is_err()
    );
    db.cleanup().await;
}

/// Whatever a target answers is stored as text: NUL bytes (which PostgreSQL's `text`
/// refuses), invalid UTF-8 and a megabyte each dead-letter their row after one request.
async fn poisoned_answers_are_recorded_and_dead_lettered_after_one_request<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let keys: Vec<String> = ["nul", "invalid", "huge"]
        .iter()
        .map(|id| db.inbox.identity(&key(id)).derive("notify").to_string())
        .collect();
    let answers = keys.clone();
    let sink = Sink::scripted(Arc::new(move |key, _| {
        let body = match answers.iter().position(|k| k == key) {
            Some(0) => b"refused\0here".to_vec(),
            Some(1) => b"refused \xff\xfe here".to_vec(),
            _ => vec![b'x'; 1 << 20],
        };
        Answer {
            body,
            ..Answer::status(400)
        }
    }))
    .await;
    let mut ids = Vec::new();
    for id in ["nul", "invalid", "huge"] {
        ids.push(enqueue(&db.inbox, id, "x").await);
    }
    let outbox = db.inbox.outbox();
    let relay = outbox
        .relay()
        .options(eager())
        .destination("hooks", HttpDestination::new(&sink.url()).unwrap());
    assert_eq!(relay.relay_once().await.unwrap().dead, 3);
    assert_eq!(relay.relay_once().await.unwrap().taken, 0);
    assert_eq!(sink.requests(), 3, "one request per row");
    for id in ids {
        let row = outbox.get(id).await.unwrap().unwrap();
        let reason = row.last_error.unwrap();
        assert!(row.dead && reason.contains("400 Bad Request"), "{reason}");
        assert!(
            !reason.contains('\0') && reason.len() <= 1_024,
            "{reason:?}"
        );
    }
    db.cleanup().await;
}

/// A key of any characters reaches an ASCII-only target: the bytes a header cannot carry
/// as they are travel as `%XX`, and percent-decoding gives the key back.
async fn a_key_outside_visible_ascii_travels_percent_encoded<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let sink = Sink::start().await;
    let event = key("shop:caf\u{e9} 100%");
    let message = Message::new("hooks", b"{}".to_vec());
    let outcome = db.inbox.run_forward(&event, b"{}", message).await.unwrap();
    assert_eq!(outcome, justonce_sql::Outcome::Processed(()));
    let relay = db
        .inbox
        .outbox()
        .relay()
        .destination("hooks", HttpDestination::new(&sink.url()).unwrap());
    assert_eq!(relay.relay_once().await.unwrap().sent, 1);
    let received = sink.received();
    assert_eq!(received[0].key.as_deref(), Some("shop:caf%C3%A9%20100%25"));
    db.cleanup().await;
}

/// A target that accepts connections and answers nothing until told to, counting them.
struct Silent {
    url: String,
    connections: Arc<std::sync::atomic::AtomicUsize>,
    answering: Arc<std::sync::atomic::AtomicBool>,
}

impl Silent {
    async fn start() -> Self {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let answering = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (counted, told) = (Arc::clone(&connections), Arc::clone(&answering));
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                let answer = told.load(Ordering::SeqCst);
                tokio::spawn(async move {
                    if !answer {
                        // Holds the connection, never answering.
                        let mut sink = [0; 1024];
                        while stream.read(&mut sink).await.is_ok_and(|n| n > 0) {}
                        return;
                    }
                    let mut head = Vec::new();
                    let mut buffer = [0; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buffer).await {
                            Ok(n) if n > 0 => head.extend_from_slice(&buffer[..n]),
                            _ => return,
                        }
                    }
                    let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
                    let _ = stream.write_all(ok).await;
                });
            }
        });
        Self {
            url,
            connections,
            answering,
        }
    }

    fn connections(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::SeqCst)
    }
}

async fn enqueue_for<DB: TestBackend>(inbox: &Inbox<DB>, id: &str, destination: &str) -> i64 {
    let id = key(id);
    let outcome = inbox
        .run(&id, b"x", |tx| {
            Box::pin(inbox.enqueue(tx, &id, "notify", Message::new(destination, "x")))
        })
        .await
        .expect("run");
    outcome.processed().expect("a new key")
}

/// 40 rows for a target that accepts connections and never answers, then one for another
/// target: that one arrives within 2 s. The silent target's breaker opens after 5 failures
/// in a row, lets one probe through when each pause ends, and closes when the target
/// answers, after which every row of it is delivered.
async fn a_target_that_never_answers_holds_back_no_other_and_is_backed_off<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let silent = Silent::start().await;
    let sink = Sink::start().await;
    let mut silent_rows = Vec::new();
    for n in 0..40 {
        silent_rows.push(enqueue_for(&db.inbox, &format!("silent_{n}"), "silent").await);
    }
    let options = RelayOptions::default()
        .lease(Duration::from_secs(4))
        .first_backoff(Duration::from_millis(200))
        .breaker_pause(Duration::from_secs(1))
        .poll_interval(Duration::from_millis(100));
    let timeout = Duration::from_secs(1);
    let relay = db
        .inbox
        .outbox()
        .relay()
        .options(options)
        .destination(
            "silent",
            HttpDestination::with_timeout(&silent.url, timeout).unwrap(),
        )
        .destination("fast", HttpDestination::new(&sink.url()).unwrap());
    let started = std::time::Instant::now();
    let running = RunningRelay::start(relay);
    tokio::time::sleep(Duration::from_millis(200)).await;
    enqueue_for(&db.inbox, "fast_1", "fast").await;
    let posted = std::time::Instant::now();
    while sink.requests() == 0 {
        assert!(
            posted.elapsed() < Duration::from_secs(2),
            "held back behind the silent target"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!(
        "another target's row arrived {:?} after it was written",
        posted.elapsed()
    );
    // The first failures come at about 1 s and open the breaker for 1 s (on a busy machine
    // a few more rows start before the fifth); one probe follows at about 2 s, fails at
    // 3 s, and the breaker stays open until about 5 s.
    tokio::time::sleep_until((started + Duration::from_millis(1_800)).into()).await;
    let opened = silent.connections();
    tokio::time::sleep_until((started + Duration::from_millis(4_500)).into()).await;
    let probes = silent.connections() - opened;
    assert_eq!(
        probes, 1,
        "{opened} connections, then {probes} probes in one pause"
    );
    let outbox = db.inbox.outbox();
    let backed_off = outbox.backed_off().await.unwrap();
    assert_eq!(backed_off.len(), 1, "{backed_off:?}");
    assert_eq!(backed_off[0].destination, "silent");
    assert!(backed_off[0].failures >= 5, "{backed_off:?}");
    silent
        .answering
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    for id in &silent_rows {
        while !outbox.get(*id).await.unwrap().unwrap().sent {
            assert!(
                std::time::Instant::now() < deadline,
                "row {id} was never sent"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    running.stop().await;
    assert_eq!(outbox.backed_off().await.unwrap(), Vec::new(), "closed");
    // Each attempt counted is a request the target saw: rows taken but never tried, while
    // the breaker opened or their lease ran short, gave their attempt back.
    let mut attempts = 0;
    for id in &silent_rows {
        attempts += outbox.get(*id).await.unwrap().unwrap().attempts as usize;
    }
    assert_eq!(
        attempts,
        silent.connections(),
        "attempts counted against requests seen"
    );
    db.cleanup().await;
}

/// One destination, whose target hangs past the timeout on every row of the scope `slow`:
/// 40 of them do not delay a row of the scope `quick`, neither while they fill their lane
/// nor while their breaker, the lane's own, holds them back.
async fn a_scope_a_target_hangs_on_holds_back_no_other_scope<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let slow = db.inbox.with_scope(Scope::new("slow").unwrap());
    let quick = db.inbox.with_scope(Scope::new("quick").unwrap());
    let mut hanging = std::collections::HashSet::new();
    for n in 0..40 {
        let id = format!("slow_{n}");
        enqueue_for(&slow, &id, "shared").await;
        hanging.insert(slow.identity(&key(&id)).derive("notify").to_string());
    }
    let sink = Sink::scripted(Arc::new(move |key, _| {
        let mut answer = Answer::status(200);
        if hanging.contains(key) {
            answer.delay = Duration::from_secs(60);
        }
        answer
    }))
    .await;
    let options = RelayOptions::default()
        .lease(Duration::from_secs(8))
        .breaker_pause(Duration::from_secs(30))
        .poll_interval(Duration::from_millis(100));
    let timeout = Duration::from_secs(2);
    let relay = db.inbox.outbox().relay().options(options).destination(
        "shared",
        HttpDestination::with_timeout(&sink.url(), timeout).unwrap(),
    );
    let running = RunningRelay::start(relay);
    let outbox = db.inbox.outbox();
    while sink.requests() < 8 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut waits = Vec::new();
    for n in 0..2 {
        if n == 1 {
            // The slow scope's first deliveries time out at about 2 s and open its breaker.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while outbox.backed_off().await.unwrap().is_empty() {
                assert!(std::time::Instant::now() < deadline, "no breaker opened");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let id = format!("quick_{n}");
        let expected = quick.identity(&key(&id)).derive("notify").to_string();
        enqueue_for(&quick, &id, "shared").await;
        let written = std::time::Instant::now();
        loop {
            let received = sink.received();
            if let Some(request) = received.iter().find(|r| r.key.as_ref() == Some(&expected)) {
                waits.push(request.at.saturating_duration_since(written));
                break;
            }
            assert!(
                written.elapsed() < Duration::from_secs(20),
                "the quick scope's row {n} never arrived"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    eprintln!("the quick scope's rows arrived after {waits:?}");
    let backed_off = outbox.backed_off().await.unwrap();
    running.stop().await;
    for wait in &waits {
        assert!(
            *wait < Duration::from_secs(1),
            "held back behind the slow scope: {waits:?}"
        );
    }
    assert_eq!(backed_off.len(), 1, "{backed_off:?}");
    assert_eq!(
        (
            backed_off[0].destination.as_str(),
            backed_off[0].scope.as_str()
        ),
        ("shared", "slow")
    );
    db.cleanup().await;
}

/// 40 rows for a target that never answers, retried for 3 s: once their window has passed,
/// the breaker's next opening dead-letters them all, without a request for each.
async fn rows_of_a_backed_off_target_past_their_window_are_dead_lettered_together<
    DB: TestBackend,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let silent = Silent::start().await;
    let mut rows = Vec::new();
    for n in 0..40 {
        rows.push(enqueue_for(&db.inbox, &format!("late_{n}"), "silent").await);
    }
    let options = RelayOptions::default()
        .lease(Duration::from_secs(4))
        .first_backoff(Duration::from_millis(200))
        .breaker_pause(Duration::from_secs(1))
        .poll_interval(Duration::from_millis(100));
    let relay = db.inbox.outbox().relay().options(options).destination_for(
        "silent",
        HttpDestination::with_timeout(&silent.url, Duration::from_secs(1)).unwrap(),
        Duration::from_secs(3),
    );
    let running = RunningRelay::start(relay);
    let outbox = db.inbox.outbox();
    // Probes fail at about 3 s and 6 s; the opening after the window dead-letters the rest.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    for id in &rows {
        loop {
            let row = outbox.get(*id).await.unwrap().unwrap();
            if row.dead {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "row {id} is not dead-lettered after its window: {row:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    running.stop().await;
    let tried = silent.connections();
    assert!(
        tried < rows.len() / 2,
        "{tried} requests for {} rows: dead-lettered one by one",
        rows.len()
    );
    db.cleanup().await;
}

/// A trace context attached to an enqueued message travels with its row and reaches the
/// target, in place of any `traceparent` the message had; a row without one sends none.
async fn a_rows_trace_context_reaches_the_target<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let sink = Sink::start().await;
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let context = TraceContext::parse(parent, Some("congo=t61rcWkgMzE")).unwrap();
    for (id, context) in [("evt_traced", Some(&context)), ("evt_plain", None)] {
        let id = key(id);
        let outcome = db
            .inbox
            .run(&id, b"{}", |tx| {
                let message = match context {
                    Some(context) => Message::new("hooks", "{}")
                        .header("traceparent", "00-stale-01")
                        .header("TraceState", "stale=1")
                        .trace_context(context),
                    None => Message::new("hooks", "{}"),
                };
                Box::pin(db.inbox.enqueue(tx, &id, "notify", message))
            })
            .await
            .expect("run");
        outcome.processed().expect("a new key");
    }
    let relay = db
        .inbox
        .outbox()
        .relay()
        .destination("hooks", HttpDestination::new(&sink.url()).unwrap());
    assert_eq!(relay.relay_once().await.unwrap().sent, 2);
    let received = sink.received();
    let by_id = |id: &str| {
        let expected = db.inbox.identity(&key(id)).derive("notify");
        received
            .iter()
            .find(|request| request.key.as_deref() == Some(expected.as_str()))
            .unwrap_or_else(|| panic!("{id} not received"))
    };
    let traced = by_id("evt_traced");
    assert_eq!(traced.headers["traceparent"], parent);
    assert_eq!(traced.headers["tracestate"], "congo=t61rcWkgMzE");
    let plain = by_id("evt_plain");
    assert!(!plain.headers.contains_key("traceparent"));
    assert!(!plain.headers.contains_key("tracestate"));
    db.cleanup().await;
}
