//! The RabbitMQ consumer and publisher against the real broker, with the keys on each real
//! database: failures retried then dead-lettered, two worker processes on one queue, and
//! the relay publishing outbox rows. The proofs every broker shares, and those of batches,
//! are in `broker`.

use super::broker::{Batching, GivingBack, TestBroker, take};
use super::on_every_database;
use justonce_sql::{Inbox, Key, Message};
use justonce_tests::{TestBackend, TestDb, amqp_url, consumer_work};
use justonce_transport::amqp::{AmqpConsumer, AmqpDestination, AmqpOptions, QueueType};
use justonce_transport::{ATTEMPT_HEADER, KeyFrom, REASON_HEADER};
use justonce_transport::{Broker, ConsumerStats, Settle};
use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeleteOptions};
use lapin::types::AMQPValue;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use std::time::Duration;

on_every_database!(
    failing_work_is_retried_then_dead_lettered,
    a_message_without_a_key_or_with_a_blank_one_is_dead_lettered,
    a_key_header_missing_or_not_utf8_is_dead_lettered_with_its_reason,
    run_stops_on_shutdown_after_settling_what_it_took,
    the_relay_publishes_rows_with_their_key_as_message_id,
);

/// A queue (and its dead-letter queue) named after the test's prefix, deleted at the end:
/// a classic queue, or a quorum queue where `QUORUM` holds.
pub(crate) struct Queue<const QUORUM: bool = false> {
    name: String,
    connection: Connection,
    publisher: AmqpDestination,
}

/// A quorum queue, which the generic broker tests run on as on a classic one.
pub(crate) type QuorumQueue = Queue<true>;

impl<const QUORUM: bool> Queue<QUORUM> {
    async fn new<DB: TestBackend>(db: &TestDb<DB>) -> Self {
        let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("RabbitMQ at {}: {e}", amqp_url()));
        let name = format!("{}orders", db.prefix);
        Self {
            publisher: AmqpDestination::new(&amqp_url(), "", &name),
            name,
            connection,
        }
    }

    fn dead(&self) -> String {
        format!("{}.dead", self.name)
    }

    /// A consumer's options for this queue, declared as its type says.
    fn options(&self) -> AmqpOptions {
        let options = AmqpOptions::new(&self.name);
        if QUORUM {
            options.queue_type(QueueType::Quorum)
        } else {
            options
        }
    }

    /// Publishes through the relay's own destination: `message_id` is the key.
    async fn publish(&self, key: &str, body: &[u8]) {
        use justonce_sql::{Delivered, Delivery, Destination};
        let delivery = Delivery {
            id: 0,
            key,
            destination: "orders",
            payload: body,
            headers: &[],
            attempt: 1,
        };
        assert_eq!(self.publisher.deliver(delivery).await, Delivered::Sent);
    }

    /// Publishes each body with its properties as they are, straight to the queue.
    async fn publish_raw<'m>(
        &self,
        messages: impl IntoIterator<Item = (&'m [u8], BasicProperties)>,
    ) {
        let channel = self.connection.create_channel().await.unwrap();
        for (body, properties) in messages {
            channel
                .basic_publish(
                    "".into(),
                    self.name.as_str().into(),
                    BasicPublishOptions::default(),
                    body,
                    properties,
                )
                .await
                .unwrap()
                .await
                .unwrap();
        }
    }

    /// Messages ready in the queue: neither delivered to a consumer nor acknowledged.
    async fn ready(&self) -> u32 {
        self.ready_in(&self.name).await
    }

    async fn ready_in(&self, queue: &str) -> u32 {
        let channel = self.connection.create_channel().await.unwrap();
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let queue = channel
            .queue_declare(queue.into(), passive, Default::default())
            .await
            .unwrap();
        queue.message_count()
    }

    /// One message from `queue`, if any: its properties and body.
    async fn get(&self, queue: &str) -> Option<(BasicProperties, Vec<u8>)> {
        let channel = self.connection.create_channel().await.unwrap();
        let message = channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()?;
        Some((message.delivery.properties, message.delivery.data))
    }

    async fn delete(self) {
        let channel = self.connection.create_channel().await.unwrap();
        for queue in [self.dead(), self.name.clone()] {
            channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await
                .unwrap();
        }
    }
}

fn header(properties: &BasicProperties, name: &str) -> Option<AMQPValue> {
    properties
        .headers()
        .as_ref()
        .and_then(|headers| headers.inner().get(name).cloned())
}

/// A consumer of the classic `queue` with the options `options` makes of its defaults.
async fn connect<DB: TestBackend>(
    db: &TestDb<DB>,
    queue: &Queue,
    options: impl FnOnce(AmqpOptions) -> AmqpOptions,
) -> AmqpConsumer<DB> {
    AmqpConsumer::connect(&amqp_url(), db.inbox.clone(), options(queue.options()))
        .await
        .unwrap()
}

async fn failing_work_is_retried_then_dead_lettered<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let queue = Queue::new(&db).await;
    let consumer = connect(&db, &queue, |options| options.max_attempts(3)).await;
    queue
        .publish("fail2:order", b"succeeds on the third attempt")
        .await;
    queue.publish("bad:order", b"never succeeds").await;
    // 3 attempts of each.
    let stats = take(&consumer, &db, 6).await;
    assert_eq!(
        (stats.processed, stats.retried, stats.dead_lettered),
        (1, 4, 1)
    );
    assert_eq!(db.effects_of(&Key::new("fail2:order").unwrap()).await, 1);
    assert_eq!(db.effects_of(&Key::new("bad:order").unwrap()).await, 0);
    let (properties, body) = queue.get(&queue.dead()).await.expect("a dead letter");
    assert_eq!(body, b"never succeeds");
    assert_eq!(
        properties.message_id().as_ref().map(|id| id.as_str()),
        Some("bad:order")
    );
    assert_eq!(
        header(&properties, ATTEMPT_HEADER),
        Some(AMQPValue::LongLongInt(3))
    );
    let Some(AMQPValue::LongString(reason)) = header(&properties, REASON_HEADER) else {
        panic!("a dead letter carries its reason");
    };
    let reason = String::from_utf8_lossy(reason.as_bytes()).into_owned();
    assert!(reason.contains("refused on attempt 3"), "{reason}");
    assert!(queue.get(&queue.name).await.is_none());
    consumer.close().await.unwrap();
    queue.delete().await;
    db.cleanup().await;
}

async fn a_message_without_a_key_or_with_a_blank_one_is_dead_lettered<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let queue = Queue::new(&db).await;
    let consumer = connect(&db, &queue, |options| options).await;
    // A blank id is no key either: as a key, every blank id would be one message.
    let blank = BasicProperties::default().with_message_id("  ".into());
    queue
        .publish_raw([
            (b"no id".as_slice(), BasicProperties::default()),
            (b"blank id".as_slice(), blank),
        ])
        .await;
    let stats = take(&consumer, &db, 2).await;
    assert_eq!(stats.dead_lettered, 2);
    let (properties, body) = queue.get(&queue.dead()).await.expect("a dead letter");
    assert_eq!(body, b"no id");
    assert_eq!(reason(&properties), "the message has no message_id");
    let (properties, body) = queue.get(&queue.dead()).await.expect("a dead letter");
    assert_eq!(body, b"blank id");
    let Some(AMQPValue::LongString(reason)) = header(&properties, REASON_HEADER) else {
        panic!("a reason: {properties:?}");
    };
    let reason = String::from_utf8_lossy(reason.as_bytes()).into_owned();
    assert!(reason.contains("blank"), "{reason}");
    assert_eq!(db.rows("effects").await, 0);
    consumer.close().await.unwrap();
    queue.delete().await;
    db.cleanup().await;
}

/// A quorum queue counts each delivery lost with its consumer (`x-delivery-count`), and
/// the consumer counts those as attempts: a message lost twice runs as its third attempt,
/// and one that fails then is at `max_attempts` and goes to the dead-letter queue at once.
/// Deliveries the consumer gave back are not counted.
#[tokio::test]
async fn a_quorum_queue_counts_deliveries_lost_with_their_consumer_as_attempts() {
    let db = TestDb::<justonce_sql::sqlx::Sqlite>::new("amqp_quorum").await;
    let queue = Queue::new(&db).await;
    let consumer = connect(&db, &queue, |options| {
        options.queue_type(QueueType::Quorum).max_attempts(3)
    })
    .await;
    // Declared quorum: a classic declaration of the same queue is refused.
    let channel = queue.connection.create_channel().await.unwrap();
    let durable = lapin::options::QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let classic = channel
        .queue_declare(queue.name.as_str().into(), durable, Default::default())
        .await;
    assert!(
        classic.is_err_and(|e| e.to_string().contains("inequivalent arg")),
        "the queue is not a quorum queue"
    );
    queue
        .publish("fail2:order", b"succeeds on its third attempt")
        .await;
    queue.publish("bad:order", b"never succeeds").await;
    // Twice, a consumer takes both and dies without settling them.
    for _ in 0..2 {
        assert_eq!(take_and_lose(&queue, 2, Duration::from_secs(10)).await, 2);
    }
    // Each given back twice (as while the database is down), which is not counted, then
    // run as its third attempt.
    let work = consumer_work::<justonce_sql::sqlx::Sqlite>(&db.prefix);
    let mut stats = ConsumerStats::default();
    let mut deliveries = consumer.deliveries().await.unwrap();
    for taken in 0..6 {
        let delivery = tokio::time::timeout(Duration::from_secs(10), deliveries.next())
            .await
            .expect("a delivery")
            .unwrap()
            .unwrap();
        if taken < 4 {
            let broker = consumer.broker();
            broker.settle(&delivery, Settle::GiveBack).await.unwrap();
        } else {
            let ran = consumer.run_one(&delivery, &work).await;
            consumer.settle(&delivery, ran, &mut stats).await.unwrap();
        }
    }
    deliveries.stop().await.unwrap();
    assert_eq!(
        (stats.processed, stats.retried, stats.dead_lettered),
        (1, 0, 1)
    );
    assert_eq!(db.effects_of(&Key::new("fail2:order").unwrap()).await, 1);
    let (properties, body) = queue.get(&queue.dead()).await.expect("a dead letter");
    assert_eq!(body, b"never succeeds");
    assert_eq!(
        header(&properties, ATTEMPT_HEADER),
        Some(AMQPValue::LongLongInt(3))
    );
    assert!(reason(&properties).contains("refused on attempt 3"));
    consumer.close().await.unwrap();
    queue.delete().await;
    db.cleanup().await;
}

/// Takes up to `count` deliveries of `queue` on a channel of its own, each within `wait`,
/// and closes the channel without settling them, as a consumer that dies does; how many
/// came.
async fn take_and_lose(queue: &Queue, count: usize, wait: Duration) -> usize {
    use futures_util::StreamExt;
    let channel = queue.connection.create_channel().await.unwrap();
    let mut taken = channel
        .basic_consume(
            queue.name.as_str().into(),
            "".into(),
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
    let mut came = 0;
    while came < count && tokio::time::timeout(wait, taken.next()).await.is_ok() {
        came += 1;
    }
    channel.close(200, "gone".into()).await.unwrap();
    came
}

/// A quorum queue declared with a delivery limit: a message lost with its consumer more
/// often than the limit goes to the dead-letter queue by the broker itself, with its body
/// and id, though no consumer of justonce saw it again.
#[tokio::test]
async fn a_quorum_queue_dead_letters_what_passes_its_delivery_limit() {
    let db = TestDb::<justonce_sql::sqlx::Sqlite>::new("amqp_limit").await;
    let queue = Queue::new(&db).await;
    let declare = |options: AmqpOptions| options.queue_type(QueueType::Quorum).delivery_limit(2);
    connect(&db, &queue, declare).await.close().await.unwrap();
    queue
        .publish("poison:order", b"kills whoever takes it")
        .await;
    // Taken and lost with its consumer, until the broker stops handing it out.
    let mut lost = 0;
    while take_and_lose(&queue, 1, Duration::from_secs(2)).await == 1 {
        lost += 1;
        assert!(lost <= 5, "the broker went on handing it out");
    }
    assert_eq!(lost, 3, "delivered once, and again up to its limit of 2");
    assert_eq!(queue.ready().await, 0);
    let (properties, body) = queue.get(&queue.dead()).await.expect("a dead letter");
    assert_eq!(body, b"kills whoever takes it");
    assert_eq!(
        properties.message_id().as_ref().map(|id| id.as_str()),
        Some("poison:order")
    );
    queue.delete().await;
    db.cleanup().await;
}

/// A message whose work ends its consumer's process, on a quorum queue with a prefetch of
/// 1: each worker started dies on it, on its first delivery and on each of the 3 attempts
/// counted in the database after it; then it is dead-lettered before it runs, and the worker goes on. Every
/// other message takes effect once.
#[tokio::test]
async fn a_message_that_kills_its_consumer_is_dead_lettered_after_its_attempts_on_a_quorum_queue() {
    use justonce_sql::sqlx::Postgres;
    let db = TestDb::<Postgres>::new("amqp_exit").await;
    let queue = Queue::new(&db).await;
    // Declared as the worker declares them.
    let declare = |options: AmqpOptions| options.queue_type(QueueType::Quorum);
    connect(&db, &queue, declare).await.close().await.unwrap();
    let mut keys: Vec<String> = (0..20).map(|n| format!("order:{n}")).collect();
    keys.insert(5, "exit:order".to_owned());
    for key in &keys {
        queue.publish(key, b"x").await;
    }
    let done = async || {
        db.rows("effects").await == 20
            && queue.ready_in(&queue.dead()).await == 1
            && queue.ready().await == 0
    };
    let start = || {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_broker-worker"))
            .args([&db.url, &db.prefix, &amqp_url(), &queue.name, "consumer"])
            .arg("run-quorum")
            .kill_on_drop(true)
            .spawn()
            .expect("start broker-worker")
    };
    let exits = super::broker::exits_until_done(start, done, 4).await;
    assert_eq!(
        exits, 4,
        "a worker died on its first run and its 3 counted attempts"
    );
    assert_eq!(db.rows("effects").await, 20);
    assert_eq!(db.doubled_effects().await, 0);
    assert_eq!(db.effects_of(&Key::new("exit:order").unwrap()).await, 0);
    let (properties, _) = queue.get(&queue.dead()).await.expect("a dead letter");
    assert_eq!(
        properties.message_id().as_ref().map(|id| id.as_str()),
        Some("exit:order")
    );
    assert_eq!(
        header(&properties, ATTEMPT_HEADER),
        Some(AMQPValue::LongLongInt(5))
    );
    let reason = reason(&properties);
    assert!(
        reason.contains("3 runs of it counted, 3 allowed"),
        "{reason}"
    );
    queue.delete().await;
    db.cleanup().await;
}

/// The dead letter's reason header, as text.
fn reason(properties: &BasicProperties) -> String {
    let Some(AMQPValue::LongString(reason)) = header(properties, REASON_HEADER) else {
        panic!("a reason: {properties:?}");
    };
    String::from_utf8_lossy(reason.as_bytes()).into_owned()
}

/// The reason tells a missing header from one that is not text.
async fn a_key_header_missing_or_not_utf8_is_dead_lettered_with_its_reason<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let queue = Queue::new(&db).await;
    let consumer = connect(&db, &queue, |options| {
        options.key_from(KeyFrom::Header("order-id".into()))
    })
    .await;
    let mut not_utf8 = lapin::types::FieldTable::default();
    not_utf8.insert(
        "order-id".into(),
        AMQPValue::LongString(b"\xff\xfe".as_slice().into()),
    );
    let not_utf8 = BasicProperties::default().with_headers(not_utf8);
    queue
        .publish_raw([
            (b"missing".as_slice(), BasicProperties::default()),
            (b"not utf-8".as_slice(), not_utf8),
        ])
        .await;
    let stats = take(&consumer, &db, 2).await;
    assert_eq!(stats.dead_lettered, 2);
    for (expected_body, expected_reason) in [
        (
            b"missing".as_slice(),
            "the message has no text header order-id",
        ),
        (b"not utf-8".as_slice(), "header order-id is not UTF-8"),
    ] {
        let (properties, body) = queue.get(&queue.dead()).await.expect("a dead letter");
        assert_eq!(body, expected_body);
        assert_eq!(reason(&properties), expected_reason);
    }
    consumer.close().await.unwrap();
    queue.delete().await;
    db.cleanup().await;
}

async fn run_stops_on_shutdown_after_settling_what_it_took<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let queue = Queue::new(&db).await;
    let consumer = connect(&db, &queue, |options| options).await;
    for n in 0..10 {
        queue.publish(&format!("order:{n}"), b"x").await;
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = {
        let work = consumer_work::<DB>(&db.prefix);
        async { consumer.run(stopped, work).await }
    };
    let waiting = async {
        while db.rows("effects").await < 10 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.send(()).unwrap();
    };
    let (stats, ()) = tokio::join!(running, waiting);
    let stats = stats.unwrap();
    assert_eq!(stats.processed, 10);
    assert_eq!(db.rows("effects").await, 10);
    consumer.close().await.unwrap();
    queue.delete().await;
    db.cleanup().await;
}

/// Acknowledging a batch counts each delivery acknowledged and no other: one settled
/// before is not taken again, and the one after it is acknowledged and counted all the same.
#[tokio::test]
async fn acknowledging_a_batch_counts_the_deliveries_acknowledged_whichever_failed() {
    let db = TestDb::<sqlx::Postgres>::new("ack_all_counts").await;
    let queue = Queue::new(&db).await;
    let consumer = connect(&db, &queue, |options| options).await;
    for key in ["order:1", "order:2"] {
        queue.publish(key, b"x").await;
    }
    let mut deliveries = consumer.deliveries().await.unwrap();
    let mut next = async || {
        tokio::time::timeout(Duration::from_secs(30), deliveries.next())
            .await
            .expect("a delivery within 30 s")
            .unwrap()
            .expect("the consumer is not cancelled")
    };
    let (first, second) = (next().await, next().await);
    drop(deliveries);
    let broker = consumer.broker();
    broker.settle(&first, Settle::Ack).await.unwrap();
    let mut acked = 0;
    let all = broker.ack_all(&[&first, &second], &mut acked).await;
    assert!(all.is_err(), "the first was settled before: {all:?}");
    assert_eq!(acked, 1, "the second alone");
    consumer.close().await.unwrap();
    assert_eq!(queue.ready().await, 0, "both acknowledged");
    queue.delete().await;
    db.cleanup().await;
}

/// A batch is acknowledged with one `multiple` acknowledgement only when no earlier
/// delivery of its channel is unsettled: a later batch acknowledged first leaves the
/// earlier deliveries to the broker, which delivers them again once the consumer is gone.
#[tokio::test]
async fn acknowledging_a_later_batch_first_leaves_the_earlier_deliveries_unsettled() {
    let db = TestDb::<sqlx::Postgres>::new("ack_later_batch").await;
    let queue = Queue::new(&db).await;
    let consumer = connect(&db, &queue, |options| options).await;
    for n in 1..=6 {
        queue.publish(&format!("order:{n}"), b"x").await;
    }
    let taken = deliveries_taken(&consumer, 6).await;
    let broker = consumer.broker();
    let mut acked = 0;
    let later: Vec<_> = taken[4..].iter().collect();
    broker.ack_all(&later, &mut acked).await.unwrap();
    let before: Vec<_> = taken[..2].iter().collect();
    broker.ack_all(&before, &mut acked).await.unwrap();
    assert_eq!(acked, 4, "both batches acknowledged");
    consumer.close().await.unwrap();
    assert_eq!(
        queue.ready().await,
        2,
        "the two between them are delivered again"
    );

    let consumer = connect(&db, &queue, |options| options).await;
    let again = deliveries_taken(&consumer, 2).await;
    let ids: Vec<_> = again
        .iter()
        .map(|d| d.properties.message_id().clone().unwrap().to_string())
        .collect();
    assert_eq!(ids, ["order:3", "order:4"]);
    let mut acked = 0;
    let all: Vec<_> = again.iter().collect();
    consumer.broker().ack_all(&all, &mut acked).await.unwrap();
    assert_eq!(acked, 2);
    consumer.close().await.unwrap();
    assert_eq!(queue.ready().await, 0, "all acknowledged");
    queue.delete().await;
    db.cleanup().await;
}

/// The next `count` deliveries of `consumer`, taken and not settled.
async fn deliveries_taken<DB: TestBackend>(
    consumer: &AmqpConsumer<DB>,
    count: usize,
) -> Vec<justonce_transport::amqp::AmqpDelivery> {
    let mut deliveries = consumer.deliveries().await.unwrap();
    let mut taken = Vec::new();
    for _ in 0..count {
        let next = tokio::time::timeout(Duration::from_secs(30), deliveries.next());
        taken.push(
            next.await
                .expect("a delivery within 30 s")
                .unwrap()
                .unwrap(),
        );
    }
    taken
}

async fn the_relay_publishes_rows_with_their_key_as_message_id<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let queue = Queue::new(&db).await;
    // Declares the queue the relay publishes to.
    let consumer = connect(&db, &queue, |options| options).await;
    let key = Key::new("invoice:2026-10:cust_481").unwrap();
    let mut tx = db.inbox.begin().await.unwrap();
    let message = Message::new("orders", b"invoice".to_vec()).header("content-type", "text/plain");
    db.inbox.forward(&mut tx, &key, message).await.unwrap();
    tx.commit().await.unwrap();
    let relay = db
        .inbox
        .outbox()
        .relay()
        .destination("orders", AmqpDestination::new(&amqp_url(), "", &queue.name));
    let round = relay.relay_once().await.unwrap();
    assert_eq!(round.sent, 1);
    let (properties, body) = queue.get(&queue.name).await.expect("the published row");
    assert_eq!(body, b"invoice");
    assert_eq!(
        properties.message_id().as_ref().map(|id| id.as_str()),
        Some(key.as_str())
    );
    assert_eq!(
        properties.content_type().as_ref().map(|t| t.as_str()),
        Some("text/plain")
    );
    assert_eq!(*properties.delivery_mode(), Some(2), "persistent");
    consumer.close().await.unwrap();
    queue.delete().await;
    db.cleanup().await;
}

impl super::broker::Restartable for Queue {
    const KIND: &'static str = "amqp";
    type Adapter = justonce_transport::amqp::Amqp;

    async fn connect_to<DB: TestBackend>(
        url: &str,
        name: &str,
        inbox: &Inbox<DB>,
    ) -> AmqpConsumer<DB> {
        let options = AmqpOptions::new(name).reconnect_max_wait(Duration::from_millis(200));
        AmqpConsumer::connect(url, inbox.clone(), options)
            .await
            .unwrap()
    }

    async fn publish_to(url: &str, name: &str, key: &str) {
        super::broker::deliver(&AmqpDestination::new(url, "", name), key).await;
    }
}

impl<const QUORUM: bool> GivingBack for Queue<QUORUM> {
    type Adapter = justonce_transport::amqp::Amqp;

    fn generic<DB: TestBackend>(consumer: AmqpConsumer<DB>) -> AmqpConsumer<DB> {
        consumer
    }
}

impl<const QUORUM: bool> Batching for Queue<QUORUM> {
    async fn connect_for_batches<DB: TestBackend>(&self, inbox: &Inbox<DB>) -> AmqpConsumer<DB> {
        let options = self.options().prefetch(64).max_attempts(2);
        AmqpConsumer::connect(&amqp_url(), inbox.clone(), options)
            .await
            .unwrap()
    }

    async fn dead_letters(&self) -> u64 {
        u64::from(self.ready_in(&self.dead()).await)
    }
}

impl<const QUORUM: bool> TestBroker for Queue<QUORUM> {
    type Consumer<DB: TestBackend> = AmqpConsumer<DB>;

    fn url() -> String {
        amqp_url()
    }

    async fn open<DB: TestBackend>(db: &TestDb<DB>) -> Self {
        let queue = Self::new(db).await;
        // Declares the queues.
        queue.connect(db).await.close().await.unwrap();
        queue
    }

    fn worker_options(&self) -> &'static [&'static str] {
        if QUORUM { &["quorum"] } else { &[] }
    }

    fn name(&self) -> &str {
        &self.name
    }

    async fn publish(&self, keys: &[String]) {
        for key in keys {
            Queue::publish(self, key, b"x").await;
        }
    }

    async fn connect<DB: TestBackend>(&self, db: &TestDb<DB>) -> AmqpConsumer<DB> {
        AmqpConsumer::connect(&amqp_url(), db.inbox.clone(), self.options())
            .await
            .unwrap()
    }

    async fn consume<DB: TestBackend>(
        &self,
        consumer: &AmqpConsumer<DB>,
        db: &TestDb<DB>,
        count: usize,
    ) -> ConsumerStats {
        take(consumer, db, count).await
    }

    async fn settled<DB: TestBackend>(&self, _db: &TestDb<DB>) -> bool {
        // Ready messages only: AMQP does not count the unacknowledged ones.
        self.ready().await == 0
    }

    async fn delete(self) {
        Queue::delete(self).await
    }
}

/// A broker that takes the connection and never answers the AMQP handshake: the probe
/// gives up, and the socket is shut, so that lapin's thread, which waits on it, ends.
#[tokio::test]
async fn a_connection_given_up_on_is_shut() {
    use tokio::io::AsyncReadExt;
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("amqp://guest:guest@{}/%2f", silent.local_addr().unwrap());
    let probing = tokio::spawn(async move {
        justonce_transport::amqp::probe(&url, &AmqpOptions::new("orders")).await
    });
    let (mut accepted, _) = silent.accept().await.unwrap();
    let mut header = [0; 8];
    accepted.read_exact(&mut header).await.unwrap();
    assert_eq!(
        &header, b"AMQP\x00\x00\x09\x01",
        "the protocol header, then a wait"
    );
    let error = probing.await.unwrap().unwrap_err();
    assert!(
        error.to_string().contains("no answer within 5 s"),
        "{error}"
    );
    let closed = tokio::time::timeout(Duration::from_secs(5), accepted.read(&mut [0; 1])).await;
    assert!(
        matches!(closed, Ok(Ok(0))),
        "the client's side is shut: {closed:?}"
    );
}
