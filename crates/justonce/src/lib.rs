//! justonce makes every message, job and webhook take effect once.
//!
//! Brokers, job queues and webhook senders deliver at least once, so duplicates are
//! normal. justonce records each message's key under a unique constraint in the same
//! database transaction as the work, and skips a key it has already processed.
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
//! # Features
//!
//! | feature    | what it adds                                              |
//! |------------|-----------------------------------------------------------|
//! | `sqlite`   | [`Inbox`] on SQLite (bundled): the embedded default       |
//! | `postgres` | [`Inbox`] on PostgreSQL, for several instances and scale  |
//! | `mysql`    | [`Inbox`] on MariaDB or MySQL                             |
//! | `tls`      | TLS to PostgreSQL and MariaDB/MySQL (rustls with ring)    |
//!
//! Without a feature you get the vocabulary only: [`Key`], [`Consumer`], [`Scope`],
//! [`Fingerprint`], [`Retention`], [`Outcome`] and the errors.
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
//! The rule comes from the Agent Wranglers integration and events playbook (CC BY 4.0):
//! <https://agentwranglers.se/playbook/events/consuming-events/idempotent-consumers>.

pub use justonce_core::*;
pub use justonce_sql::{
    Backend, Inbox, Message, Options, Outbox, Relay, RelayOptions, RelayRound, Row, RunError,
    StoredKey, WorkFuture, sqlx,
};

/// The Rust blocks of the README and of every page under `docs/`, compiled as doc tests:
/// those that touch a database run against SQLite, those that need a server are `no_run`.
#[cfg(all(doctest, feature = "sqlite", feature = "postgres"))]
pub mod docs {
    #[doc = include_str!("../../../README.md")]
    pub struct Readme;
    #[doc = include_str!("../../../docs/benchmarks.md")]
    pub struct Benchmarks;
    #[doc = include_str!("../../../docs/brokers.md")]
    pub struct Brokers;
    #[doc = include_str!("../../../docs/check.md")]
    pub struct Check;
    #[doc = include_str!("../../../docs/configuration.md")]
    pub struct Configuration;
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
