//! An MQTT client and the task that drives its event loop.

use super::Message;
use super::options::MqttOptions;
use crate::Error;
use crate::tls::{Tls, TlsError};
use rumqttc::Outgoing;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::SubscribeReasonCode;
use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
use rumqttc::v5::{AsyncClient, Event, EventLoop};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Mutex, mpsc};

/// How many publishes a connection may have awaiting the broker's acknowledgement.
const OUTGOING_INFLIGHT: u16 = 16;

/// How long the broker has to acknowledge a publish or a subscription.
const BROKER_ANSWER: Duration = Duration::from_secs(30);

/// Why the connection failed, as each waiter needs it: a failed TLS handshake stays one,
/// and so does a refused login.
#[derive(Debug, Clone)]
pub(super) struct Failure {
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

    pub(super) fn error(self) -> Error {
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
    pub(super) client: AsyncClient,
    confirms: Mutex<mpsc::UnboundedReceiver<Confirm>>,
    pub(super) messages: Arc<Mutex<mpsc::UnboundedReceiver<Result<Message, Failure>>>>,
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
    pub(super) fn open(
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
    pub(super) async fn publish_confirmed(
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

/// Connects on the client's persistent session and subscribes to the topic at QoS 1,
/// waiting for the broker's answer.
pub(super) async fn subscribed(url: &str, options: &MqttOptions) -> Result<Connection, Error> {
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
pub(super) struct Address {
    host: String,
    port: u16,
    tls: bool,
    login: Option<(String, String)>,
}

/// The address in `mqtt[s]://[user:password@]host[:port]`.
pub(super) fn parse_url(url: &str) -> Result<Address, Error> {
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
pub(super) fn broker(error: impl std::error::Error + Send + Sync + 'static) -> Error {
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
