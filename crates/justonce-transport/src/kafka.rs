//! Kafka: a consumer-group member that keeps each partition's offset in the database, and
//! the relay's idempotent producer.
//!
//! ```no_run
//! # async fn example(inbox: justonce_sql::Inbox<justonce_sql::sqlx::Postgres>) -> Result<(), justonce_transport::Error> {
//! use justonce_sql::sqlx;
//! use justonce_transport::KeyFrom;
//! use justonce_transport::kafka::{KafkaOptions, KafkaReader};
//!
//! // A record's Kafka key names an entity; the message id is in the CloudEvents header.
//! let options = KafkaOptions::new("orders", "billing").key_from(KeyFrom::Header("ce_id".into()));
//! let reader = KafkaReader::connect("kafka://127.0.0.1:9092", inbox, options)?;
//! reader
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
//! The reader never relies on the offsets committed to the broker. It stores each record's
//! offset in the same transaction as the record's work, under the topic's name and the
//! record's partition, and claims the record's key too (a producer may send one message
//! twice). When the group assigns it a partition, it starts after the stored offset, or at
//! the configured start when none is stored. A record whose transaction committed is
//! therefore never run again, across crashes and rebalances.
//!
//! Failed work runs again in place after a growing delay, holding up its partition, up to
//! the attempt limit; then the record goes to `<topic>.dead` with the reason in the
//! [`REASON_HEADER`] header, and the offset moves past it.
//!
//! A Kafka record carries no message id: its key names an entity, such as an order, and
//! many messages share it. The id must come from a header or a JSON pointer
//! ([`KafkaOptions::key_from`]); [`KeyFrom::MessageId`] is refused.

use crate::consumer::{Receive, Received, policy_setters};
use crate::destination::destination;
use crate::reconnect::Connection;
use crate::tls::{Tls, TlsError};
use crate::{
    ATTEMPT_HEADER, Error, KeyFrom, OrderedBroker, Policy, Position, REASON_BYTES, REASON_HEADER,
    StoredOffsets, truncate,
};
use justonce_core::Delivery;
use justonce_sql::{Backend, Inbox, Offset};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _, ConsumerContext, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Headers, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::{RDKafkaErrorCode, RDKafkaRespErr};
use rdkafka::{ClientContext, TopicPartitionList};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use rdkafka::message::OwnedMessage;

/// The header the relay's records carry their key in, beside the record's Kafka key.
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";

/// How long a seek or a produced record may take before it counts as failed.
const BROKER_TIMEOUT: Duration = Duration::from_secs(30);

/// Why [`KeyFrom::MessageId`] is refused.
const NO_MESSAGE_ID: &str = "a Kafka record carries no message id (its key names an entity, \
                             not a message): take the id from a header or a JSON pointer";

/// Where a partition with no stored offset starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Start {
    /// The partition's first record still kept.
    Earliest,
    /// Records produced after the partition was assigned.
    Latest,
}

/// A SASL mechanism a broker takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SaslMechanism {
    /// `PLAIN`: the password as it is; use it over TLS only.
    Plain,
    /// `SCRAM-SHA-256`.
    ScramSha256,
    /// `SCRAM-SHA-512`.
    ScramSha512,
}

impl SaslMechanism {
    fn name(self) -> &'static str {
        match self {
            SaslMechanism::Plain => "PLAIN",
            SaslMechanism::ScramSha256 => "SCRAM-SHA-256",
            SaslMechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

/// The user and password a broker asks for.
#[derive(Clone)]
pub struct Sasl {
    mechanism: SaslMechanism,
    username: String,
    password: String,
}

impl std::fmt::Debug for Sasl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The password is a secret: never shown.
        f.debug_struct("Sasl")
            .field("mechanism", &self.mechanism)
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

impl Sasl {
    /// Authenticates as `username` with `password` by `mechanism`.
    pub fn new(
        mechanism: SaslMechanism,
        username: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        Self {
            mechanism,
            username: username.into(),
            password: password.into(),
        }
    }
}

/// How a client reaches the brokers: TLS and SASL, each optional.
#[derive(Debug, Clone, Default)]
struct Security {
    tls: Option<Tls>,
    sasl: Option<Sasl>,
}

impl Security {
    /// librdkafka's settings for `url`: the bootstrap servers, TLS and SASL.
    fn client_config(&self, url: &str) -> Result<ClientConfig, Error> {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", bootstrap_servers(url)?);
        let protocol = match (&self.tls, &self.sasl) {
            (None, None) => "plaintext",
            (Some(_), None) => "ssl",
            (None, Some(_)) => "sasl_plaintext",
            (Some(_), Some(_)) => "sasl_ssl",
        };
        config.set("security.protocol", protocol);
        if let Some(tls) = &self.tls {
            if let Some(ca) = tls.ca_pem() {
                config.set("ssl.ca.pem", pem_text(ca)?);
            }
            if let Some((certificate, key)) = tls.client_pem() {
                config.set("ssl.certificate.pem", pem_text(certificate)?);
                config.set("ssl.key.pem", pem_text(key)?);
            }
            if tls.is_insecure() {
                config.set("enable.ssl.certificate.verification", "false");
                config.set("ssl.endpoint.identification.algorithm", "none");
            }
        }
        if let Some(sasl) = &self.sasl {
            config.set("sasl.mechanism", sasl.mechanism.name());
            config.set("sasl.username", &sasl.username);
            config.set("sasl.password", &sasl.password);
        }
        Ok(config)
    }
}

/// The bootstrap servers of a `kafka://host:port[,host:port...]` URL.
fn bootstrap_servers(url: &str) -> Result<&str, Error> {
    let servers = url
        .strip_prefix("kafka://")
        .ok_or_else(|| Error::Config("a Kafka URL starts with kafka://".to_owned()))?
        .trim_end_matches('/');
    if servers.contains('@') {
        return Err(Error::Config(
            "a Kafka URL holds no credentials: give them as SASL settings".to_owned(),
        ));
    }
    if servers.is_empty() || servers.split(',').any(|server| !server.contains(':')) {
        return Err(Error::Config(
            "a Kafka URL names each bootstrap server as host:port, such as kafka://127.0.0.1:9092"
                .to_owned(),
        ));
    }
    Ok(servers)
}

fn pem_text(pem: &[u8]) -> Result<&str, Error> {
    std::str::from_utf8(pem).map_err(|_| Error::Config("a PEM file is not text".to_owned()))
}

/// Settings of a [`KafkaReader`].
#[derive(Debug, Clone)]
pub struct KafkaOptions {
    topic: String,
    group: String,
    policy: Policy,
    start: Start,
    session_timeout: Duration,
    security: Security,
}

impl KafkaOptions {
    /// Consumes `topic` as a member of consumer group `group`: partitions with no stored
    /// offset start at their earliest record, failed work gets 5 attempts before it is
    /// produced to `<topic>.dead`, and the group's session timeout is 45 s. The id must be
    /// set with [`KafkaOptions::key_from`].
    pub fn new(topic: impl Into<String>, group: impl Into<String>) -> Self {
        Self {
            topic: topic.into(),
            group: group.into(),
            policy: Policy::default(),
            start: Start::Earliest,
            session_timeout: Duration::from_secs(45),
            security: Security::default(),
        }
    }

    policy_setters!(
        /// Where the message id is: a header (such as CloudEvents' `ce_id`) or a JSON
        /// pointer. [`KeyFrom::MessageId`] is refused by [`KafkaReader::connect`].
    );

    /// Where a partition with no stored offset starts.
    pub fn start(mut self, start: Start) -> Self {
        self.start = start;
        self
    }

    /// How long the group waits for a silent member before it gives its partitions to the
    /// others.
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    /// Connects over TLS, checked with these settings.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.security.tls = Some(tls);
        self
    }

    /// Authenticates with SASL.
    pub fn sasl(mut self, sasl: Sasl) -> Self {
        self.security.sasl = Some(sasl);
        self
    }

    /// The topic consumed, and the name its offsets are stored under.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The topic dead letters are produced to: `<topic>.dead`.
    pub fn dead_letter_topic(&self) -> String {
        format!("{}.dead", self.topic)
    }
}

/// A change of the partitions the group assigned, as the rebalance callback saw it. The
/// group hands out whole assignments (its eager protocol): each replaces the one before.
#[derive(Debug, Clone)]
enum Change {
    Assigned(Vec<i32>),
    Revoked,
}

/// What the reader's loop and librdkafka's rebalance callback share: the changes the
/// callback saw and the loop has not yet applied, oldest first, a wake-up for the loop,
/// which waits for a record that an unassigned consumer never fetches, and the partitions
/// held.
#[derive(Default)]
struct Changes {
    queued: Mutex<VecDeque<Change>>,
    changed: tokio::sync::Notify,
    /// The next offset expected of each partition held: a record below it is dropped. The
    /// loop fills it when it assigns; the callback empties it when it gives the partitions
    /// up.
    positioned: Mutex<HashMap<i32, i64>>,
    /// How many assignments the loop applied.
    assigned: AtomicU64,
}

/// The consumer's context: forwards each rebalance to the reader's loop, and reports the
/// client's connection to the brokers as the reader's [`Link`](crate::Link).
///
/// librdkafka calls the rebalance callback synchronously, inside the poll that receives the
/// next record; it cannot wait for the database. So the callback assigns nothing: it queues
/// the group's assignment, and before it takes another record the loop loads the stored
/// offsets and assigns each partition from after its own (librdkafka waits for that call).
/// Nothing is fetched before: no record comes from where the broker would start. A
/// revocation is applied in the callback at once, in a poll that may come while a batch
/// runs (the reader reads the next one meanwhile). From then on the partitions are not
/// held ([`OrderedBroker::holds`]): the records of theirs read ahead are dropped, and a
/// failing one is not tried again, since the partitions' next reader reads them again from
/// the stored offsets. A batch already running finishes: its transaction claims its keys
/// and stores its offsets only if no reader moved past them, so nothing takes effect
/// twice.
struct Rebalancing {
    topic: String,
    changes: Arc<Changes>,
    link: BrokerLink,
    /// A refused handshake or login, to name instead of "all brokers are down".
    refusals: Refusals,
}

impl ClientContext for Rebalancing {
    /// The client's statistics, every [`LINK_CHECK`]: connected while a broker connection
    /// is up.
    fn stats_raw(&self, statistics: &[u8]) {
        match any_broker_up(statistics) {
            Some(true) => self.link.up(),
            Some(false) => self.link.none_up(),
            None => tracing::debug!("the Kafka client's statistics are not JSON"),
        }
    }

    /// An error of the client as a whole. The reader's loop receives and logs it too. A
    /// refusal names why the brokers are down: a certificate or a login to change (say, a
    /// broker's certificate replaced while the reader runs).
    fn error(&self, error: KafkaError, reason: &str) {
        let refusal = self.refusals.note(&error, reason);
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::AllBrokersDown) {
            let recent = Instant::now()
                .checked_sub(REFUSAL_NAMES_DOWN)
                .and_then(|since| self.refusals.last_since(since));
            let cause = match recent {
                Some(refusal) => Error::from(refusal).to_string(),
                None => format!("{error} ({reason})"),
            };
            self.link.down(cause);
        } else if let Some(refusal) = refusal {
            self.link.refused(Error::from(refusal).to_string());
        }
    }
}

impl ConsumerContext for Rebalancing {
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        event: RDKafkaRespErr,
        list: &mut TopicPartitionList,
    ) {
        if event == RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS {
            self.queue(Change::Assigned(self.partitions(list)));
            return;
        }
        crate::lock(&self.changes.positioned).clear();
        if event == RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS {
            self.queue(Change::Revoked);
        } else {
            tracing::warn!(
                ?event,
                "the group's rebalance failed: giving up the partitions"
            );
            self.queue(Change::Revoked);
        }
        if let Err(error) = consumer.unassign() {
            tracing::warn!(%error, "giving up the partitions failed");
        }
    }
}

/// How often the client reports its statistics, which say whether a broker connection is
/// up.
const LINK_CHECK: Duration = Duration::from_secs(1);

/// How long a refusal names the brokers' being down: librdkafka tries a broker again
/// within 10 s.
const REFUSAL_NAMES_DOWN: Duration = Duration::from_secs(10);

/// Whether any broker connection of the client is up, from its statistics; `None` if they
/// are not JSON. librdkafka's internal broker is no connection.
fn any_broker_up(statistics: &[u8]) -> Option<bool> {
    let statistics: serde_json::Value = serde_json::from_slice(statistics).ok()?;
    let brokers = statistics.get("brokers")?.as_object()?;
    Some(
        brokers
            .values()
            .any(|broker| broker["source"] != "internal" && broker["state"] == "UP"),
    )
}

/// The reader's [`Link`](crate::Link) as the client's own signals tell it: librdkafka
/// connects again by itself, so the reader's own reconnection never sees the connection go.
struct BrokerLink {
    connection: Connection,
    /// The inbox consumer, which the reconnections are counted under.
    consumer: String,
    /// Since when no broker connection is up, once one was.
    away: Mutex<Option<Instant>>,
    /// Whether a broker connection was up once: before, the client is still connecting for
    /// the first time, which is not a lost connection.
    was_up: AtomicBool,
}

impl BrokerLink {
    /// The client says all its brokers are down, for `error`.
    fn down(&self, error: String) {
        let mut away = crate::lock(&self.away);
        if away.is_some() {
            self.connection.still_lost(error);
        } else {
            *away = Some(Instant::now());
            self.connection.lost(error);
        }
    }

    /// The brokers refused the client for `cause`: the reason the link gives, if it is down.
    fn refused(&self, cause: String) {
        if crate::lock(&self.away).is_some() {
            self.connection.still_lost(cause);
        }
    }

    /// The statistics show no broker connection up.
    fn none_up(&self) {
        if self.was_up.load(Ordering::Relaxed) && crate::lock(&self.away).is_none() {
            self.down("no connection to a Kafka broker is up".to_owned());
        }
    }

    /// The statistics show a broker connection up.
    fn up(&self) {
        self.was_up.store(true, Ordering::Relaxed);
        if let Some(away) = crate::lock(&self.away).take() {
            self.connection
                .back(away, None, (&self.consumer, <Kafka as OrderedBroker>::NAME));
        }
    }
}

impl Rebalancing {
    fn partitions(&self, list: &TopicPartitionList) -> Vec<i32> {
        (list.elements_for_topic(&self.topic).iter())
            .map(|element| element.partition())
            .collect()
    }

    fn queue(&self, change: Change) {
        crate::lock(&self.changes.queued).push_back(change);
        self.changes.changed.notify_one();
    }
}

/// A Kafka consumer-group member that runs each record's work once in effect, with the
/// record's key claimed and its partition's offset stored in the same transaction: the one
/// generic [`Reader`](crate::Reader) over the [`Kafka`] adapter.
///
/// Records are read in order within each partition. Members of one group share the
/// partitions; give each the same inbox consumer name, since the offsets are stored under
/// it. The broker's committed offsets are neither read nor written.
pub type KafkaReader<DB> = crate::Reader<Kafka, DB>;

/// The Kafka adapter of [`KafkaReader`]: a consumer-group member that assigns each partition
/// it is given from after its stored offset.
pub struct Kafka {
    consumer: StreamConsumer<Rebalancing>,
    changes: Arc<Changes>,
    producer: Producer,
    options: KafkaOptions,
}

debug_shows_options!(Kafka);

impl<DB: Backend> KafkaReader<DB> {
    /// Joins the group and subscribes to the topic; the brokers are reached when reading
    /// starts. Refuses [`KeyFrom::MessageId`] and a bad URL.
    pub fn connect(url: &str, inbox: Inbox<DB>, options: KafkaOptions) -> Result<Self, Error> {
        if options.policy.key_from == KeyFrom::MessageId {
            return Err(Error::Config(NO_MESSAGE_ID.to_owned()));
        }
        let config = options.security.client_config(url)?;
        let changes = Arc::new(Changes::default());
        let connection = Connection::default();
        let context = Rebalancing {
            topic: options.topic.clone(),
            changes: Arc::clone(&changes),
            link: BrokerLink {
                connection: connection.clone(),
                consumer: inbox.consumer().as_str().to_owned(),
                away: Mutex::default(),
                was_up: AtomicBool::default(),
            },
            refusals: Refusals::new(&options.security, url),
        };
        let start = match options.start {
            Start::Earliest => "earliest",
            Start::Latest => "latest",
        };
        let consumer: StreamConsumer<Rebalancing> = config
            .clone()
            .set("group.id", &options.group)
            // The offsets live in the database: the broker's are neither stored nor read.
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", start)
            .set("statistics.interval.ms", LINK_CHECK.as_millis().to_string())
            .set(
                "session.timeout.ms",
                options.session_timeout.as_millis().to_string(),
            )
            // Three heartbeats per session, as Kafka advises: librdkafka's default of 3 s
            // would let a short session lapse between two heartbeats of a live member.
            .set(
                "heartbeat.interval.ms",
                (options.session_timeout / 3).as_millis().max(1).to_string(),
            )
            .create_with_context(context)
            .map_err(|e| Error::Config(format!("Kafka consumer: {e}")))?;
        consumer
            .subscribe(&[&options.topic])
            .map_err(|e| Error::Config(format!("subscribing to {}: {e}", options.topic)))?;
        let kafka = Kafka {
            consumer,
            changes,
            producer: Producer::new(&config, Refusals::new(&options.security, url))?,
            options,
        };
        Ok(Self::reporting(kafka, inbox, connection))
    }
}

/// The records of the partitions assigned to a [`Kafka`] member, each partition in order.
pub struct Records<'k> {
    kafka: &'k Kafka,
    stored: StoredOffsets,
    /// How many changes of the assignment this reader has applied.
    applied: u64,
}

impl Receive for Records<'_> {
    type Delivery = OwnedMessage;

    /// The next record of an assigned partition, after the partition's stored offset.
    /// Cancelling it loses nothing: an assignment is applied again, and a record is only
    /// taken when it is returned.
    async fn next(&mut self) -> Result<Option<OwnedMessage>, Error> {
        let kafka = self.kafka;
        loop {
            self.apply_changes().await;
            let record = tokio::select! {
                record = kafka.consumer.recv() => match record {
                    Ok(record) => record.detach(),
                    Err(error) if recovers_by_itself(&error) => {
                        tracing::warn!(%error, "Kafka client error: the client recovers by itself");
                        tokio::time::sleep(RECOVERY_POLL).await;
                        continue;
                    }
                    Err(error) => return Err(unrecoverable(error)),
                },
                () = kafka.changes.changed.notified() => continue,
            };
            // Nothing is awaited from here on: the record is either returned or dropped. A
            // change queued during this poll makes the assignment it came from stale.
            if !crate::lock(&kafka.changes.queued).is_empty() {
                continue;
            }
            let mut positioned = crate::lock(&kafka.changes.positioned);
            match positioned.get_mut(&record.partition()) {
                Some(next) if record.offset() >= *next => {
                    *next = record.offset() + 1;
                    return Ok(Some(record));
                }
                _ => continue,
            }
        }
    }

    /// `first` and the records already fetched after it, as every receiver takes them; none
    /// if the assignment changed meanwhile. A rebalance comes in a poll, and polls happen
    /// here while the batch waits to run: a partition released in one may already be read
    /// by another member, from its stored offset, so its records must not run here. They
    /// are read again by whoever holds the partition next.
    async fn more(
        &mut self,
        first: OwnedMessage,
        batch_size: usize,
    ) -> Result<Vec<OwnedMessage>, Error> {
        let applied = self.applied;
        let mut batch = vec![first];
        while batch.len() < batch_size {
            let next = tokio::time::timeout(crate::consumer::BATCH_WAIT, self.next()).await;
            if self.applied != applied || !crate::lock(&self.kafka.changes.queued).is_empty() {
                return Ok(Vec::new());
            }
            match next {
                Ok(next) => match next? {
                    Some(record) => batch.push(record),
                    None => break,
                },
                Err(_) => break,
            }
        }
        Ok(batch)
    }
}

impl Records<'_> {
    /// Applies the latest change the rebalance callback queued, which replaces those before
    /// it; the queue is emptied only once it is applied, so that a cancelled call leaves it
    /// for the next.
    async fn apply_changes(&mut self) {
        let kafka = self.kafka;
        loop {
            let (latest, queued) = {
                let changes = crate::lock(&kafka.changes.queued);
                match changes.back() {
                    Some(latest) => (latest.clone(), changes.len()),
                    None => return,
                }
            };
            match latest {
                // The callback gave the partitions up.
                Change::Revoked => {}
                Change::Assigned(partitions) => {
                    while let Err(error) = self.assign(&partitions).await {
                        tracing::warn!(%error, "assigning partitions failed: trying again");
                        tokio::time::sleep(kafka.options.policy.store_pause).await;
                    }
                }
            }
            crate::lock(&kafka.changes.queued).drain(..queued);
            self.applied += 1;
        }
    }

    /// Assigns `partitions`, each from after its stored offset or at the configured start.
    async fn assign(&self, partitions: &[i32]) -> Result<(), Error> {
        let kafka = self.kafka;
        let topic = &kafka.options.topic;
        let mut list = TopicPartitionList::new();
        let mut positioned = HashMap::with_capacity(partitions.len());
        for &partition in partitions {
            let (start, next) = match self.stored.offset(topic, partition).await? {
                Some(offset) => (
                    rdkafka::Offset::Offset(offset.position + 1),
                    offset.position + 1,
                ),
                None => match kafka.options.start {
                    Start::Earliest => (rdkafka::Offset::Beginning, 0),
                    Start::Latest => (rdkafka::Offset::End, 0),
                },
            };
            list.add_partition_offset(topic, partition, start)
                .map_err(broker)?;
            positioned.insert(partition, next);
        }
        kafka.consumer.assign(&list).map_err(broker)?;
        *crate::lock(&kafka.changes.positioned) = positioned;
        kafka.changes.assigned.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            ?partitions,
            "assigned partitions after their stored offsets"
        );
        Ok(())
    }
}

impl OrderedBroker for Kafka {
    type Entry = OwnedMessage;
    type Entries<'b> = Records<'b>;
    const NAME: &'static str = "kafka";

    fn policy(&self) -> &Policy {
        &self.options.policy
    }

    /// Each partition starts after its stored offset when the group assigns it. A read
    /// after another (once a lost connection is back) assigns the partitions held again,
    /// each from after its stored offset: the client's position is past records taken and
    /// not stored, which would otherwise never run.
    async fn read(&self, stored: StoredOffsets) -> Result<Records<'_>, Error> {
        let mut held: Vec<i32> = crate::lock(&self.changes.positioned)
            .keys()
            .copied()
            .collect();
        if !held.is_empty() {
            held.sort_unstable();
            let mut queued = crate::lock(&self.changes.queued);
            // A change queued already is applied first, and assigns from the stored offsets.
            if queued.is_empty() {
                queued.push_back(Change::Assigned(held));
            }
        }
        Ok(Records {
            kafka: self,
            stored,
            applied: 0,
        })
    }

    /// librdkafka connects again by itself, and a partition it reassigns starts after its
    /// stored offset: nothing to do.
    async fn reconnect(&self) -> Result<(), Error> {
        Ok(())
    }

    /// Until the rebalance callback gives the record's partition up; a partition given back
    /// to this member is read again from its stored offset.
    fn holds(&self, record: &OwnedMessage) -> bool {
        crate::lock(&self.changes.positioned).contains_key(&record.partition())
    }

    /// Each assignment the group makes: the record a partition starts at may be the one its
    /// previous member died on.
    fn assignments(&self) -> u64 {
        self.changes.assigned.load(Ordering::Relaxed)
    }

    fn position<'e>(&'e self, record: &'e OwnedMessage) -> Result<Position<'e>, String> {
        Ok(Position {
            stream: &self.options.topic,
            partition: record.partition(),
            offset: Offset::from(record.offset()),
        })
    }

    /// Produces the record, with its key, its headers, the attempt and the reason, to
    /// `<topic>.dead`, and waits for the brokers to acknowledge it. A reader that dies
    /// before it moves the offset produces it again.
    async fn dead_letter(
        &self,
        record: &OwnedMessage,
        attempt: u32,
        reason: &str,
    ) -> Result<(), Error> {
        let mut headers = OwnedHeaders::new();
        for header in record
            .headers()
            .into_iter()
            .flat_map(|headers| headers.iter())
        {
            if header.key != ATTEMPT_HEADER && header.key != REASON_HEADER {
                headers = headers.insert(header);
            }
        }
        let attempt = attempt.to_string();
        let headers = headers
            .insert(Header {
                key: ATTEMPT_HEADER,
                value: Some(attempt.as_str()),
            })
            .insert(Header {
                key: REASON_HEADER,
                value: Some(truncate(reason, REASON_BYTES)),
            });
        let topic = self.options.dead_letter_topic();
        let mut letter = FutureRecord::<[u8], [u8]>::to(&topic).headers(headers);
        if let Some(key) = record.key() {
            letter = letter.key(key);
        }
        if let Some(payload) = record.payload() {
            letter = letter.payload(payload);
        }
        self.producer.send(letter).await
    }
}

impl Received for OwnedMessage {
    fn message_id(&self) -> Result<String, String> {
        Err(NO_MESSAGE_ID.to_owned())
    }

    fn header(&self, name: &str) -> Option<String> {
        let header = self.headers()?.iter().find(|header| header.key == name)?;
        String::from_utf8(header.value?.to_vec()).ok()
    }

    fn no_header(&self, name: &str) -> String {
        format!("the record has no header {name}")
    }

    fn log_id(&self) -> String {
        format!(
            "{} partition {} offset {}",
            self.topic(),
            self.partition(),
            self.offset()
        )
    }

    fn body(&self) -> Vec<u8> {
        self.payload().unwrap_or_default().to_vec()
    }

    fn content_type(&self) -> Option<String> {
        self.header("content-type")
    }

    /// A reader runs a record again in place: the broker delivered it once.
    fn attempt(&self) -> u32 {
        1
    }
}

/// An idempotent producer with `acks=all`: a record is acknowledged only once every in-sync
/// replica holds it, and a retried send is not written twice.
struct Producer {
    client: FutureProducer<Refusals>,
    refusals: Refusals,
}

impl Producer {
    fn new(config: &ClientConfig, refusals: Refusals) -> Result<Self, Error> {
        let client = config
            .clone()
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("message.timeout.ms", BROKER_TIMEOUT.as_millis().to_string())
            .create_with_context(refusals.clone())
            .map_err(|e| Error::Config(format!("Kafka producer: {e}")))?;
        Ok(Self { client, refusals })
    }

    /// Produces `record` and waits for the brokers to acknowledge it. A send that times out
    /// while the brokers refuse the connection fails with the refusal.
    async fn send<K, P>(&self, record: FutureRecord<'_, K, P>) -> Result<(), Error>
    where
        K: rdkafka::message::ToBytes + ?Sized,
        P: rdkafka::message::ToBytes + ?Sized,
    {
        let since = Instant::now();
        self.client
            .send(record, BROKER_TIMEOUT)
            .await
            .map(drop)
            .map_err(|(error, _)| match self.refusals.last_since(since) {
                Some(refusal) => refusal.into(),
                None => broker(error),
            })
    }
}

/// The relay's destination for Kafka: produces each outbox row to a topic with the row's
/// key as the record's key (so one key's rows stay in one partition, in order) and as the
/// [`IDEMPOTENCY_KEY_HEADER`] header, through an idempotent producer with `acks=all`, and
/// marks the row sent once the brokers acknowledge it.
pub struct KafkaDestination {
    url: String,
    topic: String,
    security: Security,
    /// The producer, made on the first delivery.
    producer: tokio::sync::OnceCell<Producer>,
}

impl std::fmt::Debug for KafkaDestination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaDestination")
            .field("topic", &self.topic)
            .field("security", &self.security)
            .finish_non_exhaustive()
    }
}

impl KafkaDestination {
    /// Produces to `topic`, which must exist. Connects on the first delivery.
    pub fn new(url: &str, topic: &str) -> Self {
        Self {
            url: url.to_owned(),
            topic: topic.to_owned(),
            security: Security::default(),
            producer: tokio::sync::OnceCell::new(),
        }
    }

    /// Connects over TLS, checked with these settings.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.security.tls = Some(tls);
        self
    }

    /// Authenticates with SASL.
    pub fn sasl(mut self, sasl: Sasl) -> Self {
        self.security.sasl = Some(sasl);
        self
    }

    async fn send(&self, delivery: Delivery<'_>) -> Result<(), String> {
        let producer = self
            .producer
            .get_or_try_init(|| async {
                let config = self.security.client_config(&self.url)?;
                Producer::new(&config, Refusals::new(&self.security, &self.url))
            })
            .await
            .map_err(|e: Error| e.to_string())?;
        let mut headers = OwnedHeaders::new().insert(Header {
            key: IDEMPOTENCY_KEY_HEADER,
            value: Some(delivery.key),
        });
        for (name, value) in delivery.headers {
            headers = headers.insert(Header {
                key: name,
                value: Some(value),
            });
        }
        let record = FutureRecord::to(&self.topic)
            .key(delivery.key)
            .payload(delivery.payload)
            .headers(headers);
        producer.send(record).await.map_err(|e| e.to_string())
    }
}

// The producer is kept after a failed send: librdkafka connects again by itself, and the
// relay's sends run at once through it.
destination!(KafkaDestination);

/// Proves that the brokers at `url` take a reader with `options`: connects with its TLS and
/// SASL settings, and asks for the topic's metadata, which fails on refused credentials and
/// says whether the topic exists. Joins no group and consumes nothing. Gives up after
/// [`PROBE_TIMEOUT`](crate::PROBE_TIMEOUT), or at the first refused TLS handshake or login.
pub async fn probe(url: &str, options: &KafkaOptions) -> Result<(), Error> {
    let config = options.security.client_config(url)?;
    let refusals = Refusals::new(&options.security, url);
    let topic = options.topic.clone();
    crate::within_probe_timeout(async move {
        // librdkafka's metadata request blocks its caller.
        tokio::task::spawn_blocking(move || {
            let client: BaseConsumer<Refusals> = config
                .create_with_context(refusals.clone())
                .map_err(|e| Error::Config(format!("Kafka client: {e}")))?;
            let since = Instant::now();
            let metadata = loop {
                match client.fetch_metadata(Some(&topic), PROBE_ATTEMPT) {
                    Ok(metadata) => break metadata,
                    Err(error) => {
                        // Serves the client's events for a while: its log lines come first
                        // in its queue, then the errors that tell of a refusal.
                        let _ = client.poll(PROBE_ATTEMPT);
                        if let Some(refusal) = refusals.last_since(since) {
                            return Err(refusal.into());
                        }
                        if since.elapsed() >= crate::PROBE_TIMEOUT {
                            return Err(broker(error));
                        }
                    }
                }
            };
            let found = metadata.topics().iter().find(|found| found.name() == topic);
            match found.map(|found| found.error()) {
                Some(None) => Ok(()),
                Some(Some(error)) => Err(Error::Config(format!(
                    "topic {topic}: {}",
                    RDKafkaErrorCode::from(error)
                ))),
                None => Err(Error::Config(format!("topic {topic} does not exist"))),
            }
        })
        .await
        .map_err(|e| Error::Broker(e.into()))?
    })
    .await
}

/// How long one metadata request of a probe may take, and how long the probe serves the
/// client's events after it, before it asks again.
const PROBE_ATTEMPT: Duration = Duration::from_millis(250);

/// The context of a probe's client and of a producer. librdkafka reports a refused TLS
/// handshake or SASL login only to its error callback, then tries again until a request
/// times out; kept here, the refusal can be named instead of the timeout.
#[derive(Clone)]
struct Refusals {
    last: Arc<Mutex<Option<LastRefusal>>>,
    /// The TLS settings and the first bootstrap server, to learn why a certificate failed.
    tls: Option<(Tls, String)>,
}

struct LastRefusal {
    at: Instant,
    /// librdkafka's words without their timing, which repeat at each attempt to connect.
    reason: String,
    refusal: Refusal,
}

/// Why the brokers refused a connection: a setting must change, not the network.
#[derive(Clone)]
enum Refusal {
    Tls(TlsError),
    /// librdkafka's reason for the refused login.
    Login(String),
}

impl From<Refusal> for Error {
    fn from(refusal: Refusal) -> Self {
        match refusal {
            Refusal::Tls(tls) => Error::Tls(tls),
            Refusal::Login(reason) => Error::Config(format!(
                "the brokers refused the SASL login ({reason}): check the mechanism, the user \
                 and the password"
            )),
        }
    }
}

/// How long learning why a certificate failed may take at each step.
const DIAGNOSIS: Duration = Duration::from_secs(2);

impl Refusals {
    fn new(security: &Security, url: &str) -> Self {
        let first_server = bootstrap_servers(url)
            .ok()
            .and_then(|servers| servers.split(',').next())
            .map(str::to_owned);
        Self {
            last: Arc::default(),
            tls: security.tls.clone().zip(first_server),
        }
    }

    /// Keeps the refusal the client's `error` tells of, if it is one, and gives it. A new one
    /// with a failed verification takes a handshake of its own, up to [`DIAGNOSIS`] twice.
    fn note(&self, error: &KafkaError, reason: &str) -> Option<Refusal> {
        // The same refusal again, at the next attempt: known already.
        let (words, _timing) = reason.split_once(" (after ").unwrap_or((reason, ""));
        let mut last = crate::lock(&self.last);
        if let Some(last) = last.as_mut().filter(|last| last.reason == words) {
            last.at = Instant::now();
            return Some(last.refusal.clone());
        }
        let refusal = if error.rdkafka_error_code() == Some(RDKafkaErrorCode::Authentication) {
            Refusal::Login(reason.to_owned())
        } else {
            Refusal::Tls(self.refusal(reason)?)
        };
        *last = Some(LastRefusal {
            at: Instant::now(),
            reason: words.to_owned(),
            refusal: refusal.clone(),
        });
        Some(refusal)
    }

    /// The last refusal, if at or after `since`.
    fn last_since(&self, since: Instant) -> Option<Refusal> {
        let last = crate::lock(&self.last);
        last.as_ref()
            .filter(|last| last.at >= since)
            .map(|last| last.refusal.clone())
    }

    /// The refusal librdkafka's error `reason` tells of, if it is one. Its OpenSSL reports a
    /// CA it does not know and a certificate for another host alike, as a failed
    /// verification: rustls's verdict on a handshake of its own tells them apart.
    fn refusal(&self, reason: &str) -> Option<TlsError> {
        let lower = reason.to_ascii_lowercase();
        if lower.contains("alert certificate required") {
            return Some(TlsError::ClientCertificateRequired);
        }
        let refused_client = [
            "alert unknown ca",
            "alert bad certificate",
            "alert certificate unknown",
            "alert access denied",
        ];
        if refused_client.iter().any(|alert| lower.contains(alert)) {
            return Some(TlsError::ClientCertificateRefused(reason.to_owned()));
        }
        if !lower.contains("ssl handshake failed") {
            return None;
        }
        if !lower.contains("certificate verify failed") {
            return Some(TlsError::Handshake(reason.to_owned()));
        }
        let diagnosed = (self.tls.as_ref())
            .and_then(|(tls, server)| crate::tls::handshake_refusal(tls, server, DIAGNOSIS));
        Some(diagnosed.unwrap_or_else(|| TlsError::BadCertificate(reason.to_owned())))
    }
}

impl ClientContext for Refusals {
    /// Called when the client is polled: a producer polls all the time, a probe between its
    /// requests.
    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(%error, reason, "Kafka client error");
        self.note(&error, reason);
    }
}

impl ConsumerContext for Refusals {}

/// How long the reader waits after an error the client recovers from, so that a broker
/// that is down costs no busy loop.
const RECOVERY_POLL: Duration = Duration::from_millis(100);

/// Whether librdkafka goes on after `error` by itself: a broker down or a transport failure
/// is reported through the consumer too, and reconnecting is the client's job. A fatal
/// error or a refused login ends the reader.
fn recovers_by_itself(error: &KafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode as Code;
    !matches!(
        error.rdkafka_error_code(),
        Some(
            Code::Fatal
                | Code::Authentication
                | Code::SaslAuthenticationFailed
                | Code::TopicAuthorizationFailed
                | Code::GroupAuthorizationFailed
                | Code::ClusterAuthorizationFailed
        )
    )
}

/// An error the client does not recover from (see [`recovers_by_itself`]): not a lost
/// connection, so the reader ends instead of connecting again to the same client.
fn unrecoverable(error: KafkaError) -> Error {
    Error::Config(format!(
        "the Kafka client cannot go on: {error} (check the credentials and the topic's ACLs)"
    ))
}

fn broker(error: KafkaError) -> Error {
    crate::tls::broker_error(error)
}

#[cfg(test)]
mod tests {
    use super::any_broker_up;

    /// The brokers of librdkafka's statistics, trimmed to the fields read: the internal
    /// broker is always up and says nothing of the connection.
    fn statistics(bootstrap: &str, learned: &str) -> Vec<u8> {
        format!(
            r#"{{"name": "rdkafka#consumer-1", "type": "consumer", "brokers": {{
                ":0/internal": {{"name": ":0/internal", "nodeid": -1, "source": "internal", "state": "UP"}},
                "127.0.0.1:9092/bootstrap": {{"name": "127.0.0.1:9092/bootstrap", "nodeid": -1, "source": "configured", "state": "{bootstrap}"}},
                "127.0.0.1:9092/1": {{"name": "127.0.0.1:9092/1", "nodeid": 1, "source": "learned", "state": "{learned}"}}
            }}}}"#
        )
        .into_bytes()
    }

    /// librdkafka's words for each refusal, as its OpenSSL wrote them here.
    #[test]
    fn a_refused_handshake_is_told_from_librdkafkas_words() {
        use crate::tls::TlsError;
        let refusals = super::Refusals::new(&super::Security::default(), "kafka://127.0.0.1:9093");
        let required = "ssl://127.0.0.1:9093/bootstrap: Receive failed: error:0A00045C:SSL \
            routines::tlsv13 alert certificate required: SSL alert number 116 (after 0ms in state \
            APIVERSION_QUERY)";
        assert_eq!(
            refusals.refusal(required),
            Some(TlsError::ClientCertificateRequired)
        );
        let unknown_ca = "ssl://127.0.0.1:9093/bootstrap: SSL handshake failed: error:0A000418:SSL \
            routines::tlsv1 alert unknown ca: SSL alert number 48";
        assert!(matches!(
            refusals.refusal(unknown_ca),
            Some(TlsError::ClientCertificateRefused(_))
        ));
        // Without TLS settings to try a handshake with, the cause stays librdkafka's.
        let unverified = "ssl://127.0.0.1:9093/bootstrap: SSL handshake failed: \
            error:0A000086:SSL routines::certificate verify failed: broker certificate could not \
            be verified (after 1ms in state SSL_HANDSHAKE)";
        assert_eq!(
            refusals.refusal(unverified),
            Some(TlsError::BadCertificate(unverified.to_owned()))
        );
        let plaintext = "ssl://127.0.0.1:9093/bootstrap: SSL handshake failed: Disconnected: \
            connecting to a PLAINTEXT broker listener?";
        assert!(matches!(
            refusals.refusal(plaintext),
            Some(TlsError::Handshake(_))
        ));
        let down = "ssl://127.0.0.1:9093/bootstrap: Connect to ipv4#127.0.0.1:9093 failed: \
            Connection refused";
        assert_eq!(refusals.refusal(down), None);
    }

    #[test]
    fn a_broker_connection_is_up_when_a_broker_but_the_internal_one_says_up() {
        assert_eq!(any_broker_up(&statistics("INIT", "UP")), Some(true));
        assert_eq!(any_broker_up(&statistics("UP", "INIT")), Some(true));
        assert_eq!(any_broker_up(&statistics("DOWN", "CONNECT")), Some(false));
        assert_eq!(any_broker_up(b"not json"), None);
    }
}
