//! Redis Streams: a consumer group reader that acknowledges (`XACK`) only after the commit,
//! reclaims what a dead reader left pending, and the relay's publisher.
//!
//! ```no_run
//! # async fn example(inbox: justonce_sql::Inbox<justonce_sql::sqlx::Postgres>) -> Result<(), justonce_transport::Error> {
//! use justonce_sql::sqlx;
//! use justonce_transport::redis_streams::{RedisStreamConsumer, RedisStreamOptions};
//!
//! let consumer = RedisStreamConsumer::connect(
//!     "redis://127.0.0.1:6379",
//!     inbox,
//!     RedisStreamOptions::new("orders", "shipping"),
//! )
//! .await?;
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
//! An entry is a set of fields: by default the key is in `key` and the body in `body`, as
//! [`RedisStreamDestination`] writes them. An entry read but not acknowledged stays in the
//! group's pending list. After [`RedisStreamOptions::claim_idle`] any reader of the group
//! takes it over (`XAUTOCLAIM`), which is how the entries of a reader that died are
//! delivered again and how failed work is retried; Redis counts the deliveries, and after
//! the attempt limit the entry is added to `<stream>.dead` with its reason and acknowledged.
//!
//! A `rediss://` URL connects over TLS, checked against the system's roots or the CA of
//! [`RedisStreamOptions::tls`].
//!
//! Redis keeps a stream only as well as its persistence settings: without AOF
//! (`appendonly yes`, and `appendfsync always` to lose nothing on a crash of the machine) a
//! restart loses the stream, its pending lists and its acknowledgements.

use crate::consumer::{Broker, Receive, Received, Settle, policy_setters};
use crate::destination::{Publish, Reopening, destination};
use crate::reader::PARTITION;
use crate::tls::Tls;
use crate::{
    ATTEMPT_HEADER, Error, OrderedBroker, Policy, Position, REASON_BYTES, REASON_HEADER,
    StoredOffsets, truncate,
};
use justonce_core::Delivery;
use justonce_sql::{Backend, Inbox, Offset};
use redis::aio::MultiplexedConnection;
use redis::streams::{StreamAutoClaimOptions, StreamId, StreamReadOptions, StreamReadReply};
use redis::{AsyncCommands, IntoConnectionInfo};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The field that holds an entry's key, by default.
pub const KEY_FIELD: &str = "key";
/// The field that holds an entry's body.
pub const BODY_FIELD: &str = "body";
/// The field that holds an entry's content type, if any.
pub const CONTENT_TYPE_FIELD: &str = "content-type";

/// How long one read waits for new entries before the reader looks at the pending list
/// and its shutdown again.
const READ_BLOCK: Duration = Duration::from_millis(1_000);

/// Settings of a [`RedisStreamConsumer`].
#[derive(Debug, Clone)]
pub struct RedisStreamOptions {
    stream: String,
    group: String,
    consumer: String,
    policy: Policy,
    claim_idle: Duration,
    count: usize,
    tls: Option<Tls>,
}

impl RedisStreamOptions {
    /// Reads `stream` as a member of consumer group `group` (created at the start of the
    /// stream, with the stream, if missing), under a consumer name of its own process
    /// (`justonce-<host>-<pid>`: in containers every process may be pid 1). The
    /// key is the `key` field; failed work gets 5 attempts before it goes to
    /// `<stream>.dead`; entries pending for 30 s are taken over.
    pub fn new(stream: impl Into<String>, group: impl Into<String>) -> Self {
        Self {
            stream: stream.into(),
            group: group.into(),
            consumer: own_consumer_name(),
            policy: Policy::default(),
            claim_idle: Duration::from_secs(30),
            count: 16,
            tls: None,
        }
    }

    /// This reader's name in the group: unique among the group's live readers.
    pub fn consumer(mut self, consumer: impl Into<String>) -> Self {
        self.consumer = consumer.into();
        self
    }

    policy_setters!(
        /// Where the key is: [`KeyFrom::MessageId`](crate::KeyFrom::MessageId) is the `key`
        /// field, [`KeyFrom::Header`](crate::KeyFrom::Header) a field of that name,
        /// [`KeyFrom::Json`](crate::KeyFrom::Json) a pointer into the `body` field.
    );

    /// How long an entry stays pending, unacknowledged, before a reader takes it over:
    /// longer than the longest work, since work still running is taken over too. It is
    /// also the delay before failed work is tried again.
    pub fn claim_idle(mut self, idle: Duration) -> Self {
        self.claim_idle = idle.max(Duration::from_millis(1));
        self
    }

    /// How many entries one read takes at most (at least 1).
    pub fn count(mut self, count: usize) -> Self {
        self.count = count.max(1);
        self
    }

    /// How to check the server's certificate and which client certificate to present; the
    /// URL must be `rediss://`.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// The stream dead letters are added to.
    pub fn dead_letter_stream(&self) -> String {
        format!("{}.dead", self.stream)
    }
}

/// A Redis Streams consumer group reader that runs each entry's work once in effect.
pub type RedisStreamConsumer<DB> = crate::Consumer<RedisStreams, DB>;

/// The Redis Streams adapter of [`RedisStreamConsumer`], a member of a consumer group, and
/// of [`RedisStreamReader`], a single reader.
pub struct RedisStreams {
    url: String,
    /// The connection that acknowledges and dead-letters, replaced when the consumer or the
    /// reader connects again; each read has one of its own.
    redis: std::sync::Mutex<MultiplexedConnection>,
    options: RedisStreamOptions,
}

debug_shows_options!(RedisStreams);

/// One entry taken from the stream, with the delivery Redis counts.
#[derive(Debug)]
pub struct Entry {
    entry: StreamId,
    attempt: u32,
}

impl Entry {
    /// The entry's id in the stream.
    pub fn id(&self) -> &str {
        &self.entry.id
    }

    /// Which delivery of the entry this is, from 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The value of one of the entry's fields.
    pub fn field(&self, name: &str) -> Option<Vec<u8>> {
        self.entry.get::<Vec<u8>>(name)
    }
}

impl<DB: Backend> RedisStreamConsumer<DB> {
    /// Connects to `url` and creates the group (and the stream) unless it exists.
    pub async fn connect(
        url: &str,
        inbox: Inbox<DB>,
        options: RedisStreamOptions,
    ) -> Result<Self, Error> {
        let mut redis = connect(url, options.tls.as_ref()).await?;
        create_group(&mut redis, &options).await?;
        Ok(Self::new(RedisStreams::new(url, redis, options), inbox))
    }
}

/// Creates the group (and the stream) unless it exists. A refusal is a setting to fix; a
/// connection lost meanwhile, or a server still loading its data, is not.
async fn create_group(
    redis: &mut MultiplexedConnection,
    options: &RedisStreamOptions,
) -> Result<(), Error> {
    let created: redis::RedisResult<()> = redis
        .xgroup_create_mkstream(&options.stream, &options.group, "0")
        .await;
    match created {
        Ok(()) => Ok(()),
        Err(error) if error.code() == Some("BUSYGROUP") => Ok(()),
        Err(error) if error.code().is_none_or(|code| code == "LOADING") => Err(broker(error)),
        Err(error) => Err(Error::Config(format!(
            "creating group {} on stream {}: {error}",
            options.group, options.stream
        ))),
    }
}

impl Received for Entry {
    fn message_id(&self) -> Result<String, String> {
        self.header(KEY_FIELD)
            .ok_or_else(|| self.no_header(KEY_FIELD))
    }

    fn header(&self, name: &str) -> Option<String> {
        String::from_utf8(self.field(name)?).ok()
    }

    fn no_header(&self, name: &str) -> String {
        match self.field(name) {
            Some(_) => format!("the field {name} is not UTF-8"),
            None => format!("the entry has no field {name}"),
        }
    }

    fn log_id(&self) -> String {
        format!("entry {}", self.id())
    }

    fn body(&self) -> Vec<u8> {
        self.field(BODY_FIELD).unwrap_or_default()
    }

    fn content_type(&self) -> Option<String> {
        self.header(CONTENT_TYPE_FIELD)
    }

    fn attempt(&self) -> u32 {
        self.attempt
    }
}

impl Broker for RedisStreams {
    type Delivery = Entry;
    type Receiver<'b> = Entries<'b>;
    const NAME: &'static str = "redis";

    fn policy(&self) -> &Policy {
        &self.options.policy
    }

    /// On a connection of its own: a read blocks the connection for up to a second, and
    /// the consumer acknowledges a batch while it reads the next.
    async fn receive(&self) -> Result<Entries<'_>, Error> {
        let reading = connect(&self.url, self.options.tls.as_ref()).await?;
        Ok(self.entries(reading, Cursor::Group { last_claim: None }))
    }

    /// A new connection, and the group made again if the server lost it.
    async fn reconnect(&self) -> Result<(), Error> {
        let mut redis = connect(&self.url, self.options.tls.as_ref()).await?;
        create_group(&mut redis, &self.options).await?;
        *crate::lock(&self.redis) = redis;
        Ok(())
    }

    /// A retry, or an entry given back, is left pending: a reader takes it over after the
    /// claim idle time. A dead letter is added to the dead-letter stream and acknowledged
    /// in one transaction on the server.
    async fn settle(&self, entry: &Entry, settle: Settle) -> Result<(), Error> {
        match settle {
            Settle::Ack => self.ack_all(&[entry], &mut 0).await,
            Settle::Retry { .. } | Settle::GiveBack => Ok(()),
            Settle::DeadLetter { attempt, reason } => {
                let mut redis = self.redis();
                redis::pipe()
                    .atomic()
                    .xadd(
                        self.options.dead_letter_stream(),
                        "*",
                        &dead_letter_fields(entry, attempt, &reason),
                    )
                    .ignore()
                    .xack(&self.options.stream, &self.options.group, &[entry.id()])
                    .ignore()
                    .query_async::<()>(&mut redis)
                    .await
                    .map_err(broker)
            }
        }
    }

    /// One `XACK` for them all.
    async fn ack_all(&self, entries: &[&Entry], acked: &mut u64) -> Result<(), Error> {
        if entries.is_empty() {
            return Ok(());
        }
        let ids: Vec<&str> = entries.iter().map(|entry| entry.id()).collect();
        let mut redis = self.redis();
        let _: usize = redis
            .xack(&self.options.stream, &self.options.group, &ids)
            .await
            .map_err(broker)?;
        *acked += entries.len() as u64;
        Ok(())
    }
}

impl RedisStreams {
    fn new(url: &str, redis: MultiplexedConnection, options: RedisStreamOptions) -> Self {
        Self {
            url: url.to_owned(),
            redis: std::sync::Mutex::new(redis),
            options,
        }
    }

    /// The connection in use.
    fn redis(&self) -> MultiplexedConnection {
        crate::lock(&self.redis).clone()
    }

    /// The entries from `cursor` on, read through `redis`.
    fn entries(&self, redis: MultiplexedConnection, cursor: Cursor) -> Entries<'_> {
        Entries {
            streams: self,
            redis,
            cursor,
            read: VecDeque::new(),
        }
    }
}

/// An entry's fields, with the attempt it was given up on and why.
fn dead_letter_fields(entry: &Entry, attempt: u32, reason: &str) -> Vec<(String, Vec<u8>)> {
    let mut fields: Vec<(String, Vec<u8>)> = entry
        .entry
        .map
        .keys()
        .filter_map(|name| Some((name.clone(), entry.field(name)?)))
        .collect();
    fields.push((ATTEMPT_HEADER.to_owned(), attempt.to_string().into()));
    fields.push((
        REASON_HEADER.to_owned(),
        truncate(reason, REASON_BYTES).as_bytes().to_vec(),
    ));
    fields
}

/// Proves that the server at `url` takes a consumer with `options`: connects with its TLS
/// settings and the URL's login, and sends `PING`, which a server that wants a login (or
/// another one) refuses. Creates and reads nothing. Gives up after
/// [`PROBE_TIMEOUT`](crate::PROBE_TIMEOUT).
pub async fn probe(url: &str, options: &RedisStreamOptions) -> Result<(), Error> {
    crate::within_probe_timeout(async {
        let mut redis = connect(url, options.tls.as_ref()).await?;
        // Dropping the connection closes it: Redis has no goodbye but the deprecated QUIT.
        redis::cmd("PING")
            .query_async::<String>(&mut redis)
            .await
            .map(drop)
            .map_err(broker)
    })
    .await
}

/// Connects to `url` with a response timeout past the time a read blocks on the server; a
/// `rediss://` URL over TLS with `tls`, or the defaults.
async fn connect(url: &str, tls: Option<&Tls>) -> Result<MultiplexedConnection, Error> {
    let info = connection_info(url)?;
    let config = redis::AsyncConnectionConfig::new()
        .set_response_timeout(Some(READ_BLOCK + Duration::from_secs(10)));
    let redis::ConnectionAddr::TcpTls {
        host,
        port,
        insecure,
        ..
    } = info.addr().clone()
    else {
        if tls.is_some() {
            return Err(Error::Config(
                "TLS settings need a rediss:// URL".to_owned(),
            ));
        }
        return redis::Client::open(info)
            .map_err(|e| Error::Config(format!("Redis URL: {e}")))?
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(broker);
    };
    if insecure {
        return Err(Error::Config(
            "the Redis URL's #insecure is not taken: turn verification off in the TLS settings"
                .to_owned(),
        ));
    }
    // The handshake is made here, with the rustls configuration every broker uses, so that
    // its failure is told apart from a server that is down: redis keeps only its text.
    let tls = tls.cloned().unwrap_or_default().client_config()?;
    let server_name = tokio_rustls::rustls::pki_types::ServerName::try_from(host.clone())
        .map_err(|e| Error::Config(format!("Redis URL: the host {host}: {e}")))?;
    let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
        .await
        .map_err(broker)?;
    tcp.set_nodelay(true).map_err(broker)?;
    let mut stream = tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls))
        .connect(server_name, tcp)
        .await
        .map_err(broker)?;
    // Under TLS 1.3 a server refuses a client certificate after the handshake, at the
    // first read: a PING answered here shows it as a TLS failure, which redis would turn
    // into text.
    ping(&mut stream).await?;
    let (redis, driver) =
        MultiplexedConnection::new_with_config(info.redis_settings(), stream, config)
            .await
            .map_err(broker)?;
    tokio::spawn(driver);
    Ok(redis)
}

/// Sends `PING` and reads the answer's line (`+PONG`, or an error such as `-NOAUTH` before
/// the login): whatever the server says, it took the connection.
async fn ping(
    stream: &mut (impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin),
) -> Result<(), Error> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream.write_all(b"PING\r\n").await.map_err(broker)?;
    stream.flush().await.map_err(broker)?;
    let mut byte = [0u8];
    loop {
        if stream.read(&mut byte).await.map_err(broker)? == 0 {
            return Err(Error::Broker("the server closed the connection".into()));
        }
        if byte[0] == b'\n' {
            return Ok(());
        }
    }
}

fn connection_info(url: &str) -> Result<redis::ConnectionInfo, Error> {
    url.into_connection_info()
        .map_err(|e| Error::Config(format!("Redis URL: {e}")))
}

/// A single reader of a stream that keeps its position in the database: each entry's id
/// is stored as an offset in the same transaction as its work, and the reader starts after
/// the stored one. It reads with plain `XREAD`: no group, nothing pending, nothing to
/// acknowledge.
///
/// Use it where one process reads a stream in order; readers that share the entries need
/// [`RedisStreamConsumer`]. It is the generic [`Reader`](crate::Reader) over
/// [`RedisStreams`]: failed work runs again in place, up to the attempt limit, then goes to
/// `<stream>.dead` with its reason. The group, the consumer name and the claim idle time of
/// [`RedisStreamOptions`] do not apply.
pub type RedisStreamReader<DB> = crate::Reader<RedisStreams, DB>;

impl<DB: Backend> RedisStreamReader<DB> {
    /// Connects to `url`.
    pub async fn connect(
        url: &str,
        inbox: Inbox<DB>,
        options: RedisStreamOptions,
    ) -> Result<Self, Error> {
        let redis = connect(url, options.tls.as_ref()).await?;
        Ok(Self::new(RedisStreams::new(url, redis, options), inbox))
    }

    /// The name the position is stored under for the inbox's consumer: the stream's.
    pub fn offset_stream(&self) -> &str {
        &self.broker().options.stream
    }
}

/// A single reader reads with `XREAD` after the last entry it read; a dead letter is added
/// to the dead-letter stream.
impl OrderedBroker for RedisStreams {
    type Entry = Entry;
    type Entries<'b> = Entries<'b>;
    const NAME: &'static str = "redis";

    fn policy(&self) -> &Policy {
        &self.options.policy
    }

    /// On a connection of its own, as [`Broker::receive`]: a read blocks its connection for
    /// up to a second, and a dead letter is added while the next batch is read.
    async fn read(&self, stored: StoredOffsets) -> Result<Entries<'_>, Error> {
        let after = (stored.offset(&self.options.stream, PARTITION).await?).unwrap_or_default();
        let cursor = Cursor::After(format!("{}-{}", after.position, after.sequence));
        let reading = connect(&self.url, self.options.tls.as_ref()).await?;
        Ok(self.entries(reading, cursor))
    }

    /// A new connection for dead letters; the next read, on one of its own, starts after
    /// the stored offset.
    async fn reconnect(&self) -> Result<(), Error> {
        let redis = connect(&self.url, self.options.tls.as_ref()).await?;
        *crate::lock(&self.redis) = redis;
        Ok(())
    }

    fn position<'e>(&'e self, entry: &'e Entry) -> Result<Position<'e>, String> {
        let offset = offset_of(entry.id())
            .ok_or_else(|| format!("the entry id {} is not <ms>-<seq>", entry.id()))?;
        Ok(Position {
            stream: &self.options.stream,
            partition: PARTITION,
            offset,
        })
    }

    async fn dead_letter(&self, entry: &Entry, attempt: u32, reason: &str) -> Result<(), Error> {
        let mut redis = self.redis();
        redis
            .xadd::<_, _, _, _, String>(
                self.options.dead_letter_stream(),
                "*",
                &dead_letter_fields(entry, attempt, reason),
            )
            .await
            .map(drop)
            .map_err(broker)
    }
}

/// `justonce-<host>-<pid>`, or `justonce-<pid>` where the host name cannot be read: the
/// host tells apart containers, whose processes often all have pid 1.
fn own_consumer_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|host| host.trim().to_owned())
        .filter(|host| !host.is_empty());
    match host {
        Some(host) => format!("justonce-{host}-{}", std::process::id()),
        None => format!("justonce-{}", std::process::id()),
    }
}

/// The offset of an entry id `<ms>-<seq>`.
fn offset_of(id: &str) -> Option<Offset> {
    let (ms, seq) = id.split_once('-')?;
    Some(Offset::new(ms.parse().ok()?, seq.parse().ok()?))
}

/// Where a reader of the stream takes entries from.
enum Cursor {
    /// As a member of the group: first what other members left pending past the claim idle
    /// time (looked at when this was last done), then new ones.
    Group { last_claim: Option<Instant> },
    /// After this entry id, with no group: a single reader.
    After(String),
}

/// The entries of one member of a group, or of a single reader, in the order read.
pub struct Entries<'c> {
    streams: &'c RedisStreams,
    redis: MultiplexedConnection,
    cursor: Cursor,
    /// The entries of the last read not yet taken.
    read: VecDeque<Entry>,
}

impl Receive for Entries<'_> {
    type Delivery = Entry;

    async fn next(&mut self) -> Result<Option<Entry>, Error> {
        while self.read.is_empty() {
            self.read = self.read().await?.into();
        }
        Ok(self.read.pop_front())
    }

    /// The entries of the same read: a batch waits for no other.
    async fn more(&mut self, first: Entry, batch_size: usize) -> Result<Vec<Entry>, Error> {
        let more = batch_size.saturating_sub(1).min(self.read.len());
        Ok(std::iter::once(first)
            .chain(self.read.drain(..more))
            .collect())
    }
}

impl Entries<'_> {
    /// Pending entries taken over, or new ones; none when none came within a second.
    async fn read(&mut self) -> Result<Vec<Entry>, Error> {
        let options = &self.streams.options;
        let read = StreamReadOptions::default()
            .count(options.count)
            .block(usize::try_from(READ_BLOCK.as_millis()).unwrap_or(1_000));
        let (read, after) = match &self.cursor {
            Cursor::After(after) => (read, after.clone()),
            Cursor::Group { last_claim } => {
                // Looked at every half of the idle time: a pending entry waits at most 1.5
                // times it.
                if last_claim.is_none_or(|at| at.elapsed() >= options.claim_idle / 2) {
                    let claimed = self.claim_pending().await?;
                    if !claimed.is_empty() {
                        return Ok(claimed);
                    }
                    self.cursor = Cursor::Group {
                        last_claim: Some(Instant::now()),
                    };
                }
                (
                    read.group(&options.group, &options.consumer),
                    ">".to_owned(),
                )
            }
        };
        let reply: Option<StreamReadReply> = self
            .redis
            .xread_options(&[&options.stream], &[&after], &read)
            .await
            .map_err(broker)?;
        let entries = entries_of(reply);
        if let (Cursor::After(after), Some(last)) = (&mut self.cursor, entries.last()) {
            last.id().clone_into(after);
        }
        Ok(entries)
    }

    /// Takes over entries pending longer than the claim idle time, with the delivery count
    /// Redis keeps for each.
    async fn claim_pending(&mut self) -> Result<Vec<Entry>, Error> {
        let options = &self.streams.options;
        let idle = u64::try_from(options.claim_idle.as_millis()).unwrap_or(u64::MAX);
        let claimed: redis::streams::StreamAutoClaimReply = self
            .redis
            .xautoclaim_options(
                &options.stream,
                &options.group,
                &options.consumer,
                idle,
                "0-0",
                StreamAutoClaimOptions::default().count(options.count),
            )
            .await
            .map_err(broker)?;
        let mut entries = Vec::with_capacity(claimed.claimed.len());
        for entry in claimed.claimed {
            let pending: redis::streams::StreamPendingCountReply = self
                .redis
                .xpending_count(&options.stream, &options.group, &entry.id, &entry.id, 1)
                .await
                .map_err(broker)?;
            let delivered = pending.ids.first().map_or(1, |p| p.times_delivered);
            entries.push(Entry {
                entry,
                attempt: u32::try_from(delivered).unwrap_or(u32::MAX).max(1),
            });
        }
        Ok(entries)
    }
}

/// The entries of a read, each on its first delivery.
fn entries_of(reply: Option<StreamReadReply>) -> Vec<Entry> {
    reply
        .into_iter()
        .flat_map(|reply| reply.keys)
        .flat_map(|stream| stream.ids)
        .map(|entry| Entry { entry, attempt: 1 })
        .collect()
}

/// The relay's destination for Redis Streams: adds each outbox row to a stream as an entry
/// with its key in `key`, its payload in `body` and its headers as fields. A row added
/// twice (the relay died before marking it sent) is two entries with one key: the
/// consumer's claim makes the second a duplicate.
#[derive(Debug)]
pub struct RedisStreamDestination {
    url: String,
    stream: String,
    tls: Option<Tls>,
    redis: Reopening<MultiplexedConnection>,
}

impl RedisStreamDestination {
    /// Adds to `stream`. Connects on the first delivery.
    pub fn new(url: &str, stream: &str) -> Result<Self, Error> {
        connection_info(url)?;
        Ok(Self {
            url: url.to_owned(),
            stream: stream.to_owned(),
            tls: None,
            redis: Reopening::default(),
        })
    }

    /// Connects with these TLS settings; the URL must be `rediss://`.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }
}

impl Publish for RedisStreamDestination {
    type Connection = MultiplexedConnection;

    async fn open(&self) -> Result<MultiplexedConnection, Error> {
        connect(&self.url, self.tls.as_ref()).await
    }

    async fn publish(
        &self,
        redis: &MultiplexedConnection,
        delivery: Delivery<'_>,
    ) -> Result<(), String> {
        let mut fields: Vec<(&str, &[u8])> = vec![
            (KEY_FIELD, delivery.key.as_bytes()),
            (BODY_FIELD, delivery.payload),
        ];
        for (name, value) in delivery.headers {
            fields.push((name.as_str(), value.as_bytes()));
        }
        (redis.clone())
            .xadd::<_, _, _, _, String>(&self.stream, "*", &fields)
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    }

    fn connection(&self) -> &Reopening<MultiplexedConnection> {
        &self.redis
    }
}

destination!(RedisStreamDestination);

fn broker(error: impl std::error::Error + Send + Sync + 'static) -> Error {
    let redis = (&error as &dyn std::error::Error).downcast_ref::<redis::RedisError>();
    // A wrong password, a password missing, or a user without the right to a command.
    let refused = redis.is_some_and(|redis| {
        redis.kind() == redis::ErrorKind::AuthenticationFailed
            || matches!(redis.code(), Some("NOAUTH" | "NOPERM" | "WRONGPASS"))
    });
    if refused {
        return crate::refused_access(error);
    }
    crate::tls::broker_error(error)
}

#[cfg(test)]
mod tests {
    /// Two containers whose processes both have pid 1 differ by their host names.
    #[test]
    fn the_default_consumer_name_holds_the_host_and_the_pid() {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("a host name");
        assert_eq!(
            super::own_consumer_name(),
            format!("justonce-{}-{}", host.trim(), std::process::id())
        );
    }
}
