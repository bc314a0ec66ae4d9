//! The retrying client against a real receiver on loopback: every try of a request carries
//! one Idempotency-Key, and only what is safe to retry is retried.

use justonce_http::client::{Error, IdempotencyKey, RetryPolicy, RetryingClient};
use justonce_sql::{Consumer, Identity, Key, Scope};
use justonce_tests::{Answer, Sink};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Retries at once, apart from what `Retry-After` asks.
fn client(max_attempts: u32) -> RetryingClient {
    RetryingClient::with_policy(
        RetryingClient::http_client(Duration::from_secs(5)).unwrap(),
        RetryPolicy::default()
            .max_attempts(max_attempts)
            .first_backoff(Duration::from_millis(1))
            .max_backoff(Duration::from_millis(250)),
    )
}

fn keys_sent(sink: &Sink) -> HashSet<Option<String>> {
    sink.received()
        .into_iter()
        .map(|request| request.key)
        .collect()
}

/// The receiver acts on every request it records, then fails to answer the first two: a
/// receiver that deduplicates on the key acts once, since all three tries carry one key.
#[tokio::test]
async fn server_errors_are_retried_with_one_key() {
    let sink = Sink::scripted(Arc::new(|_, attempt| match attempt {
        1 => Answer::status(503),
        2 => Answer {
            headers: vec![("retry-after", "1".to_owned())],
            ..Answer::status(503)
        },
        _ => Answer::status(201),
    }))
    .await;
    let sent = client(5)
        .post(sink.url())
        .body("charge 1200")
        .send()
        .await
        .unwrap();
    assert_eq!(sent.response.status(), 201);
    assert_eq!(sent.attempts, 3);
    assert_eq!(sent.key.as_str().len(), 32);
    assert_eq!(
        keys_sent(&sink),
        HashSet::from([Some(sent.key.to_string())])
    );
    let received = sink.received();
    assert!(
        received
            .iter()
            .all(|request| request.body == b"charge 1200")
    );
    // Retry-After: 1 was honoured, cut down to the policy's longest pause.
    let pause = received[2].at - received[1].at;
    assert!(
        pause >= Duration::from_millis(250) && pause < Duration::from_secs(1),
        "{pause:?}"
    );
}

/// A key the caller persisted, such as an outbox row's derived key, is sent unchanged; so
/// is an Idempotency-Key already on the request.
#[tokio::test]
async fn the_callers_key_is_sent_on_every_try() {
    let sink = Sink::scripted(Arc::new(|_, attempt| {
        Answer::status(if attempt < 3 { 502 } else { 200 })
    }))
    .await;
    let client = client(5);
    let derived = Identity::new(
        Scope::none(),
        Consumer::new("billing").unwrap(),
        Key::new("order-42").unwrap(),
    )
    .derive("charge");
    let sent = client
        .post(sink.url())
        .key(derived.clone())
        .send()
        .await
        .unwrap();
    assert_eq!((sent.response.status().as_u16(), sent.attempts), (200, 3));
    assert_eq!(sent.key.as_str(), derived.as_str());
    assert_eq!(keys_sent(&sink), HashSet::from([Some(derived.to_string())]));

    let mut request = reqwest::Request::new(reqwest::Method::POST, sink.url().parse().unwrap());
    request.headers_mut().insert(
        "idempotency-key",
        reqwest::header::HeaderValue::from_static("order-43:charge"),
    );
    let sent = client.execute(request, None).await.unwrap();
    assert_eq!((sent.key.as_str(), sent.attempts), ("order-43:charge", 3));
    assert_eq!(sink.received().len(), 6);
    assert!(keys_sent(&sink).contains(&Some("order-43:charge".to_owned())));
}

#[tokio::test]
async fn client_errors_are_not_retried() {
    for status in [400, 422] {
        let sink = Sink::scripted(Arc::new(move |_, _| Answer::status(status))).await;
        let sent = client(5)
            .post(sink.url())
            .key(IdempotencyKey::new("k1").unwrap())
            .send()
            .await
            .unwrap();
        assert_eq!(
            (sent.response.status().as_u16(), sent.attempts),
            (status, 1)
        );
        assert_eq!(sink.received().len(), 1, "{status} was retried");
    }
}

/// When the attempts run out, the last answer is returned as it is.
#[tokio::test]
async fn the_last_answer_is_returned_after_the_attempts() {
    let sink = Sink::scripted(Arc::new(|_, _| Answer::status(503))).await;
    let sent = client(4).post(sink.url()).send().await.unwrap();
    assert_eq!((sent.response.status().as_u16(), sent.attempts), (503, 4));
    assert_eq!(sink.received().len(), 4);
    assert_eq!(keys_sent(&sink).len(), 1);
}

/// No retry starts that would end after the time budget, however many attempts are left.
#[tokio::test]
async fn the_time_budget_stops_retries() {
    let sink = Sink::scripted(Arc::new(|_, _| Answer::status(500))).await;
    let client = RetryingClient::with_policy(
        RetryingClient::http_client(Duration::from_secs(5)).unwrap(),
        RetryPolicy::default()
            .max_attempts(1_000)
            .first_backoff(Duration::from_millis(40))
            .max_backoff(Duration::from_millis(40))
            .give_up_after(Duration::from_millis(300)),
    );
    let started = Instant::now();
    let sent = client.post(sink.url()).send().await.unwrap();
    assert!(
        sent.attempts > 1 && sent.attempts < 1_000,
        "{}",
        sent.attempts
    );
    assert_eq!(sink.received().len(), sent.attempts as usize);
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn a_refused_connection_gives_a_typed_error_after_the_attempts() {
    // A port that was just free: nothing listens there.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let error = client(3)
        .post(format!("http://{closed}/hook"))
        .key(IdempotencyKey::new("k2").unwrap())
        .send()
        .await
        .unwrap_err();
    match error {
        Error::NoAnswer {
            key,
            attempts,
            source,
        } => {
            assert_eq!((key.as_str(), attempts), ("k2", 3));
            assert!(source.is_connect(), "{source}");
        }
        other => panic!("{other}"),
    }
}

/// A body that could not be sent again is refused before anything is sent.
#[tokio::test]
async fn a_streaming_body_is_refused() {
    let sink = Sink::start().await;
    let error = client(3)
        .post(sink.url())
        .body(reqwest::Body::wrap(String::from("a stream")))
        .send()
        .await
        .unwrap_err();
    assert!(matches!(error, Error::UnrepeatableBody), "{error}");
    assert!(sink.received().is_empty());
}
