//! NATS JetStream: a durable pull consumer that acknowledges only after the commit, and the
//! relay's publisher.
//!
//! ```no_run
//! # async fn example(inbox: justonce_sql::Inbox<justonce_sql::sqlx::Postgres>) -> Result<(), justonce_transport::Error> {
//! use justonce_sql::sqlx;
//! use justonce_transport::nats::{NatsConsumer, NatsOptions};
//!
//! let consumer =
//!     NatsConsumer::connect("nats://127.0.0.1:4222", inbox, NatsOptions::new("ORDERS", "orders"))
//!         .await?;
//! consumer
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
//! # Ok(())
//! # }
//! ```
//!
//! The stream counts deliveries itself: failed work is answered with a NAK and a growing
//! delay, and redelivered, up to the attempt limit; then the message is published to the
//! dead-letter subject with its reason and terminated. While work runs, the consumer tells
//! the server it is in progress, so that long work is not redelivered to another reader.
//!
//! A server that requires TLS gets it; with [`NatsOptions::tls`], TLS is required of any
//! server and checked against the CA given.

pub use async_nats::jetstream::Message;

mod adapter;
mod connection;
mod destination;
mod options;
mod reader;

pub use adapter::{Messages, Nats, NatsConsumer};
pub use connection::probe;
pub use destination::NatsDestination;
pub use options::{MSG_ID_HEADER, NatsOptions};
pub use reader::{NatsReader, NatsStream};
