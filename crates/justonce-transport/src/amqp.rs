//! RabbitMQ: a consumer that acknowledges only after the commit, and the relay's publisher.
//!
//! ```no_run
//! # async fn example(inbox: justonce_sql::Inbox<justonce_sql::sqlx::Postgres>) -> Result<(), justonce_transport::Error> {
//! use justonce_sql::sqlx;
//! use justonce_transport::amqp::{AmqpConsumer, AmqpOptions};
//!
//! let consumer = AmqpConsumer::connect(
//!     "amqp://guest:guest@127.0.0.1:5672/%2f",
//!     inbox,
//!     AmqpOptions::new("orders"),
//! )
//! .await?;
//! let stats = consumer
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
//! println!("{} processed, {} duplicates", stats.processed, stats.duplicates);
//! # Ok(())
//! # }
//! ```
//!
//! An `amqps://` URL connects over TLS, checked against the system's roots or the CA of
//! [`AmqpOptions::tls`].

use crate::tls::Tls;
use crate::{
    ATTEMPT_HEADER, ConsumerStats, Error, Incoming, KeyFrom, REASON_BYTES, REASON_HEADER, Ran,
    truncate,
};
use futures_util::StreamExt;
use justonce_core::trace::{TRACEPARENT, TRACESTATE};
use justonce_core::{Delivered, Delivery, Destination, Key, TraceContext};
use justonce_sql::{Backend, Inbox, Outcome, WorkFuture, sqlx};
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::tcp::{AsyncTcpStream, RustlsConnector};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

/// Settings of an [`AmqpConsumer`].
#[derive(Debug, Clone)]
pub struct AmqpOptions {
    queue: String,
    key_from: KeyFrom,
    prefetch: u16,
    max_attempts: u32,
    dead_letter_queue: String,
    declare: bool,
    store_pause: Duration,
    tls: Option<Tls>,
}

impl AmqpOptions {
    /// Consumes `queue`: the key is the `message_id`, 16 deliveries are prefetched, failed
    /// work gets 5 attempts before it goes to `<queue>.dead`, and both queues are declared
    /// durable if missing.
    pub fn new(queue: impl Into<String>) -> Self {
        let queue = queue.into();
        Self {
            dead_letter_queue: format!("{queue}.dead"),
            queue,
            key_from: KeyFrom::MessageId,
            prefetch: 16,
            max_attempts: 5,
            declare: true,
            store_pause: Duration::from_secs(1),
            tls: None,
        }
    }

    /// Where the key is.
    pub fn key_from(mut self, key_from: KeyFrom) -> Self {
        self.key_from = key_from;
        self
    }

    /// How many unacknowledged deliveries the broker sends ahead (at least 1).
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// How many times failed work is tried before it is dead-lettered (at least 1).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The queue dead letters go to.
    pub fn dead_letter_queue(mut self, queue: impl Into<String>) -> Self {
        self.dead_letter_queue = queue.into();
        self
    }

    /// Leaves the queues as they are instead of declaring them: for queues declared with
    /// arguments of their own (a quorum queue, say), which a plain declaration would
    /// contradict.
    pub fn existing_queues(mut self) -> Self {
        self.declare = false;
        self
    }

    /// How long to wait after the database failed before taking the next delivery.
    pub fn store_pause(mut self, pause: Duration) -> Self {
        self.store_pause = pause;
        self
    }

    /// How to check the broker's certificate and which client certificate to present;
    /// the URL must be `amqps://`.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }
}

/// A RabbitMQ consumer that runs each delivery's work once in effect.
pub struct AmqpConsumer<DB: Backend> {
    inbox: Inbox<DB>,
    connection: Connection,
    channel: Channel,
    options: AmqpOptions,
}

impl<DB: Backend> std::fmt::Debug for AmqpConsumer<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpConsumer")
            .field("inbox", &self.inbox)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> AmqpConsumer<DB> {
    /// Connects to `url` and prepares the channel: publisher confirms (for retries and dead
    /// letters), the prefetch, and the queues unless they are declared elsewhere.
    pub async fn connect(url: &str, inbox: Inbox<DB>, options: AmqpOptions) -> Result<Self, Error> {
        let connection = connect(url, options.tls.as_ref()).await?;
        let channel = open_channel(&connection).await?;
        channel
            .basic_qos(options.prefetch, BasicQosOptions::default())
            .await
            .map_err(broker)?;
        if options.declare {
            for queue in [&options.queue, &options.dead_letter_queue] {
                declare(&channel, queue).await?;
            }
        }
        Ok(Self {
            inbox,
            connection,
            channel,
            options,
        })
    }

    /// Takes deliveries until `shutdown` resolves or the broker cancels the consumer, runs
    /// `work` for each in a transaction with its key, and settles each only after.
    /// Deliveries taken but not settled at shutdown go back to the broker.
    pub async fn run<F, E>(&self, shutdown: impl Future, work: F) -> Result<ConsumerStats, Error>
    where
        F: for<'e, 't> Fn(&'t mut sqlx::Transaction<'e, DB>, &'t Incoming) -> WorkFuture<'t, (), E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        self.run_batched(shutdown, 1, work).await
    }

    /// Like [`AmqpConsumer::run`], with the deliveries that have arrived, up to
    /// `batch_size`, claimed with one statement and worked in one transaction, then
    /// acknowledged after its commit; a `batch_size` of 1 is [`AmqpConsumer::run`]. If
    /// any work in a batch fails, the batch rolls back and its deliveries are run one by
    /// one, so that one failing message neither loses nor doubles the others. Set a
    /// prefetch of at least `batch_size`.
    pub async fn run_batched<F, E>(
        &self,
        shutdown: impl Future,
        batch_size: usize,
        work: F,
    ) -> Result<ConsumerStats, Error>
    where
        F: for<'e, 't> Fn(&'t mut sqlx::Transaction<'e, DB>, &'t Incoming) -> WorkFuture<'t, (), E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        let mut deliveries = self.deliveries().await?;
        let mut stats = ConsumerStats::default();
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let next = tokio::select! {
                _ = &mut shutdown => break,
                next = deliveries.next() => next,
            };
            let Some(first) = next? else { break };
            if batch_size <= 1 {
                let ran = first.run(&self.inbox, &work).await;
                first.settle(ran, &mut stats).await?;
            } else {
                let batch = deliveries.more(first, batch_size).await?;
                self.settle_batch(batch, &work, &mut stats).await?;
            }
        }
        deliveries.stop().await?;
        Ok(stats)
    }

    /// Claims the keys of `batch` with one statement, runs the work of each first claim in
    /// one transaction, and settles every delivery after its commit; if any work fails,
    /// rolls back and runs and settles the deliveries one by one.
    pub async fn settle_batch<F, E>(
        &self,
        batch: Vec<Taken<'_, DB>>,
        work: &F,
        stats: &mut ConsumerStats,
    ) -> Result<(), Error>
    where
        F: for<'e, 't> Fn(&'t mut sqlx::Transaction<'e, DB>, &'t Incoming) -> WorkFuture<'t, (), E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        let (keyed, unkeyed): (Vec<_>, Vec<_>) =
            batch.into_iter().partition(|taken| taken.incoming.is_ok());
        let incoming: Vec<&Incoming> = keyed
            .iter()
            .filter_map(|taken| taken.incoming.as_ref().ok())
            .collect();
        let one_by_one = match crate::commit_batch(&self.inbox, &incoming, work).await {
            Ok(outcomes) => {
                for (taken, outcome) in keyed.into_iter().zip(outcomes) {
                    taken.settle(Ran::<E>::Outcome(outcome), stats).await?;
                }
                unkeyed
            }
            Err(error) => {
                tracing::debug!(%error, "a batch failed: running its deliveries one by one");
                keyed.into_iter().chain(unkeyed).collect()
            }
        };
        for taken in one_by_one {
            let ran = taken.run(&self.inbox, work).await;
            taken.settle(ran, stats).await?;
        }
        Ok(())
    }

    /// The deliveries one at a time, for callers that run and settle them themselves.
    pub async fn deliveries(&self) -> Result<Deliveries<'_, DB>, Error> {
        let tag = format!("justonce-{}", std::process::id());
        let consumer = self
            .channel
            .basic_consume(
                self.options.queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(broker)?;
        Ok(Deliveries {
            owner: self,
            consumer,
            tag,
        })
    }

    /// Closes the channel and the connection; deliveries not acknowledged go back to the
    /// broker.
    pub async fn close(self) -> Result<(), Error> {
        self.channel
            .close(200, "bye".into())
            .await
            .map_err(broker)?;
        self.connection
            .close(200, "bye".into())
            .await
            .map_err(broker)
    }
}

/// The stream of one consumer's deliveries.
pub struct Deliveries<'c, DB: Backend> {
    owner: &'c AmqpConsumer<DB>,
    consumer: lapin::Consumer,
    tag: String,
}

impl<'c, DB: Backend> Deliveries<'c, DB> {
    /// The next delivery, with its key read; `None` once the broker cancelled the consumer.
    pub async fn next(&mut self) -> Result<Option<Taken<'c, DB>>, Error> {
        let Some(delivery) = self.consumer.next().await else {
            return Ok(None);
        };
        let delivery = delivery.map_err(broker)?;
        let attempt = attempt_of(&delivery);
        let incoming = key_of(&self.owner.options.key_from, &delivery).map(|key| Incoming {
            key,
            body: delivery.data.clone(),
            attempt,
            redelivered: delivery.redelivered,
            content_type: (delivery.properties.content_type().as_ref())
                .map(|content_type| content_type.as_str().to_owned()),
            trace: trace_of(&delivery),
        });
        Ok(Some(Taken {
            owner: self.owner,
            attempt,
            incoming,
            delivery,
        }))
    }

    /// `first` and the deliveries that have arrived after it, up to `batch_size` in all;
    /// it does not wait for more.
    pub async fn more(
        &mut self,
        first: Taken<'c, DB>,
        batch_size: usize,
    ) -> Result<Vec<Taken<'c, DB>>, Error> {
        let mut batch = vec![first];
        while batch.len() < batch_size {
            match tokio::time::timeout(Duration::from_millis(1), self.next()).await {
                Ok(next) => match next? {
                    Some(taken) => batch.push(taken),
                    None => break,
                },
                Err(_) => break,
            }
        }
        Ok(batch)
    }

    /// Stops taking deliveries; those taken and not settled go back to the broker when the
    /// channel closes.
    pub async fn stop(self) -> Result<(), Error> {
        self.owner
            .channel
            .basic_cancel(self.tag.as_str().into(), BasicCancelOptions::default())
            .await
            .map_err(broker)
    }
}

/// One delivery, taken and not yet settled.
pub struct Taken<'c, DB: Backend> {
    owner: &'c AmqpConsumer<DB>,
    delivery: lapin::message::Delivery,
    attempt: u32,
    /// The delivery as the work sees it, or why it has no usable key.
    incoming: Result<Incoming, String>,
}

impl<DB: Backend> Taken<'_, DB> {
    /// The delivery's key, or why it has none.
    pub fn key(&self) -> Result<&Key, &str> {
        match &self.incoming {
            Ok(incoming) => Ok(&incoming.key),
            Err(reason) => Err(reason),
        }
    }

    /// Runs `work` in a transaction with the key claimed (see [`Inbox::run`]).
    pub async fn run<F, E>(&self, inbox: &Inbox<DB>, work: &F) -> Ran<E>
    where
        F: for<'e, 't> Fn(&'t mut sqlx::Transaction<'e, DB>, &'t Incoming) -> WorkFuture<'t, (), E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        let incoming = match &self.incoming {
            Ok(incoming) => incoming,
            Err(reason) => return Ran::NoKey(reason.clone()),
        };
        Ran::of(
            inbox
                .run(&incoming.key, &incoming.body, |tx| work(tx, incoming))
                .instrument(crate::consume_span(incoming))
                .await,
        )
    }

    /// Acknowledges, retries, dead-letters or returns the delivery as `ran` says, and
    /// counts it in `stats`.
    pub async fn settle<E: std::fmt::Display>(
        self,
        ran: Ran<E>,
        stats: &mut ConsumerStats,
    ) -> Result<(), Error> {
        let options = &self.owner.options;
        let key = self.key().map(Key::as_str).unwrap_or("");
        match ran {
            Ran::Outcome(Outcome::Processed(())) => stats.processed += 1,
            Ran::Outcome(Outcome::Duplicate) => stats.duplicates += 1,
            Ran::Outcome(Outcome::KeyReused { .. }) => {
                tracing::warn!(%key, "the same key with another payload: skipped");
                stats.key_reused += 1;
            }
            Ran::NoKey(reason) => {
                tracing::warn!(%reason, "a delivery without a usable key: dead-lettered");
                self.dead_letter(&reason).await?;
                stats.dead_lettered += 1;
            }
            Ran::Work(error) if self.attempt < options.max_attempts => {
                tracing::debug!(%key, attempt = self.attempt, %error, "work failed: retrying");
                self.publish_copy(&options.queue, self.attempt + 1, None)
                    .await?;
                stats.retried += 1;
            }
            Ran::Work(error) => {
                let reason = format!("attempt {}: {error}", self.attempt);
                tracing::warn!(%key, %reason, "work failed for the last time: dead-lettered");
                self.dead_letter(&reason).await?;
                stats.dead_lettered += 1;
            }
            Ran::Store(error) => {
                tracing::warn!(%key, %error, "database failed: the delivery goes back to the broker");
                let requeue = BasicNackOptions {
                    multiple: false,
                    requeue: true,
                };
                self.delivery.nack(requeue).await.map_err(broker)?;
                stats.returned += 1;
                tokio::time::sleep(options.store_pause).await;
                return Ok(());
            }
        }
        crate::count_consumed(&self.owner.inbox, "amqp", 1);
        self.delivery
            .ack(BasicAckOptions::default())
            .await
            .map(drop)
            .map_err(broker)
    }

    async fn dead_letter(&self, reason: &str) -> Result<(), Error> {
        let queue = &self.owner.options.dead_letter_queue;
        self.publish_copy(queue, self.attempt, Some(reason)).await
    }

    /// Publishes the delivery again, with its properties, to `queue` through the default
    /// exchange, and waits for the broker's confirm. The original is acknowledged after:
    /// if this process dies in between, both copies exist, and the key makes the second
    /// one a duplicate.
    async fn publish_copy(
        &self,
        queue: &str,
        attempt: u32,
        reason: Option<&str>,
    ) -> Result<(), Error> {
        let mut headers = self
            .delivery
            .properties
            .headers()
            .clone()
            .unwrap_or_default();
        headers.insert(
            ATTEMPT_HEADER.into(),
            AMQPValue::LongLongInt(attempt.into()),
        );
        if let Some(reason) = reason {
            let reason = truncate(reason, REASON_BYTES);
            headers.insert(REASON_HEADER.into(), AMQPValue::LongString(reason.into()));
        }
        let properties = self.delivery.properties.clone().with_headers(headers);
        publish(
            &self.owner.channel,
            "",
            queue,
            &self.delivery.data,
            properties,
        )
        .await
    }
}

/// The relay's destination for RabbitMQ: publishes each outbox row with its key as the
/// `message_id`, persistent, and marks it sent once the broker confirms it. A message no
/// queue takes is retried, so that a missing binding shows as a backlog rather than a loss.
pub struct AmqpDestination {
    url: String,
    exchange: String,
    routing_key: String,
    tls: Option<Tls>,
    /// The open channel, reopened after a failure.
    channel: tokio::sync::Mutex<Option<(Connection, Channel)>>,
}

impl std::fmt::Debug for AmqpDestination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpDestination")
            .field("exchange", &self.exchange)
            .field("routing_key", &self.routing_key)
            .finish_non_exhaustive()
    }
}

impl AmqpDestination {
    /// Publishes to `exchange` (`""` for the default exchange, which routes to the queue
    /// named by the routing key) with `routing_key`. Connects on the first delivery.
    pub fn new(url: &str, exchange: &str, routing_key: &str) -> Self {
        Self {
            url: url.to_owned(),
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
            tls: None,
            channel: tokio::sync::Mutex::new(None),
        }
    }

    /// Connects with these TLS settings; the URL must be `amqps://`.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }

    async fn send(&self, delivery: Delivery<'_>) -> Result<(), String> {
        let mut open = self.channel.lock().await;
        if open.is_none() {
            let connection = connect(&self.url, self.tls.as_ref())
                .await
                .map_err(|e| format!("connecting: {e}"))?;
            let channel = open_channel(&connection).await.map_err(|e| e.to_string())?;
            *open = Some((connection, channel));
        }
        let (_, channel) = open.as_ref().expect("opened above");
        let mut headers = FieldTable::default();
        let mut properties = BasicProperties::default()
            .with_message_id(ShortString::from(delivery.key))
            .with_delivery_mode(2);
        for (name, value) in delivery.headers {
            if name.eq_ignore_ascii_case("content-type") {
                properties = properties.with_content_type(value.as_str().into());
            } else {
                headers.insert(
                    name.as_str().into(),
                    AMQPValue::LongString(value.as_str().into()),
                );
            }
        }
        let properties = properties.with_headers(headers);
        let sent = publish(
            channel,
            &self.exchange,
            &self.routing_key,
            delivery.payload,
            properties,
        )
        .await;
        if let Err(error) = &sent {
            // The next delivery opens a new channel.
            tracing::debug!(%error, "publishing failed: reconnecting next time");
            *open = None;
        }
        sent.map_err(|e| e.to_string())
    }
}

impl Destination for AmqpDestination {
    fn deliver<'a>(
        &'a self,
        delivery: Delivery<'a>,
    ) -> Pin<Box<dyn Future<Output = Delivered> + Send + 'a>> {
        Box::pin(async move { crate::delivered(self.send(delivery).await) })
    }
}

/// Proves that the broker at `url` takes a consumer with `options`: opens a connection with
/// its TLS settings, whose AMQP handshake completes only once the broker has accepted the
/// credentials and the virtual host, and closes it. Declares and consumes nothing. Gives up
/// after [`PROBE_TIMEOUT`](crate::PROBE_TIMEOUT).
pub async fn probe(url: &str, options: &AmqpOptions) -> Result<(), Error> {
    crate::within_probe_timeout(async {
        let connection = connect(url, options.tls.as_ref()).await?;
        connection.close(200, "probed".into()).await.map_err(broker)
    })
    .await
}

/// Connects to `url`; an `amqps://` URL over TLS with `tls`, or the defaults.
async fn connect(url: &str, tls: Option<&Tls>) -> Result<Connection, Error> {
    let uri: AMQPUri = url
        .parse()
        .map_err(|e| Error::Config(format!("AMQP URL: {e}")))?;
    let properties = ConnectionProperties::default();
    if uri.scheme != AMQPScheme::AMQPS {
        if tls.is_some() {
            return Err(Error::Config(
                "TLS settings need an amqps:// URL".to_owned(),
            ));
        }
        return Connection::connect_uri(uri, properties)
            .await
            .map_err(broker);
    }
    // lapin's own TLS takes no verifier and adds a CA to the system's roots: the connection
    // is made here with the one rustls configuration every broker uses.
    let config = tls.cloned().unwrap_or_default().client_config()?;
    let connector = RustlsConnector::from(Arc::new(config));
    let runtime = lapin::runtime::default_runtime().map_err(broker)?;
    let open = async move |uri: AMQPUri, runtime| {
        let host = uri.authority.host.as_str();
        let addresses: Vec<std::net::SocketAddr> =
            tokio::net::lookup_host((host, uri.authority.port))
                .await?
                .collect();
        let stream = AsyncTcpStream::connect(&runtime, addresses).await?;
        Ok(stream.into_rustls(&connector, host).await?)
    };
    Connection::connector(uri, runtime, open, properties)
        .await
        .map_err(broker)
}

async fn open_channel(connection: &Connection) -> Result<Channel, Error> {
    let channel = connection.create_channel().await.map_err(broker)?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(broker)?;
    Ok(channel)
}

async fn declare(channel: &Channel, queue: &str) -> Result<(), Error> {
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), durable, FieldTable::default())
        .await
        .map(drop)
        .map_err(|e| Error::Config(format!("declaring queue {queue}: {e}")))
}

/// Publishes persistently with `mandatory`, and waits for the broker's confirm: a nack or
/// a returned (unroutable) message is an error.
async fn publish(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    payload: &[u8],
    properties: BasicProperties,
) -> Result<(), Error> {
    let mandatory = BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    };
    let confirm = channel
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            mandatory,
            payload,
            properties.with_delivery_mode(2),
        )
        .await
        .map_err(broker)?
        .await
        .map_err(broker)?;
    match confirm {
        lapin::Confirmation::Ack(None) => Ok(()),
        lapin::Confirmation::Ack(Some(_)) => Err(Error::Broker(
            format!(
                "no queue took the message (exchange {exchange:?}, routing key {routing_key:?})"
            )
            .into(),
        )),
        other => Err(Error::Broker(
            format!("the broker did not confirm the message: {other:?}").into(),
        )),
    }
}

fn attempt_of(delivery: &lapin::message::Delivery) -> u32 {
    let value = delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|headers| headers.inner().get(ATTEMPT_HEADER).cloned());
    match value {
        Some(AMQPValue::LongLongInt(n)) => u32::try_from(n).unwrap_or(1).max(1),
        _ => 1,
    }
}

/// The trace context among a delivery's headers.
fn trace_of(delivery: &lapin::message::Delivery) -> Option<TraceContext> {
    let headers = delivery.properties.headers().as_ref()?.inner();
    let text = |name: &str| match headers.get(name)? {
        AMQPValue::LongString(text) => std::str::from_utf8(text.as_bytes()).ok(),
        AMQPValue::ShortString(text) => Some(text.as_str()),
        _ => None,
    };
    TraceContext::parse(text(TRACEPARENT)?, text(TRACESTATE))
}

/// The key of a delivery, or why it has none.
fn key_of(key_from: &KeyFrom, delivery: &lapin::message::Delivery) -> Result<Key, String> {
    let text = match key_from {
        KeyFrom::MessageId => delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned())
            .ok_or("the message has no message_id")?,
        KeyFrom::Header(name) => {
            let value = delivery
                .properties
                .headers()
                .as_ref()
                .and_then(|headers| headers.inner().get(name.as_str()).cloned());
            match value {
                Some(AMQPValue::LongString(text)) => String::from_utf8(text.as_bytes().to_vec())
                    .map_err(|_| format!("header {name} is not UTF-8"))?,
                Some(AMQPValue::ShortString(text)) => text.as_str().to_owned(),
                Some(AMQPValue::LongLongInt(n)) => n.to_string(),
                Some(AMQPValue::LongInt(n)) => n.to_string(),
                _ => return Err(format!("the message has no text header {name}")),
            }
        }
        KeyFrom::Json(pointer) => crate::json_id(&delivery.data, pointer)?,
    };
    crate::message_key(text)
}

fn broker(error: lapin::Error) -> Error {
    crate::tls::broker_error(error)
}
