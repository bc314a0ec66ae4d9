//! The webhook receiver: stores once, answers 2xx every time, rejects with problem+json,
//! and hands the delivery to the relay.

use super::{on_every_database, respond};
use axum::body::Body;
use axum::http::{Request, StatusCode};
use ed25519_dalek::{Signer, SigningKey};
use justonce_http::HttpDestination;
use justonce_http::receiver::{IdLocation, Scheme, Source, router, standard_webhooks_signature};
use justonce_tests::{Sink, TestBackend, TestDb};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tower::ServiceExt;

on_every_database!(
    the_same_event_twice_is_stored_once_and_answered_200_both_times,
    rejected_requests_store_nothing,
    an_unreachable_database_answers_503,
    hostile_event_ids_get_400_problems_or_are_stored_once_as_given,
    json_ids_are_taken_as_their_exact_text,
    a_v1a_signed_event_is_stored_once_and_a_wrongly_signed_one_stores_nothing,
    the_senders_trace_context_reaches_the_target,
);

const KEY: &[u8] = b"the shop's signing key";
const LIMIT: usize = 1024;

fn shop() -> Source {
    let secret = format!("whsec_{}", base64_of(KEY));
    let scheme = Scheme::standard_webhooks(&[secret], Duration::from_secs(300)).unwrap();
    Source::new(
        "shop",
        scheme,
        IdLocation::Header("webhook-id".parse().unwrap()),
    )
    .unwrap()
}

/// The seed of the key the `partner` source signs with: `v1a` (ed25519) only.
const PARTNER_SEED: [u8; 32] = [7; 32];

fn partner() -> Source {
    let public = SigningKey::from_bytes(&PARTNER_SEED).verifying_key();
    let whpk = format!("whpk_{}", base64_of(public.as_bytes()));
    let scheme = Scheme::standard_webhooks(&[whpk], Duration::from_secs(300)).unwrap();
    Source::new(
        "partner",
        scheme,
        IdLocation::Header("webhook-id".parse().unwrap()),
    )
    .unwrap()
}

/// A request to the `partner` source signed `v1a` with the key of `seed`.
fn v1a_signed(seed: &[u8; 32], id: &str, body: &str) -> Request<Body> {
    let timestamp = now();
    let signature =
        SigningKey::from_bytes(seed).sign(format!("{id}.{timestamp}.{body}").as_bytes());
    Request::post("/webhooks/partner")
        .header("content-type", "application/json")
        .header("webhook-id", id)
        .header("webhook-timestamp", timestamp.to_string())
        .header(
            "webhook-signature",
            format!("v1a,{}", base64_of(&signature.to_bytes())),
        )
        .body(Body::from(body.to_owned()))
        .unwrap()
}

fn stripe() -> Source {
    let scheme = Scheme::Stripe {
        secrets: vec![b"whsec_stripe".to_vec()],
        tolerance: Duration::from_secs(300),
    };
    Source::new("stripe", scheme, IdLocation::Json("/id".to_owned())).unwrap()
}

fn base64_of(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn hmac_hex(key: &[u8], message: &str) -> String {
    use hmac::Mac;
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(key).unwrap();
    mac.update(message.as_bytes());
    mac.finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A request signed the Standard Webhooks way for the `shop` source.
fn signed(id: &str, body: &str) -> Request<Body> {
    let timestamp = now();
    Request::post("/webhooks/shop")
        .header("content-type", "application/json")
        .header("webhook-id", id)
        .header("webhook-timestamp", timestamp.to_string())
        .header(
            "webhook-signature",
            standard_webhooks_signature(KEY, id, timestamp, body.as_bytes()),
        )
        .body(Body::from(body.to_owned()))
        .unwrap()
}

async fn answer(app: &axum::Router, request: Request<Body>) -> (StatusCode, String, String) {
    let (status, headers, body) = respond(app, request).await;
    let content_type = headers
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (
        status,
        content_type,
        String::from_utf8(body.to_vec()).unwrap(),
    )
}

async fn the_same_event_twice_is_stored_once_and_answered_200_both_times<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let app = router(&db.inbox, vec![shop()], LIMIT);
    let body = r#"{"type":"order.paid","order":1}"#;
    for expected in ["accepted", "duplicate"] {
        let (status, _, answer_body) = answer(&app, signed("evt_1", body)).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            answer_body,
            format!(r#"{{"key":"shop:evt_1","status":"{expected}"}}"#)
        );
    }
    let (status, _, reused) = answer(&app, signed("evt_1", r#"{"other":true}"#)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(reused.contains("key_reused"), "{reused}");
    assert_eq!((db.rows("keys").await, db.rows("outbox").await), (1, 1));

    let sink = Sink::start().await;
    let relay = db
        .inbox
        .outbox()
        .relay()
        .destination("shop", HttpDestination::new(&sink.url()).unwrap());
    assert_eq!(relay.relay_once().await.unwrap().sent, 1);
    let received = sink.received();
    assert_eq!(received.len(), 1);
    assert_eq!(received[0].key.as_deref(), Some("shop:evt_1"));
    assert_eq!(received[0].body, body.as_bytes());
    assert_eq!(received[0].headers["content-type"], "application/json");
    db.cleanup().await;
}

async fn rejected_requests_store_nothing<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let app = router(&db.inbox, vec![shop(), stripe()], LIMIT);
    let post = |uri: &str| Request::post(uri.to_owned());
    let mut tampered = signed("evt_2", r#"{"a":1}"#);
    *tampered.body_mut() = Body::from(r#"{"a":2}"#);
    let mut unsigned = signed("evt_3", "{}");
    unsigned.headers_mut().remove("webhook-signature");
    let stale = {
        let timestamp = now() - 600;
        Request::post("/webhooks/shop")
            .header("webhook-id", "evt_4")
            .header("webhook-timestamp", timestamp.to_string())
            .header(
                "webhook-signature",
                standard_webhooks_signature(KEY, "evt_4", timestamp, b"{}"),
            )
            .body(Body::from("{}"))
            .unwrap()
    };
    let huge = "x".repeat(10 * LIMIT);
    let streamed = {
        let chunks = (0..10).map(|_| Ok::<_, std::io::Error>(vec![b'x'; LIMIT]));
        Body::from_stream(futures_util::stream::iter(chunks))
    };
    let deep_json = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let cases: Vec<(Request<Body>, StatusCode)> = vec![
        (
            post("/webhooks/nobody").body(Body::from("{}")).unwrap(),
            StatusCode::NOT_FOUND,
        ),
        (tampered, StatusCode::UNAUTHORIZED),
        (unsigned, StatusCode::UNAUTHORIZED),
        (stale, StatusCode::UNAUTHORIZED),
        (signed("evt_5", &huge), StatusCode::PAYLOAD_TOO_LARGE),
        (
            post("/webhooks/shop").body(streamed).unwrap(),
            StatusCode::PAYLOAD_TOO_LARGE,
        ),
        (stripe_signed("not json"), StatusCode::BAD_REQUEST),
        (stripe_signed(r#"{"no_id":1}"#), StatusCode::BAD_REQUEST),
        (stripe_signed("\u{0}\u{ff}"), StatusCode::BAD_REQUEST),
    ];
    for (n, (request, expected)) in cases.into_iter().enumerate() {
        let (status, content_type, body) = answer(&app, request).await;
        assert_eq!(status, expected, "case {n}: {body}");
        assert_eq!(content_type, "application/problem+json", "case {n}");
        assert!(
            body.contains(&format!("\"status\":{}", expected.as_u16())),
            "case {n}: {body}"
        );
    }
    // JSON nested 100,000 deep, under a limit that lets it in: refused, not a stack overflow.
    let roomy = router(&db.inbox, vec![stripe()], 1 << 20);
    let (status, _, _) = answer(&roomy, stripe_signed(&deep_json)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!((db.rows("keys").await, db.rows("outbox").await), (0, 0));
    db.cleanup().await;
}

/// A Stripe-signed request whose id lives in the body.
fn stripe_signed(body: &str) -> Request<Body> {
    let timestamp = now();
    let signature = hmac_hex(b"whsec_stripe", &format!("{timestamp}.{body}"));
    Request::post("/webhooks/stripe")
        .header("stripe-signature", format!("t={timestamp},v1={signature}"))
        .body(Body::from(body.to_owned()))
        .unwrap()
}

async fn an_unreachable_database_answers_503<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let app = router(&db.inbox, vec![shop()], LIMIT);
    let healthy = answer(&app, Request::get("/healthz").body(Body::empty()).unwrap()).await;
    assert_eq!(healthy.0, StatusCode::OK);
    let url = db.url.clone();
    let prefix = db.prefix.clone();
    db.inbox.pool().close().await;
    let response = app.clone().oneshot(signed("evt_1", "{}")).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()["retry-after"], "5");
    let unhealthy = answer(&app, Request::get("/healthz").body(Body::empty()).unwrap()).await;
    assert_eq!(unhealthy.0, StatusCode::SERVICE_UNAVAILABLE);
    // Clean up through a new connection.
    let reopened = TestDb::<DB>::reopen(&url, &prefix).await;
    assert_eq!(reopened.rows("keys").await, 0);
    reopened.cleanup().await;
}

/// An event whose id makes no key gets a 400 problem that says why and stores nothing; any
/// other id is the key `<source>:<id>` byte for byte, stored once.
async fn hostile_event_ids_get_400_problems_or_are_stored_once_as_given<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    // Room for a mebibyte of id, so that the id is refused and not the body.
    let app = router(&db.inbox, vec![shop(), stripe()], 2 << 20);
    let with_id =
        |id: serde_json::Value| stripe_signed(&serde_json::json!({ "id": id }).to_string());
    // "stripe:" takes 7 of a key's 255 bytes.
    let (longest, mebibyte) = ("i".repeat(248), "i".repeat(1 << 20));
    let refused = [
        (with_id("".into()), "no event id", "blank"),
        (with_id(" \t ".into()), "no event id", "blank"),
        (
            with_id(serde_json::Value::Null),
            "no event id",
            "no string or number",
        ),
        (
            with_id(serde_json::json!({"nested": 1})),
            "no event id",
            "no string or number",
        ),
        (
            with_id(format!("{longest}i").into()),
            "unusable event id",
            "256 bytes long",
        ),
        (
            with_id(mebibyte.clone().into()),
            "unusable event id",
            "1048583 bytes long",
        ),
        (
            with_id("a\0b".into()),
            "unusable event id",
            "control character",
        ),
        (
            with_id("line\nbreak".into()),
            "unusable event id",
            "control character",
        ),
        (
            with_id("\u{1b}[2J".into()),
            "unusable event id",
            "control character",
        ),
        (signed("", "{}"), "no event id", "blank"),
        (signed("   ", "{}"), "no event id", "blank"),
        (
            signed(&mebibyte, "{}"),
            "unusable event id",
            "1048581 bytes long",
        ),
    ];
    for (n, (request, title, why)) in refused.into_iter().enumerate() {
        let (status, content_type, body) = answer(&app, request).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "case {n}: {body}");
        assert_eq!(content_type, "application/problem+json", "case {n}");
        let problem: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(problem["title"], title, "case {n}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains(why), "case {n}: {why:?} not in {detail:?}");
        assert!(body.len() < 1024, "case {n}: the problem repeats the id");
    }
    // A header id that is not visible ASCII fails the signature's own check of its headers.
    let mut utf8_id = signed("evt\u{200f}1", "{}");
    utf8_id.headers_mut().insert(
        "webhook-id",
        axum::http::HeaderValue::from_bytes("evt\u{200f}1".as_bytes()).unwrap(),
    );
    assert_eq!(answer(&app, utf8_id).await.0, StatusCode::UNAUTHORIZED);
    assert_eq!((db.rows("keys").await, db.rows("outbox").await), (0, 0));

    let accepted: [(serde_json::Value, &str); 9] = [
        ("'; DROP TABLE x; --".into(), "'; DROP TABLE x; --"),
        (longest.clone().into(), &longest),
        ("\u{1f980}".into(), "\u{1f980}"),
        ("evt1".into(), "evt1"),
        ("evt\u{200f}1".into(), "evt\u{200f}1"),
        ("caf\u{e9}".into(), "caf\u{e9}"),
        ("cafe\u{301}".into(), "cafe\u{301}"),
        (" padded ".into(), " padded "),
        (12345.into(), "12345"),
    ];
    let requests = accepted.iter().map(|(id, text)| {
        let request = move || with_id(id.clone());
        (
            Box::new(request) as Box<dyn Fn() -> Request<Body>>,
            format!("stripe:{text}"),
        )
    });
    let in_a_header = || signed("'; DROP TABLE x; --", "{}");
    let requests = requests.chain([(
        Box::new(in_a_header) as Box<dyn Fn() -> Request<Body>>,
        "shop:'; DROP TABLE x; --".to_owned(),
    )]);
    let mut stored = 0;
    for (request, key) in requests {
        for status in ["accepted", "duplicate"] {
            let (code, _, body) = answer(&app, request()).await;
            assert_eq!(code, StatusCode::OK, "{key:?}: {body}");
            let answered: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(answered["key"].as_str(), Some(key.as_str()));
            assert_eq!(answered["status"], status, "{key:?}");
        }
        stored += 1;
    }
    assert_eq!(
        (db.rows("keys").await, db.rows("outbox").await),
        (stored, stored)
    );
    db.inbox.check().await.expect("the tables are intact");
    db.cleanup().await;
}

/// A JSON id is its exact text, never a float: two numbers past 2^64 that differ in their
/// last digit are two keys; an escaped string is its unescaped text; a pointer reaches
/// into arrays and escaped member names.
async fn json_ids_are_taken_as_their_exact_text<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let app = router(&db.inbox, vec![stripe()], LIMIT);
    for (body, key) in [
        (
            r#"{"id":123456789012345678901}"#,
            "stripe:123456789012345678901",
        ),
        (
            r#"{"id":123456789012345678902}"#,
            "stripe:123456789012345678902",
        ),
        (r#"{"id": -1.50e3 }"#, "stripe:-1.50e3"),
        (r#"{"id":"evt_\u00e9"}"#, "stripe:evt_\u{e9}"),
    ] {
        let (status, _, answer_body) = answer(&app, stripe_signed(body)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(
            answer_body,
            serde_json::json!({ "key": key, "status": "accepted" }).to_string(),
            "{body}"
        );
    }
    assert_eq!((db.rows("keys").await, db.rows("outbox").await), (4, 4));
    let nested = Scheme::Stripe {
        secrets: vec![b"whsec_stripe".to_vec()],
        tolerance: Duration::from_secs(300),
    };
    let nested = Source::new(
        "stripe",
        nested,
        IdLocation::Json("/data/0/a~1b".to_owned()),
    )
    .unwrap();
    let app = router(&db.inbox, vec![nested], LIMIT);
    let (status, _, answer_body) = answer(&app, stripe_signed(r#"{"data":[{"a/b":77}]}"#)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        answer_body.contains(r#""key":"stripe:77""#),
        "{answer_body}"
    );
    for missing in [
        r#"{"data":[]}"#,
        r#"{"data":{"0":{}}}"#,
        r#"{"data":[{"a/b":null}]}"#,
    ] {
        let (status, _, _) = answer(&app, stripe_signed(missing)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{missing}");
    }
    db.cleanup().await;
}

async fn a_v1a_signed_event_is_stored_once_and_a_wrongly_signed_one_stores_nothing<
    DB: TestBackend,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let app = router(&db.inbox, vec![shop(), partner()], LIMIT);
    let body = r#"{"type":"order.paid","order":2}"#;
    // Another ed25519 key, and the shop's HMAC key, which the partner source does not hold.
    let mut hmac_signed = signed("evt_1", body);
    *hmac_signed.uri_mut() = "/webhooks/partner".parse().unwrap();
    for request in [v1a_signed(&[8; 32], "evt_1", body), hmac_signed] {
        let (status, content_type, _) = answer(&app, request).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert_eq!(content_type, "application/problem+json");
    }
    assert_eq!((db.rows("keys").await, db.rows("outbox").await), (0, 0));
    for expected in ["accepted", "duplicate"] {
        let (status, _, answer_body) = answer(&app, v1a_signed(&PARTNER_SEED, "evt_1", body)).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            answer_body,
            format!(r#"{{"key":"partner:evt_1","status":"{expected}"}}"#)
        );
    }
    assert_eq!((db.rows("keys").await, db.rows("outbox").await), (1, 1));
    db.cleanup().await;
}

/// A sender's `traceparent` and `tracestate` travel with the event to its target; a
/// malformed one is dropped, and the event is stored all the same.
async fn the_senders_trace_context_reaches_the_target<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let app = router(&db.inbox, vec![shop()], LIMIT);
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut traced = signed("evt_traced", "{}");
    traced
        .headers_mut()
        .insert("traceparent", parent.parse().unwrap());
    traced
        .headers_mut()
        .insert("tracestate", "congo=t61rcWkgMzE".parse().unwrap());
    let mut malformed = signed("evt_malformed", "{}");
    malformed
        .headers_mut()
        .insert("traceparent", "00-not-a-trace-01".parse().unwrap());
    malformed
        .headers_mut()
        .insert("tracestate", "congo=t61rcWkgMzE".parse().unwrap());
    for request in [traced, malformed] {
        let (status, _, body) = answer(&app, request).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let sink = Sink::start().await;
    let relay = db
        .inbox
        .outbox()
        .relay()
        .destination("shop", HttpDestination::new(&sink.url()).unwrap());
    assert_eq!(relay.relay_once().await.unwrap().sent, 2);
    let received = sink.received();
    let by_key = |key: &str| {
        received
            .iter()
            .find(|request| request.key.as_deref() == Some(key))
            .unwrap_or_else(|| panic!("{key} not received"))
    };
    let traced = by_key("shop:evt_traced");
    assert_eq!(traced.headers["traceparent"], parent);
    assert_eq!(traced.headers["tracestate"], "congo=t61rcWkgMzE");
    let malformed = by_key("shop:evt_malformed");
    assert!(!malformed.headers.contains_key("traceparent"));
    assert!(!malformed.headers.contains_key("tracestate"));
    db.cleanup().await;
}
