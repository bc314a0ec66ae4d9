//! The relay's destination for NATS JetStream.

use super::connection::connect;
use super::options::MSG_ID_HEADER;
use crate::Error;
use crate::destination::{Publish, Reopening, destination};
use crate::tls::Tls;
use async_nats::HeaderMap;
use async_nats::jetstream::{self};
use justonce_core::Delivery;

/// The relay's destination for NATS JetStream: publishes each outbox row to a subject with
/// its key as `Nats-Msg-Id`, so that the stream's duplicate window drops a row published
/// again, and marks it sent once the stream acknowledges it.
#[derive(Debug)]
pub struct NatsDestination {
    url: String,
    subject: String,
    jetstream: Reopening<jetstream::Context>,
    tls: Option<Tls>,
}

impl NatsDestination {
    /// Publishes to `subject`, which a stream must capture, through the server at `url` (or
    /// a cluster's servers separated by commas). Connects on the first delivery.
    pub fn new(url: &str, subject: &str) -> Self {
        Self {
            url: url.to_owned(),
            subject: subject.to_owned(),
            jetstream: Reopening::default(),
            tls: None,
        }
    }

    /// Requires TLS of the server, checked with these settings.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }
}

impl Publish for NatsDestination {
    type Connection = jetstream::Context;

    async fn open(&self) -> Result<jetstream::Context, Error> {
        Ok(jetstream::new(connect(&self.url, self.tls.as_ref()).await?))
    }

    async fn publish(
        &self,
        jetstream: &jetstream::Context,
        delivery: Delivery<'_>,
    ) -> Result<(), String> {
        let mut headers = HeaderMap::new();
        headers.insert(MSG_ID_HEADER, delivery.key);
        for (name, value) in delivery.headers {
            headers.insert(name.as_str(), value.as_str());
        }
        let payload = delivery.payload.to_vec().into();
        match jetstream
            .publish_with_headers(self.subject.clone(), headers, payload)
            .await
        {
            Ok(ack) => ack.await.map(drop).map_err(|e| e.to_string()),
            Err(error) => Err(error.to_string()),
        }
    }

    fn connection(&self) -> &Reopening<jetstream::Context> {
        &self.jetstream
    }
}

destination!(NatsDestination);
