//! Messages per second through the RabbitMQ consumer, one transaction per message and in
//! batches, with a share of them repeated.
//!
//! `amqp-throughput [--backend postgres|sqlite] [--messages N] [--duplicates PERCENT]
//! [--batch N] [--json]`
//!
//! The program publishes the messages to a fresh durable queue and waits for the broker's
//! confirms, then starts the clock and consumes them all: each message's key is claimed
//! and one effect row written in a transaction, and the message acknowledged after the
//! commit. With `--batch`, up to that many deliveries share one claim statement and one
//! transaction. Before it prints, it checks that effect rows equal distinct keys.

use justonce_sql::Backend;
use justonce_tests::{StreamArgs, TestBackend, TestDb, amqp_url, consumer_work, publish_many};
use justonce_transport::ConsumerStats;
use justonce_transport::amqp::{AmqpConsumer, AmqpOptions};
use sqlx::{Postgres, Sqlite};
use std::time::Instant;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let Some(args) = StreamArgs::from_args(10_000, 1) else {
        eprintln!(
            "usage: amqp-throughput [--backend postgres|sqlite] [--messages N] \
             [--duplicates PERCENT] [--batch N] [--json]"
        );
        return std::process::ExitCode::from(2);
    };
    let (per_second, stats) = if args.backend == "sqlite" {
        measure::<Sqlite>(&args).await
    } else {
        measure::<Postgres>(&args).await
    };
    let rss = justonce_tests::peak_rss_mib(None);
    let mode = if args.batch > 1 {
        format!("batches of {}", args.batch)
    } else {
        "one by one".to_owned()
    };
    if args.json {
        println!(
            "{{\"bench\":\"amqp_throughput\",\"database\":\"{}\",\"batch\":{},\"messages\":{},\
             \"duplicates_percent\":{},\"messages_per_second\":{per_second:.0},\
             \"effects\":{},\"peak_rss_mib\":{rss:.1}}}",
            args.backend, args.batch, args.messages, args.duplicates, stats.processed
        );
    } else {
        println!(
            "{:<10} {mode:<16} {per_second:>8.0} msg/s   effects {} = distinct keys, \
             duplicates {}, peak RSS {rss:.1} MiB",
            args.backend, stats.processed, stats.duplicates
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

    let work = consumer_work::<DB>(&db.prefix);
    let mut stats = ConsumerStats::default();
    let started = Instant::now();
    let mut deliveries = consumer.deliveries().await.expect("consuming");
    while ((stats.processed + stats.duplicates) as usize) < args.messages {
        let first = deliveries
            .next()
            .await
            .expect("a delivery")
            .expect("not cancelled");
        if args.batch > 1 {
            let batch = deliveries.more(first, args.batch).await.expect("a batch");
            consumer
                .settle_batch(batch, &work, &mut stats)
                .await
                .expect("settled");
        } else {
            let ran = first.run(&db.inbox, &work).await;
            first.settle(ran, &mut stats).await.expect("settled");
        }
    }
    let per_second = args.messages as f64 / started.elapsed().as_secs_f64();
    deliveries.stop().await.expect("stopped");
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
