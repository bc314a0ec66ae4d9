//! The relay's destination for RabbitMQ.

use super::connection::{connect, open_channel, publish};
use crate::Error;
use crate::destination::{Publish, Reopening, destination};
use crate::tls::Tls;
use justonce_core::Delivery;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection};

/// The relay's destination for RabbitMQ: publishes each outbox row with its key as the
/// `message_id`, persistent, and marks it sent once the broker confirms it. A message no
/// queue takes is retried, so that a missing binding shows as a backlog rather than a loss.
pub struct AmqpDestination {
    url: String,
    exchange: String,
    routing_key: String,
    tls: Option<Tls>,
    /// The channel, with the connection it lives on.
    channel: Reopening<(Connection, Channel)>,
}

impl std::fmt::Debug for AmqpDestination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpDestination")
            .field("exchange", &self.exchange)
            .field("routing_key", &self.routing_key)
            .finish_non_exhaustive()
    }
}

impl AmqpDestination {
    /// Publishes to `exchange` (`""` for the default exchange, which routes to the queue
    /// named by the routing key) with `routing_key`. Connects on the first delivery.
    pub fn new(url: &str, exchange: &str, routing_key: &str) -> Self {
        Self {
            url: url.to_owned(),
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
            tls: None,
            channel: Reopening::default(),
        }
    }

    /// Connects with these TLS settings; the URL must be `amqps://`.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }
}

impl Publish for AmqpDestination {
    type Connection = (Connection, Channel);

    async fn open(&self) -> Result<(Connection, Channel), Error> {
        let connection = connect(&self.url, self.tls.as_ref()).await?;
        let channel = open_channel(&connection).await?;
        Ok((connection, channel))
    }

    async fn publish(
        &self,
        (_, channel): &(Connection, Channel),
        delivery: Delivery<'_>,
    ) -> Result<(), String> {
        let mut headers = FieldTable::default();
        let mut properties = BasicProperties::default()
            .with_message_id(ShortString::from(delivery.key))
            .with_delivery_mode(2);
        for (name, value) in delivery.headers {
            if name.eq_ignore_ascii_case("content-type") {
                properties = properties.with_content_type(value.as_str().into());
            } else {
                headers.insert(
                    name.as_str().into(),
                    AMQPValue::LongString(value.as_str().into()),
                );
            }
        }
        let properties = properties.with_headers(headers);
        publish(
            channel,
            &self.exchange,
            &self.routing_key,
            delivery.payload,
            properties,
        )
        .await
        .map_err(|e| e.to_string())
    }

    fn connection(&self) -> &Reopening<(Connection, Channel)> {
        &self.channel
    }
}

destination!(AmqpDestination);
