//! Claim each message's key in the caller's own SQL transaction, so that the work and the
//! record that it was done commit together, and a duplicate does nothing. The inbox, the
//! outbox and its relay, stream offsets and leases of [justonce](https://docs.rs/justonce),
//! on sqlx.
//!
//! ```
//! # #[cfg(feature = "sqlite")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use justonce_sql::{Consumer, Inbox, Key, Outcome};
//! use sqlx::Sqlite;
//!
//! let inbox = Inbox::<Sqlite>::connect("sqlite::memory:", Consumer::new("billing")?).await?;
//! inbox.migrate().await?;
//! sqlx::query("CREATE TABLE invoices (customer TEXT)").execute(inbox.pool()).await?;
//!
//! let key = Key::purpose(["invoice", "2026-10", "cust_481"])?;
//! for _ in 0..2 {
//!     let outcome = inbox
//!         .run(&key, b"job payload", |tx| Box::pin(async move {
//!             sqlx::query("INSERT INTO invoices (customer) VALUES ('cust_481')")
//!                 .execute(&mut **tx)
//!                 .await
//!         }))
//!         .await?;
//!     match outcome {
//!         Outcome::Processed(_) => println!("invoice created"),
//!         Outcome::Duplicate => println!("already processed"),
//!         Outcome::KeyReused { .. } => println!("same key, different payload: skipped"),
//!     }
//! }
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "sqlite"))]
//! # fn main() {}
//! ```
//!
//! # Feature flags
//!
//! No feature is on by default; each database is one. Without one only the types remain.
//!
//! | feature    | what it adds |
//! |------------|--------------|
//! | `postgres` | PostgreSQL, through sqlx |
//! | `mysql`    | MariaDB or MySQL, through sqlx |
//! | `sqlite`   | SQLite (bundled), through sqlx |
//! | `tls`      | TLS to PostgreSQL and MariaDB/MySQL: rustls with ring |
//!
//! # TLS
//!
//! A PostgreSQL or MariaDB/MySQL server reached over the network is verified by default:
//! a URL without `sslmode` (`ssl-mode`) connects as with `verify-full`
//! (`VERIFY_IDENTITY`). A server on this machine (loopback, a Unix socket) keeps the
//! driver's default, `prefer`. A URL that names a weaker mode logs a warning at connect;
//! a certificate or TLS problem at connect is an [`Error::Config`] that names the
//! database and the problem.

#![cfg_attr(docsrs, feature(doc_cfg))]
// Without a database feature only the types remain, and the statements go unused.
#![cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]

mod admin;
mod backend;
mod common;
mod dashboard;
mod effect;
mod events;
mod inbox;
mod leases;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod numbered;
mod outbox;
mod pool;
#[cfg(feature = "postgres")]
mod postgres;
mod recent;
mod relay;
mod rows;
mod shared;
#[cfg(feature = "sqlite")]
mod sqlite;
#[doc(hidden)]
pub mod statements;
mod tables;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod tls;
mod wake;

pub use backend::Backend;
pub use dashboard::{Dashboard, DashboardMinute, DashboardTotals, DestinationDashboard};
pub use effect::Effect;
pub use events::{
    Event, EventDetail, EventFilter, EventPage, EventState, KEY_CONTAINS_WINDOW, REPLAYED_EVENTS,
    ReplayRange, ReplayWindow,
};
pub use inbox::{Inbox, InboxOptions, OffsetSpan, RunError, WorkFuture};
pub use justonce_core::*;
pub use leases::StoredKey;
pub use outbox::{Attempt, BackedOff, Message, Outbox, OutboxStats, Row, RowFilter, RowSummary};
#[cfg(feature = "postgres")]
pub use postgres::check_postgres_hosts;
pub use relay::{DELIVERED_SECONDS, Relay, RelayOptions, RelayRound};
pub use rows::{KeyCount, StoredOffset};
/// The sqlx this crate is built with, so that your queries use the same version.
pub use sqlx;
pub use wake::RELAY_NOTIFICATIONS;

/// Describes the metrics this crate emits, for the `# HELP` lines of an exporter. Call it
/// once, after installing the metrics recorder.
pub fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        "justonce_claims_total",
        "Runs of a key, by outcome (processed, duplicate, key_reused) and by what answered \
         (the database or the recent keys)"
    );
    describe_counter!(
        "justonce_retries_total",
        "Tries of a run that failed and were tried again, by cause (transient, commit_unknown)"
    );
    describe_counter!(
        "justonce_lease_takeovers_total",
        "Leases taken over after they expired"
    );
    describe_counter!(
        "justonce_deliveries_total",
        "Outbox rows the relay delivered, by destination and outcome (sent, retried, dead, \
         or superseded: the row was replayed, dead-lettered or taken over while it was \
         sent, and this outcome was not recorded)"
    );
    describe_histogram!(
        DELIVERED_SECONDS,
        "Seconds from an outbox row's commit (or replay) to its delivery, by destination"
    );
    describe_counter!(
        REPLAYED_EVENTS,
        "Stored events put back to be delivered again, by origin and by how they were \
         picked (event, key, range)"
    );
    describe_counter!(
        RELAY_NOTIFICATIONS,
        "Notifications sent after commits of outbox rows to wake the relays of other \
         processes, at most one per notify interval (PostgreSQL)"
    );
    describe_counter!(
        "justonce_relay_record_failures_total",
        "Failed deliveries whose reason the database refused, recorded without it"
    );
    describe_gauge!(
        "justonce_destination_open",
        "1 while a destination's breaker holds its deliveries back, by destination and tenant"
    );
}
