//! An axum handler that takes each webhook once, with the library and no service.
//!
//! ```sh
//! SHOP_WEBHOOK_SECRET=whsec_c2hvcC1zZWNyZXQ= cargo run --example webhook_handler -- \
//!     --listen 127.0.0.1:8082 --database postgres://postgres@127.0.0.1/test
//! ```
//!
//! `POST /webhooks/shop` takes Standard Webhooks events such as
//! `{"type": "order.paid", "order": "ord_1", "amount": 1250}`. The handler checks the
//! signature, then claims the key `shop:<webhook-id>` and records the paid order in one
//! transaction. The same event again records nothing and is answered 200 as well, so that
//! the sender stops retrying.

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use justonce::http::problem;
use justonce::http::receiver::Scheme;
use justonce::sqlx::{self, Postgres, Transaction};
use justonce::{Consumer, Inbox, Key, Outcome};
use std::sync::Arc;
use std::time::Duration;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let mut listen = "127.0.0.1:8082".to_owned();
    let mut database = "postgres://postgres@127.0.0.1/test".to_owned();
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next()) {
            ("--listen", Some(address)) => listen = address,
            ("--database", Some(url)) => database = url,
            _ => {
                eprintln!("usage: webhook_handler [--listen ADDRESS] [--database postgres://URL]");
                std::process::exit(2);
            }
        }
    }
    let Ok(secret) = std::env::var("SHOP_WEBHOOK_SECRET") else {
        eprintln!("SHOP_WEBHOOK_SECRET must hold the whsec_ signing secret");
        std::process::exit(2);
    };
    // Standard Webhooks signs a timestamp: older or newer than 5 minutes is refused.
    let scheme = Scheme::standard_webhooks(&[secret], Duration::from_secs(300))?;
    let inbox = open(&database).await?;
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("webhooks on http://{listen}/webhooks/shop");
    axum::serve(listener, router(inbox, scheme)).await?;
    Ok(())
}

/// Connects, and creates justonce's tables and `paid_orders` unless they exist.
pub async fn open(database: &str) -> Result<Inbox<Postgres>, BoxError> {
    let inbox = Inbox::<Postgres>::connect(database, Consumer::new("shop-webhooks")?).await?;
    inbox.migrate().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS paid_orders (order_id text NOT NULL, amount bigint NOT NULL)",
    )
    .execute(inbox.pool())
    .await?;
    Ok(inbox)
}

/// What every request shares. An `Inbox` is cheap to clone: its pool is inside an `Arc`.
#[derive(Clone)]
struct Shop {
    inbox: Inbox<Postgres>,
    scheme: Arc<Scheme>,
}

/// `POST /webhooks/shop`.
pub fn router(inbox: Inbox<Postgres>, scheme: Scheme) -> Router {
    let shop = Shop {
        inbox,
        scheme: Arc::new(scheme),
    };
    Router::new()
        .route("/webhooks/shop", post(receive))
        .with_state(shop)
}

/// A paid order, as the event's body holds it.
struct OrderPaid {
    order: String,
    amount: i64,
}

async fn receive(State(shop): State<Shop>, headers: HeaderMap, body: Bytes) -> Response {
    if shop.scheme.verify(&headers, &body).is_err() {
        let detail = "the signature, its timestamp or the webhook-id is missing or wrong";
        return problem(StatusCode::UNAUTHORIZED, "Unauthorized", detail);
    }
    // The scheme signs the id with the body: a body sent again under a new id fails above.
    let id = headers.get("webhook-id").and_then(|id| id.to_str().ok());
    let id = id.unwrap_or_default(); // an empty id makes no key
    let Ok(key) = Key::purpose(["shop", id]) else {
        return problem(
            StatusCode::BAD_REQUEST,
            "Bad Request",
            "the webhook-id makes no key",
        );
    };
    let event = match parse(&body) {
        Ok(event) => event,
        Err(detail) => {
            return problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Unprocessable Content",
                detail,
            );
        }
    };
    // The work is an async fn taking the transaction: the closure borrows `event` for it.
    let outcome = shop
        .inbox
        .run(&key, &body, |tx| Box::pin(record(tx, &event)));
    match outcome.await {
        Ok(Outcome::Processed(())) => (StatusCode::OK, "recorded\n").into_response(),
        Ok(Outcome::Duplicate) => (StatusCode::OK, "duplicate: nothing done\n").into_response(),
        // The sender reused an id for another body: retrying cannot help it.
        Ok(Outcome::KeyReused { .. }) => {
            eprintln!("{key}: the same id with another body: ignored");
            (StatusCode::OK, "key reused: nothing done\n").into_response()
        }
        // Nothing was recorded: the sender retries, and the retry is judged by the key.
        Err(error) => {
            eprintln!("{key}: {error}");
            problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "Service Unavailable",
                "not recorded: try again",
            )
        }
    }
}

/// The effect, in the transaction that claims the event's key.
async fn record(tx: &mut Transaction<'_, Postgres>, event: &OrderPaid) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO paid_orders (order_id, amount) VALUES ($1, $2)")
        .bind(&event.order)
        .bind(event.amount)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

fn parse(body: &[u8]) -> Result<OrderPaid, &'static str> {
    let event: serde_json::Value =
        serde_json::from_slice(body).map_err(|_| "the body is not JSON")?;
    let order = event["order"].as_str().ok_or("order must be a string")?;
    let amount = event["amount"]
        .as_i64()
        .ok_or("amount must be an integer")?;
    Ok(OrderPaid {
        order: order.to_owned(),
        amount,
    })
}
