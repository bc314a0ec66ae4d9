//! `broker-kill`: the workload published to a queue of the run's own on a real broker and
//! consumed by a `broker-worker` process, the project's real consumer, SIGKILLed at random
//! moments and, every fourth time, at its failpoint (a message's work committed, the
//! message not yet acknowledged), and restarted, until the broker says that every message
//! was acknowledged. RabbitMQ counts what a queue holds, a Redis group what is pending or
//! unread, a JetStream consumer what is pending or awaits its acknowledgement; Mosquitto
//! says nothing, so an MQTT run waits for every key's effect and then resumes the
//! consumer's session to see what it still holds. A single reader acknowledges nothing to
//! the broker: what it has not done is what comes after the position it stored in the
//! database.

use crate::broker::{failpoint_line, key_index, key_name, sibling};
use crate::report::Report;
use crate::{Args, Rng};
use async_nats::jetstream;
use async_nats::jetstream::consumer::pull;
use futures_util::StreamExt;
use justonce_sql::{Delivered, Delivery, Destination, Key, Offset};
use justonce_tests::{TestBackend, TestDb};
use justonce_transport::KeyFrom;
use justonce_transport::amqp::{AmqpConsumer, AmqpOptions};
use justonce_transport::mqtt::{KEY_PROPERTY, MqttConsumer, MqttDestination};
use justonce_transport::nats::{NatsConsumer, NatsOptions};
use justonce_transport::redis_streams::KEY_FIELD;
use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::{Connection, ConnectionProperties};
use redis::AsyncCommands;
use redis::aio::MultiplexedConnection;
use redis::streams::{
    StreamInfoGroup, StreamInfoGroupsReply, StreamPendingCountReply, StreamRangeReply,
};
use rumqttc::v5::mqttbytes::v5::Packet;
use rumqttc::v5::{AsyncClient, Event};
use std::collections::HashSet;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

/// The brokers `--broker` takes: a `-reader` is the broker's single reader, which keeps its
/// position in the database, instead of its consumer. Kafka's members are readers.
pub const BROKERS: [&str; 7] = [
    "amqp",
    "redis",
    "nats",
    "mqtt",
    "redis-reader",
    "nats-reader",
    "kafka",
];

/// What `broker-kill`, `broker-restart` and `pause` ask of a queue of the run's own on a real
/// broker.
pub trait RealQueue: Sized {
    /// The machine's shared broker, where `broker-kill` and `pause` make their queues.
    fn shared_url() -> String;

    /// Creates the run's queue on the broker at `url`, as the consumer finds it, and
    /// connects to it.
    async fn open<DB: TestBackend>(db: &TestDb<DB>, url: &str) -> Result<Self, String>;

    /// Connects again, after the broker was restarted.
    async fn reconnect(&mut self) -> Result<(), String>;

    /// The broker's URL, as `broker-worker` takes it.
    fn url(&self) -> &str;

    /// The queue's name, as `broker-worker` takes it.
    fn name(&self) -> &str;

    /// How many messages may be published ahead of the consumer; `None`: all at once.
    const AHEAD: Option<usize> = None;

    /// One message per key, in order, with the key where `broker-worker` reads it.
    async fn publish(&self, keys: &[String]) -> Result<(), String>;

    /// Whether no message waits for a consumer to take it; `None` if the broker cannot tell.
    async fn nothing_waiting<DB: TestBackend>(
        &self,
        db: &TestDb<DB>,
    ) -> Result<Option<bool>, String>;

    /// With no consumer running: whether every message was acknowledged.
    async fn settled<DB: TestBackend>(&self, db: &TestDb<DB>) -> Result<bool, String>;

    /// Deliveries made again so far; `None` if the broker does not count them.
    async fn redeliveries(&self) -> Result<Option<u64>, String> {
        Ok(None)
    }

    /// With no consumer running: the key of each message never acknowledged. The queue
    /// may be left without them.
    async fn take_unacknowledged<DB: TestBackend>(
        &self,
        db: &TestDb<DB>,
    ) -> Result<Vec<String>, String>;

    /// `broker-worker`'s kind: `consumer`, or `reader` for a single reader that keeps its
    /// position in the database.
    const KIND: &str = "consumer";

    /// How long a delivery may stay unacknowledged before the broker gives it to another
    /// consumer of the queue; `None` if it never does while the consumer's connection lives.
    const TAKEN_OVER_AFTER: Option<Duration> = None;

    async fn delete(self) -> Result<(), String>;
}

/// A RabbitMQ queue, and its dead-letter queue.
pub struct AmqpQueue {
    url: String,
    name: String,
    connection: Connection,
}

impl AmqpQueue {
    /// The queue's state: messages ready (not delivered to a consumer, or given back), and
    /// consumers.
    async fn state(&self) -> Result<lapin::Queue, String> {
        let channel = self.channel().await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        channel
            .queue_declare(self.name.as_str().into(), passive, Default::default())
            .await
            .map_err(|e| e.to_string())
    }

    /// Messages ready once the broker has seen the consumer go: it gives back what the
    /// consumer held when it drops the consumer, a moment after the process died.
    async fn ready_without_consumers(&self) -> Result<usize, String> {
        let given_up = Instant::now() + Duration::from_secs(10);
        loop {
            let state = self.state().await?;
            if state.consumer_count() == 0 {
                return Ok(state.message_count() as usize);
            }
            if Instant::now() >= given_up {
                return Err("RabbitMQ still counts a consumer that was killed".to_owned());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn channel(&self) -> Result<lapin::Channel, String> {
        self.connection
            .create_channel()
            .await
            .map_err(|e| e.to_string())
    }
}

async fn amqp_connection(url: &str) -> Result<Connection, String> {
    Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("RabbitMQ at {url}: {e}"))
}

/// The name of the run's queue (stream, topic).
fn queue_name<DB: TestBackend>(db: &TestDb<DB>) -> String {
    format!("{}real_queue", db.prefix)
}

impl RealQueue for AmqpQueue {
    fn shared_url() -> String {
        justonce_tests::amqp_url()
    }

    /// Declares the queues as the consumer does.
    async fn open<DB: TestBackend>(db: &TestDb<DB>, url: &str) -> Result<Self, String> {
        let name = queue_name(db);
        let consumer = AmqpConsumer::connect(url, db.inbox.clone(), AmqpOptions::new(&name))
            .await
            .map_err(|e| format!("RabbitMQ at {url}: {e}"))?;
        consumer.close().await.map_err(|e| e.to_string())?;
        Ok(Self {
            url: url.to_owned(),
            name,
            connection: amqp_connection(url).await?,
        })
    }

    async fn reconnect(&mut self) -> Result<(), String> {
        self.connection = amqp_connection(&self.url).await?;
        Ok(())
    }

    fn url(&self) -> &str {
        &self.url
    }

    fn name(&self) -> &str {
        &self.name
    }

    /// The key is the `message_id`; persistent, each confirmed by the broker.
    async fn publish(&self, keys: &[String]) -> Result<(), String> {
        justonce_tests::try_publish_keys(&self.connection, &self.name, keys).await
    }

    async fn nothing_waiting<DB: TestBackend>(
        &self,
        _: &TestDb<DB>,
    ) -> Result<Option<bool>, String> {
        Ok(Some(self.state().await?.message_count() == 0))
    }

    async fn settled<DB: TestBackend>(&self, _: &TestDb<DB>) -> Result<bool, String> {
        Ok(self.ready_without_consumers().await? == 0)
    }

    async fn take_unacknowledged<DB: TestBackend>(
        &self,
        _: &TestDb<DB>,
    ) -> Result<Vec<String>, String> {
        self.ready_without_consumers().await?;
        let channel = self.channel().await?;
        let mut keys = Vec::new();
        while let Some(message) = channel
            .basic_get(self.name.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .map_err(|e| e.to_string())?
        {
            let id = message.delivery.properties.message_id().as_ref();
            keys.push(id.map(ToString::to_string).unwrap_or_default());
        }
        Ok(keys)
    }

    async fn delete(self) -> Result<(), String> {
        let channel = self.channel().await?;
        for queue in [format!("{}.dead", self.name), self.name] {
            channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

/// A Redis stream read by consumer group `test`, and its dead-letter stream.
pub struct RedisStream {
    url: String,
    name: String,
    redis: MultiplexedConnection,
}

impl RedisStream {
    /// The group's state: entries pending (read, not acknowledged), its lag (entries not
    /// yet read; `None` if Redis cannot tell) and the last id it read.
    async fn group(&self) -> Result<StreamInfoGroup, String> {
        let groups: StreamInfoGroupsReply = self
            .redis
            .clone()
            .xinfo_groups(&self.name)
            .await
            .map_err(|e| e.to_string())?;
        groups
            .groups
            .into_iter()
            .find(|group| group.name == "test")
            .ok_or_else(|| "the stream lost its group".to_owned())
    }
}

/// An entry id (`ms-seq`) as numbers: ids do not compare as text.
fn entry_id(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
}

async fn redis_connection(url: &str) -> Result<MultiplexedConnection, String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| format!("Redis at {url}: {e}"))
}

impl RealQueue for RedisStream {
    /// `broker-worker`'s `claim_idle`.
    const TAKEN_OVER_AFTER: Option<Duration> = Some(Duration::from_millis(500));

    fn shared_url() -> String {
        justonce_tests::redis_url()
    }

    /// Creates the stream and its group, reading from the start.
    async fn open<DB: TestBackend>(db: &TestDb<DB>, url: &str) -> Result<Self, String> {
        let mut redis = redis_connection(url).await?;
        let name = queue_name(db);
        let () = redis
            .xgroup_create_mkstream(&name, "test", "0")
            .await
            .map_err(|e| e.to_string())?;
        Ok(Self {
            url: url.to_owned(),
            name,
            redis,
        })
    }

    async fn reconnect(&mut self) -> Result<(), String> {
        self.redis = redis_connection(&self.url).await?;
        Ok(())
    }

    fn url(&self) -> &str {
        &self.url
    }

    fn name(&self) -> &str {
        &self.name
    }

    /// The key is the `key` field.
    async fn publish(&self, keys: &[String]) -> Result<(), String> {
        let mut pipe = redis::pipe();
        for key in keys {
            pipe.xadd(&self.name, "*", &[(KEY_FIELD, key.as_str())])
                .ignore();
        }
        pipe.query_async::<()>(&mut self.redis.clone())
            .await
            .map_err(|e| e.to_string())
    }

    /// The group's lag; Redis may not know it, and then something may wait.
    async fn nothing_waiting<DB: TestBackend>(
        &self,
        _: &TestDb<DB>,
    ) -> Result<Option<bool>, String> {
        Ok(Some(self.group().await?.lag == Some(0)))
    }

    /// A dead consumer's entries stay pending in the group until another claims them.
    async fn settled<DB: TestBackend>(&self, _: &TestDb<DB>) -> Result<bool, String> {
        let group = self.group().await?;
        Ok(group.pending == 0 && group.lag == Some(0))
    }

    async fn take_unacknowledged<DB: TestBackend>(
        &self,
        _: &TestDb<DB>,
    ) -> Result<Vec<String>, String> {
        let mut redis = self.redis.clone();
        let group = self.group().await?;
        let read = entry_id(&group.last_delivered_id);
        let pending: StreamPendingCountReply = redis
            .xpending_count(&self.name, "test", "-", "+", group.pending.max(1))
            .await
            .map_err(|e| e.to_string())?;
        let pending: HashSet<String> = pending.ids.into_iter().map(|entry| entry.id).collect();
        let entries: StreamRangeReply = redis
            .xrange_all(&self.name)
            .await
            .map_err(|e| e.to_string())?;
        Ok(entries
            .ids
            .into_iter()
            .filter(|entry| pending.contains(&entry.id) || entry_id(&entry.id) > read)
            .map(|entry| entry.get::<String>(KEY_FIELD).unwrap_or_default())
            .collect())
    }

    async fn delete(self) -> Result<(), String> {
        let dead = format!("{}.dead", self.name);
        let () = self
            .redis
            .clone()
            .del(&[self.name, dead])
            .await
            .map_err(|e| e.to_string())?;
        Ok(())
    }
}

impl Ordered for RedisStream {
    /// The stream's name, as `RedisStreamReader` stores it.
    fn offset_stream(&self) -> String {
        self.name.clone()
    }

    async fn any_after(&self, after: Option<Offset>) -> Result<bool, String> {
        let next: StreamRangeReply = self
            .redis
            .clone()
            .xrange_count(&self.name, range_after(after), "+", 1)
            .await
            .map_err(|e| e.to_string())?;
        Ok(!next.ids.is_empty())
    }

    async fn keys_after(&self, after: Option<Offset>) -> Result<Vec<String>, String> {
        let entries: StreamRangeReply = self
            .redis
            .clone()
            .xrange(&self.name, range_after(after), "+")
            .await
            .map_err(|e| e.to_string())?;
        Ok(entries
            .ids
            .into_iter()
            .map(|entry| entry.get::<String>(KEY_FIELD).unwrap_or_default())
            .collect())
    }
}

/// The start of an `XRANGE` of the entries after the entry id `<position>-<sequence>`
/// (exclusive, Redis 6.2 and later); from the first entry after `None`.
fn range_after(after: Option<Offset>) -> String {
    after.map_or("-".to_owned(), |offset| {
        format!("({}-{}", offset.position, offset.sequence)
    })
}

/// A JetStream stream with the subject and durable consumer of the same name, and its
/// dead-letter stream, as `broker-worker` reads them.
pub struct NatsStream {
    url: String,
    name: String,
    jetstream: jetstream::Context,
}

/// The header `broker-worker` reads the key from. Not `Nats-Msg-Id`: the stream would drop
/// the second copy of a key published twice as a duplicate within its window.
const NATS_KEY_HEADER: &str = "Order-Id";

/// How long the durable consumer waits for an acknowledgement before it delivers a message
/// again: what a killed consumer held comes back after it.
const NATS_ACK_WAIT: Duration = Duration::from_secs(2);

impl NatsStream {
    async fn stream(&self) -> Result<jetstream::stream::Stream, String> {
        self.jetstream
            .get_stream(&self.name)
            .await
            .map_err(|e| e.to_string())
    }

    async fn consumer(&self) -> Result<jetstream::consumer::Consumer<pull::Config>, String> {
        self.stream()
            .await?
            .get_consumer(&self.name)
            .await
            .map_err(|e| e.to_string())
    }

    /// Messages of the stream the durable consumer has not had acknowledged: those not yet
    /// delivered (`num_pending`) and those delivered and not acknowledged
    /// (`num_ack_pending`). The ack floor alone cannot say, since acknowledgements above it
    /// come in any order; the server's count of its pending acknowledgements can.
    async fn unsettled(&self) -> Result<usize, String> {
        let info = self
            .consumer()
            .await?
            .get_info()
            .await
            .map_err(|e| e.to_string())?;
        Ok(info.num_pending as usize + info.num_ack_pending)
    }
}

async fn nats_connection(url: &str) -> Result<jetstream::Context, String> {
    let client = async_nats::connect(url)
        .await
        .map_err(|e| format!("NATS at {url}: {e}"))?;
    Ok(jetstream::new(client))
}

impl RealQueue for NatsStream {
    const TAKEN_OVER_AFTER: Option<Duration> = Some(NATS_ACK_WAIT);

    fn shared_url() -> String {
        justonce_tests::nats_url()
    }

    /// Creates the streams and the durable consumer with a short ack wait; `broker-worker`
    /// binds to the consumer as it finds it.
    async fn open<DB: TestBackend>(db: &TestDb<DB>, url: &str) -> Result<Self, String> {
        let name = queue_name(db);
        let options = NatsOptions::new(&name, &name)
            .key_from(KeyFrom::Header(NATS_KEY_HEADER.into()))
            .ack_wait(NATS_ACK_WAIT);
        // Connected first: an unreachable server leaves no stream behind.
        let jetstream = nats_connection(url).await?;
        NatsConsumer::connect(url, db.inbox.clone(), options)
            .await
            .map_err(|e| format!("NATS at {url}: {e}"))?;
        Ok(Self {
            url: url.to_owned(),
            name,
            jetstream,
        })
    }

    async fn reconnect(&mut self) -> Result<(), String> {
        self.jetstream = nats_connection(&self.url).await?;
        Ok(())
    }

    fn url(&self) -> &str {
        &self.url
    }

    fn name(&self) -> &str {
        &self.name
    }

    /// The key is the `Order-Id` header; each publish is stored before the next chunk.
    async fn publish(&self, keys: &[String]) -> Result<(), String> {
        for chunk in keys.chunks(500) {
            let mut stored = Vec::with_capacity(chunk.len());
            for key in chunk {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(NATS_KEY_HEADER, key.as_str());
                let ack = self
                    .jetstream
                    .publish_with_headers(self.name.clone(), headers, key.clone().into())
                    .await
                    .map_err(|e| e.to_string())?;
                stored.push(ack);
            }
            for ack in stored {
                ack.await.map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }

    /// Not yet acknowledged, whether delivered or not: a killed consumer's messages come
    /// back only after the ack wait, so the consumer keeps running until they have.
    async fn nothing_waiting<DB: TestBackend>(
        &self,
        _: &TestDb<DB>,
    ) -> Result<Option<bool>, String> {
        Ok(Some(self.unsettled().await? == 0))
    }

    async fn settled<DB: TestBackend>(&self, _: &TestDb<DB>) -> Result<bool, String> {
        Ok(self.unsettled().await? == 0)
    }

    /// The consumer numbers every delivery, a redelivery too, and delivers each message of
    /// the stream (numbered from 1, all on its subject) for the first time in order: the
    /// deliveries past the last message delivered were made again.
    async fn redeliveries(&self) -> Result<Option<u64>, String> {
        let info = self
            .consumer()
            .await?
            .get_info()
            .await
            .map_err(|e| e.to_string())?;
        let delivered = info.delivered;
        Ok(Some(
            delivered
                .consumer_sequence
                .saturating_sub(delivered.stream_sequence),
        ))
    }

    /// Takes what the durable consumer still holds through the consumer itself, each message
    /// acknowledged once its key is read: the server delivers what was never delivered at
    /// once, and what a dead consumer held once its ack wait has passed, until it counts
    /// nothing unacknowledged.
    async fn take_unacknowledged<DB: TestBackend>(
        &self,
        _: &TestDb<DB>,
    ) -> Result<Vec<String>, String> {
        let consumer = self.consumer().await?;
        let given_up = Instant::now() + 3 * NATS_ACK_WAIT + Duration::from_secs(5);
        let mut keys = Vec::new();
        while self.unsettled().await? > 0 {
            if Instant::now() >= given_up {
                return Err("JetStream did not deliver again what it holds".to_owned());
            }
            let mut batch = consumer
                .fetch()
                .max_messages(500)
                .expires(Duration::from_millis(500))
                .messages()
                .await
                .map_err(|e| e.to_string())?;
            while let Some(message) = batch.next().await {
                let message = message.map_err(|e| e.to_string())?;
                let key = (message.headers.as_ref())
                    .and_then(|headers| headers.get(NATS_KEY_HEADER))
                    .map(|key| key.as_str().to_owned())
                    .unwrap_or_default();
                keys.push(key);
                // Confirmed, so that the count above no longer includes it.
                message.double_ack().await.map_err(|e| e.to_string())?;
            }
        }
        Ok(keys)
    }

    async fn delete(self) -> Result<(), String> {
        for name in [format!("{}_DEAD", self.name), self.name] {
            self.jetstream
                .delete_stream(&name)
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

impl Ordered for NatsStream {
    /// `<stream>:<subject>`, as `NatsReader` stores it.
    fn offset_stream(&self) -> String {
        format!("{0}:{0}", self.name)
    }

    /// The stream holds its subject's messages only, numbered from 1.
    async fn any_after(&self, after: Option<Offset>) -> Result<bool, String> {
        Ok(last_sequence(&mut self.stream().await?).await? > read_sequence(after))
    }

    async fn keys_after(&self, after: Option<Offset>) -> Result<Vec<String>, String> {
        let mut stream = self.stream().await?;
        let mut keys = Vec::new();
        for sequence in read_sequence(after) + 1..=last_sequence(&mut stream).await? {
            let message = stream
                .get_raw_message(sequence)
                .await
                .map_err(|e| e.to_string())?;
            let key = (message.headers.get(NATS_KEY_HEADER))
                .map(|key| key.as_str().to_owned())
                .unwrap_or_default();
            keys.push(key);
        }
        Ok(keys)
    }
}

/// The stream sequence number a `NatsReader` stored as its position; 0 before any.
fn read_sequence(after: Option<Offset>) -> u64 {
    after.map_or(0, |offset| offset.position.max(0) as u64)
}

/// The sequence number of the stream's last message.
async fn last_sequence(stream: &mut jetstream::stream::Stream) -> Result<u64, String> {
    let info = stream.info().await.map_err(|e| e.to_string())?;
    Ok(info.state.last_sequence)
}

/// An MQTT topic, consumed on `broker-worker`'s persistent session (client `<topic>-c`,
/// QoS 1).
pub struct MqttTopic {
    url: String,
    name: String,
    publisher: MqttDestination,
}

/// How long Mosquitto keeps the consumer's session while no client holds it, as
/// `justonce_tests::mqtt_options` asks for it.
const MQTT_SESSION_EXPIRY: u32 = 300;

/// How long a resumed session must stay silent before the harness takes it that the broker
/// has sent all it holds for it: it sends them as soon as the session is resumed.
const MQTT_QUIET: Duration = Duration::from_secs(1);

impl MqttTopic {
    /// The broker's host and port.
    fn address(&self) -> Result<(&str, u16), String> {
        let bad_url = || format!("MQTT URL {}: expected mqtt://host[:port]", self.url);
        let address = self.url.strip_prefix("mqtt://").ok_or_else(bad_url)?;
        let (host, port) = address
            .trim_end_matches('/')
            .rsplit_once(':')
            .unwrap_or((address, "1883"));
        Ok((host, port.parse().map_err(|_| bad_url())?))
    }

    /// Connects as the consumer's client id, on its session (`resume`) or a clean one, which
    /// discards it. A resumed session is sent what it holds: messages delivered and never
    /// acknowledged, and those queued for it. Returns their keys once the broker has sent
    /// nothing for [`MQTT_QUIET`], acknowledging each if `acknowledge`; unacknowledged, they
    /// stay in the session.
    async fn session(&self, resume: bool, acknowledge: bool) -> Result<Vec<String>, String> {
        let (host, port) = self.address()?;
        let mut options = rumqttc::v5::MqttOptions::new(format!("{}-c", self.name), host, port);
        options.set_clean_start(!resume).set_manual_acks(true);
        if resume {
            options.set_session_expiry_interval(Some(MQTT_SESSION_EXPIRY));
        }
        let (client, mut events) = AsyncClient::new(options, 64);
        let mut connected = false;
        let mut keys = Vec::new();
        loop {
            let wait = if connected {
                MQTT_QUIET
            } else {
                Duration::from_secs(10)
            };
            let event = match tokio::time::timeout(wait, events.poll()).await {
                Ok(event) => event.map_err(|e| format!("MQTT at {}: {e}", self.url))?,
                Err(_) if connected => return Ok(keys),
                Err(_) => return Err(format!("MQTT at {}: no CONNACK", self.url)),
            };
            match event {
                Event::Incoming(Packet::ConnAck(ack)) => {
                    if resume && !ack.session_present {
                        return Err("Mosquitto lost the consumer's session".to_owned());
                    }
                    if !resume {
                        return Ok(keys);
                    }
                    connected = true;
                }
                Event::Incoming(Packet::Publish(message)) => {
                    let key = (message.properties.as_ref())
                        .and_then(|p| p.user_properties.iter().find(|(n, _)| n == KEY_PROPERTY))
                        .map(|(_, key)| key.clone())
                        .unwrap_or_default();
                    keys.push(key);
                    if acknowledge {
                        client.ack(&message).await.map_err(|e| e.to_string())?;
                    }
                }
                _ => {}
            }
        }
    }
}

impl RealQueue for MqttTopic {
    fn shared_url() -> String {
        justonce_tests::mqtt_url()
    }

    /// Opens the consumer's session and its subscription, so that the broker queues what is
    /// published before the first consumer runs.
    async fn open<DB: TestBackend>(db: &TestDb<DB>, url: &str) -> Result<Self, String> {
        let name = queue_name(db);
        MqttConsumer::connect(url, db.inbox.clone(), justonce_tests::mqtt_options(&name))
            .await
            .map_err(|e| format!("MQTT at {url}: {e}"))?;
        let publisher =
            MqttDestination::new(url, &name, &format!("{name}-p")).map_err(|e| e.to_string())?;
        Ok(Self {
            url: url.to_owned(),
            name,
            publisher,
        })
    }

    /// The publisher opens a new connection on its next delivery after a failure: this
    /// only waits for the broker to listen.
    async fn reconnect(&mut self) -> Result<(), String> {
        let (host, port) = self.address()?;
        tokio::net::TcpStream::connect((host, port))
            .await
            .map(drop)
            .map_err(|e| format!("MQTT at {}: {e}", self.url))
    }

    fn url(&self) -> &str {
        &self.url
    }

    fn name(&self) -> &str {
        &self.name
    }

    /// Mosquitto queues at most 1,000 messages per session (`max_queued_messages`) and
    /// drops the rest: half of that. The rest is margin for the second copies between two
    /// keys' first messages, which the pacing cannot see delivered.
    const AHEAD: Option<usize> = Some(500);

    /// The key is the `key` user property; each publish is acknowledged by the broker
    /// before the next.
    async fn publish(&self, keys: &[String]) -> Result<(), String> {
        for (id, key) in keys.iter().enumerate() {
            let delivery = Delivery {
                id: id as i64,
                key,
                destination: &self.name,
                payload: key.as_bytes(),
                headers: &[],
                attempt: 1,
            };
            match self.publisher.deliver(delivery).await {
                Delivered::Sent => {}
                refused => return Err(format!("MQTT at {}: {refused:?}", self.url)),
            }
        }
        Ok(())
    }

    /// Mosquitto does not say what a session has taken.
    async fn nothing_waiting<DB: TestBackend>(
        &self,
        _: &TestDb<DB>,
    ) -> Result<Option<bool>, String> {
        Ok(None)
    }

    /// Whether the consumer's session, resumed without acknowledging anything, still holds
    /// a message: the broker sends a window of them at once if it holds any.
    async fn settled<DB: TestBackend>(&self, _: &TestDb<DB>) -> Result<bool, String> {
        Ok(self.session(true, false).await?.is_empty())
    }

    async fn take_unacknowledged<DB: TestBackend>(
        &self,
        _: &TestDb<DB>,
    ) -> Result<Vec<String>, String> {
        self.session(true, true).await
    }

    /// Discards the consumer's session with a clean start.
    async fn delete(self) -> Result<(), String> {
        self.session(false, false).await.map(drop)
    }
}

/// A stream read in order, each message at an offset, as a single reader reads it.
trait Ordered: RealQueue {
    /// The name the reader stores its position under.
    fn offset_stream(&self) -> String;

    /// Whether any message comes after `after` (any at all after `None`).
    async fn any_after(&self, after: Option<Offset>) -> Result<bool, String>;

    /// The keys of the messages after `after`.
    async fn keys_after(&self, after: Option<Offset>) -> Result<Vec<String>, String>;
}

/// The stream of `Q` read by a single `broker-worker` reader, which stores its position in
/// the transaction of each message's work and acknowledges nothing to the broker: what
/// waits, and what was never acknowledged, is what comes after the stored position.
struct Read<Q>(Q);

impl<Q: Ordered> Read<Q> {
    async fn stored<DB: TestBackend>(&self, db: &TestDb<DB>) -> Result<Option<Offset>, String> {
        let offsets = db
            .inbox
            .load_offsets(&self.0.offset_stream())
            .await
            .map_err(|e| format!("cannot read the reader's position: {e}"))?;
        Ok(offsets.into_iter().map(|(_, offset)| offset).max())
    }
}

impl<Q: Ordered> RealQueue for Read<Q> {
    const KIND: &str = "reader";

    fn shared_url() -> String {
        Q::shared_url()
    }

    async fn open<DB: TestBackend>(db: &TestDb<DB>, url: &str) -> Result<Self, String> {
        Q::open(db, url).await.map(Self)
    }

    async fn reconnect(&mut self) -> Result<(), String> {
        self.0.reconnect().await
    }

    fn url(&self) -> &str {
        self.0.url()
    }

    fn name(&self) -> &str {
        self.0.name()
    }

    async fn publish(&self, keys: &[String]) -> Result<(), String> {
        self.0.publish(keys).await
    }

    async fn nothing_waiting<DB: TestBackend>(
        &self,
        db: &TestDb<DB>,
    ) -> Result<Option<bool>, String> {
        self.settled(db).await.map(Some)
    }

    async fn settled<DB: TestBackend>(&self, db: &TestDb<DB>) -> Result<bool, String> {
        Ok(!self.0.any_after(self.stored(db).await?).await?)
    }

    async fn take_unacknowledged<DB: TestBackend>(
        &self,
        db: &TestDb<DB>,
    ) -> Result<Vec<String>, String> {
        self.0.keys_after(self.stored(db).await?).await
    }

    async fn delete(self) -> Result<(), String> {
        self.0.delete().await
    }
}

/// The consumer process, replaced by a new one when it is killed.
pub struct Consumer<'a, DB: TestBackend> {
    db: &'a TestDb<DB>,
    /// The queue's broker URL, name and `broker-worker` kind.
    url: String,
    name: String,
    kind: &'static str,
    /// `broker-worker`'s mode: `run`, or a deliberately broken one.
    mode: &'a str,
    running: Option<Child>,
    /// The lines the running consumer printed, as it prints them.
    printed: Option<tokio::sync::mpsc::UnboundedReceiver<String>>,
}

impl<'a, DB: TestBackend> Consumer<'a, DB> {
    /// A consumer of `queue` in `mode`, not started.
    pub fn of<Q: RealQueue>(db: &'a TestDb<DB>, queue: &Q, mode: &'a str) -> Self {
        Self {
            db,
            url: queue.url().to_owned(),
            name: queue.name().to_owned(),
            kind: Q::KIND,
            mode,
            running: None,
            printed: None,
        }
    }

    /// Starts the consumer; in mode `run` it prints its counts when it is terminated.
    pub fn start(&mut self) -> Result<(), String> {
        use tokio::io::{AsyncBufReadExt, BufReader};
        let mut child = self.spawn(self.mode, Stdio::piped())?;
        let stdout = child.stdout.take().ok_or("broker-worker's output")?;
        let (line, printed) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(printed)) = lines.next_line().await {
                if line.send(printed).is_err() {
                    break;
                }
            }
        });
        self.running = Some(child);
        self.printed = Some(printed);
        Ok(())
    }

    /// The next line the running consumer prints, by `deadline`.
    async fn next_line(&mut self, deadline: Instant) -> Result<String, String> {
        let printed = self.printed.as_mut().ok_or("no consumer runs")?;
        tokio::time::timeout_at(deadline.into(), printed.recv())
            .await
            .map_err(|_| "the consumer printed nothing in time".to_owned())?
            .ok_or_else(|| "the consumer exited".to_owned())
    }

    /// Waits until a consumer in mode `run-pausing`, asked with SIGUSR1, has stopped itself
    /// with SIGSTOP holding its next delivery; the delivery's key.
    pub async fn paused(&mut self, deadline: Instant) -> Result<String, String> {
        let line = self.next_line(deadline).await?;
        let key = line
            .strip_prefix("paused ")
            .ok_or_else(|| format!("the consumer printed {line:?}, not that it paused"))?
            .to_owned();
        let pid = (self.running.as_ref())
            .and_then(Child::id)
            .ok_or("no consumer runs")?;
        // It says so just before it stops.
        loop {
            let status = justonce_tests::process_status(pid).ok_or("the consumer exited")?;
            if status.first().is_some_and(|state| state == "T") {
                return Ok(key);
            }
            if Instant::now() >= deadline {
                return Err("the consumer did not stop at its failpoint in time".to_owned());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits until the running consumer catches SIGUSR1: sent earlier, while it still
    /// connects, the signal would end it.
    pub async fn catching_usr1(&self, deadline: Instant) -> Result<(), String> {
        const SIGUSR1: u64 = 1 << (10 - 1);
        let pid = (self.running.as_ref())
            .and_then(Child::id)
            .ok_or("no consumer runs")?;
        loop {
            let status = justonce_tests::process_status(pid).ok_or("the consumer exited")?;
            // `sigcatch`, field 34 of /proc/<pid>/stat: the 32nd after the command's name.
            let caught: u64 = status
                .get(31)
                .and_then(|field| field.parse().ok())
                .unwrap_or(0);
            if caught & SIGUSR1 != 0 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err("the consumer did not catch SIGUSR1 in time".to_owned());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Starts the consumer again if it exited on its own, as a consumer does when its
    /// broker goes away; true if it did.
    pub fn restart_if_exited(&mut self) -> Result<bool, String> {
        let exited = match &mut self.running {
            Some(child) => child.try_wait().map_err(|e| e.to_string())?.is_some(),
            None => true,
        };
        if exited {
            self.start()?;
        }
        Ok(exited)
    }

    /// Sends `signal` (`STOP`, `CONT`) to the running consumer.
    pub async fn signal(&self, signal: &str) -> Result<(), String> {
        let pid = (self.running.as_ref())
            .and_then(Child::id)
            .ok_or("no consumer runs")?;
        let status = Command::new("kill")
            .args([format!("-{signal}"), pid.to_string()])
            .status()
            .await
            .map_err(|e| e.to_string())?;
        status
            .success()
            .then_some(())
            .ok_or_else(|| format!("cannot send SIG{signal} to the consumer"))
    }

    /// Stops the consumer with SIGTERM, and returns its counts: how many deliveries it
    /// acknowledged as processed and as duplicates.
    pub async fn terminate(&mut self) -> Result<(u64, u64), String> {
        self.signal("TERM").await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut printed = Vec::new();
        let counts = loop {
            let line = self.next_line(deadline).await.map_err(|e| {
                format!("the consumer printed no counts on SIGTERM ({e}): {printed:?}")
            })?;
            if let Some(counts) = line.strip_prefix("processed ") {
                break counts.to_owned();
            }
            printed.push(line);
        };
        if let Some(mut child) = self.running.take() {
            tokio::time::timeout_at(deadline.into(), child.wait())
                .await
                .map_err(|_| "the consumer did not stop on SIGTERM".to_owned())?
                .map_err(|e| e.to_string())?;
        }
        // `<processed> duplicates <duplicates>`
        let counts: Vec<u64> = (counts.split_whitespace())
            .filter_map(|word| word.parse().ok())
            .collect();
        match counts.as_slice() {
            [processed, duplicates] => Ok((*processed, *duplicates)),
            _ => Err(format!("the consumer printed no counts: {counts:?}")),
        }
    }

    /// Starts a consumer armed to stop at its failpoint, and returns once it has: it took
    /// one message, committed its work, and will never acknowledge it.
    async fn start_to_failpoint(&mut self) -> Result<(), String> {
        let mut child = self.spawn("pause-after-commit", Stdio::piped())?;
        let stdout = child.stdout.take().ok_or("broker-worker's output")?;
        self.running = Some(child);
        self.printed = None;
        match failpoint_line(stdout, "broker-worker").await? {
            Some(line) if line.starts_with("committed ") => Ok(()),
            other => Err(format!(
                "broker-worker stopped before its failpoint: {other:?}"
            )),
        }
    }

    fn spawn(&self, mode: &str, stdout: Stdio) -> Result<Child, String> {
        Command::new(sibling("broker-worker"))
            .args([
                &self.db.url,
                &self.db.prefix,
                &self.url,
                &self.name,
                self.kind,
                mode,
            ])
            .stdout(stdout)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start broker-worker: {e}"))
    }

    /// SIGKILLs the consumer and waits until it is gone: what it held goes back to the
    /// queue.
    pub async fn kill(&mut self) -> Result<(), String> {
        if let Some(mut child) = self.running.take() {
            child
                .kill()
                .await
                .map_err(|e| format!("cannot kill the consumer: {e}"))?;
        }
        Ok(())
    }

    /// An error if the consumer exited on its own: it failed.
    fn failed(&mut self) -> Result<(), String> {
        if let Some(child) = &mut self.running
            && let Some(status) = child.try_wait().map_err(|e| e.to_string())?
        {
            return Err(format!("broker-worker exited on its own: {status}"));
        }
        Ok(())
    }
}

/// `broker-kill` on the broker of `--broker`.
pub async fn broker_kill<DB: TestBackend>(
    args: &Args,
    db: &TestDb<DB>,
    rng: &mut Rng,
    title: String,
) -> Result<Report, String> {
    match args.broker.as_str() {
        "redis" => kill_consumer::<DB, RedisStream>(args, db, rng, title).await,
        "nats" => kill_consumer::<DB, NatsStream>(args, db, rng, title).await,
        "mqtt" => kill_consumer::<DB, MqttTopic>(args, db, rng, title).await,
        "redis-reader" => kill_consumer::<DB, Read<RedisStream>>(args, db, rng, title).await,
        "nats-reader" => kill_consumer::<DB, Read<NatsStream>>(args, db, rng, title).await,
        "amqp" => kill_consumer::<DB, AmqpQueue>(args, db, rng, title).await,
        other => Err(format!(
            "broker-kill does not run on {other}: a Kafka member is killed by group-kill"
        )),
    }
}

/// Publishes `keys` distinct keys, a tenth of them twice, shuffled; runs the consumer,
/// killing it at random moments and at its failpoint, until the queue is settled; and
/// compares the broker's account with the effect rows.
async fn kill_consumer<DB: TestBackend, Q: RealQueue>(
    args: &Args,
    db: &TestDb<DB>,
    rng: &mut Rng,
    title: String,
) -> Result<Report, String> {
    let keys = args.size(2_000, 20_000);
    let kills = args.size(10, 100);
    let deadline = Instant::now() + Duration::from_secs(args.size(50, 900) as u64);
    let mut plan: Vec<u32> = (0..keys as u32).chain(0..keys as u32 / 10).collect();
    rng.shuffle(&mut plan);
    let queue = Q::open(db, &Q::shared_url()).await?;
    let mode = if args.mode == "correct" {
        args.run_mode()
    } else {
        &args.mode
    };
    let mut consumer = Consumer::of(db, &queue, mode);
    let checked = async {
        let messages: Vec<String> = plan.iter().map(|key| key_name(*key)).collect();
        let published = AtomicUsize::new(0);
        if Q::AHEAD.is_none() {
            queue.publish(&messages).await?;
            published.store(messages.len(), Ordering::Relaxed);
        }
        let publishing = async {
            match Q::AHEAD {
                Some(ahead) => publish_paced(&queue, db, &plan, ahead, &published, deadline).await,
                None => Ok(()),
            }
        };

        // Kill points: after random numbers of effects, well inside the run so that there is
        // work left to recover to, plus a few random milliseconds so that the consumer is
        // caught at any point of a delivery. Every fourth kill is at the failpoint instead,
        // of a consumer started in its place, and takes the next point's place.
        let mut points: Vec<i64> = (0..kills)
            .map(|_| (keys / 20 + rng.below(keys as u64 * 17 / 20) as usize) as i64)
            .collect();
        points.sort_unstable();
        let effects = async || db.rows("effects").await;
        let armed = args.mode == "correct";
        let consuming = async {
            consumer.start()?;
            let mut faults = 0;
            let mut at_failpoint = 0;
            let mut recovery = Vec::new();
            let mut drained = false;
            let mut quiet_since = None;
            let mut last_effect = (0, Instant::now());
            let mut points = points.into_iter().peekable();
            while Instant::now() < deadline {
                consumer.failed()?;
                let committed = effects().await;
                if committed != last_effect.0 {
                    last_effect = (committed, Instant::now());
                }
                let all_published = published.load(Ordering::Relaxed) == messages.len();
                if points.next_if(|point| committed >= *point).is_some() {
                    tokio::time::sleep(Duration::from_millis(rng.below(10))).await;
                    // When each kill not yet recovered from began.
                    let mut unrecovered = vec![Instant::now()];
                    consumer.kill().await?;
                    faults += 1;
                    if armed && faults % 4 == 3 && points.next().is_some() {
                        let before = effects().await;
                        consumer.start_to_failpoint().await?;
                        // The consumer started at the failpoint recovered if its commit
                        // was an effect; not if it was a duplicate's.
                        if effects().await > before {
                            recovery.extend(unrecovered.drain(..).map(|began| began.elapsed()));
                        }
                        unrecovered.push(Instant::now());
                        consumer.kill().await?;
                        faults += 1;
                        at_failpoint += 1;
                    }
                    consumer.start()?;
                    // Recovered at the next effect committed after the kill: the new consumer's.
                    // A kill with nothing left to commit has no recovery.
                    let before = effects().await;
                    let given_up = Instant::now() + Duration::from_secs(10);
                    while Instant::now() < given_up.min(deadline) {
                        if effects().await > before {
                            recovery.extend(unrecovered.iter().map(|began| began.elapsed()));
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                } else if points.peek().is_none()
                    && all_published
                    && match queue.nothing_waiting(db).await? {
                        Some(nothing) => nothing,
                        // A broker that cannot tell what waits: a key without its effect may,
                        // unless no effect has come for a while (a broken consumer's lost key).
                        None => committed as usize >= keys || last_effect.1.elapsed() >= STALLED,
                    }
                {
                    // Nothing is waiting: once that has held long enough for the consumer to
                    // acknowledge what it took, stop it, and the broker counts what it left
                    // unacknowledged. Anything left is delivered again to a new consumer.
                    let quiet = *quiet_since.get_or_insert_with(Instant::now);
                    if quiet.elapsed() >= Duration::from_millis(300) {
                        consumer.kill().await?;
                        if queue.settled(db).await? {
                            drained = true;
                            break;
                        }
                        consumer.start()?;
                        quiet_since = None;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                } else {
                    quiet_since = None;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            Ok::<_, String>((faults, at_failpoint, recovery, drained))
        };
        let ((), (faults, at_failpoint, recovery, drained)) =
            tokio::try_join!(publishing, consuming)?;
        consumer.kill().await?;
        // Counted before the harness takes anything itself.
        let redeliveries = queue.redeliveries().await?;
        // What the broker still holds was never acknowledged.
        let mut acknowledged = vec![true; keys];
        for key in queue.take_unacknowledged(db).await? {
            let index = key_index(&key).ok_or_else(|| format!("the queue held key {key:?}"))?;
            acknowledged[index as usize] = false;
        }
        let effects = DB::effect_counts(db.inbox.pool(), &db.prefix)
            .await
            .map_err(|e| format!("cannot read the effect rows: {e}"))?;
        let mut report =
            Report::compare(title, plan.len(), &vec![true; keys], &acknowledged, effects);
        report.redeliveries = redeliveries;
        report.faults = faults;
        report.recovery = recovery;
        report.drained = drained;
        report.details = vec![(
            format!(
                "kills at the failpoint ({})",
                justonce_tests::WORKER_FAILPOINT
            ),
            at_failpoint,
        )];
        Ok(report)
    }
    .await;
    // Whatever happened, the queue goes, and the consumer before it: one that has just
    // started would declare the queue again.
    let stopped = consumer.kill().await;
    drop(consumer);
    let deleted = queue
        .delete()
        .await
        .map_err(|e| format!("cannot delete the queue: {e}"));
    crate::cleaned_up(crate::cleaned_up(checked, stopped), deleted)
}

/// How long without a new effect before the harness looks in a broker that cannot tell what
/// waits for what is left.
pub const STALLED: Duration = Duration::from_secs(2);

/// The latest position in the plan at which a key with an effect was first published.
async fn furthest_effect<DB: TestBackend>(
    db: &TestDb<DB>,
    first_at: &[Option<usize>],
) -> Result<Option<usize>, String> {
    let effects = DB::effect_counts(db.inbox.pool(), &db.prefix)
        .await
        .map_err(|e| format!("cannot read the effect rows: {e}"))?;
    Ok(effects
        .iter()
        .filter_map(|(key, _)| first_at.get(key_index(key)? as usize).copied().flatten())
        .max())
}

/// Publishes the messages of `plan` in chunks, never more than about `ahead` past what the
/// consumer was delivered, counting them in `published`; gives up at `deadline`.
///
/// The broker delivers a session's messages in the order they were published, so a key's
/// effect means that its first message, and every message before it, was delivered. The
/// chunk that would take the count more than `ahead` past a message waits for the effect
/// of the latest first message at or before it; the second copies between the two are
/// the slack. A key a broken consumer lost has no effect; a later key's effect shows that
/// it was delivered all the same. Had the broker delivered out of order and dropped what
/// passed its limit, the dropped keys would be reported lost: a pacing error fails the run,
/// it never passes one.
async fn publish_paced<DB: TestBackend, Q: RealQueue>(
    queue: &Q,
    db: &TestDb<DB>,
    plan: &[u32],
    ahead: usize,
    published: &AtomicUsize,
    deadline: Instant,
) -> Result<(), String> {
    let mut first_at: Vec<Option<usize>> = vec![None; plan.len()];
    let mut latest = None;
    // For each position, the key of the latest first message of a key at or before it.
    let latest_first: Vec<Option<u32>> = plan
        .iter()
        .enumerate()
        .map(|(position, key)| {
            if first_at[*key as usize].is_none() {
                first_at[*key as usize] = Some(position);
                latest = Some(*key);
            }
            latest
        })
        .collect();
    for start in (0..plan.len()).step_by(100) {
        let end = (start + 100).min(plan.len());
        let delivered = end.checked_sub(ahead + 1).and_then(|due| latest_first[due]);
        if let Some(index) = delivered {
            let key = Key::new(key_name(index)).map_err(|e| e.to_string())?;
            let mut polls = 0_u32;
            while db.effects_of(&key).await == 0 {
                polls += 1;
                // Every 200th poll, a second or more apart, the costlier look at every key.
                if polls.is_multiple_of(200)
                    && furthest_effect(db, &first_at).await? >= first_at[index as usize]
                {
                    break;
                }
                if Instant::now() >= deadline {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        let messages: Vec<String> = plan[start..end].iter().map(|key| key_name(*key)).collect();
        queue.publish(&messages).await?;
        published.store(end, Ordering::Relaxed);
    }
    Ok(())
}
