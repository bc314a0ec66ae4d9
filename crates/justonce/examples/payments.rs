//! An HTTP API that creates each payment once, however often its clients retry.
//!
//! ```sh
//! cargo run --example payments -- --listen 127.0.0.1:8081 --database sqlite://payments.db
//! curl -i http://127.0.0.1:8081/payments -H 'Idempotency-Key: pay-1' -H 'X-Tenant: acme' \
//!      -H 'Content-Type: application/json' -d '{"amount": 1250, "currency": "EUR"}'
//! ```
//!
//! `POST /payments` needs an `Idempotency-Key` and an `X-Tenant`. The handler inserts the
//! payment through the request's transaction, the one that also claims the key and stores
//! the response, so the row, the key and the answer commit together. The same request
//! again is answered with the same `201` and `Idempotent-Replayed: true`, and no new row.
//! `--database` also takes a `postgres://` or a `mysql://` URL.

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use justonce::http::server::{IdempotencyLayer, Tx};
use justonce::sqlx::{self, MySql, Postgres, Sqlite};
use justonce::{Backend, Consumer, Inbox};
use std::future::Future;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut args = std::env::args().skip(1);
    let (mut listen, mut database) = (
        "127.0.0.1:8081".to_owned(),
        "sqlite://payments.db".to_owned(),
    );
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next()) {
            ("--listen", Some(address)) => listen = address,
            ("--database", Some(url)) => database = url,
            _ => {
                eprintln!(
                    "usage: payments [--listen ADDRESS] [--database sqlite://FILE | postgres://URL | mysql://URL]"
                );
                std::process::exit(2);
            }
        }
    }
    if database.starts_with("postgres") {
        serve::<Postgres>(&listen, &database).await
    } else if database.starts_with("mysql") || database.starts_with("mariadb") {
        serve::<MySql>(&listen, &database).await
    } else {
        serve::<Sqlite>(&listen, &database).await
    }
}

async fn serve<DB: PaymentsTable>(
    listen: &str,
    database: &str,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let inbox = Inbox::<DB>::connect(database, Consumer::new("payments")?).await?;
    inbox.migrate().await?;
    DB::create_table(inbox.pool()).await?;
    let listener = tokio::net::TcpListener::bind(listen).await?;
    println!("payments on http://{listen}/payments, keys in {database}");
    axum::serve(listener, router(inbox)).await?;
    Ok(())
}

/// `POST /payments`, idempotent by key and tenant.
pub fn router<DB: PaymentsTable>(inbox: Inbox<DB>) -> Router {
    let idempotent = IdempotencyLayer::transactional(inbox).principal(|request| {
        let tenant = request.headers.get("x-tenant")?.to_str().ok()?;
        Some(tenant.to_owned())
    });
    Router::new()
        .route("/payments", post(create_payment::<DB>))
        .route_layer(idempotent)
}

async fn create_payment<DB: PaymentsTable>(
    tx: Tx<DB>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    // The layer has refused requests without a tenant already.
    let tenant = headers
        .get("x-tenant")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let (amount, currency) = match parse(&body) {
        Ok(payment) => payment,
        // A 4xx is stored like a 2xx: the same bad request again gets the same answer.
        Err(detail) => return problem(StatusCode::UNPROCESSABLE_ENTITY, &detail),
    };
    let inserted = match tx.lock().await {
        Ok(mut tx) => DB::insert(&mut tx, &tenant, amount, &currency).await,
        Err(error) => return problem(StatusCode::INTERNAL_SERVER_ERROR, &error.to_string()),
    };
    match inserted {
        Ok(id) => {
            let payment = serde_json::json!({
                "id": id, "tenant": tenant, "amount": amount, "currency": currency,
            });
            (
                StatusCode::CREATED,
                [
                    (header::CONTENT_TYPE, "application/json".to_owned()),
                    (header::LOCATION, format!("/payments/{id}")),
                ],
                payment.to_string(),
            )
                .into_response()
        }
        // A 5xx rolls the transaction back and frees the key for the retry.
        Err(error) => problem(StatusCode::INTERNAL_SERVER_ERROR, &error.to_string()),
    }
}

/// `{"amount": 1250, "currency": "EUR"}`: a positive amount in minor units and an ISO 4217
/// code.
fn parse(body: &[u8]) -> Result<(i64, String), String> {
    let payment: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let amount = payment["amount"]
        .as_i64()
        .filter(|amount| *amount > 0)
        .ok_or("amount must be a positive integer")?;
    let currency = payment["currency"]
        .as_str()
        .filter(|code| code.len() == 3 && code.bytes().all(|b| b.is_ascii_uppercase()))
        .ok_or("currency must be three capital letters")?;
    Ok((amount, currency.to_owned()))
}

fn problem(status: StatusCode, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

/// The `payments` table in each database's SQL.
pub trait PaymentsTable: Backend {
    /// Creates the table unless it exists.
    fn create_table(
        pool: &sqlx::Pool<Self>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Inserts one payment and returns its id.
    fn insert<'a>(
        conn: &'a mut Self::Connection,
        tenant: &'a str,
        amount: i64,
        currency: &'a str,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'a;
}

const INSERT: &str =
    "INSERT INTO payments (tenant, amount, currency) VALUES ($1, $2, $3) RETURNING id";

impl PaymentsTable for Sqlite {
    async fn create_table(pool: &sqlx::Pool<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS payments (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                tenant TEXT NOT NULL,
                amount INTEGER NOT NULL,
                currency TEXT NOT NULL
            )",
        )
        .execute(pool)
        .await
        .map(drop)
    }

    async fn insert<'a>(
        conn: &'a mut Self::Connection,
        tenant: &'a str,
        amount: i64,
        currency: &'a str,
    ) -> Result<i64, sqlx::Error> {
        let query = sqlx::query_scalar(INSERT)
            .bind(tenant)
            .bind(amount)
            .bind(currency);
        query.fetch_one(conn).await
    }
}

impl PaymentsTable for Postgres {
    async fn create_table(pool: &sqlx::Pool<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS payments (
                id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                tenant text NOT NULL,
                amount bigint NOT NULL,
                currency text NOT NULL
            )",
        )
        .execute(pool)
        .await
        .map(drop)
    }

    async fn insert<'a>(
        conn: &'a mut Self::Connection,
        tenant: &'a str,
        amount: i64,
        currency: &'a str,
    ) -> Result<i64, sqlx::Error> {
        let query = sqlx::query_scalar(INSERT)
            .bind(tenant)
            .bind(amount)
            .bind(currency);
        query.fetch_one(conn).await
    }
}

impl PaymentsTable for MySql {
    async fn create_table(pool: &sqlx::Pool<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS payments (
                id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
                tenant VARCHAR(128) NOT NULL,
                amount BIGINT NOT NULL,
                currency CHAR(3) NOT NULL
            )",
        )
        .execute(pool)
        .await
        .map(drop)
    }

    async fn insert<'a>(
        conn: &'a mut Self::Connection,
        tenant: &'a str,
        amount: i64,
        currency: &'a str,
    ) -> Result<i64, sqlx::Error> {
        // No RETURNING on MySQL: the id is in the statement's answer.
        let done = sqlx::query("INSERT INTO payments (tenant, amount, currency) VALUES (?, ?, ?)")
            .bind(tenant)
            .bind(amount)
            .bind(currency)
            .execute(conn)
            .await?;
        Ok(done.last_insert_id() as i64)
    }
}
