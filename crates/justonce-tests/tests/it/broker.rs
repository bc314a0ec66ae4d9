//! What every broker consumer must do, one body per proof fanned over every broker (and the
//! single readers of NATS and Redis, which keep their offset in the database) and every
//! database: a message delivered twice takes effect once; a worker killed after its commit
//! and before its ack leaves one effect, and the redelivery is a duplicate (a reader does
//! not read it again); 10,000 messages with a fifth repeated take effect once per key; a
//! consumer killed twenty times at random moments loses nothing and doubles nothing; two
//! consumer processes on one queue take effect once per key; where a consumer takes
//! batches, a failing or killed batch neither loses nor doubles the others; and a consumer
//! whose broker (one of the test's own) is killed and started again goes on by itself.

use super::{Xorshift, run_until};
use justonce_sql::{Inbox, InboxOptions, Key};
use justonce_tests::{OwnBroker, SeenBatches, TestBackend, TestDb, batch_work, consumer_work};
use justonce_transport::{
    Broker, Consumer, ConsumerStats, Incoming, Link, OrderedBroker, Ran, Reader, Received,
};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};

/// A broker under test: the queue, stream or topic of one test, and its consumers.
pub(crate) trait TestBroker: Sized {
    /// A consumer of the test's queue, with the test's inbox.
    type Consumer<DB: TestBackend>: Consume<DB>;

    /// Whether the consumer keeps its position in the database (a single reader): what it
    /// committed is not delivered again, instead of delivered again as a duplicate.
    const KEEPS_OFFSET: bool = false;

    /// The broker's URL, as a worker process takes it.
    fn url() -> String;

    /// The queue, stream or topic named after the test, ready to hold messages for its
    /// consumers (a session or group made), with no consumer connected.
    async fn open<DB: TestBackend>(db: &TestDb<DB>) -> Self;

    /// The queue opened for two consumer processes that share its messages: [`open`], and on
    /// MQTT their sessions in one shared subscription.
    ///
    /// [`open`]: TestBroker::open
    async fn open_shared<DB: TestBackend>(db: &TestDb<DB>) -> Self {
        Self::open(db).await
    }

    /// The name a worker process consumes.
    fn name(&self) -> &str;

    /// What a worker process takes after its mode to consume the queue as declared: on
    /// RabbitMQ, a quorum queue's type.
    fn worker_options(&self) -> &'static [&'static str] {
        &[]
    }

    /// Publishes one message per key, each stored by the broker before the next.
    async fn publish(&self, keys: &[String]);

    async fn connect<DB: TestBackend>(&self, db: &TestDb<DB>) -> Self::Consumer<DB>;

    /// Takes exactly `count` messages, runs and settles each.
    async fn consume<DB: TestBackend>(
        &self,
        consumer: &Self::Consumer<DB>,
        db: &TestDb<DB>,
        count: usize,
    ) -> ConsumerStats;

    /// Whether the broker holds nothing unread or unacknowledged for the consumers (a
    /// reader: its stored offset is the stream's last); true where the broker cannot say
    /// (MQTT).
    async fn settled<DB: TestBackend>(&self, db: &TestDb<DB>) -> bool;

    async fn delete(self);
}

/// What the consumer of every broker offers: running the tests' work until stopped, one
/// message at a time or in batches.
pub(crate) trait Consume<DB: TestBackend> {
    async fn run_work(
        &self,
        db: &TestDb<DB>,
        stopped: tokio::sync::oneshot::Receiver<()>,
    ) -> Result<ConsumerStats, justonce_transport::Error>;

    /// `run_batched` with batches of up to `batch_size`.
    async fn run_work_batched(
        &self,
        db: &TestDb<DB>,
        stopped: tokio::sync::oneshot::Receiver<()>,
        batch_size: usize,
    ) -> Result<ConsumerStats, justonce_transport::Error>;

    /// `run_batches` with batches of up to `batch_size` and [`batch_work`], which notes
    /// the keys of each batch it gets in `seen`.
    async fn run_batch_work(
        &self,
        db: &TestDb<DB>,
        stopped: tokio::sync::oneshot::Receiver<()>,
        batch_size: usize,
        seen: SeenBatches,
    ) -> Result<ConsumerStats, justonce_transport::Error>;
}

/// Every consumer, and the single readers, which keep their offset in the database.
macro_rules! consume_with_run {
    ($([$($generics:tt)*] $consumer:ty),* $(,)?) => {$(
        impl<$($generics)* DB: TestBackend> Consume<DB> for $consumer {
            async fn run_work(
                &self,
                db: &TestDb<DB>,
                stopped: tokio::sync::oneshot::Receiver<()>,
            ) -> Result<ConsumerStats, justonce_transport::Error> {
                self.run(stopped, consumer_work::<DB>(&db.prefix)).await
            }

            async fn run_work_batched(
                &self,
                db: &TestDb<DB>,
                stopped: tokio::sync::oneshot::Receiver<()>,
                batch_size: usize,
            ) -> Result<ConsumerStats, justonce_transport::Error> {
                let work = consumer_work::<DB>(&db.prefix);
                self.run_batched(stopped, batch_size, work).await
            }

            async fn run_batch_work(
                &self,
                db: &TestDb<DB>,
                stopped: tokio::sync::oneshot::Receiver<()>,
                batch_size: usize,
                seen: SeenBatches,
            ) -> Result<ConsumerStats, justonce_transport::Error> {
                let work = batch_work::<DB>(&db.prefix, Some(seen));
                self.run_batches(stopped, batch_size, work).await
            }
        }
    )*};
}

consume_with_run!(
    [B: Broker,] Consumer<B, DB>,
    [O: OrderedBroker,] Reader<O, DB>,
);

/// What a consumer's `consume` does: takes exactly `count` deliveries, each within 30 s,
/// and runs and settles each.
pub(crate) async fn take<B: Broker, DB: TestBackend>(
    consumer: &Consumer<B, DB>,
    db: &TestDb<DB>,
    count: usize,
) -> ConsumerStats {
    let work = consumer_work::<DB>(&db.prefix);
    let mut stats = ConsumerStats::default();
    let mut deliveries = consumer.deliveries().await.unwrap();
    for taken in 0..count {
        let delivery = tokio::time::timeout(Duration::from_secs(30), deliveries.next())
            .await
            .unwrap_or_else(|_| panic!("{taken} of {count} deliveries, then none for 30 s"))
            .unwrap()
            .expect("the consumer is not cancelled");
        let ran = consumer.run_one(&delivery, &work).await;
        consumer.settle(&delivery, ran, &mut stats).await.unwrap();
    }
    deliveries.stop().await.unwrap();
    stats
}

/// What a single reader's `consume` does: runs it until its stored offset is the stream's
/// last, then checks that it took exactly `count` entries.
pub(crate) async fn read_to_end<B, DB>(
    broker: &B,
    reader: &B::Consumer<DB>,
    db: &TestDb<DB>,
    count: usize,
) -> ConsumerStats
where
    B: TestBroker,
    DB: TestBackend,
{
    let stats = consume_until(db, reader, || broker.settled(db)).await;
    let taken = stats.processed + stats.duplicates + stats.key_reused + stats.dead_lettered;
    assert_eq!(taken, count as u64, "entries read: {stats:?}");
    stats
}

/// A broker whose consumer (or reader) claims what has arrived in batches.
pub(crate) trait Batching: TestBroker {
    /// A consumer claiming in `inbox` that takes up to 64 messages ahead and gives failed
    /// work 2 attempts; a reader runs two batches at once.
    async fn connect_for_batches<DB: TestBackend>(&self, inbox: &Inbox<DB>) -> Self::Consumer<DB>;

    /// How many messages the dead-letter queue or stream holds.
    async fn dead_letters(&self) -> u64;
}

/// A broker whose consumer gives deliveries back to it: every one but the single readers.
pub(crate) trait GivingBack: Batching {
    /// The broker's adapter.
    type Adapter: Broker;

    /// The consumer as the generic [`Consumer`] it is.
    fn generic<DB: TestBackend>(consumer: Self::Consumer<DB>) -> Consumer<Self::Adapter, DB>;
}

/// A broker whose consumer gives deliveries back and can give each message one attempt.
pub(crate) trait OneAttempt: GivingBack {
    /// A consumer as [`Batching::connect_for_batches`] connects, giving each message a
    /// single attempt: a delivery counted as a run it was not is then dead-lettered.
    async fn connect_with_one_attempt<DB: TestBackend>(
        &self,
        inbox: &Inbox<DB>,
    ) -> Self::Consumer<DB>;
}

/// A broker whose consumer a test keeps running while it kills the broker, one of the
/// test's own ([`OwnBroker`]), and starts it again.
pub(crate) trait Restartable {
    /// The broker's kind, as [`OwnBroker::start`] takes it.
    const KIND: &'static str;

    /// The broker's adapter.
    type Adapter: Broker;

    /// A consumer of `name` (a queue, stream or topic) on the broker at `url`, claiming in
    /// `inbox`, that waits at most 200 ms between two attempts to connect again.
    async fn connect_to<DB: TestBackend>(
        url: &str,
        name: &str,
        inbox: &Inbox<DB>,
    ) -> Consumer<Self::Adapter, DB>;

    /// Publishes `key` to `name` on the broker at `url` through the relay's destination,
    /// which puts the key where the consumer takes it from by default, and waits until the
    /// broker stored it.
    async fn publish_to(url: &str, name: &str, key: &str);
}

/// What every [`Restartable::publish_to`] does once it has the broker's destination.
pub(crate) async fn deliver(destination: &impl justonce_sql::Destination, key: &str) {
    let delivery = justonce_sql::Delivery {
        id: 0,
        key,
        destination: "orders",
        payload: b"x",
        headers: &[],
        attempt: 1,
    };
    assert_eq!(
        destination.deliver(delivery).await,
        justonce_sql::Delivered::Sent
    );
}

/// Runs `consumer` until `done` holds, then stops it, and returns what it counted.
pub(crate) async fn consume_until<DB, F, Fut>(
    db: &TestDb<DB>,
    consumer: &impl Consume<DB>,
    done: F,
) -> ConsumerStats
where
    DB: TestBackend,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    run_until(|stopped| consumer.run_work(db, stopped), done, effects(db)).await
}

/// The effect rows of `db`: the progress a stalled test is judged by.
pub(crate) fn effects<'d, DB: TestBackend>(
    db: &'d TestDb<DB>,
) -> impl Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = i64> + 'd>> + 'd {
    move || Box::pin(db.rows("effects"))
}

/// Whether the broker is settled within 10 s: NATS takes acks without answering them, so
/// the last ones may still be on their way when the consumer has sent them.
async fn settles<B: TestBroker, DB: TestBackend>(broker: &B, db: &TestDb<DB>) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !broker.settled(db).await {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    true
}

/// Fans each generic test body out into one test per broker and database, such as
/// `broker::every::amqp::sqlite::name`.
macro_rules! on_brokers {
    ($module:ident: [$($name:ident = $broker:ty),* $(,)?] $tests:tt) => {
        mod $module {
            $(on_brokers!(@broker $name, $broker, $tests);)*
        }
    };
    (@broker $name:ident, $broker:ty, $tests:tt) => {
        mod $name {
            on_brokers!(@database sqlite, sqlx::Sqlite, $broker, $tests);
            on_brokers!(@database postgres, sqlx::Postgres, $broker, $tests);
            on_brokers!(@database mysql, sqlx::MySql, $broker, $tests);
        }
    };
    (@broker_on $database:ident, $db:ty, [$($name:ident = $broker:ty),* $(,)?] $tests:tt) => {$(
        mod $name {
            on_brokers!(@database $database, $db, $broker, $tests);
        }
    )*};
    (@database $name:ident, $db:ty, $broker:ty, ($($test:ident),* $(,)?)) => {
        mod $name {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    crate::broker::$test::<$broker, $db>(stringify!($test)).await
                }
            )*
        }
    };
}

on_brokers!(every: [
    amqp = crate::amqp::Queue,
    nats = crate::nats::Stream,
    nats_reader = crate::nats::ReadStream,
    redis = crate::redis_streams::Stream,
    redis_reader = crate::redis_streams::ReadStream,
    mqtt = crate::mqtt::Topic,
] (
    each_message_delivered_twice_takes_effect_once,
    a_worker_killed_between_commit_and_ack_leaves_one_effect,
    a_consumer_killed_twenty_times_loses_nothing_and_doubles_nothing,
));

// Kafka has its own list: a member killed holds its partitions until the group's session
// timeout, so twenty kills would cost twenty timeouts.
on_brokers!(every_kafka: [
    kafka = crate::kafka::Topic,
] (
    each_message_delivered_twice_takes_effect_once,
    a_worker_killed_between_commit_and_ack_leaves_one_effect,
));

// NATS is left out: its stream drops a message published again with the same
// `Nats-Msg-Id` within its duplicate window, so the second tries would not reach the
// consumer.
on_brokers!(check: [
    amqp = crate::amqp::Queue,
    redis = crate::redis_streams::Stream,
    redis_reader = crate::redis_streams::ReadStream,
    mqtt = crate::mqtt::Topic,
] (
    the_conformance_kit_passes_a_consumer_restarted_between_tries,
));

// A broker of the test's own is started for each run, twice (RabbitMQ takes the longest,
// about 20 s a start): each broker runs it on one database, the three taken in turn. Redis
// breaks its connection through a proxy on every database too, in its own module.
mod restarted {
    mod amqp {
        on_brokers!(@database postgres, sqlx::Postgres, crate::amqp::Queue,
            (a_consumer_goes_on_by_itself_while_its_broker_is_killed_and_started_again));
    }
    mod nats {
        on_brokers!(@database mysql, sqlx::MySql, crate::nats::Stream,
            (a_consumer_goes_on_by_itself_while_its_broker_is_killed_and_started_again));
    }
    mod mqtt {
        on_brokers!(@database sqlite, sqlx::Sqlite, crate::mqtt::Topic,
            (a_consumer_goes_on_by_itself_while_its_broker_is_killed_and_started_again));
    }
    mod redis {
        on_brokers!(@database postgres, sqlx::Postgres, crate::redis_streams::Stream,
            (a_consumer_goes_on_by_itself_while_its_broker_is_killed_and_started_again));
    }
}

// The 10,000-message proof is about the consumer, not the database, and costs a minute a
// run: each broker runs it on one database, the three taken in turn. The claim tests and
// the fault harness prove every database under load. MQTT's own test publishes while it
// consumes: Mosquitto keeps 1,000 messages per session.
mod many {
    mod amqp {
        on_brokers!(@database postgres, sqlx::Postgres, crate::amqp::Queue,
            (ten_thousand_messages_a_fifth_repeated_take_effect_once_per_key));
    }
    mod nats {
        on_brokers!(@database mysql, sqlx::MySql, crate::nats::Stream,
            (ten_thousand_messages_a_fifth_repeated_take_effect_once_per_key));
    }
    mod nats_reader {
        on_brokers!(@database postgres, sqlx::Postgres, crate::nats::ReadStream,
            (ten_thousand_messages_a_fifth_repeated_take_effect_once_per_key));
    }
    mod redis {
        on_brokers!(@database sqlite, sqlx::Sqlite, crate::redis_streams::Stream,
            (ten_thousand_messages_a_fifth_repeated_take_effect_once_per_key));
    }
    mod redis_reader {
        on_brokers!(@database mysql, sqlx::MySql, crate::redis_streams::ReadStream,
            (ten_thousand_messages_a_fifth_repeated_take_effect_once_per_key));
    }
}

on_brokers!(competing: [
    amqp = crate::amqp::Queue,
    nats = crate::nats::Stream,
    redis = crate::redis_streams::Stream,
    mqtt = crate::mqtt::Topic,
] (
    two_consumer_processes_on_one_queue_take_effect_once_each,
));

on_brokers!(batched: [
    amqp = crate::amqp::Queue,
    nats = crate::nats::Stream,
    nats_reader = crate::nats::ReadStream,
    redis = crate::redis_streams::Stream,
    redis_reader = crate::redis_streams::ReadStream,
    mqtt = crate::mqtt::Topic,
    kafka = crate::kafka::Topic,
] (
    a_failing_message_in_a_batch_neither_loses_nor_doubles_the_others,
    a_worker_killed_in_the_middle_of_a_batch_loses_nothing_and_doubles_nothing,
    a_batch_work_gets_each_key_once_and_writes_one_effect_per_key,
    a_failing_batch_work_runs_again_alone_and_the_poison_message_alone_fails,
    a_work_that_panics_fails_its_attempts_and_the_consumer_goes_on,
));

on_brokers!(giving_back: [
    amqp = crate::amqp::Queue,
    nats = crate::nats::Stream,
    redis = crate::redis_streams::Stream,
    mqtt = crate::mqtt::Topic,
] (
    a_database_failure_gives_the_batch_back_and_asks_for_a_pause,
    a_batched_consumer_stopped_mid_run_acknowledges_every_delivery_it_committed,
));

// Two transactions at once: SQLite takes one writer at a time.
mod at_once {
    on_brokers!(@broker_on postgres, sqlx::Postgres, [
        amqp = crate::amqp::Queue,
        nats = crate::nats::Stream,
        redis = crate::redis_streams::Stream,
        mqtt = crate::mqtt::Topic,
    ] (
        batches_run_two_at_once_and_each_message_takes_effect_once,
        two_batches_at_once_stopped_mid_run_acknowledge_every_delivery_committed,
        batches_at_once_pause_after_a_database_failure,
    ));
    mod on_mariadb {
        on_brokers!(@broker_on mysql, sqlx::MySql, [
            amqp = crate::amqp::Queue,
        ] (
            batches_run_two_at_once_and_each_message_takes_effect_once,
            two_batches_at_once_stopped_mid_run_acknowledge_every_delivery_committed,
            batches_at_once_pause_after_a_database_failure,
        ));
    }
}

// RabbitMQ's quorum queue, the replicated one, through the proofs of a classic queue: what
// differs is the broker's, so one database runs them. A quorum queue's own delivery count and
// limit have their tests in `amqp`.
mod quorum {
    on_brokers!(@broker_on postgres, sqlx::Postgres, [
        amqp = crate::amqp::QuorumQueue,
    ] (
        each_message_delivered_twice_takes_effect_once,
        a_worker_killed_between_commit_and_ack_leaves_one_effect,
        a_consumer_killed_twenty_times_loses_nothing_and_doubles_nothing,
        ten_thousand_messages_a_fifth_repeated_take_effect_once_per_key,
        two_consumer_processes_on_one_queue_take_effect_once_each,
        a_failing_message_in_a_batch_neither_loses_nor_doubles_the_others,
        a_worker_killed_in_the_middle_of_a_batch_loses_nothing_and_doubles_nothing,
        a_batch_work_gets_each_key_once_and_writes_one_effect_per_key,
        a_failing_batch_work_runs_again_alone_and_the_poison_message_alone_fails,
        a_work_that_panics_fails_its_attempts_and_the_consumer_goes_on,
        a_database_failure_gives_the_batch_back_and_asks_for_a_pause,
        a_batched_consumer_stopped_mid_run_acknowledges_every_delivery_it_committed,
    ));
}

// A message whose work ends its process, on every broker: the runs started are counted
// in the database. PostgreSQL only: the count is proven on every database by `runs`.
mod crash_loop {
    on_brokers!(@broker_on postgres, sqlx::Postgres, [
        amqp = crate::amqp::Queue,
        nats = crate::nats::Stream,
        nats_reader = crate::nats::ReadStream,
        redis = crate::redis_streams::Stream,
        redis_reader = crate::redis_streams::ReadStream,
        mqtt = crate::mqtt::Topic,
        kafka = crate::kafka::Topic,
    ] (
        a_message_that_kills_its_consumer_is_dead_lettered_after_its_attempts,
        a_message_that_kills_a_batch_is_dead_lettered_alone,
        a_message_that_kills_a_later_batch_ends_its_attempts_and_one_more,
    ));
}

on_brokers!(given_back: [
    nats = crate::nats::Stream,
    redis = crate::redis_streams::Stream,
] (
    a_delivery_given_back_while_the_database_is_down_costs_no_attempt,
));

on_brokers!(reading: [
    nats_reader = crate::nats::ReadStream,
    redis_reader = crate::redis_streams::ReadStream,
] (
    a_reader_runs_an_entry_again_after_the_pause_that_follows_a_database_failure,
    a_batched_reader_runs_an_entry_again_after_the_pause_that_follows_a_database_failure,
    a_batch_that_fails_is_not_skipped_by_the_batch_running_beside_it,
));

// A trigger fails the database once: PostgreSQL's, and readers of one partition.
mod first_batch {
    on_brokers!(@broker_on postgres, sqlx::Postgres, [
        nats_reader = crate::nats::ReadStream,
        redis_reader = crate::redis_streams::ReadStream,
    ] (
        a_first_batch_cut_by_a_database_failure_still_counts_the_runs_of_its_rest,
    ));
}

/// A worker process: a consumer, or the reader of a broker that keeps its offset.
fn worker<B: TestBroker, DB: TestBackend>(
    db: &TestDb<DB>,
    broker: &B,
    mode: &str,
) -> tokio::process::Child {
    let kind = if B::KEEPS_OFFSET {
        "reader"
    } else {
        "consumer"
    };
    spawn_worker(db, broker, kind, mode)
}

fn spawn_worker<B: TestBroker, DB: TestBackend>(
    db: &TestDb<DB>,
    broker: &B,
    kind: &str,
    mode: &str,
) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_broker-worker"))
        .args([&db.url, &db.prefix, &B::url(), broker.name(), kind, mode])
        .args(broker.worker_options())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start broker-worker")
}

async fn each_message_delivered_twice_takes_effect_once<B: TestBroker, DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let broker = B::open(&db).await;
    let keys: Vec<String> = (0..100).map(|n| format!("order:{}", n % 50)).collect();
    broker.publish(&keys).await;
    let consumer = broker.connect(&db).await;
    let stats = broker.consume(&consumer, &db, 100).await;
    assert_eq!((stats.processed, stats.duplicates), (50, 50));
    assert_eq!(db.rows("effects").await, 50);
    assert_eq!(db.doubled_effects().await, 0);
    assert!(
        settles(&broker, &db).await,
        "every delivery was acknowledged"
    );
    drop(consumer);
    broker.delete().await;
    db.cleanup().await;
}

async fn a_worker_killed_between_commit_and_ack_leaves_one_effect<
    B: TestBroker,
    DB: TestBackend,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let broker = B::open(&db).await;
    broker
        .publish(&["order:0".to_owned(), "order:1".to_owned()])
        .await;
    let mut paused = worker(&db, &broker, "pause-after-commit");
    let mut lines = BufReader::new(paused.stdout.take().unwrap()).lines();
    let said = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("the worker commits within 30 s")
        .unwrap();
    assert_eq!(said.as_deref(), Some("committed order:0 Processed(())"));
    paused.kill().await.expect("SIGKILL the worker");
    assert_eq!(db.effects_of(&Key::new("order:0").unwrap()).await, 1);
    // The broker delivers the unacknowledged message again: a duplicate, acknowledged. A
    // reader starts after the offset committed with the work, and reads only order:1.
    let consumer = broker.connect(&db).await;
    let redelivered = u64::from(!B::KEEPS_OFFSET);
    let stats = broker
        .consume(&consumer, &db, 1 + usize::from(!B::KEEPS_OFFSET))
        .await;
    assert_eq!((stats.processed, stats.duplicates), (1, redelivered));
    for key in ["order:0", "order:1"] {
        assert_eq!(db.effects_of(&Key::new(key).unwrap()).await, 1, "{key}");
    }
    assert!(
        settles(&broker, &db).await,
        "the redelivery was acknowledged"
    );
    drop(consumer);
    broker.delete().await;
    db.cleanup().await;
}

async fn ten_thousand_messages_a_fifth_repeated_take_effect_once_per_key<
    B: TestBroker,
    DB: TestBackend,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let broker = B::open(&db).await;
    let keys: Vec<String> = (0..10_000)
        .map(|n| format!("order:{}", n % 8_000))
        .collect();
    broker.publish(&keys).await;
    let consumer = broker.connect(&db).await;
    let stats = broker.consume(&consumer, &db, 10_000).await;
    assert_eq!((stats.processed, stats.duplicates), (8_000, 2_000));
    assert_eq!(db.rows("effects").await, 8_000, "effects = distinct keys");
    assert_eq!(db.doubled_effects().await, 0);
    // On a slow machine a broker may have redelivered what sat in the consumer's prefetch
    // past its ack wait; a running consumer takes those as duplicates and settles them.
    if !broker.settled(&db).await {
        let again = consume_until(&db, &consumer, || broker.settled(&db)).await;
        assert_eq!(again.processed, 0, "a redelivery ran its work again");
    }
    assert!(settles(&broker, &db).await, "every message was settled");
    assert_eq!(db.rows("effects").await, 8_000, "effects = distinct keys");
    drop(consumer);
    broker.delete().await;
    db.cleanup().await;
}

/// The test's queue with 500 messages for 400 keys published: within Mosquitto's default
/// of 1,000 queued per session.
async fn with_repeats<B: TestBroker>(broker: B) -> B {
    let keys: Vec<String> = (0..500).map(|n| format!("order:{}", n % 400)).collect();
    broker.publish(&keys).await;
    broker
}

async fn a_consumer_killed_twenty_times_loses_nothing_and_doubles_nothing<
    B: TestBroker,
    DB: TestBackend,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let broker = with_repeats(B::open(&db).await).await;
    let mut random = Xorshift::from_clock();
    // A run cut short by a kill is a run started, as one that ended its process: with 5
    // attempts, a message that the kills caught in its run 5 times would be given up. The
    // workers take more attempts than there are kills.
    for _ in 0..20 {
        let mut running = worker(&db, &broker, "run-25-attempts");
        tokio::time::sleep(Duration::from_millis(100 + random.below(300))).await;
        running.kill().await.expect("SIGKILL the consumer");
    }
    let mut finishing = worker(&db, &broker, "run-25-attempts");
    let finished = async {
        while !(db.rows("effects").await == 400 && broker.settled(&db).await) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(120), finished)
        .await
        .expect("every message took effect and was settled within 120 s");
    finishing.kill().await.expect("SIGKILL the last consumer");
    assert_eq!(db.rows("effects").await, 400, "nothing lost");
    assert_eq!(db.doubled_effects().await, 0, "nothing doubled");
    broker.delete().await;
    db.cleanup().await;
}

async fn two_consumer_processes_on_one_queue_take_effect_once_each<
    B: TestBroker,
    DB: TestBackend,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let broker = with_repeats(B::open_shared(&db).await).await;
    let mut workers =
        [1, 2].map(|member| spawn_worker(&db, &broker, &format!("member-{member}"), "run"));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while db.rows("effects").await < 400 || !broker.settled(&db).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not drained within a minute"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for worker in &mut workers {
        worker.kill().await.unwrap();
    }
    assert_eq!(db.rows("effects").await, 400, "effects = distinct keys");
    assert_eq!(db.doubled_effects().await, 0);
    broker.delete().await;
    db.cleanup().await;
}

async fn a_failing_message_in_a_batch_neither_loses_nor_doubles_the_others<B, DB>(test: &str)
where
    B: Batching,
    DB: TestBackend,
{
    let db = TestDb::<DB>::new(test).await;
    let broker = B::open(&db).await;
    broker.publish(&keys_with_a_poison_message()).await;
    let consumer = broker.connect_for_batches(&db.inbox).await;
    let stats = run_until(
        |stopped| consumer.run_work_batched(&db, stopped, 20),
        || poison_run_over(&broker, &db),
        effects(&db),
    )
    .await;
    assert_poison_alone_failed(&db, &stats).await;
    drop(consumer);
    broker.delete().await;
    db.cleanup().await;
}

/// A work that panics on one key, in batches: the batch fails and runs again one by one,
/// the panic is a failed attempt, retried and then dead-lettered, and the consumer goes on
/// to give every other key one effect.
async fn a_work_that_panics_fails_its_attempts_and_the_consumer_goes_on<B, DB>(test: &str)
where
    B: Batching,
    DB: TestBackend,
{
    let db = TestDb::<DB>::new(test).await;
    let broker = B::open(&db).await;
    let mut keys: Vec<String> = (0..40).map(|n| format!("order:{n}")).collect();
    keys.insert(15, "panic:order".to_owned());
    broker.publish(&keys).await;
    let consumer = broker.connect_for_batches(&db.inbox).await;
    let stats = run_until(
        |stopped| consumer.run_work_batched(&db, stopped, 20),
        || dead_lettered_and_settled(&broker, &db, 40),
        effects(&db),
    )
    .await;
    assert_eq!(
        (stats.processed, stats.retried, stats.dead_lettered),
        (40, 1, 1),
        "the panic on its 2 attempts: {stats:?}"
    );
    assert_eq!(db.doubled_effects().await, 0);
    assert_eq!(db.effects_of(&Key::new("panic:order").unwrap()).await, 0);
    drop(consumer);
    broker.delete().await;
    db.cleanup().await;
}

/// Whether a run over [`keys_with_a_poison_message`] is over: an effect per key, the poison
/// message dead-lettered, and everything settled.
async fn poison_run_over<B: Batching, DB: TestBackend>(broker: &B, db: &TestDb<DB>) -> bool {
    dead_lettered_and_settled(broker, db, 41).await
}

/// Whether `effects` effect rows are written, one message is dead-lettered, and everything
/// is settled.
async fn dead_lettered_and_settled<B: Batching, DB: TestBackend>(
    broker: &B,
    db: &TestDb<DB>,
    effects: i64,
) -> bool {
    db.rows("effects").await == effects
        && broker.dead_letters().await == 1
        && broker.settled(db).await
}

/// After a run over [`keys_with_a_poison_message`]: one effect per key but the poison
/// message's, which is the one dead letter.
async fn assert_poison_alone_failed<DB: TestBackend>(db: &TestDb<DB>, stats: &ConsumerStats) {
    assert_eq!(stats.processed, 41, "40 keys and the one that failed once");
    assert_eq!(stats.dead_lettered, 1);
    assert_eq!(db.rows("effects").await, 41);
    assert_eq!(db.doubled_effects().await, 0);
    assert_eq!(db.effects_of(&Key::new("bad:order").unwrap()).await, 0);
}

/// 40 keys, 10 of them twice, one that fails once (`fail1:order`) and one that always fails
/// (`bad:order`), mixed in.
fn keys_with_a_poison_message() -> Vec<String> {
    let mut keys = Vec::new();
    for n in 0..50 {
        keys.push(format!("order:{}", n % 40));
        match n {
            10 => keys.push("fail1:order".to_owned()),
            30 => keys.push("bad:order".to_owned()),
            _ => {}
        }
    }
    keys
}

/// A batch work on 40 keys, 10 of them published twice, all waiting before the consumer
/// starts: it gets batches of several messages, each key in one of them only (the repeats
/// are duplicates it never sees), and writes one effect per key. A reader's stored offset
/// ends at the stream's last entry.
async fn a_batch_work_gets_each_key_once_and_writes_one_effect_per_key<B, DB>(test: &str)
where
    B: Batching,
    DB: TestBackend,
{
    let db = TestDb::<DB>::new(test).await;
    let broker = B::open(&db).await;
    let keys: Vec<String> = (0..50).map(|n| format!("order:{}", n % 40)).collect();
    broker.publish(&keys).await;
    let consumer = broker.connect_for_batches(&db.inbox).await;
    let seen = SeenBatches::default();
    // Batches of 10, a reader's first too: its runs are counted in one statement.
    let stats = run_until(
        |stopped| consumer.run_batch_work(&db, stopped, 10, seen.clone()),
        || async { db.rows("effects").await == 40 && broker.settled(&db).await },
        effects(&db),
    )
    .await;
    assert_eq!(stats.processed, 40, "{stats:?}");
    assert_eq!(stats.duplicates, 10, "{stats:?}");
    assert_eq!(db.rows("effects").await, 40);
    assert_eq!(db.doubled_effects().await, 0);
    let batches = seen.lock().unwrap().clone();
    assert!(
        batches.iter().any(|batch| batch.len() > 1),
        "the work got whole batches: {batches:?}"
    );
    let mut given: Vec<String> = batches.concat();
    given.sort();
    let mut distinct: Vec<String> = keys[..40].to_vec();
    distinct.sort();
    assert_eq!(given, distinct, "each key given to the work once");
    assert!(
        broker.settled(&db).await,
        "all acknowledged, or the offset stored"
    );
    drop(consumer);
    broker.delete().await;
    db.cleanup().await;
}

/// A batch work that fails for a batch holding a message it always refuses: the batch
/// runs again alone, message by message through the same work, so the poison message fails
/// by itself and is dead-lettered; the one that fails once is retried, and every other key
/// takes effect once.
async fn a_failing_batch_work_runs_again_alone_and_the_poison_message_alone_fails<B, DB>(test: &str)
where
    B: Batching,
    DB: TestBackend,
{
    let db = TestDb::<DB>::new(test).await;
    let broker = B::open(&db).await;
    broker.publish(&keys_with_a_poison_message()).await;
    let consumer = broker.connect_for_batches(&db.inbox).await;
    let seen = SeenBatches::default();
    let stats = run_until(
        |stopped| consumer.run_batch_work(&db, stopped, 20, seen.clone()),
        || poison_run_over(&broker, &db),
        effects(&db),
    )
    .await;
    assert_poison_alone_failed(&db, &stats).await;
    let batches = seen.lock().unwrap().clone();
    let poison = vec!["bad:order".to_owned()];
    assert!(
        batches.contains(&poison),
        "the poison message ran alone: {batches:?}"
    );
    drop(consumer);
    broker.delete().await;
    db.cleanup().await;
}

/// A batch worker killed while a message in the middle of its batch runs, with the work of
/// the ones before it written in the batch's open transaction: nothing of the batch was
/// committed, and its redelivery (a reader: reading it again) takes effect once per key.
async fn a_worker_killed_in_the_middle_of_a_batch_loses_nothing_and_doubles_nothing<B, DB>(
    test: &str,
) where
    B: Batching,
    DB: TestBackend,
{
    let db = TestDb::<DB>::new(test).await;
    let broker = B::open(&db).await;
    let mut keys: Vec<String> = (0..20).map(|n| format!("order:{n}")).collect();
    keys.insert(10, "hang:order".to_owned());
    broker.publish(&keys).await;
    let mut batcher = worker(&db, &broker, "run-batched");
    let mut lines = BufReader::new(batcher.stdout.take().unwrap()).lines();
    let said = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("the worker reaches the failpoint within 30 s")
        .unwrap();
    assert_eq!(said.as_deref(), Some("hanging hang:order"));
    assert_eq!(
        db.rows("effects").await,
        0,
        "nothing of the batch committed"
    );
    batcher.kill().await.expect("SIGKILL the worker");

    let consumer = broker.connect_for_batches(&db.inbox).await;
    let stats = run_until(
        |stopped| consumer.run_work_batched(&db, stopped, 20),
        || async { db.rows("effects").await == 21 && broker.settled(&db).await },
        effects(&db),
    )
    .await;
    assert_eq!(
        stats.processed, 21,
        "the whole batch again, the failpoint passed"
    );
    assert_eq!(db.doubled_effects().await, 0);
    assert_eq!(broker.dead_letters().await, 0);
    drop(consumer);
    broker.delete().await;
    db.cleanup().await;
}

/// What `justonce_deliveries_consumed_total` holds for `consumer`, from a recorder installed
/// for the whole test binary on the first call (deliveries settled before it are not seen).
pub(crate) fn consumed(consumer: &str) -> u64 {
    counted(
        "justonce_deliveries_consumed_total",
        &[("consumer", consumer)],
    )
}

/// What counter `metric` holds for the series with each of `labels`, summed over the
/// others, from the test binary's recorder (see [`consumed`]).
pub(crate) fn counted(metric: &str, labels: &[(&str, &str)]) -> u64 {
    static RECORDER: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    let handle = RECORDER.get_or_init(|| {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .expect("no other recorder in the test binary")
    });
    let labels: Vec<String> = (labels.iter())
        .map(|(name, value)| format!("{name}=\"{value}\""))
        .collect();
    let start = format!("{metric}{{");
    (handle.render().lines())
        .filter(|line| line.starts_with(&start))
        .filter(|line| labels.iter().all(|label| line.contains(label.as_str())))
        .map(|line| line.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum()
}

/// The rule after a database failure, the same on every broker: the delivery that met it and
/// the rest of its batch go back to the broker, nothing is acknowledged, each counts as
/// consumed, and the consumer is told to pause; a healthy consumer then gives each message
/// one effect.
async fn a_database_failure_gives_the_batch_back_and_asks_for_a_pause<B, DB>(test: &str)
where
    B: GivingBack,
    DB: TestBackend,
{
    let (db, broker) = with_orders::<B, DB>(test, 3).await;
    // A consumer of this test alone, for its metric.
    let consumer_name = format!("{}broken", db.prefix);
    assert_eq!(consumed(&consumer_name), 0);
    let broken = failing_inbox(&db, &consumer_name).await;
    let failing = B::generic(broker.connect_for_batches(&broken).await);
    let mut deliveries = failing.deliveries().await.unwrap();
    let first = tokio::time::timeout(Duration::from_secs(30), deliveries.next())
        .await
        .expect("a delivery within 30 s")
        .unwrap()
        .expect("the consumer is not cancelled");
    let batch = deliveries.more(first, 3).await.unwrap();
    let work = consumer_work::<DB>(&db.prefix);
    let mut stats = ConsumerStats::default();
    let pause = failing
        .settle_batch(&batch, &work, &mut stats)
        .await
        .unwrap();
    assert!(pause, "a database failure asks for a pause");
    assert_eq!(stats.returned, batch.len() as u64, "{stats:?}");
    assert_eq!(stats.processed + stats.retried + stats.dead_lettered, 0);
    assert_eq!(
        consumed(&consumer_name),
        batch.len() as u64,
        "every delivery given back is settled, and counted"
    );
    drop(deliveries);
    drop(failing);
    each_given_back_takes_effect_once(broker, db, 3).await;
}

/// A database and a queue of `test`'s own, holding `count` messages keyed `order:0`,
/// `order:1`, and so on.
async fn with_orders<B: TestBroker, DB: TestBackend>(test: &str, count: usize) -> (TestDb<DB>, B) {
    let db = TestDb::<DB>::new(test).await;
    let broker = B::open(&db).await;
    let keys: Vec<String> = (0..count).map(|n| format!("order:{n}")).collect();
    broker.publish(&keys).await;
    (db, broker)
}

/// An inbox of consumer `name` under a prefix with no tables: every claim fails in the
/// database.
async fn failing_inbox<DB: TestBackend>(db: &TestDb<DB>, name: &str) -> Inbox<DB> {
    let options = InboxOptions::default().prefix(format!("{}missing_", db.prefix));
    let consumer = justonce_sql::Consumer::new(name).unwrap();
    Inbox::<DB>::connect_with(&db.url, consumer, options)
        .await
        .unwrap()
}

/// A healthy consumer gives each of the `keys` messages given back one effect, and none is
/// dead-lettered; then the queue and the tables go.
async fn each_given_back_takes_effect_once<B: GivingBack, DB: TestBackend>(
    broker: B,
    db: TestDb<DB>,
    keys: u64,
) {
    let consumer = broker.connect_for_batches(&db.inbox).await;
    let stats = run_until(
        |stopped| consumer.run_work_batched(&db, stopped, 20),
        || async { db.rows("effects").await == keys as i64 && broker.settled(&db).await },
        effects(&db),
    )
    .await;
    assert_eq!(stats.processed, keys, "nothing given back was lost");
    assert_eq!(db.doubled_effects().await, 0);
    assert_eq!(broker.dead_letters().await, 0);
    drop(consumer);
    broker.delete().await;
    db.cleanup().await;
}

/// A consumer that runs two batches at once: a batch's work waits (up to a second) for
/// another batch's work to be running beside it, so that one after the other fails the
/// test; 60 messages all waiting take effect once each, and every one is acknowledged.
async fn batches_run_two_at_once_and_each_message_takes_effect_once<B, DB>(test: &str)
where
    B: GivingBack,
    DB: TestBackend,
{
    let (db, broker) = with_orders::<B, DB>(test, 60).await;
    let consumer = B::generic(broker.connect_for_batches(&db.inbox).await).batches_at_once(2);
    let most = Arc::new(AtomicUsize::new(0));
    let work = beside_another::<DB>(&db.prefix, most.clone());
    let stats = run_until(
        |stopped| consumer.run_batches(stopped, 10, work),
        || async { db.rows("effects").await == 60 && broker.settled(&db).await },
        effects(&db),
    )
    .await;
    assert_eq!(most.load(Ordering::SeqCst), 2, "two batches ran at once");
    assert_eq!(stats.processed, 60, "{stats:?}");
    assert_eq!(db.doubled_effects().await, 0);
    assert!(settles(&broker, &db).await, "every delivery acknowledged");
    drop(consumer);
    broker.delete().await;
    db.cleanup().await;
}

/// [`batch_work`], run once another batch's work runs beside it, or after a second alone;
/// `most` keeps how many ran at once at most.
fn beside_another<DB: TestBackend>(
    prefix: &str,
    most: Arc<AtomicUsize>,
) -> impl for<'e, 't> Fn(
    &'t mut justonce_sql::sqlx::Transaction<'e, DB>,
    &'t [&'t Incoming],
) -> justonce_sql::WorkFuture<'t, (), justonce_sql::sqlx::Error>
+ Sync
+ use<DB> {
    let write = batch_work::<DB>(prefix, None);
    let running = Arc::new(AtomicUsize::new(0));
    move |tx, batch| {
        let (running, most) = (running.clone(), most.clone());
        let written = write(tx, batch);
        Box::pin(async move {
            most.fetch_max(running.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
            let alone_until = tokio::time::Instant::now() + Duration::from_secs(1);
            while most.load(Ordering::SeqCst) < 2 && tokio::time::Instant::now() < alone_until {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            running.fetch_sub(1, Ordering::SeqCst);
            written.await
        })
    }
}

/// A shutdown while batches commit and are acknowledged side by side: the batch committing
/// finishes, and every delivery committed is acknowledged before the run returns, so that
/// none of them comes back as a duplicate.
async fn a_batched_consumer_stopped_mid_run_acknowledges_every_delivery_it_committed<B, DB>(
    test: &str,
) where
    B: GivingBack,
    DB: TestBackend,
{
    stopped_mid_run::<B, DB>(test, 1).await;
}

/// [`a_batched_consumer_stopped_mid_run_acknowledges_every_delivery_it_committed`] with two
/// batches committing at once: both finish, and are acknowledged.
async fn two_batches_at_once_stopped_mid_run_acknowledge_every_delivery_committed<B, DB>(test: &str)
where
    B: GivingBack,
    DB: TestBackend,
{
    stopped_mid_run::<B, DB>(test, 2).await;
}

/// Two batches at once on a database that fails every claim: after each failure no new
/// batch starts for the policy's pause (1 s), so that the consumer does not spin on the
/// failing database; nothing is acknowledged, and a healthy consumer then gives each
/// message one effect.
async fn batches_at_once_pause_after_a_database_failure<B, DB>(test: &str)
where
    B: GivingBack,
    DB: TestBackend,
{
    let (db, broker) = with_orders::<B, DB>(test, 60).await;
    let broken = failing_inbox(&db, &format!("{}broken", db.prefix)).await;
    let failing = B::generic(broker.connect_for_batches(&broken).await).batches_at_once(2);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let stopping = async {
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        let _ = stop.send(());
    };
    let work = consumer_work::<DB>(&db.prefix);
    let running = tokio::time::timeout(
        Duration::from_secs(30),
        failing.run_batched(stopped, 5, work),
    );
    let (ran, ()) = tokio::join!(running, stopping);
    let stats = ran.expect("stopped within 30 s").unwrap();
    assert_eq!(stats.processed + stats.duplicates, 0, "{stats:?}");
    assert!(
        stats.returned > 0,
        "the failing batches were given back: {stats:?}"
    );
    // Batches start at 0 s, after 1 s and after 2 s: 3 rounds of 2 batches of at most 5.
    // Without the pause, hundreds would be.
    assert!(
        stats.returned <= 30,
        "no batch starts during the pause: {stats:?}"
    );
    drop(failing);
    each_given_back_takes_effect_once(broker, db, 60).await;
}

/// Stops a consumer running `batches_at_once` batches of 20 once 100 effects committed, and
/// checks that each delivery committed was acknowledged.
async fn stopped_mid_run<B: GivingBack, DB: TestBackend>(test: &str, batches_at_once: usize) {
    let (db, broker) = with_orders::<B, DB>(test, 600).await;
    // A consumer of this test alone, for its metric, on the test's tables.
    let name = format!("{}stopped", db.prefix);
    assert_eq!(consumed(&name), 0);
    let stopping = TestDb {
        url: db.url.clone(),
        prefix: db.prefix.clone(),
        inbox: db.consumer(&name),
    };
    let consumer = B::generic(broker.connect_for_batches(&stopping.inbox).await)
        .batches_at_once(batches_at_once);
    let stats = run_until(
        |stopped| consumer.run_work_batched(&stopping, stopped, 20),
        || async { db.rows("effects").await >= 100 },
        effects(&db),
    )
    .await;
    let committed = db.rows("effects").await as u64;
    assert_eq!(stats.processed, committed, "{stats:?}");
    assert_eq!(
        consumed(&name),
        committed,
        "each delivery committed was acknowledged before the run returned: {stats:?}"
    );
    drop(consumer);
    broker.delete().await;
    db.cleanup().await;
}

/// The rule after a database failure, for a single reader: the entry that met it is neither
/// skipped nor dead-lettered; the reader pauses, then runs the same entry again, and once
/// the database answers each entry takes effect once and the stored offset is the last.
async fn a_reader_runs_an_entry_again_after_the_pause_that_follows_a_database_failure<B, DB>(
    test: &str,
) where
    B: TestBroker,
    DB: TestBackend,
{
    run_again_after_a_database_failure::<B, DB>(test, 1).await
}

/// The same rule for a reader that runs batches: the batch that met the failure runs one by
/// one, and the entry that met it runs again after the pause.
async fn a_batched_reader_runs_an_entry_again_after_the_pause_that_follows_a_database_failure<
    B,
    DB,
>(
    test: &str,
) where
    B: TestBroker,
    DB: TestBackend,
{
    run_again_after_a_database_failure::<B, DB>(test, 20).await
}

/// A reader runs two batches at once, the second moving its offsets only from where the
/// first left them. When the first fails, the second does not commit: committed, it would
/// store an offset past the failed entries, and they would never take effect. Both run
/// again, in order, and each key takes effect once.
async fn a_batch_that_fails_is_not_skipped_by_the_batch_running_beside_it<B, DB>(test: &str)
where
    B: Batching,
    DB: TestBackend,
{
    let db = TestDb::<DB>::new(test).await;
    let broker = B::open(&db).await;
    // Batches of 5: the first runs alone, as the reader's first; then two at a time. The
    // second, the first of a pair, fails once, on `slowfail1:order`, after a wait long
    // enough for the third to start beside it.
    let mut keys: Vec<String> = (0..30).map(|n| format!("order:{n}")).collect();
    keys.insert(5, "slowfail1:order".to_owned());
    broker.publish(&keys).await;
    // Reads of 64 on Redis: every batch holds 5, but the last.
    let reader = broker.connect_for_batches(&db.inbox).await;
    let seen = SeenBatches::default();
    let stats = run_until(
        |stopped| reader.run_batch_work(&db, stopped, 5, seen.clone()),
        || async { db.rows("effects").await == 31 && broker.settled(&db).await },
        effects(&db),
    )
    .await;
    assert_eq!(stats.processed, 31, "{stats:?}");
    assert_eq!(db.doubled_effects().await, 0);
    let batches = seen.lock().unwrap().clone();
    let third: Vec<String> = keys[10..15].to_vec();
    assert!(
        batches.iter().filter(|batch| **batch == third).count() == 2,
        "the batch after the failed one ran beside it, did not commit, and ran again: {batches:?}"
    );
    drop(reader);
    broker.delete().await;
    db.cleanup().await;
}

/// A reader's first batch after its start may hold the entries its predecessor died on.
/// When the database fails in it after an entry committed, the rest of the batch runs
/// again after the pause: that commit proves nothing of the rest, whose runs are counted.
async fn a_first_batch_cut_by_a_database_failure_still_counts_the_runs_of_its_rest<B, DB>(
    test: &str,
) where
    B: TestBroker,
    DB: TestBackend,
{
    let (db, broker) = with_orders::<B, DB>(test, 3).await;
    // A run of order:0 counted already, as by a reader that died on it: the batch of the
    // three runs entry by entry, each with its own count.
    let key = |name: &str| Key::new(name).unwrap();
    db.inbox.record_run(&key("order:0")).await.unwrap();
    // The first count of order:1 fails in the database; a sequence is not rolled back.
    let prefix = &db.prefix;
    for sql in [
        format!("CREATE SEQUENCE {prefix}failures"),
        format!(
            "CREATE FUNCTION {prefix}fail_once() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                IF NEW.key = 'order:1' AND nextval('{prefix}failures') = 1 THEN
                    RAISE EXCEPTION 'the database failed';
                END IF;
                RETURN NEW;
             END $$"
        ),
        format!(
            "CREATE TRIGGER {prefix}fail_once BEFORE INSERT ON {prefix}runs
             FOR EACH ROW EXECUTE FUNCTION {prefix}fail_once()"
        ),
    ] {
        DB::execute(db.inbox.pool(), sql).await.unwrap();
    }
    let reader = broker.connect(&db).await;
    let done = || async { db.rows("effects").await == 3 && broker.settled(&db).await };
    let stats = run_until(
        |stopped| reader.run_work_batched(&db, stopped, 20),
        done,
        effects(&db),
    )
    .await;
    assert_eq!(stats.returned, 1, "the database failed once: {stats:?}");
    assert_eq!(stats.processed, 3, "{stats:?}");
    assert_eq!(db.doubled_effects().await, 0);
    assert_eq!(db.runs_counted(&key("order:0")).await, 1);
    for rest in ["order:1", "order:2"] {
        assert_eq!(db.runs_counted(&key(rest)).await, 1, "{rest} is counted");
    }
    drop(reader);
    DB::execute(
        db.inbox.pool(),
        format!("DROP FUNCTION {prefix}fail_once CASCADE"),
    )
    .await
    .unwrap();
    DB::execute(db.inbox.pool(), format!("DROP SEQUENCE {prefix}failures"))
        .await
        .unwrap();
    broker.delete().await;
    db.cleanup().await;
}

async fn run_again_after_a_database_failure<B: TestBroker, DB: TestBackend>(
    test: &str,
    batch_size: usize,
) {
    let db = TestDb::<DB>::new(test).await;
    let broker = B::open(&db).await;
    let keys: Vec<String> = (0..3).map(|n| format!("order:{n}")).collect();
    broker.publish(&keys).await;
    // A consumer of this test alone, for its metric, on the test's tables.
    let name = format!("{}paused", db.prefix);
    assert_eq!(consumed(&name), 0);
    let reading = TestDb {
        url: db.url.clone(),
        prefix: db.prefix.clone(),
        inbox: db.consumer(&name),
    };
    let rename = |from: &str, to: &str| {
        let sql = format!("ALTER TABLE {0}{from} RENAME TO {0}{to}", db.prefix);
        DB::execute(db.inbox.pool(), sql)
    };
    // No key can be claimed, while offsets still load: every run fails in the database.
    rename("keys", "keys_away").await.unwrap();
    let reader = broker.connect(&reading).await;
    let restored = std::sync::atomic::AtomicBool::new(false);
    let done = || async {
        if restored.load(std::sync::atomic::Ordering::Relaxed) {
            return reading.rows("effects").await == 3 && broker.settled(&reading).await;
        }
        // The third run of the first entry has begun: two have failed, each followed by
        // the pause.
        if consumed(&name) >= 3 {
            rename("keys_away", "keys").await.unwrap();
            restored.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        false
    };
    let stats = run_until(
        |stopped| reader.run_work_batched(&reading, stopped, batch_size),
        done,
        effects(&reading),
    )
    .await;
    assert!(stats.returned >= 2, "{stats:?}");
    assert_eq!(
        (stats.processed, stats.duplicates),
        (3, 0),
        "each entry once: {stats:?}"
    );
    assert_eq!(
        (stats.retried, stats.dead_lettered),
        (0, 0),
        "a database failure is no failure of the work: {stats:?}"
    );
    assert_eq!(db.doubled_effects().await, 0);
    drop(reader);
    broker.delete().await;
    db.cleanup().await;
}

/// `justonce check` publishing to the broker, with the worker process killed and started
/// again between the first and the second tries, as `--between` does for users.
async fn the_conformance_kit_passes_a_consumer_restarted_between_tries<
    B: TestBroker,
    DB: TestBackend,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let broker = B::open(&db).await;
    let kind = if B::KEEPS_OFFSET {
        "reader"
    } else {
        "consumer"
    };
    let pid_file = std::env::temp_dir().join(format!("{}worker.pid", db.prefix));
    let pid_file = pid_file.display();
    // Detached from the test's output, which a worker left behind must not hold open.
    let start = format!(
        "'{}' '{}' '{}' '{}' '{}' {kind} run >/dev/null 2>&1 & echo $! > '{pid_file}'",
        env!("CARGO_BIN_EXE_broker-worker"),
        db.url,
        db.prefix,
        B::url(),
        broker.name(),
    );
    let kill = format!("kill -9 $(cat '{pid_file}')");
    let shell = |command: String| async move {
        let status = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(&command)
            .status()
            .await
            .unwrap();
        assert!(status.success(), "{command}");
    };
    shell(start.clone()).await;

    let effects = format!("SELECT msg_key FROM {}effects", db.prefix);
    let restart = format!("{kill}; {start}");
    let more = ["--to", broker.name(), "--between", &restart];
    let output = crate::check::check_events(&B::url(), &effects, &db.url, 9, &more).await;
    shell(kill).await;
    crate::check::assert_passed(&output, 9);
    assert_eq!(db.rows("effects").await, 9);
    broker.delete().await;
    db.cleanup().await;
}

/// A consumer in this process keeps running while its broker is killed with SIGKILL and
/// started again: its link says it is connecting again, then connected; its run does not
/// end; the reconnection is counted; and a message published after the restart takes
/// effect once, as the one before the kill did (delivered again if the kill lost its ack).
async fn a_consumer_goes_on_by_itself_while_its_broker_is_killed_and_started_again<
    B: Restartable,
    DB: TestBackend,
>(
    test: &str,
) {
    use std::sync::atomic::{AtomicU8, Ordering::Relaxed};
    let db = TestDb::<DB>::new(test).await;
    let broker = OwnBroker::start(B::KIND)
        .await
        .unwrap_or_else(|e| panic!("a {} broker of the test's own: {e}", B::KIND));
    let url = broker.url();
    let broker = tokio::sync::Mutex::new(broker);
    let name = format!("{}orders", db.prefix);
    // Installs the recorder before anything is counted.
    assert_eq!(
        counted("justonce_broker_reconnects_total", &[("consumer", &name)]),
        0
    );
    let inbox = db.consumer(&name);
    let consumer = B::connect_to(&url, &name, &inbox).await;
    let link = consumer.link();
    B::publish_to(&url, &name, "order:1").await;
    // 0: before the kill; 1: killed; 2: started again; 3: connected again, with a message
    // published after the restart.
    let step = AtomicU8::new(0);
    let stats = run_until(
        |stopped| consumer.run(stopped, consumer_work::<DB>(&db.prefix)),
        || async {
            match step.load(Relaxed) {
                0 if db.rows("effects").await == 1 => {
                    broker.lock().await.kill().await.unwrap();
                    step.store(1, Relaxed);
                }
                1 if matches!(*link.borrow(), Link::Reconnecting { .. }) => {
                    broker.lock().await.start_again().await.unwrap();
                    step.store(2, Relaxed);
                }
                2 if *link.borrow() == Link::Connected => {
                    B::publish_to(&url, &name, "order:2").await;
                    step.store(3, Relaxed);
                }
                3 => return db.rows("effects").await == 2,
                _ => {}
            }
            false
        },
        || async { i64::from(step.load(Relaxed)) },
    )
    .await;
    // The kill may come before the broker stored the first message's ack: it delivers the
    // message again after the restart, as a duplicate.
    assert_eq!(stats.processed, 2, "{stats:?}");
    assert_eq!(db.doubled_effects().await, 0);
    assert!(counted("justonce_broker_reconnects_total", &[("consumer", &name)]) >= 1);
    db.cleanup().await;
}

/// A message whose work ends its consumer's process (as running out of memory would),
/// among 20 that do not: each worker started dies on it until the runs of it counted in
/// the database after its first reach the 3 attempts; then it is dead-lettered before it runs,
/// and the worker goes on. Every other message takes effect once.
async fn a_message_that_kills_its_consumer_is_dead_lettered_after_its_attempts<B, DB>(test: &str)
where
    B: Batching,
    DB: TestBackend,
{
    // 4 deaths: on its first run, which a worker that committed before it does not count,
    // and on its 3 counted attempts.
    kills_until_dead_lettered::<B, DB>(test, "run-3-attempts", 5, 4).await;
}

/// The same in batches of 20: the killer's batch comes back and runs together once more,
/// each run counted; then each of its messages runs alone with its own count, and only
/// the killer is dead-lettered.
async fn a_message_that_kills_a_batch_is_dead_lettered_alone<B, DB>(test: &str)
where
    B: Batching,
    DB: TestBackend,
{
    // A consumer dies on the first batch, not counted, then on the 3 counted attempts, the
    // first of them with its batch. A reader counts the first batch it reads after a start:
    // it dies on the 3 counted attempts only.
    let deaths = if B::KEEPS_OFFSET { 3 } else { 4 };
    kills_until_dead_lettered::<B, DB>(test, "run-batched-3-attempts", 5, deaths).await;
}

/// A killer in the second batch of 20, after a first batch committed: the worker dies on
/// it with its batch, not counted, then on the 3 counted attempts, the first of them with
/// its batch. A reader's commit of the first entry after its start proves nothing of the
/// entries after it in the batch: the killer's run there is counted too.
async fn a_message_that_kills_a_later_batch_ends_its_attempts_and_one_more<B, DB>(test: &str)
where
    B: Batching,
    DB: TestBackend,
{
    kills_until_dead_lettered::<B, DB>(test, "run-batched-3-attempts", 25, 4).await;
}

/// Starts workers in `mode`, each after the last one died, until all but the killer took
/// effect and the killer is a dead letter, and checks the workers died `deaths` times.
/// The killer comes after `killer_at` messages, 15 after it.
async fn kills_until_dead_lettered<B: Batching, DB: TestBackend>(
    test: &str,
    mode: &str,
    killer_at: usize,
    deaths: usize,
) {
    let db = TestDb::<DB>::new(test).await;
    let broker = B::open(&db).await;
    let count = killer_at + 15;
    let mut keys: Vec<String> = (0..count).map(|n| format!("order:{n}")).collect();
    keys.insert(killer_at, "exit:order".to_owned());
    // A duplicate right before the killer: its transaction stores no offset, so a reader
    // restarted after the killer reads it again and must still count the killer's run.
    keys.insert(killer_at, format!("order:{}", killer_at - 1));
    broker.publish(&keys).await;
    // The killer's count of runs is forgotten once it is a dead letter: a replay of it
    // starts its attempts again.
    let done = async || {
        db.rows("effects").await == count as i64
            && broker.dead_letters().await == 1
            && broker.settled(&db).await
            && db.runs_counted(&Key::new("exit:order").unwrap()).await == 0
    };
    let exits = exits_until_done(|| worker(&db, &broker, mode), done, deaths).await;
    assert_eq!(exits, deaths, "workers died on the killer");
    assert_eq!(db.rows("effects").await, count as i64);
    assert_eq!(db.doubled_effects().await, 0);
    assert_eq!(db.effects_of(&Key::new("exit:order").unwrap()).await, 0);
    assert_eq!(broker.dead_letters().await, 1);
    assert!(settles(&broker, &db).await, "every delivery was settled");
    broker.delete().await;
    db.cleanup().await;
}

/// Starts a worker with `start`, and again each time one exits as a killed run makes it
/// exit ([`justonce_tests::EXITED`]), until `done` holds; then kills the last and returns
/// how many exited. Fails past `most` exits, or when a worker neither exits nor gets it
/// done within 90 s.
pub(crate) async fn exits_until_done(
    start: impl Fn() -> tokio::process::Child,
    done: impl AsyncFn() -> bool,
    most: usize,
) -> usize {
    let mut exits = 0;
    loop {
        let mut worker = start();
        let finished = async {
            while !done().await {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        tokio::select! {
            exited = worker.wait() => {
                assert_eq!(exited.unwrap().code(), Some(justonce_tests::EXITED));
                exits += 1;
                assert!(exits <= most, "a worker died {exits} times, {most} at most");
            }
            finished = tokio::time::timeout(Duration::from_secs(90), finished) => {
                finished.expect("the worker went on and finished within 90 s");
                worker.kill().await.unwrap();
                return exits;
            }
        }
    }
}

/// A delivery given back while the database is down, more often than its single attempt
/// allows, is not counted as a run: the broker's own count passes the limit, and the
/// message still runs once the database is back, on its one attempt.
async fn a_delivery_given_back_while_the_database_is_down_costs_no_attempt<B, DB>(test: &str)
where
    B: OneAttempt,
    DB: TestBackend,
{
    let db = TestDb::<DB>::new(test).await;
    let broker = B::open(&db).await;
    broker.publish(&["order:0".to_owned()]).await;
    // No tables under this prefix: every claim, and every count of a run, fails.
    let options = InboxOptions::default().prefix(format!("{}missing_", db.prefix));
    let broken = Inbox::<DB>::connect_with(&db.url, db.inbox.consumer().clone(), options)
        .await
        .unwrap();
    let failing = B::generic(broker.connect_with_one_attempt(&broken).await);
    let work = consumer_work::<DB>(&db.prefix);
    let mut stats = ConsumerStats::default();
    let mut deliveries = failing.deliveries().await.unwrap();
    // Four times the attempt allowed, the broker counting each delivery.
    let mut attempts = Vec::new();
    while attempts.len() < 4 {
        let delivery = tokio::time::timeout(Duration::from_secs(30), deliveries.next())
            .await
            .expect("a delivery within 30 s")
            .unwrap()
            .expect("the consumer is not cancelled");
        attempts.push(delivery.attempt());
        let ran = failing.run_one(&delivery, &work).await;
        assert!(matches!(ran, Ran::Store(_)), "{ran:?}");
        failing.settle(&delivery, ran, &mut stats).await.unwrap();
    }
    assert!(
        attempts[3] > 1,
        "the broker counted every delivery: {attempts:?}"
    );
    assert_eq!(stats.returned, 4, "{stats:?}");
    deliveries.stop().await.unwrap();
    drop(failing);

    let consumer = broker.connect_with_one_attempt(&db.inbox).await;
    let stats = run_until(
        |stopped| consumer.run_work(&db, stopped),
        || async { db.rows("effects").await == 1 && broker.settled(&db).await },
        effects(&db),
    )
    .await;
    assert_eq!(stats.processed, 1, "the message given back ran: {stats:?}");
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    assert_eq!(broker.dead_letters().await, 0);
    drop(consumer);
    broker.delete().await;
    db.cleanup().await;
}
