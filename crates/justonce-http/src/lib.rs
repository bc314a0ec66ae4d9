//! HTTP for [justonce](https://docs.rs/justonce): webhooks received once, requests
//! answered once, and calls that carry one `Idempotency-Key` on every retry.
//!
//! - [`receiver`]: `POST /webhooks/{source}` verifies each event, stores it under its
//!   key with an outbox row in one transaction, answers 2xx, and the relay delivers it.
//! - [`server`]: a tower layer for axum routes that runs a keyed request once, stores its
//!   response and replays it to every retry.
//! - [`client`]: POSTs that send one `Idempotency-Key` and send it again on every retry.
//! - [`HttpDestination`]: the outbox relay POSTs each row with its key as
//!   `Idempotency-Key`.
//!
//! The destination carries the row's key on every attempt, so that a receiver which
//! deduplicates on it acts once however often the relay retries:
//!
//! ```no_run
//! # #[cfg(feature = "destination")]
//! # async fn example<DB: justonce_sql::Backend>(outbox: justonce_sql::Outbox<DB>) -> Result<(), justonce_core::Error> {
//! use justonce_http::HttpDestination;
//!
//! let relay = outbox
//!     .relay()
//!     .destination("invoice-email", HttpDestination::new("https://mail.example/send")?);
//! relay.run(std::future::pending()).await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Feature flags
//!
//! No feature is on by default; each part is one.
//!
//! | feature       | what it adds |
//! |---------------|--------------|
//! | `receiver`    | [`receiver`]: the webhook receiver, an axum router |
//! | `server`      | [`server`]: the Idempotency-Key layer for axum routes |
//! | `client`      | [`client`]: the retrying client, on reqwest |
//! | `destination` | [`HttpDestination`]: the relay's HTTP destination, on reqwest |
//! | `failpoints`  | for fault tests only: `JUSTONCE_FAILPOINT` stops the receiver at [`receiver::FAILPOINT`] |

#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(any(feature = "receiver", feature = "server"))]
mod answer;
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
#[cfg(feature = "destination")]
mod destination;
#[cfg(all(feature = "failpoints", feature = "receiver"))]
mod failpoint;
#[cfg(feature = "receiver")]
#[cfg_attr(docsrs, doc(cfg(feature = "receiver")))]
pub mod receiver;
#[cfg(any(feature = "client", feature = "destination"))]
mod retry_after;
#[cfg(feature = "server")]
#[cfg_attr(docsrs, doc(cfg(feature = "server")))]
pub mod server;
#[cfg(any(feature = "destination", feature = "receiver"))]
mod standard_webhooks;

#[cfg(any(feature = "receiver", feature = "server"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "receiver", feature = "server"))))]
pub use answer::{problem, problem_with};
/// The axum the receiver and the Idempotency-Key layer are built with, so that your
/// routes and theirs use the same version.
#[cfg(any(feature = "receiver", feature = "server"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "receiver", feature = "server"))))]
pub use axum;
#[cfg(feature = "destination")]
#[cfg_attr(docsrs, doc(cfg(feature = "destination")))]
pub use destination::HttpDestination;
/// The reqwest the client is built with, for its requests' bodies, headers and responses.
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub use reqwest;

/// Describes the metrics the enabled features emit, for the `# HELP` lines of an
/// exporter. Call it once, after installing the metrics recorder.
pub fn describe_metrics() {
    #[cfg(feature = "receiver")]
    {
        metrics::describe_counter!(
            "justonce_webhooks_total",
            "Webhook requests, by source, tenant for a source with tenants, and outcome \
             (accepted, duplicate, key_reused, rejected_body, rejected_signature, \
             rejected_tenant, rejected_id, unknown_source, unavailable)"
        );
        metrics::describe_histogram!(
            receiver::ANSWERED_SECONDS,
            "Seconds from a webhook's arrival to its 2xx answer, by source, and tenant for \
             a source with tenants"
        );
    }
    #[cfg(feature = "server")]
    metrics::describe_counter!(
        "justonce_idempotency_requests_total",
        "Requests through the Idempotency-Key layer, by outcome"
    );
}
