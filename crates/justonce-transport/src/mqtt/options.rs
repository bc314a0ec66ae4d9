//! The settings of an MQTT consumer.

use crate::Policy;
use crate::consumer::policy_setters;
use crate::tls::Tls;
use std::time::Duration;

/// The user property that holds a message's key, by default.
pub const KEY_PROPERTY: &str = "key";
/// Settings of an [`MqttConsumer`](super::MqttConsumer).
#[derive(Debug, Clone)]
pub struct MqttOptions {
    pub(super) topic: String,
    shared_group: Option<String>,
    pub(super) client_id: String,
    pub(super) policy: Policy,
    pub(super) session_expiry: Duration,
    pub(super) dead_letter_topic: String,
    pub(super) tls: Option<Tls>,
}

impl MqttOptions {
    /// Subscribes to `topic` (a filter, wildcards allowed) at QoS 1 as client `client_id`,
    /// whose session the broker keeps for a week while it is away. The key is the `key`
    /// user property; failed work gets 5 attempts before it goes to
    /// `justonce/dead/<client_id>`.
    pub fn new(topic: impl Into<String>, client_id: impl Into<String>) -> Self {
        let client_id = client_id.into();
        Self {
            topic: topic.into(),
            shared_group: None,
            dead_letter_topic: format!("justonce/dead/{client_id}"),
            client_id,
            policy: Policy::default(),
            session_expiry: Duration::from_secs(7 * 86_400),
            tls: None,
        }
    }

    policy_setters!(
        /// Where the key is: [`KeyFrom::MessageId`](crate::KeyFrom::MessageId) is the `key`
        /// user property, [`KeyFrom::Header`](crate::KeyFrom::Header) a user property of
        /// that name, [`KeyFrom::Json`](crate::KeyFrom::Json) a pointer into the payload.
    );

    /// Shares the topic's messages among the consumers of `group` (an MQTT 5 shared
    /// subscription, `$share/<group>/<topic>`): each message goes to one of them. Each
    /// consumer process needs a client id of its own. A message delivered to a consumer
    /// that died waits in that consumer's session until its client id connects again; the
    /// broker does not hand it to another member.
    pub fn shared(mut self, group: impl Into<String>) -> Self {
        self.shared_group = Some(group.into());
        self
    }

    /// The filter subscribed to: the topic, or its shared subscription.
    pub(super) fn subscription(&self) -> String {
        match &self.shared_group {
            Some(group) => format!("$share/{group}/{}", self.topic),
            None => self.topic.clone(),
        }
    }

    /// How long the broker keeps the session, and the messages for it, while no consumer
    /// with this client id is connected: at least as long as a consumer may be down.
    pub fn session_expiry(mut self, expiry: Duration) -> Self {
        self.session_expiry = expiry;
        self
    }

    /// The topic dead letters are published to.
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = topic.into();
        self
    }

    /// How to check the broker's certificate and which client certificate to present; the
    /// URL must be `mqtts://`.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }
}
