//! The axum webhook example, compiled from its own source, on the real PostgreSQL: the same
//! signed event posted twice records one paid order and is answered 200 both times.

use super::respond;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use base64::Engine;
use justonce_http::receiver::{Scheme, standard_webhooks_signature};
use justonce_tests::{TestBackend, unique};
use sqlx::Postgres;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

// The example's `main` is not called here.
#[allow(dead_code)]
#[path = "../../../justonce/examples/webhook_handler.rs"]
mod example;

const SECRET: &str = "whsec_c2hvcC1zZWNyZXQ=";

/// A Standard Webhooks request, signed with `SECRET` now.
fn signed(id: &str, body: &str) -> Request<Body> {
    let key = base64::engine::general_purpose::STANDARD
        .decode(SECRET.trim_start_matches("whsec_"))
        .unwrap();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let signature = standard_webhooks_signature(&key, id, now, body.as_bytes());
    Request::post("/webhooks/shop")
        .header("content-type", "application/json")
        .header("webhook-id", id)
        .header("webhook-timestamp", now.to_string())
        .header("webhook-signature", signature)
        .body(Body::from(body.to_owned()))
        .unwrap()
}

/// Paid orders, and keys claimed.
async fn rows(pool: &sqlx::PgPool) -> [i64; 2] {
    let mut counts = [0; 2];
    for (count, table) in counts.iter_mut().zip(["paid_orders", "justonce_keys"]) {
        *count = Postgres::count(pool, format!("SELECT count(*) FROM {table}")).await;
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_webhook_posted_twice_records_one_order_and_is_answered_200_both_times() {
    let url = Postgres::create_database(&format!("hook_{}", unique())).await;
    let inbox = example::open(&url).await.unwrap();
    let scheme = Scheme::standard_webhooks(&[SECRET.to_owned()], Duration::from_secs(300)).unwrap();
    let app = example::router(inbox.clone(), scheme);
    let body = r#"{"type": "order.paid", "order": "ord_1", "amount": 1250}"#;

    let (first, _, said) = respond(&app, signed("msg_1", body)).await;
    assert_eq!((first, &said[..]), (StatusCode::OK, &b"recorded\n"[..]));
    let after_first = rows(inbox.pool()).await;
    assert_eq!(after_first, [1, 1]);

    // The sender's retry, signed again: answered 2xx, and no row changes.
    let (again, _, said) = respond(&app, signed("msg_1", body)).await;
    assert_eq!(
        (again, &said[..]),
        (StatusCode::OK, &b"duplicate: nothing done\n"[..])
    );
    assert_eq!(rows(inbox.pool()).await, after_first);

    // Ten copies of a new event at once: one order, ten 200s.
    let copies = (0..10).map(|_| respond(&app, signed("msg_2", body)));
    let answers = futures_util::future::join_all(copies).await;
    assert!(
        answers
            .iter()
            .all(|(status, _, _)| *status == StatusCode::OK)
    );
    assert_eq!(rows(inbox.pool()).await, [2, 2]);

    // A body whose signature does not verify records nothing.
    let mut forged = signed("msg_3", body);
    *forged.body_mut() = Body::from(body.replace("1250", "1"));
    let (status, headers, _) = respond(&app, forged).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(rows(inbox.pool()).await, [2, 2]);

    inbox.pool().close().await;
    Postgres::drop_database(&url).await;
}
