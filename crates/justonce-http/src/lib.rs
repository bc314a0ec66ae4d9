//! HTTP for justonce.
//!
//! | feature       | what it adds |
//! |---------------|--------------|
//! | `client`      | [`client::RetryingClient`]: POSTs with one `Idempotency-Key`, sent again on every retry |
//! | `destination` | [`HttpDestination`]: the outbox relay POSTs each row with its key as `Idempotency-Key` |
//! | `receiver`    | [`receiver::router`]: `POST /webhooks/{source}` verifies, stores and answers 2xx, and the relay delivers |
//! | `server`      | [`server::IdempotencyLayer`]: a tower layer for axum routes that stores each keyed response and replays it on retries |
//! | `failpoints`  | for fault tests only: `JUSTONCE_FAILPOINT=stored-not-answered` stops the receiver's first stored event before its answer |
//!
//! The destination carries the row's key on every attempt, so that a receiver which
//! deduplicates on it acts once however often the relay retries:
//!
//! ```no_run
//! # #[cfg(feature = "destination")]
//! # fn example<DB: justonce_sql::Backend>(outbox: justonce_sql::Outbox<DB>) -> Result<(), justonce_core::Error> {
//! use justonce_http::HttpDestination;
//!
//! let relay = outbox
//!     .relay()
//!     .destination("invoice-email", HttpDestination::new("https://mail.example/send")?);
//! # Ok(())
//! # }
//! ```

#[cfg(any(feature = "receiver", feature = "server"))]
mod answer;
#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "destination")]
mod destination;
#[cfg(all(feature = "failpoints", feature = "receiver"))]
mod failpoint;
#[cfg(feature = "receiver")]
pub mod receiver;
#[cfg(any(feature = "client", feature = "destination"))]
mod retry_after;
#[cfg(feature = "server")]
pub mod server;
#[cfg(any(feature = "destination", feature = "receiver"))]
mod standard_webhooks;

#[cfg(any(feature = "receiver", feature = "server"))]
pub use answer::{problem, problem_with};
#[cfg(feature = "destination")]
pub use destination::HttpDestination;

/// Describes the metrics the enabled features emit, for the `# HELP` lines of an
/// exporter. Call it once, after installing the metrics recorder.
pub fn describe_metrics() {
    #[cfg(feature = "receiver")]
    {
        metrics::describe_counter!(
            "justonce_webhooks_total",
            "Webhook requests, by source and outcome (accepted, duplicate, key_reused, \
             rejected_body, rejected_signature, rejected_id, unknown_source, unavailable)"
        );
        metrics::describe_histogram!(
            receiver::ANSWERED_SECONDS,
            "Seconds from a webhook's arrival to its 2xx answer, by source"
        );
    }
    #[cfg(feature = "server")]
    metrics::describe_counter!(
        "justonce_idempotency_requests_total",
        "Requests through the Idempotency-Key layer, by outcome"
    );
}
