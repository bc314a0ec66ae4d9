//! A RabbitMQ worker that ships each order once, however often RabbitMQ delivers it.
//!
//! ```sh
//! cargo run --example rabbitmq_worker -- --amqp amqp://guest:guest@127.0.0.1:5672/%2f \
//!     --database postgres://postgres@127.0.0.1/test --queue orders
//! ```
//!
//! A message's `message_id` is its key, and its body is an order such as
//! `{"order": "ord_1", "address": "1 Main St"}`. The worker claims the key and inserts the
//! shipment in one transaction, and acknowledges the message after the commit. A message
//! published twice, or delivered again after a crash, finds its key claimed: it is
//! acknowledged and ships nothing. Ctrl-C stops the worker.

use justonce::amqp::{AmqpConsumer, AmqpOptions};
use justonce::broker::{ConsumerStats, Incoming};
use justonce::sqlx::{self, Postgres, Transaction};
use justonce::{Consumer, Inbox};
use std::future::Future;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let mut amqp = "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned();
    let mut database = "postgres://postgres@127.0.0.1/test".to_owned();
    let mut queue = "orders".to_owned();
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next()) {
            ("--amqp", Some(url)) => amqp = url,
            ("--database", Some(url)) => database = url,
            ("--queue", Some(name)) => queue = name,
            _ => {
                eprintln!(
                    "usage: rabbitmq_worker [--amqp URL] [--database postgres://URL] [--queue NAME]"
                );
                std::process::exit(2);
            }
        }
    }
    let inbox = open(&database).await?;
    println!("shipping the orders of queue {queue}; Ctrl-C stops");
    let stats = work(&amqp, inbox, &queue, tokio::signal::ctrl_c()).await?;
    println!(
        "shipped {}, skipped {} duplicates",
        stats.processed, stats.duplicates
    );
    Ok(())
}

/// Connects, and creates justonce's tables and `shipments` unless they exist.
pub async fn open(database: &str) -> Result<Inbox<Postgres>, BoxError> {
    let inbox = Inbox::<Postgres>::connect(database, Consumer::new("shipping")?).await?;
    inbox.migrate().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS shipments (order_id text NOT NULL, address text NOT NULL)",
    )
    .execute(inbox.pool())
    .await?;
    Ok(inbox)
}

/// Consumes `queue` until `shutdown` completes. Failed work is retried, then moved to
/// `<queue>.dead`.
pub async fn work(
    amqp: &str,
    inbox: Inbox<Postgres>,
    queue: &str,
    shutdown: impl Future,
) -> Result<ConsumerStats, justonce::broker::Error> {
    let consumer = AmqpConsumer::connect(amqp, inbox, AmqpOptions::new(queue)).await?;
    let stats = consumer
        .run(shutdown, |tx, message| Box::pin(ship(tx, message)))
        .await?;
    consumer.close().await?;
    Ok(stats)
}

#[derive(Debug, thiserror::Error)]
enum ShipError {
    #[error("the body is not an order: {0}")]
    Body(&'static str),
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
}

/// The effect, in the transaction that claims the message's key.
async fn ship(tx: &mut Transaction<'_, Postgres>, message: &Incoming) -> Result<(), ShipError> {
    let order: serde_json::Value =
        serde_json::from_slice(&message.body).map_err(|_| ShipError::Body("not JSON"))?;
    let id = order["order"].as_str().ok_or(ShipError::Body("no order"))?;
    let address = order["address"]
        .as_str()
        .ok_or(ShipError::Body("no address"))?;
    sqlx::query("INSERT INTO shipments (order_id, address) VALUES ($1, $2)")
        .bind(id)
        .bind(address)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
