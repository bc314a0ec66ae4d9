//! RabbitMQ: a consumer that acknowledges only after the commit, and the relay's publisher.
//!
//! ```no_run
//! # async fn example(inbox: justonce_sql::Inbox<justonce_sql::sqlx::Postgres>) -> Result<(), justonce_transport::Error> {
//! use justonce_sql::sqlx;
//! use justonce_transport::amqp::{AmqpConsumer, AmqpOptions};
//!
//! let consumer = AmqpConsumer::connect(
//!     "amqp://guest:guest@127.0.0.1:5672/%2f",
//!     inbox,
//!     AmqpOptions::new("orders"),
//! )
//! .await?;
//! let stats = consumer
//!     .run(tokio::signal::ctrl_c(), |tx, message| {
//!         Box::pin(async move {
//!             sqlx::query("INSERT INTO shipments (order_key) VALUES ($1)")
//!                 .bind(message.key.as_str())
//!                 .execute(&mut **tx)
//!                 .await
//!                 .map(drop)
//!         })
//!     })
//!     .await?;
//! println!("{} processed, {} duplicates", stats.processed, stats.duplicates);
//! # Ok(())
//! # }
//! ```
//!
//! An `amqps://` URL connects over TLS, checked against the system's roots or the CA of
//! [`AmqpOptions::tls`].

mod adapter;
mod connection;
mod destination;
mod options;

pub use adapter::{Amqp, AmqpConsumer, AmqpDelivery, AmqpReceiver};
pub use connection::probe;
pub use destination::AmqpDestination;
pub use options::{AmqpOptions, QueueType};
