//! The settings of a Kafka reader and how it reaches the brokers.

use crate::consumer::policy_setters;
use crate::tls::Tls;
use crate::{Error, Policy};
use rdkafka::config::ClientConfig;
use std::time::Duration;

/// Why [`KeyFrom::MessageId`] is refused.
pub(super) const NO_MESSAGE_ID: &str = "a Kafka record carries no message id (its key names an entity, \
                             not a message): take the id from a header or a JSON pointer";

/// Where a partition with no stored offset starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Start {
    /// The partition's first record still kept.
    Earliest,
    /// Records produced after the partition was assigned.
    Latest,
}

/// A SASL mechanism a broker takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SaslMechanism {
    /// `PLAIN`: the password as it is; use it over TLS only.
    Plain,
    /// `SCRAM-SHA-256`.
    ScramSha256,
    /// `SCRAM-SHA-512`.
    ScramSha512,
}

impl SaslMechanism {
    fn name(self) -> &'static str {
        match self {
            SaslMechanism::Plain => "PLAIN",
            SaslMechanism::ScramSha256 => "SCRAM-SHA-256",
            SaslMechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

/// The user and password a broker asks for.
#[derive(Clone)]
pub struct Sasl {
    mechanism: SaslMechanism,
    username: String,
    password: String,
}

impl std::fmt::Debug for Sasl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The password is a secret: never shown.
        f.debug_struct("Sasl")
            .field("mechanism", &self.mechanism)
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

impl Sasl {
    /// Authenticates as `username` with `password` by `mechanism`.
    pub fn new(
        mechanism: SaslMechanism,
        username: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        Self {
            mechanism,
            username: username.into(),
            password: password.into(),
        }
    }
}

/// How a client reaches the brokers: TLS and SASL, each optional.
#[derive(Debug, Clone, Default)]
pub(super) struct Security {
    pub(super) tls: Option<Tls>,
    pub(super) sasl: Option<Sasl>,
}

impl Security {
    /// librdkafka's settings for `url`: the bootstrap servers, TLS and SASL.
    pub(super) fn client_config(&self, url: &str) -> Result<ClientConfig, Error> {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", bootstrap_servers(url)?);
        let protocol = match (&self.tls, &self.sasl) {
            (None, None) => "plaintext",
            (Some(_), None) => "ssl",
            (None, Some(_)) => "sasl_plaintext",
            (Some(_), Some(_)) => "sasl_ssl",
        };
        config.set("security.protocol", protocol);
        if let Some(tls) = &self.tls {
            if let Some(ca) = tls.ca_pem() {
                config.set("ssl.ca.pem", pem_text(ca)?);
            }
            if let Some((certificate, key)) = tls.client_pem() {
                config.set("ssl.certificate.pem", pem_text(certificate)?);
                config.set("ssl.key.pem", pem_text(key)?);
            }
            if tls.is_insecure() {
                config.set("enable.ssl.certificate.verification", "false");
                config.set("ssl.endpoint.identification.algorithm", "none");
            }
        }
        if let Some(sasl) = &self.sasl {
            config.set("sasl.mechanism", sasl.mechanism.name());
            config.set("sasl.username", &sasl.username);
            config.set("sasl.password", &sasl.password);
        }
        Ok(config)
    }
}

/// The bootstrap servers of a `kafka://host:port[,host:port...]` URL.
pub(super) fn bootstrap_servers(url: &str) -> Result<&str, Error> {
    let servers = url
        .strip_prefix("kafka://")
        .ok_or_else(|| Error::Config("a Kafka URL starts with kafka://".to_owned()))?
        .trim_end_matches('/');
    if servers.contains('@') {
        return Err(Error::Config(
            "a Kafka URL holds no credentials: give them as SASL settings".to_owned(),
        ));
    }
    if servers.is_empty() || servers.split(',').any(|server| !server.contains(':')) {
        return Err(Error::Config(
            "a Kafka URL names each bootstrap server as host:port, such as kafka://127.0.0.1:9092"
                .to_owned(),
        ));
    }
    Ok(servers)
}

fn pem_text(pem: &[u8]) -> Result<&str, Error> {
    std::str::from_utf8(pem).map_err(|_| Error::Config("a PEM file is not text".to_owned()))
}

/// Settings of a [`KafkaReader`](super::KafkaReader).
#[derive(Debug, Clone)]
pub struct KafkaOptions {
    pub(super) topic: String,
    pub(super) group: String,
    pub(super) policy: Policy,
    pub(super) start: Start,
    pub(super) session_timeout: Duration,
    pub(super) security: Security,
}

impl KafkaOptions {
    /// Consumes `topic` as a member of consumer group `group`: partitions with no stored
    /// offset start at their earliest record, failed work gets 5 attempts before it is
    /// produced to `<topic>.dead`, and the group's session timeout is 45 s. The id must be
    /// set with [`KafkaOptions::key_from`].
    pub fn new(topic: impl Into<String>, group: impl Into<String>) -> Self {
        Self {
            topic: topic.into(),
            group: group.into(),
            policy: Policy::default(),
            start: Start::Earliest,
            session_timeout: Duration::from_secs(45),
            security: Security::default(),
        }
    }

    policy_setters!(
        /// Where the message id is: a header (such as CloudEvents' `ce_id`) or a JSON
        /// pointer. [`KeyFrom::MessageId`](crate::KeyFrom::MessageId) is refused by
        /// [`KafkaReader::connect`](super::KafkaReader::connect).
    );

    /// Where a partition with no stored offset starts.
    pub fn start(mut self, start: Start) -> Self {
        self.start = start;
        self
    }

    /// How long the group waits for a silent member before it gives its partitions to the
    /// others.
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
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

    /// The topic consumed, and the name its offsets are stored under.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The topic dead letters are produced to: `<topic>.dead`.
    pub fn dead_letter_topic(&self) -> String {
        format!("{}.dead", self.topic)
    }
}
