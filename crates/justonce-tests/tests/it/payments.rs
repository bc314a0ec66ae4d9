//! The payments example, compiled from its own source, on each real database: one payment
//! per key and tenant, however many requests and retries.

use super::{on_every_database, respond};
use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use justonce_tests::{TestBackend, TestDb};

// The example's `main` is not called here.
#[allow(dead_code)]
#[path = "../../../justonce/examples/payments.rs"]
mod example;

on_every_database!(
    the_same_key_under_two_tenants_makes_two_payments,
    fifty_concurrent_requests_make_one_payment,
    a_client_whose_first_two_answers_are_lost_makes_one_payment,
    the_conformance_kit_passes_the_example,
);

const BODY: &str = r#"{"amount": 1250, "currency": "EUR"}"#;

/// The example's router on this test's key tables; tenants are named after the test's
/// table prefix, so that payments of other tests and runs on a shared database are apart.
async fn payments<DB: TestBackend + example::PaymentsTable>(
    db: &TestDb<DB>,
) -> (axum::Router, String) {
    // PostgreSQL's CREATE TABLE IF NOT EXISTS can fail when two sessions race.
    static CREATING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    {
        let _one_at_a_time = CREATING.lock().await;
        DB::create_table(db.inbox.pool()).await.unwrap();
    }
    (example::router(db.inbox.clone()), db.prefix.clone())
}

fn pay(tenant: &str, key: &str) -> Request<Body> {
    Request::post("/payments")
        .header("content-type", "application/json")
        .header("x-tenant", tenant)
        .header("idempotency-key", key)
        .body(Body::from(BODY))
        .unwrap()
}

/// Status, whether the answer is a replay, and body.
async fn send(app: &axum::Router, request: Request<Body>) -> (StatusCode, bool, Bytes) {
    let (status, headers, body) = respond(app, request).await;
    (status, headers.contains_key("idempotent-replayed"), body)
}

async fn payments_of<DB: TestBackend>(db: &TestDb<DB>, tenant: &str) -> i64 {
    DB::count(
        db.inbox.pool(),
        format!("SELECT count(*) FROM payments WHERE tenant = '{tenant}'"),
    )
    .await
}

async fn forget_payments<DB: TestBackend>(db: &TestDb<DB>, tenants: &[&str]) {
    for tenant in tenants {
        DB::execute(
            db.inbox.pool(),
            format!("DELETE FROM payments WHERE tenant = '{tenant}'"),
        )
        .await
        .unwrap();
    }
}

async fn the_same_key_under_two_tenants_makes_two_payments<
    DB: TestBackend + example::PaymentsTable,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let (app, prefix) = payments(&db).await;
    let (a, b) = (format!("{prefix}a"), format!("{prefix}b"));
    let first_a = send(&app, pay(&a, "pay-1")).await;
    let first_b = send(&app, pay(&b, "pay-1")).await;
    assert_eq!(
        (first_a.0, first_b.0),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(String::from_utf8_lossy(&first_a.2).contains(&format!("\"tenant\":\"{a}\"")));
    assert!(String::from_utf8_lossy(&first_b.2).contains(&format!("\"tenant\":\"{b}\"")));
    let again_a = send(&app, pay(&a, "pay-1")).await;
    let again_b = send(&app, pay(&b, "pay-1")).await;
    assert_eq!((again_a.1, again_b.1), (true, true));
    assert_eq!(
        (again_a.2, again_b.2),
        (first_a.2, first_b.2),
        "each its own tenant's"
    );
    assert_eq!(
        (payments_of(&db, &a).await, payments_of(&db, &b).await),
        (1, 1)
    );
    forget_payments(&db, &[&a, &b]).await;
    db.cleanup().await;
}

async fn fifty_concurrent_requests_make_one_payment<DB: TestBackend + example::PaymentsTable>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let (app, prefix) = payments(&db).await;
    let tenant = format!("{prefix}a");
    let requests: Vec<_> = (0..50)
        .map(|_| {
            let (app, tenant) = (app.clone(), tenant.clone());
            tokio::spawn(async move { send(&app, pay(&tenant, "pay-1")).await })
        })
        .collect();
    let mut answers = Vec::new();
    for request in requests {
        answers.push(request.await.unwrap());
    }
    let created: Vec<_> = answers
        .iter()
        .filter(|a| a.0 == StatusCode::CREATED)
        .collect();
    let first: Vec<_> = created.iter().filter(|a| !a.1).collect();
    assert_eq!(first.len(), 1, "one request ran the handler");
    for answer in &answers {
        match answer.0 {
            StatusCode::CREATED => assert_eq!(answer.2, first[0].2, "a replay of the first"),
            StatusCode::CONFLICT => {}
            other => panic!("unexpected {other}: {:?}", answer.2),
        }
    }
    assert_eq!(payments_of(&db, &tenant).await, 1);
    forget_payments(&db, &[&tenant]).await;
    db.cleanup().await;
}

async fn a_client_whose_first_two_answers_are_lost_makes_one_payment<
    DB: TestBackend + example::PaymentsTable,
>(
    test: &str,
) {
    use justonce_http::client::{RetryPolicy, RetryingClient};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    let db = TestDb::<DB>::new(test).await;
    let (app, prefix) = payments(&db).await;
    let tenant = format!("{prefix}a");
    // In front of the example: every request is served, and the first two answers are
    // then replaced by 503, as if a proxy lost them after the payment was made.
    let keys_seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let seen = Arc::clone(&keys_seen);
    let lossy = app.layer(axum::middleware::from_fn(
        move |request: axum::extract::Request, next: axum::middleware::Next| {
            let seen = Arc::clone(&seen);
            async move {
                let key = request.headers()["idempotency-key"]
                    .to_str()
                    .unwrap()
                    .to_owned();
                let tries = {
                    let mut seen = seen.lock().unwrap();
                    seen.push(key);
                    seen.len()
                };
                let response = next.run(request).await;
                if tries <= 2 {
                    return StatusCode::SERVICE_UNAVAILABLE.into_response();
                }
                response
            }
        },
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/payments", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, lossy).await });

    let policy = RetryPolicy::default()
        .first_backoff(Duration::from_millis(10))
        .max_backoff(Duration::from_millis(50));
    let http = RetryingClient::http_client(Duration::from_secs(10)).unwrap();
    let client = RetryingClient::with_policy(http, policy);
    let sent = client
        .post(&url)
        .header(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/json"),
        )
        .header(
            axum::http::HeaderName::from_static("x-tenant"),
            tenant.parse().unwrap(),
        )
        .body(BODY)
        .send()
        .await
        .unwrap();
    assert_eq!(sent.attempts, 3);
    assert_eq!(sent.response.status(), 201);
    assert_eq!(sent.response.headers()["idempotent-replayed"], "true");
    let keys = keys_seen.lock().unwrap().clone();
    assert_eq!(keys.len(), 3);
    assert!(keys.iter().all(|key| *key == sent.key.as_str()), "{keys:?}");
    assert_eq!(payments_of(&db, &tenant).await, 1, "exactly one payment");
    forget_payments(&db, &[&tenant]).await;
    db.cleanup().await;
}

/// `justonce check` against the example on a real socket: each payment twice, some at once
/// (the second waits for the first's commit and gets its answer replayed), one payment each.
async fn the_conformance_kit_passes_the_example<DB: TestBackend + example::PaymentsTable>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let (app, tenant) = payments(&db).await;
    let url = format!("{}/payments", super::check::serve(app).await);
    // The amount carries the event's number, which the effects query reads back.
    let effects = format!("SELECT amount FROM payments WHERE tenant = '{tenant}'");
    let tenant_header = format!("X-Tenant: {tenant}");
    let body = r#"{"amount": {n}, "currency": "EUR"}"#;
    let more = ["--header", &tenant_header, "--body", body];
    let output = super::check::check_events(&url, &effects, &db.url, 9, &more).await;
    super::check::assert_passed(&output, 9);
    assert_eq!(payments_of(&db, &tenant).await, 9);
    forget_payments(&db, &[&tenant]).await;
    db.cleanup().await;
}
