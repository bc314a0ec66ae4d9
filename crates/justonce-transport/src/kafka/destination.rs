//! The relay's destination for Kafka: an idempotent producer.

use super::connection::{BROKER_TIMEOUT, Refusals, broker};
use super::options::{Sasl, Security};
use crate::Error;
use crate::destination::destination;
use crate::tls::Tls;
use justonce_core::Delivery;
use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use std::time::Instant;

/// The header the relay's records carry their key in, beside the record's Kafka key.
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";
/// An idempotent producer with `acks=all`: a record is acknowledged only once every in-sync
/// replica holds it, and a retried send is not written twice.
pub(super) struct Producer {
    client: FutureProducer<Refusals>,
    refusals: Refusals,
}

impl Producer {
    pub(super) fn new(config: &ClientConfig, refusals: Refusals) -> Result<Self, Error> {
        let client = config
            .clone()
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("message.timeout.ms", BROKER_TIMEOUT.as_millis().to_string())
            .create_with_context(refusals.clone())
            .map_err(|e| Error::Config(format!("Kafka producer: {e}")))?;
        Ok(Self { client, refusals })
    }

    /// Produces `record` and waits for the brokers to acknowledge it. A send that times out
    /// while the brokers refuse the connection fails with the refusal.
    pub(super) async fn send<K, P>(&self, record: FutureRecord<'_, K, P>) -> Result<(), Error>
    where
        K: rdkafka::message::ToBytes + ?Sized,
        P: rdkafka::message::ToBytes + ?Sized,
    {
        let since = Instant::now();
        self.client
            .send(record, BROKER_TIMEOUT)
            .await
            .map(drop)
            .map_err(|(error, _)| match self.refusals.last_since(since) {
                Some(refusal) => refusal.into(),
                None => broker(error),
            })
    }
}

/// The relay's destination for Kafka: produces each outbox row to a topic with the row's
/// key as the record's key (so one key's rows stay in one partition, in order) and as the
/// [`IDEMPOTENCY_KEY_HEADER`] header, through an idempotent producer with `acks=all`, and
/// marks the row sent once the brokers acknowledge it.
pub struct KafkaDestination {
    url: String,
    topic: String,
    security: Security,
    /// The producer, made on the first delivery.
    producer: tokio::sync::OnceCell<Producer>,
}

impl std::fmt::Debug for KafkaDestination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaDestination")
            .field("topic", &self.topic)
            .field("security", &self.security)
            .finish_non_exhaustive()
    }
}

impl KafkaDestination {
    /// Produces to `topic`, which must exist. Connects on the first delivery.
    pub fn new(url: &str, topic: &str) -> Self {
        Self {
            url: url.to_owned(),
            topic: topic.to_owned(),
            security: Security::default(),
            producer: tokio::sync::OnceCell::new(),
        }
    }

    /// Connects over TLS, checked with these settings.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.security.tls = Some(tls);
        self
    }

    /// Authenticates with SASL.
    pub fn sasl(mut self, sasl: Sasl) -> Self {
        self.security.sasl = Some(sasl);
        self
    }

    async fn send(&self, delivery: Delivery<'_>) -> Result<(), String> {
        let producer = self
            .producer
            .get_or_try_init(|| async {
                let config = self.security.client_config(&self.url)?;
                Producer::new(&config, Refusals::new(&self.security, &self.url))
            })
            .await
            .map_err(|e: Error| e.to_string())?;
        let mut headers = OwnedHeaders::new().insert(Header {
            key: IDEMPOTENCY_KEY_HEADER,
            value: Some(delivery.key),
        });
        for (name, value) in delivery.headers {
            headers = headers.insert(Header {
                key: name,
                value: Some(value),
            });
        }
        let record = FutureRecord::to(&self.topic)
            .key(delivery.key)
            .payload(delivery.payload)
            .headers(headers);
        producer.send(record).await.map_err(|e| e.to_string())
    }
}

// The producer is kept after a failed send: librdkafka connects again by itself, and the
// relay's sends run at once through it.
destination!(KafkaDestination);
