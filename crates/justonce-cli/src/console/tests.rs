//! The console's pages against a real store, through the admin listener's router without
//! a socket: each page's elements hold what the store holds, escaped; the dashboard's
//! figures are the store's counts; data stays behind the token when one is set.

use crate::admin_api::{self, Access, AdminToken};
use crate::probes::Consumers;
use axum::Router;
use axum::body::Body;
use axum::http::header::{AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE, HOST};
use axum::http::{Request, StatusCode};
use justonce_http::HttpDestination;
use justonce_sql::sqlx::{Postgres, Sqlite};
use justonce_sql::{Key, Message, Outcome};
use justonce_tests::{Answer, Sink, TestBackend, TestDb};
use std::sync::Arc;
use tower::ServiceExt;

const TOKEN: &str = "a console token nobody guesses";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_show_what_sqlite_holds() {
    pages_show_what_the_store_holds::<Sqlite>("console_sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_show_what_postgres_holds() {
    pages_show_what_the_store_holds::<Postgres>("console_postgres").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_token_pages_hold_no_data_without_it() {
    let db = TestDb::<Sqlite>::new("console_token").await;
    let orders = db.consumer("orders");
    let key = Key::new("orders:secret-1").unwrap();
    let stored = orders
        .run_forward(&key, b"{}", Message::new("orders", b"{}".to_vec()))
        .await
        .unwrap();
    assert!(matches!(stored, Outcome::Processed(())));
    let admin = router(&db, Some(AdminToken::new(TOKEN)));

    let (status, _, frame) = get(&admin, "/events", None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(frame.contains("<main data-needs-token>"), "{frame}");
    assert!(frame.contains("id=\"token-form\""), "{frame}");
    assert!(!frame.contains("orders:secret-1"), "{frame}");

    let (status, _, page) = get(&admin, "/events", Some(TOKEN)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(page.contains("orders:secret-1"), "{page}");
    // Replays are enabled: the script sends them with the token.
    let (_, _, page) = get(&admin, "/dead-letters", Some(TOKEN)).await;
    assert!(!page.contains("disabled"), "{page}");

    let (status, headers, _) = get(&admin, "/events", Some("another token")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(headers[CONTENT_TYPE], "application/problem+json");
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn assets_are_served_with_their_type_and_unknown_pages_are_not_found() {
    let db = TestDb::<Sqlite>::new("console_assets").await;
    let admin = router(&db, None);
    for (path, content_type, sample) in [
        (
            "/assets/console.css",
            "text/css; charset=utf-8",
            "rect.failed",
        ),
        (
            "/assets/console.js",
            "text/javascript; charset=utf-8",
            "sessionStorage",
        ),
    ] {
        let (status, headers, text) = get(&admin, path, None).await;
        assert_eq!(status, StatusCode::OK, "{path}");
        assert_eq!(headers[CONTENT_TYPE], content_type, "{path}");
        assert_eq!(headers[CACHE_CONTROL], "public, max-age=3600", "{path}");
        assert!(text.contains(sample), "{path}: {text}");
    }
    for path in ["/nope", "/events/1/more", "/assets/other.js"] {
        let (status, headers, _) = get(&admin, path, None).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
        assert_eq!(headers[CONTENT_TYPE], "application/problem+json", "{path}");
    }
    let (status, _, _) = get(&admin, "/events/987654", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _, _) = get(&admin, "/?since=forever", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _, _) = get(&admin, "/events?colour=red", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    db.cleanup().await;
}

/// Four events of `orders` (one of them twice), three delivered and one refused for good.
async fn pages_show_what_the_store_holds<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let orders = db.consumer("orders");
    let events: [(&str, &[u8]); 4] = [
        ("orders:1", br#"{"n":1,"note":"<b>bold</b>"}"#),
        ("orders:2-refused", b"<script>alert(1)</script>"),
        ("orders:<i>3</i>", b"plain text"),
        ("orders:4", &[0xff, 0xfe, 0x00]),
    ];
    for (key, body) in events {
        let key = Key::new(key).unwrap();
        let stored = orders
            .run_forward(&key, body, Message::new("orders", body.to_vec()))
            .await
            .unwrap();
        assert!(matches!(stored, Outcome::Processed(())));
    }
    let again = Key::new("orders:1").unwrap();
    let duplicate = orders
        .run_forward(
            &again,
            events[0].1,
            Message::new("orders", events[0].1.to_vec()),
        )
        .await
        .unwrap();
    assert!(matches!(duplicate, Outcome::Duplicate));
    let outbox = db.inbox.outbox();
    outbox.flush_duplicates().await.unwrap();
    let sink = Sink::scripted(Arc::new(|key: &str, _| {
        let status = if key.contains("refused") { 400 } else { 200 };
        let mut answer = Answer::status(status);
        answer.body = b"<em>thanks</em>".to_vec();
        answer
    }))
    .await;
    let relay = outbox
        .relay()
        .destination("orders", HttpDestination::new(&sink.url()).unwrap());
    let round = relay.relay_once().await.unwrap();
    assert_eq!((round.sent, round.dead), (3, 1));
    let admin = router(&db, None);

    // The dashboard's figures are the store's counts.
    let stats = outbox.stats().await.unwrap();
    let (status, headers, page) = get(&admin, "/?since=6h", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers[CONTENT_TYPE], "text/html; charset=utf-8");
    assert!(page.contains("id=\"token-form\"") && page.contains("id=\"admin-token\""));
    let figure = |name: &str| figure(&page, name);
    assert_eq!(figure("accepted"), db.rows("outbox").await.to_string());
    assert_eq!(figure("duplicates"), "1");
    assert_eq!(figure("sent"), stats.sent.to_string());
    assert_eq!(figure("failed"), stats.dead.to_string());
    assert_eq!(figure("backlog"), stats.due.to_string());
    assert_eq!(figure("oldest-due"), "");
    assert_eq!(
        (figure("accepted"), figure("sent"), figure("failed")),
        ("4".into(), "3".into(), "1".into())
    );
    // The API answers the same figures.
    let (status, _, json) = get(&admin, "/api/v1/dashboard?since=6h", None).await;
    assert_eq!(status, StatusCode::OK);
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        json["totals"],
        serde_json::json!({"accepted": 4, "duplicates": 1, "sent": 3, "failed": 1})
    );
    assert_eq!(json["due"], 0);
    assert_eq!(json["oldest_due_seconds"], serde_json::Value::Null);
    assert_eq!(json["destinations"][0]["name"], "orders");

    // The search lists each event, its key escaped.
    let (status, _, page) = get(&admin, "/events?key=&source=orders&state=&since=1h", None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(page.contains("id=\"event-search\""), "{page}");
    assert!(page.contains("<table id=\"events\">"), "{page}");
    let ids: Vec<i64> = attribute_values(&page, "data-event-id");
    assert_eq!(ids.len(), 4, "{page}");
    for id in &ids {
        assert!(
            page.contains(&format!("<a href=\"/events/{id}\">")),
            "{page}"
        );
    }
    assert!(page.contains("orders:&lt;i&gt;3&lt;/i&gt;"), "{page}");
    assert!(!page.contains("<i>3</i>"), "{page}");
    // The key's start by default, served by an index: no window of time.
    let (_, _, page) = get(&admin, "/events?key=orders%3A2", None).await;
    assert_eq!(attribute_values(&page, "data-event-id"), vec![ids[1]]);
    assert!(
        page.contains("<option value=\"prefix\" selected>starts with</option>"),
        "{page}"
    );
    assert!(!page.contains("id=\"searched-since\""), "{page}");
    let (_, _, page) = get(&admin, "/events?key=refused", None).await;
    assert!(
        attribute_values(&page, "data-event-id").is_empty(),
        "{page}"
    );
    // Any part of it, within the last day, which the page names.
    let (status, _, page) = get(&admin, "/events?key=refused&match=contains", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(attribute_values(&page, "data-event-id"), vec![ids[1]]);
    assert!(
        page.contains("<option value=\"contains\" selected>contains</option>"),
        "{page}"
    );
    assert!(
        page.contains("<p id=\"searched-since\">Keys containing the text were searched"),
        "{page}"
    );
    let (_, _, page) = get(&admin, "/events?key=refused&match=contains&since=1h", None).await;
    assert_eq!(attribute_values(&page, "data-event-id"), vec![ids[1]]);
    assert!(!page.contains("id=\"searched-since\""), "{page}");
    let (status, _, _) = get(&admin, "/events?key=1&match=like", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    // An event's page: its body escaped, JSON pretty, other bytes in base64.
    let (status, _, page) = get(&admin, &format!("/events/{}", ids[1]), None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        page.contains("<pre id=\"event-body\">&lt;script&gt;alert(1)&lt;/script&gt;</pre>"),
        "{page}"
    );
    assert!(page.contains("<table id=\"attempts\">"), "{page}");
    assert_eq!(page.matches("<tr class=\"attempt\">").count(), 1, "{page}");
    assert!(page.contains("&lt;em&gt;thanks&lt;/em&gt;"), "{page}");
    // Without a token the button is there, and the API's 403 answers it.
    assert!(page.contains("id=\"replay\""), "{page}");
    assert!(page.contains("server.admin_token is not set"), "{page}");
    let (_, _, page) = get(&admin, &format!("/events/{}", ids[0]), None).await;
    assert!(
        page.contains(
            "{\n  &quot;n&quot;: 1,\n  &quot;note&quot;: &quot;&lt;b&gt;bold&lt;/b&gt;&quot;\n}"
        ),
        "{page}"
    );
    let (_, _, page) = get(&admin, &format!("/events/{}", ids[3]), None).await;
    assert!(page.contains("not UTF-8"), "{page}");
    assert!(page.contains("<pre id=\"event-body\">//4A</pre>"), "{page}");

    // The dead letter, with its replay.
    let (status, _, page) = get(&admin, "/dead-letters?destination=orders&since=", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(attribute_values(&page, "data-dead-letter-id"), vec![ids[1]]);
    assert!(page.contains("class=\"replay\""), "{page}");
    assert!(page.contains("id=\"replay-matching\""), "{page}");
    assert!(page.contains("data-query=\"destination=orders\""), "{page}");

    // The consumer, not connected in this test.
    let (status, _, page) = get(&admin, "/consumers", None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(page.contains("<table id=\"consumers\">"), "{page}");
    assert!(page.contains("<tr data-consumer=\"orders\">"), "{page}");
    db.cleanup().await;
}

/// The admin listener's console and API over `db`, with one consumer, `orders`.
fn router<DB: TestBackend>(db: &TestDb<DB>, token: Option<AdminToken>) -> Router {
    let consumers = Arc::new(Consumers::new(["orders"]));
    let access = Arc::new(Access::new(token, "127.0.0.1:9090".parse().unwrap()));
    super::router(&db.inbox, &consumers, &access).merge(admin_api::router(
        &db.inbox,
        &[],
        &["orders".to_owned()],
        &consumers,
        access,
    ))
}

/// The status, headers and body of `GET path`, with `token` as a bearer token.
async fn get(
    router: &Router,
    path: &str,
    token: Option<&str>,
) -> (StatusCode, axum::http::HeaderMap, String) {
    let mut request = Request::get(path).header(HOST, "127.0.0.1:9090");
    if let Some(token) = token {
        request = request.header(AUTHORIZATION, format!("Bearer {token}"));
    }
    let response = router
        .clone()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    (
        parts.status,
        parts.headers,
        String::from_utf8(body.to_vec()).unwrap(),
    )
}

/// The text of the element with `data-figure="name"`.
fn figure(page: &str, name: &str) -> String {
    let start = format!("data-figure=\"{name}\">");
    let at = page
        .find(&start)
        .unwrap_or_else(|| panic!("no figure {name}: {page}"))
        + start.len();
    page[at..].split('<').next().unwrap().to_owned()
}

/// The values of every `name="…"` attribute, as numbers, in order.
fn attribute_values(page: &str, name: &str) -> Vec<i64> {
    page.split(&format!("{name}=\""))
        .skip(1)
        .map(|rest| rest.split('"').next().unwrap().parse().unwrap())
        .collect()
}
