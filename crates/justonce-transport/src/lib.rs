//! Broker consumers and publishers for [justonce](https://docs.rs/justonce).
//!
//! A broker delivers at least once. A consumer here claims each delivery's key in the same
//! database transaction as the work, commits, and only then acknowledges: a delivery that
//! arrives again (because the consumer died before its ack, or the sender published
//! twice) finds its key claimed, and is acknowledged without running the work.
//!
//! | feature | broker |
//! |---------|--------|
//! | `amqp`  | RabbitMQ (AMQP 0-9-1), through lapin: [`amqp::AmqpConsumer`] and [`amqp::AmqpDestination`] |
//!
//! What a consumer does with each delivery:
//!
//! | the work | the delivery |
//! |---|---|
//! | committed | acknowledged |
//! | the key was already processed (a duplicate) | acknowledged; the work did not run |
//! | the key was processed with another payload | acknowledged and counted; the work did not run |
//! | failed | published again with its attempt count and acknowledged, up to the attempt limit; then dead-lettered with the reason |
//! | no usable key | dead-lettered at once |
//! | the database failed | returned to the broker (nack with requeue), after a pause |
//!
//! Nothing is acknowledged before its transaction has committed.

#[cfg(feature = "amqp")]
pub mod amqp;

/// What a consumer did with the deliveries it took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// Work committed and acknowledged.
    pub processed: u64,
    /// Keys already processed: acknowledged without work.
    pub duplicates: u64,
    /// Keys already processed with another payload: acknowledged without work.
    pub key_reused: u64,
    /// Failed work sent back for another attempt.
    pub retried: u64,
    /// Deliveries moved to the dead-letter queue.
    pub dead_lettered: u64,
    /// Deliveries returned to the broker after a database failure.
    pub returned: u64,
}

/// Why a consumer or publisher stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The broker refused a setting or a declaration, or the URL is unusable.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The connection or channel to the broker failed. Deliveries not acknowledged are
    /// delivered again.
    #[error("broker: {0}")]
    Broker(#[source] justonce_core::BoxError),
}

impl Error {
    /// What kind of error this is.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Config(_) => ErrorKind::Config,
            Error::Broker(_) => ErrorKind::Broker,
        }
    }
}

/// The kind of an [`Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// See [`Error::Config`].
    Config,
    /// See [`Error::Broker`].
    Broker,
}
