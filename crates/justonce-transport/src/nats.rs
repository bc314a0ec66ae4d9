//! NATS JetStream: a durable pull consumer that acknowledges only after the commit, and the
//! relay's publisher.
//!
//! ```no_run
//! # async fn example(inbox: justonce_sql::Inbox<justonce_sql::sqlx::Postgres>) -> Result<(), justonce_transport::Error> {
//! use justonce_sql::sqlx;
//! use justonce_transport::nats::{NatsConsumer, NatsOptions};
//!
//! let consumer =
//!     NatsConsumer::connect("nats://127.0.0.1:4222", inbox, NatsOptions::new("ORDERS", "orders"))
//!         .await?;
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
//! The stream counts deliveries itself: failed work is answered with a NAK and a growing
//! delay, and redelivered, up to the attempt limit; then the message is published to the
//! dead-letter subject with its reason and terminated. While work runs, the consumer tells
//! the server it is in progress, so that long work is not redelivered to another reader.
//!
//! A server that requires TLS gets it; with [`NatsOptions::tls`], TLS is required of any
//! server and checked against the CA given.

use crate::consumer::{Broker, Receive, Received, Settle, policy_setters};
use crate::destination::{Publish, Reopening, destination};
use crate::reader::{PARTITION, retry_delay};
use crate::tls::Tls;
use crate::{
    ATTEMPT_HEADER, Error, OrderedBroker, Policy, Position, REASON_BYTES, REASON_HEADER,
    StoredOffsets, truncate,
};
use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;
use justonce_core::Delivery;
use justonce_sql::{Backend, Inbox, Offset};
use std::future::Future;
use std::time::Duration;

pub use async_nats::jetstream::Message;

/// The header JetStream deduplicates on, and the default key.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// Settings of a [`NatsConsumer`].
#[derive(Debug, Clone)]
pub struct NatsOptions {
    stream: String,
    subject: String,
    durable: String,
    policy: Policy,
    ack_wait: Duration,
    prefetch: usize,
    declare: bool,
    replicas: usize,
    tls: Option<Tls>,
}

impl NatsOptions {
    /// Consumes `subject` of `stream` through a durable consumer named after the stream:
    /// the key is the `Nats-Msg-Id` header, failed work gets 5 attempts before it is
    /// published to `justonce.dead.<stream>`, the ack wait is 30 s, 64 messages are pulled
    /// ahead, and the stream (with file storage) and its dead-letter stream `<stream>_DEAD`
    /// are created if missing, with one replica each.
    pub fn new(stream: impl Into<String>, subject: impl Into<String>) -> Self {
        let stream = stream.into();
        Self {
            durable: stream.clone(),
            stream,
            subject: subject.into(),
            policy: Policy::default(),
            ack_wait: Duration::from_secs(30),
            prefetch: 64,
            declare: true,
            replicas: 1,
            tls: None,
        }
    }

    /// The durable consumer's name; readers that share it share the messages.
    pub fn durable(mut self, durable: impl Into<String>) -> Self {
        self.durable = durable.into();
        self
    }

    policy_setters!(
        /// Where the key is: [`KeyFrom::MessageId`](crate::KeyFrom::MessageId) is the
        /// `Nats-Msg-Id` header.
    );

    /// How long the server waits for an ack before it redelivers. Work in progress is
    /// reported every half of it.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// How many messages each pull asks for ahead of the work (at least 1); the next pull
    /// goes out when half of them are taken. The server's ack wait runs for a message from
    /// when it is sent, and the consumer reports progress only on the messages it is working
    /// on, so the work of one and a half times this many messages must fit in the ack wait:
    /// a message that waits longer is delivered again, and its second delivery is a
    /// duplicate that costs time. With batches, twice the batch size: the next batch is
    /// gathered while one commits.
    pub fn prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// How many servers of a cluster keep a copy of each stream this consumer creates (at
    /// least 1, at most the cluster's size; JetStream allows 5). A copy survives the loss of
    /// a server when the stream has 3. It applies when the stream is created: a stream that
    /// exists keeps the replicas it has.
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas.max(1);
        self
    }

    /// Leaves the streams as they are instead of creating them.
    pub fn existing_streams(mut self) -> Self {
        self.declare = false;
        self
    }

    /// Requires TLS of the server, checked with these settings.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// The subject dead letters are published to.
    pub fn dead_letter_subject(&self) -> String {
        format!("justonce.dead.{}", self.stream)
    }
}

/// A NATS JetStream consumer that runs each message's work once in effect.
pub type NatsConsumer<DB> = crate::Consumer<Nats, DB>;

/// The NATS JetStream adapter of [`NatsConsumer`]: a durable pull consumer.
pub struct Nats {
    jetstream: jetstream::Context,
    consumer: jetstream::consumer::Consumer<pull::Config>,
    options: NatsOptions,
}

debug_shows_options!(Nats);

impl<DB: Backend> NatsConsumer<DB> {
    /// Connects to `url` (one server, or a cluster's servers separated by commas), creates
    /// the streams unless they exist elsewhere, and binds the durable pull consumer
    /// (explicit acks, no delivery limit of its own: this consumer counts attempts and
    /// dead-letters).
    pub async fn connect(url: &str, inbox: Inbox<DB>, options: NatsOptions) -> Result<Self, Error> {
        let (jetstream, stream) = open_stream(url, &options).await?;
        let consumer = stream
            .get_or_create_consumer(
                &options.durable,
                pull::Config {
                    durable_name: Some(options.durable.clone()),
                    filter_subject: options.subject.clone(),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait: options.ack_wait,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| Error::Config(format!("consumer {}: {e}", options.durable)))?;
        let nats = Nats {
            jetstream,
            consumer,
            options,
        };
        Ok(Self::new(nats, inbox))
    }
}

/// The messages of one pull consumer: a durable one, or the ordered one of a
/// [`NatsReader`].
pub struct Messages<S = pull::Stream> {
    stream: S,
}

impl<S, E> Receive for Messages<S>
where
    S: futures_util::Stream<Item = Result<jetstream::Message, E>> + Unpin + Send,
    E: std::error::Error + Send + Sync + 'static,
{
    type Delivery = jetstream::Message;

    async fn next(&mut self) -> Result<Option<jetstream::Message>, Error> {
        self.stream.next().await.transpose().map_err(broker)
    }
}

impl Received for jetstream::Message {
    fn message_id(&self) -> Result<String, String> {
        self.header(MSG_ID_HEADER)
            .ok_or_else(|| "the message has no Nats-Msg-Id header".to_owned())
    }

    fn header(&self, name: &str) -> Option<String> {
        let value = self.headers.as_ref()?.get(name)?;
        Some(value.as_str().to_owned())
    }

    fn no_header(&self, name: &str) -> String {
        format!("the message has no header {name}")
    }

    fn log_id(&self) -> String {
        format!("subject {}", self.subject)
    }

    fn body(&self) -> Vec<u8> {
        self.payload.to_vec()
    }

    fn content_type(&self) -> Option<String> {
        self.header("Content-Type")
    }

    /// As the server counts deliveries.
    fn attempt(&self) -> u32 {
        self.info()
            .map(|info| u32::try_from(info.delivered).unwrap_or(1).max(1))
            .unwrap_or(1)
    }
}

impl Broker for Nats {
    type Delivery = jetstream::Message;
    type Receiver<'b> = Messages;
    const NAME: &'static str = "nats";

    fn policy(&self) -> &Policy {
        &self.options.policy
    }

    async fn receive(&self) -> Result<Messages, Error> {
        // A consumer made elsewhere may cap its pulls lower; the server refuses a larger one.
        let max_batch = usize::try_from(self.consumer.cached_info().config.max_batch)
            .ok()
            .filter(|&max| max > 0);
        let prefetch =
            max_batch.map_or(self.options.prefetch, |max| self.options.prefetch.min(max));
        let stream = self
            .consumer
            .stream()
            .max_messages_per_batch(prefetch)
            // The client's default, which a stream built by hand leaves off: a pull the
            // server lost is noticed in seconds, not at its expiry.
            .heartbeat(Duration::from_secs(15))
            .messages()
            .await
            .map_err(broker)?;
        Ok(Messages { stream })
    }

    async fn reconnect(&self) -> Result<(), Error> {
        connected(&self.jetstream)
    }

    /// A retry is a NAK with a growing delay, counted by the server; a dead letter is
    /// published, then the original terminated; given back is a NAK without delay.
    async fn settle(&self, message: &jetstream::Message, settle: Settle) -> Result<(), Error> {
        let kind = match settle {
            Settle::Ack => AckKind::Ack,
            Settle::Retry { attempt } => AckKind::Nak(Some(retry_delay(attempt))),
            Settle::DeadLetter { attempt, reason } => {
                dead_letter(&self.jetstream, &self.options, message, attempt, &reason).await?;
                AckKind::Term
            }
            Settle::GiveBack => AckKind::Nak(None),
        };
        message.ack_with(kind).await.map_err(Error::Broker)
    }

    /// Tells the server every half ack wait that `messages` are in progress, so that long
    /// work is not redelivered to another reader.
    async fn working<T: Send>(
        &self,
        messages: &[&jetstream::Message],
        work: impl Future<Output = T> + Send,
    ) -> T {
        let mut work = std::pin::pin!(work);
        // The first report is due after half the ack wait. An interval's immediate first
        // tick would cost a turn of the timer wheel (up to a millisecond) on every message.
        let every = self.options.ack_wait / 2;
        let mut progress = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tokio::select! {
                done = &mut work => return done,
                _ = progress.tick() => {
                    for message in messages {
                        // A lost progress report costs at most a redelivery, which is a
                        // duplicate.
                        let _ = message.ack_with(AckKind::Progress).await;
                    }
                }
            }
        }
    }
}

/// Connects to `url` and opens the stream of `options`, creating it and its dead-letter
/// stream (with file storage) unless they are declared elsewhere.
async fn open_stream(
    url: &str,
    options: &NatsOptions,
) -> Result<(jetstream::Context, jetstream::stream::Stream), Error> {
    let jetstream = jetstream::new(connect(url, options.tls.as_ref()).await?);
    if options.declare {
        let dead = format!("{}_DEAD", options.stream);
        for (name, subject) in [
            (&dead, options.dead_letter_subject()),
            (&options.stream, options.subject.clone()),
        ] {
            let stream = jetstream
                .get_or_create_stream(jetstream::stream::Config {
                    name: name.clone(),
                    subjects: vec![subject],
                    storage: jetstream::stream::StorageType::File,
                    num_replicas: options.replicas,
                    ..Default::default()
                })
                .await
                .map_err(|e| Error::Config(format!("creating stream {name}: {e}")))?;
            // A stream that existed keeps its own copies: say so, or a user who asked for
            // three would believe the stream survives a server's loss.
            let kept = stream.cached_info().config.num_replicas;
            if kept != options.replicas {
                tracing::warn!(
                    stream = %name,
                    replicas = kept,
                    asked = options.replicas,
                    "the stream existed with other replicas and keeps them"
                );
            }
        }
    }
    let stream = jetstream
        .get_stream(&options.stream)
        .await
        .map_err(|e| Error::Config(format!("stream {}: {e}", options.stream)))?;
    Ok((jetstream, stream))
}

/// Whether the client is connected: async-nats connects again by itself, so connecting
/// again is waiting for it.
fn connected(jetstream: &jetstream::Context) -> Result<(), Error> {
    match jetstream.client().connection_state() {
        async_nats::connection::State::Connected => Ok(()),
        state => Err(Error::Broker(
            format!("the client has not connected again yet ({state:?})").into(),
        )),
    }
}

/// Publishes the message, with its headers and the reason, to the dead-letter subject and
/// waits for the stream to store it.
async fn dead_letter(
    jetstream: &jetstream::Context,
    options: &NatsOptions,
    message: &jetstream::Message,
    attempt: u32,
    reason: &str,
) -> Result<(), Error> {
    let mut headers = message.headers.clone().unwrap_or_default();
    headers.insert(ATTEMPT_HEADER, attempt.to_string().as_str());
    headers.insert(REASON_HEADER, truncate(reason, REASON_BYTES));
    // A dead letter is its own message: the original id would be deduplicated away. The
    // stream sequence makes a letter published twice (by a reader that died before it moved
    // its offset) one.
    let stream_sequence = message.info().map(|info| info.stream_sequence).unwrap_or(0);
    headers.insert(
        MSG_ID_HEADER,
        format!("dead:{}:{stream_sequence}", options.stream).as_str(),
    );
    jetstream
        .publish_with_headers(
            options.dead_letter_subject(),
            headers,
            message.payload.clone(),
        )
        .await
        .map_err(broker)?
        .await
        .map(drop)
        .map_err(broker)
}

/// A single reader of a JetStream subject that keeps its position in the database: each
/// message's stream sequence is stored as an offset in the same transaction as its work, and
/// the reader starts after the stored one. The server keeps no acknowledgement state: the
/// messages come through an ordered consumer, which the server forgets when the reader
/// goes.
///
/// Use it where one process reads a subject in order; readers that share the messages need
/// [`NatsConsumer`]. It is the generic [`Reader`](crate::Reader) over [`NatsStream`]: failed
/// work runs again in place, up to the attempt limit, then goes to the dead-letter subject
/// with its reason. The durable name and the ack wait of [`NatsOptions`] do not apply.
pub type NatsReader<DB> = crate::Reader<NatsStream, DB>;

/// The NATS JetStream adapter of [`NatsReader`]: a stream read through ordered consumers.
#[derive(Debug)]
pub struct NatsStream {
    jetstream: jetstream::Context,
    stream: jetstream::stream::Stream,
    /// See [`NatsReader::offset_stream`].
    offset_stream: String,
    options: NatsOptions,
}

impl<DB: Backend> NatsReader<DB> {
    /// Connects to `url` (one server, or a cluster's servers separated by commas) and
    /// creates the streams unless they exist elsewhere.
    pub async fn connect(url: &str, inbox: Inbox<DB>, options: NatsOptions) -> Result<Self, Error> {
        let (jetstream, stream) = open_stream(url, &options).await?;
        let nats = NatsStream {
            jetstream,
            stream,
            offset_stream: format!("{}:{}", options.stream, options.subject),
            options,
        };
        Ok(Self::new(nats, inbox))
    }

    /// The name the position is stored under for the inbox's consumer: the stream and the
    /// subject, such as `ORDERS:orders.*`, since two subjects of one stream are read apart.
    pub fn offset_stream(&self) -> &str {
        &self.broker().offset_stream
    }
}

impl OrderedBroker for NatsStream {
    type Entry = jetstream::Message;
    type Entries<'b> = Messages<pull::Ordered>;
    const NAME: &'static str = "nats";

    fn policy(&self) -> &Policy {
        &self.options.policy
    }

    async fn read(&self, stored: StoredOffsets) -> Result<Messages<pull::Ordered>, Error> {
        let deliver_policy = match stored.offset(&self.offset_stream, PARTITION).await? {
            Some(offset) => DeliverPolicy::ByStartSequence {
                start_sequence: u64::try_from(offset.position).unwrap_or(0) + 1,
            },
            None => DeliverPolicy::All,
        };
        let consumer = self
            .stream
            .create_consumer(pull::OrderedConfig {
                filter_subject: self.options.subject.clone(),
                deliver_policy,
                ..Default::default()
            })
            .await
            .map_err(|e| {
                use async_nats::jetstream::stream::ConsumerErrorKind as Kind;
                // A server not answering yet, as after a restart, is a lost connection; a
                // refusal is the configuration's.
                match e.kind() {
                    Kind::TimedOut | Kind::Request => broker(e),
                    _ => Error::Config(format!("reading stream {}: {e}", self.options.stream)),
                }
            })?;
        let stream = consumer.messages().await.map_err(broker)?;
        Ok(Messages { stream })
    }

    async fn reconnect(&self) -> Result<(), Error> {
        connected(&self.jetstream)
    }

    fn position<'e>(&'e self, message: &'e jetstream::Message) -> Result<Position<'e>, String> {
        let info = message
            .info()
            .map_err(|e| format!("the message has no stream position: {e}"))?;
        Ok(Position {
            stream: &self.offset_stream,
            partition: PARTITION,
            offset: Offset::from(i64::try_from(info.stream_sequence).unwrap_or(i64::MAX)),
        })
    }

    async fn dead_letter(
        &self,
        message: &jetstream::Message,
        attempt: u32,
        reason: &str,
    ) -> Result<(), Error> {
        dead_letter(&self.jetstream, &self.options, message, attempt, reason).await
    }
}

/// The relay's destination for NATS JetStream: publishes each outbox row to a subject with
/// its key as `Nats-Msg-Id`, so that the stream's duplicate window drops a row published
/// again, and marks it sent once the stream acknowledges it.
#[derive(Debug)]
pub struct NatsDestination {
    url: String,
    subject: String,
    jetstream: Reopening<jetstream::Context>,
    tls: Option<Tls>,
}

impl NatsDestination {
    /// Publishes to `subject`, which a stream must capture, through the server at `url` (or
    /// a cluster's servers separated by commas). Connects on the first delivery.
    pub fn new(url: &str, subject: &str) -> Self {
        Self {
            url: url.to_owned(),
            subject: subject.to_owned(),
            jetstream: Reopening::default(),
            tls: None,
        }
    }

    /// Requires TLS of the server, checked with these settings.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }
}

impl Publish for NatsDestination {
    type Connection = jetstream::Context;

    async fn open(&self) -> Result<jetstream::Context, Error> {
        Ok(jetstream::new(connect(&self.url, self.tls.as_ref()).await?))
    }

    async fn publish(
        &self,
        jetstream: &jetstream::Context,
        delivery: Delivery<'_>,
    ) -> Result<(), String> {
        let mut headers = HeaderMap::new();
        headers.insert(MSG_ID_HEADER, delivery.key);
        for (name, value) in delivery.headers {
            headers.insert(name.as_str(), value.as_str());
        }
        let payload = delivery.payload.to_vec().into();
        match jetstream
            .publish_with_headers(self.subject.clone(), headers, payload)
            .await
        {
            Ok(ack) => ack.await.map(drop).map_err(|e| e.to_string()),
            Err(error) => Err(error.to_string()),
        }
    }

    fn connection(&self) -> &Reopening<jetstream::Context> {
        &self.jetstream
    }
}

destination!(NatsDestination);

/// Proves that the server at `url` takes a consumer with `options`: connects with its TLS
/// settings (the server answers the connect only once it has accepted the credentials),
/// checks that the account has JetStream, which every consumer here reads through, and
/// drains the connection. Creates and consumes nothing. Gives up after
/// [`PROBE_TIMEOUT`](crate::PROBE_TIMEOUT).
pub async fn probe(url: &str, options: &NatsOptions) -> Result<(), Error> {
    crate::within_probe_timeout(async {
        let client = connect(url, options.tls.as_ref()).await?;
        // The account's JetStream information, read loosely: its fields vary between
        // server versions, and only whether the server answers it with an error matters.
        let account: Result<jetstream::response::Response<serde_json::Value>, _> =
            jetstream::new(client.clone()).request("INFO", b"").await;
        let drained = client.drain().await;
        match account {
            Ok(jetstream::response::Response::Ok(_)) => {}
            Ok(jetstream::response::Response::Err { error }) => {
                return Err(Error::Broker(format!("JetStream: {error}").into()));
            }
            // Nothing answers the JetStream API where the server runs without it.
            Err(error) if error.kind() == jetstream::context::RequestErrorKind::NoResponders => {
                return Err(Error::Broker(
                    "JetStream is not enabled on the server for this account".into(),
                ));
            }
            Err(error) => return Err(Error::Broker(format!("JetStream: {error}").into())),
        }
        drained.map_err(broker)
    })
    .await
}

/// Connects to `url`, which may list the servers of a cluster separated by commas
/// (`nats://a:4222,nats://b:4222`): the client connects to the first of them that answers,
/// in random order, and to another when it loses one. With `tls`, over TLS whether or not
/// the server requires it.
async fn connect(url: &str, tls: Option<&Tls>) -> Result<async_nats::Client, Error> {
    let options = match tls {
        Some(tls) => async_nats::ConnectOptions::new()
            .tls_client_config(tls.client_config()?)
            .require_tls(true),
        None => async_nats::ConnectOptions::new(),
    };
    let servers = url
        .split(',')
        .map(|server| server.trim().parse::<async_nats::ServerAddr>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::Config(format!("NATS URL: {e}")))?;
    with_login(options, &servers)
        .connect(servers.as_slice())
        .await
        .map_err(|error| match error.kind() {
            async_nats::ConnectErrorKind::AuthorizationViolation
            | async_nats::ConnectErrorKind::Authentication => crate::refused_access(error),
            _ => broker(error),
        })
}

/// The login of the first server URL that has one: `user:password@` or `token@`, each
/// percent-decoded. The client reads the servers' addresses from the URLs but not their
/// logins.
fn with_login(
    options: async_nats::ConnectOptions,
    servers: &[async_nats::ServerAddr],
) -> async_nats::ConnectOptions {
    let decoded = |text: &str| {
        percent_encoding::percent_decode_str(text)
            .decode_utf8_lossy()
            .into_owned()
    };
    let login = servers
        .iter()
        .find_map(|server| Some((decoded(server.username()?), server.password().map(decoded))));
    match login {
        Some((user, Some(password))) => options.user_and_password(user, password),
        Some((token, None)) => options.token(token),
        None => options,
    }
}

fn broker(error: impl std::error::Error + Send + Sync + 'static) -> Error {
    crate::tls::broker_error(error)
}
