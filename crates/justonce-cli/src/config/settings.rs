//! The settings the rest of the binary runs with: validated, with every default filled in.

use crate::admin_api::AdminToken;
use anyhow::Result;
use justonce_http::HttpDestination;
use justonce_http::receiver::{Source, Tenant};
use justonce_sql::{Retention, Scope};
use justonce_transport::Tenants;
use justonce_transport::amqp::AmqpOptions;
use justonce_transport::kafka::KafkaOptions;
use justonce_transport::mqtt::MqttOptions;
use justonce_transport::nats::NatsOptions;
use justonce_transport::redis_streams::RedisStreamOptions;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

/// Everything `serve` and the other commands need, checked. Not `Debug`: the database URL
/// may hold a password.
pub struct Settings {
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub database: String,
    pub body_limit: usize,
    /// How long a delivery the relay took stays hidden from other relays.
    pub relay_lease: Duration,
    /// Deliveries in flight at once to one destination for one tenant.
    pub relay_per_destination: usize,
    /// Deliveries in flight at once to one destination over all its tenants: at least
    /// `relay_per_destination`.
    pub relay_per_destination_total: usize,
    /// How often the service purges what is past its retention; `None`: never.
    pub purge_every: Option<Duration>,
    /// What `serve` runs: every role unless `server.roles` or `serve --role` names fewer.
    pub roles: Roles,
    /// What each listener holds: timeouts and caps.
    pub limits: Limits,
    /// The most database connections the service opens.
    pub pool_size: u32,
    /// How long work waits for a database connection before it is refused.
    pub acquire_timeout: Duration,
    /// Whether concurrent receipts share their database commits.
    pub share_commits: bool,
    pub sources: Vec<SourceSettings>,
    pub consumers: Vec<ConsumerSettings>,
    /// How log lines are written, unless `--log-format` says otherwise.
    pub log_format: LogFormat,
    /// The URL `serve` posts its spans to over OTLP/HTTP; `None`: no traces are exported.
    pub traces_url: Option<String>,
    /// The token the admin API asks for; `None`: reads are open and changes refused.
    pub admin_token: Option<AdminToken>,
    /// `JUSTONCE_*` variables that name no setting: a warning at start, an error with
    /// `--strict`.
    pub unknown_variables: Vec<String>,
    /// The effective configuration as TOML, each value with where it came from, secrets
    /// only by reference: what `justonce config` prints.
    pub printed: String,
}

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human text, coloured on a terminal.
    #[default]
    Text,
    /// One JSON object a line.
    Json,
}

impl LogFormat {
    /// `text` or `json`.
    pub fn name(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

/// One part of what `serve` runs. Processes on one database may each run any of them:
/// receivers scale with traffic, relays with targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// The public listener: webhooks received, stored and answered.
    Receiver,
    /// Delivers the stored events to their targets, retries, dead-letters.
    Relay,
    /// The `[consumers]`: broker messages claimed and stored.
    Consumers,
    /// Deletes what is past its retention, every `server.purge_every`.
    Purge,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Receiver, Role::Relay, Role::Consumers, Role::Purge];

    /// The role as `server.roles` and `--role` spell it.
    pub fn name(self) -> &'static str {
        match self {
            Role::Receiver => "receiver",
            Role::Relay => "relay",
            Role::Consumers => "consumers",
            Role::Purge => "purge",
        }
    }
}

/// The roles one `serve` runs: at least one, each once, in a fixed order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roles(Vec<Role>);

impl Roles {
    /// Every role: what `serve` runs unless told otherwise.
    pub fn all() -> Self {
        Self(Role::ALL.to_vec())
    }

    pub fn runs(&self, role: Role) -> bool {
        self.0.contains(&role)
    }

    pub fn iter(&self) -> impl Iterator<Item = Role> + '_ {
        self.0.iter().copied()
    }
}

impl std::str::FromStr for Roles {
    type Err = String;

    /// A comma-separated list such as `receiver,relay`, or `all`.
    fn from_str(text: &str) -> Result<Self, String> {
        let mut roles = Vec::new();
        for word in text.split(',').map(str::trim) {
            if word == "all" {
                return Ok(Self::all());
            }
            let role = Role::ALL
                .into_iter()
                .find(|role| role.name() == word)
                .ok_or_else(|| {
                    format!(
                        "{word:?} is not a role: the roles are receiver, relay, consumers and \
                         purge (or all)"
                    )
                })?;
            roles.push(role);
        }
        roles.sort();
        roles.dedup();
        Ok(Self(roles))
    }
}

impl std::fmt::Display for Roles {
    /// As `server.roles` is written: `receiver,relay`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.iter().map(Role::name).collect();
        f.write_str(&names.join(","))
    }
}

/// What a listener holds before it closes or refuses a connection.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// How long a connection may take to send a request's headers, counted from when it
    /// opened or its last answer was sent: it also closes idle keep-alive connections.
    pub header_timeout: Duration,
    /// How long one request may take, body included, before it is answered 408.
    pub request_timeout: Duration,
    /// Connections open at once; one more is answered 503 and closed.
    pub max_connections: usize,
    /// Requests in flight at once; one more is answered 503.
    pub max_requests: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            max_connections: 4_096,
            max_requests: 1_024,
        }
    }
}

/// One webhook sender and where its events go, built and checked.
pub struct SourceSettings {
    pub name: String,
    pub source: Source,
    pub retention: Retention,
    /// How long a delivered event stays stored to be replayed: at least the retention.
    pub event_retention: Duration,
    pub destination: HttpDestination,
    pub deliver_for: Duration,
}

/// One broker queue and where its messages go, built and checked. Not `Debug`: the broker
/// URL may hold a password.
pub struct ConsumerSettings {
    pub name: String,
    pub from: String,
    pub options: BrokerOptions,
    /// Whether the broker's certificate goes unchecked (`tls_verify = "insecure"`).
    pub tls_insecure: bool,
    pub retention: Retention,
    /// How long a delivered event stays stored to be replayed: at least the retention.
    pub event_retention: Duration,
    pub destination: HttpDestination,
    pub deliver_for: Duration,
    /// The tenant every message is stored for, if the consumer has one.
    pub tenant: Option<Scope>,
    /// The tenants taken when each message names its own (also in `options`).
    pub tenants: Option<Tenants>,
}

/// What to consume, per broker.
#[derive(Debug, Clone)]
pub enum BrokerOptions {
    Amqp(AmqpOptions),
    Nats(NatsOptions),
    Redis(RedisStreamOptions),
    Mqtt(MqttOptions),
    Kafka(KafkaOptions),
}

impl Settings {
    /// The scopes each source and consumer claims its keys in, by name: the empty scope
    /// for one without tenants.
    pub fn scopes(&self) -> BTreeMap<&str, BTreeSet<String>> {
        let sources = self.sources.iter().map(|source| {
            let scopes = match source.source.tenant() {
                None => BTreeSet::from([String::new()]),
                Some(Tenant::Fixed(scope)) => BTreeSet::from([scope.as_str().to_owned()]),
                Some(Tenant::FromRequest { allowed, .. }) => allowed.clone(),
                Some(Tenant::BySecret(secrets)) => {
                    secrets.tenants().map(|t| t.as_str().to_owned()).collect()
                }
            };
            (source.name.as_str(), scopes)
        });
        let consumers = self.consumers.iter().map(|consumer| {
            let scopes = match (&consumer.tenant, &consumer.tenants) {
                (Some(scope), _) => BTreeSet::from([scope.as_str().to_owned()]),
                (None, Some(tenants)) => tenants.allowed().clone(),
                (None, None) => BTreeSet::from([String::new()]),
            };
            (consumer.name.as_str(), scopes)
        });
        sources.chain(consumers).collect()
    }

    /// Deliveries the relay keeps in flight over all destinations: the library's 16, or
    /// more when one destination may take more.
    pub fn relay_concurrency(&self) -> usize {
        (justonce_sql::RelayOptions::DEFAULT_CONCURRENCY).max(self.relay_per_destination_total)
    }

    /// The retention the shared store is opened with: every source and consumer keeps its
    /// keys at least this long, and purges each by its own.
    pub fn store_retention(&self) -> Result<Retention> {
        let retentions = || {
            let sources = self.sources.iter().map(|s| s.retention);
            sources.chain(self.consumers.iter().map(|c| c.retention))
        };
        let keep = retentions().map(|r| r.keep()).min();
        let horizon = retentions().map(|r| r.retry_horizon()).min();
        Ok(match (keep, horizon) {
            (Some(keep), Some(horizon)) => Retention::new(keep, horizon)?,
            _ => Retention::default(),
        })
    }
}
