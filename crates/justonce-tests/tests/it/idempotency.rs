//! The Idempotency-Key layer on real axum routes, through `oneshot` with no socket, with
//! its keys on each real database.

use super::{LeaseStore, on_every_database, on_every_lease_store, respond};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::Path;
use axum::http::header::{ETAG, SET_COOKIE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, Method, Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use justonce_http::server::{IdempotencyLayer, Tx};
use justonce_sql::Leases;
use justonce_tests::{TestBackend, TestDb};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tower::ServiceExt;

on_every_lease_store!(
    a_retry_gets_the_first_response_byte_for_byte,
    another_body_with_the_same_key_is_422,
    a_request_still_running_gets_409,
    keys_are_required_and_checked,
    a_5xx_is_not_stored_and_the_retry_runs,
    tenants_never_share_a_response,
    another_path_under_the_same_route_is_a_key_reuse,
    another_query_string_or_content_type_is_a_key_reuse,
    another_method_is_another_request,
    a_client_that_disconnects_does_not_stop_the_handler,
    set_cookie_is_never_replayed,
    a_handler_past_its_lease_lets_the_retry_run,
    fifty_concurrent_identical_requests_run_the_handler_once,
);

on_every_database!(
    an_unreachable_store_answers_503,
    transactional_writes_commit_with_the_key_and_the_response,
    a_transactional_5xx_rolls_the_writes_back,
    a_transactional_retry_waits_for_the_first_and_replays_it,
    a_transactional_request_without_a_key_still_gets_a_transaction,
    a_transactional_request_whose_client_disconnects_still_commits,
    hostile_keys_get_400_problems_or_are_used_as_given,
);

/// What the handlers saw: how many times they ran, and what the next ones should do.
#[derive(Clone, Default)]
struct Handler {
    calls: Arc<AtomicUsize>,
    /// Calls with a number in this list answer 500.
    failing: Arc<Vec<usize>>,
    /// How long each call takes before it answers.
    delay: Duration,
}

impl Handler {
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    async fn create(self, order: Option<String>, body: Bytes) -> axum::response::Response {
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        tokio::time::sleep(self.delay).await;
        if self.failing.contains(&call) {
            return (StatusCode::INTERNAL_SERVER_ERROR, "try again").into_response();
        }
        let payment = format!(
            r#"{{"payment":{call},"order":{order:?},"bytes":{}}}"#,
            body.len()
        );
        (
            StatusCode::CREATED,
            [
                ("content-type", "application/json"),
                ("location", &format!("/payments/{call}")),
                ("etag", &format!("\"{call}\"")),
                ("x-not-stored", "per call"),
                ("set-cookie", &format!("session=caller-{call}")),
            ],
            payment,
        )
            .into_response()
    }
}

/// The tenant a request names, as the principal that scopes its keys.
fn tenant(request: &Parts) -> Option<String> {
    Some(request.headers.get("x-tenant")?.to_str().ok()?.to_owned())
}

fn app(leases: Arc<dyn Leases>, handler: &Handler, lease_for: Duration) -> Router {
    let layer = IdempotencyLayer::new(leases)
        .lease_for(lease_for)
        .principal(tenant);
    app_with(layer, handler)
}

fn app_with(layer: IdempotencyLayer, handler: &Handler) -> Router {
    let (direct, patched, nested) = (handler.clone(), handler.clone(), handler.clone());
    Router::new()
        .route(
            "/payments",
            post(move |body: Bytes| direct.clone().create(None, body))
                .patch(move |body: Bytes| patched.clone().create(None, body))
                .get(|| async { "a GET needs no key" }),
        )
        .route(
            "/orders/{order}/payments",
            post(move |Path(order): Path<String>, body: Bytes| {
                nested.clone().create(Some(order), body)
            }),
        )
        .route_layer(layer)
}

const LEASE: Duration = Duration::from_secs(60);

fn request(uri: &str, tenant: &str, key: Option<&str>, body: &str) -> Request<Body> {
    request_with(Method::POST, uri, tenant, key, body)
}

fn request_with(
    method: Method,
    uri: &str,
    tenant: &str,
    key: Option<&str>,
    body: &str,
) -> Request<Body> {
    let mut builder = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .header("x-tenant", tenant);
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder.body(Body::from(body.to_owned())).unwrap()
}

fn assert_problem(answer: &(StatusCode, HeaderMap, Bytes), status: StatusCode) {
    assert_eq!(answer.0, status, "{:?}", answer.2);
    assert_eq!(answer.1["content-type"], "application/problem+json");
    let body = String::from_utf8_lossy(&answer.2);
    assert!(
        body.contains(&format!("\"status\":{}", status.as_u16())),
        "{body}"
    );
}

/// `answer` is `first` replayed: its status and bytes, marked as a replay.
fn assert_replay(answer: &(StatusCode, HeaderMap, Bytes), first: &(StatusCode, HeaderMap, Bytes)) {
    assert_eq!((answer.0, &answer.2), (first.0, &first.2));
    assert_eq!(answer.1["idempotent-replayed"], "true");
}

async fn a_retry_gets_the_first_response_byte_for_byte<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let handler = Handler::default();
    let app = app(store.leases(), &handler, LEASE);
    let body = r#"{"amount":1250,"currency":"EUR"}"#;
    let first = respond(&app, request("/payments", "a", Some("k1"), body)).await;
    assert_eq!(first.0, StatusCode::CREATED);
    assert!(!first.1.contains_key("idempotent-replayed"));
    for key in ["k1", "\"k1\""] {
        let retry = respond(&app, request("/payments", "a", Some(key), body)).await;
        assert_eq!(retry.0, StatusCode::CREATED);
        assert_eq!(retry.2, first.2, "the same bytes");
        assert_eq!(retry.1["content-type"], "application/json");
        assert_eq!(retry.1["location"], "/payments/1");
        assert_eq!(retry.1["etag"], "\"1\"");
        assert_eq!(retry.1["idempotent-replayed"], "true");
        assert!(!retry.1.contains_key("x-not-stored"));
        assert!(!retry.1.contains_key("set-cookie"));
    }
    assert_eq!(handler.calls(), 1, "the handler ran once");
    let get = respond(&app, Request::get("/payments").body(Body::empty()).unwrap()).await;
    assert_eq!(get.0, StatusCode::OK, "other methods pass through");
    store.close().await;
}

async fn another_body_with_the_same_key_is_422<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let handler = Handler::default();
    let app = app(store.leases(), &handler, LEASE);
    let first = respond(
        &app,
        request("/payments", "a", Some("k1"), r#"{"amount":1}"#),
    )
    .await;
    assert_eq!(first.0, StatusCode::CREATED);
    let reused = respond(
        &app,
        request("/payments", "a", Some("k1"), r#"{"amount":2}"#),
    )
    .await;
    assert_problem(&reused, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(handler.calls(), 1);
    store.close().await;
}

async fn a_request_still_running_gets_409<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let handler = Handler {
        delay: Duration::from_millis(500),
        ..Handler::default()
    };
    let app = app(store.leases(), &handler, LEASE);
    let running = {
        let app = app.clone();
        tokio::spawn(
            async move { respond(&app, request("/payments", "a", Some("k1"), "{}")).await },
        )
    };
    while handler.calls() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let concurrent = respond(&app, request("/payments", "a", Some("k1"), "{}")).await;
    assert_problem(&concurrent, StatusCode::CONFLICT);
    let retry_after: u64 = concurrent.1["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    let first = running.await.unwrap();
    assert_eq!(first.0, StatusCode::CREATED);
    let after = respond(&app, request("/payments", "a", Some("k1"), "{}")).await;
    assert_eq!((after.0, after.2), (first.0, first.2));
    assert_eq!(handler.calls(), 1);
    store.close().await;
}

async fn keys_are_required_and_checked<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let handler = Handler::default();
    let app = app(store.leases(), &handler, LEASE);
    let long = "k".repeat(256);
    for key in [
        None,
        Some(""),
        Some("\"\""),
        Some(long.as_str()),
        Some("a\tb"),
    ] {
        let answer = respond(&app, request("/payments", "a", key, "{}")).await;
        assert_problem(&answer, StatusCode::BAD_REQUEST);
    }
    let mut doubled = request("/payments", "a", Some("k1"), "{}");
    doubled
        .headers_mut()
        .append("idempotency-key", "k2".parse().unwrap());
    assert_problem(&respond(&app, doubled).await, StatusCode::BAD_REQUEST);
    let longest = "k".repeat(255);
    let accepted = respond(&app, request("/payments", "a", Some(&longest), "{}")).await;
    assert_eq!(accepted.0, StatusCode::CREATED);
    assert_eq!(handler.calls(), 1, "only the valid key reached the handler");
    store.close().await;
}

async fn a_5xx_is_not_stored_and_the_retry_runs<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let handler = Handler {
        failing: Arc::new(vec![1]),
        ..Handler::default()
    };
    let app = app(store.leases(), &handler, LEASE);
    let failed = respond(&app, request("/payments", "a", Some("k1"), "{}")).await;
    assert_eq!(failed.0, StatusCode::INTERNAL_SERVER_ERROR);
    let retried = respond(&app, request("/payments", "a", Some("k1"), "{}")).await;
    assert_eq!(retried.0, StatusCode::CREATED);
    assert!(!retried.1.contains_key("idempotent-replayed"));
    let replayed = respond(&app, request("/payments", "a", Some("k1"), "{}")).await;
    assert_eq!(replayed.2, retried.2);
    assert_eq!(replayed.1["idempotent-replayed"], "true");
    assert_eq!(handler.calls(), 2);
    store.close().await;
}

async fn tenants_never_share_a_response<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let handler = Handler::default();
    let app = app(store.leases(), &handler, LEASE);
    let a = respond(&app, request("/payments", "a", Some("k1"), "{}")).await;
    let b = respond(&app, request("/payments", "b", Some("k1"), "{}")).await;
    assert_eq!((a.0, b.0), (StatusCode::CREATED, StatusCode::CREATED));
    assert!(!b.1.contains_key("idempotent-replayed"));
    assert_ne!(a.2, b.2, "tenant B got its own payment");
    assert_eq!(handler.calls(), 2);
    let a_again = respond(&app, request("/payments", "a", Some("k1"), "{}")).await;
    let b_again = respond(&app, request("/payments", "b", Some("k1"), "{}")).await;
    assert_eq!((a_again.2, b_again.2), (a.2, b.2));
    let mut nobody = request("/payments", "a", Some("k1"), "{}");
    nobody.headers_mut().remove("x-tenant");
    assert_problem(&respond(&app, nobody).await, StatusCode::BAD_REQUEST);
    assert_eq!(handler.calls(), 2);
    store.close().await;
}

async fn another_path_under_the_same_route_is_a_key_reuse<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let handler = Handler::default();
    let app = app(store.leases(), &handler, LEASE);
    let first = respond(&app, request("/orders/1/payments", "a", Some("k1"), "{}")).await;
    assert_eq!(first.0, StatusCode::CREATED);
    // The same template for another order: the key stands for order 1's payment.
    let other_order = respond(&app, request("/orders/2/payments", "a", Some("k1"), "{}")).await;
    assert_problem(&other_order, StatusCode::UNPROCESSABLE_ENTITY);
    let retry = respond(&app, request("/orders/1/payments", "a", Some("k1"), "{}")).await;
    assert_replay(&retry, &first);
    // Another route is another scope.
    let other_route = respond(&app, request("/payments", "a", Some("k1"), "{}")).await;
    assert_eq!(other_route.0, StatusCode::CREATED);
    assert!(!other_route.1.contains_key("idempotent-replayed"));
    assert_eq!(handler.calls(), 2);

    // Nesting strips the prefix before the layer sees the path; its parameter still counts.
    let nested = Router::new().nest("/shops/{shop}", app.clone());
    let shop_1 = respond(&nested, request("/shops/1/payments", "a", Some("k2"), "{}")).await;
    assert_eq!(shop_1.0, StatusCode::CREATED);
    let shop_2 = respond(&nested, request("/shops/2/payments", "a", Some("k2"), "{}")).await;
    assert_problem(&shop_2, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(handler.calls(), 3);
    store.close().await;
}

async fn another_query_string_or_content_type_is_a_key_reuse<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let handler = Handler::default();
    let app = app(store.leases(), &handler, LEASE);
    let first = respond(
        &app,
        request("/payments?currency=EUR", "a", Some("k1"), "{}"),
    )
    .await;
    assert_eq!(first.0, StatusCode::CREATED);
    for uri in ["/payments?currency=SEK", "/payments"] {
        let other = respond(&app, request(uri, "a", Some("k1"), "{}")).await;
        assert_problem(&other, StatusCode::UNPROCESSABLE_ENTITY);
    }
    let mut as_text = request("/payments?currency=EUR", "a", Some("k1"), "{}");
    as_text
        .headers_mut()
        .insert("content-type", "text/plain".parse().unwrap());
    assert_problem(
        &respond(&app, as_text).await,
        StatusCode::UNPROCESSABLE_ENTITY,
    );
    let retry = respond(
        &app,
        request("/payments?currency=EUR", "a", Some("k1"), "{}"),
    )
    .await;
    assert_replay(&retry, &first);
    assert_eq!(handler.calls(), 1);
    store.close().await;
}

async fn another_method_is_another_request<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let handler = Handler::default();
    let app = app(store.leases(), &handler, LEASE);
    let send = |method: Method| request_with(method, "/payments", "a", Some("k1"), "{}");
    let post = respond(&app, send(Method::POST)).await;
    let patch = respond(&app, send(Method::PATCH)).await;
    assert_eq!(
        (post.0, patch.0),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(
        !patch.1.contains_key("idempotent-replayed"),
        "not the POST's"
    );
    assert_ne!(patch.2, post.2);
    assert_eq!(handler.calls(), 2);
    for (method, first) in [(Method::POST, &post), (Method::PATCH, &patch)] {
        let retry = respond(&app, send(method)).await;
        assert_replay(&retry, first);
    }
    assert_eq!(handler.calls(), 2);
    store.close().await;
}

/// Sends `request` until it is no longer answered 409 (its first request still running),
/// for at most ten seconds.
async fn once_not_running(
    app: &Router,
    request: impl Fn() -> Request<Body>,
) -> (StatusCode, HeaderMap, Bytes) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let answer = respond(app, request()).await;
        if answer.0 != StatusCode::CONFLICT || tokio::time::Instant::now() > deadline {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends `request` and leaves 100 ms after the handler has started, as a client that
/// disconnects: the response future is dropped.
async fn disconnect_after_100_ms(app: &Router, handler: &Handler, request: Request<Body>) {
    let mut answer = Box::pin(app.clone().oneshot(request));
    let started_and_100_ms = async {
        while handler.calls() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    tokio::select! {
        answered = &mut answer => panic!("answered before the client left: {answered:?}"),
        () = started_and_100_ms => drop(answer),
    }
}

/// The bytes the handler answers on its first call for `{}` on `/payments`.
const FIRST_PAYMENT: &str = r#"{"payment":1,"order":None,"bytes":2}"#;

async fn a_client_that_disconnects_does_not_stop_the_handler<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let handler = Handler {
        delay: Duration::from_secs(1),
        ..Handler::default()
    };
    let app = app(store.leases(), &handler, LEASE);
    let send = || request("/payments", "a", Some("k1"), "{}");
    disconnect_after_100_ms(&app, &handler, send()).await;
    let retry = once_not_running(&app, send).await;
    assert_eq!(retry.0, StatusCode::CREATED, "{:?}", retry.2);
    assert_eq!(retry.1["idempotent-replayed"], "true");
    assert_eq!(retry.2, FIRST_PAYMENT, "the handler's own bytes");
    assert_eq!(handler.calls(), 1, "the handler ran once");
    store.close().await;
}

async fn set_cookie_is_never_replayed<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let handler = Handler::default();
    let by_default = app(store.leases(), &handler, LEASE);
    // A layer told to store `Set-Cookie` still does not.
    let asked = IdempotencyLayer::new(store.leases())
        .principal(tenant)
        .stored_headers([SET_COOKIE, ETAG]);
    let asked = app_with(asked, &handler);
    for (app, key) in [(&by_default, "k1"), (&asked, "k2")] {
        let first = respond(app, request("/payments", "a", Some(key), "{}")).await;
        assert!(
            first.1.contains_key("set-cookie"),
            "the caller gets its own"
        );
        let retry = respond(app, request("/payments", "a", Some(key), "{}")).await;
        assert_eq!(retry.1["idempotent-replayed"], "true");
        assert_eq!(retry.1["etag"], first.1["etag"]);
        assert!(!retry.1.contains_key("set-cookie"), "{:?}", retry.1);
    }
    assert_eq!(handler.calls(), 2);
    store.close().await;
}

async fn a_handler_past_its_lease_lets_the_retry_run<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let slow = Handler {
        delay: Duration::from_millis(800),
        ..Handler::default()
    };
    let lease = Duration::from_millis(300);
    let slow_app = app(store.leases(), &slow, lease);
    let running = {
        let app = slow_app.clone();
        tokio::spawn(
            async move { respond(&app, request("/payments", "a", Some("k1"), "{}")).await },
        )
    };
    while slow.calls() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let fast = Handler::default();
    let fast_app = app(store.leases(), &fast, lease);
    let early = respond(&fast_app, request("/payments", "a", Some("k1"), "{}")).await;
    assert_problem(&early, StatusCode::CONFLICT);
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let taken_over = respond(&fast_app, request("/payments", "a", Some("k1"), "{}")).await;
    assert_eq!(taken_over.0, StatusCode::CREATED, "the lease ran out");
    assert_eq!(fast.calls(), 1);
    // The slow handler still answers its caller, but cannot overwrite the stored response.
    assert_eq!(running.await.unwrap().0, StatusCode::CREATED);
    let replayed = respond(&fast_app, request("/payments", "a", Some("k1"), "{}")).await;
    assert_eq!(replayed.2, taken_over.2);
    store.close().await;
}

async fn an_unreachable_store_answers_503<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let handler = Handler::default();
    let app = app(Arc::new(db.inbox.clone()), &handler, LEASE);
    let (url, prefix) = (db.url.clone(), db.prefix.clone());
    db.inbox.pool().close().await;
    let answer = respond(&app, request("/payments", "a", Some("k1"), "{}")).await;
    assert_problem(&answer, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.1["retry-after"], "1");
    assert_eq!(handler.calls(), 0, "no work without a key");
    let reopened = TestDb::<DB>::reopen(&url, &prefix).await;
    reopened.cleanup().await;
}

/// A route under the transactional layer whose handler writes one effect row through the
/// request's transaction, then answers 500 on the calls in `failing` and 201 otherwise.
fn transactional_app<DB: TestBackend>(
    db: &TestDb<DB>,
    handler: &Handler,
    layer: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> Router {
    let prefix = db.prefix.clone();
    let handler = handler.clone();
    let pay = move |tx: Tx<DB>, body: Bytes| {
        let (prefix, handler) = (prefix.clone(), handler.clone());
        async move {
            {
                let mut tx = tx.lock().await.unwrap();
                DB::insert_effect(&mut tx, &prefix, "payments", "effect")
                    .await
                    .unwrap();
            }
            handler.create(None, body).await
        }
    };
    let layer = layer(IdempotencyLayer::transactional(db.inbox.clone()).shared());
    Router::new()
        .route("/payments", post(pay))
        .route_layer(layer)
}

async fn transactional_writes_commit_with_the_key_and_the_response<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let handler = Handler::default();
    let app = transactional_app(&db, &handler, |layer| layer);
    let first = respond(&app, request("/payments", "a", Some("k1"), "{}")).await;
    assert_eq!(first.0, StatusCode::CREATED);
    let retry = respond(&app, request("/payments", "a", Some("k1"), "{}")).await;
    assert_eq!(retry.2, first.2);
    assert_eq!(retry.1["idempotent-replayed"], "true");
    for (uri, body) in [("/payments", "{\"other\":1}"), ("/payments?other=1", "{}")] {
        let reused = respond(&app, request(uri, "a", Some("k1"), body)).await;
        assert_problem(&reused, StatusCode::UNPROCESSABLE_ENTITY);
    }
    assert_eq!(handler.calls(), 1);
    assert_eq!((db.rows("effects").await, db.rows("keys").await), (1, 1));
    db.cleanup().await;
}

async fn a_transactional_5xx_rolls_the_writes_back<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let handler = Handler {
        failing: Arc::new(vec![1]),
        ..Handler::default()
    };
    let app = transactional_app(&db, &handler, |layer| layer);
    let failed = respond(&app, request("/payments", "a", Some("k1"), "{}")).await;
    assert_eq!(failed.0, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        (db.rows("effects").await, db.rows("keys").await),
        (0, 0),
        "the handler's write and the key rolled back together"
    );
    let retried = respond(&app, request("/payments", "a", Some("k1"), "{}")).await;
    assert_eq!(retried.0, StatusCode::CREATED);
    assert_eq!((db.rows("effects").await, db.rows("keys").await), (1, 1));
    db.cleanup().await;
}

async fn a_transactional_retry_waits_for_the_first_and_replays_it<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let handler = Handler {
        delay: Duration::from_millis(300),
        ..Handler::default()
    };
    let app = transactional_app(&db, &handler, |layer| layer);
    let running = {
        let app = app.clone();
        tokio::spawn(
            async move { respond(&app, request("/payments", "a", Some("k1"), "{}")).await },
        )
    };
    while handler.calls() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let retry = respond(&app, request("/payments", "a", Some("k1"), "{}")).await;
    let first = running.await.unwrap();
    assert_eq!(first.0, StatusCode::CREATED);
    assert_eq!(retry.2, first.2, "the retry got the first response");
    assert_eq!(retry.1["idempotent-replayed"], "true");
    assert_eq!(handler.calls(), 1);
    assert_eq!(db.rows("effects").await, 1);
    db.cleanup().await;
}

async fn a_transactional_request_without_a_key_still_gets_a_transaction<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let handler = Handler::default();
    let app = transactional_app(&db, &handler, IdempotencyLayer::optional);
    let keyless = respond(&app, request("/payments", "a", None, "{}")).await;
    assert_eq!(keyless.0, StatusCode::CREATED);
    assert_eq!((db.rows("effects").await, db.rows("keys").await), (1, 0));
    db.cleanup().await;
}

async fn a_transactional_request_whose_client_disconnects_still_commits<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let handler = Handler {
        delay: Duration::from_secs(1),
        ..Handler::default()
    };
    let app = transactional_app(&db, &handler, |layer| layer);
    let send = || request("/payments", "a", Some("k1"), "{}");
    disconnect_after_100_ms(&app, &handler, send()).await;
    let retry = once_not_running(&app, send).await;
    assert_eq!(retry.0, StatusCode::CREATED, "{:?}", retry.2);
    assert_eq!(retry.1["idempotent-replayed"], "true");
    assert_eq!(retry.2, FIRST_PAYMENT, "the handler's own bytes");
    assert_eq!(handler.calls(), 1, "the handler ran once");
    assert_eq!((db.rows("effects").await, db.rows("keys").await), (1, 1));
    db.cleanup().await;
}

async fn fifty_concurrent_identical_requests_run_the_handler_once<S: LeaseStore>(test: &str) {
    let store = S::open(test).await;
    let handler = Handler {
        delay: Duration::from_millis(50),
        ..Handler::default()
    };
    let app = app(store.leases(), &handler, LEASE);
    let requests: Vec<_> = (0..50)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(
                async move { respond(&app, request("/payments", "a", Some("k1"), "{}")).await },
            )
        })
        .collect();
    let mut answers = Vec::new();
    for request in requests {
        answers.push(request.await.unwrap());
    }
    assert_eq!(handler.calls(), 1, "one handler run");
    let first: Vec<_> = answers
        .iter()
        .filter(|a| a.0 == StatusCode::CREATED && !a.1.contains_key("idempotent-replayed"))
        .collect();
    assert_eq!(first.len(), 1);
    for answer in &answers {
        match answer.0 {
            StatusCode::CREATED => assert_eq!(answer.2, first[0].2),
            StatusCode::CONFLICT => assert_problem(answer, StatusCode::CONFLICT),
            other => panic!("unexpected {other}"),
        }
    }
    store.close().await;
}

/// Every key the layer refuses gets a 400 problem that says why, without running the
/// handler or storing a row; the ones it accepts are used byte for byte.
async fn hostile_keys_get_400_problems_or_are_used_as_given<DB: TestBackend>(test: &str) {
    use axum::http::HeaderValue;
    let db = TestDb::<DB>::new(test).await;
    let handler = Handler::default();
    let app = app(Arc::new(db.inbox.clone()), &handler, LEASE);
    let with_key = |value: HeaderValue| {
        let mut request = request("/payments", "a", None, "{}");
        request.headers_mut().insert("idempotency-key", value);
        request
    };
    let text = |text: &str| HeaderValue::from_str(text).unwrap();
    let mebibyte = "k".repeat(1 << 20);
    let refused = [
        (text(""), "it is empty"),
        (text("   "), "it is empty"),
        (text("\"\""), "it is empty"),
        (text("\" \""), "is blank"),
        (
            text(&"k".repeat(256)),
            "256 bytes long, more than the 255 allowed",
        ),
        (text(&format!("\"{}\"", "k".repeat(256))), "256 bytes long"),
        (text(&mebibyte), "1048576 bytes long"),
        (text("a\tb"), "control character"),
        (text(r#""a\nb""#), "bad escape"),
        // UTF-8 in a header is not visible ASCII, so emoji and right-to-left marks are
        // refused rather than guessed at.
        (
            HeaderValue::from_bytes("\u{1f980}".as_bytes()).unwrap(),
            "not visible ASCII",
        ),
        (
            HeaderValue::from_bytes("a\u{200f}b".as_bytes()).unwrap(),
            "not visible ASCII",
        ),
    ];
    for (value, why) in refused {
        let answer = respond(&app, with_key(value)).await;
        assert_problem(&answer, StatusCode::BAD_REQUEST);
        let problem: serde_json::Value = serde_json::from_slice(&answer.2).unwrap();
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains(why), "{why:?} not in {detail:?}");
        assert!(answer.2.len() < 1024, "the problem repeats the key");
    }
    // HTTP itself has no way to carry NUL or DEL in a header.
    assert!(HeaderValue::from_bytes(b"a\0b").is_err());
    assert!(HeaderValue::from_bytes(b"a\x7fb").is_err());
    assert_eq!((handler.calls(), db.rows("keys").await), (0, 0));

    let sql = "'; DROP TABLE x; --";
    let longest = "k".repeat(255);
    for key in [sql, longest.as_str(), r#"" spaced ""#, "k1"] {
        let first = respond(&app, with_key(text(key))).await;
        assert_eq!(first.0, StatusCode::CREATED, "{key:?}");
        let retry = respond(&app, with_key(text(key))).await;
        assert_eq!((retry.0, &retry.2), (first.0, &first.2), "{key:?}");
        assert_eq!(retry.1["idempotent-replayed"], "true");
    }
    // The spaces around a bare value are not part of it, as on the wire.
    let padded = respond(&app, with_key(text(" \tk1\t "))).await;
    assert_eq!(padded.1["idempotent-replayed"], "true");
    assert_eq!((handler.calls(), db.rows("keys").await), (4, 4));
    let consumer = IdempotencyLayer::consumer_for(&axum::http::Method::POST, "/payments");
    let scope = justonce_sql::Scope::new("a").unwrap();
    for key in [sql, longest.as_str(), " spaced ", "k1"] {
        let identity = justonce_sql::Identity::new(
            scope.clone(),
            consumer.clone(),
            justonce_sql::Key::new(key).unwrap(),
        );
        let stored = db.inbox.lookup(&identity).await.unwrap();
        assert!(stored.is_some_and(|k| k.result.is_some()), "{key:?}");
    }
    db.inbox.check().await.expect("the tables are intact");
    db.cleanup().await;
}
