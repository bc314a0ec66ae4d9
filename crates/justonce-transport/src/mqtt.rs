//! MQTT 5: a QoS 1 subscriber on a persistent session that acknowledges (`PUBACK`) only after
//! the commit, and the relay's publisher.
//!
//! ```no_run
//! # async fn example(inbox: justonce_sql::Inbox<justonce_sql::sqlx::Postgres>) -> Result<(), justonce_transport::Error> {
//! use justonce_sql::sqlx;
//! use justonce_transport::mqtt::{MqttConsumer, MqttOptions};
//!
//! let consumer = MqttConsumer::connect(
//!     "mqtt://127.0.0.1:1883",
//!     inbox,
//!     MqttOptions::new("orders/#", "shipping-1"),
//! )
//! .await?;
//! consumer
//!     .run(tokio::signal::ctrl_c(), |tx, message| {
//!         Box::pin(async move {
//!             sqlx::query("INSERT INTO shipments (order_key) VALUES ($1)")
//!                 .bind(message.key.as_str())
//!                 .execute(&mut **tx)
//!                 .await
//!                 .map(drop)
//!         })
//!     })
//!     .await?;
//! # Ok(())
//! # }
//! ```
//!
//! The session is persistent (`clean_start` off, a session expiry): a message delivered but
//! not acknowledged when the consumer died is sent again when a consumer with the same
//! client id connects. MQTT has no negative acknowledgement, so failed work is published
//! again to the message's topic with its attempt count in a user property, then
//! acknowledged; after the attempt limit it is published to the dead-letter topic with the
//! reason. Each copy is acknowledged by the broker before the original is.
//!
//! The key is the `key` user property by default, as [`MqttDestination`] publishes it.
//!
//! An `mqtts://` URL connects over TLS, checked against the system's roots or the CA of
//! [`MqttOptions::tls`].

use crate::consumer::{Broker, Receive, Received, Settle, policy_setters};
use crate::destination::{Publish, Reopening, destination};
use crate::tls::{Tls, TlsError};
use crate::{ATTEMPT_HEADER, Error, Policy, REASON_BYTES, REASON_HEADER, truncate};
use justonce_core::Delivery;
use justonce_sql::{Backend, Inbox};
use rumqttc::Outgoing;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::SubscribeReasonCode;
use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
use rumqttc::v5::{AsyncClient, Event, EventLoop};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Mutex, OwnedMutexGuard, mpsc};

pub use rumqttc::v5::mqttbytes::v5::Publish as Message;

/// The user property that holds a message's key, by default.
pub const KEY_PROPERTY: &str = "key";

/// How many publishes a connection may have awaiting the broker's acknowledgement.
const OUTGOING_INFLIGHT: u16 = 16;

/// How long the broker has to acknowledge a publish or a subscription.
const BROKER_ANSWER: Duration = Duration::from_secs(30);

/// Settings of an [`MqttConsumer`].
#[derive(Debug, Clone)]
pub struct MqttOptions {
    topic: String,
    shared_group: Option<String>,
    client_id: String,
    policy: Policy,
    session_expiry: Duration,
    dead_letter_topic: String,
    tls: Option<Tls>,
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
    fn subscription(&self) -> String {
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

/// Why the connection failed, as each waiter needs it: a failed TLS handshake stays one,
/// and so does a refused login.
#[derive(Debug, Clone)]
struct Failure {
    reason: String,
    tls: Option<TlsError>,
    refused_access: bool,
}

impl Failure {
    fn of(error: &rumqttc::v5::ConnectionError) -> Self {
        use rumqttc::v5::mqttbytes::v5::ConnectReturnCode;
        use rumqttc::v5::{ConnectionError, StateError, mqttbytes};
        // A read that fails in rumqttc's decoder does not give its cause as its source: a
        // client certificate refused after a TLS 1.3 handshake arrives there.
        let tls = match error {
            ConnectionError::MqttState(StateError::Deserialization(mqttbytes::Error::Io(io))) => {
                crate::tls::tls_error(io)
            }
            error => crate::tls::tls_error(error),
        };
        let refused_access = matches!(
            error,
            ConnectionError::ConnectionRefused(
                ConnectReturnCode::BadUserNamePassword | ConnectReturnCode::NotAuthorized
            )
        );
        Self {
            reason: error.to_string(),
            tls,
            refused_access,
        }
    }

    fn error(self) -> Error {
        match self.tls {
            Some(tls) => Error::Tls(tls),
            None if self.refused_access => crate::refused_access(self.reason),
            None => Error::Broker(self.reason.into()),
        }
    }
}

/// What the event loop passes on to the consumer or publisher.
enum Confirm {
    /// The broker accepted the connection (a `CONNACK` with success).
    Connected,
    /// The event loop sent a publish with this packet id.
    Sent(u16),
    /// The broker acknowledged the publish with this packet id.
    Acked(u16),
    /// The broker answered a subscription: granted at QoS 1 or more, or refused.
    Subscribed(Result<(), String>),
    /// The connection failed, for this reason.
    Failed(Failure),
}

/// A client and the task that drives its event loop.
pub(crate) struct Connection {
    client: AsyncClient,
    confirms: Mutex<mpsc::UnboundedReceiver<Confirm>>,
    messages: Arc<Mutex<mpsc::UnboundedReceiver<Result<Message, Failure>>>>,
    driver: tokio::task::JoinHandle<()>,
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

impl Connection {
    /// Connects as `client_id`; `session_expiry` of `None` starts a clean session. An
    /// `mqtts://` URL connects over TLS with `tls`, or the defaults.
    fn open(
        url: &str,
        tls: Option<&Tls>,
        client_id: &str,
        session_expiry: Option<Duration>,
    ) -> Result<Self, Error> {
        let address = parse_url(url)?;
        let mut options = rumqttc::v5::MqttOptions::new(client_id, address.host, address.port);
        match (address.tls, tls) {
            (true, tls) => {
                let config = tls.cloned().unwrap_or_default().client_config()?;
                options.set_transport(rumqttc::Transport::tls_with_config(
                    rumqttc::TlsConfiguration::Rustls(Arc::new(config)),
                ));
            }
            (false, Some(_)) => {
                return Err(Error::Config(
                    "TLS settings need an mqtts:// URL".to_owned(),
                ));
            }
            (false, None) => {}
        }
        options.set_keep_alive(Duration::from_secs(30));
        // rumqttc keeps a slot per packet id it may have in flight, 65,535 by default: about
        // 16 MiB per connection. This client publishes one message at a time.
        options.set_outgoing_inflight_upper_limit(OUTGOING_INFLIGHT);
        if let Some((user, password)) = address.login {
            options.set_credentials(user, password);
        }
        match session_expiry {
            Some(expiry) => {
                let seconds = u32::try_from(expiry.as_secs()).unwrap_or(u32::MAX);
                options
                    .set_clean_start(false)
                    .set_session_expiry_interval(Some(seconds))
                    .set_manual_acks(true);
            }
            None => {
                options.set_clean_start(true);
            }
        }
        let (client, events) = AsyncClient::new(options, 64);
        let (confirm_tx, confirms) = mpsc::unbounded_channel();
        let (message_tx, messages) = mpsc::unbounded_channel();
        let driver = tokio::spawn(drive(events, confirm_tx, message_tx));
        Ok(Self {
            client,
            confirms: Mutex::new(confirms),
            messages: Arc::new(Mutex::new(messages)),
            driver,
        })
    }

    /// Publishes at QoS 1 and waits until the broker has acknowledged it.
    async fn publish_confirmed(
        &self,
        topic: &str,
        payload: Vec<u8>,
        properties: PublishProperties,
    ) -> Result<(), Error> {
        // One publish in flight at a time, so that the next packet id sent is this one's.
        let mut confirms = self.confirms.lock().await;
        self.client
            .publish_with_properties(topic, QoS::AtLeastOnce, false, payload, properties)
            .await
            .map_err(|error| ended(&mut confirms, error))?;
        let answered = tokio::time::timeout(BROKER_ANSWER, async {
            let mut sent = None;
            while let Some(confirm) = confirms.recv().await {
                match (confirm, sent) {
                    (Confirm::Sent(pkid), None) => sent = Some(pkid),
                    (Confirm::Acked(pkid), Some(sent)) if pkid == sent => return Ok(()),
                    (Confirm::Failed(failure), _) => return Err(failure.error()),
                    _ => {}
                }
            }
            Err(Error::Broker("the connection to the broker closed".into()))
        })
        .await;
        answered.unwrap_or_else(|_| {
            Err(Error::Broker(
                format!("the broker did not acknowledge a publish to {topic}").into(),
            ))
        })
    }
}

/// Why a request to the event loop failed: the loop ended, and its last confirm says why
/// (a refused TLS handshake, say), sent before it ended.
fn ended(
    confirms: &mut mpsc::UnboundedReceiver<Confirm>,
    error: rumqttc::v5::ClientError,
) -> Error {
    while let Ok(confirm) = confirms.try_recv() {
        if let Confirm::Failed(failure) = confirm {
            return failure.error();
        }
    }
    broker(error)
}

/// Polls the event loop, passing on messages, publish confirmations and subscriptions,
/// until the connection fails; the consumer then connects again with a new one.
async fn drive(
    mut events: EventLoop,
    confirms: mpsc::UnboundedSender<Confirm>,
    messages: mpsc::UnboundedSender<Result<Message, Failure>>,
) {
    loop {
        let passed = match events.poll().await {
            Ok(Event::Incoming(Packet::Publish(message))) => messages.send(Ok(message)).is_ok(),
            Ok(Event::Incoming(Packet::PubAck(ack))) => {
                confirms.send(Confirm::Acked(ack.pkid)).is_ok()
            }
            Ok(Event::Incoming(Packet::SubAck(ack))) => {
                // QoS 0 granted would be at most once: as bad as a refusal.
                let granted = ack.return_codes.iter().all(|code| {
                    matches!(
                        code,
                        SubscribeReasonCode::Success(QoS::AtLeastOnce | QoS::ExactlyOnce)
                    )
                });
                let answer = if granted {
                    Ok(())
                } else {
                    Err(format!("the broker answered {:?}", ack.return_codes))
                };
                confirms.send(Confirm::Subscribed(answer)).is_ok()
            }
            Ok(Event::Incoming(Packet::ConnAck(_))) => confirms.send(Confirm::Connected).is_ok(),
            Ok(Event::Outgoing(Outgoing::Publish(pkid))) => {
                confirms.send(Confirm::Sent(pkid)).is_ok()
            }
            // Nothing follows a DISCONNECT on the wire: the waiters see the channels close.
            Ok(Event::Outgoing(Outgoing::Disconnect)) => false,
            Ok(_) => true,
            Err(error) => {
                let failure = Failure::of(&error);
                let _ = confirms.send(Confirm::Failed(failure.clone()));
                let _ = messages.send(Err(failure));
                false
            }
        };
        if !passed {
            return;
        }
    }
}

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

/// Connects on the client's persistent session and subscribes to the topic at QoS 1,
/// waiting for the broker's answer.
async fn subscribed(url: &str, options: &MqttOptions) -> Result<Connection, Error> {
    let connection = Connection::open(
        url,
        options.tls.as_ref(),
        &options.client_id,
        Some(options.session_expiry),
    )?;
    let subscription = options.subscription();
    if let Err(error) = connection
        .client
        .subscribe(subscription.clone(), QoS::AtLeastOnce)
        .await
    {
        return Err(ended(&mut *connection.confirms.lock().await, error));
    }
    let subscribed = tokio::time::timeout(BROKER_ANSWER, async {
        let mut confirms = connection.confirms.lock().await;
        loop {
            match confirms.recv().await {
                Some(Confirm::Subscribed(answer)) => {
                    return answer.map_err(|reason| {
                        Error::Config(format!("subscribing to {subscription}: {reason}"))
                    });
                }
                Some(Confirm::Failed(failure)) => return Err(failure.error()),
                Some(_) => {}
                None => return Err(Error::Broker("the connection closed".into())),
            }
        }
    })
    .await
    .map_err(|_| {
        Error::Broker(format!("no answer to the subscription to {}", options.topic).into())
    })?;
    subscribed?;
    Ok(connection)
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

/// Proves that the broker at `url` takes a consumer with `options`: connects with its TLS
/// settings and login, waits for the broker to accept the connection, and disconnects.
/// It connects as the consumer's client id with `-check` added, on a clean session, so that
/// it neither takes over a running consumer's connection nor touches its persistent
/// session. Subscribes to nothing. Gives up after [`PROBE_TIMEOUT`](crate::PROBE_TIMEOUT).
pub async fn probe(url: &str, options: &MqttOptions) -> Result<(), Error> {
    let client_id = format!("{}-check", options.client_id);
    crate::within_probe_timeout(async {
        let connection = Connection::open(url, options.tls.as_ref(), &client_id, None)?;
        let mut confirms = connection.confirms.lock().await;
        match confirms.recv().await {
            Some(Confirm::Connected) => {}
            Some(Confirm::Failed(failure)) => return Err(failure.error()),
            _ => return Err(Error::Broker("the connection closed".into())),
        }
        // The broker's accept is the proof. What follows cannot fail the probe: another
        // check at the same moment, under the same client id, may have taken the
        // connection over.
        if connection.client.disconnect().await.is_ok() {
            // The event loop ends once the DISCONNECT is sent.
            while confirms.recv().await.is_some() {}
        }
        Ok(())
    })
    .await
}

/// Where a broker is, whether over TLS, and who to log in as.
#[derive(Debug, PartialEq, Eq)]
struct Address {
    host: String,
    port: u16,
    tls: bool,
    login: Option<(String, String)>,
}

/// The address in `mqtt[s]://[user:password@]host[:port]`.
fn parse_url(url: &str) -> Result<Address, Error> {
    let bad = |why: &str| {
        Error::Config(format!(
            "MQTT URL: {why}; expected mqtt://[user:password@]host[:port] or mqtts://..."
        ))
    };
    let (tls, rest) = match (url.strip_prefix("mqtt://"), url.strip_prefix("mqtts://")) {
        (Some(rest), _) => (false, rest),
        (None, Some(rest)) => (true, rest),
        (None, None) => return Err(bad("not mqtt:// or mqtts://")),
    };
    let rest = rest.trim_end_matches('/');
    let decoded = |text: &str| {
        percent_encoding::percent_decode_str(text)
            .decode_utf8_lossy()
            .into_owned()
    };
    let (login, address) = match rest.rsplit_once('@') {
        Some((login, address)) => {
            let (user, password) = login.split_once(':').unwrap_or((login, ""));
            (Some((decoded(user), decoded(password))), address)
        }
        None => (None, rest),
    };
    let (host, port) = match address.rsplit_once(':') {
        Some((host, port)) => (
            host,
            port.parse().map_err(|_| bad("the port is not a number"))?,
        ),
        None => (address, if tls { 8883 } else { 1883 }),
    };
    if host.is_empty() {
        return Err(bad("no host"));
    }
    Ok(Address {
        host: host.to_owned(),
        port,
        tls,
        login,
    })
}

fn user_property<'m>(message: &'m Message, name: &str) -> Option<&'m str> {
    let properties = message.properties.as_ref()?;
    properties
        .user_properties
        .iter()
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.as_str())
}

fn broker(error: impl std::error::Error + Send + Sync + 'static) -> Error {
    crate::tls::broker_error(error)
}

#[cfg(test)]
mod tests {
    use super::parse_url;

    #[test]
    fn urls_name_host_port_and_login() {
        let address = parse_url("mqtt://127.0.0.1:1883").unwrap();
        assert_eq!((address.host.as_str(), address.port), ("127.0.0.1", 1883));
        assert_eq!(address.login, None);
        assert_eq!(parse_url("mqtt://broker").unwrap().port, 1883);
        let secure = parse_url("mqtts://broker").unwrap();
        assert_eq!((secure.port, secure.tls), (8883, true));
        assert!(!address.tls);
        assert_eq!(
            parse_url("mqtt://app:s3cret@broker:8883").unwrap().login,
            Some(("app".to_owned(), "s3cret".to_owned()))
        );
        assert_eq!(
            parse_url("mqtt://app%20one:p%40ss%2Fw%3Ard@broker")
                .unwrap()
                .login,
            Some(("app one".to_owned(), "p@ss/w:rd".to_owned()))
        );
        for bad in ["http://broker", "mqtt://", "mqtt://broker:port"] {
            assert!(parse_url(bad).is_err(), "{bad} was accepted");
        }
    }
}
