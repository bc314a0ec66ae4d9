//! Kafka: a consumer-group member that keeps each partition's offset in the database, and
//! the relay's idempotent producer.
//!
//! ```no_run
//! # async fn example(inbox: justonce_sql::Inbox<justonce_sql::sqlx::Postgres>) -> Result<(), justonce_transport::Error> {
//! use justonce_sql::sqlx;
//! use justonce_transport::KeyFrom;
//! use justonce_transport::kafka::{KafkaOptions, KafkaReader};
//!
//! // A record's Kafka key names an entity; the message id is in the CloudEvents header.
//! let options = KafkaOptions::new("orders", "billing").key_from(KeyFrom::Header("ce_id".into()));
//! let reader = KafkaReader::connect("kafka://127.0.0.1:9092", inbox, options)?;
//! reader
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
//! The reader never relies on the offsets committed to the broker. It stores each record's
//! offset in the same transaction as the record's work, under the topic's name and the
//! record's partition, and claims the record's key too (a producer may send one message
//! twice). When the group assigns it a partition, it starts after the stored offset, or at
//! the configured start when none is stored. A record whose transaction committed is
//! therefore never run again, across crashes and rebalances.
//!
//! Failed work runs again in place after a growing delay, holding up its partition, up to
//! the attempt limit; then the record goes to `<topic>.dead` with the reason in the
//! [`REASON_HEADER`](crate::REASON_HEADER) header, and the offset moves past it.
//!
//! A Kafka record carries no message id: its key names an entity, such as an order, and
//! many messages share it. The id must come from a header or a JSON pointer
//! ([`KafkaOptions::key_from`]); [`KeyFrom::MessageId`](crate::KeyFrom::MessageId) is refused.

pub use rdkafka::message::OwnedMessage;

mod adapter;
mod connection;
mod context;
mod destination;
mod options;

pub use adapter::{Kafka, KafkaReader, Records};
pub use connection::probe;
pub use destination::{IDEMPOTENCY_KEY_HEADER, KafkaDestination};
pub use options::{KafkaOptions, Sasl, SaslMechanism, Start};
