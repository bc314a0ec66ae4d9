//! The relay's destination for Redis Streams.

use super::connection::{connect, connection_info};
use super::options::{BODY_FIELD, KEY_FIELD};
use crate::Error;
use crate::destination::{Publish, Reopening, destination};
use crate::tls::Tls;
use justonce_core::Delivery;
use redis::AsyncCommands;
use redis::aio::MultiplexedConnection;

/// The relay's destination for Redis Streams: adds each outbox row to a stream as an entry
/// with its key in `key`, its payload in `body` and its headers as fields. A row added
/// twice (the relay died before marking it sent) is two entries with one key: the
/// consumer's claim makes the second a duplicate.
#[derive(Debug)]
pub struct RedisStreamDestination {
    url: String,
    stream: String,
    tls: Option<Tls>,
    redis: Reopening<MultiplexedConnection>,
}

impl RedisStreamDestination {
    /// Adds to `stream`. Connects on the first delivery.
    pub fn new(url: &str, stream: &str) -> Result<Self, Error> {
        connection_info(url)?;
        Ok(Self {
            url: url.to_owned(),
            stream: stream.to_owned(),
            tls: None,
            redis: Reopening::default(),
        })
    }

    /// Connects with these TLS settings; the URL must be `rediss://`.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }
}

impl Publish for RedisStreamDestination {
    type Connection = MultiplexedConnection;

    async fn open(&self) -> Result<MultiplexedConnection, Error> {
        connect(&self.url, self.tls.as_ref()).await
    }

    async fn publish(
        &self,
        redis: &MultiplexedConnection,
        delivery: Delivery<'_>,
    ) -> Result<(), String> {
        let mut fields: Vec<(&str, &[u8])> = vec![
            (KEY_FIELD, delivery.key.as_bytes()),
            (BODY_FIELD, delivery.payload),
        ];
        for (name, value) in delivery.headers {
            fields.push((name.as_str(), value.as_bytes()));
        }
        (redis.clone())
            .xadd::<_, _, _, _, String>(&self.stream, "*", &fields)
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    }

    fn connection(&self) -> &Reopening<MultiplexedConnection> {
        &self.redis
    }
}

destination!(RedisStreamDestination);
