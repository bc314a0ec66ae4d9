//! Messages per second through a broker consumer, one transaction per message and in
//! batches, with a share of them repeated.
//!
//! `broker-throughput [--broker amqp|nats|nats-reader|redis|redis-reader|mqtt]
//! [--backend postgres|mysql|sqlite] [--messages N] [--duplicates PERCENT] [--batch N] [--json]`
//!
//! The program publishes the messages to a fresh durable queue, file-stored stream or Redis
//! stream and waits for the broker's confirms, then starts the clock and consumes them all:
//! each message's key is claimed and one effect row written in a transaction, and the
//! message acknowledged after the commit; the single readers (`nats-reader`,
//! `redis-reader`) store each entry's offset in that transaction instead. With `--batch`, up
//! to that many deliveries share one claim statement and one transaction; on Redis, it is
//! also how many entries one read takes (each entry still in its own transaction on the
//! reader). On MQTT the messages are published while they are consumed, never more than 500
//! ahead: Mosquitto drops what passes its queue of 1,000 per session, and the clock runs from
//! the first publish. Before it prints, it checks that effect rows equal distinct keys.

use justonce_sql::{Backend, Outcome};
use justonce_tests::{StreamArgs, TestBackend, TestDb, amqp_url, consumer_work, publish_many};
use justonce_transport::amqp::{AmqpConsumer, AmqpOptions};
use justonce_transport::nats::{NatsConsumer, NatsOptions, NatsReader};
use justonce_transport::redis_streams::{
    BODY_FIELD, KEY_FIELD, RedisStreamConsumer, RedisStreamOptions, RedisStreamReader,
};
use justonce_transport::{Broker, Consumer, ConsumerStats, KeyFrom, OrderedBroker, Ran, Reader};
use std::time::Instant;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let brokers = [
        "amqp",
        "nats",
        "nats-reader",
        "redis",
        "redis-reader",
        "mqtt",
    ];
    let args = StreamArgs::from_args(10_000, 1, &brokers)
        .filter(|args| args.broker != "nats-reader" || args.batch == 1);
    let Some(args) = args else {
        eprintln!(
            "usage: broker-throughput [--broker amqp|nats|nats-reader|redis|redis-reader|mqtt] \
             [--backend postgres|mysql|sqlite] [--messages N] [--duplicates PERCENT] \
             [--batch N (reads on redis-reader; not nats-reader)] [--json]"
        );
        return std::process::ExitCode::from(2);
    };
    let (per_second, stats) = if args.broker.starts_with("nats") {
        justonce_tests::with_backend!(args.backend, DB => measure_nats::<DB>(&args).await)
    } else if args.broker == "mqtt" {
        justonce_tests::with_backend!(args.backend, DB => measure_mqtt::<DB>(&args).await)
    } else if args.broker.starts_with("redis") {
        justonce_tests::with_backend!(args.backend, DB => measure_redis::<DB>(&args).await)
    } else {
        justonce_tests::with_backend!(args.backend, DB => measure::<DB>(&args).await)
    };
    let rss = justonce_tests::peak_rss_mib(None);
    let mode = match (args.batch, args.broker.as_str()) {
        (1, _) => "one by one".to_owned(),
        (batch, "redis-reader") => format!("reads of {batch}"),
        (batch, _) => format!("batches of {batch}"),
    };
    if args.json {
        println!(
            "{{\"bench\":\"broker_throughput\",\"broker\":\"{}\",\"database\":\"{}\",\"batch\":{},\"messages\":{},\
             \"duplicates_percent\":{},\"messages_per_second\":{per_second:.0},\
             \"effects\":{},\"peak_rss_mib\":{rss:.1}}}",
            args.broker, args.backend, args.batch, args.messages, args.duplicates, stats.processed
        );
    } else {
        println!(
            "{:<5} {:<10} {mode:<16} {per_second:>8.0} msg/s   effects {} = distinct keys, \
             duplicates {}, peak RSS {rss:.1} MiB",
            args.broker, args.backend, stats.processed, stats.duplicates
        );
    }
    std::process::ExitCode::SUCCESS
}

async fn measure<DB: TestBackend + Backend>(args: &StreamArgs) -> (f64, ConsumerStats) {
    let db = TestDb::<DB>::new("amqp-throughput").await;
    let queue = format!("{}bench", db.prefix);
    let options =
        AmqpOptions::new(&queue).prefetch(u16::try_from(args.batch.max(64)).unwrap_or(u16::MAX));
    let consumer = AmqpConsumer::connect(&amqp_url(), db.inbox.clone(), options)
        .await
        .expect("RabbitMQ");
    let connection =
        lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
            .await
            .expect("RabbitMQ");
    let distinct = args.distinct();
    publish_many(&connection, &queue, args.messages, distinct).await;

    let started = Instant::now();
    let stats = consume_all(&consumer, &db, args).await;
    let per_second = args.messages as f64 / started.elapsed().as_secs_f64();
    assert_eq!(
        db.rows("effects").await,
        distinct as i64,
        "effects = distinct keys"
    );
    assert_eq!(stats.processed as usize, distinct);
    let channel = connection.create_channel().await.expect("a channel");
    for name in [format!("{queue}.dead"), queue] {
        channel
            .queue_delete(name.as_str().into(), Default::default())
            .await
            .expect("queue deleted");
    }
    consumer.close().await.expect("closed");
    db.cleanup().await;
    (per_second, stats)
}

async fn measure_nats<DB: TestBackend + Backend>(args: &StreamArgs) -> (f64, ConsumerStats) {
    let db = TestDb::<DB>::new("nats-throughput").await;
    let stream = format!("{}BENCH", db.prefix);
    let url = std::env::var("JUSTONCE_TEST_NATS_URL")
        .unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let options = NatsOptions::new(&stream, &stream).key_from(KeyFrom::Header("Order-Id".into()));
    let consumer = NatsConsumer::connect(&url, db.inbox.clone(), options.clone())
        .await
        .expect("NATS");
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

    let started = Instant::now();
    let stats = if args.broker == "nats-reader" {
        let reader = NatsReader::connect(&url, db.inbox.clone(), options)
            .await
            .expect("NATS");
        read_all(&reader, &db, args).await
    } else {
        consume_all(&consumer, &db, args).await
    };
    let per_second = args.messages as f64 / started.elapsed().as_secs_f64();
    assert_eq!(
        db.rows("effects").await,
        distinct as i64,
        "effects = distinct keys"
    );
    for name in [format!("{stream}_DEAD"), stream] {
        jetstream
            .delete_stream(&name)
            .await
            .expect("stream deleted");
    }
    db.cleanup().await;
    (per_second, stats)
}

async fn measure_redis<DB: TestBackend + Backend>(args: &StreamArgs) -> (f64, ConsumerStats) {
    let db = TestDb::<DB>::new("redis-throughput").await;
    let stream = format!("{}bench", db.prefix);
    let url = justonce_tests::redis_url();
    let options = RedisStreamOptions::new(&stream, "bench").count(args.batch.max(16));
    let consumer = RedisStreamConsumer::connect(&url, db.inbox.clone(), options)
        .await
        .expect("Redis");
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

    let started = Instant::now();
    let stats = if args.broker == "redis-reader" {
        let options = RedisStreamOptions::new(&stream, "bench").count(args.batch.max(16));
        let reader = RedisStreamReader::connect(&url, db.inbox.clone(), options)
            .await
            .expect("Redis");
        read_all(&reader, &db, args).await
    } else {
        consume_all(&consumer, &db, args).await
    };
    let per_second = args.messages as f64 / started.elapsed().as_secs_f64();
    assert_eq!(
        db.rows("effects").await,
        distinct as i64,
        "effects = distinct keys"
    );
    redis::cmd("DEL")
        .arg(&stream)
        .query_async::<()>(&mut redis)
        .await
        .expect("stream deleted");
    db.cleanup().await;
    (per_second, stats)
}

/// Consumes `args.messages` messages through `consumer`, one by one or in batches.
async fn consume_all<B: Broker, DB: TestBackend + Backend>(
    consumer: &Consumer<B, DB>,
    db: &TestDb<DB>,
    args: &StreamArgs,
) -> ConsumerStats {
    let work = consumer_work::<DB>(&db.prefix);
    let mut stats = ConsumerStats::default();
    let mut deliveries = consumer.deliveries().await.expect("consuming");
    while ((stats.processed + stats.duplicates) as usize) < args.messages {
        let first = deliveries.next().await.expect("a delivery");
        let first = first.expect("not cancelled");
        let batch = deliveries.more(first, args.batch).await.expect("a batch");
        consumer
            .settle_batch(&batch, &work, &mut stats)
            .await
            .expect("settled");
    }
    deliveries.stop().await.expect("stopped");
    stats
}

/// Reads `args.messages` entries through `reader`, one by one.
async fn read_all<O: OrderedBroker, DB: TestBackend + Backend>(
    reader: &Reader<O, DB>,
    db: &TestDb<DB>,
    args: &StreamArgs,
) -> ConsumerStats {
    let work = consumer_work::<DB>(&db.prefix);
    let mut stats = ConsumerStats::default();
    let mut entries = reader.deliveries().await.expect("reading");
    while ((stats.processed + stats.duplicates) as usize) < args.messages {
        let entry = entries.next().await.expect("an entry").expect("a stream");
        count(reader.run_one(&entry, &work).await, &mut stats);
    }
    stats
}

/// Counts what a single reader's run of one entry came to; the bench's work never fails.
fn count<E: std::fmt::Debug>(ran: Ran<E>, stats: &mut ConsumerStats) {
    match ran {
        Ran::Outcome(Outcome::Processed(())) => stats.processed += 1,
        Ran::Outcome(_) => stats.duplicates += 1,
        other => panic!("the bench's work failed: {other:?}"),
    }
}

async fn measure_mqtt<DB: TestBackend + Backend>(args: &StreamArgs) -> (f64, ConsumerStats) {
    use justonce_transport::mqtt::MqttConsumer;

    let db = TestDb::<DB>::new("mqtt-throughput").await;
    let topic = format!("{}bench", db.prefix);
    let url = justonce_tests::mqtt_url();
    let consumer =
        MqttConsumer::connect(&url, db.inbox.clone(), justonce_tests::mqtt_options(&topic))
            .await
            .expect("MQTT");
    let distinct = args.distinct();
    let started = Instant::now();
    let stats = justonce_tests::publish_while_consuming(
        &db.prefix,
        &consumer,
        &topic,
        (args.messages, distinct),
        args.batch,
    )
    .await;
    let per_second = args.messages as f64 / started.elapsed().as_secs_f64();
    assert_eq!(
        db.rows("effects").await,
        distinct as i64,
        "effects = distinct keys"
    );
    db.cleanup().await;
    (per_second, stats)
}
