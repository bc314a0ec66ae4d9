//! The settings of a NATS JetStream consumer or reader.

use crate::Policy;
use crate::consumer::policy_setters;
use crate::tls::Tls;
use std::time::Duration;

/// The header JetStream deduplicates on, and the default key.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// Settings of a [`NatsConsumer`](super::NatsConsumer).
#[derive(Debug, Clone)]
pub struct NatsOptions {
    pub(super) stream: String,
    pub(super) subject: String,
    pub(super) durable: String,
    pub(super) policy: Policy,
    pub(super) ack_wait: Duration,
    pub(super) prefetch: usize,
    pub(super) declare: bool,
    pub(super) replicas: usize,
    pub(super) tls: Option<Tls>,
}

impl NatsOptions {
    /// Consumes `subject` of `stream` through a durable consumer named after the stream:
    /// the key is the `Nats-Msg-Id` header, failed work gets 5 attempts before it is
    /// published to `justonce.dead.<stream>`, the ack wait is 30 s, 64 messages are pulled
    /// ahead, and the stream (with file storage) and its dead-letter stream `<stream>_DEAD`
    /// are created if missing, with one replica each.
    pub fn new(stream: impl Into<String>, subject: impl Into<String>) -> Self {
        let stream = stream.into();
        Self {
            durable: stream.clone(),
            stream,
            subject: subject.into(),
            policy: Policy::default(),
            ack_wait: Duration::from_secs(30),
            prefetch: 64,
            declare: true,
            replicas: 1,
            tls: None,
        }
    }

    /// The durable consumer's name; readers that share it share the messages.
    pub fn durable(mut self, durable: impl Into<String>) -> Self {
        self.durable = durable.into();
        self
    }

    policy_setters!(
        /// Where the key is: [`KeyFrom::MessageId`](crate::KeyFrom::MessageId) is the
        /// `Nats-Msg-Id` header.
    );

    /// How long the server waits for an ack before it redelivers. Work in progress is
    /// reported every half of it.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// How many messages each pull asks for ahead of the work (at least 1); the next pull
    /// goes out when half of them are taken. The server's ack wait runs for a message from
    /// when it is sent, and the consumer reports progress only on the messages it is working
    /// on, so the work of one and a half times this many messages must fit in the ack wait:
    /// a message that waits longer is delivered again, and its second delivery is a
    /// duplicate that costs time. With batches, twice the batch size: the next batch is
    /// gathered while one commits.
    pub fn prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// How many servers of a cluster keep a copy of each stream this consumer creates (at
    /// least 1, at most the cluster's size; JetStream allows 5). A copy survives the loss of
    /// a server when the stream has 3. It applies when the stream is created: a stream that
    /// exists keeps the replicas it has.
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas.max(1);
        self
    }

    /// Leaves the streams as they are instead of creating them.
    pub fn existing_streams(mut self) -> Self {
        self.declare = false;
        self
    }

    /// Requires TLS of the server, checked with these settings.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// The subject dead letters are published to.
    pub fn dead_letter_subject(&self) -> String {
        format!("justonce.dead.{}", self.stream)
    }
}
