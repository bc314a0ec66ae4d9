//! The Idempotency-Key header through `IdempotencyLayer` on a real axum route, with its keys
//! in an in-memory SQLite store. Every header is answered 400 or used, as the layer's
//! documentation says, and a used key is stored exactly as the header spells it.
#![no_main]

use arbitrary::Arbitrary;
use axum::Router;
use axum::body::Body;
use axum::http::{HeaderValue, Method, Request, StatusCode};
use axum::routing::post;
use justonce_http::server::{IDEMPOTENCY_KEY, IdempotencyLayer};
use justonce_sql::sqlx::sqlite::{Sqlite, SqlitePoolOptions};
use justonce_sql::{Consumer, Identity, Inbox, Key, InboxOptions, Scope};
use libfuzzer_sys::fuzz_target;
use std::sync::LazyLock;
use tower_service::Service;

#[derive(Arbitrary, Debug)]
struct Input {
    /// The Idempotency-Key headers of the request, as raw bytes.
    keys: Vec<Vec<u8>>,
    body: Vec<u8>,
}

struct Harness {
    runtime: tokio::runtime::Runtime,
    inbox: Inbox<Sqlite>,
    app: Router,
}

static HARNESS: LazyLock<Harness> = LazyLock::new(|| {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let inbox = runtime.block_on(async {
        // One connection that is never closed: an in-memory database lives as long as it.
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect("sqlite::memory:")
            .await
            .unwrap();
        let inbox =
            Inbox::from_pool(pool, Consumer::new("fuzz").unwrap(), InboxOptions::default()).unwrap();
        inbox.migrate().await.unwrap();
        inbox
    });
    let app = Router::new()
        .route("/pay", post(|| async { (StatusCode::CREATED, "paid") }))
        .route_layer(IdempotencyLayer::new(inbox.clone()).shared());
    Harness {
        runtime,
        inbox,
        app,
    }
});

fuzz_target!(|input: Input| {
    let harness = &*HARNESS;
    let mut values = Vec::new();
    for bytes in input.keys.iter().take(3) {
        // What cannot be a header value cannot reach a server.
        let Ok(value) = HeaderValue::from_bytes(bytes) else {
            return;
        };
        values.push(value);
    }
    let mut request = Request::post("/pay")
        .body(Body::from(input.body.clone()))
        .unwrap();
    for value in &values {
        request.headers_mut().append(IDEMPOTENCY_KEY, value.clone());
    }
    let expected = match values.as_slice() {
        [] => Err("Idempotency-Key required"),
        [one] => documented_key(one.as_bytes()).ok_or("invalid Idempotency-Key"),
        _ => Err("invalid Idempotency-Key"),
    };
    harness.runtime.block_on(async {
        let response = harness.app.clone().call(request).await.unwrap();
        let status = response.status();
        let key = match expected {
            Err(title) => {
                assert_eq!(status, StatusCode::BAD_REQUEST, "expected {title:?}");
                let body = axum::body::to_bytes(response.into_body(), 1 << 16)
                    .await
                    .unwrap();
                let body = String::from_utf8_lossy(&body);
                assert!(body.contains(title), "expected {title:?}, got {body}");
                return;
            }
            Ok(key) => key,
        };
        // First use or a replay is 201; the same key with another body is 422.
        assert!(
            status == StatusCode::CREATED || status == StatusCode::UNPROCESSABLE_ENTITY,
            "{key:?} was answered {status}"
        );
        // The key is stored under the route's consumer exactly as the header spells it.
        let identity = Identity::new(
            Scope::none(),
            IdempotencyLayer::consumer_for(&Method::POST, "/pay"),
            Key::new(key.clone()).unwrap(),
        );
        let stored = harness.inbox.lookup(&identity).await.unwrap();
        assert!(
            stored.is_some_and(|stored| stored.result.is_some()),
            "{key:?} was not stored as given"
        );
    });
});

/// The key the layer's documentation promises for one header value, or `None` for a 400:
/// spaces and tabs around it dropped; a quoted string unquoted, with `\"` and `\\` its only
/// escapes; then not empty or blank, at most 255 bytes, visible ASCII without control
/// characters.
fn documented_key(value: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(value).ok()?;
    if !text
        .bytes()
        .all(|b| b == b'\t' || (b' '..=b'~').contains(&b))
    {
        return None;
    }
    let text = text.trim_matches([' ', '\t']);
    let key = match text.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
        Some(quoted) => {
            let mut key = String::new();
            let mut chars = quoted.chars();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => match chars.next() {
                        Some(escaped @ ('"' | '\\')) => key.push(escaped),
                        _ => return None,
                    },
                    '"' => return None,
                    c => key.push(c),
                }
            }
            key
        }
        None => text.to_owned(),
    };
    let usable = !key.trim().is_empty() && key.len() <= Key::MAX_LEN && !key.contains('\t');
    usable.then_some(key)
}
