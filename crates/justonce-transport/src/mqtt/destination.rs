//! The relay's destination for MQTT.

use super::connection::{Connection, parse_url};
use super::options::KEY_PROPERTY;
use crate::Error;
use crate::destination::{Publish, Reopening, destination};
use crate::tls::Tls;
use justonce_core::Delivery;
use rumqttc::v5::mqttbytes::v5::PublishProperties;

/// The relay's destination for MQTT: publishes each outbox row to a topic at QoS 1 with
/// its key in the `key` user property and its headers as user properties, and marks it
/// sent once the broker acknowledges it. A row published again is a second message with
/// the same key, which the consumer's claim makes a duplicate.
pub struct MqttDestination {
    url: String,
    topic: String,
    client_id: String,
    tls: Option<Tls>,
    connection: Reopening<Connection>,
}

impl std::fmt::Debug for MqttDestination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MqttDestination")
            .field("topic", &self.topic)
            .field("client_id", &self.client_id)
            .finish_non_exhaustive()
    }
}

impl MqttDestination {
    /// Publishes to `topic` as client `client_id` on a clean session. Connects on the first
    /// delivery.
    pub fn new(url: &str, topic: &str, client_id: &str) -> Result<Self, Error> {
        parse_url(url)?;
        Ok(Self {
            url: url.to_owned(),
            topic: topic.to_owned(),
            client_id: client_id.to_owned(),
            tls: None,
            connection: Reopening::default(),
        })
    }

    /// Connects with these TLS settings; the URL must be `mqtts://`.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }
}

impl Publish for MqttDestination {
    type Connection = Connection;

    async fn open(&self) -> Result<Connection, Error> {
        Connection::open(&self.url, self.tls.as_ref(), &self.client_id, None)
    }

    async fn publish(&self, connection: &Connection, delivery: Delivery<'_>) -> Result<(), String> {
        let mut properties = PublishProperties::default();
        properties
            .user_properties
            .push((KEY_PROPERTY.to_owned(), delivery.key.to_owned()));
        for (name, value) in delivery.headers {
            if name.eq_ignore_ascii_case("content-type") {
                properties.content_type = Some(value.clone());
            } else {
                properties
                    .user_properties
                    .push((name.clone(), value.clone()));
            }
        }
        connection
            .publish_confirmed(&self.topic, delivery.payload.to_vec(), properties)
            .await
            .map_err(|e| e.to_string())
    }

    fn connection(&self) -> &Reopening<Connection> {
        &self.connection
    }
}

destination!(MqttDestination);
