//! The RabbitMQ worker example, compiled from its own source, against the real broker and
//! PostgreSQL: an order published twice, then published and redelivered again, ships once.

use justonce_tests::{TestBackend, amqp_url, unique};
use justonce_transport::ConsumerStats;
use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeleteOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use sqlx::Postgres;
use std::time::Duration;

// The example's `main` is not called here.
#[allow(dead_code)]
#[path = "../../../justonce/examples/rabbitmq_worker.rs"]
mod example;

const ORDER: &[u8] = br#"{"order": "ord_1", "address": "1 Main St"}"#;

async fn publish(connection: &Connection, queue: &str, message_id: &str) {
    let channel = connection.create_channel().await.unwrap();
    channel.confirm_select(Default::default()).await.unwrap();
    let properties = BasicProperties::default()
        .with_message_id(message_id.into())
        .with_delivery_mode(2);
    let confirm = channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            ORDER,
            properties,
        )
        .await
        .unwrap();
    assert!(confirm.await.unwrap().is_ack(), "the broker took it");
    channel.close(200, "bye".into()).await.unwrap();
}

/// Messages ready in `queue`.
async fn ready(connection: &Connection, queue: &str) -> u32 {
    let channel = connection.create_channel().await.unwrap();
    let passive = lapin::options::QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let declared = channel
        .queue_declare(queue.into(), passive, Default::default())
        .await
        .unwrap();
    channel.close(200, "bye".into()).await.unwrap();
    declared.message_count()
}

/// Runs the example's worker until it has settled `count` deliveries. One it took but had
/// not settled when stopped goes back to the queue, for the next run to take.
async fn settle(connection: &Connection, url: &str, queue: &str, count: u64) -> ConsumerStats {
    let amqp = amqp_url();
    let mut total = ConsumerStats::default();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while total.processed + total.duplicates < count {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not settled within a minute"
        );
        let inbox = example::open(url).await.unwrap();
        let stats = super::run_until(
            |stop| example::work(&amqp, inbox, queue, stop),
            || async { ready(connection, queue).await == 0 },
            || async { i64::from(ready(connection, queue).await) },
        )
        .await;
        assert_eq!((stats.retried, stats.dead_lettered), (0, 0));
        total.processed += stats.processed;
        total.duplicates += stats.duplicates;
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_published_twice_then_redelivered_ships_once() {
    let url = Postgres::create_database(&format!("ship_{}", unique())).await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("RabbitMQ at {}: {e}", amqp_url()));
    let queue = format!("ship_{}", unique());
    // The worker declares its queues; a message published before that would be dropped.
    let inbox = example::open(&url).await.unwrap();
    let declared = example::work(&amqp_url(), inbox, &queue, async {}).await;
    declared.unwrap();
    let rows = async || {
        let mut counts = [0; 2];
        for (count, table) in counts.iter_mut().zip(["shipments", "justonce_keys"]) {
            *count = Postgres::count(&pool, format!("SELECT count(*) FROM {table}")).await;
        }
        counts
    };

    // The first run: the order published twice.
    publish(&connection, &queue, "ord_1").await;
    publish(&connection, &queue, "ord_1").await;
    let first = settle(&connection, &url, &queue, 2).await;
    assert_eq!((first.processed, first.duplicates), (1, 1));
    assert_eq!(rows().await, [1, 1]);

    // The second run: published once more, and a copy delivered again after a consumer
    // took it and went away without an ack.
    publish(&connection, &queue, "ord_1").await;
    publish(&connection, &queue, "ord_1").await;
    let channel = connection.create_channel().await.unwrap();
    let taken = channel
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap();
    assert!(taken.is_some(), "a copy taken and not acknowledged");
    channel.close(200, "bye".into()).await.unwrap();
    let second = settle(&connection, &url, &queue, 2).await;
    assert_eq!((second.processed, second.duplicates), (0, 2));
    assert_eq!(rows().await, [1, 1], "the second run changes no row");
    assert_eq!(ready(&connection, &format!("{queue}.dead")).await, 0);

    let channel = connection.create_channel().await.unwrap();
    for name in [format!("{queue}.dead"), queue] {
        let _ = channel
            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    pool.close().await;
    Postgres::drop_database(&url).await;
}
