//! Broker consumers and publishers for [justonce](https://docs.rs/justonce): each delivery
//! takes effect once, and is acknowledged only after its work has committed.
//!
//! A broker delivers at least once. A consumer here claims each delivery's key in the same
//! database transaction as the work, commits, and only then acknowledges: a delivery that
//! arrives again (because the consumer died before its ack, or the sender published
//! twice) finds its key claimed, and is acknowledged without running the work.
//!
//! ```no_run
//! # #[cfg(feature = "amqp")]
//! # async fn example(inbox: justonce_sql::Inbox<justonce_sql::sqlx::Postgres>) -> Result<(), justonce_transport::Error> {
//! use justonce_sql::sqlx;
//! use justonce_transport::KeyFrom;
//! use justonce_transport::amqp::{AmqpConsumer, AmqpOptions};
//!
//! // The key is the order id in the body: a second publish of the order is a duplicate.
//! let options = AmqpOptions::new("orders").key_from(KeyFrom::Json("/order_id".into()));
//! let consumer = AmqpConsumer::connect("amqp://127.0.0.1:5672/%2f", inbox, options).await?;
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
//! # Feature flags
//!
//! No feature is on by default; each broker is one.
//!
//! | feature | broker |
//! |---------|--------|
//! | `amqp`  | RabbitMQ (AMQP 0-9-1), through lapin: [`amqp::AmqpConsumer`] and [`amqp::AmqpDestination`] |
//! | `nats`  | NATS JetStream, through async-nats: [`nats::NatsConsumer`], the single reader [`nats::NatsReader`] and [`nats::NatsDestination`] |
//! | `redis` | Redis Streams, through redis: [`redis_streams::RedisStreamConsumer`], the single reader [`redis_streams::RedisStreamReader`] and [`redis_streams::RedisStreamDestination`] |
//! | `mqtt`  | MQTT 5, through rumqttc: [`mqtt::MqttConsumer`] and [`mqtt::MqttDestination`] |
//! | `kafka` | Kafka, through rdkafka: the consumer-group member [`kafka::KafkaReader`] and [`kafka::KafkaDestination`] |
//! | `tls`   | on with any broker: [`tls::Tls`], the TLS settings every broker takes |
//!
//! Each consumer is the one generic [`Consumer`] over its broker's adapter ([`Broker`]):
//! `AmqpConsumer<DB>` is `Consumer<Amqp, DB>`. The adapter receives, reads and settles
//! deliveries; the consumer holds the policy every broker shares.
//!
//! # Settling
//!
//! What a consumer does with each delivery:
//!
//! | the work | the delivery |
//! |---|---|
//! | committed | acknowledged |
//! | the key was already processed (a duplicate) | acknowledged; the work did not run |
//! | the key was processed with another payload | acknowledged and counted; the work did not run |
//! | failed | redelivered with its attempt count, up to the attempt limit; then dead-lettered with the reason |
//! | no usable key | dead-lettered at once |
//! | the database failed | returned to the broker at once; the consumer then pauses |
//!
//! Nothing is acknowledged before its transaction has committed.
//!
//! A consumer or reader whose connection is lost connects again by itself, after a growing,
//! jittered wait (100 ms doubling to the options' `reconnect_max_wait`, 5 s by default),
//! each adapter with its own connection code ([`Broker::reconnect`],
//! [`OrderedBroker::reconnect`]). What it had not settled comes again from the broker and
//! is judged by its claimed key. `Consumer::link` follows the connection, for readiness
//! probes; `justonce_broker_reconnects_total` counts the reconnections.
//!
//! Each broker's module has a `probe` ([`amqp::probe`], [`nats::probe`],
//! [`redis_streams::probe`], [`mqtt::probe`], [`kafka::probe`]): it connects with a consumer's settings, proves
//! that the broker answers and accepts the credentials, and disconnects, without declaring,
//! subscribing or consuming anything, within [`PROBE_TIMEOUT`]. A deployment check calls it
//! before it starts consumers.
//!
//! A single reader ([`nats::NatsReader`], [`redis_streams::RedisStreamReader`]) acknowledges
//! nothing: it stores each entry's position as an offset in the same transaction as the work,
//! and starts after the stored offset. Each is the one generic [`Reader`] over its broker's
//! adapter ([`OrderedBroker`]): `NatsReader<DB>` is `Reader<NatsStream, DB>`. The Kafka
//! reader ([`kafka::KafkaReader`]) does the same for each partition the consumer group
//! assigns it.
//!
//! Every broker connects over TLS the same way: an `amqps://`, `rediss://` or `mqtts://` URL
//! (a NATS server that requires TLS, or any NATS URL given [`tls::Tls`] settings), checked
//! against the system's roots unless the options are given a [`tls::Tls`] with a CA.

#![cfg_attr(docsrs, feature(doc_cfg))]

/// `Debug` for a broker adapter: its options, never its connections.
macro_rules! debug_shows_options {
    ($adapter:ident) => {
        impl std::fmt::Debug for $adapter {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($adapter))
                    .field("options", &self.options)
                    .finish_non_exhaustive()
            }
        }
    };
}

/// Compiles the items given with any broker's feature: the parts every adapter shares.
macro_rules! with_any_broker {
    ($($item:item)*) => {$(
        #[cfg(any(
            feature = "amqp",
            feature = "kafka",
            feature = "mqtt",
            feature = "nats",
            feature = "redis"
        ))]
        $item
    )*};
}

#[cfg(feature = "amqp")]
#[cfg_attr(docsrs, doc(cfg(feature = "amqp")))]
pub mod amqp;
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub mod kafka;
#[cfg(feature = "mqtt")]
#[cfg_attr(docsrs, doc(cfg(feature = "mqtt")))]
pub mod mqtt;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats;
#[cfg(any(feature = "kafka", feature = "nats", feature = "redis"))]
mod reader;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis_streams;
#[cfg(feature = "tls")]
#[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
pub mod tls;

with_any_broker! {
    mod consumer;
    mod destination;
    mod reconnect;
    pub use consumer::{
        BatchWork, Broker, Consumer, Deliveries, Policy, Receive, Received, Settle, Work,
    };
    pub use reconnect::Link;
}
use justonce_core::{Key, Scope, TraceContext};
use justonce_sql::Outcome;
#[cfg(any(feature = "kafka", feature = "nats", feature = "redis"))]
pub use reader::{OrderedBroker, Position, Reader, ReaderDeliveries, StoredOffsets};
use std::collections::BTreeSet;

/// How long a broker's `probe` (such as [`amqp::probe`]) waits for the broker before it
/// gives up: a broker that does not answer is as unusable as one that refuses.
pub const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

with_any_broker! {
    /// `probe` within [`PROBE_TIMEOUT`].
    pub(crate) async fn within_probe_timeout(
        probe: impl std::future::Future<Output = Result<(), Error>>,
    ) -> Result<(), Error> {
        tokio::time::timeout(PROBE_TIMEOUT, probe)
            .await
            .unwrap_or_else(|_| {
                Err(Error::Broker(
                    format!("no answer within {} s", PROBE_TIMEOUT.as_secs()).into(),
                ))
            })
    }
}

/// The broker refused the URL's login, or what its user may do: a setting to fix, not a
/// broker that is down. `serve` and `check` stop with it at start.
#[cfg(any(
    feature = "amqp",
    feature = "mqtt",
    feature = "nats",
    feature = "redis"
))]
pub(crate) fn refused_access(reason: impl std::fmt::Display) -> Error {
    Error::Config(format!(
        "the broker refused access ({reason}): check the user and the password in the URL, \
         and what the user may do"
    ))
}

/// Locks `mutex`. A panic elsewhere while it was held leaves the value whole: it is used.
#[cfg(any(
    feature = "amqp",
    feature = "kafka",
    feature = "mqtt",
    feature = "nats",
    feature = "redis"
))]
pub(crate) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The header that counts a message's attempts: absent on the first.
pub const ATTEMPT_HEADER: &str = "x-justonce-attempt";
/// The header a dead letter carries: why it was given up.
pub const REASON_HEADER: &str = "x-justonce-reason";

/// How long a reason in [`REASON_HEADER`] may be, in bytes.
pub(crate) const REASON_BYTES: usize = 1024;

/// Where a delivery's key is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyFrom {
    /// The broker's message id: AMQP's `message_id` property, NATS's `Nats-Msg-Id` header.
    MessageId,
    /// A header, as text.
    Header(String),
    /// A JSON pointer into the body, such as `/id`: a string or a number.
    Json(String),
}

/// Where each message names its tenant, and the tenants a consumer takes: each message is
/// claimed in its tenant's scope. A message that names no tenant, a blank one or one not
/// taken is dead-lettered at once, since no later attempt can make it better.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenants {
    from: KeyFrom,
    allowed: BTreeSet<String>,
}

impl Tenants {
    /// Each message names its tenant at `from`, a header or a JSON pointer, one of
    /// `allowed` (at least one). A tenant becomes a part of keys, so it may not hold ':'.
    pub fn new<I, T>(from: KeyFrom, allowed: I) -> Result<Self, Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        if from == KeyFrom::MessageId {
            return Err(Error::Config(
                "a message names its tenant in a header or at a JSON pointer".to_owned(),
            ));
        }
        let allowed: BTreeSet<String> = allowed.into_iter().map(Into::into).collect();
        if allowed.is_empty() {
            return Err(Error::Config(
                "a tenant named by the message needs a list of the tenants taken".to_owned(),
            ));
        }
        for tenant in &allowed {
            if tenant.contains(Key::SEPARATOR) {
                return Err(Error::Config(format!(
                    "tenant {tenant:?} may not contain ':'"
                )));
            }
            Scope::new(tenant.as_str())
                .map_err(|error| Error::Config(format!("tenant {tenant:?}: {error}")))?;
        }
        Ok(Self { from, allowed })
    }

    /// Where each message names its tenant.
    pub fn from(&self) -> &KeyFrom {
        &self.from
    }

    /// The tenants taken.
    pub fn allowed(&self) -> &BTreeSet<String> {
        &self.allowed
    }
}

/// One delivery as the work sees it.
#[derive(Debug)]
#[non_exhaustive]
pub struct Incoming {
    /// The key claimed for it.
    pub key: Key,
    /// The tenant scope the key is claimed in: the one the message names when the
    /// consumer takes [`Tenants`], else its inbox's.
    pub scope: Scope,
    /// The message body.
    pub body: Vec<u8>,
    /// Which attempt this is, from 1.
    pub attempt: u32,
    /// Whether it may be a re-run ([`Received::redelivered`]): the broker delivered it
    /// before without an ack, or it is a later attempt published again (RabbitMQ, MQTT).
    /// A reader sets it on each retry in place.
    pub redelivered: bool,
    /// The content type: AMQP's `content_type` property, a `Content-Type` header on NATS.
    pub content_type: Option<String>,
    /// The W3C trace context the message carries, if well formed: its `traceparent` and
    /// `tracestate` headers on AMQP and NATS, stream fields on Redis, user properties on
    /// MQTT 5.
    pub trace: Option<TraceContext>,
}

with_any_broker! {
    /// The span of one message's claim and work: a child of the trace context the message
    /// carries, when a [`justonce_core::trace::TracePropagator`] is installed.
    fn consume_span(incoming: &Incoming) -> tracing::Span {
        let span = tracing::debug_span!(
            "justonce.consume",
            otel.kind = "consumer",
            key = %incoming.key,
        );
        if let Some(trace) = &incoming.trace {
            justonce_core::trace::set_parent(&span, trace);
        }
        span
    }
}

/// Describes the metrics this crate emits, for the `# HELP` lines of an exporter. Call it
/// once, after installing the metrics recorder.
pub fn describe_metrics() {
    metrics::describe_counter!(
        CONSUMED,
        "Messages consumed from a broker and settled, by consumer and broker"
    );
    metrics::describe_counter!(
        REJECTED_TENANT,
        "Messages dead-lettered for naming no tenant, a blank one or one not taken, by \
         consumer and broker"
    );
    metrics::describe_counter!(
        "justonce_broker_reconnects_total",
        "Times a consumer connected again after losing its broker, by consumer and broker"
    );
}

with_any_broker! {
    /// Counts `messages` consumed by the consumer of `inbox` from `broker`.
    pub(crate) fn count_consumed<DB: justonce_sql::Backend>(
        inbox: &justonce_sql::Inbox<DB>,
        broker: &'static str,
        messages: u64,
    ) {
        metrics::counter!(
            CONSUMED,
            "consumer" => inbox.consumer().as_str().to_owned(),
            "broker" => broker
        )
        .increment(messages);
    }
}

const CONSUMED: &str = "justonce_deliveries_consumed_total";
const REJECTED_TENANT: &str = "justonce_deliveries_rejected_tenant_total";

with_any_broker! {
    /// Counts a message of the consumer of `inbox` refused for its tenant.
    pub(crate) fn count_rejected_tenant<DB: justonce_sql::Backend>(
        inbox: &justonce_sql::Inbox<DB>,
        broker: &'static str,
    ) {
        metrics::counter!(
            REJECTED_TENANT,
            "consumer" => inbox.consumer().as_str().to_owned(),
            "broker" => broker
        )
        .increment(1);
    }
}

/// What running a delivery's work came to, for its settling.
#[derive(Debug)]
#[non_exhaustive]
pub enum Ran<E> {
    /// The work's outcome: processed, duplicate or key reused.
    Outcome(Outcome<()>),
    /// The delivery has no usable key.
    NoKey(String),
    /// The delivery names no tenant, a blank one or one the consumer does not take
    /// ([`Tenants`]): dead-lettered at once with this reason.
    NoTenant(String),
    /// The work failed.
    Work(E),
    /// The work panicked, with this message: a failed attempt, retried and dead-lettered
    /// as [`Ran::Work`] is.
    Panicked(String),
    /// Not run: the runs of its key already started, counted in the database for each
    /// delivery that may be a re-run ([`Received::redelivered`]), passed the attempts
    /// allowed. Its work failed, or was lost with a consumer that died under it, each time.
    /// A first run is not counted, so it may have run once more. Dead-lettered on
    /// `attempt` with `reason`.
    Spent {
        /// The attempt it would have been, by the count or the broker's, whichever is
        /// higher: one more if its first run was not counted and the broker did not count it.
        attempt: u32,
        /// Why, for the dead letter's reason header.
        reason: String,
    },
    /// The database failed; nothing was committed unless it says the commit is unknown.
    Store(justonce_core::Error),
}

with_any_broker! {
    impl<E> Ran<E> {
        /// What [`Inbox::run`](justonce_sql::Inbox::run) returned, as a delivery's settling
        /// needs it.
        pub(crate) fn of(
            run: Result<Outcome<()>, justonce_sql::RunError<consumer::Failed<E>>>,
        ) -> Self {
            match run {
                Ok(outcome) => Ran::Outcome(outcome),
                Err(justonce_sql::RunError::Work(failed)) => failed.ran(),
                Err(justonce_sql::RunError::Store(error)) => Ran::Store(error),
                Err(error) => Ran::Store(justonce_core::Error::Config(format!(
                    "the run failed in a way this consumer does not know: {error}"
                ))),
            }
        }
    }
}

with_any_broker! {
    /// The key of a delivery from the id it carries. A blank id is refused, not kept as a key
    /// of spaces: every message with a blank id would share it, and all but the first would be
    /// skipped as duplicates.
    pub(crate) fn message_key(text: String) -> Result<Key, String> {
        if !text.is_empty() && text.trim().is_empty() {
            return Err("the message id is blank".to_owned());
        }
        Key::new(text).map_err(|e| e.to_string())
    }
}

/// At most `bytes` bytes of `text`, cut at a character boundary.
pub(crate) fn truncate(text: &str, bytes: usize) -> &str {
    let mut end = text.len().min(bytes);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

with_any_broker! {
    /// The id at a JSON pointer in `body`: a string or a number.
    pub(crate) fn json_id(body: &[u8], pointer: &str) -> Result<String, String> {
        // serde_json refuses nesting deeper than 128 levels.
        let body: serde_json::Value =
            serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
        match body.pointer(pointer) {
            Some(serde_json::Value::String(id)) => Ok(id.clone()),
            Some(serde_json::Value::Number(id)) => Ok(id.to_string()),
            _ => Err(format!("the body has no string or number at {pointer}")),
        }
    }
}

/// The inbox that claims in `scope`: `inbox` itself, or the same store and consumer in the
/// tenant's scope a message names. Offsets are the consumer's, in any scope.
pub(crate) fn inbox_in<'a, DB: justonce_sql::Backend>(
    inbox: &'a justonce_sql::Inbox<DB>,
    scope: &Scope,
) -> std::borrow::Cow<'a, justonce_sql::Inbox<DB>> {
    if scope == inbox.scope() {
        std::borrow::Cow::Borrowed(inbox)
    } else {
        std::borrow::Cow::Owned(inbox.with_scope(scope.clone()))
    }
}

/// Forgets the count of runs of a message that left the consumer as a dead letter, so that
/// a replay of it is not given up for its past runs. Only after the dead letter is
/// settled: a consumer that dies before then takes the message back with its count, and
/// gives it up again. A database failure, or no answer within [`FORGET_WAIT`], leaves the
/// count, logged: the wait holds up the settling of the batches after it.
pub(crate) async fn forget_runs<DB: justonce_sql::Backend>(
    inbox: &justonce_sql::Inbox<DB>,
    incoming: &Incoming,
    log_id: &str,
) {
    let inbox = inbox_in(inbox, &incoming.scope);
    let forgot = tokio::time::timeout(FORGET_WAIT, inbox.forget_runs(&incoming.key)).await;
    let failed = match forgot {
        Ok(Ok(_)) => return,
        Ok(Err(error)) => error.to_string(),
        Err(_) => format!("no answer within {FORGET_WAIT:?}"),
    };
    tracing::warn!(
        error = failed,
        delivery = log_id,
        key = incoming.key.as_str(),
        "database failed: the dead letter's count of runs stays until the purge"
    );
}

/// How long forgetting a dead letter's count of runs may take.
const FORGET_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// What a consumer did with the deliveries it took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// Work committed. Counted at the commit: an acknowledgement that then fails leaves
    /// the delivery to come again, as a duplicate.
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

impl std::ops::AddAssign for ConsumerStats {
    fn add_assign(&mut self, more: Self) {
        // Named in full, so that a new count cannot be left out.
        let Self {
            processed,
            duplicates,
            key_reused,
            retried,
            dead_lettered,
            returned,
        } = more;
        self.processed += processed;
        self.duplicates += duplicates;
        self.key_reused += key_reused;
        self.retried += retried;
        self.dead_lettered += dead_lettered;
        self.returned += returned;
    }
}

/// Why a consumer or publisher stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The broker refused a setting, a declaration or the login, or the URL is unusable.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The connection or channel to the broker failed. Deliveries not acknowledged are
    /// delivered again.
    #[error("broker: {0}")]
    Broker(#[source] justonce_core::BoxError),
    /// The database failed where a reader loads or stores its position.
    #[error("database: {0}")]
    Store(#[source] justonce_core::Error),
    /// The TLS handshake with the broker failed: a certificate was refused, or the port
    /// does not speak TLS. Connecting again fails the same way until a setting changes.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    #[error("TLS: {0}")]
    Tls(#[source] tls::TlsError),
}
