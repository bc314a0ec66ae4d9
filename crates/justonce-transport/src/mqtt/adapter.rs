//! The MQTT adapter: a persistent session's messages and how it settles them.

use super::Message;
use super::connection::{Connection, Failure, broker, subscribed};
use super::options::{KEY_PROPERTY, MqttOptions};
use crate::consumer::{Broker, Receive, Received, Settle};
use crate::{ATTEMPT_HEADER, Error, Policy, REASON_BYTES, REASON_HEADER, truncate};
use justonce_sql::{Backend, Inbox};
use std::sync::Arc;
use tokio::sync::{OwnedMutexGuard, mpsc};

/// An MQTT consumer that runs each message's work once in effect.
pub type MqttConsumer<DB> = crate::Consumer<Mqtt, DB>;

/// The MQTT adapter of [`MqttConsumer`]: a persistent session subscribed at QoS 1.
pub struct Mqtt {
    url: String,
    /// The connection, replaced when the consumer connects again.
    connection: std::sync::Mutex<Arc<Connection>>,
    options: MqttOptions,
}

debug_shows_options!(Mqtt);

impl<DB: Backend> MqttConsumer<DB> {
    /// Connects to `url` (`mqtt://[user:password@]host[:port]`) on the client's persistent
    /// session and subscribes to the topic at QoS 1, waiting for the broker's answer.
    pub async fn connect(url: &str, inbox: Inbox<DB>, options: MqttOptions) -> Result<Self, Error> {
        let connection = subscribed(url, &options).await?;
        let mqtt = Mqtt {
            url: url.to_owned(),
            connection: std::sync::Mutex::new(Arc::new(connection)),
            options,
        };
        Ok(Self::new(mqtt, inbox))
    }
}

/// The messages of the session, one taker at a time.
pub struct MqttReceiver {
    messages: OwnedMutexGuard<mpsc::UnboundedReceiver<Result<Message, Failure>>>,
}

impl Receive for MqttReceiver {
    type Delivery = Message;

    async fn next(&mut self) -> Result<Option<Message>, Error> {
        match self.messages.recv().await {
            Some(Ok(message)) => Ok(Some(message)),
            Some(Err(failure)) => Err(failure.error()),
            None => Err(Error::Broker("the connection to the broker closed".into())),
        }
    }
}

impl Received for Message {
    fn message_id(&self) -> Result<String, String> {
        self.header(KEY_PROPERTY)
            .ok_or_else(|| "the message has no key user property".to_owned())
    }

    fn header(&self, name: &str) -> Option<String> {
        user_property(self, name).map(str::to_owned)
    }

    fn no_header(&self, name: &str) -> String {
        format!("the message has no user property {name}")
    }

    fn log_id(&self) -> String {
        format!("topic {}", String::from_utf8_lossy(&self.topic))
    }

    fn body(&self) -> Vec<u8> {
        self.payload.to_vec()
    }

    fn content_type(&self) -> Option<String> {
        self.properties.as_ref()?.content_type.clone()
    }

    /// As the copies published for retries count.
    fn attempt(&self) -> u32 {
        user_property(self, ATTEMPT_HEADER)
            .and_then(|attempt| attempt.parse().ok())
            .unwrap_or(1)
            .max(1)
    }

    fn redelivered(&self) -> bool {
        self.dup || self.attempt() > 1
    }
}

impl Broker for Mqtt {
    type Delivery = Message;
    type Receiver<'b> = MqttReceiver;
    const NAME: &'static str = "mqtt";

    fn policy(&self) -> &Policy {
        &self.options.policy
    }

    async fn receive(&self) -> Result<MqttReceiver, Error> {
        let messages = Arc::clone(&self.connection().messages);
        Ok(MqttReceiver {
            messages: messages.lock_owned().await,
        })
    }

    /// A new connection on the same persistent session, subscribed again. The broker sends
    /// again what the session holds unacknowledged.
    async fn reconnect(&self) -> Result<(), Error> {
        let connection = subscribed(&self.url, &self.options).await?;
        *crate::lock(&self.connection) = Arc::new(connection);
        Ok(())
    }

    /// MQTT has no negative acknowledgement: a retry, a dead letter or a message given back
    /// is a copy published, acknowledged by the broker, then the original acknowledged.
    async fn settle(&self, message: &Message, settle: Settle) -> Result<(), Error> {
        let topic = String::from_utf8_lossy(&message.topic).into_owned();
        match settle {
            Settle::Ack => {}
            Settle::Retry { attempt } => {
                self.publish_copy(message, &topic, attempt + 1, None)
                    .await?;
            }
            Settle::DeadLetter { attempt, reason } => {
                let topic = &self.options.dead_letter_topic;
                self.publish_copy(message, topic, attempt, Some(&reason))
                    .await?;
            }
            Settle::GiveBack => {
                self.publish_copy(message, &topic, message.attempt(), None)
                    .await?;
            }
        }
        self.connection().client.ack(message).await.map_err(broker)
    }
}

impl Mqtt {
    /// The connection in use.
    fn connection(&self) -> Arc<Connection> {
        Arc::clone(&crate::lock(&self.connection))
    }

    /// Publishes the message to `topic` with its properties, the attempt and the reason, and
    /// waits for the broker to acknowledge it.
    async fn publish_copy(
        &self,
        message: &Message,
        topic: &str,
        attempt: u32,
        reason: Option<&str>,
    ) -> Result<(), Error> {
        let mut properties = message.properties.clone().unwrap_or_default();
        // Set by the broker for its subscribers, not by publishers.
        properties.subscription_identifiers.clear();
        properties
            .user_properties
            .retain(|(name, _)| name != ATTEMPT_HEADER && name != REASON_HEADER);
        properties
            .user_properties
            .push((ATTEMPT_HEADER.to_owned(), attempt.to_string()));
        if let Some(reason) = reason {
            properties.user_properties.push((
                REASON_HEADER.to_owned(),
                truncate(reason, REASON_BYTES).to_owned(),
            ));
        }
        self.connection()
            .publish_confirmed(topic, message.payload.to_vec(), properties)
            .await
    }
}

fn user_property<'m>(message: &'m Message, name: &str) -> Option<&'m str> {
    let properties = message.properties.as_ref()?;
    properties
        .user_properties
        .iter()
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.as_str())
}
