//! Redis Streams: a consumer group reader that acknowledges (`XACK`) only after the commit,
//! reclaims what a dead reader left pending, and the relay's publisher.
//!
//! ```no_run
//! # async fn example(inbox: justonce_sql::Inbox<justonce_sql::sqlx::Postgres>) -> Result<(), justonce_transport::Error> {
//! use justonce_sql::sqlx;
//! use justonce_transport::redis_streams::{RedisStreamConsumer, RedisStreamOptions};
//!
//! let consumer = RedisStreamConsumer::connect(
//!     "redis://127.0.0.1:6379",
//!     inbox,
//!     RedisStreamOptions::new("orders", "shipping"),
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
//! An entry is a set of fields: by default the key is in `key` and the body in `body`, as
//! [`RedisStreamDestination`] writes them. An entry read but not acknowledged stays in the
//! group's pending list. After [`RedisStreamOptions::claim_idle`] any reader of the group
//! takes it over (`XAUTOCLAIM`), which is how the entries of a reader that died are
//! delivered again and how failed work is retried; Redis counts the deliveries, and after
//! the attempt limit the entry is added to `<stream>.dead` with its reason and acknowledged.
//!
//! A `rediss://` URL connects over TLS, checked against the system's roots or the CA of
//! [`RedisStreamOptions::tls`].
//!
//! Redis keeps a stream only as well as its persistence settings: without AOF
//! (`appendonly yes`, and `appendfsync always` to lose nothing on a crash of the machine) a
//! restart loses the stream, its pending lists and its acknowledgements.

mod adapter;
mod connection;
mod destination;
mod options;
mod reader;

pub use adapter::{Entries, Entry, RedisStreamConsumer, RedisStreams};
pub use connection::probe;
pub use destination::RedisStreamDestination;
pub use options::{BODY_FIELD, CONTENT_TYPE_FIELD, KEY_FIELD, RedisStreamOptions};
pub use reader::RedisStreamReader;
