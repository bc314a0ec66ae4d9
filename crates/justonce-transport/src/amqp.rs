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

use crate::consumer::{Broker, Receive, Received, Settle, policy_setters};
use crate::destination::{Publish, Reopening, destination};
use crate::tls::Tls;
use crate::{ATTEMPT_HEADER, Error, Policy, REASON_BYTES, REASON_HEADER, truncate};
use futures_util::{FutureExt, StreamExt};
use justonce_core::Delivery;
use justonce_sql::{Backend, Inbox};
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::tcp::{AsyncTcpStream, RustlsConnector};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// Settings of an [`AmqpConsumer`].
#[derive(Debug, Clone)]
pub struct AmqpOptions {
    queue: String,
    policy: Policy,
    prefetch: u16,
    dead_letter_queue: String,
    declare: bool,
    queue_type: QueueType,
    delivery_limit: Option<u32>,
    tls: Option<Tls>,
}

/// How RabbitMQ keeps the queues it declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum QueueType {
    /// A classic queue, on one node.
    #[default]
    Classic,
    /// A quorum queue, replicated on a majority of the cluster's nodes by Raft. The broker
    /// counts each delivery lost with its consumer (`x-delivery-count`), and the consumer
    /// counts those as attempts. What the consumer gives back (while its database is down,
    /// or as it stops) is published again at the same attempt, so it is not counted. What
    /// passes the broker's own delivery limit goes to the dead-letter queue.
    Quorum,
}

/// Set by a quorum queue on a delivery it gave before: how many times it was given back
/// or lost with its consumer.
const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

impl AmqpOptions {
    /// Consumes `queue`: the key is the `message_id`, 16 deliveries are prefetched, failed
    /// work gets 5 attempts before it goes to `<queue>.dead`, and both queues are declared
    /// durable if missing.
    pub fn new(queue: impl Into<String>) -> Self {
        let queue = queue.into();
        Self {
            dead_letter_queue: format!("{queue}.dead"),
            queue,
            policy: Policy::default(),
            prefetch: 16,
            declare: true,
            queue_type: QueueType::Classic,
            delivery_limit: None,
            tls: None,
        }
    }

    policy_setters!(
        /// Where the key is: [`KeyFrom::MessageId`](crate::KeyFrom::MessageId) is the
        /// `message_id` property.
    );

    /// How many unacknowledged deliveries the broker sends ahead (at least 1). With
    /// batches, twice the batch size: the next batch is gathered while one commits.
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// The queue dead letters go to.
    pub fn dead_letter_queue(mut self, queue: impl Into<String>) -> Self {
        self.dead_letter_queue = queue.into();
        self
    }

    /// Declares the queue and its dead-letter queue as `queue_type` (classic by default).
    /// A queue that exists already must be of that type: RabbitMQ refuses the declaration
    /// otherwise, and the consumer stops with a configuration error.
    pub fn queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// Declares a quorum queue with the broker's own delivery limit (`x-delivery-limit`): a
    /// message delivered more than `limit` times without an acknowledgement goes to the
    /// dead-letter queue, by the broker, even if no consumer of justonce sees it again. The
    /// consumer's own count ([`Inbox::record_run`](justonce_sql::Inbox::record_run)) stops a
    /// message that kills its process first, when `max_attempts` is below `limit`. A classic
    /// queue has no such limit: it is not declared there.
    pub fn delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = Some(limit);
        self
    }

    /// Leaves the queues as they are instead of declaring them: for queues declared with
    /// arguments of their own, which a plain declaration would contradict.
    pub fn existing_queues(mut self) -> Self {
        self.declare = false;
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
pub type AmqpConsumer<DB> = crate::Consumer<Amqp, DB>;

/// The RabbitMQ adapter of [`AmqpConsumer`]: a channel with publisher confirms (for
/// retries and dead letters) and the prefetch.
pub struct Amqp {
    url: String,
    /// The connection, its channel and the channel's deliveries not settled, replaced
    /// together when the consumer connects again.
    open: std::sync::Mutex<Open>,
    options: AmqpOptions,
}

debug_shows_options!(Amqp);

impl<DB: Backend> AmqpConsumer<DB> {
    /// Connects to `url` and prepares the channel: publisher confirms (for retries and dead
    /// letters), the prefetch, and the queues unless they are declared elsewhere.
    pub async fn connect(url: &str, inbox: Inbox<DB>, options: AmqpOptions) -> Result<Self, Error> {
        let open = open(url, &options).await?;
        let amqp = Amqp {
            url: url.to_owned(),
            open: std::sync::Mutex::new(open),
            options,
        };
        Ok(Self::new(amqp, inbox))
    }
}

/// A consumer's connection, its channel, and the channel's deliveries not settled.
type Open = (Arc<Connection>, Channel, Arc<Unsettled>);

/// Connects to `url` and prepares a consumer's channel: publisher confirms, the prefetch,
/// and the queues unless they are declared elsewhere.
async fn open(url: &str, options: &AmqpOptions) -> Result<Open, Error> {
    let connection = connect(url, options.tls.as_ref()).await?;
    let channel = open_channel(&connection).await?;
    channel
        .basic_qos(options.prefetch, BasicQosOptions::default())
        .await
        .map_err(broker)?;
    if options.declare {
        let dead = &options.dead_letter_queue;
        let queue = Declared {
            name: &options.queue,
            queue_type: options.queue_type,
            dead_letters: Some(dead),
            delivery_limit: options.delivery_limit,
        };
        declare(&connection, &channel, queue).await?;
        let dead = Declared {
            name: dead,
            queue_type: options.queue_type,
            dead_letters: None,
            delivery_limit: None,
        };
        declare(&connection, &channel, dead).await?;
    }
    Ok((Arc::new(connection), channel, Arc::default()))
}

/// The deliveries of one `basic.consume`.
pub struct AmqpReceiver {
    channel: Channel,
    unsettled: Arc<Unsettled>,
    consumer: lapin::Consumer,
    tag: String,
}

impl Receive for AmqpReceiver {
    type Delivery = AmqpDelivery;

    /// An end of the deliveries on a channel that closed is a lost connection, not the
    /// broker ending the consumer.
    async fn next(&mut self) -> Result<Option<Self::Delivery>, Error> {
        let next = while_open(&self.channel, self.consumer.next().map(Option::transpose)).await?;
        if next.is_none() && !self.channel.status().connected() {
            return Err(channel_closed());
        }
        Ok(next.map(|delivery| {
            crate::lock(&self.unsettled.tags).insert(delivery.delivery_tag);
            AmqpDelivery {
                delivery,
                unsettled: Arc::clone(&self.unsettled),
            }
        }))
    }

    async fn stop(self) -> Result<(), Error> {
        let cancel = self
            .channel
            .basic_cancel(self.tag.as_str().into(), BasicCancelOptions::default());
        while_open(&self.channel, cancel).await
    }
}

/// A delivery of the consumer's channel. It derefs to lapin's delivery: its body, its
/// properties, its tag. Settle it through the consumer (`settle`, `settle_batch`): one
/// acknowledged through lapin directly stays unsettled to the consumer, and the later
/// batches of its channel go back to an acknowledgement per delivery.
pub struct AmqpDelivery {
    delivery: lapin::message::Delivery,
    /// Its channel's deliveries not settled yet.
    unsettled: Arc<Unsettled>,
}

impl std::ops::Deref for AmqpDelivery {
    type Target = lapin::message::Delivery;

    fn deref(&self) -> &lapin::message::Delivery {
        &self.delivery
    }
}

impl std::fmt::Debug for AmqpDelivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.delivery.fmt(f)
    }
}

/// The tags of a channel's deliveries handed to the consumer and not yet settled. A tag
/// leaves only once its settlement is written, so that one `multiple` acknowledgement never
/// covers a delivery with another settlement on its way.
#[derive(Default)]
struct Unsettled {
    tags: std::sync::Mutex<std::collections::BTreeSet<u64>>,
}

impl Unsettled {
    /// The delivery whose `multiple` acknowledgement settles exactly `deliveries`: all
    /// from this channel, and no other delivery of it unsettled below the highest tag.
    fn one_ack_for<'d>(
        self: &Arc<Self>,
        deliveries: &[&'d AmqpDelivery],
    ) -> Option<&'d AmqpDelivery> {
        if !(deliveries.iter()).all(|delivery| Arc::ptr_eq(&delivery.unsettled, self)) {
            return None;
        }
        let tags: Vec<u64> = deliveries
            .iter()
            .map(|delivery| delivery.delivery_tag)
            .collect();
        let last = one_ack_tag(&crate::lock(&self.tags), &tags)?;
        deliveries
            .iter()
            .find(|delivery| delivery.delivery_tag == last)
            .copied()
    }

    fn settled(&self, deliveries: &[&AmqpDelivery]) {
        let mut tags = crate::lock(&self.tags);
        for delivery in deliveries {
            tags.remove(&delivery.delivery_tag);
        }
    }
}

/// The tag whose `multiple` acknowledgement settles exactly `batch`, two deliveries or
/// more of a channel whose unsettled tags are `unsettled`: every one of them unsettled, and
/// no other unsettled below the highest.
fn one_ack_tag(unsettled: &std::collections::BTreeSet<u64>, batch: &[u64]) -> Option<u64> {
    let last = *batch.iter().max()?;
    let below = unsettled.range(..=last).count();
    let all_unsettled = batch.iter().all(|tag| unsettled.contains(tag));
    (batch.len() >= 2 && below == batch.len() && all_unsettled).then_some(last)
}

impl Received for AmqpDelivery {
    fn message_id(&self) -> Result<String, String> {
        self.properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned())
            .ok_or_else(|| "the message has no message_id".to_owned())
    }

    fn header(&self, name: &str) -> Option<String> {
        let headers = self.properties.headers().as_ref()?.inner();
        match headers.get(name)? {
            AMQPValue::LongString(text) => String::from_utf8(text.as_bytes().to_vec()).ok(),
            AMQPValue::ShortString(text) => Some(text.as_str().to_owned()),
            AMQPValue::LongLongInt(n) => Some(n.to_string()),
            AMQPValue::LongInt(n) => Some(n.to_string()),
            _ => None,
        }
    }

    fn no_header(&self, name: &str) -> String {
        let headers = self.properties.headers().as_ref().map(FieldTable::inner);
        match headers.and_then(|headers| headers.get(name)) {
            Some(AMQPValue::LongString(_)) => format!("header {name} is not UTF-8"),
            _ => format!("the message has no text header {name}"),
        }
    }

    fn log_id(&self) -> String {
        format!("delivery tag {}", self.delivery_tag)
    }

    fn body(&self) -> Vec<u8> {
        self.data.clone()
    }

    fn content_type(&self) -> Option<String> {
        (self.properties.content_type().as_ref())
            .map(|content_type| content_type.as_str().to_owned())
    }

    /// The attempts counted by the consumer's own header (each failed run publishes the
    /// next), plus those a quorum queue counted: deliveries given back, or lost when their
    /// consumer died before it settled them.
    fn attempt(&self) -> u32 {
        let counted = |name| self.header(name).and_then(|n| n.parse::<u32>().ok());
        let failed_runs = counted(ATTEMPT_HEADER).unwrap_or(1).max(1);
        failed_runs.saturating_add(counted(DELIVERY_COUNT_HEADER).unwrap_or(0))
    }

    /// The broker's `redelivered` flag, or an attempt the consumer published again after
    /// a failed run.
    fn redelivered(&self) -> bool {
        self.redelivered || self.attempt() > 1
    }
}

impl Broker for Amqp {
    type Delivery = AmqpDelivery;
    type Receiver<'b> = AmqpReceiver;
    const NAME: &'static str = "amqp";

    fn policy(&self) -> &Policy {
        &self.options.policy
    }

    /// Waits at most 5 s for each goodbye: a close marks the channel closing at once, so
    /// the watch of the other calls, which fail once it is not open, cannot be used.
    async fn close(&self) -> Result<(), Error> {
        let (connection, channel, _) = self.open();
        within_goodbye_wait(channel.close(200, "bye".into())).await?;
        within_goodbye_wait(connection.close(200, "bye".into())).await
    }

    async fn receive(&self) -> Result<AmqpReceiver, Error> {
        let (_, channel, unsettled) = self.open();
        let tag = format!("justonce-{}", std::process::id());
        let consume = channel.basic_consume(
            self.options.queue.as_str().into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        );
        let consumer = while_open(&channel, consume).await?;
        Ok(AmqpReceiver {
            channel,
            unsettled,
            consumer,
            tag,
        })
    }

    /// A new connection and channel, prepared as at connect. The one lost is dropped.
    async fn reconnect(&self) -> Result<(), Error> {
        let open = open(&self.url, &self.options).await?;
        *crate::lock(&self.open) = open;
        Ok(())
    }

    /// A retry or a dead letter is a copy published, confirmed, then the original
    /// acknowledged: if this process dies in between, both copies exist, and the key makes
    /// the second one a duplicate. Given back is a requeueing nack.
    async fn settle(&self, delivery: &Self::Delivery, settle: Settle) -> Result<(), Error> {
        let options = &self.options;
        let (_, channel, _) = self.open();
        match settle {
            Settle::Ack => {}
            Settle::Retry { attempt } => {
                self.publish_copy(&channel, delivery, &options.queue, attempt + 1, None)
                    .await?;
            }
            Settle::DeadLetter { attempt, reason } => {
                let queue = &options.dead_letter_queue;
                self.publish_copy(&channel, delivery, queue, attempt, Some(&reason))
                    .await?;
            }
            // A quorum queue would count a requeue as a delivery failed: a database outage
            // would use up the message's attempts. A copy at the same attempt is not counted.
            Settle::GiveBack if options.queue_type == QueueType::Quorum => {
                let attempt = delivery.attempt();
                self.publish_copy(&channel, delivery, &options.queue, attempt, None)
                    .await?;
            }
            Settle::GiveBack => {
                let requeue = BasicNackOptions {
                    multiple: false,
                    requeue: true,
                };
                taken(while_open(&channel, delivery.nack(requeue)).await?)?;
                delivery.unsettled.settled(&[delivery]);
                return Ok(());
            }
        }
        taken(while_open(&channel, delivery.ack(BasicAckOptions::default())).await?)?;
        delivery.unsettled.settled(&[delivery]);
        Ok(())
    }

    /// A batch that holds every delivery of its channel not settled up to its highest tag
    /// is acknowledged with one `multiple` acknowledgement of that tag: one frame for the
    /// batch. Otherwise (a delivery below it is still being worked on, or its settlement
    /// is on its way) each has its own `basic.ack`, so no delivery outside the batch is
    /// acknowledged: these are handed to the connection all at once, then awaited
    /// together. Each one taken is counted, whichever failed; the first failure is
    /// returned. Those still pending when the channel closes are not counted: the broker
    /// delivers them again.
    async fn ack_all(&self, deliveries: &[&Self::Delivery], acked: &mut u64) -> Result<(), Error> {
        let (_, channel, unsettled) = self.open();
        if let Some(last) = unsettled.one_ack_for(deliveries) {
            let all_up_to_last = BasicAckOptions { multiple: true };
            taken(while_open(&channel, last.ack(all_up_to_last)).await?)?;
            unsettled.settled(deliveries);
            *acked += deliveries.len() as u64;
            return Ok(());
        }
        let mut acks: futures_util::stream::FuturesOrdered<_> = deliveries
            .iter()
            .map(|&delivery| {
                delivery
                    .ack(BasicAckOptions::default())
                    .map(move |done| (delivery, done))
            })
            .collect();
        let mut failed = None;
        let all = async {
            while let Some((delivery, done)) = acks.next().await {
                match done.map_err(broker).and_then(taken) {
                    Ok(()) => {
                        delivery.unsettled.settled(&[delivery]);
                        *acked += 1;
                    }
                    Err(error) if failed.is_none() => failed = Some(error),
                    Err(_) => {}
                }
            }
            Ok::<(), lapin::Error>(())
        };
        while_open(&channel, all).await?;
        failed.map_or(Ok(()), Err)
    }
}

impl Amqp {
    /// The connection and channel in use, with the channel's deliveries not settled.
    fn open(&self) -> Open {
        let open = crate::lock(&self.open);
        (Arc::clone(&open.0), open.1.clone(), Arc::clone(&open.2))
    }

    /// Publishes the delivery again, with its properties, to `queue` through the default
    /// exchange, and waits for the broker's confirm.
    async fn publish_copy(
        &self,
        channel: &Channel,
        delivery: &AmqpDelivery,
        queue: &str,
        attempt: u32,
        reason: Option<&str>,
    ) -> Result<(), Error> {
        let original = delivery.properties.headers().clone().unwrap_or_default();
        // The copy is a new message to the broker: its count of this one's returns is
        // carried in the attempt instead.
        let mut headers = FieldTable::from(
            original
                .inner()
                .iter()
                .filter(|(name, _)| name.as_str() != DELIVERY_COUNT_HEADER)
                .map(|(name, value)| (name.clone(), value.clone()))
                .collect::<std::collections::BTreeMap<_, _>>(),
        );
        headers.insert(
            ATTEMPT_HEADER.into(),
            AMQPValue::LongLongInt(attempt.into()),
        );
        if let Some(reason) = reason {
            let reason = truncate(reason, REASON_BYTES);
            headers.insert(REASON_HEADER.into(), AMQPValue::LongString(reason.into()));
        }
        let properties = delivery.properties.clone().with_headers(headers);
        publish(channel, "", queue, &delivery.data, properties).await
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
    /// The channel, with the connection it lives on.
    channel: Reopening<(Connection, Channel)>,
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
            channel: Reopening::default(),
        }
    }

    /// Connects with these TLS settings; the URL must be `amqps://`.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }
}

impl Publish for AmqpDestination {
    type Connection = (Connection, Channel);

    async fn open(&self) -> Result<(Connection, Channel), Error> {
        let connection = connect(&self.url, self.tls.as_ref()).await?;
        let channel = open_channel(&connection).await?;
        Ok((connection, channel))
    }

    async fn publish(
        &self,
        (_, channel): &(Connection, Channel),
        delivery: Delivery<'_>,
    ) -> Result<(), String> {
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
        publish(
            channel,
            &self.exchange,
            &self.routing_key,
            delivery.payload,
            properties,
        )
        .await
        .map_err(|e| e.to_string())
    }

    fn connection(&self) -> &Reopening<(Connection, Channel)> {
        &self.channel
    }
}

destination!(AmqpDestination);

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

/// Connects to `url`; an `amqps://` URL over TLS with `tls`, or the defaults. Gives up
/// after [`CONNECT_WAIT`]: lapin has no bound of its own, and a connection failing while
/// its handshake starts can leave lapin waiting for it forever.
async fn connect(url: &str, tls: Option<&Tls>) -> Result<Connection, Error> {
    let uri: AMQPUri = url
        .parse()
        .map_err(|e| Error::Config(format!("AMQP URL: {e}")))?;
    // lapin's own TLS takes no verifier and adds a CA to the system's roots: the connection
    // is made here with the one rustls configuration every broker uses.
    let connector = match (uri.scheme == AMQPScheme::AMQPS, tls) {
        (true, tls) => {
            let config = tls.cloned().unwrap_or_default().client_config()?;
            Some(RustlsConnector::from(Arc::new(config)))
        }
        (false, None) => None,
        (false, Some(_)) => {
            return Err(Error::Config(
                "TLS settings need an amqps:// URL".to_owned(),
            ));
        }
    };
    let socket = Opening::default();
    let kept = Arc::clone(&socket.0);
    let open = async move |uri: AMQPUri, _| {
        let host = uri.authority.host.as_str();
        let stream = tokio::net::TcpStream::connect((host, uri.authority.port)).await?;
        stream.set_nodelay(true)?;
        let stream = stream.into_std()?;
        *crate::lock(&kept) = Some(stream.try_clone()?);
        let stream = tokio::net::TcpStream::from_std(stream)?;
        let stream = AsyncTcpStream::Plain(async_compat::Compat::new(stream));
        Ok(match &connector {
            Some(connector) => stream.into_rustls(connector, host).await?,
            None => stream,
        })
    };
    let runtime = lapin::runtime::default_runtime().map_err(broker)?;
    let opening = Connection::connector(uri, runtime, open, ConnectionProperties::default());
    let Ok(opened) = tokio::time::timeout(CONNECT_WAIT, opening).await else {
        return Err(Error::Broker(
            format!("no connection within {} s", CONNECT_WAIT.as_secs()).into(),
        ));
    };
    let connection = opened.map_err(broker)?;
    socket.opened();
    Ok(connection)
}

/// A copy of the socket of a connection being opened, shut down when dropped unless it
/// opened: lapin's IO thread waits on the socket until it closes, past a caller that gave
/// up on it.
#[derive(Default)]
struct Opening(Arc<std::sync::Mutex<Option<std::net::TcpStream>>>);

impl Opening {
    /// The connection holds its own socket: the copy goes, open.
    fn opened(self) {
        crate::lock(&self.0).take();
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        if let Some(copy) = crate::lock(&self.0).take() {
            let _ = copy.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// How long opening a connection may take: a TCP connect, TLS, and the AMQP handshake.
const CONNECT_WAIT: Duration = Duration::from_secs(15);

async fn open_channel(connection: &Connection) -> Result<Channel, Error> {
    let channel = connection.create_channel().await.map_err(broker)?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(broker)?;
    Ok(channel)
}

/// A queue as [`declare`] declares it.
struct Declared<'q> {
    name: &'q str,
    queue_type: QueueType,
    /// Where a quorum queue dead-letters what passes the broker's delivery limit.
    dead_letters: Option<&'q str>,
    /// A quorum queue's `x-delivery-limit`.
    delivery_limit: Option<u32>,
}

/// Declares `queue` durable, of its type. A quorum queue dead-letters to its dead letters
/// what passes the broker's own delivery limit, which would otherwise drop it. A refusal is
/// a setting to fix; a connection lost meanwhile is not.
async fn declare(
    connection: &Connection,
    channel: &Channel,
    queue: Declared<'_>,
) -> Result<(), Error> {
    let Declared {
        name: queue,
        queue_type,
        dead_letters,
        delivery_limit,
    } = queue;
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let mut arguments = FieldTable::default();
    if queue_type == QueueType::Quorum {
        arguments.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        if let Some(dead_letters) = dead_letters {
            arguments.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString("".into()),
            );
            arguments.insert(
                "x-dead-letter-routing-key".into(),
                AMQPValue::LongString(dead_letters.into()),
            );
        }
        if let Some(limit) = delivery_limit {
            arguments.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(i64::from(limit)),
            );
        }
    }
    let declared = channel
        .queue_declare(queue.into(), durable, arguments)
        .await;
    match declared {
        Ok(_) => Ok(()),
        Err(error) if !connection.status().connected() => Err(broker(error)),
        Err(error) => Err(Error::Config(format!("declaring queue {queue}: {error}"))),
    }
}

/// The answer lapin gives a settlement: false when it did not send it, because its channel
/// closed (or it was settled before).
fn taken(sent: bool) -> Result<(), Error> {
    if sent {
        Ok(())
    } else {
        Err(Error::Broker(
            "the delivery was not settled: its channel closed, or it was settled before".into(),
        ))
    }
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
    let publish = channel.basic_publish(
        exchange.into(),
        routing_key.into(),
        mandatory,
        payload,
        properties.with_delivery_mode(2),
    );
    let confirm = while_open(channel, publish).await?;
    let confirm = while_open(channel, confirm).await?;
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

/// How often a pending call checks that its channel is still open.
const OPEN_CHECK: Duration = Duration::from_millis(200);

/// How long [`Broker::close`] waits for each goodbye.
const GOODBYE_WAIT: Duration = Duration::from_secs(5);

/// Awaits `call`, failing once `channel` is no longer open. When the connection dies under
/// it, lapin can leave a call (an ack, a confirm, a `basic.cancel`) pending for ever: the
/// consumer would then neither consume nor exit.
async fn while_open<T>(
    channel: &Channel,
    call: impl Future<Output = Result<T, lapin::Error>>,
) -> Result<T, Error> {
    let closed = async {
        while channel.status().connected() {
            tokio::time::sleep(OPEN_CHECK).await;
        }
    };
    tokio::select! {
        biased;
        done = call => done.map_err(broker),
        () = closed => Err(channel_closed()),
    }
}

fn channel_closed() -> Error {
    Error::Broker("the channel to RabbitMQ closed with a call pending".into())
}

/// Awaits a goodbye for at most [`GOODBYE_WAIT`].
async fn within_goodbye_wait(
    goodbye: impl Future<Output = Result<(), lapin::Error>>,
) -> Result<(), Error> {
    tokio::time::timeout(GOODBYE_WAIT, goodbye)
        .await
        .map_err(|_| {
            Error::Broker(
                format!("RabbitMQ did not answer the close within {GOODBYE_WAIT:?}").into(),
            )
        })?
        .map_err(broker)
}

fn broker(error: lapin::Error) -> Error {
    // 403 ACCESS_REFUSED: a login refused, or a user without the right to what it asked.
    if let lapin::ErrorKind::ProtocolError(refused) = error.kind()
        && refused.get_id() == 403
    {
        return crate::refused_access(refused.get_message());
    }
    crate::tls::broker_error(error)
}

#[cfg(test)]
mod tests {
    use super::one_ack_tag;
    use std::collections::BTreeSet;

    #[test]
    fn one_multiple_ack_only_for_every_unsettled_tag_up_to_the_highest() {
        let unsettled: BTreeSet<u64> = [3, 4, 5, 6, 7].into();
        assert_eq!(
            one_ack_tag(&unsettled, &[3, 4, 5]),
            Some(5),
            "a whole prefix"
        );
        assert_eq!(one_ack_tag(&unsettled, &[5, 3, 4]), Some(5), "in any order");
        assert_eq!(
            one_ack_tag(&unsettled, &[4, 5]),
            None,
            "3 below is unsettled"
        );
        assert_eq!(one_ack_tag(&unsettled, &[6, 7]), None, "a gap below");
        assert_eq!(
            one_ack_tag(&unsettled, &[2, 3]),
            None,
            "2 is settled already"
        );
        assert_eq!(one_ack_tag(&unsettled, &[3]), None, "one has its own ack");
        assert_eq!(one_ack_tag(&unsettled, &[]), None);
        assert_eq!(
            one_ack_tag(&BTreeSet::new(), &[1, 2]),
            None,
            "another channel's"
        );
    }
}
