//! HTTP for justonce.
//!
//! [`HttpDestination`] delivers outbox rows with a POST that carries the row's key as
//! `Idempotency-Key`, the same on every attempt, so that a receiver which deduplicates on
//! it acts once however often the relay retries.
//!
//! ```no_run
//! # fn example<DB: justonce_sql::Backend>(outbox: justonce_sql::Outbox<DB>) -> Result<(), justonce_core::Error> {
//! use justonce_http::HttpDestination;
//!
//! let relay = outbox
//!     .relay()
//!     .destination("invoice-email", HttpDestination::new("https://mail.example/send")?);
//! # Ok(())
//! # }
//! ```

mod destination;

pub use destination::HttpDestination;
