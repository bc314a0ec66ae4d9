//! Many messages through Mosquitto, which drops what passes its queue of 1,000 per session.

use crate::{TestBackend, consume};
use justonce_sql::{Delivered, Delivery, Destination};
use justonce_transport::ConsumerStats;
use justonce_transport::mqtt::{MqttConsumer, MqttDestination};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

/// Publishes `count` messages for keys `order:0` to `order:<distinct - 1>` in turn to `topic`
/// while `consumer` runs the tests' work for each (in batches of up to `batch` when it is
/// more than 1), never more than 500 ahead of it, and returns what the consumer counted.
pub async fn publish_while_consuming<DB: TestBackend>(
    prefix: &str,
    consumer: &MqttConsumer<DB>,
    topic: &str,
    (count, distinct): (usize, usize),
    batch: usize,
) -> ConsumerStats {
    let settled = AtomicU64::new(0);
    let consuming = consume(consumer, prefix, (count, batch), &settled);
    publish_while(topic, (count, distinct), &settled, consuming).await
}

/// Publishes `count` messages for keys `order:0` to `order:<distinct - 1>` in turn to `topic`
/// while `consuming` runs, never more than 500 ahead of what it has `settled`, and returns
/// what `consuming` does.
pub async fn publish_while<T>(
    topic: &str,
    (count, distinct): (usize, usize),
    settled: &AtomicU64,
    consuming: impl Future<Output = T>,
) -> T {
    let url = crate::mqtt_url();
    let publisher = MqttDestination::new(&url, topic, &format!("{topic}-p")).expect("an MQTT URL");
    let publishing = async {
        for n in 0..count {
            while n as u64 >= settled.load(Ordering::Relaxed) + 500 {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            let key = format!("order:{}", n % distinct);
            let delivery = Delivery {
                id: n as i64,
                key: &key,
                destination: "orders",
                payload: key.as_bytes(),
                headers: &[],
                attempt: 1,
            };
            assert_eq!(
                publisher.deliver(delivery).await,
                Delivered::Sent,
                "MQTT at {url}"
            );
        }
    };
    let ((), consumed) = tokio::join!(publishing, consuming);
    consumed
}
