//! The Redis Streams consumer and publisher against the real server, with the keys on each
//! real database: failures taken over again then
//! dead-lettered, two workers in one group, and the relay's publisher. The proofs every
//! broker shares are in `broker`.

use super::broker::{
    Batching, GivingBack, OneAttempt, TestBroker, consume_until, consumed, counted, read_to_end,
    take,
};
use super::{on_every_database, run_until};
use justonce_sql::{Delivered, Delivery, Destination, Inbox, Key, WorkFuture, sqlx};
use justonce_tests::{BreakableRedis, TestBackend, TestDb, redis_url};
use justonce_transport::redis_streams::{
    BODY_FIELD, KEY_FIELD, RedisStreamConsumer, RedisStreamDestination, RedisStreamOptions,
    RedisStreamReader,
};
use justonce_transport::{ConsumerStats, Incoming, KeyFrom, Link, REASON_HEADER, Tenants};
use redis::AsyncCommands;
use std::time::Duration;

on_every_database!(
    failing_work_is_taken_over_again_then_dead_lettered,
    an_entry_without_a_text_key_field_is_dead_lettered_with_the_reason,
    a_reader_runs_failing_work_again_in_place_then_dead_letters_it_and_moves_on,
    a_reader_stopped_while_failing_work_waits_to_run_again_stops_at_once,
    a_reader_that_cannot_move_its_offset_past_a_dead_letter_publishes_it_once,
    a_consumer_whose_connection_breaks_connects_again_and_goes_on,
    two_batches_at_once_whose_connection_breaks_take_effect_once_each,
    the_relay_adds_each_row_with_its_key,
    a_consumer_takes_batches_of_interleaved_tenants_each_in_its_scope,
    a_reader_takes_batches_of_interleaved_tenants_each_in_its_scope,
);

/// The group every reader of these tests joins.
const GROUP: &str = "test";

/// A stream named after the test's prefix, deleted at the end with its dead letters.
pub(crate) struct Stream {
    name: String,
    redis: redis::aio::MultiplexedConnection,
}

impl Stream {
    async fn new<DB: TestBackend>(db: &TestDb<DB>) -> Self {
        let client = redis::Client::open(redis_url()).unwrap();
        let redis = client
            .get_multiplexed_async_connection()
            .await
            .unwrap_or_else(|e| panic!("Redis at {}: {e}", redis_url()));
        Self {
            name: format!("{}orders", db.prefix),
            redis,
        }
    }

    /// Adds entries with these keys, each with body `x`, in one round trip.
    async fn add(&self, keys: impl IntoIterator<Item = String>) {
        let mut pipe = redis::pipe();
        for key in keys {
            pipe.xadd(
                &self.name,
                "*",
                &[(KEY_FIELD, key.as_bytes()), (BODY_FIELD, b"x")],
            )
            .ignore();
        }
        pipe.query_async::<()>(&mut self.redis.clone())
            .await
            .unwrap();
    }

    /// Entries the group has not yet read, or read and not acknowledged.
    async fn unsettled(&self) -> usize {
        let mut redis = self.redis.clone();
        let groups: redis::streams::StreamInfoGroupsReply =
            redis.xinfo_groups(&self.name).await.unwrap();
        let group = groups.groups.iter().find(|g| g.name == GROUP).unwrap();
        group.pending + group.lag.unwrap_or(usize::MAX)
    }

    async fn length(&self, stream: &str) -> usize {
        self.redis.clone().xlen(stream).await.unwrap()
    }

    async fn delete(self) {
        let mut redis = self.redis.clone();
        let _: () = redis
            .del(&[self.name.clone(), format!("{}.dead", self.name)])
            .await
            .unwrap();
    }
}

fn options(stream: &Stream, consumer: &str) -> RedisStreamOptions {
    RedisStreamOptions::new(&stream.name, GROUP)
        .consumer(consumer)
        .claim_idle(Duration::from_millis(500))
}

async fn failing_work_is_taken_over_again_then_dead_lettered<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let stream = Stream::new(&db).await;
    let consumer = RedisStreamConsumer::connect(
        &redis_url(),
        db.inbox.clone(),
        options(&stream, "a").max_attempts(2),
    )
    .await
    .unwrap();
    stream
        .add([
            "fail1:order".to_owned(),
            "bad:order".to_owned(),
            "good:order".to_owned(),
        ])
        .await;
    let dead = format!("{}.dead", stream.name);
    let stats = consume_until(&db, &consumer, || async {
        stream.unsettled().await == 0 && stream.length(&dead).await == 1
    })
    .await;
    assert_eq!(
        (stats.processed, stats.retried, stats.dead_lettered),
        (2, 2, 1)
    );
    assert_eq!(db.effects_of(&Key::new("fail1:order").unwrap()).await, 1);
    assert_eq!(db.effects_of(&Key::new("good:order").unwrap()).await, 1);
    assert_eq!(db.effects_of(&Key::new("bad:order").unwrap()).await, 0);
    let mut redis = stream.redis.clone();
    let letters: redis::streams::StreamRangeReply = redis.xrange_all(&dead).await.unwrap();
    let letter = &letters.ids[0];
    assert_eq!(
        letter.get::<String>(KEY_FIELD).as_deref(),
        Some("bad:order")
    );
    let reason: String = letter.get(REASON_HEADER).unwrap();
    assert!(reason.contains("refused on attempt 2"), "{reason}");
    stream.delete().await;
    db.cleanup().await;
}

/// The reason tells a missing field from one that is not text.
async fn an_entry_without_a_text_key_field_is_dead_lettered_with_the_reason<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let stream = Stream::new(&db).await;
    let consumer =
        RedisStreamConsumer::connect(&redis_url(), db.inbox.clone(), options(&stream, "a"))
            .await
            .unwrap();
    let mut redis = stream.redis.clone();
    let _: String = redis
        .xadd(&stream.name, "*", &[(BODY_FIELD, b"missing".as_slice())])
        .await
        .unwrap();
    let not_utf8: &[(&str, &[u8])] = &[(KEY_FIELD, b"\xff\xfe"), (BODY_FIELD, b"not utf-8")];
    let _: String = redis.xadd(&stream.name, "*", not_utf8).await.unwrap();
    let dead = format!("{}.dead", stream.name);
    let stats = consume_until(&db, &consumer, || async {
        stream.unsettled().await == 0 && stream.length(&dead).await == 2
    })
    .await;
    assert_eq!(stats.dead_lettered, 2);
    let letters: redis::streams::StreamRangeReply = redis.xrange_all(&dead).await.unwrap();
    let reasons: Vec<String> = (letters.ids.iter())
        .map(|letter| letter.get(REASON_HEADER).unwrap())
        .collect();
    assert_eq!(
        reasons,
        ["the entry has no field key", "the field key is not UTF-8"]
    );
    stream.delete().await;
    db.cleanup().await;
}

async fn the_relay_adds_each_row_with_its_key<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let stream = Stream::new(&db).await;
    let consumer =
        RedisStreamConsumer::connect(&redis_url(), db.inbox.clone(), options(&stream, "a"))
            .await
            .unwrap();
    let destination = RedisStreamDestination::new(&redis_url(), &stream.name).unwrap();
    let headers = [("content-type".to_owned(), "text/plain".to_owned())];
    let delivery = Delivery {
        id: 1,
        key: "billing:invoice:2026-10",
        destination: "orders",
        payload: b"invoice",
        headers: &headers,
        attempt: 1,
    };
    assert_eq!(destination.deliver(delivery).await, Delivered::Sent);
    // The relay sends a row again when its mark was lost: two entries, one key.
    assert_eq!(destination.deliver(delivery).await, Delivered::Sent);
    let mut redis = stream.redis.clone();
    let entries: redis::streams::StreamRangeReply = redis.xrange_all(&stream.name).await.unwrap();
    assert_eq!(entries.ids.len(), 2);
    for entry in &entries.ids {
        assert_eq!(
            entry.get::<String>(KEY_FIELD).as_deref(),
            Some("billing:invoice:2026-10")
        );
        assert_eq!(
            entry.get::<Vec<u8>>(BODY_FIELD).as_deref(),
            Some(&b"invoice"[..])
        );
        assert_eq!(
            entry.get::<String>("content-type").as_deref(),
            Some("text/plain")
        );
    }
    let stats = consume_until(&db, &consumer, || async { stream.unsettled().await == 0 }).await;
    assert_eq!((stats.processed, stats.duplicates), (1, 1));
    assert_eq!(
        db.effects_of(&Key::new("billing:invoice:2026-10").unwrap())
            .await,
        1
    );
    stream.delete().await;
    db.cleanup().await;
}

async fn a_reader_runs_failing_work_again_in_place_then_dead_letters_it_and_moves_on<
    DB: TestBackend,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let stream = ReadStream::open(&db).await;
    let keys = ["fail1:order", "bad:order", "order:after"];
    stream.0.add(keys.map(str::to_owned)).await;
    let reader = RedisStreamReader::connect(
        &redis_url(),
        db.inbox.clone(),
        options(&stream.0, "a").max_attempts(2),
    )
    .await
    .unwrap();
    let stats = consume_until(&db, &reader, || stream.settled(&db)).await;
    assert_eq!(
        (stats.processed, stats.retried, stats.dead_lettered),
        (2, 2, 1)
    );
    for (key, effects) in [("fail1:order", 1), ("bad:order", 0), ("order:after", 1)] {
        assert_eq!(
            db.effects_of(&Key::new(key).unwrap()).await,
            effects,
            "{key}"
        );
    }
    let dead = format!("{}.dead", stream.0.name);
    let letters: redis::streams::StreamRangeReply =
        stream.0.redis.clone().xrange_all(&dead).await.unwrap();
    let [letter] = letters.ids.as_slice() else {
        panic!("one dead letter: {letters:?}");
    };
    assert_eq!(
        letter.get::<String>(KEY_FIELD).as_deref(),
        Some("bad:order")
    );
    let reason: String = letter.get(REASON_HEADER).unwrap();
    assert!(reason.contains("attempt 2: "), "{reason}");
    stream.delete().await;
    db.cleanup().await;
}

/// The test's tables, read through a consumer of the test's own, for its metric.
fn read_as<DB: TestBackend>(db: &TestDb<DB>, name: &str) -> TestDb<DB> {
    TestDb {
        url: db.url.clone(),
        prefix: db.prefix.clone(),
        inbox: db.consumer(name),
    }
}

/// A stop while failing work waits to run again ends the wait at once: the work does not
/// run again, nothing is dead-lettered, and the offset stays before the entry.
async fn a_reader_stopped_while_failing_work_waits_to_run_again_stops_at_once<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let stream = ReadStream::open(&db).await;
    stream.0.add(["bad:order".to_owned()]).await;
    let name = format!("{}stopped", db.prefix);
    assert_eq!(consumed(&name), 0);
    let reading = read_as(&db, &name);
    // Five attempts: waits of 1, 2, 4 and 8 s between them, unless the stop ends them.
    let reader =
        RedisStreamReader::connect(&redis_url(), reading.inbox.clone(), options(&stream.0, "a"))
            .await
            .unwrap();
    // Stopped once the entry is taken: during its first run, or the wait after it.
    let stats = consume_until(&reading, &reader, || async { consumed(&name) >= 1 }).await;
    assert_eq!(
        (stats.retried, stats.dead_lettered, stats.processed),
        (1, 0, 0),
        "{stats:?}"
    );
    let dead = format!("{}.dead", stream.0.name);
    assert_eq!(stream.0.length(&dead).await, 0);
    assert!(
        !stream.settled(&reading).await,
        "the offset stays before it"
    );
    stream.delete().await;
    db.cleanup().await;
}

/// An offset that cannot be moved past a dead letter is moved again alone after the pause:
/// the entry's work does not run again, and its dead letter is published once.
async fn a_reader_that_cannot_move_its_offset_past_a_dead_letter_publishes_it_once<
    DB: TestBackend,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let stream = ReadStream::open(&db).await;
    stream
        .0
        .add(["bad:order".to_owned(), "order:after".to_owned()])
        .await;
    let name = format!("{}offset", db.prefix);
    assert_eq!(consumed(&name), 0);
    let reading = read_as(&db, &name);
    let rename = |from: &str, to: &str| {
        let sql = format!("ALTER TABLE {0}{from} RENAME TO {0}{to}", db.prefix);
        DB::execute(db.inbox.pool(), sql)
    };
    let options = options(&stream.0, "a")
        .max_attempts(2)
        .store_pause(Duration::from_millis(100));
    let reader = RedisStreamReader::connect(&redis_url(), reading.inbox.clone(), options)
        .await
        .unwrap();
    let dead = format!("{}.dead", stream.0.name);
    // 0: offsets in place; 1: moved away; 2: the dead letter seen; 3: back in place.
    let step = std::sync::atomic::AtomicU8::new(0);
    let stats = consume_until(&reading, &reader, || async {
        use std::sync::atomic::Ordering::Relaxed;
        match step.load(Relaxed) {
            // In the wait before the second attempt, the offsets go: no offset can move.
            0 if consumed(&name) >= 1 => {
                rename("offsets", "offsets_away").await.unwrap();
                step.store(1, Relaxed);
            }
            1 if stream.0.length(&dead).await >= 1 => step.store(2, Relaxed),
            // A poll after the dead letter: the move past it has failed by now.
            2 => {
                rename("offsets_away", "offsets").await.unwrap();
                step.store(3, Relaxed);
            }
            3 => return stream.settled(&reading).await,
            _ => {}
        }
        false
    })
    .await;
    assert_eq!(
        (stats.retried, stats.dead_lettered, stats.processed),
        (1, 1, 1),
        "the work of the entry given up ran twice, no more: {stats:?}"
    );
    assert_eq!(stream.0.length(&dead).await, 1, "one dead letter");
    assert_eq!(db.effects_of(&Key::new("order:after").unwrap()).await, 1);
    stream.delete().await;
    db.cleanup().await;
}

/// A consumer whose connection breaks connects again by itself and goes on: its link says
/// it is connecting again, its run does not end, the reconnection is counted, and what was
/// published meanwhile takes effect once.
async fn a_consumer_whose_connection_breaks_connects_again_and_goes_on<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let stream = Stream::new(&db).await;
    let proxy = BreakableRedis::start().await;
    let name = format!("{}reconnecting", db.prefix);
    assert_eq!(
        counted("justonce_broker_reconnects_total", &[("consumer", &name)]),
        0
    );
    let reading = read_as(&db, &name);
    let options = options(&stream, "a").reconnect_max_wait(Duration::from_millis(200));
    let consumer = RedisStreamConsumer::connect(&proxy.url(), reading.inbox.clone(), options)
        .await
        .unwrap();
    let link = consumer.link();
    stream.add(["order:1".to_owned()]).await;
    // 0: before the break; 1: broken; 2: up again, with a message published meanwhile.
    let step = std::sync::atomic::AtomicU8::new(0);
    let work = justonce_tests::consumer_work::<DB>(&db.prefix);
    let stats = run_until(
        |stopped| consumer.run(stopped, work),
        || async {
            use std::sync::atomic::Ordering::Relaxed;
            match step.load(Relaxed) {
                0 if db.rows("effects").await == 1 => {
                    proxy.set_up(false);
                    step.store(1, Relaxed);
                }
                1 if matches!(*link.borrow(), Link::Reconnecting { .. }) => {
                    stream.add(["order:2".to_owned()]).await;
                    proxy.set_up(true);
                    step.store(2, Relaxed);
                }
                2 => return db.rows("effects").await == 2 && *link.borrow() == Link::Connected,
                _ => {}
            }
            false
        },
        || async { i64::from(step.load(std::sync::atomic::Ordering::Relaxed)) },
    )
    .await;
    assert_eq!((stats.processed, stats.duplicates), (2, 0), "{stats:?}");
    assert_eq!(db.doubled_effects().await, 0);
    assert!(counted("justonce_broker_reconnects_total", &[("consumer", &name)]) >= 1);
    stream.delete().await;
    db.cleanup().await;
}

/// Two batches at once, and the connection breaks while they run: a batch committed whose
/// acknowledgement is lost stays pending, is taken over after the consumer connects again,
/// and is a duplicate. Every entry takes effect once and ends acknowledged.
async fn two_batches_at_once_whose_connection_breaks_take_effect_once_each<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let stream = Stream::new(&db).await;
    let proxy = BreakableRedis::start().await;
    let name = format!("{}breaking", db.prefix);
    let reading = read_as(&db, &name);
    let options = options(&stream, "a").reconnect_max_wait(Duration::from_millis(200));
    let consumer = RedisStreamConsumer::connect(&proxy.url(), reading.inbox.clone(), options)
        .await
        .unwrap()
        .batches_at_once(2);
    let link = consumer.link();
    stream.add((0..2_000).map(|n| format!("order:{n}"))).await;
    // 0: before the break; 1: broken; 2: up again.
    let step = std::sync::atomic::AtomicU8::new(0);
    let work = justonce_tests::consumer_work::<DB>(&db.prefix);
    let stats = run_until(
        |stopped| consumer.run_batched(stopped, 10, work),
        || async {
            use std::sync::atomic::Ordering::Relaxed;
            match step.load(Relaxed) {
                0 if db.rows("effects").await >= 200 => {
                    proxy.set_up(false);
                    step.store(1, Relaxed);
                }
                1 if matches!(*link.borrow(), Link::Reconnecting { .. }) => {
                    proxy.set_up(true);
                    step.store(2, Relaxed);
                }
                2 => return db.rows("effects").await == 2_000 && stream.unsettled().await == 0,
                _ => {}
            }
            false
        },
        || async { i64::from(step.load(std::sync::atomic::Ordering::Relaxed)) },
    )
    .await;
    assert_eq!(stats.processed, 2_000, "{stats:?}");
    assert_eq!(db.rows("effects").await, 2_000);
    assert_eq!(db.doubled_effects().await, 0);
    assert!(counted("justonce_broker_reconnects_total", &[("consumer", &name)]) >= 1);
    stream.delete().await;
    db.cleanup().await;
}

impl super::broker::Restartable for Stream {
    const KIND: &'static str = "redis";
    type Adapter = justonce_transport::redis_streams::RedisStreams;

    async fn connect_to<DB: TestBackend>(
        url: &str,
        name: &str,
        inbox: &Inbox<DB>,
    ) -> RedisStreamConsumer<DB> {
        let options =
            RedisStreamOptions::new(name, GROUP).reconnect_max_wait(Duration::from_millis(200));
        RedisStreamConsumer::connect(url, inbox.clone(), options)
            .await
            .unwrap()
    }

    async fn publish_to(url: &str, name: &str, key: &str) {
        let destination = RedisStreamDestination::new(url, name).unwrap();
        super::broker::deliver(&destination, key).await;
    }
}

impl GivingBack for Stream {
    type Adapter = justonce_transport::redis_streams::RedisStreams;

    fn generic<DB: TestBackend>(consumer: RedisStreamConsumer<DB>) -> RedisStreamConsumer<DB> {
        consumer
    }
}

impl OneAttempt for Stream {
    async fn connect_with_one_attempt<DB: TestBackend>(
        &self,
        inbox: &Inbox<DB>,
    ) -> RedisStreamConsumer<DB> {
        let options = options(self, "a").count(64).max_attempts(1);
        RedisStreamConsumer::connect(&redis_url(), inbox.clone(), options)
            .await
            .unwrap()
    }
}

impl Batching for Stream {
    async fn connect_for_batches<DB: TestBackend>(
        &self,
        inbox: &Inbox<DB>,
    ) -> RedisStreamConsumer<DB> {
        let options = options(self, "a").count(64).max_attempts(2);
        RedisStreamConsumer::connect(&redis_url(), inbox.clone(), options)
            .await
            .unwrap()
    }

    async fn dead_letters(&self) -> u64 {
        self.length(&format!("{}.dead", self.name)).await as u64
    }
}

impl TestBroker for Stream {
    type Consumer<DB: TestBackend> = RedisStreamConsumer<DB>;

    fn url() -> String {
        redis_url()
    }

    async fn open<DB: TestBackend>(db: &TestDb<DB>) -> Self {
        let stream = Stream::new(db).await;
        // Creates the group.
        TestBroker::connect(&stream, db).await;
        stream
    }

    fn name(&self) -> &str {
        &self.name
    }

    async fn publish(&self, keys: &[String]) {
        self.add(keys.iter().cloned()).await
    }

    async fn connect<DB: TestBackend>(&self, db: &TestDb<DB>) -> RedisStreamConsumer<DB> {
        RedisStreamConsumer::connect(&redis_url(), db.inbox.clone(), options(self, "a"))
            .await
            .unwrap()
    }

    async fn consume<DB: TestBackend>(
        &self,
        consumer: &RedisStreamConsumer<DB>,
        db: &TestDb<DB>,
        count: usize,
    ) -> ConsumerStats {
        take(consumer, db, count).await
    }

    async fn settled<DB: TestBackend>(&self, _db: &TestDb<DB>) -> bool {
        self.unsettled().await == 0
    }

    async fn delete(self) {
        Stream::delete(self).await
    }
}

/// The stream of a test read by a single reader that keeps its offset in the database.
pub(crate) struct ReadStream(Stream);

impl Batching for ReadStream {
    async fn connect_for_batches<DB: TestBackend>(
        &self,
        inbox: &Inbox<DB>,
    ) -> RedisStreamReader<DB> {
        let options = options(&self.0, "a").count(64).max_attempts(2);
        RedisStreamReader::connect(&redis_url(), inbox.clone(), options)
            .await
            .unwrap()
            .batches_at_once(2)
    }

    async fn dead_letters(&self) -> u64 {
        self.0.dead_letters().await
    }
}

impl TestBroker for ReadStream {
    type Consumer<DB: TestBackend> = RedisStreamReader<DB>;
    const KEEPS_OFFSET: bool = true;

    fn url() -> String {
        redis_url()
    }

    async fn open<DB: TestBackend>(db: &TestDb<DB>) -> Self {
        ReadStream(Stream::new(db).await)
    }

    fn name(&self) -> &str {
        &self.0.name
    }

    async fn publish(&self, keys: &[String]) {
        self.0.add(keys.iter().cloned()).await
    }

    async fn connect<DB: TestBackend>(&self, db: &TestDb<DB>) -> RedisStreamReader<DB> {
        RedisStreamReader::connect(&redis_url(), db.inbox.clone(), options(&self.0, "a"))
            .await
            .unwrap()
    }

    async fn consume<DB: TestBackend>(
        &self,
        reader: &RedisStreamReader<DB>,
        db: &TestDb<DB>,
        count: usize,
    ) -> ConsumerStats {
        read_to_end(self, reader, db, count).await
    }

    /// Whether the reader's stored offset is the id of the stream's last entry.
    async fn settled<DB: TestBackend>(&self, db: &TestDb<DB>) -> bool {
        let last: redis::streams::StreamRangeReply = self
            .0
            .redis
            .clone()
            .xrevrange_count(&self.0.name, "+", "-", 1)
            .await
            .unwrap();
        let stored = db.inbox.load_offsets(&self.0.name).await.unwrap();
        let stored = stored
            .first()
            .map(|(_, offset)| format!("{}-{}", offset.position, offset.sequence));
        last.ids.first().map(|entry| entry.id.clone()) == stored
    }

    async fn delete(self) {
        self.0.delete().await
    }
}

/// Two tenants' entries interleaved, the same ids in both, one repeated, and one of a
/// tenant not taken, in the `tenant` field.
const TENANT_ENTRIES: [(&str, &str); 6] = [
    ("o1", "acme"),
    ("o1", "globex"),
    ("o2", "acme"),
    ("o2", "acme"),
    ("o1", "globex"),
    ("o3", "umbrella"),
];

/// Adds [`TENANT_ENTRIES`] to `stream` in one round trip, so that one batch takes them.
async fn add_for_tenants(stream: &Stream) {
    let mut pipe = redis::pipe();
    for (key, tenant) in TENANT_ENTRIES {
        let fields: [(&str, &[u8]); 3] = [
            (KEY_FIELD, key.as_bytes()),
            (BODY_FIELD, b"x"),
            ("tenant", tenant.as_bytes()),
        ];
        pipe.xadd(&stream.name, "*", &fields).ignore();
    }
    pipe.query_async::<()>(&mut stream.redis.clone())
        .await
        .unwrap();
}

/// The tenants the consumer or reader takes, named by the `tenant` field.
fn acme_and_globex() -> Tenants {
    Tenants::new(KeyFrom::Header("tenant".to_owned()), ["acme", "globex"]).unwrap()
}

/// A work that writes one effect named `<scope>/<key>`.
fn scoped_work<DB: TestBackend>(
    prefix: &str,
) -> impl for<'e, 't> Fn(
    &'t mut sqlx::Transaction<'e, DB>,
    &'t Incoming,
) -> WorkFuture<'t, (), sqlx::Error>
+ Sync
+ use<DB> {
    let prefix = prefix.to_owned();
    move |tx, message| {
        let prefix = prefix.clone();
        Box::pin(async move {
            let effect = format!("{}/{}", message.scope.as_str(), message.key.as_str());
            DB::insert_effect(tx, &prefix, "test", &effect).await
        })
    }
}

/// What a run over [`TENANT_ENTRIES`] must leave: one effect per tenant and id, the keys
/// in each tenant's scope, and the tenant off the list dead-lettered at once.
async fn assert_each_tenant_s_effects<DB: TestBackend>(
    db: &TestDb<DB>,
    stream: &Stream,
    stats: ConsumerStats,
) {
    assert_eq!(
        (
            stats.processed,
            stats.duplicates,
            stats.retried,
            stats.dead_lettered
        ),
        (3, 2, 0, 1),
        "{stats:?}"
    );
    for effect in ["acme/o1", "globex/o1", "acme/o2"] {
        assert_eq!(
            db.effects_of(&Key::new(effect).unwrap()).await,
            1,
            "{effect}"
        );
    }
    assert_eq!(db.rows("effects").await, 3);
    let counts = db.inbox.key_counts().await.unwrap();
    let scopes: Vec<(&str, i64)> = counts
        .iter()
        .map(|count| (count.scope.as_str(), count.keys))
        .collect();
    assert_eq!(scopes, [("acme", 2), ("globex", 1)]);
    let dead = format!("{}.dead", stream.name);
    let letters: redis::streams::StreamRangeReply =
        stream.redis.clone().xrange_all(&dead).await.unwrap();
    let [letter] = letters.ids.as_slice() else {
        panic!("one dead letter: {letters:?}");
    };
    let reason: String = letter.get(REASON_HEADER).unwrap();
    assert_eq!(
        reason,
        r#"tenant not allowed: "umbrella" is not one of the tenants this consumer takes"#
    );
}

/// A consumer taking batches claims each run of one tenant's entries in its scope.
async fn a_consumer_takes_batches_of_interleaved_tenants_each_in_its_scope<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let stream = Stream::new(&db).await;
    let options = options(&stream, "a").tenants(acme_and_globex());
    let consumer = RedisStreamConsumer::connect(&redis_url(), db.inbox.clone(), options)
        .await
        .unwrap();
    add_for_tenants(&stream).await;
    let dead = format!("{}.dead", stream.name);
    let work = scoped_work::<DB>(&db.prefix);
    let stats = run_until(
        |stopped| consumer.run_batched(stopped, 16, work),
        || async { stream.unsettled().await == 0 && stream.length(&dead).await == 1 },
        || db.rows("effects"),
    )
    .await;
    assert_each_tenant_s_effects(&db, &stream, stats).await;
    stream.delete().await;
    db.cleanup().await;
}

/// A reader taking batches does the same, its offsets moving past every entry.
async fn a_reader_takes_batches_of_interleaved_tenants_each_in_its_scope<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let stream = ReadStream::open(&db).await;
    add_for_tenants(&stream.0).await;
    let options = options(&stream.0, "a").count(64).tenants(acme_and_globex());
    let reader = RedisStreamReader::connect(&redis_url(), db.inbox.clone(), options)
        .await
        .unwrap();
    let work = scoped_work::<DB>(&db.prefix);
    let stats = run_until(
        |stopped| reader.run_batched(stopped, 16, work),
        || stream.settled(&db),
        || db.rows("effects"),
    )
    .await;
    assert_each_tenant_s_effects(&db, &stream.0, stats).await;
    stream.delete().await;
    db.cleanup().await;
}
