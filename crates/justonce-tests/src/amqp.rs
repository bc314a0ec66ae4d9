//! RabbitMQ for the broker tests and benchmarks.

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Connection};

/// The RabbitMQ server the tests use; they fail if it is down.
pub fn amqp_url() -> String {
    std::env::var("JUSTONCE_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// Publishes `count` persistent messages to `queue` through the default exchange, all at
/// once, and waits for every confirm. Message `n` has the key (`message_id` and body)
/// `order:{n % distinct}`, so the ones after the first `distinct` repeat earlier keys.
pub async fn publish_many(connection: &Connection, queue: &str, count: usize, distinct: usize) {
    let keys: Vec<String> = (0..count)
        .map(|n| format!("order:{}", n % distinct))
        .collect();
    publish_keys(connection, queue, &keys).await
}

/// Publishes one persistent message per key, in order, to `queue` through the default
/// exchange, all at once, and waits for every confirm. The key is the `message_id` and the
/// body.
pub async fn publish_keys(connection: &Connection, queue: &str, keys: &[String]) {
    try_publish_keys(connection, queue, keys)
        .await
        .expect("the broker took every message")
}

/// [`publish_keys`], or why the broker did not confirm every message.
pub async fn try_publish_keys(
    connection: &Connection,
    queue: &str,
    keys: &[String],
) -> Result<(), String> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| format!("a channel: {e}"))?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| format!("publisher confirms: {e}"))?;
    let mut confirms = Vec::with_capacity(keys.len());
    for key in keys {
        let properties = BasicProperties::default()
            .with_message_id(key.as_str().into())
            .with_delivery_mode(2);
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                key.as_bytes(),
                properties,
            )
            .await
            .map_err(|e| format!("publish: {e}"))?;
        confirms.push(confirm);
    }
    for confirm in confirms {
        let confirmation = confirm.await.map_err(|e| format!("a confirm: {e}"))?;
        if !confirmation.is_ack() {
            return Err("the broker refused a message".to_owned());
        }
    }
    Ok(())
}
