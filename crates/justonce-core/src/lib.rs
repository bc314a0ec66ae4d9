//! The vocabulary of [justonce](https://docs.rs/justonce): the identity of one unit of work
//! and what happened to it. No database or network code lives here.
//!
//! - [`Key`]: a message id, or a purpose key such as `invoice:2026-10:cust_481`.
//! - [`Consumer`]: the explicit, stable name of a handler.
//! - [`Scope`]: an optional tenant namespace. The unique identity is (scope, consumer, key):
//!   an [`Identity`].
//! - [`Fingerprint`]: the SHA-256 of the payload, stored with the key so that a key reused
//!   for another payload is reported instead of silently merged.
//! - [`Retention`]: how long keys are kept, never shorter than the sender's retry horizon.
//! - [`Claim`] and [`Outcome`]: what a claim found, and what a run did.
//! - [`Leases`]: keys held for work outside the transaction, with fencing tokens.
//! - [`Offset`]: a stream position kept in the same transaction as the work.
//! - [`Destination`]: where the outbox relay sends rows, and what came of each
//!   [`Delivery`].
//! - [`TraceContext`]: the W3C trace context an outbox row carries to its destination, and
//!   [`trace`]'s hook that joins justonce's spans to the trace.
//!
//! Every value is validated when it is built, before anything touches a database:
//!
//! ```
//! use justonce_core::{Consumer, Error, Key};
//!
//! let key = Key::purpose(["invoice", "2026-10", "cust_481"])?;
//! assert_eq!(key.as_str(), "invoice:2026-10:cust_481");
//!
//! let err = Key::new("bad\nkey").unwrap_err();
//! assert!(matches!(err, Error::InvalidKey(_)));
//! assert!(Consumer::new("").is_err());
//! # Ok::<(), justonce_core::Error>(())
//! ```
//!
//! # Feature flags
//!
//! None: this crate is types and traits only. The databases, HTTP and the brokers are
//! features of [justonce](https://docs.rs/justonce).

#![cfg_attr(docsrs, feature(doc_cfg))]

mod destination;
mod error;
mod fingerprint;
mod identity;
mod lease;
mod offset;
mod outcome;
mod retention;
pub mod trace;

pub use destination::{Answer, Delivered, Delivery, Destination};
pub use error::{BoxError, Error, Invalid};
pub use fingerprint::Fingerprint;
pub use identity::{Consumer, DerivedKey, Identity, Key, Scope};
pub use lease::{Lease, LeaseClaim, LeaseFuture, Leases};
pub use offset::{Offset, OffsetCommit};
pub use outcome::{Claim, Outcome};
pub use retention::Retention;
pub use trace::{TraceContext, TracePropagator};

/// Builder setters that take a value and return `self`, one per field, with their docs.
/// For justonce's own option types.
#[doc(hidden)]
#[macro_export]
macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $type:ty),* $(,)?) => {$(
        $(#[$doc])*
        pub fn $name(mut self, $name: $type) -> Self {
            self.$name = $name;
            self
        }
    )*};
}
