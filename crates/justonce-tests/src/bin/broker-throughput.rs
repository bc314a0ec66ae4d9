//! Messages per second through a broker consumer, one transaction per message and in
//! batches, with a share of them repeated, beside the broker's own limit and the database's.
//!
//! `broker-throughput [--broker amqp|nats|nats-reader|redis|redis-reader|mqtt|kafka]
//! [--backend postgres|mysql|sqlite] [--messages N] [--duplicates PERCENT] [--batch N] [--prefetch N]
//! [--batches-at-once N] [--json]`
//!
//! The program publishes the messages to a fresh durable queue, file-stored stream, Redis
//! stream or Kafka topic (of three partitions) and waits for the broker's confirms, then
//! starts the clock and consumes them all: each message's key is claimed and one effect row
//! written in a transaction, and the message acknowledged after the commit; the single
//! readers (`nats-reader`, `redis-reader`, and `kafka`, a group member) store each entry's
//! offset in that transaction instead, and their clock starts at the first entry read, so
//! that Kafka's group join is not counted. With `--batch`, up to that many deliveries share
//! one claim statement and one transaction (on a reader, with the offset of each
//! partition's last entry); on Redis, it is also how many entries one read takes. On MQTT
//! the messages are published while they are consumed, never more than 500 ahead: Mosquitto
//! drops what passes its queue of 1,000 per session, and the clock runs from the first
//! publish. Before it prints, it checks that effect rows equal distinct keys.
//!
//! Each run measures, one after the other and each on a fresh queue (stream, topic) with the
//! same messages and prefetch: the baseline, which takes the deliveries in the same batches
//! and only acknowledges them (a reader: only reads them), with no database work (the
//! broker's own limit); one by one; and, with `--batch` above 1, batched twice: with the
//! work run once per message (an INSERT each), then with a batch work run once per batch,
//! which writes the batch's effects with one multi-row INSERT. The batch work runs through
//! `Consumer::run_batches` (`Reader::run_batches`) itself, which gathers the next batch
//! while one commits, until the consumer's own metric counts every message settled; on a
//! reader its clock starts at the first batch's work. Then `claim_many` on the same database at the same batch size
//! (the database's own limit, as `justonce bench` measures it). It prints each figure, and
//! the batch work's against both limits, with the cores the machine and this process kept
//! busy during the baseline, the consumer's run and `claim_many` (from the kernel's counts):
//! a figure with every core busy is bound by CPU, one with cores idle by waiting. From
//! those it prints the machine's ceiling: the messages per second its cores could carry if
//! the broker's CPU per message (on the baseline) and the database's (on `claim_many`)
//! were all that ran.
//!
//! With `--batches-at-once`, a consumer runs that many batches at once, each on its own
//! connection (`Consumer::batches_at_once`), and a reader two with 2 or more
//! (`Reader::batches_at_once`). The prefetch is that many batches and two more on RabbitMQ
//! and NATS (at least 64), as the consumer holds them: one gathered, those committing, one
//! being acknowledged.

use justonce_sql::{Backend, Outcome, WorkFuture, sqlx};
use justonce_tests::cpu::{self, Clock, Timed};
use justonce_tests::{
    StreamArgs, TestBackend, TestDb, acknowledge, amqp_url, batch_work, consume, consumer_work,
    publish_many,
};
use justonce_transport::amqp::{AmqpConsumer, AmqpOptions};
use justonce_transport::kafka::{KafkaOptions, KafkaReader};
use justonce_transport::nats::{NatsConsumer, NatsOptions, NatsReader};
use justonce_transport::redis_streams::{
    BODY_FIELD, KEY_FIELD, RedisStreamConsumer, RedisStreamOptions, RedisStreamReader,
};
use justonce_transport::{
    Broker, Consumer, ConsumerStats, Incoming, KeyFrom, OrderedBroker, Ran, Reader,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// The partitions of the Kafka topic: a batch holds entries of several, each partition's
/// offset stored in its transaction.
const KAFKA_PARTITIONS: i32 = 3;

/// How a run takes the messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// Only acknowledged, in batches of `--batch`, with no database work.
    Baseline,
    /// The work, a transaction per message (on the readers, the reader's own path).
    OneByOne,
    /// The work for each message, a transaction per batch of up to `--batch`.
    Batched,
    /// A batch work, once per batch of up to `--batch`, in its transaction.
    BatchWork,
}

impl Path {
    /// The most deliveries this path takes at once.
    fn batch(self, args: &StreamArgs) -> usize {
        match self {
            Path::OneByOne => 1,
            Path::Baseline | Path::Batched | Path::BatchWork => args.batch,
        }
    }
}

/// The messages per second of each path of one run, with the cores busy meanwhile.
#[derive(Default)]
struct Figures {
    baseline: Timed,
    one_by_one: Timed,
    batched: Option<Timed>,
    batch_work: Option<Timed>,
    claim_many: Timed,
}

impl Figures {
    /// The consumer's figure at `--batch`: with a batch work, or one by one when the batch
    /// is 1.
    fn consumer(&self) -> Timed {
        self.batch_work.unwrap_or(self.one_by_one)
    }

    /// The most messages per second the machine's cores could carry, if the broker's work
    /// for one (its CPU per message on the baseline) and the database's (on `claim_many`)
    /// were all that ran, side by side: a consumer above the bar needs no more than this.
    fn ceiling(&self) -> f64 {
        let per_message = |timed: Timed| timed.machine_cores / timed.per_second;
        cpu::cores() as f64 / (per_message(self.baseline) + per_message(self.claim_many))
    }
}

/// The deliveries consumers have settled, as `justonce_deliveries_consumed_total` counts
/// them, all consumers together: the program runs one at a time.
static SETTLED: AtomicU64 = AtomicU64::new(0);
/// Woken at each count of [`SETTLED`].
static SETTLING: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// The count behind [`SETTLED`].
struct SettledCounter;

impl metrics::CounterFn for SettledCounter {
    fn increment(&self, value: u64) {
        SETTLED.fetch_add(value, Ordering::Relaxed);
        SETTLING.notify_waiters();
    }

    fn absolute(&self, value: u64) {
        SETTLED.fetch_max(value, Ordering::Relaxed);
        SETTLING.notify_waiters();
    }
}

/// A recorder that keeps only the settled deliveries, in [`SETTLED`].
struct SettledRecorder;

impl metrics::Recorder for SettledRecorder {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }

    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        if key.name() == "justonce_deliveries_consumed_total" {
            metrics::Counter::from_arc(Arc::new(SettledCounter))
        } else {
            metrics::Counter::noop()
        }
    }

    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }

    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// Resolves once [`SETTLED`] reaches `count`.
async fn settled_reaches(count: u64) {
    loop {
        let counted = SETTLING.notified();
        if SETTLED.load(Ordering::Relaxed) >= count {
            return;
        }
        counted.await;
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    metrics::set_global_recorder(SettledRecorder).expect("the program's only recorder");
    let brokers = [
        "amqp",
        "nats",
        "nats-reader",
        "redis",
        "redis-reader",
        "mqtt",
        "kafka",
    ];
    let Some(args) = StreamArgs::from_args(10_000, 1, &brokers) else {
        eprintln!(
            "usage: broker-throughput [--broker amqp|nats|nats-reader|redis|redis-reader|mqtt|kafka] \
             [--backend postgres|mysql|sqlite] [--messages N] [--duplicates PERCENT] \
             [--batch N] [--prefetch N] [--batches-at-once N] [--json]"
        );
        return std::process::ExitCode::from(2);
    };
    let mut paths = vec![Path::Baseline, Path::OneByOne];
    if args.batch > 1 {
        paths.extend([Path::Batched, Path::BatchWork]);
    }
    let mut figures = Figures::default();
    let mut effects = ConsumerStats::default();
    for path in paths {
        let (timed, stats) = if args.broker == "kafka" {
            justonce_tests::with_backend!(args.backend, DB => measure_kafka::<DB>(&args, path).await)
        } else if args.broker.starts_with("nats") {
            justonce_tests::with_backend!(args.backend, DB => measure_nats::<DB>(&args, path).await)
        } else if args.broker == "mqtt" {
            justonce_tests::with_backend!(args.backend, DB => measure_mqtt::<DB>(&args, path).await)
        } else if args.broker.starts_with("redis") {
            justonce_tests::with_backend!(args.backend, DB => measure_redis::<DB>(&args, path).await)
        } else {
            justonce_tests::with_backend!(args.backend, DB => measure::<DB>(&args, path).await)
        };
        match path {
            Path::Baseline => figures.baseline = timed,
            Path::OneByOne => figures.one_by_one = timed,
            Path::Batched => figures.batched = Some(timed),
            Path::BatchWork => figures.batch_work = Some(timed),
        }
        if path != Path::Baseline {
            effects = stats;
        }
    }
    figures.claim_many =
        justonce_tests::with_backend!(args.backend, DB => claim_many::<DB>(&args).await);
    let rss = justonce_tests::peak_rss_mib(None);
    report(&args, &figures, &effects, rss);
    std::process::ExitCode::SUCCESS
}

/// Prints the run's figures: a line, or a JSON object with `--json`.
fn report(args: &StreamArgs, figures: &Figures, stats: &ConsumerStats, rss: f64) {
    let consumer = figures.consumer();
    let against_baseline = consumer.per_second / figures.baseline.per_second;
    let against_claim_many = consumer.per_second / figures.claim_many.per_second;
    let prefetch = prefetch(args);
    if args.json {
        let hundredths = |r: f64| (r * 100.0).round() / 100.0;
        let tenths = |r: f64| (r * 10.0).round() / 10.0;
        let result = serde_json::json!({
            "bench": "broker_throughput",
            "broker": args.broker,
            "database": args.backend,
            "batch": args.batch,
            "prefetch": prefetch,
            "batches_at_once": args.batches_at_once,
            "messages": args.messages,
            "duplicates_percent": args.duplicates,
            "messages_per_second": consumer.per_second.round(),
            "baseline_messages_per_second": figures.baseline.per_second.round(),
            "one_by_one_messages_per_second": figures.one_by_one.per_second.round(),
            "batched_messages_per_second": figures.batched.map(|timed| timed.per_second.round()),
            "batch_work_messages_per_second": figures.batch_work.map(|timed| timed.per_second.round()),
            "cores": cpu::cores(),
            "baseline_machine_cores_busy": tenths(figures.baseline.machine_cores),
            "consumer_machine_cores_busy": tenths(consumer.machine_cores),
            "consumer_process_cores_busy": tenths(consumer.process_cores),
            "against_baseline": hundredths(against_baseline),
            "claim_many_keys_per_second": figures.claim_many.per_second.round(),
            "claim_many_machine_cores_busy": tenths(figures.claim_many.machine_cores),
            "machine_ceiling_messages_per_second": figures.ceiling().round(),
            "against_claim_many": hundredths(against_claim_many),
            "effects": stats.processed,
            "peak_rss_mib": (rss * 10.0).round() / 10.0,
        });
        println!("{result}");
        return;
    }
    let batched = match (figures.batched, figures.batch_work) {
        (Some(each), Some(whole)) => format!(
            "batches of {}: work per message {:.0}, batch work {:.0}",
            args.batch, each.per_second, whole.per_second
        ),
        _ => String::new(),
    };
    println!(
        "{:<12} {:<8} prefetch {prefetch:<4} baseline {:.0}  one by one {:.0}  {batched} msg/s   \
         {against_baseline:.2}x baseline   claim_many ({}) {:.0} keys/s, {against_claim_many:.2}x   \
         effects {} = distinct keys, duplicates {}, peak RSS {rss:.1} MiB   \
         cores busy of {}: baseline {:.1}, consumer {:.1} (this process {:.1}), claim_many {:.1}   \
         the machine's ceiling {:.0} msg/s",
        args.broker,
        args.backend,
        figures.baseline.per_second,
        figures.one_by_one.per_second,
        args.batch,
        figures.claim_many.per_second,
        stats.processed,
        stats.duplicates,
        cpu::cores(),
        figures.baseline.machine_cores,
        consumer.machine_cores,
        consumer.process_cores,
        figures.claim_many.machine_cores,
        figures.ceiling(),
    );
}

/// How many deliveries the broker sends ahead of the acknowledgements: `--prefetch` on
/// RabbitMQ and NATS, or as this program sets it: at least the batch, so that a batch can
/// fill (on Redis, the entries one read takes; on MQTT, Mosquitto's
/// `max_inflight_messages`, 20 by default).
fn prefetch(args: &StreamArgs) -> usize {
    match (args.broker.as_str(), args.prefetch) {
        ("mqtt", _) => 20,
        // librdkafka fetches ahead by bytes, not records: this is only reported.
        ("kafka", _) => args.batch,
        ("redis" | "redis-reader", _) => args.batch.max(16),
        (_, Some(prefetch)) => prefetch,
        // The batches in hand: gathered, committing, acknowledged.
        (_, None) => ((args.batches_at_once + 2) * args.batch).max(64),
    }
}

/// Messages per second through `claim_many` in batches of `--batch` on a fresh database of
/// the backend, the same number of messages with the same share repeated.
async fn claim_many<DB: TestBackend + Backend>(args: &StreamArgs) -> Timed {
    let db = TestDb::<DB>::new("claim-many").await;
    // The cores are counted over the call, its preparation of the database included.
    let clock = Clock::start();
    let per_second =
        justonce_bench::claim_many_per_second(&db.url, args.messages, args.duplicates, args.batch)
            .await
            .expect("claim_many measured");
    let timed = clock.stop(args.messages);
    db.cleanup().await;
    Timed {
        per_second,
        ..timed
    }
}

/// Takes `args.messages` deliveries from `consumer` by `path`, and returns what it counted
/// (nothing on the baseline). Stores how many are settled in `settled` as it goes.
async fn take<B: Broker, DB: TestBackend + Backend>(
    consumer: &Consumer<B, DB>,
    db: &TestDb<DB>,
    (args, path): (&StreamArgs, Path),
    settled: &AtomicU64,
) -> ConsumerStats {
    let taking = (args.messages, path.batch(args));
    match path {
        Path::Baseline => {
            acknowledge(consumer.broker(), taking, settled).await;
            ConsumerStats::default()
        }
        Path::OneByOne | Path::Batched => consume(consumer, &db.prefix, taking, settled).await,
        Path::BatchWork => {
            let all = SETTLED.load(Ordering::Relaxed) + args.messages as u64;
            let work = batch_work::<DB>(&db.prefix, None);
            (consumer.run_batches(settled_reaches(all), args.batch, work))
                .await
                .expect("the batches run")
        }
    }
}

/// After the work, checks that effect rows equal distinct keys; the baseline has none.
async fn check<DB: TestBackend + Backend>(db: &TestDb<DB>, args: &StreamArgs, path: Path) {
    let expected = if path == Path::Baseline {
        0
    } else {
        args.distinct() as i64
    };
    assert_eq!(
        db.rows("effects").await,
        expected,
        "effects = distinct keys"
    );
}

async fn measure<DB: TestBackend + Backend>(
    args: &StreamArgs,
    path: Path,
) -> (Timed, ConsumerStats) {
    let db = TestDb::<DB>::new("amqp-throughput").await;
    let queue = format!("{}bench", db.prefix);
    let options =
        AmqpOptions::new(&queue).prefetch(u16::try_from(prefetch(args)).unwrap_or(u16::MAX));
    let consumer = AmqpConsumer::connect(&amqp_url(), db.inbox.clone(), options)
        .await
        .expect("RabbitMQ")
        .batches_at_once(args.batches_at_once);
    let connection =
        lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
            .await
            .expect("RabbitMQ");
    publish_many(&connection, &queue, args.messages, args.distinct()).await;

    let clock = Clock::start();
    let stats = take(&consumer, &db, (args, path), &AtomicU64::new(0)).await;
    let timed = clock.stop(args.messages);
    check(&db, args, path).await;
    let channel = connection.create_channel().await.expect("a channel");
    for name in [format!("{queue}.dead"), queue] {
        channel
            .queue_delete(name.as_str().into(), Default::default())
            .await
            .expect("queue deleted");
    }
    consumer.close().await.expect("closed");
    db.cleanup().await;
    (timed, stats)
}

async fn measure_nats<DB: TestBackend + Backend>(
    args: &StreamArgs,
    path: Path,
) -> (Timed, ConsumerStats) {
    let db = TestDb::<DB>::new("nats-throughput").await;
    let stream = format!("{}BENCH", db.prefix);
    let url = std::env::var("JUSTONCE_TEST_NATS_URL")
        .unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let options = NatsOptions::new(&stream, &stream)
        .key_from(KeyFrom::Header("Order-Id".into()))
        .prefetch(prefetch(args));
    let consumer = NatsConsumer::connect(&url, db.inbox.clone(), options.clone())
        .await
        .expect("NATS")
        .batches_at_once(args.batches_at_once);
    let jetstream = async_nats::jetstream::new(async_nats::connect(&url).await.expect("NATS"));
    let distinct = args.distinct();
    // The client holds back publishes while too many acks are outstanding: await them in
    // rounds.
    for round in (0..args.messages).collect::<Vec<_>>().chunks(1_000) {
        let mut acks = Vec::with_capacity(round.len());
        for n in round {
            let key = format!("order:{}", n % distinct);
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Order-Id", key.as_str());
            let ack = jetstream
                .publish_with_headers(stream.clone(), headers, key.into_bytes().into())
                .await
                .expect("publish");
            acks.push(ack);
        }
        for ack in acks {
            ack.await.expect("stored");
        }
    }

    let (timed, stats) = if args.broker == "nats-reader" {
        let reader = NatsReader::connect(&url, db.inbox.clone(), options)
            .await
            .expect("NATS")
            .batches_at_once(args.batches_at_once);
        read(&reader, &db, (args, path)).await
    } else {
        let clock = Clock::start();
        let stats = take(&consumer, &db, (args, path), &AtomicU64::new(0)).await;
        (clock.stop(args.messages), stats)
    };
    check(&db, args, path).await;
    for name in [format!("{stream}_DEAD"), stream] {
        jetstream
            .delete_stream(&name)
            .await
            .expect("stream deleted");
    }
    db.cleanup().await;
    (timed, stats)
}

async fn measure_redis<DB: TestBackend + Backend>(
    args: &StreamArgs,
    path: Path,
) -> (Timed, ConsumerStats) {
    let db = TestDb::<DB>::new("redis-throughput").await;
    let stream = format!("{}bench", db.prefix);
    let url = justonce_tests::redis_url();
    let options = RedisStreamOptions::new(&stream, "bench").count(prefetch(args));
    let consumer = RedisStreamConsumer::connect(&url, db.inbox.clone(), options)
        .await
        .expect("Redis")
        .batches_at_once(args.batches_at_once);
    let mut redis = redis::Client::open(url.as_str())
        .expect("a Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("Redis");
    let distinct = args.distinct();
    for round in (0..args.messages).collect::<Vec<_>>().chunks(1_000) {
        let mut pipe = redis::pipe();
        for n in round {
            let key = format!("order:{}", n % distinct);
            pipe.xadd(
                &stream,
                "*",
                &[(KEY_FIELD, key.as_str()), (BODY_FIELD, key.as_str())],
            )
            .ignore();
        }
        pipe.query_async::<()>(&mut redis).await.expect("added");
    }

    let (timed, stats) = if args.broker == "redis-reader" {
        let options = RedisStreamOptions::new(&stream, "bench").count(prefetch(args));
        let reader = RedisStreamReader::connect(&url, db.inbox.clone(), options)
            .await
            .expect("Redis")
            .batches_at_once(args.batches_at_once);
        read(&reader, &db, (args, path)).await
    } else {
        let clock = Clock::start();
        let stats = take(&consumer, &db, (args, path), &AtomicU64::new(0)).await;
        (clock.stop(args.messages), stats)
    };
    check(&db, args, path).await;
    redis::cmd("DEL")
        .arg(&stream)
        .query_async::<()>(&mut redis)
        .await
        .expect("stream deleted");
    db.cleanup().await;
    (timed, stats)
}

/// Reads `args.messages` entries through `reader` by `path`: only reading them, in batches
/// of `--batch`, on the baseline; one by one; in batches run with [`Reader::run_batch`];
/// or, with a batch work, through [`read_batches`].
/// Returns the entries per second from the first entry read, and what the reader counted
/// (nothing on the baseline).
async fn read<O: OrderedBroker, DB: TestBackend + Backend>(
    reader: &Reader<O, DB>,
    db: &TestDb<DB>,
    (args, path): (&StreamArgs, Path),
) -> (Timed, ConsumerStats) {
    if path == Path::BatchWork {
        return read_batches(reader, db, args).await;
    }
    let work = consumer_work::<DB>(&db.prefix);
    let mut stats = ConsumerStats::default();
    let mut entries = reader.deliveries().await.expect("reading");
    let mut clock = None;
    let mut taken = 0;
    while taken < args.messages {
        let first = entries.next().await.expect("an entry").expect("a stream");
        clock.get_or_insert_with(Clock::start);
        let batch = entries
            .more(first, path.batch(args))
            .await
            .expect("a batch");
        match path {
            Path::Baseline => {}
            Path::OneByOne => {
                for entry in &batch {
                    count(reader.run_one(entry, &work).await, &mut stats);
                }
            }
            Path::Batched | Path::BatchWork => {
                let done = reader.run_batch(&batch, &work, &mut stats).await;
                assert_eq!(
                    done.expect("a batch run"),
                    batch.len(),
                    "the database failed"
                );
            }
        }
        taken += batch.len();
    }
    let timed = clock.expect("an entry read").stop(args.messages);
    entries.stop().await.expect("stopped");
    (timed, stats)
}

/// Runs [`Reader::run_batches`] with the batch work until the reader's own metric counts
/// `args.messages` entries settled. Returns the entries per second from the first batch's
/// work, so that Kafka's group join is not counted, and what the reader counted.
async fn read_batches<O: OrderedBroker, DB: TestBackend + Backend>(
    reader: &Reader<O, DB>,
    db: &TestDb<DB>,
    args: &StreamArgs,
) -> (Timed, ConsumerStats) {
    let all = SETTLED.load(Ordering::Relaxed) + args.messages as u64;
    let whole_batches = batch_work::<DB>(&db.prefix, None);
    let clock = OnceLock::new();
    let work = timed::<DB>(whole_batches, &clock);
    let stats = (reader.run_batches(settled_reaches(all), args.batch, work))
        .await
        .expect("the batches run");
    let timed = clock.get().expect("a batch run").stop(args.messages);
    (timed, stats)
}

/// `work`, starting `clock` when it first runs.
fn timed<'w, DB: TestBackend>(
    work: impl for<'e, 't> Fn(
        &'t mut sqlx::Transaction<'e, DB>,
        &'t [&'t Incoming],
    ) -> WorkFuture<'t, (), sqlx::Error>
    + Sync
    + 'w,
    clock: &'w OnceLock<Clock>,
) -> impl for<'e, 't> Fn(
    &'t mut sqlx::Transaction<'e, DB>,
    &'t [&'t Incoming],
) -> WorkFuture<'t, (), sqlx::Error>
+ Sync
+ 'w {
    move |tx, batch| {
        clock.get_or_init(Clock::start);
        work(tx, batch)
    }
}

/// Counts what a single reader's run of one entry came to; the bench's work never fails.
fn count<E: std::fmt::Debug>(ran: Ran<E>, stats: &mut ConsumerStats) {
    match ran {
        Ran::Outcome(Outcome::Processed(())) => stats.processed += 1,
        Ran::Outcome(_) => stats.duplicates += 1,
        other => panic!("the bench's work failed: {other:?}"),
    }
}

/// The Kafka topic of `args.messages` records over [`KAFKA_PARTITIONS`] partitions, the id
/// in the `ce_id` header, read by a group member of its own.
async fn measure_kafka<DB: TestBackend + Backend>(
    args: &StreamArgs,
    path: Path,
) -> (Timed, ConsumerStats) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};

    let db = TestDb::<DB>::new("kafka-throughput").await;
    let topic = format!("{}bench", db.prefix);
    let url = justonce_tests::kafka_url();
    let mut config = rdkafka::ClientConfig::new();
    config.set("bootstrap.servers", url.trim_start_matches("kafka://"));
    let admin: AdminClient<_> = config.create().expect("a Kafka admin client");
    let dead = format!("{topic}.dead");
    let topics = [(&topic, KAFKA_PARTITIONS), (&dead, 1)]
        .map(|(name, count)| NewTopic::new(name, count, TopicReplication::Fixed(1)));
    for created in (admin.create_topics(&topics, &AdminOptions::new()).await).expect("Kafka") {
        created.expect("topic created");
    }
    let producer: FutureProducer = (config.clone())
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()
        .expect("a Kafka producer");
    let distinct = args.distinct();
    // Enqueued a thousand at a time, then each confirmed.
    for round in (0..args.messages).collect::<Vec<_>>().chunks(1_000) {
        let mut confirms = Vec::with_capacity(round.len());
        for n in round {
            let key = format!("order:{}", n % distinct);
            let headers = OwnedHeaders::new().insert(Header {
                key: "ce_id",
                value: Some(key.as_str()),
            });
            let partition = i32::try_from(n % KAFKA_PARTITIONS as usize).unwrap_or(0);
            let record = FutureRecord::<(), _>::to(&topic)
                .partition(partition)
                .payload(key.as_bytes())
                .headers(headers);
            let confirm = producer.send_result(record).map_err(|(error, _)| error);
            confirms.push(confirm.expect("enqueued"));
        }
        for confirm in confirms {
            let stored = confirm.await.expect("a confirm");
            stored.map_err(|(error, _)| error).expect("stored");
        }
    }
    let options = KafkaOptions::new(&topic, &topic).key_from(KeyFrom::Header("ce_id".into()));
    let reader = KafkaReader::connect(&url, db.inbox.clone(), options)
        .expect("Kafka")
        .batches_at_once(args.batches_at_once);
    let (timed, stats) = read(&reader, &db, (args, path)).await;
    check(&db, args, path).await;
    drop(reader);
    (admin
        .delete_topics(&[&topic, &dead], &AdminOptions::new())
        .await)
        .expect("topics deleted");
    db.cleanup().await;
    (timed, stats)
}

async fn measure_mqtt<DB: TestBackend + Backend>(
    args: &StreamArgs,
    path: Path,
) -> (Timed, ConsumerStats) {
    use justonce_transport::mqtt::MqttConsumer;

    let db = TestDb::<DB>::new("mqtt-throughput").await;
    let topic = format!("{}bench", db.prefix);
    let url = justonce_tests::mqtt_url();
    let consumer =
        MqttConsumer::connect(&url, db.inbox.clone(), justonce_tests::mqtt_options(&topic))
            .await
            .expect("MQTT")
            .batches_at_once(args.batches_at_once);
    // The publisher stays at most 500 ahead of what is settled, which the batch work's run
    // counts in SETTLED, and the other paths store there.
    SETTLED.store(0, Ordering::Relaxed);
    let clock = Clock::start();
    let taking = take(&consumer, &db, (args, path), &SETTLED);
    let stats =
        justonce_tests::publish_while(&topic, (args.messages, args.distinct()), &SETTLED, taking)
            .await;
    let timed = clock.stop(args.messages);
    check(&db, args, path).await;
    db.cleanup().await;
    (timed, stats)
}
