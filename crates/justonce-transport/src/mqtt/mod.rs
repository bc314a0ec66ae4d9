//! MQTT 5: a QoS 1 subscriber on a persistent session that acknowledges (`PUBACK`) only after
//! the commit, and the relay's publisher.
//!
//! ```no_run
//! # async fn example(inbox: justonce_sql::Inbox<justonce_sql::sqlx::Postgres>) -> Result<(), justonce_transport::Error> {
//! use justonce_sql::sqlx;
//! use justonce_transport::mqtt::{MqttConsumer, MqttOptions};
//!
//! let consumer = MqttConsumer::connect(
//!     "mqtt://127.0.0.1:1883",
//!     inbox,
//!     MqttOptions::new("orders/#", "shipping-1"),
//! )
//! .await?;
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
//! The session is persistent (`clean_start` off, a session expiry): a message delivered but
//! not acknowledged when the consumer died is sent again when a consumer with the same
//! client id connects. MQTT has no negative acknowledgement, so failed work is published
//! again to the message's topic with its attempt count in a user property, then
//! acknowledged; after the attempt limit it is published to the dead-letter topic with the
//! reason. Each copy is acknowledged by the broker before the original is.
//!
//! The key is the `key` user property by default, as [`MqttDestination`] publishes it.
//!
//! An `mqtts://` URL connects over TLS, checked against the system's roots or the CA of
//! [`MqttOptions::tls`].

pub use rumqttc::v5::mqttbytes::v5::Publish as Message;

mod adapter;
mod connection;
mod destination;
mod options;

pub use adapter::{Mqtt, MqttConsumer, MqttReceiver};
pub use connection::probe;
pub use destination::MqttDestination;
pub use options::{KEY_PROPERTY, MqttOptions};
