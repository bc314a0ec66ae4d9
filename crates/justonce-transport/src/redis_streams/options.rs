//! The settings of a Redis Streams consumer or reader, and the fields of an entry.

use super::adapter::own_consumer_name;
use crate::Policy;
use crate::consumer::policy_setters;
use crate::tls::Tls;
use std::time::Duration;

/// The field that holds an entry's key, by default.
pub const KEY_FIELD: &str = "key";
/// The field that holds an entry's body.
pub const BODY_FIELD: &str = "body";
/// The field that holds an entry's content type, if any.
pub const CONTENT_TYPE_FIELD: &str = "content-type";
/// Settings of a [`RedisStreamConsumer`](super::RedisStreamConsumer).
#[derive(Debug, Clone)]
pub struct RedisStreamOptions {
    pub(super) stream: String,
    pub(super) group: String,
    pub(super) consumer: String,
    pub(super) policy: Policy,
    pub(super) claim_idle: Duration,
    pub(super) count: usize,
    pub(super) tls: Option<Tls>,
}

impl RedisStreamOptions {
    /// Reads `stream` as a member of consumer group `group` (created at the start of the
    /// stream, with the stream, if missing), under a consumer name of its own process
    /// (`justonce-<host>-<pid>`: in containers every process may be pid 1). The
    /// key is the `key` field; failed work gets 5 attempts before it goes to
    /// `<stream>.dead`; entries pending for 30 s are taken over.
    pub fn new(stream: impl Into<String>, group: impl Into<String>) -> Self {
        Self {
            stream: stream.into(),
            group: group.into(),
            consumer: own_consumer_name(),
            policy: Policy::default(),
            claim_idle: Duration::from_secs(30),
            count: 16,
            tls: None,
        }
    }

    /// This reader's name in the group: unique among the group's live readers.
    pub fn consumer(mut self, consumer: impl Into<String>) -> Self {
        self.consumer = consumer.into();
        self
    }

    policy_setters!(
        /// Where the key is: [`KeyFrom::MessageId`](crate::KeyFrom::MessageId) is the `key`
        /// field, [`KeyFrom::Header`](crate::KeyFrom::Header) a field of that name,
        /// [`KeyFrom::Json`](crate::KeyFrom::Json) a pointer into the `body` field.
    );

    /// How long an entry stays pending, unacknowledged, before a reader takes it over:
    /// longer than the longest work, since work still running is taken over too. It is
    /// also the delay before failed work is tried again.
    pub fn claim_idle(mut self, idle: Duration) -> Self {
        self.claim_idle = idle.max(Duration::from_millis(1));
        self
    }

    /// How many entries one read takes at most (at least 1).
    pub fn count(mut self, count: usize) -> Self {
        self.count = count.max(1);
        self
    }

    /// How to check the server's certificate and which client certificate to present; the
    /// URL must be `rediss://`.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// The stream dead letters are added to.
    pub fn dead_letter_stream(&self) -> String {
        format!("{}.dead", self.stream)
    }
}
