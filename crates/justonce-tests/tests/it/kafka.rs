//! The Kafka reader and the relay's producer against a real Kafka-protocol broker, with the
//! keys and offsets on each real database: failing work run again in place then
//! dead-lettered with its reason, the id required of the configuration, and the relay's
//! records seen once each with their key. The proofs every broker shares are in `broker`.

use super::broker::{TestBroker, consume_until, read_to_end};
use super::on_every_database;
use justonce_sql::{Delivered, Delivery, Destination, Key};
use justonce_tests::{TestBackend, TestDb, kafka_url};
use justonce_transport::kafka::{
    IDEMPOTENCY_KEY_HEADER, KafkaDestination, KafkaOptions, KafkaReader,
};
use justonce_transport::{ConsumerStats, KeyFrom, REASON_HEADER};
use rdkafka::TopicPartitionList;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use std::sync::Arc;
use std::time::Duration;

on_every_database!(
    failing_work_runs_again_in_place_then_is_dead_lettered_with_the_reason,
    the_relay_produces_each_row_once_with_its_key_as_record_key_and_header,
);

/// The header the tests' records carry their id in, as CloudEvents' binary mode does.
const ID_HEADER: &str = "ce_id";

/// The group's session timeout in the tests: a member killed by a test is replaced after it.
const SESSION_TIMEOUT: Duration = Duration::from_secs(3);

/// The bootstrap servers of the test broker, as librdkafka takes them.
fn servers() -> String {
    kafka_url().trim_start_matches("kafka://").to_owned()
}

fn client_config() -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", servers());
    config
}

/// A topic named after the test's prefix, with one partition, and its dead-letter topic;
/// deleted at the end.
pub(crate) struct Topic {
    name: String,
    admin: AdminClient<DefaultClientContext>,
    producer: FutureProducer,
    /// Asks for the partitions' high watermarks.
    client: Arc<BaseConsumer>,
}

impl Topic {
    async fn create<DB: TestBackend>(db: &TestDb<DB>) -> Self {
        let name = format!("{}orders", db.prefix);
        let admin: AdminClient<DefaultClientContext> = client_config().create().unwrap();
        let dead = format!("{name}.dead");
        let topics =
            [&name, &dead].map(|topic| NewTopic::new(topic, 1, TopicReplication::Fixed(1)));
        for created in admin
            .create_topics(&topics, &AdminOptions::new())
            .await
            .unwrap_or_else(|e| panic!("Kafka at {}: {e}", kafka_url()))
        {
            created.unwrap_or_else(|(topic, e)| panic!("creating {topic}: {e}"));
        }
        let producer = client_config()
            .set("enable.idempotence", "true")
            .create()
            .unwrap();
        let client = Arc::new(client_config().create().unwrap());
        Self {
            name,
            admin,
            producer,
            client,
        }
    }

    /// Produces `body` with the id in the `ce_id` header (and a Kafka key naming the entity,
    /// shared by many records) and waits for the broker to acknowledge it.
    async fn produce(&self, id: Option<&str>, body: &[u8]) {
        let mut headers = OwnedHeaders::new();
        if let Some(id) = id {
            headers = headers.insert(Header {
                key: ID_HEADER,
                value: Some(id),
            });
        }
        let record = FutureRecord::to(&self.name)
            .key("customer:1")
            .payload(body)
            .headers(headers);
        self.producer
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| e)
            .unwrap();
    }

    /// The high watermark of partition 0 of `topic`: how many records it has held.
    async fn high_watermark(&self, topic: String) -> i64 {
        let client = Arc::clone(&self.client);
        tokio::task::spawn_blocking(move || {
            client
                .fetch_watermarks(&topic, 0, Duration::from_secs(10))
                .unwrap()
                .1
        })
        .await
        .unwrap()
    }

    /// The records of the dead-letter topic, read from its start by a consumer of its own.
    async fn dead_letters(&self, count: usize) -> Vec<OwnedMessage> {
        read_records(&format!("{}.dead", self.name), count).await
    }

    /// The partition's last offset, and the reader's stored offset.
    async fn positions<DB: TestBackend>(&self, db: &TestDb<DB>) -> (i64, Option<i64>) {
        let last = self.high_watermark(self.name.clone()).await - 1;
        let stored = db.inbox.load_offsets(&self.name).await.unwrap();
        (last, stored.first().map(|(_, offset)| offset.position))
    }

    async fn remove(self) {
        let dead = format!("{}.dead", self.name);
        self.admin
            .delete_topics(&[&self.name, &dead], &AdminOptions::new())
            .await
            .unwrap();
    }
}

/// Reads `count` records of partition 0 of `topic` from its start, as a plain consumer does
/// (assigned the partition: no group to join).
async fn read_records(topic: &str, count: usize) -> Vec<OwnedMessage> {
    let consumer: StreamConsumer = client_config()
        .set("group.id", format!("{topic}-reader"))
        .create()
        .unwrap();
    let mut partition = TopicPartitionList::new();
    partition
        .add_partition_offset(topic, 0, rdkafka::Offset::Beginning)
        .unwrap();
    consumer.assign(&partition).unwrap();
    let mut records = Vec::with_capacity(count);
    while records.len() < count {
        let record = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{} of {count} records of {topic}, then none for 30 s",
                    records.len()
                )
            })
            .unwrap();
        records.push(record.detach());
    }
    records
}

fn header(record: &OwnedMessage, name: &str) -> Option<String> {
    let headers = record.headers()?;
    let found = headers.iter().find(|header| header.key == name)?;
    Some(String::from_utf8(found.value?.to_vec()).unwrap())
}

fn options(topic: &Topic) -> KafkaOptions {
    KafkaOptions::new(&topic.name, &topic.name)
        .key_from(KeyFrom::Header(ID_HEADER.into()))
        .session_timeout(SESSION_TIMEOUT)
}

async fn failing_work_runs_again_in_place_then_is_dead_lettered_with_the_reason<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let topic = Topic::create(&db).await;
    topic.produce(Some("fail1:order"), b"fail1:order").await;
    topic.produce(Some("bad:order"), b"bad:order").await;
    topic.produce(None, b"no id").await;
    topic.produce(Some("order:after"), b"order:after").await;
    let reader = KafkaReader::connect(
        &kafka_url(),
        db.inbox.clone(),
        options(&topic).max_attempts(2),
    )
    .unwrap();
    let stats = consume_until(&db, &reader, || topic.settled(&db)).await;
    assert_eq!(
        (stats.processed, stats.retried, stats.dead_lettered),
        (2, 2, 2),
        "{stats:?}"
    );
    for (key, effects) in [("fail1:order", 1), ("bad:order", 0), ("order:after", 1)] {
        assert_eq!(
            db.effects_of(&Key::new(key).unwrap()).await,
            effects,
            "{key}"
        );
    }
    let letters = topic.dead_letters(2).await;
    assert_eq!(letters[0].payload(), Some(b"bad:order".as_slice()));
    assert_eq!(letters[0].key(), Some(b"customer:1".as_slice()));
    let reason = header(&letters[0], REASON_HEADER).unwrap();
    assert!(reason.contains("attempt 2: "), "{reason}");
    assert_eq!(letters[1].payload(), Some(b"no id".as_slice()));
    let reason = header(&letters[1], REASON_HEADER).unwrap();
    assert_eq!(reason, "the record has no header ce_id");
    assert_eq!(topic.positions(&db).await, (3, Some(3)));
    drop(reader);
    topic.remove().await;
    db.cleanup().await;
}

/// The relay's destination produces each row with its key as the record's key and in the
/// `idempotency-key` header; a plain consumer sees each row once.
async fn the_relay_produces_each_row_once_with_its_key_as_record_key_and_header<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let topic = Topic::create(&db).await;
    let destination = KafkaDestination::new(&kafka_url(), &topic.name);
    let headers = [("content-type".to_owned(), "application/json".to_owned())];
    for n in 0..3 {
        let key = format!("billing:invoice:{n}");
        let payload = format!("{{\"invoice\":{n}}}");
        let delivery = Delivery {
            id: n,
            key: &key,
            destination: "invoices",
            payload: payload.as_bytes(),
            headers: &headers,
            attempt: 1,
        };
        assert_eq!(destination.deliver(delivery).await, Delivered::Sent);
    }
    let records = read_records(&topic.name, 3).await;
    for (n, record) in records.iter().enumerate() {
        let key = format!("billing:invoice:{n}");
        assert_eq!(record.key(), Some(key.as_bytes()));
        assert_eq!(
            header(record, IDEMPOTENCY_KEY_HEADER).as_deref(),
            Some(key.as_str())
        );
        assert_eq!(
            header(record, "content-type").as_deref(),
            Some("application/json")
        );
        assert_eq!(
            record.payload(),
            Some(format!("{{\"invoice\":{n}}}").as_bytes())
        );
    }
    assert_eq!(
        topic.high_watermark(topic.name.clone()).await,
        3,
        "each row once"
    );
    topic.remove().await;
    db.cleanup().await;
}

/// The configuration must say where the id is: a record's Kafka key names an entity.
#[tokio::test]
async fn a_reader_without_an_id_setting_is_refused_with_a_typed_error() {
    let db = TestDb::<justonce_sql::sqlx::Sqlite>::new("kafka_no_id").await;
    let refused = KafkaReader::connect(
        &kafka_url(),
        db.inbox.clone(),
        KafkaOptions::new("orders", "billing"),
    );
    match refused {
        Err(justonce_transport::Error::Config(reason)) => {
            assert!(reason.contains("carries no message id"), "{reason}")
        }
        other => panic!("not refused as configuration: {other:?}"),
    }
    db.cleanup().await;
}

impl TestBroker for Topic {
    type Consumer<DB: TestBackend> = KafkaReader<DB>;
    const KEEPS_OFFSET: bool = true;

    fn url() -> String {
        kafka_url()
    }

    async fn open<DB: TestBackend>(db: &TestDb<DB>) -> Self {
        Topic::create(db).await
    }

    fn name(&self) -> &str {
        &self.name
    }

    async fn publish(&self, keys: &[String]) {
        for key in keys {
            self.produce(Some(key), b"x").await;
        }
    }

    async fn connect<DB: TestBackend>(&self, db: &TestDb<DB>) -> KafkaReader<DB> {
        KafkaReader::connect(&kafka_url(), db.inbox.clone(), options(self)).unwrap()
    }

    async fn consume<DB: TestBackend>(
        &self,
        reader: &KafkaReader<DB>,
        db: &TestDb<DB>,
        count: usize,
    ) -> ConsumerStats {
        read_to_end(self, reader, db, count).await
    }

    async fn settled<DB: TestBackend>(&self, db: &TestDb<DB>) -> bool {
        match self.positions(db).await {
            (-1, _) => true,
            (last, stored) => stored == Some(last),
        }
    }

    async fn delete(self) {
        self.remove().await
    }
}
