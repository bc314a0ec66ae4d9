//! The Kafka reader and the relay's producer against a real Kafka-protocol broker, with the
//! keys and offsets on each real database: failing work run again in place then
//! dead-lettered with its reason, the id required of the configuration, and the relay's
//! records seen once each with their key. The proofs every broker shares are in `broker`.

use super::broker::{Batching, TestBroker, consume_until, read_to_end};
use super::on_every_database;
use justonce_sql::{Delivered, Delivery, Destination, Inbox, Key, WorkFuture};
use justonce_tests::{TestBackend, TestDb, consumer_work, kafka_url};
use justonce_transport::kafka::{
    IDEMPOTENCY_KEY_HEADER, KafkaDestination, KafkaOptions, KafkaReader,
};
use justonce_transport::{ConsumerStats, Incoming, KeyFrom, REASON_HEADER};
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
    a_read_after_another_starts_after_the_stored_offset_not_the_clients_position,
    a_member_joining_and_another_leaving_mid_run_leave_one_effect_per_key_and_offsets_at_the_end,
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

/// A topic named after the test's prefix, with one partition unless said otherwise, and its
/// dead-letter topic; deleted at the end.
pub(crate) struct Topic {
    name: String,
    partitions: i32,
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
        let topics = [(&name, partitions), (&dead, 1)].map(|(topic, partitions)| {
            NewTopic::new(topic, partitions, TopicReplication::Fixed(1))
        });
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
            partitions,
            admin,
            producer,
            client,
        }
    }

    /// Produces one record per key, the key in the `ce_id` header, to the partitions in
    /// turn from `first`, and waits for the broker to acknowledge each.
    async fn produce_spread(&self, keys: &[String], first: usize) {
        let mut sent = Vec::with_capacity(keys.len());
        for (n, key) in keys.iter().enumerate() {
            let headers = OwnedHeaders::new().insert(Header {
                key: ID_HEADER,
                value: Some(key.as_str()),
            });
            let record = FutureRecord::to(&self.name)
                .partition((first + n) as i32 % self.partitions)
                .key("customer:1")
                .payload(key.as_str())
                .headers(headers);
            sent.push(
                self.producer
                    .send_result(record)
                    .map_err(|(e, _)| e)
                    .unwrap(),
            );
        }
        for delivery in sent {
            delivery.await.unwrap().map_err(|(e, _)| e).unwrap();
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

    /// The offset stored for each partition, by partition.
    async fn stored_offsets<DB: TestBackend>(&self, db: &TestDb<DB>) -> Vec<Option<i64>> {
        let stored = db.inbox.load_offsets(&self.name).await.unwrap();
        (0..self.partitions)
            .map(|partition| {
                let offset = stored.iter().find(|(p, _)| *p == partition);
                offset.map(|(_, offset)| offset.position)
            })
            .collect()
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

/// The tests' work for a member of a group: one effect row for the record's key, under the
/// member's name.
fn member_work<DB: TestBackend>(
    prefix: &str,
    member: &'static str,
) -> impl for<'e, 't> Fn(
    &'t mut sqlx::Transaction<'e, DB>,
    &'t Incoming,
) -> WorkFuture<'t, (), sqlx::Error>
+ Sync
+ use<DB> {
    let prefix = prefix.to_owned();
    move |tx, message| {
        let prefix = prefix.clone();
        Box::pin(async move { DB::insert_effect(tx, &prefix, member, message.key.as_str()).await })
    }
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
        let stored = topic.stored_offsets(&db).await;
        for (partition, offset) in &last {
            assert_eq!(
                stored[*partition as usize],
                Some(*offset),
                "partition {partition}"
            );
        }
        taken += batch.len();
    }
    assert_eq!((stats.processed, stats.duplicates), (24, 6), "{stats:?}");
    assert_eq!(db.rows("effects").await, 24);
    assert_eq!(db.doubled_effects().await, 0);
    // Ten records in each partition, the last at offset 9.
    assert_eq!(topic.stored_offsets(&db).await, vec![Some(9); 3]);
    records.stop().await.unwrap();
    drop(reader);
    topic.remove().await;
    db.cleanup().await;
}

/// A read after another, as after a lost connection, starts each partition it holds after
/// the stored offset, not at the client's position: a record taken and not stored is read
/// again, never skipped.
async fn a_read_after_another_starts_after_the_stored_offset_not_the_clients_position<
    DB: TestBackend,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let topic = Topic::create(&db).await;
    for n in 0..3 {
        topic.produce(Some(&format!("order:{n}")), b"x").await;
    }
    let reader = KafkaReader::connect(&kafka_url(), db.inbox.clone(), options(&topic)).unwrap();
    let work = consumer_work::<DB>(&db.prefix);
    let mut records = reader.deliveries().await.unwrap();
    let mut taken = Vec::new();
    for _ in 0..2 {
        let record = tokio::time::timeout(Duration::from_secs(30), records.next())
            .await
            .expect("a record within 30 s")
            .unwrap()
            .expect("the reader is not cancelled");
        taken.push(record);
    }
    assert_eq!(taken.iter().map(|r| r.offset()).collect::<Vec<_>>(), [0, 1]);
    // The first runs and its offset is stored; the second was taken and not stored.
    assert!(matches!(
        reader.run_one(&taken[0], &work).await,
        justonce_transport::Ran::Outcome(justonce_sql::Outcome::Processed(()))
    ));
    drop(records);
    let mut again = reader.deliveries().await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(30), again.next())
        .await
        .expect("a record within 30 s")
        .unwrap()
        .expect("the reader is not cancelled");
    assert_eq!(
        next.offset(),
        1,
        "the record taken and not stored comes again"
    );
    drop(again);
    drop(reader);
    topic.remove().await;
    db.cleanup().await;
}

/// Two live members of one group on four partitions, each running batches of up to 20,
/// and a rebalance each way: a second member joins while the first consumes, and once it consumes its share the first leaves
/// cleanly; what is produced after that is the second's alone, in every partition. 2,000
/// records for 1,600 keys take effect once per key between the two, and each partition's
/// stored offset is its last record's.
async fn a_member_joining_and_another_leaving_mid_run_leave_one_effect_per_key_and_offsets_at_the_end<
    DB: TestBackend,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let topic = Topic::with_partitions(&db, 4).await;
    let keys: Vec<String> = (0..2_000).map(|n| format!("order:{}", n % 1_600)).collect();
    let effects_of = |member: &str| {
        DB::count(
            db.inbox.pool(),
            format!(
                "SELECT count(*) FROM {}effects WHERE consumer = '{member}'",
                db.prefix
            ),
        )
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    let before_deadline = |what: &str| {
        assert!(tokio::time::Instant::now() < deadline, "{what} within 90 s");
    };
    topic.produce_spread(&keys[..800], 0).await;
    let first = KafkaReader::connect(&kafka_url(), db.inbox.clone(), options(&topic)).unwrap();
    let (leave, left) = tokio::sync::oneshot::channel::<()>();
    let (gone, first_gone) = tokio::sync::oneshot::channel::<()>();
    let (join, joined) = tokio::sync::oneshot::channel::<()>();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let prefix = db.prefix.as_str();
    let first_run = async move {
        let stats = (first)
            .run_batched(left, 20, member_work::<DB>(prefix, "first"))
            .await;
        // Dropped, the member leaves the group.
        drop(first);
        gone.send(()).unwrap();
        stats
    };
    let second_run = async {
        joined.await.unwrap();
        let second = KafkaReader::connect(&kafka_url(), db.inbox.clone(), options(&topic)).unwrap();
        second
            .run_batched(stopped, 20, member_work::<DB>(prefix, "second"))
            .await
    };
    let driving = async {
        while effects_of("first").await < 200 {
            before_deadline("the first member consumes");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        join.send(()).unwrap();
        // Records keep coming, spread over the partitions, until the second has its share.
        let mut produced = 800;
        while effects_of("second").await == 0 {
            before_deadline("the second member consumes");
            if produced < 1_200 {
                (topic.produce_spread(&keys[produced..produced + 20], produced)).await;
                produced += 20;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        leave.send(()).unwrap();
        first_gone.await.unwrap();
        // The rest is the second's alone, in every partition.
        topic.produce_spread(&keys[produced..], produced).await;
        // 500 records in each partition, the last at offset 499.
        while topic.stored_offsets(&db).await != vec![Some(499); 4] {
            before_deadline("every partition read to its end");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stop.send(()).unwrap();
    };
    let (first_stats, second_stats, ()) = tokio::join!(first_run, second_run, driving);
    let (first_stats, second_stats) = (first_stats.unwrap(), second_stats.unwrap());
    assert_eq!(db.rows("effects").await, 1_600, "effects = distinct keys");
    assert_eq!(db.doubled_effects().await, 0);
    assert_eq!(
        (first_stats.processed, second_stats.processed),
        (
            effects_of("first").await as u64,
            effects_of("second").await as u64
        )
    );
    assert!(
        first_stats.processed > 0 && second_stats.processed > 0,
        "both took part: {first_stats:?} {second_stats:?}"
    );
    assert_eq!(
        topic.stored_offsets(&db).await,
        vec![Some(499); 4],
        "each partition's last record"
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
        KafkaReader::connect(&kafka_url(), inbox.clone(), options(self).max_attempts(2))
            .unwrap()
            .batches_at_once(2)
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
