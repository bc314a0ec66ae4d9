//! Probing the brokers, and how their refusals and errors are told apart.

use super::options::{KafkaOptions, Security, bootstrap_servers};
use crate::Error;
use crate::tls::{Tls, TlsError};
use rdkafka::ClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer as _, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a seek or a produced record may take before it counts as failed.
pub(super) const BROKER_TIMEOUT: Duration = Duration::from_secs(30);

/// Proves that the brokers at `url` take a reader with `options`: connects with its TLS and
/// SASL settings, and asks for the topic's metadata, which fails on refused credentials and
/// says whether the topic exists. Joins no group and consumes nothing. Gives up after
/// [`PROBE_TIMEOUT`](crate::PROBE_TIMEOUT), or at the first refused TLS handshake or login.
pub async fn probe(url: &str, options: &KafkaOptions) -> Result<(), Error> {
    let config = options.security.client_config(url)?;
    let refusals = Refusals::new(&options.security, url);
    let topic = options.topic.clone();
    crate::within_probe_timeout(async move {
        // librdkafka's metadata request blocks its caller.
        tokio::task::spawn_blocking(move || {
            let client: BaseConsumer<Refusals> = config
                .create_with_context(refusals.clone())
                .map_err(|e| Error::Config(format!("Kafka client: {e}")))?;
            let since = Instant::now();
            let metadata = loop {
                match client.fetch_metadata(Some(&topic), PROBE_ATTEMPT) {
                    Ok(metadata) => break metadata,
                    Err(error) => {
                        // Serves the client's events for a while: its log lines come first
                        // in its queue, then the errors that tell of a refusal.
                        let _ = client.poll(PROBE_ATTEMPT);
                        if let Some(refusal) = refusals.last_since(since) {
                            return Err(refusal.into());
                        }
                        if since.elapsed() >= crate::PROBE_TIMEOUT {
                            return Err(broker(error));
                        }
                    }
                }
            };
            let found = metadata.topics().iter().find(|found| found.name() == topic);
            match found.map(|found| found.error()) {
                Some(None) => Ok(()),
                Some(Some(error)) => Err(Error::Config(format!(
                    "topic {topic}: {}",
                    RDKafkaErrorCode::from(error)
                ))),
                None => Err(Error::Config(format!("topic {topic} does not exist"))),
            }
        })
        .await
        .map_err(|e| Error::Broker(e.into()))?
    })
    .await
}

/// How long one metadata request of a probe may take, and how long the probe serves the
/// client's events after it, before it asks again.
const PROBE_ATTEMPT: Duration = Duration::from_millis(250);

/// The context of a probe's client and of a producer. librdkafka reports a refused TLS
/// handshake or SASL login only to its error callback, then tries again until a request
/// times out; kept here, the refusal can be named instead of the timeout.
#[derive(Clone)]
pub(super) struct Refusals {
    last: Arc<Mutex<Option<LastRefusal>>>,
    /// The TLS settings and the first bootstrap server, to learn why a certificate failed.
    tls: Option<(Tls, String)>,
    /// Whether that handshake runs on a thread of its own, for a client whose callbacks run
    /// on the async runtime: the refusal is named from librdkafka's words first, then the
    /// handshake's verdict replaces it.
    diagnose_aside: bool,
}

struct LastRefusal {
    at: Instant,
    /// librdkafka's words without their timing, which repeat at each attempt to connect.
    reason: String,
    refusal: Refusal,
}

/// Why the brokers refused a connection: a setting must change, not the network.
#[derive(Clone)]
pub(super) enum Refusal {
    Tls(TlsError),
    /// librdkafka's reason for the refused login.
    Login(String),
}

impl From<Refusal> for Error {
    fn from(refusal: Refusal) -> Self {
        match refusal {
            Refusal::Tls(tls) => Error::Tls(tls),
            Refusal::Login(reason) => Error::Config(format!(
                "the brokers refused the SASL login ({reason}): check the mechanism, the user \
                 and the password"
            )),
        }
    }
}

/// How long learning why a certificate failed may take at each step.
const DIAGNOSIS: Duration = Duration::from_secs(2);

impl Refusals {
    pub(super) fn new(security: &Security, url: &str) -> Self {
        let first_server = bootstrap_servers(url)
            .ok()
            .and_then(|servers| servers.split(',').next())
            .map(str::to_owned);
        Self {
            last: Arc::default(),
            tls: security.tls.clone().zip(first_server),
            diagnose_aside: false,
        }
    }

    /// Refusals of a reader, whose client calls back inside the async poll that reads
    /// records: a failed verification's handshake runs on a thread of its own, so that it
    /// holds no runtime worker.
    pub(super) fn diagnosed_aside(security: &Security, url: &str) -> Self {
        Self {
            diagnose_aside: true,
            ..Self::new(security, url)
        }
    }

    /// Keeps the refusal the client's `error` tells of, if it is one, and gives it. A new one
    /// with a failed verification takes a handshake of its own, up to [`DIAGNOSIS`] twice,
    /// here or aside.
    pub(super) fn note(&self, error: &KafkaError, reason: &str) -> Option<Refusal> {
        // The same refusal again, at the next attempt: known already.
        let words = without_timing(reason);
        let mut last = crate::lock(&self.last);
        if let Some(last) = last.as_mut().filter(|last| last.reason == words) {
            last.at = Instant::now();
            return Some(last.refusal.clone());
        }
        let refusal = if error.rdkafka_error_code() == Some(RDKafkaErrorCode::Authentication) {
            Refusal::Login(reason.to_owned())
        } else {
            Refusal::Tls(self.refusal(reason)?)
        };
        *last = Some(LastRefusal {
            at: Instant::now(),
            reason: words.to_owned(),
            refusal: refusal.clone(),
        });
        Some(refusal)
    }

    /// The last refusal, if at or after `since`.
    pub(super) fn last_since(&self, since: Instant) -> Option<Refusal> {
        let last = crate::lock(&self.last);
        last.as_ref()
            .filter(|last| last.at >= since)
            .map(|last| last.refusal.clone())
    }

    /// The refusal librdkafka's error `reason` tells of, if it is one. Its OpenSSL reports a
    /// CA it does not know and a certificate for another host alike, as a failed
    /// verification: rustls's verdict on a handshake of its own tells them apart.
    fn refusal(&self, reason: &str) -> Option<TlsError> {
        let lower = reason.to_ascii_lowercase();
        if lower.contains("alert certificate required") {
            return Some(TlsError::ClientCertificateRequired);
        }
        let refused_client = [
            "alert unknown ca",
            "alert bad certificate",
            "alert certificate unknown",
            "alert access denied",
        ];
        if refused_client.iter().any(|alert| lower.contains(alert)) {
            return Some(TlsError::ClientCertificateRefused(reason.to_owned()));
        }
        if !lower.contains("ssl handshake failed") {
            return None;
        }
        if !lower.contains("certificate verify failed") {
            return Some(TlsError::Handshake(reason.to_owned()));
        }
        let unverified = TlsError::BadCertificate(reason.to_owned());
        let Some((tls, server)) = &self.tls else {
            return Some(unverified);
        };
        if !self.diagnose_aside {
            return Some(
                crate::tls::handshake_refusal(tls, server, DIAGNOSIS).unwrap_or(unverified),
            );
        }
        let (tls, server) = (tls.clone(), server.clone());
        let (last, words) = (Arc::clone(&self.last), without_timing(reason).to_owned());
        // `note` holds `last` until it has kept this refusal: the verdict comes after it.
        std::thread::spawn(move || {
            let Some(diagnosed) = crate::tls::handshake_refusal(&tls, &server, DIAGNOSIS) else {
                return;
            };
            if let Some(last) = crate::lock(&last)
                .as_mut()
                .filter(|last| last.reason == words)
            {
                last.refusal = Refusal::Tls(diagnosed);
            }
        });
        Some(unverified)
    }
}

/// librdkafka's words without their timing, which changes at each attempt to connect.
fn without_timing(reason: &str) -> &str {
    reason
        .split_once(" (after ")
        .map_or(reason, |(words, _timing)| words)
}

impl ClientContext for Refusals {
    /// Called when the client is polled: a producer polls all the time, a probe between its
    /// requests.
    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(%error, reason, "Kafka client error");
        self.note(&error, reason);
    }
}

impl ConsumerContext for Refusals {}

/// How long the reader waits after an error the client recovers from, so that a broker
/// that is down costs no busy loop.
pub(super) const RECOVERY_POLL: Duration = Duration::from_millis(100);

/// Whether librdkafka goes on after `error` by itself: a broker down or a transport failure
/// is reported through the consumer too, and reconnecting is the client's job. A fatal
/// error or a refused login ends the reader.
pub(super) fn recovers_by_itself(error: &KafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode as Code;
    !matches!(
        error.rdkafka_error_code(),
        Some(
            Code::Fatal
                | Code::Authentication
                | Code::SaslAuthenticationFailed
                | Code::TopicAuthorizationFailed
                | Code::GroupAuthorizationFailed
                | Code::ClusterAuthorizationFailed
        )
    )
}

/// An error the client does not recover from (see [`recovers_by_itself`]): not a lost
/// connection, so the reader ends instead of connecting again to the same client.
pub(super) fn unrecoverable(error: KafkaError) -> Error {
    Error::Config(format!(
        "the Kafka client cannot go on: {error} (check the credentials and the topic's ACLs)"
    ))
}

pub(super) fn broker(error: KafkaError) -> Error {
    crate::tls::broker_error(error)
}

#[cfg(test)]
mod tests {
    /// librdkafka's words for each refusal, as its OpenSSL wrote them here.
    #[test]
    fn a_refused_handshake_is_told_from_librdkafkas_words() {
        use crate::tls::TlsError;
        let refusals = super::Refusals::new(&super::Security::default(), "kafka://127.0.0.1:9093");
        let required = "ssl://127.0.0.1:9093/bootstrap: Receive failed: error:0A00045C:SSL \
            routines::tlsv13 alert certificate required: SSL alert number 116 (after 0ms in state \
            APIVERSION_QUERY)";
        assert_eq!(
            refusals.refusal(required),
            Some(TlsError::ClientCertificateRequired)
        );
        let unknown_ca = "ssl://127.0.0.1:9093/bootstrap: SSL handshake failed: error:0A000418:SSL \
            routines::tlsv1 alert unknown ca: SSL alert number 48";
        assert!(matches!(
            refusals.refusal(unknown_ca),
            Some(TlsError::ClientCertificateRefused(_))
        ));
        // Without TLS settings to try a handshake with, the cause stays librdkafka's.
        let unverified = "ssl://127.0.0.1:9093/bootstrap: SSL handshake failed: \
            error:0A000086:SSL routines::certificate verify failed: broker certificate could not \
            be verified (after 1ms in state SSL_HANDSHAKE)";
        assert_eq!(
            refusals.refusal(unverified),
            Some(TlsError::BadCertificate(unverified.to_owned()))
        );
        let plaintext = "ssl://127.0.0.1:9093/bootstrap: SSL handshake failed: Disconnected: \
            connecting to a PLAINTEXT broker listener?";
        assert!(matches!(
            refusals.refusal(plaintext),
            Some(TlsError::Handshake(_))
        ));
        let down = "ssl://127.0.0.1:9093/bootstrap: Connect to ipv4#127.0.0.1:9093 failed: \
            Connection refused";
        assert_eq!(refusals.refusal(down), None);
    }
}
