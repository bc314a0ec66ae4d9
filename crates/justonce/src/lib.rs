//! justonce makes every message, job and webhook take effect once.
//!
//! Brokers, job queues and webhook senders deliver at least once, so duplicates are
//! normal. justonce records each message's key under a unique constraint in the same
//! database transaction as the work, and skips a key it has already processed.
//!
//! This crate is the one to depend on. Each part is a feature, and each feature adds a
//! module of its name: [`http`], [`amqp`], [`nats`], [`redis`], [`mqtt`], [`kafka`].
//!
//! # What it promises
//!
//! - An acknowledged message produces its effect exactly once when the effect is written
//!   in the same database transaction as its key. Acknowledge a message (broker ack, HTTP
//!   2xx) only after [`Inbox::run`] has returned.
//! - Effects outside that database (an HTTP call, an email, a publish) are at-least-once;
//!   each carries a stable idempotency key derived from the message key
//!   ([`Identity::derive`]), so the receiver can make them once too.
//! - Nobody promises exactly-once *delivery*: justonce gives you once in effect.
//!
//! # Example
//!
//! ```
//! # #[cfg(feature = "sqlite")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use justonce::sqlx::{self, Sqlite};
//! use justonce::{Consumer, Inbox, Key, Outcome};
//!
//! let inbox = Inbox::<Sqlite>::connect("sqlite::memory:", Consumer::new("billing")?).await?;
//! inbox.migrate().await?;
//! sqlx::query("CREATE TABLE invoices (customer TEXT)").execute(inbox.pool()).await?;
//!
//! let key = Key::purpose(["invoice", "2026-10", "cust_481"])?;
//! for _ in 0..2 {
//!     let outcome = inbox
//!         .run(&key, b"cust_481 2026-10", |tx| {
//!             Box::pin(async move {
//!                 sqlx::query("INSERT INTO invoices VALUES ('cust_481')")
//!                     .execute(&mut **tx)
//!                     .await
//!             })
//!         })
//!         .await?;
//!     match outcome {
//!         Outcome::Processed(_) => println!("invoice created"),
//!         Outcome::Duplicate => println!("already invoiced: nothing done"),
//!         Outcome::KeyReused { .. } => println!("same key, different payload: skipped"),
//!     }
//! }
//! let (invoices,): (i64,) = sqlx::query_as("SELECT count(*) FROM invoices")
//!     .fetch_one(inbox.pool())
//!     .await?;
//! assert_eq!(invoices, 1);
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "sqlite"))]
//! # fn main() {}
//! ```
//!
//! # Feature flags
//!
//! No feature is on by default. Without one you get the vocabulary only: [`Key`],
//! [`Consumer`], [`Scope`], [`Fingerprint`], [`Retention`], [`Outcome`] and the errors.
//!
//! | feature            | what it adds                                                         |
//! |--------------------|----------------------------------------------------------------------|
//! | `sqlite`           | [`Inbox`] on SQLite (bundled): the embedded default                  |
//! | `postgres`         | [`Inbox`] on PostgreSQL, for several instances and scale             |
//! | `mysql`            | [`Inbox`] on MariaDB or MySQL                                        |
//! | `tls`              | TLS to PostgreSQL and MariaDB/MySQL (rustls with ring)               |
//! | `receiver`         | [`http::receiver`]: the webhook receiver, an axum router             |
//! | `http-server`      | [`http::server`]: the Idempotency-Key layer for axum routes          |
//! | `http-client`      | [`http::client`]: POSTs that send one Idempotency-Key on every retry |
//! | `http-destination` | [`http::HttpDestination`]: the relay POSTs each outbox row           |
//! | `amqp`             | [`amqp`]: a RabbitMQ consumer and publisher                          |
//! | `nats`             | [`nats`]: a NATS JetStream consumer, reader and publisher            |
//! | `redis`            | [`redis`]: a Redis Streams consumer, reader and publisher; leases    |
//! | `mqtt`             | [`mqtt`]: an MQTT 5 subscriber and publisher                         |
//! | `kafka`            | [`kafka`]: a Kafka group member with offsets in the database, and an idempotent publisher |
//!
//! Any broker feature adds [`broker`]: what every broker's consumer shares, TLS included.
//! Pick the database features you run on; the HTTP parts and the brokers work with each.
//!
//! # One crate
//!
//! Every part is reachable from here, and so is every type its methods take or return.
//! A webhook receiver and a payments route behind the Idempotency-Key layer, on one
//! inbox, called by the retrying client:
//!
//! ```
//! # #[cfg(all(feature = "sqlite", feature = "receiver", feature = "http-server",
//! #     feature = "http-client", feature = "amqp", feature = "nats", feature = "redis",
//! #     feature = "mqtt"))]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use justonce::http::axum::{self, Router, http::StatusCode, routing::post};
//! use justonce::http::client::{IdempotencyKey, RetryingClient};
//! use justonce::http::receiver::{self, IdLocation, Scheme, Source};
//! use justonce::http::reqwest::header::{HeaderName, HeaderValue};
//! use justonce::http::server::IdempotencyLayer;
//! use justonce::sqlx::Sqlite;
//! use justonce::{Consumer, Inbox, InboxOptions, OutboxStats};
//! use std::time::Duration;
//!
//! let options = InboxOptions::default().prefix("shop_");
//! let inbox = Inbox::<Sqlite>::connect_with("sqlite::memory:", Consumer::new("shop")?, options)
//!     .await?;
//! inbox.migrate().await?;
//!
//! // `POST /webhooks/orders`, each event keyed by its `x-event-id`.
//! let event_id = HeaderName::from_static("x-event-id");
//! let orders = Source::new("orders", Scheme::None, IdLocation::Header(event_id.clone()))?;
//! // `POST /payments`, run once per `Idempotency-Key`.
//! let payments = Router::new()
//!     .route("/payments", post(|| async { (StatusCode::CREATED, "pay_1") }))
//!     .route_layer(IdempotencyLayer::new(inbox.clone()).shared());
//! let app = receiver::router(&inbox, vec![orders], 1 << 20).merge(payments);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let base = format!("http://{}", listener.local_addr()?);
//! tokio::spawn(async move { axum::serve(listener, app).await });
//!
//! // The same event twice: stored once, with one outbox row for the relay to deliver.
//! let client = RetryingClient::new(RetryingClient::http_client(Duration::from_secs(5))?);
//! for status in ["accepted", "duplicate"] {
//!     let sent = client
//!         .post(format!("{base}/webhooks/orders"))
//!         .header(event_id.clone(), HeaderValue::from_static("evt_1"))
//!         .body(r#"{"order":"ord_1"}"#)
//!         .send()
//!         .await?;
//!     assert!(sent.response.text().await?.contains(status));
//! }
//! let outbox: OutboxStats = inbox.outbox().stats().await?;
//! assert_eq!(outbox.due, 1);
//!
//! // The same payment twice: the second answer is the first, replayed.
//! for replayed in [None, Some("true")] {
//!     let sent = client
//!         .post(format!("{base}/payments"))
//!         .key(IdempotencyKey::new("pay-1")?)
//!         .send()
//!         .await?;
//!     assert_eq!(sent.response.status(), StatusCode::CREATED.as_u16());
//!     let header = sent.response.headers().get("idempotent-replayed");
//!     assert_eq!(header.and_then(|value| value.to_str().ok()), replayed);
//! }
//!
//! // Each broker's consumer takes its options, and what the brokers share.
//! use justonce::{amqp, broker, mqtt, nats, redis};
//! let tls = broker::Tls::default();
//! let _ = amqp::AmqpOptions::new("orders").key_from(broker::KeyFrom::MessageId).tls(tls.clone());
//! let _ = nats::NatsOptions::new("ORDERS", "orders.>").tls(tls.clone());
//! let _ = redis::RedisStreamOptions::new("orders", "shipping").tls(tls.clone());
//! let _ = mqtt::MqttOptions::new("orders", "shipping-1").tls(tls);
//! let _leases_on_redis = redis::RedisLeases::connect;
//! # Ok(())
//! # }
//! # #[cfg(not(all(feature = "sqlite", feature = "receiver", feature = "http-server",
//! #     feature = "http-client", feature = "amqp", feature = "nats", feature = "redis",
//! #     feature = "mqtt")))]
//! # fn main() {}
//! ```
//!
//! # Names
//!
//! The outbox's and the inbox's types carry their part's name here, so that they read
//! apart from sqlx's and std's: [`InboxOptions`], [`OutboxMessage`], [`OutboxRow`].
//!
//! The rule comes from the Agent Wranglers integration and events playbook (CC BY 4.0):
//! <https://agentwranglers.se/playbook/events/consuming-events/idempotent-consumers>.

#![cfg_attr(docsrs, feature(doc_cfg))]

pub use justonce_core::*;
pub use justonce_sql::Message as OutboxMessage;

pub use justonce_sql::Row as OutboxRow;
pub use justonce_sql::{
    BackedOff, Backend, DELIVERED_SECONDS, Effect, Inbox, InboxOptions, KeyCount, Outbox,
    OutboxStats, Relay, RelayOptions, RelayRound, RunError, StoredKey, StoredOffset, WorkFuture,
    sqlx,
};

/// The Rust blocks of the README and of every page under `docs/`, compiled as doc tests:
/// those that touch a database run against SQLite, those that need a server are `no_run`.
#[cfg(all(doctest, feature = "sqlite", feature = "postgres"))]
pub mod docs {
    #[doc = include_str!("../../../README.md")]
    pub struct Readme;
    #[doc = include_str!("../../../docs/admin-api.md")]
    pub struct AdminApi;
    #[doc = include_str!("../../../docs/benchmarks.md")]
    pub struct Benchmarks;
    #[doc = include_str!("../../../docs/brokers.md")]
    pub struct Brokers;
    #[doc = include_str!("../../../docs/capacity.md")]
    pub struct Capacity;
    #[doc = include_str!("../../../docs/check.md")]
    pub struct Check;
    #[doc = include_str!("../../../docs/contributing.md")]
    pub struct Contributing;
    #[doc = include_str!("../../../docs/configuration.md")]
    pub struct Configuration;
    #[doc = include_str!("../../../docs/console.md")]
    pub struct Console;
    #[doc = include_str!("../../../docs/deploy.md")]
    pub struct Deploy;
    #[doc = include_str!("../../../docs/http.md")]
    pub struct Http;
    #[doc = include_str!("../../../docs/library.md")]
    pub struct Library;
    #[doc = include_str!("../../../docs/README.md")]
    pub struct Index;
    #[doc = include_str!("../../../docs/operations.md")]
    pub struct Operations;
    #[doc = include_str!("../../../docs/reliability.md")]
    pub struct Reliability;
    #[doc = include_str!("../../../docs/service.md")]
    pub struct Service;
    #[doc = include_str!("../../../docs/testing.md")]
    pub struct Testing;
    #[doc = include_str!("../../../docs/tls.md")]
    pub struct Tls;
}

/// HTTP: the webhook receiver, the Idempotency-Key layer, the retrying client and the
/// relay's HTTP destination, each behind its feature.
#[cfg(any(
    feature = "receiver",
    feature = "http-server",
    feature = "http-client",
    feature = "http-destination"
))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(
        feature = "receiver",
        feature = "http-server",
        feature = "http-client",
        feature = "http-destination"
    )))
)]
pub mod http {
    #[cfg(any(feature = "receiver", feature = "http-server"))]
    #[cfg_attr(docsrs, doc(cfg(any(feature = "receiver", feature = "http-server"))))]
    pub use justonce_http::{axum, problem, problem_with};

    #[cfg(feature = "http-client")]
    #[cfg_attr(docsrs, doc(cfg(feature = "http-client")))]
    pub use justonce_http::{client, reqwest};

    #[cfg(feature = "http-destination")]
    #[cfg_attr(docsrs, doc(cfg(feature = "http-destination")))]
    pub use justonce_http::HttpDestination;

    #[cfg(feature = "receiver")]
    #[cfg_attr(docsrs, doc(cfg(feature = "receiver")))]
    pub use justonce_http::receiver;

    #[cfg(feature = "http-server")]
    #[cfg_attr(docsrs, doc(cfg(feature = "http-server")))]
    pub use justonce_http::server;
}

/// What every broker's consumer shares: the generic [`broker::Consumer`] over a
/// [`broker::Broker`] adapter, where a delivery's key is, what the work sees, what a run
/// came to, the counts, the errors, and TLS to the broker. With NATS, Redis or Kafka, the
/// generic single reader `Reader` over an `OrderedBroker` adapter too.
#[cfg(any(
    feature = "amqp",
    feature = "nats",
    feature = "redis",
    feature = "mqtt",
    feature = "kafka"
))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(
        feature = "amqp",
        feature = "nats",
        feature = "redis",
        feature = "mqtt",
        feature = "kafka"
    )))
)]
pub mod broker {
    pub use justonce_transport::tls::{Tls, TlsError};
    pub use justonce_transport::{
        ATTEMPT_HEADER, Broker, Consumer, ConsumerStats, Deliveries, Error, Incoming, KeyFrom,
        Policy, REASON_HEADER, Ran, Receive, Received, Settle, Work,
    };
    #[cfg(any(feature = "nats", feature = "redis", feature = "kafka"))]
    pub use justonce_transport::{
        OrderedBroker, Position, Reader, ReaderDeliveries, StoredOffsets,
    };
}

#[cfg(feature = "amqp")]
#[cfg_attr(docsrs, doc(cfg(feature = "amqp")))]
pub use justonce_transport::amqp;

#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub use justonce_transport::nats;

#[cfg(feature = "mqtt")]
#[cfg_attr(docsrs, doc(cfg(feature = "mqtt")))]
pub use justonce_transport::mqtt;

#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use justonce_transport::kafka;

/// Redis: a Redis Streams consumer group reader, a single reader that keeps its position
/// in the database, the relay's publisher, and leases kept on Redis.
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis {
    pub use justonce_redis::*;
    pub use justonce_transport::redis_streams::*;
}

/// Describes the metrics of every enabled part, for the `# HELP` lines of an exporter.
/// Call it once, after installing the metrics recorder.
pub fn describe_metrics() {
    justonce_sql::describe_metrics();
    #[cfg(any(
        feature = "receiver",
        feature = "http-server",
        feature = "http-client",
        feature = "http-destination"
    ))]
    justonce_http::describe_metrics();
    #[cfg(any(
        feature = "amqp",
        feature = "nats",
        feature = "redis",
        feature = "mqtt",
        feature = "kafka"
    ))]
    justonce_transport::describe_metrics();
}
