//! The Kafka reader and the relay's producer against a real Kafka-protocol broker, with the
//! keys and offsets on each real database: failing work run again in place then
//! dead-lettered with its reason, the id required of the configuration, and the relay's
//! records seen once each with their key. The proofs every broker shares are in `broker`.

use super::broker::{Batching, TestBroker, consume_until, effects, read_to_end};
use super::on_every_database;
use super::run_until;
use justonce_sql::{Delivered, Delivery, Destination, Inbox, Key};
use justonce_tests::{TestBackend, TestDb, consumer_work, kafka_url};
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
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

on_every_database!(
    failing_work_runs_again_in_place_then_is_dead_lettered_with_the_reason,
    the_relay_produces_each_row_once_with_its_key_as_record_key_and_header,
    a_batch_stores_the_offset_of_its_last_record_in_each_partition,
    two_members_running_batches_through_rebalances_take_effect_once_per_key,
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

/// A topic named after the test's prefix, with one partition unless the test asks for
/// more, and its dead-letter topic; deleted at the end.
pub(crate) struct Topic {
    name: String,
    admin: AdminClient<DefaultClientContext>,
    producer: FutureProducer,
    /// Asks for the partitions' high watermarks.
    client: Arc<BaseConsumer>,
}

impl Topic {
    async fn create<DB: TestBackend>(db: &TestDb<DB>) -> Self {
        Self::with_partitions(db, 1).await
    }

    async fn with_partitions<DB: TestBackend>(db: &TestDb<DB>, partitions: i32) -> Self {
        let name = format!("{}orders", db.prefix);
        let admin: AdminClient<DefaultClientContext> = client_config().create().unwrap();
        let dead = format!("{name}.dead");
        let topics = [(&name, partitions), (&dead, 1)]
            .map(|(topic, count)| NewTopic::new(topic, count, TopicReplication::Fixed(1)));
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
        self.produce_to(None, id, body).await
    }

    /// [`Topic::produce`] into `partition`, or the one the record's Kafka key picks.
    async fn produce_to(&self, partition: Option<i32>, id: Option<&str>, body: &[u8]) {
        let mut headers = OwnedHeaders::new();
        if let Some(id) = id {
            headers = headers.insert(Header {
                key: ID_HEADER,
                value: Some(id),
            });
        }
        let mut record = FutureRecord::to(&self.name)
            .key("customer:1")
            .payload(body)
            .headers(headers);
        if let Some(partition) = partition {
            record = record.partition(partition);
        }
        self.producer
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| e)
            .unwrap();
    }

    /// The high watermark of partition 0 of `topic`: how many records it has held.
    async fn high_watermark(&self, topic: String) -> i64 {
        self.high_watermark_of(topic, 0).await
    }

    /// The high watermark of `partition` of `topic`.
    async fn high_watermark_of(&self, topic: String, partition: i32) -> i64 {
        let client = Arc::clone(&self.client);
        tokio::task::spawn_blocking(move || {
            client
                .fetch_watermarks(&topic, partition, Duration::from_secs(10))
                .unwrap()
                .1
        })
        .await
        .unwrap()
    }

    /// The last offset of each of the first `partitions` partitions, and the reader's stored
    /// offsets, by partition.
    async fn all_positions<DB: TestBackend>(
        &self,
        db: &TestDb<DB>,
        partitions: i32,
    ) -> (BTreeMap<i32, i64>, BTreeMap<i32, i64>) {
        let mut last = BTreeMap::new();
        for partition in 0..partitions {
            let high = self.high_watermark_of(self.name.clone(), partition).await;
            last.insert(partition, high - 1);
        }
        (last, stored_offsets(db, &self.name).await)
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

/// The reader's stored offset of each partition of `topic`.
async fn stored_offsets<DB: TestBackend>(db: &TestDb<DB>, topic: &str) -> BTreeMap<i32, i64> {
    let stored = db.inbox.load_offsets(topic).await.unwrap();
    (stored.into_iter())
        .map(|(partition, offset)| (partition, offset.position))
        .collect()
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

/// Records of three partitions, 24 keys over 30 records, taken in batches as they come and
/// run with `run_batch`: after each batch, the stored offset of each partition it held is
/// that of its last record there; in the end, each partition's last, with one effect per
/// key.
async fn a_batch_stores_the_offset_of_its_last_record_in_each_partition<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let topic = Topic::with_partitions(&db, 3).await;
    for n in 0..30 {
        let key = format!("order:{}", n % 24);
        topic.produce_to(Some(n % 3), Some(&key), b"x").await;
    }
    let reader = KafkaReader::connect(&kafka_url(), db.inbox.clone(), options(&topic)).unwrap();
    let work = consumer_work::<DB>(&db.prefix);
    let mut stats = ConsumerStats::default();
    let mut records = reader.deliveries().await.unwrap();
    let mut taken = 0;
    while taken < 30 {
        let first = tokio::time::timeout(Duration::from_secs(30), records.next())
            .await
            .unwrap_or_else(|_| panic!("{taken} of 30 records, then none for 30 s"))
            .unwrap()
            .expect("the reader is not cancelled");
        let batch = records.more(first, 20).await.unwrap();
        let mut last = BTreeMap::new();
        for record in &batch {
            let offset = last.entry(record.partition()).or_insert(record.offset());
            assert!(*offset <= record.offset(), "each partition in order");
            *offset = record.offset();
        }
        let done = reader.run_batch(&batch, &work, &mut stats).await.unwrap();
        assert_eq!(done, batch.len(), "the database answered");
        let stored = stored_offsets(&db, &topic.name).await;
        for (partition, offset) in &last {
            assert_eq!(stored.get(partition), Some(offset), "partition {partition}");
        }
        taken += batch.len();
    }
    assert_eq!((stats.processed, stats.duplicates), (24, 6), "{stats:?}");
    assert_eq!(db.rows("effects").await, 24);
    assert_eq!(db.doubled_effects().await, 0);
    let (last, stored) = topic.all_positions(&db, 3).await;
    assert_eq!(stored, last, "each partition's last record");
    records.stop().await.unwrap();
    drop(reader);
    topic.remove().await;
    db.cleanup().await;
}

/// Two member processes of one group read a topic of three partitions in batches, the
/// second joining while the first runs, so that the group takes partitions back from the
/// first and hands them out again: every key takes effect once, and the stored offsets
/// reach each partition's last record.
async fn two_members_running_batches_through_rebalances_take_effect_once_per_key<
    DB: TestBackend,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let topic = Topic::with_partitions(&db, 3).await;
    let member = || {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_broker-worker"))
            .args([&db.url, &db.prefix, &kafka_url(), &topic.name])
            .args(["reader", "run-batched"])
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start broker-worker")
    };
    let mut members = vec![member()];
    for n in 0..300 {
        let key = format!("order:{}", n % 240);
        topic.produce_to(Some(n % 3), Some(&key), b"x").await;
        if n == 100 {
            // Joins while the first member runs: the group takes its partitions back.
            members.push(member());
        }
    }
    let settled = || async {
        let (last, stored) = topic.all_positions(&db, 3).await;
        db.rows("effects").await == 240 && stored == last
    };
    // Nothing runs here: the members do, and the guard watches their effects.
    let idle = |stopped: tokio::sync::oneshot::Receiver<()>| async move {
        let _ = stopped.await;
        Ok(ConsumerStats::default())
    };
    run_until(idle, settled, effects(&db)).await;
    for member in &mut members {
        member.kill().await.expect("SIGKILL a member");
    }
    assert_eq!(db.rows("effects").await, 240, "effects = distinct keys");
    assert_eq!(db.doubled_effects().await, 0);
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

impl Batching for Topic {
    async fn connect_for_batches<DB: TestBackend>(&self, inbox: &Inbox<DB>) -> KafkaReader<DB> {
        KafkaReader::connect(&kafka_url(), inbox.clone(), options(self).max_attempts(2)).unwrap()
    }

    async fn dead_letters(&self) -> u64 {
        self.high_watermark(format!("{}.dead", self.name)).await as u64
    }
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
